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
