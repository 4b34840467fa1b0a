"""Clopper-Pearson bounds and the empirical epsilon lower bound (clipless.audit.bounds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from clipless.audit import clopper_pearson, epsilon_lower_bound


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (10, 10), (17, 1000), (500, 1000)])
def test_clopper_pearson_matches_scipy_exact_interval(k: int, n: int) -> None:
    # the one-sided bounds at alpha are the ends of the two-sided exact interval at 1 - 2 alpha
    lo, hi = clopper_pearson(k, n, 0.025)
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    assert lo == pytest.approx(ci.low, abs=1e-12)
    assert hi == pytest.approx(ci.high, abs=1e-12)


def test_clopper_pearson_closed_forms_at_the_ends() -> None:
    n, alpha = 50, 0.05
    assert clopper_pearson(0, n, alpha)[1] == pytest.approx(1 - alpha ** (1 / n))
    assert clopper_pearson(n, n, alpha)[0] == pytest.approx(alpha ** (1 / n))


@pytest.mark.parametrize(
    ("args", "match"),
    [((5, 3, 0.05), "successes"), ((1, 0, 0.05), "trials"), ((1, 3, 1.5), "alpha")],
)
def test_clopper_pearson_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        clopper_pearson(*args)
    with pytest.raises(TypeError, match="successes"):
        clopper_pearson(1.5, 3, 0.05)  # type: ignore[arg-type]


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism N(0,1) vs N(mu,1) at delta (Balle-Wang 2018)."""

    def d(eps: float) -> float:
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("mu", [0.5, 2.0, 4.0])
def test_lower_bound_is_below_the_exact_epsilon_and_informative(mu: float) -> None:
    rng = np.random.default_rng(7)
    a = rng.normal(0.0, 1.0, 20000)
    b = rng.normal(mu, 1.0, 20000)
    delta = 1e-5
    test = epsilon_lower_bound(a, b, delta, 0.95)
    exact = _gaussian_epsilon(mu, delta)
    assert test.epsilon < exact
    assert test.epsilon > {0.5: 0.1, 2.0: 2.0, 4.0: 4.5}[mu]  # the attack is not toothless
    assert test.direction in ("above", "below")  # both tails are equally informative here


def test_reversed_scores_are_detected_and_identical_samples_give_nothing() -> None:
    rng = np.random.default_rng(1)
    a = rng.normal(0.0, 1.0, 10000)
    flipped = epsilon_lower_bound(a, -3.0 + rng.normal(0.0, 1.0, 10000), 1e-5)
    assert flipped.direction.endswith("swapped") and flipped.epsilon > 2.0
    same = epsilon_lower_bound(a, rng.normal(0.0, 1.0, 10000), 1e-5)
    assert same.epsilon < 0.3


def test_lower_bound_bad_input() -> None:
    with pytest.raises(ValueError, match="scores_with"):
        epsilon_lower_bound([0.0, 1.0], [np.nan, 1.0], 1e-5)
    with pytest.raises(ValueError, match="scores_without"):
        epsilon_lower_bound([0.0], [0.0, 1.0], 1e-5)
    with pytest.raises(ValueError, match="delta"):
        epsilon_lower_bound([0.0, 1.0], [0.0, 1.0], 1.5)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound([0.0, 1.0], [0.0, 1.0], 1e-5, confidence=1.0)


def test_numpy_scalars_are_numbers() -> None:
    """Audit finding: ``delta=np.float32(1e-5)`` was refused with "delta must be in [0, 1); got
    np.float32(1e-05)", which contradicts itself."""
    a, b = np.zeros(200), np.ones(200)
    d32, c32 = np.float32(1e-5), np.float32(0.95)
    ref = epsilon_lower_bound(a, b, float(d32), float(c32))
    got = epsilon_lower_bound(a, b, d32, c32)  # type: ignore[arg-type]
    assert got.epsilon == ref.epsilon
    a32 = np.float32(0.05)
    assert clopper_pearson(3, 10, a32) == clopper_pearson(3, 10, float(a32))  # type: ignore[arg-type]
