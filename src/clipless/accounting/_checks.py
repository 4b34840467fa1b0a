"""Argument validation for :mod:`clipless.accounting`, and the settings it checks against.

Every checker returns the normalised value or raises :class:`TypeError` (wrong type) or
:class:`ValueError` (wrong value) with a message naming the argument and the accepted range.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Literal

from dp_accounting.rdp import rdp_privacy_accountant

#: Which ``dp_accounting`` accountant composes the events: privacy loss distributions (tight,
#: the default) or Renyi DP (an upper bound; refuses replace-one under subsampling).
AccountantKind = Literal["pld", "rdp"]
#: The neighbouring relation of the guarantee: add or remove one example, or replace one.
Neighbouring = Literal["add_remove", "replace_one"]

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
NEIGHBOURING_RELATIONS: tuple[str, ...] = ("add_remove", "replace_one")

DEFAULT_PLD_DISCRETIZATION = 1e-4
"""Default ``value_discretization_interval`` of the PLD accountant (package docstring)."""

DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS
)
"""``dp_accounting``'s default orders: 1.1..10.9 by 0.1, 11..63, 128, 256, 512, 1024."""


def _real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__} {value!r}")
    return float(value)


def _check_epsilon(value: object, name: str = "epsilon", *, allow_zero: bool = False) -> float:
    eps = _real(value, name)
    low_ok = eps >= 0.0 if allow_zero else eps > 0.0
    if not (math.isfinite(eps) and low_ok):
        bound = "[0, inf)" if allow_zero else "(0, inf)"
        raise ValueError(f"{name} must be a finite number in {bound}; got {value!r}")
    return eps


def _check_delta(value: object, name: str = "delta") -> float:
    delta = _real(value, name)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"{name} must be in the open interval (0, 1); got {value!r}")
    return delta


def _check_sample_rate(value: object, name: str = "sample_rate") -> float:
    q = _real(value, name)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"{name} must be in (0, 1]; got {value!r}")
    return q


def _check_noise_multiplier(value: object, name: str = "noise_multiplier") -> float:
    sigma = _real(value, name)
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
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer; got bool {value!r}")
    if isinstance(value, numbers.Integral):
        count = int(value)
    elif isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be an integer >= {minimum}; got non-integer {value!r}")
    else:
        raise TypeError(f"{name} must be an integer; got {type(value).__name__} {value!r}")
    if count < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return count


def _check_kind(value: object) -> str:
    if value not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}; got {value!r}")
    return str(value)


def _check_neighbouring(value: object) -> str:
    if value not in NEIGHBOURING_RELATIONS:
        raise ValueError(f"neighbouring must be one of {NEIGHBOURING_RELATIONS}; got {value!r}")
    return str(value)


def _check_discretization(value: object) -> float:
    vdi = _real(value, "value_discretization_interval")
    if not (math.isfinite(vdi) and 0.0 < vdi <= 0.1):
        raise ValueError(f"value_discretization_interval must be in (0, 0.1]; got {value!r}")
    return vdi


def _check_orders(value: Iterable[object] | None) -> tuple[float, ...]:
    if value is None:
        return DEFAULT_RDP_ORDERS
    orders = tuple(_real(a, "orders[i]") for a in value)
    if not orders or any(not (math.isfinite(a) and a > 1.0) for a in orders):
        raise ValueError(
            f"orders must be a non-empty sequence of finite numbers > 1; got {value!r}"
        )
    return orders
