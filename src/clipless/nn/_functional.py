"""Functional forms shared by the clipless layers and their plain exports (private).

The layer and the plain :mod:`torch` module that :func:`clipless.nn.vanilla_export` produces call
the same function, so the exported model computes bit-identical outputs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from clipless import _autograd
from clipless._certified import NUMERIC_MARGIN, inflate
from clipless.nn._checks import safe_radius
from clipless.norms import matrix_products_only

__all__ = [
    "NUMERIC_MARGIN",
    "clip_per_sample",
    "group_sort",
    "l2_norm_pool2d",
    "norm_upper",
    "project_norm",
    "round_up",
    "sample_norms_upper",
    "thesis_group_norm",
]


def norm_upper(t: torch.Tensor) -> float:
    """Euclidean norm of a whole tensor in float64, rounded up by :data:`NUMERIC_MARGIN`."""
    return inflate(float(torch.linalg.vector_norm(t.detach().double())))


def round_up(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast the float64 tensor ``t`` to ``dtype`` rounding upward (never below ``t``)."""
    out = t.to(dtype)
    if dtype == torch.float64 or not dtype.is_floating_point:
        return out
    low = out.double() < t
    return torch.where(low, torch.nextafter(out, torch.full_like(out, math.inf)), out)


def group_sort(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sort (ascending) contiguous groups of ``group_size`` entries along dimension 1."""
    if x.ndim < 2:
        raise ValueError(
            f"GroupSort expects an input of shape [batch, channels, ...], got {x.shape}"
        )
    channels = x.shape[1]
    if channels % group_size != 0:
        raise ValueError(
            f"GroupSort: the size of dimension 1 ({channels}) must be divisible by "
            f"group_size={group_size}"
        )
    if group_size == 1:
        return x
    grouped = x.reshape(x.shape[0], channels // group_size, group_size, *x.shape[2:])
    if group_size == 2:  # MaxMin: two elementwise ops are much cheaper than a sort
        a, b = grouped.unbind(dim=2)
        out = torch.stack((torch.minimum(a, b), torch.maximum(a, b)), dim=2)
    else:
        out = torch.sort(grouped, dim=2).values
    return out.reshape(x.shape)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return 2.0**-53 if dtype == torch.float64 else 2.0**-24


def _sq_norm_upper(sq: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Certified upper bounds (float64) on ``sum_j x_ij^2`` from their floating-point values ``sq``.

    ``sq`` was computed in ``dtype`` (float32 or float64) from ``numel`` products by any
    summation order, possibly with a final square root and a squaring (``vector_norm``), possibly
    scaled by a power of two: every exact value is within ``gamma_k = k u / (1 - k u)``,
    ``k = numel + 8``, of the computed one in relative terms (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., eq. 3.4 and Lemma 3.1: a sum of ``numel`` non-negative
    products has relative error ``<= gamma_numel`` in any order; 8 more roundings cover a square
    root, a squaring and scaling steps), plus ``numel 2^-149`` (float32) or ``numel 2^-1074``
    (float64) for products that underflow. The bound is applied in float64, rounded up.
    """
    u = _unit_roundoff(dtype)
    k = numel + 8
    if k * u >= 0.5:  # pragma: no cover - > 8 M entries per sample in float32: no useful bound
        raise ValueError(f"{numel} entries per sample are too many for a {dtype} norm bound")
    gamma = k * u / (1.0 - k * u)
    tiny = numel * (2.0**-149 if dtype != torch.float64 else 2.0**-1074)
    inflation = math.nextafter(1.0 / (1.0 - gamma), math.inf)
    return sq.double() * inflation + tiny


def _norms_and_upper(x: torch.Tensor, differentiable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the computed per-sample norms, their certified upper bounds in float64)."""
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))
    if not differentiable:
        flat = flat.detach()
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    numel = int(flat.shape[1])
    if flat.dtype == torch.float32 and matrix_products_only(flat):
        return _wide_norms_and_upper(flat)
    norms = torch.linalg.vector_norm(flat, dim=1)
    sq = _sq_norm_upper(norms.double().square(), numel, flat.dtype)
    if flat.dtype == torch.float32:
        bad = ~torch.isfinite(norms)
        try:
            overflow = bool(bad.any())
        except RuntimeError:  # inside torch.func transforms (vmap): no data-dependent branch
            overflow = True
        if overflow:  # x^2 overflowed float32: those samples in float64
            wide = torch.linalg.vector_norm(flat.double(), dim=1).square()
            sq = torch.where(bad, _sq_norm_upper(wide, numel, torch.float64), sq)
    return norms, torch.sqrt(sq) * (1.0 + 2.0**-50)  # the float64 sqrt and this product round


def _wide_norms_and_upper(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_norms_and_upper` of float32 rows without a data-dependent branch (no host read on
    an accelerator), summed in float64: a float32 entry converts exactly, its square is exact in
    float64 (24-bit significands give 48-bit products; ``|x| <= 2^128`` and ``|x| >= 2^-149``
    give squares in ``[2^-298, 2^256]``, inside float64's normal range), so no square overflows
    or underflows and :func:`_sq_norm_upper`'s float64 bound applies. A few operators instead of
    the three dozen of a per-row power-of-two scaling in float32; the float64 pass reads each
    entry once more, which an accelerator's memory bandwidth absorbs (the CPU keeps the cheaper
    float32 sum of :func:`_norms_and_upper`). Returns float64 computed norms."""
    numel = int(flat.shape[1])
    norms = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64)
    upper = torch.sqrt(_sq_norm_upper(norms.square(), numel, torch.float64))
    return norms, upper * (1.0 + 2.0**-50)  # the float64 sqrt and this product round


