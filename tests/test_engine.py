"""PrivacyEngine and DPOptimizer: accounting identities, noise calibration, validation, memory."""

from __future__ import annotations

import dataclasses
import math

import dp_accounting
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import clipless
from _mechanism import split_options
from clipless import nn
from clipless.engine import MechanismSpec
from clipless.mechanism import PrivacyConfig

N = 200
DIM = 5


def _data(n: int = N, zero: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(n, DIM) if zero else torch.randn(n, DIM, generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return TensorDataset(x, y)


def _model(bias: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.InputNorm(1.0),
        nn.Linear(DIM, 8, bias=bias),
        nn.GroupSort(2),
        nn.Linear(8, 2, bias=bias),
    )


def _private(noise: str = "global", neighbouring: str = "add_remove", **kw):
    model = _model(bias=kw.pop("bias", False))
    opt = torch.optim.SGD(model.parameters(), lr=kw.pop("lr", 0.1))
    loader = DataLoader(kw.pop("dataset", _data()), batch_size=20)
    engine = clipless.PrivacyEngine(accountant="pld", seed=kw.pop("seed", 0))
    kw.setdefault("noise_multiplier", 1.3)
    m, o, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        loss=nn.CrossEntropyLoss(),
        **split_options({"noise": noise, "neighbouring": neighbouring, **kw}),
    )
    return engine, m, o, dl


def _train_steps(m, o, dl, loss_fn, steps: int) -> None:
    it = iter(dl)
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(dl)
            x, y = next(it)
        o.zero_grad()
        if x.shape[0] > 0:
            loss_fn(m(x), y).backward()
        o.step()


def _dpa_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    acc = dp_accounting.pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(delta)


def test_global_noise_epsilon_identity() -> None:
    engine, m, o, dl = _private("global", noise_multiplier=1.3)
    _train_steps(m, o, dl, o.loss, 25)
    assert engine.ledger.steps == 25
    ref = _dpa_epsilon(1.3, 0.1, 25, 1e-5)
    assert engine.get_epsilon(1e-5) == pytest.approx(ref, rel=5e-3)


def test_per_layer_noise_epsilon_identity() -> None:
    """Two layers with biases: four noised tensors, but each (weight, bias) pair is one
    Gaussian mechanism (mechanism.py, "Noise allocation"), so D = 2."""
    engine, m, o, dl = _private("per-layer", noise_multiplier=2.0, bias=True)
    assert len(list(m.parameters())) == 4
    assert o.config.num_mechanisms == 2 and o.config.mechanisms == 2
    _train_steps(m, o, dl, o.loss, 10)
    ref = _dpa_epsilon(2.0 / math.sqrt(2), 0.1, 10, 1e-5)
    assert engine.get_epsilon(1e-5) == pytest.approx(ref, rel=5e-3)


def test_per_layer_noise_counts_every_tensor_of_a_config_saved_before() -> None:
    """A config without num_mechanisms (saved before it existed) keeps D = the tensor count."""
    _, _, o, _ = _private("per-layer", noise_multiplier=2.0, bias=True)
    old = dataclasses.replace(o.config, num_mechanisms=None)
    assert old.mechanisms == 4
    assert old.effective_noise_multiplier == pytest.approx(2.0 / math.sqrt(4), rel=1e-15)
    assert (
        PrivacyConfig.from_dict(
            {k: v for k, v in o.config.to_dict().items() if k != "num_mechanisms"}
        )
        == old
    )


def test_replace_one_doubles_sensitivities() -> None:
    _, _, o_ar, _ = _private(neighbouring="add_remove")
    _, _, o_ro, _ = _private(neighbouring="replace_one")
    s_ar, s_ro = o_ar.sensitivities(), o_ro.sensitivities()
    assert s_ar.keys() == s_ro.keys()
    for k in s_ar:
        assert s_ro[k] == pytest.approx(2 * s_ar[k], rel=1e-12)


def test_sensitivities_are_cotangent_bounds() -> None:
    """Every parameter's sensitivity is G_k: L * product of later Lipschitz constants."""
    from clipless import bounds

    _, m, o, _ = _private()
    rep = bounds.report(m, o.loss, (DIM,))
    sens = o.sensitivities()
    lip_last = m[3].lipschitz()
    margin = 1.0 + o.current_plan().rounding_margin  # floating-point allowance of the step
    assert sens["3.weight"] == pytest.approx(math.sqrt(2) * margin, rel=1e-9)
    assert sens["1.weight"] == pytest.approx(math.sqrt(2) * lip_last * margin, rel=1e-9)
    assert rep.layers[0].cotangent_bound * margin == pytest.approx(sens["1.weight"], rel=1e-12)


def test_global_noise_uses_joint_layer_bounds() -> None:
    """With biases, weight and bias share one bound per layer: G = sqrt(sum_k G_k^2)."""
    _, _, o, _ = _private("global", noise_multiplier=1.0, bias=True)
    sens = o.sensitivities()
    layers = o.layer_sensitivities()
    assert set(layers) == {"1", "3"}
    for path, g in layers.items():
        assert sens[f"{path}.weight"] == sens[f"{path}.bias"] == g
    expected = math.sqrt(layers["1"] ** 2 + layers["3"] ** 2)
    for std in o.noise_stds().values():
        assert std == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("noise", ["global", "per-layer"])
def test_empirical_noise_std(noise: str) -> None:
    """With zero gradients the noise added to each parameter has std sigma_k G_k / (q N)."""
    _engine, m, o, _ = _private(noise, noise_multiplier=0.7, lr=0.0, constraint=None)
    stds = o.noise_stds()
    draws: dict[str, list[torch.Tensor]] = {k: [] for k in stds}
    names = dict(m.named_parameters())
    for _ in range(300):
        o.zero_grad()
        o.add_noise()
        for k in stds:
            draws[k].append(names[k].grad.flatten().clone())
    qn = o.sample_rate * o.num_samples
    assert qn == pytest.approx(20.0)
    g = math.sqrt(sum(v**2 for v in o.layer_sensitivities().values()))
    for k, sd in stds.items():
        expect = 0.7 * (g if noise == "global" else o.sensitivities()[k])
        assert sd == pytest.approx(expect, rel=1e-12)
        sample = torch.cat(draws[k]) * qn
        n = sample.numel()
        # std estimate within 5 standard errors (se of the std ~ sd / sqrt(2n))
        assert abs(float(sample.std()) - sd) < 5 * sd / math.sqrt(2 * n)
        assert abs(float(sample.mean())) < 5 * sd / math.sqrt(n)


def test_zero_data_only_noise_reaches_weights() -> None:
    """A step on all-zero inputs: the weight change is exactly -lr * noise / (qN)."""
    _engine, m, o, _dl = _private(
        dataset=_data(zero=True), lr=1.0, constraint=None, noise_multiplier=1.0
    )
    o.data_loader = None  # own rows
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    x = torch.zeros(20, DIM)
    y = torch.zeros(20, dtype=torch.long)
    o.zero_grad()
    o.loss(m(x), y).backward()
    for p in m.parameters():
        assert torch.count_nonzero(p.grad) == 0
    state = o.generator.get_state()
    stds = o.noise_stds()  # at the weights the forward used
    o.step()
    gen = torch.Generator().set_state(state)
    for k, p in m.named_parameters():
        noise = torch.normal(0.0, stds[k], size=p.shape, generator=gen)
        torch.testing.assert_close(p.detach(), before[k] - noise / 20.0)


class _MaxNumel(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("scaling", ["per-sample", "bound"])
def test_no_per_sample_gradients(scaling: str) -> None:
    """The largest tensor built in a step grows like batch x width, never batch x parameters."""
    torch.manual_seed(0)
    width = 64
    sizes = {}
    for batch in (16, 256):
        model = nn.Sequential(
            nn.InputNorm(1.0),
            nn.Linear(width, width, bias=False),
            nn.GroupSort(2),
            nn.Linear(width, width, bias=False),
        )
        data = TensorDataset(torch.randn(batch * 4, width), torch.randint(0, width, (batch * 4,)))
        engine = clipless.PrivacyEngine(seed=0)
        m, o, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=batch),
            loss=nn.CrossEntropyLoss(),
            noise_multiplier=1.0,
            mechanism=MechanismSpec(scaling=scaling),
        )
        o.data_loader = None  # own rows
        x, y = data.tensors[0][:batch], data.tensors[1][:batch]
        o.refresh()  # the plan's thresholds on the layers: the scaled kernels as a step runs them
        o.detach()  # a dispatch mode around a guarded pass is refused (it could change results)
        mode = _MaxNumel()
        with mode:
            o.zero_grad()
            o.loss(m(x), y).backward()
        sizes[batch] = mode.max_numel
        n_params = sum(p.numel() for p in m.parameters())
        assert mode.max_numel < batch * n_params / 10
    # 16x larger batch: the largest tensor grows by far less than 16x the parameter count
    assert sizes[256] <= max(256 * width, width * width) * 2


