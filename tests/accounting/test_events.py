"""clipless.accounting.events: noise strategies and the replace-one relation."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from clipless.accounting import (
    Accountant,
    PrivacyLedger,
    calibrate_noise,
    effective_noise_multiplier,
    epsilon,
    gaussian_step_event,
)

from ._helpers import FAST


# ---------------------------------------------------------------------------- noise strategies
@pytest.mark.parametrize("depth", [1, 2, 5, 17])
def test_per_layer_noise_identity(depth: int) -> None:
    s = 1.7
    assert effective_noise_multiplier([s] * depth) == pytest.approx(s / math.sqrt(depth), 1e-15)


def test_global_noise_identity() -> None:
    rng = np.random.default_rng(0)
    sens = rng.uniform(0.01, 5.0, size=9)
    sigma = 1.3
    total = math.sqrt(float(np.sum(sens**2)))
    sigmas = [sigma * total / g for g in sens]  # DESIGN "global": sigma_k = sigma G / G_k
    assert effective_noise_multiplier(sigmas) == pytest.approx(sigma, rel=1e-12)


def test_global_vs_per_layer_epsilon() -> None:
    """Per-layer noise sigma on D layers spends exactly what global noise sigma/sqrt(D) spends."""
    depth, sigma, q, steps = 4, 2.0, 0.05, 200
    kw = {"value_discretization_interval": FAST}
    per_layer = epsilon(effective_noise_multiplier([sigma] * depth), q, steps, 1e-5, **kw)  # type: ignore[arg-type]
    global_ = epsilon(sigma / 2.0, q, steps, 1e-5, **kw)  # type: ignore[arg-type]
    assert per_layer == global_


def test_effective_noise_multiplier_edge_cases() -> None:
    assert effective_noise_multiplier([1.0, math.inf]) == 1.0
    assert effective_noise_multiplier([math.inf, math.inf]) == math.inf
    assert effective_noise_multiplier([1.0, 0.0]) == 0.0
    with pytest.raises(ValueError, match="at least one"):
        effective_noise_multiplier([])
    with pytest.raises(ValueError, match=r"sigmas\[i\]"):
        effective_noise_multiplier([1.0, -1.0])
    with pytest.raises(ValueError, match=r"sigmas\[i\]"):
        effective_noise_multiplier([math.nan])


# ------------------------------------------------------------------------------- replace-one
@pytest.mark.parametrize("sigma", [1.5, 3.0, 6.0])
def test_replace_one_unsubsampled_is_half_sigma(sigma: float) -> None:
    kw = {"value_discretization_interval": FAST}
    for kind in ("pld", "rdp"):
        replace = epsilon(sigma, 1.0, 4, 1e-5, kind, "replace_one", **kw)  # type: ignore[arg-type]
        half = epsilon(sigma / 2, 1.0, 4, 1e-5, kind, "add_remove", **kw)  # type: ignore[arg-type]
        assert replace == pytest.approx(half, rel=1e-6)
    # Exact analytic check of the q = 1 replace-one PLD (one step): sensitivity 2G.
    exact = dp_accounting.get_epsilon_gaussian(sigma / 2, 1e-5)
    assert exact <= epsilon(sigma, 1.0, 1, 1e-5, "pld", "replace_one") <= exact * (1 + 1e-5)


def test_rdp_replace_one_avoids_sensitivity_bug() -> None:
    """dp_accounting's RdpAccountant(REPLACE_ONE) takes sensitivity G for a GaussianDpEvent
    (google/differential-privacy#378); clipless accounts for 2G."""
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 10)
    naive = RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    ).compose(event)
    ours = Accountant("rdp", "replace_one").compose(event).epsilon(1e-5)
    assert ours > naive.get_epsilon(1e-5) * 1.5
    assert ours == epsilon(1.0, 1.0, 10, 1e-5, "rdp")


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.01), (2.0, 0.1), (0.9, 0.5)])
def test_replace_one_subsampled_between_naive_bounds(sigma: float, q: float) -> None:
    kw = {"value_discretization_interval": FAST}
    ar = epsilon(sigma, q, 100, 1e-5, "pld", "add_remove", **kw)  # type: ignore[arg-type]
    ro = epsilon(sigma, q, 100, 1e-5, "pld", "replace_one", **kw)  # type: ignore[arg-type]
    ar_half = epsilon(sigma / 2, q, 100, 1e-5, "pld", "add_remove", **kw)  # type: ignore[arg-type]
    assert ar < ro < ar_half


def test_replace_one_pair_dominates_all_configurations() -> None:
    """The REPLACE_ONE pair P=(1-q)N(0)+qN(-e), Q=(1-q)N(0)+qN(+e) has the largest hockey-stick
    divergence H_a(P||Q) among all replace-one pairs (1-q)N(0)+qN(u) vs (1-q)N(0)+qN(v),
    ||u||, ||v|| <= 1, for every a > 0 (numerical 2-D quadrature; the claim the accounting of
    replace-one with Poisson subsampling relies on, module docstring)."""
    grid = np.linspace(-7.0, 7.0, 561)
    step = grid[1] - grid[0]
    xx, yy = np.meshgrid(grid, grid, indexing="ij")
    sigma = 1.0

    def normal(cx: float, cy: float) -> np.ndarray:
        return stats.norm.pdf(xx, cx, sigma) * stats.norm.pdf(yy, cy, sigma)

    alphas = np.exp(np.linspace(-3.0, 3.0, 13))
    n0 = normal(0.0, 0.0)
    for q in (0.05, 0.5):
        p_star = (1 - q) * n0 + q * normal(-1.0, 0.0)
        q_star = (1 - q) * n0 + q * normal(1.0, 0.0)
        worst = np.array([np.maximum(p_star - a * q_star, 0).sum() * step**2 for a in alphas])
        for r_u, r_v, angle in [(1, 0, 0), (0, 1, 0), (1, 1, 2.0), (1, 0.5, 3.0), (0.5, 1, 1.0)]:
            p = (1 - q) * n0 + q * normal(r_u, 0.0)
            qq = (1 - q) * n0 + q * normal(r_v * math.cos(angle), r_v * math.sin(angle))
            h = np.array([np.maximum(p - a * qq, 0).sum() * step**2 for a in alphas])
            assert np.all(h <= worst + 1e-9)


def test_rdp_replace_one_subsampled_refused() -> None:
    with pytest.raises(ValueError, match="accountant='pld'"):
        epsilon(1.0, 0.1, 10, 1e-5, "rdp", "replace_one")
    with pytest.raises(ValueError, match="accountant='pld'"):
        PrivacyLedger("rdp", "replace_one").record(1.0, 0.1)
    with pytest.raises(ValueError, match="accountant='pld'"):
        calibrate_noise(1.0, 1e-5, 0.1, 10, "rdp", "replace_one")
    assert not Accountant("rdp", "replace_one").supports(gaussian_step_event(1.0, 0.1))
    assert Accountant("rdp", "replace_one").supports(gaussian_step_event(1.0, 1.0))
