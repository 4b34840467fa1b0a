"""Pooling layers with certified constants (docs/design.md "Layers and losses")."""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F

from clipless import _certified, _validate, norms
from clipless.nn import _checks
from clipless.nn._base import LipschitzModule
from clipless.nn._functional import l2_norm_pool2d
from clipless.nn.activations import NonExpansive

__all__ = ["AvgPool2d", "L2NormPool2d", "MaxPool2d"]


def _check_input(name: str, x: torch.Tensor, kernel_size: tuple[int, int]) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name} expects an input of shape [batch, C, H, W], got {tuple(x.shape)}")
    if x.shape[2] < kernel_size[0] or x.shape[3] < kernel_size[1]:
        raise ValueError(
            f"{name}: input spatial size {tuple(x.shape[2:])} is smaller than "
            f"kernel_size={kernel_size}"
        )


def _window(
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int] | None,
    padding: int | tuple[int, int],
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """A pooling window's checked ``(kernel_size, stride, padding)`` (stride defaults to the
    kernel; padding at most half the kernel, as torch's pooling requires)."""
    kernel = _checks.int_pair("kernel_size", kernel_size, 1)
    step = kernel if stride is None else _checks.int_pair("stride", stride, 1)
    pad = _checks.int_pair("padding", padding, 0)
    if any(2 * p > k for p, k in zip(pad, kernel, strict=True)):
        raise ValueError(
            f"padding must be at most half of kernel_size, got padding={pad} for "
            f"kernel_size={kernel}"
        )
    return kernel, step, pad


class AvgPool2d(LipschitzModule):
    """Average over ``kh x kw`` windows (default: non-overlapping, stride = kernel, no padding).

    **Lipschitz constant ``1 / sqrt(kh kw)``** for non-overlapping windows (``1/k`` for ``k x k``
    windows; docs/design.md "Layers and losses"). Proof: the map is linear; for one window ``w``
    with entries ``x_1..x_q`` (``q = kh kw``), ``mean^2 <= (1/q) sum x_j^2`` (Cauchy-Schwarz), so
    summing over the disjoint windows ``||y||^2 <= ||x||^2 / q``. Equality for a constant input:
    the constant is exact. Entries left over when the size is not a multiple of the kernel are
    dropped (floor mode), which only lowers the norm. Output bound ``X / sqrt(kh kw)``.

    With ``stride`` and ``padding`` (overlapping or padded windows, zero padding counted in the
    divisor as torch's default ``count_include_pad=True``): the same per-window inequality summed
    over windows counts each pixel at most ``m`` times, ``m`` the most windows containing one pixel
    (:func:`clipless.norms.conv_multiplicity`, as :class:`MaxPool2d`), so the constant is
    ``sqrt(m / q)``: 1 for ``avg_pool2d(x, 2, 1)``, approached by a constant input on large images.
    """

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = _window(kernel_size, stride, padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input("AvgPool2d", x, self.kernel_size)
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding)

    def multiplicity(self) -> int:
        """``m``: the most windows containing one pixel (1 for non-overlapping windows)."""
        return norms.conv_multiplicity(self.kernel_size, self.stride, self.padding, "zeros", None)

    def lipschitz(self) -> float:
        """``sqrt(m / (kh kw))``, rounded up (``1 / sqrt(kh kw)`` without overlap)."""
        kh, kw = self.kernel_size
        m = self.multiplicity()
        if m == 1:
            return _certified.inv_sqrt_upper(kh * kw)
        return _certified.sqrt_upper(Fraction(m, kh * kw))

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.AvgPool2d(self.kernel_size, self.stride, self.padding)

    def extra_repr(self) -> str:
        if self.stride == self.kernel_size and self.padding == (0, 0):
            return f"kernel_size={self.kernel_size}"
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class L2NormPool2d(NonExpansive):
    """L2 norm of each non-overlapping ``kh x kw`` window (stride = kernel, no padding).

    Equivalently ``sqrt(kh kw)`` times the window's root mean square: the "L2-norm pooling scaled
    by k" of docs/design.md "Layers and losses" (``torch.nn.LPPool2d(2, kernel_size)`` computes the
    same values), the Lipschitz replacement for max pooling.

    **Lipschitz constant 1.** Per window, ``| ||a|| - ||b|| | <= ||a - b||`` (reverse triangle
    inequality); summing squares over the disjoint windows gives ``||f(x) - f(y)|| <= ||x - y||``.
    Attained (the Jacobian of a window's norm is ``a^T / ||a||``, of norm 1). Output bound: the
    windows are disjoint, so ``||f(x)|| <= ||x|| <= X``.
    """

    def __init__(self, kernel_size: int | tuple[int, int]) -> None:
        super().__init__()
        self.kernel_size = _checks.int_pair("kernel_size", kernel_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input("L2NormPool2d", x, self.kernel_size)
        return l2_norm_pool2d(x, self.kernel_size)

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.LPPool2d(2, self.kernel_size, stride=self.kernel_size)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}"


class MaxPool2d(LipschitzModule):
    """Max pooling (as :class:`torch.nn.MaxPool2d`, without dilation), windows may overlap.

    **Lipschitz constant ``sqrt(m)``**, ``m`` the most windows that contain one input pixel:
    ``m = ceil(kh/sh) ceil(kw/sw)``, :func:`clipless.norms.conv_multiplicity` of the same
    geometry (a window is a kernel position; padding holds ``-inf``, so it reads the same
    pixels as a zero-padded convolution's window, and the count holds for every input size and
    with ``ceil_mode``). Proof: for one window ``w``, ``|max(a_w) - max(b_w)| <=
    max_i |a_i - b_i| <= ||a_w - b_w||``; summing squares over the windows counts each pixel at
    most ``m`` times, so ``||f(a) - f(b)||^2 <= m ||a - b||^2``. Attained: where one pixel is the
    maximum of all ``m`` windows containing it, the Jacobian's column for that pixel has ``m``
    ones. ``f(0) = 0``, so the output bound is ``sqrt(m) X``. Non-overlapping windows
    (``stride >= kernel_size``) give ``m = 1``.
    """

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
        ceil_mode: bool = False,
    ) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = _window(kernel_size, stride, padding)
        self.ceil_mode = _validate.flag("ceil_mode", ceil_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, 1, self.ceil_mode)

    def multiplicity(self) -> int:
        """``m``: the most windows containing one pixel (size-free, exact for large inputs)."""
        return norms.conv_multiplicity(self.kernel_size, self.stride, self.padding, "zeros", None)

    def lipschitz(self) -> float:
        """``sqrt(m)``, rounded up."""
        return _certified.sqrt_upper(self.multiplicity())

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.MaxPool2d(
            self.kernel_size, self.stride, self.padding, ceil_mode=self.ceil_mode
        )

    def extra_repr(self) -> str:
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"ceil_mode={self.ceil_mode}"
        )
