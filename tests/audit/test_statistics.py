"""Audits of the DP statistics (clipless.audit.statistics): exact privacy loss, sampled samplers."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from clipless.audit.statistics import (
    _laplace_node_loss,
    audit_ecdf,
    audit_sampler,
    gaussian_renyi_divergence,
    laplace_privacy_loss,
)
from clipless.stats import discrete_laplace, discrete_laplace_pmf, seeded_rng
from clipless.stats.tree import node_counts_from_leaves, release_counts


@pytest.mark.parametrize("d", [-3, -1, 1, 2])
def test_node_loss_pmf_is_exact(d: int) -> None:
    scale = 1.7
    node = _laplace_node_loss(d, scale)
    assert sum(node.values()) == pytest.approx(1.0, abs=1e-14)
    ks = np.arange(-400, 401)
    p = discrete_laplace_pmf(ks, scale)
    brute: dict[int, float] = {}
    for k, pk in zip(ks.tolist(), p.tolist(), strict=True):
        v = abs(k + d) - abs(k)
        brute[v] = brute.get(v, 0.0) + pk
    assert set(brute) == set(node)
    for v, pv in node.items():
        assert pv == pytest.approx(brute[v], rel=1e-10, abs=1e-300)


@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
@pytest.mark.parametrize("num_leaves", [2, 3, 5, 8])
def test_ecdf_laplace_release_is_exactly_epsilon_dp_and_tight(
    neighbouring: str, num_leaves: int
) -> None:
    result = audit_ecdf(list(range(num_leaves)), 2, epsilon=0.7, neighbouring=neighbouring)
    assert result.holds, result
    assert result.delta_at_claim == 0.0
    # the claim is attained by some pair: the tree constant is not loose on these domains
    assert result.worst == pytest.approx(0.7, rel=1e-9)


@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
def test_ecdf_gaussian_release_is_exactly_rho_zcdp(neighbouring: str) -> None:
    result = audit_ecdf(
        [0.0, 0.5, 1.0, 2.0, 3.0], 2, epsilon=None, rho=0.3, neighbouring=neighbouring
    )
    assert result.holds, result
    assert result.worst == pytest.approx(0.3, rel=1e-6)


def test_a_release_with_half_the_noise_is_caught() -> None:
    laplace = audit_ecdf(list(range(4)), 2, epsilon=1.0, scale_factor=0.5)
    assert not laplace.holds and laplace.worst == pytest.approx(2.0)
    assert laplace.delta_at_claim > 0.0
    gauss = audit_ecdf(list(range(4)), 2, epsilon=None, rho=0.5, scale_factor=0.5)
    assert not gauss.holds and gauss.worst == pytest.approx(1.0, rel=1e-6)


def test_exact_privacy_loss_matches_sampled_releases() -> None:
    # The exact PLD is the distribution of log P[V|c]/P[V|c'] at V = release_counts(c):
    # sample the library's release and compare the empirical distribution with the exact one.
    c, c2 = np.array([1, 0, 2, 0]), np.array([0, 1, 2, 0])
    release = release_counts(c, 1.0, "replace_one", rng=seeded_rng(0))
    scale = release.noise_param
    exact = laplace_privacy_loss(c, c2, scale)
    depth = release.depth
    theta = np.concatenate(node_counts_from_leaves(c, depth))
    theta2 = np.concatenate(node_counts_from_leaves(c2, depth))
    rng = seeded_rng(1)
    trials = 4000
    eta = discrete_laplace(scale, (trials, theta.size), rng)
    v = theta + eta
    loss = (np.abs(v - theta2) - np.abs(v - theta)).sum(axis=1) / float(scale)
    for value, prob in zip(exact.losses.tolist(), exact.probs.tolist(), strict=True):
        freq = float(np.mean(np.isclose(loss, value)))
        assert abs(freq - prob) < 5 * math.sqrt(prob * (1 - prob) / trials) + 1e-3


def test_renyi_divergence_of_integer_orders_is_the_continuous_value() -> None:
    # For integer alpha the shifted theta-function sum equals the normaliser: D = alpha d^2/(2s2)
    c, c2 = np.array([1, 0]), np.array([0, 1])
    sigma2 = Fraction(9, 4)
    changed = 2  # replace-one on two leaves moves two nodes by 1
    value = gaussian_renyi_divergence(c, c2, sigma2, 3.0)
    assert value == pytest.approx(3.0 * changed / (2 * 9 / 4), rel=1e-12)
    assert gaussian_renyi_divergence(c, c2, sigma2, 2.5) <= 2.5 * changed / (2 * 9 / 4)


@pytest.mark.parametrize("sigma2", [0.25, 1.0, 4.0, 9.0])
@pytest.mark.parametrize("alpha", [4.0, 16.0, 64.0])
def test_renyi_divergence_is_exact_at_large_orders(sigma2: float, alpha: float) -> None:
    """Audit finding: the summation window was centred at (1 - alpha) d instead of alpha d, so
    at alpha = 64, sigma^2 = 1 the divergence came out 39.8 instead of 64 (an underestimate)."""
    c, c2 = np.array([1, 0]), np.array([0, 1])
    value = gaussian_renyi_divergence(c, c2, sigma2, alpha)
    assert value == pytest.approx(2 * alpha / (2 * sigma2), rel=1e-12)


def test_bad_input_is_named() -> None:
    """Audit finding: these came from inside fractions, builtins or numpy, or returned NaN."""
    with pytest.raises(ValueError, match="scale_factor"):
        audit_ecdf([0, 1], 1, scale_factor=float("nan"))
    with pytest.raises(ValueError, match="scale_factor"):
        audit_ecdf([0, 1], 1, scale_factor=-1.0)
    with pytest.raises(ValueError, match="alphas"):
        audit_ecdf([0, 1], 1, epsilon=None, rho=0.5, alphas=())
    with pytest.raises(ValueError, match="alphas"):
        audit_ecdf([0, 1], 1, epsilon=None, rho=0.5, alphas=(0.5,))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="sigma2"):
            gaussian_renyi_divergence([1], [0], bad, 2.0)
    with pytest.raises(TypeError, match="parameter"):
        audit_sampler("laplace", "abc")  # type: ignore[arg-type]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="size"):
        audit_ecdf([0, 1], 0)
    with pytest.raises(ValueError, match="neighbouring"):
        audit_ecdf([0, 1], 1, neighbouring="swap")
    with pytest.raises(ValueError, match="counts"):
        laplace_privacy_loss([1, 0], [1, 0, 0], 1.0)
    with pytest.raises(ValueError, match="alpha"):
        gaussian_renyi_divergence([1], [0], 1.0, 1.0)
    with pytest.raises(ValueError, match="kind"):
        audit_sampler("cauchy", 1.0)
    with pytest.raises(ValueError, match="samples"):
        audit_sampler("laplace", 1.0, 10)


@pytest.mark.parametrize(("kind", "parameter"), [("laplace", Fraction(5, 2)), ("gaussian", 4)])
def test_samplers_match_their_exact_pmf(kind: str, parameter: float) -> None:
    result = audit_sampler(kind, parameter, 60_000, rng=seeded_rng(3))
    assert result.p_value > 1e-4
    if kind == "laplace":
        assert result.claimed_epsilon == pytest.approx(0.4)
        assert result.epsilon_lower_bound < result.claimed_epsilon
        assert result.epsilon_lower_bound > 0.25  # the audit can see the true epsilon


def test_a_sampler_with_a_third_of_the_scale_is_caught() -> None:
    def broken(scale, size, rng):  # the stated scale, sampled at a third of it
        return discrete_laplace(Fraction(scale) / 3, size, rng)

    result = audit_sampler("laplace", Fraction(5, 2), 60_000, rng=seeded_rng(4), sampler=broken)
    assert result.p_value < 1e-6
    assert result.epsilon_lower_bound > result.claimed_epsilon
