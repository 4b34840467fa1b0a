"""Tests for clipless.stats.grid."""

import numpy as np
import pytest

from clipless.stats import Grid, tree_depth


def test_linear_size_is_linspace():
    g = Grid(-1.0, 3.0, size=9)
    np.testing.assert_array_equal(g.thresholds, np.linspace(-1.0, 3.0, 9))
    assert len(g) == 9
    assert g.thresholds.dtype == np.float64
    assert g.depth == 4


def test_log_size_is_geomspace():
    g = Grid(1.0, 1000.0, size=4, scale="log")
    np.testing.assert_allclose(g.thresholds, [1.0, 10.0, 100.0, 1000.0])
    assert g.thresholds[0] == 1.0 and g.thresholds[-1] == 1000.0


def test_precision_linear_includes_upper():
    np.testing.assert_allclose(Grid(0, 1, precision=0.1).thresholds, np.linspace(0, 1, 11))
    np.testing.assert_allclose(Grid(0, 1, precision=0.3).thresholds, [0, 0.3, 0.6, 0.9])
    assert Grid(2.0, 2.0, precision=1.0).thresholds.tolist() == [2.0]


def test_precision_log_relative():
    g = Grid(1.0, 16.0, precision=1.0, scale="log")
    np.testing.assert_allclose(g.thresholds, [1, 2, 4, 8, 16])


def test_from_thresholds_read_only_and_equality():
    g = Grid.from_thresholds([0.5, 1.0, 7.0])
    assert g.scale == "explicit"
    with pytest.raises(ValueError):
        g.thresholds[0] = 3.0
    assert g == Grid.from_thresholds(np.array([0.5, 1.0, 7.0]))
    assert hash(g) == hash(Grid.from_thresholds([0.5, 1.0, 7.0]))


@pytest.mark.parametrize(
    ("n", "depth"), [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (2**15, 15)]
)
def test_depth(n, depth):
    assert tree_depth(n) == depth
    assert Grid.from_thresholds(np.arange(n, dtype=float)).depth == depth


def test_counts_clamp_and_ties():
    g = Grid.from_thresholds([0.0, 1.0, 2.0])
    # -5 -> tau_1; 0 -> leaf 0; 0.5 and 1.0 -> leaf 1 (<= tau_2); 1.5 -> leaf 2; 9 -> tau_N
    np.testing.assert_array_equal(g.counts([-5, 0, 0.5, 1.0, 1.5, 9]), [2, 2, 2])
    np.testing.assert_array_equal(g.leaf_index([-5, 0, 0.5, 1.0, 1.5, 9]), [0, 0, 1, 1, 2, 2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lower": float("nan"), "upper": 1.0, "size": 3}, "lower"),
        ({"lower": 0.0, "upper": float("inf"), "size": 3}, "upper"),
        ({"lower": 1.0, "upper": 0.0, "size": 3}, "upper"),
        ({"lower": 0.0, "upper": 1.0}, "size and precision"),
        ({"lower": 0.0, "upper": 1.0, "size": 3, "precision": 0.1}, "size and precision"),
        ({"lower": 0.0, "upper": 1.0, "size": 0}, "size"),
        ({"lower": 0.0, "upper": 1.0, "precision": -0.1}, "precision"),
        ({"lower": 0.0, "upper": 1.0, "precision": float("nan")}, "precision"),
        ({"lower": 0.0, "upper": 1.0, "size": 3, "scale": "log"}, "lower"),
        ({"lower": 0.0, "upper": 1.0, "size": 3, "scale": "cubic"}, "scale"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Grid(**kwargs)


def test_bad_types():
    with pytest.raises(TypeError, match="size"):
        Grid(0, 1, size=2.5)
    with pytest.raises(TypeError, match="lower"):
        Grid("0", 1, size=2)


@pytest.mark.parametrize(
    ("thresholds", "match"),
    [
        ([0.0, 2.0, 1.0], "strictly increasing"),
        ([0.0, 1.0, 1.0], "strictly increasing"),
        ([0.0, float("nan")], "finite"),
        ([], "at least one"),
        ([[0.0, 1.0]], "one-dimensional"),
    ],
)
def test_bad_thresholds(thresholds, match):
    with pytest.raises(ValueError, match=match) as info:
        Grid.from_thresholds(thresholds)
    assert "thresholds" in str(info.value)


@pytest.mark.parametrize(
    ("lower", "upper", "precision", "expected"),
    [
        (-2.0, -1.0, 0.5, [-2.0, -1.5, -1.0]),
        (0.0, 1e6, 1.0, None),
        (0.0, 1.0, 0.25, [0.0, 0.25, 0.5, 0.75, 1.0]),
    ],
)
def test_precision_edges(lower, upper, precision, expected):
    g = Grid(lower, upper, precision=precision)
    assert g.thresholds[0] == lower and g.thresholds[-1] == upper
    assert np.all(np.diff(g.thresholds) > 0)
    if expected is not None:
        np.testing.assert_allclose(g.thresholds, expected)
    else:
        assert len(g) == 10**6 + 1
