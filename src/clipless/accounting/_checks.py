"""Argument checks of :mod:`clipless.accounting` (the generic parts are :mod:`clipless._validate`),
and the settings they check against.

Every checker returns the normalised value or raises :class:`TypeError` (wrong type) or
:class:`ValueError` (wrong value) with a message naming the argument and the accepted range.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal, get_args

from dp_accounting.rdp import rdp_privacy_accountant

from clipless import _validate

#: Which ``dp_accounting`` accountant composes the events: privacy loss distributions (tight,
#: the default) or Renyi DP (an upper bound; refuses replace-one under subsampling).
AccountantKind = Literal["pld", "rdp"]
#: The neighbouring relation of the guarantee: add or remove one example, or replace one.
Neighbouring = Literal["add_remove", "replace_one"]

ACCOUNTANTS: tuple[AccountantKind, ...] = get_args(AccountantKind)
NEIGHBOURING_RELATIONS: tuple[Neighbouring, ...] = get_args(Neighbouring)

DEFAULT_PLD_DISCRETIZATION = 1e-4
"""Default ``value_discretization_interval`` of the PLD accountant (package docstring)."""

DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS
)
"""``dp_accounting``'s default orders: 1.1..10.9 by 0.1, 11..63, 128, 256, 512, 1024."""


def _real(value: object, name: str) -> float:
    return _validate.real(name, value)


def _check_epsilon(value: object, name: str = "epsilon", *, allow_zero: bool = False) -> float:
    return _validate.real_in(name, value, 0.0, math.inf, open_low=not allow_zero, open_high=True)


def _check_delta(value: object, name: str = "delta") -> float:
    return _validate.probability(name, value, open_low=True, open_high=True)


def _check_sample_rate(value: object, name: str = "sample_rate") -> float:
    return _validate.probability(name, value, open_low=True)


def _check_noise_multiplier(value: object, name: str = "noise_multiplier") -> float:
    sigma = _validate.real(name, value)
    if math.isnan(sigma) or sigma < 0.0:
        raise ValueError(
            f"{name} must be in [0, inf] (0 means no privacy, inf releases nothing); got {value!r}"
        )
    return sigma


def _check_releases(value: object, name: str = "releases") -> tuple[float, ...]:
    """Noise multipliers of one-shot (``q = 1``) Gaussian releases: each in ``(0, inf]``."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of noise multipliers; got {value!r}")
    return tuple(_check_release(raw, f"{name}[{i}]") for i, raw in enumerate(value))


def _check_release(value: object, name: str) -> float:
    """The noise multiplier of one one-shot Gaussian release: in ``(0, inf]``."""
    sigma = _check_noise_multiplier(value, name)
    if sigma == 0.0:
        raise ValueError(f"{name} must be > 0 (0 means no privacy); got {value!r}")
    return sigma


def _check_count(value: object, name: str, *, minimum: int) -> int:
    if _validate.is_real(value) and not _validate.is_int(value):  # 2.5 steps: a wrong value
        raise ValueError(f"{name} must be an integer >= {minimum}, got non-integer {value!r}")
    return _validate.integer(name, value, minimum=minimum)


def _check_kind(value: object) -> str:
    return _validate.choice("accountant", value, ACCOUNTANTS)


def _check_neighbouring(value: object) -> str:
    return _validate.choice("neighbouring", value, NEIGHBOURING_RELATIONS)


def _check_discretization(value: object) -> float:
    return _validate.real_in("value_discretization_interval", value, 0.0, 0.1, open_low=True)


def _check_orders(value: Iterable[object] | None) -> tuple[float, ...]:
    if value is None:
        return DEFAULT_RDP_ORDERS
    orders = tuple(_real(a, "orders[i]") for a in value)
    if not orders or any(not (math.isfinite(a) and a > 1.0) for a in orders):
        raise ValueError(
            f"orders must be a non-empty sequence of finite numbers > 1; got {value!r}"
        )
    return orders
