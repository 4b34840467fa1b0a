from __future__ import annotations

import math

import pytest
import torch

from clipless.nn import Linear, LossGradientClip, Sequential

from ._helpers import per_sample_grads, sample_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(64,), (64, 5), (64, 3, 4, 4)])
def test_backward_clips_each_sample(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    max_norm = 0.7
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    scales = torch.logspace(-3, 6, shape[0], dtype=torch.float64)
    cotangent = torch.randn(shape, generator=gen, dtype=torch.float64)
    cotangent = (cotangent * scales.reshape(-1, *[1] * (len(shape) - 1))).to(dtype)
    layer = LossGradientClip(max_norm)
    out = layer(x)
    torch.testing.assert_close(out, x, rtol=0, atol=0)  # identity forward
    out.backward(cotangent)
    assert x.grad is not None
    grad_norms = sample_norms(x.grad)
    cot_norms = sample_norms(cotangent)
    assert float(grad_norms.max()) <= max_norm  # never above, even after rounding
    small = cot_norms <= max_norm
    torch.testing.assert_close(x.grad[small], cotangent[small], rtol=0, atol=0)
    big = ~small
    assert bool(big.any())
    # certified float32 norms are looser by at most (numel + 8) 2^-24 (sample_norms_upper)
    numel = math.prod(shape[1:])
    rtol = 1e-6 if dtype == torch.float64 else 1e-6 + (numel + 8) * 2.0**-23
    torch.testing.assert_close(
        grad_norms[big], torch.full_like(grad_norms[big], max_norm), rtol=rtol, atol=0
    )
    assert float(grad_norms[big].min()) >= max_norm * (1.0 - rtol)
    # direction preserved
    cosine = (x.grad[big] * cotangent[big]).reshape(int(big.sum()), -1).double().sum(1) / (
        grad_norms[big] * cot_norms[big]
    )
    torch.testing.assert_close(cosine, torch.ones_like(cosine))


def test_clip_inside_a_model_bounds_upstream_cotangent() -> None:
    torch.manual_seed(1)
    model = Sequential(Linear(4, 4, bias=False), LossGradientClip(0.5))
    x = torch.randn(8, 4, requires_grad=True)
    (model(x) * 1e3).sum().backward()
    assert x.grad is not None
    # Linear is 1-Lipschitz (orthogonal init), so the input cotangent is <= 0.5 too
    assert float(sample_norms(x.grad).max()) <= 0.5 * (1 + 1e-5)
    assert model.lipschitz() == pytest.approx(1.0, rel=1e-5)


def test_properties_and_arguments() -> None:
    layer = LossGradientClip(2.0)
    assert layer.max_norm == 2.0
    assert layer.lipschitz() == 1.0
    assert layer.output_bound(3.0) == 3.0
    assert isinstance(layer.vanilla_export(), torch.nn.Identity)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="max_norm"):
            LossGradientClip(bad)


def test_per_sample_gradients_through_the_clip() -> None:
    """torch.func (vmap(grad)) runs through the layer: ||grad_W|| = min(||dy||, c) ||x||."""
    gen = torch.Generator().manual_seed(4)
    model = Sequential(Linear(4, 3, bias=False), LossGradientClip(0.5)).double()
    x = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    dy = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    dy = dy * torch.logspace(-2, 2, 16, dtype=torch.float64)[:, None]
    grads = per_sample_grads(model, x, dy)
    expected = torch.clamp(sample_norms(dy), max=0.5) * sample_norms(x)
    torch.testing.assert_close(sample_norms(grads["0.weight"]), expected, rtol=1e-6, atol=0)