def test_target_epsilon_calibration() -> None:
    engine, m, o, dl = _private(
        noise_multiplier=None, target_epsilon=2.0, target_delta=1e-5, epochs=3
    )
    steps = 3 * 10
    sigma = o.effective_noise_multiplier
    assert _dpa_epsilon(sigma, 0.1, steps, 1e-5) <= 2.0 * 1.005
    assert _dpa_epsilon(sigma * 0.97, 0.1, steps, 1e-5) > 2.0
    _train_steps(m, o, dl, o.loss, steps)
    assert engine.get_epsilon(1e-5) <= 2.0 * 1.005


def test_projection_applied_after_step() -> None:
    _engine, m, o, dl = _private(lr=50.0, max_norm=1.0, constraint="clip")
    _train_steps(m, o, dl, o.loss, 3)
    for layer in (m[1], m[3]):
        assert layer.lipschitz() <= 1.0 + 1e-6


def test_state_dict_round_trip() -> None:
    engine, m, o, dl = _private()
    _train_steps(m, o, dl, o.loss, 5)
    state = engine.state_dict()
    eps = engine.get_epsilon(1e-5)
    engine2, *_ = _private()
    engine2.load_state_dict(state)
    assert engine2.ledger.steps == 5
    assert engine2.get_epsilon(1e-5) == eps


