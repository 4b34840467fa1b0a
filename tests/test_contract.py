"""The optimizer enforces the contract its noise relies on (clipless.optim, clipless.mechanism).

Each test of a formerly silent case measures one example's contribution (a batch of one) against
the sensitivity the noise was calibrated to, or checks that the step is refused before anything
is spent.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless
from _mechanism import split_options
from clipless import nn, norms
from clipless.optim import PlanExhaustedError, PrivacyContractError
from clipless.training import training_loss

DIM = 5
N = 200


def _data(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(0, 2, (n,), generator=g))


def _model(clip: float | None = None, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [
        nn.InputNorm(2.0),
        nn.Linear(DIM, 8, bias=bias),
        nn.GroupSort(2),
        nn.Linear(8, 2, bias=bias),
    ]
    if clip is not None:
        layers.append(nn.LossGradientClip(clip))
    return nn.Sequential(*layers)


def _private(model: torch.nn.Module | None = None, **kw):
    model = model if model is not None else _model()
    opt = kw.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    engine = clipless.PrivacyEngine(seed=0)
    kw.setdefault("noise_multiplier", 1.0)
    m, o, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(kw.pop("dataset", _data()), batch_size=20),
        loss=kw.pop("loss", nn.CrossEntropyLoss()),
        **split_options(kw),
    )
    o.data_loader = None  # these tests feed their own rows (test_batches_* check the loader)
    return engine, m, o, dl


def _worst_ratio(m: torch.nn.Module, o, sens: dict[str, float]) -> float:
    return max(
        float(p.grad.norm()) / sens[name]
        for name, p in m.named_parameters()
        if p.grad is not None and name in sens
    )


def _one(i: int = 0, scale: float = 50.0) -> tuple[torch.Tensor, torch.Tensor]:
    data = _data()
    return data.tensors[0][i : i + 1] * scale, data.tensors[1][i : i + 1]


BAD_LOSSES = {
    "100x": lambda out, y: 100 * nn.CrossEntropyLoss(reduction="sum")(out, y),
    "1000x torch mean": lambda out, y: 1000 * torch.nn.CrossEntropyLoss()(out, y),
    "regulariser": lambda out, y: (
        nn.CrossEntropyLoss(reduction="sum")(out, y) + 50 * (out**2).sum()
    ),
    "mse on a classifier": lambda out, y: torch.nn.MSELoss(reduction="sum")(
        out, 100 * torch.nn.functional.one_hot(y, 2).float()
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_LOSSES))
def test_no_loss_can_exceed_the_calibrated_sensitivity(name: str) -> None:
    _, m, o, _ = _private()
    sens = o.sensitivities()
    worst = 0.0
    for i in range(10):
        x, y = _one(i)
        o.zero_grad()
        BAD_LOSSES[name](m(x), y).backward()
        worst = max(worst, _worst_ratio(m, o, sens))
        o._pending.clear()  # measured without stepping
    assert worst <= 1.0
    assert worst > 0.2  # the clip binds: the contribution is at the bound, not vacuous


def test_the_certified_loss_is_untouched_by_the_guard() -> None:
    """For the certified loss the clip is a no-op: the gradient equals the unguarded one."""
    _, m, o, _ = _private()
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    o.zero_grad()
    o.loss(m(x), y).backward()
    guarded = [p.grad.clone() for p in m.parameters()]
    o._pending.clear()
    o.detach()  # remove the hooks: the same layers (thresholds still set), no guard
    o.zero_grad()
    o.loss(m(x), y).backward()
    for a, p in zip(guarded, m.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=0, atol=0)


def test_mean_reduced_loss_is_an_error_before_the_first_step() -> None:
    """A loss built in the training loop keeps reduction='mean' (make_private switches only the
    instance it is given): 10% accuracy on MNIST with a warning only (issue 38)."""
    x, y = _data().tensors[0][:32], _data().tensors[1][:32]
    for loss in (torch.nn.CrossEntropyLoss(), nn.CrossEntropyLoss()):
        _, m, o, _ = _private()
        o.zero_grad()
        loss(m(x), y).backward()  # measured on the device, read with the step's checks
        with pytest.raises(PrivacyContractError, match=r"mean-reduced.*allow_mean_reduced_loss"):
            o.step()
        assert o.ledger.steps == 0  # refused before anything is spent
    # the summed loss passes, and after the first step a small gradient only warns (a
    # converged model's can be that small)
    _, m, o, _ = _private()
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    o.zero_grad()
    torch.nn.CrossEntropyLoss()(m(x), y).backward()
    with pytest.warns(RuntimeWarning, match="mean-reduced"):
        o.step()


def test_mean_reduced_loss_opt_out_is_a_warning() -> None:
    _, m, o, _ = _private(allow_mean_reduced_loss=True)
    x, y = _data().tensors[0][:32], _data().tensors[1][:32]
    o.zero_grad()
    torch.nn.CrossEntropyLoss()(m(x), y).backward()
    with pytest.warns(RuntimeWarning, match="mean-reduced"):  # read with the step's checks
        o.step()  # the step itself is allowed
    with pytest.raises(TypeError, match="allow_mean_reduced_loss must be True or False"):
        _private(allow_mean_reduced_loss="yes")


def test_steps_past_the_plan_are_refused_and_extend_re_accounts() -> None:
    engine, m, o, _dl = _private(
        noise_multiplier=None, target_epsilon=1.0, target_delta=1e-5, steps=3
    )
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    for _ in range(3):
        o.zero_grad()
        o.loss(m(x), y).backward()
        o.step()
    assert engine.steps_remaining == 0
    o.zero_grad()
    o.loss(m(x), y).backward()
    with pytest.raises(PlanExhaustedError, match="extend"):
        o.step()
    assert engine.ledger.steps == 3
    assert engine.get_epsilon(1e-5) <= 1.0
    planned = engine.extend(steps=2, delta=1e-5)
    assert planned is not None and planned > 1.0
    for _ in range(2):
        o.zero_grad()
        o.loss(m(x), y).backward()
        o.step()
    assert engine.get_epsilon(1e-5) == pytest.approx(planned, rel=1e-9)


def test_two_backwards_before_one_step_are_refused() -> None:
    engine, m, o, _ = _private()
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.loss(m(x), y).backward()
    with pytest.raises(PrivacyContractError, match="2 backward passes"):
        o.step()
    assert engine.ledger.steps == 0
    # the same batch backpropagated twice through one forward
    o.zero_grad()
    out = m(x)
    o.loss(out, y).backward(retain_graph=True)
    o.loss(out, y).backward()
    with pytest.raises(PrivacyContractError, match="2 backward passes"):
        o.step()


def test_gradients_from_outside_the_model_are_refused() -> None:
    engine, m, o, _ = _private()
    o.zero_grad()
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(PrivacyContractError, match="did not come through"):
        o.step()
    assert engine.ledger.steps == 0


def test_parameter_added_after_make_private_is_refused() -> None:
    _, _m, o, _ = _private()
    extra = torch.nn.Parameter(torch.zeros(3))
    o.add_param_group({"params": [extra]})
    with pytest.raises(PrivacyContractError, match="add_param_group"):
        o.step()


def test_input_shape_is_checked() -> None:
    _, m, _, _ = _private()
    with pytest.raises(ValueError, match="shape"):
        m(torch.zeros(4, DIM + 1))


def test_weights_changed_between_forward_and_backward_are_refused() -> None:
    _, m, o, _ = _private()
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    out = m(x)
    m[3].weight.data.mul_(100.0)
    o.loss(out, y).backward()  # compared on the device, refused before the noise
    before = [p.detach().clone() for p in m.parameters()]
    steps = o.ledger.steps
    with pytest.raises(PrivacyContractError, match="changed between the forward"):
        o.step()
    assert o.ledger.steps == steps  # nothing recorded ...
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))  # or moved


def test_a_weight_written_through_data_after_certification_refuses_the_step() -> None:
    """The bound cache trusts a weight autograd saw unchanged and checks its bits on the device,
    read with the step's checks: a write through .data (no version bump) is refused before the
    noise, and the next forward certifies the new weight."""
    _, m, o, _ = _private()
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()  # seeds the bounds of the projected weights
    m[3].weight.data.mul_(100.0)
    o.zero_grad()
    o.loss(m(x), y).backward()
    steps, before = o.ledger.steps, [p.detach().clone() for p in m.parameters()]
    with pytest.raises(PrivacyContractError, match="'3' was changed without autograd seeing it"):
        o.step()
    assert o.ledger.steps == steps
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()  # planned for the new weight
    assert o.ledger.steps == steps + 1
    assert m[3].lipschitz() == pytest.approx(norms.dense_norm(m[3].weight), rel=1e-5)


def test_noise_is_planned_at_the_weights_the_forward_used() -> None:
    """Scaling a layer after backward and before step no longer changes another layer's noise."""
    _, m, o, _ = _private(constraint=None)
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    planned = o.noise_stds()
    used: list = []
    o.add_noise = lambda plan=None: used.append(plan)  # type: ignore[method-assign]
    o.zero_grad()
    o.loss(m(x), y).backward()
    with torch.no_grad():
        m[3].weight.mul_(0.01)
    o.step()
    assert dict(used[0].stds) == planned


