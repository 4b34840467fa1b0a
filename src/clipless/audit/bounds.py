"""Empirical epsilon lower bounds from a distinguishing test (Clopper-Pearson confidence).

A mechanism ``M`` is ``(epsilon, delta)``-DP only if, for every pair of neighbouring datasets
``D, D'`` and every set ``S`` of outputs, ``P[M(D') in S] <= e^epsilon P[M(D) in S] + delta`` and
the same with ``D, D'`` swapped. An auditor who runs ``M`` many times on ``D`` and on ``D'`` and
applies a test "``S = {score > tau}``" estimates the false positive rate ``FPR = P[M(D) in S]``
and the true positive rate ``TPR = P[M(D') in S]``; with a one-sided Clopper-Pearson upper bound
on ``FPR`` and lower bound on ``TPR``, each at level ``alpha / 2``,

    ``epsilon >= log((TPR_lo - delta) / FPR_hi)``

holds with probability at least ``1 - alpha`` (union bound). This is the audit of Jagielski,
Ullman and Oprea 2020 ("Auditing differentially private machine learning: how private is private
SGD?", section 3) and Nasr, Song, Thakurta, Papernot and Carlini 2021 ("Adversary instantiation:
lower bounds for differentially private machine learning", section 4). The complementary test
``S = {score <= tau}`` with the roles of ``D`` and ``D'`` swapped gives the same kind of bound.

Choosing the threshold and the direction on the same samples that are then used to evaluate them
would bias the bound upwards (the best of many thresholds is an optimistic estimate), so
:func:`epsilon_lower_bound` splits the trials: the first half selects ``(direction, tau)``, the
second half, independent of the choice, gives the reported bound.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats as _stats

__all__ = ["ThresholdTest", "clopper_pearson", "epsilon_lower_bound"]


def _check_level(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha must be a number in (0, 1); got {type(alpha).__name__}")
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must be in (0, 1); got {alpha!r}")
    return float(alpha)


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds ``(lower, upper)`` on a binomial proportion.

    Each bound holds with probability at least ``1 - alpha`` on its own (Clopper and Pearson 1934):
    ``lower = Beta(alpha; k, n - k + 1)`` quantile (0 if ``k = 0``), ``upper = Beta(1 - alpha;
    k + 1, n - k)`` quantile (1 if ``k = n``).

    >>> lo, hi = clopper_pearson(0, 100, 0.05)
    >>> lo, round(hi, 4)
    (0.0, 0.0295)
    """
    for name, value in (("successes", successes), ("trials", trials)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    k, n = int(successes), int(trials)
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need trials >= 1 and 0 <= successes <= trials; got {k} of {n}")
    a = _check_level(alpha)
    lower = 0.0 if k == 0 else float(_stats.beta.ppf(a, k, n - k + 1))
    upper = 1.0 if k == n else float(_stats.beta.ppf(1.0 - a, k + 1, n - k))
    return lower, upper


def _as_scores(values: ArrayLike, name: str) -> NDArray[np.float64]:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size < 2:
        raise ValueError(f"{name} needs at least 2 scores; got {arr.size}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} has non-finite scores")
    return arr


def _bound(pos: int, n_pos: int, neg: int, n_neg: int, delta: float, alpha: float) -> float:
    """``log((TPR_lo - delta) / FPR_hi)`` with one-sided CP bounds at ``alpha / 2`` each."""
    tpr_lo, _ = clopper_pearson(pos, n_pos, alpha / 2.0)
    _, fpr_hi = clopper_pearson(neg, n_neg, alpha / 2.0)
    if tpr_lo - delta <= 0.0:
        return 0.0
    return max(0.0, math.log((tpr_lo - delta) / fpr_hi))


def _bounds(
    pos: NDArray[np.int64],
    n_pos: int,
    neg: NDArray[np.int64],
    n_neg: int,
    delta: float,
    alpha: float,
) -> NDArray[np.float64]:
    """:func:`_bound` for arrays of counts (vectorised Clopper-Pearson quantiles)."""
    a = alpha / 2.0
    k = pos.astype(np.float64)
    tpr_lo = np.where(pos > 0, _stats.beta.ppf(a, np.maximum(k, 1), n_pos - k + 1), 0.0)
    j = neg.astype(np.float64)
    fpr_hi = np.where(neg < n_neg, _stats.beta.ppf(1.0 - a, j + 1, np.maximum(n_neg - j, 1)), 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(np.maximum(tpr_lo - delta, 0.0) / fpr_hi)
    return np.where(np.isfinite(out) & (out > 0), out, 0.0)


@dataclass(frozen=True)
class ThresholdTest:
    """The selected test and its evaluation (:func:`epsilon_lower_bound`).

    ``direction`` names the tail and the dataset the test announces there: ``"above"`` (score
    ``> threshold`` says "``D'``"), ``"below"`` (score ``<= threshold`` says "``D``"), and the same
    two with the datasets' roles ``"swapped"`` (DP bounds both ratios). ``tpr`` and ``fpr`` are
    the empirical rates on the evaluation half, ``tpr_lower`` and ``fpr_upper`` their
    Clopper-Pearson bounds.
    """

    epsilon: float
    delta: float
    confidence: float
    threshold: float
    direction: str
    tpr: float
    fpr: float
    tpr_lower: float
    fpr_upper: float
    evaluation_trials: int


_DIRECTIONS = {
    # name: (tail, which sample is the alternative) -- the test says "alternative" on the tail
    "above": ("upper", "with"),
    "below": ("lower", "without"),
    "above, swapped": ("upper", "without"),
    "below, swapped": ("lower", "with"),
}


def _rates(
    a: NDArray[np.float64], b: NDArray[np.float64], taus: NDArray[np.float64], direction: str
) -> tuple[NDArray[np.int64], int, NDArray[np.int64], int]:
    """Tail counts ``(alternative hits, n_alternative, null hits, n_null)`` per threshold."""
    tail, alternative = _DIRECTIONS[direction]
    alt, null = (b, a) if alternative == "with" else (a, b)

    def hits(x: NDArray[np.float64]) -> NDArray[np.int64]:
        le = np.searchsorted(np.sort(x), taus, side="right").astype(np.int64)
        return (x.size - le) if tail == "upper" else le

    return hits(alt), alt.size, hits(null), null.size


def epsilon_lower_bound(
    scores_without: ArrayLike,
    scores_with: ArrayLike,
    delta: float,
    confidence: float = 0.95,
    *,
    candidates: int = 200,
) -> ThresholdTest:
    """Empirical lower bound on epsilon at ``delta`` from scores of ``M(D)`` and ``M(D')``.

    ``scores_without`` are test statistics of outputs on ``D``, ``scores_with`` on ``D'`` (both
    tails and both roles are tried). The first half of each sample selects
    the direction and the threshold among ``candidates`` quantiles (maximising the same bound);
    the second half evaluates it. The returned ``epsilon`` is a lower bound on the mechanism's
    epsilon at ``delta`` with probability at least ``confidence`` (module docstring).
    """
    a = _as_scores(scores_without, "scores_without")
    b = _as_scores(scores_with, "scores_with")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1); got {delta!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real):
        raise TypeError(f"confidence must be a number in (0, 1); got {confidence!r}")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence must be in (0, 1); got {confidence!r}")
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise ValueError(f"candidates must be an integer >= 1; got {candidates!r}")
    alpha = 1.0 - float(confidence)
    ha, hb = a.size // 2, b.size // 2
    sel_a, ev_a = a[:ha], a[ha:]
    sel_b, ev_b = b[:hb], b[hb:]
    pooled = np.concatenate([sel_a, sel_b])
    taus = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, candidates + 2)[1:-1]))
    best = (-1.0, 0.0, "above")
    for direction in _DIRECTIONS:
        hits, n_hits, false_hits, n_false = _rates(sel_a, sel_b, taus, direction)
        values = _bounds(hits, n_hits, false_hits, n_false, float(delta), alpha)
        i = int(np.argmax(values))
        if values[i] > best[0]:
            best = (float(values[i]), float(taus[i]), direction)
    _, tau, direction = best
    pos_arr, n_pos, neg_arr, n_neg = _rates(ev_a, ev_b, np.array([tau]), direction)
    pos, neg = int(pos_arr[0]), int(neg_arr[0])
    tpr_lo, _ = clopper_pearson(pos, n_pos, alpha / 2.0)
    _, fpr_hi = clopper_pearson(neg, n_neg, alpha / 2.0)
    return ThresholdTest(
        epsilon=_bound(pos, n_pos, neg, n_neg, float(delta), alpha),
        delta=float(delta),
        confidence=float(confidence),
        threshold=float(tau),
        direction=direction,
        tpr=float(pos) / float(n_pos),
        fpr=float(neg) / float(n_neg),
        tpr_lower=tpr_lo,
        fpr_upper=fpr_hi,
        evaluation_trials=min(n_pos, n_neg),
    )
