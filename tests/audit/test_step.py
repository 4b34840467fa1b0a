"""Mechanism-level audit of a training step (clipless.audit.step)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType

import pytest

from clipless import mechanism
from clipless.audit import audit_step
from clipless.cli import main

TRIALS = 4000


@pytest.mark.parametrize(
    ("mode", "noise"),
    [("per-sample", "global"), ("bound", "global"), ("threshold", "per-layer")],
)
def test_rigorous_modes_lower_bound_below_the_claim_and_canary_is_tight(
    mode: str, noise: str
) -> None:
    result = audit_step(mode, noise=noise, trials=TRIALS, seed=11)
    assert result.proven
    assert result.epsilon_lower_bound < result.claimed_epsilon
    # the canary reaches the certified sensitivity (a weak canary would make the audit vacuous)
    # and never exceeds it (the noise-free half of the audit)
    assert 0.95 <= result.sensitivity_ratio <= 1.0 + 1e-9
    assert result.epsilon_lower_bound > 0.0


def test_composition_over_steps_is_below_the_claim() -> None:
    one = audit_step("per-sample", trials=TRIALS, seed=2)
    four = audit_step("per-sample", trials=TRIALS, steps=4, seed=2)
    assert four.claimed_epsilon > one.claimed_epsilon
    assert four.epsilon_lower_bound < four.claimed_epsilon


def test_a_mechanism_with_ten_times_too_little_noise_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = mechanism.plan_step

    def broken(*args, **kwargs):
        plan = real(*args, **kwargs)
        stds = MappingProxyType({k: v / 10 for k, v in plan.stds.items()})
        return dataclasses.replace(plan, stds=stds)

    monkeypatch.setattr(mechanism, "plan_step", broken)
    result = audit_step("per-sample", trials=TRIALS, seed=5)
    assert result.epsilon_lower_bound > result.claimed_epsilon
    assert result.sensitivity_ratio > 9.0  # relative to the (broken) noise actually drawn


def test_batch_max_leaks_beyond_its_claim() -> None:
    with pytest.raises(ValueError, match="allow_unproven"):
        audit_step("batch-max", trials=TRIALS)
    result = audit_step("batch-max", trials=TRIALS, allow_unproven=True, seed=3)
    assert not result.proven
    assert result.sensitivity_ratio > 5.0
    assert result.epsilon_lower_bound > result.claimed_epsilon
    assert any("NOT a guarantee" in line for line in result.lines())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "nope"}, "mode"),
        ({"trials": 3}, "trials"),
        ({"steps": 0}, "steps"),
        ({"delta": 0.0}, "delta"),
        ({"confidence": 1.0}, "confidence"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"radius": -1.0}, "radius"),
        ({"seed": -1}, "seed"),
        ({"noise": "loud"}, "noise"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        audit_step(**kwargs)


def test_cli_prints_claim_and_lower_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "audit.png"
    argv = ["audit", "--mode", "bound", "--trials", "2000", "--seed", "1", "--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    claim = next(line for line in out.splitlines() if line.startswith("claimed epsilon:"))
    lower = next(line for line in out.splitlines() if line.startswith("empirical lower bound:"))
    assert float(lower.split()[3]) < float(claim.split()[2])
    assert "95% confidence" in lower
    assert plot.is_file() and plot.stat().st_size > 1000


def test_cli_batch_max_needs_allow_unproven_and_then_exceeds_its_claim(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["audit", "--mode", "batch-max", "--trials", "2000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-unproven" in err
    argv = ["audit", "--mode", "batch-max", "--allow-unproven", "--trials", "2000", "--seed", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    claim = next(line for line in out.splitlines() if line.startswith("claimed epsilon:"))
    lower = next(line for line in out.splitlines() if line.startswith("empirical lower bound:"))
    assert float(lower.split()[3]) > float(claim.split()[2])