def test_augmult_with_a_clip_layer_keeps_one_sample_within_the_sensitivity() -> None:
    """Review finding 1: K copies each clipped to c used to contribute K c; now at most c."""
    _, m, o, _ = _private(model=_model(clip=0.05))
    sens = o.sensitivities()
    g = torch.Generator().manual_seed(1)

    def wild(t: torch.Tensor) -> torch.Tensor:
        return 5.0 * t + 3.0 * torch.randn(t.shape, generator=g)

    worst = 0.0
    for i in range(8):
        x, y = _one(i, scale=1.0)
        o.zero_grad()
        value, _, _ = training_loss(m, o.loss, x, y, augment=wild, augmult=8, optimizer=o)
        value.backward()
        worst = max(worst, _worst_ratio(m, o, sens))
        o._pending.clear()
    assert 0.3 < worst <= 1.0
    with pytest.raises(ValueError, match="LossGradientClip"):
        training_loss(m, o.loss, x, y, augment=wild, augmult=8)


def test_batch_max_ledger_is_not_a_guarantee(tmp_path) -> None:
    path = tmp_path / "ledger.json"
    engine, m, o, _ = _private(scaling="batch-max", allow_unproven=True, ledger_path=path)
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    saved = clipless.accounting.PrivacyLedger.from_json(path)
    assert [e.proven for e in saved.entries] == [False]
    assert not saved.guarantee(1e-5).is_dp_guarantee
    assert not engine.guarantee(1e-5).is_dp_guarantee
    assert "NOT a DP guarantee" in str(saved.guarantee(1e-5))


def test_load_state_dict_never_rolls_the_ledger_back() -> None:
    engine, m, o, _ = _private()
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    early = engine.state_dict()
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    with pytest.raises(ValueError, match="roll the accounting back"):
        engine.load_state_dict(early)
    assert engine.ledger.steps == 2


def test_frozen_parameter_in_the_optimizer_does_not_miscalibrate_per_layer_noise() -> None:
    """Review finding 11: D counts the noised tensors (the optimizer's trainable ones)."""
    model = _model()
    model[1].bias.requires_grad_(False)
    engine, m, o, _ = _private(
        model=model,
        noise="per-layer",
        noise_multiplier=None,
        target_epsilon=1.0,
        target_delta=1e-5,
        steps=4,
    )
    assert o.config.num_tensors == 3
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    before = model[1].bias.detach().clone()
    for _ in range(4):
        o.zero_grad()
        o.loss(m(x), y).backward()
        o.step()
    assert engine.get_epsilon(1e-5) <= 1.0
    assert torch.equal(model[1].bias.detach(), before)  # frozen: never noised nor stepped


