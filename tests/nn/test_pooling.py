from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from clipless import norms
from clipless.nn import AvgPool2d, L2NormPool2d, MaxPool2d

from ._helpers import jacobian_norm, sample_norms, with_norms

kernels = st.tuples(st.integers(1, 3), st.integers(1, 3))


@settings(max_examples=20, deadline=None)
@given(kernels, st.integers(0, 2), st.integers(0, 2), st.integers(0, 2**16))
def test_avgpool_lipschitz_is_exact(
    kernel: tuple[int, int], extra_h: int, extra_w: int, seed: int
) -> None:
    kh, kw = kernel
    layer = AvgPool2d(kernel)
    size = (2 * kh + extra_h, 2 * kw + extra_w)
    x = torch.randn(2, *size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    exact = jacobian_norm(layer, x)
    assert exact <= layer.lipschitz()
    assert exact == pytest.approx(1 / math.sqrt(kh * kw), rel=1e-12)
    torch.testing.assert_close(layer.vanilla_export()(x[None]), layer(x[None]), rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(kernels, st.integers(0, 2), st.sampled_from([1e-3, 1.0, 100.0]), st.integers(0, 2**16))
def test_l2normpool_jacobian_at_most_one(
    kernel: tuple[int, int], extra: int, scale: float, seed: int
) -> None:
    kh, kw = kernel
    layer = L2NormPool2d(kernel)
    gen = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(2, 2 * kh + extra, 2 * kw, generator=gen, dtype=torch.float64)
    exact = jacobian_norm(layer, x)
    assert exact <= layer.lipschitz() * (1 + 1e-12)
    assert exact == pytest.approx(1.0, rel=1e-9)  # a window's norm has a unit gradient
    torch.testing.assert_close(layer.vanilla_export()(x[None]), layer(x[None]))


def test_l2normpool_values_and_pairs() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 4, 6, generator=gen, dtype=torch.float64)
    layer = L2NormPool2d((2, 3))
    out = layer(x)
    windows = x.reshape(64, 3, 2, 2, 2, 3).permute(0, 1, 2, 4, 3, 5).reshape(64, 3, 2, 2, 6)
    torch.testing.assert_close(out, torch.linalg.vector_norm(windows, dim=-1))
    y = x + 0.3 * torch.randn(x.shape, generator=gen, dtype=torch.float64)
    ratio = sample_norms(layer(x) - layer(y)) / sample_norms(x - y)
    assert float(ratio.max()) <= 1.0 + 1e-12
    # disjoint windows covering the input: the output keeps the norm
    torch.testing.assert_close(sample_norms(out), sample_norms(x))


def test_l2normpool_gradient_finite_at_zero() -> None:
    x = torch.zeros(1, 1, 4, 4, requires_grad=True)
    L2NormPool2d(2)(x).sum().backward()
    assert x.grad is not None and bool((x.grad == 0).all())


@pytest.mark.parametrize("layer", [AvgPool2d(2), AvgPool2d((1, 3)), L2NormPool2d((2, 2))])
@pytest.mark.parametrize("x_bound", [0.0, 1.0, 1e6])
def test_output_bound(layer: AvgPool2d | L2NormPool2d, x_bound: float) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 2, 6, 7, generator=gen, dtype=torch.float64)
    x = with_norms(x, x_bound) if x_bound > 0 else torch.zeros_like(x)
    assert float(sample_norms(layer(x)).max()) <= layer.output_bound(x_bound) * (1 + 1e-12)


def test_avgpool_lipschitz_values() -> None:
    assert AvgPool2d(2).lipschitz() == 0.5
    assert AvgPool2d((1, 2)).lipschitz() >= 1 / math.sqrt(2)
    assert AvgPool2d((2, 3)).lipschitz() == pytest.approx(1 / math.sqrt(6))


