from __future__ import annotations

import math

import pytest
import torch

from clipless.nn import InputNorm

from ._helpers import jacobian_norm, sample_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [0.3, 1.0, 17.0])
def test_ball_projection_never_exceeds_radius(dtype: torch.dtype, max_norm: float) -> None:
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-6, 8, 400, dtype=torch.float64)
    x = torch.randn(400, 3, 5, 5, generator=gen, dtype=torch.float64) * scales[:, None, None, None]
    x = x.to(dtype)
    layer = InputNorm(max_norm)
    out = layer(x)
    norms = sample_norms(out)  # float64 norms of the rounded outputs
    assert float(norms.max()) <= max_norm
    inside = sample_norms(x) < max_norm * 0.999
    torch.testing.assert_close(out[inside], x[inside], rtol=0, atol=0)  # untouched inside
    outside = ~inside
    # certified float32 norms are looser by at most (numel + 8) 2^-24 (sample_norms_upper)
    rtol = 1e-6 if dtype == torch.float64 else 1e-6 + (75 + 8) * 2.0**-23
    torch.testing.assert_close(
        norms[outside], torch.full_like(norms[outside], max_norm), rtol=rtol, atol=0
    )
    assert layer.output_bound(math.inf) == max_norm
    assert layer.output_bound(0.0) == max_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ["ball", "sphere"])
