"""Checks of a private step's inputs, read with the step's other checks (private).

A loss validates its targets (class indices in ``[0, K)``, binary labels, finite values). On an
accelerator a check read on the host at once is a synchronisation in the middle of the step;
when the loss's input is the output of a private model's guarded training forward, the guard of
that model (:mod:`clipless.optim.guard`) takes the check instead and reads it with its own in
the step's one transfer, before anything is released: a false one refuses the step with the
loss's :class:`ValueError`. Everywhere else (the CPU, evaluation, a transformed output, no private
model) the check is read at once. Torch only: the losses below ``nn`` and the guard above use it.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

__all__ = ["Listener", "check", "listen"]


class Listener(Protocol):
    def take_check(self, output: torch.Tensor, ok: torch.Tensor, message: str) -> bool:
        """Keep ``ok`` (0-dim boolean, on ``output``'s device) for the step that backpropagates
        ``output``, or return False (then the caller reads it)."""
        ...


_LISTENERS: weakref.WeakSet[Listener] = weakref.WeakSet()


def listen(listener: Listener) -> None:
    """Offer ``listener`` the checks of the outputs it guards (held weakly)."""
    _LISTENERS.add(listener)


def check(output: torch.Tensor, ok: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok`` holds: at once, or at the private step that
    backpropagates ``output`` when a listener takes it."""
    for listener in list(_LISTENERS):
        if listener.take_check(output, ok, message):
            return
    if not bool(ok):
        raise ValueError(message)
