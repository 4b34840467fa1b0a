"""Bitwise tensor equality, fast on the CPU (private).

The bound cache of every parametric layer (:meth:`clipless.nn.ParametricLipschitzModule.
_cached_bound`) reuses a certified bound only while the weight is *bitwise* equal to the copy it
was certified for, and the optimizer checks that no weight changed between a forward pass and its
backward pass (:class:`clipless.optim.DPOptimizer`). Both compare every weight once per step.
On the CPU, ``torch.equal`` reads a ``1024 x 1024`` float32 pair in about 0.8 ms on one core;
NumPy's comparison of the same bytes viewed as integers takes about 0.2 ms
(``benchmarks/RESULTS.md`` section 26). :func:`same_bits` uses the latter for large CPU
tensors and ``torch.equal`` on integer views elsewhere, so the result is the same everywhere:
equal bit patterns (``-0.0`` differs from ``0.0``; a NaN equals the same NaN), which is stricter
than numeric equality wherever that matters (a false "different" only costs a recomputation or a
refused step, never a stale bound). Complex tensors compare the bits of their real and imaginary
parts; lazy conjugate or negative views, quantized and sparse tensors fall back to numeric
``torch.equal`` (equal values, hence equal bounds).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["same_bits"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_FROM = 2**14
"""Elements from which a CPU comparison goes through NumPy (below, its fixed cost dominates)."""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``True`` when ``a`` and ``b`` have the same shape, dtype, device and bit patterns."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    plain = a.layout == torch.strided and not (
        a.is_conj() or a.is_neg() or b.is_conj() or b.is_neg()
    )
    if not plain or a.is_quantized:
        return torch.equal(a, b)  # numeric (lazy conjugate / negative views, quantized, sparse)
    x, y = a.detach(), b.detach()
    if x.is_complex():  # complex128 has no 16-byte integer: compare its float64 parts' bits
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    as_int = _INT.get(x.dtype.itemsize)
    if as_int is None:  # pragma: no cover - every real dtype has an integer of its size
        return torch.equal(x, y)
    x, y = x.view(as_int), y.view(as_int)
    if x.device.type == "cpu" and x.numel() >= _NUMPY_FROM:
        return bool(np.array_equal(x.numpy(), y.numpy()))
    return torch.equal(x, y)


def same_bits_tensor(
    a: torch.Tensor, b: torch.Tensor, *, numpy_on_cpu: bool = True
) -> torch.Tensor:
    """:func:`same_bits` as a 0-dim boolean tensor on ``a``'s device, computed without a host
    read, so that many comparisons leave an accelerator in one transfer. ``numpy_on_cpu``: a
    large CPU comparison runs in NumPy (faster there); off for a CPU run of the accelerator's
    path, so that it runs the accelerator's operators."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return torch.zeros((), dtype=torch.bool, device=a.device)
    plain = a.layout == torch.strided and not (
        a.is_conj() or a.is_neg() or b.is_conj() or b.is_neg()
    )
    x, y = a.detach(), b.detach()
    if not plain or x.is_quantized:
        return torch.eq(x, y).all()
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    as_int = _INT.get(x.dtype.itemsize)
    if as_int is None:  # pragma: no cover - every real dtype has an integer of its size
        return torch.eq(x, y).all()
    x, y = x.view(as_int), y.view(as_int)
    if numpy_on_cpu and x.device.type == "cpu" and x.numel() >= _NUMPY_FROM:
        return torch.tensor(bool(np.array_equal(x.numpy(), y.numpy())))  # no transfer to avoid
    return torch.eq(x, y).all()
