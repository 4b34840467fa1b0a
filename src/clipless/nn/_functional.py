"""Functional forms shared by the clipless layers and their plain exports (private).

The layer and the plain :mod:`torch` module that :func:`clipless.nn.vanilla_export` produces call
the same function, so the exported model computes bit-identical outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from clipless._certified import NUMERIC_MARGIN, inflate
from clipless.nn._checks import safe_radius

__all__ = [
    "NUMERIC_MARGIN",
    "clip_per_sample",
    "group_sort",
    "l2_norm_pool2d",
    "norm_upper",
    "project_norm",
    "round_up",
    "thesis_group_norm",
]

# Norms below this are treated as zero when dividing (the quotient is clamped anyway).
_TINY = 1e-300


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


def _sample_norms(x: torch.Tensor) -> torch.Tensor:
    """Per-sample L2 norms over all non-batch dims, in float64 (shape ``[batch]``).

    Differentiable (torch's norm has gradient 0 at 0); callers detach when they want a constant.
    """
    return torch.linalg.vector_norm(x.reshape(x.shape[0], math.prod(x.shape[1:])).double(), dim=1)


def _broadcast(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return factor.to(like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


def project_norm(x: torch.Tensor, max_norm: float, mode: str) -> torch.Tensor:
    """Project each sample onto the ball (``mode="ball"``) or sphere of radius ``max_norm``.

    The scale is computed in float64 and applied in the input's dtype; it is differentiable, so the
    autograd Jacobian is the true one (``I`` inside the ball, ``(R/||x||)(I - u u^T)`` outside,
    ``u = x/||x||``). Zero samples stay zero in both modes.
    """
    if x.ndim < 1:
        raise ValueError("InputNorm expects an input of shape [batch, ...]")
    norms = _sample_norms(x)
    radius = safe_radius(max_norm, x.dtype)
    factor = radius / norms.clamp_min(_TINY)
    if mode == "ball":
        factor = factor.clamp(max=1.0)
    else:
        factor = torch.where(norms > 0, factor, torch.zeros_like(factor))
    return x * _broadcast(factor, x)


def clip_per_sample(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each sample of ``g`` (dim 0) by ``min(1, max_norm / ||g_i||)``; norms in float64."""
    norms = _sample_norms(g.detach())
    factor = (safe_radius(max_norm, g.dtype) / norms.clamp_min(_TINY)).clamp(max=1.0)
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

    The derivative of ``sqrt`` at a window of zeros is replaced by 0 (a valid subgradient of the
    norm), so the gradient is finite everywhere.
    """
    if x.ndim != 4:
        raise ValueError(f"L2NormPool2d expects an input of shape [batch, C, H, W], got {x.shape}")
    kh, kw = kernel_size
    sums = F.avg_pool2d(x * x, kernel_size, stride=kernel_size) * float(kh * kw)
    positive = sums > 0
    safe = torch.where(positive, sums, torch.ones_like(sums))
    return torch.where(positive, torch.sqrt(safe), torch.zeros_like(sums))
