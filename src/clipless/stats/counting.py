r"""Counting mechanisms for all prefix counts, as one choice (``mechanism=``).

Every mechanism here releases, from the integer leaf counts ``c_1..c_N`` of a public grid, an
estimate of every prefix count ``C_i = c_1 + ... + c_i``. The DP part is one noisy vector; the
estimate is post-processing of it. Four mechanisms:

* ``"binary"``: the thesis's binary tree (signed-node release, :mod:`clipless.stats.tree`).
* ``"k-ary"``: the full ``k``-ary tree of counts with least-squares consistency (Hay, Rastogi,
  Miklau, Suciu, PVLDB 2010; Qardaji, Yang, Li, "Understanding hierarchical methods for
  differentially private histograms", PVLDB 2013, who show the branching factor matters and
  that ``k`` near 16 is best for range queries; Honaker, "Efficient use of differentially
  private binary trees", 2015, for the subtraction view). Pure DP or zCDP, exact discrete noise.
* ``"factorization"``: the square-root factorisation of the prefix-sum matrix ``A = L L``
  (Fichtenberger, Henzinger, Upadhyay, ICML 2023; Henzinger, Upadhyay, Upadhyay, SODA 2023),
  exact discrete Gaussian noise on an integer version of the factor, zCDP.
* ``"smooth-binary"``: the smooth binary mechanism (Andersson, Pagh, "A smooth binary
  mechanism for efficient private continual observation", NeurIPS 2023): a binary tree whose
  used leaves all have the same number of ones in their label, so every prefix is the sum of
  the same number of noisy nodes: equal variance at every threshold. Pure DP or zCDP, exact
  discrete noise.

**k-ary tree (proof).** Pad the leaves to ``k^h`` (``h = ceil(log_k N) >= 1``) with empty
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

**Factorisation (proof).** ``A`` (lower-triangular ones, ``N x N``) equals ``L L`` with ``L``
the lower-triangular Toeplitz matrix of ``c_k = binom(2k, k) / 4^k`` (the series of
``(1 - t)^(-1/2)``; ``c_0 = 1``, ``c_k = c_(k-1) (2k - 1) / (2k)``, computed in ``O(N)``). To
keep the noise *exact* (integer query, discrete Gaussian) the mechanism uses the integer
factor ``Lt`` with coefficients ``ct_k = round(2^20 c_k)`` (positive, non-increasing), releases
``w = Lt x + Z`` with ``Z`` i.i.d. discrete Gaussian (Canonne, Kamath, Steinke 2020), and
estimates the prefix counts by ``A Lt^-1 w = A x + A Lt^-1 Z`` (unbiased; ``A Lt^-1`` is
Toeplitz with coefficients ``g ~ c / 2^20``, computed by Newton's iteration on power series;
all products by FFT, ``O(N log N)``). ``Lt x`` is computed exactly in integers
(:func:`exact_convolve`: float FFTs on limbs small enough that a rigorous error bound is below
1/4, then rounded). *Sensitivity.* Changing one leaf count by 1 moves ``Lt x`` by a column of
``Lt``, squared norm at most ``St(N) = sum_(k<N) ct_k^2`` (column 0): the add/remove
sensitivity. Moving a value from leaf ``a`` to ``b = a + d`` moves it by ``Lt (e_b - e_a)``,
squared norm ``f(a, d)``; ``f(a, d) - f(a + 1, d) = (ct_(N-a-1) - ct_(N-a-d-1))^2 >= 0`` (the
only terms that leave the window), so the replace-one sensitivity is ``max_d f(0, d) = max_d
[St(N) + St(N - d) - 2 sum_(j < N-d) ct_j ct_(j+d)]``, all ``d`` at once by an exact integer
autocorrelation. Both are exact integers (tested against brute force). ``Z`` with ``sigma^2 >=
Delta_2^2 / (2 rho)`` (rational, rounded up) is ``rho``-zCDP (CKS 2020, Theorem 14).
*Error.* ``Var(Chat_i) = Var(Z_1) sum_(k <= i) g_k^2 ~ (Delta_2^2 / 2 rho) S(i+1) / 4^20``, i.e.
``S(N) S(i+1) / (2 rho)`` with ``S(m) = sum_(k<m) c_k^2 ~ 1 + ln(m) / pi``: the average is close
to the lower bound for any factorisation (the factorisation norm of ``A`` lies within
``0.701 .. 0.846`` of ``1 + ln(N) / pi``, Henzinger, Kalinin, Upadhyay 2025; Fichtenberger,
Henzinger, Upadhyay 2023). Under ``replace_one`` the public total is used: the estimate is
conditioned on ``C_N = n`` (Gaussian conditioning, post-processing). Pure DP is not offered:
the L1 norm of a column grows like ``sqrt(N)``.

**Smooth binary mechanism (proof).** (Andersson & Pagh 2023, section 3; here offline, ``N``
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

**Which one.** :func:`default_mechanism` (``mechanism="auto"``) takes the mechanism with the
smallest exact mean error at the release's ``N``, relation and budget, every candidate scored
with the exact variance of the discrete noise it would draw (:func:`counting_plan`: ``k``,
level set and shares; the flat histogram is ``k = N`` with only the leaves released).
``docs/statistics.md`` and ``benchmarks/RESULTS.md`` (sections 9, 10 and 33) give the
measurements.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal, Protocol

import numpy as np
import scipy.signal
from numpy.typing import ArrayLike, NDArray

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
from clipless.stats.tree import (
    Neighbouring,
    NoiseKind,
    TreeRelease,
    _check_neighbouring,
    _leaf_counts_array,
    release_counts,
)

__all__ = [
    "MECHANISMS",
    "CountRelease",
    "CountingPlan",
    "Mechanism",
    "NodeNoiseSource",
    "best_branching",
    "counting_plan",
    "default_mechanism",
    "exact_convolve",
    "exact_level_variances",
    "factorization_coefficients",
    "factorization_integer_coefficients",
    "factorization_score",
    "factorization_sensitivity",
    "kary_consistent_leaves",
    "kary_depth",
    "kary_estimate",
    "kary_node_counts",
    "kary_params",
    "kary_prefix_covariance_with_last",
    "kary_prefix_variance",
    "kary_released_nodes",
    "kary_sensitivity",
    "level_shares",
    "release_prefix_counts",
    "smooth_binary_labels",
    "smooth_binary_node_counts",
    "smooth_binary_nodes",
    "smooth_binary_sensitivity",
    "smooth_binary_shape",
]

Mechanism = Literal["auto", "binary", "k-ary", "factorization", "smooth-binary"]


class NodeNoiseSource(Protocol):
    """Keyed node noise (:class:`clipless.federated.NodeNoise`): the exact noise of nodes
    ``(levels[i], index[i])`` at parameter ``param``, the same wherever it is recomputed."""

    def nodes(
        self, kind: NoiseKind, param: Fraction, levels: NDArray[np.int64], index: NDArray[np.int64]
    ) -> NDArray[np.int64]: ...


MECHANISMS: tuple[str, ...] = ("auto", "binary", "k-ary", "factorization", "smooth-binary")

_FACT_MAX_N = 1 << 22


def _check_mechanism(mechanism: str) -> None:
    if mechanism not in MECHANISMS:
        raise ValueError(
            f"mechanism must be one of {', '.join(repr(m) for m in MECHANISMS)}, got {mechanism!r}"
        )


def default_mechanism(
    noise: NoiseKind, num_leaves: int, neighbouring: Neighbouring, budget: float | Fraction
) -> Mechanism:
    """What ``mechanism="auto"`` releases: the mechanism with the smallest exact mean error
    (:func:`_tree_score`; the variance of the discrete noise actually drawn) at this ``N``,
    relation and budget (``epsilon`` for Laplace, ``rho`` for Gaussian). Pure DP: ``"k-ary"``
    with :func:`counting_plan`'s shape (which includes the flat histogram). zCDP: that plan or
    ``"factorization"``, whichever is lower (the factorisation below about ``rho = 1``, the
    flat histogram at large ``rho``; ``benchmarks/RESULTS.md`` section 33). Public."""
    if noise not in ("laplace", "gaussian"):
        raise ValueError(f"noise must be 'laplace' or 'gaussian', got {noise!r}")
    if noise == "laplace" or num_leaves > _FACT_MAX_N:
        return "k-ary"
    tree = counting_plan(num_leaves, neighbouring, noise, budget).score
    fact = factorization_score(num_leaves, neighbouring, to_fraction(budget, "budget"))
    return "factorization" if fact < tree else "k-ary"


# --------------------------------------------------------------------------------------------
# k-ary tree
# --------------------------------------------------------------------------------------------


MAX_BRANCHING = 2**16
"""Largest accepted ``k``: a wider node only pads (the optimum is a few dozen at most)."""


def _check_branching(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"branching must be an int >= 2, got {type(k).__name__}")
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


def kary_prefix_variance(
    num_leaves: int, branching: int, level_variances: list[float]
) -> NDArray[np.float64]:
    """Exact variance of every least-squares prefix estimate ``Chat_1..Chat_N`` (module doc)."""
    k = _check_branching(branching)
    h = len(level_variances) - 1
    if k**h < num_leaves:
        raise ValueError(f"{h} levels of branching {k} hold fewer than {num_leaves} leaves")
    kappa = _kary_kappa(h, k, tuple(float(v) for v in level_variances))
    i = np.arange(1, num_leaves + 1, dtype=np.float64)
    q_prev = i.copy()
    var = kappa[0] * q_prev
    for lev in range(1, h + 1):
        block = float(k**lev)
        q = np.floor(i / block) * block * block + np.mod(i, block) ** 2
        var = var + kappa[lev] * (q - q_prev)
        q_prev = q
    return np.maximum(var, 0.0)


def kary_prefix_covariance_with_last(
    num_leaves: int, branching: int, level_variances: list[float]
) -> NDArray[np.float64]:
    """``Cov(Chat_i, Chat_N)`` for every ``i`` (same ``kappa`` argument as
    :func:`kary_prefix_variance`, with ``R_l(i) = sum_v |P_i cap v| |P_N cap v|`` over the
    level-``l`` nodes: ``floor(i/k^l) k^(2l) + (i mod k^l) min(N - floor(i/k^l) k^l, k^l)``)."""
    k = _check_branching(branching)
    h = len(level_variances) - 1
    kappa = _kary_kappa(h, k, tuple(float(v) for v in level_variances))
    i = np.arange(1, num_leaves + 1, dtype=np.float64)
    r_prev = i.copy()
    cov = kappa[0] * r_prev
    for lev in range(1, h + 1):
        block = float(k**lev)
        j0 = np.floor(i / block)
        r = j0 * block * block + np.mod(i, block) * np.minimum(num_leaves - j0 * block, block)
        cov = cov + kappa[lev] * (r - r_prev)
        r_prev = r
    return cov


def _condition_on_total(
    prefix: NDArray[np.float64],
    variance: NDArray[np.float64],
    cov_last: NDArray[np.float64],
    total: float,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The linear estimate ``prefix`` conditioned on its last entry being ``total`` (public).

    ``Chat_i - Cov(Chat_i, Chat_N) / Var(Chat_N) (Chat_N - n)``, variance
    ``Var(Chat_i) - Cov(Chat_i, Chat_N)^2 / Var(Chat_N)``: the best linear unbiased estimate
    given the extra exact equation (post-processing of the release with a public value).
    """
    n_pub = float(total)
    var_n = float(variance[-1])
    prefix = np.array(prefix, dtype=np.float64)
    variance = np.array(variance, dtype=np.float64)
    if var_n > 0:
        prefix = prefix - cov_last / var_n * (prefix[-1] - n_pub)
        variance = np.maximum(variance - cov_last**2 / var_n, 0.0)
    prefix[-1] = n_pub
    variance[-1] = 0.0
    return prefix, variance


