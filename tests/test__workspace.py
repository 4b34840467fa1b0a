"""Reused scratch buffers (clipless._workspace) and the hot paths that use them: the buffers are
shared per slot and thread, and stale content in them never reaches a certified bound, a
projection or the noise."""

from __future__ import annotations

import threading

import pytest
import torch

import clipless
from clipless import _workspace, constraints, norms
from clipless import nn as cnn
from clipless.mechanism import NoisePlan
from clipless.optim import draw_noise


def test_a_slot_reuses_one_buffer_per_dtype() -> None:
    _workspace.release()
    a = _workspace.scratch("t.a", (64, 32), torch.float64)
    again = _workspace.scratch("t.a", (32, 64), torch.float64)  # same slot, same size
    smaller = _workspace.scratch("t.a", (10,), torch.float64)
    other = _workspace.scratch("t.b", (64, 32), torch.float64)
    single = _workspace.scratch("t.a", (64, 32), torch.float32)
    assert a.shape == (64, 32) and again.shape == (32, 64) and a.is_contiguous()
    assert a.data_ptr() == again.data_ptr() == smaller.data_ptr()
    assert other.data_ptr() != a.data_ptr() and single.data_ptr() != a.data_ptr()
    grown = _workspace.scratch("t.a", (100, 100), torch.float64)  # larger: a new buffer
    assert grown.numel() == 10_000 and _workspace.scratch(
        "t.a", (5,), torch.float64
    ).data_ptr() == (grown.data_ptr())
    _workspace.release()
    assert _workspace.scratch("t.a", (5,), torch.float64).data_ptr() != grown.data_ptr()


def test_large_buffers_and_empty_shapes_are_not_pooled() -> None:
    n = _workspace.MAX_BYTES // 8 + 1
    one, two = (_workspace.scratch("t.big", (n,), torch.float64) for _ in range(2))
    assert one.numel() == n and one.data_ptr() != two.data_ptr()
    assert _workspace.scratch("t.empty", (0, 3), torch.float32).shape == (0, 3)


def test_pools_are_per_thread() -> None:
    mine = _workspace.scratch("t.thread", (16,), torch.float32).data_ptr()
    seen: list[int] = []
    worker = threading.Thread(
        target=lambda: seen.append(_workspace.scratch("t.thread", (16,), torch.float32).data_ptr())
    )
    worker.start()
    worker.join()
    assert seen and seen[0] != mine


@pytest.mark.parametrize("shape", [(300, 200), (200, 300), (130, 130)])
def test_stale_buffers_do_not_change_the_dense_certificate(shape: tuple[int, int]) -> None:
    """dsyrk writes only the Gram matrix's upper triangle into a reused buffer: filling every
    buffer with NaN first must give the same bound (the lower triangle is never read)."""
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=gen) / 20
    _workspace.release()
    fresh = norms.dense_norm(w, method="cholesky")
    k, n = max(shape), min(shape)
    for slot, size in [
        ("float64.rows", (k, n)),
        ("float64.work", (n, n)),
    ]:
        _workspace.scratch(slot, size, torch.float64).fill_(float("nan"))
    assert norms.dense_norm(w, method="cholesky") == fresh
    exact = float(torch.linalg.matrix_norm(w.double(), ord=2))
    assert exact <= fresh <= exact * (1 + 1e-5)
    assert norms.dense_norm(w.double(), method="cholesky") == fresh  # float32 converts exactly


def test_stale_buffers_do_not_change_the_projection() -> None:
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(96, 80, generator=gen) * 0.3
    results = []
    for stale in (False, True):
        _workspace.release()
        layer = cnn.Linear(80, 96, bias=False)
        with torch.no_grad():
            layer.weight.copy_(weights)
        if stale:
            for slot in ("float64.rows", "float64.work"):
                _workspace.scratch(slot, (96, 80), torch.float64).fill_(float("nan"))
            _workspace.scratch("weight.draft", (96, 80), torch.float32).fill_(7.0)
        bound = constraints.project(cnn.Sequential(layer), mode="clip", max_norm=1.0)
        results.append((bound, layer.weight.detach().clone()))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])
    exact = float(torch.linalg.matrix_norm(results[0][1].double(), ord=2))
    assert 0.999 < exact <= 1.0


