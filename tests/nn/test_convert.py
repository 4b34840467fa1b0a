"""clipless.nn.convert: torch model -> clipless twin and report (ModuleValidator.fix)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import clipless.nn as cnn
from clipless import bounds


def _inside_ball(shape: tuple[int, ...], radius: float, seed: int = 0) -> torch.Tensor:
    """Samples of norm at most radius / 2 (well inside the InputNorm ball)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    norms = x.flatten(1).norm(dim=1).clamp_min(1e-12)
    scale = torch.rand(shape[0], generator=torch.Generator().manual_seed(seed + 1)) * radius / 2
    return x * (scale / norms).reshape(-1, *([1] * (len(shape) - 1)))


class SmallCNN(nn.Module):
    """torchvision-style: conv -> BN -> ReLU -> max-pool blocks, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Flatten(), nn.Linear(16 * 2 * 2, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int = 8, width: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.fc1 = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.fc2(self.act(self.fc1(h)))
        return self.out(h)


def _check_certifiable(model: nn.Module, input_shape: tuple[int, ...]) -> None:
    cnn.validate(model)
    rep = bounds.report(model, cnn.CrossEntropyLoss(), input_shape)
    sens = rep.sensitivities()
    assert set(sens) == {name for name, _ in model.named_parameters()}


def test_small_cnn_converts_with_substitutions() -> None:
    model = SmallCNN()
    converted, report = cnn.convert(model, input_norm=5.0)
    assert isinstance(converted, cnn.Sequential)
    assert isinstance(converted[0], cnn.InputNorm)
    assert converted[0].max_norm == 5.0
    _check_certifiable(converted, (3, 8, 8))
    assert report.ok
    assert not report.exact
    kinds = {(e.path, e.kind) for e in report.entries}
    assert ("features.1", "substituted") in kinds  # BatchNorm2d
    assert ("features.3", "substituted") in kinds  # MaxPool2d
    assert ("classifier.0", "removed") in kinds  # Dropout
    assert ("features.0", "twin") in kinds
    by_path = {e.path: e for e in report.entries}
    assert "GroupNorm" in str(by_path["features.1"].replacement)
    assert "mix the samples" in by_path["features.1"].reason
    assert "L2NormPool2d" in str(by_path["features.7"].replacement)
    assert "bias" in by_path["features.4"].reason  # the conv bias note
    assert by_path[""].kind == "inserted"
    assert not any(isinstance(m, nn.Dropout) for m in converted.modules())
    # the twins carry the original weights
    conv = converted.get_submodule("features.0")
    assert isinstance(conv, cnn.Conv2d)
    assert torch.equal(conv.weight, model.features[0].weight)
    assert conv.weight is not model.features[0].weight
    out = converted(torch.randn(4, 3, 8, 8))
    assert out.shape == (4, 10)


def test_residual_mlp_custom_module_is_exact() -> None:
    torch.manual_seed(0)
    model = ResidualMLP().eval()
    converted, report = cnn.convert(model, input_norm=3.0)
    assert report.exact
    residuals = [m for m in converted.modules() if isinstance(m, cnn.Residual)]
    assert len(residuals) == 1 and residuals[0].mode == "add"
    _check_certifiable(converted, (8,))
    x = _inside_ball((32, 8), 3.0)
    assert torch.equal(converted(x), model(x))
    # outside the ball the InputNorm projects: the function differs (and is certified)
    big = 100 * torch.randn(4, 8)
    assert not torch.allclose(converted(big), model(big))


def test_plain_sequential_is_exact_and_keeps_parameter_names() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 4), nn.Sigmoid()
    )
    converted, report = cnn.convert(model, input_norm=2.0)
    assert report.exact
    assert all(e.kind in ("twin", "inserted") for e in report.entries)
    original = dict(model.named_parameters())
    for name, param in converted.named_parameters():
        assert torch.equal(param, original[name])
    x = _inside_ball((16, 6), 2.0)
    assert torch.equal(converted(x), model(x))
    _check_certifiable(converted, (6,))


class AveragedFunctional(nn.Module):
    """Function calls instead of modules, and an averaged skip."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding="same")
        self.block = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular", bias=False)
        self.head = nn.Linear(4 * 2 * 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))
        h = (h + torch.tanh(self.block(h))) / 2
        h = F.avg_pool2d(h, 2)
        h = h.view(h.size(0), -1)
        return self.head(h)


