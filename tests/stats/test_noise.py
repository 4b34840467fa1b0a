"""Tests for the exact discrete samplers (Canonne, Kamath, Steinke 2020)."""

import random
import secrets
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from clipless.stats import (
    discrete_gaussian,
    discrete_gaussian_pmf,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_pmf,
    discrete_laplace_variance,
    secure_rng,
    seeded_rng,
)
from clipless.stats.noise import _discrete_gaussian_scalar, _discrete_laplace_scalar


def _moments_ok(x, var, fourth, sigmas=5.0):
    """Sample mean and variance within ``sigmas`` standard errors of the exact values."""
    n = x.size
    assert abs(x.mean()) < sigmas * np.sqrt(var / n)
    m2 = np.mean(x.astype(np.float64) ** 2)  # mean is exactly 0: E[x^2] = var
    assert abs(m2 - var) < sigmas * np.sqrt((fourth - var**2) / n)


def _chi2_pvalue(x, pmf, half):
    ks = np.arange(-half, half + 1)
    observed = np.array([np.sum(x < -half)] + [np.sum(x == k) for k in ks] + [np.sum(x > half)])
    p = pmf(ks)
    tail = (1.0 - p.sum()) / 2
    expected = x.size * np.concatenate([[tail], p, [tail]])
    keep = expected > 5
    obs, exp = observed[keep], expected[keep]
    exp = exp * obs.sum() / exp.sum()
    return stats.chisquare(obs, exp).pvalue


def _fourth_moment(pmf, half):
    ks = np.arange(-half, half + 1, dtype=np.float64)
    return float(np.sum(ks**4 * pmf(ks)))


@pytest.mark.parametrize("scale", [Fraction(1, 3), 1, Fraction(7, 3), 0.1, 3.7, 16])
def test_discrete_laplace_moments_and_pmf(scale):
    x = discrete_laplace(scale, 200_000, seeded_rng(1))
    assert x.dtype == np.int64 and x.shape == (200_000,)
    var = discrete_laplace_variance(scale)
    half = int(40 * float(scale)) + 20
    fourth = _fourth_moment(lambda k: discrete_laplace_pmf(k, scale), half)
    _moments_ok(x, var, fourth)
    width = max(3, int(4 * float(scale)))
    assert _chi2_pvalue(x, lambda k: discrete_laplace_pmf(k, scale), width) > 1e-4


def test_discrete_laplace_variance_formula():
    b = 5.0
    q = np.exp(-1 / b)
    assert discrete_laplace_variance(b) == pytest.approx(2 * q / (1 - q) ** 2, rel=1e-14)
    # relation to the continuous Laplace: 2 b^2 - 1/6 + O(b^-2)
    assert discrete_laplace_variance(100) == pytest.approx(2 * 100**2 - 1 / 6, abs=1e-4)
    ks = np.arange(-2000, 2001)
    assert discrete_laplace_pmf(ks, 7).sum() == pytest.approx(1.0, abs=1e-12)
    assert np.sum(ks**2 * discrete_laplace_pmf(ks, 7)) == pytest.approx(
        discrete_laplace_variance(7), rel=1e-12
    )


def test_discrete_laplace_slow_exact_path():
    # numerator >= 2**62: the scalar path with Python integers
    scale = Fraction(2**64 + 1, 2**62)  # about 4
    x = discrete_laplace(scale, 4000, seeded_rng(2))
    var = discrete_laplace_variance(scale)
    fourth = _fourth_moment(lambda k: discrete_laplace_pmf(k, scale), 400)
    _moments_ok(x, var, fourth)
    assert _chi2_pvalue(x, lambda k: discrete_laplace_pmf(k, scale), 12) > 1e-4


