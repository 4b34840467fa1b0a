from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import clipless.nn as cnn
from clipless.nn import vanilla_export
from clipless.nn.export import PlainResidual


def _full_model() -> cnn.Sequential:
    torch.manual_seed(0)
    model = cnn.Sequential(
        OrderedDict(
            [
                ("input", cnn.InputNorm(5.0)),
                ("conv1", cnn.Conv2d(3, 8, 3, padding=1, padding_mode="circular", bias=True)),
                ("sort", cnn.GroupSort(2)),
                ("norm", cnn.GroupNorm(4, 8, alpha=0.3)),
                ("pool", cnn.L2NormPool2d(2)),
                (
                    "block",
                    cnn.Residual(
                        cnn.Sequential(cnn.Conv2d(8, 8, 3, padding=1, stride=1), cnn.Abs()),
                        mode="average",
                    ),
                ),
                ("avg", cnn.AvgPool2d((1, 2))),
                ("flat", cnn.Flatten()),
                ("fc1", cnn.Linear(8 * 4 * 2, 16)),
                ("tanh", cnn.Tanh()),
                ("fc2", cnn.Linear(16, 16, bias=False)),
                ("relu", cnn.ReLU()),
                ("sort3", cnn.GroupSort(4)),
                ("fc3", cnn.Linear(16, 5)),
                ("sigmoid", cnn.Sigmoid()),
                ("clip", cnn.LossGradientClip(1.0)),
            ]
        )
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def test_export_is_plain_and_equivalent() -> None:
    model = _full_model()
    x = torch.randn(7, 3, 8, 8) * 3
    expected = model(x)
    plain = vanilla_export(model)
    assert isinstance(plain, torch.nn.Sequential)
    assert list(dict(plain.named_children())) == list(dict(model.named_children()))
    for name, module in plain.named_modules():
        assert not isinstance(module, cnn.LipschitzModule), name
    assert isinstance(plain.conv1, torch.nn.Conv2d) and plain.conv1.padding_mode == "circular"
    assert isinstance(plain.fc1, torch.nn.Linear)
    assert isinstance(plain.block, PlainResidual)
    assert isinstance(plain.pool, torch.nn.LPPool2d)
    torch.testing.assert_close(plain(x), expected)
    # weights are copies: training the clipless model further does not touch the export
    fc3 = model.get_submodule("fc3")
    assert isinstance(fc3, cnn.Linear)
    with torch.no_grad():
        fc3.weight.mul_(3.0)
    torch.testing.assert_close(plain(x), expected)
    assert not torch.allclose(model(x), expected)


def test_export_of_wrapper_and_training_flag() -> None:
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = cnn.Sequential(cnn.Linear(4, 4), cnn.GroupSort())
            self.head = cnn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x) + x)

    model = Wrapper().eval()
    x = torch.randn(3, 4)
    plain = vanilla_export(model)
    assert type(plain) is Wrapper and not plain.training
    assert isinstance(plain.head, torch.nn.Linear)
    assert isinstance(model.head, cnn.Linear)  # original untouched
    torch.testing.assert_close(plain(x), model(x))


def test_export_rejects_unexportable() -> None:
    class Custom(cnn.LipschitzModule):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

        def lipschitz(self) -> float:
            return 1.0

    with pytest.raises(TypeError, match="vanilla_export"):
        vanilla_export(cnn.Sequential(Custom()))
    with pytest.raises(TypeError, match="model"):
        vanilla_export(42)  # type: ignore[arg-type]


def test_a_child_registered_twice_is_exported_everywhere() -> None:
    """Audit finding: ``named_children()`` lists a module registered under two names once, so a
    wrapper's second name kept a clipless layer in the "plain" export."""

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = cnn.Linear(3, 3)
            self.b = self.a

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    model = Wrapper()
    exported = cnn.vanilla_export(model)
    assert not any(isinstance(m, cnn.LipschitzModule) for m in exported.modules())
    assert exported.a is exported.b  # still one shared layer
    x = torch.randn(5, 3)
    torch.testing.assert_close(exported(x), model(x), rtol=0, atol=0)
