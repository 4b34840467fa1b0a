"""Custom autograd functions applied without torch's per-call signature binding.

``torch.autograd.Function.apply`` of a function with a separate ``setup_context`` (the style
:mod:`torch.func` transforms need) binds its arguments with :func:`inspect.signature` on every
call: tens of microseconds of host time per layer per step, which on an accelerator is time the
device waits. :func:`apply` runs the same ``forward``, ``setup_context`` and ``backward`` through a
twin in the classic style (``forward(ctx, *args)``) outside the transforms, where nothing needs the
binding (every argument is passed positionally, none has a default), and the original class
inside them (``vmap``, ``grad``), where the separate ``setup_context`` is required.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["apply"]

_TWINS: dict[type[torch.autograd.Function], type[torch.autograd.Function]] = {}


def _twin(fn: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """The classic-style function with ``fn``'s forward, context and backward."""
    twin = _TWINS.get(fn)
    if twin is None:

        def forward(ctx: Any, *args: Any) -> Any:
            output = fn.forward(*args)
            fn.setup_context(ctx, args, output)
            return output

        namespace = {"forward": staticmethod(forward), "backward": staticmethod(fn.backward)}
        # the same name, so that graphs read the same (``grad_fn`` is ``<name>Backward``)
        twin = _TWINS[fn] = type(fn.__name__, (torch.autograd.Function,), namespace)
    return twin


def _transforms_active() -> bool:
    check = getattr(torch._C, "_are_functorch_transforms_active", None)
    return check is None or bool(check())


def apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` (positional arguments only), the same outputs and gradients."""
    if _transforms_active():
        return fn.apply(*args)
    return _twin(fn).apply(*args)
