"""Federated DP-ECDF (thesis section 6.4): the central tree release, computed without a curator.

Each owner holds some values; the thresholds ``tau_1 < ... < tau_N`` of a public
:class:`~clipless.stats.Grid` are known to all. A query names the evaluation points:

* ``thresholds=None`` (the whole grid): the servers obtain shares of every prefix count
  ``C_1..C_N``, turn them locally into shares of the node values ``theta(c)`` of
  :mod:`clipless.stats.tree` (a public integer linear map, exact in ``Z_2^64``), add their shares
  of each node's noise, and publish. The result is the central
  :class:`~clipless.stats.tree.TreeRelease` ``V = theta(c) + eta``, post-processed by
  :func:`clipless.stats.ecdf.from_release` (consistency, smoothing) into the same
  :class:`~clipless.stats.DPECDF` -- bit for bit, given the same keyed noise
  (:class:`~clipless.federated.NodeNoise` of the caller's key bound to this tree by
  :func:`~clipless.federated.noise.tree_key`; ``FederatedECDF.noise_source``).
* ``thresholds=B`` (leaf indices): the thesis's pointwise evaluation (Eq. 6.4.1),
  ``P_i = C_i + sum_l eta_{(l, i >> l)}`` for ``i in B``, equal to the central
  ``release.prefix_counts[B]``. Because the node noise is a PRF of the node id, answering more
  thresholds later reuses the same noise: every answer is a post-processing of one tree release
  (thesis Theorem 6.3.1), so the budget is spent once.

Protocols: ``"local"`` (trusted curator), ``"shares"`` (:class:`~clipless.federated.UStat`,
owners send one share vector per query, thesis section 6.4.1, cost ``O(n |E|)``), ``"fss"``
(:mod:`clipless.federated.dcf`: each owner sends one DCF key per server once, the servers
evaluate any threshold locally, thesis section 6.4.2, cost ``O(n + m |E|)``; two servers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import scipy.sparse as sp
from numpy.typing import ArrayLike, NDArray

from clipless.federated._checks import check_protocol
from clipless.federated.noise import NodeNoise, SummedNoise, node_ids, tree_context
from clipless.federated.ustat import Backend, NoiseSharing, Traffic, UStat
from clipless.stats.counting import (
    CountingPlan,
    CountRelease,
    counting_plan,
    kary_depth,
    kary_estimate,
    kary_params,
    kary_released_nodes,
)
from clipless.stats.ecdf import DPECDF, Smoothing, _as_grid, from_release
from clipless.stats.grid import Grid, tree_depth
from clipless.stats.noise import (
    conservative_scale,
    discrete_gaussian_variance,
    discrete_laplace_variance,
    to_fraction,
)
from clipless.stats.tree import (
    Neighbouring,
    NoiseKind,
    TreeRelease,
    _suffix_columns,
    noise_budget,
    tree_release,
    tree_sensitivity,
)

__all__ = [
    "FederatedECDF",
    "Protocol",
    "federated_ecdf",
    "kary_query",
    "kary_shape",
    "noise_parameter",
    "tree_query",
]

Protocol = Literal["local", "shares", "fss"]
FederatedMechanism = Literal["auto", "binary", "k-ary"]


def noise_parameter(
    depth: int,
    neighbouring: Neighbouring,
    noise: NoiseKind,
    epsilon: float | None,
    rho: float | None,
) -> tuple[Fraction, float, int]:
    """``(exact parameter, node variance, sensitivity)`` exactly as
    :func:`clipless.stats.tree.release_counts` computes them (Laplace scale
    ``Delta/epsilon`` rounded up by :func:`~clipless.stats.noise.conservative_scale`, or Gaussian
    ``sigma^2 = Delta / (2 rho)``).

    Args:
        depth: the binary tree's depth ``L``.
        neighbouring: ``"replace_one"`` or ``"add_remove"``.
        noise: ``"laplace"`` (needs ``epsilon``) or ``"gaussian"`` (needs ``rho``).
        epsilon, rho: the budget of the chosen noise; the other is ``None``.

    Raises:
        ValueError: an unknown noise, or a budget that does not fit it.
    """
    delta = tree_sensitivity(depth, neighbouring)
    if noise == "laplace":
        if rho is not None:
            raise ValueError("rho is only for noise='gaussian'; give epsilon for Laplace noise")
        if epsilon is None:
            raise ValueError("epsilon is required for noise='laplace'")
        param = conservative_scale(Fraction(delta) / to_fraction(epsilon, "epsilon"))
        return param, discrete_laplace_variance(param), delta
    if noise == "gaussian":
        if epsilon is not None:
            raise ValueError("noise='gaussian' is calibrated by rho (zCDP); pass epsilon=None")
        if rho is None:
            raise ValueError("rho is required for noise='gaussian'")
        param = Fraction(delta) / (2 * to_fraction(rho, "rho"))
        return param, discrete_gaussian_variance(param), delta
    raise ValueError(f"noise must be 'laplace' or 'gaussian', got {noise!r}")


@lru_cache(maxsize=32)
def tree_query(num_leaves: int) -> sp.csr_matrix:
    """The public integer map from the prefix counts ``C`` to the node values ``theta(c)``:
    ``theta @ D`` with ``c = D C`` (``c_0 = C_0``, ``c_i = C_i - C_{i-1}``)."""
    depth = tree_depth(num_leaves)
    diff = sp.diags(
        [np.ones(num_leaves, dtype=np.int64), -np.ones(num_leaves - 1, dtype=np.int64)],
        [0, -1],
        shape=(num_leaves, num_leaves),
        dtype=np.int64,
        format="csr",
    )
    return (_suffix_columns(depth, num_leaves) @ diff).tocsr()


def kary_query(num_leaves: int, plan: CountingPlan) -> sp.csr_matrix:
    """The public integer map from the prefix counts ``C`` to the released nodes of the
    ``k``-ary ``plan`` (:func:`~clipless.stats.counting.kary_released_nodes` order): node
    ``(l, j)`` counts leaves ``[j k^l, (j+1) k^l)``, i.e. ``C[min((j+1) k^l, N) - 1] -
    C[j k^l - 1]`` (``0`` for a padded node beyond ``N``). Two entries per row at most."""
    levels, index = kary_released_nodes(num_leaves, plan, "add_remove")
    width = np.power(plan.branching, levels)
    lo = index * width
    hi = np.minimum(lo + width, num_leaves)
    real = np.flatnonzero(lo < num_leaves)
    rows = np.concatenate([real, real[lo[real] > 0]])
    cols = np.concatenate([hi[real] - 1, lo[real][lo[real] > 0] - 1])
    vals = np.concatenate([np.ones(real.size), -np.ones(int(np.sum(lo[real] > 0)))])
    return sp.csr_matrix(
        (vals.astype(np.int64), (rows, cols)), shape=(levels.size, num_leaves), dtype=np.int64
    )


def kary_shape(plan: CountingPlan) -> str:
    """The ``shape`` of :func:`~clipless.federated.noise.tree_context` for a ``k``-ary plan."""
    return f"k-ary/{plan.branching}/" + ",".join(str(w) for w in plan.shares)


@dataclass(frozen=True, eq=False)
class FederatedECDF:
    """The output of :func:`federated_ecdf`.

    ``ecdf`` and ``release`` are set for a whole-grid query (``thresholds=None``; ``release``
    is the :class:`~clipless.stats.counting.CountRelease` of the ``k``-ary tree, or the
    binary :class:`~clipless.stats.tree.TreeRelease`); ``prefix_counts`` holds the released
    prefix counts at ``points`` (leaf indices; integers for the binary tree, the least-squares
    estimates of the ``k``-ary tree) and
    ``values`` the same divided by the public ``n`` (replace-one) or, for a whole-grid query,
    the :class:`~clipless.stats.DPECDF`'s values. ``traffic``: payload bytes per role of the
    in-process run (the TCP runner counts framed bytes on the wire instead).
    """

    protocol: Protocol
    servers: int
    noise_sharing: NoiseSharing
    points: NDArray[np.int64] = field(repr=False)
    prefix_counts: NDArray[np.int64] | NDArray[np.float64] = field(repr=False)
    values: NDArray[np.float64] = field(repr=False)
    ecdf: DPECDF | None = field(repr=False)
    release: TreeRelease | CountRelease | None = field(repr=False)
    traffic: Traffic
    noise_keys: list[bytes] = field(repr=False)
    noise_source: NodeNoise | SummedNoise = field(repr=False)
    """The central equivalent of the released noise (the keys bound to this tree)."""


def _points(thresholds: ArrayLike | None, num_leaves: int) -> NDArray[np.int64] | None:
    if thresholds is None:
        return None
    pts = np.asarray(thresholds)
    if pts.ndim != 1 or pts.size == 0 or not np.issubdtype(pts.dtype, np.integer):
        raise ValueError("thresholds must be a non-empty 1-D array of grid indices (ints)")
    if pts.min() < 0 or pts.max() >= num_leaves:
        raise ValueError(f"thresholds must be grid indices in [0, {num_leaves}), got {pts}")
    if np.any(np.diff(pts) <= 0):
        raise ValueError("thresholds must be strictly increasing grid indices")
    return pts.astype(np.int64)


def owner_leaves(owner_values: Sequence[ArrayLike], grid: Grid) -> list[NDArray[np.int64]]:
    """Each owner's leaf indices (values clamped to the grid, as in :meth:`Grid.leaf_index`)."""
    if len(owner_values) == 0:
        raise ValueError("owner_values must hold at least one owner")
    out = []
    for k, vals in enumerate(owner_values):
        arr = np.asarray(vals, dtype=np.float64).ravel()
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"owner_values[{k}] must be finite")
        out.append(grid.leaf_index(arr))
    return out


