"""The private channel second moment (clipless.features.release_channel_moment), the whitening
built from it, InputNorm's whitening, and their accounting by the engine."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from torch.utils.data import DataLoader, TensorDataset

import clipless
from clipless import nn
from clipless.engine import MechanismSpec, input_release_labels, input_releases
from clipless.features import release_channel_moment, release_mean, whitening
from clipless.nn.export import PlainInputNorm


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-30, 30, 64, dtype=torch.float64)
    x = torch.randn(64, 3, 2, 2, generator=gen, dtype=torch.float64) * scales[:, None, None, None]
    x[5] = 0.0  # a zero sample contributes nothing
    return x


def _symmetric_noise(channels: int, seed: int) -> torch.Tensor:
    z = torch.randn(
        channels, channels, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    ).triu()
    return z + z.triu(1).T


def test_release_is_the_noisy_channel_moment_of_unit_samples_over_n() -> None:
    x = _rows()
    out = release_channel_moment(x, 7.0, generator=torch.Generator().manual_seed(4))
    expected = torch.zeros(3, 3, dtype=torch.float64)
    for sample in x:  # a plain loop over samples and positions: the reference
        norm = float(sample.norm())
        if norm == 0.0:
            continue
        u = (sample / norm).reshape(3, 4)
        for p in range(4):
            expected += torch.outer(u[:, p], u[:, p])
    expected = (expected + 7.0 * _symmetric_noise(3, 4)) / 64
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)
    assert out.dtype == torch.float64 and torch.equal(out, out.T)
    # float32 inputs and a flat sample (D channels of one position); num_samples divides
    flat = x.flatten(1).float()
    out32 = release_channel_moment(
        flat, 2.0, generator=torch.Generator().manual_seed(1), num_samples=128
    )
    units = x.flatten(1) / x.flatten(1).norm(dim=1, keepdim=True).clamp_min(1e-300)
    reference = (units.T @ units + 2.0 * _symmetric_noise(12, 1)) / 128
    torch.testing.assert_close(out32, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_sample_moves_the_released_moment_by_at_most_one(dtype: torch.dtype) -> None:
    """Add/remove sensitivity 1 (Frobenius, so also of the upper triangle) of the computed sum,
    on adversarial rows: huge, tiny, aligned, and one sample with all its mass in one channel."""
    x = _rows().to(dtype)
    x[10:20] = x[10]  # many copies of one direction: the largest sums
    x[30] = 0.0
    x[30, 1] = 1e20  # one channel at every position: ||U U^T||_F = 1 exactly
    for i in (0, 10, 30, 63):
        rest = torch.cat([x[:i], x[i + 1 :]])
        # the public n (64) is the same for both neighbours, so is the normalisation radius
        gen = torch.Generator().manual_seed(9)
        full = release_channel_moment(x, 1.0, generator=gen, num_samples=64)
        gen = torch.Generator().manual_seed(9)
        less = release_channel_moment(rest, 1.0, generator=gen, num_samples=64)
        # the same noise: the difference is the difference of the computed sums
        diff = 64 * (full - less)
        assert float(diff.norm()) <= 1.0 + 1e-12
    # the one-channel sample uses the whole sensitivity
    alone = release_channel_moment(x[30:31], 1.0, generator=torch.Generator().manual_seed(2))
    assert float((alone - _symmetric_noise(3, 2)).norm()) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize(("n", "channels", "positions"), [(500, 81, 49), (2000, 64, 1)])
def test_release_is_exactly_symmetric_on_wide_inputs(n: int, channels: int, positions: int) -> None:
    """The lower triangle is the upper one's mirror bit for bit. A computed ``U U^T`` is not
    symmetric in floating point (these shapes give ``|M - M^T|`` up to ~1e-17 unmirrored), and its
    asymmetry is a noiseless function of the data that a release must not contain."""
    x = torch.randn(n, channels, positions, generator=torch.Generator().manual_seed(0))
    out = release_channel_moment(x, 20.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, out.T)


def test_noise_has_the_stated_scale_and_is_symmetric() -> None:
    x = torch.ones(10, 150, 1, dtype=torch.float64)
    out = release_channel_moment(x, 3.0, generator=torch.Generator().manual_seed(1))
    residual = out * 10 - torch.full((150, 150), 10 / 150, dtype=torch.float64)
    upper = residual[torch.triu_indices(150, 150).unbind()]
    assert float(upper.std()) == pytest.approx(3.0, rel=0.03)
    assert torch.equal(out, out.T)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="noise_multiplier"):
        release_channel_moment(torch.ones(3, 2), 0.0)
    with pytest.raises(ValueError, match="inputs must be a non-empty"):
        release_channel_moment(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="floating point"):
        release_channel_moment(torch.ones(3, 2, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="finite"):
        release_channel_moment(torch.tensor([[1.0, math.nan]]), 1.0)
    with pytest.raises(ValueError, match="num_samples"):
        release_channel_moment(torch.ones(3, 2), 1.0, num_samples=0)
    with pytest.raises(ValueError, match="num_samples must be at least"):
        release_channel_moment(torch.ones(5, 2), 1.0, num_samples=3)
    with pytest.raises(ValueError, match="moment must be a square"):
        whitening(torch.ones(2, 3))
    with pytest.raises(ValueError, match="shrink"):
        whitening(torch.eye(2), shrink=0.0)
    with pytest.raises(ValueError, match="go together"):
        whitening(torch.eye(2), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="num_samples"):
        whitening(torch.eye(2), noise_multiplier=1.0, num_samples=0)
    with pytest.raises(ValueError, match="center must have"):
        whitening(torch.eye(2), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="whiten and whiten_noise go together"):
        nn.InputNorm(1.0, "sphere", whiten=torch.eye(2))
    with pytest.raises(ValueError, match="square"):
        nn.InputNorm(1.0, "sphere", whiten=torch.ones(2, 3), whiten_noise=1.0)
    with pytest.raises(ValueError, match="whiten_noise"):
        nn.InputNorm(1.0, "sphere", whiten=torch.eye(2), whiten_noise=-1.0)
    layer = nn.InputNorm(1.0, "sphere", whiten=torch.eye(2), whiten_noise=1.0)
    with pytest.raises(ValueError, match="channels"):
        layer(torch.ones(4, 3, 5))


def test_whitening_is_the_shrunk_inverse_square_root_of_the_centred_covariance() -> None:
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    moment = a @ a.T + 0.5 * torch.eye(4, dtype=torch.float64)
    center = torch.randn(4, 3, generator=gen, dtype=torch.float64) * 0.1
    cov = moment - center @ center.T
    lam, vecs = torch.linalg.eigh(cov)
    for shrink in (0.3, 1.0, 3.0):
        w = whitening(moment, center, shrink)
        d = (lam + shrink * lam.mean()).rsqrt()
        expected = (vecs * (d / d.max())) @ vecs.T
        torch.testing.assert_close(w, expected, rtol=1e-10, atol=1e-12)
        # non-expansive, exactly 1 on the least-varying direction
        assert float(torch.linalg.matrix_norm(w, ord=2)) == pytest.approx(1.0, rel=1e-12)
        # it equalises the spread: W cov W has a smaller condition number than cov
        spread = torch.linalg.eigvalsh(w @ cov @ w)
        assert float(spread[-1] / spread[0]) < float(lam[-1] / lam[0])
    # a large shrink tends to the identity; negative (noise) eigenvalues are treated as 0
    torch.testing.assert_close(
        whitening(moment, center, 1e9), torch.eye(4, dtype=torch.float64), atol=1e-8, rtol=0
    )
    indefinite = torch.diag(torch.tensor([-1.0, 0.0, 2.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(
        whitening(indefinite, shrink=1.0),
        torch.diag(torch.tensor([1.0, 1.0, 1 / 3, 1 / 3], dtype=torch.float64).sqrt()),
    )
    assert torch.equal(whitening(torch.zeros(3, 3)), torch.eye(3, dtype=torch.float64))
    # the release's noise floor 2 z sqrt(C) / n: here 2 * 10 * 2 / 10 = 4 > shrink * mean = 1
    floored = whitening(indefinite, shrink=1.0, noise_multiplier=10.0, num_samples=10)
    torch.testing.assert_close(
        floored, torch.diag(torch.tensor([1.0, 1.0, 4 / 6, 4 / 6], dtype=torch.float64).sqrt())
    )
    # ... and no effect when it is below the shrinkage (z = 1, n = 1000: floor 0.004 < 1)
    torch.testing.assert_close(
        whitening(indefinite, noise_multiplier=1.0, num_samples=1000), whitening(indefinite)
    )


def test_input_norm_whitens_then_projects_and_its_twin_agrees() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 3, 2, 2, generator=gen) * 10
    mu = release_mean(x, 2.0, generator=torch.Generator().manual_seed(1))
    w = whitening(release_channel_moment(x, 2.0, generator=gen), mu)
    layer = nn.InputNorm(2.0, "sphere", center=mu, center_noise=2.0, whiten=w, whiten_noise=4.0)
    out = layer(x)
    u = x / x.flatten(1).norm(dim=1)[:, None, None, None] - mu
    mixed = torch.einsum("cd,ndhw->nchw", w.float(), u)
    expected = 2.0 * mixed / mixed.flatten(1).norm(dim=1)[:, None, None, None]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert float(out.flatten(1).norm(dim=1).max()) <= 2.0  # the certified bound holds
    assert layer.releases == (("input mean", 2.0), ("input second moment", 4.0))
    assert layer.lipschitz() == math.inf and layer.output_bound(123.0) == 2.0
    twin = layer.vanilla_export()
    assert isinstance(twin, PlainInputNorm)
    torch.testing.assert_close(twin(x), out)
    # whitening without centring normalises first too; the state dict round-trips
    alone = nn.InputNorm(1.0, "ball", whiten=w, whiten_noise=4.0)
    unit = x / x.flatten(1).norm(dim=1)[:, None, None, None]
    ref = torch.einsum("cd,ndhw->nchw", w.float(), unit)
    torch.testing.assert_close(alone(x), ref, rtol=1e-5, atol=1e-6)
    other = nn.InputNorm(
        1.0, "ball", whiten=torch.zeros(3, 3, dtype=torch.float64), whiten_noise=4.0
    )
    other.load_state_dict(alone.state_dict())
    assert torch.equal(other.whiten, alone.whiten) and other.releases == alone.releases


def _private(
    engine: clipless.PrivacyEngine,
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    batch: int,
    epsilon: float,
    steps: int,
) -> tuple[Any, Any, Any]:
    """``engine.make_private`` of an SGD model on ``(x, y)`` (no constraint, delta 1e-5)."""
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
        loss=nn.CrossEntropyLoss(),
        target_epsilon=epsilon,
        target_delta=1e-5,
        steps=steps,
        mechanism=MechanismSpec(constraint=None),
    )


def _train(model: Any, opt: Any, loader: Any) -> None:
    for xb, yb in loader:
        opt.zero_grad()
        nn.CrossEntropyLoss(reduction="sum")(model(xb), yb).backward()
        opt.step()


def test_engine_composes_both_releases_with_the_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 6, generator=gen), torch.randint(0, 3, (200,), generator=gen)
    mu = release_mean(x, 5.0, generator=torch.Generator().manual_seed(1))
    w = whitening(release_channel_moment(x, 8.0, generator=torch.Generator().manual_seed(2)), mu)
    norm = nn.InputNorm(1.0, "sphere", center=mu, center_noise=5.0, whiten=w, whiten_noise=8.0)
    model = nn.Sequential(norm, nn.Linear(6, 3, bias=False))
    assert input_releases(model) == (5.0, 8.0)
    assert input_release_labels(model) == (("input mean", 5.0), ("input second moment", 8.0))
    engine = clipless.PrivacyEngine(seed=0)
    model, opt, loader = _private(engine, model, x, y, lr=0.1, batch=20, epsilon=2.0, steps=10)
    assert engine.config["releases"] == [5.0, 8.0]
    assert [r.label for r in engine.ledger.releases] == ["input mean", "input second moment"]
    sigma, q = engine.config["noise_multiplier"], engine.config["sample_rate"]
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.GaussianDpEvent(5.0))
    acc.compose(dp_event.GaussianDpEvent(8.0))
    assert engine.get_epsilon(1e-5) == pytest.approx(float(acc.get_epsilon(1e-5)), rel=1e-9)
    _train(model, opt, loader)
    acc.compose(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), engine.ledger.steps
    )
    assert engine.get_epsilon(1e-5) == pytest.approx(float(acc.get_epsilon(1e-5)), rel=1e-9)


def _whitened_layer(x: torch.Tensor, radius: float = 2.0) -> nn.InputNorm:
    mu = release_mean(x, 2.0, generator=torch.Generator().manual_seed(1))
    w = whitening(release_channel_moment(x, 2.0, generator=torch.Generator().manual_seed(2)), mu)
    return nn.InputNorm(radius, "sphere", center=mu, center_noise=2.0, whiten=w, whiten_noise=4.0)


def test_premapped_inputs_give_the_full_map_and_keep_the_bound() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(11, 3, 2, 2, generator=gen) * 10
    layer = _whitened_layer(x)
    full = layer(x)
    z = x.clone()
    assert layer.premap_(z, batch_size=4) is z and layer.inputs_premapped
    torch.testing.assert_close(z, full, rtol=0, atol=0)  # per-sample map: batching changes nothing
    torch.testing.assert_close(layer(z), full, rtol=1e-6, atol=0)  # a second projection: rounding
    assert "inputs_premapped=True" in repr(layer)
    # the projection still certifies the bound when raw (unmapped) data is fed by mistake
    wild = torch.randn(5, 3, 2, 2, generator=gen) * 1e6
    assert float(layer(wild).flatten(1).norm(dim=1).max()) <= 2.0
    # the flag is not state: a reloaded layer and the twin map raw inputs
    fresh = _whitened_layer(torch.ones(1, 3, 2, 2))
    fresh.load_state_dict(layer.state_dict())
    assert not fresh.inputs_premapped
    torch.testing.assert_close(fresh(x), full, rtol=0, atol=0)
    torch.testing.assert_close(layer.vanilla_export()(x), full, rtol=0, atol=0)
    with pytest.raises(ValueError, match="samples have shape"):
        layer.premap_(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="floating"):
        layer.premap_(torch.zeros(2, 3, 2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch_size"):
        layer.premap_(x.clone(), batch_size=0)


def test_training_on_premapped_data_matches_training_on_raw_data() -> None:
    """The same seeds, raw features through the full map or premapped ones through the projection:
    the same steps, the same epsilon and (to rounding) the same weights."""
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(120, 3, 2, 2, generator=gen), torch.randint(0, 4, (120,), generator=gen)
    results = []
    for premap in (False, True):
        torch.manual_seed(0)
        layer = _whitened_layer(x, radius=1.0)
        model = nn.Sequential(layer, nn.Flatten(), nn.Linear(12, 4, bias=False))
        data = x.clone()
        if premap:
            layer.premap_(data)
        engine = clipless.PrivacyEngine(seed=3)
        model, opt, loader = _private(
            engine, model, data, y, lr=0.5, batch=30, epsilon=3.0, steps=8
        )
        _train(model, opt, loader)
        weight = next(p for p in model.parameters()).detach().clone()
        results.append((weight, engine.get_epsilon(1e-5), engine.ledger.steps))
    (raw, eps_raw, steps_raw), (mapped, eps_mapped, steps_mapped) = results
    assert steps_raw == steps_mapped > 0 and eps_raw == eps_mapped
    torch.testing.assert_close(mapped, raw, rtol=1e-5, atol=1e-6)
    assert float((mapped - raw).abs().max()) < 1e-3 * float(raw.abs().max())
