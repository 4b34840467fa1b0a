from __future__ import annotations

import pytest
import torch

import clipless.nn as cnn
from clipless.nn import validate


class Wrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = cnn.Sequential(cnn.Flatten(), cnn.Linear(8, 10))
        self.drop = torch.nn.Dropout(0.5)
        self.softmax = torch.nn.Softmax(dim=1)


def test_lists_every_offending_path_once() -> None:
    with pytest.raises(TypeError) as info:
        validate(Wrapper())
    message = str(info.value)
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(lines) == 8
    assert message.startswith("8 modules have no certified Lipschitz bound")
    expected = [
        ("<root>", f"({Wrapper.__module__}.Wrapper)", "no clipless replacement"),
        ("'features'", "(torch.nn.Sequential)", "use clipless.nn.Sequential"),
        ("'features.0'", "(torch.nn.Conv2d)", "use clipless.nn.Conv2d"),
        ("'features.1'", "(torch.nn.BatchNorm2d)", "use clipless.nn.GroupNorm"),
        ("'features.2'", "(torch.nn.ReLU)", "use clipless.nn.ReLU"),
        ("'features.3'", "(torch.nn.MaxPool2d)", "use clipless.nn.MaxPool2d"),
        ("'drop'", "(torch.nn.Dropout)", "remove it"),
        ("'softmax'", "(torch.nn.Softmax)", "put it in the loss"),
    ]
    for path, type_name, advice in expected:
        assert any(
            line.startswith(f"  - {path} {type_name}: ") and advice in line for line in lines
        ), (path, message)
    assert not any("'head" in line for line in lines)


@pytest.mark.parametrize(
    ("module", "advice"),
    [
        (torch.nn.Linear(2, 2), "clipless.nn.Linear"),
        (torch.nn.LayerNorm(4), "clipless.nn.GroupNorm"),
        (torch.nn.GroupNorm(2, 4), "clipless.nn.GroupNorm"),
        (torch.nn.AvgPool2d(2), "clipless.nn.AvgPool2d"),
        (torch.nn.GELU(), "clipless.nn.GroupSort"),
        (torch.nn.LogSoftmax(dim=1), "put it in the loss"),
        (torch.nn.CrossEntropyLoss(), "losses do not belong in the model"),
        (torch.nn.LSTM(2, 2), "no certified recurrent layer"),
        (torch.nn.Embedding(5, 2), "one-hot"),
        (torch.nn.MultiheadAttention(4, 2), "no certified attention"),
    ],
)
def test_suggestions(module: torch.nn.Module, advice: str) -> None:
    with pytest.raises(TypeError, match=advice):
        validate(_wrap(module))


def _wrap(module: torch.nn.Module) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.add_module("inner", module)
    return holder


class Scaled(cnn.LipschitzModule):
    """A custom clipless module with a trainable parameter but no gradient bound."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def lipschitz(self) -> float:
        return float(self.scale.abs())


def test_parameters_without_gradient_bound_are_rejected() -> None:
    with pytest.raises(TypeError, match=r"'1'.*trainable parameters"):
        validate(cnn.Sequential(cnn.ReLU(), Scaled()))
    frozen = Scaled().requires_grad_(False)
    validate(cnn.Sequential(cnn.ReLU(), frozen))  # frozen parameters are public constants


def test_clean_model_passes() -> None:
    model = cnn.Sequential(
        cnn.InputNorm(1.0),
        cnn.Conv2d(3, 4, 3),
        cnn.GroupSort(),
        cnn.GroupNorm(2, 4),
        cnn.L2NormPool2d(2),
        cnn.Residual(cnn.Sequential(cnn.Conv2d(4, 4, 1), cnn.Abs()), mode="average"),
        cnn.AvgPool2d(1),
        cnn.Flatten(),
        cnn.Linear(4, 2),
        cnn.Tanh(),
        cnn.Sigmoid(),
        cnn.ReLU(),
        cnn.LossGradientClip(1.0),
    )
    validate(model)


def test_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match="module"):
        validate("model")  # type: ignore[arg-type]


def test_foreign_hooks_are_reported() -> None:
    """A forward hook ``o * 10`` on the last layer made every gradient 10x the bound that
    ``clipless.bounds.sensitivities`` certified (measured 14.14 for 1.41 with torch.func); the
    private optimizer refused it at the step, but ``validate`` and the bounds accepted it."""
    import torch

    from clipless import bounds

    model = cnn.Sequential(
        cnn.InputNorm(1.0), cnn.Linear(4, 4, bias=False), cnn.GroupSort(2), cnn.Linear(4, 2)
    )
    handle = model[3].register_forward_hook(lambda module, args, out: out * 10)
    with pytest.raises(TypeError, match=r"'3' .*forward hook"):
        cnn.validate(model)
    with pytest.raises(TypeError, match="forward hook"):
        bounds.sensitivities(model, cnn.CrossEntropyLoss(), (4,))
    handle.remove()
    model[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    with pytest.raises(TypeError, match=r"'1' .*forward-pre hook"):
        cnn.validate(model)
    assert torch.is_tensor(model(torch.zeros(1, 4)))