def test_tied_weights_add_their_bounds_under_global_noise() -> None:
    """Review finding 3: a module used twice sums its uses' bounds; it no longer crashes."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(nn.InputNorm(1.0), shared, nn.GroupSort(2), shared, nn.Linear(4, 2))
    data = TensorDataset(torch.randn(50, 4), torch.randint(0, 2, (50,)))
    _, m, o, _ = _private(model=model, dataset=data)
    report = o.bound_report()
    uses = [lb.cotangent_bound for lb in report.layers if lb.path in ("1", "3")]
    assert len(uses) == 2
    margin = 1.0 + o.current_plan().rounding_margin
    sens = o.sensitivities()
    assert sens["1.weight"] == pytest.approx(sum(uses) * margin, rel=1e-12)
    plan = o.current_plan()
    expected = math.sqrt(sens["1.weight"] ** 2 + sens["4.weight"] ** 2 + 0.0)
    # global: the groups are {1.weight (both uses)} and {4.weight, 4.bias}
    assert plan.stds["1.weight"] == pytest.approx(expected, rel=1e-9)
    worst = 0.0
    for i in range(20):
        o.zero_grad()
        o.loss(m(data.tensors[0][i : i + 1] * 10), data.tensors[1][i : i + 1]).backward()
        worst = max(worst, _worst_ratio(m, o, sens))
        o._pending.clear()
    assert worst <= 1.0


def test_bad_records_are_found_before_training() -> None:
    data = _data()
    x = data.tensors[0].clone()
    x[7, 2] = float("nan")
    with pytest.raises(ValueError, match="record 7"):
        _private(dataset=TensorDataset(x, data.tensors[1]))
    y = data.tensors[1].clone()
    y[11] = 5
    with pytest.raises(ValueError, match="record 11"):
        _private(dataset=TensorDataset(data.tensors[0], y))


def test_half_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="float32 or float64"):
        _private(model=_model().to(torch.bfloat16))


@pytest.mark.parametrize("how", ["half", "one-layer", "autocast"])
def test_lower_precision_after_make_private_is_refused(how: str) -> None:
    """Audit finding: the dtype was checked only at make_private, so a later ``model.half()``
    stepped with the float32 rounding margin. Now every training forward checks it (and
    refuses torch.autocast, which lowers the precision without changing the parameters)."""
    _, m, o, dl = _private()
    x, y = next(iter(dl))
    if how == "half":
        m.to(torch.bfloat16)
    elif how == "one-layer":
        m[3].to(torch.bfloat16)
    loss = nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(PrivacyContractError, match=r"float32|autocast"):
        if how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss(m(x), y).backward()
        else:
            loss(m(x.to(torch.bfloat16)), y).backward()
    assert o.ledger.steps == 0  # nothing was spent
    # converted back, the model trains again
    m.to(torch.float32)
    loss(m(x), y).backward()
    o.step()
    assert o.ledger.steps == 1


@pytest.mark.parametrize("how", ["matmul-precision", "mkldnn-bf16"])
def test_reduced_float32_precision_is_refused(how: str) -> None:
    """Audit finding: TF32 (CUDA's default for float32 convolutions) and bfloat16 products
    round float32 operands to a 10- or 7-bit mantissa, beyond the float32 rounding margin of the
    noise; only dtype and autocast were checked. Every training forward of a float32 model now
    reads the backends' precision settings (the CUDA flags are read for CUDA parameters only:
    ``reduced_float32_precision({"cuda"})`` names ``cudnn.allow_tf32``, True by default)."""
    from clipless.optim import reduced_float32_precision

    assert reduced_float32_precision({"cpu"}) is None
    _, m, o, dl = _private()
    x, y = next(iter(dl))
    loss = nn.CrossEntropyLoss(reduction="sum")
    mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
    if how == "mkldnn-bf16" and mkldnn is None:
        pytest.skip("torch < 2.9 has no torch.backends.mkldnn.matmul.fp32_precision")
    try:
        if how == "matmul-precision":
            torch.set_float32_matmul_precision("medium")
        else:
            mkldnn.fp32_precision = "bf16"
        assert reduced_float32_precision({"cpu"}) is not None
        with pytest.raises(PrivacyContractError, match=r"TF32 or bfloat16"):
            loss(m(x), y).backward()
    finally:
        if how == "matmul-precision":
            torch.set_float32_matmul_precision("highest")
        else:
            mkldnn.fp32_precision = "none"
    assert reduced_float32_precision({"cpu"}) is None
    assert o.ledger.steps == 0
    loss(m(x), y).backward()
    o.step()
    assert o.ledger.steps == 1


def test_make_private_switches_reduced_float32_precision_off() -> None:
    """A float32 model made private under bfloat16 products (TF32 on CUDA, CUDA's default for
    convolutions) would have every step refused: make_private turns full float32 on itself, with
    a warning; switched back on afterwards, the training forward refuses it as before."""
    from clipless.optim import reduced_float32_precision

    mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
    if mkldnn is None:
        pytest.skip("torch < 2.9 has no torch.backends.mkldnn.matmul.fp32_precision")
    try:
        mkldnn.fp32_precision = "bf16"
        with pytest.warns(RuntimeWarning, match="switched float32 to full precision"):
            _, m, o, dl = _private()
        assert reduced_float32_precision({"cpu"}) is None
        x, y = next(iter(dl))
        o.loss(m(x), y).backward()
        o.step()
        mkldnn.fp32_precision = "bf16"
        with pytest.raises(PrivacyContractError, match=r"TF32 or bfloat16"):
            m(x)
    finally:
        mkldnn.fp32_precision = "none"


def test_opacus_names() -> None:
    with pytest.raises(TypeError, match="max_grad_norm: there is no per-sample gradient clipping"):
        _private(max_grad_norm=1.0)
    with pytest.raises(ValueError, match="secure_mode"):
        clipless.PrivacyEngine(secure_mode=True)
    with pytest.raises(TypeError, match="grad_sample_mode"):
        _private(grad_sample_mode="hooks")
    engine = clipless.PrivacyEngine(seed=0)
    model = _model()
    m, o, _ = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=20),
        loss=nn.CrossEntropyLoss(),
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=1,
    )
    o.data_loader = None  # own rows
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    assert engine.accountant.get_epsilon(1e-5) == engine.get_epsilon(1e-5) > 0


def test_empty_batch_still_takes_a_noisy_step() -> None:
    engine, m, o, _ = _private()
    o.zero_grad()
    out = m(torch.zeros(0, DIM))
    o.loss(out, torch.zeros(0, dtype=torch.long)).backward()
    before = m[1].weight.detach().clone()
    o.step()
    assert engine.ledger.steps == 1
    assert not torch.equal(before, m[1].weight.detach())


@pytest.mark.parametrize("clip", [None, 0.3])
def test_unconstrained_weights_keep_the_sensitivity(clip: float | None) -> None:
    """``constraint=None``: the noise follows the certified norms of the current (public) weights.

    A later layer grown 40x multiplies the earlier layer's cotangent bound, and one example's
    contribution stays within the sensitivity the step was planned with; the plan is made at the
    weights of the forward pass, so the growth is seen before the noise is drawn.
    """
    _, m, o, _ = _private(_model(clip=clip), constraint=None)
    before = o.sensitivities()
    with torch.no_grad():
        m[3].weight.mul_(40.0)  # public weights: what the optimizer would release anyway
    worst = 0.0
    for i in range(10):
        x, y = _one(i)
        o.zero_grad()
        o.loss(m(x), y).backward()  # the forward re-plans at these weights
        sens = o.sensitivities()
        worst = max(worst, _worst_ratio(m, o, sens))
        o._pending.clear()
    assert sens["1.weight"] > 30 * before["1.weight"]  # the growth reached the bound
    assert sens["3.weight"] == pytest.approx(before["3.weight"])  # last layer: L (or c) only
    assert 0.05 < worst <= 1.0


def _guarded_step_with(variant: str):
    """One example, a guarded training-mode forward, and one more way into the gradients."""
    engine, m, o, _ = _private()
    ce = nn.CrossEntropyLoss(reduction="sum")
    x, y = _one(0)
    o.zero_grad()
    loss = ce(m(x), y)
    if variant == "eval-mode forward":
        m.eval()
        extra = m(x)
        m.train()
        loss = loss + 100 * ce(extra, y)
    elif variant == "keyword argument":
        loss = loss + 100 * ce(m(input=x), y)
    elif variant == "submodule":
        loss = loss + 100 * ce(m[3](m[2](m[1](m[0](x)))), y)
    elif variant == "slice":
        loss = loss + 100 * ce(m[1:](x), y)
    loss.backward()
    if variant == "scaled grad":
        for p in m.parameters():
            p.grad.mul_(100)
    elif variant == "replaced grad":
        m[1].weight.grad = m[1].weight.grad * 100
    elif variant == "second backward outside the model":
        (100 * torch.nn.functional.linear(x, m[1].weight).sum()).backward()
    return engine, m, o


@pytest.mark.parametrize(
    ("variant", "match"),
    [
        ("eval-mode forward", "eval-mode forward"),
        ("submodule", "called outside a forward"),
        ("slice", "called outside a forward"),
        ("scaled grad", "changed after the backward pass"),
        ("replaced grad", "changed after the backward pass"),
        ("second backward outside the model", "outside the private model accumulated"),
    ],
)
def test_gradients_that_bypass_the_guard_are_refused(variant: str, match: str) -> None:
    """Audit finding: with one guarded backward pending, any other way into the gradients gave
    one example ~21x the certified sensitivity, and the step was accounted at the planned epsilon.
    Now the step is refused before anything is recorded."""
    engine, _m, o = _guarded_step_with(variant)
    with pytest.raises(PrivacyContractError, match=match):
        o.step()
    assert engine.ledger.steps == 0


def test_a_keyword_call_is_guarded_like_a_positional_one() -> None:
    engine, m, o = _guarded_step_with("keyword argument")
    with pytest.raises(PrivacyContractError, match="2 backward passes"):
        o.step()
    assert engine.ledger.steps == 0
    o.zero_grad()
    o.loss(m(input=_data().tensors[0][:20]), _data().tensors[1][:20]).backward()
    o.step()  # the keyword call alone is one guarded pass
    assert engine.ledger.steps == 1
    with pytest.raises(PrivacyContractError, match="first argument"):
        m()


def test_a_backward_outside_the_model_alone_is_refused() -> None:
    engine, m, o, _ = _private()
    x, y = _one(0)
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    o.zero_grad()
    (torch.nn.functional.linear(x, m[1].weight).sum()).backward()  # no forward of the model
    m(x)  # a guarded forward whose backward never runs
    with pytest.raises(PrivacyContractError, match="did not come through"):
        o.step()
    o.zero_grad()
    out = m(x)
    o.zero_grad()
    (torch.nn.functional.linear(x, m[1].weight).sum()).backward()
    o.loss(out, y).backward()  # the guarded backward accumulates into a gradient already there
    with pytest.raises(PrivacyContractError, match="already held a gradient"):
        o.step()
    assert engine.ledger.steps == 1


def test_legitimate_loops_still_step() -> None:
    """Input gradients of an evaluation, gradients kept across steps, zero_grad(set_to_none=False)
    and an unrelated evaluation forward all leave the step alone."""
    engine, m, o, _ = _private()
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    for step in range(4):
        if step == 1:
            o.zero_grad(set_to_none=False)
        elif step != 2:  # step 2 accumulates onto the gradient step 1 released
            o.zero_grad()
        o.loss(m(x), y).backward()
        m.eval()
        probe = x[:3].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(m(probe).sum(), probe)  # input gradient, eval mode
        assert bool(torch.isfinite(g).all())
        m.train()
        o.step()
    assert engine.ledger.steps == 4


def test_the_wrapped_optimizer_cannot_step_on_its_own() -> None:
    """Audit finding: stepping the optimizer given to make_private applied the raw gradient with
    no noise and no ledger entry (epsilon 0 reported)."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, m, o, _ = _private(model=model, optimizer=inner)
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    o.zero_grad()
    o.loss(m(x), y).backward()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(PrivacyContractError, match="stepped directly"):
        inner.step()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
    o.step()
    assert engine.ledger.steps == 1
    o.detach()  # the hooks are the optimizer's: detached, the inner optimizer is plain again
    inner.step()


