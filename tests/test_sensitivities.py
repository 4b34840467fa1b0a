"""Backpropagation for bounds (:func:`clipless.bounds.report` / :func:`sensitivities`).

Reference: exact per-sample gradients (one sample's loss with ``reduction="sum"``, float64,
``torch.func.vmap(grad(...))``) of random small ``clipless.nn`` models, with inputs mostly far
outside the ``InputNorm`` ball; the claimed per-parameter bounds, input bounds ``X_k`` and
cotangent bounds ``G_k`` must never be exceeded. The random-model builder is shared with
``benchmarks/tightness.py``.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, vmap

import clipless.nn as cnn
from clipless.bounds import BoundReport, report, sensitivities
from clipless.constraints import project
from clipless.norms import conv_norm

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _one_thread():
    """Two BLAS threads on a shared, loaded 2-core machine are several times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


RTOL = 1e-9  # float64 forward/backward rounding is ~1e-15 relative; bounds carry 1e-9 margins


class Chooser(Protocol):
    def int(self, lo: int, hi: int) -> int: ...
    def float(self, lo: float, hi: float) -> float: ...
    def choice(self, options: Sequence[T]) -> T: ...


class RandomChooser:
    """:class:`Chooser` backed by :class:`random.Random` (benchmarks)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def float(self, lo: float, hi: float) -> float:
        return self.rng.uniform(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return self.rng.choice(list(options))


class DataChooser:
    """:class:`Chooser` backed by hypothesis's ``st.data()`` (shrinkable)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return int(self.data.draw(st.integers(lo, hi)))

    def float(self, lo: float, hi: float) -> float:
        return float(self.data.draw(st.floats(lo, hi, allow_nan=False, allow_infinity=False)))

    def choice(self, options: Sequence[T]) -> T:
        return self.data.draw(st.sampled_from(list(options)))


@dataclass
class Case:
    model: cnn.Sequential
    loss: cnn.LipschitzLoss
    input_shape: tuple[int, ...]
    x: torch.Tensor
    y: torch.Tensor
    description: str


LOSSES = ("ce", "bce", "hinge", "kr", "hkr", "l1", "huber")


def _activation(ch: Chooser, channels: int) -> cnn.LipschitzModule:
    options = ["relu", "tanh", "sigmoid", "abs"] + (["groupsort"] if channels % 2 == 0 else [])
    name = ch.choice(options)
    if name == "groupsort":
        return cnn.GroupSort(2)
    return {"relu": cnn.ReLU, "tanh": cnn.Tanh, "sigmoid": cnn.Sigmoid, "abs": cnn.Abs}[name]()


