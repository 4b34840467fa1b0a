"""clipless on an accelerator, checked without one: the simulated device ``simgpu``
(``tests/_simdevice.py``) runs every op on the CPU but refuses mixed-device code as CUDA does.
Each test does real work on the device and compares it with the same work on the CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless
from _simdevice import SimTensor
from clipless import models, nn, norms
from clipless.cli import FEATURES_INPUT_NORM, FEATURES_LOSS_CLIP, _premap_inputs
from clipless.engine import MechanismSpec, RunOptions
from clipless.features import (
    CENTER_NOISE,
    WHITEN_NOISE,
    WHITEN_SHRINK,
    Scattering2d,
    apply_features,
    cached_features,
    release_channel_moment,
    release_mean,
    whitening,
)
from clipless.mechanism import PrivacyConfig
from clipless.sampling import poisson_loader
from clipless.training import fit

SEED = 7


@pytest.fixture
def device(simgpu: torch.device, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The simulated accelerator (the ``simgpu`` fixture of ``tests/conftest.py``). An
    accelerator certifies by matrix products (clipless.norms.matrix_products_only): the CPU
    reference runs of these tests take the same path, so the two agree bit for bit."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    return simgpu


def _same(device_tensor: torch.Tensor, cpu_tensor: torch.Tensor) -> None:
    """``device_tensor`` is on the simulated device and equals ``cpu_tensor`` bit for bit."""
    assert isinstance(device_tensor, SimTensor), type(device_tensor)
    assert device_tensor.device.type == "simgpu"
    moved = device_tensor.detach().cpu()
    assert type(moved) is torch.Tensor and moved.device.type == "cpu"
    torch.testing.assert_close(moved, cpu_tensor.detach(), rtol=0, atol=0)


def test_the_simulated_device_computes_as_the_cpu_and_refuses_what_cuda_refuses(
    device: torch.device,
) -> None:
    x = torch.arange(6.0).reshape(2, 3)
    on = x.to(device)
    _same(on * 2 + torch.tensor(1.0), x * 2 + 1)  # a 0-dim CPU tensor is a scalar
    _same(torch.zeros(2, 3, device=device), torch.zeros(2, 3))
    _same(torch.tensor([[0.0, 1, 2], [3, 4, 5]], device=device), x)
    _same(on.new_tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    _same(on[torch.tensor([1])], x[[1]])  # CPU indices
    _same(torch.eye(3, device=device, dtype=torch.float64), torch.eye(3, dtype=torch.float64))
    assert on.tolist() == x.tolist() and on.sum().item() == 15.0
    gram = torch.randn(5, 5, generator=_cpu_gen(), dtype=torch.float64)
    gram = gram @ gram.T
    # the CPU's LAPACK calls, not the ones torch picks for tensor subclasses (last bits differ)
    _same(torch.linalg.eigvalsh(gram.to(device)), torch.linalg.eigvalsh(gram))
    _same(torch.linalg.matrix_norm(gram.to(device), ord=2), torch.linalg.matrix_norm(gram, ord=2))
    with pytest.raises(TypeError, match="to numpy"):
        on.numpy()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        _ = on - x
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.cat([on, x])
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        on[torch.tensor([0])] = torch.ones(1, 3)  # CPU indices, but CPU values too
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(3, device=device, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(3, generator=torch.Generator(device=device))
    g_dev = torch.Generator(device=device).manual_seed(SEED)
    _same(torch.randn(3, device=device, generator=g_dev), torch.randn(3, generator=_cpu_gen()))


def _cpu_gen(seed: int = SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_premap_of_cpu_features_with_a_released_center_on_the_device(
    device: torch.device,
) -> None:
    """Issue 34's crash (``clipless train --dataset fashion-mnist --device cuda``): the model's
    released centre and whitening live on the device, the features it premaps on the CPU."""
    x = torch.randn(50, 3, 4, 4, generator=_cpu_gen())
    center = release_mean(x, 4.0, generator=_cpu_gen(1))
    white = whitening(
        release_channel_moment(x, 4.0, generator=_cpu_gen(2)),
        center,
        0.5,
        noise_multiplier=4.0,
        num_samples=len(x),
    )

    def layer() -> nn.InputNorm:
        return nn.InputNorm(1.0, "sphere", center, 4.0, white, 4.0)

    expected = layer().premap_(x.clone())
    on_device = layer().to(device)
    assert isinstance(on_device.center, SimTensor) and isinstance(on_device.whiten, SimTensor)
    got = on_device.premap_(x.clone())
    assert type(got) is torch.Tensor  # mapped in place, on the CPU where it lives
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert on_device.inputs_premapped


def _on(tensor: torch.Tensor, device: torch.device) -> None:
    assert tensor.device == device, (tensor.device, device)
    assert isinstance(tensor, SimTensor) == (device.type == "simgpu"), type(tensor)


def _host(value: Any, device: torch.device) -> float:
    """A bound (a float, or a 0-dim tensor on the model's device) as a float."""
    if isinstance(value, torch.Tensor):
        _on(value, device)
        return float(value)
    return float(value)


def _private_step(
    build: Callable[[], torch.nn.Module],
    data: TensorDataset,
    device: torch.device,
    certify_every: int = 1,
    steps: int = 1,
) -> dict[str, Any]:
    """make_private, then ``steps`` private steps on ``device``: what the last step produced,
    on the host."""
    torch.manual_seed(SEED)
    plain = build().to(device)
    engine = clipless.PrivacyEngine(seed=SEED)
    loss = nn.CrossEntropyLoss()
    model, opt, loader = engine.make_private(
        module=plain,
        optimizer=torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9),
        data_loader=DataLoader(data, batch_size=16),
        loss=loss,
        noise_multiplier=1.0,
        options=clipless.RunOptions(certify_every=certify_every),
    )
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        loss(model(x.to(device)), y.to(device)).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        clean = {n: g.detach().clone() for n, g in grads.items()}
        opt.step()
    report = opt.bound_report()
    out: dict[str, Any] = {"sensitivities": {}, "clean": {}, "noisy": {}, "weights": {}}
    for name, value in report.sensitivities().items():
        out["sensitivities"][name] = _host(value, device)
    for name, p in model.named_parameters():
        assert p.grad is not None
        for tensor in (p, p.grad, clean[name]):
            _on(tensor, device)
        out["clean"][name] = clean[name].cpu()
        out["noisy"][name] = p.grad.detach().cpu()
        out["weights"][name] = p.detach().cpu()
    for buffer in model.buffers():
        _on(buffer, device)
    return out


