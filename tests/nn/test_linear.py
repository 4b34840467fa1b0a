from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from clipless import nn
from clipless.nn import Linear

from ._helpers import jacobian_norm, joint_norms, per_sample_grads, sample_norms, with_norms

shapes = st.tuples(st.integers(1, 12), st.integers(1, 12), st.booleans(), st.integers(0, 2**16))


def _random_linear(fan_in: int, fan_out: int, bias: bool, seed: int) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(fan_in, fan_out, bias=bias).double()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(fan_out, fan_in, generator=gen, dtype=torch.float64))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(fan_out, generator=gen, dtype=torch.float64))
    return layer


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_lipschitz_is_tight_upper_bound_of_jacobian(shape: tuple[int, int, bool, int]) -> None:
    fan_in, fan_out, bias, seed = shape
    layer = _random_linear(fan_in, fan_out, bias, seed)
    lip = layer.lipschitz()
    assert isinstance(lip, float)
    x = torch.randn(fan_in, dtype=torch.float64)
    exact = jacobian_norm(layer, x)
    assert exact <= lip
    assert lip <= exact * 1.01


def test_orthogonal_init_is_one_lipschitz() -> None:
    torch.manual_seed(0)
    for fan_in, fan_out in [(8, 8), (5, 9), (9, 5)]:
        layer = Linear(fan_in, fan_out)
        assert layer.lipschitz() == pytest.approx(1.0, rel=1e-5)
        assert layer.bias is not None and bool((layer.bias == 0).all())


@settings(max_examples=20, deadline=None)
@given(shapes, st.sampled_from([0.0, 1e-3, 1.0, 7.5, 1e6]))
def test_output_bound_holds(shape: tuple[int, int, bool, int], x_bound: float) -> None:
    fan_in, fan_out, bias, seed = shape
    layer = _random_linear(fan_in, fan_out, bias, seed)
    x = torch.randn(64, fan_in, dtype=torch.float64)
    # worst direction: the top right singular vector, both signs
    top = torch.linalg.svd(layer.weight.detach())[2][0]
    x = torch.cat([x, top[None], -top[None]])
    x = with_norms(x, x_bound) if x_bound > 0 else torch.zeros_like(x)
    norms = sample_norms(layer(x))
    bound = layer.output_bound(x_bound)
    assert float(norms.max()) <= bound
    assert float(norms.max()) >= 0.99 * bound or bias  # tight without a bias


