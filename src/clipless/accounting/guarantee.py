"""A frozen, self-describing privacy claim."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from clipless import _validate
from clipless.accounting._checks import (
    _check_count,
    _check_delta,
    _check_kind,
    _check_neighbouring,
    _check_noise_multiplier,
    _check_sample_rate,
    _real,
)

__all__ = ["PrivacyGuarantee"]


@dataclasses.dataclass(frozen=True)
class PrivacyGuarantee:
    """A frozen description of a privacy claim, separate from the code that trains.

    ``noise_multiplier`` (effective, ``std / G``) and ``sample_rate`` are ``None`` when the steps
    did not all share one value (``mechanism`` then lists them). ``is_dp_guarantee`` is ``False``
    when an unproven mode (e.g. batch-max gradient scaling, docs/design.md "Gradient scaling") was
    used: the numbers are then what the accountant *would* report, and ``str()`` says "NOT a DP
    guarantee".
    """

    epsilon: float
    delta: float
    accountant: str
    neighbouring: str
    sample_rate: float | None
    noise_multiplier: float | None
    steps: int
    mechanism: str
    is_dp_guarantee: bool = True

    def __post_init__(self) -> None:
        # the numbers are stored as Python floats and ints (NumPy scalars are accepted and
        # converted), so that to_dict() is plain JSON
        eps = _real(self.epsilon, "epsilon")
        if math.isnan(eps) or eps < 0.0:
            raise ValueError(f"epsilon must be in [0, inf]; got {self.epsilon!r}")
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "delta", _check_delta(self.delta))
        _check_kind(self.accountant)
        _check_neighbouring(self.neighbouring)
        if self.sample_rate is not None:
            object.__setattr__(self, "sample_rate", _check_sample_rate(self.sample_rate))
        if self.noise_multiplier is not None:
            sigma = _check_noise_multiplier(self.noise_multiplier)
            object.__setattr__(self, "noise_multiplier", sigma)
        object.__setattr__(self, "steps", _check_count(self.steps, "steps", minimum=0))
        if not isinstance(self.mechanism, str):
            raise TypeError(f"mechanism must be a str; got {type(self.mechanism).__name__}")
        _validate.flag("is_dp_guarantee", self.is_dp_guarantee)

    def __str__(self) -> str:
        relation = "add/remove-one" if self.neighbouring == "add_remove" else "replace-one"
        claim = (
            f"(epsilon={self.epsilon:.4g}, delta={self.delta:.3g})-DP under {relation} "
            f"neighbours, {self.accountant.upper()} accountant, {self.steps} steps of "
            f"{self.mechanism}"
        )
        if self.noise_multiplier is not None and self.sample_rate is not None:
            claim += (
                f" (noise multiplier {self.noise_multiplier:.6g}, "
                f"sample rate {self.sample_rate:.6g})"
            )
        if not self.is_dp_guarantee:
            return (
                "NOT a DP guarantee: an unproven mode was used, so the following is only what "
                f"the accountant would report: {claim}"
            )
        return claim

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
        return dataclasses.asdict(self)
