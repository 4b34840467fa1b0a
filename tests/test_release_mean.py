"""The private input mean (clipless.features.release_mean) and its accounting by the engine."""

from __future__ import annotations

import math

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from torch.utils.data import DataLoader, TensorDataset

import clipless
from clipless import nn
from clipless.engine import MechanismSpec, input_releases
from clipless.features import release_mean


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-30, 30, 64, dtype=torch.float64)
    x = torch.randn(64, 3, 4, generator=gen, dtype=torch.float64) * scales[:, None, None]
    x[5] = 0.0  # a zero sample contributes nothing
    return x


def test_release_is_the_noisy_sum_of_unit_samples_over_n() -> None:
    x = _rows()
    out = release_mean(x, 7.0, generator=torch.Generator().manual_seed(4))
    norms = x.flatten(1).norm(dim=1)
    unit = torch.where(norms[:, None, None] > 0, x / norms.clamp_min(1e-300)[:, None, None], 0.0)
    noise = torch.randn((3, 4), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = (unit.sum(0) + 7.0 * noise) / 64
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)
    assert out.shape == (3, 4) and out.dtype == torch.float64
    # float32 inputs: summed in float64, returned in float32; num_samples divides
    out32 = release_mean(
        x.float(), 7.0, generator=torch.Generator().manual_seed(4), num_samples=128
    )
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_sample_moves_the_released_sum_by_at_most_one(dtype: torch.dtype) -> None:
    """Add/remove sensitivity 1 of the computed sum, on adversarial rows (huge, tiny, aligned)."""
    x = _rows().to(dtype)
    x[10:20] = x[10]  # many copies of one direction: the largest sums
    for i in (0, 10, 33, 63):
        rest = torch.cat([x[:i], x[i + 1 :]])
        # the public n is the same for both neighbours, so is the normalisation radius
        full = release_mean(x, 1.0, generator=torch.Generator().manual_seed(9), num_samples=64)
        less = release_mean(rest, 1.0, generator=torch.Generator().manual_seed(9), num_samples=64)
        # the same noise: the difference is the difference of the computed sums (over n)
        assert float(64 * (full.double() - less.double()).norm()) <= 1.0 + (
            64 * 4e-7 if dtype == torch.float32 else 1e-13  # the *result*'s own rounding
        )


def test_noise_has_the_stated_scale() -> None:
    x = torch.ones(10, 20000, dtype=torch.float64)
    out = release_mean(x, 3.0, generator=torch.Generator().manual_seed(1))
    residual = out * 10 - x[0] / math.sqrt(20000) * 10
    assert float(residual.std()) == pytest.approx(3.0, rel=0.03)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="noise_multiplier"):
        release_mean(torch.ones(3, 2), 0.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        release_mean(torch.ones(3, 2), math.inf)
    with pytest.raises(ValueError, match="inputs must be a non-empty"):
        release_mean(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="floating point"):
        release_mean(torch.ones(3, 2, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="finite"):
        release_mean(torch.tensor([[1.0, math.nan]]), 1.0)
    with pytest.raises(ValueError, match="num_samples"):
        release_mean(torch.ones(3, 2), 1.0, num_samples=0)
    with pytest.raises(ValueError, match="num_samples must be at least"):
        release_mean(torch.ones(5, 2), 1.0, num_samples=3)  # more than n + 1 rows
    with pytest.raises(ValueError, match="num_samples must be an integer"):
        release_mean(torch.ones(3, 2), 1.0, num_samples=2.9)  # once silently truncated to 2
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number"):
        release_mean(torch.ones(3, 2), True)
    with pytest.raises(ValueError, match="batch_size must be an integer"):
        release_mean(torch.ones(3, 2), 1.0, batch_size=1.5)
    import numpy as np

    out = release_mean(torch.ones(3, 2), np.float64(2.0), num_samples=np.int64(3))
    assert out.shape == (2,)


def test_engine_composes_the_models_release_with_the_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 6, generator=gen), torch.randint(0, 3, (200,), generator=gen)
    mu = release_mean(x, 5.0, generator=torch.Generator().manual_seed(1))
    model = nn.Sequential(
        nn.InputNorm(1.0, "sphere", center=mu, center_noise=5.0), nn.Linear(6, 3, bias=False)
    )
    assert input_releases(model) == (5.0,)
    engine = clipless.PrivacyEngine(seed=0)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=20),
        loss=nn.CrossEntropyLoss(),
        target_epsilon=2.0,
        target_delta=1e-5,
        steps=10,
        mechanism=MechanismSpec(constraint=None),
    )
    config = engine.config
    assert config["releases"] == [5.0]
    sigma, q = config["noise_multiplier"], config["sample_rate"]
    # recorded before any step, and part of every epsilon from then on
    assert engine.ledger.steps == 0 and len(engine.ledger.releases) == 1
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.GaussianDpEvent(5.0))
    assert engine.get_epsilon(1e-5) == pytest.approx(float(acc.get_epsilon(1e-5)), rel=1e-12)
    for xb, yb in loader:
        opt.zero_grad()
        nn.CrossEntropyLoss(reduction="sum")(model(xb), yb).backward()
        opt.step()
    acc.compose(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), engine.ledger.steps
    )
    spent = engine.get_epsilon(1e-5)
    # (PLD composition order differs: equal up to discretisation round-off)
    assert spent == pytest.approx(float(acc.get_epsilon(1e-5)), rel=1e-9)
    # the calibration met the target with the release included, for the planned 10 steps
    planned = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    planned.compose(dp_event.GaussianDpEvent(5.0))
    planned.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), 10)
    assert float(planned.get_epsilon(1e-5)) <= 2.0


def test_a_module_reached_twice_is_one_release() -> None:
    norm = nn.InputNorm(1.0, "sphere", center=torch.zeros(4), center_noise=3.0)
    assert input_releases(nn.Sequential(norm, nn.Linear(4, 2))) == (3.0,)
    assert input_releases(nn.Sequential(nn.InputNorm(1.0), nn.Linear(4, 2))) == ()
