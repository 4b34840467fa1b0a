"""Gradient scaling against exact per-sample gradients from torch.func."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call, grad, vmap

from clipless import nn
from clipless.mechanism import BATCH_MAX, thresholds_for

DT = torch.float64


def _per_sample_grads(
    layer: torch.nn.Module, x: torch.Tensor, cot: torch.Tensor, *, scaled: bool = False
) -> dict:
    """Per-sample gradients of <layer(x_i), cot_i> w.r.t. the parameters by vmap: unscaled, or
    with ``scaled=True`` through the layer's scaled kernel at its current threshold."""
    params = {k: v.detach() for k, v in layer.named_parameters()}
    saved = layer.scaling_threshold
    if not scaled:
        layer.scaling_threshold = None

    def f(p: dict, xi: torch.Tensor, ci: torch.Tensor) -> torch.Tensor:
        return (functional_call(layer, p, (xi.unsqueeze(0),)).squeeze(0) * ci).sum()

    try:
        return vmap(grad(f), in_dims=(None, 0, 0))(params, x, cot)
    finally:
        layer.scaling_threshold = saved


def _case(make, seed: int, batch: int) -> tuple:
    """A float64 layer, a batch for it, random cotangents and the unscaled per-sample grads."""
    torch.manual_seed(seed)
    layer = make().double()
    x = _input_for(layer, batch)
    with torch.no_grad():
        cot = torch.randn_like(layer(x))
    return layer, x, cot, _per_sample_grads(layer, x, cot)


def _scaled_batch_grads(layer: torch.nn.Module, x: torch.Tensor, cot: torch.Tensor) -> dict:
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    (layer(x) * cot).sum().backward()
    return {k: v.grad.clone() for k, v in layer.named_parameters()}, x.grad.clone()


LAYERS = [
    lambda: nn.Linear(6, 4, bias=False),
    lambda: nn.Linear(6, 4, bias=True),
    lambda: nn.Conv2d(2, 3, 3, stride=1, padding=1),
    lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=True),
    lambda: nn.Conv2d(2, 3, 3, stride=1, padding=1, padding_mode="circular", bias=True),
    lambda: nn.Conv2d(2, 2, 2, stride=2, padding=0),
]


def _input_for(layer: torch.nn.Module, batch: int) -> torch.Tensor:
    if isinstance(layer, nn.Linear):
        return (
            torch.randn(batch, layer.in_features, dtype=DT)
            * torch.linspace(0.01, 5.0, batch, dtype=DT)[:, None]
        )
    scale = torch.linspace(0.01, 5.0, batch, dtype=DT)[:, None, None, None]
    return torch.randn(batch, 2, 6, 6, dtype=DT) * scale


@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize("threshold", [0.0, 2.5, BATCH_MAX])
def test_scaled_gradient_equals_reference(make, threshold) -> None:
    layer, x, cot, ref = _case(make, 0, 7)
    n = layer.sample_norm_factor(x)
    t = float(n.max()) if threshold == BATCH_MAX else threshold
    s = torch.clamp(n, min=max(t, 1e-30))
    layer.scaling_threshold = threshold
    got, gx = _scaled_batch_grads(layer, x, cot)
    for name, g in ref.items():
        expected = (g / s.view(-1, *([1] * (g.dim() - 1)))).sum(0)
        torch.testing.assert_close(got[name], expected, rtol=1e-10, atol=1e-12)
    # The input gradient is never scaled.
    layer.scaling_threshold = None
    _, gx_plain = _scaled_batch_grads(layer, x, cot)
    torch.testing.assert_close(gx, gx_plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make", LAYERS)
def test_scaled_contribution_bounded_by_cotangent(make) -> None:
    """Each sample's scaled joint contribution has norm <= ||dy_i||, for any threshold."""
    layer, x, cot, ref = _case(make, 1, 9)
    n = layer.sample_norm_factor(x)
    joint = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in ref.values()))
    cot_norm = cot.flatten(1).norm(dim=1)
    for t in (0.0, 0.5, 100.0):
        scaled = joint / torch.clamp(n, min=max(t, 1e-30))
        assert torch.all(scaled <= cot_norm * (1 + 1e-9))


def test_zero_input_gives_zero_contribution_not_nan() -> None:
    layer = nn.Linear(3, 2, bias=False).double()
    layer.scaling_threshold = 0.0
    x = torch.zeros(4, 3, dtype=DT, requires_grad=True)
    layer(x).sum().backward()
    assert torch.all(torch.isfinite(layer.weight.grad))
    assert torch.count_nonzero(layer.weight.grad) == 0