def _images(n: int, shape: tuple[int, ...]) -> TensorDataset:
    g = _cpu_gen(3)
    return TensorDataset(
        torch.randn(n, *shape, generator=g), torch.randint(0, 4, (n,), generator=g)
    )


@pytest.mark.parametrize("certify_every", [1, 3])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_private_step_on_the_device_equals_the_cpu_step(
    kind: str, certify_every: int, device: torch.device
) -> None:
    """One step, or four with carried bounds between exact certifications (computed on the
    device, which keeps the bounds and the reference weights there)."""
    shape = (1, 8, 8)
    hidden = (16, 8) if kind == "mlp" else (4, 8)

    def build() -> torch.nn.Module:
        return models.build(models.Architecture(kind, shape, hidden, 4))

    data = _images(64, shape)
    steps = 1 if certify_every == 1 else 4
    on_device = _private_step(build, data, device, certify_every, steps)
    on_cpu = _private_step(build, data, torch.device("cpu"), certify_every, steps)
    assert on_device["sensitivities"] == on_cpu["sensitivities"]
    for key in ("clean", "noisy", "weights"):
        assert on_device[key].keys() == on_cpu[key].keys()
        for name, value in on_device[key].items():
            torch.testing.assert_close(value, on_cpu[key][name], rtol=0, atol=0)
    for name in on_cpu["noisy"]:  # noise was added, the same noise
        assert not torch.equal(on_cpu["noisy"][name], on_cpu["clean"][name])


