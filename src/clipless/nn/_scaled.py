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

The parameter gradients (the batch sums, the one place where rows meet) are accumulated in
float64 whatever the parameters' dtype, in chunks of at most :data:`SUM_CHUNK_TERMS` summands per
coordinate, and rounded to the parameters' dtype once: the proof of the rounding margin
(:func:`clipless.mechanism.rounding_margin`) relies on it. A float32 sum of ``B`` terms can be off
by ``(B - 1) 2^-24`` times the sum of their magnitudes (up to ``B`` sensitivities), which no
constant margin covers (1.000167 times the planned sensitivity was measured at ``B = 8192``).

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

from clipless import _autograd
from clipless.nn._functional import _wrapped
from clipless.norms import matrix_products_only

if TYPE_CHECKING:
    from clipless.nn._base import ParametricLipschitzModule

__all__ = [
    "BATCH_MAX",
    "SCALING_MODES",
    "SUM_CHUNK_TERMS",
    "SUM_MAX_CHUNKS",
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
#: Float64 summands per coordinate in one chunk of a parameter gradient's batch sum, and the
#: most chunks whose sums are added (the rounding margin's proof,
#: :func:`clipless.mechanism.rounding_margin`).
SUM_CHUNK_TERMS = 2**20
SUM_MAX_CHUNKS = 2**20


def _chunks(rows: int, terms_per_row: int) -> range:
    """Start rows of the chunks of at most :data:`SUM_CHUNK_TERMS` summands per coordinate."""
    if terms_per_row > SUM_CHUNK_TERMS:
        raise ValueError(
            f"a parameter gradient would sum {terms_per_row} positions of one example per "
            f"coordinate, more than the {SUM_CHUNK_TERMS} the rounding margin's proof covers: "
            "use a smaller input or a larger stride"
        )
    step = SUM_CHUNK_TERMS // terms_per_row
    if rows > step * SUM_MAX_CHUNKS:
        raise ValueError(f"a batch of {rows} rows is beyond the rounding margin's proof")
    return range(0, rows, step)


def _weight_sum(dys: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dys^T x`` over the rows of 2-D ``dys`` and ``x``, in float64 by chunks, in ``dtype``."""
    total: torch.Tensor | None = None
    for start in _chunks(dys.shape[0], 1):
        part = (
            dys[start : start + SUM_CHUNK_TERMS].double().t()
            @ x[start : start + SUM_CHUNK_TERMS].double()
        )
        total = part if total is None else total.add_(part)
    if total is None:
        total = torch.zeros(dys.shape[1], x.shape[1], dtype=torch.float64, device=dys.device)
    return total.to(dtype)


def _rows_sum(t: torch.Tensor, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``t.sum(dims)`` (``dims`` include 0, the rows) in float64 by chunks of rows, in ``dtype``."""
    per_row = 1
    for d in dims:
        if d != 0:
            per_row *= t.shape[d]
    total: torch.Tensor | None = None
    for start in _chunks(t.shape[0], per_row):
        step = SUM_CHUNK_TERMS // per_row
        part = t[start : start + step].double().sum(dim=dims)
        total = part if total is None else total.add_(part)
    if total is None:
        total = t.double().sum(dim=dims)
    return total.to(dtype)


def _divisors(
    layer: ParametricLipschitzModule, x: torch.Tensor, threshold: float | str
) -> torch.Tensor:
    """``1 / (K max(n_i, T, tiny))`` per row, detached, in the input's dtype.

    ``K = layer.scaling_multiplicity`` is the number of rows each sample occupies (augmentation
    copies): each row contributes at most ``G_k / K``, so one sample's ``K`` rows at most ``G_k``.
    """
    with torch.no_grad():
        # an accelerator takes the float64 factor as it is (fewer launches); the CPU keeps the
        # factor rounded up to x's dtype, as it always has (the same bits for seeded runs)
        if matrix_products_only(x):
            n = layer.sample_norm_factor_wide(x.detach())
        else:
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
        s = torch.clamp(n, min=max(t, _TINY))
        copies = float(getattr(layer, "scaling_multiplicity", 1))
        if copies != 1.0:  # a product by 1 is exact: skipped (one launch less per layer)
            s = s * copies
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
        rows = dys.reshape(-1, dys.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = _weight_sum(rows, x.reshape(-1, x.shape[-1]), weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _rows_sum(rows, (0,), weight.dtype)
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
            grad_w = _conv_weight_sum(x, weight, dys, ctx.stride, ctx.padding)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _rows_sum(dys, (0, 2, 3), weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _conv_weight_sum(
    x: torch.Tensor,
    weight: torch.Tensor,
    dys: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
) -> torch.Tensor:
    """``conv2d_weight`` in float64 by chunks of rows (module docstring), in the weight's dtype."""
    total: torch.Tensor | None = None
    positions = dys.shape[2] * dys.shape[3]
    for start in _chunks(dys.shape[0], max(1, positions)):
        stop = start + SUM_CHUNK_TERMS // max(1, positions)
        part = conv2d_weight(
            x[start:stop].double(),
            weight.shape,
            dys[start:stop].double(),
            stride=stride,
            padding=padding,
        )
        total = part if total is None else total.add_(part)
    if total is None:
        total = torch.zeros(weight.shape, dtype=torch.float64, device=weight.device)
    return total.to(weight.dtype)


def scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: float | str,
    layer: ParametricLipschitzModule,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose parameter gradient is scaled per sample (module doc).

    Without autograd (``torch.no_grad``, inference mode: evaluation, the bound report's traced
    forward) no gradient exists to scale: the plain product, the same output, without the
    per-sample norms."""
    if not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _autograd.apply(_ScaledLinear, x, weight, bias, _divisors(layer, x, threshold))


def scaled_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: float | str,
    layer: ParametricLipschitzModule,
) -> torch.Tensor:
    """The layer's 2-D convolution with per-sample scaled parameter gradients (module doc).

    ``layer`` supplies ``stride``, ``padding`` and ``padding_mode``; circular padding is applied
    with :func:`torch.nn.functional.pad` before a padding-free convolution. Without autograd, the
    plain convolution (as :func:`scaled_linear`).
    """
    grad = torch.is_grad_enabled()
    inv = _divisors(layer, x, threshold) if grad else None
    stride = _pair(getattr(layer, "stride", 1))
    padding = _pair(getattr(layer, "padding", 0))
    if getattr(layer, "padding_mode", "zeros") == "circular" and any(padding):
        ph, pw = padding
        x = F.pad(x, (pw, pw, ph, ph), mode="circular")
        padding = (0, 0)
    if inv is None:
        return F.conv2d(x, weight, bias, stride=stride, padding=padding)
    return _autograd.apply(_ScaledConv2d, x, weight, bias, inv, stride, padding)


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    return (int(v[0]), int(v[1]))
