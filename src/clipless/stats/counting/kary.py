r"""The ``k``-ary tree of counts with level budgets and least-squares consistency.

(Hay, Rastogi, Miklau, Suciu, PVLDB 2010; Qardaji, Yang, Li, "Understanding hierarchical methods
for differentially private histograms", PVLDB 2013, who show the branching factor matters and that
``k`` near 16 is best for range queries; Honaker, "Efficient use of differentially private binary
trees", 2015, for the subtraction view.) Pure DP or zCDP, exact discrete noise. The choice of
``k``, level set and shares is :mod:`clipless.stats.counting.choice`.

**Precondition.** Integer leaf counts on a public grid of ``N`` leaves; a public plan
(:class:`CountingPlan`: branching ``k``, level shares summing to exactly 1, the leaves' share
positive); a budget ``epsilon`` (discrete Laplace) or ``rho`` (discrete Gaussian); under
``replace_one`` the size ``n`` is public.

**Claim.** The vector of noisy node counts that :func:`_release_kary` draws is ``epsilon``-DP or
``rho``-zCDP under the relation; :func:`kary_estimate` (least squares, exact variances,
conditioning on the public ``n``) is post-processing of it.

**Proof.** Pad the leaves to ``k^h`` (``h = ceil(log_k N) >= 1``) with empty
leaves. Node ``(l, j)`` (level ``l = 0..h``, level 0 = leaves, level ``h`` = the root) counts
the values in leaves ``j k^l .. (j+1) k^l - 1``. One value lies in exactly one node per level,
so adding or removing one value changes exactly ``h + 1`` node counts by 1 (the root included);
moving one value from leaf ``a`` to leaf ``b`` changes at most two nodes per level below the root,
by 1 each, and never the root: ``2h``. Under ``replace_one`` the root *is* the public size ``n`` and
is not released with noise (it is known exactly). So the noisy vector changes by ``+-1`` in at most
``per = 1`` (add/remove) or ``per = 2`` (replace-one) nodes of each level: L1 sensitivity ``Delta =
h + 1`` or ``2h`` in all. The budget is split over the levels, level ``l`` getting the public share
``w_l`` (:func:`level_shares`, ``sum_l w_l = 1``; ``w_l = 0``: the level is not released at all and
adds nothing to the sensitivity, which is ``per`` times the number of released levels; only the
leaves, with ``k = N``, is the flat histogram): discrete Laplace of scale ``b_l >= per / (w_l
epsilon)`` at level ``l`` gives privacy loss ``sum_l per / b_l <= epsilon`` (``epsilon``-DP);
discrete Gaussian with ``sigma_l^2 = per / (2 w_l rho)`` gives ``sum_l per / (2 sigma_l^2) = rho``
(``rho``-zCDP, Canonne, Kamath, Steinke 2020, Theorem 14). With uniform shares these are the usual
``Delta / epsilon`` and ``Delta / (2 rho)``. ``tests/stats/test_counting.py`` (all levels) and
``tests/stats/test_counting_choice.py`` (level sets) verify both exhaustively (every leaf, every
pair of leaves) for small ``N`` and ``k``, and that they are attained.

**Consistency (least squares).** With independent noise of variance ``v_l`` at level ``l``
(``v_h = 0`` when the root is the public ``n``), the best linear unbiased estimate of the leaf
counts from all noisy nodes is computed in ``O(k^h)`` by two passes (Hay et al. 2010, section
4, generalised to ``k`` children and per-level variances as in Cormode, Procopiuc, Srivastava,
Shen, Yu, ICDE 2012, section 4): upward, ``z_v`` is the inverse-variance average of the node's
own measurement and the sum of its children's ``z``, with variance ``t_l = 1 / (1/v_l + 1/(k
t_{l-1}))``; downward, each child gets ``z_c + (x_v - sum_c' z_c') / k``. The prefix estimates
are the cumulative sums of the estimated leaves (the least-squares estimate of any linear
function is that function of the least-squares estimate); this is how "subtraction" (Honaker
2015) enters: every node, also the right siblings, contributes. The test compares with dense
weighted least squares.

**Exact per-threshold variance.** The tree is symmetric, so the covariance of two estimated
leaves depends only on the level ``l`` of their lowest common ancestor: ``kappa_l``. Running the
two passes on the measurement vector ``v_0 e_(leaf 0)`` returns ``Cov(xhat_0, xhat_j)`` for
every ``j`` (for the least-squares estimate ``xhat = G y``, ``Cov(xhat) = (M^T S^-1 M)^-1 =
G S S^-1 M (M^T S^-1 M)^-1`` and ``M^T S^-1 (v_0 e_leaf0) = e_0``). Then
``Var(Chat_i) = kappa_0 Q_0 + sum_{l >= 1} kappa_l (Q_l - Q_{l-1})`` with ``Q_l = floor(i /
k^l) k^(2l) + (i mod k^l)^2`` the number of ordered pairs of the first ``i`` leaves that share
their level-``l`` ancestor. :func:`kary_prefix_variance` returns it; the test checks it against
the dense covariance.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from clipless import _validate
from clipless.stats.counting.release import (
    CountRelease,
    NodeNoiseSource,
    _condition_on_total,
    _count_release,
    _draw,
    _noise_param,
    _param_variance,
)
from clipless.stats.tree import Neighbouring, NoiseKind, _check_neighbouring

MAX_BRANCHING = 2**16
"""Largest accepted ``k``: a wider node only pads (the optimum is a few dozen at most)."""


def _check_branching(k: int) -> int:
    k = _validate.integer("branching", k)
    if not 2 <= k <= MAX_BRANCHING:
        raise ValueError(
            f"branching must be between 2 and {MAX_BRANCHING} (the optimum is small: "
            f"best_branching), got {k}"
        )
    return int(k)


def kary_depth(num_leaves: int, branching: int) -> int:
    """``h = ceil(log_k N)``, at least 1 (computed with integers).

    >>> kary_depth(4096, 8), kary_depth(4097, 8), kary_depth(1, 4)
    (4, 5, 1)
    """
    k = _check_branching(branching)
    if num_leaves < 1:
        raise ValueError(f"num_leaves must be >= 1, got {num_leaves}")
    h, size = 1, k
    while size < num_leaves:
        h += 1
        size *= k
    return h


def kary_sensitivity(depth: int, neighbouring: Neighbouring) -> int:
    """L1 (= squared L2) sensitivity of the noisy nodes: ``h + 1`` (add/remove, root included)
    or ``2 h`` (replace-one, the root is the public ``n`` and gets no noise). Module docstring.
    """
    _check_neighbouring(neighbouring)
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    return depth + 1 if neighbouring == "add_remove" else 2 * depth


def kary_node_counts(leaf_counts: ArrayLike, branching: int) -> list[NDArray[np.int64]]:
    """Node counts of the padded ``k``-ary tree: one array per level ``l = 0..h`` (level 0 =
    the ``k^h`` leaves, level ``h`` = the root, length 1). Linear (negative counts allowed, as
    the sensitivity test uses)."""
    arr = np.asarray(leaf_counts, dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("leaf_counts must be a non-empty one-dimensional array")
    k = _check_branching(branching)
    h = kary_depth(arr.size, k)
    cur = np.zeros(k**h, dtype=np.int64)
    cur[: arr.size] = arr
    out = [cur]
    for _ in range(h):
        cur = cur.reshape(-1, k).sum(axis=1)
        out.append(cur)
    return out


def _upward_variances(level_var: list[float], k: int) -> list[float]:
    t = [float(level_var[0])]
    for lev in range(1, len(level_var)):
        v = float(level_var[lev])
        t.append(0.0 if v == 0.0 else 1.0 / (1.0 / v + 1.0 / (k * t[-1])))
    return t


def kary_consistent_leaves(
    node_values: list[NDArray[np.float64]] | list[NDArray[np.int64]],
    branching: int,
    level_variances: list[float],
) -> NDArray[np.float64]:
    """Least-squares leaf estimates from noisy ``k``-ary node values (two passes, module doc).

    ``level_variances[l]`` is the noise variance at level ``l``; ``0`` means known exactly
    (only the root may be exact). Returns the ``k^h`` estimated leaves (padding included).
    Post-processing.
    """
    k = _check_branching(branching)
    h = len(node_values) - 1
    if len(level_variances) != h + 1:
        raise ValueError("level_variances needs one entry per level")
    if any(v == 0.0 for v in level_variances[:-1]):
        raise ValueError("only the root may have variance 0")
    t = _upward_variances(list(level_variances), k)
    z: list[NDArray[np.float64]] = [np.asarray(node_values[0], dtype=np.float64)]
    for lev in range(1, h + 1):
        s = z[-1].reshape(-1, k).sum(axis=1)
        y = np.asarray(node_values[lev], dtype=np.float64)
        v = float(level_variances[lev])
        if v == 0.0:
            z.append(y)
        else:
            w_own = 1.0 / v
            w_kids = 1.0 / (k * t[lev - 1])
            z.append((w_own * y + w_kids * s) / (w_own + w_kids))
    x = z[h]
    for lev in range(h, 0, -1):
        kids = z[lev - 1]
        resid = x - kids.reshape(-1, k).sum(axis=1)
        x = kids + np.repeat(resid / k, k)
    return x


def _kappa(h: int, k: int, level_var: tuple[float, ...]) -> NDArray[np.float64]:
    """``kappa_l``: covariance of two estimated leaves whose common ancestor is at level ``l``.

    The two passes run on ``v_0 e_(leaf 0)`` (module docstring) in ``O(h)``: upward only the
    path of leaf 0 is non-zero (``zp[l]``); downward a node off that path gets only its
    parent's residual share ``1/k``, so a sibling of the path at level ``l - 1`` gets
    ``(xp[l] - zp[l-1]) / k`` and each leaf below it ``k^-(l-1)`` of that.
    (:func:`kary_consistent_leaves` on the full vector gives the same; the test checks it.)
    """
    t = _upward_variances(list(level_var), k)
    zp = [float(level_var[0])]
    for lev in range(1, h + 1):
        v = float(level_var[lev])
        if v == 0.0:
            zp.append(0.0)
        else:
            w_own, w_kids = 1.0 / v, 1.0 / (k * t[lev - 1])
            zp.append(w_kids * zp[-1] / (w_own + w_kids))
    xp = [0.0] * (h + 1)
    xp[h] = zp[h]
    kappa = np.zeros(h + 1)
    for lev in range(h, 0, -1):
        share = (xp[lev] - zp[lev - 1]) / k
        xp[lev - 1] = zp[lev - 1] + share
        kappa[lev] = share / float(k ** (lev - 1))
    kappa[0] = xp[0]
    return kappa


_kary_kappa = lru_cache(maxsize=256)(_kappa)


def _level_increments(
    i: NDArray[np.float64], num_leaves: int, k: int, h: int, q: bool
) -> NDArray[np.float64]:
    """Rows ``l = 0..h``: ``Q_l(i) - Q_(l-1)(i)`` (``q``) or ``R_l(i) - R_(l-1)(i)`` at the
    thresholds ``i`` (:func:`kary_prefix_variance`, :func:`kary_prefix_covariance_with_last`)."""
    out = np.empty((h + 1, i.size))
    prev = np.zeros_like(i)
    for lev in range(h + 1):
        block = float(k**lev)
        j0 = np.floor(i / block)
        rest = np.mod(i, block)
        cur = j0 * block * block + rest * (
            rest if q else np.minimum(num_leaves - j0 * block, block)
        )
        out[lev] = cur - prev
        prev = cur
    return out


def _kappa_sum(
    num_leaves: int, k: int, h: int, level_variances: list[float], q: bool
) -> NDArray[np.float64]:
    """``sum_l kappa_l (Q_l(i) - Q_(l-1)(i))`` (``q``) or the same with ``R_l`` at every
    threshold ``i = 1..N``, accumulated level by level from the leaves up."""
    kappa = _kary_kappa(h, k, tuple(float(v) for v in level_variances))
    i = np.arange(1, num_leaves + 1, dtype=np.float64)
    rows = _level_increments(i, num_leaves, k, h, q)
    out = kappa[0] * rows[0]
    for lev in range(1, h + 1):
        out = out + kappa[lev] * rows[lev]
    return out


def kary_prefix_variance(
    num_leaves: int, branching: int, level_variances: list[float]
) -> NDArray[np.float64]:
    """Exact variance of every least-squares prefix estimate ``Chat_1..Chat_N`` (module doc)."""
    k = _check_branching(branching)
    h = len(level_variances) - 1
    if k**h < num_leaves:
        raise ValueError(f"{h} levels of branching {k} hold fewer than {num_leaves} leaves")
    var = _kappa_sum(num_leaves, k, h, level_variances, q=True)
    return np.maximum(var, 0.0)


def kary_prefix_covariance_with_last(
    num_leaves: int, branching: int, level_variances: list[float]
) -> NDArray[np.float64]:
    """``Cov(Chat_i, Chat_N)`` for every ``i`` (same ``kappa`` argument as
    :func:`kary_prefix_variance`, with ``R_l(i) = sum_v |P_i cap v| |P_N cap v|`` over the
    level-``l`` nodes: ``floor(i/k^l) k^(2l) + (i mod k^l) min(N - floor(i/k^l) k^l, k^l)``)."""
    k = _check_branching(branching)
    h = len(level_variances) - 1
    return _kappa_sum(num_leaves, k, h, level_variances, q=False)


def _per_level(neighbouring: Neighbouring) -> int:
    """How much one neighbouring change moves one level (L1 = squared L2): module docstring."""
    return 1 if neighbouring == "add_remove" else 2


def _level_param(share: Fraction, per: int, noise: NoiseKind, budget: Fraction) -> Fraction:
    """The exact noise parameter of a level with budget ``share``: discrete Laplace scale
    ``b >= per / (share epsilon)`` or discrete Gaussian ``sigma^2 >= per / (2 share rho)``."""
    return _noise_param(per, noise, budget * share)


def exact_level_variances(
    shares: tuple[Fraction, ...], neighbouring: Neighbouring, noise: NoiseKind, budget: Fraction
) -> list[float]:
    """The variance of the noise each level of the ``k``-ary tree actually draws (discrete
    Laplace or discrete Gaussian at the level's exact scale, :func:`_level_param`) for budget
    ``shares`` of the noisy levels; ``inf`` for a level that is not released, ``0`` for the
    public root under replace-one. Not ``1/epsilon^2``: below scale ~1 the discrete Laplace's
    variance ``2 q / (1 - q)^2`` falls exponentially (``q = exp(-1/b)``)."""
    per = _per_level(neighbouring)
    out = [
        math.inf if w == 0 else _param_variance(_level_param(w, per, noise, budget), noise)
        for w in shares
    ]
    if neighbouring == "replace_one":
        out.append(0.0)
    return out


@dataclass(frozen=True)
class CountingPlan:
    """A public choice of the ``k``-ary release: branching ``k``, the budget share of each
    noisy level (``0``: not released) and its exact mean error score (counts^2,
    :func:`_tree_score`) at the budget it was chosen for."""

    branching: int
    shares: tuple[Fraction, ...]
    score: float


def kary_params(
    plan: CountingPlan, neighbouring: Neighbouring, noise: NoiseKind, budget: Fraction
) -> tuple[Fraction | None, ...]:
    """The exact noise parameter of every noisy level of ``plan`` (``None``: not released)."""
    per = _per_level(neighbouring)
    return tuple(None if w == 0 else _level_param(w, per, noise, budget) for w in plan.shares)


def kary_released_nodes(
    num_leaves: int, plan: CountingPlan, neighbouring: Neighbouring
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``(level, index)`` of every released node of ``plan``, in the order of
    :attr:`CountRelease.noisy` (levels from the leaves up, each left to right)."""
    h = kary_depth(num_leaves, plan.branching)
    lev, idx = [], []
    for level, share in enumerate(plan.shares):
        if share != 0:
            size = plan.branching ** (h - level)
            lev.append(np.full(size, level, dtype=np.int64))
            idx.append(np.arange(size, dtype=np.int64))
    del neighbouring  # the shares already exclude the public root under replace-one
    return np.concatenate(lev), np.concatenate(idx)


def _check_plan(num_leaves: int, plan: CountingPlan, neighbouring: Neighbouring) -> int:
    k = _check_branching(plan.branching)
    h = kary_depth(num_leaves, k)
    m = h + 1 if neighbouring == "add_remove" else h
    shares = plan.shares
    if len(shares) != m or sum(shares) != 1 or shares[0] <= 0 or min(shares) < 0:
        raise ValueError("shares must give every noisy level a share >= 0, the leaves > 0, sum 1")
    return h


def _release_kary(
    counts: NDArray[np.int64],
    plan: CountingPlan,
    neighbouring: Neighbouring,
    noise: NoiseKind,
    budget: Fraction,
    gen: random.Random,
    eps_out: float | None,
    rho_out: float | None,
    node_noise: NodeNoiseSource | None = None,
) -> CountRelease:
    """``mechanism="k-ary"`` with the plan's branching and level shares (module docstring):
    level ``l`` with share ``w_l > 0`` gets noise at :func:`_level_param` (drawn from ``gen``,
    or the keyed ``node_noise`` of node ``(l, j)``), a level with share 0 is not released;
    then :func:`kary_estimate`."""
    N = int(counts.size)
    h = _check_plan(N, plan, neighbouring)
    params = kary_params(plan, neighbouring, noise, budget)
    true_nodes = kary_node_counts(counts, plan.branching)
    noisy: list[NDArray[np.int64]] = []
    for level, param in enumerate(params):
        if param is None:  # not released: no noise drawn, no budget spent
            continue
        size = plan.branching ** (h - level)
        if node_noise is not None:
            lev = np.full(size, level, dtype=np.int64)
            eta = np.asarray(node_noise.nodes(noise, param, lev, np.arange(size)), np.int64)
        else:
            eta = _draw(noise, param, size, gen)
        noisy.append(true_nodes[level] + eta)
    copies = 1 if node_noise is None else int(getattr(node_noise, "copies", 1))
    return kary_estimate(
        np.concatenate(noisy), N, plan, neighbouring, noise, budget, int(counts.sum()),
        eps_out, rho_out, copies,
    )  # fmt: skip


def _level_values(
    vec: NDArray[Any], params: tuple[Fraction | None, ...], k: int, h: int
) -> list[NDArray[np.float64]]:
    """The released vector cut into its levels (zeros for a level that is not released)."""
    if not np.issubdtype(vec.dtype, np.integer):
        raise ValueError(f"noisy must hold integers, got {vec.dtype}")
    values: list[NDArray[np.float64]] = []
    start = 0
    for level, param in enumerate(params):
        size = k ** (h - level)
        if param is None:
            values.append(np.zeros(size))
            continue
        values.append(vec[start : start + size].astype(np.float64))
        start += size
    if start != vec.size:
        raise ValueError(f"noisy must hold the {start} released nodes, got {vec.size}")
    return values


def kary_estimate(
    noisy: ArrayLike,
    num_leaves: int,
    plan: CountingPlan,
    neighbouring: Neighbouring,
    noise: NoiseKind,
    budget: Fraction,
    n_public: int,
    epsilon: float | None,
    rho: float | None,
    copies: int = 1,
) -> CountRelease:
    """The :class:`CountRelease` of a released ``k``-ary vector (post-processing only).

    ``noisy``: the released nodes in :func:`kary_released_nodes` order (integers: true counts
    plus noise); ``n_public``: the public ``n`` (replace-one; ignored under add/remove);
    ``copies``: independent full-scale draws summed in each node's noise (``m`` for the
    federated ``"distributed"`` option), which multiplies the variances. Least squares with the
    exact level variances, then (replace-one) conditioning on ``C_N = n``. The central release
    and the federated one call this same function: equal inputs give equal outputs, bit for bit.
    """
    N = int(num_leaves)
    k, shares = plan.branching, plan.shares
    h = _check_plan(N, plan, neighbouring)
    params = kary_params(plan, neighbouring, noise, budget)
    vec = np.asarray(noisy)
    values = _level_values(vec, params, k, h)
    level_var = [v * copies for v in exact_level_variances(shares, neighbouring, noise, budget)]
    if neighbouring == "replace_one":
        values.append(np.array([float(n_public)]))  # the root: the public n, exact
    weights, scale_var = level_var, 1.0
    if any(v == 0.0 for v in level_var[: len(params)]):
        # noise too small to have a float variance (huge budget): weight by a unit-budget
        # profile (any positive weights give an unbiased estimate); its variance underflows to 0
        per = _per_level(neighbouring)
        weights = [math.inf if w == 0 else float(per / w) ** 2 for w in shares]
        weights += [0.0] if neighbouring == "replace_one" else []
        scale_var = 0.0
    leaves = kary_consistent_leaves(values, k, weights)
    prefix = np.cumsum(leaves[:N])
    unit_var = kary_prefix_variance(N, k, weights)
    if neighbouring == "replace_one":
        # The root is the public n, but when N < k^h it also counts the padded leaves, so
        # Chat_N stays noisy: condition on C_N = n as well (Gaussian conditioning of the
        # linear estimate, post-processing; exact already when N = k^h).
        prefix, unit_var = _condition_on_total(
            prefix, unit_var, kary_prefix_covariance_with_last(N, k, weights), n_public
        )
    variance = scale_var * unit_var
    leaf_param = params[0]
    assert leaf_param is not None  # the leaves always get a share
    sensitivity = _per_level(neighbouring) * sum(1 for p in params if p is not None)
    leaves_only = _count_release(
        "k-ary", (prefix, variance, vec.astype(np.float64)), noise, leaf_param, level_var[0],
        sensitivity, neighbouring, (epsilon, rho),
    )  # fmt: skip
    return dataclasses.replace(leaves_only, noise_param=params, branching=k, shares=shares)