def test_frozen_weights_changed_between_forward_and_backward_are_refused() -> None:
    """Audit finding: a frozen layer's weight sets the cotangent bound of the layers below it."""
    model = _model()
    model[3].weight.requires_grad_(False)
    model[3].bias.requires_grad_(False)
    _, m, o, _ = _private(model=model)
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    out = m(x)
    m[3].weight.data.mul_(100.0)
    o.loss(out, y).backward()
    with pytest.raises(PrivacyContractError, match=r"'3\.weight' changed between the forward"):
        o.step()


def test_trainable_parameters_outside_the_optimizer_are_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"\['3.weight', '3.bias'\] require gradients"):
        _private(model=model, optimizer=torch.optim.SGD(list(model[1].parameters()), lr=0.1))


def test_sample_multiplicity_needs_whole_samples() -> None:
    _, m, o, _ = _private()
    with o.sample_multiplicity(3), pytest.raises(ValueError, match="not a multiple of 3"):
        m(_data().tensors[0][:20])


# --------------------------------------------------------------------------------------------
# Findings of an audit of the optimizer's contract (each passed silently before its fix)
# --------------------------------------------------------------------------------------------


def _scale100(*args):
    """A hook of any kind that multiplies what it sees by 100 (the audit's 70x-7000x cases)."""
    last = args[-1]
    if isinstance(last, tuple):
        return tuple(None if t is None else 100 * t for t in last)
    return 100 * last if isinstance(last, torch.Tensor) else None


HOOKS = {
    "tensor hook": lambda m: m[1].weight.register_hook(_scale100),
    "post-accumulate hook": lambda m: m[1].weight.register_post_accumulate_grad_hook(
        lambda p: p.grad.mul_(100)
    ),
    "forward hook": lambda m: m[2].register_forward_hook(_scale100),
    "forward pre-hook": lambda m: m[3].register_forward_pre_hook(_scale100),
    "backward hook": lambda m: m[3].register_full_backward_hook(_scale100),
    "backward pre-hook": lambda m: m[3].register_full_backward_pre_hook(_scale100),
    "global forward hook": lambda m: torch.nn.modules.module.register_module_forward_hook(
        _scale100
    ),
}


@pytest.mark.parametrize("kind", list(HOOKS))
def test_hooks_inside_the_guarded_pass_are_refused(kind: str) -> None:
    _, m, o, _ = _private()
    handle = HOOKS[kind](m)
    try:
        x, y = _one()
        o.zero_grad()
        with pytest.raises(PrivacyContractError, match="hook"):
            o.loss(m(x), y).backward()
            o.step()
    finally:
        handle.remove()
    o.zero_grad()
    o.loss(m(x), y).backward()  # without the hook the same step is accepted
    o.step()