# --------------------------------------------------------------------------------------------
# the choice of tree shape and level budgets, with the exact variance of the noise drawn
# --------------------------------------------------------------------------------------------


def _per_level(neighbouring: Neighbouring) -> int:
    """How much one neighbouring change moves one level (L1 = squared L2): module docstring."""
    return 1 if neighbouring == "add_remove" else 2


def _level_param(share: Fraction, per: int, noise: NoiseKind, budget: Fraction) -> Fraction:
    """The exact noise parameter of a level with budget ``share``: discrete Laplace scale
    ``b >= per / (share epsilon)`` or discrete Gaussian ``sigma^2 >= per / (2 share rho)``."""
    if noise == "laplace":
        return conservative_scale(Fraction(per) / (budget * share))
    return conservative_scale(Fraction(per) / (2 * budget * share))


def _param_variance(param: Fraction, noise: NoiseKind) -> float:
    if noise == "laplace":
        return discrete_laplace_variance(param)
    return discrete_gaussian_variance(param)


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


def _fast_level_variances(
    shares: NDArray[np.float64], neighbouring: Neighbouring, noise: NoiseKind, budget: float
) -> list[float]:
    """:func:`exact_level_variances` in floats for the optimiser (the same formulas; the
    discrete Gaussian's variance equals ``sigma^2`` to float precision once ``sigma^2 > 64``)."""
    per = float(_per_level(neighbouring))
    out = []
    for w in shares.tolist():
        if w <= 0.0:
            out.append(math.inf)
        elif noise == "laplace":
            x = budget * w / per  # 1 / b
            out.append(math.inf if x < 1e-150 else 2.0 * math.exp(-x) / math.expm1(-x) ** 2)
        else:
            s2 = per / (2.0 * budget * w)
            out.append(s2 if s2 > 64.0 else discrete_gaussian_variance(s2))
    if neighbouring == "replace_one":
        out.append(0.0)
    return out


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


