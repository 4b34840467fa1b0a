"""The error a private step raises when the contract its noise relies on is broken (private;
re-exported by :mod:`clipless.optim`). A leaf module, so the layers' hook marks can name it."""

from __future__ import annotations

__all__ = ["PlanExhaustedError", "PrivacyContractError"]


class PrivacyContractError(RuntimeError):
    """A training step would break an assumption the noise calibration relies on."""


class PlanExhaustedError(PrivacyContractError):
    """The run has taken every step its privacy budget was planned for."""