def test_would_exceed() -> None:
    engine, m, o, dl = _private(noise_multiplier=1.0)
    _train_steps(m, o, dl, o.loss, 5)
    eps5 = engine.get_epsilon(1e-5)
    assert engine.would_exceed(eps5, 1e-5)
    assert not engine.would_exceed(eps5 * 10, 1e-5)


def test_guarantee_is_frozen() -> None:
    engine, m, o, dl = _private()
    _train_steps(m, o, dl, o.loss, 2)
    g = engine.guarantee(1e-5)
    assert g.is_dp_guarantee
    with pytest.raises(AttributeError):
        g.epsilon = 0.0  # type: ignore[misc]


# ----------------------------------------------------------------- bad input
def test_non_lipschitz_model_rejected() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 2), torch.nn.BatchNorm1d(2))
    with pytest.raises(TypeError, match="BatchNorm1d"):
        clipless.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=10),
            loss=nn.CrossEntropyLoss(),
            noise_multiplier=1.0,
        )


def test_batch_max_requires_flag() -> None:
    with pytest.raises(ValueError, match="allow_unproven"):
        _private(scaling="batch-max")
    engine, m, o, dl = _private(scaling="batch-max", allow_unproven=True)
    _train_steps(m, o, dl, o.loss, 1)
    assert not engine.guarantee(1e-5).is_dp_guarantee
    with pytest.warns(UserWarning, match="NOT a DP guarantee"):
        engine.get_epsilon(1e-5)