def _features_run(device: torch.device, out: Path, epochs: int) -> dict[str, Any]:
    """``clipless train``'s default pipeline for images (``cli._run_train``: scattering features
    on the CPU, released centre and whitening, a linear model on ``device`` whose ``InputNorm``
    premaps the features, ``fit`` with evaluation, checkpoints and an EMA), on 16 x 16 images."""
    g = _cpu_gen(5)
    images = torch.rand(60, 1, 16, 16, generator=g)
    labels = torch.randint(0, 3, (60,), generator=g)
    front = Scattering2d((1, 16, 16), J=2, L=2, max_order=1, groups=5)
    train = apply_features(front, TensorDataset(images[:48], labels[:48]))
    test = apply_features(front, TensorDataset(images[48:], labels[48:]))
    shape = tuple(front.output_shape)
    center = release_mean(train, CENTER_NOISE, generator=_cpu_gen(1))
    moment = release_channel_moment(train, WHITEN_NOISE, generator=_cpu_gen(2))
    white = whitening(moment, center, WHITEN_SHRINK, noise_multiplier=WHITEN_NOISE, num_samples=48)
    torch.manual_seed(SEED)
    arch = models.Architecture(
        "linear", shape, (), 3, FEATURES_INPUT_NORM, False, "l2", "sphere",
        center_noise=CENTER_NOISE, whiten_noise=WHITEN_NOISE,
    )  # fmt: skip
    built = models.build(arch, center=center, whiten=white)
    built.append(nn.LossGradientClip(FEATURES_LOSS_CLIP))
    plain = built.to(device)
    loss = nn.CrossEntropyLoss()
    engine = clipless.PrivacyEngine(seed=SEED)
    model, opt, loader = engine.make_private(
        module=plain,
        optimizer=torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9),
        data_loader=poisson_loader(train, sample_rate=0.25, generator=_cpu_gen(3)),
        loss=loss,
        noise_multiplier=2.0,
        mechanism=MechanismSpec(constraint=None),
        options=RunOptions(input_shape=shape),
    )
    _premap_inputs(model, train, test)  # the CPU features, with the model's buffers
    result = fit(
        model,
        opt,
        loader,
        loss,
        engine=engine,
        epochs=epochs,
        delta=1e-5,
        eval_loader=DataLoader(test, batch_size=8),
        checkpoint_dir=out,
        resume=True,
        ema_decay=0.5,
    )
    for tensor in (*model.parameters(), *model.buffers()):
        _on(tensor, device)
    assert result.ema_model is not None
    return {
        "history": [{k: v for k, v in r.items() if k != "time_s"} for r in result.history],
        "steps": result.steps,
        "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "ema": {k: v.detach().cpu() for k, v in result.ema_model.state_dict().items()},
    }


def test_the_default_feature_pipeline_trains_on_the_device_as_on_the_cpu(
    device: torch.device, tmp_path: Path
) -> None:
    runs = {}
    for where in (device, torch.device("cpu")):
        out = tmp_path / where.type
        first = _features_run(where, out, epochs=1)
        # resumed from its checkpoint (saved from the device, loaded on the CPU, then copied)
        runs[where.type] = _features_run(where, out, epochs=2)
        assert runs[where.type]["history"][:1] == first["history"]
    on_device, on_cpu = runs["simgpu"], runs["cpu"]
    assert on_cpu["steps"] > 3 and on_device["history"] == on_cpu["history"]
    for key in ("weights", "ema"):
        assert on_device[key].keys() == on_cpu[key].keys()
        for name, value in on_device[key].items():
            torch.testing.assert_close(value, on_cpu[key][name], rtol=0, atol=0)


