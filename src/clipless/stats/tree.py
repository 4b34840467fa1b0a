r"""The binary tree mechanism for releasing all prefix counts (thesis chapter 6, section 6.3.1).

Notation (thesis): ``N`` leaves (thresholds), ``L = ceil(log2 N)``, leaves padded with empty ones
to ``2^L``; node ``(j, l)``, ``l = 0..L``, ``j = 1..2^(L-l)``, covers leaves
``(j-1) 2^l + 1 .. j 2^l`` (level 0 = the leaves, level ``L`` = the root). In arrays nodes are
0-based: ``node_counts[l][j - 1]``. The prefix count of leaf ``i`` is ``C_i = #{values <= tau_i}``.

The thesis (eq. 6.3.1) publishes ``P_i = C_i + sum_{l=0..L} eta_{ceil(i/2^l), l}``: each prefix
gets the ``L+1`` noises on its root-to-leaf path. Theorem 6.3.1 proves ``epsilon``-DP under
replace-one with ``eta ~ Lap((L+1)/epsilon)``; Lemma 6.3.1 / Theorem 6.3.2 give
``ceil((L+1)/2)`` for a change of a suffix (add/remove one value, or one stream element).

**Node values (what is released).** Here the mechanism is written as the release of one noisy
integer per node, ``V = theta(c) + eta``, whose path sums are the thesis's ``P`` (so ``P`` is
post-processing of ``V``, and the smoothing and consistency steps can use ``V``). ``theta`` is a
*fixed linear* map from leaf counts ``c`` to signed node counts, built from the signed dyadic
decomposition behind Lemma 6.3.1: a value at leaf ``a`` contributes the suffix indicator
``1_[a, 2^L]`` to the prefix vector; with ``m = 2^L - a + 1`` and ``m = sum_l d_l 2^l`` its
non-adjacent form (NAF, Reitwiesner 1960: digits in ``{-1, 0, 1}``, no two adjacent non-zero),
``p_l = sum_{k > l} d_k 2^k``, the value adds ``+1`` to node ``((2^L - p_l)/2^l, l)`` when
``d_l = +1`` and ``-1`` to node ``((2^L - p_l)/2^l + 1, l)`` when ``d_l = -1``. These are the
blocks at distance ``(p_l, p_l + 2^l]`` resp. ``(p_l - 2^l, p_l]`` from the right end; their
signed sum telescopes to the last ``m`` leaves, so the path sums of ``theta(c)`` are exactly the
prefix counts. (``p_l`` is a multiple of ``2^(l+1)``, so each block is a tree node; as
``|sum_{k < l} d_k 2^k| < 2^(l-1)`` when ``d_l != 0`` and ``1 <= m <= 2^L``, every block lies in
``[1, 2^L]``.) ``theta`` is available as :func:`node_counts_from_leaves`.

**Sensitivity (proof).** A positive NAF with top digit ``k`` has value ``> (2/3) 2^k``, so for
``m <= 2^L`` all digits sit at levels ``0..L``; being non-adjacent there are at most
``ceil((L+1)/2)`` of them, on distinct levels, hence distinct nodes with coefficients ``+-1``.

* add/remove one value (and one stream element, Theorem 6.3.2): the node vector changes by
  ``+-chi_a``: at most ``ceil((L+1)/2)`` nodes, each by exactly 1.
* replace-one (a value moves from leaf ``a`` to leaf ``b``): the change is ``chi_b - chi_a``. If
  both NAFs have their top digit at ``L``, both contain ``+root`` (``p_L = 0``), which cancels, and
  the rest sit at levels ``<= L-2``: at most ``2 ceil((L-1)/2) <= L`` nodes. Otherwise one NAF has
  top digit ``<= L-1`` (weight ``<= ceil(L/2)``) and the total is ``<= ceil(L/2) +
  ceil((L+1)/2) = L+1``. No node gets ``+-2``: the same node would be a ``+`` block at ``p`` and a
  ``-`` block at ``p' = p + 2^l``, impossible for two multiples of ``2^(l+1)``. So at most ``L+1``
  nodes change, each by exactly 1 (thesis Theorem 6.3.1).

``tests/stats/test_tree.py`` verifies both bounds exhaustively for every ``N <= 64``. The
replace-one bound ``L+1`` is *attained* by this node-level release (e.g. ``L = 1``: leaf 1 is
``+root``, leaf 2 is ``+leaf2``), so the tighter constant ``L`` of docs/design.md "Tree noise" (it
holds for the prefix vector alone, with a representation chosen per neighbouring pair) is not used.

**Noise.** The node vector has integer L1 sensitivity ``Delta`` (above) and L2 sensitivity
``sqrt(Delta)`` (``Delta`` entries of ``+-1``). Laplace: exact discrete Laplace of scale
``Delta/epsilon`` on every node gives ``epsilon``-DP (the exact rational scale, rounded *up* in
its 61st bit when its numerator is longer, :func:`~clipless.stats.noise.conservative_scale`,
which keeps the guarantee). Gaussian: exact discrete Gaussian with
``sigma^2 = Delta / (2 rho)`` gives ``rho``-zCDP (CKS 2020, Theorem 14; Bun and Steinke 2016);
this is Theorem 6.3.2's ``N(0, ceil((L+1)/2) z^2)`` with ``rho = 1/(2 z^2)``. Samplers:
:mod:`clipless.stats.noise` (Canonne, Kamath, Steinke 2020).

**Error.** Each released prefix has variance ``(L+1) Var(eta)``; with a continuous Laplace of
scale ``(L+1)/epsilon`` this is the thesis's ``2 (L+1)^3 / epsilon^2`` (Theorem 6.3.1, counts
not divided by ``n``). The discrete Laplace variance ``2q/(1-q)^2``, ``q = exp(-1/scale)``, is
``2 scale^2 - 1/6 + O(scale^-2)``, slightly below.

**Consistency (least squares).** Hay, Rastogi, Miklau and Suciu (PVLDB 2010, "Boosting the
accuracy of differentially private histograms through consistency") replace a redundant noisy
hierarchy by its least-squares fit (the BLUE for i.i.d. noise; their two-pass algorithm is the
closed form for *block* counts). Here the same principle is applied to the released node values:
:func:`consistent_prefix_sums` returns ``Z^T argmin_{u in range(theta)} ||V - u||^2``. Only the
``N`` nodes that some real leaf's ``chi_a`` uses carry data (for ``N = 2^L``: the root, the right
child of the root and, below, every node that is the same-side child as its parent); the other
nodes are pure noise, and dropping them from the path sums *is* the least-squares estimate. The
per-leaf variance falls from ``(L+1) Var(eta)`` to ``(L+2)/2 Var(eta)`` on average, roughly a
factor 2 (:func:`prefix_variance`). For ``N`` not a power of two a few (``r``) extra nodes
carry data redundantly and an exact rank-``r`` projection finishes the fit.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal, get_args

import numpy as np
import scipy.sparse as sp
from numpy.typing import ArrayLike, NDArray

from clipless import _validate
from clipless.stats.grid import tree_depth
from clipless.stats.noise import (
    conservative_scale,
    discrete_gaussian,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_variance,
    resolve_rng,
    to_fraction,
)

__all__ = [
    "Neighbouring",
    "NoiseKind",
    "TreeRelease",
    "consistent_prefix_sums",
    "node_counts_from_leaves",
    "path_sums",
    "prefix_variance",
    "release_counts",
    "tree_depth",
    "tree_path_matrix",
    "tree_sensitivity",
]

Neighbouring = Literal["replace_one", "add_remove"]
NoiseKind = Literal["laplace", "gaussian"]
NEIGHBOURING: tuple[Neighbouring, ...] = get_args(Neighbouring)
NOISE_KINDS: tuple[NoiseKind, ...] = get_args(NoiseKind)


def _check_neighbouring(neighbouring: str) -> None:
    _validate.choice("neighbouring", neighbouring, NEIGHBOURING)


def _check_noise(noise: str, name: str = "noise") -> None:
    _validate.choice(name, noise, NOISE_KINDS)


def tree_sensitivity(depth: int, neighbouring: Neighbouring) -> int:
    """Largest number of node values one neighbouring change moves (each by exactly 1).

    ``replace_one``: ``L + 1`` (thesis Theorem 6.3.1); ``add_remove``: ``ceil((L+1)/2)``
    (Lemma 6.3.1, Theorem 6.3.2). This is both the L1 sensitivity and the squared L2
    sensitivity of the node vector (proof in the module docstring).

    Args:
        depth: the tree's depth ``L``, an int ``>= 0``.
        neighbouring: ``"replace_one"`` or ``"add_remove"``.

    >>> tree_sensitivity(15, "replace_one"), tree_sensitivity(15, "add_remove")
    (16, 8)
    """
    depth = _validate.integer("depth", depth)
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    _check_neighbouring(neighbouring)
    if neighbouring == "replace_one":
        return int(depth) + 1
    return (int(depth) + 2) // 2


def _level_offsets(depth: int) -> NDArray[np.int64]:
    sizes = [1 << (depth - level) for level in range(depth + 1)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@lru_cache(maxsize=32)
def _suffix_matrix(depth: int) -> sp.csc_matrix:
    """``theta`` as a sparse (nodes x 2^L) matrix: column ``a`` is ``chi_a`` (see module doc)."""
    size = 1 << depth
    m = size - np.arange(size, dtype=np.int64)  # suffix length of 0-based leaf a
    digits = np.zeros((depth + 2, size), dtype=np.int64)
    rest = m.copy()
    level = 0
    while np.any(rest):
        d = np.where(rest & 1, 2 - (rest & 3), 0)
        digits[level] = d
        rest = (rest - d) >> 1
        level += 1
    if np.any(digits[depth + 1]):
        raise AssertionError("NAF digit above the root")  # impossible, see module docstring
    offsets = _level_offsets(depth)
    rows: list[NDArray[np.int64]] = []
    cols: list[NDArray[np.int64]] = []
    vals: list[NDArray[np.int64]] = []
    p = np.zeros(size, dtype=np.int64)
    leaves = np.arange(size, dtype=np.int64)
    for lev in range(depth, -1, -1):
        d = digits[lev]
        nz = d != 0
        base = (size - p[nz]) >> lev
        idx = np.where(d[nz] > 0, base - 1, base)
        rows.append(offsets[lev] + idx)
        cols.append(leaves[nz])
        vals.append(d[nz])
        p = p + (d << lev)
    mat = sp.csc_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(int(offsets[-1]), size),
        dtype=np.int64,
    )
    mat.sort_indices()
    return mat


@lru_cache(maxsize=64)
def _suffix_columns(depth: int, num_leaves: int) -> sp.csr_matrix:
    """``theta`` restricted to the real leaves, as CSR (cached)."""
    return _suffix_matrix(depth)[:, :num_leaves].tocsr()


def _leaf_counts_array(leaf_counts: ArrayLike, name: str = "leaf_counts") -> NDArray[np.int64]:
    arr = np.asarray(leaf_counts)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must be non-empty")
    if arr.dtype == bool or np.issubdtype(arr.dtype, np.integer):
        out = arr.astype(np.int64)
    elif np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold integer counts")
        out = arr.astype(np.int64)
    else:
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if np.any(out < 0):
        raise ValueError(f"{name} must be non-negative")
    return out


def node_counts_from_leaves(
    leaf_counts: ArrayLike, depth: int | None = None
) -> list[NDArray[np.int64]]:
    """``theta(c)``: the signed node counts whose path sums are the prefix counts.

    ``leaf_counts[i]`` is the number of values in leaf ``i`` (0-based); ``depth`` defaults to
    ``ceil(log2 N)``. Returns one int64 array per level ``l = 0..L`` of length ``2^(L-l)``.
    Negative leaf counts are allowed here (it is linear), which the sensitivity test uses.
    """
    arr = np.asarray(leaf_counts, dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("leaf_counts must be a non-empty one-dimensional array")
    L = tree_depth(arr.size) if depth is None else int(depth)
    if arr.size > (1 << L):
        raise ValueError(f"depth {L} has {1 << L} leaves < {arr.size}")
    flat = np.asarray(_suffix_columns(L, int(arr.size)) @ arr, dtype=np.int64)
    offsets = _level_offsets(L)
    return [flat[offsets[lev] : offsets[lev + 1]] for lev in range(L + 1)]


def path_sums(node_values: Sequence[NDArray[Any]], num_leaves: int) -> NDArray[Any]:
    """``(V Z)_i = sum_{l=0..L} V[l][i >> l]`` for the first ``num_leaves`` (0-based) leaves."""
    idx = np.arange(num_leaves, dtype=np.int64)
    total = np.zeros(num_leaves, dtype=np.result_type(*[np.asarray(v) for v in node_values]))
    for lev, vals in enumerate(node_values):
        total = total + np.asarray(vals)[idx >> lev]
    return total


def tree_path_matrix(depth: int, num_leaves: int) -> sp.csr_matrix:
    """Sparse ``Z^T`` of shape ``(num_leaves, 2^(L+1) - 1)``: row ``i`` marks the ``L+1`` nodes
    on leaf ``i``'s path, nodes ordered level by level (``np.concatenate(node_counts)``).

    ``tree_path_matrix(L, N) @ np.concatenate(nu)`` are the per-leaf path sums of corrections
    ``nu`` (the variables of the thesis's smoothing problem 6.3.6)."""
    offsets = _level_offsets(depth)
    leaves = np.arange(num_leaves, dtype=np.int64)
    rows = np.repeat(leaves, depth + 1)
    cols = (offsets[:-1][None, :] + (leaves[:, None] >> np.arange(depth + 1)[None, :])).ravel()
    data = np.ones(rows.size, dtype=np.float64)
    return sp.csr_matrix((data, (rows, cols)), shape=(num_leaves, int(offsets[-1])))


@dataclass(frozen=True, eq=False)
class TreeRelease:
    """The output of :func:`release_counts` (all fields are public, private-by-construction).

    Attributes:
        depth: ``L = ceil(log2 num_leaves)``.
        num_leaves: ``N``, the number of real leaves (thresholds); the tree is padded to ``2^L``
            leaves.
        node_counts: noisy signed node values ``V = theta(c) + eta`` (module docstring), one int64
            array per level ``l = 0..L`` (level 0 = leaves) of length ``2^(L-l)``.
        prefix_counts: the thesis's released prefix counts
            ``P_i = sum_l V[l][i >> l] = C_i + (L+1) noises``, int64, length ``N``.
        noise: ``"laplace"`` or ``"gaussian"``.
        noise_param: exact noise parameter: discrete Laplace scale ``b`` or discrete Gaussian
            ``sigma^2``.
        noise_scale: ``b`` (Laplace) or ``sigma`` (Gaussian) as a float.
        node_variance: exact variance of one node's noise.
        sensitivity: number of node values one neighbouring change can move by 1
            (:func:`tree_sensitivity`).
        neighbouring, epsilon, rho: the guarantee: ``epsilon``-DP (Laplace) or ``rho``-zCDP
            (Gaussian) under ``neighbouring``.
    """

    depth: int
    num_leaves: int
    node_counts: list[NDArray[np.int64]] = field(repr=False)
    prefix_counts: NDArray[np.int64] = field(repr=False)
    noise: NoiseKind
    noise_param: Fraction
    noise_scale: float
    node_variance: float
    sensitivity: int
    neighbouring: Neighbouring
    epsilon: float | None
    rho: float | None

    @property
    def padded_leaves(self) -> int:
        """``2^L``."""
        return 1 << self.depth

    @property
    def prefix_variance(self) -> float:
        """Variance of each entry of :attr:`prefix_counts`: ``(L+1) * node_variance``."""
        return (self.depth + 1) * self.node_variance


def release_counts(
    leaf_counts: ArrayLike,
    epsilon: float | None,
    neighbouring: Neighbouring = "replace_one",
    noise: NoiseKind = "laplace",
    rng: random.Random | None = None,
    rho: float | None = None,
    *,
    node_noise: Callable[[NoiseKind, Fraction, int], NDArray[np.int64]] | None = None,
) -> TreeRelease:
    """Release every prefix count of ``leaf_counts`` with the binary tree mechanism.

    Thesis Theorem 6.3.1 (replace-one, ``L+1``) and Lemma 6.3.1 / Theorem 6.3.2 (add/remove,
    ``ceil((L+1)/2)``), with exact discrete noise (Canonne, Kamath, Steinke 2020). See the
    module docstring for the node representation and the sensitivity proof.

    Args:
        leaf_counts: non-negative integer counts per leaf (values in ``(tau_{i-1}, tau_i]``), length
            ``N``.
        epsilon: pure DP budget for ``noise="laplace"`` (``> 0``); must be ``None`` for Gaussian
            noise.
        neighbouring: ``"replace_one"`` (``n`` public) or ``"add_remove"``.
        noise: ``"laplace"``: discrete Laplace of scale ``Delta / epsilon`` per node,
            ``epsilon``-DP. ``"gaussian"``: discrete Gaussian, ``sigma^2 = Delta / (2 rho)``,
            ``rho``-zCDP.
        rng: :class:`random.Random`; default :func:`~clipless.stats.noise.secure_rng`.
        rho: zCDP budget for Gaussian noise.
        node_noise: optional keyed noise source ``(kind, exact parameter, depth) -> int64
            noise of the 2^(L+1) - 1 nodes in level order`` replacing the draw from ``rng``,
            e.g. :class:`clipless.federated.NodeNoise` (same exact samplers, node-indexed PRF
            streams): the central release then equals the federated one bit for bit. A source
            that sums ``copies`` independent full-scale draws (its ``copies`` attribute, e.g.
            :class:`clipless.federated.SummedNoise`) has ``copies`` times the node variance,
            which :attr:`TreeRelease.node_variance` (and the least-squares weights) then carry.
    """
    counts = _leaf_counts_array(leaf_counts)
    _check_neighbouring(neighbouring)
    gen = resolve_rng(rng)
    N = int(counts.size)
    L = tree_depth(N)
    delta = tree_sensitivity(L, neighbouring)
    num_nodes = (1 << (L + 1)) - 1
    budget, eps_out, rho_out = noise_budget(noise, epsilon, rho)
    param: Fraction
    if noise == "laplace":
        param = conservative_scale(Fraction(delta) / budget)
        eta = (
            discrete_laplace(param, num_nodes, gen)
            if node_noise is None
            else _external_noise(node_noise, noise, param, L)
        )
        variance = discrete_laplace_variance(param)
    else:
        param = Fraction(delta) / (2 * budget)
        eta = (
            discrete_gaussian(None, num_nodes, gen, sigma2=param)
            if node_noise is None
            else _external_noise(node_noise, noise, param, L)
        )
        variance = discrete_gaussian_variance(param)
    if node_noise is not None:
        variance = variance * _noise_copies(node_noise)
    true_nodes = node_counts_from_leaves(counts, L)
    offsets = _level_offsets(L)
    noisy = [true_nodes[lev] + eta[offsets[lev] : offsets[lev + 1]] for lev in range(L + 1)]
    return tree_release(
        noisy, N, noise, param, variance, delta, neighbouring, epsilon=eps_out, rho=rho_out
    )


def tree_release(
    nodes: list[NDArray[np.int64]],
    num_leaves: int,
    noise: NoiseKind,
    param: Fraction,
    node_variance: float,
    sensitivity: int,
    neighbouring: Neighbouring,
    *,
    epsilon: float | None,
    rho: float | None,
) -> TreeRelease:
    """The :class:`TreeRelease` of the noisy node values ``nodes`` (one array per level, leaves
    first), made read-only, with their path sums as the prefix counts (post-processing; also
    the federated ECDF's)."""
    for arr in nodes:
        arr.setflags(write=False)
    prefix = np.asarray(path_sums(nodes, num_leaves), dtype=np.int64)
    prefix.setflags(write=False)
    return TreeRelease(
        depth=len(nodes) - 1,
        num_leaves=num_leaves,
        node_counts=nodes,
        prefix_counts=prefix,
        noise=noise,
        noise_param=param,
        noise_scale=noise_scale(noise, param),
        node_variance=node_variance,
        sensitivity=sensitivity,
        neighbouring=neighbouring,
        epsilon=epsilon,
        rho=rho,
    )


def noise_scale(noise: NoiseKind, param: Fraction) -> float:
    """The scale of one node's noise as a float: ``b`` (Laplace) or ``sigma``, the square root of
    the exact ``sigma^2`` (Gaussian)."""
    return float(param) if noise == "laplace" else float(param) ** 0.5


def noise_budget(
    noise: str, epsilon: float | None, rho: float | None
) -> tuple[Fraction, float | None, float | None]:
    """The exact budget of ``noise`` (``epsilon`` for Laplace, ``rho`` for Gaussian) and the
    guarantee ``(epsilon, rho)`` a release reports; refuses the other one given, or none."""
    if noise == "laplace":
        if rho is not None:
            raise ValueError("rho is only for noise='gaussian'; give epsilon for Laplace noise")
        if epsilon is None:
            raise ValueError("epsilon is required for noise='laplace'")
        return to_fraction(epsilon, "epsilon"), float(epsilon), None
    if noise == "gaussian":
        if epsilon is not None:
            raise ValueError(
                "noise='gaussian' is calibrated by rho (zCDP); pass epsilon=None and rho"
            )
        if rho is None:
            raise ValueError("rho is required for noise='gaussian'")
        return to_fraction(rho, "rho"), None, float(rho)
    raise ValueError(f"noise must be 'laplace' or 'gaussian', got {noise!r}")


def _noise_copies(node_noise: object) -> int:
    copies = getattr(node_noise, "copies", 1)
    return _validate.positive_int("node_noise.copies", copies, wrong_type=ValueError)


def _external_noise(
    node_noise: Callable[[NoiseKind, Fraction, int], NDArray[np.int64]],
    noise: NoiseKind,
    param: Fraction,
    depth: int,
) -> NDArray[np.int64]:
    eta = np.asarray(node_noise(noise, param, depth))
    if eta.shape != ((1 << (depth + 1)) - 1,) or not np.issubdtype(eta.dtype, np.integer):
        raise ValueError(
            f"node_noise must return {(1 << (depth + 1)) - 1} integers, got {eta.dtype} {eta.shape}"
        )
    return eta.astype(np.int64)


@lru_cache(maxsize=64)
def _consistency_plan(depth: int, num_leaves: int) -> tuple[NDArray[np.bool_], NDArray[Any]]:
    """Data-carrying nodes and an orthonormal basis ``Q`` of the redundant directions.

    ``range(theta_U)`` (``theta`` restricted to the used nodes ``U`` and the real leaves) has
    codimension ``r = |U| - N`` in ``R^U``; its orthogonal complement is ``range(P0^T)`` with
    ``P0 = I - theta_U M`` and ``M = S^{-1} Z_U^T`` the left inverse of ``theta_U`` given by the
    path sums (``Z_U^T theta_U = S``, the prefix-sum matrix). ``Q`` spans it (``r`` columns).
    """
    mat = _suffix_columns(depth, num_leaves)
    used = np.diff(mat.indptr) > 0
    n_used = int(used.sum())
    r = n_used - num_leaves
    if r == 0:
        return used, np.zeros((n_used, 0))
    mat_u = mat[used]
    offsets = _level_offsets(depth)
    used_levels = [used[offsets[lev] : offsets[lev + 1]] for lev in range(depth + 1)]
    g = np.random.default_rng(0).standard_normal((n_used, r + 4))  # generic directions

    def m_transpose(y: NDArray[np.float64]) -> NDArray[np.float64]:
        # S^{-T} y (x_a = y_a - y_{a+1}), then block sums over real leaves, restricted to U
        x = y - np.concatenate([y[1:], np.zeros((1, y.shape[1]))])
        pad = np.zeros(((1 << depth) - num_leaves, y.shape[1]))
        cur = np.vstack([x, pad])
        out = []
        for lev in range(depth + 1):
            if lev > 0:
                cur = cur[0::2] + cur[1::2]
            out.append(cur[used_levels[lev]])
        return np.vstack(out)

    k = g - m_transpose(np.asarray(mat_u.T @ g))
    u_svd, s_svd, _ = np.linalg.svd(k, full_matrices=False)
    rank = int(np.sum(s_svd > 1e-9 * s_svd[0]))
    if rank != r:  # pragma: no cover - would contradict the dimension count
        raise AssertionError(f"redundancy rank {rank} != {r}")
    return used, u_svd[:, :r]


def _path_sums_flat(flat: NDArray[np.float64], depth: int, num_leaves: int) -> NDArray[np.float64]:
    offsets = _level_offsets(depth)
    return np.asarray(
        path_sums([flat[offsets[lev] : offsets[lev + 1]] for lev in range(depth + 1)], num_leaves),
        dtype=np.float64,
    )


def consistent_prefix_sums(release: TreeRelease) -> NDArray[np.float64]:
    """Least-squares (BLUE) prefix counts from the released node values (Hay et al. 2010).

    Exact least squares ``Z^T argmin_{u in range(theta)} ||V - u||_2`` (module docstring):
    the path sums over the data-carrying nodes only, plus a rank-``r`` projection when ``N`` is
    not a power of two. Post-processing: no privacy cost. Unbiased; per-leaf variances in
    :func:`prefix_variance` (about half of the plain release's ``(L+1) Var(eta)``).

    Args:
        release: a binary tree release (:func:`release_counts`).
    """
    L, N = release.depth, release.num_leaves
    used, q = _consistency_plan(L, N)
    flat = np.concatenate(release.node_counts).astype(np.float64)
    v_u = flat[used]
    if q.shape[1]:
        v_u = v_u - q @ (q.T @ v_u)
    full = np.zeros_like(flat)
    full[used] = v_u
    return _path_sums_flat(full, L, N)


def prefix_variance(release: TreeRelease, consistent: bool = False) -> NDArray[np.float64]:
    """Exact per-leaf variance of a release's prefix counts.

    Args:
        release: a binary tree release (:func:`release_counts`).
        consistent: the variance of :func:`consistent_prefix_sums` (``True``) or of the plain
            :attr:`TreeRelease.prefix_counts` (``False``, default).
    """
    L, N = release.depth, release.num_leaves
    if not consistent:
        return np.full(N, release.prefix_variance)
    used, q = _consistency_plan(L, N)
    n_used = _path_sums_flat(used.astype(np.float64), L, N)
    if q.shape[1]:
        full = np.zeros((used.size, q.shape[1]))
        full[used] = q
        qz = np.stack([_path_sums_flat(full[:, k], L, N) for k in range(q.shape[1])])
        n_used = n_used - (qz**2).sum(axis=0)
    return n_used * release.node_variance
