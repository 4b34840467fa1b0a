"""Carried bounds on the accelerator path (``project(..., certify_every=k)`` on a device).

Between exact certifications the bound ``ub_ref + m ||W - W_ref||_F`` is computed on the
weights' device and the call reads the host once; its verdict on the carried bound (certify
exactly next time) comes from that read. Every bound is compared with the exact spectral norm
(an SVD of the weight, or of the explicit convolution matrix).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from _exact import dense_exact, exact
from clipless import nn as cnn
from clipless import norms
from clipless.constraints import project, projection_state


@pytest.fixture(autouse=True)
def _device_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    yield


def _layer(kind: str, dtype: torch.dtype, seed: int) -> cnn.Linear | cnn.Conv2d:
    torch.manual_seed(seed)
    if kind == "dense":
        return cnn.Linear(12, 9, bias=False).to(dtype)
    return cnn.Conv2d(3, 4, 3, padding=1, bias=False, input_size=(6, 6)).to(dtype)


def _step(layer: torch.nn.Module, size: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = layer.weight  # type: ignore[union-attr]
    with torch.no_grad():
        noise = torch.randn(weight.shape, generator=gen, dtype=torch.float64)
        weight.add_((noise * size).to(weight.device, weight.dtype))


def _exact_certifications(layer: torch.nn.Module) -> int:
    state = projection_state(layer)
    assert state is not None
    return state.exact_certifications


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["clip", "fix", "orthogonal"])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_every_bound_is_above_the_exact_norm(kind: str, mode: str, dtype: torch.dtype) -> None:
    """Small steps (carried), a large one (a carried bound far above C) and steps that shrink:
    each returned bound is at least the exact norm, and at most C but for ``fix``'s rounding."""
    layer = _layer(kind, dtype, 0)
    sizes = [0.0, 1e-3, 2e-3, 1e-3, 0.5, 1e-3, 0.0, 3e-2, 1e-4, 1e-3, 1e-3, 0.2]
    carried = 0
    for i, size in enumerate(sizes):
        _step(layer, size, i)
        before = _exact_certifications(layer) if i else 0
        bound = project(layer, mode, 1.0, certify_every=4, tolerance=0.05)[""]  # type: ignore[arg-type]
        carried += _exact_certifications(layer) == before
        assert exact(layer) <= bound * (1.0 + 1e-12)
        assert bound <= 1.0 + (1e-6 if mode == "fix" else 0.0)
    assert carried >= 4  # the chains did carry


def test_exact_certification_every_k_calls() -> None:
    layer = _layer("dense", torch.float32, 1)
    for i in range(10):
        _step(layer, 1e-5, i)
        project(layer, "clip", 1.0, certify_every=4)
    assert _exact_certifications(layer) == 3  # calls 1, 5 and 9


def test_a_carried_call_that_may_have_shrunk_too_much_makes_the_next_exact() -> None:
    """``fix`` rescales every call: with tolerance 0 a carried call is judged loose, so the
    calls alternate exact / carried; with a large tolerance only the first is exact."""
    strict, lax = _layer("conv", torch.float32, 2), _layer("conv", torch.float32, 2)
    for i in range(6):
        _step(strict, 1e-2, i)
        _step(lax, 1e-2, i)
        project(strict, "fix", 1.0, certify_every=100, tolerance=0.0)
        project(lax, "fix", 1.0, certify_every=100, tolerance=10.0)
    assert _exact_certifications(strict) == 3
    assert _exact_certifications(lax) == 1


def test_one_transfer_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    model = cnn.Sequential(_layer("conv", torch.float32, 3), cnn.Flatten(), cnn.Linear(144, 5))
    model(torch.zeros(1, 3, 6, 6))
    reads = collections.Counter[str]()
    original_tolist, original_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(self: torch.Tensor, *args: Any) -> Any:
        reads["tolist"] += 1
        return original_tolist(self, *args)

    def item(self: torch.Tensor) -> Any:
        reads["item"] += 1
        return original_item(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "item", item)
    for i in range(7):
        _step(model[0], 1e-3, i)
        reads.clear()
        project(model, "clip", 1.0, certify_every=3)
        assert reads == {"tolist": 1}, (i, reads)
    assert _exact_certifications(model[0]) == 3  # calls 1, 4 and 7


def test_switching_between_the_paths_stays_certified(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path moves the reference weight without the device's copy of its bound: the
    device path then certifies exactly rather than carry that stale bound (a weight growing
    below C, so that no rescale hides it)."""
    layer = _layer("dense", torch.float32, 4)
    with torch.no_grad():
        layer.weight.mul_(0.3 / dense_exact(layer.weight))
    path = [(True, 1.0), (True, 1.2), (False, 1.5), (True, 1.0), (True, 1.1), (False, 1.2)]
    for on_device, growth in [*path, (True, 1.0)]:
        monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", on_device)
        with torch.no_grad():
            layer.weight.mul_(growth)
        bound = project(layer, "clip", 1.0, certify_every=50, tolerance=1.0)[""]
        assert dense_exact(layer.weight) <= bound * (1.0 + 1e-12)


def test_noise_like_steps_keep_the_weight_near_the_constraint() -> None:
    """``clip`` never scales back up: the verdict after each carried call (over-shrink judged
    from the slack) keeps a chain of 20 noise-like steps of 0.77% of C near C (0.869 C when
    every carried call may shrink by the whole tolerance, measured on the CPU path)."""
    gen = torch.Generator().manual_seed(0)
    layer = cnn.Linear(64, 64)
    for _ in range(20):
        with torch.no_grad():
            layer.weight.add_(torch.randn(64, 64, generator=gen) * 1.2e-4)
        project(cnn.Sequential(layer), mode="clip", max_norm=1.0, certify_every=20, tolerance=0.01)
    assert dense_exact(layer.weight) > 0.95


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_carried_bounds_on_cuda(kind: str) -> None:
    """The same chain on a real device: every bound above the exact norm (computed on the CPU),
    exact certification every third call."""
    layer = _layer(kind, torch.float32, 5).cuda()
    for i in range(8):
        _step(layer, 1e-3, i)
        bound = project(layer, "clip", 1.0, certify_every=3)[""]
        assert exact(layer) <= bound * (1.0 + 1e-12)
    assert _exact_certifications(layer) == 3  # calls 1, 4 and 7