def test_functional_forward_and_average_skip() -> None:
    torch.manual_seed(2)
    model = AveragedFunctional().eval()
    converted, report = cnn.convert(model, input_norm=4.0)
    assert report.exact, str(report)
    residuals = [m for m in converted.modules() if isinstance(m, cnn.Residual)]
    assert len(residuals) == 1 and residuals[0].mode == "average"
    nodes = {e.node for e in report.entries if e.node is not None}
    assert {"relu", "tanh", "avg_pool2d", "view"} <= nodes
    x = _inside_ball((8, 1, 4, 4), 4.0)
    torch.testing.assert_close(converted(x), model(x), rtol=1e-6, atol=1e-6)
    _check_certifiable(converted, (1, 4, 4))


class Concat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.a(x), self.b(x)], dim=1))


def test_concatenation_is_reported_with_its_node() -> None:
    with pytest.raises(TypeError, match="'cat'") as info:
        cnn.convert(Concat(), input_norm=1.0)
    assert "concatenat" in str(info.value)
    converted, report = cnn.convert(Concat(), input_norm=1.0, strict=False)
    (entry,) = report.unconvertible
    assert entry.node == "cat"
    assert entry.replacement is None
    assert entry.original == "call_function torch.cat" and entry.path == ""
    assert entry.blocker == "operation"
    assert not report.ok
    with pytest.raises(TypeError):
        cnn.validate(converted)
    x = torch.randn(3, 4) / 10
    assert converted(x).shape == (3, 2)  # the partial conversion still runs


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * torch.sigmoid(h)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return x


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


