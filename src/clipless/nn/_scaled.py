"""Per-layer gradient scaling kernels: one mechanism with a per-layer threshold ``T_k``.

docs/design.md, "Gradient scaling"; Lip-DP-SGD (thesis Algorithm 8, line 11) and Clipless DP-SGD
(Béthune et al. 2024, Algorithm 1, line 2). For a parametric layer ``k`` with input ``x_i`` of
sample ``i``, the joint gradient of one sample's loss with respect to the layer's parameters
satisfies ``||grad_i|| <= ||dy_i|| * n_i`` where ``n_i = layer.sample_norm_factor(x)[i]``
(``||x_i||`` for a dense layer, ``sqrt(||x_i||^2 + 1)`` with a bias, ``sqrt(k_eff ||x_i||^2 (+ P))``
for a convolution; see :mod:`clipless.nn`). Dividing each sample's contribution by
``s_i = max(n_i, T_k)`` therefore gives every sample a contribution of norm at most
``||dy_i|| <= G_k`` whatever ``T_k`` is, so the layer's per-sample sensitivity is ``G_k`` (the
cotangent bound of :mod:`clipless.bounds`). The threshold only trades bias against variance; it
never affects the privacy argument.

The rescale happens inside the layer's backward: ``grad_W = sum_i (dy_i / s_i) x_i^T`` (one
elementwise rescale of the cotangent, then the usual batched matrix product or
``torch.nn.grad.conv2d_weight``). No per-sample gradient is ever materialised. The gradient with
respect to the layer *input* is not scaled, so cotangents propagate exactly as without scaling.

Modes (:func:`clipless.mechanism.thresholds_for` chooses ``T_k``):

* ``"bound"``: ``T_k`` = the certified bound on ``n_i`` propagated from the input norm bound
  (Béthune et al. 2024, Algorithm 1), so ``s_i = T_k`` for every sample: the true gradient divided
  by a public constant. This is Clipless DP-SGD.
* ``"per-sample"``: ``T_k = 0``: each sample normalised by its own factor (a reweighting). Rigorous.
* ``"threshold"``: user-given ``T_k`` per layer (for instance a DP quantile of activation norms
  released and accounted for separately): samples above it are down-weighted. Rigorous.
* ``"batch-max"``: the thesis's ``X_k = max_i ||x_{k,i}||`` over the batch (Algorithm 8 line 11).
  **Not differentially private as written**: adding or replacing one sample with a large activation
  rescales every other sample's term, so the sensitivity of the sum is unbounded in the batch size.
  It exists only to reproduce the thesis and needs ``allow_unproven=True``; an epsilon computed for
  it is never a DP guarantee.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight

from clipless.nn._functional import _wrapped

if TYPE_CHECKING:
    from clipless.nn._base import ParametricLipschitzModule

__all__ = [
    "BATCH_MAX",
    "SCALING_MODES",
    "ScalingMode",
    "scaled_conv2d",
    "scaled_linear",
]

ScalingMode = Literal["bound", "per-sample", "threshold", "batch-max"]
SCALING_MODES: tuple[str, ...] = ("bound", "per-sample", "threshold", "batch-max")
#: Sentinel threshold meaning "the largest factor in the current batch" (unproven mode).
BATCH_MAX = "batch-max"
#: Floor on the divisor so that an all-zero sample (whose contribution is zero) never divides by 0.
_TINY = 1e-30


def _divisors(
    layer: ParametricLipschitzModule, x: torch.Tensor, threshold: float | str
) -> torch.Tensor:
    """``1 / (K max(n_i, T, tiny))`` per row, detached, in the input's dtype.

    ``K = layer.scaling_multiplicity`` is the number of rows each sample occupies (augmentation
    copies): each row contributes at most ``G_k / K``, so one sample's ``K`` rows at most ``G_k``.
    """
    with torch.no_grad():
        n = layer.sample_norm_factor(x.detach()).to(torch.float64)
        if threshold == BATCH_MAX:
            if _wrapped(x):
                raise ValueError(
                    "scaling='batch-max' divides by the largest factor of the whole batch, so "
                    "one sample's contribution is not defined inside a torch.func transform "
                    "(vmap); use a rigorous scaling mode"
                )
            t = float(n.max()) if n.numel() > 0 else 1.0
        else:
            t = float(threshold)
        s = torch.clamp(n, min=max(t, _TINY)) * float(getattr(layer, "scaling_multiplicity", 1))
        return (1.0 / s).to(x.dtype)


class _ScaledLinear(torch.autograd.Function):
    """``F.linear`` whose weight and bias gradients divide row ``i`` of the cotangent by
    ``inv_scale[i]`` (module docstring); the input gradient is exact.

    ``generate_vmap_rule``: under :func:`torch.func.vmap` (exact per-sample contributions, e.g.
    :func:`clipless.diagnostics.sensitivity_use`) each mapped slice is its own batch, with the
    divisors :func:`_divisors` computed for that slice's rows."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        inv_scale: torch.Tensor,
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, weight, bias, inv_scale = inputs
        ctx.save_for_backward(x, weight, inv_scale)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, inv_scale = ctx.saved_tensors
        grad_x = dy @ weight if ctx.needs_input_grad[0] else None
        shape = (-1,) + (1,) * (dy.dim() - 1)
        dys = dy * inv_scale.view(shape)
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = dys.reshape(-1, dys.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dys.reshape(-1, dys.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


class _ScaledConv2d(torch.autograd.Function):
    """The 2-D convolution counterpart of :class:`_ScaledLinear` (same scaling, same vmap rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        inv_scale: torch.Tensor,
        stride: tuple[int, int],
        padding: tuple[int, int],
    ) -> torch.Tensor:
        return F.conv2d(x, weight, bias, stride=stride, padding=padding)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, weight, bias, inv_scale, stride, padding = inputs
        ctx.save_for_backward(x, weight, inv_scale)
        ctx.has_bias = bias is not None
        ctx.stride = stride
        ctx.padding = padding

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, inv_scale = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = conv2d_input(x.shape, weight, dy, stride=ctx.stride, padding=ctx.padding)
        dys = dy * inv_scale.view(-1, 1, 1, 1)
        if ctx.needs_input_grad[1]:
            grad_w = conv2d_weight(x, weight.shape, dys, stride=ctx.stride, padding=ctx.padding)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dys.sum(dim=(0, 2, 3))
        return grad_x, grad_w, grad_b, None, None, None


def scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: float | str,
    layer: ParametricLipschitzModule,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose parameter gradient is scaled per sample (module doc)."""
    return _ScaledLinear.apply(x, weight, bias, _divisors(layer, x, threshold))


def scaled_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: float | str,
    layer: ParametricLipschitzModule,
) -> torch.Tensor:
    """The layer's 2-D convolution with per-sample scaled parameter gradients (module doc).

    ``layer`` supplies ``stride``, ``padding`` and ``padding_mode``; circular padding is applied
    with :func:`torch.nn.functional.pad` before a padding-free convolution.
    """
    inv = _divisors(layer, x, threshold)
    stride = _pair(getattr(layer, "stride", 1))
    padding = _pair(getattr(layer, "padding", 0))
    if getattr(layer, "padding_mode", "zeros") == "circular" and any(padding):
        ph, pw = padding
        x = F.pad(x, (pw, pw, ph, ph), mode="circular")
        padding = (0, 0)
    return _ScaledConv2d.apply(x, weight, bias, inv, stride, padding)


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    return (int(v[0]), int(v[1]))