def test_saved_tensor_hooks_around_the_model_are_refused() -> None:
    _, m, o, _ = _private()
    x, y = _one()
    o.zero_grad()
    with (
        pytest.raises(PrivacyContractError, match="saved-tensor hooks"),
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: 100 * t),
    ):
        o.loss(m(x), y).backward()


def test_load_state_dict_keeps_the_optimizers_connected() -> None:
    """torch's load_state_dict replaces the wrapped optimizer's lists: the copies the DPOptimizer
    took went stale (a StepLR on it changed nothing, and add_param_group was no longer seen)."""
    _, m, o, _ = _private()
    o.load_state_dict(o.state_dict())
    assert o.param_groups is o.original_optimizer.param_groups
    assert o.state is o.original_optimizer.state
    scheduler = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    x, y = _one()
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    scheduler.step()
    assert o.original_optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_the_wrapped_optimizer_refuses_to_step_once_its_dp_optimizer_is_gone() -> None:
    import gc

    def train_then_drop() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        _, m, o, _ = _private()
        return m, o.original_optimizer

    m, inner = train_then_drop()
    gc.collect()
    x, y = _one()
    nn.CrossEntropyLoss(reduction="sum")(m(x), y).backward()
    before = m[1].weight.detach().clone()
    with pytest.raises(PrivacyContractError, match="no longer exists"):
        inner.step()
    assert torch.equal(m[1].weight.detach(), before)


def test_step_hooks_on_the_dp_optimizer_run_after_the_noise() -> None:
    engine, m, o, _ = _private()
    seen: list[int] = []  # the ledger's steps when the hook runs: recorded (and noised) before
    handle = o.register_step_pre_hook(lambda opt, args, kwargs: seen.append(engine.ledger.steps))
    x, y = _one()
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    handle.remove()
    assert seen == [1]


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_gradient_written_without_autograd_seeing_it_is_refused(how: str) -> None:
    """Writes through .data or a NumPy view do not bump the version counter (an audit measured
    20.9x the planned sensitivity through them); the gradient's exact float64 norm is recorded
    when it is accumulated and compared at step()."""
    _, m, o, _ = _private()
    x, y = _one()
    o.zero_grad()
    o.loss(m(x), y).backward()
    grad = m[1].weight.grad
    version = grad._version
    if how == "data":
        grad.data.mul_(100.0)
    else:
        grad.numpy()[...] *= 100.0
    assert grad._version == version  # autograd did not see it
    with pytest.raises(PrivacyContractError, match=r"changed after the backward pass without"):
        o.step()
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()  # an untouched gradient steps


# ---------------------------------------------- the batches the steps train on (the loader's)
def _loader_private(n: int = N, batch_size: int = 20, **kw):
    """make_private's default: the optimizer checks the returned Poisson loader."""
    model = _model()
    engine = clipless.PrivacyEngine(seed=0)
    m, o, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(n), batch_size=batch_size),
        loss=nn.CrossEntropyLoss(),
        noise_multiplier=1.0,
        **split_options(kw),
    )
    assert o.data_loader is dl
    return engine, m, o, dl


def _train_on(m, o, x, y) -> None:
    o.zero_grad()
    if x.shape[0]:
        o.loss(m(x), y).backward()
    o.step()


def test_batches_of_the_returned_loader_step_empty_ones_included() -> None:
    engine, m, o, dl = _loader_private(n=30, batch_size=1)  # q = 1/30: empty batches occur
    sizes = []
    for _ in range(3):
        for x, y in dl:
            sizes.append(x.shape[0])
            _train_on(m, o, x, y)
    assert 0 in sizes and engine.ledger.steps == len(sizes) == 90


def test_batches_of_the_batches_original_loader_are_refused() -> None:
    """The most common port mistake: training on the loader given to make_private instead of
    the Poisson loader it returned (fixed-size shuffled batches are not what is accounted)."""
    engine, m, o, _dl = _loader_private()
    original = DataLoader(_data(), batch_size=20, shuffle=True)
    x, y = next(iter(original))
    o.zero_grad()
    o.loss(m(x[:0]), y[:0]).backward()  # rows are not the issue here
    with pytest.raises(PrivacyContractError, match="no batch was drawn from the Poisson loader"):
        o.step()
    assert engine.ledger.steps == 0


def test_one_batch_stepped_on_twice_is_refused() -> None:
    engine, m, o, dl = _loader_private()
    x, y = next(iter(dl))
    _train_on(m, o, x, y)
    with pytest.raises(PrivacyContractError, match="no batch was drawn"):
        _train_on(m, o, x, y)
    assert engine.ledger.steps == 1
    x, y = next(iter(dl))  # the refused step consumed nothing more: the next batch steps
    _train_on(m, o, x, y)
    assert engine.ledger.steps == 2


def test_a_skipped_batch_is_refused() -> None:
    """Skipping a batch (the usual case: an empty one) is not DP; neither is a peek before the
    loop counted as free."""
    engine, m, o, dl = _loader_private()
    it = iter(dl)
    next(it)  # skipped
    x, y = next(it)
    o.zero_grad()
    o.loss(m(x), y).backward()
    with pytest.raises(PrivacyContractError, match="2 batches were drawn"):
        o.step()
    assert engine.ledger.steps == 0