class NestedSkips(nn.Module):
    """h + (h + relu(h)), with a dead computation: nested Residual blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mean()  # dead code
        y = h + torch.relu(h)
        return y + h


@pytest.mark.parametrize(
    ("model", "node", "words"),
    [
        (Gated(), "mul", "multiplies two activations"),
        (TwoBranches(), "add", "neither of which"),
    ],
    ids=["product", "two-branches"],
)
def test_unconvertible_graphs(model: nn.Module, node: str, words: str) -> None:
    _, report = cnn.convert(model, input_norm=1.0, strict=False)
    (entry,) = report.unconvertible
    assert entry.node == node
    assert words in entry.reason


def test_nested_skips() -> None:
    model = NestedSkips()
    converted, report = cnn.convert(model, input_norm=1.0)
    assert report.exact
    assert sum(isinstance(m, cnn.Residual) for m in converted.modules()) == 2
    x = _inside_ball((6, 4), 1.0)
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-6)
    _check_certifiable(converted, (4,))


def test_data_dependent_control_flow() -> None:
    _, report = cnn.convert(Branchy(), input_norm=1.0, strict=False)
    (entry,) = report.unconvertible
    assert "symbolic_trace failed" in entry.reason
    assert "control flow" in entry.reason


def test_every_unconvertible_module_listed_at_once() -> None:
    model = nn.Sequential(
        nn.Linear(4, 8),
        nn.GELU(),
        nn.Unflatten(1, (1, 8)),
        nn.Conv1d(1, 2, 3, dilation=2),
        nn.Flatten(),
        nn.Linear(12, 2),
    )
    with pytest.raises(TypeError) as info:
        cnn.convert(model, input_norm=1.0)
    message = str(info.value)
    assert "3 modules or operations" in message
    for path in ("'1'", "'2'", "'3'"):
        assert path in message
    assert "GroupSort" in message  # the advice of clipless.nn.validate


def test_conv_options() -> None:
    _, report = cnn.convert(nn.Conv2d(4, 4, 3, groups=2), input_norm=1.0, strict=False)
    assert "groups=2" in report.unconvertible[0].reason
    _, report = cnn.convert(nn.Conv2d(1, 1, 3, dilation=2), input_norm=1.0, strict=False)
    assert "dilation" in report.unconvertible[0].reason
    _, report = cnn.convert(
        nn.Conv2d(1, 1, 3, padding_mode="reflect"), input_norm=1.0, strict=False
    )
    assert "padding_mode" in report.unconvertible[0].reason
    _, report = cnn.convert(nn.MaxPool2d(3, stride=2, dilation=2), input_norm=1.0, strict=False)
    assert "dilation" in report.unconvertible[0].reason
    _, report = cnn.convert(nn.AvgPool2d(2, stride=1), input_norm=1.0, strict=False)
    assert report.exact and "Lipschitz 1" in report.entries[-1].reason  # sqrt(4 windows / 4)
    _, report = cnn.convert(
        nn.AvgPool2d(3, 1, 1, count_include_pad=False), input_norm=1.0, strict=False
    )
    assert "count_include_pad=False" in report.unconvertible[0].reason
    conv = nn.Conv2d(2, 3, (3, 5), stride=2, padding=(1, 2))
    converted, report = cnn.convert(conv, input_norm=10.0)
    assert report.exact
    x = _inside_ball((2, 2, 9, 9), 10.0)
    torch.testing.assert_close(converted(x), conv(x), rtol=1e-6, atol=1e-6)


def test_norm_substitutions() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.LayerNorm(6), nn.Linear(6, 2))
    converted, report = cnn.convert(model, input_norm=1.0)
    norms = [m for m in converted.modules() if isinstance(m, cnn.GroupNorm)]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(1, 6), (1, 6)]
    assert len(report.substitutions) == 2
    _check_certifiable(converted, (4,))
    _, report = cnn.convert(nn.BatchNorm2d(48), input_norm=1.0)
    assert "GroupNorm(24, 48" in str(report.substitutions[0].replacement)


def test_input_norm_argument() -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(ValueError, match="input_norm") as info:
        cnn.convert(model)
    assert "InputNorm" in str(info.value)
    with pytest.raises(ValueError, match="input_norm"):
        cnn.convert(model, input_norm=0.0)
    already = nn.Sequential(cnn.InputNorm(2.0), nn.Linear(4, 2))
    converted, report = cnn.convert(already)
    assert isinstance(converted[0], cnn.InputNorm) and converted[0].max_norm == 2.0
    assert not any(e.kind == "inserted" for e in report.entries)
    assert sum(isinstance(m, cnn.InputNorm) for m in converted.modules()) == 1
    cnn.convert(already, input_norm=2.0)
    with pytest.raises(ValueError, match="contradicts"):
        cnn.convert(already, input_norm=3.0)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        cnn.convert("model", input_norm=1.0)  # type: ignore[arg-type]


def test_original_untouched_and_report_frozen() -> None:
    model = ResidualMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted, report = cnn.convert(model, input_norm=1.0)
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(1.0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.entries = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.entries[0].reason = "x"  # type: ignore[misc]
    assert "ConversionReport" in str(report)
    assert converted.training == model.training


class SharedActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc2(self.act(self.fc1(x))))


def test_module_called_twice() -> None:
    model = SharedActivation()
    converted, report = cnn.convert(model, input_norm=1.0)
    x = _inside_ball((5, 4), 1.0)
    assert torch.equal(converted(x), model(x))
    assert sum(e.path == "act" for e in report.entries) == 1
    _check_certifiable(converted, (4,))


def test_already_clipless_modules_are_kept() -> None:
    model = nn.Sequential(cnn.Linear(4, 4), nn.ReLU(), cnn.GroupSort(2), nn.Linear(4, 2))
    converted, report = cnn.convert(model, input_norm=1.0)
    assert isinstance(converted[1], cnn.Linear)
    assert isinstance(converted[3], cnn.GroupSort)
    assert len(report.entries) == 3  # InputNorm inserted, ReLU and the torch Linear
    _check_certifiable(converted, (4,))


# --------------------------------------------------------------------------- audit findings
# Each model below was accepted with ``report.exact`` although the converted model computed a
# different function (in-place operations, training-mode branches, F.dropout's default, view(-1,
# n), hooks), or crashed convert (sizes read from tensors). Not a privacy defect (the bounds are
# those of the converted model), but "exact" was false.
class _Chain(nn.Module):
    def __init__(self, body: str) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.body = body
        self.relu_ip = nn.ReLU(inplace=True)
        self.ident = nn.Identity()
        self.seq = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.body == "dead-mul_":
            h.mul_(3)
            return self.b(h)
        if self.body == "inplace-relu-reread":
            return self.b(h + F.relu(h, inplace=True))
        if self.body == "relu_-reread":
            y = h.relu_()
            return self.b(h + y)
        if self.body == "view-alias":
            v = h.view(h.size(0), -1)
            v.relu_()
            return self.b(h)
        if self.body == "iadd-skip":
            h += F.relu(self.a(h))
            return self.b(h)
        if self.body == "inplace-relu-last":
            return self.b(F.relu(h, inplace=True))
        if self.body == "training-branch":
            if self.training:
                h = h * 0.5
            return self.b(h)
        if self.body == "dropout-default":
            return self.b(F.dropout(h, 0.5))
        if self.body == "dropout-training":
            return self.b(F.dropout(h, 0.5, self.training))
        if self.body == "batch-size-of-input":
            return self.b(torch.relu(h).view(x.size(0), -1))
        if self.body == "view-minus-one":
            return self.b(h.view(-1, 4))
        if self.body == "iadd-alias":  # h0 is h: += updates it eagerly
            h0 = h
            h += F.relu(self.a(h))
            return self.b(h + h0)
        if self.body == "module-alias":  # Identity returns h itself, then overwritten
            return self.b(h + self.relu_ip(self.ident(h)))
        if self.body == "inplace-sequential":
            return self.b(h + self.seq(h))
        if self.body == "size-after-inplace":
            r = self.relu_ip(h)
            return self.b(r.view(h.size(0), -1))
        if self.body == "inplace-dropout-eval":
            return self.b(h + F.dropout(h, 0.1, self.training, True))
        if self.body == "halved-in-place":
            h = h + F.relu(self.a(h))
            h /= 2
            return self.b(h)
        raise AssertionError(self.body)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("dead-mul_", "in-place operation whose result"),
        ("inplace-relu-reread", "reads afterwards"),
        ("relu_-reread", "reads afterwards"),
        ("view-alias", "in-place operation whose result"),
        ("dropout-default", "training=True"),
        ("iadd-alias", "reads afterwards"),
        ("module-alias", "reads afterwards"),
        ("inplace-sequential", "reads afterwards"),
    ],
)
def test_functions_the_chain_would_change_are_refused(body: str, words: str) -> None:
    _, report = cnn.convert(_Chain(body), input_norm=1.0, strict=False)
    (entry,) = report.unconvertible
    assert words in entry.reason, entry.reason


@pytest.mark.parametrize(
    "body",
    [
        "iadd-skip",
        "inplace-relu-last",
        "training-branch",
        "dropout-training",
        "batch-size-of-input",
        "view-minus-one",
        "size-after-inplace",
        "inplace-dropout-eval",
        "halved-in-place",
    ],
)
def test_converted_in_train_mode_computes_the_eval_function(body: str) -> None:
    model = _Chain(body)
    assert model.training
    converted, report = cnn.convert(model, input_norm=1.0)
    assert model.training and all(m.training for m in model.modules())  # modes restored
    assert report.ok
    x = _inside_ball((6, 4), 1.0)
    model.eval()
    converted.eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(x), model(x.clone()), rtol=0, atol=1e-6)
    _check_certifiable(converted, (4,))


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_hooks_on_traced_through_modules_are_unconvertible() -> None:
    model = _Outer()
    model.inner.register_full_backward_hook(lambda module, gin, gout: None)
    _, report = cnn.convert(model, input_norm=1.0, strict=False)
    (entry,) = report.unconvertible
    assert entry.path == "inner" and "backward hook" in entry.reason


def test_hooked_modules_are_unconvertible() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[2].register_forward_hook(lambda module, args, out: out * 10)
    _, report = cnn.convert(model, input_norm=1.0, strict=False)
    (entry,) = report.unconvertible
    assert entry.path == "2" and "forward hook" in entry.reason


class _SizedPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(self.conv(x), x.size(3)).flatten(1)


def test_sizes_read_from_tensors_are_reported_not_crashed() -> None:
    _, report = cnn.convert(_SizedPool(), input_norm=1.0, strict=False)
    (entry,) = report.unconvertible
    assert entry.node == "avg_pool2d"
    assert "computed from a tensor" in entry.reason


def test_argument_types() -> None:
    import numpy as np

    model = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(TypeError, match="strict must be True or False"):
        cnn.convert(model, input_norm=1.0, strict=None)  # type: ignore[arg-type]
    converted, _ = cnn.convert(model, input_norm=np.float32(2.0))
    assert converted[0].max_norm == 2.0


# every blocker in one error (issue 38: layers first, then operations, then structure)
class CharLSTM(nn.Module):
    """Opacus's char-LSTM classifier (examples/char-lstm-classification.py), with torch's LSTM."""

    def __init__(self, vocab: int = 30, dim: int = 8, hidden: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.out_layer = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embedding(x)
        x, _ = self.lstm(x, hidden)
        x = x[:, -1, :]
        return self.out_layer(x)


def test_char_lstm_lists_every_blocker_in_one_error() -> None:
    with pytest.raises(TypeError) as info:
        cnn.convert(CharLSTM(), input_norm=1.0)
    message = str(info.value)
    assert message.startswith("5 modules or operations")
    lines = message.splitlines()[1:]
    assert len(lines) == 5
    # the real blockers first, each with its reason and the alternative
    assert "'embedding': torch.nn.Embedding" in lines[0] and "one-hot" in lines[0]
    assert "'lstm': torch.nn.LSTM" in lines[1] and "L^T" in lines[1]
    assert all("operator.getitem" in line for line in lines[2:4])
    assert "exactly one input tensor, it uses 2 (x, hidden)" in lines[4]
    _, report = cnn.convert(CharLSTM(), input_norm=1.0, strict=False)
    assert [e.blocker for e in report.unconvertible] == [
        "module",
        "module",
        "operation",
        "operation",
        "structure",
    ]


class _ManyBlockers(nn.Module):
    """A layer, three operations and a value used twice: five blockers of three kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.GELU()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        h = torch.cat([h, F.softplus(h)], dim=1)
        return self.head(h) + self.head(h).softmax(1)


