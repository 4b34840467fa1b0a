"""Tests for clipless.stats.quantiles (many quantiles from one DP CDF)."""

import numpy as np
import pytest

from clipless.stats import Grid, seeded_rng
from clipless.stats.quantiles import quantiles, rank_error


def test_noise_free_quantiles_are_exact_and_rank_error_zero():
    values = np.random.default_rng(0).integers(1, 101, 2000).astype(float)
    grid = Grid(1, 100, size=100)
    qs = np.arange(1, 100) / 100
    for nb in ("replace_one", "add_remove"):
        r = quantiles(values, grid, qs, 1e9, nb, rng=seeded_rng(0))
        srt = np.sort(values)
        expected = srt[np.ceil(qs * values.size).astype(int) - 1]
        np.testing.assert_array_equal(r.values, expected)
        np.testing.assert_array_equal(rank_error(values, r.values, qs), 0.0)
    assert r.cdf.release.mechanism == "k-ary"


def test_rank_error_definition_with_ties():
    data = np.array([1.0, 2.0, 2.0, 2.0, 3.0])
    # rank interval of 2.0 is [1, 4]; target ranks 0.5*5 = 2.5 -> 0; 0.9*5 = 4.5 -> 0.5
    np.testing.assert_allclose(rank_error(data, [2.0, 2.0, 1.0], [0.5, 0.9, 0.9]), [0, 0.5, 3.5])


def test_rank_error_is_small_at_epsilon_1():
    """Mean rank error over 99 quantiles at epsilon = 1 stays within a few noise std."""
    values = np.random.default_rng(1).integers(1, 1025, 20000).astype(float)
    grid = Grid(1, 1024, size=1024)
    qs = np.arange(1, 100) / 100
    r = quantiles(values, grid, qs, 1.0, "add_remove", rng=seeded_rng(2))
    std = float(np.sqrt(np.max(r.cdf.variance)))
    assert rank_error(values, r.values, qs).mean() < 3 * std


def test_bad_levels():
    with pytest.raises(ValueError, match="qs must lie in"):
        quantiles([1.0, 2.0], [1.0, 2.0], [1.5], 1.0)
    with pytest.raises(ValueError, match="non-empty"):
        quantiles([1.0, 2.0], [1.0, 2.0], [], 1.0)


def test_repr_shows_the_released_values_and_guarantee():
    r = quantiles(range(1, 101), Grid(1, 100, size=100), [0.25, 0.5], 2.0, rng=seeded_rng(3))
    text = repr(r)
    assert text == str(r)
    expected = ", ".join(f"{q!r}: {float(v)!r}" for q, v in zip([0.25, 0.5], r.values, strict=True))
    assert text == (
        f"QuantileRelease({{{expected}}}, epsilon={r.cdf.epsilon!r}, neighbouring='replace_one')"
    )
    assert r.to_dict() == {0.25: float(r.values[0]), 0.5: float(r.values[1])}


def test_rank_error_accepts_a_quantile_release():
    values = np.random.default_rng(4).integers(1, 1025, 300).astype(float)
    qs = [0.1, 0.5, 0.9]
    r = quantiles(values, Grid(1, 1024, size=1024), qs, 0.05, rng=seeded_rng(5))
    expected = rank_error(values, r.values, qs)
    assert expected.max() > 0  # at epsilon 0.05 the release is not exact, so the test can fail
    np.testing.assert_array_equal(rank_error(values, r), expected)
    np.testing.assert_array_equal(rank_error(values, r, qs), expected)
    with pytest.raises(ValueError, match="qs: must be omitted or equal"):
        rank_error(values, r, [0.1, 0.5, 0.8])
    with pytest.raises(TypeError, match="qs: required"):
        rank_error(values, r.values)
