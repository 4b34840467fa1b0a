"""clipless._validate: each validator's accepted values, refusals and exact messages."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from clipless import _validate as v


def _raises(error: type[Exception], message: str) -> Any:
    return pytest.raises(error, match=f"^{re.escape(message)}$")


def test_predicates_refuse_bools_and_take_numpy_numbers() -> None:
    assert v.is_int(3) and v.is_int(np.int64(3)) and not v.is_int(True) and not v.is_int(3.0)
    assert v.is_real(3) and v.is_real(np.float32(0.5)) and v.is_real(Fraction(1, 3))
    assert not v.is_real(False) and not v.is_real("1") and not v.is_real(None)
    assert not v.is_real(1 + 0j)


def test_integer_accepts_and_normalises() -> None:
    assert v.integer("n", np.int32(-4)) == -4 and type(v.integer("n", np.int32(-4))) is int
    assert v.integer("n", 5, minimum=5, maximum=5) == 5
    assert v.positive_int("n", 1) == 1 and v.positive_int("n", 2, minimum=2) == 2
    assert v.nonnegative_int("n", 0) == 0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: v.integer("n", True), TypeError, "n must be an integer, got bool True"),
        (lambda: v.integer("n", 2.0), TypeError, "n must be an integer, got float 2.0"),
        (lambda: v.integer("n", 9, maximum=8), ValueError, "n must be an integer <= 8, got 9"),
        (
            lambda: v.integer("n", 0, minimum=1, maximum=3),
            ValueError,
            "n must be an integer in [1, 3], got 0",
        ),
        (lambda: v.positive_int("steps", 0), ValueError, "steps must be an integer >= 1, got 0"),
        (
            lambda: v.positive_int("steps", "3"),
            TypeError,
            "steps must be an integer >= 1, got str '3'",
        ),
        (lambda: v.positive_int("k", 1, minimum=2), ValueError, "k must be an integer >= 2, got 1"),
        (lambda: v.nonnegative_int("seed", -1), ValueError, "seed must be an integer >= 0, got -1"),
    ],
)
def test_integer_refusals(call: Any, error: type[Exception], message: str) -> None:
    with _raises(error, message):
        call()


def test_reals_accept_and_normalise() -> None:
    assert v.real("x", math.inf) == math.inf and math.isnan(v.real("x", math.nan))
    assert type(v.real("x", np.float32(0.25))) is float and v.real("x", 3) == 3.0
    assert v.finite("x", -2) == -2.0
    assert v.finite_positive("x", 1e-300) == 1e-300
    assert v.finite_nonnegative("x", 0) == 0.0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: v.real("x", True), TypeError, "x must be a real number, got bool True"),
        (lambda: v.real("x", "1"), TypeError, "x must be a real number, got str '1'"),
        (lambda: v.finite("x", math.inf), ValueError, "x must be a finite number, got inf"),
        (lambda: v.finite("x", math.nan), ValueError, "x must be a finite number, got nan"),
        (lambda: v.finite_positive("x", 0.0), ValueError, "x must be a finite number > 0, got 0.0"),
        (
            lambda: v.finite_positive("x", math.inf),
            ValueError,
            "x must be a finite number > 0, got inf",
        ),
        (
            lambda: v.finite_positive("x", None),
            TypeError,
            "x must be a finite number > 0, got NoneType None",
        ),
        (lambda: v.finite("x", "1"), TypeError, "x must be a finite number, got str '1'"),
        (
            lambda: v.finite_nonnegative("x", -1e-9),
            ValueError,
            "x must be a finite number >= 0, got -1e-09",
        ),
        (
            lambda: v.finite_nonnegative("x", math.nan),
            ValueError,
            "x must be a finite number >= 0, got nan",
        ),
    ],
)
def test_real_refusals(call: Any, error: type[Exception], message: str) -> None:
    with _raises(error, message):
        call()


def test_real_in_ends() -> None:
    assert v.real_in("r", 0, 0.0, math.inf) == 0.0
    assert v.real_in("r", math.inf, 0.0, math.inf) == math.inf  # a closed infinite end
    assert v.real_in("q", 1, 0.0, 1.0, open_low=True) == 1.0
    assert v.probability("p", 0) == 0.0 and v.probability("p", 1) == 1.0
    assert v.probability("d", 0.5, open_low=True, open_high=True) == 0.5


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: v.real_in("r", -1, 0.0, math.inf), "r must be in [0, inf], got -1"),
        (lambda: v.real_in("r", math.nan, 0.0, math.inf), "r must be in [0, inf], got nan"),
        (
            lambda: v.real_in("e", math.inf, 0.0, math.inf, open_low=True, open_high=True),
            "e must be in the open interval (0, inf), got inf",
        ),
        (
            lambda: v.real_in("t", 0.5, 0.5, 2.0, open_low=True),
            "t must be in (0.5, 2], got 0.5",
        ),
        (lambda: v.real_in("t", -3, -2.0, 2.0), "t must be in [-2, 2], got -3"),
        (
            lambda: v.probability("sample_rate", 0.0, open_low=True),
            "sample_rate must be in (0, 1], got 0.0",
        ),
        (
            lambda: v.probability("delta", 1.0, open_low=True, open_high=True),
            "delta must be in the open interval (0, 1), got 1.0",
        ),
        (lambda: v.probability("p", 1.5), "p must be in [0, 1], got 1.5"),
        (lambda: v.probability("p", math.nan), "p must be in [0, 1], got nan"),
        (
            lambda: v.probability("p", 1.0, open_high=True),
            "p must be in [0, 1), got 1.0",
        ),
    ],
)
def test_real_in_refusals(call: Any, message: str) -> None:
    with _raises(ValueError, message):
        call()


def test_real_in_refuses_bools_by_type() -> None:
    with _raises(TypeError, "p must be in [0, 1], got bool False"):
        v.probability("p", False)


def test_wrong_type_can_stay_a_value_error() -> None:
    """Some public functions have always raised ValueError for a wrong type; they keep it."""
    with _raises(ValueError, "steps must be an integer >= 1, got str '2'"):
        v.positive_int("steps", "2", wrong_type=ValueError)
    with _raises(ValueError, "steps must be an integer >= 1, got 0"):
        v.positive_int("steps", 0, wrong_type=ValueError)
    with _raises(ValueError, "seed must be an integer >= 0, got bool True"):
        v.nonnegative_int("seed", True, wrong_type=ValueError)
    with _raises(ValueError, "c must be a finite number > 0, got NoneType None"):
        v.finite_positive("c", None, wrong_type=ValueError)
    with _raises(ValueError, "c must be a finite number >= 0, got str '1'"):
        v.finite_nonnegative("c", "1", wrong_type=ValueError)
    with _raises(ValueError, "x must be a real number, got list []"):
        v.real("x", [], wrong_type=ValueError)
    with _raises(ValueError, "x must be a finite number, got bool False"):
        v.finite("x", False, wrong_type=ValueError)
    with _raises(ValueError, "d must be in the open interval (0, 1), got str '0.1'"):
        v.probability("d", "0.1", open_low=True, open_high=True, wrong_type=ValueError)
    with _raises(ValueError, "n must be an integer, got float 1.5"):
        v.integer("n", 1.5, wrong_type=ValueError)


def test_choice() -> None:
    assert v.choice("mode", "sum", ("mean", "sum")) == "sum"
    with _raises(ValueError, "mode must be one of ('mean', 'sum'), got 'max'"):
        v.choice("mode", "max", ("mean", "sum"))
    with _raises(ValueError, "level must be one of (0, 1), got True"):
        v.choice("level", True, (0, 1))  # True == 1, but a bool is not an int here
    with _raises(ValueError, "mode must be one of ('mean',), got ['mean']"):
        v.choice("mode", ["mean"], ("mean",))


def test_flag() -> None:
    assert v.flag("strict", True) is True and v.flag("strict", False) is False
    assert str(v.flag("x", True)) == "True"
    for bad in (1, None, np.bool_(True), "True"):
        with _raises(TypeError, f"strict must be True or False, got {type(bad).__name__} {bad!r}"):
            v.flag("strict", bad)


def test_optional() -> None:
    assert v.optional(v.positive_int, "seed", None) is None
    assert v.optional(v.positive_int, "seed", 3, minimum=3) == 3
    assert v.optional(v.real_in, "x", 0.5, 0.0, 1.0) == 0.5
    with _raises(ValueError, "seed must be an integer >= 1, got 0"):
        v.optional(v.positive_int, "seed", 0)


def test_numpy_ints_are_stored_as_ints_where_ints_were_required() -> None:
    """Sites that took Python ints only accept NumPy ints now, and keep them as ints."""
    from clipless import nn as cnn

    flat = cnn.Flatten(np.int64(1), np.int32(-1))  # type: ignore[arg-type]
    assert (flat.start_dim, flat.end_dim) == (1, -1)
    assert type(flat.start_dim) is int and type(flat.end_dim) is int
    with pytest.raises(ValueError, match="start_dim"):
        cnn.Flatten(True)
