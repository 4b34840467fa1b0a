"""Rounding-up float64 arithmetic: the one home of the helpers every certified bound uses (private).

A certified bound is an *upper* bound that holds for the exact real number, not only for its
float64 approximation. Python floats are IEEE-754 binary64 with round-to-nearest, so one
correctly rounded operation (``*``, ``+``, :func:`math.sqrt`, :func:`math.fsum`) lands within half
an ulp of the exact result; moving the computed value one ulp towards ``+inf``
(:func:`math.nextafter`) therefore gives a float ``>=`` the exact result, and at most one ulp above
the smallest such float. Every operand is assumed non-negative (they are norms and Lipschitz
constants), ``inf`` stays ``inf`` and ``0 * inf`` is taken as 0 (a zero factor kills an unbounded
one: a layer that contributes nothing).

Where a quantity comes out of floating-point *linear algebra* (an SVD, an FFT, a long sum of
squares), one ulp is not enough; those bounds are multiplied by ``1 + NUMERIC_MARGIN``
(:func:`inflate`; the justification is in the docstring of :data:`clipless.norms.NUMERIC_MARGIN`).

For exact rationals (:class:`fractions.Fraction`: loss constants such as ``sqrt(k / (k - 1))``)
:func:`upper`, :func:`sqrt_upper` and :func:`inv_sqrt_upper` return the smallest float64 ``>=`` the
value (or within an ulp of it for square roots), checked in exact arithmetic.

This module imports nothing but the standard library (no torch), so any module may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction

__all__ = [
    "NUMERIC_MARGIN",
    "UNIT_ROUNDOFF",
    "add",
    "gamma",
    "inflate",
    "inv_sqrt_upper",
    "mul",
    "product",
    "sqrt",
    "sqrt_upper",
    "total",
    "up",
    "upper",
]

UNIT_ROUNDOFF: float = 2.0**-53
"""Unit roundoff ``u`` of float64: every correctly rounded operation has relative error ``<= u``."""

NUMERIC_MARGIN: float = 1e-9
"""Relative inflation of bounds computed with floating-point linear algebra (:func:`inflate`)."""


def gamma(j: int) -> float:
    """``gamma_j = j u / (1 - j u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
    Lemma 3.1), float64 ``u``: the relative error bound of ``j`` rounded operations."""
    ju = j * UNIT_ROUNDOFF
    if ju >= 0.5:
        raise ValueError(f"gamma_{j} is too large for a float64 bound")
    return ju / (1.0 - ju)


def up(value: float) -> float:
    """Round the float64 result of ONE rounded-to-nearest operation up to a certified bound."""
    return math.nextafter(float(value), math.inf)


def mul(a: float, b: float) -> float:
    """Certified upper bound on ``a * b`` for non-negative ``a, b`` (with ``0 * inf = 0``)."""
    if a == 0.0 or b == 0.0:
        return 0.0
    return up(float(a) * float(b))


def add(a: float, b: float) -> float:
    """Certified upper bound on ``a + b`` for non-negative ``a, b``."""
    return up(float(a) + float(b))


def sqrt(value: float) -> float:
    """Certified upper bound on ``sqrt(value)`` for ``value >= 0`` (exact for 0)."""
    if value == 0.0:
        return 0.0
    return up(math.sqrt(value))


def product(values: Iterable[float]) -> float:
    """Certified upper bound on the product of non-negative floats (1 for no values).

    Each partial product is rounded up (:func:`mul`), so the result bounds the exact product;
    a zero factor gives 0 even next to ``inf``.
    """
    out = 1.0
    for v in values:
        out = mul(out, v)
    return out


def total(values: Iterable[float]) -> float:
    """Certified upper bound on the sum of non-negative floats (0 for no values).

    :func:`math.fsum` is correctly rounded (one rounding for the whole sum), so one ulp up covers
    it.
    """
    items = [float(v) for v in values]
    if not items:
        return 0.0
    return up(math.fsum(items))


def inflate(value: float) -> float:
    """``value (1 + NUMERIC_MARGIN)``: the margin for results of floating-point linear algebra."""
    return float(value) * (1.0 + NUMERIC_MARGIN)


def upper(value: Fraction | int) -> float:
    """The smallest float64 ``>= value`` (``value`` an exact rational)."""
    f = float(value)
    if Fraction(f) < value:
        f = math.nextafter(f, math.inf)
    return f


def sqrt_upper(value: Fraction | int) -> float:
    """A float64 ``c >= sqrt(value)`` (checked exactly: ``c^2 >= value``), within an ulp or two."""
    c = math.sqrt(float(value))
    while Fraction(c) ** 2 < value:
        c = math.nextafter(c, math.inf)
    return c


def inv_sqrt_upper(value: float) -> float:
    """The smallest float64 ``c`` found with ``c >= 1 / sqrt(value)`` exactly (``value > 0``).

    Checked in exact rational arithmetic (``c^2 value >= 1``), so e.g. ``1/sqrt(4)`` stays
    ``0.5`` while an inexact quotient is rounded up by one ulp.
    """
    c = 1.0 / math.sqrt(value)
    while Fraction(c) ** 2 * Fraction(value) < 1:
        c = math.nextafter(c, math.inf)
    return c
