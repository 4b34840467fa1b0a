"""``make_private``'s keywords for tests written with the flat spelling: the mechanism's and the
run options' keywords folded into ``mechanism=`` / ``options=`` values."""

from __future__ import annotations

import dataclasses
from typing import Any

from clipless.engine import RunOptions
from clipless.mechanism import MechanismSpec

_MECHANISM = {f.name for f in dataclasses.fields(MechanismSpec)}
_RUN = {f.name for f in dataclasses.fields(RunOptions)}


def split_options(kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with its mechanism and run-option keywords moved into the two values (the values
    are built here, so their validation errors are raised here)."""
    out = {k: v for k, v in kw.items() if k not in _MECHANISM | _RUN}
    spec = {k: v for k, v in kw.items() if k in _MECHANISM}
    run = {k: v for k, v in kw.items() if k in _RUN}
    if spec:
        out["mechanism"] = MechanismSpec(**spec)
    if run:
        out["options"] = RunOptions(**run)
    return out


def private_on_batches(
    model: Any,
    x: Any,
    y: Any,
    loss: Any,
    constraint: str = "clip",
    certify_every: int = 1,
    batch_size: int = 16,
) -> tuple[Any, Any]:
    """``(model, optimizer)`` made private (seed 0, SGD lr 0.1, noise multiplier 1, ``constraint``
    with ``max_norm`` 1) over the dataset ``(x, y)``; the optimizer's loader is detached, so
    the test steps on batches of its choice."""
    import torch

    import clipless

    m, o, _ = clipless.PrivacyEngine(seed=0).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=batch_size
        ),
        loss=loss,
        noise_multiplier=1.0,
        mechanism=MechanismSpec(constraint=constraint),
        options=RunOptions(certify_every=certify_every),
    )
    o.data_loader = None
    return m, o
