"""Exact references shared by the clipless.nn tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import functional_call, grad, jacrev, vmap


def jacobian_norm(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """Spectral norm (float64) of the explicit Jacobian of ``f`` at one sample ``x`` (no batch dim).

    ``f`` is applied to ``x[None]`` (a batch of one), so layers see their usual input shape.
    """

    def single(v: torch.Tensor) -> torch.Tensor:
        return f(v.unsqueeze(0)).squeeze(0)

    jac = jacrev(single)(x.double())
    out_numel = single(x.double()).numel()
    mat = jac.detach().reshape(out_numel, x.numel()).double()
    return float(torch.linalg.matrix_norm(mat, ord=2))


def per_sample_grads(
    module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Exact per-sample gradients of ``<dy_i, module(x_i)>`` w.r.t. the parameters (vmap(grad))."""
    params = {name: p.detach() for name, p in module.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, dyi: torch.Tensor) -> torch.Tensor:
        out = functional_call(module, p, (xi.unsqueeze(0),))
        return (out.squeeze(0) * dyi).sum()

    result: dict[str, torch.Tensor] = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, dy)
    return result


def with_norms(t: torch.Tensor, norms: torch.Tensor | float) -> torch.Tensor:
    """Rescale each sample (dim 0) of ``t`` to the given L2 norm(s)."""
    flat = t.reshape(t.shape[0], -1)
    current = torch.linalg.vector_norm(flat, dim=1, keepdim=True)
    target = torch.as_tensor(norms, dtype=t.dtype).reshape(-1, 1)
    return (flat / current * target).reshape(t.shape)


def sample_norms(t: torch.Tensor) -> torch.Tensor:
    """Per-sample L2 norms (float64)."""
    return torch.linalg.vector_norm(t.detach().reshape(t.shape[0], -1).double(), dim=1)


def joint_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample norm of the concatenation of all parameter gradients."""
    squares = [g.reshape(g.shape[0], -1).double().pow(2).sum(dim=1) for g in grads.values()]
    return torch.sqrt(torch.stack(squares).sum(dim=0))
