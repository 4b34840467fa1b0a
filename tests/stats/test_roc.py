"""DP ROC curves (thesis section 6.5.1) against known curves and scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.metrics import roc_auc_score

from clipless.stats import Grid, seeded_rng, tree_sensitivity
from clipless.stats.roc import DPROC, nonprivate_roc, roc

HUGE = 1e12  # discrete Laplace scale ~1e-11: the noise is 0 with probability ~1


def binormal(n: int, d: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    s = rng.normal(0.0, 1.0, n) + d * y
    return s, y


def test_exact_auc_equals_sklearn_when_grid_holds_every_score() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 3000)
    s = np.round(rng.normal(0.8 * y, 1.0), 1)  # many ties
    grid = Grid.from_thresholds(np.unique(s))
    for nb in ("replace_one", "add_remove"):
        for smoothing in (None, "isotonic", "l1", "l2"):
            r = roc(s, y, grid, HUGE, nb, smoothing, rng=seeded_rng(1))  # type: ignore[arg-type]
            assert r.auc() == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    fpr, tpr = nonprivate_roc(s, y, grid)
    np.testing.assert_allclose(r.curve()[0], fpr)
    np.testing.assert_allclose(r.curve()[1], tpr)


def test_binormal_auc_close_to_theory() -> None:
    """Binormal scores with shift d: AUC = Phi(d / sqrt 2)."""
    d = 1.0
    s, y = binormal(200_000, d, seed=1)
    grid = Grid(-6, 7, size=4096)
    r = roc(s, y, grid, 5.0, rng=seeded_rng(2))
    assert r.auc() == pytest.approx(norm.cdf(d / math.sqrt(2)), abs=0.01)
    assert np.all(np.diff(r.fpr) <= 0) and np.all(np.diff(r.tpr) <= 0)
    assert r.fpr.min() >= 0 and r.tpr.max() <= 1


def test_curve_close_to_true_curve_with_consistency() -> None:
    s, y = binormal(50_000, 1.5, seed=3)
    grid = Grid(-5, 7, size=1024)
    r = roc(s, y, grid, 2.0, "add_remove", "isotonic", seeded_rng(4), consistency=True)
    fpr, tpr = nonprivate_roc(s, y, grid)
    assert np.max(np.abs(r.curve()[0] - fpr)) < 0.02
    assert np.max(np.abs(r.curve()[1] - tpr)) < 0.02


def test_epsilon_split_noise_scales() -> None:
    """replace-one: each class at epsilon/2 with the add/remove constant, i.e. Laplace scale
    2 ceil((L+1)/2) / epsilon per node; add/remove: ceil((L+1)/2) / epsilon per class."""
    s, y = binormal(100, 1.0, seed=5)
    for size in (1024, 2048):  # L = 10 (L+1 odd) and L = 11 (L+1 even)
        grid = Grid(-4, 5, size=size)
        L = grid.depth
        ar = tree_sensitivity(L, "add_remove")
        r1 = roc(s, y, grid, 0.5, "replace_one", rng=seeded_rng(0), mechanism="binary")
        r2 = roc(s, y, grid, 0.5, "add_remove", rng=seeded_rng(0), mechanism="binary")
        for part in (r1.negatives, r1.positives):
            assert part.release.noise_scale == pytest.approx(2 * ar / 0.5)
            assert part.epsilon == 0.25 and part.neighbouring == "add_remove"
        for part in (r2.negatives, r2.positives):
            assert part.release.noise_scale == pytest.approx(ar / 0.5)
        # the joint replace-one constant max(L+1, 2 ceil((L+1)/2)) equals 2 * add/remove
        assert 2 * ar == max(tree_sensitivity(L, "replace_one"), 2 * ar)
    assert r1.epsilon == 0.5 and r1.neighbouring == "replace_one"


def test_gaussian_noise_splits_rho() -> None:
    s, y = binormal(500, 1.0, seed=6)
    grid = Grid(-4, 5, size=256)
    r = roc(s, y, grid, None, noise="gaussian", rho=0.5, rng=seeded_rng(0))
    assert r.rho == 0.5 and r.epsilon is None
    assert r.negatives.rho == 0.25 and r.positives.rho == 0.25
    assert 0.4 < r.auc() < 1.0


def test_empty_class_raises_nothing() -> None:
    """A data-dependent error would leak that a class is empty."""
    s = np.linspace(0, 1, 50)
    r = roc(s, np.zeros(50, dtype=int), Grid(0, 1, size=64), 1.0, rng=seeded_rng(0))
    assert isinstance(r, DPROC)
    assert np.all((r.tpr >= 0) & (r.tpr <= 1))


def test_plot_and_curve_endpoints() -> None:
    pytest.importorskip("matplotlib")
    s, y = binormal(2000, 1.0, seed=7)
    grid = Grid(-4, 5, size=128)
    r = roc(s, y, grid, 1.0, rng=seeded_rng(0))
    fpr, tpr = r.curve()
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (1.0, 1.0, 0.0, 0.0)
    ax = r.plot(true_curve=nonprivate_roc(s, y, grid))
    assert len(ax.get_lines()) == 3


def test_validation() -> None:
    grid = Grid(0, 1, size=16)
    s = np.linspace(0, 1, 10)
    y = np.array([0, 1] * 5)
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        roc(s, np.arange(10), grid, 1.0)
    with pytest.raises(ValueError, match=r"scores must be numbers \(no NaN"):
        roc(np.where(s > 0.5, np.nan, s), y, grid, 1.0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        roc(s, y, grid, 0.0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        roc(s, y, grid, -1.0)
    with pytest.raises(ValueError, match="length of scores"):
        roc(s, y[:5], grid, 1.0)
    with pytest.raises(ValueError, match="neighbouring"):
        roc(s, y, grid, 1.0, "swap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="smoothing"):
        roc(s, y, grid, 1.0, smoothing="spline")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scores must be non-empty"):
        roc([], [], grid, 1.0)
    with pytest.raises(TypeError, match="scores must be an array"):
        roc([10**400], [1], grid, 1.0)
    # under add/remove the size is private: an empty dataset is released, never refused
    empty = roc([], [], grid, 1.0, "add_remove", rng=seeded_rng(0))
    assert empty.fpr.shape == empty.tpr.shape
    with pytest.raises(TypeError, match="labels must be 0/1"):
        roc(s, np.array(["a"] * 10), grid, 1.0)
    with pytest.raises(ValueError, match="rho is required"):
        roc(s, y, grid, None, noise="gaussian")
    with pytest.raises(TypeError, match="consistency"):
        roc(s, y, grid, 1.0, consistency=1)