def test_empty_batch() -> None:
    layer = nn.Linear(3, 2).double()
    layer.scaling_threshold = BATCH_MAX
    layer(torch.zeros(0, 3, dtype=DT)).sum().backward()
    assert layer.weight.grad.abs().sum() == 0


def test_thresholds_modes() -> None:
    from clipless import bounds

    model = nn.Sequential(
        nn.InputNorm(2.0), nn.Linear(4, 3, bias=False), nn.ReLU(), nn.Linear(3, 2)
    )
    loss = nn.CrossEntropyLoss()
    rep = bounds.report(model, loss, (4,))
    paths = [lb.path for lb in rep.layers]
    assert thresholds_for(rep, "per-sample") == dict.fromkeys(paths, 0.0)
    bound = thresholds_for(rep, "bound")
    assert bound[paths[0]] == pytest.approx(2.0 * (1 + 1e-12))
    # second layer: dense with bias -> sqrt(X^2 + 1) with X the propagated bound
    x1 = rep.layers[1].input_bound
    assert bound[paths[1]] == pytest.approx(math.sqrt(x1**2 + 1))
    with pytest.raises(ValueError, match="allow_unproven"):
        thresholds_for(rep, "batch-max")
    assert set(thresholds_for(rep, "batch-max", allow_unproven=True).values()) == {BATCH_MAX}
    with pytest.raises(ValueError, match="thresholds"):
        thresholds_for(rep, "threshold")
    with pytest.raises(ValueError, match="missing"):
        thresholds_for(rep, "threshold", {paths[0]: 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        thresholds_for(rep, "threshold", {paths[0]: 1.0, paths[1]: -1.0})
    with pytest.raises(ValueError, match="scaling must be"):
        thresholds_for(rep, "nope")


@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize("threshold", [0.0, 2.5])
def test_vmap_of_the_scaled_kernel_is_each_sample_scaled_alone(make, threshold) -> None:
    """Under vmap (the kernels' generated vmap rule) each sample's parameter gradient is its
    own unscaled gradient divided by max(n_i, T), and the per-sample gradients sum to the
    batch's scaled gradient: vmap sees the same contributions a step sums."""
    layer, x, cot, ref = _case(make, 2, 7)
    s = torch.clamp(layer.sample_norm_factor(x), min=max(threshold, 1e-30))
    layer.scaling_threshold = threshold
    got = _per_sample_grads(layer, x, cot, scaled=True)
    batch, _ = _scaled_batch_grads(layer, x, cot)
    for name, g in ref.items():
        expected = g / s.view(-1, *([1] * (g.dim() - 1)))
        torch.testing.assert_close(got[name], expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got[name].sum(0), batch[name], rtol=1e-10, atol=1e-12)


def test_vmap_refuses_batch_max_with_a_clear_error() -> None:
    layer = nn.Linear(3, 2).double()
    layer.scaling_threshold = BATCH_MAX
    x = torch.randn(4, 3, dtype=DT)
    with pytest.raises(ValueError, match=r"batch-max.*not defined"):
        _per_sample_grads(layer, x, torch.ones(4, 2, dtype=DT), scaled=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Linear(6, 4, bias=True),
        lambda: nn.Conv2d(2, 3, 3, padding=1, bias=True),
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular", stride=2),
    ],
)
@pytest.mark.parametrize("threshold", [0.0, BATCH_MAX])
def test_no_grad_forward_skips_the_divisors_with_the_same_output(
    make, threshold, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without autograd no gradient exists to scale: the forward is the plain layer's, bit for
    bit the scaled forward's output, and computes no per-sample norm (nor batch-max's host
    read)."""
    torch.manual_seed(0)
    layer = make().double()
    layer.scaling_threshold = threshold
    x = _input_for(layer, 5)
    scaled = layer(x)
    monkeypatch.setattr(
        "clipless.nn._scaled._divisors", lambda *a: pytest.fail("divisors under no_grad")
    )
    with torch.no_grad():
        plain = layer(x)
    with torch.inference_mode():
        inferred = layer(x)
    assert torch.equal(plain, scaled.detach()) and torch.equal(inferred, scaled.detach())
    layer.scaling_threshold = None
    assert torch.equal(plain, layer(x).detach())
