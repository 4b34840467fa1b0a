"""Argument checks of the layers and losses (private): the generic ones are
:mod:`clipless._validate`'s under the names the layers import, beside the layer-specific ones.

Every checker raises :class:`ValueError` (wrong value) or :class:`TypeError` (wrong type) whose
message names the argument and the accepted range, as docs/design.md "Bad input" requires.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from clipless import _validate
from clipless._validate import finite as finite_float
from clipless._validate import finite_nonnegative as nonnegative_float
from clipless._validate import finite_positive as positive_float
from clipless._validate import positive_int

__all__ = [
    "as_bound",
    "finite_float",
    "int_pair",
    "nonnegative_float",
    "positive_float",
    "positive_int",
    "reduction",
    "safe_radius",
]

REDUCTIONS = ("mean", "sum", "none")


def parameter_dtype(dtype: Any) -> torch.dtype | None:
    """A layer's ``dtype``: ``None`` (torch's default), ``torch.float32`` or ``torch.float64``.

    The certified rounding margins cover these two; lower precisions are refused by the private
    optimizer anyway, and the orthogonal initialisation has no half-precision kernel on the CPU.
    """
    if dtype is None or dtype in (torch.float32, torch.float64):
        return dtype
    raise ValueError(f"dtype must be None, torch.float32 or torch.float64; got {dtype!r}")


def int_pair(name: str, value: Any, minimum: int) -> tuple[int, int]:
    """``value`` (an int or a pair of ints, each ``>= minimum``) as a ``(h, w)`` tuple."""
    items: Sequence[Any]
    if _validate.is_int(value):
        items = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        items = value
    else:
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if not all(_validate.is_int(v) for v in items):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if any(v < minimum for v in items):
        raise ValueError(f"{name} must be >= {minimum} in each dimension, got {value!r}")
    return (int(items[0]), int(items[1]))


def as_bound(name: str, value: Any) -> float:
    """A norm bound argument: a float in ``[0, inf]`` (``inf`` allowed, NaN and negatives not)."""
    return _validate.real_in(name, value, 0.0, math.inf)


def reduction(value: Any) -> str:
    """A loss reduction: ``"mean"``, ``"sum"`` or ``"none"``."""
    return _validate.choice("reduction", value, REDUCTIONS)


def safe_radius(radius: float, dtype: torch.dtype) -> float:
    """``radius`` shrunk by four units of roundoff of ``dtype``.

    Rescaling a float32 vector to norm ``R`` lands at ``R (1 + O(eps))``; aiming at
    ``R (1 - 4 eps)`` with the scale computed in float64 keeps the rounded result at or below ``R``
    so that the certified bound ``R`` holds for the tensor actually produced.
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return float(radius) * (1.0 - 4.0 * eps)
