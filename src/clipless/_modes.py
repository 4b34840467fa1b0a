"""Python modes that would run inside the private model's guarded pass (a check of
:class:`clipless.optim.DPOptimizer`).

A ``TorchDispatchMode`` (``torch.utils._python_dispatch``) or a ``TorchFunctionMode``
(``torch.overrides``) active around a training forward, its backward or the step intercepts every
operator of the pass, the scaled kernels' parameter-gradient products and the noise draw
included, and can return anything: an audit multiplied every ``aten.mm`` result by 100 around
``backward()`` and the step accepted 1650 times the planned sensitivity. Nothing can tell an
observing mode (a memory or FLOP counter) from one that changes results, so every mode is
refused, except ``with torch.device(...)`` (a function mode that only sets the default device of
factory functions; its exact type is required, not a subclass).
"""

from __future__ import annotations

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["foreign_mode"]

_INFRA_KEYS = tuple(
    getattr(torch._C._TorchDispatchModeKey, name)
    for name in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, name)
)


# exact types of the function modes allowed around training (a test's simulated device adds its
# own for the duration of the test)
EXEMPT_FUNCTION_MODES: tuple[type, ...] = (DeviceContext,)


def foreign_mode() -> str | None:
    """A description of the first active Python mode other than ``torch.device``, or ``None``."""
    for mode in _get_current_function_mode_stack():
        if type(mode) not in EXEMPT_FUNCTION_MODES:
            return f"a TorchFunctionMode ({type(mode).__name__})"
    stack = _get_current_dispatch_mode_stack()
    if stack:
        return f"a TorchDispatchMode ({type(stack[-1]).__name__})"
    for key in _INFRA_KEYS:
        mode = torch._C._get_dispatch_mode(key)
        if mode is not None:
            return f"a TorchDispatchMode ({type(mode).__name__})"
    return None
