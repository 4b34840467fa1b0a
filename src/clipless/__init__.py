"""clipless: differentially private deep learning without per-sample gradient clipping.

Lipschitz-constrained layers (:mod:`clipless.nn`) whose per-layer gradient sensitivity is bounded
analytically (:mod:`clipless.bounds`), so DP-SGD needs no per-sample gradients
(:class:`clipless.PrivacyEngine`); and DP statistics (:mod:`clipless.stats`).

Submodules are imported lazily so that :mod:`clipless.accounting` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["MechanismSpec", "PrivacyEngine", "RunOptions", "__version__"]

if TYPE_CHECKING:
    from clipless.engine import PrivacyEngine, RunOptions
    from clipless.mechanism import MechanismSpec


def __getattr__(name: str) -> Any:
    if name in ("PrivacyEngine", "RunOptions", "MechanismSpec"):
        return getattr(importlib.import_module("clipless.engine"), name)
    raise AttributeError(f"module 'clipless' has no attribute {name!r}")