def test_more_rows_than_the_batch_are_refused_at_the_forward() -> None:
    """An example in several rows contributes several times: a batch concatenated with another
    (or with itself), or augmented copies without sample_multiplicity (here 2x the sensitivity,
    which nothing else sees)."""
    _engine, m, o, dl = _loader_private(sample_rate=1.0)
    x, y = next(iter(dl))
    with pytest.raises(PrivacyContractError, match=f"{2 * N} rows but the last batch"):
        m(torch.cat([x, x + 0.01]))
    with o.sample_multiplicity(2):  # declared copies are fine
        out = m(torch.cat([x, x + 0.01]).reshape(2, N, DIM).transpose(0, 1).reshape(2 * N, DIM))
    o.zero_grad()
    o.loss(out, y.repeat_interleave(2)).backward()
    o.step()
    x, y = next(iter(dl))
    with o.sample_multiplicity(2), pytest.raises(PrivacyContractError, match="x 2 copies"):
        m(torch.cat([x, x, x]))  # 3N rows (whole samples of 2 rows) > 2N
    _train_on(m, o, x[: N // 2], y[: N // 2])  # fewer rows (a shard, dropped rows) are fine


def test_a_stopping_loop_can_discard_its_last_batch() -> None:
    engine, m, o, dl = _loader_private()
    it = iter(dl)
    x, y = next(it)
    _train_on(m, o, x, y)
    next(it)  # drawn, then training stops (a budget limit) without a step
    o.discard_batch()
    x, y = next(it)  # later, training resumes (engine.extend)
    _train_on(m, o, x, y)
    assert engine.ledger.steps == 2


def test_sampling_yourself_is_an_explicit_opt_out() -> None:
    engine, m, o, _dl = _loader_private()
    with pytest.raises(TypeError, match="PoissonDataLoader"):
        o.data_loader = DataLoader(_data(), batch_size=20)
    o.data_loader = None
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    _train_on(m, o, x, y)
    _train_on(m, o, x, y)
    assert engine.ledger.steps == 2


def test_copies_made_by_the_collate_count_as_copies() -> None:
    """Review finding: the row limit was read from the collated batch, so a collate_fn emitting
    K views of every example as rows raised it to K B and one example counted K times (3.5x the
    sensitivity at K = 16). The limit is now the number of examples the sampler drew."""
    model = _model()
    data = _data()

    def four_views(rows):
        x = torch.stack([r[0] for r in rows])
        y = torch.stack([r[1] for r in rows])
        return x.repeat_interleave(4, 0), y.repeat_interleave(4, 0)

    engine = clipless.PrivacyEngine(seed=0)
    m, o, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=20, collate_fn=four_views),
        loss=nn.CrossEntropyLoss(),
        noise_multiplier=1.0,
    )
    x, y = next(iter(dl))
    while x.shape[0] == 0:  # (a skip that does not depend on what the batch holds... in a test)
        o.discard_batch()
        x, y = next(iter(dl))
    with pytest.raises(PrivacyContractError, match="examples"):
        m(x)
    with o.sample_multiplicity(4):
        out = m(x)
    o.zero_grad()
    o.loss(out, y).backward()
    o.step()
    assert engine.ledger.steps == 1


def test_convolution_precision_concerns_convolutional_models_only() -> None:
    """cuDNN's TF32 flag is on by default on CUDA but affects convolutions only: a model of
    dense clipless layers is not refused for the convolution settings, a ConvNet is (here with
    the CPU's oneDNN convolution setting, the same check)."""
    from clipless.optim import reduced_float32_precision

    conv = getattr(torch.backends.mkldnn, "conv", None)
    if conv is None or not hasattr(conv, "fp32_precision"):
        pytest.skip("torch < 2.9 has no torch.backends.mkldnn.conv.fp32_precision")
    saved = conv.fp32_precision
    try:
        conv.fp32_precision = "tf32"
        assert reduced_float32_precision({"cpu"}) is not None
        assert reduced_float32_precision({"cpu"}, convolutions=False) is None
        _, m, o, dl = _private()  # an MLP: trains
        x, y = next(iter(dl))
        nn.CrossEntropyLoss(reduction="sum")(m(x), y).backward()
        o.step()
        assert o.ledger.steps == 1
        model = nn.Sequential(
            nn.InputNorm(1.0), nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(32, 2)
        )
        images = torch.utils.data.TensorDataset(
            torch.randn(64, 1, 4, 4), torch.randint(0, 2, (64,))
        )
        with pytest.warns(RuntimeWarning, match="switched float32 to full precision"):
            model, _, loader = clipless.PrivacyEngine(seed=0).make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=torch.utils.data.DataLoader(images, batch_size=16),
                loss=nn.CrossEntropyLoss(),
                noise_multiplier=1.0,
            )
        conv.fp32_precision = "tf32"  # switched on again after make_private: refused
        x, y = next(iter(loader))
        with pytest.raises(PrivacyContractError, match=r"mkldnn\.conv"):
            model(x)
    finally:
        conv.fp32_precision = saved


def test_full_float32_precision_clears_every_reduced_setting() -> None:
    """The legacy writes (``allow_tf32 = False``) leave a TF32 setting inherited from
    ``torch.backends.fp32_precision`` in place on torch >= 2.9; ``full_float32_precision`` sets
    every backend's precision explicitly (review finding)."""
    from clipless.optim import full_float32_precision, reduced_float32_precision
    from clipless.optim.precision import _FP32_LEAVES

    backends = torch.backends
    if not isinstance(getattr(backends, "fp32_precision", None), str):
        pytest.skip("torch < 2.9: only the legacy flags")
    owners = [getattr(getattr(backends, a), b) for a, b in _FP32_LEAVES]
    saved = [o.fp32_precision for o in owners], backends.fp32_precision
    try:
        for owner in owners:
            owner.fp32_precision = "none"
        backends.fp32_precision = "tf32"  # inherited by every backend
        assert reduced_float32_precision({"cpu"}) is not None
        assert reduced_float32_precision({"cuda"}) is not None
        full_float32_precision()
        assert reduced_float32_precision({"cpu", "cuda"}) is None
    finally:
        for owner, value in zip(owners, saved[0], strict=True):
            owner.fp32_precision = value
        backends.fp32_precision = saved[1]


# --------------------------------------------------------------------------------------------
# Findings of an audit of unusual model structures (sixteenth session)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["grad", "vjp", "eval grad", "copies", "eval create_graph"])
def test_an_unguarded_penalty_pass_is_refused(how: str) -> None:
    """An input-gradient penalty through ``torch.func.grad`` (2.47x the planned sensitivity) or
    a second pass through ``torch.func.vjp`` (6.82x) joined the guarded gradient unseen: the
    transformed pass has no output clip, and autograd merged both paths into one accumulation.
    The same in eval mode, on copies of the parameters passed through ``functional_call``, or
    with ``torch.autograd.grad(create_graph=True)`` through an eval-mode forward (3.33x each)."""
    _, m, o, _ = _private()
    x, y = _data().tensors[0][:20] * 3, _data().tensors[1][:20]
    match = r"inside a torch\.func transform"
    if how == "eval create_graph":
        match = r"create_graph=True through an eval-mode forward"
    with pytest.raises(PrivacyContractError, match=match):
        if how in ("grad", "eval grad"):
            m.train(how == "grad")
            gx = torch.func.grad(lambda xb: o.loss(m(xb), y))(x)
            m.train()
            (o.loss(m(x), y) + 100.0 * gx.square().sum()).backward()
        elif how == "vjp":
            out, _ = torch.func.vjp(m, x)
            (o.loss(m(x), y) + 10.0 * o.loss(out, y)).backward()
        elif how == "copies":
            copies = {k: v * 1.0 for k, v in m.named_parameters()}
            out = torch.func.vmap(lambda xi: torch.func.functional_call(m, copies, (xi[None],)))
            (o.loss(m(x), y) + o.loss(out(x)[:, 0], y)).backward()
        else:
            m.eval()
            xr = x.clone().requires_grad_(True)
            (gx,) = torch.autograd.grad(o.loss(m(xr), y), xr, create_graph=True)
    m.eval()  # a diagnostic under torch.no_grad() (an input Jacobian) stays allowed
    with torch.no_grad():
        assert not torch.func.jacrev(m)(x[:2]).requires_grad
    m.train()
    o.zero_grad()
    o._pending.clear()
    o.loss(m(x), y).backward()  # the guarded pass alone is accepted
    o.step()