_CHUNK = 1 << 16


@lru_cache(maxsize=256)
def _score_forms(
    num_leaves: int, k: int, neighbouring: Neighbouring
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """The error score of the ``k``-ary release as forms in ``kappa`` (:func:`_kary_kappa`):
    add/remove, the linear ``a . kappa``; replace-one, ``a . kappa - kappa^T M kappa /
    (q_N . kappa)`` (:func:`_tree_score`). Accumulated over chunks of thresholds (memory
    ``O(h * 2^16)`` for any ``N``)."""
    h = kary_depth(num_leaves, k)
    n = float(num_leaves)
    a = np.zeros(h + 1)
    m = np.zeros((h + 1, h + 1))
    last = np.array([n])
    q_last = _level_increments(last, num_leaves, k, h, q=True)[:, 0]
    for start in range(1, num_leaves + 1, _CHUNK):
        i = np.arange(start, min(start + _CHUNK, num_leaves + 1), dtype=np.float64)
        dq = _level_increments(i, num_leaves, k, h, q=True)
        dr = _level_increments(i, num_leaves, k, h, q=False)
        a += dq.sum(axis=1)
        if neighbouring == "add_remove":
            f = i / n
            a += -2.0 * (dr * f).sum(axis=1) + float(np.sum(f * f)) * q_last
        else:
            m += dr @ dr.T
    return a / n, q_last, m / n


def _tree_score(
    num_leaves: int, k: int, neighbouring: Neighbouring, level_var: list[float]
) -> float:
    """The exact mean error score (counts^2) of the ``k``-ary release with noise variances
    ``level_var``: under replace-one the mean variance of the prefix counts conditioned on
    ``C_N = n`` (what is released); under add/remove, where the CDF is normalised by the
    released ``Chat_N``, the mean variance of ``Chat_i - (i/N) Chat_N`` (the first-order
    error of ``N Chat_i / Chat_N`` for uniform data), which penalises trees padded far beyond
    ``N``."""
    h = len(level_var) - 1
    exact_root = neighbouring == "replace_one"
    # a variance that underflows to 0 (huge budget) is kept positive: only the public root is
    # known exactly, and the score is then ~0 for every shape anyway
    lv = tuple(v if exact_root and i == h else max(v, 1e-250) for i, v in enumerate(level_var))
    kappa = _kappa(h, k, lv)
    a, q_last, m = _score_forms(num_leaves, k, neighbouring)
    score = float(a @ kappa)
    if neighbouring == "replace_one":
        var_n = float(q_last @ kappa)
        if var_n > 1e-9 * num_leaves * abs(float(kappa[0])):  # else C_N is exact (rounding)
            score -= float(kappa @ m @ kappa) / var_n
    return max(score, 0.0)


def _geometric(levels: tuple[int, ...], m: int, log_r: float) -> NDArray[np.float64]:
    w = np.zeros(m)
    lv = np.asarray(levels)
    w[lv] = np.exp(log_r * (lv - lv.max()))
    return w / w.sum()


_SHARE_GRID = 1 << 10


def _round_shares(w: NDArray[np.float64]) -> tuple[Fraction, ...]:
    """Multiples of ``1/1024`` summing to exactly 1; a level with a positive share keeps at
    least one unit (its released / not-released status is kept)."""
    units = np.floor(w * _SHARE_GRID).astype(int)
    units[(w > 0) & (units == 0)] = 1
    units[int(np.argmax(units))] += _SHARE_GRID - int(units.sum())
    return tuple(Fraction(int(u), _SHARE_GRID) for u in units)


@dataclass(frozen=True)
class CountingPlan:
    """A public choice of the ``k``-ary release: branching ``k``, the budget share of each
    noisy level (``0``: not released) and its exact mean error score (counts^2,
    :func:`_tree_score`) at the budget it was chosen for."""

    branching: int
    shares: tuple[Fraction, ...]
    score: float


def _plan_for(
    num_leaves: int, k: int, neighbouring: Neighbouring, noise: NoiseKind, budget: Fraction
) -> CountingPlan:
    """The best level set and shares for one ``k``, at the exact variances of the noise drawn.

    Candidates: uniform shares over all noisy levels (OpenDP's b-ary tree), and "geometric
    shares ``r^l`` over a level set", the level set found by backward elimination from all
    levels (each round drops the non-leaf level whose removal, with ``r`` re-optimised, lowers
    the score most; the leaves are always released). The flat histogram is the level set
    ``{0}``. Each candidate is scored at its rounded shares with the exact parameters.
    """
    import scipy.optimize

    h = kary_depth(num_leaves, k)
    m = h + 1 if neighbouring == "add_remove" else h
    b = float(budget)

    def fit(levels: tuple[int, ...]) -> tuple[float, NDArray[np.float64]]:
        def obj(log_r: float) -> float:
            lv = _fast_level_variances(_geometric(levels, m, log_r), neighbouring, noise, b)
            return _tree_score(num_leaves, k, neighbouring, lv)

        if len(levels) == 1:
            return obj(0.0), _geometric(levels, m, 0.0)
        res = scipy.optimize.minimize_scalar(
            obj, bounds=(-4.0, 4.0), method="bounded", options={"xatol": 1e-3}
        )
        return float(res.fun), _geometric(levels, m, float(res.x))

    levels = tuple(range(m))
    cur_score, cur_w = fit(levels)
    found = [cur_w, np.full(m, 1.0 / m), _geometric((0,), m, 0.0)]
    while len(levels) > 1:
        trials = [(*fit(tuple(x for x in levels if x != drop)), drop) for drop in levels[1:]]
        score, w, drop = min(trials, key=lambda t: t[0])
        if score >= cur_score:
            break
        levels = tuple(x for x in levels if x != drop)
        cur_score, cur_w = score, w
        found.append(w)
    best: CountingPlan | None = None
    for w in found:
        shares = _round_shares(w)
        lv = exact_level_variances(shares, neighbouring, noise, budget)
        score = _tree_score(num_leaves, k, neighbouring, lv)
        if best is None or score < best.score:
            best = CountingPlan(k, shares, score)
    assert best is not None
    return best


_BRANCHINGS = (2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32)


def _branching_candidates(num_leaves: int) -> list[int]:
    """``2..32`` and, for ``h = 1, 2, 3``, the smallest ``k`` with ``k^h >= N`` (no padding;
    ``h = 1`` is the flat histogram)."""
    out = set(_BRANCHINGS)
    for h in (1, 2, 3):
        k = max(2, math.ceil(num_leaves ** (1.0 / h) - 1e-9))
        while k > 2 and (k - 1) ** h >= num_leaves:
            k -= 1
        while k**h < num_leaves:
            k += 1
        if k <= MAX_BRANCHING:
            out.add(k)
    return sorted(out)


@lru_cache(maxsize=256)
def _counting_plan(
    num_leaves: int, neighbouring: Neighbouring, noise: NoiseKind, budget: Fraction
) -> CountingPlan:
    plans = [
        _plan_for(num_leaves, k, neighbouring, noise, budget)
        for k in _branching_candidates(num_leaves)
    ]
    best = min(plans, key=lambda p: (p.score, p.branching))
    if 2 <= num_leaves <= MAX_BRANCHING:
        # the flat histogram (k = N, no padding) on a tie: e.g. when best is the flat level set
        # on a padded tree, or when the noise is so small that every score is ~0 (then its
        # integer cumulative sums are exact where a tree's least squares rounds)
        flat = _plan_for(num_leaves, num_leaves, neighbouring, noise, budget)
        best = flat if flat.score <= best.score * (1 + 1e-9) + 1e-9 else best
    return best


def counting_plan(
    num_leaves: int,
    neighbouring: Neighbouring,
    noise: NoiseKind,
    budget: float | Fraction,
    branching: int | None = None,
) -> CountingPlan:
    """The ``k``-ary release with the smallest exact mean error (:func:`_tree_score`) at this
    budget (``epsilon`` for Laplace, ``rho`` for Gaussian): over ``k`` in
    :func:`_branching_candidates` (``k = N`` is the flat histogram) and, per ``k``, over level
    sets and shares (:func:`_plan_for`), every candidate scored with the exact variance of the
    discrete noise it would draw. Given ``branching``, only the levels and shares are chosen.
    Public: depends on ``N``, the relation, the noise kind and the budget only.
    """
    _check_neighbouring(neighbouring)
    if noise not in ("laplace", "gaussian"):
        raise ValueError(f"noise must be 'laplace' or 'gaussian', got {noise!r}")
    if num_leaves < 1:
        raise ValueError(f"num_leaves must be >= 1, got {num_leaves}")
    frac = to_fraction(budget, "budget")
    if branching is not None:
        return _plan_for(num_leaves, _check_branching(branching), neighbouring, noise, frac)
    return _counting_plan(int(num_leaves), neighbouring, noise, frac)


def level_shares(
    num_leaves: int,
    branching: int,
    neighbouring: Neighbouring,
    noise: NoiseKind,
    budget: float | Fraction,
) -> tuple[Fraction, ...]:
    """Budget fraction of each noisy level (``0..h``, or ``0..h-1`` under replace-one), summing
    to exactly 1; share 0 = the level is not released (:func:`counting_plan` with ``k`` given).

    A data-independent, public choice ("non-uniform budget allocation", Cormode, Procopiuc,
    Srivastava, Shen, Yu, ICDE 2012; Qardaji, Yang, Li, PVLDB 2013), optimised for the exact
    error of the discrete noise drawn at this ``budget`` (``epsilon`` or ``rho``).
    """
    return counting_plan(num_leaves, neighbouring, noise, budget, branching).shares


def best_branching(
    num_leaves: int, neighbouring: Neighbouring, noise: NoiseKind, budget: float | Fraction
) -> int:
    """The ``k`` of :func:`counting_plan`: ``2..32`` or a padding-free ``k`` for 1, 2 or 3
    levels (``k = N``: the flat histogram), whichever has the smallest exact error at this
    budget with its own level set and shares."""
    return counting_plan(num_leaves, neighbouring, noise, budget).branching


# --------------------------------------------------------------------------------------------
# factorisation
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def factorization_coefficients(num_leaves: int) -> NDArray[np.float64]:
    """``c_k = binom(2k, k) / 4^k``, ``k < N``, by the recurrence ``c_k = c_(k-1)(2k-1)/(2k)``.

    >>> factorization_coefficients(4).tolist()
    [1.0, 0.5, 0.375, 0.3125]
    """
    if num_leaves < 1:
        raise ValueError(f"num_leaves must be >= 1, got {num_leaves}")
    k = np.arange(1, num_leaves, dtype=np.float64)
    ratios = (2.0 * k - 1.0) / (2.0 * k)
    out = np.concatenate([[1.0], np.cumprod(ratios)])
    out.setflags(write=False)
    return out


_FFT_K = 21  # Higham (2002), Theorem 24.2: each FFT errs by <= log2(M) * ~7u (relative, 2-norm)


def _fft_error_bound(m: int, a_l1: float, b_l2: float) -> float:
    """Upper bound on ``|fl(a * b) - a * b|_inf`` for the FFT convolution of length ``m``.

    Three FFTs of length ``M = 2^ceil(log2 m)`` (forward, forward, inverse) each with relative
    2-norm error ``<= log2(M) eta``, ``eta ~ 7u`` (Higham, "Accuracy and Stability of Numerical
    Algorithms", 2nd ed., section 24.1, Theorem 24.2), on vectors whose exact product has 2-norm
    ``<= ||a||_1 ||b||_2``; ``_FFT_K log2(M) + 2`` units cover the three transforms, the
    pointwise product and its rounding with a factor ~3 to spare. Used with a further factor 2
    below (``0.25`` instead of ``0.5``).
    """
    log_m = max(1, (m - 1).bit_length())
    return (_FFT_K * log_m + 2) * 2.0**-53 * a_l1 * b_l2


def _limbs(a: NDArray[np.int64], bits: int) -> list[NDArray[np.int64]]:
    out = []
    rest = a.copy()
    mask = (1 << bits) - 1
    while np.any(rest):
        out.append(rest & mask)
        rest = rest >> bits
    return out or [np.zeros_like(a)]


def exact_convolve(a: ArrayLike, b: ArrayLike, size: int) -> NDArray[np.int64]:
    """The first ``size`` entries of the convolution of two non-negative int64 vectors, exactly.

    Small inputs: :func:`numpy.convolve` (integer arithmetic). Large ones: both vectors are cut
    into ``bits``-bit limbs so small that every limb product's FFT error bound
    (:func:`_fft_error_bound`) is below ``1/4``; each limb product is then the rounding of its
    float FFT convolution, exactly, and the limbs recombine in int64. The result must fit in
    int64: ``max(a) * sum(b) < 2^62`` is checked. ``O(N log N)`` per limb pair.
    """
    x = np.asarray(a, dtype=np.int64)
    y = np.asarray(b, dtype=np.int64)
    if np.any(x < 0) or np.any(y < 0):
        raise ValueError("exact_convolve needs non-negative integers")
    if (
        float(x.max(initial=0)) * float(y.sum()) >= 2.0**62
        or float(y.max(initial=0)) * float(x.sum()) >= 2.0**62
    ):
        raise OverflowError("the convolution does not fit in int64")
    if x.size * y.size <= 1 << 22:
        return np.convolve(x, y)[:size].astype(np.int64)
    m = x.size + y.size - 1
    bits = 31
    while bits > 1:
        xl, yl = _limbs(x, bits), _limbs(y, bits)
        worst = max(
            min(
                _fft_error_bound(
                    m, float(p.sum()), float(np.sqrt(np.sum(q.astype(np.float64) ** 2)))
                ),
                _fft_error_bound(
                    m, float(q.sum()), float(np.sqrt(np.sum(p.astype(np.float64) ** 2)))
                ),
            )
            for p in xl
            for q in yl
        )
        if worst < 0.25:
            break
        bits -= 1
    else:  # pragma: no cover - only for astronomically large inputs
        return np.convolve(x, y)[:size].astype(np.int64)
    out = np.zeros(size, dtype=np.int64)
    for i, p in enumerate(xl):
        for j, q in enumerate(yl):
            if not (np.any(p) and np.any(q)):
                continue
            f = scipy.signal.fftconvolve(p.astype(np.float64), q.astype(np.float64))[:size]
            r = np.rint(f)
            if np.max(np.abs(f - r), initial=0.0) >= 0.25:  # pragma: no cover - contradicts bound
                raise ArithmeticError("FFT error above its certified bound")
            out += r.astype(np.int64) << (bits * (i + j))
    return out


_FACT_BITS = 20


@lru_cache(maxsize=16)
def factorization_integer_coefficients(num_leaves: int) -> NDArray[np.int64]:
    """``ct_k = round(2^20 c_k)``: the integer Toeplitz factor actually used (module doc).

    Positive and non-increasing (rounding is monotone and ``c`` decreases), which the
    replace-one sensitivity argument needs; checked here.
    """
    if num_leaves > _FACT_MAX_N:
        raise ValueError(f"the factorisation is implemented for N <= 2^22, got {num_leaves}")
    c = factorization_coefficients(num_leaves)
    out = np.rint(c * float(1 << _FACT_BITS)).astype(np.int64)
    if out[-1] < 1 or np.any(np.diff(out) > 0):  # pragma: no cover - impossible for N <= 2^22
        raise AssertionError("integer factor coefficients must be positive, non-increasing")
    out.setflags(write=False)
    return out


@lru_cache(maxsize=16)
def factorization_sensitivity(num_leaves: int, neighbouring: Neighbouring) -> int:
    """Squared L2 sensitivity of ``Lt x`` (``Lt``: lower-triangular Toeplitz of
    :func:`factorization_integer_coefficients`): an exact integer for add/remove (``St(N) =
    sum_k ct_k^2``) and for replace-one (``max_d [St(N) + St(N-d) - 2 sum_j ct_j ct_(j+d)]``,
    module docstring; the autocorrelation by :func:`exact_convolve`)."""
    _check_neighbouring(neighbouring)
    ct = factorization_integer_coefficients(num_leaves)
    sq = ct * ct  # <= 2^40 each; N <= 2^22 keeps every sum below 2^62
    cums = np.concatenate([[0], np.cumsum(sq)])
    total = int(cums[-1])
    if neighbouring == "add_remove" or num_leaves == 1:
        return total
    n = num_leaves
    auto = exact_convolve(ct, ct[::-1], 2 * n - 1)[n - 1 :]  # auto[d] = sum_j ct_j ct_(j+d)
    d = np.arange(1, n)
    f = total + cums[n - d] - 2 * auto[d]
    return int(np.max(f))


def _lower_toeplitz_apply(c: NDArray[np.float64], x: NDArray[np.float64]) -> NDArray[np.float64]:
    return np.asarray(scipy.signal.fftconvolve(c, x)[: x.size], dtype=np.float64)


@lru_cache(maxsize=16)
def _estimator_coefficients(num_leaves: int) -> NDArray[np.float64]:
    """``g``: the Toeplitz coefficients of ``A Lt^-1`` (the series of ``1 / ((1 - t) Ct(t))``),
    by Newton's iteration ``g <- g (2 - h g)`` with FFT products, ``O(N log N)``; float64
    (post-processing only). ``g ~ c / 2^20``."""
    ct = factorization_integer_coefficients(num_leaves).astype(np.float64)
    h = np.concatenate([[ct[0]], np.diff(ct)])  # (1 - t) Ct(t)
    g = np.array([1.0 / h[0]])
    m = 1
    while m < num_leaves:
        m = min(2 * m, num_leaves)
        hg = scipy.signal.fftconvolve(h[:m], g)[:m]
        corr = -hg
        corr[0] += 2.0
        g = scipy.signal.fftconvolve(g, corr)[:m]
    g.setflags(write=False)
    return g


def _factorization_moments(
    num_leaves: int, neighbouring: Neighbouring, node_var: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``Var(Chat_i)`` and ``Cov(Chat_i, Chat_N)`` of the factorisation's estimate, before any
    conditioning, for noise variance ``node_var``."""
    g = _estimator_coefficients(num_leaves)
    variance = node_var * np.cumsum(g * g)
    cov_n = node_var * scipy.signal.fftconvolve(g, g[::-1])[:num_leaves]
    return variance, cov_n


@lru_cache(maxsize=64)
def factorization_score(num_leaves: int, neighbouring: Neighbouring, rho: Fraction) -> float:
    """The factorisation's exact mean error score at ``rho`` (the same score as
    :func:`_tree_score`: conditioned on ``C_N = n`` under replace-one, ``Chat_i - (i/N)
    Chat_N`` under add/remove), with the discrete Gaussian's exact variance."""
    sigma2 = conservative_scale(
        Fraction(factorization_sensitivity(num_leaves, neighbouring)) / (2 * rho)
    )
    var, cov = _factorization_moments(num_leaves, neighbouring, discrete_gaussian_variance(sigma2))
    if neighbouring == "replace_one":
        return float(np.mean(_condition_on_total(np.zeros(num_leaves), var, cov, 0.0)[1]))
    f = np.arange(1, num_leaves + 1, dtype=np.float64) / num_leaves
    return float(np.mean(var - 2 * f * cov + f * f * var[-1]))


# --------------------------------------------------------------------------------------------
# smooth binary mechanism
# --------------------------------------------------------------------------------------------

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
    if isinstance(num_leaves, bool) or not isinstance(num_leaves, (int, np.integer)):
        raise TypeError(f"num_leaves must be an int >= 1, got {type(num_leaves).__name__}")
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


# --------------------------------------------------------------------------------------------
# the common release
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CountRelease:
    """Output of :func:`release_prefix_counts` for ``"k-ary"``, ``"factorization"`` and
    ``"smooth-binary"``.

    Attributes
    ----------
    mechanism:
        ``"k-ary"`` or ``"factorization"``.
    num_leaves:
        ``N``.
    prefix_counts:
        The (least-squares / factorised) estimates of the ``N`` prefix counts, float64.
    variance:
        Exact per-threshold variance of :attr:`prefix_counts` (given the noise parameters).
    noisy:
        The DP vector itself (node values for ``k``-ary, concatenated by level; ``L x + z`` for
        the factorisation).
    noise, noise_param, noise_scale, node_variance:
        ``"laplace"``/``"gaussian"``; exact scale ``b`` or ``sigma^2`` (``k``-ary: one per
        level, ``None`` for a level that is not released); ``b`` or ``sigma`` (of the leaves);
        variance of one noise draw (of the leaves).
    sensitivity:
        L1 sensitivity (Laplace) or squared L2 sensitivity (Gaussian) of the noisy vector
        (``k``-ary: the most nodes one change moves, over the released levels: ``per`` times
        their number, ``per = 1`` add/remove, ``2`` replace-one).
    shares:
        ``k``-ary: the budget fraction of each noisy level (:func:`level_shares`).
    branching:
        ``k`` (``None`` for the factorisation).
    neighbouring, epsilon, rho:
        The guarantee.
    """

    mechanism: str
    num_leaves: int
    prefix_counts: NDArray[np.float64] = field(repr=False)
    variance: NDArray[np.float64] = field(repr=False)
    noisy: NDArray[np.float64] = field(repr=False)
    noise: NoiseKind
    noise_param: Fraction | float | tuple[Fraction | None, ...]
    noise_scale: float
    node_variance: float
    sensitivity: float
    branching: int | None
    neighbouring: Neighbouring
    epsilon: float | None
    rho: float | None
    shares: tuple[Fraction, ...] | None = None

    @property
    def depth(self) -> int:
        """Binary depth ``ceil(log2 N)`` (used by the thesis's l1/l2 smoothing graph)."""
        return tree_depth(self.num_leaves)


def _budget(
    noise: str, epsilon: float | None, rho: float | None
) -> tuple[Fraction, float | None, float | None]:
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


def release_prefix_counts(
    leaf_counts: ArrayLike,
    epsilon: float | None,
    neighbouring: Neighbouring = "replace_one",
    noise: NoiseKind = "laplace",
    rng: random.Random | None = None,
    rho: float | None = None,
    *,
    mechanism: Mechanism = "auto",
    branching: int | None = None,
    node_noise: Any = None,
) -> TreeRelease | CountRelease:
    """Release every prefix count of ``leaf_counts`` with the chosen counting ``mechanism``.

    ``"auto"`` (the default) is :func:`default_mechanism`: the mechanism with the smallest
    exact error at this ``N``, relation and budget (``"k-ary"`` with :func:`counting_plan`'s
    shape under pure DP, the flat histogram included; that or ``"factorization"`` for zCDP).
    ``"binary"`` returns :func:`~clipless.stats.tree.release_counts`'s :class:`TreeRelease`;
    ``"k-ary"``, ``"factorization"`` and ``"smooth-binary"`` (equal variance at every
    threshold, Laplace or Gaussian) return a :class:`CountRelease` (module docstring for the
    proofs). ``branching`` (``k``, ``"k-ary"`` only) defaults to the ``k`` of
    :func:`counting_plan` (the levels and shares are chosen for the budget either way).
    Under ``replace_one`` the size ``n = sum(leaf_counts)`` is public and used exactly.

    ``node_noise`` (``"binary"`` and ``"k-ary"``): a keyed node-noise source
    (:class:`clipless.federated.NodeNoise`, or ``SummedNoise`` whose ``copies`` multiply the
    variances) replacing the draw from ``rng``; node ``(l, j)`` of the released tree gets its
    noise at level ``l``'s parameter. The federated release with the same source is equal bit
    for bit.
    """
    _check_mechanism(mechanism)
    _check_neighbouring(neighbouring)
    if mechanism == "binary":
        if branching is not None:
            raise ValueError("branching is only for mechanism='k-ary'")
        return release_counts(
            leaf_counts, epsilon, neighbouring, noise, rng, rho, node_noise=node_noise
        )
    counts = _leaf_counts_array(leaf_counts)
    budget, eps_out, rho_out = _budget(noise, epsilon, rho)
    gen = resolve_rng(rng)
    N = int(counts.size)
    if mechanism == "auto":  # with a branching given, the k-ary tree with that k
        mechanism = (
            "k-ary" if branching is not None else default_mechanism(noise, N, neighbouring, budget)
        )
    if mechanism == "k-ary":
        plan = counting_plan(N, neighbouring, noise, budget, branching)
        return _release_kary(
            counts, plan, neighbouring, noise, budget, gen, eps_out, rho_out, node_noise
        )
    if node_noise is not None:
        raise ValueError(
            f"node_noise is for mechanism 'binary' or 'k-ary' (the federated releases), got "
            f"{mechanism!r}"
        )
    if mechanism == "smooth-binary":
        if branching is not None:
            raise ValueError("branching is only for mechanism='k-ary'")
        return _release_smooth_binary(counts, neighbouring, noise, budget, gen, eps_out, rho_out)
    # factorisation
    if branching is not None:
        raise ValueError("branching is only for mechanism='k-ary'")
    if noise != "gaussian":
        raise ValueError(
            "mechanism='factorization' needs noise='gaussian' (zCDP): its L1 sensitivity grows "
            "like sqrt(N), so under pure DP use 'k-ary'"
        )
    sens2 = factorization_sensitivity(N, neighbouring)
    sigma2 = conservative_scale(Fraction(sens2) / (2 * budget))
    ct = factorization_integer_coefficients(N)
    if float(counts.sum()) * float(ct[0]) >= 2.0**61:
        raise ValueError("too many values for the factorisation's int64 arithmetic (n < 2^41)")
    z = discrete_gaussian(None, N, gen, sigma2=sigma2)
    noisy_int = exact_convolve(ct, counts, N) + z  # Lt x + Z: the only DP step
    noisy_vec = noisy_int.astype(np.float64)
    g = _estimator_coefficients(N)
    prefix = _lower_toeplitz_apply(g, noisy_vec)  # A Lt^-1 (Lt x + Z) = A x + A Lt^-1 Z
    node_var = discrete_gaussian_variance(sigma2)
    variance, cov_n = _factorization_moments(N, neighbouring, node_var)
    if neighbouring == "replace_one":
        # condition on C_N = n (public): Cov(Chat_i, Chat_N) = var sum_j g_(i-j) g_(N-1-j)
        prefix, variance = _condition_on_total(prefix, variance, cov_n, counts.sum())
    for a in (prefix, variance, noisy_vec):
        a.setflags(write=False)
    return CountRelease(
        mechanism="factorization",
        num_leaves=N,
        prefix_counts=prefix,
        variance=variance,
        noisy=noisy_vec,
        noise="gaussian",
        noise_param=sigma2,
        noise_scale=float(sigma2) ** 0.5,
        node_variance=node_var,
        sensitivity=float(sens2),
        branching=None,
        neighbouring=neighbouring,
        epsilon=None,
        rho=rho_out,
    )


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
        elif noise == "laplace":
            eta = discrete_laplace(param, size, gen)
        else:
            eta = discrete_gaussian(None, size, gen, sigma2=param)
        noisy.append(true_nodes[level] + eta)
    copies = 1 if node_noise is None else int(getattr(node_noise, "copies", 1))
    return kary_estimate(
        np.concatenate(noisy), N, plan, neighbouring, noise, budget, int(counts.sum()),
        eps_out, rho_out, copies,
    )  # fmt: skip


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
    noisy_vec = vec.astype(np.float64)
    for a in (prefix, variance, noisy_vec):
        a.setflags(write=False)
    leaf_param = params[0]
    assert leaf_param is not None  # the leaves always get a share
    return CountRelease(
        mechanism="k-ary",
        num_leaves=N,
        prefix_counts=prefix,
        variance=variance,
        noisy=noisy_vec,
        noise=noise,
        noise_param=params,
        noise_scale=float(leaf_param) if noise == "laplace" else float(leaf_param) ** 0.5,
        node_variance=level_var[0],
        sensitivity=float(_per_level(neighbouring) * sum(1 for p in params if p is not None)),
        branching=k,
        neighbouring=neighbouring,
        epsilon=epsilon,
        rho=rho,
        shares=shares,
    )


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
    param: Fraction
    if noise == "laplace":
        param = conservative_scale(Fraction(delta) / budget)
        eta = discrete_laplace(param, keys.size, gen)
        node_var = discrete_laplace_variance(param)
    else:
        param = conservative_scale(Fraction(delta) / (2 * budget))
        eta = discrete_gaussian(None, keys.size, gen, sigma2=param)
        node_var = discrete_gaussian_variance(param)
    noisy_int = smooth_binary_node_counts(counts) + eta  # the only DP step
    noisy_vec = noisy_int.astype(np.float64)
    rows, _, _ = _smooth_read_nodes(N)
    prefix = np.asarray(np.bincount(rows, weights=noisy_vec[inverse], minlength=N), np.float64)
    variance = np.full(N, k * node_var)
    if neighbouring == "replace_one":
        # condition on C_N = n (public): Cov(Chat_m, Chat_N) = node_var * #(shared nodes); the
        # reads of L_m and L_N share node (j, .) iff both have bit j set and agree above it
        labels = smooth_binary_labels(N)
        reads, last = labels[1:], int(labels[N])
        shared = np.zeros(N)
        for j in range(int(last).bit_length()):
            if (last >> j) & 1:
                shared += ((reads >> j) & 1) * ((reads >> j) == (last >> j))
        cov_n = node_var * shared
        var_n = float(variance[-1])
        n_pub = float(counts.sum())
        if var_n > 0:
            prefix = prefix - cov_n / var_n * (prefix[-1] - n_pub)
            variance = np.maximum(variance - cov_n**2 / var_n, 0.0)
        prefix[-1] = n_pub
        variance[-1] = 0.0
    for a in (prefix, variance, noisy_vec):
        a.setflags(write=False)
    return CountRelease(
        mechanism="smooth-binary",
        num_leaves=N,
        prefix_counts=prefix,
        variance=variance,
        noisy=noisy_vec,
        noise=noise,
        noise_param=param,
        noise_scale=float(param) if noise == "laplace" else float(param) ** 0.5,
        node_variance=node_var,
        sensitivity=float(delta),
        branching=None,
        neighbouring=neighbouring,
        epsilon=eps_out,
        rho=rho_out,
    )
