"""The Gaussian-DP fit audit (issue 37, item 4 of "What to build")."""

import math

import numpy as np
import pytest
from scipy import integrate, stats

from clipless.audit.bounds import (
    gaussian_dp_delta,
    gaussian_dp_epsilon,
    gaussian_epsilon_lower_bound,
)


@pytest.mark.parametrize(("mu", "eps"), [(0.5, 0.0), (0.5, 1.0), (1.0, 2.0), (3.0, 5.0)])
def test_profile_is_the_hockey_stick_divergence_of_two_gaussians(mu: float, eps: float) -> None:
    """delta(eps) = integral of max(0, p_mu(x) - e^eps p_0(x)), by numerical integration."""

    def gap(x: float) -> float:
        return max(0.0, stats.norm.pdf(x, mu) - math.exp(eps) * stats.norm.pdf(x))

    cross = eps / mu + mu / 2.0  # p_mu > e^eps p_0 exactly above this point
    ref, _ = integrate.quad(gap, cross, cross + 40.0, epsabs=1e-14, limit=200)
    assert gaussian_dp_delta(eps, mu) == pytest.approx(ref, rel=1e-7, abs=1e-15)


def test_epsilon_inverts_the_profile_and_matches_the_gaussian_mechanism_claim() -> None:
    eps = gaussian_dp_epsilon(0.5, 1e-5)
    assert gaussian_dp_delta(eps, 0.5) == pytest.approx(1e-5, rel=1e-6)
    assert eps == pytest.approx(1.9931, abs=1e-4)  # `clipless audit` claims 1.9931 at sigma 2
    assert gaussian_dp_epsilon(0.0, 1e-5) == 0.0
    assert gaussian_dp_epsilon(67.0, 1e-5) > gaussian_dp_epsilon(6.0, 1e-5) > 40


def test_lower_bound_covers_the_truth_and_has_power() -> None:
    """Coverage: over 400 synthetic audits (mu = 0.5, 2,000 scores each) the 95% bound exceeds
    the true epsilon at most ~5% of the time; power: at 20,000 scores it reaches >= 0.8 of it."""
    mu, delta = 0.5, 1e-5
    truth = gaussian_dp_epsilon(mu, delta)
    gen = np.random.default_rng(0)
    misses = 0
    estimates = []
    for _ in range(400):
        a = gen.normal(3.0, 2.0, 2000)
        b = gen.normal(3.0 + 2.0 * mu, 2.0, 2000)
        fit = gaussian_epsilon_lower_bound(a, b, delta, 0.95)
        misses += fit.epsilon_lower > truth
        estimates.append(fit.mu_estimate)
    assert misses <= 0.07 * 400
    assert float(np.mean(estimates)) == pytest.approx(mu, rel=0.01)
    fit = gaussian_epsilon_lower_bound(gen.normal(0, 1, 20000), gen.normal(mu, 1, 20000), delta)
    assert 0.8 * truth <= fit.epsilon_lower <= truth
    swapped = gaussian_epsilon_lower_bound(gen.normal(mu, 1, 500), gen.normal(0, 1, 500), delta)
    assert swapped.mu_estimate > 0  # the sign of the shift does not matter


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="delta must be in"):
        gaussian_epsilon_lower_bound([0, 1, 2], [1, 2, 3], 0.0)
    with pytest.raises(ValueError, match="alpha must be in"):
        gaussian_epsilon_lower_bound([0, 1, 2], [1, 2, 3], 1e-5, 1.0)
    with pytest.raises(ValueError, match="no spread"):
        gaussian_epsilon_lower_bound([1, 1], [1, 1], 1e-5)


@pytest.mark.parametrize("mode", ["per-sample", "batch-max"])
def test_the_step_audit_reaches_the_claim(mode: str) -> None:
    """Target of issue 37: the rigorous bound >= 0.8 of the claimed epsilon (claim 1.993) with
    20,000 releases each, and above the claim for batch-max."""
    from clipless.audit import audit_step

    result = audit_step(mode, trials=20000, seed=1, allow_unproven=mode == "batch-max")
    g = result.gaussian
    assert g is not None
    if mode == "per-sample":
        assert 0.8 * result.claimed_epsilon <= g.epsilon_lower <= result.claimed_epsilon
        assert g.epsilon_lower > 1.5 * result.epsilon_lower_bound  # more power than CP
    else:
        assert g.epsilon_lower > 10 * result.claimed_epsilon
    assert any(line.startswith("Gaussian-DP fit") for line in result.lines())
