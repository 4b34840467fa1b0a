"""Shared by the tests of :mod:`clipless.accounting`."""

from __future__ import annotations

import dp_accounting
from dp_accounting.pld import PLDAccountant

FAST = 1e-3  # PLD discretisation for tests that need many evaluations (8x faster than 1e-4)


def _dpa_pld(sigma: float, q: float, steps: int, delta: float, **kw: object) -> float:
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    acc = PLDAccountant(**kw)  # type: ignore[arg-type]
    return float(acc.compose(dp_accounting.SelfComposedDpEvent(event, steps)).get_epsilon(delta))
