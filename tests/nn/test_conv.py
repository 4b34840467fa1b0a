from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clipless.nn import Conv2d

from ._helpers import jacobian_norm, joint_norms, per_sample_grads, sample_norms, with_norms


@dataclass(frozen=True)
class Config:
    c_in: int
    c_out: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    mode: str
    size: tuple[int, int]
    bias: bool
    seed: int

    def layer(self, fixed_size: bool = False) -> Conv2d:
        layer = Conv2d(
            self.c_in,
            self.c_out,
            self.kernel,
            stride=self.stride,
            padding=self.padding,
            padding_mode=self.mode,
            bias=self.bias,
            input_size=self.size if fixed_size else None,
        ).double()
        gen = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen, dtype=torch.float64))
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen, dtype=torch.float64))
        return layer

    def inputs(self, batch: int, seed_offset: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + 1 + seed_offset)
        return torch.randn(batch, self.c_in, *self.size, generator=gen, dtype=torch.float64)


@st.composite
def configs(draw: st.DrawFn) -> Config:
    mode = draw(st.sampled_from(["zeros", "circular"]))
    kernel, stride, padding, size = [], [], [], []
    for _ in range(2):
        k = draw(st.integers(1, 3))
        p = draw(st.integers(0, 2))
        low = max(1, k - 2 * p, p if mode == "circular" else 1)
        kernel.append(k)
        stride.append(draw(st.integers(1, 3)))
        padding.append(p)
        size.append(draw(st.integers(low, max(low, 6))))
    return Config(
        c_in=draw(st.integers(1, 3)),
        c_out=draw(st.integers(1, 3)),
        kernel=(kernel[0], kernel[1]),
        stride=(stride[0], stride[1]),
        padding=(padding[0], padding[1]),
        mode=mode,
        size=(size[0], size[1]),
        bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def brute_force_multiplicity(cfg: Config) -> int:
    """Largest number of (output position, kernel offset) pairs reading one pixel: A^T 1."""
    counter = Conv2d(
        1, 1, cfg.kernel, stride=cfg.stride, padding=cfg.padding, padding_mode=cfg.mode
    ).double()
    with torch.no_grad():
        counter.weight.fill_(1.0)
    x = torch.zeros(1, 1, *cfg.size, dtype=torch.float64, requires_grad=True)
    counter(x).sum().backward()
    assert x.grad is not None
    return round(float(x.grad.max()))


@settings(max_examples=30, deadline=None)
@given(configs())
def test_lipschitz_upper_bounds_exact_jacobian(cfg: Config) -> None:
    layer = cfg.layer()
    size_free = layer.lipschitz()  # no input size recorded yet: valid for every size
    x = cfg.inputs(1)[0]
    exact = jacobian_norm(layer, x)  # records the input size
    assert layer.input_size == cfg.size
    assert exact <= layer.lipschitz() * (1 + 1e-12)
    assert exact <= size_free * (1 + 1e-12)
    assert layer.lipschitz() <= size_free * (1 + 1e-9)
    assert layer.multiplicity() == brute_force_multiplicity(cfg)


@pytest.mark.parametrize("kernel", [1, 3, (3, 5)])
def test_lipschitz_exact_for_same_size_circular(kernel: int | tuple[int, int]) -> None:
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    cfg = Config(
        2, 3, (kh, kw), (1, 1), ((kh - 1) // 2, (kw - 1) // 2), "circular", (6, 7), False, 5
    )
    layer = cfg.layer()
    exact = jacobian_norm(layer, cfg.inputs(1)[0])
    assert exact <= layer.lipschitz() <= exact * (1 + 1e-6)


@settings(max_examples=30, deadline=None)
@given(configs(), st.sampled_from([0.1, 1.0, 10.0]), st.sampled_from([0.5, 2.0]))
def test_gradient_bounds_against_per_sample_gradients(
    cfg: Config, x_bound: float, g_bound: float
) -> None:
    layer = cfg.layer()
    batch = 6
    gen = torch.Generator().manual_seed(cfg.seed)
    x_norms = x_bound * torch.rand(batch, generator=gen, dtype=torch.float64)
    x_norms[0] = x_bound
    x = with_norms(cfg.inputs(batch), x_norms)
    out_shape = layer(x).shape
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    dy = with_norms(torch.randn(out_shape, generator=gen, dtype=torch.float64), g_bound)
    grads = per_sample_grads(layer, x, dy)
    bounds = layer.gradient_bounds(x_bound, g_bound)
    assert set(bounds) == {name for name, _ in layer.named_parameters()}
    k_eff = layer.multiplicity()
    assert bounds["weight"] == pytest.approx(g_bound * math.sqrt(k_eff) * x_bound)
    assert float(sample_norms(grads["weight"]).max()) <= bounds["weight"] * (1 + 1e-12)
    positions = out_shape[2] * out_shape[3]
    assert layer.output_positions() == positions
    if cfg.bias:
        assert bounds["bias"] == pytest.approx(g_bound * math.sqrt(positions))
        assert float(sample_norms(grads["bias"]).max()) <= bounds["bias"] * (1 + 1e-12)
    factors = layer.sample_norm_factor(x).double()
    expected = torch.sqrt(k_eff * sample_norms(x) ** 2 + (positions if cfg.bias else 0))
    torch.testing.assert_close(factors, expected, rtol=1e-12, atol=0)
    assert bool((joint_norms(grads) <= g_bound * factors * (1 + 1e-12)).all())
    assert layer.norm_factor_bound(x_bound) >= float(factors.max()) * (1 - 1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_sample_norm_factor_and_bounds_are_attained(bias: bool) -> None:
    """Constant image, circular 'same' stride-1 conv, cotangent u (x) 1_P: equality throughout."""
    cfg = Config(2, 3, (3, 3), (1, 1), (1, 1), "circular", (5, 5), bias, 0)
    layer = cfg.layer()
    x = torch.full((1, 2, 5, 5), 0.7, dtype=torch.float64)
    u = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    dy = (u[:, None, None] * torch.ones(3, 5, 5, dtype=torch.float64))[None]
    grads = per_sample_grads(layer, x, dy)
    g_norm = float(sample_norms(dy)[0])
    expected = g_norm * float(layer.sample_norm_factor(x)[0])
    assert float(joint_norms(grads)[0]) == pytest.approx(expected, rel=1e-12)
    bounds = layer.gradient_bounds(float(sample_norms(x)[0]), g_norm)
    for name, value in bounds.items():
        assert float(sample_norms(grads[name])[0]) == pytest.approx(value, rel=1e-12)


@settings(max_examples=20, deadline=None)
@given(configs(), st.sampled_from([0.0, 1.0, 1e6]))
def test_output_bound_holds(cfg: Config, x_bound: float) -> None:
    layer = cfg.layer()
    x = cfg.inputs(32)
    x = with_norms(x, x_bound) if x_bound > 0 else torch.zeros_like(x)
    norms = sample_norms(layer(x))
    assert float(norms.max()) <= layer.output_bound(x_bound) * (1 + 1e-12)


@settings(max_examples=20, deadline=None)
@given(configs())
def test_forward_matches_torch_conv_and_export(cfg: Config) -> None:
    layer = cfg.layer()
    x = cfg.inputs(3)
    reference = torch.nn.Conv2d(
        cfg.c_in,
        cfg.c_out,
        cfg.kernel,
        stride=cfg.stride,
        padding=cfg.padding,
        padding_mode="circular" if cfg.mode == "circular" else "zeros",
        bias=cfg.bias,
    ).double()
    reference.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x), reference(x))
    plain = layer.vanilla_export()
    assert type(plain) is torch.nn.Conv2d
    torch.testing.assert_close(plain(x), layer(x))


@pytest.mark.parametrize("mode", ["zeros", "circular"])
def test_scaling_threshold_routes_through_scaling(mode: str) -> None:
    cfg = Config(2, 3, (3, 3), (2, 1), (1, 1), mode, (6, 5), True, 11)
    layer = cfg.layer()
    x = cfg.inputs(4) * 2
    out_plain = layer(x)
    dy = torch.randn(out_plain.shape, dtype=torch.float64)
    threshold = 5.0
    per_sample = per_sample_grads(layer, x, dy)
    scale = 1.0 / torch.clamp(layer.sample_norm_factor(x), min=threshold)
    layer.scaling_threshold = threshold
    out = layer(x)
    torch.testing.assert_close(out, out_plain)
    (out * dy).sum().backward()
    for name, param in layer.named_parameters():
        expected = (per_sample[name] * scale.reshape(-1, *[1] * param.dim())).sum(dim=0)
        assert param.grad is not None
        torch.testing.assert_close(param.grad, expected)


def test_input_size_recording_and_fixing() -> None:
    layer = Conv2d(1, 2, 3, padding=1, bias=True)
    assert layer.input_size is None
    with pytest.raises(RuntimeError, match="input size"):
        layer.gradient_bounds(1.0, 1.0)
    with pytest.raises(RuntimeError, match="input size"):
        layer.output_bound(1.0)
    layer(torch.zeros(2, 1, 5, 4))
    assert layer.input_size == (5, 4)
    assert layer.output_positions() == 20
    assert layer.gradient_bounds(1.0, 1.0)["bias"] == pytest.approx(math.sqrt(20))
    fixed = Conv2d(1, 2, 3, input_size=(5, 5))
    assert fixed.input_size == (5, 5)
    with pytest.raises(ValueError, match="input_size"):
        fixed(torch.zeros(1, 1, 6, 6))
    assert fixed.lipschitz(input_size=(8, 8)) > 0


def test_default_init_is_one_lipschitz_size_free() -> None:
    torch.manual_seed(0)
    layer = Conv2d(4, 6, 3)
    assert layer.bias is None
    assert layer.lipschitz() <= 1.0 + 1e-6


@pytest.mark.parametrize(
    ("kwargs", "name", "error"),
    [
        ({"in_channels": 0}, "in_channels", ValueError),
        ({"out_channels": -2}, "out_channels", ValueError),
        ({"kernel_size": 0}, "kernel_size", ValueError),
        ({"kernel_size": (3, 0)}, "kernel_size", ValueError),
        ({"kernel_size": "3"}, "kernel_size", TypeError),
        ({"stride": 0}, "stride", ValueError),
        ({"padding": -1}, "padding", ValueError),
        ({"padding_mode": "reflect"}, "padding_mode", ValueError),
        ({"input_size": (0, 4)}, "input_size", ValueError),
        ({"input_size": (1, 1)}, "input_size", ValueError),  # smaller than the kernel
        (
            {"input_size": (2, 2), "padding": 3, "padding_mode": "circular"},
            "input_size",
            ValueError,
        ),
        ({"bias": 1}, "bias", TypeError),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], name: str, error: type[Exception]) -> None:
    args: dict[str, object] = {"in_channels": 2, "out_channels": 2, "kernel_size": 3}
    args.update(kwargs)
    with pytest.raises(error, match=name):
        Conv2d(**args)  # type: ignore[arg-type]


def test_bad_input_shape() -> None:
    layer = Conv2d(2, 2, 3)
    with pytest.raises(ValueError, match=r"\[batch, 2, H, W\]"):
        layer(torch.zeros(1, 3, 5, 5))
    with pytest.raises(ValueError, match="kernel_size"):
        layer(torch.zeros(1, 2, 2, 5))


@pytest.mark.parametrize("accelerator", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_float64_factor_bounds_exact_per_sample_gradients(
    bias: bool, accelerator: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sample_norm_factor_wide`` (the accelerator's divisor) of float32 images bounds the
    exact per-sample gradient (float64 reference) and lies below the rounded factor."""
    from clipless import norms

    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", accelerator)
    cfg = Config(2, 3, (3, 3), (2, 1), (1, 1), "zeros", (6, 5), bias, 5)
    layer = cfg.layer()
    scales = torch.logspace(-20, 20, 12, dtype=torch.float64)[:, None, None, None]
    x = (cfg.inputs(12) * scales).float()
    out_shape = layer(x.double()).shape
    dy = torch.randn(out_shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    grads = per_sample_grads(layer, x.double(), dy)
    wide = layer.sample_norm_factor_wide(x)
    assert wide.dtype == torch.float64
    assert bool((joint_norms(grads) <= sample_norms(dy) * wide * (1 + 1e-12)).all())
    assert bool((layer.sample_norm_factor(x).double() >= wide).all())
