"""clipless.accounting.ledger: merging, epsilon, JSON, lookahead."""

from __future__ import annotations

import json
import math
import os

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant

from clipless import accounting
from clipless.accounting import (
    PrivacyLedger,
    epsilon,
)

from ._helpers import FAST


# --------------------------------------------------------------------------------------- ledger
def _ledger(**kw: object) -> PrivacyLedger:
    return PrivacyLedger(value_discretization_interval=FAST, **kw)  # type: ignore[arg-type]


def test_ledger_merges_consecutive_identical_steps() -> None:
    ledger = _ledger()
    for _ in range(5):
        ledger.record(1.0, 0.1)
    ledger.record(1.0, 0.1, count=3)
    ledger.record(2.0, 0.1)
    ledger.record(1.0, 0.1, label="phase 2")
    ledger.record(1.0, 0.1, label="phase 2")
    ledger.record(1.0, 0.1)
    entries = ledger.entries
    assert [(e.noise_multiplier, e.count, e.start_step, e.label) for e in entries] == [
        (1.0, 8, 0, None),
        (2.0, 1, 8, None),
        (1.0, 2, 9, "phase 2"),
        (1.0, 1, 11, None),
    ]
    assert ledger.steps == 12
    assert entries[1].stop_step == 9


def test_ledger_epsilon_matches_direct_composition() -> None:
    ledger = _ledger()
    ledger.record(1.0, 0.01, count=600)
    ledger.record(1.5, 0.02, count=100)
    ledger.record(1.0, 0.01, count=400)
    acc = PLDAccountant(value_discretization_interval=FAST)
    step = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0))
    acc.compose(dp_accounting.SelfComposedDpEvent(step, 1000))
    step2 = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.5))
    acc.compose(dp_accounting.SelfComposedDpEvent(step2, 100))
    assert ledger.epsilon(1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    homogeneous = _ledger()
    homogeneous.record(1.0, 0.01, count=1000)
    assert homogeneous.epsilon(1e-5) == epsilon(
        1.0, 0.01, 1000, 1e-5, value_discretization_interval=FAST
    )
    assert ledger.delta(ledger.epsilon(1e-5)) <= 1e-5 * 1.01


def test_ledger_json_round_trip(tmp_path: os.PathLike[str]) -> None:
    ledger = _ledger(neighbouring="replace_one", metadata={"num_samples": 60000, "run": "a"})
    ledger.record(1.1, 0.01, count=50)
    ledger.record(0.9, 0.01, count=20, label="fine-tune")
    ledger.record(math.inf, 0.01, count=3)
    path = os.path.join(os.fspath(tmp_path), "ledger.json")
    ledger.to_json(path)
    eps = ledger.epsilon(1e-5)
    fresh = PrivacyLedger.from_json(path)
    assert fresh.to_dict() == ledger.to_dict()
    assert fresh.epsilon(1e-5) == eps
    assert fresh.neighbouring == "replace_one"
    assert fresh.metadata == {"num_samples": 60000, "run": "a"}
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)  # strict JSON (no Infinity)
    assert raw["version"] == accounting.LEDGER_VERSION
    assert raw["entries"][2]["noise_multiplier"] == "inf"
    # Overwrite in place, atomically: no temporary files left behind.
    ledger.record(1.1, 0.01)
    ledger.to_json(path)
    assert PrivacyLedger.from_json(path).steps == 74
    assert os.listdir(os.fspath(tmp_path)) == ["ledger.json"]


