"""Reusable CPU scratch tensors for the work every private step repeats.

Every step of a dense Lipschitz layer makes the same large temporaries: float64 rows of the
weight and its Gram matrix for the certificate (:func:`clipless.norms.dense_norm`), the scaled
candidates of the clip projection (:mod:`clipless.constraints`) and the noise
(:class:`clipless.optim.DPOptimizer`). On Linux, glibc serves blocks of this size with ``mmap``
and gives them back to the system when freed, so every step faulted the same pages in again: for
the 1024-wide MLP of the speed benchmark that was about a fifth of the clipless step
(``benchmarks/RESULTS.md`` section 24c). Reusing one buffer per slot removes it. The values are
unchanged: a scratch tensor is only ever fully overwritten before it is read.

Rules for callers: a slot's tensor is valid until the next :func:`scratch` call with the same slot
in the same thread, so it must never escape the function that asked for it (copy it out), and two
live tensors need two slots. Functions that never run inside one another share slots, which bounds
what is kept: ``"float64.rows"`` (about 1 MiB of float64 rows of the weight; also the chunks of
the optimizer's gradient fingerprint), ``"float64.work"``
(the Gram matrix, factorised in place, then the projection's float64 candidate) and
``"weight.draft"`` in the weight's dtype (the noise, then the rescaled candidate). For the
benchmark's 1024-wide MLP that is 13 MiB kept between steps (28 MiB before the certificate converted
the weight by blocks of rows and factorised in place: ``benchmarks/RESULTS.md`` section 25a). Pools
are per thread (``threading.local``). Only CPU tensors of at most :data:`MAX_BYTES` are pooled;
larger ones (whose page faults are small next to their ``O(n^3)`` certification), and other devices
(whose allocators cache already), get a fresh ``torch.empty``. :func:`release` frees this thread's
pool.
"""

from __future__ import annotations

import math
import threading

import torch

__all__ = ["MAX_BYTES", "pooled_bytes", "release", "scratch"]

MAX_BYTES = 16 * 2**20
"""Largest pooled buffer (16 MiB: a float64 ``1448 x 1448`` matrix); larger ones are not kept."""

_local = threading.local()


def scratch(
    slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape``, backed by ``slot``'s reused buffer."""
    device = torch.device(device)
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0 or numel * dtype.itemsize > MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    pool: dict[tuple[str, torch.dtype], torch.Tensor] | None = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    flat = pool.get((slot, dtype))
    if flat is None or flat.numel() < numel:
        # A normal tensor even when first asked for under torch.inference_mode (an inference
        # tensor could not be written in place afterwards), and on the CPU whatever
        # torch.set_default_device says.
        with torch.inference_mode(False):
            flat = torch.empty(numel, dtype=dtype, device="cpu")
        pool[(slot, dtype)] = flat
    return flat[:numel].view(shape)


def release() -> None:
    """Free this thread's scratch buffers (they are made again on the next use)."""
    _local.pool = {}


def pooled_bytes() -> int:
    """Bytes held by this thread's pool (kept between steps; memory benchmarks add them)."""
    pool = getattr(_local, "pool", None) or {}
    return sum(t.numel() * t.element_size() for t in pool.values())