def test_layers_and_operations_listed_together_before_the_structure() -> None:
    _, report = cnn.convert(_ManyBlockers(), input_norm=1.0, strict=False)
    found = [(e.blocker, e.original) for e in report.unconvertible]
    assert found[0] == ("module", "torch.nn.GELU")
    operations = {o for kind, o in found if kind == "operation"}
    assert operations == {
        "call_function torch.cat",
        "call_function torch.nn.functional.softplus",
        "call_method Tensor.softmax",
    }
    assert [kind for kind, _ in found] == ["module"] + ["operation"] * 3 + ["structure"]


class _BranchyLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(self.embedding(x))
        return self.fc(self.embedding(x + 1))


def test_untraceable_forward_still_lists_its_layers() -> None:
    _, report = cnn.convert(_BranchyLSTM(), input_norm=1.0, strict=False)
    first, second = report.unconvertible
    assert (first.path, first.blocker) == ("embedding", "module")
    assert second.blocker == "structure" and "symbolic_trace failed" in second.reason


# certified twins added for issue 38
class SampleConvNet(nn.Module):
    """Opacus's examples/mnist.py model, written here: overlapping max pools and view(-1, N)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))  # [B, 16, 14, 14]
        x = F.max_pool2d(x, 2, 1)  # [B, 16, 13, 13]
        x = F.relu(self.conv2(x))  # [B, 32, 5, 5]
        x = F.max_pool2d(x, 2, 1)  # [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # [B, 512]
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def _jacobian_norm_of(model: nn.Module, x: torch.Tensor) -> float:
    jac = torch.autograd.functional.jacobian(lambda v: model(v[None])[0], x)
    return float(torch.linalg.matrix_norm(jac.reshape(-1, x.numel()), ord=2))


def test_opacus_mnist_model_converts_exactly_and_is_certified() -> None:
    torch.manual_seed(0)
    model = SampleConvNet().double()
    converted, report = cnn.convert(model, input_norm=28.0)
    assert report.exact
    pools = [m for m in converted.modules() if isinstance(m, cnn.MaxPool2d)]
    assert len(pools) == 2 and all(p.lipschitz() == 2.0 for p in pools)  # sqrt(4 windows)
    flat = [m for m in converted.modules() if isinstance(m, cnn.Flatten)]
    assert [f.features for f in flat] == [512]
    model.eval()
    x = _inside_ball((4, 1, 28, 28), 28.0).double()
    torch.testing.assert_close(converted(x), model(x), rtol=1e-10, atol=1e-10)
    _check_certifiable(converted, (1, 28, 28))
    plain = cnn.vanilla_export(converted)
    torch.testing.assert_close(plain(x), model(x), rtol=1e-10, atol=1e-10)
    rep = bounds.report(converted, cnn.CrossEntropyLoss(), (1, 28, 28))
    for i in range(2):  # the certified constant is never below the exact Jacobian norm
        assert _jacobian_norm_of(converted, x[i]) <= rep.model_lipschitz
    with pytest.raises(ValueError, match="move entries between samples"):
        converted(torch.zeros(2, 1, 36, 36, dtype=torch.float64))  # view(-1, 512) mixes


class _Activations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.leaky = nn.LeakyReLU(0.2)
        self.relu6 = nn.ReLU6()
        self.elu = nn.ELU(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.elu(self.relu6(self.leaky(self.a(x))))
        h = F.leaky_relu(h, 0.1)
        h = F.hardtanh(self.b(h), -2.0, 3.0)
        return F.elu(F.relu6(h))


def test_one_lipschitz_activations_convert_to_certified_twins() -> None:
    model = _Activations().double()
    converted, report = cnn.convert(model, input_norm=4.0)
    assert report.exact
    kinds = [type(m).__name__ for m in converted.modules() if not isinstance(m, cnn.Linear)]
    assert kinds.count("LeakyReLU") == 2 and kinds.count("Hardtanh") == 3
    assert kinds.count("ELU") == 2
    x = 5 * _inside_ball((8, 6), 4.0).double()  # norms up to 2 x 5 / 2: the clamps act
    x = x * (4.0 / x.flatten(1).norm(dim=1).clamp_min(4.0))[:, None]
    torch.testing.assert_close(converted(x), model(x), rtol=1e-12, atol=1e-12)
    rep = bounds.report(converted, cnn.CrossEntropyLoss(), (6,))
    for i in range(8):
        assert _jacobian_norm_of(converted, x[i]) <= rep.model_lipschitz
    _, report = cnn.convert(nn.Hardtanh(0.5, 1.0), input_norm=1.0, strict=False)
    assert "does not map 0 to 0" in report.unconvertible[0].reason


def test_conv1d_converts_to_a_one_row_conv2d() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(3, 4, 5, stride=2, padding=2),
        nn.ReLU(),
        nn.Conv1d(4, 2, 3, padding="same", bias=False, padding_mode="circular"),
        nn.Flatten(),
    ).double()
    converted, report = cnn.convert(model, input_norm=3.0)
    assert report.exact
    x = _inside_ball((5, 3, 16), 3.0).double()
    torch.testing.assert_close(converted(x), model(x), rtol=1e-12, atol=1e-12)
    _check_certifiable(converted, (3, 16))
    plain = cnn.vanilla_export(converted)  # a plain torch model for inference
    torch.testing.assert_close(plain(x), model(x), rtol=1e-12, atol=1e-12)
    rep = bounds.report(converted, cnn.CrossEntropyLoss(), (3, 16))
    assert _jacobian_norm_of(model, x[0]) <= rep.model_lipschitz
    # the per-sample gradient of each converted conv stays under its certified bound
    loss = cnn.CrossEntropyLoss(reduction="sum")
    target = torch.tensor([0, 1, 2, 3, 4])
    sens = rep.sensitivities()
    for i in range(5):
        converted.zero_grad()
        loss(converted(x[i : i + 1]), target[i : i + 1]).backward()
        for name, p in converted.named_parameters():
            assert p.grad is not None and float(p.grad.norm()) <= sens[name]
    _, report = cnn.convert(nn.Conv1d(2, 2, 3, groups=2), input_norm=1.0, strict=False)
    assert "groups=2" in report.unconvertible[0].reason


class CharConv(nn.Module):
    """The documented alternative to the char-LSTM: a Conv1d over one-hot characters."""

    def __init__(self, vocab: int = 30, length: int = 12, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(vocab, 16, 3, padding=1, bias=False)
        self.out = nn.Linear(16 * length, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.flatten(F.relu(self.conv(x)), 1))


def test_the_char_lstm_alternative_converts_exactly() -> None:
    torch.manual_seed(0)
    vocab, length = 30, 12
    model = CharConv(vocab, length).double()
    # a one-hot character per position: every sample has norm sqrt(length), a public bound
    converted, report = cnn.convert(model, input_norm=math.sqrt(length))
    assert report.exact
    tokens = torch.randint(0, vocab, (5, length))
    x = F.one_hot(tokens, vocab).transpose(1, 2).double()
    torch.testing.assert_close(converted(x), model(x), rtol=1e-12, atol=1e-12)
    _check_certifiable(converted, (vocab, length))
