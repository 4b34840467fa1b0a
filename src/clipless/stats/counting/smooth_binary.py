r"""The smooth binary mechanism: equal variance at every threshold.

(Andersson, Pagh, "A smooth binary mechanism for efficient private continual observation",
NeurIPS 2023.) A binary tree whose used leaves all have the same number of ones in their label,
so every prefix is the sum of the same number of noisy nodes. Pure DP or zCDP, exact discrete
noise.

**Precondition.** Integer leaf counts on a public grid of ``1 <= N <= 2^22`` leaves; a budget
``epsilon`` (discrete Laplace) or ``rho`` (discrete Gaussian); under ``replace_one`` the size
``n`` is public.

**Claim.** The noisy counts of the node set ``U`` (:func:`_release_smooth_binary`) are
``epsilon``-DP or ``rho``-zCDP under the relation; every prefix estimate is the sum of ``k`` of
them (post-processing), with the same variance at every threshold before conditioning.

**Proof.** (Andersson & Pagh 2023, section 3; here offline, ``N``
public.) Take the ``N + 1`` smallest ``h``-bit labels ``L_0 < ... < L_N`` with exactly ``k``
ones (:func:`smooth_binary_shape` picks ``(h, k)`` with ``binom(h, k) >= N + 1`` minimising
``k (h - k)``, ``k ~ h / 2``). Grid leaf ``i`` sits at tree leaf ``L_i``; the other tree
leaves are empty. Since no grid leaf lies strictly between ``L_(m-1)`` and ``L_m``,
``C_m = #`` values at labels ``< L_m``, and ``[0, L_m)`` is the disjoint union of one dyadic
node per set bit ``j`` of ``L_m``: node ``(j, (L_m >> j) - 1)``, the left sibling of ``L_m``'s
ancestor at level ``j``. So *every* prefix is the sum of exactly ``k`` nodes. The mechanism
releases every node of the union ``U`` of these reads plus i.i.d. noise (also the few nodes of
``U`` that hold no grid leaf: their count is 0 for every data set, the noise keeps every
prefix's distribution identical), and ``Chat_m`` is the sum of its ``k`` noisy nodes:
``Var(Chat_m) = k Var(Z)`` for every ``m``. *Sensitivity.* A value at ``L_a`` is counted by
its ancestors that lie in ``U`` (each by 1, disjoint levels). A node of ``U`` is the left
sibling of a read's ancestor, so only ancestors at a level ``j >= 1`` where ``L_a`` has a 0
can count it: at most ``h - k`` nodes (the leaf itself is never in ``U``: ``L_m - 1`` has
``k - 1`` ones). Add/remove moves ``F(a) = #(ancestors of L_a in U)`` entries by 1: L1 =
squared L2 sensitivity ``max_a F(a) <= h - k``. Replace-one ``a -> b`` moves the ancestors
below the lowest common ancestor of ``L_a, L_b`` (those above cancel): the exact maximum over
all pairs is one bottom-up pass (:func:`smooth_binary_sensitivity`). Discrete Laplace of scale
``b >= Delta / epsilon`` is ``epsilon``-DP; discrete Gaussian of ``sigma^2 >= Delta / (2 rho)``
is ``rho``-zCDP (CKS 2020, Theorem 14); both constants are integers, checked exhaustively
against the node-by-leaf matrix in ``tests/stats/test_smooth_binary.py``. *Error.*
``k Delta / (2 rho) ~ h^2 / (8 rho)`` with ``h ~ log2 N`` (the paper's ``(1 + o(1)) log2(T)^2
/ (8 rho)``): about 4x below the binary tree, but above the square-root factorisation
(``~ (1 + ln(N) / pi)^2 / (2 rho)``), which stays the zCDP default. Its merits are the flat
variance and ``O(log N)`` memory for streams (not used here: ``ContinualCounter`` does not
offer it). Under ``replace_one`` the estimate is conditioned on ``C_N = n`` (post-processing;
``Cov(Chat_m, Chat_N) = Var(Z) #(shared nodes)``, the reads of ``L_m`` and ``L_N`` share node
``(j, .)`` iff both have bit ``j`` set and agree above it), so there the variances are no
longer flat (and lower). No least squares over the redundant nodes is done.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from functools import lru_cache

import numpy as np
from numpy.typing import ArrayLike, NDArray

from clipless import _validate
from clipless.stats.counting.release import (
    CountRelease,
    _condition_on_total,
    _count_release,
    _draw,
    _noise_param,
    _param_variance,
)
from clipless.stats.tree import Neighbouring, NoiseKind, _check_neighbouring

_SMOOTH_MAX_N = 1 << 22


@lru_cache(maxsize=64)
def smooth_binary_shape(num_leaves: int) -> tuple[int, int]:
    """``(h, k)`` of the smooth binary tree for ``N`` leaves: ``binom(h, k) >= N + 1`` labels of
    ``h`` bits with exactly ``k`` ones, chosen to minimise the variance proxy ``k (h - k)``
    (``k`` nodes per prefix, at most ``h - k`` noisy nodes per value; module docstring), ``h``
    searched from the smallest feasible height to 3 more (Andersson & Pagh 2023 take ``k ~
    h / 2`` and a slightly taller tree). Public: depends on ``N`` only.

    >>> smooth_binary_shape(1000), smooth_binary_shape(4096)
    ((13, 5), (15, 6))
    """
    num_leaves = _validate.integer("num_leaves", num_leaves)
    if not 1 <= num_leaves <= _SMOOTH_MAX_N:
        raise ValueError(f"num_leaves must be in 1..2^22, got {num_leaves}")
    need = int(num_leaves) + 1
    h0 = 1
    while math.comb(h0, h0 // 2) < need:
        h0 += 1
    best: tuple[tuple[int, int], int, int] | None = None
    for h in range(h0, h0 + 4):
        for k in range(1, h):
            if math.comb(h, k) >= need:
                key = (k * (h - k), h)
                if best is None or key < best[0]:
                    best = (key, h, k)
    assert best is not None  # h0 is feasible with k = h0 // 2
    return best[1], best[2]


@lru_cache(maxsize=16)
def smooth_binary_labels(num_leaves: int) -> NDArray[np.int64]:
    """The ``N + 1`` smallest ``h``-bit labels with exactly ``k`` ones, increasing
    (:func:`smooth_binary_shape`; Gosper's next-combination step). Leaf ``i`` of the grid
    (``i = 0..N-1``) sits at label ``L_i``; the prefix count ``C_m`` is read at ``L_m``."""
    h, k = smooth_binary_shape(num_leaves)
    out = np.empty(num_leaves + 1, dtype=np.int64)
    v = (1 << k) - 1
    for i in range(num_leaves + 1):
        out[i] = v
        c = v & -v
        r = v + c
        v = (((r ^ v) >> 2) // c) | r
    assert int(out[-1]) < (1 << h)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=16)
def _smooth_read_nodes(
    num_leaves: int,
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """For every read ``m = 1..N`` (label ``t = L_m``) the ``k`` dyadic nodes of ``[0, t)``:
    one per set bit ``j`` of ``t``, node ``(j, (t >> j) - 1)``. Returns ``(rows, levels,
    indices)`` (``rows[r] = m - 1``), ``N k`` entries."""
    h, _ = smooth_binary_shape(num_leaves)
    reads = smooth_binary_labels(num_leaves)[1:]
    rows, levels, idx = [], [], []
    for j in range(h):
        sel = np.flatnonzero((reads >> j) & 1)
        rows.append(sel)
        levels.append(np.full(sel.size, j, dtype=np.int64))
        idx.append((reads[sel] >> j) - 1)
    out = (
        np.concatenate(rows).astype(np.int64),
        np.concatenate(levels),
        np.concatenate(idx).astype(np.int64),
    )
    for a in out:
        a.setflags(write=False)
    return out


@lru_cache(maxsize=16)
def smooth_binary_nodes(num_leaves: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The released node set ``U`` (the union of all reads' nodes), as sorted keys
    ``j * 2^h + p`` for node ``(j, p)`` (level ``j``, index ``p``), and for every read-node
    entry of :func:`_smooth_read_nodes` its position in ``U``."""
    h, _ = smooth_binary_shape(num_leaves)
    _, levels, idx = _smooth_read_nodes(num_leaves)
    keys, inverse = np.unique(levels * (1 << h) + idx, return_inverse=True)
    keys.setflags(write=False)
    inverse = inverse.astype(np.int64)
    inverse.setflags(write=False)
    return keys, inverse


def smooth_binary_node_counts(leaf_counts: ArrayLike) -> NDArray[np.int64]:
    """Exact counts of the released nodes ``U`` (:func:`smooth_binary_nodes`), linear in
    ``leaf_counts`` (negative entries allowed, as the sensitivity test uses): node ``(j, p)``
    counts the grid leaves whose label lies in ``[p 2^j, (p + 1) 2^j)``."""
    arr = np.asarray(leaf_counts, dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("leaf_counts must be a non-empty one-dimensional array")
    N = int(arr.size)
    h, _ = smooth_binary_shape(N)
    keys, _ = smooth_binary_nodes(N)
    labels = smooth_binary_labels(N)[:N]
    cum = np.concatenate([[0], np.cumsum(arr)])
    j = keys >> h
    p = keys & ((1 << h) - 1)
    lo = np.searchsorted(labels, p << j, side="left")
    hi = np.searchsorted(labels, (p + 1) << j, side="left")
    return np.asarray(cum[hi] - cum[lo], dtype=np.int64)


@lru_cache(maxsize=16)
def smooth_binary_sensitivity(num_leaves: int, neighbouring: Neighbouring) -> int:
    """Exact L1 (= squared L2) sensitivity of the released node counts (module docstring).

    One value at leaf ``a`` is counted by its ancestors that lie in ``U``: ``F(a)`` nodes, each
    by 1. Add/remove: ``max_a F(a)``. Replace-one (``a -> b``): the ancestors above the lowest
    common ancestor cancel, so the change is ``F_below(a) + F_below(b)`` nodes, maximised over
    every pair by one bottom-up pass (``G(v)`` = the most ``U``-ancestors from a grid leaf
    under ``v`` up to ``v`` inclusive; a pair meeting at ``v`` moves ``G(left) + G(right)``).
    At least 1 (a replace-one release of ``N = 1`` leaf moves nothing; 1 is a safe bound).
    """
    _check_neighbouring(neighbouring)
    h, _ = smooth_binary_shape(num_leaves)
    keys, _ = smooth_binary_nodes(num_leaves)
    in_u = [np.sort(keys[(keys >> h) == j] & ((1 << h) - 1)) for j in range(h + 1)]

    def member(j: int, p: NDArray[np.int64]) -> NDArray[np.bool_]:
        return np.isin(p, in_u[j])

    idx = np.asarray(smooth_binary_labels(num_leaves)[:num_leaves], dtype=np.int64)
    g = member(0, idx).astype(np.int64)  # G at level 0 (grid leaves only; sorted, unique)
    best_pair = 0
    for j in range(1, h + 1):
        parent = idx >> 1
        starts = np.flatnonzero(np.concatenate([[True], parent[1:] != parent[:-1]]))
        gmax = np.maximum.reduceat(g, starts)
        sizes = np.diff(np.concatenate([starts, [parent.size]]))
        pairs = np.flatnonzero(sizes == 2)  # both children hold grid leaves
        if pairs.size:
            best_pair = max(best_pair, int(np.max(g[starts[pairs]] + g[starts[pairs] + 1])))
        idx = parent[starts]
        g = gmax + member(j, idx).astype(np.int64)
    add = int(np.max(g))
    return max(1, add if neighbouring == "add_remove" else best_pair)


def _shared_with_last(num_leaves: int) -> NDArray[np.float64]:
    """How many nodes the read of every ``C_m`` shares with the read of ``C_N``: ``Cov(Chat_m,
    Chat_N) / Var(Z)``. The reads of ``L_m`` and ``L_N`` share node ``(j, .)`` iff both have bit
    ``j`` set and agree above it."""
    labels = smooth_binary_labels(num_leaves)
    reads, last = labels[1:], int(labels[num_leaves])
    shared = np.zeros(num_leaves)
    for j in range(int(last).bit_length()):
        if (last >> j) & 1:
            shared += ((reads >> j) & 1) * ((reads >> j) == (last >> j))
    return shared


def _release_smooth_binary(
    counts: NDArray[np.int64],
    neighbouring: Neighbouring,
    noise: NoiseKind,
    budget: Fraction,
    gen: random.Random,
    eps_out: float | None,
    rho_out: float | None,
) -> CountRelease:
    """``mechanism="smooth-binary"`` (module docstring): noise on every node of ``U``, each
    prefix the sum of its ``k`` noisy nodes; under replace-one, conditioned on ``C_N = n``."""
    N = int(counts.size)
    _, k = smooth_binary_shape(N)
    delta = smooth_binary_sensitivity(N, neighbouring)
    keys, inverse = smooth_binary_nodes(N)
    param = _noise_param(delta, noise, budget)
    eta = _draw(noise, param, keys.size, gen)
    node_var = _param_variance(param, noise)
    noisy_int = smooth_binary_node_counts(counts) + eta  # the only DP step
    noisy_vec = noisy_int.astype(np.float64)
    rows, _, _ = _smooth_read_nodes(N)
    prefix = np.asarray(np.bincount(rows, weights=noisy_vec[inverse], minlength=N), np.float64)
    variance = np.full(N, k * node_var)
    if neighbouring == "replace_one":
        cov_n = node_var * _shared_with_last(N)
        prefix, variance = _condition_on_total(prefix, variance, cov_n, counts.sum())
    return _count_release(
        "smooth-binary", (prefix, variance, noisy_vec), noise, param, node_var, delta,
        neighbouring, (eps_out, rho_out),
    )  # fmt: skip
