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