@pytest.mark.parametrize("cls", [AvgPool2d, L2NormPool2d])
def test_bad_arguments(cls: type[AvgPool2d] | type[L2NormPool2d]) -> None:
    with pytest.raises(ValueError, match="kernel_size"):
        cls(0)
    with pytest.raises(TypeError, match="kernel_size"):
        cls((2, 2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kernel_size"):
        cls(3)(torch.zeros(1, 1, 2, 5))
    with pytest.raises(ValueError, match="batch, C, H, W"):
        cls(1)(torch.zeros(1, 4, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_l2normpool_backward_never_exceeds_one_in_the_subnormal_range(
    dtype: torch.dtype, k: int
) -> None:
    """Windows whose squares are subnormal: ``fl(sum x^2)`` falls far below the true sum (22% in
    float32 at 1e-22), and dividing by it made the backward 1.22-Lipschitz; it divides by a
    certified upper bound now. Also the ordinary range, and a window partly outside the grid."""
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    for m in [*torch.linspace(0.5, 12.0, 200, dtype=torch.float64).tolist(), 1e6, 1e30]:
        v = math.sqrt(m * tiny)
        x = torch.full((1, 1, k + 1, k), v, dtype=dtype, requires_grad=True)
        y = L2NormPool2d(k)(x)
        g = torch.ones_like(y) / math.sqrt(y.numel())
        (y * g).sum().backward()
        assert x.grad is not None
        assert float(x.grad.double().norm()) <= 1.0
        if k > 1:  # the last row lies outside every window
            assert bool((x.grad[:, :, k:] == 0).all())


# (kernel, stride, padding, ceil_mode): overlapping, padded, gapped and non-overlapping windows
MAX_POOLS = [
    ((2, 2), (1, 1), (0, 0), False),  # Opacus's MNIST example: F.max_pool2d(x, 2, 1)
    ((3, 3), (1, 1), (1, 1), False),
    ((3, 3), (2, 2), (1, 1), False),
    ((3, 2), (2, 1), (0, 1), True),
    ((2, 2), (2, 2), (0, 0), False),
    ((2, 2), (3, 3), (0, 0), False),
]


def _windows_per_pixel(size: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """Brute force: the most windows of one dimension containing one pixel (torch's windows)."""
    out = F.max_pool1d(torch.zeros(1, 1, size), k, s, p, ceil_mode=ceil_mode).shape[-1]
    return max(sum(o * s - p <= i < o * s - p + k for o in range(out)) for i in range(size))


@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil_mode"), MAX_POOLS)
def test_maxpool_multiplicity_is_the_most_windows_per_pixel(
    kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int], ceil_mode: bool
) -> None:
    layer = MaxPool2d(kernel, stride, padding, ceil_mode)
    assert layer.multiplicity() == norms.conv_multiplicity(kernel, stride, padding, "zeros", None)
    exact = [
        math.prod(
            _windows_per_pixel(n, k, s, p, ceil_mode)
            for k, s, p in zip(kernel, stride, padding, strict=True)
        )
        for n in range(max(kernel), 12)
    ]
    assert max(exact) == layer.multiplicity()  # never below any size, reached by some size
    assert layer.lipschitz() >= math.sqrt(layer.multiplicity())


@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil_mode"), MAX_POOLS)
@pytest.mark.parametrize("size", [(5, 5), (7, 6)])
def test_maxpool_jacobian_never_exceeds_and_reaches_sqrt_m(
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    ceil_mode: bool,
    size: tuple[int, int],
) -> None:
    layer = MaxPool2d(kernel, stride, padding, ceil_mode)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2, *size, generator=gen, dtype=torch.float64)
        assert jacobian_norm(layer, x) <= layer.lipschitz()
    # a pixel that is the maximum of every window containing it: its Jacobian column has one
    # 1 per such window, so the norm is sqrt(#windows); the largest count over pixels is exact
    best = 0.0
    for i in range(size[0]):
        for j in range(size[1]):
            x = torch.rand(1, *size, generator=gen, dtype=torch.float64)
            x[0, i, j] = 10.0
            best = max(best, jacobian_norm(layer, x))
    counts = math.prod(
        _windows_per_pixel(n, k, s, p, ceil_mode)
        for n, k, s, p in zip(size, kernel, stride, padding, strict=True)
    )
    assert best == pytest.approx(math.sqrt(counts), rel=1e-12)
    assert best <= layer.lipschitz()
    x = torch.randn(3, 2, *size, dtype=torch.float64)
    torch.testing.assert_close(layer.vanilla_export()(x), layer(x), rtol=0, atol=0)
    torch.testing.assert_close(
        layer(x), F.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode), rtol=0, atol=0
    )
    norms_in = sample_norms(x)
    assert bool((sample_norms(layer(x)) <= layer.output_bound(float(norms_in.max()))).all())


def test_maxpool_arguments() -> None:
    assert MaxPool2d(3).stride == (3, 3)
    with pytest.raises(ValueError, match="padding must be at most half"):
        MaxPool2d(2, 1, 2)
    with pytest.raises(TypeError, match="ceil_mode"):
        MaxPool2d(2, ceil_mode=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kernel", "stride", "padding"),
    [
        ((2, 2), (1, 1), (0, 0)),
        ((3, 3), (1, 1), (1, 1)),
        ((3, 3), (2, 2), (1, 1)),
        ((2, 3), (1, 2), (1, 0)),
    ],
)
def test_overlapping_avgpool_constant_is_sqrt_m_over_q(
    kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]
) -> None:
    layer = AvgPool2d(kernel, stride, padding)
    m = norms.conv_multiplicity(kernel, stride, padding, "zeros", None)
    q = kernel[0] * kernel[1]
    assert layer.multiplicity() == m and layer.lipschitz() >= math.sqrt(m / q)
    assert layer.lipschitz() == pytest.approx(math.sqrt(m / q), rel=1e-15)
    gen = torch.Generator().manual_seed(0)
    exact = [
        jacobian_norm(layer, torch.randn(1, n, n, generator=gen, dtype=torch.float64))
        for n in (5, 8, 16)
    ]
    assert max(exact) <= layer.lipschitz()  # a linear map: the same at every input
    assert exact[-1] >= 0.8 * layer.lipschitz()  # approached as the image grows
    x = torch.randn(3, 2, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.avg_pool2d(x, kernel, stride, padding), rtol=0, atol=0)
    torch.testing.assert_close(layer.vanilla_export()(x), layer(x), rtol=0, atol=0)
