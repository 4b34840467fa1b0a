"""Gram iterations of many layers batched together (:func:`clipless.norms.evaluate_plans`).

References: exact singular values (float64 / complex128 LAPACK) of each matrix, of the explicit
Jacobian of each convolution, and each request's own chain (:func:`_gram_bounds`).
"""

from __future__ import annotations

import math

import pytest
import torch

from clipless import norms
from clipless.norms import iterations
from clipless.norms.iterations import GramRequest, _buckets, _gram_bounds, _gram_bounds_many
from test_norms import conv_jacobian_norm


def _exact(mats: torch.Tensor) -> torch.Tensor:
    wide = mats.to(torch.complex128 if mats.is_complex() else torch.float64)
    return torch.linalg.matrix_norm(wide, ord=2)


def _orthogonal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(max(rows, cols), min(rows, cols), generator=gen))
    return q if rows >= cols else q.T


def _requests(gen: torch.Generator) -> list[GramRequest]:
    """Shapes like an MLP's and a CNN's layers, both orientations, batches of matrices, float32
    and float64, flat spectra (orthogonal), rank one, a zero and a huge float64 matrix."""
    huge = torch.randn(30, 20, generator=gen, dtype=torch.float64) * 2.0**600
    zero = torch.zeros(3, 25, 18)
    zero[1] = torch.randn(25, 18, generator=gen)
    return [
        GramRequest(torch.randn(64, 40, generator=gen), 12),
        GramRequest(torch.randn(40, 64, generator=gen, dtype=torch.float64), 12),
        GramRequest(_orthogonal(48, 33, gen), 12),
        GramRequest(torch.randn(5, 30, 20, generator=gen), 12),
        GramRequest(huge, 12),
        GramRequest(zero, 12),
        GramRequest(torch.randn(1, 64, generator=gen), 12),
        GramRequest(torch.randn(64, 1, generator=gen, dtype=torch.float64), 12),
        GramRequest(torch.randn(10, 64, generator=gen), 0),
        GramRequest(torch.randn(7, 8, 3, generator=gen, dtype=torch.complex128), 10),
        GramRequest(torch.randn(2, 9, 6, generator=gen, dtype=torch.complex64), 10, True),
    ]


def test_batched_bounds_are_certified_and_equal_each_chain() -> None:
    """Every batched result is >= the exact norm of its matrix and equals the request's own
    chain up to the rounding factor of the padded shape (relative 1e-9)."""
    reqs = _requests(torch.Generator().manual_seed(0))
    batched = _gram_bounds_many(reqs)
    assert len(batched) == len(reqs)
    for req, got in zip(reqs, batched, strict=True):
        alone = _gram_bounds(req.mats, req.iters, unscaled=req.unscaled)
        assert got.shape == alone.shape == req.mats.shape[:-2]
        exact = _exact(req.mats)
        assert bool((got >= exact).all()), (req.mats.shape, got, exact)
        assert torch.allclose(got, alone, rtol=1e-9, atol=0.0), (req.mats.shape, got, alone)


def test_batching_merges_chains() -> None:
    """The requests above run as fewer chains than requests (the padded shapes stay within the
    allowance), and a large and a tiny matrix are never padded together."""
    reqs = _requests(torch.Generator().manual_seed(0))
    real12 = [
        r for r in reqs if not r.mats.is_complex() and r.iters == 12 and min(r.mats.shape[-2:]) > 1
    ]
    buckets = _buckets(real12, list(range(len(real12))), 12)
    assert len(buckets) < len(real12)
    big = [GramRequest(torch.zeros(1024, 900), 12), GramRequest(torch.zeros(1024, 1024), 12)]
    tiny = [GramRequest(torch.zeros(10, 1024), 12)]
    reqs2 = big + tiny
    assert sorted(map(sorted, _buckets(reqs2, [0, 1, 2], 12))) == [[0, 1], [2]]
    # 784 padded to 1024 would cost 1.37x the products: two chains
    wide = [GramRequest(torch.zeros(1024, 784), 12), GramRequest(torch.zeros(1024, 1024), 12)]
    assert len(_buckets(wide, [0, 1], 12)) == 2