def test_the_feature_front_end_and_its_releases_on_the_device(device: torch.device) -> None:
    """The scattering features computed on the device, and the centre and whitening released
    from them there (drawn from a device generator), equal the CPU's."""
    images = torch.rand(40, 1, 16, 16, generator=_cpu_gen(4))
    front = Scattering2d((1, 16, 16), J=2, L=2, max_order=1, groups=5)
    expected = apply_features(front, TensorDataset(images)).tensors[0]
    center = release_mean(expected, CENTER_NOISE, generator=_cpu_gen(1))
    moment = release_channel_moment(expected, WHITEN_NOISE, generator=_cpu_gen(2))
    white = whitening(moment, center, WHITEN_SHRINK, noise_multiplier=WHITEN_NOISE, num_samples=40)

    feats = apply_features(front.to(device), TensorDataset(images.to(device))).tensors[0]
    _same(feats, expected)
    g_center = torch.Generator(device=device).manual_seed(1)
    center_dev = release_mean(feats, CENTER_NOISE, generator=g_center)
    _same(center_dev, center)
    g_moment = torch.Generator(device=device).manual_seed(2)
    moment_dev = release_channel_moment(feats, WHITEN_NOISE, generator=g_moment)
    _same(moment_dev, moment)
    white_dev = whitening(
        moment_dev, center_dev, WHITEN_SHRINK, noise_multiplier=WHITEN_NOISE, num_samples=40
    )
    _same(white_dev, white)
    with pytest.raises(RuntimeError, match="device type for generator"):  # as CUDA refuses it
        release_mean(feats, CENTER_NOISE, generator=_cpu_gen(1))


def test_features_of_cpu_data_computed_on_the_device(device: torch.device, tmp_path: Path) -> None:
    """``apply_features(..., device=)`` (what ``clipless train --device`` uses) maps CPU data on
    the device and returns CPU features equal to the CPU's; the cache keys them by device."""
    images = torch.rand(30, 1, 16, 16, generator=_cpu_gen(5))
    front = Scattering2d((1, 16, 16), J=2, L=2, max_order=1, groups=5)
    expected = apply_features(front, TensorDataset(images), batch_size=7).tensors[0]
    feats = apply_features(front, TensorDataset(images), batch_size=7, device=device).tensors[0]
    assert feats.device.type == "cpu"
    torch.testing.assert_close(feats, expected, rtol=0, atol=0)
    cached, path, found = cached_features(front, TensorDataset(images), tmp_path, device=device)
    assert not found and cached.tensors[0].device.type == "cpu"
    _, cpu_path, cpu_found = cached_features(front.cpu(), TensorDataset(images), tmp_path)
    assert not cpu_found and cpu_path != path  # another device's features are not reused


# clipless train with the default pipeline for images (on digits: 8 x 8, scattering to 2 x 2)
TRAIN_FEATURES = ["train", "--dataset", "digits", "--features", "scatter", "--epochs", "1"]
TRAIN_FEATURES += ["--batch-size", "720", "--no-progress", "--quiet", "--unsafe-seed", "3"]
TRAIN_FEATURES += ["--no-feature-cache"]


