"""Certified per-sample norms in the input's precision (``sample_norms_upper``) vs exact values."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from clipless.nn._functional import sample_norms_upper


def _exact_sq(row: torch.Tensor) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in row.reshape(-1).tolist()), Fraction(0))


def _check(x: torch.Tensor, slack: float) -> None:
    """Every bound is >= the exact norm of the stored values, and within ``slack`` of it."""
    bounds = sample_norms_upper(x)
    assert bounds.dtype == torch.float64 and bounds.shape == (x.shape[0],)
    for i in range(x.shape[0]):
        exact_sq = _exact_sq(x[i].float() if x.dtype in (torch.float16, torch.bfloat16) else x[i])
        b = Fraction(float(bounds[i]))
        assert b * b >= exact_sq, (i, float(bounds[i]), math.sqrt(exact_sq))
        if exact_sq > 0:
            assert float(b * b / exact_sq) <= 1.0 + slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_random_and_wide_range(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, 3, 12, dtype=torch.float64)[:, None]
    x = (torch.randn(12, 97, generator=gen, dtype=torch.float64) * scales).to(dtype)
    u = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    _check(x, slack=3 * (97 + 8) * u + 1e-12)


def test_adversarial_float32() -> None:
    n = 4096
    rows = [
        torch.full((n,), 1.0 + 2.0**-23),  # equal terms: the worst case of recursive summation
        torch.cat([torch.tensor([1e6]), torch.full((n - 1,), 1e-3)]),  # one huge, many tiny
        torch.full((n,), 1e-20),  # squares underflow to subnormals / zero
        torch.full((n,), 3e-45),  # subnormal inputs: squares are 0 in float32
        torch.cat([torch.tensor([3e19]), torch.zeros(n - 1)]),  # x^2 overflows float32
        torch.cat([torch.full((n // 2,), 1.7e38), torch.full((n // 2,), -1.7e38)]),  # near max
        torch.zeros(n),
    ]
    x = torch.stack(rows).float()
    bounds = sample_norms_upper(x)
    assert bool(torch.isfinite(bounds).all())
    assert float(bounds[-1]) > 0.0  # a zero sample still gets a (tiny) positive bound
    assert float(bounds[-1]) <= math.sqrt(n * 2.0**-149) * (1 + 1e-9)  # the underflow term
    for i in range(x.shape[0] - 1):
        b = Fraction(float(bounds[i]))
        assert b * b >= _exact_sq(x[i]), i


def test_differentiable_keeps_the_graph() -> None:
    x = torch.randn(3, 5, dtype=torch.float32, requires_grad=True)
    norms = sample_norms_upper(x, differentiable=True)
    norms.sum().backward()
    assert x.grad is not None
    expected = (x / torch.linalg.vector_norm(x, dim=1, keepdim=True)).detach()
    torch.testing.assert_close(x.grad, expected, rtol=1e-3, atol=0)
    assert not sample_norms_upper(x).requires_grad


def test_the_accelerator_path_is_certified_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The branch-free bound an accelerator computes (float32 rows summed in float64) is >= the
    exact norm on the random and the adversarial rows above, float32, and tight."""
    from clipless import norms

    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, 3, 12, dtype=torch.float64)[:, None]
    _check((torch.randn(12, 97, generator=gen, dtype=torch.float64) * scales).float(), 1e-4)
    n = 4096
    rows = [
        torch.full((n,), 1.0 + 2.0**-23),
        torch.cat([torch.tensor([1e6]), torch.full((n - 1,), 1e-3)]),
        torch.full((n,), 1e-20),
        torch.full((n,), 3e-45),
        torch.cat([torch.tensor([3e19]), torch.zeros(n - 1)]),
        torch.cat([torch.full((n // 2,), 1.7e38), torch.full((n // 2,), -1.7e38)]),
    ]
    x = torch.stack(rows).float()
    bounds = sample_norms_upper(x)
    assert bool(torch.isfinite(bounds).all())
    for i in range(x.shape[0]):
        b = Fraction(float(bounds[i]))
        assert b * b >= _exact_sq(x[i]), i
        assert float(b * b / _exact_sq(x[i])) <= 1.0 + 1e-3, i  # tight at every magnitude
