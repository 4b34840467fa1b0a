"""One-shot Gaussian releases composed with the steps (ledger, epsilon, calibration)."""

from __future__ import annotations

import json
import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from clipless import accounting
from clipless.accounting import PrivacyLedger

Q, STEPS, DELTA = 0.05, 40, 1e-5


def _direct_pld(sigma: float, q: float, steps: int, releases: list[float], delta: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    for z in releases:
        acc.compose(dp_event.GaussianDpEvent(z))
    return float(acc.get_epsilon(delta))


def test_epsilon_with_releases_equals_direct_dp_accounting_composition() -> None:
    ours = accounting.epsilon(1.0, Q, STEPS, DELTA, releases=[20.0, 5.0])
    assert ours == pytest.approx(_direct_pld(1.0, Q, STEPS, [20.0, 5.0], DELTA), rel=1e-12)
    # a release costs something, and more noise costs less
    base = accounting.epsilon(1.0, Q, STEPS, DELTA)
    assert base < accounting.epsilon(1.0, Q, STEPS, DELTA, releases=[20.0]) < ours


def test_epsilon_with_releases_rdp_matches_dp_accounting() -> None:
    ours = accounting.epsilon(1.0, Q, STEPS, DELTA, accountant="rdp", releases=[3.0])
    acc = rdp_privacy_accountant.RdpAccountant(list(accounting.DEFAULT_RDP_ORDERS))
    acc.compose(dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(1.0)), STEPS)
    acc.compose(dp_event.GaussianDpEvent(3.0))
    assert ours == pytest.approx(float(acc.get_epsilon(DELTA)), rel=1e-12)


def test_release_under_replace_one_is_the_gaussian_at_half_the_multiplier() -> None:
    # q = 1: replace-one doubles the sensitivity exactly (package docstring)
    one = accounting.epsilon(math.inf, Q, 1, DELTA, "pld", "replace_one", releases=[4.0])
    two = accounting.epsilon(math.inf, Q, 1, DELTA, "pld", "add_remove", releases=[2.0])
    assert one == pytest.approx(two, rel=1e-3)


def test_calibration_leaves_the_steps_what_the_release_does_not_spend() -> None:
    sigma = accounting.calibrate_noise(2.0, DELTA, Q, STEPS, "rdp", releases=[5.0])
    plain = accounting.calibrate_noise(2.0, DELTA, Q, STEPS, "rdp")
    assert sigma > plain  # the release takes part of the budget
    assert accounting.epsilon(sigma, Q, STEPS, DELTA, "rdp", releases=[5.0]) <= 2.0
    assert accounting.epsilon(sigma / 1.001, Q, STEPS, DELTA, "rdp", releases=[5.0]) > 2.0


def test_calibration_refuses_releases_that_spend_the_whole_budget() -> None:
    with pytest.raises(ValueError, match=r"releases .* alone spend epsilon"):
        accounting.calibrate_noise(0.5, DELTA, Q, STEPS, releases=[1.0])


@pytest.mark.parametrize("bad", [[0.0], [-1.0], [float("nan")], "20", [None]])
def test_bad_releases_are_refused_with_the_argument_named(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="releases"):
        accounting.epsilon(1.0, Q, STEPS, DELTA, releases=bad)  # type: ignore[arg-type]


def test_ledger_composes_releases_without_counting_them_as_steps() -> None:
    ledger = PrivacyLedger()
    ledger.record_release(20.0, label="input mean")
    ledger.record(1.0, Q, count=STEPS)
    assert ledger.steps == STEPS
    assert ledger.releases == (accounting.LedgerRelease(20.0, "input mean"),)
    assert ledger.epsilon(DELTA) == pytest.approx(
        _direct_pld(1.0, Q, STEPS, [20.0], DELTA), rel=1e-12
    )
    assert ledger.delta(ledger.epsilon(DELTA)) == pytest.approx(DELTA, rel=1e-2)
    g = ledger.guarantee(DELTA)
    assert "Gaussian release (input mean) (sigma=20)" in g.mechanism
    assert g.steps == STEPS
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(ledger.to_dp_event())
    assert float(acc.get_epsilon(DELTA)) == pytest.approx(ledger.epsilon(DELTA), rel=1e-12)


def test_ledger_would_exceed_counts_the_release() -> None:
    sigma = accounting.calibrate_noise(2.0, DELTA, Q, STEPS, "rdp")
    plain = PrivacyLedger("rdp")
    assert not plain.would_exceed(2.0, DELTA, sigma, Q, count=STEPS)
    released = PrivacyLedger("rdp")
    released.record_release(3.0)
    assert released.would_exceed(2.0, DELTA, sigma, Q, count=STEPS)


def test_ledger_round_trips_releases_and_reads_ledgers_without_them(tmp_path) -> None:
    ledger = PrivacyLedger()
    ledger.record_release(20.0, label="input mean")
    ledger.record(1.0, Q, count=3)
    path = tmp_path / "ledger.json"
    ledger.to_json(path)
    again = PrivacyLedger.from_json(path)
    assert again.releases == ledger.releases
    assert again.epsilon(DELTA) == ledger.epsilon(DELTA)
    # a ledger without releases has no "releases" key (files of earlier versions read the same)
    plain = PrivacyLedger()
    plain.record(1.0, Q, count=3)
    assert "releases" not in plain.to_dict()
    data = json.loads(path.read_text())
    data["releases"] = [{"noise_multiplier": 0.0, "label": None}]
    with pytest.raises(ValueError, match=r"releases\[0\]"):
        PrivacyLedger.from_dict(data)
    data["releases"] = [{"noise_multiplier": 1.0}]
    with pytest.raises(ValueError, match="exactly the keys"):
        PrivacyLedger.from_dict(data)


def test_record_release_refuses_bad_values() -> None:
    ledger = PrivacyLedger()
    with pytest.raises(ValueError, match=r"^noise_multiplier must be > 0"):  # not "...[0]"
        ledger.record_release(0.0)
    with pytest.raises(TypeError, match="label"):
        ledger.record_release(1.0, label=3)  # type: ignore[arg-type]


def test_an_infinite_release_survives_the_file(tmp_path) -> None:
    """Audit finding: record_release(inf) was accepted ((0, inf] as for steps) but the ledger
    could then not be saved (strict JSON has no Infinity), which would stop training."""
    ledger = PrivacyLedger()
    ledger.record_release(math.inf, label="nothing released")
    ledger.record(1.0, 0.01, 5)
    path = tmp_path / "ledger.json"
    ledger.to_json(path)
    back = PrivacyLedger.from_json(path)
    assert back.releases[0].noise_multiplier == math.inf
    assert back.epsilon(1e-5) == ledger.epsilon(1e-5)
    plain = PrivacyLedger()
    plain.record(1.0, 0.01, 5)
    assert back.epsilon(1e-5) == plain.epsilon(1e-5)  # it releases nothing


def test_delta_of_an_extreme_ledger_is_a_bound_not_a_crash() -> None:
    """Audit finding: epsilon() reported inf for sigma = 1e-300 but delta() raised
    OverflowError; 1 is the sound bound."""
    ledger = PrivacyLedger()
    ledger.record(1e-300, 0.5)
    assert ledger.epsilon(1e-5) == math.inf
    assert ledger.delta(1.0) == 1.0