def _plan() -> NoisePlan:
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(6, 4, bias=False))
    data = torch.utils.data.TensorDataset(torch.randn(32, 6), torch.randint(0, 4, (32,)))
    _, opt, _ = clipless.PrivacyEngine(seed=0).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8),
        loss=cnn.CrossEntropyLoss(),
        noise_multiplier=1.0,
    )
    return opt.current_plan()  # type: ignore[attr-defined,no-any-return]


def test_noise_drawn_into_a_buffer_is_the_same_draw() -> None:
    plan = _plan()
    name = next(iter(plan.stds))
    shape = (4, 6)
    fresh = draw_noise(plan, name, shape, torch.Generator().manual_seed(5), torch.float32)
    out = torch.full(shape, float("nan"))
    drawn = draw_noise(plan, name, shape, torch.Generator().manual_seed(5), torch.float32, out=out)
    assert drawn.data_ptr() == out.data_ptr() and torch.equal(drawn, fresh)
    assert float(fresh.std()) > 0
    for bad in (torch.empty(3, 6), torch.empty(shape, dtype=torch.float64)):
        with pytest.raises(ValueError, match="out must have shape"):
            draw_noise(plan, name, shape, torch.Generator(), torch.float32, out=bad)


def test_a_first_use_under_inference_mode_does_not_poison_the_pool() -> None:
    """Review finding: a buffer first made under torch.inference_mode was an inference tensor,
    and every later certification outside it failed ('Inplace update to inference tensor')."""
    _workspace.release()
    w = torch.randn(100, 96, generator=torch.Generator().manual_seed(4)) / 10
    with torch.inference_mode():
        inside = norms.dense_norm(w, method="cholesky")
    assert not _workspace.scratch("float64.rows", (100, 96), torch.float64).is_inference()
    assert norms.dense_norm(w, method="cholesky") == inside
    layer = cnn.Linear(96, 100, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w * 20)
    constraints.project(cnn.Sequential(layer), mode="clip", max_norm=1.0)
    assert float(torch.linalg.matrix_norm(layer.weight.detach().double(), ord=2)) <= 1.0


def test_pooled_buffers_stay_on_the_cpu_under_another_default_device() -> None:
    """Review finding: the pooled path followed torch.set_default_device."""
    _workspace.release()
    with torch.device("meta"):
        buf = _workspace.scratch("t.device", (8, 8), torch.float64, "cpu")
    assert buf.device.type == "cpu"
    w = torch.randn(70, 66, generator=torch.Generator().manual_seed(6))
    with torch.device("meta"):
        _workspace.release()
        bound = norms.dense_norm(w, method="cholesky")
    assert bound == norms.dense_norm(w, method="cholesky")


def test_integer_weights_take_the_same_certificate_as_their_float64_copy() -> None:
    w = torch.randint(-5, 6, (90, 70), generator=torch.Generator().manual_seed(8))
    assert norms.dense_norm(w, method="cholesky") == norms.dense_norm(w.double(), method="cholesky")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_chunked_residual_is_bitwise_sub(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    """The rescale's residual ``sW - fl(sW)`` converts the candidate ~1 MiB at a time (a whole
    float64 copy was the step's memory peak): bitwise the same as ``sub_``, whatever the chunk."""
    gen = torch.Generator().manual_seed(9)
    exact = torch.randn(301, 97, generator=gen, dtype=torch.float64) * 0.37
    rounded = exact.to(dtype)
    expected = exact - rounded.to(torch.float64)
    for chunk in (2**17, 1000, 97):
        monkeypatch.setattr(constraints, "_CHUNK", chunk)
        _workspace.scratch("float64.rows", (chunk,), torch.float64).fill_(float("nan"))
        work = exact.clone()
        constraints._subtract(work, rounded)
        assert torch.equal(work, expected), chunk
