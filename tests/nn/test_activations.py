from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clipless.nn import (
    ELU,
    Abs,
    Flatten,
    GroupSort,
    Hardtanh,
    LeakyReLU,
    LipschitzModule,
    ReLU,
    Sigmoid,
    Tanh,
    Unflatten,
)

from ._helpers import jacobian_norm, sample_norms, with_norms

SCALES = [1e-3, 1.0, 10.0]


def _elementwise() -> list[LipschitzModule]:
    return [
        *(ReLU(), Tanh(), Abs(), Sigmoid(), Flatten(), GroupSort(2), GroupSort(3), GroupSort(6)),
        *(LeakyReLU(), LeakyReLU(-0.5), LeakyReLU(2.0), LeakyReLU(-3.0)),
        *(Hardtanh(), Hardtanh(0.0, 6.0), Hardtanh(-0.5, 0.25), ELU(), ELU(0.5)),
    ]


@pytest.mark.parametrize("layer", _elementwise(), ids=lambda m: repr(m))
@pytest.mark.parametrize("scale", SCALES)
def test_jacobian_never_exceeds_lipschitz(layer: LipschitzModule, scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    lip = layer.lipschitz()
    worst = 0.0
    for _ in range(5):
        x = scale * torch.randn(6, 2, 2, generator=gen, dtype=torch.float64)
        worst = max(worst, jacobian_norm(layer, x))
    assert worst <= lip * (1 + 1e-12)
    # tight at small inputs: every one of these layers has a Jacobian of norm Lip near 0
    if scale == 1e-3:
        assert worst >= lip * (1 - 1e-5)


@pytest.mark.parametrize("layer", _elementwise(), ids=lambda m: repr(m))
def test_lipschitz_on_random_pairs(layer: LipschitzModule) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 6, 3, generator=gen, dtype=torch.float64) * 3
    y = x + torch.randn(x.shape, generator=gen, dtype=torch.float64) * 0.5
    ratio = sample_norms(layer(x) - layer(y)) / sample_norms(x - y)
    assert float(ratio.max()) <= layer.lipschitz() * (1 + 1e-12)


@pytest.mark.parametrize("layer", _elementwise(), ids=lambda m: repr(m))
@pytest.mark.parametrize("x_bound", [0.0, 0.5, 30.0, 1e8])
def test_output_bound_holds(layer: LipschitzModule, x_bound: float) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(128, 6, 3, generator=gen, dtype=torch.float64)
    x = with_norms(x, x_bound) if x_bound > 0 else torch.zeros_like(x)
    out = layer(x)
    assert float(sample_norms(out).max()) <= layer.output_bound(x_bound) * (1 + 1e-12)


def test_groupsort_preserves_norm_and_sorts_groups() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 12, 3, 2, generator=gen)
    for size in (1, 2, 3, 4, 12):
        out = GroupSort(size)(x)
        reference = x.reshape(4, 12 // size, size, 3, 2).sort(dim=2).values.reshape(x.shape)
        torch.testing.assert_close(out, reference, rtol=0, atol=0)
        torch.testing.assert_close(sample_norms(out), sample_norms(x))
    assert GroupSort().output_bound(2.5) == 2.5


def test_groupsort_rejects_bad_groups() -> None:
    with pytest.raises(ValueError, match="group_size"):
        GroupSort(0)
    with pytest.raises(ValueError, match="divisible"):
        GroupSort(4)(torch.zeros(2, 6))


def test_sigmoid_output_bound_needs_size() -> None:
    layer = Sigmoid()
    with pytest.raises(RuntimeError, match="forward"):
        layer.output_bound(1.0)
    layer(torch.zeros(3, 5, 2))
    assert layer.sample_numel == 10
    n = 10
    assert layer.output_bound(0.0) == pytest.approx(0.5 * math.sqrt(n))
    assert layer.output_bound(1e9) == pytest.approx(math.sqrt(n))
    assert Sigmoid(num_features=4).output_bound(0.0) == pytest.approx(1.0)
    assert layer.lipschitz() == 0.25
    with pytest.raises(ValueError, match="num_features"):
        Sigmoid(num_features=0)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 20), st.floats(0.0, 50.0))
def test_sigmoid_output_bound_is_attained_near_the_worst_case(n: int, x_bound: float) -> None:
    layer = Sigmoid(num_features=n)
    # the all-equal positive direction is the worst case of sqrt(n)/2 + X/4 for small X
    x = torch.full((1, n), x_bound / math.sqrt(n), dtype=torch.float64)
    norm = float(sample_norms(layer(x))[0])
    assert norm <= layer.output_bound(x_bound) * (1 + 1e-12)


def test_flatten_arguments() -> None:
    x = torch.randn(2, 3, 4, 5)
    assert Flatten()(x).shape == (2, 60)
    assert Flatten(2)(x).shape == (2, 3, 20)
    with pytest.raises(ValueError, match="start_dim"):
        Flatten(0)
    with pytest.raises(ValueError, match="end_dim"):
        Flatten(1, 0)


@pytest.mark.parametrize("layer", _elementwise(), ids=lambda m: repr(m))
def test_export_matches(layer: LipschitzModule) -> None:
    x = torch.randn(5, 6, 2)
    plain = layer.vanilla_export()
    assert not isinstance(plain, LipschitzModule)
    torch.testing.assert_close(plain(x), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("alpha", [1.5, 3.0])
def test_elu_constant_is_the_supremum_of_its_slope(alpha: float) -> None:
    """``alpha exp(x)`` approaches ``alpha`` as ``x -> 0-``: never above, arbitrarily close."""
    layer = ELU(alpha)
    assert layer.lipschitz() == alpha
    for eps in (1e-2, 1e-6):
        x = torch.tensor([[-eps, 0.5, -1.0]], dtype=torch.float64)
        exact = jacobian_norm(layer, x[0])
        assert exact <= alpha
        assert exact >= alpha * math.exp(-eps) * (1 - 1e-12)
    x = torch.randn(64, 5, dtype=torch.float64) * 4
    assert float(sample_norms(layer(x)).max()) <= layer.output_bound(float(sample_norms(x).max()))


def test_activation_arguments() -> None:
    with pytest.raises(ValueError, match="min_val <= 0 <= max_val"):
        Hardtanh(0.5, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        ELU(-1.0)
    with pytest.raises(ValueError, match="negative_slope"):
        LeakyReLU(float("nan"))
    with pytest.raises(TypeError, match="negative_slope"):
        LeakyReLU("0.1")  # type: ignore[arg-type]


def test_flatten_features_refuses_a_view_that_mixes_samples() -> None:
    layer = Flatten(features=8)
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(layer(x), x.view(-1, 8), rtol=0, atol=0)
    with pytest.raises(ValueError, match="move entries between samples"):
        layer(torch.randn(3, 4, 4))  # x.view(-1, 8) would give 6 rows from 3 samples
    assert "features=8" in repr(layer)
    with pytest.raises(ValueError, match="features"):
        Flatten(features=0)


def test_unflatten_is_an_isometry() -> None:
    layer = Unflatten(2, (1, -1))
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    assert layer(x).shape == (4, 3, 1, 5)
    assert jacobian_norm(layer, x[0]) == pytest.approx(1.0)
    assert layer.output_bound(2.0) == 2.0
    torch.testing.assert_close(layer.vanilla_export()(x), layer(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="dim"):
        Unflatten(0, (1, -1))
