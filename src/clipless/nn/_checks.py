"""Argument validation shared by the layers and losses (private).

Every checker raises :class:`ValueError` (wrong value) or :class:`TypeError` (wrong type) whose
message names the argument and the accepted range, as docs/design.md "Bad input" requires.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "as_bound",
    "int_pair",
    "nonnegative_float",
    "positive_float",
    "positive_int",
    "reduction",
    "safe_radius",
]

REDUCTIONS = ("mean", "sum", "none")


def _is_int(value: Any) -> bool:
    # numbers.Integral: Python and NumPy integers, not bools (as _as_float takes NumPy floats)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int >= 1``."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return int(value)


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
    if _is_int(value):
        items = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        items = value
    else:
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if not all(_is_int(v) for v in items):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if any(v < minimum for v in items):
        raise ValueError(f"{name} must be >= {minimum} in each dimension, got {value!r}")
    return (int(items[0]), int(items[1]))


def _as_float(name: str, value: Any) -> float:
    # numbers.Real: Python and NumPy ints and floats (np.float32 included), not bools
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def finite_float(name: str, value: Any) -> float:
    """``value`` as a finite float."""
    v = _as_float(name, value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return v


def positive_float(name: str, value: Any) -> float:
    """``value`` as a finite float ``> 0``."""
    v = _as_float(name, value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def nonnegative_float(name: str, value: Any) -> float:
    """``value`` as a finite float ``>= 0``."""
    v = _as_float(name, value)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def as_bound(name: str, value: Any) -> float:
    """A norm bound argument: a float in ``[0, inf]`` (``inf`` allowed, NaN and negatives not)."""
    v = _as_float(name, value)
    if math.isnan(v) or v < 0.0:
        raise ValueError(f"{name} must be a number in [0, inf], got {value!r}")
    return v


def reduction(value: Any) -> str:
    """A loss reduction: ``"mean"``, ``"sum"`` or ``"none"``."""
    if value not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {value!r}")
    return str(value)


def safe_radius(radius: float, dtype: torch.dtype) -> float:
    """``radius`` shrunk by four units of roundoff of ``dtype``.

    Rescaling a float32 vector to norm ``R`` lands at ``R (1 + O(eps))``; aiming at
    ``R (1 - 4 eps)`` with the scale computed in float64 keeps the rounded result at or below ``R``
    so that the certified bound ``R`` holds for the tensor actually produced.
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return float(radius) * (1.0 - 4.0 * eps)
