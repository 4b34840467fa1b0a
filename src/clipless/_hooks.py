"""The hooks a private optimizer places on a model (private; no dependency above torch).

:func:`clipless.nn.validate.foreign_hooks` tells them from the user's hooks by their type, so they
live below :mod:`clipless.nn` (which imports nothing above it). Each holds its optimizer weakly and
calls one of its methods by name; a deep copy or pickle of the model gets an inert hook.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from clipless._errors import PrivacyContractError

__all__ = ["_GradHook", "_Hook"]


class _Hook:
    """A model hook calling ``owner.<method>``; copies of the model (EMA, export) drop it.

    The hook holds its optimizer weakly, and a deep copy or pickle of the model gets an inert
    hook: only the model that was made private is enforced.
    """

    def __init__(self, owner: Any, method: str) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self._method = method

    def __call__(self, *args: Any) -> Any:
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            if self._owner is not None and self._method == "_before_inner_step":
                # the DPOptimizer is gone but its wrapped optimizer is not: a step now would
                # apply the raw private gradient
                raise PrivacyContractError(
                    "this optimizer was wrapped by a DPOptimizer that no longer exists: step the "
                    "DPOptimizer, or call its detach() before using the wrapped optimizer alone"
                )
            return None
        return getattr(owner, self._method)(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return _Hook(None, self._method)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Hook, (None, self._method))


class _GradHook:
    """A noised parameter's tensor hook: tells ``owner`` a gradient is about to be accumulated."""

    def __init__(self, owner: Any, param: torch.nn.Parameter | None) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self._param = weakref.ref(param) if param is not None else None

    def __call__(self, grad: torch.Tensor) -> None:
        owner = self._owner() if self._owner is not None else None
        param = self._param() if self._param is not None else None
        if owner is not None and param is not None:
            owner._check_modes("backward pass")
            owner._check_param_hooks(param)
            owner._before_accumulate(param)

    def __deepcopy__(self, memo: dict[int, Any]) -> _GradHook:
        return _GradHook(None, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_GradHook, (None, None))
