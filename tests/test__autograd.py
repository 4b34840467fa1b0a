"""``clipless._autograd.apply``: the classic-style twin computes what the function computes."""

from __future__ import annotations

import pytest
import torch

from clipless import _autograd
from clipless.nn import _scaled
from clipless.nn._functional import _L2NormPool


class _Probe(torch.autograd.Function):
    """Counts which path ran and scales the cotangent, so a wrong backward shows."""

    generate_vmap_rule = True
    setups = 0

    @staticmethod
    def forward(x: torch.Tensor, k: float) -> torch.Tensor:
        return x * k

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
        _Probe.setups += 1
        ctx.k = inputs[1]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return 3.0 * grad * ctx.k, None  # type: ignore[attr-defined]


def test_the_twin_runs_the_functions_forward_context_and_backward() -> None:
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    before = _Probe.setups
    out = _autograd.apply(_Probe, x, 2.0)
    assert _Probe.setups == before + 1
    assert type(out.grad_fn).__name__ == "_ProbeBackward"
    assert out.grad_fn.__class__ is not _Probe._backward_cls  # the twin's, not the original's
    out.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.full_like(x, 6.0))  # the custom backward, not autograd's


def test_inside_torch_func_the_original_function_runs() -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    grads = torch.func.vmap(torch.func.grad(lambda r: _autograd.apply(_Probe, r, 2.0).sum()))(x)
    assert torch.equal(grads, torch.full_like(x, 6.0))


@pytest.mark.parametrize("kind", ["linear", "conv", "pool"])
def test_same_outputs_and_gradients_as_apply(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 5, 5, generator=g, dtype=torch.float64)
    if kind == "linear":
        x = x.flatten(1)
        w = torch.randn(7, x.shape[1], generator=g, dtype=torch.float64)
        args: tuple[object, ...] = (None, torch.rand(6, generator=g, dtype=torch.float64) + 0.5)
        fn: type[torch.autograd.Function] = _scaled._ScaledLinear
    elif kind == "conv":
        w = torch.randn(3, 2, 3, 3, generator=g, dtype=torch.float64)
        args = (None, torch.rand(6, generator=g, dtype=torch.float64) + 0.5, (1, 1), (1, 1))
        fn = _scaled._ScaledConv2d
    else:
        w = None
        args = ()
        fn = _L2NormPool
    results = []
    for run in (fn.apply, lambda *a: _autograd.apply(fn, *a)):
        xi = x.clone().requires_grad_(True)
        wi = None if w is None else w.clone().requires_grad_(True)
        call = (xi, 2, 2) if w is None else (xi, wi, *args)
        out = run(*call)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append((out.detach(), xi.grad, None if wi is None else wi.grad))
    for a, b in zip(*results, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