@settings(max_examples=20, deadline=None)
@given(shapes, st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from([0.1, 1.0, 20.0]))
def test_gradient_bounds_against_per_sample_gradients(
    shape: tuple[int, int, bool, int], g_bound: float, x_bound: float
) -> None:
    fan_in, fan_out, bias, seed = shape
    layer = _random_linear(fan_in, fan_out, bias, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    batch = 16
    x_norms = x_bound * torch.rand(batch, generator=gen, dtype=torch.float64)
    x_norms[0] = x_bound  # one sample on the boundary
    x = with_norms(torch.randn(batch, fan_in, generator=gen, dtype=torch.float64), x_norms)
    dy = with_norms(torch.randn(batch, fan_out, generator=gen, dtype=torch.float64), g_bound)
    grads = per_sample_grads(layer, x, dy)
    bounds = layer.gradient_bounds(x_bound, g_bound)
    assert set(bounds) == {name for name, _ in layer.named_parameters()}
    w_norms = sample_norms(grads["weight"])
    assert float(w_norms.max()) <= bounds["weight"] * (1 + 1e-12)
    # ||dy x^T||_F = ||dy|| ||x||: attained on the boundary sample
    assert float(w_norms[0]) == pytest.approx(bounds["weight"], rel=1e-10)
    if bias:
        b_norms = sample_norms(grads["bias"])
        assert torch.allclose(b_norms, torch.full_like(b_norms, g_bound), rtol=1e-12)
    # sample_norm_factor: joint norm = ||dy_i|| n_i exactly for a dense layer
    factors = layer.sample_norm_factor(x).double()
    expected = torch.sqrt(sample_norms(x) ** 2 + (1.0 if bias else 0.0))
    torch.testing.assert_close(factors, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(joint_norms(grads), g_bound * factors, rtol=1e-10, atol=1e-12)
    assert layer.norm_factor_bound(x_bound) >= float(factors.max()) * (1 - 1e-12)
    assert layer.norm_factor_bound(x_bound) == pytest.approx(
        math.sqrt(x_bound**2 + 1) if bias else x_bound
    )


def test_sample_norm_factor_rounds_up_in_float32() -> None:
    torch.manual_seed(1)
    layer = Linear(50, 3)
    x = torch.randn(200, 50)
    exact = torch.sqrt(x.double().pow(2).sum(dim=1) + 1.0)
    factors = layer.sample_norm_factor(x)
    assert factors.dtype == torch.float32
    assert bool((factors.double() >= exact).all())


def test_forward_matches_functional_and_export() -> None:
    torch.manual_seed(2)
    layer = Linear(6, 4)
    with torch.no_grad():
        layer.bias.uniform_(-1, 1)  # type: ignore[union-attr]
    x = torch.randn(5, 6)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    plain = layer.vanilla_export()
    assert type(plain) is torch.nn.Linear
    torch.testing.assert_close(plain(x), layer(x))
    with torch.no_grad():
        layer.weight.mul_(2)
    assert not torch.allclose(plain(x), layer(x))  # copied, not shared


def test_scaling_threshold_routes_through_scaling() -> None:
    torch.manual_seed(3)
    layer = Linear(4, 3).double()
    x = torch.randn(6, 4, dtype=torch.float64) * 3
    dy = torch.randn(6, 3, dtype=torch.float64)
    threshold = 2.5
    layer.scaling_threshold = threshold
    out = layer(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))
    (out * dy).sum().backward()
    scale = 1.0 / torch.clamp(layer.sample_norm_factor(x), min=threshold)
    assert layer.weight.grad is not None and layer.bias is not None
    torch.testing.assert_close(layer.weight.grad, (dy * scale[:, None]).T @ x)
    torch.testing.assert_close(layer.bias.grad, (dy * scale[:, None]).sum(dim=0))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"in_features": 0, "out_features": 2}, "in_features"),
        ({"in_features": 2, "out_features": -1}, "out_features"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Linear(kwargs["in_features"], kwargs["out_features"])


def test_bad_types_and_shapes() -> None:
    with pytest.raises(TypeError, match="in_features"):
        Linear(2.5, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bias"):
        Linear(2, 3, bias="yes")  # type: ignore[arg-type]
    layer = Linear(3, 2)
    with pytest.raises(ValueError, match=r"\[batch, 3\]"):
        layer(torch.zeros(4, 1, 3))
    with pytest.raises(ValueError, match="input_bound"):
        layer.output_bound(-1.0)
    with pytest.raises(ValueError, match="cotangent_bound"):
        layer.gradient_bounds(1.0, float("nan"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_layers_refuse_dtypes_without_a_certified_margin(dtype: torch.dtype) -> None:
    """Audit finding: torch's QR ("geqrf_cpu not implemented for 'Half'") or requires_grad
    errors instead of a named one."""
    with pytest.raises(ValueError, match=r"dtype must be None, torch\.float32 or torch\.float64"):
        nn.Linear(4, 2, dtype=dtype)
    with pytest.raises(ValueError, match=r"dtype must be None, torch\.float32 or torch\.float64"):
        nn.Conv2d(1, 2, 3, dtype=dtype)
    assert nn.Linear(4, 2, dtype=torch.float64).weight.dtype == torch.float64


@pytest.mark.parametrize("accelerator", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_float64_factor_bounds_exact_per_sample_gradients(
    bias: bool, accelerator: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sample_norm_factor_wide`` (the accelerator's divisor) of float32 rows bounds the exact
    per-sample gradient (float64 reference): ``||grad_i|| <= ||dy_i|| n_i``, and the rounded
    factor lies above it."""
    from clipless import norms

    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", accelerator)
    layer = _random_linear(40, 7, bias, 3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 40, generator=gen) * torch.logspace(-20, 20, 32)[:, None]
    dy = torch.randn(32, 7, generator=gen, dtype=torch.float64)
    grads = per_sample_grads(layer, x.double(), dy)
    wide = layer.sample_norm_factor_wide(x)
    assert wide.dtype == torch.float64
    assert bool((joint_norms(grads) <= sample_norms(dy) * wide * (1 + 1e-12)).all())
    assert bool((layer.sample_norm_factor(x).double() >= wide).all())
