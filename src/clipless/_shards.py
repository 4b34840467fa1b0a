"""The rows :func:`clipless.distributed.shard` handed this rank, for the optimizer's forward check.

Under :mod:`clipless.distributed` every rank draws the same Poisson batch and must train on its
own rows ``rank::world``: the noise covers each example once, in the sum over the ranks. A rank
that trains on other rows of the batch (every rank on ``x[: len(x) // world]``: the first rows
counted on every rank, twice the sensitivity with two ranks) passes a check of the row count
alone. So :func:`record` keeps an exact digest of the first tensor :func:`shard` returned, and the
private model's training forward (:meth:`clipless.optim.DPOptimizer._check_shard`) requires its
input to be exactly those rows: bitwise, on any device (the digest is an integer sum of the
values' bits, independent of the order of summation), in the same order.

An augmented shard (other values, ``K`` rows per example) is allowed for one forward after
:func:`allow_augmented`, which :func:`clipless.training.training_loss` calls once it has checked
the shard itself, before augmenting it row by row (:func:`clipless.training.per_sample`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["allow_augmented", "check", "digest", "record"]

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _State:
    shard: tuple[int, int] | None = None  # digest of the last shard handed to this rank
    augmented: int | None = None  # rows of the augmented forward allowed next


_state = _State()


def digest(t: torch.Tensor) -> tuple[int, int]:
    """``(rows, h)``: an exact digest of ``t``'s values, in their order (a wrapping integer sum of
    the bits, weighted by position, so device- and order-of-summation independent)."""
    rows = int(t.shape[0]) if t.ndim else 1
    flat = t.detach().reshape(rows, math.prod(t.shape[1:]))
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view(_INTS[flat.element_size()])
    bits = flat.to(torch.int64)
    cols = torch.arange(1, bits.shape[1] + 1, dtype=torch.int64, device=bits.device)
    row = torch.arange(1, rows + 1, dtype=torch.int64, device=bits.device)
    h = int(((bits * cols).sum(dim=1) * (row * 1_000_003 + 7)).sum()) if bits.numel() else 0
    return rows, h


def record(t: torch.Tensor) -> None:
    """The shard just handed to this rank (its first tensor: the inputs)."""
    _state.shard = digest(t)
    _state.augmented = None


def allow_augmented(x: torch.Tensor, rows: int) -> str | None:
    """Check that ``x`` is this rank's shard, then let the next training forward take ``rows``
    augmented rows made from it; returns why not, or ``None``."""
    why = check(x)
    if why is None:
        _state.augmented = rows
    return why


def check(x: torch.Tensor) -> str | None:
    """Why ``x`` is not the last shard this rank was handed, or ``None`` if it is."""
    augmented = _state.augmented
    if augmented is not None:
        _state.augmented = None
        if int(x.shape[0]) == augmented:
            return None
    shard = _state.shard
    if shard is None:
        return "no shard was handed to this rank"
    if digest(x) != shard:
        return f"the input is not the {shard[0]} rows shard() handed this rank last"
    return None
