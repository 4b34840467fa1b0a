r"""Monotone smoothing of a released DP-ECDF (thesis chapter 6, section 6.3.2, eq. 6.3.6).

Everything here is **post-processing** of an already private release (a
:class:`~clipless.stats.tree.TreeRelease` or released values), so it costs no privacy budget
(the output depends on the data only through the DP output). The goal is utility: a noisy ECDF
need not be non-decreasing, which breaks quantile search and ROC curves, and projecting it back
onto the set of distribution functions can also reduce the error (thesis section 6.6.3).

Two smoothers:

* :func:`isotonic` -- weighted least squares onto non-decreasing sequences (pool-adjacent-
  violators, O(N)), then clipped to ``[0, 1]``. Clipping a non-decreasing sequence keeps it
  non-decreasing, and for constant bounds the clipped isotonic fit *is* the least-squares
  projection onto ``{non-decreasing, within [0, 1]}``.
* :func:`smooth_tree` -- the thesis's problem (eq. 6.3.6) over corrections ``nu`` to the noisy
  tree nodes: minimise ``sum |nu_{j,l}|^p`` (``p = 1``: an LP, the maximum-likelihood correction
  for Laplace noise; ``p = 2``: a QP) such that the corrected prefix counts
  ``y_i = P_i + sum_l nu_{ceil(i/2^l), l}`` are non-decreasing and within ``[0, n]``; it returns
  ``F = y / n``. The thesis allows a subset ``B`` of thresholds; here ``B`` is all of them.

**Reformulation (why it is fast).** Write the corrected prefix counts through their increments
``z_0 = y_1``, ``z_r = y_{r+1} - y_r`` (``r = 1..N-1``) and ``z_N = n - y_N`` (0-based vertices
``r = 0..N``). The constraints of 6.3.6 are exactly ``z >= 0``. A correction ``nu`` on the node
covering leaves ``a+1..b`` (1-based) raises ``y_{a+1..b}``, i.e. adds ``+nu`` to ``z_a`` and
``-nu`` to ``z_b`` (``b = N`` counts as vertex ``N``). So with ``d = z(P)``,

    ``z = d + K nu``,   ``K`` = the incidence matrix of the "dyadic graph" on vertices ``0..N``
    with one edge ``(a, b)`` per tree node (2 non-zeros per column, against ``L+1`` per row of
    the path-sum matrix),

and 6.3.6 is ``min ||nu||_p^p  s.t.  d + K nu >= 0``: for ``p = 1`` a min-cost flow (move the
noisy negative mass ``d_r < 0`` along tree edges at unit cost per unit and edge), for ``p = 2`` a
least-norm problem. ``K`` is a network matrix, hence totally unimodular. The dyadic graph is
series-parallel (treewidth 2): eliminating vertices by increasing number of trailing zero bits
creates no fill. Two exact combinatorial solvers exploit this (``method="auto"``):

* ``p = 2``: the dual is the obstacle problem ``min_{lambda >= 0} 1/2 lambda^T G lambda +
  d^T lambda`` with ``G = K K^T`` the graph Laplacian (an M-matrix on every proper subset), solved
  by the primal-dual active set method (Hintermueller, Ito, Kunisch 2002: a semismooth Newton
  method, globally and finitely convergent for nonsingular M-matrices; here every step solves on
  a proper vertex subset, where ``G`` is one). Each step is one fill-free elimination, ``O(N)``
  vectorised per level; a handful of steps suffice in practice (5 to 9 on ``X_pois(3)``,
  ``N = 2^15``, ``epsilon`` from 10 to 0.1). Then ``nu = K^T lambda`` and
  ``z = d + G lambda``. The final active set satisfies the KKT conditions exactly (up to
  rounding; checked, else OSQP is used), so the result is the exact optimum, not an
  approximation.
* ``p = 1``: the dual LP ``max -d^T lambda`` s.t. ``lambda >= 0``, ``|lambda_a - lambda_b| <= 1``
  on every edge has an integral optimum (``K^T`` is totally unimodular), with
  ``0 <= lambda <= 2L`` (the graph diameter), so it is solved *exactly* by dynamic programming
  over the same elimination order (messages are ``(B+1) x 3`` tables per edge for the box
  ``0 <= lambda <= B``; ``B`` starts at 8 and doubles while the bound is attained: when it is not,
  the box constraint is inactive and by convexity the boxed optimum is global). A primal flow is
  then recovered from complementary slackness by one integral maximum flow on the "tight" edges
  (:func:`scipy.sparse.csgraph.maximum_flow`); this needs integer data (integer noisy counts and
  an integer ``n``, which :func:`~clipless.stats.ecdf.ecdf` provides: the tree noise is discrete).

``method="generic"`` (and the automatic fallback: non-integer data for ``p = 1``, or a failed
check) solves the same reformulated problem with the general solvers the design asks for:
HiGHS (``scipy.optimize.linprog(method="highs")``) for ``p = 1`` and OSQP (sparse ADMM, polished)
for ``p = 2``. The tests check every path against brute-force references on small trees.

Whatever the solver, the returned values are made exactly valid: the prefix counts are clipped to
``[0, n]`` (removing solver tolerance) and passed through a running maximum, so ``F`` is
non-decreasing and within ``[0, 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import scipy.sparse as sp
from numpy.typing import ArrayLike, NDArray

from clipless import _validate
from clipless.stats.grid import finite_vector

if TYPE_CHECKING:
    from clipless.stats.tree import TreeRelease

__all__ = ["Norm", "SmoothedCounts", "isotonic", "smooth_counts", "smooth_tree"]

Norm = Literal["l1", "l2"]
Method = Literal["auto", "generic"]

_PDAS_MAX_ITER = 200
_L1_BOX_START = 8  # initial bound on the l1 dual variables (grown on demand, see _solve_l1)
_INT32_MAX = (1 << 31) - 1


# --------------------------------------------------------------------------------------------
# isotonic regression (pool adjacent violators)
# --------------------------------------------------------------------------------------------


def isotonic(values: ArrayLike, weights: ArrayLike | None = None) -> NDArray[np.float64]:
    """Weighted isotonic regression by pool-adjacent-violators, then clipped to ``[0, 1]``.

    Returns the non-decreasing ``f`` minimising ``sum_i w_i (f_i - v_i)^2`` (Ayer et al. 1955;
    Barlow et al. 1972), clipped to ``[0, 1]``. For constant bounds the clipped fit equals the
    weighted least-squares projection onto ``{non-decreasing, 0 <= f <= 1}`` (each pooled block
    mean is clipped independently, and clipping preserves order). ``O(N)``: every element is
    pushed once and merged at most once. Post-processing (thesis section 6.3.2): no privacy cost.

    Args:
        values: the values to fit, finite.
        weights: positive, finite weights, one per value (``None``: all 1); typically inverse
            variances, e.g. of the least-squares consistent release.

    >>> isotonic([0.1, 0.3, 0.2, 1.2]).tolist()
    [0.1, 0.25, 0.25, 1.0]
    """
    y = _float_vector(values, "values")
    if weights is None:
        w = np.ones_like(y)
    else:
        w = _float_vector(weights, "weights")
        if w.shape != y.shape:
            raise ValueError(
                f"weights must have the same length as values ({y.size}), got {w.size}"
            )
        if np.any(w <= 0):
            raise ValueError("weights must be > 0")
    return np.clip(_pav(y, w), 0.0, 1.0)


def _pav(y: NDArray[np.float64], w: NDArray[np.float64]) -> NDArray[np.float64]:
    """Unclipped weighted PAV (block means, block weights and block lengths on a stack)."""
    means: list[float] = []
    wts: list[float] = []
    lens: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist(), strict=True):
        m, ww, ln = yi, wi, 1
        while means and means[-1] > m:
            pm, pw, pl = means.pop(), wts.pop(), lens.pop()
            tot = pw + ww
            m = (pm * pw + m * ww) / tot
            ww, ln = tot, ln + pl
        means.append(m)
        wts.append(ww)
        lens.append(ln)
    return np.repeat(np.asarray(means, dtype=np.float64), np.asarray(lens, dtype=np.int64))


def _float_vector(values: ArrayLike, name: str) -> NDArray[np.float64]:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of real numbers: {exc}") from None
    finite_vector(arr, name)
    return arr


# --------------------------------------------------------------------------------------------
# the dyadic graph of a tree with N leaves
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Dyadic:
    """Edges of the dyadic graph: level ``l`` edge ``j`` joins ``j 2^l`` and ``min((j+1) 2^l, N)``
    (the tree node covering 0-based leaves ``j 2^l .. (j+1) 2^l - 1``, clipped to the real ones).
    """

    num_leaves: int
    depth: int
    left: list[NDArray[np.int64]] = field(repr=False)
    right: list[NDArray[np.int64]] = field(repr=False)
    incidence: sp.csr_matrix = field(repr=False)  # (N+1) x M, columns level by level
    degree: NDArray[np.float64] = field(repr=False)

    @property
    def num_edges(self) -> int:
        return int(self.incidence.shape[1])


@lru_cache(maxsize=16)
def _dyadic(num_leaves: int, depth: int) -> _Dyadic:
    N = num_leaves
    left: list[NDArray[np.int64]] = []
    right: list[NDArray[np.int64]] = []
    for lev in range(depth + 1):
        m = -(-N // (1 << lev))
        j = np.arange(m, dtype=np.int64)
        left.append(j << lev)
        right.append(np.minimum((j + 1) << lev, N))
    a = np.concatenate(left)
    b = np.concatenate(right)
    M = a.size
    cols = np.arange(M, dtype=np.int64)
    inc = sp.csr_matrix(
        (
            np.concatenate([np.ones(M), -np.ones(M)]),
            (np.concatenate([a, b]), np.concatenate([cols, cols])),
        ),
        shape=(N + 1, M),
    )
    degree = np.bincount(np.concatenate([a, b]), minlength=N + 1).astype(np.float64)
    return _Dyadic(N, depth, left, right, inc, degree)


# --------------------------------------------------------------------------------------------
# the smoothing problem (thesis eq. 6.3.6)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SmoothedCounts:
    """Solution of the thesis's smoothing problem (eq. 6.3.6) for one release.

    Attributes:
        values: ``F = y / n``: non-decreasing, within ``[0, 1]`` (the smoothed DP-ECDF).
        prefix: the smoothed prefix counts ``y`` (after the final clip and running maximum).
        objective: ``sum |nu|^p`` of the solver's corrections (``p = 1`` or ``2``; for ``p = 2`` the
            sum of squares, not half of it), before the final clip.
        norm: ``"l1"`` or ``"l2"``.
        method: which solver ran: ``"dual-dp+maxflow"`` or ``"highs"`` (l1), ``"pdas"`` or
            ``"osqp"`` (l2), or ``"none"`` when the release was already feasible.
    """

    values: NDArray[np.float64] = field(repr=False)
    prefix: NDArray[np.float64] = field(repr=False)
    objective: float
    norm: Norm
    method: str


def smooth_tree(release: TreeRelease, n: float, norm: Norm = "l2") -> NDArray[np.float64]:
    """The thesis's smoothed DP-ECDF (eq. 6.3.6): ``F = y / n``, non-decreasing within [0, 1].

    Finds corrections ``nu`` to the noisy tree nodes of ``release`` minimising ``||nu||_1``
    (``norm="l1"``, a linear program) or ``||nu||_2^2`` (``norm="l2"``, a quadratic program) such
    that the corrected prefix counts are non-decreasing and within ``[0, n]``. Post-processing of
    the release: no privacy cost. See the module docstring for the flow reformulation and the
    exact solvers; :func:`smooth_counts` returns the objective and the solver used as well.

    Args:
        release: a :class:`~clipless.stats.tree.TreeRelease` (its ``prefix_counts`` and ``depth``).
        n: the normaliser (``> 0``): the public size (replace-one) or a released total (add/remove).
        norm: ``"l1"`` or ``"l2"`` (the thesis's ``p = 1`` or ``p = 2``).
    """
    depth = getattr(release, "depth", None)
    prefix = getattr(release, "prefix_counts", None)
    if depth is None or prefix is None:
        raise TypeError(
            "release must be a TreeRelease (with depth and prefix_counts), "
            f"got {type(release).__name__}"
        )
    return smooth_counts(prefix, n, norm, depth=depth).values


def smooth_counts(
    prefix_counts: ArrayLike,
    n: float,
    norm: Norm = "l2",
    *,
    depth: int | None = None,
    method: Method = "auto",
) -> SmoothedCounts:
    """Solve the thesis's problem 6.3.6 for noisy prefix counts of a tree release.

    Args:
        prefix_counts: the released noisy prefix counts ``P_1..P_N`` (path sums of the tree nodes).
        n: the upper bound of the prefix counts and the normaliser, ``> 0``.
        norm: ``"l1"`` (LP) or ``"l2"`` (QP).
        depth: tree depth ``L`` (default ``ceil(log2 N)``; must satisfy ``2^L >= N``).
        method: ``"auto"``: the exact combinatorial solvers of the module docstring (falling back to
            the generic ones when they do not apply); ``"generic"``: HiGHS (l1) or OSQP (l2).
    """
    P = _float_vector(prefix_counts, "prefix_counts")
    N = int(P.size)
    n_val = _positive(n, "n")
    if norm not in ("l1", "l2"):
        raise ValueError(f"norm must be 'l1' or 'l2', got {norm!r}")
    if method not in ("auto", "generic"):
        raise ValueError(f"method must be 'auto' or 'generic', got {method!r}")
    min_depth = int(N - 1).bit_length()
    if depth is None:
        L = min_depth
    else:
        depth = _validate.integer("depth", depth)
        if depth < min_depth:
            raise ValueError(f"depth must be >= ceil(log2 N) = {min_depth}, got {depth}")
        L = int(depth)
    graph = _dyadic(N, L)
    d = np.empty(N + 1)
    d[0] = P[0]
    d[1:N] = np.diff(P)
    d[N] = n_val - P[-1]

    if np.all(d >= 0):
        z, objective, used = d, 0.0, "none"
    elif norm == "l2":
        z, objective, used = _solve_l2(d, graph, method)
    else:
        z, objective, used = _solve_l1(d, graph, method)

    y = np.cumsum(z[:N])
    y = np.maximum.accumulate(np.clip(y, 0.0, n_val))
    values = np.minimum(y / n_val, 1.0)
    values.setflags(write=False)
    y.setflags(write=False)
    return SmoothedCounts(values=values, prefix=y, objective=objective, norm=norm, method=used)


def _positive(value: Any, name: str) -> float:
    out = _validate.real(name, value)
    if not np.isfinite(out) or out <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return out


# --------------------------------------------------------------------------------------------
# p = 2: primal-dual active set on the Laplacian obstacle problem
# --------------------------------------------------------------------------------------------


def _solve_l2(
    d: NDArray[np.float64], graph: _Dyadic, method: Method
) -> tuple[NDArray[np.float64], float, str]:
    if method == "auto":
        lam = _pdas(d, graph)
        if lam is not None:
            nu = graph.incidence.T @ lam
            z = d + graph.incidence @ nu
            return z, float(nu @ nu), "pdas"
    return _osqp_l2(d, graph)


def _laplacian_solve(
    rhs: NDArray[np.float64], grounded: NDArray[np.bool_], graph: _Dyadic
) -> NDArray[np.float64]:
    """Solve ``G_II x_I = rhs_I``, ``x = 0`` off ``I`` (``I`` = not grounded), ``G = K K^T``.

    Gaussian elimination of the vertices with ``l`` trailing zero bits at step ``l``: such a
    vertex ``r`` has exactly two neighbours left, ``r - 2^l`` and ``min(r + 2^l, N)``, which are
    themselves joined by a level ``l+1`` edge, so there is no fill; grounded vertices become
    identity rows with their edges removed. Vectorised per level: ``O(N)`` work in ``L`` steps.
    """
    N, L = graph.num_leaves, graph.depth
    diag = graph.degree.copy()
    diag[grounded] = 1.0
    b = np.where(grounded, 0.0, rhs)
    coef: list[NDArray[np.float64]] = []
    for lev in range(L + 1):
        c = np.full(graph.left[lev].size, -1.0)
        c[grounded[graph.left[lev]] | grounded[graph.right[lev]]] = 0.0
        coef.append(c)
    for lev in range(L):
        c = coef[lev]
        m = c.size
        ne = m // 2
        if ne:
            cl, cr = c[0 : 2 * ne : 2], c[1 : 2 * ne : 2]
            i = np.arange(ne, dtype=np.int64)
            r = (2 * i + 1) << lev
            u = i << (lev + 1)
            w = np.minimum(r + (1 << lev), N)
            dr, br = diag[r], b[r]
            diag[u] -= cl * cl / dr
            diag[w] -= cr * cr / dr
            b[u] -= cl * br / dr
            b[w] -= cr * br / dr
            coef[lev + 1][:ne] -= cl * cr / dr
        if m % 2:
            coef[lev + 1][ne] += c[m - 1]
    x = np.zeros(N + 1)
    c0 = coef[L][0]
    det = diag[0] * diag[N] - c0 * c0
    if N == 0 or not det > 0:  # pragma: no cover - impossible for a proper grounded subset
        raise np.linalg.LinAlgError("singular grounded Laplacian")
    x[0] = (b[0] * diag[N] - c0 * b[N]) / det
    x[N] = (diag[0] * b[N] - c0 * b[0]) / det
    for lev in range(L - 1, -1, -1):
        c = coef[lev]
        ne = c.size // 2
        if not ne:
            continue
        cl, cr = c[0 : 2 * ne : 2], c[1 : 2 * ne : 2]
        i = np.arange(ne, dtype=np.int64)
        r = (2 * i + 1) << lev
        u = i << (lev + 1)
        w = np.minimum(r + (1 << lev), N)
        x[r] = (b[r] - cl * x[u] - cr * x[w]) / diag[r]
    x[grounded] = 0.0
    return x


def _pdas(d: NDArray[np.float64], graph: _Dyadic) -> NDArray[np.float64] | None:
    """Primal-dual active set for ``min_{x >= 0} 1/2 x^T G x + d^T x``; ``None`` if it fails."""
    K = graph.incidence
    KT = K.T.tocsr()
    x = np.zeros(d.size)
    mu = d.copy()
    free = x - mu > 0
    scale = max(1.0, float(np.max(np.abs(d))))
    for _ in range(_PDAS_MAX_ITER):
        if free.all():  # the Laplacian is singular on the whole vertex set
            return None
        x = _laplacian_solve(-d, ~free, graph)
        mu = d + K @ (KT @ x)
        new_free = x - mu > 0
        if np.array_equal(new_free, free):
            tol = 1e-9 * scale
            if np.all(x >= -tol) and np.all(mu >= -tol):
                return np.maximum(x, 0.0)
            return None  # pragma: no cover - a fixed point of PDAS satisfies the KKT conditions
        free = new_free
    return None  # pragma: no cover


def _osqp_l2(d: NDArray[np.float64], graph: _Dyadic) -> tuple[NDArray[np.float64], float, str]:
    import osqp  # lazy: slow to import; only the fallback when the active-set method fails

    K = graph.incidence.tocsc()
    M = graph.num_edges
    solver = osqp.OSQP()
    solver.setup(
        P=sp.identity(M, format="csc"),
        q=np.zeros(M),
        A=K,
        l=-d,
        u=np.full(d.size, np.inf),
        verbose=False,
        eps_abs=1e-7,
        eps_rel=1e-7,
        polishing=True,
        max_iter=200_000,
    )
    res = solver.solve(raise_error=False)
    status = str(res.info.status).lower()
    if "solved" not in status or "inaccurate" in status:
        raise RuntimeError(f"OSQP failed on the smoothing QP: {res.info.status}")
    nu = np.asarray(res.x, dtype=np.float64)
    return d + K @ nu, float(nu @ nu), "osqp"


# --------------------------------------------------------------------------------------------
# p = 1: exact dual dynamic programme + max-flow primal recovery, or HiGHS
# --------------------------------------------------------------------------------------------


def _solve_l1(
    d: NDArray[np.float64], graph: _Dyadic, method: Method
) -> tuple[NDArray[np.float64], float, str]:
    if method == "auto" and _integral(d):
        # an optimum has min(lam) = 0 and max(lam) <= the graph diameter <= 2L; a smaller box
        # suffices when its bound is not attained (the box constraint is then inactive, so the
        # restricted optimum is a global one: the problem is convex), so grow it on demand
        d_max = 2 * graph.depth + 2
        box = min(_L1_BOX_START, d_max)
        while True:
            lam = _l1_dual_dp(d, graph, box)
            if lam.max() < box or box >= d_max:
                break
            box = min(2 * box, d_max)
        z = _l1_primal_from_dual(d, lam, graph)
        if z is not None:
            return z, float(-(d @ lam)), "dual-dp+maxflow"
    return _highs_l1(d, graph)


def _integral(d: NDArray[np.float64]) -> bool:
    return bool(np.all(d == np.round(d)) and np.sum(np.abs(d)) < _INT32_MAX // 4)


def _l1_dual_dp(d: NDArray[np.float64], graph: _Dyadic, box: int) -> NDArray[np.int64]:
    """An integral optimum of ``max -d^T lam`` s.t. ``0 <= lam <= box``, ``|lam_a - lam_b| <= 1``.

    Variable elimination in the fill-free order of :func:`_laplacian_solve`. The message on the
    edge ``(u, w)`` is a table ``T[lam_u, k]`` for ``lam_w = lam_u + k - 1`` (``k = 0, 1, 2``):
    the minimum of ``sum d_r lam_r`` over the eliminated vertices between them.
    """
    N, L = graph.num_leaves, graph.depth
    D = box
    lam_vals = np.arange(D + 1, dtype=np.float64)
    base = np.zeros((D + 1, 3))
    base[0, 0] = np.inf
    base[D, 2] = np.inf
    tables = np.broadcast_to(base, (graph.left[0].size, D + 1, 3)).copy()
    choices: list[NDArray[np.int8]] = []
    inf_col = np.full((1,), np.inf)
    for lev in range(L):
        m = tables.shape[0]
        ne = m // 2
        nxt = np.broadcast_to(base, (-(-m // 2), D + 1, 3)).copy()
        if ne:
            A = tables[0 : 2 * ne : 2]  # (ne, D+1, 3): edge (u, r)
            B = tables[1 : 2 * ne : 2]  # edge (r, w)
            r = ((2 * np.arange(ne, dtype=np.int64) + 1) << lev).astype(np.int64)
            unary = d[r][:, None] * lam_vals[None, :]  # (ne, D+1): d_r lam_r
            best = np.full((ne, D + 1, 3), np.inf)
            arg = np.zeros((ne, D + 1, 3), dtype=np.int8)
            for k1 in range(3):  # lam_r = lam_u + k1 - 1
                s = k1 - 1
                # shift so that row lam_u reads the values at lam_r = lam_u + s
                Bs = _shift_rows(B, s, inf_col)
                Us = _shift_rows(unary[:, :, None], s, inf_col)[:, :, 0]
                part = A[:, :, k1] + Us  # (ne, D+1)
                for k2 in range(3):  # lam_w = lam_r + k2 - 1
                    k = k1 + k2 - 1  # lam_w = lam_u + k - 1
                    if not 0 <= k <= 2:
                        continue
                    cand = part + Bs[:, :, k2]
                    better = cand < best[:, :, k]
                    best[:, :, k] = np.where(better, cand, best[:, :, k])
                    arg[:, :, k] = np.where(better, k1, arg[:, :, k])
            nxt[:ne] += best
            choices.append(arg)
        else:
            choices.append(np.zeros((0, D + 1, 3), dtype=np.int8))
        if m % 2:
            nxt[ne] += tables[m - 1]
        tables = nxt
    final = tables[0] + d[0] * lam_vals[:, None]
    final = final + d[N] * (lam_vals[:, None] + np.arange(3)[None, :] - 1)
    top = np.unravel_index(int(np.argmin(final)), final.shape)
    lam = np.zeros(N + 1, dtype=np.int64)
    lam[0] = int(top[0])
    lam[N] = int(top[0]) + int(top[1]) - 1
    for lev in range(L - 1, -1, -1):
        arg = choices[lev]
        ne = arg.shape[0]
        if not ne:
            continue
        i = np.arange(ne, dtype=np.int64)
        r = (2 * i + 1) << lev
        u = i << (lev + 1)
        w = np.minimum(r + (1 << lev), N)
        lu = lam[u]
        kk = lam[w] - lu + 1
        lam[r] = lu + arg[i, lu, kk].astype(np.int64) - 1
    return lam


def _shift_rows(x: NDArray[np.float64], s: int, inf_col: NDArray[np.float64]) -> Any:
    """``out[:, t] = x[:, t + s]`` along axis 1 (``s`` in -1, 0, 1), ``inf`` outside."""
    if s == 0:
        return x
    out = np.full_like(x, np.inf)
    if s > 0:
        out[:, :-s] = x[:, s:]
    else:
        out[:, -s:] = x[:, :s]
    return out


def _l1_primal_from_dual(
    d: NDArray[np.float64], lam: NDArray[np.int64], graph: _Dyadic
) -> NDArray[np.float64] | None:
    """A primal optimum from an optimal dual by complementary slackness (one max flow).

    Mass may move along edge ``(a, b)`` only towards the endpoint with the larger ``lam`` (and
    only if the difference is 1); every vertex with ``lam > 0`` must end with ``z = 0``; vertices
    with ``lam = 0`` may keep mass. Sources: the supplies ``d_r > 0`` (those with ``lam_r > 0``
    must be shipped in full, the others through a common node capped by the remaining demand);
    sinks: the demands ``d_r < 0``. A flow saturating every demand is optimal. ``None`` if the
    check fails (the caller then falls back to HiGHS).
    """
    from scipy.sparse.csgraph import maximum_flow

    N = graph.num_leaves
    di = np.round(d).astype(np.int64)
    a = np.concatenate(graph.left)
    b = np.concatenate(graph.right)
    diff = lam[a] - lam[b]
    demand = int(-di[di < 0].sum())
    fixed = (di > 0) & (lam > 0)
    free = (di > 0) & (lam == 0)
    rest = demand - int(di[fixed].sum())
    if rest < 0:
        return None
    S, T, X = N + 1, N + 2, N + 3
    big = max(demand, 1)
    src = np.concatenate([b[diff == 1], a[diff == -1]])
    dst = np.concatenate([a[diff == 1], b[diff == -1]])
    caps = np.full(src.size, big, dtype=np.int64)
    v_fixed = np.flatnonzero(fixed)
    v_free = np.flatnonzero(free)
    v_dem = np.flatnonzero(di < 0)
    rows = np.concatenate([src, np.full(v_fixed.size, S), [S], np.full(v_free.size, X), v_dem])
    cols = np.concatenate([dst, v_fixed, [X], v_free, np.full(v_dem.size, T)])
    vals = np.concatenate([caps, di[v_fixed], [rest], di[v_free], -di[v_dem]])
    keep = rows != cols
    if np.any(vals > _INT32_MAX):
        return None
    cap = sp.csr_matrix(
        (vals[keep].astype(np.int32), (rows[keep], cols[keep])), shape=(N + 4, N + 4)
    )
    res = maximum_flow(cap, S, T)
    if int(res.flow_value) != demand:
        return None
    flow = sp.csr_matrix(res.flow)[: N + 1, : N + 1]
    net_out = np.asarray(flow.sum(axis=1)).ravel()  # the flow matrix is antisymmetric
    z = d - net_out
    if np.any(z < -1e-9) or np.any(z[lam > 0] > 1e-9):
        return None  # pragma: no cover - contradicts the optimality of lam
    return z


def _highs_l1(d: NDArray[np.float64], graph: _Dyadic) -> tuple[NDArray[np.float64], float, str]:
    from scipy.optimize import linprog

    K = graph.incidence.tocsc()
    M = graph.num_edges
    # nu = u_plus - u_minus; minimise sum(u_plus + u_minus) s.t. -K nu <= d
    A_ub = sp.hstack([-K, K], format="csc")
    res = linprog(np.ones(2 * M), A_ub=A_ub, b_ub=d, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"HiGHS failed on the smoothing LP: {res.message}")
    nu = res.x[:M] - res.x[M:]
    return d + K @ nu, float(np.abs(nu).sum()), "highs"