def prefix_indicators(leaves: NDArray[np.int64], points: NDArray[np.int64]) -> NDArray[np.int64]:
    """``u[e] = #{own leaves <= points[e]}``: one owner's contribution to the prefix counts."""
    return np.searchsorted(np.sort(leaves), points, side="right").astype(np.int64)


def path_nodes(
    points: NDArray[np.int64], depth: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Nodes ``(l, i >> l)``, ``l = 0..L``, on the path of each leaf: arrays ``(|points|, L+1)``."""
    levels = np.broadcast_to(np.arange(depth + 1, dtype=np.int64), (points.size, depth + 1))
    return np.ascontiguousarray(levels), points[:, None] >> levels


def assemble(
    out: NDArray[np.int64],
    g: Grid,
    points: NDArray[np.int64],
    whole: bool,
    n_total: int,
    noise: NoiseKind,
    param: Fraction,
    node_var: float,
    delta: int,
    epsilon: float | None,
    rho: float | None,
    neighbouring: Neighbouring,
    smoothing: Smoothing | None,
    consistency: bool,
) -> tuple[NDArray[np.int64], NDArray[np.float64], TreeRelease | None, DPECDF | None]:
    """The published sums -> ``(prefix counts, values, TreeRelease, DPECDF)`` (post-processing)."""
    N = len(g)
    L = tree_depth(N)
    if whole:
        offsets = np.concatenate([[0], np.cumsum([1 << (L - lev) for lev in range(L + 1)])])
        nodes = [out[offsets[lev] : offsets[lev + 1]].copy() for lev in range(L + 1)]
        eps_out = float(epsilon) if noise == "laplace" and epsilon is not None else None
        release = tree_release(
            nodes,
            N,
            noise,
            param,
            node_var,
            delta,
            neighbouring,
            epsilon=eps_out,
            rho=float(rho) if rho is not None else None,
        )
        prefix = release.prefix_counts
        F = from_release(
            release,
            g,
            n=n_total if neighbouring == "replace_one" else None,
            smoothing=smoothing,
            consistency=consistency,
        )
        return prefix, np.asarray(F.values), release, F
    counts = out
    if neighbouring == "replace_one":
        values = counts / float(n_total)
    elif points[-1] == N - 1:  # the released total P_N normalises (add/remove)
        values = counts / max(float(counts[-1]), 1.0)
    else:
        values = np.full(counts.size, np.nan)  # no public size: counts only
    return counts, values, None, None


def federated_ecdf(
    owner_values: Sequence[ArrayLike],
    grid: Grid | ArrayLike,
    epsilon: float | None,
    *,
    protocol: Protocol = "shares",
    servers: int = 2,
    noise_sharing: NoiseSharing = "dealer",
    thresholds: ArrayLike | None = None,
    neighbouring: Neighbouring = "replace_one",
    noise: NoiseKind = "laplace",
    rho: float | None = None,
    smoothing: Smoothing | None = "isotonic",
    consistency: bool = True,
    noise_keys: Sequence[bytes] | None = None,
    mechanism: FederatedMechanism = "auto",
    branching: int | None = None,
) -> FederatedECDF:
    """Release the DP-ECDF of the union of the owners' values, in process (see module doc).

    ``mechanism``: ``"auto"`` (default) releases a whole-grid query with the central default's
    ``k``-ary tree (:func:`~clipless.stats.counting.counting_plan`: ``k``, released levels,
    level budgets; the flat histogram included) and the same post-processing (least squares,
    conditioning, smoothing), so it equals :func:`clipless.stats.ecdf` with ``node_noise=``
    :attr:`FederatedECDF.noise_source` bit for bit; a pointwise query (``thresholds``) or
    ``consistency=False`` uses the thesis's binary tree (``"binary"`` forces it). Under zCDP,
    where the central default may be the factorisation, ``"auto"`` is the ``k``-ary plan (the
    factorisation's dense integer map is not computed over shares).

    The guarantee is that of :func:`clipless.stats.ecdf` with the same arguments against the
    coalitions listed for the chosen backend and noise option; with ``"distributed"`` the noise
    variance is ``servers`` times larger (and :attr:`DPECDF.variance` says so).

    Args:
        owner_values: ``owner_values[k]`` is owner ``k``'s values (finite reals; at least one
            owner).
        grid, epsilon, neighbouring, noise, rho, smoothing, consistency: as in
            :func:`clipless.stats.ecdf`.
        protocol: ``"local"`` (trusted curator), ``"shares"`` (additive secret sharing,
            ``servers >= 2``) or ``"fss"`` (two servers, distributed comparison functions;
            replace-one only).
        servers: the number of non-colluding servers.
        noise_sharing: ``"dealer"`` or ``"distributed"`` (:mod:`clipless.federated.ustat`
            lists the coalitions each survives).
        thresholds: strictly increasing grid indices for a pointwise query (binary tree);
            ``None`` (default): the whole grid.
        noise_keys: the node-noise key(s) (``None``: fresh; give them to reproduce a release
            or to compare with the central one).
        mechanism: ``"auto"``, ``"binary"`` or ``"k-ary"`` (above).
        branching: ``k`` of the ``k``-ary tree (``None``: the plan's).

    Returns:
        A :class:`FederatedECDF`: the released counts and values, the whole-grid
        :class:`~clipless.stats.DPECDF`, the traffic per role and the noise keys.

    Raises:
        ValueError: an option outside the accepted values, or options that do not go together
            (``"fss"`` with other than 2 servers or with add/remove, ``"k-ary"`` with
            ``thresholds``).
    """
    _check_options(protocol, servers, neighbouring, smoothing, mechanism)
    g = _as_grid(grid)
    N = len(g)
    noise_parameter(tree_depth(N), neighbouring, noise, epsilon, rho)  # refused before either tree
    pts = _points(thresholds, N)
    whole = pts is None
    if mechanism == "k-ary" and not (whole and consistency):
        raise ValueError(
            "mechanism='k-ary' releases the whole grid with least squares: thresholds must be "
            "None and consistency True (pointwise queries use the binary tree)"
        )
    if branching is not None and mechanism == "binary":
        raise ValueError("branching is only for mechanism 'k-ary' or 'auto'")
    query = _Query(
        owner_values, g, epsilon, rho, protocol, servers, noise_sharing, neighbouring, noise,
        smoothing, noise_keys,
    )  # fmt: skip
    if mechanism != "binary" and whole and consistency:
        return _federated_kary(query, branching)
    return _federated_binary(query, pts, consistency)


@dataclass(frozen=True)
class _Query:
    """One federated ECDF release's data, grid and options (checked by :func:`federated_ecdf`)."""

    owner_values: Sequence[ArrayLike]
    grid: Grid
    epsilon: float | None
    rho: float | None
    protocol: Protocol
    servers: int
    noise_sharing: NoiseSharing
    neighbouring: Neighbouring
    noise: NoiseKind
    smoothing: Smoothing | None
    noise_keys: Sequence[bytes] | None

    def leaves(self) -> tuple[list[NDArray[np.int64]], int]:
        """Each owner's grid cells and the total count (refused when 0 and public)."""
        leaves = owner_leaves(self.owner_values, self.grid)
        n_total = int(sum(x.size for x in leaves))
        if n_total == 0 and self.neighbouring == "replace_one":  # under add/remove n is private
            raise ValueError("the owners hold no values (n = 0 is public under replace_one)")
        return leaves, n_total

    def publish(
        self,
        leaves: list[NDArray[np.int64]],
        points: NDArray[np.int64],
        params: Any,
        noise_at: tuple[NDArray[np.int64], NDArray[np.int64]],
        matrix: sp.csr_matrix | None,
        context: bytes,
    ) -> tuple[NDArray[np.int64], UStat]:
        """The servers' published noisy node counts over the owners' shares (or FSS keys), with
        the noise bound to ``context`` (the tree: :func:`~clipless.federated.noise.tree_key`)."""
        backend: Backend = "local" if self.protocol == "local" else "shares"
        ustat = UStat(backend, self.servers, self.noise_sharing, self.noise_keys, tree=context)
        levels, index = noise_at
        if self.protocol == "fss":
            from clipless.federated.dcf import fss_publish

            out = fss_publish(
                leaves, points, ustat, self.noise, params, levels, index, matrix,
                domain=len(self.grid),
            )  # fmt: skip
        else:
            contributions = [prefix_indicators(x, points) for x in leaves]
            out = ustat.publish(contributions, self.noise, params, levels, index, matrix)
        return out, ustat


def _check_options(
    protocol: str, servers: int, neighbouring: str, smoothing: str | None, mechanism: str
) -> None:
    """:func:`federated_ecdf`'s choices, each refused with its name and the accepted values."""
    check_protocol(protocol, servers, neighbouring)
    if smoothing not in (None, "isotonic", "l1", "l2"):
        raise ValueError(f"smoothing must be None, 'isotonic', 'l1' or 'l2', got {smoothing!r}")
    if mechanism not in ("auto", "binary", "k-ary"):
        raise ValueError(f"mechanism must be 'auto', 'binary' or 'k-ary', got {mechanism!r}")


def _federated_binary(q: _Query, pts: NDArray[np.int64] | None, consistency: bool) -> FederatedECDF:
    """The thesis's binary tree over the owners' shares: a pointwise query (``pts``) or the
    whole grid (``pts`` None)."""
    N = len(q.grid)
    L = tree_depth(N)
    param, variance, delta = noise_parameter(L, q.neighbouring, q.noise, q.epsilon, q.rho)
    whole = pts is None
    points = np.arange(N, dtype=np.int64) if pts is None else pts
    leaves, n_total = q.leaves()
    if whole:
        matrix: sp.csr_matrix | None = tree_query(N)
        lv, ix = node_ids(L)
        noise_at = (lv[:, None], ix[:, None])
    else:
        matrix = None
        noise_at = path_nodes(points, L)
    context = tree_context(q.grid.thresholds, "ecdf")
    out, ustat = q.publish(leaves, points, param, noise_at, matrix, context)
    m_noise = ustat.noise_source.copies  # servers under "distributed": each adds full noise
    counts, values, release, F = assemble(
        out, q.grid, points, whole, n_total, q.noise, param, variance * m_noise, delta,
        q.epsilon, q.rho, q.neighbouring, q.smoothing, consistency,
    )  # fmt: skip
    return _result(q, ustat, points, counts, values, F, release)


def _result(
    q: _Query,
    ustat: UStat,
    points: NDArray[np.int64],
    counts: Any,
    values: Any,
    F: DPECDF | None,
    release: Any,
) -> FederatedECDF:
    return FederatedECDF(
        protocol=q.protocol,
        servers=ustat.servers,
        noise_sharing=ustat.noise_sharing,
        points=points,
        prefix_counts=counts,
        values=values,
        ecdf=F,
        release=release,
        traffic=ustat.traffic,
        noise_keys=list(ustat.noise_keys),
        noise_source=ustat.noise_source,
    )


def _federated_kary(q: _Query, branching: int | None) -> FederatedECDF:
    """The whole-grid release with the central default's ``k``-ary plan: the servers map
    their shares of the prefix counts to the released node counts (:func:`kary_query`), add
    their shares of each node's noise at its level's parameter, publish; the published vector
    goes through :func:`~clipless.stats.counting.kary_estimate` and
    :func:`~clipless.stats.ecdf.from_release`, the central release's own post-processing."""
    N = len(q.grid)
    budget, eps_out, rho_out = noise_budget(q.noise, q.epsilon, q.rho)
    plan = counting_plan(N, q.neighbouring, q.noise, budget, branching)
    params = kary_params(plan, q.neighbouring, q.noise, budget)
    lv, ix = kary_released_nodes(N, plan, q.neighbouring)
    points = np.arange(N, dtype=np.int64)
    leaves, n_total = q.leaves()
    context = tree_context(q.grid.thresholds, "ecdf", kary_shape(plan))
    out, ustat = q.publish(
        leaves, points, params, (lv[:, None], ix[:, None]), kary_query(N, plan), context
    )
    assert kary_depth(N, plan.branching) >= 1
    release = kary_estimate(
        out, N, plan, q.neighbouring, q.noise, budget, n_total, eps_out, rho_out,
        ustat.noise_source.copies,
    )  # fmt: skip
    n = n_total if q.neighbouring == "replace_one" else None
    F = from_release(release, q.grid, n=n, smoothing=q.smoothing)
    return _result(q, ustat, points, release.prefix_counts, np.asarray(F.values), F, release)
