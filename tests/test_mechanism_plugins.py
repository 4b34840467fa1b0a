"""The mechanism as pluggable parts: a registered noise allocation end to end, the DpEvent as
what the ledger records, calibration against a caller's ``make_event``, and make_private's
mechanism / run-option values (with the deprecated keywords)."""

from __future__ import annotations

import argparse
import inspect
import json
import math
from collections.abc import Iterator, Mapping, Sequence

import dp_accounting
import pytest
import torch
from dp_accounting import dp_event
from torch.utils.data import DataLoader, TensorDataset

import clipless
from clipless import accounting, allocation, nn
from clipless.allocation import NoiseAllocation, UseGroup
from clipless.mechanism import MechanismSpec, PrivacyConfig

N, DIM = 120, 4


class _PerTensor(NoiseAllocation):
    """Per-layer noise accounted as one mechanism per tensor (valid: it over-counts), whose step
    event is written as a one-element composition, so that the ledger's event is this class's
    and not a Gaussian built elsewhere."""

    name = "test-per-tensor"

    def effective_multiplier(self, config: PrivacyConfig) -> float:
        return config.noise_multiplier / math.sqrt(config.num_tensors)

    def noise_multiplier_for(self, config: PrivacyConfig, effective: float) -> float:
        return effective * math.sqrt(config.num_tensors)

    def stds(
        self, config: PrivacyConfig, groups: Sequence[UseGroup], sensitivities: Mapping[str, float]
    ) -> dict[str, float]:
        return {
            n: math.nextafter(config.noise_multiplier * s, math.inf)
            for n, s in sensitivities.items()
        }

    def step_event(self, accounting_multiplier: float, sample_rate: float) -> dp_event.DpEvent:
        inner = accounting.gaussian_step_event(accounting_multiplier, sample_rate)
        return dp_event.ComposedDpEvent([inner])


@pytest.fixture
def per_tensor() -> Iterator[str]:
    allocation.register_allocation(_PerTensor)
    try:
        yield _PerTensor.name
    finally:
        allocation.unregister_allocation(_PerTensor.name)


def _setup(
    spec: MechanismSpec, **kw: object
) -> tuple[clipless.PrivacyEngine, torch.nn.Module, object, DataLoader]:  # type: ignore[type-arg]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.InputNorm(1.0), nn.Linear(DIM, 6, bias=True), nn.GroupSort(2), nn.Linear(6, 2, bias=True)
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, DIM, generator=g), torch.randint(0, 2, (N,), generator=g))
    engine = clipless.PrivacyEngine(seed=0)
    m, o, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=30),
        loss=nn.CrossEntropyLoss(),
        mechanism=spec,
        **kw,  # type: ignore[arg-type]
    )
    return engine, m, o, dl


def _steps(m: torch.nn.Module, o: object, dl: DataLoader, count: int) -> None:  # type: ignore[type-arg]
    loss = nn.CrossEntropyLoss(reduction="sum")
    batches = iter(dl)
    for _ in range(count):
        x, y = next(batches)
        o.zero_grad()  # type: ignore[attr-defined]
        loss(m(x), y).backward()
        o.step()  # type: ignore[attr-defined]