def test_non_finite_matrices_give_inf_and_leave_the_others_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(4, 20, 16, generator=gen)
    b = torch.randn(22, 15, generator=gen)
    a[2, 3, 4] = math.nan
    b[0, 0] = math.inf
    got_a, got_b = _gram_bounds_many([GramRequest(a, 8), GramRequest(b, 8)])
    assert math.isinf(float(got_b))
    assert math.isinf(float(got_a[2]))
    finite = torch.tensor([0, 1, 3])
    assert bool((got_a[finite] >= _exact(a[finite])).all())
    assert bool((got_a[finite] <= _exact(a[finite]) * 1.01).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_evaluate_plans_of_a_network_matches_each_layer(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dense and convolutional layers' bounds computed together equal each layer's own bound
    (up to 1e-9 relative) and are >= the exact norm of each layer's explicit Jacobian: small
    layers (their explicit matrix), FFT symbols under circular and zero padding, strided, and
    the size-free bound."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    gen = torch.Generator().manual_seed(4)
    convs = [
        (torch.randn(8, 3, 3, 3, generator=gen, dtype=dtype), 1, 1, "zeros", (9, 9)),
        (torch.randn(16, 8, 3, 3, generator=gen, dtype=dtype), 2, 1, "zeros", (9, 9)),
        (torch.randn(16, 16, 3, 3, generator=gen, dtype=dtype), 1, 1, "circular", (10, 10)),
        (torch.randn(12, 16, 3, 3, generator=gen, dtype=dtype), 1, 1, "zeros", (12, 12)),
        (torch.randn(12, 16, 3, 3, generator=gen, dtype=dtype), 2, 1, "zeros", (12, 12)),
        (torch.randn(12, 16, 3, 3, generator=gen, dtype=dtype), 1, 0, "zeros", None),
    ]
    dense = [torch.randn(30, 50, generator=gen, dtype=dtype), torch.randn(50, 60, generator=gen)]
    plans = [
        norms.norm_plan(w, stride=s, padding=p, padding_mode=m, input_size=size)
        for w, s, p, m, size in convs
    ] + [norms.norm_plan(w) for w in dense]
    chains = []
    original = iterations._gram_bounds

    def counted(mats: torch.Tensor, iters: int, *, unscaled: bool = False) -> torch.Tensor:
        chains.append(mats.shape)
        return original(mats, iters, unscaled=unscaled)

    monkeypatch.setattr(iterations, "_gram_bounds", counted)
    together = norms.evaluate_plans(plans)
    requests = sum(len(plan.requests) for plan in plans)
    assert len(chains) < requests, (len(chains), requests)
    monkeypatch.setattr(iterations, "_gram_bounds", original)
    for (w, s, p, m, size), got in zip(convs, together, strict=False):
        alone = norms.norm_tensor(w, stride=s, padding=p, padding_mode=m, input_size=size)
        assert float(got) == pytest.approx(float(alone), rel=1e-9)
        if size is not None:
            exact = conv_jacobian_norm(w, (s, s), (p, p), m, size)
            assert float(got) >= exact
    for w, got in zip(dense, together[len(convs) :], strict=True):
        assert float(got) >= float(_exact(w))
        assert float(got) == pytest.approx(float(norms.norm_tensor(w)), rel=1e-9)


def test_cpu_plans_hold_the_cpu_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the accelerator path a plan carries the CPU's bound and no Gram request."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", False)
    w = torch.randn(20, 30, generator=torch.Generator().manual_seed(5))
    plan = norms.norm_plan(w)
    assert plan.requests == ()
    assert float(norms.evaluate_plans([plan])[0]) == norms.dense_norm(w)
