"""Certified layer bounds along real private training trajectories (issue 11).

Every bound the optimizer plans the next step's noise with (the layer's memoised
``lipschitz()``, seeded by the projection or computed by the Cholesky certificate of
:func:`clipless.norms.dense_norm`) must stay above the exact spectral norm (float64 SVD) of the
weight the next forward uses, whether it was certified exactly or carried
(``certify_every > 1``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import clipless
from clipless import constraints
from clipless import nn as cnn
from clipless.engine import MechanismSpec, RunOptions


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _exact(w: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(w.detach().double(), ord=2))


def _train(certify_every: int, lr: float, dtype: torch.dtype, steps: int) -> list[cnn.Linear]:
    torch.manual_seed(0)
    model = cnn.Sequential(
        cnn.InputNorm(1.0),
        cnn.Linear(20, 96),  # min dimension 20: exact SVD
        cnn.GroupSort(2),
        cnn.Linear(96, 80),  # 80 > 64: the Cholesky certificate
        cnn.GroupSort(2),
        cnn.Linear(80, 3),
    ).to(dtype)
    layers = [m for m in model.modules() if isinstance(m, cnn.Linear)]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 20, generator=gen, dtype=dtype)
    y = torch.randint(0, 3, (256,), generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    loss = cnn.CrossEntropyLoss(temperature=0.1)
    engine = clipless.PrivacyEngine(accountant="pld", seed=3)
    model, opt, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=loader,
        loss=loss,
        noise_multiplier=1.0,
        mechanism=MechanismSpec(max_norm=1.0, constraint="clip"),
        options=RunOptions(certify_every=certify_every),
    )
    opt.data_loader = None  # a deterministic trajectory: the test picks the rows
    for step in range(steps):
        idx = torch.arange(32) + 32 * (step % 8)
        opt.zero_grad()
        loss(model(x[idx]), y[idx]).backward()
        opt.step()
        for layer in layers:
            bound = layer.lipschitz()  # what the next step's plan uses
            truth = _exact(layer.weight)
            assert truth <= bound, (step, bound, truth)
            assert bound <= 1.0
            if certify_every == 1 and bound >= 1.0 - 1e-3:
                # clip rescaled: the exact certificate is tight (relative 1e-5)
                assert bound <= truth * (1 + 1e-5), (step, bound / truth)
    return layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_certificates_along_a_trajectory(dtype: torch.dtype) -> None:
    layers = _train(1, lr=0.5, dtype=dtype, steps=10)
    state = constraints.projection_state(layers[1])
    assert state is not None and state.exact_certifications == state.calls


@pytest.mark.parametrize("lr", [1e-4, 0.5])
def test_carried_bounds_along_a_trajectory(lr: float) -> None:
    layers = _train(4, lr=lr, dtype=torch.float32, steps=12)
    state = constraints.projection_state(layers[1])
    assert state is not None
    assert state.calls == 13  # make_private projects once
    if lr < 0.01:  # small steps: the carried bound is used between exact certifications
        assert state.exact_certifications < state.calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rescale_keeps_the_weight_direction(dtype: torch.dtype) -> None:
    """The clip rescale writes ``s W`` (rounded), never anything else (e.g. a zeroed buffer)."""
    layer = cnn.Linear(90, 70).to(dtype)
    with torch.no_grad():
        layer.weight.mul_(7.0)
    before = layer.weight.detach().clone()
    bound = constraints.project(layer, "clip", 1.0)[""]
    after = layer.weight.detach()
    scale = float(after.double().norm() / before.double().norm())
    assert scale == pytest.approx(1 / 7, rel=1e-5)
    torch.testing.assert_close(after, before * scale, rtol=1e-6, atol=0.0)
    assert _exact(after) <= bound <= 1.0
    assert bound >= 1.0 - 1e-5


def test_forward_snapshot_reuses_the_certified_copy() -> None:
    """The optimizer's per-forward weight snapshot is the bound cache's copy (no extra clone),
    and a write through ``.data`` after the forward is still refused at backward."""
    torch.manual_seed(0)
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(6, 8), cnn.GroupSort(2), cnn.Linear(8, 3))
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    loss = cnn.CrossEntropyLoss()
    model, opt, _ = clipless.PrivacyEngine(seed=0).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        loss=loss,
        noise_multiplier=1.0,
    )
    opt.data_loader = None  # own rows
    out = model(x[:16])
    layers = [m for m in model.modules() if isinstance(m, cnn.Linear)]
    loss(out, y[:16]).backward()
    opt.step()
    out = model(x[16:32])
    layers[1].weight.data.add_(1.0)
    loss(out, y[16:32]).backward()
    with pytest.raises(clipless.optim.PrivacyContractError, match="changed between the forward"):
        opt.step()
    snapshot = opt._snapshot(layers[0].weight)
    assert snapshot is layers[0].__dict__["_bound_cache"][0]
    assert torch.equal(snapshot, layers[0].weight.detach())


def _set_tf32_products(on: bool) -> None:
    """TF32 float32 products on CUDA, through the API the installed torch has."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9 (the legacy flag mixes APIs)
        matmul.fp32_precision = "tf32" if on else "ieee"
    else:
        matmul.allow_tf32 = on


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_certification_and_steps_on_cuda() -> None:
    """Off the CPU, ``auto`` certifies by Gram iteration on the device; make_private switches
    TF32 off (with a warning), a private step keeps every tensor (noise included) on the device
    and its bounds certified, and TF32 switched on again afterwards is refused."""
    gen = torch.Generator().manual_seed(4)
    mat = torch.randn(200, 150, generator=gen).cuda()
    exact = _exact(mat.cpu())
    from clipless.norms import dense_norm

    assert exact <= dense_norm(mat) <= exact * 1.01
    try:
        _set_tf32_products(True)
        with pytest.warns(RuntimeWarning, match="switched float32 to full precision"):
            model, opt, loss, x, y = _private_on("cuda")
        assert clipless.optim.reduced_float32_precision({"cuda"}) is None
        layers = _steps(model, opt, loss, x, y)
        _set_tf32_products(True)
        with pytest.raises(clipless.optim.PrivacyContractError, match="TF32"):
            model(x[:32])
    finally:
        clipless.optim.full_float32_precision()
    for layer in layers:
        assert layer.weight.device.type == "cuda"
        assert _exact(layer.weight.cpu()) <= layer.lipschitz() <= 1.0


