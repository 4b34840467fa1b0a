"""Tests of :mod:`clipless._bits`: bitwise equality on every path (NumPy and torch)."""

from __future__ import annotations

import pytest
import torch

from clipless._bits import _NUMPY_FROM, same_bits, same_bits_tensor

SIZES = [7, _NUMPY_FROM + 3]  # the torch path and the NumPy path


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.bool]
)
def test_equal_bits_and_one_flipped_element(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=g) * 100).to(dtype)
    b = a.clone()
    assert same_bits(a, b)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for i in (0, n // 2, n - 1):  # the lowest bit of one element, anywhere
        c = b.clone()
        c.view(ints[dtype.itemsize])[i] ^= 1
        assert not same_bits(a, c)


@pytest.mark.parametrize("n", SIZES)
def test_bit_patterns_not_numeric_equality(n: int) -> None:
    a = torch.zeros(n)
    b = a.clone()
    b[n - 1] = -0.0
    assert torch.equal(a, b) and not same_bits(a, b)  # -0.0 is another weight's bits
    nan = torch.full((n,), float("nan"))
    assert not torch.equal(nan, nan.clone()) and same_bits(nan, nan.clone())


@pytest.mark.parametrize("n", SIZES)
def test_views_transposes_and_parameters(n: int) -> None:
    w = torch.nn.Parameter(torch.randn(n, 3))
    assert same_bits(w, w.detach().clone())  # requires_grad is not a difference
    assert same_bits(w.detach().mT, w.detach().clone().mT)  # strided views
    assert not same_bits(w.detach().mT, w.detach().mT.contiguous().reshape(3, n).flip(1))
    assert not same_bits(w.detach(), w.detach().reshape(3, n))  # shape
    assert not same_bits(w.detach(), w.detach().double())  # dtype


@pytest.mark.parametrize("n", SIZES)
def test_complex_and_conjugate_views(n: int) -> None:
    z = torch.randn(n, dtype=torch.complex128)
    assert same_bits(z, z.clone())
    w = z.clone()
    w[n - 1] = complex(-0.0, float(w[n - 1].imag))
    z[n - 1] = complex(0.0, float(w[n - 1].imag))
    assert torch.equal(z, w) and not same_bits(z, w)  # bits, not values (review finding)
    assert not same_bits(z, z.conj())  # a lazy conjugate is compared by value
    assert same_bits(z.conj(), z.conj().resolve_conj())


@pytest.mark.parametrize("n", [7, 2**15])
def test_same_bits_tensor_agrees_with_same_bits(n: int) -> None:
    a = torch.randn(n, generator=torch.Generator().manual_seed(n))
    b = a.clone()
    assert bool(same_bits_tensor(a, b)) and same_bits(a, b)
    b[n // 2] = -b[n // 2] if b[n // 2] != 0 else 1.0
    assert not bool(same_bits_tensor(a, b)) and not same_bits(a, b)
    nan = torch.full((3,), float("nan"))
    assert bool(same_bits_tensor(nan, nan.clone()))  # the same NaN bits
    assert not bool(same_bits_tensor(torch.zeros(3), -torch.zeros(3)))  # -0.0 differs
    assert not bool(same_bits_tensor(a, a[:-1].clone()))  # shapes
