"""One-run audit with white-box gradient canaries (Steinke, Nasr and Jagielski 2023, section 6)."""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import pytest
import torch
from scipy.linalg import hadamard

from clipless import mechanism
from clipless.audit import audit_gradient_canaries, planned_guesses
from clipless.audit.bounds import gaussian_dp_epsilon
from clipless.audit.gradient_canaries import _Directions, _fwht
from clipless.audit.one_run import one_run_epsilon_lower_bound


def test_fwht_is_the_sylvester_hadamard_matrix() -> None:
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    h = torch.as_tensor(hadamard(64), dtype=torch.float64)
    torch.testing.assert_close(_fwht(x), x @ h.T, rtol=0, atol=1e-12)


def test_directions_are_orthonormal_and_combine_and_project_are_adjoint() -> None:
    """The canaries' directions in one tensor: exactly orthonormal, so one canary's score sees
    none of the others' gradients; ``combine`` is ``U w`` and ``project`` is ``U^T x``."""
    size, m = 300, 100  # 300 is not a power of two: 256 random coordinates carry them
    d = _Directions.draw(size, m, torch.Generator().manual_seed(0))
    u = torch.stack([d.combine(torch.eye(m, dtype=torch.float64)[i], size) for i in range(m)])
    torch.testing.assert_close(u @ u.T, torch.eye(m, dtype=torch.float64), rtol=0, atol=1e-12)
    assert int((u != 0).sum(dim=1).min()) == 256  # dense on their support
    x = torch.randn(size, dtype=torch.float64)
    torch.testing.assert_close(d.project(x), u @ x, rtol=0, atol=1e-12)


def test_planned_guesses_maximise_the_expected_bound() -> None:
    # no signal: any r gives nothing; strong signal: many guesses pay
    assert planned_guesses(4.0, 1000, 1e-5, 0.95) > planned_guesses(0.5, 1000, 1e-5, 0.95)
    r = planned_guesses(1.0, 1000, 1e-5, 0.95)
    assert r % 2 == 0 and 2 <= r <= 1000


@pytest.mark.parametrize("noise", ["global", "per-layer"])
def test_the_canaries_sit_exactly_at_the_claimed_sensitivity(noise: str) -> None:
    """At q = 1 a release is a Gaussian mechanism whose epsilon is fixed by the canary's
    whitened norm mu: mu-GDP at the claim's delta must give back the claimed epsilon (the
    canary is the worst case the claim covers, and no worse)."""
    result = audit_gradient_canaries(2.0, canaries=64, width=8, noise=noise, steps=3, seed=0)
    assert gaussian_dp_epsilon(result.canary_mu, 1e-5) == pytest.approx(
        result.claimed_epsilon, rel=2e-3
    )


@pytest.mark.parametrize(
    ("epsilon", "mode", "noise", "seed"),
    [
        (1.0, "per-sample", "global", 0),
        (2.0, "bound", "per-layer", 1),
        (8.0, "threshold", "global", 2),
        (8.0, "per-sample", "per-layer", 3),
    ],
)
def test_a_correct_mechanism_stays_below_its_claim_and_is_informative(
    epsilon: float, mode: str, noise: str, seed: int
) -> None:
    result = audit_gradient_canaries(epsilon, mode=mode, noise=noise, seed=seed)
    assert result.claimed_epsilon <= epsilon
    assert 0.3 * result.claimed_epsilon < result.epsilon_lower_bound <= result.claimed_epsilon
    assert not result.violated
    assert result.epsilon_lower_bound == one_run_epsilon_lower_bound(
        4096, result.guesses, result.correct, 1e-5, 0.95
    )


@pytest.mark.parametrize("epsilon", [1.0, 2.0])
def test_noise_four_times_too_small_is_caught(
    epsilon: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every plan's noise scaled down 4x (the claim unchanged): the bound exceeds the claim."""
    real = mechanism.plan_step

    def broken(*args, **kwargs):
        plan = real(*args, **kwargs)
        stds = MappingProxyType({k: v / 4 for k, v in plan.stds.items()})
        return dataclasses.replace(plan, stds=stds)

    monkeypatch.setattr(mechanism, "plan_step", broken)
    result = audit_gradient_canaries(epsilon, seed=0)
    assert result.violated and result.epsilon_lower_bound > result.claimed_epsilon


def test_reproducible_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = audit_gradient_canaries(1.0, canaries=64, width=8, guesses=20, seed=5)
    assert torch.equal(torch.rand(3), expected)
    b = audit_gradient_canaries(1.0, canaries=64, width=8, guesses=20, seed=5)
    assert a == b and a.guesses == 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": math.inf}, "epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"confidence": 0.0}, "confidence"),
        ({"canaries": 1}, "canaries"),
        ({"canaries": 100, "width": 8}, "width"),
        ({"width": 7, "canaries": 16}, "width"),
        ({"guesses": 3}, "guesses"),
        ({"guesses": 8192}, "guesses"),
        ({"steps": 0}, "steps"),
        ({"seed": -1}, "seed"),
        ({"mode": "clip"}, "mode"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        audit_gradient_canaries(**kwargs)


def test_batch_max_is_sent_to_the_step_audit() -> None:
    with pytest.raises(ValueError, match="audit_step"):
        audit_gradient_canaries(1.0, canaries=16, width=8, mode="batch-max", seed=0)
