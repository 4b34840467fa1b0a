"""One-run audit (Steinke, Nasr and Jagielski 2023): the p-value, its inversion, a training run."""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import numpy as np
import pytest
from scipy import stats

from clipless import mechanism
from clipless.audit.one_run import audit_one_run, one_run_epsilon_lower_bound, one_run_p_value


def test_p_value_without_delta_is_the_binomial_tail() -> None:
    q = 1 / (1 + math.exp(-0.7))
    assert one_run_p_value(500, 60, 41, 0.7, 0.0) == pytest.approx(stats.binom.sf(40, 60, q))
    # delta adds 2 m delta max_i P[v-i <= Bin < v] / i (brute force over i)
    pmf = stats.binom.pmf(np.arange(41), 60, q)
    worst = max(pmf[41 - i : 41].sum() / i for i in range(1, 42))
    expected = stats.binom.sf(40, 60, q) + 2 * 500 * 1e-4 * worst
    assert one_run_p_value(500, 60, 41, 0.7, 1e-4) == pytest.approx(expected)


def test_lower_bound_inverts_the_p_value() -> None:
    # all r guesses right, delta = 0: the bound solves q^r = beta exactly
    r, beta = 50, 0.05
    q = beta ** (1 / r)
    exact = math.log(q / (1 - q))
    assert one_run_epsilon_lower_bound(1000, r, r, 0.0, 0.95) == pytest.approx(exact, rel=1e-9)
    assert one_run_epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0  # chance level: nothing
    # more correct guesses, larger bound; delta only lowers it
    values = [one_run_epsilon_lower_bound(1000, 100, v, 1e-5) for v in (60, 70, 80, 90)]
    assert values == sorted(values) and values[0] < values[-1]
    assert one_run_epsilon_lower_bound(1000, 100, 90, 1e-3) < values[-1]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="v <= r <= m"):
        one_run_p_value(10, 20, 5, 1.0, 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        one_run_p_value(10, 5, 5, math.nan, 0.0)
    with pytest.raises(ValueError, match="guesses"):
        audit_one_run(np.zeros((10, 2)), np.zeros(10, dtype=int), canaries=10, guesses=11)


@pytest.mark.parametrize(
    ("x", "y", "kwargs", "match"),
    [
        (np.zeros((0, 4)), np.zeros(0, dtype=int), {}, "n >= 1"),
        (np.full((4, 2), np.nan), np.zeros(4, dtype=int), {}, "finite"),
        (np.ones((4, 2)), np.array([0.2, 0.7, 0.0, 1.0]), {}, "integer class labels"),
        (np.ones((4, 2)), np.array([0, -1, 0, 1]), {}, "integer class labels"),
        (np.ones((4, 2)), np.zeros(4, dtype=int), {"radius": -1.0}, "radius"),
        (np.zeros((4, 2)), np.zeros(4, dtype=int), {}, "radius"),
        (np.ones((4, 2)), np.zeros(4, dtype=int), {"confidence": 1.5}, "confidence"),
        (np.ones((4, 2)), np.zeros(4, dtype=int), {"delta": 0.0}, "delta"),
        (np.ones((4, 2)), np.zeros(4, dtype=int), {"seed": -3}, "seed"),
    ],
)
def test_bad_input_is_named_before_training(
    x: np.ndarray, y: np.ndarray, kwargs: dict, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit finding: empty data and NaN raised from inside torch, fractional labels were cast
    to a one-class model, and confidence was checked only after the whole training run."""
    import clipless.training

    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking its arguments")

    monkeypatch.setattr(clipless.training, "fit", no_training)
    with pytest.raises((ValueError, TypeError), match=match):
        audit_one_run(x, y, canaries=10, guesses=4, **kwargs)


def test_leaves_the_global_rng_alone() -> None:
    import torch

    x, y = _data(20, 3)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    audit_one_run(x, y, canaries=10, guesses=4, epsilon=1.0, epochs=1, batch_size=10)
    assert torch.equal(torch.rand(3), expected)


def _data(n: int = 100, d: int = 10) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d))
    return x, (x @ rng.normal(size=d) > 0).astype(int)


def test_a_private_run_stays_below_its_claim() -> None:
    x, y = _data()
    result = audit_one_run(x, y, canaries=100, guesses=40, epsilon=1.0, epochs=8, batch_size=50)
    assert result.claimed_epsilon <= 1.0
    assert result.epsilon_lower_bound < result.claimed_epsilon


def test_a_training_pipeline_without_noise_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noise 1000 times too small. With independent canary and noise streams, 200 canaries and
    40 guesses caught it on one seed of five (lower bounds 0.58-1.12); 400 and 80 catch it on
    all five (seeds 0-4: 1.79, 1.46, 1.37, 1.05, 1.37 against a claim of 1.0)."""
    real = mechanism.plan_step

    def broken(*args, **kwargs):
        plan = real(*args, **kwargs)
        stds = MappingProxyType({k: v * 1e-3 for k, v in plan.stds.items()})
        return dataclasses.replace(plan, stds=stds)

    monkeypatch.setattr(mechanism, "plan_step", broken)
    x, y = _data()
    result = audit_one_run(
        x,
        y,
        canaries=400,
        guesses=80,
        epsilon=1.0,
        epochs=60,
        batch_size=50,
        hidden=(64, 64),
        lr=0.2,
    )
    assert result.epsilon_lower_bound > result.claimed_epsilon


def test_the_audit_does_not_warn_about_its_own_seeded_engine() -> None:
    """Its engine is seeded on purpose (an experiment, never a release; issue 38)."""
    import warnings

    x, y = _data(20, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        audit_one_run(x, y, canaries=10, guesses=4, epsilon=1.0, epochs=1, batch_size=10, seed=3)
