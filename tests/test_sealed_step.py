"""One host read per private step on the accelerator path (issue 34), checked on the CPU.

The projection's verdict stays on the device, sealed: the layer's bound is the constraint's
``max_norm`` (certified when the verdict is good) until the next step's one read, or any other
use of the bound, brings it back. A loss's target check on the private model's output is read
with the same transfer. Each test compares with what the CPU path does at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from _exact import dense_exact
from _mechanism import private_on_batches
from clipless import models, norms
from clipless import nn as cnn
from clipless.constraints import projection_state


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    yield


def _private(
    loss: Any, constraint: str = "clip", binary: bool = False
) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = models.mlp((1, 6, 6), (16,), 1 if binary else 10, input_norm=1.0, bias=False)
    x = torch.rand(32, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 2 if binary else 10, (32,), generator=torch.Generator().manual_seed(1))
    m, o = private_on_batches(model, x, y, loss, constraint)
    return m, o, x[:16], y[:16]


def _step(m: Any, o: Any, loss: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    o.zero_grad()
    loss(m(x), y).backward()
    o.step()


def _dense_layers(m: torch.nn.Module) -> list[cnn.Linear]:
    return [layer for layer in m.modules() if isinstance(layer, cnn.Linear)]


@pytest.mark.usefixtures("accelerator")
@pytest.mark.parametrize("constraint", ["clip", "fix", "orthogonal"])
def test_the_plan_takes_the_constraint_until_the_verdict_is_read(constraint: str) -> None:
    loss = cnn.CrossEntropyLoss()
    m, o, x, y = _private(loss, constraint)
    for _ in range(3):
        _step(m, o, loss, x, y)
        for layer in _dense_layers(m):
            cached = layer.__dict__["_bound_cache"]
            assert cached[2] == 1.0 and cached[3] is not None and not cached[3].done
            assert projection_state(layer).pending is cached[3]  # type: ignore[union-attr]
    for layer in _dense_layers(m):
        bound = layer.lipschitz()  # any use outside the step's plan settles the seal
        assert layer.__dict__["_bound_cache"][3] is None
        assert projection_state(layer).pending is None  # type: ignore[union-attr]
        assert dense_exact(layer.weight) <= bound <= 1.0


@pytest.mark.usefixtures("accelerator")
def test_the_next_step_reads_the_verdict_and_the_checks_together() -> None:
    """The step settles the last projection's seal from its one read (the layers' bounds are
    then the certified ones, not the provisional ``max_norm``)."""
    loss = cnn.CrossEntropyLoss()
    m, o, x, y = _private(loss)
    _step(m, o, loss, x, y)
    seals = {
        id(layer.__dict__["_bound_cache"][3]): layer.__dict__["_bound_cache"][3]
        for layer in _dense_layers(m)
    }
    assert len(seals) == 1
    (seal,) = seals.values()
    reads = []
    original = torch.Tensor.tolist

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reads.append(self.numel())
        return original(self, *args, **kwargs)

    torch.Tensor.tolist = counting  # type: ignore[method-assign]
    try:
        _step(m, o, loss, x, y)
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]
    assert seal.done and len(reads) == 1
    states = [projection_state(layer) for layer in _dense_layers(m)]
    assert all(s is not None and s.exact_certifications == 2 for s in states)


@pytest.mark.parametrize("on_device", [True, False])
def test_a_failed_projection_refuses_the_next_step(
    on_device: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that overflows the weights: the CPU path raises at its projection; the device
    path at the next step's read, before that step's noise or accounting."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", on_device)
    loss = cnn.CrossEntropyLoss()
    m, o, x, y = _private(loss)
    weight = _dense_layers(m)[0].weight
    o.register_step_post_hook(lambda *_: weight.detach().fill_(torch.inf))  # diverged
    if not on_device:
        with pytest.raises(ValueError, match="not finite"):
            _step(m, o, loss, x, y)
        return
    _step(m, o, loss, x, y)
    assert o.ledger.steps == 1
    with pytest.raises(ValueError, match="not finite"):
        _step(m, o, loss, x, y)
    assert o.ledger.steps == 1  # refused before the write-ahead record
    for layer in _dense_layers(m):  # the provisional bounds are gone
        assert "_bound_cache" not in layer.__dict__
    with pytest.raises(ValueError, match="finite"):  # certified again, which it cannot be
        _dense_layers(m)[0].lipschitz()


@pytest.mark.parametrize(
    ("binary", "bad", "message"),
    [(False, 10, r"class indices must lie in \[0, 10\)"), (True, 2, "binary target")],
)
def test_a_bad_target_refuses_the_step_on_the_device(
    binary: bool, bad: int, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the device path the loss's check of its targets is read with the step's: no error
    at the loss (the indices are clamped so that no kernel faults), a ValueError at the step,
    nothing applied or recorded. Elsewhere the loss raises at once."""
    loss: Any = cnn.MulticlassHingeLoss() if binary else cnn.CrossEntropyLoss()
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    m, o, x, y = _private(loss, binary=binary)
    _step(m, o, loss, x, y)
    y_bad = y.clone()
    y_bad[3] = bad
    before = [p.detach().clone() for p in m.parameters()]
    o.zero_grad()
    out = m(x)
    value = loss(out, y_bad)
    assert torch.isfinite(value)
    with pytest.raises(ValueError, match=message):  # not taken: a tensor made from the output
        loss(out * 1.0, y_bad)
    value.backward()
    with pytest.raises(ValueError, match=message):
        o.step()
    assert o.ledger.steps == 1
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))
    _step(m, o, loss, x, y)  # the next good batch trains
    assert o.ledger.steps == 2
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", False)
    m, o, x, y = _private(loss, binary=binary)
    with pytest.raises(ValueError, match=message):
        loss(m(x), y_bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("certify_every", [1, 3])
def test_one_synchronisation_per_step_on_cuda(certify_every: int) -> None:
    """On a real device torch's sync debug mode reports every operation that waits for the GPU:
    a steady private step makes one (the checks' read)."""
    import warnings

    loss = cnn.CrossEntropyLoss()
    torch.manual_seed(0)
    model = models.mlp((1, 6, 6), (64, 64), 10, input_norm=1.0, bias=False).cuda()
    x = torch.rand(32, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(1))
    m, o = private_on_batches(model, x, y, loss, certify_every=certify_every)
    xb, yb = x[:16].cuda(), y[:16].cuda()
    for _ in range(4):
        _step(m, o, loss, xb, yb)
    torch.cuda.synchronize()
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _step(m, o, loss, xb, yb)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) <= 1, syncs