def test_ledger_to_json_mode_is_given_or_kept(tmp_path: os.PathLike[str]) -> None:
    """clipless train writes the ledger 0600; the optimizer's per-step rewrites keep that."""
    import stat

    ledger = _ledger()
    ledger.record(1.0, 0.01)
    path = os.path.join(os.fspath(tmp_path), "ledger.json")
    ledger.to_json(path, mode=0o600)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    ledger.record(1.0, 0.01)
    ledger.to_json(path)  # no mode: the replaced file's
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(path, 0o640)
    ledger.to_json(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert PrivacyLedger.from_json(path).steps == 2


def test_ledger_to_json_failure_keeps_old_file(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(os.fspath(tmp_path), "ledger.json")
    ledger = _ledger()
    ledger.record(1.0, 0.1, count=4)
    ledger.to_json(path)
    ledger.metadata["bad"] = math.nan  # not serialisable as strict JSON
    with pytest.raises(ValueError):
        ledger.to_json(path)
    assert PrivacyLedger.from_json(path).steps == 4
    assert os.listdir(os.fspath(tmp_path)) == ["ledger.json"]


def _valid_dict() -> dict[str, object]:
    ledger = _ledger()
    ledger.record(1.0, 0.1, count=4)
    ledger.record(2.0, 0.1, count=2)
    return ledger.to_dict()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(format="something"), "not a privacy ledger"),
        (lambda d: d.update(version=3), "unsupported privacy ledger version"),
        (lambda d: d.pop("entries"), "missing keys"),
        (lambda d: d.update(extra=1), "unknown keys"),
        (lambda d: d.update(accountant="gdp"), "accountant"),
        (lambda d: d["entries"][0].update(count=0), r"entries\[0\].count"),
        (lambda d: d["entries"][0].update(count=1.5), r"entries\[0\].count"),
        (lambda d: d["entries"][1].update(sample_rate=2.0), r"entries\[1\].sample_rate"),
        (lambda d: d["entries"][1].update(noise_multiplier=-1.0), "noise_multiplier"),
        (lambda d: d["entries"][1].update(start_step=3), "contiguous"),
        (lambda d: d["entries"][1].pop("label"), "exactly the keys"),
        (lambda d: d["entries"][1].update(proven="yes"), "proven"),
        (lambda d: d.update(entries={}), "must be a list"),
    ],
)
def test_ledger_rejects_malformed(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    data = _valid_dict()
    PrivacyLedger.from_dict(data)  # the unmodified dict is fine
    mutate(data)
    with pytest.raises(ValueError, match=match):
        PrivacyLedger.from_dict(data)


def test_ledger_from_json_bad_file(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(os.fspath(tmp_path), "broken.json")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write('{"format": "clipless.PrivacyLedger", "version": 1, "entr')
    with pytest.raises(ValueError, match=r"broken\.json: not a valid JSON"):
        PrivacyLedger.from_json(path)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump([1, 2], fh)
    with pytest.raises(ValueError, match=r"broken\.json"):
        PrivacyLedger.from_json(path)


def test_ledger_record_bad_input() -> None:
    ledger = _ledger()
    with pytest.raises(ValueError, match="count"):
        ledger.record(1.0, 0.1, count=0)
    with pytest.raises(ValueError, match="sample_rate"):
        ledger.record(1.0, 0.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        ledger.record(-0.5, 0.1)
    with pytest.raises(TypeError, match="label"):
        ledger.record(1.0, 0.1, label=3)  # type: ignore[arg-type]
    assert ledger.steps == 0


def test_ledger_would_exceed_matches_direct_computation() -> None:
    ledger = _ledger()
    sigma, q, delta = 1.0, 0.1, 1e-5
    budget = epsilon(sigma, q, 37, delta, value_discretization_interval=FAST)
    # 37 steps fit exactly; the 38th does not.
    assert not ledger.would_exceed(budget, delta, sigma, q, count=37)
    assert ledger.would_exceed(budget, delta, sigma, q, count=38)
    calls = 0
    original = ledger._epsilon_of

    def counting(*args: object) -> float:
        nonlocal calls
        calls += 1
        return original(*args)  # type: ignore[arg-type]

    ledger._epsilon_of = counting  # type: ignore[method-assign]
    for _ in range(37):
        assert not ledger.would_exceed(budget, delta, sigma, q)
        ledger.record(sigma, q)
    assert ledger.would_exceed(budget, delta, sigma, q)
    assert calls == 0  # the bracket found by the first query answers every later one
    ledger._epsilon_of = original  # type: ignore[method-assign]
    assert ledger.epsilon(delta) <= budget
    # A much noisier step still fits in a slightly larger budget; a huge budget always fits.
    assert not ledger.would_exceed(budget * 1.01, delta, 50.0, q)
    assert not ledger.would_exceed(budget * 10, delta, sigma, q)
    with pytest.raises(ValueError, match="epsilon_budget"):
        ledger.would_exceed(0.0, delta, sigma, q)


def test_ledger_would_exceed_when_already_over_budget() -> None:
    ledger = _ledger()
    ledger.record(0.0, 0.1)  # a non-private step: epsilon is infinite
    assert ledger.epsilon(1e-5) == math.inf
    assert ledger.would_exceed(100.0, 1e-5, 5.0, 0.1)
    free = _ledger()
    assert not free.would_exceed(0.1, 1e-5, math.inf, 0.1, count=10**6)


def test_ledger_guarantee() -> None:
    ledger = _ledger()
    ledger.record(1.0, 0.1, count=10)
    g = ledger.guarantee(1e-5)
    assert g.is_dp_guarantee and g.steps == 10 and g.noise_multiplier == 1.0
    assert g.epsilon == ledger.epsilon(1e-5)
    ledger.record(1.0, 0.1, proven=False)
    assert len(ledger.entries) == 2  # an unproven step never merges with proven ones
    g2 = ledger.guarantee(1e-5)
    assert not g2.is_dp_guarantee
    assert "NOT a DP guarantee" in str(g2)
    ledger.record(2.0, 0.2)
    g3 = ledger.guarantee(1e-5)
    assert g3.noise_multiplier is None and g3.sample_rate is None
    assert "sigma=2" in g3.mechanism
    assert not PrivacyLedger.from_dict(ledger.to_dict()).is_dp_guarantee


@pytest.mark.parametrize("sigma", [2.2250738585072014e-308, 1.7976931348623157e308])
def test_extreme_multipliers_give_a_sound_epsilon_not_a_crash(sigma: float) -> None:
    """dp_accounting overflows for such multipliers (found by fuzzing); infinity is reported."""
    ledger = PrivacyLedger()
    ledger.record(sigma, 0.1, count=3)
    assert ledger.epsilon(1e-5) == math.inf


def test_extends_recognises_a_continuation_and_nothing_else() -> None:
    from clipless.accounting import PrivacyLedger

    base = PrivacyLedger()
    base.record_release(5.0, label="mean")
    base.record(1.0, 0.1, 3)
    longer = PrivacyLedger.from_dict(base.to_dict())
    longer.record(1.0, 0.1, 2)  # the last entry continued
    longer.record(2.0, 0.1, 1)  # then another one
    assert longer.extends(base) and base.extends(base) and not base.extends(longer)
    assert longer.extends(PrivacyLedger())
    other = PrivacyLedger()
    other.record_release(5.0, label="mean")
    other.record(1.5, 0.1, 9)  # another sigma from the first step on
    assert not other.extends(base)
    no_release = PrivacyLedger()
    no_release.record(1.0, 0.1, 9)
    assert not no_release.extends(base)
    replace = PrivacyLedger(neighbouring="replace_one")
    replace.record_release(5.0, label="mean")
    replace.record(1.0, 0.1, 9)
    assert not replace.extends(base)


def test_extends_tells_runs_apart_by_their_run_id() -> None:
    from clipless.accounting import PrivacyLedger

    a = PrivacyLedger(metadata={"run_id": "a"})
    a.record(1.0, 0.1, 3)
    b = PrivacyLedger(metadata={"run_id": "b"})
    b.record(1.0, 0.1, 9)
    legacy = PrivacyLedger()
    legacy.record(1.0, 0.1, 9)
    longer_a = PrivacyLedger.from_dict(a.to_dict())
    longer_a.record(1.0, 0.1, 6)
    assert not b.extends(a) and longer_a.extends(a)
    assert legacy.extends(a)  # a ledger written before run ids: the entries decide
