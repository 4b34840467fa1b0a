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
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats as _stats

from clipless import _validate

__all__ = [
    "GaussianFit",
    "ThresholdTest",
    "clopper_pearson",
    "epsilon_lower_bound",
    "gaussian_dp_delta",
    "gaussian_dp_epsilon",
    "gaussian_epsilon_lower_bound",
]


def _check_level(alpha: float) -> float:
    return _validate.probability("alpha", alpha, open_low=True, open_high=True)


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds ``(lower, upper)`` on a binomial proportion.

    Each bound holds with probability at least ``1 - alpha`` on its own (Clopper and Pearson 1934):
    ``lower = Beta(alpha; k, n - k + 1)`` quantile (0 if ``k = 0``), ``upper = Beta(1 - alpha;
    k + 1, n - k)`` quantile (1 if ``k = n``).

    >>> lo, hi = clopper_pearson(0, 100, 0.05)
    >>> lo, round(hi, 4)
    (0.0, 0.0295)
    """
    k, n = _validate.integer("successes", successes), _validate.integer("trials", trials)
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
    _validate.probability("delta", delta, open_high=True, wrong_type=ValueError)
    _validate.probability("confidence", confidence, open_low=True, open_high=True)
    _validate.positive_int("candidates", candidates, wrong_type=ValueError)
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


# --------------------------------------------------------------------------------------------
# Gaussian-DP fit (the step's releases are Gaussian): more power than one threshold
# --------------------------------------------------------------------------------------------


def gaussian_dp_delta(epsilon: float, mu: float) -> float:
    """The privacy profile of ``mu``-Gaussian DP: ``delta(epsilon) = Phi(-epsilon/mu + mu/2) -
    e^epsilon Phi(-epsilon/mu - mu/2)`` (Balle and Wang 2018, Theorem 8; Dong, Roth and Su
    2022, Corollary 2.13): the smallest ``delta`` for which ``N(0, 1)`` against ``N(mu, 1)`` is
    ``(epsilon, delta)``-indistinguishable. Computed in log space (large ``mu`` and
    ``epsilon``).

    >>> round(gaussian_dp_delta(0.0, 1.0), 6)  # Phi(1/2) - Phi(-1/2)
    0.382925
    """
    from scipy.special import log_ndtr

    if mu <= 0.0:
        return 0.0
    a = float(log_ndtr(-epsilon / mu + mu / 2.0))
    b = epsilon + float(log_ndtr(-epsilon / mu - mu / 2.0))
    return 0.0 if b >= a else math.exp(a) * -math.expm1(b - a)


def gaussian_dp_epsilon(mu: float, delta: float) -> float:
    """The smallest ``epsilon >= 0`` with :func:`gaussian_dp_delta` ``<= delta`` (increasing in
    ``mu``, so a lower confidence bound on ``mu`` gives one on ``epsilon``)."""
    from scipy.optimize import brentq

    if mu <= 0.0 or gaussian_dp_delta(0.0, mu) <= delta:
        return 0.0
    hi = max(1.0, mu * mu)
    while gaussian_dp_delta(hi, mu) > delta:
        hi *= 2.0
    return float(brentq(lambda e: gaussian_dp_delta(e, mu) - delta, 0.0, hi, xtol=1e-12))


@dataclass(frozen=True)
class GaussianFit:
    """Gaussian-DP fit of two score samples (:func:`gaussian_epsilon_lower_bound`).

    ``mu_estimate`` / ``epsilon_estimate``: the point estimates (not bounds); ``mu_lower`` /
    ``epsilon_lower``: lower bounds holding with probability ``confidence`` when both samples
    are Gaussian with one common variance (the model; see the function).
    """

    mu_estimate: float
    mu_lower: float
    epsilon_estimate: float
    epsilon_lower: float
    delta: float
    confidence: float


def gaussian_epsilon_lower_bound(
    scores_without: ArrayLike, scores_with: ArrayLike, delta: float, confidence: float = 0.95
) -> GaussianFit:
    """Epsilon lower bound at ``delta`` from all the scores at once, under a Gaussian model.

    **Model.** The scores on ``D`` and ``D'`` are ``N(m_0, s^2)`` and ``N(m_1, s^2)`` (one
    variance). An audited step's release is its clean sum plus Gaussian noise of a fixed
    covariance, and the score is a fixed linear functional of it (chosen before any draw), so
    this holds by the mechanism's construction; if the noise were not what the code claims, the
    bound could be wrong, which is why the distribution-free :func:`epsilon_lower_bound` is kept
    beside it. The pair is then exactly ``mu``-Gaussian DP with ``mu = |m_1 - m_0| / s``, and any
    valid ``(epsilon, delta)`` has ``epsilon >= gaussian_dp_epsilon(mu, delta)``.

    **Confidence.** Exact intervals, each at ``alpha / 2`` (union bound): the pooled two-sample
    ``t`` interval (two-sided at level ``alpha / 2``) for ``m_1 - m_0``, so ``|m_1 - m_0| >=
    max(0, |d| - t s_p sqrt(1/n_0 + 1/n_1))``; the chi-square upper bound ``s <= s_p sqrt(df /
    chi2_(alpha/2, df))``. Their ratio bounds ``mu`` from below with probability ``>= 1 -
    alpha``; the epsilon bound follows by monotonicity. Uses every score (no held-out split, no
    threshold), hence far more power than one Clopper-Pearson threshold in the tails.
    """
    a = _as_scores(scores_without, "scores_without")
    b = _as_scores(scores_with, "scores_with")
    _validate.probability("delta", delta, open_low=True, open_high=True, wrong_type=ValueError)
    alpha = _check_level(1.0 - _validate.real("confidence", confidence))
    n0, n1 = a.size, b.size
    df = n0 + n1 - 2
    d = float(b.mean() - a.mean())
    sp = math.sqrt((float(((a - a.mean()) ** 2).sum()) + float(((b - b.mean()) ** 2).sum())) / df)
    if sp == 0.0:
        raise ValueError("the scores have no spread: the Gaussian model does not apply")
    t = float(_stats.t.ppf(1.0 - alpha / 4.0, df))
    gap_lo = max(0.0, abs(d) - t * sp * math.sqrt(1.0 / n0 + 1.0 / n1))
    s_hi = sp * math.sqrt(df / float(_stats.chi2.ppf(alpha / 2.0, df)))
    mu_hat, mu_lo = abs(d) / sp, gap_lo / s_hi
    return GaussianFit(
        mu_estimate=mu_hat,
        mu_lower=mu_lo,
        epsilon_estimate=gaussian_dp_epsilon(mu_hat, float(delta)),
        epsilon_lower=gaussian_dp_epsilon(mu_lo, float(delta)),
        delta=float(delta),
        confidence=float(confidence),
    )
