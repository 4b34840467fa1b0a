"""clipless._certified: every result is an upper bound, exactly (checked with Fractions).

"Tight" means the result is the smallest float64 ``>=`` the exact value, or one ulp above it.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from fractions import Fraction

import pytest

from clipless import _certified as c

INF = math.inf


def _floats(seed: int, n: int = 2000) -> list[float]:
    """Non-negative floats over many binades, with exact small ints and subnormals mixed in."""
    rng = random.Random(seed)
    out = [0.0, 5e-324, 1.0, 2.0, 3.0, 0.1, 1e-308, 1e308]
    for _ in range(n):
        kind = rng.random()
        if kind < 0.6:
            out.append(rng.random() * 10.0 ** rng.randint(-30, 30))
        elif kind < 0.8:
            out.append(float(rng.randint(0, 10**6)))
        else:
            out.append(math.ldexp(rng.random(), rng.randint(-1074, 1020)))
    return out


def _tight(result: float, exact: Fraction) -> None:
    """``result >= exact`` exactly, and at most one ulp above the smallest such float."""
    assert Fraction(result) >= exact
    below = math.nextafter(math.nextafter(result, -INF), -INF)
    if result > 0.0 and below >= 0.0:
        assert Fraction(below) < exact, (result, exact)


def test_constants() -> None:
    assert c.UNIT_ROUNDOFF == 2.0**-53 == math.ulp(1.0) / 2
    assert c.NUMERIC_MARGIN == 1e-9


def test_up_is_next_float() -> None:
    for x in _floats(0, 200):
        assert c.up(x) == math.nextafter(x, INF) > x
    assert c.up(INF) == INF


@pytest.mark.parametrize(
    ("op", "exact", "seed"),
    [(c.mul, lambda a, b: a * b, 1), (c.add, lambda a, b: a + b, 2)],
    ids=["mul", "add"],
)
def test_binary_op_is_a_tight_upper_bound(
    op: Callable[[float, float], float], exact: Callable[[Fraction, Fraction], Fraction], seed: int
) -> None:
    xs = _floats(seed)
    rng = random.Random(seed + 10)
    for a in xs:
        b = rng.choice(xs)
        r = op(a, b)
        if math.isinf(r):  # overflow: the exact value exceeds the largest float
            assert exact(Fraction(a), Fraction(b)) > Fraction(sys.float_info.max)
            continue
        _tight(r, exact(Fraction(a), Fraction(b)))


def test_sqrt_is_a_tight_upper_bound() -> None:
    for x in _floats(3):
        r = c.sqrt(x)
        assert Fraction(r) ** 2 >= Fraction(x)
        below = math.nextafter(math.nextafter(r, -INF), -INF)
        if r > 0.0 and below >= 0.0:
            assert Fraction(below) ** 2 < Fraction(x), x
    assert c.sqrt(0.0) == 0.0
    assert c.sqrt(INF) == INF


def test_product_and_total_bound_the_exact_results() -> None:
    rng = random.Random(4)
    for _ in range(300):
        values = [rng.random() * 10.0 ** rng.randint(-3, 3) for _ in range(rng.randint(0, 12))]
        exact_prod = math.prod((Fraction(v) for v in values), start=Fraction(1))
        exact_sum = sum((Fraction(v) for v in values), start=Fraction(0))
        assert Fraction(c.product(values)) >= exact_prod
        _tight(c.total(values), exact_sum)
    assert c.product([]) == 1.0
    assert c.total([]) == 0.0


def test_zero_times_inf_is_zero() -> None:
    assert c.mul(0.0, INF) == 0.0
    assert c.mul(INF, 0.0) == 0.0
    assert c.product([2.0, 0.0, INF]) == 0.0
    assert c.mul(INF, 2.0) == INF
    assert c.add(INF, 1.0) == INF


def test_inflate() -> None:
    assert c.inflate(2.0) == 2.0 * (1.0 + 1e-9)
    assert c.inflate(0.0) == 0.0


@pytest.mark.parametrize(
    "value", [Fraction(1, 3), Fraction(2), Fraction(10, 7), Fraction(1, 10**30), 5, Fraction(0)]
)
def test_upper_is_the_smallest_float_above(value: Fraction | int) -> None:
    r = c.upper(value)
    assert Fraction(r) >= value
    assert Fraction(math.nextafter(r, -INF)) < value


@pytest.mark.parametrize("value", [2, 3, 4, Fraction(7, 6), Fraction(10**6 + 1), 1])
def test_sqrt_upper(value: Fraction | int) -> None:
    r = c.sqrt_upper(value)
    assert Fraction(r) ** 2 >= value
    assert Fraction(math.nextafter(math.nextafter(r, -INF), -INF)) ** 2 < value


@pytest.mark.parametrize("value", [1, 2, 3, 4, 9, 12, 49, 1000])
def test_inv_sqrt_upper(value: int) -> None:
    r = c.inv_sqrt_upper(value)
    assert Fraction(r) ** 2 * value >= 1
    assert Fraction(math.nextafter(r, -INF)) ** 2 * value < 1


def test_gamma_is_highams_constant_and_refuses_large_counts() -> None:
    u = Fraction(1, 2**53)
    for j in (1, 3, 1000, 2**30):
        assert Fraction(c.gamma(j)) == pytest.approx(j * u / (1 - j * u), rel=1e-15)
    with pytest.raises(ValueError, match="too large"):
        c.gamma(2**52)