def _private_on(device: str) -> tuple[Any, Any, Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = cnn.Sequential(
        cnn.InputNorm(1.0), cnn.Linear(20, 96), cnn.GroupSort(2), cnn.Linear(96, 3)
    ).to(device)
    x = torch.randn(128, 20, device=device)
    y = torch.randint(0, 3, (128,), device=device)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    loss = cnn.CrossEntropyLoss()
    model, opt, _ = clipless.PrivacyEngine(seed=0).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=loader,
        loss=loss,
        noise_multiplier=1.0,
    )
    opt.data_loader = None  # own rows, on the device
    return model, opt, loss, x, y


def _steps(model: Any, opt: Any, loss: Any, x: torch.Tensor, y: torch.Tensor) -> list[cnn.Linear]:
    for step in range(3):
        idx = torch.arange(32, device=x.device) + 32 * step
        opt.zero_grad()
        loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return [m for m in model.modules() if isinstance(m, cnn.Linear)]


def _train_on(device: str) -> list[cnn.Linear]:
    return _steps(*_private_on(device))


def test_train_on_cpu_helper() -> None:
    """The device-generic helper of the CUDA test also runs (and stays certified) on the CPU."""
    for layer in _train_on("cpu"):
        assert _exact(layer.weight) <= layer.lipschitz() <= 1.0