def test_a_registered_allocation_runs_end_to_end_and_the_ledger_records_its_event(
    per_tensor: str, tmp_path: object
) -> None:
    from clipless import cli

    subparsers = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    train = subparsers.choices["train"]
    noise = next(a for a in train._actions if "--noise" in a.option_strings)
    assert per_tensor in noise.choices  # type: ignore[operator]  # the CLI reads the registry
    engine, m, o, dl = _setup(MechanismSpec(noise=per_tensor), noise_multiplier=2.0)
    config = engine.privacy_config
    assert config.num_tensors == 4 and config.num_mechanisms is None
    plan = o.current_plan()  # type: ignore[attr-defined]
    assert dict(plan.stds) == {
        n: math.nextafter(2.0 * s, math.inf) for n, s in plan.sensitivities.items()
    }
    expected = dp_event.ComposedDpEvent(
        [accounting.gaussian_step_event(2.0 / math.sqrt(4), config.sample_rate)]
    )
    assert plan.dp_event() == expected == config.step_event()
    _steps(m, o, dl, 3)
    (entry,) = engine.ledger.entries
    assert entry.event == expected and entry.count == 3 and entry.parameters is None
    direct = accounting.event_epsilon(accounting.repeated(expected, 3), 1e-5)
    assert engine.get_epsilon(1e-5) == direct == config.epsilon(1e-5, steps=3)
    guarantee = engine.guarantee(1e-5)
    assert (
        guarantee.mechanism.startswith("steps of ComposedDpEvent") and guarantee.epsilon == direct
    )
    # the file holds the event (version 2) and reads back to the same ledger
    path = f"{tmp_path}/ledger.json"
    engine.ledger.to_json(path)
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    assert raw["version"] == accounting.LEDGER_EVENT_VERSION
    assert raw["entries"][0]["event"] == accounting.event_to_dict(expected)
    back = accounting.PrivacyLedger.from_json(path)
    assert back.entries == engine.ledger.entries and back.epsilon(1e-5) == direct


def test_a_registered_allocation_calibrates_through_its_event(per_tensor: str) -> None:
    engine, *_ = _setup(
        MechanismSpec(noise=per_tensor), target_epsilon=2.0, target_delta=1e-5, steps=20
    )
    config = engine.privacy_config
    eps = config.epsilon(1e-5)
    assert eps <= 2.0
    smaller = PrivacyConfig.from_dict(
        {**config.to_dict(), "noise_multiplier": config.noise_multiplier / 1.002}
    )
    assert smaller.epsilon(1e-5) > 2.0  # the relative tolerance 1e-3 holds on the other side


def test_an_unknown_allocation_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"noise must be one of \('global', 'per-layer'"):
        _setup(MechanismSpec(noise="nope"), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="already registered"):

        class Clash(allocation.GlobalNoise):
            name = "per-layer"

        allocation.register_allocation(Clash)
    with pytest.raises(ValueError, match="cannot be unregistered"):
        allocation.unregister_allocation("global")


def _three_layer_event(q: float, steps: int) -> object:
    def make(sigma: float) -> dp_event.DpEvent:
        # two mechanisms per step at different scales, Poisson subsampled
        step = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
        tail = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(2.0 * sigma))
        return dp_event.SelfComposedDpEvent(dp_event.ComposedDpEvent([step, tail]), steps)

    return make


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_calibration_with_a_custom_make_event_matches_dp_accounting(kind: str) -> None:
    make = _three_layer_event(0.05, 50)
    eps, delta = 1.5, 1e-5

    def fresh() -> dp_accounting.PrivacyAccountant:
        if kind == "rdp":
            return dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_RDP_ORDERS))
        return dp_accounting.pld.PLDAccountant(
            value_discretization_interval=accounting.DEFAULT_PLD_DISCRETIZATION
        )

    ours = accounting.calibrate_noise(eps, delta, accountant=kind, make_event=make)  # type: ignore[arg-type]
    theirs = dp_accounting.calibrate_dp_mechanism(
        fresh, make, eps, delta, dp_accounting.LowerEndpointAndGuess(0.1, 1.0), tol=1e-5
    )
    assert ours == pytest.approx(theirs, rel=1.5e-3)
    assert fresh().compose(make(ours)).get_epsilon(delta) <= eps  # certified: within target
    assert fresh().compose(make(ours / 1.001)).get_epsilon(delta) > eps  # and tight


def test_calibration_with_the_gaussian_make_event_is_the_classic_one() -> None:
    q, steps = 0.02, 300

    def make(sigma: float) -> dp_event.DpEvent:
        return accounting.dpsgd_event(sigma, q, steps)

    classic = accounting.calibrate_noise(1.0, 1e-5, q, steps)
    assert accounting.calibrate_noise(1.0, 1e-5, q, steps, make_event=make) == classic
    with pytest.raises(ValueError, match="sample_rate and steps, or make_event"):
        accounting.calibrate_noise(1.0, 1e-5)


