"""DP Hosmer-Lemeshow (thesis Algorithm 10, Theorem 6.5.1) against direct computations."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import chi2

from clipless.stats import Grid, seeded_rng, tree_sensitivity
from clipless.stats.calibration import hosmer_lemeshow, nonprivate_hosmer_lemeshow

HUGE = 1e12


def data(n: int = 20_000, seed: int = 0, miscal: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.beta(2, 5, n)
    y = (rng.random(n) < np.clip(miscal * p, 0, 1)).astype(int)
    return p, y


def reference_hl(p: np.ndarray, y: np.ndarray, edges: np.ndarray) -> float:
    """Eq. 6.5.1 with explicit loops over groups (t_{q-1}, t_q]."""
    Q = edges.size - 1
    h = 0.0
    for q in range(Q):
        lo, hi = edges[q], edges[q + 1]
        m = (p <= hi) if q == 0 else (p > lo) & (p <= hi)
        if q == Q - 1:
            m = p > lo
        e1, o1, size = p[m].sum(), y[m].sum(), m.sum()
        h += (o1 - e1) ** 2 / e1 + ((size - o1) - (size - e1)) ** 2 / (size - e1)
    return float(h)


def deciles_of_risk(p: np.ndarray, y: np.ndarray, Q: int = 10) -> float:
    """The textbook statistic: equal-size groups of sorted probabilities."""
    order = np.argsort(p, kind="stable")
    h = 0.0
    for chunk in np.array_split(order, Q):
        e1, o1, size = p[chunk].sum(), y[chunk].sum(), chunk.size
        h += (o1 - e1) ** 2 / e1 + (o1 - e1) ** 2 / (size - e1)
    return float(h)


def test_large_epsilon_matches_direct_computation() -> None:
    p, y = data()
    for nb in ("replace_one", "add_remove"):
        r = hosmer_lemeshow(p, y, HUGE, neighbouring=nb, rng=seeded_rng(0))  # type: ignore[arg-type]
        # same groups: exact up to the 2^-20 rounding of the probabilities
        assert r.statistic == pytest.approx(reference_hl(p, y, r.boundaries), rel=1e-4)
        assert r.p_value == pytest.approx(chi2.sf(r.statistic, 8))
        assert r.dof == 8 and r.groups == 10
        # the DP deciles are the empirical ones up to the grid resolution (2^-10)
        emp = np.quantile(p, np.arange(1, 10) / 10)
        assert np.all(r.boundaries[1:-1] >= emp - 1e-12)
        assert np.all(r.boundaries[1:-1] <= emp + 1.0 / 1023 + 1e-12)
        # and the textbook rank-based statistic is close
        assert r.statistic == pytest.approx(deciles_of_risk(p, y), abs=1.5)
        table = r.to_dict()
        np.testing.assert_allclose(
            table["observed_0"] + table["observed_1"],
            table["expected_0"] + table["expected_1"],
            rtol=1e-9,
        )


def test_nonprivate_helper_matches_references() -> None:
    p, y = data(5000, seed=2)
    assert nonprivate_hosmer_lemeshow(p, y)[0] == pytest.approx(deciles_of_risk(p, y))
    edges = np.concatenate([[0.0], np.quantile(p, np.arange(1, 10) / 10), [1.0]])
    stat, pval = nonprivate_hosmer_lemeshow(p, y, boundaries=edges)
    assert stat == pytest.approx(reference_hl(p, y, edges))
    assert pval == pytest.approx(chi2.sf(stat, 8))


def test_uniform_bins_use_public_edges() -> None:
    p, y = data(8000, seed=3)
    r = hosmer_lemeshow(p, y, HUGE, binning="uniform", rng=seeded_rng(1))
    np.testing.assert_allclose(r.boundaries, np.arange(11) / 10)
    assert r.ecdf is None and r.epsilon_ecdf == 0.0 and r.epsilon_groups == HUGE
    ref, _ = nonprivate_hosmer_lemeshow(p, y, boundaries=r.boundaries, min_expected=1.0)
    assert r.statistic == pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize(
    ("nb", "split", "delta_g"),
    [
        ("replace_one", "thesis", 8),
        ("add_remove", "thesis", 4),
        ("replace_one", "tight", 4),
        ("add_remove", "tight", 2),
    ],
)
def test_epsilon_split(nb: str, split: str, delta_g: int) -> None:
    """Algorithm 10 line 3: epsilon' = epsilon / (Delta_F + Delta_G); Delta_F = L + 1 = 11 for
    the default 1024-point grid under replace-one (so epsilon / (L + 9) in the thesis)."""
    p, y = data(2000, seed=4)
    eps = 0.7
    r = hosmer_lemeshow(p, y, eps, neighbouring=nb, split=split, rng=seeded_rng(0))  # type: ignore[arg-type]
    delta_f = tree_sensitivity(10, nb)  # type: ignore[arg-type]
    unit = Fraction(eps) / (delta_f + delta_g)
    assert r.epsilon_ecdf == pytest.approx(float(delta_f * unit))
    assert r.epsilon_groups == pytest.approx(float(delta_g * unit))
    assert r.epsilon_ecdf + r.epsilon_groups == pytest.approx(eps)
    assert r.noise_scale == pytest.approx(float(1 / unit))
    assert r.ecdf is not None
    assert r.ecdf.release.noise_scale == pytest.approx(float(1 / unit))  # per node: 1/epsilon'
    if nb == "replace_one" and split == "thesis":
        assert r.noise_scale == pytest.approx((10 + 9) / eps)


def test_table_sensitivity_claim() -> None:
    """The tight split's claim: one record moves the (E_0, E_1, O_0, O_1) row of its group by
    exactly 2 in L1 (exhaustive over a grid of probabilities and both labels)."""
    for p in np.linspace(0, 1, 101):
        for yv in (0, 1):
            row = np.array([1 - p, p, 1 - yv, yv])
            assert np.abs(row).sum() == pytest.approx(2.0)
            for p2 in np.linspace(0, 1, 11):
                for y2 in (0, 1):
                    row2 = np.array([1 - p2, p2, 1 - y2, y2])
                    assert np.abs(row - row2).sum() <= 4.0 + 1e-12


def test_noise_aware_p_value_separates_calibrated_from_miscalibrated() -> None:
    good, bad = data(20_000, seed=5), data(20_000, seed=5, miscal=1.3)
    r_good = hosmer_lemeshow(*good, 1.0, split="tight", rng=seeded_rng(3))
    r_bad = hosmer_lemeshow(*bad, 1.0, split="tight", rng=seeded_rng(3))
    assert r_good.noise_aware_p_value(2000) > 0.05
    assert r_bad.noise_aware_p_value(2000) < 0.01
    assert r_good.p_value < r_good.noise_aware_p_value(2000)  # plug-in reads noise as misfit


def test_custom_grid_and_groups() -> None:
    p, y = data(3000, seed=6)
    r = hosmer_lemeshow(p, y, HUGE, groups=5, grid=Grid(0, 1, size=257), rng=seeded_rng(0))
    assert r.dof == 3 and r.observed.shape == (5, 2) and r.boundaries.size == 6


def test_validation() -> None:
    p, y = data(100)
    with pytest.raises(ValueError, match="probabilities must be finite and within"):
        hosmer_lemeshow(p * 2, y, 1.0)
    with pytest.raises(ValueError, match="probabilities must be finite"):
        hosmer_lemeshow(np.where(p > 0.5, np.nan, p), y, 1.0)
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        hosmer_lemeshow(p, y + 1, 1.0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        hosmer_lemeshow(p, y, 0.0)
    with pytest.raises(ValueError, match="groups must be between 3"):
        hosmer_lemeshow(p, y, 1.0, groups=2)
    with pytest.raises(ValueError, match="groups must be between 3"):
        hosmer_lemeshow(p, y, 1.0, groups=10**12)  # a named error, not numpy's out of memory
    with pytest.raises(TypeError, match="probabilities must be an array"):
        hosmer_lemeshow([10**400], [1], 1.0)
    with pytest.raises(TypeError, match="groups must be an int"):
        hosmer_lemeshow(p, y, 1.0, groups=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split"):
        hosmer_lemeshow(p, y, 1.0, split="loose")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="binning"):
        hosmer_lemeshow(p, y, 1.0, binning="kmeans")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_expected"):
        hosmer_lemeshow(p, y, 1.0, min_expected=0)
    with pytest.raises(ValueError, match="probabilities must be non-empty"):
        hosmer_lemeshow([], [], 1.0)
    # under add/remove the size is private: an empty dataset is released, never refused
    empty = hosmer_lemeshow([], [], 1.0, neighbouring="add_remove", rng=seeded_rng(0))
    assert math.isfinite(empty.statistic)
    with pytest.raises(ValueError, match="neighbouring"):
        hosmer_lemeshow(p, y, 1.0, neighbouring="swap")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="grid must be a Grid"):
        hosmer_lemeshow(p, y, 1.0, grid=[0, 0.5, 1])  # type: ignore[arg-type]


def test_rounded_probabilities_are_clipped_not_refused() -> None:
    """Audit finding: a sigmoid's rounding (p = 1 + 2^-52) aborted the release."""
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, 200)
    y = (rng.uniform(0, 1, 200) < p).astype(int)
    a = hosmer_lemeshow(p, y, 1.0, rng=seeded_rng(1))
    p[0], p[1] = 1.0 + 2.0**-52, -(2.0**-60)
    b = hosmer_lemeshow(np.clip(p, 0, 1), y, 1.0, rng=seeded_rng(1))
    c = hosmer_lemeshow(p, y, 1.0, rng=seeded_rng(1))
    assert b.statistic == c.statistic
    assert a.statistic is not None
    with pytest.raises(ValueError, match="within"):
        hosmer_lemeshow(np.where(np.arange(200) == 0, 1.5, p), y, 1.0)
