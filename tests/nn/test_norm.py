from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clipless.nn import GroupNorm

from ._helpers import jacobian_norm, sample_norms, with_norms


def reference(x: torch.Tensor, groups: int, alpha: float) -> torch.Tensor:
    """Explicit per-sample, per-group loop with torch.std(correction=0)."""
    out = torch.empty_like(x)
    channels_per_group = x.shape[1] // groups
    for i in range(x.shape[0]):
        for g in range(groups):
            block = x[i, g * channels_per_group : (g + 1) * channels_per_group]
            std = torch.std(block, correction=0)
            denom = torch.clamp(std, min=alpha)
            out[i, g * channels_per_group : (g + 1) * channels_per_group] = (
                block - block.mean()
            ) / denom
    return out


@pytest.mark.parametrize("alpha", [0.25, 1.0, 3.0])
def test_matches_reference(alpha: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 3, 2, generator=gen, dtype=torch.float64)
    x[1] *= 0.01  # std below alpha
    x[2] *= 100.0  # std above alpha
    layer = GroupNorm(3, 6, alpha=alpha)
    torch.testing.assert_close(layer(x), reference(x, 3, alpha))
    torch.testing.assert_close(layer.vanilla_export()(x), layer(x), rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from([(1, 2), (2, 4), (3, 3), (2, 6)]),
    st.sampled_from([0.1, 0.5, 1.0, 2.0]),
    st.sampled_from([1e-3, 0.3, 1.0, 5.0, 100.0]),
    st.integers(0, 2**16),
)
def test_jacobian_never_exceeds_one_over_alpha(
    groups_channels: tuple[int, int], alpha: float, scale: float, seed: int
) -> None:
    groups, channels = groups_channels
    layer = GroupNorm(groups, channels, alpha=alpha)
    gen = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(channels, 2, 2, generator=gen, dtype=torch.float64)
    norm = jacobian_norm(layer, x)
    assert norm <= layer.lipschitz() * (1 + 1e-12)
    assert layer.lipschitz() == pytest.approx(1.0 / alpha)
    # small inputs (std < alpha in every group): the map is P / alpha, norm exactly 1/alpha
    if scale * 3 * math.sqrt(2 * channels) < alpha:
        assert norm == pytest.approx(1.0 / alpha, rel=1e-9)


def test_lipschitz_on_pairs_across_the_kink() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = GroupNorm(2, 4, alpha=0.5)
    # x inside, y outside the "std < alpha" region: the piecewise definition is crossed
    x = torch.randn(512, 4, 3, generator=gen, dtype=torch.float64) * 0.3
    y = x + torch.randn(x.shape, generator=gen, dtype=torch.float64) * 1.5
    ratio = sample_norms(layer(x) - layer(y)) / sample_norms(x - y)
    assert float(ratio.max()) <= layer.lipschitz() * (1 + 1e-12)


@pytest.mark.parametrize("x_bound", [0.0, 0.1, 2.0, 1e7])
def test_output_bound(x_bound: float) -> None:
    layer = GroupNorm(2, 4, alpha=0.5)
    assert layer.output_bound(1.0) == pytest.approx(2.0)  # no size recorded yet: X / alpha
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4, 5, generator=gen, dtype=torch.float64)
    x = with_norms(x, x_bound) if x_bound > 0 else torch.zeros_like(x)
    out = layer(x)
    assert layer.sample_numel == 20
    assert float(sample_norms(out).max()) <= layer.output_bound(x_bound) * (1 + 1e-12)
    assert layer.output_bound(1e7) == pytest.approx(math.sqrt(20))


def test_gradient_is_finite_at_constant_input() -> None:
    layer = GroupNorm(1, 2)
    x = torch.ones(2, 2, 3, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_groups"):
        GroupNorm(0, 4)
    with pytest.raises(ValueError, match="divisible"):
        GroupNorm(3, 4)
    with pytest.raises(ValueError, match="alpha"):
        GroupNorm(2, 4, alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        GroupNorm(2, 4, alpha=math.inf)
    with pytest.raises(ValueError, match=r"alpha must be >= 2\^-60"):
        GroupNorm(2, 4, alpha=1e-320)  # 1/alpha overflowed; alpha^2 underflowed to 0 (NaN)
    with pytest.raises(ValueError, match=r"\[batch, 4"):
        GroupNorm(2, 4)(torch.zeros(2, 3, 5))


def test_lipschitz_is_rounded_up() -> None:
    from fractions import Fraction

    for alpha in (0.1, 0.3, 3.0, 7.0, 1.0):
        lip = GroupNorm(1, 1, alpha=alpha).lipschitz()
        assert Fraction(lip) >= 1 / Fraction(alpha)