def test_a_release_added_after_make_private_is_refused() -> None:
    """A released input mean put into the model after ``make_private`` trained unaccounted:
    epsilon 4.38 reported where composing the release gives 11.48."""
    from clipless.features import release_mean

    _, m, o, _ = _private()
    x, y = _data().tensors[0][:20], _data().tensors[1][:20]
    mean = release_mean(_data().tensors[0], noise_multiplier=0.5)
    m[0] = nn.InputNorm(2.0, center=mean, center_noise=0.5)
    with pytest.raises(PrivacyContractError, match="input releases changed after make_private"):
        o.loss(m(x), y).backward()
    m[0] = nn.InputNorm(2.0)  # without a release: the model make_private accounted for
    o.loss(m(x), y).backward()


def test_an_infinite_sensitivity_is_refused_before_any_noise() -> None:
    """A sphere-mode InputNorm after the first layer has no finite constant: the step drew noise
    of std inf and the weights silently became non-finite while the ledger recorded a step."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.InputNorm(1.0),
        nn.Linear(DIM, 8, bias=False),
        nn.InputNorm(1.0, mode="sphere"),
        nn.Linear(8, 2, bias=False),
    )
    with pytest.raises(ValueError, match=r"layer '1': its certified sensitivity is inf"):
        _private(model)


def test_a_module_at_two_paths_gets_the_largest_of_its_thresholds() -> None:
    """``scaling="bound"``: thresholds are planned per path, and the last path used to win, so a
    layer used at input bounds 10 and 2.83 was scaled with 2.83 for both uses (a bias, not a
    privacy loss: the threshold never enters the sensitivity)."""
    torch.manual_seed(0)
    shared = nn.Linear(DIM, DIM, bias=False)
    model = nn.Sequential(
        nn.InputNorm(10.0), shared, nn.GroupNorm(1, DIM), shared, nn.Linear(DIM, 2, bias=False)
    )
    _, _, o, _ = _private(model, scaling="bound", constraint=None)
    plan = o.refresh()
    by_path = {lb.path: lb.norm_factor_bound for lb in o.bound_report().layers}
    assert by_path["1"] != by_path["3"]
    assert plan.thresholds["1"] == by_path["1"] and plan.thresholds["3"] == by_path["3"]
    assert shared.scaling_threshold == max(by_path["1"], by_path["3"])


def test_a_layer_put_in_eval_mode_inside_a_training_model_stays_scaled() -> None:
    """The scaled kernels run whenever the plan set a threshold, not only in training mode: a
    sub-layer switched to eval mode inside a training forward still divides each row by its
    norm factor (unscaled, layer 1's rows would contribute up to the input radius 2 times G)."""
    _, m, o, _ = _private()
    m[1].eval()
    sens = o.sensitivities()
    worst = 0.0
    for i in range(10):
        x, y = _one(i)
        o.zero_grad()
        o.loss(m(x), y).backward()
        worst = max(worst, _worst_ratio(m, o, sens))
        o._pending.clear()
    assert 0.5 < worst <= 1.0


def test_power_iteration_on_a_live_private_layer_is_allowed() -> None:
    """``norms.power_iteration(op=layer)`` takes its adjoint with ``torch.func.vjp`` under
    ``torch.no_grad()``: no outer graph reaches the layer's parameters, so the torch.func check
    lets it run on a layer of the private model (a lower bound on the certified norm)."""
    from clipless.norms import power_iteration

    _, m, _, _ = _private()
    for training in (True, False):
        m.train(training)
        estimate = power_iteration(m[1], input_shape=(1, DIM), iters=50).lower_bound
        assert 0.5 < estimate <= m[1].lipschitz()


def _tied_biased() -> torch.nn.Module:
    """Two Linears sharing one weight, each with its own bias, then a last layer: the shared
    group has U = 2 uses and P = 3 tensors (D_c = 2), the last layer D_c = 1."""
    first = nn.Linear(4, 4, bias=True)
    second = nn.Linear(4, 4, bias=True)
    second.weight = first.weight
    return nn.Sequential(nn.InputNorm(1.0), first, nn.GroupSort(2), second, nn.Linear(4, 2))


@pytest.mark.parametrize(
    "make, tensors, mechanisms, tight",
    [
        (lambda: nn.Sequential(nn.InputNorm(1.0), nn.Linear(4, 2, bias=True)), 2, 1, 0.999),
        (
            lambda: nn.Sequential(
                nn.InputNorm(1.0),
                nn.Linear(4, 6, bias=True),
                nn.GroupSort(2),
                nn.Linear(6, 2, bias=True),
            ),
            4,
            2,
            0.999,
        ),
        (_tied_biased, 5, 3, 0.85),
    ],
)
def test_per_layer_noise_mahalanobis_sensitivity_is_at_most_one_over_sigma_eff(
    make, tensors: int, mechanisms: int, tight: float
) -> None:
    """Per-layer noise counts D = sum_c min(U_c, P_c) mechanisms (mechanism.py, "Noise
    allocation"). Checked on every sample's contribution through the real training path: the
    squared Mahalanobis norm ``sum_p ||c_p||^2 / std_p^2`` of one sample's contributions under the
    step's stds is at most ``1 / sigma_eff^2``, and comes close to it (so a smaller D, or noise
    stds a little smaller, would fail; counting every tensor, as before, gave 0.707 for the
    layers with a bias)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(60, 4), torch.randint(0, 2, (60,)))
    _, m, o, _ = _private(
        model=make(), dataset=data, noise="per-layer", loss=nn.CrossEntropyLoss(temperature=0.05)
    )
    assert o.config.num_tensors == tensors and o.config.mechanisms == mechanisms
    plan = o.current_plan()
    worst = 0.0
    for i in range(60):
        o.zero_grad(set_to_none=True)
        x, y = data.tensors[0][i : i + 1] * 10, data.tensors[1][i : i + 1]
        o.loss(m(x), y).backward()
        sq = sum(
            (p.grad.double().norm().item() / plan.stds[name]) ** 2
            for name, p in m.named_parameters()
            if p.grad is not None and name in plan.stds
        )
        worst = max(worst, math.sqrt(sq) * plan.effective_noise_multiplier)
        o._pending.clear()
    assert tight < worst <= 1.0


def _substitution_attacks():
    """Audit findings (session 17): a gradient through a substituted parameter reached the step
    with 25-1000 times the planned sensitivity, and the step accepted it."""
    from torch.func import functional_call, grad, jacrev, vjp

    def vjp_primal(m, o, x, y):  # the primal output of a vjp over the live weight
        w = m[3].weight
        out, _ = vjp(lambda wi: functional_call(m, {"3.weight": wi}, (x,)), w)
        return o.loss(m(x), y) + 1000.0 * out.sum()

    def grad_penalty(m, o, x, y):  # a parameter-gradient penalty through torch.func.grad
        w = m[3].weight
        g = grad(lambda wi: o.loss(functional_call(m, {"3.weight": wi}, (x,)), y))(w)
        return o.loss(m(x), y) + 1000.0 * (g**2).sum()

    def jacobian(m, o, x, y):
        w = m[3].weight
        jac = jacrev(lambda wi: functional_call(m, {"3.weight": wi}, (x,)))(w)
        return o.loss(m(x), y) + 1000.0 * (jac * w).sum()

    def same_bits(m, o, x, y):  # w's bits, 100 times its gradient: plan and snapshots pass
        w = m[3].weight
        return o.loss(
            functional_call(m, {"3.weight": w.detach() + 100 * (w - w.detach())}, (x,)), y
        )

    def scaled(m, o, x, y):
        return o.loss(functional_call(m, {"3.weight": 10.0 * m[3].weight}, (x,)), y)

    return [vjp_primal, grad_penalty, jacobian, same_bits, scaled]


@pytest.mark.parametrize("attack", _substitution_attacks(), ids=lambda f: f.__name__)
def test_a_parameter_substituted_by_a_tensor_requiring_grad_is_refused(attack) -> None:
    _, m, o, _ = _private()
    x, y = _one(0, scale=1.0)
    o.zero_grad(set_to_none=True)
    with pytest.raises(PrivacyContractError, match=r"replaced in this forward|torch.func"):
        attack(m, o, x, y).backward()


def test_detached_substitutes_and_the_diagnostics_still_run() -> None:
    """What the refusal must not catch: a reference forward with detached parameters through
    functional_call, and the torch.func diagnostics (vmap over detached parameters)."""
    from torch.func import functional_call

    from clipless.diagnostics import per_sample_gradients, sensitivity_use

    _, m, o, _ = _private()
    x, y = _data().tensors
    detached = {k: v.detach() for k, v in m.named_parameters()}
    with torch.no_grad():
        assert torch.equal(functional_call(m, detached, (x,)), m(x))
    assert set(per_sample_gradients(m, o.loss, x[:6], y[:6])) == set(dict(m.named_parameters()))
    assert sensitivity_use(o, x[:6], y[:6]).output.samples == 6
    o.zero_grad(set_to_none=True)
    o.loss(m(x[:4]), y[:4]).backward()
    o.step()  # an honest step after all of it


# ---------------------------------------------------------------- audit of session 17, round 2


def _noiseless(monkeypatch) -> None:
    """Draw zero noise, so that what a step applies is exactly the gradient it noised."""
    import clipless.optim.optimizer as optim  # the module whose step draws the noise

    def zero(plan, name, shape, generator, dtype, *, std=None, out=None):
        return torch.zeros(shape, dtype=dtype) if out is None else out.zero_()

    monkeypatch.setattr(optim, "draw_noise", zero)


@pytest.mark.parametrize("how", ["no backward", "numpy view", "restricted backward"])
def test_a_write_into_the_released_gradient_carries_nothing_into_the_next_step(
    monkeypatch, how: str
) -> None:
    """Audit finding: after a step, ``p.grad`` holds the released noisy gradient, recognised by
    its identity and version. A write through ``.data`` or a NumPy view changes neither, and the
    next step noised and applied what was written (3185 times the sensitivity with no backward,
    1593 through a backward restricted to the first layer). The release is now zeroed when it
    is recognised, so the step applies only this batch's gradient."""
    _noiseless(monkeypatch)
    _, m, o, _ = _private(constraint=None)
    x, y = _one(0, scale=1.0)
    o.zero_grad()
    o.loss(m(x), y).backward()
    o.step()
    for p in m.parameters():
        if how == "numpy view":
            p.grad.numpy()[...] = 100.0
        else:
            p.grad.data.fill_(100.0)
    if how == "restricted backward":
        m[1].weight.grad = None
        m[1].bias.grad = None
        torch.autograd.backward(o.loss(m(x), y), inputs=[m[1].weight, m[1].bias])
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    o.step()
    for n, p in m.named_parameters():
        if how == "restricted backward" and n.startswith("1."):
            continue  # this batch's (clipped, scaled) gradient
        assert torch.equal(p.grad, torch.zeros_like(p)), n
        assert torch.equal(p.detach(), before[n]), n


def test_a_parameter_hook_registered_after_the_forward_is_refused_in_the_backward() -> None:
    """Audit finding: parameter hooks were checked at the forward only; one registered between
    the forward and the backward (removed before the step) scaled the gradient 100 times."""
    _, m, o, _ = _private()
    x, y = _one(0, scale=1.0)
    out = m(x)
    handle = m[3].weight.register_hook(lambda g: 100 * g)
    with pytest.raises(PrivacyContractError, match="gradient hook that clipless did not place"):
        o.loss(out, y).backward()
    handle.remove()


def test_the_guarded_output_is_not_a_view_of_the_unguarded_one() -> None:
    """Audit finding: the guard returned a view, whose ``_base`` was the unguarded output; a
    loss on ``out._base`` reached the parameters unclipped (3292 times the sensitivity)."""
    _, m, o, _ = _private()  # o stays referenced: its hooks hold it weakly
    out = m(_one(0, scale=1.0)[0])
    assert o.config.num_tensors == 4
    assert type(out.grad_fn).__name__ == "_OutputMarkBackward"  # the guard ran
    assert out._base is None
    out /= 2.0  # in-place arithmetic on the output works (it failed on the view)


def test_live_parameters_swapped_between_layers_are_refused() -> None:
    """Audit finding: under per-layer noise each noised tensor draws the noise of its
    make_private name; swapping same-shaped live parameters between layers gave one of them
    another's (100 times smaller) noise: 421 times its sensitivity."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.InputNorm(1.0), nn.Linear(4, 4), nn.GroupSort(2), nn.Linear(4, 4), nn.Linear(4, 2)
    )
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    _, m, o, _ = _private(model=model, dataset=data, noise="per-layer")
    m[1].bias, m[3].bias = m[3].bias, m[1].bias
    with pytest.raises(PrivacyContractError, match="moved to another place"):
        m(data.tensors[0][:1])
    assert o.config.noise == "per-layer"  # o stays referenced: its hooks hold it weakly