def test_scalar_reference_samplers_match_pmf():
    rng = seeded_rng(3)
    x = np.array([_discrete_laplace_scalar(Fraction(5, 2), rng) for _ in range(6000)])
    assert _chi2_pvalue(x, lambda k: discrete_laplace_pmf(k, Fraction(5, 2)), 8) > 1e-4
    y = np.array([_discrete_gaussian_scalar(Fraction(9, 4), rng) for _ in range(6000)])
    assert _chi2_pvalue(y, lambda k: discrete_gaussian_pmf(k, Fraction(9, 4)), 5) > 1e-4


@pytest.mark.parametrize(("sigma", "sigma2"), [(None, Fraction(1, 3)), (1.5, None), (None, 40)])
def test_discrete_gaussian_moments_and_pmf(sigma, sigma2):
    x = discrete_gaussian(sigma, 100_000, seeded_rng(4), sigma2=sigma2)
    s2 = sigma**2 if sigma is not None else float(sigma2)
    var = discrete_gaussian_variance(s2)
    assert var <= s2 + 1e-12
    half = int(20 * np.sqrt(s2)) + 10
    fourth = _fourth_moment(lambda k: discrete_gaussian_pmf(k, s2), half)
    _moments_ok(x, var, fourth)
    width = max(2, int(3 * np.sqrt(s2)))
    assert _chi2_pvalue(x, lambda k: discrete_gaussian_pmf(k, s2), width) > 1e-4


def test_discrete_gaussian_float_sigma2_big_denominator():
    # sigma^2 = 0.3 exactly as a binary fraction: denominators beyond 2**62 in the exponent
    x = discrete_gaussian(None, 20_000, seeded_rng(5), sigma2=0.3)
    assert _chi2_pvalue(x, lambda k: discrete_gaussian_pmf(k, 0.3), 2) > 1e-4


def test_seeded_reproducible_and_secure_default():
    a = discrete_laplace(3, 50, seeded_rng(7))
    b = discrete_laplace(3, 50, seeded_rng(7))
    np.testing.assert_array_equal(a, b)
    assert isinstance(secure_rng(), secrets.SystemRandom)
    c = discrete_laplace(3, (4, 5))
    assert c.shape == (4, 5) and c.dtype == np.int64
    g = discrete_gaussian(2, 10)
    assert g.shape == (10,)
    assert discrete_laplace(1, 0, seeded_rng(0)).shape == (0,)


@pytest.mark.parametrize(
    ("scale", "exc", "match"),
    [
        (0, ValueError, "scale"),
        (-1.0, ValueError, "scale"),
        (float("nan"), ValueError, "scale"),
        (float("inf"), ValueError, "scale"),
        (True, TypeError, "scale"),
        ("1", TypeError, "scale"),
    ],
)
def test_bad_scale(scale, exc, match):
    with pytest.raises(exc, match=match):
        discrete_laplace(scale, 3, seeded_rng(0))


def test_bad_size_rng_sigma():
    with pytest.raises(ValueError, match="size"):
        discrete_laplace(1, -1, seeded_rng(0))
    with pytest.raises(TypeError, match="size"):
        discrete_laplace(1, 2.0, seeded_rng(0))
    with pytest.raises(TypeError, match="rng"):
        discrete_laplace(1, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="sigma"):
        discrete_gaussian(1.0, 3, seeded_rng(0), sigma2=1.0)
    with pytest.raises(ValueError, match="sigma"):
        discrete_gaussian(0.0, 3, seeded_rng(0))
    assert isinstance(seeded_rng(1), random.Random)


def test_conservative_scale_keeps_privacy():
    from clipless.stats.noise import conservative_scale

    assert conservative_scale(Fraction(16, 3)) == Fraction(16, 3)
    for eps in (0.01, 0.001, 1e-6, 0.37):
        exact = Fraction(16) / Fraction(eps)
        used = conservative_scale(exact)
        assert used >= exact  # larger scale: privacy loss 16 / used <= eps
        assert used.numerator < 2**61 and used.denominator < 2**61
        assert float((used - exact) / exact) < 1e-15