_TARGET = {"noise_multiplier": None, "target_epsilon": 1.0, "target_delta": 1e-5, "epochs": 1}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"noise_multiplier": None, "target_epsilon": 0.0, "target_delta": 1e-5, "epochs": 1},
            "epsilon",
        ),
        (
            {"noise_multiplier": None, "target_epsilon": -1.0, "target_delta": 1e-5, "epochs": 1},
            "epsilon",
        ),
        (
            {"noise_multiplier": None, "target_epsilon": 1.0, "target_delta": 1.5, "epochs": 1},
            "delta",
        ),
        (
            {"noise_multiplier": None, "target_epsilon": 1.0, "target_delta": 0.0, "epochs": 1},
            "delta",
        ),
        ({"noise_multiplier": None, "target_epsilon": 1.0, "target_delta": 1e-5}, "epochs"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise": "nope"}, "noise"),
        ({"scaling": "nope"}, "scaling"),
        ({"neighbouring": "nope"}, "neighbouring"),
        ({"constraint": "nope"}, "constraint"),
        ({"max_norm": 0.0}, "max_norm"),
        ({"certify_every": 0}, "certify_every"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    kwargs = dict(kwargs)
    noise = kwargs.pop("noise", "global")
    neighbouring = kwargs.pop("neighbouring", "add_remove")
    with pytest.raises(ValueError, match=match):
        _private(noise, neighbouring, **kwargs)


def test_ledger_written_before_noise(tmp_path, monkeypatch) -> None:
    """Write-ahead accounting: a crash while drawing the noise still leaves the step on disk."""
    from clipless.accounting import PrivacyLedger

    path = tmp_path / "ledger.json"
    engine, m, o, dl = _private(ledger_path=path)
    _train_steps(m, o, dl, o.loss, 2)
    assert PrivacyLedger.from_json(path).steps == 2

    def crash(plan=None) -> None:
        raise RuntimeError("power cut")

    next(iter(dl))  # the third step's batch (empty of gradients: noise only)
    monkeypatch.setattr(o, "add_noise", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        o.step()
    on_disk = PrivacyLedger.from_json(path)
    assert on_disk.steps == 3
    assert on_disk.epsilon(1e-5) == pytest.approx(engine.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize("seed", [-1, 2**63 - 1, 2**64 - 1])
def test_a_seed_out_of_range_is_named(seed: int) -> None:
    """Audit finding: seed=2**64-1 was accepted, then make_private failed in torch with
    'Overflow when unpacking long long' (the sampler takes seed + 1)."""
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63 - 1\)"):
        clipless.PrivacyEngine(seed=seed)
    clipless.PrivacyEngine(seed=2**63 - 2)


def test_a_fresh_run_refuses_a_ledger_path_that_records_spending(tmp_path) -> None:
    """Audit finding: make_private(ledger_path=P) over P recording 50 steps overwrote it with
    its own 1-step ledger at the first step (the file is the record of what was spent)."""
    from clipless.accounting import PrivacyLedger

    path = tmp_path / "ledger.json"
    _, m, o, dl = _private(ledger_path=path)
    _train_steps(m, o, dl, o.loss, 5)
    spent = path.read_bytes()
    _, m2, o2, dl2 = _private(ledger_path=path)
    with pytest.raises(FileExistsError, match="records 5 private steps"):
        _train_steps(m2, o2, dl2, o2.loss, 1)
    assert path.read_bytes() == spent  # untouched, and nothing was noised or stepped
    assert PrivacyLedger.from_json(path).steps == 5
    path.write_text("{not json")  # an unreadable file may record spending too
    with pytest.raises(ValueError, match="cannot be read"):
        _train_steps(m2, o2, dl2, o2.loss, 1)


@pytest.mark.parametrize("seed", [0, None])
def test_a_hand_written_resume_keeps_the_larger_ledger_file(tmp_path, seed) -> None:
    """Audit finding: restoring an older checkpoint with engine.load_state_dict under the same
    ledger_path rolled the file back to the checkpoint's steps and replayed the saved generator
    states. The file's ledger is kept; without a seed the generators are reseeded."""
    import copy

    from clipless.accounting import PrivacyLedger

    path = tmp_path / "ledger.json"
    engine, m, o, dl = _private(ledger_path=path, seed=seed)
    _train_steps(m, o, dl, o.loss, 4)
    ckpt = {
        "model": copy.deepcopy(m.state_dict()),
        "optimizer": copy.deepcopy(o.state_dict()),
        "engine": copy.deepcopy(engine.state_dict()),
    }
    _train_steps(m, o, dl, o.loss, 6)  # ... then the process dies
    assert PrivacyLedger.from_json(path).steps == 10
    engine2, m2, o2, dl2 = _private(ledger_path=path, seed=seed)
    m2.load_state_dict(ckpt["model"])
    o2.load_state_dict(ckpt["optimizer"])
    with pytest.warns(UserWarning, match="records 10 steps but the checkpoint only 4") as caught:
        engine2.load_state_dict(ckpt["engine"])  # (seeded: a second warning, the replay)
    assert len(caught) == (2 if seed is not None else 1)
    assert {w.filename for w in caught} == {__file__}  # the caller's line, not clipless's
    assert engine2.ledger.steps == 10
    restored = torch.equal(o2.generator.get_state(), ckpt["engine"]["generator"])
    assert restored == (seed is not None)  # a seeded (reproducible) run keeps its states
    _train_steps(m2, o2, dl2, o2.loss, 1)
    assert PrivacyLedger.from_json(path).steps == 11
    assert engine2.get_epsilon(1e-5) == pytest.approx(PrivacyLedger.from_json(path).epsilon(1e-5))


def test_bounds_follow_weights_changed_through_data() -> None:
    """Sensitivities are recomputed from the weights the forward uses, even after .data writes."""
    _, m, o, _ = _private(constraint=None)
    before = o.sensitivities()["1.weight"]
    m[3].weight.data.mul_(3.0)  # bypasses version counters
    after = o.sensitivities()["1.weight"]
    assert after == pytest.approx(3.0 * before, rel=1e-6)


@pytest.mark.parametrize("bad", [2.9, 0.5, "3", True, 0])
def test_dpoptimizer_refuses_a_bad_certify_every(bad) -> None:
    """Audit finding: DPOptimizer coerced certify_every with int() (2.9 became 2, 0.5 became 0,
    whose error then came from the projection after the step was recorded and the weight
    updated, leaving it unprojected)."""
    from clipless.optim import DPOptimizer

    _, _, o, _ = _private()
    with pytest.raises(ValueError, match="certify_every must be an integer >= 1"):
        DPOptimizer(
            o.original_optimizer,
            module=o.module,
            loss=o.loss,
            input_shape=o.input_shape,
            config=o.config,
            ledger=o.ledger,
            certify_every=bad,
        )


def test_two_hand_written_resumes_of_one_checkpoint_draw_fresh_noise() -> None:
    """Audit finding (fit's, the same in engine.load_state_dict): with no step lost after the
    checkpoint, an unseeded engine restored the saved generator states, so two runs resumed from
    one checkpoint drew the same noise (and batches) on different gradients."""
    import copy

    engine, m, o, dl = _private(seed=None)
    _train_steps(m, o, dl, o.loss, 2)
    saved = copy.deepcopy(engine.state_dict())
    states = []
    for _ in range(2):
        engine2, _m2, o2, dl2 = _private(seed=None)
        engine2.load_state_dict(saved)
        states.append((o2.generator.get_state(), dl2.batch_sampler.generator.get_state()))
    for noise, sampler in states:
        assert not torch.equal(noise, saved["generator"])
        assert not torch.equal(sampler, saved["sampler_generator"])
    assert not torch.equal(states[0][0], states[1][0])


# ------------------------------------------------ argument checks (fourteenth session's audit)


def test_a_seeded_engine_warns_and_its_guarantee_says_so() -> None:
    with pytest.warns(UserWarning, match="experiments only"):
        engine = clipless.PrivacyEngine(seed=3)
    model = _model()
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=20),
        loss=nn.CrossEntropyLoss(),
        noise_multiplier=1.3,
    )
    assert "seeded by the caller" in str(engine.guarantee(1e-5))
    unseeded, _, _, _ = _private(seed=None)
    assert "seeded" not in str(unseeded.guarantee(1e-5))


def test_delta_above_one_over_n_warns() -> None:
    with pytest.warns(UserWarning, match=r"target_delta=0\.01 is above 1/n \(n = 200"):
        engine, *_ = _private(
            noise_multiplier=None, target_epsilon=1.0, target_delta=0.01, epochs=1
        )
    with pytest.warns(UserWarning, match="above 1/n"):
        engine.guarantee(0.006)
    with pytest.warns(UserWarning, match="above 1/n"):
        engine.get_epsilon(0.006)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.guarantee(1 / N)  # delta = 1/n (the thesis's protocol) does not warn


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"epochs": 2, "steps": 3}, ValueError, "epochs or steps, not both"),
        ({"target_delta": 1e-5}, ValueError, "target_delta is used with target_epsilon only"),
        ({"scaling": "per-sample", "thresholds": {"1": 1.0}}, ValueError, "threshold' only"),
        ({"scaling": "batch-max", "allow_unproven": "no"}, TypeError, "allow_unproven"),
        ({"ledger_path": 123}, TypeError, "ledger_path"),
        ({"input_shape": (0,)}, ValueError, "input_shape"),
        ({"input_shape": 2.5}, TypeError, "input_shape"),
    ],
)
def test_contradictory_or_mistyped_options_are_refused(
    options: dict, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        _private(**options)


def test_numpy_scalars_and_a_plain_int_shape_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    _, _, o, _ = _private(
        noise_multiplier=np.float32(1.3),
        steps=np.int64(4),
        certify_every=np.int64(2),
        max_norm=np.float32(1.0),
        input_shape=DIM,
    )
    assert type(o.config.noise_multiplier) is float and type(o.config.steps) is int
    assert o.input_shape == (DIM,) and o.certify_every == 2


@pytest.mark.parametrize(
    ("loss", "target", "bad_row"),
    [
        (nn.BCEWithLogitsLoss(), torch.tensor([[0.0], [1.0], [2.0], [1.0]]), " 2"),
        (nn.MulticlassHingeLoss(), torch.tensor([[1.0], [0.0], [1.0], [3.0]]), " 3"),
        # {0, 1} mixed with {-1, 1}: no single record is wrong, any batch holding both fails
        (nn.KRLoss(), torch.tensor([[0.0], [-1.0], [1.0], [1.0]]), "s 0-3"),
    ],
)
def test_targets_the_loss_refuses_are_refused_before_the_first_step(
    loss: torch.nn.Module, target: torch.Tensor, bad_row: str
) -> None:
    """Audit finding: a record whose target the loss refuses made only the steps that sampled
    it fail (a failure with probability q per step breaks delta); make_private now names it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.InputNorm(1.0), nn.Linear(DIM, 1))
    data = TensorDataset(torch.randn(4, DIM), target)
    with pytest.raises(ValueError, match=rf"record{bad_row}: the loss"):
        clipless.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=2),
            loss=loss,
            noise_multiplier=1.0,
        )


def test_probability_rows_that_do_not_sum_to_one_are_refused() -> None:
    torch.manual_seed(0)
    y = torch.tensor([[0.5, 0.5], [0.9, 0.9], [1.0, 0.0]])
    with pytest.raises(ValueError, match=r"record 1: the loss \(CrossEntropyLoss\)"):
        _private(dataset=TensorDataset(torch.randn(3, DIM), y))


def test_features_of_another_dtype_than_the_model_are_refused() -> None:
    data = TensorDataset(torch.randn(20, DIM, dtype=torch.float64), torch.randint(0, 2, (20,)))
    with pytest.raises(ValueError, match=r"features are torch.float64 but the model's"):
        _private(dataset=data)


def test_max_norm_without_a_constraint_warns_and_still_trains() -> None:
    """The review: an error here broke `clipless train --max-norm 2` with a linear model (no
    constraint) and the resume of runs saved that way; it is unused, so a warning."""
    with pytest.warns(UserWarning, match="projects nothing: it is unused"):
        _, _, o, _ = _private(constraint=None, max_norm=0.5)
    assert o.config.max_norm == 0.5


def test_make_privates_warnings_name_the_callers_line() -> None:
    """Each warning of ``make_private`` points at the line that called it, however deep the
    preparation step that raises it: the user's call (here ``_private``, in this file)."""
    with pytest.warns(UserWarning) as caught:
        _private(constraint=None, max_norm=0.5)
        _private(noise_multiplier=None, target_epsilon=3.0, target_delta=0.01, epochs=1)
    messages = {str(w.message).split(" ")[0]: w.filename for w in caught}
    assert messages.keys() >= {"max_norm=0.5", "target_delta=0.01"}, messages
    assert set(messages.values()) == {__file__}, messages


def test_binary_label_conventions_mixed_across_chunks_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The review: {0, 1} and {-1, 1} labels in different validation chunks passed, and a step
    holding both failed."""
    from clipless import engine as engine_module

    monkeypatch.setattr(engine_module, "_TARGET_CHUNK", 4)
    torch.manual_seed(0)
    y = torch.tensor([[0.0], [1.0], [1.0], [0.0], [-1.0], [1.0], [1.0], [-1.0]])
    model = nn.Sequential(nn.InputNorm(1.0), nn.Linear(DIM, 1))
    with pytest.raises(ValueError, match=r"refuses a batch holding the targets \[-1.0, 0.0, 1.0\]"):
        clipless.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(8, DIM), y), batch_size=2),
            loss=nn.KRLoss(),
            noise_multiplier=1.0,
        )


def test_the_target_is_the_second_tensor_of_a_record() -> None:
    """The review: (x, y, extra) datasets were checked on the extra tensor."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(20, DIM, generator=g), torch.randint(0, 2, (20,), generator=g), torch.ones(20)
    )
    _private(dataset=data)  # the weights column is not a target


PLANNED = {
    "bias": True,
    "noise_multiplier": None,
    "target_epsilon": 1.0,
    "target_delta": 1e-5,
    "epochs": 2,
}


def test_a_per_layer_checkpoint_saved_before_num_mechanisms_is_refused_by_name() -> None:
    """A per-layer run with biases saved by the version that counted every tensor had its
    multiplier calibrated for that D: resuming it under the new D is refused, with the reason."""
    from clipless.engine import CheckpointMismatchError

    engine, *_ = _private("per-layer", **PLANNED)
    state = engine.state_dict()
    saved = dict(state["config"])
    assert saved.pop("num_mechanisms") == 2
    saved["noise_multiplier"] *= math.sqrt(2)  # calibrated for 4 mechanisms
    state["config"] = saved
    again, *_ = _private("per-layer", **PLANNED)
    with pytest.raises(CheckpointMismatchError, match="counted every tensor"):
        again.load_state_dict(state)