def test_non_finite_samples_become_zero_samples(dtype: torch.dtype, mode: str) -> None:
    """The bound holds for every input: a NaN or infinite entry zeroes its sample only, and the
    gradient with respect to the other samples stays finite (the non-finite samples' own input
    gradient is not defined)."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).to(dtype) * 10
    x[1, 2] = math.nan
    x[3, 0] = math.inf
    x[4] = -math.inf
    x.requires_grad_(True)
    out = InputNorm(2.0, mode)(x)
    assert bool(torch.isfinite(out).all())
    assert bool((out[[1, 3, 4]] == 0).all())
    assert float(sample_norms(out).max()) <= 2.0
    clean = InputNorm(2.0, mode)(x.detach()[[0, 2, 5]])
    assert torch.equal(out[[0, 2, 5]].detach(), clean)
    out.sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad[[0, 2, 5]]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sphere_projection(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(100, 7, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
    x[0] = 0.0
    x[1] *= 1e-9
    x.requires_grad_(True)
    layer = InputNorm(2.0, mode="sphere")
    out = layer(x)
    norms = sample_norms(out)
    assert float(norms[0]) == 0.0
    assert float(norms.max()) <= 2.0
    rtol = 1e-6 if dtype == torch.float64 else 1e-6 + (7 + 8) * 2.0**-23
    torch.testing.assert_close(norms[1:], torch.full_like(norms[1:], 2.0), rtol=rtol, atol=0)
    out.sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad[[0, 2, 5]]).all())
    assert layer.lipschitz() == math.inf
    assert layer.output_bound(5.0) == 2.0


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_ball_jacobian_at_most_one(scale: float) -> None:
    gen = torch.Generator().manual_seed(2)
    layer = InputNorm(1.0)
    for _ in range(5):
        x = scale * torch.randn(4, 3, generator=gen, dtype=torch.float64)
        norm = jacobian_norm(layer, x)
        assert norm <= layer.lipschitz() * (1 + 1e-9)
        if scale == 0.01:
            assert norm == pytest.approx(1.0)  # identity inside the ball
    # pairs, one inside and one outside the ball
    x = torch.randn(256, 6, generator=gen, dtype=torch.float64) * 0.5
    y = torch.randn(256, 6, generator=gen, dtype=torch.float64) * 3.0
    ratio = sample_norms(layer(x) - layer(y)) / sample_norms(x - y)
    assert float(ratio.max()) <= 1.0 + 1e-12


def test_sphere_jacobian_grows_near_zero() -> None:
    layer = InputNorm(1.0, mode="sphere")
    x = torch.tensor([1e-3, 2e-3, 0.0], dtype=torch.float64)
    assert jacobian_norm(layer, x) > 100.0  # not Lipschitz: lipschitz() is inf


def test_export_matches() -> None:
    x = torch.randn(6, 2, 3) * 10
    for mode in ("ball", "sphere"):
        layer = InputNorm(3.0, mode=mode)
        torch.testing.assert_close(layer.vanilla_export()(x), layer(x), rtol=0, atol=0)


def test_bad_arguments() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_norm"):
            InputNorm(bad)
    with pytest.raises(TypeError, match="max_norm"):
        InputNorm("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        InputNorm(1.0, mode="cube")


@pytest.mark.parametrize("mode", ["ball", "sphere"])
def test_centring_subtracts_the_mean_of_unit_samples_then_projects(mode: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50, 2, 3, generator=gen, dtype=torch.float64) * 10.0
    center = torch.randn(2, 3, generator=gen, dtype=torch.float64) * 0.1
    layer = InputNorm(2.0, mode, center=center, center_noise=20.0)
    unit = x / x.flatten(1).norm(dim=1)[:, None, None]
    expected = InputNorm(2.0, mode)(unit - center)
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    assert float(sample_norms(layer(x)).max()) <= 2.0
    assert layer.release_noise == 20.0 and layer.lipschitz() == math.inf
    assert layer.output_bound(math.inf) == 2.0
    # the plain twin (Opacus baselines, export) computes the same map
    torch.testing.assert_close(layer.vanilla_export()(x), layer(x), rtol=0, atol=0)
    # the released mean and its noise travel with the state dict
    state = layer.state_dict()
    assert set(state) == {"center", "center_noise"}
    other = InputNorm(2.0, mode, center=torch.zeros(2, 3, dtype=torch.float64), center_noise=1.0)
    other.load_state_dict(state)
    assert other.release_noise == 20.0
    torch.testing.assert_close(other(x), layer(x), rtol=0, atol=0)
    assert InputNorm(2.0).state_dict() == {}  # no centring: nothing saved (old model files load)


def test_centring_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="center and center_noise go together"):
        InputNorm(1.0, center=torch.zeros(3))
    with pytest.raises(ValueError, match="center and center_noise go together"):
        InputNorm(1.0, center_noise=2.0)
    with pytest.raises(ValueError, match="center_noise"):
        InputNorm(1.0, center=torch.zeros(3), center_noise=0.0)
    with pytest.raises(ValueError, match="finite tensor"):
        InputNorm(1.0, center=torch.tensor([math.nan, 0.0]), center_noise=1.0)
    layer = InputNorm(1.0, center=torch.zeros(3), center_noise=1.0)
    with pytest.raises(ValueError, match=r"center has shape \(3,\)"):
        layer(torch.ones(4, 5))


@pytest.mark.parametrize("convert", ["half", "bfloat16", "half-float", "double"])
def test_release_multipliers_survive_dtype_conversions(convert: str) -> None:
    """The accountant reads the multipliers from these buffers: a conversion that rounded 0.7 up
    (``half`` gives 0.7002) would record less privacy loss than the release spent."""
    eye = torch.eye(3)
    layer = InputNorm(1.0, "sphere", center=eye[0], center_noise=0.7, whiten=eye, whiten_noise=1.1)
    layer = layer.half().float() if convert == "half-float" else layer.to(getattr(torch, convert))
    assert layer.releases == (("input mean", 0.7), ("input second moment", 1.1))
    assert layer.center_noise is not None and layer.center_noise.dtype == torch.float64
    state = layer.state_dict()
    again = InputNorm(
        1.0, "sphere", center=torch.ones(3), center_noise=5.0, whiten=torch.eye(3), whiten_noise=5.0
    )
    again.load_state_dict(state)
    assert again.releases == (("input mean", 0.7), ("input second moment", 1.1))
