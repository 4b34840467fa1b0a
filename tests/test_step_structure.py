"""What a steady-state private step runs on the accelerator path (issue 34), checked on the CPU.

With :data:`clipless.norms.ACCELERATOR_PATH_ON_CPU` the CPU runs what a GPU runs. A CPU
profile then shows every operator and every value read on the host (a synchronisation on a
GPU): the step must call no LAPACK decomposition, and read the host once, before the noise: the
loss's target check, the step's contract checks and the verdict of the last step's projection
leave the device in one transfer. Counted, not timed.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import clipless
from _mechanism import private_on_batches
from clipless import models, norms
from clipless import nn as cnn

DECOMPOSITIONS = ("eig", "svd", "cholesky", "matrix_norm", "linalg_qr", "linalg_solve", "lstsq")


def _private(
    model: torch.nn.Module, shape: tuple[int, ...], certify_every: int = 1
) -> tuple[Any, Any, Any, Any]:
    x = torch.rand(64, *shape, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(1))
    loss = cnn.CrossEntropyLoss()
    m, o = private_on_batches(model, x, y, loss, certify_every=certify_every)
    return m, o, loss, (x[:16], y[:16])


def _step(m: Any, o: Any, loss: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    o.zero_grad()
    loss(m(batch[0]), batch[1]).backward()
    o.step()


@pytest.mark.parametrize("certify_every", [1, 3])
@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_a_steady_step_on_the_accelerator_path(
    name: str, certify_every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact certification every step, or carried bounds between exact ones every third step:
    one host read in each of three steps (so both kinds of projection are seen): the loss's
    target check, the step's checks and the last projection's sealed verdict leave together."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    torch.manual_seed(0)
    if name == "mlp":
        shape: tuple[int, ...] = (1, 8, 8)
        model = models.mlp(shape, (48, 48), 10, input_norm=1.0, bias=False)
    else:
        shape = (1, 8, 8)
        model = models.convnet(shape, (4, 8), 10, input_norm=1.0, pool="l2", bias=False)
    m, o, loss, batch = _private(model, shape, certify_every)
    for _ in range(2):
        _step(m, o, loss, batch)
    tolist = collections.Counter[str]()
    original = torch.Tensor.tolist

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tolist["calls"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    layers = [x for x in m.modules() if isinstance(x, cnn.Linear | cnn.Conv2d)]
    kinds = set()
    for _ in range(3):
        before = [_exact_count(x) for x in layers]
        tolist.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(m, o, loss, batch)
        ops = collections.Counter(e.name for e in prof.events())
        reads = ops["aten::_local_scalar_dense"] + ops["aten::equal"] + tolist["calls"]
        assert reads == 1, (ops["aten::_local_scalar_dense"], ops["aten::equal"], tolist["calls"])
        kinds.add(tuple(_exact_count(x) - b for x, b in zip(layers, before, strict=True)))
        assert not [k for k in ops if any(d in k for d in DECOMPOSITIONS)]
        # and the bounds it planned with are certified
        for layer in m.modules():
            if isinstance(layer, cnn.Linear):
                exact = float(torch.linalg.matrix_norm(layer.weight.detach().double(), ord=2))
                assert exact <= layer.lipschitz() <= 1.0
    exact_every_step = {tuple(1 for _ in layers)}
    assert (kinds == exact_every_step) == (certify_every == 1), kinds


def _exact_count(layer: torch.nn.Module) -> int:
    """Exact certifications so far, the last (sealed) projection's included."""
    clipless.constraints._settle_pending([layer])
    state = clipless.constraints.projection_state(layer)
    assert state is not None
    return state.exact_certifications