def test_clipless_train_default_feature_pipeline_on_the_device(
    device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``clipless train --device cuda`` of issue 34 with the default image pipeline (scattering
    features premapped by the model's released centre and whitening): the whole command, its
    ``--device`` resolved to the simulated device, saves the model the CPU run saves."""
    pytest.importorskip("kymatio")
    from clipless import cli, pipeline

    monkeypatch.setenv("CLIPLESS_DATA", str(tmp_path / "cache"))
    calibrate, calibrated = PrivacyConfig.calibrate, {}

    def once(config: PrivacyConfig, *args: Any) -> PrivacyConfig:
        # the noise calibration (host arithmetic, most of the run's time) is done once for both
        key = (repr(config), *args)
        if key not in calibrated:
            calibrated[key] = calibrate(config, *args)
        return calibrated[key]

    monkeypatch.setattr(PrivacyConfig, "calibrate", once)
    runs = {}
    for where in (device, torch.device("cpu")):
        monkeypatch.setattr(pipeline, "_resolve_device", lambda name, where=where: where)
        out = tmp_path / where.type
        assert cli.main([*TRAIN_FEATURES, "--out", str(out)]) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["config"]["device"] == str(where)
        assert metrics["config"]["center_noise"] and metrics["config"]["whiten_noise"]
        runs[where.type] = (
            [{k: v for k, v in r.items() if k != "time_s"} for r in metrics["history"]],
            torch.load(out / "model.pt", weights_only=True)["state_dict"],
        )
    (history, weights), (cpu_history, cpu_weights) = runs["simgpu"], runs["cpu"]
    assert history == cpu_history and history[-1]["steps"] >= 2
    assert weights.keys() == cpu_weights.keys()
    for name, value in weights.items():
        assert type(value) is torch.Tensor  # saved from the device as plain CPU tensors
        torch.testing.assert_close(value, cpu_weights[name], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_clipless_train_default_feature_pipeline_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same command with ``--device cuda`` on a real GPU (its noise differs from the CPU's:
    another generator): it runs, and the saved model scores on the raw test images what the run
    reported."""
    pytest.importorskip("kymatio")
    from clipless.cli import load_trained_model, main
    from clipless.data import load_dataset

    monkeypatch.setenv("CLIPLESS_DATA", str(tmp_path / "cache"))
    out = tmp_path / "cuda"
    assert main([*TRAIN_FEATURES, "--device", "cuda", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["device"].startswith("cuda")
    model = load_trained_model(out / "model.pt")
    _, test, _ = load_dataset("digits")
    x, y = test.tensors
    with torch.no_grad():
        accuracy = int((model(x).argmax(1) == y).sum()) / len(y)
    # the run evaluated on the GPU, this on the CPU: a near tie may round the other way
    assert accuracy == pytest.approx(metrics["final"]["test_accuracy"], abs=2 / len(y))


def test_clipless_audit_on_the_device_equals_the_cpu_audit(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``clipless audit --device`` (issue 34: every command on the device): the step audit and
    the one-run gradient-canary audit train and draw their noise on the device, and with one
    seed report what the CPU reports (the scores bit for bit)."""
    from clipless import _devices
    from clipless.audit.gradient_canaries import audit_gradient_canaries
    from clipless.audit.step import audit_step
    from clipless.cli import main

    on_device = audit_step(trials=40, seed=3, device=device)
    on_cpu = audit_step(trials=40, seed=3)
    assert (on_device.scores_with == on_cpu.scores_with).all()
    assert (on_device.scores_without == on_cpu.scores_without).all()
    assert on_device.sensitivity_ratio == on_cpu.sensitivity_ratio
    canaries = {
        where.type: audit_gradient_canaries(1.0, canaries=64, seed=5, device=where)
        for where in (device, torch.device("cpu"))
    }
    assert canaries["simgpu"] == canaries["cpu"]
    printed = {}
    for where in (device, torch.device("cpu")):
        monkeypatch.setattr(_devices, "resolve_device", lambda name, where=where: where)
        assert main(["audit", "--trials", "40", "--seed", "3", "--device", "cuda"]) == 0
        printed[where.type] = capsys.readouterr().out
    assert printed["simgpu"] == printed["cpu"] and "lower bound" in printed["cpu"]


def test_clipless_evaluate_on_the_device_equals_the_cpu(
    device: torch.device,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``clipless evaluate RUN_DIR --device``: the saved model certified and evaluated on the
    device reports what the CPU reports."""
    from clipless import _devices, robustness
    from clipless.cli import main

    seen: list[str] = []
    certify = robustness.certify

    def recorded(model: torch.nn.Module, x: torch.Tensor, **kwargs: Any) -> Any:
        seen.append(next(model.parameters()).device.type)
        return certify(model, x, **kwargs)

    monkeypatch.setattr(robustness, "certify", recorded)
    out = tmp_path / "run"
    argv = ["train", "--dataset", "breast-cancer", "--epochs", "2", "--no-progress"]
    assert main([*argv, "--unsafe-seed", "1", "--threads", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    seen.clear()  # the training run's own certification, on the CPU
    printed = {}
    for where in (device, torch.device("cpu")):
        monkeypatch.setattr(_devices, "resolve_device", lambda name, where=where: where)
        assert main(["evaluate", str(out), "--json", "--device", "cuda"]) == 0
        printed[where.type] = json.loads(capsys.readouterr().out)
    assert printed["simgpu"] == printed["cpu"]
    assert 0.5 < printed["cpu"]["accuracy"] <= 1.0
    half = len(seen) // 2  # the model was certified on the device, then on the CPU
    assert half >= 1 and seen == ["simgpu"] * half + ["cpu"] * half, seen
