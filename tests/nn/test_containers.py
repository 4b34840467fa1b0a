from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

from clipless.nn import (
    Conv2d,
    Flatten,
    GroupNorm,
    GroupSort,
    InputNorm,
    Linear,
    LipschitzModule,
    ReLU,
    Residual,
    Sequential,
    Sigmoid,
    Tanh,
)

from ._helpers import jacobian_norm, sample_norms, with_norms


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.7)


def _layers(model: Sequential) -> list[LipschitzModule]:
    layers = list(model)
    assert all(isinstance(m, LipschitzModule) for m in layers)
    return [m for m in layers if isinstance(m, LipschitzModule)]


def _model() -> Sequential:
    model = Sequential(
        Conv2d(2, 4, 3, padding=1, bias=True),
        GroupSort(2),
        Residual(Sequential(Conv2d(4, 4, 3, padding=1, padding_mode="circular"), Tanh())),
        GroupNorm(2, 4, alpha=0.5),
        Flatten(),
        Linear(4 * 5 * 5, 6),
        Residual(Sequential(Linear(6, 6), ReLU()), mode="average"),
        Sigmoid(),
    ).double()
    _randomise(model, 0)
    return model


def test_lipschitz_is_product_and_bounds_jacobian() -> None:
    model = _model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 5, generator=gen, dtype=torch.float64)
    model(x[None])  # records input sizes
    expected = math.prod(m.lipschitz() for m in _layers(model))
    assert model.lipschitz() == pytest.approx(expected, rel=1e-15)
    for scale in (0.01, 1.0, 10.0):
        assert jacobian_norm(model, scale * x) <= model.lipschitz()
    # pairs
    xs = torch.randn(64, 2, 5, 5, generator=gen, dtype=torch.float64)
    ys = xs + 0.1 * torch.randn(xs.shape, generator=gen, dtype=torch.float64)
    ratio = sample_norms(model(xs) - model(ys)) / sample_norms(xs - ys)
    assert float(ratio.max()) <= model.lipschitz()


@pytest.mark.parametrize("x_bound", [0.0, 1.0, 100.0, 1e6])
def test_output_bound_composes(x_bound: float) -> None:
    model = _model()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 2, 5, 5, generator=gen, dtype=torch.float64)
    x = with_norms(x, x_bound) if x_bound > 0 else torch.zeros_like(x)
    out = model(x)
    bound = x_bound
    for layer in _layers(model):
        bound = layer.output_bound(bound)
    assert model.output_bound(x_bound) == bound
    assert float(sample_norms(out).max()) <= bound


def test_input_norm_makes_output_bound_data_free() -> None:
    model = Sequential(InputNorm(2.0), Linear(3, 3, bias=False))
    assert model.output_bound(math.inf) == pytest.approx(2.0, rel=1e-6)


def test_ordered_dict_indexing_and_slicing() -> None:
    model = Sequential(OrderedDict([("fc", Linear(3, 4)), ("act", ReLU()), ("out", Linear(4, 2))]))
    assert isinstance(model.fc, Linear)
    head = model[:2]
    assert isinstance(head, Sequential)
    assert list(dict(head.named_children())) == ["fc", "act"]
    assert Sequential().lipschitz() == 1.0
    assert Sequential().output_bound(3.0) == 3.0


def test_rejects_non_clipless_modules() -> None:
    with pytest.raises(TypeError) as info:
        Sequential(Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 3))
    message = str(info.value)
    assert "'1' (torch.nn.BatchNorm1d)" in message
    assert "'2' (torch.nn.Linear): use clipless.nn.Linear" in message
    model = Sequential(Linear(3, 3))
    with pytest.raises(TypeError, match="module"):
        model.append(torch.nn.ReLU())
    with pytest.raises(TypeError, match="module"):
        model.insert(0, torch.nn.Dropout())
    with pytest.raises(TypeError, match="module"):
        model[0] = torch.nn.Linear(3, 3)
    model.append(ReLU())
    assert len(model) == 2


def test_residual_modes() -> None:
    torch.manual_seed(3)
    branch = Sequential(Linear(4, 4), Tanh()).double()
    _randomise(branch, 4)
    add = Residual(branch)
    avg = Residual(branch, mode="average")
    lb = branch.lipschitz()
    assert add.lipschitz() == pytest.approx(1 + lb)
    assert avg.lipschitz() == pytest.approx((1 + lb) / 2)
    assert add.scale == 1.0 and avg.scale == 0.5
    x = torch.randn(4, dtype=torch.float64)
    for layer in (add, avg):
        assert jacobian_norm(layer, x) <= layer.lipschitz()
        xs = with_norms(torch.randn(128, 4, dtype=torch.float64), 5.0)
        assert float(sample_norms(layer(xs)).max()) <= layer.output_bound(5.0)
    torch.testing.assert_close(avg(x[None]), (x[None] + branch(x[None])) / 2)
    # a 1-Lipschitz branch in "average" mode stays 1-Lipschitz
    gnp = Residual(Sequential(Linear(4, 4, bias=False), GroupSort()), mode="average")
    assert gnp.lipschitz() == pytest.approx(1.0, rel=1e-6)


def test_residual_arguments() -> None:
    with pytest.raises(TypeError, match="branch"):
        Residual(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="mode"):
        Residual(ReLU(), mode="concat")
    with pytest.raises(TypeError, match=r"'branch\.0'"):
        Residual(_BadContainer())
    with pytest.raises(ValueError, match="shape"):
        Residual(Linear(3, 2))(torch.zeros(1, 3))


class _BadContainer(ReLU):
    """A clipless module that smuggles a plain torch layer inside."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("0", torch.nn.Linear(2, 2))
