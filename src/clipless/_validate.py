"""Argument validation shared by the whole package (private; standard library only).

Each validator takes the argument's name and value, returns the value normalised (``int``,
``float``, ``str``, ``bool``) and otherwise raises :class:`TypeError` (wrong type) or
:class:`ValueError` (wrong value) with one sentence naming the argument and what is accepted
(docs/design.md "Bad input"). Bools are refused wherever a number is expected, and NaN wherever
a range is; Python and NumPy numbers are accepted alike (``numbers.Integral``, ``numbers.Real``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection
from typing import Any, NoReturn, TypeGuard, TypeVar

__all__ = [
    "choice",
    "finite",
    "finite_nonnegative",
    "finite_positive",
    "flag",
    "integer",
    "is_int",
    "is_real",
    "nonnegative_int",
    "optional",
    "positive_int",
    "probability",
    "real",
    "real_in",
]

T = TypeVar("T")


# The predicates tell the type checker ``int`` and ``float``: NumPy numbers behave as those do
# under ``int()``, ``float()``, comparison and arithmetic, which is all the callers do with them.
def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer (Python or NumPy), a bool not counting as one."""
    # the exact type first: an abstract-class check costs microseconds, on every step's paths
    return type(value) is int or (
        isinstance(value, numbers.Integral) and not isinstance(value, bool)
    )


def is_real(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a real number (Python or NumPy int or float), a bool not counting."""
    kind = type(value)
    return (
        kind is float
        or kind is int
        or (isinstance(value, numbers.Real) and not isinstance(value, bool))
    )


def _refuse(name: str, accepted: str, value: object) -> NoReturn:
    raise ValueError(f"{name} must be {accepted}, got {value!r}")


def _wrong_type(error: type[Exception], name: str, accepted: str, value: object) -> NoReturn:
    raise error(f"{name} must be {accepted}, got {type(value).__name__} {value!r}")


def integer(
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    wrong_type: type[Exception] = TypeError,
) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (either end may be open-ended).

    ``wrong_type`` is the exception for a value that is no integer: the few public functions that
    have always raised :class:`ValueError` there keep doing so.
    """
    if minimum is not None and maximum is not None:
        accepted = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        accepted = f"an integer >= {minimum}"
    elif maximum is not None:
        accepted = f"an integer <= {maximum}"
    else:
        accepted = "an integer"
    if not is_int(value):
        _wrong_type(wrong_type, name, accepted, value)
    result = int(value)
    if (minimum is not None and result < minimum) or (maximum is not None and result > maximum):
        _refuse(name, accepted, value)
    return result


def positive_int(
    name: str, value: object, *, minimum: int = 1, wrong_type: type[Exception] = TypeError
) -> int:
    """``value`` as an ``int >= minimum`` (1 unless told)."""
    return integer(name, value, minimum=minimum, wrong_type=wrong_type)


def nonnegative_int(name: str, value: object, *, wrong_type: type[Exception] = TypeError) -> int:
    """``value`` as an ``int >= 0``."""
    return integer(name, value, minimum=0, wrong_type=wrong_type)


def _checked_real(
    name: str,
    value: object,
    accepted: str | Callable[[], str],
    ok: Callable[[float], bool],
    wrong_type: type[Exception],
) -> float:
    """``accepted`` (or a function giving it: worded only for an error) names the values
    allowed."""
    if not is_real(value):
        _wrong_type(wrong_type, name, accepted if isinstance(accepted, str) else accepted(), value)
    result = float(value)
    if not ok(result):
        _refuse(name, accepted if isinstance(accepted, str) else accepted(), value)
    return result


def real(name: str, value: object, *, wrong_type: type[Exception] = TypeError) -> float:
    """``value`` as a ``float`` (NaN and infinities included)."""
    return _checked_real(name, value, "a real number", lambda _: True, wrong_type)


def finite(name: str, value: object, *, wrong_type: type[Exception] = TypeError) -> float:
    """``value`` as a finite ``float``."""
    return _checked_real(name, value, "a finite number", math.isfinite, wrong_type)


def finite_positive(name: str, value: object, *, wrong_type: type[Exception] = TypeError) -> float:
    """``value`` as a finite ``float > 0``."""

    def ok(x: float) -> bool:
        return math.isfinite(x) and x > 0.0

    return _checked_real(name, value, "a finite number > 0", ok, wrong_type)


def finite_nonnegative(
    name: str, value: object, *, wrong_type: type[Exception] = TypeError
) -> float:
    """``value`` as a finite ``float >= 0``."""

    def ok(x: float) -> bool:
        return math.isfinite(x) and x >= 0.0

    return _checked_real(name, value, "a finite number >= 0", ok, wrong_type)


def _interval(low: float, high: float, open_low: bool, open_high: bool) -> str:
    def end(x: float) -> str:
        return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"

    span = f"{'(' if open_low else '['}{end(low)}, {end(high)}{')' if open_high else ']'}"
    return f"the open interval {span}" if open_low and open_high else span


def real_in(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    open_low: bool = False,
    open_high: bool = False,
    wrong_type: type[Exception] = TypeError,
) -> float:
    """``value`` as a ``float`` in the interval from ``low`` to ``high`` (NaN refused).

    The ends are closed unless ``open_low`` / ``open_high``; an infinite closed end accepts the
    infinity itself (``real_in(name, v, 0, math.inf)`` is ``[0, inf]``).
    """

    def ok(x: float) -> bool:  # NaN fails both comparisons
        return (x > low if open_low else x >= low) and (x < high if open_high else x <= high)

    def accepted() -> str:
        return f"in {_interval(low, high, open_low, open_high)}"

    return _checked_real(name, value, accepted, ok, wrong_type)


def probability(
    name: str,
    value: object,
    *,
    open_low: bool = False,
    open_high: bool = False,
    wrong_type: type[Exception] = TypeError,
) -> float:
    """``value`` as a ``float`` in ``[0, 1]`` (either end open on request)."""
    return real_in(
        name, value, 0.0, 1.0, open_low=open_low, open_high=open_high, wrong_type=wrong_type
    )


def choice(name: str, value: object, choices: Collection[T]) -> T:
    """``value`` itself when it is one of ``choices``."""
    for option in choices:
        same_kind = isinstance(value, type(option)) and isinstance(value, bool) == isinstance(
            option, bool
        )
        if same_kind and value == option:
            return option
    raise ValueError(f"{name} must be one of {tuple(choices)!r}, got {value!r}")


def flag(name: str, value: object) -> bool:
    """``value`` when it is ``True`` or ``False`` (not an int, NumPy bool or ``None``)."""
    if not isinstance(value, bool):
        _wrong_type(TypeError, name, "True or False", value)
    return value


def optional(
    check: Callable[..., T], name: str, value: object, *args: Any, **kwargs: Any
) -> T | None:
    """``None`` when ``value`` is ``None``, otherwise ``check(name, value, *args, **kwargs)``."""
    return None if value is None else check(name, value, *args, **kwargs)
