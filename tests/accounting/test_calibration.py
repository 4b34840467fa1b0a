"""clipless.accounting.calibration: calibrate_noise round trips and bad input."""

from __future__ import annotations

import pytest

from clipless.accounting import (
    calibrate_noise,
    epsilon,
)

from ._helpers import FAST


# ------------------------------------------------------------------------------- calibration
@pytest.mark.parametrize(
    ("kind", "rel", "q", "steps", "target"),
    [
        ("pld", "add_remove", 0.02, 300, 1.5),
        ("pld", "replace_one", 0.05, 100, 3.0),
        ("rdp", "add_remove", 0.01, 1000, 2.0),
        ("rdp", "replace_one", 1.0, 5, 4.0),
    ],
)
def test_calibrate_noise_round_trip(
    kind: str, rel: str, q: float, steps: int, target: float
) -> None:
    tol = 1e-3
    kw = {"value_discretization_interval": FAST}
    sigma = calibrate_noise(target, 1e-5, q, steps, kind, rel, tol, **kw)  # type: ignore[arg-type]
    assert epsilon(sigma, q, steps, 1e-5, kind, rel, **kw) <= target  # type: ignore[arg-type]
    smaller = sigma / (1 + 2 * tol)
    assert epsilon(smaller, q, steps, 1e-5, kind, rel, **kw) > target  # type: ignore[arg-type]


def test_calibrate_noise_bad_input() -> None:
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise(0.0, 1e-5, 0.1, 10)
    with pytest.raises(ValueError, match="target_delta"):
        calibrate_noise(1.0, 1.0, 0.1, 10)
    with pytest.raises(ValueError, match="steps"):
        calibrate_noise(1.0, 1e-5, 0.1, 0)
    with pytest.raises(ValueError, match="tolerance"):
        calibrate_noise(1.0, 1e-5, 0.1, 10, tolerance=0.0)
    with pytest.raises(ValueError, match="max_noise_multiplier"):
        calibrate_noise(1e-3, 1e-5, 1.0, 10, "rdp", max_noise_multiplier=2.0)


def test_pld_refuses_targets_it_cannot_calibrate_in_time() -> None:
    """API audit: calibrate_noise(1000, ...) with the PLD accountant did not return in 150 s;
    the CLI already capped --epsilon at 50. RDP answers at once."""
    from clipless import accounting
    from clipless.cli import PLD_MAX_EPSILON

    assert accounting.PLD_MAX_EPSILON == PLD_MAX_EPSILON
    with pytest.raises(ValueError, match="accountant='rdp'"):
        accounting.calibrate_noise(1000.0, 1e-5, 0.25, 4)
    assert accounting.calibrate_noise(1000.0, 1e-5, 0.25, 4, "rdp") > 0