def sample_norms_upper(x: torch.Tensor, *, differentiable: bool = False) -> torch.Tensor:
    """Certified upper bounds on the per-sample L2 norms over all non-batch dims (float64).

    The squares are summed in the input's precision (float32 for half types, which convert
    exactly) and inflated by the rounding bound of :func:`_sq_norm_upper`: ~8x cheaper than a
    float64 conversion of the batch, and looser by ``numel * 6e-8`` relative in float32
    (``2.4e-4`` for 3,969 features). A sample whose float32 sum overflows is recomputed in float64.
    ``differentiable=True`` keeps the autograd graph (the Jacobian of the float32 norm).
    """
    return _norms_and_upper(x, differentiable)[1]


def _broadcast(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return factor.to(like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


def _wrapped(x: torch.Tensor) -> bool:
    """True inside ``torch.func`` transforms (vmap, grad), where data-dependent branches fail."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return callable(check) and bool(check(x))


def project_norm(x: torch.Tensor, max_norm: float, mode: str) -> torch.Tensor:
    """Project each sample onto the ball (``mode="ball"``) or sphere of radius ``max_norm``.

    The norm is a certified upper bound (:func:`sample_norms_upper`), so every output norm is at
    most ``max_norm``; the scale is computed in float64 and applied in the input's dtype. It is
    differentiable: the autograd Jacobian is that of the computed map (``I`` inside the ball,
    ``(R/||x||)(I - u u^T)`` outside, ``u = x/||x||``, up to rounding). Zero samples stay zero in
    both modes. A sample with a NaN or infinite entry (or whose squared norm overflows float64)
    becomes a zero sample: without that its output would be NaN, which no norm bound covers, and
    a NaN in one sample's output turns the whole gradient NaN, a noiseless sign of its presence.
    """
    if x.ndim < 1:
        raise ValueError("InputNorm expects an input of shape [batch, ...]")
    computed, norms = _norms_and_upper(x, differentiable=True)
    finite = torch.isfinite(norms)
    # branch-free inside torch.func transforms and on accelerators (no host read)
    if _wrapped(x) or matrix_products_only(x) or not bool(finite.all()):
        x = torch.where(_broadcast(finite, x).bool(), x, torch.zeros((), dtype=x.dtype))
        computed = torch.where(finite, computed, torch.zeros_like(computed))
        norms = torch.where(finite, norms, torch.ones_like(norms))
    # A computed norm of 0 means a zero sample (or one whose squares all underflow: leaving it, or
    # zeroing it in sphere mode, keeps its norm below the radius either way).
    nonzero = computed > 0
    radius = safe_radius(max_norm, x.dtype)
    # zero samples divide by 1 (not by the bound's underflow term): no inf * 0 in the backward
    factor = radius / torch.where(nonzero, norms, torch.ones_like(norms))
    if mode == "ball":
        factor = factor.clamp(max=1.0)
    else:
        factor = torch.where(nonzero, factor, torch.zeros_like(factor))
    return x * _broadcast(factor, x)


def clip_per_sample(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each sample of ``g`` (dim 0) by ``min(1, max_norm / ||g_i||)`` (certified norms)."""
    norms = sample_norms_upper(g)
    factor = (safe_radius(max_norm, g.dtype) / norms).clamp(max=1.0)  # norms > 0 (see bound)
    return g * _broadcast(factor, g)


def thesis_group_norm(x: torch.Tensor, num_groups: int, alpha: float) -> torch.Tensor:
    """``(x - mean) / max(alpha, std)`` per sample and group (population std, no affine, no eps)."""
    if x.ndim < 2:
        raise ValueError(
            f"GroupNorm expects an input of shape [batch, channels, ...], got {x.shape}"
        )
    grouped = x.reshape(x.shape[0], num_groups, -1)
    centred = grouped - grouped.mean(dim=2, keepdim=True)
    variance = centred.pow(2).mean(dim=2, keepdim=True)
    # sqrt(max(alpha^2, var)) = max(alpha, std); the argument of sqrt is >= alpha^2 > 0, so the
    # gradient is finite everywhere (no eps needed).
    denominator = torch.sqrt(torch.clamp(variance, min=alpha * alpha))
    return (centred / denominator).reshape(x.shape)


def l2_norm_pool2d(x: torch.Tensor, kernel_size: tuple[int, int]) -> torch.Tensor:
    """L2 norm of each non-overlapping ``kernel_size`` window (stride = kernel, no padding).

    The backward pass divides by a certified *upper* bound of each window's norm, never by the
    computed one: when a window's squares fall into the subnormal range, ``fl(sum x^2)`` can be
    far below the true sum (22% in float32 at 1e-22), and ``g x / sqrt(fl(sum x^2))`` would then
    exceed the Lipschitz constant 1 the bounds use. A window of zeros gets the subgradient 0, so
    the gradient is finite everywhere.
    """
    if x.ndim != 4:
        raise ValueError(f"L2NormPool2d expects an input of shape [batch, C, H, W], got {x.shape}")
    out, _ = _autograd.apply(_L2NormPool, x, int(kernel_size[0]), int(kernel_size[1]))
    result: torch.Tensor = out
    return result


def _window_sums(x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    return F.avg_pool2d(x * x, (kh, kw), stride=(kh, kw)) * float(kh * kw)


class _L2NormPool(torch.autograd.Function):
    """``y = sqrt(fl(sum x^2))`` per window; ``dx = g x / u``, ``u >= ||x_window||`` certified."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, kh: int, kw: int) -> tuple[torch.Tensor, torch.Tensor]:
        sums = _window_sums(x, kh, kw)
        positive = sums > 0
        safe = torch.where(positive, sums, torch.ones_like(sums))
        return torch.where(positive, torch.sqrt(safe), torch.zeros_like(sums)), sums

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, kh, kw = inputs
        ctx.save_for_backward(x, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.kernel = (kh, kw)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor, _unused: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None]:
        x, sums = ctx.saved_tensors
        kh, kw = ctx.kernel
        k = kh * kw
        info = torch.finfo(x.dtype)
        u, smallest = info.eps / 2.0, info.smallest_normal * info.eps
        # fl(sum) >= (1 - gamma) sum - (absolute subnormal errors): every square, the division by
        # k and the product by k round once each (relative u, or absolute smallest / 2 below the
        # normal range), the k - 1 additions relative u each.
        gamma = (k + 3) * u / (1.0 - (k + 3) * u)
        wide = sums.double()
        upper = (wide * (1.0 + 2.0 * gamma) + (k + 2) * k * smallest) * (1.0 + 2.0**-50)
        # the factor below is rounded to x's dtype and multiplied once more in it: 1 + 4u covers
        # both roundings (only window-sized tensors are float64)
        scale = grad.double() / (torch.sqrt(upper) * (1.0 + 4.0 * u + 2.0**-50))
        scale = torch.where(wide > 0, scale, torch.zeros_like(scale)).to(x.dtype)
        lead, (hk, wk) = x.shape[:-2], sums.shape[-2:]
        h, w = hk * kh, wk * kw
        core = x[..., :h, :w].reshape(*lead, hk, kh, wk, kw) * scale.reshape(*lead, hk, 1, wk, 1)
        out = core.reshape(*lead, h, w)
        pad_h, pad_w = x.shape[-2] - h, x.shape[-1] - w
        if pad_h or pad_w:  # rows and columns outside every window get no gradient
            out = F.pad(out, (0, pad_w, 0, pad_h))
        return out, None, None