def test_the_ledger_stores_any_event_and_keeps_reading_version_1() -> None:
    ledger = accounting.PrivacyLedger()
    ledger.record(1.0, 0.01, 2)
    laplace = dp_event.LaplaceDpEvent(3.0)
    ledger.record_event(laplace, 2)
    ledger.record_event(accounting.gaussian_step_event(1.0, 0.01))  # a Gaussian: version 1 form
    assert [e.count for e in ledger.entries] == [2, 2, 1]
    assert ledger.entries[2].parameters == (1.0, 0.01)
    data = ledger.to_dict()
    assert data["version"] == 2 and data["entries"][1]["event"]["type"] == "LaplaceDpEvent"
    back = accounting.PrivacyLedger.from_dict(data)
    assert back.entries == ledger.entries and back.epsilon(1e-5) == ledger.epsilon(1e-5)
    expected = (
        accounting.Accountant()
        .compose(accounting.repeated(accounting.gaussian_step_event(1.0, 0.01), 3))
        .compose(accounting.repeated(laplace, 2))
        .epsilon(1e-5)
    )
    assert ledger.epsilon(1e-5) == expected
    assert math.isnan(ledger.history[1][0])
    assert ledger.guarantee(1e-5).noise_multiplier is None
    v1 = accounting.PrivacyLedger()
    v1.record(1.0, 0.01, 2)
    assert v1.to_dict()["version"] == 1
    data["version"] = 1  # a version-1 file cannot hold events
    with pytest.raises(ValueError, match="must have exactly the keys"):
        accounting.PrivacyLedger.from_dict(data)
    assert ledger.would_exceed(0.5, 1e-5, event=laplace) is True


def test_make_private_signature_is_short() -> None:
    params = inspect.signature(clipless.PrivacyEngine.make_private).parameters
    opacus_aliases = {"max_grad_norm", "poisson_sampling", "opacus_options"}
    assert len([p for p in params if p not in opacus_aliases | {"self"}]) < 12


def test_moved_keywords_warn_and_build_the_same_config() -> None:
    spec = MechanismSpec(noise="per-layer", scaling="bound", neighbouring="replace_one")
    new, *_ = _setup(spec, noise_multiplier=1.5, options=clipless.RunOptions(certify_every=2))
    mech = pytest.warns(DeprecationWarning, match=r"pass mechanism=MechanismSpec\(noise=\.\.\.")
    run = pytest.warns(DeprecationWarning, match=r"options=RunOptions\(certify_every")
    with mech as caught, run:
        old, *_ = _setup(
            None,  # type: ignore[arg-type]
            noise_multiplier=1.5,
            noise="per-layer",
            scaling="bound",
            neighbouring="replace_one",
            certify_every=2,
        )
    # attributed to make_private's caller (here _setup), so that the warning filter of the
    # caller's module applies (pyproject makes those from clipless's own modules errors)
    assert {w.filename for w in caught if w.category is DeprecationWarning} == {__file__}
    with pytest.warns(DeprecationWarning) as caught:
        engine = clipless.PrivacyEngine(seed=0)
        model = nn.Sequential(nn.InputNorm(1.0), nn.Linear(DIM, 2))
        engine.make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(N, DIM), torch.zeros(N).long())),
            loss=nn.CrossEntropyLoss(),
            target_epsilon=2.0,
            target_delta=1e-5,
            steps=5,
            scaling="bound",
        )
    assert [w.filename for w in caught if w.category is DeprecationWarning] == [__file__]
    assert engine.privacy_config.scaling == "bound"
    assert old.privacy_config == new.privacy_config
    assert old.optimizer.certify_every == new.optimizer.certify_every == 2  # type: ignore[union-attr]
    with pytest.raises(TypeError, match=r"give \['scaling'\] inside mechanism="):
        _setup(spec, noise_multiplier=1.5, scaling="bound")
    with pytest.raises(ValueError, match="certify_every must be a positive integer"):
        clipless.RunOptions(certify_every=0)
    with pytest.raises(TypeError, match="mechanism must be a MechanismSpec"):
        _setup("global", noise_multiplier=1.5)  # type: ignore[arg-type]
