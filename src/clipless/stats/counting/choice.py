"""Which counting mechanism and which ``k``-ary shape: the ``"auto"`` plan.

:func:`default_mechanism` (``mechanism="auto"``) takes the mechanism with the smallest exact mean
error at the release's ``N``, relation and budget, every candidate scored with the exact variance
of the discrete noise it would draw (:func:`counting_plan`: ``k``, level set and shares; the flat
histogram is ``k = N`` with only the leaves released). Every choice here depends on public values
only (``N``, the relation, the noise kind and the budget), so it costs no privacy.
``docs/statistics.md`` gives the measurements.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from clipless.stats.counting.factorization import _FACT_MAX_N, factorization_score
from clipless.stats.counting.kary import (
    MAX_BRANCHING,
    CountingPlan,
    _check_branching,
    _kappa,
    _level_increments,
    _per_level,
    exact_level_variances,
    kary_depth,
)
from clipless.stats.counting.release import Mechanism
from clipless.stats.noise import discrete_gaussian_variance, to_fraction
from clipless.stats.tree import Neighbouring, NoiseKind, _check_neighbouring, _check_noise


def default_mechanism(
    noise: NoiseKind, num_leaves: int, neighbouring: Neighbouring, budget: float | Fraction
) -> Mechanism:
    """What ``mechanism="auto"`` releases: the mechanism with the smallest exact mean error
    (:func:`_tree_score`; the variance of the discrete noise actually drawn) at this ``N``,
    relation and budget (``epsilon`` for Laplace, ``rho`` for Gaussian). Pure DP: ``"k-ary"``
    with :func:`counting_plan`'s shape (which includes the flat histogram). zCDP: that plan or
    ``"factorization"``, whichever is lower (the factorisation below about ``rho = 1``, the
    flat histogram at large ``rho``). Public.

    Args:
        noise: ``"laplace"`` or ``"gaussian"``.
        num_leaves: the grid size ``N``.
        neighbouring: ``"replace_one"`` or ``"add_remove"``.
        budget: ``epsilon`` (Laplace) or ``rho`` (Gaussian), ``> 0``.
    """
    _check_noise(noise)
    if noise == "laplace" or num_leaves > _FACT_MAX_N:
        return "k-ary"
    tree = counting_plan(num_leaves, neighbouring, noise, budget).score
    fact = factorization_score(num_leaves, neighbouring, to_fraction(budget, "budget"))
    return "factorization" if fact < tree else "k-ary"


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

    Args:
        num_leaves: the grid size ``N``, ``>= 1``.
        neighbouring: ``"replace_one"`` or ``"add_remove"``.
        noise: ``"laplace"`` or ``"gaussian"``.
        budget: ``epsilon`` (Laplace) or ``rho`` (Gaussian), ``> 0``.
        branching: a fixed ``k``, from 2 to
            :data:`~clipless.stats.counting.kary.MAX_BRANCHING` (``None``: the best one).

    Raises:
        ValueError: an unknown relation or noise, ``N < 1``, a budget ``<= 0`` or an invalid
            ``k``.
    """
    _check_neighbouring(neighbouring)
    _check_noise(noise)
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