def _conv(ch: Chooser, c_in: int, size: tuple[int, int]) -> tuple[cnn.Conv2d, int, tuple[int, int]]:
    c_out = ch.int(1, 4)
    mode = ch.choice(["zeros", "circular"])
    kernel, stride, padding, out = [], [], [], []
    for n in size:
        p = min(ch.int(0, 2), n) if mode == "circular" else ch.int(0, 2)
        k = min(ch.int(1, 4), n + 2 * p)
        s = ch.int(1, 2)
        kernel.append(k)
        stride.append(s)
        padding.append(p)
        out.append((n + 2 * p - k) // s + 1)
    conv = cnn.Conv2d(
        c_in,
        c_out,
        (kernel[0], kernel[1]),
        stride=(stride[0], stride[1]),
        padding=(padding[0], padding[1]),
        padding_mode=mode,
        bias=ch.choice([False, True]),
    )
    return conv, c_out, (out[0], out[1])


def _groupnorm(ch: Chooser, channels: int) -> cnn.GroupNorm:
    groups = ch.choice([g for g in range(1, channels + 1) if channels % g == 0])
    return cnn.GroupNorm(groups, channels, alpha=ch.float(0.3, 2.0))


def build_case(ch: Chooser, batch: int = 3) -> Case:
    """A random small model (conv or dense), loss, inputs (mostly far outside the ball), labels."""
    seed = ch.int(0, 2**31 - 1)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _build(ch, batch)


def _build(ch: Chooser, batch: int) -> Case:
    max_norm = ch.float(0.3, 4.0)
    layers: list[cnn.LipschitzModule] = [
        cnn.InputNorm(max_norm, mode=ch.choice(["ball", "sphere"]))
    ]
    desc = [f"InputNorm({max_norm:.2f})"]
    if ch.choice(["conv", "dense"]) == "conv":
        channels, size = ch.int(1, 3), (ch.int(3, 8), ch.int(3, 8))
        input_shape: tuple[int, ...] = (channels, *size)
        for _ in range(ch.int(1, 3)):
            op = ch.choice(["conv", "conv", "residual", "pool", "norm", "clip"])
            if op == "conv":
                conv, channels, size = _conv(ch, channels, size)
                layers += [conv, _activation(ch, channels)]
            elif op == "residual":
                k = ch.choice([1, 3])
                mode = ch.choice(["zeros", "circular"])
                if mode == "circular" and k // 2 > min(size):
                    mode = "zeros"
                branch: list[cnn.LipschitzModule] = [
                    cnn.Conv2d(
                        channels,
                        channels,
                        k,
                        padding=k // 2,
                        padding_mode=mode,
                        bias=ch.choice([False, True]),
                    ),
                    _activation(ch, channels),
                ]
                if ch.choice([False, True]):
                    branch.append(_groupnorm(ch, channels))
                layers.append(
                    cnn.Residual(cnn.Sequential(*branch), mode=ch.choice(["add", "average"]))
                )
            elif op == "pool" and min(size) >= 2:
                layers.append(ch.choice([cnn.AvgPool2d, cnn.L2NormPool2d])(2))
                size = (size[0] // 2, size[1] // 2)
            elif op == "norm":
                layers.append(_groupnorm(ch, channels))
            elif op == "clip":
                layers.append(cnn.LossGradientClip(ch.float(0.05, 2.0)))
        layers.append(cnn.Flatten())
        features = channels * size[0] * size[1]
    else:
        features = ch.int(1, 10)
        input_shape = (features,)
    for _ in range(ch.int(0, 2)):
        op = ch.choice(["linear", "linear", "residual", "clip", "norm"])
        if op == "linear":
            width = ch.int(1, 8)
            layers += [
                cnn.Linear(features, width, bias=ch.choice([False, True])),
                _activation(ch, width),
            ]
            features = width
        elif op == "residual":
            inner = cnn.Sequential(
                cnn.Linear(features, features, bias=ch.choice([False, True])),
                _activation(ch, features),
            )
            layers.append(cnn.Residual(inner, mode=ch.choice(["add", "average"])))
        elif op == "clip":
            layers.append(cnn.LossGradientClip(ch.float(0.05, 2.0)))
        else:
            layers.append(_groupnorm(ch, features))
    if ch.choice([False, False, True]):  # released centre and whitening: InputNorm's data map
        first = layers[0]
        assert isinstance(first, cnn.InputNorm)
        c = input_shape[0]
        layers[0] = cnn.InputNorm(
            max_norm,
            mode=first.mode,
            center=torch.randn(input_shape, dtype=torch.float64) * ch.float(0.0, 1.0),
            center_noise=1.0,
            whiten=torch.randn(c, c, dtype=torch.float64) * ch.float(0.1, 5.0),
            whiten_noise=1.0,
        )
        desc[0] += " centred, whitened"
    loss_name = ch.choice(LOSSES)
    if loss_name == "ce":
        logits = ch.int(2, 4)
    elif loss_name in ("hinge", "kr", "hkr"):
        logits = ch.choice([1, 2, 3])
    else:
        logits = ch.int(1, 3)
    if ch.choice([False, False, True]):
        layers.append(cnn.LossGradientClip(ch.float(0.05, 2.0)))
    layers.append(cnn.Linear(features, logits, bias=ch.choice([False, True])))
    model = cnn.Sequential(*layers).double()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * ch.float(0.0, 2.0))
            else:
                param.mul_(ch.float(0.3, 3.0))
    loss, y = _loss_and_labels(ch, loss_name, logits, batch)
    scales = torch.tensor([max_norm * ch.choice([0.05, 1.0, 30.0, 1e3]) for _ in range(batch)])
    x = torch.randn(batch, *input_shape, dtype=torch.float64)
    x = x / torch.linalg.vector_norm(x.reshape(batch, -1), dim=1).reshape(
        -1, *[1] * len(input_shape)
    )
    x = x * scales.double().reshape(-1, *[1] * len(input_shape))
    desc += [type(m).__name__ for m in layers[1:]]
    return Case(model, loss, input_shape, x, y, f"{' > '.join(desc)} | {type(loss).__name__}")


def _loss_and_labels(
    ch: Chooser, name: str, logits: int, batch: int
) -> tuple[cnn.LipschitzLoss, torch.Tensor]:
    if name == "ce":
        loss: cnn.LipschitzLoss = cnn.CrossEntropyLoss(
            temperature=ch.float(0.2, 3.0), reduction="sum"
        )
        return loss, torch.randint(0, logits, (batch,))
    if name == "bce":
        return cnn.BCEWithLogitsLoss(reduction="sum"), torch.rand(
            batch, logits, dtype=torch.float64
        )
    if name in ("l1", "huber"):
        target = torch.randn(batch, logits, dtype=torch.float64) * ch.float(0.0, 3.0)
        loss = (
            cnn.L1Loss(reduction="sum")
            if name == "l1"
            else cnn.HuberLoss(delta=ch.float(0.1, 2.0), reduction="sum")
        )
        return loss, target
    if name == "hinge":
        loss = cnn.MulticlassHingeLoss(margin=ch.float(0.0, 2.0), reduction="sum")
    elif name == "kr":
        loss = cnn.KRLoss(reduction="sum")
    else:
        loss = cnn.HKRLoss(alpha=ch.float(0.0, 3.0), margin=ch.float(0.0, 2.0), reduction="sum")
    if logits == 1:
        return loss, torch.randint(0, 2, (batch,)) * 2 - 1
    return loss, torch.randint(0, logits, (batch,))


@dataclass
class Observation:
    """Per-sample maxima observed on one case, next to the bounds."""

    grads: dict[str, float]
    inputs: dict[str, float]
    cotangents: dict[str, float]
    total: float


def observe(case: Case, rep: BoundReport) -> Observation:
    """Exact per-sample gradient norms and the norms of every parametric layer's input/cotangent.

    One batched float64 forward/backward of the summed loss gives, per sample, the input of every
    parametric layer and the cotangent at its output (samples do not interact: every layer and
    loss here acts on each sample separately) and the logit cotangents ``c_i = dl_i/dz_i``. The
    per-sample parameter gradients are then ``vmap(grad(<model(x_i), c_i>))`` (torch.func), the
    exact gradient of ``l_i``: the backward from the logits is the same, clipping layers included.
    """
    model = case.model
    batch = case.x.shape[0]
    params = dict(model.named_parameters())
    # A module used several times is called once per occurrence, in forward order.
    occurrences: dict[int, list[str]] = defaultdict(list)
    for layer in rep.layers:
        occurrences[id(model.get_submodule(layer.path))].append(layer.path)
    calls: dict[int, int] = defaultdict(int)
    inputs: dict[str, float] = {}
    cotangents: dict[str, float] = {}

    def norms(t: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(t.detach().reshape(batch, -1), dim=1).max())

    def pre(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        inputs[occurrences[id(module)][calls[id(module)]]] = norms(args[0])

    def post(module: torch.nn.Module, _args: Any, out: torch.Tensor) -> None:
        path = occurrences[id(module)][calls[id(module)]]
        calls[id(module)] += 1

        def keep(grad: torch.Tensor) -> None:
            cotangents[path] = norms(grad)

        out.register_hook(keep)

    modules = {id(m): m for m in (model.get_submodule(layer.path) for layer in rep.layers)}
    handles = []
    for module in modules.values():
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        logits = model(case.x)
        value = case.loss(logits, case.y)
        logit_grad, *_ = torch.autograd.grad(value, [logits, *params.values()], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()

    def inner(p: dict[str, torch.Tensor], xi: torch.Tensor, ci: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, p, (xi[None],))[0] * ci).sum()

    detached = {name: p.detach() for name, p in params.items()}
    per_sample = vmap(grad(inner), in_dims=(None, 0, 0))(detached, case.x, logit_grad.detach())
    grads: dict[str, float] = {}
    squares = torch.zeros(batch, dtype=torch.float64)
    for name, g in per_sample.items():
        sample_norms = torch.linalg.vector_norm(g.reshape(batch, -1), dim=1)
        grads[name] = float(sample_norms.max())
        squares = squares + sample_norms**2
    return Observation(grads, inputs, cotangents, float(squares.sqrt().max()))


TIGHTNESS: dict[str, list[float]] = defaultdict(list)


def check_case(case: Case) -> None:
    rep = report(case.model, case.loss, case.input_shape)
    sens = sensitivities(case.model, case.loss, case.input_shape)
    assert set(sens) == {name for name, _ in case.model.named_parameters()}
    obs = observe(case, rep)
    for name, bound in sens.items():
        assert obs.grads[name] <= bound * (1 + RTOL), (
            case.description,
            name,
            obs.grads[name],
            bound,
        )
    assert obs.total <= rep.total_sensitivity() * (1 + RTOL)
    for layer in rep.layers:
        assert obs.inputs[layer.path] <= layer.input_bound * (1 + RTOL), (
            case.description,
            layer.path,
        )
        assert obs.cotangents.get(layer.path, 0.0) <= layer.cotangent_bound * (1 + RTOL), (
            case.description,
            layer.path,
        )
        kind = type(case.model.get_submodule(layer.path)).__name__
        for name, bound in layer.gradient_bounds.items():
            if bound > 0:
                TIGHTNESS[f"{kind}.{name.rsplit('.', 1)[-1]}"].append(obs.grads[name] / bound)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_sensitivities_bound_exact_per_sample_gradients(data: Any) -> None:
    """Before and after a projection in each mode (issue A: "before and after project(...)")."""
    case = build_case(DataChooser(data))
    check_case(case)
    mode = data.draw(st.sampled_from(["clip", "fix", "orthogonal"]))
    max_norm = data.draw(st.sampled_from([0.5, 1.0, 3.0]))
    project(case.model, mode=mode, max_norm=max_norm)
    check_case(case)


def test_tightness_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints (max observed per-sample gradient norm) / bound per layer type (random inputs)."""
    if not TIGHTNESS:  # run alone: a seeded sample of cases
        for seed in range(40):
            check_case(build_case(RandomChooser(seed)))
    with capsys.disabled():
        print("\nper-sample gradient norm / certified bound (1 = tight), random models and inputs:")
        for key in sorted(TIGHTNESS):
            values = TIGHTNESS[key]
            med, worst = statistics.median(values), max(values)
            print(f"  {key:14s} n={len(values):4d}  median {med:.3f}  max {worst:.3f}")
    assert all(v <= 1 + RTOL for values in TIGHTNESS.values() for v in values)


# ------------------------------------------------------------------------------ structure


def _mlp(*extra: cnn.LipschitzModule) -> cnn.Sequential:
    torch.manual_seed(0)
    return cnn.Sequential(
        cnn.InputNorm(2.0), cnn.Linear(4, 3), cnn.ReLU(), *extra, cnn.Linear(3, 2)
    )


def test_report_hand_computed_values() -> None:
    torch.manual_seed(0)
    first = cnn.Linear(4, 3, bias=False)
    last = cnn.Linear(3, 2)
    with torch.no_grad():
        first.weight.copy_(torch.tensor([[2.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]))
        last.weight.copy_(torch.tensor([[0.5, 0, 0], [0, 0.5, 0]]))
        last.bias.copy_(torch.tensor([3.0, 4.0]))
    model = cnn.Sequential(cnn.InputNorm(2.0), first, cnn.Tanh(), last)
    rep = report(model, cnn.CrossEntropyLoss(), (4,))
    assert rep.input_bound == 2.0
    assert rep.num_logits == 2
    assert rep.loss_lipschitz == pytest.approx(math.sqrt(2))
    assert [layer.path for layer in rep.layers] == ["1", "3"]
    l1, l3 = rep.layers
    assert l1.input_bound == 2.0
    assert l1.lipschitz == pytest.approx(2.0, rel=1e-8)
    assert l3.input_bound == pytest.approx(4.0, rel=1e-8)  # ||W1|| X_0, tanh keeps it
    assert l3.cotangent_bound == pytest.approx(math.sqrt(2))
    assert l1.cotangent_bound == pytest.approx(
        math.sqrt(2) * 0.5, rel=1e-8
    )  # * Lip(last) * Lip(tanh)
    assert dict(l3.gradient_bounds) == pytest.approx(
        {"3.weight": 4 * math.sqrt(2), "3.bias": math.sqrt(2)}, rel=1e-8
    )
    assert dict(l1.gradient_bounds) == pytest.approx({"1.weight": math.sqrt(2)}, rel=1e-8)
    assert l1.norm_factor_bound == pytest.approx(2.0)
    assert rep.model_lipschitz == pytest.approx(1.0, rel=1e-8)
    with pytest.raises(TypeError):
        l1.gradient_bounds["1.weight"] = 0.0  # type: ignore[index]


def test_loss_gradient_clip_and_residual_rules() -> None:
    """InputNorm(1) > first (I) > Residual(average, [clip(0.25), 3 I]) > head (2 I): by hand."""
    first = cnn.Linear(3, 3, bias=False)
    inner = cnn.Linear(3, 3, bias=False)
    head = cnn.Linear(3, 2, bias=False)
    with torch.no_grad():
        first.weight.copy_(torch.eye(3))
        inner.weight.copy_(3 * torch.eye(3))
        head.weight.copy_(2 * torch.eye(3)[:2])
    residual = cnn.Residual(cnn.Sequential(cnn.LossGradientClip(0.25), inner), mode="average")
    model = cnn.Sequential(cnn.InputNorm(1.0), first, residual, head)
    rep = report(model, cnn.L1Loss(), (3,))
    assert [layer.path for layer in rep.layers] == ["1", "2.branch.1", "3"]
    l_first, l_inner, l_head = rep.layers
    g_head = math.sqrt(2)  # L1 loss on 2 logits
    g_res = 2 * g_head  # below the head (||W|| = 2)
    assert l_head.cotangent_bound == pytest.approx(g_head)
    assert l_head.input_bound == pytest.approx((1 + 3) / 2, rel=1e-8)  # (X + 3X) / 2
    assert l_inner.cotangent_bound == pytest.approx(g_res / 2, rel=1e-8)  # average: G / 2
    assert l_inner.input_bound == pytest.approx(1.0, rel=1e-8)
    # residual input: G/2 (skip) + min(3 G/2, 0.25) (branch, clipped), not G (1 + 3) / 2
    assert l_first.cotangent_bound == pytest.approx(g_res / 2 + 0.25, rel=1e-8)
    assert rep.model_lipschitz == pytest.approx(1 * 2 * 2, rel=1e-8)
    check_case(
        Case(
            model.double(),
            cnn.L1Loss(reduction="sum"),
            (3,),
            torch.randn(5, 3, dtype=torch.float64) * 5,
            torch.randn(5, 2, dtype=torch.float64) * 3,
            "hand",
        )
    )


def test_report_requires_leading_input_norm_and_validates() -> None:
    with pytest.raises(ValueError, match="InputNorm"):
        report(cnn.Sequential(cnn.Linear(3, 2)), cnn.L1Loss(), (3,))
    with pytest.raises(ValueError, match="InputNorm"):
        report(cnn.Sequential(), cnn.L1Loss(), (3,))
    bad = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(3, 2))
    bad.add_module("extra", torch.nn.Dropout())
    with pytest.raises(TypeError, match="Dropout"):
        report(bad, cnn.L1Loss(), (3,))
    with pytest.raises(TypeError, match="lipschitz"):
        report(_mlp(), torch.nn.MSELoss(), (4,))
    with pytest.raises(ValueError, match="input_shape"):
        report(_mlp(), cnn.L1Loss(), (0,))
    nested = cnn.Sequential(cnn.Sequential(cnn.InputNorm(1.5)), cnn.Linear(4, 1))
    assert report(nested, cnn.L1Loss(), (4,)).input_bound == 1.5


def test_sensitivities_cover_every_parameter_and_refuse_hidden_ones() -> None:
    model = _mlp(cnn.Residual(cnn.Sequential(cnn.Linear(3, 3), cnn.Tanh())))
    sens = sensitivities(model, cnn.HuberLoss(), (4,))
    assert list(sens) == [name for name, _ in model.named_parameters()]

    class Hidden(cnn.LipschitzModule):
        def __init__(self) -> None:
            super().__init__()
            self.inner = cnn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

        def lipschitz(self) -> float:
            return self.inner.lipschitz()

    with pytest.raises(ValueError, match=r"parametric layer '3\.inner' \(Linear\) sits inside"):
        sensitivities(_mlp(Hidden()), cnn.L1Loss(), (4,))
    hidden = _mlp(Hidden())
    for p in hidden[3].parameters():
        p.requires_grad_(False)
    assert sensitivities(hidden, cnn.L1Loss(), (4,))["3.inner.weight"] == 0.0


def test_shared_layer_bounds_add_up() -> None:
    torch.manual_seed(1)
    shared = cnn.Linear(3, 3)
    model = cnn.Sequential(
        cnn.InputNorm(1.0), shared, cnn.Tanh(), shared, cnn.Linear(3, 1)
    ).double()
    rep = report(model, cnn.L1Loss(reduction="sum"), (3,))
    assert [layer.path for layer in rep.layers] == ["1", "3", "4"]
    sens = rep.sensitivities()
    assert sens["1.weight"] == pytest.approx(
        rep.layers[0].gradient_bounds["1.weight"] + rep.layers[1].gradient_bounds["1.weight"]
    )
    case = Case(
        model,
        cnn.L1Loss(reduction="sum"),
        (3,),
        torch.randn(4, 3, dtype=torch.float64) * 10,
        torch.randn(4, 1, dtype=torch.float64),
        "shared",
    )
    check_case(case)


def test_conv_layers_get_their_recorded_input_size() -> None:
    torch.manual_seed(2)
    conv = cnn.Conv2d(2, 4, 3, padding=1, padding_mode="circular")
    model = cnn.Sequential(
        cnn.InputNorm(1.0), conv, cnn.ReLU(), cnn.Flatten(), cnn.Linear(4 * 6 * 5, 2)
    )
    rep = report(model, cnn.CrossEntropyLoss(), (2, 6, 5))
    assert conv.input_size == (6, 5)
    assert rep.layers[0].lipschitz == conv.lipschitz(input_size=(6, 5))
    size_free = conv_norm(
        conv.weight, stride=1, padding=1, padding_mode="circular", input_size=None
    )
    assert rep.layers[0].lipschitz < size_free


# --------------------------------------------------------------------------------------------
# Findings of an audit of the layer bounds (each gave a per-sample contribution above the
# planned sensitivity, or a wrong bound, before its fix)
# --------------------------------------------------------------------------------------------


def test_the_leading_input_norm_used_again_is_refused() -> None:
    """The walker took every use of the leading InputNorm as 1-Lipschitz: reused after a layer
    in sphere mode it amplifies by R / ||h|| (580x the planned sensitivity in the audit)."""
    norm = cnn.InputNorm(1.0, "sphere")
    model = cnn.Sequential(norm, cnn.Linear(4, 4, bias=False), norm, cnn.Linear(4, 2, bias=False))
    with pytest.raises(ValueError, match="leading InputNorm is applied more than once"):
        report(model, cnn.CrossEntropyLoss(), (4,))
    other = cnn.Sequential(
        cnn.InputNorm(1.0, "sphere"),
        cnn.Linear(4, 4, bias=False),
        cnn.InputNorm(1.0, "sphere"),
        cnn.Linear(4, 2, bias=False),
    )
    assert report(other, cnn.CrossEntropyLoss(), (4,)).sensitivities()["1.weight"] == math.inf


def test_a_container_with_its_own_forward_is_refused() -> None:
    """A Sequential subclass looping over its children was certified for one pass (3.5x)."""

    class Looped(cnn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(2):
                for module in self:
                    x = module(x)
            return x

    model = cnn.Sequential(
        cnn.InputNorm(1.0),
        cnn.Linear(4, 4, bias=False),
        Looped(cnn.Linear(4, 4, bias=False), cnn.GroupSort(2)),
        cnn.Linear(4, 2, bias=False),
    )
    with pytest.raises(ValueError, match=r"module '2' \(Looped\) overrides the forward"):
        report(model, cnn.CrossEntropyLoss(), (4,))


def test_a_conv_weight_of_another_kernel_size_is_refused() -> None:
    """Bounds read kernel_size, the forward the weight: a 1x1 layer tied to a 3x3 weight was
    certified with k_eff = 1 instead of 9 (1.58x)."""
    a = cnn.Conv2d(1, 1, 3, padding=1)
    b = cnn.Conv2d(1, 1, 1)
    b.weight = a.weight
    model = cnn.Sequential(cnn.InputNorm(1.0), b, cnn.Flatten(), cnn.Linear(16, 2, bias=False))
    with pytest.raises(ValueError, match=r"Conv2d\.weight has shape \(1, 1, 3, 3\)"):
        report(model, cnn.CrossEntropyLoss(), (1, 6, 6))
    with pytest.raises(ValueError, match="declared geometry"):
        b.multiplicity()


@pytest.mark.parametrize("kind", ["sigmoid", "groupnorm"])
def test_a_size_dependent_layer_used_at_two_sizes_is_refused(kind: str) -> None:
    """Sigmoid's and GroupNorm's output bounds use the last forward's number of features: a
    Sigmoid shared between 64 and 2 features bounded the next input by 0.957 (true 4.05)."""
    if kind == "sigmoid":
        shared = cnn.Sigmoid()
        model = cnn.Sequential(
            cnn.InputNorm(1.0),
            cnn.Linear(4, 64, bias=False),
            shared,
            cnn.Linear(64, 2, bias=False),
            shared,
            cnn.Linear(2, 2, bias=False),
        )
        shape: tuple[int, ...] = (4,)
    else:
        shared = cnn.GroupNorm(1, 2)
        model = cnn.Sequential(
            cnn.InputNorm(1.0),
            cnn.Conv2d(1, 2, 3, padding=1),
            shared,
            cnn.Conv2d(2, 2, 2, stride=2),
            shared,
            cnn.Flatten(),
            cnn.Linear(2 * 4 * 4, 2, bias=False),
        )
        shape = (1, 8, 8)
    with pytest.raises(ValueError, match="is applied to inputs of 2 shapes"):
        report(model, cnn.CrossEntropyLoss(), shape)


# --------------------------------------------------------------------------------------------
# Findings of an audit of unusual model structures (sixteenth session): each model was accepted
# and one sample's contribution exceeded the planned sensitivity (ratios measured by the audit
# through the library's own step), or a data-dependent buffer was released without noise
# --------------------------------------------------------------------------------------------


class _Wrap(cnn.LipschitzModule):
    """An honest user leaf: its constant is the certified one of the layer it applies."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def lipschitz(self) -> float:
        return self.inner.lipschitz()


def _around(middle: torch.nn.Module, first: torch.nn.Module | None = None) -> cnn.Sequential:
    torch.manual_seed(0)
    return cnn.Sequential(
        cnn.InputNorm(1.0, mode="sphere"),
        first if first is not None else cnn.Linear(8, 8, bias=False),
        cnn.GroupSort(2),
        middle,
        cnn.GroupSort(2),
        cnn.Linear(8, 2, bias=False),
    )


def test_a_parametric_layer_inside_a_custom_leaf_is_refused() -> None:
    """A Linear tied to the first layer's weight, applied inside a custom leaf: the walk never
    visits it, and no parameter is missing, so its use went uncounted (1.35x at radius 1, 7.37x
    at radius 10, where that use is not scaled either)."""
    first = cnn.Linear(8, 8, bias=False)
    tied = cnn.Linear(8, 8, bias=False)
    tied.weight = first.weight
    with pytest.raises(ValueError, match=r"parametric layer '3\.inner' \(Linear\) sits inside"):
        report(_around(_Wrap(tied), first), cnn.MulticlassHingeLoss(), (8,))


def test_a_custom_leaf_that_uses_a_parameter_is_refused() -> None:
    """The same use written as ``F.linear(x, first.weight)`` in the leaf's forward (1.28x)."""
    first = cnn.Linear(8, 8, bias=False)

    class Functional(cnn.LipschitzModule):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, first.weight)

        def lipschitz(self) -> float:
            return first.lipschitz()

    with pytest.raises(ValueError, match=r"custom module '3' \(Functional\) uses 1 parameter"):
        report(_around(Functional(), first), cnn.MulticlassHingeLoss(), (8,))


def test_an_honest_custom_leaf_is_accepted_and_its_bounds_hold() -> None:
    """The control: a parameter-free custom leaf that keeps one row per sample passes, and the
    certified bounds cover exact per-sample gradients from torch.func."""

    class Half(cnn.LipschitzModule):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 0.5 * torch.flip(x, dims=(1,))

        def lipschitz(self) -> float:
            return 0.5

    model = _around(Half())
    loss = cnn.MulticlassHingeLoss()
    sens = sensitivities(model, loss, (8,))
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    y = torch.arange(64) % 2

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    for name, g in grads.items():
        worst = float(g.double().flatten(1).norm(dim=1).max())
        assert 0.0 < worst <= sens[name]


def test_a_container_subclass_with_a_skip_is_refused() -> None:
    """``x + super().forward(x)`` keeps every call count, so the count check passed it (1.24x);
    a forward applying the children in another order gave 28.3x."""

    class Skip(cnn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + super().forward(x)

    with pytest.raises(ValueError, match=r"module '3' \(Skip\) overrides the forward"):
        report(_around(Skip(cnn.Linear(8, 8, bias=False))), cnn.CrossEntropyLoss(), (8,))


@pytest.mark.parametrize("how", ["fold", "merge"])
def test_a_leaf_that_changes_the_rows_per_sample_is_refused(how: str) -> None:
    """A leaf folding 16 positions of a sample into 16 rows: the next Linear bounded each row,
    so one sample contributed sqrt(16) = 4x its sensitivity (3.999 measured); merging the
    samples of a batch into one row breaks the same per-row argument."""

    class Reshape(cnn.LipschitzModule):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.width = width

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, self.width)

        def lipschitz(self) -> float:
            return 1.0

    if how == "fold":
        model = cnn.Sequential(
            cnn.InputNorm(1.0),
            Reshape(4),
            cnn.Linear(4, 4, bias=False),
            Reshape(64),
            cnn.Linear(64, 2, bias=False),
        )
        match = r"module '2' \(Linear\) received 32 row\(s\) for a batch of 2"
    else:
        model = cnn.Sequential(cnn.InputNorm(1.0), Reshape(128), cnn.Linear(128, 2, bias=False))
        match = r"module '2' \(Linear\) received 1 row\(s\) for a batch of 2"
    with pytest.raises(ValueError, match=match):
        report(model, cnn.CrossEntropyLoss(), (64,))


class _RunningCentre(cnn.LipschitzModule):
    """A running mean updated from the batch, the ways user code writes it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        if how == "attribute":
            self.running_mean = torch.zeros(8)  # a plain tensor attribute, not a buffer
        else:
            self.register_buffer("running_mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean = x.detach().mean(0)
            if self.how == "in place":
                self.running_mean.lerp_(mean, 0.1)  # bumps the version counter
            elif self.how == "data":
                self.running_mean.data.mul_(0.9).add_(0.1 * mean)  # does not
            else:
                self.running_mean = 0.9 * self.running_mean + 0.1 * mean  # a new tensor
        return x - self.running_mean

    def lipschitz(self) -> float:
        return 1.0


@pytest.mark.parametrize("how", ["in place", "data", "assign", "attribute"])
def test_state_updated_by_the_training_forward_is_refused(how: str) -> None:
    """A running mean updated from the batch: the step was accepted, and the buffer (released
    with the model, without noise) differed between neighbouring datasets by 0.00323 (0.0066
    for the ``.data`` update, which leaves the version counter alone, and for the attribute).
    Zeros leave a zero-initialised mean unchanged: the public random re-run shows it."""
    model = _around(_RunningCentre(how))
    match = (
        r"changes the model's buffer\(s\) \['3\.running_mean'\]"
        if how == "in place"
        else r"custom module '3' \(_RunningCentre\) changes its tensor\(s\) \['running_mean'\]"
    )
    with pytest.raises(ValueError, match=match):
        report(model, cnn.CrossEntropyLoss(), (8,))
    report(model.eval(), cnn.CrossEntropyLoss(), (8,))  # an eval-mode forward leaves it alone


def test_constant_state_made_by_a_custom_leaf_is_accepted() -> None:
    """The control: a constant created on first use, and one re-assigned at every call, are not
    data: both pass."""

    class Constants(cnn.LipschitzModule):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if getattr(self, "scale", None) is None:
                self.register_buffer("scale", torch.full((8,), 0.5))
            self.register_buffer("offset", torch.zeros(8), persistent=False)
            return x * self.scale + self.offset

        def lipschitz(self) -> float:
            return 0.5

    model = _around(Constants())
    for _ in range(2):
        report(model, cnn.CrossEntropyLoss(), (8,))


@pytest.mark.parametrize("holder", ["reference", "child"])
def test_a_leaf_using_a_parameter_only_for_nonzero_inputs_is_refused(holder: str) -> None:
    """A custom leaf with an all-zero fast path applied a visited layer (or a child tied to it)
    only to nonzero inputs: the zero structural forward saw no use (1.28x / 1.35x accepted)."""
    first = cnn.Linear(8, 8, bias=False)

    class Refine(cnn.LipschitzModule):
        def __init__(self) -> None:
            super().__init__()
            self._ref = [first]  # a plain reference, not a child
            if holder == "child":
                self.lin = cnn.Linear(8, 8, bias=False)
                self.lin.weight = first.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not bool(x.any()):
                return x
            return self.lin(x) if holder == "child" else self._ref[0](x)

        def lipschitz(self) -> float:
            return max(1.0, first.lipschitz())

    match = (
        r"custom module '3' \(Refine\) uses 1 parameter"
        if holder == "reference"
        else r"parametric layer '3\.lin' \(Linear\) sits inside"
    )
    with pytest.raises(ValueError, match=match):
        report(_around(Refine(), first), cnn.MulticlassHingeLoss(), (8,))
