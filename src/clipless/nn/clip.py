"""The loss-gradient clipping layer (Béthune et al. 2024, section 3.1, "hybrid approach")."""

from __future__ import annotations

from typing import Any

import torch

from clipless import _autograd
from clipless.nn import _checks
from clipless.nn._functional import clip_per_sample
from clipless.nn.activations import NonExpansive

__all__ = ["LossGradientClip"]


class _ClipCotangent(torch.autograd.Function):
    """Identity forward; backward scales each sample's cotangent to norm ``<= max_norm``.

    ``generate_vmap_rule`` lets :mod:`torch.func` transforms (``vmap(grad(...))`` for exact
    per-sample gradients in tests and audits) run through the layer; under ``vmap`` each mapped
    slice is clipped on its own leading dimension.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, max_norm: float) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.max_norm = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return clip_per_sample(grad_output, ctx.max_norm), None


class LossGradientClip(NonExpansive):
    """Identity in the forward pass; clips each sample's cotangent to L2 norm ``max_norm``.

    Béthune et al. 2024, section 3.1 ("Controlling L with the hybrid approach, loss gradient
    clipping"): instead of clipping parameter gradients, the cotangent ``dloss/dy`` flowing back
    through this layer is replaced, for each sample ``i`` (dimension 0), by
    ``dy_i min(1, max_norm / ||dy_i||)`` (norm over all non-batch dims; one vectorised rescale, no
    per-sample loop). The result is a descent direction rather than a true gradient (Béthune
    et al. 2024, after Boyd & Vandenberghe, *Convex Optimization*).
    Placed after the last layer it caps the loss Lipschitz constant ``L``; anywhere, the cotangent
    bound ``G_k`` of every layer before it uses ``max_norm`` in place of the product of the
    constants after it (docs/design.md "Loss-gradient clipping layer"); :mod:`clipless.bounds`
    handles that through :attr:`max_norm`.

    Units: the clip applies to whatever cotangent reaches the layer. Clipless backpropagates
    ``reduction="sum"`` losses (the noisy sum is divided by the *expected* batch size afterwards),
    so ``max_norm`` is in per-sample loss units; with a ``"mean"`` loss the cotangents are already
    divided by the batch size and the clip would bind ``b`` times later.

    The rescale is computed in float64 and aims at ``max_norm (1 - 4 eps)`` so that the rounded
    cotangent's norm never exceeds ``max_norm``. Forward: Lipschitz 1, output bound ``X``.
    """

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self.max_norm = _checks.positive_float("max_norm", max_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 1:
            raise ValueError("LossGradientClip expects an input of shape [batch, ...]")
        out: torch.Tensor = _autograd.apply(_ClipCotangent, x, self.max_norm)
        return out

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.Identity()

    def extra_repr(self) -> str:
        return f"max_norm={self.max_norm}"
