"""Certified norm bounds of :mod:`clipless.norms` against exact references.

References: exact singular values (float64 LAPACK) of the matrix itself or of the explicit
Jacobian of ``F.conv2d`` (the convolution applied to every basis vector), and brute-force counts
for the multiplicity ``k_eff``.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from clipless import norms
from clipless.norms import (
    NUMERIC_MARGIN,
    conv_multiplicity,
    conv_norm,
    conv_power_iteration,
    dense_norm,
    gram_iteration,
    power_iteration,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """LAPACK with 2 threads on a shared, loaded 2-core machine is up to 8x slower than with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def exact_norm(mat: torch.Tensor) -> float:
    return float(
        torch.linalg.matrix_norm(
            mat.to(torch.complex128 if mat.is_complex() else torch.float64), ord=2
        )
    )


def conv_apply(
    x: torch.Tensor, w: torch.Tensor, stride: tuple[int, int], padding: tuple[int, int], mode: str
) -> torch.Tensor:
    if mode == "circular":
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]), mode="circular")
        return F.conv2d(x, w, stride=stride)
    return F.conv2d(x, w, stride=stride, padding=padding)


def conv_jacobian_norm(
    w: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    mode: str,
    size: tuple[int, int],
) -> float:
    """Spectral norm of the explicit matrix of the convolution (applied to the identity basis)."""
    c_in = w.shape[1]
    d = c_in * size[0] * size[1]
    basis = torch.eye(d, dtype=torch.float64).reshape(d, c_in, *size)
    jac = conv_apply(basis, w.double(), stride, padding, mode).reshape(d, -1)
    return exact_norm(jac)


def brute_multiplicity(
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    mode: str,
    size: tuple[int, int],
) -> int:
    """Max over pixels of #(output, tap) pairs reading it: adjoint of an all-ones conv on ones."""
    x = torch.ones(1, 1, *size, dtype=torch.float64, requires_grad=True)
    y = conv_apply(x, torch.ones(1, 1, *kernel, dtype=torch.float64), stride, padding, mode)
    (g,) = torch.autograd.grad(y.sum(), x)
    return round(float(g.max()))


# ------------------------------------------------------------------------------------- dense


def _with_singular_values(rows: int, cols: int, sv: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64))
    r = min(rows, cols)
    return u[:, :r] @ torch.diag(sv.double()) @ v[:, :r].T


def _matrices() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = [
        ("random 30x50", torch.randn(30, 50, generator=gen)),
        ("random 64x8 float32", torch.randn(64, 8, generator=gen)),
        ("random 1x7", torch.randn(1, 7, generator=gen, dtype=torch.float64)),
        ("ill-conditioned 40x40", _with_singular_values(40, 40, torch.logspace(0, -12, 40), 1)),
        ("near-orthogonal 200x100", _with_singular_values(200, 100, 1 - torch.rand(100) * 1e-3, 2)),
        ("orthogonal 128x128", _with_singular_values(128, 128, torch.ones(128), 3)),
        ("huge scale", torch.randn(20, 30, generator=gen, dtype=torch.float64) * 1e150),
        ("tiny scale", torch.randn(20, 30, generator=gen, dtype=torch.float64) * 1e-150),
    ]
    low = torch.randn(60, 3, generator=gen, dtype=torch.float64) @ torch.randn(
        3, 45, generator=gen, dtype=torch.float64
    )
    out.append(("rank-3 60x45", low))
    return out


@pytest.mark.parametrize("method", ["svd", "eigh", "gram", "cholesky", "auto"])
@pytest.mark.parametrize(("name", "mat"), _matrices(), ids=[n for n, _ in _matrices()])
def test_dense_norm_is_certified_and_within_one_percent(
    method: str, name: str, mat: torch.Tensor
) -> None:
    exact = exact_norm(mat)
    bound = dense_norm(mat, method=method)  # type: ignore[arg-type]
    assert bound >= exact
    assert bound <= exact * 1.01, (name, bound / exact)
    if method == "svd":
        assert bound == pytest.approx(exact * (1 + NUMERIC_MARGIN), rel=1e-12)


def test_dense_norm_large_matrix_gram_path() -> None:
    gen = torch.Generator().manual_seed(5)
    mat = torch.randn(2000, 1500, generator=gen)
    exact = float(torch.linalg.svdvals(mat.double())[0])
    gram = dense_norm(mat, method="gram")
    assert exact <= gram <= exact * 1.01, gram / exact


def test_dense_norm_auto_switches_to_gram(monkeypatch: pytest.MonkeyPatch) -> None:
    mat = torch.randn(90, 70, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert dense_norm(mat) == dense_norm(mat, method="cholesky")  # min dim 70 > 64, CPU
    assert dense_norm(mat[:, :40]) == dense_norm(mat[:, :40], method="svd")
    monkeypatch.setattr(norms, "_CHOLESKY_MAX_DIM", 50)
    assert dense_norm(mat) == dense_norm(mat, method="eigh")
    monkeypatch.setattr(norms, "_SVD_MAX_DIM", 50)
    gram = dense_norm(mat, method="gram", gram_iters=norms._GRAM_AUTO_ITERS)
    assert dense_norm(mat) == gram != dense_norm(mat, method="svd")


def test_dense_norm_auto_uses_matrix_products_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path (forced on the CPU) is Gram iteration at every size."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    gen = torch.Generator().manual_seed(7)
    for shape in ((10, 300), (90, 70), (300, 300)):
        mat = torch.randn(*shape, generator=gen, dtype=torch.float64)
        gram = dense_norm(mat, method="gram", gram_iters=norms._GRAM_AUTO_ITERS)
        assert dense_norm(mat) == gram
        exact = float(torch.linalg.svdvals(mat)[0])
        assert exact <= gram <= exact * 1.002, (shape, gram / exact)


def test_a_name_set_on_the_package_reaches_the_submodules_that_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``clipless.norms`` is a package whose submodules read their own globals: the flag set on
    the package (as the conftest and the benchmarks do) and a helper patched there reach them."""
    from clipless.norms import certificates, convolution, dense

    mat = torch.randn(90, 70, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    gram = dense_norm(mat, method="gram", gram_iters=norms._GRAM_AUTO_ITERS)
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", False)
    assert certificates.ACCELERATOR_PATH_ON_CPU is False
    assert dense_norm(mat) == dense_norm(mat, method="cholesky") != gram
    norms.ACCELERATOR_PATH_ON_CPU = True  # plain assignment; monkeypatch restores the original
    assert certificates.ACCELERATOR_PATH_ON_CPU is True
    assert dense_norm(mat) == gram
    calls: list[tuple[int, ...]] = []
    original = norms.matrix_products_only

    def counting(t: torch.Tensor) -> bool:
        calls.append(tuple(t.shape))
        return original(t)

    monkeypatch.setattr(norms, "matrix_products_only", counting)
    assert dense.matrix_products_only is convolution.matrix_products_only is counting
    weight = torch.randn(4, 3, 3, 3, generator=torch.Generator().manual_seed(1))
    norms.norm_tensor(weight, padding=1, input_size=12)
    assert (4, 3, 3, 3) in calls


def _adversarial(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Near-degenerate top singular values, huge condition numbers, rank deficiency, scales."""
    n = 160
    top = torch.ones(n)
    top[1:] = 1.0 - torch.logspace(-15, -1, n - 1)  # gaps from 1e-15 up
    cond = torch.logspace(0, -15, n)
    return [
        (name, (m * scale).to(dtype))
        for name, m, scale in [
            ("clustered top", _with_singular_values(200, n, top, 11), 1.0),
            ("cond 1e15", _with_singular_values(n, 200, cond, 12), 1.0),
            ("all equal", _with_singular_values(n, n, torch.ones(n), 13), 3.0),
            ("rank 1", _with_singular_values(n, 120, torch.eye(120)[0], 14), 1.0),
            ("clustered, 2^-60", _with_singular_values(200, n, top, 15), 2.0**-60),
            ("clustered, 2^60", _with_singular_values(200, n, top, 16), 2.0**60),
        ]
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_norm_is_certified_and_tight_on_adversarial_matrices(dtype: torch.dtype) -> None:
    for name, mat in _adversarial(dtype):
        exact = exact_norm(mat)
        result = norms._cholesky_norm(mat.double())
        assert result is not None, name  # the certificate itself succeeded (no fallback)
        assert exact <= result[0] <= exact * (1 + 5e-6), (name, result[0] / exact - 1)
        assert dense_norm(mat, method="cholesky") == result[0]


@pytest.mark.parametrize("exponent", [-1060, -1000, 1000])
def test_cholesky_norm_at_extreme_scales(exponent: int) -> None:
    """Entries near the subnormal range (scaling up, or down with underflow) and near overflow."""
    base = _with_singular_values(120, 90, torch.linspace(1.0, 0.1, 90), 31)
    mat = base * 2.0 ** (exponent // 2) * 2.0 ** (exponent - exponent // 2)
    back = mat * 2.0 ** (-(exponent // 2)) * 2.0 ** (-(exponent - exponent // 2))
    exact = exact_norm(back) * 2.0**exponent  # scaling a float64 matrix up is exact
    result = norms._cholesky_norm(mat)
    assert result is not None
    assert exact <= result[0] <= exact * (1 + 1e-5) + 2.0**-1000


@pytest.mark.parametrize("scale", [1e-170, 1e-300, 1e170, 1e300])
@pytest.mark.parametrize("complex_", [False, True])
def test_eigh_norm_at_extreme_scales(scale: float, complex_: bool) -> None:
    """The Gram product of entries below ~1e-154 underflows (the unscaled bound was 0 at 1e-170)
    and above ~1e154 overflows: the eigh certificate scales by a power of two first."""
    gen = torch.Generator().manual_seed(42)
    dtype = torch.complex128 if complex_ else torch.float64
    base = torch.randn(20, 30, generator=gen, dtype=dtype)
    exact = exact_norm(base) * scale
    mat = base * scale
    bound = dense_norm(mat, method="eigh")
    assert exact <= bound <= exact * (1 + 1e-8), bound / exact


def test_cholesky_norm_rejects_a_level_below_the_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate only steers: below the truth the factorisation fails, or what it certifies
    (with the rounding terms) is still above the exact norm."""
    mat = _with_singular_values(150, 120, 1.0 - torch.linspace(0, 0.5, 120), 21)
    exact = exact_norm(mat)
    e = -math.frexp(float(mat.abs().max()))[1] + 1  # _cholesky_norm works on 2^e W
    lam = exact**2 * 4.0**e
    monkeypatch.setattr(norms, "_CHOLESKY_MARGINS", (0.0,))
    for rel in (1e-1, 1e-4, 1e-8, 1e-11, 1e-13, 1e-15, 0.0):
        est = norms._Estimate(lam * (1 - rel), None)
        monkeypatch.setattr(norms, "_top_eigenvalue_estimate", lambda g, v0=None, e=est: e)
        result = norms._cholesky_norm(mat)
        if rel >= 1e-8:
            assert result is None, rel  # c^2 I - W^T W is clearly indefinite
        if result is not None:
            assert result[0] >= exact, rel
    # A level far above the truth is certified as such: the bound never depends on the estimate.
    high = norms._Estimate(lam * 2.25, None)
    monkeypatch.setattr(norms, "_top_eigenvalue_estimate", lambda g, v0=None: high)
    result = norms._cholesky_norm(mat)
    assert result is not None
    assert result[0] == pytest.approx(1.5 * exact, rel=1e-6)
    # No estimate (ARPACK failed): dense_norm falls back to the eigh certificate.
    monkeypatch.setattr(norms, "_top_eigenvalue_estimate", lambda g, v0=None: None)
    assert dense_norm(mat, method="cholesky") == dense_norm(mat, method="eigh")


def test_cholesky_norm_retries_with_a_larger_level(monkeypatch: pytest.MonkeyPatch) -> None:
    mat = _with_singular_values(100, 80, torch.linspace(2.0, 1.0, 80), 22)
    exact = exact_norm(mat)
    e = -math.frexp(float(mat.abs().max()))[1] + 1
    # The first two lifts fail, 1e-2 passes.
    low = norms._Estimate(exact**2 * 4.0**e * (1 - 1e-3), None)
    monkeypatch.setattr(norms, "_top_eigenvalue_estimate", lambda g, v0=None: low)
    result = norms._cholesky_norm(mat)
    assert result is not None
    assert exact <= result[0] <= exact * 1.006


def test_gram_iteration_converges_and_bounds_each_matrix() -> None:
    gen = torch.Generator().manual_seed(1)
    mats = torch.randn(5, 3, 12, 7, generator=gen, dtype=torch.float64)
    exact = torch.linalg.matrix_norm(mats, ord=2)
    previous = None
    for iters in range(0, 9):
        ub = gram_iteration(mats, iters)
        assert ub.shape == (5, 3)
        assert bool((ub >= exact).all())
        if previous is not None:  # monotone up to rounding
            assert bool((ub <= previous * (1 + 1e-12)).all())
        previous = ub
    assert bool((previous <= exact * (1 + 1e-6)).all())  # type: ignore[operator]


def test_gram_iteration_complex_and_zero() -> None:
    gen = torch.Generator().manual_seed(2)
    mats = torch.randn(4, 6, 9, generator=gen, dtype=torch.complex128)
    mats[1] = 0
    ub = gram_iteration(mats, 6)
    exact = torch.linalg.matrix_norm(mats, ord=2)
    assert bool((ub >= exact).all())
    assert float(ub[1]) == 0.0
    assert bool((ub <= exact * 1.01).all())


def test_gram_rounding_factor_is_small_and_grows() -> None:
    small = norms._gram_rounding_factor(64, 64, complex_=False)
    big = norms._gram_rounding_factor(4096, 4096, complex_=True)
    assert 1.0 < small < 1 + 1e-11
    assert small < big < 1 + 1e-8


def test_dense_norm_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="2-D"):
        dense_norm(torch.ones(3))
    with pytest.raises(ValueError, match="finite"):
        dense_norm(torch.tensor([[1.0, math.nan]]))
    with pytest.raises(ValueError, match="method"):
        dense_norm(torch.ones(2, 2), method="power")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gram_iters"):
        dense_norm(torch.ones(2, 2), gram_iters=-1)
    assert dense_norm(torch.zeros(3, 4)) == 0.0
    assert dense_norm(torch.zeros(3, 4), method="gram") == 0.0


# ------------------------------------------------------------------------------- convolution

conv_configs = st.fixed_dictionaries(
    {
        "c_out": st.integers(1, 3),
        "c_in": st.integers(1, 3),
        "kernel": st.tuples(st.integers(1, 5), st.integers(1, 5)),
        "stride": st.tuples(st.integers(1, 3), st.integers(1, 3)),
        "padding": st.tuples(st.integers(0, 2), st.integers(0, 2)),
        "mode": st.sampled_from(["zeros", "circular"]),
        "size": st.tuples(st.integers(3, 9), st.integers(3, 9)),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def _valid(cfg: dict) -> bool:
    for n, k, p in zip(cfg["size"], cfg["kernel"], cfg["padding"], strict=True):
        if n + 2 * p < k or (cfg["mode"] == "circular" and p > n):
            return False
    return True


def _kernel(cfg: dict) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cfg["seed"])
    return torch.randn(
        cfg["c_out"], cfg["c_in"], *cfg["kernel"], generator=gen, dtype=torch.float64
    )


@settings(max_examples=150, deadline=None)
@given(conv_configs)
def test_conv_norm_bounds_explicit_jacobian(cfg: dict) -> None:
    if not _valid(cfg):
        with pytest.raises(ValueError):
            conv_norm(
                _kernel(cfg),
                stride=cfg["stride"],
                padding=cfg["padding"],
                padding_mode=cfg["mode"],
                input_size=cfg["size"],
            )
        return
    w = _kernel(cfg)
    exact = conv_jacobian_norm(w, cfg["stride"], cfg["padding"], cfg["mode"], cfg["size"])
    kwargs = {"stride": cfg["stride"], "padding": cfg["padding"], "padding_mode": cfg["mode"]}
    fft = conv_norm(w, input_size=cfg["size"], method="fft", **kwargs)
    frob = conv_norm(w, input_size=cfg["size"], method="frobenius", **kwargs)
    explicit = conv_norm(w, input_size=cfg["size"], method="explicit", **kwargs)
    auto = conv_norm(w, input_size=cfg["size"], **kwargs)
    size_free = conv_norm(w, input_size=None, **kwargs)
    assert fft >= exact
    assert frob >= exact
    assert exact <= explicit <= exact * (1 + 2 * NUMERIC_MARGIN)
    assert auto == explicit  # small layer: "auto" is exact
    assert size_free >= frob
    # never looser than the seeds' sqrt(kh kw) ||K||_F for zero padding
    if cfg["mode"] == "zeros":
        seeds = math.sqrt(w.shape[2] * w.shape[3]) * float(torch.linalg.vector_norm(w))
        assert frob <= seeds * (1 + 1e-8)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
)
def test_conv_norm_exact_for_circular_same_padding(
    c_out: int, c_in: int, half: int, stride: int, blocks: int, seed: int
) -> None:
    """Circular, ``2p = k - 1`` and ``s | n``: the polyphase circulant is exact (Sedghi et al.)."""
    k = 2 * half + 1
    n = stride * max(blocks, -(-k // stride))
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(c_out, c_in, k, k, generator=gen, dtype=torch.float64)
    exact = conv_jacobian_norm(w, (stride, stride), (half, half), "circular", (n, n))
    fft = conv_norm(
        w, stride=stride, padding=half, padding_mode="circular", input_size=n, method="fft"
    )
    assert exact <= fft <= exact * (1 + 1e-8)


@pytest.mark.parametrize(
    ("c", "k", "stride", "pad", "n", "worst"),
    [
        (16, 3, 2, 1, 15, 1.30),  # the padded-copy relaxation alone: 1.88-2.00x
        (8, 3, 2, 1, 21, 1.35),  # 1.85-1.97x
        (8, 5, 2, 2, 17, 1.40),  # 1.91-1.96x
        (16, 3, 3, 1, 16, 1.45),  # 1.66-1.73x
    ],
)
def test_conv_norm_circular_stride_not_dividing_the_size(
    c: int, k: int, stride: int, pad: int, n: int, worst: float
) -> None:
    """Circular padding, ``s`` not dividing ``n``: the circulant superset keeps ``fft`` within
    ``worst`` of the exact norm (the padded-copy relaxation alone was ~1.7-2x above it)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        w = torch.randn(c, c, k, k, generator=gen, dtype=torch.float64)
        exact = conv_jacobian_norm(w, (stride, stride), (pad, pad), "circular", (n, n))
        fft = conv_norm(
            w, stride=stride, padding=pad, padding_mode="circular", input_size=n, method="fft"
        )
        assert exact <= fft <= worst * exact
        assert (
            conv_norm(w, stride=stride, padding=pad, padding_mode="circular", input_size=n) <= fft
        )


def test_conv_norm_circular_mixed_embeddings_stay_sound() -> None:
    """Each dimension picks its own circular embedding; every combination bounds the exact norm,
    including kernels built to be large on the rows the circulant superset adds."""
    gen = torch.Generator().manual_seed(5)
    for size, stride, pad, k in [((7, 8), (2, 2), (1, 1), 3), ((9, 6), (2, 3), (1, 2), 4)]:
        for trial in range(4):
            w = torch.randn(3, 2, k, k, generator=gen, dtype=torch.float64)
            if trial == 3:
                w = w.abs()  # all taps of one sign: the low frequency dominates
            exact = conv_jacobian_norm(w, stride, pad, "circular", size)
            fft = conv_norm(
                w,
                stride=stride,
                padding=pad,
                padding_mode="circular",
                input_size=size,
                method="fft",
            )
            assert exact <= fft


def test_conv_norm_tightness_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """Tightness (exact / bound) of the FFT and Frobenius methods over seeded random configs."""
    gen = torch.Generator().manual_seed(123)
    ratios: dict[str, list[float]] = {"fft": [], "frobenius": [], "min": []}
    stride1: list[float] = []
    count = 0
    while count < 60:
        cfg = {
            "c_out": int(torch.randint(1, 4, (), generator=gen)),
            "c_in": int(torch.randint(1, 4, (), generator=gen)),
            "kernel": tuple(int(v) for v in torch.randint(1, 6, (2,), generator=gen)),
            "stride": tuple(int(v) for v in torch.randint(1, 4, (2,), generator=gen)),
            "padding": tuple(int(v) for v in torch.randint(0, 3, (2,), generator=gen)),
            "mode": "circular" if bool(torch.rand((), generator=gen) < 0.5) else "zeros",
            "size": tuple(int(v) for v in torch.randint(3, 10, (2,), generator=gen)),
            "seed": int(torch.randint(0, 2**31 - 1, (), generator=gen)),
        }
        if not _valid(cfg):
            continue
        count += 1
        w = _kernel(cfg)
        exact = conv_jacobian_norm(w, cfg["stride"], cfg["padding"], cfg["mode"], cfg["size"])
        kwargs = {
            "stride": cfg["stride"],
            "padding": cfg["padding"],
            "padding_mode": cfg["mode"],
            "input_size": cfg["size"],
        }
        fft = conv_norm(w, method="fft", **kwargs)  # type: ignore[arg-type]
        frob = conv_norm(w, method="frobenius", **kwargs)  # type: ignore[arg-type]
        ratios["fft"].append(exact / fft)
        ratios["frobenius"].append(exact / frob)
        ratios["min"].append(exact / min(fft, frob))
        if cfg["stride"] == (1, 1):
            stride1.append(exact / conv_norm(w, method="fft", **kwargs))  # type: ignore[arg-type]
    with capsys.disabled():
        print("\nconv_norm tightness exact/bound over 60 random configs (1 = exact):")
        for method, values in ratios.items():
            print(f"  {method:9s} median {statistics.median(values):.3f}  worst {min(values):.3f}")
        med, worst = statistics.median(stride1), min(stride1)
        print(f"  fft, stride 1 only ({len(stride1)}): median {med:.3f} worst {worst:.3f}")
    assert all(r <= 1.0 for values in ratios.values() for r in values)
    assert statistics.median(ratios["min"]) > 0.8
    assert statistics.median(ratios["fft"]) > statistics.median(ratios["frobenius"])


def test_conv_norm_design_example_is_tight() -> None:
    """DESIGN.md: random 64x64x3x3 kernel, 32x32 inputs: FFT within 3% of power iteration."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, 3, 3, generator=gen)
    fft = conv_norm(w, padding=1, input_size=(32, 32), method="fft")
    frob = conv_norm(w, padding=1, input_size=(32, 32), method="frobenius")
    seeds = 3.0 * float(torch.linalg.vector_norm(w.double()))
    lower = conv_power_iteration(w, padding=1, input_size=32, iters=25, generator=gen).lower_bound
    assert lower <= fft <= lower * 1.03
    assert fft < frob < seeds
    assert conv_norm(w, padding=1, input_size=(32, 32)) == fft  # "auto" = min(fft, frobenius)
    assert seeds / fft > 8  # the seeds' bound is an order of magnitude looser


def test_conv_norm_accepts_ints_and_rejects_bad_input() -> None:
    w = torch.randn(2, 3, 3, 3)
    assert conv_norm(w, stride=1, padding=1, input_size=5) == conv_norm(
        w, stride=(1, 1), padding=(1, 1), input_size=(5, 5)
    )
    with pytest.raises(ValueError, match="4-D"):
        conv_norm(torch.ones(3, 3), input_size=4)
    with pytest.raises(ValueError, match="padding_mode"):
        conv_norm(w, input_size=4, padding_mode="reflect")
    with pytest.raises(ValueError, match="needs input_size"):
        conv_norm(w, input_size=None, method="fft")
    with pytest.raises(ValueError, match="smaller than the kernel"):
        conv_norm(w, input_size=2)
    with pytest.raises(ValueError, match="circular padding"):
        conv_norm(w, input_size=3, padding=4, padding_mode="circular")
    with pytest.raises(TypeError, match="stride"):
        conv_norm(w, input_size=4, stride=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        conv_norm(w * math.nan, input_size=4)


@settings(max_examples=200, deadline=None)
@given(conv_configs)
def test_conv_multiplicity_matches_brute_force(cfg: dict) -> None:
    if not _valid(cfg):
        return
    args = (cfg["kernel"], cfg["stride"], cfg["padding"], cfg["mode"])
    exact = conv_multiplicity(*args, cfg["size"])
    assert exact == brute_multiplicity(*args, cfg["size"])
    assert conv_multiplicity(*args, None) >= exact  # the size-free value holds for every size


def test_conv_multiplicity_size_free_values() -> None:
    assert conv_multiplicity(3, 1, 1, "zeros", None) == 9
    assert conv_multiplicity((5, 3), (2, 3), 0, "zeros", None) == 3
    assert conv_multiplicity(3, 1, 1, "circular", None) == 9  # stride 1, 2p <= k - 1
    assert conv_multiplicity(3, 3, 1, "circular", None) == 9  # wrap-around: 3 ceil(k/s) per dim
    assert conv_multiplicity(3, 3, 1, "circular", (4, 4)) == 4  # e.g. n = 4: 2 per dimension
    assert conv_multiplicity(3, 1, 1, "zeros", (1, 1)) == 1


# --------------------------------------------------------------------------- power iteration


def test_power_iteration_is_a_lower_bound() -> None:
    gen = torch.Generator().manual_seed(3)
    mat = torch.randn(40, 25, generator=gen, dtype=torch.float64)
    exact = exact_norm(mat)
    few = power_iteration(mat, iters=2, generator=gen)
    many = power_iteration(mat, iters=200, init=few.vector)
    assert few.lower_bound <= exact * (1 + 1e-12)
    assert many.lower_bound <= exact * (1 + 1e-12)
    assert many.lower_bound == pytest.approx(exact, rel=1e-6)
    w = torch.randn(2, 3, 3, 3, generator=gen, dtype=torch.float64)
    for mode in ("zeros", "circular"):
        exact_conv = conv_jacobian_norm(w, (2, 1), (1, 1), mode, (6, 5))
        est = conv_power_iteration(
            w,
            stride=(2, 1),
            padding=1,
            padding_mode=mode,
            input_size=(6, 5),
            iters=100,
            generator=gen,
        )
        assert est.lower_bound <= exact_conv * (1 + 1e-12)
        assert est.lower_bound == pytest.approx(exact_conv, rel=1e-3)
    with pytest.raises(ValueError, match="input_shape"):
        power_iteration(lambda v: v)


def test_column_major_weights_certify_as_row_major() -> None:
    """A weight stored transposed (from a QR factor, a ``.mT`` view) takes the fast reduction
    path and gets exactly the bound of its row-major copy; non-finite entries are still caught."""
    mat = _with_singular_values(150, 120, 1.0 - torch.linspace(0, 0.5, 120), 41)
    col_major = mat.mT.contiguous().mT
    assert not col_major.is_contiguous() and torch.equal(col_major, mat)
    exact = exact_norm(mat)
    for method in ("cholesky", "auto"):
        bound = dense_norm(col_major, method=method)  # type: ignore[arg-type]
        assert bound == dense_norm(mat.contiguous(), method=method)  # type: ignore[arg-type]
        assert exact <= bound <= exact * (1 + 5e-6)
    for bad in (math.nan, math.inf, -math.inf):
        broken = col_major.clone(memory_format=torch.preserve_format)
        broken[3, 7] = bad
        assert not broken.is_contiguous()
        assert not norms.all_finite(broken)
        with pytest.raises(ValueError, match="finite"):
            dense_norm(broken)


def test_max_spectral_norm_is_certified_on_complex_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-frequency bound (complex Cholesky certificate at a common level; the threshold is
    lowered from 48 to 16 so that these sides take it) is
    never below the exact largest singular value, and within 2e-6 of it (the level's lift of
    3e-6 on ||.||^2), on adversarial complex matrices (clustered top, huge condition number,
    rank one, wide and tall)."""
    monkeypatch.setattr(norms, "_CONV_EIGH_MAX_DIM", 16)
    gen = torch.Generator().manual_seed(61)
    mats = []
    for rows, cols, sv in (
        (40, 30, 1.0 - torch.logspace(-15, -1, 30)),
        (30, 40, torch.logspace(0, -15, 30)),
        (50, 20, torch.eye(20)[0] * 7.0),
        (25, 25, torch.ones(25)),
    ):
        u = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.complex128, generator=gen))[0]
        v = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.complex128, generator=gen))[0]
        k = min(rows, cols)
        s = torch.zeros(rows, cols, dtype=torch.complex128)
        s[range(k), range(k)] = sv.to(torch.complex128)
        mats.append(u @ s @ v.mH)
    for m in mats:
        exact = float(torch.linalg.matrix_norm(m, ord=2))
        bound = norms._max_spectral_norm(m[None])
        assert exact <= bound <= exact * (1 + 2e-6), bound / exact - 1
    batch = torch.stack(
        [torch.nn.functional.pad(m, (0, 40 - m.shape[1], 0, 50 - m.shape[0])) for m in mats]
    )
    exact = float(torch.linalg.matrix_norm(batch, ord=2).max())
    assert exact <= norms._max_spectral_norm(batch) <= exact * (1 + 2e-6)


@pytest.mark.parametrize("exponent", [-1060, -1000, -600, 0, 512, 600, 1000])
def test_gram_iteration_is_sound_at_every_float64_scale(exponent: int) -> None:
    """Audit finding: entries beyond 2^+-512 made the first Frobenius norm inf or 0 and the
    certified bound 0. Power-of-two pre-scaling keeps it above the exact norm at every scale."""
    base = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mats = base * 2.0**exponent  # subnormal entries at -1060: the reference scales them back
    half = -exponent // 2
    exact = torch.linalg.matrix_norm(mats * 2.0**half * 2.0 ** (-exponent - half), ord=2)
    for iters in (0, 1, 3, 6):
        bound = norms.gram_iteration(mats, iters)
        if exponent < -1000:  # a subnormal norm is bounded by the smallest normal number
            assert bool((bound == 2.0**-1022).all())
            continue
        scaled = bound * 2.0 ** (-exponent)  # exact: both are normal numbers
        assert bool((scaled >= exact).all())
        assert bool((scaled <= exact * 3.0).all())  # rank 5: at most sqrt(5) loose at iters 0


@pytest.mark.parametrize("shape", [(300, 200), (200, 300), (129, 64), (1000, 70)])
def test_cholesky_norm_over_blocks_of_rows(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int]
) -> None:
    """The float64 copy of W is made 64+ rows at a time and the Gram product accumulated over
    the blocks: the same certificate up to the order of the sums (last bits), never below the
    exact norm, including when a failed level forms the Gram matrix again."""
    mat = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) / 10
    exact = exact_norm(mat)
    whole = dense_norm(mat, method="cholesky")
    monkeypatch.setattr(norms, "_GRAM_BLOCK_BYTES", 1)  # 64 rows per block
    blocked = dense_norm(mat, method="cholesky")
    assert exact <= blocked <= exact * (1 + 1e-5)
    assert blocked == pytest.approx(whole, rel=1e-14)
    e = -math.frexp(float(mat.abs().max()))[1] + 1
    low = norms._Estimate(exact**2 * 4.0**e * (1 - 1e-3), None)  # the first two lifts fail
    monkeypatch.setattr(norms, "_top_eigenvalue_estimate", lambda g, v0=None: low)
    result = norms._cholesky_norm(mat)
    assert result is not None
    assert exact <= result[0] <= exact * 1.006


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accelerator_certificate_is_certified_on_adversarial_matrices(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The matrix-products certificate (what "auto" runs off the CPU) never falls below the exact
    norm, and stays within 0.3% of it on these spectra (all equal: exact through Hoelder)."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    for name, mat in _adversarial(dtype):
        exact = exact_norm(mat)
        bound = dense_norm(mat)
        assert exact <= bound <= exact * 1.003, (name, bound / exact - 1)
    with pytest.raises(ValueError, match="finite"):
        dense_norm(torch.tensor([[1.0, float("nan")]], dtype=dtype))


def test_gram_bounds_mark_non_finite_matrices_infinite_without_a_host_read() -> None:
    mats = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mats[1, 2, 3] = float("inf")
    mats[2, 0, 0] = float("nan")
    bounds = norms._gram_bounds(mats, 6)
    assert math.isinf(float(bounds[1])) and math.isinf(float(bounds[2]))
    assert exact_norm(mats[0]) <= float(bounds[0]) <= exact_norm(mats[0]) * 1.001


@pytest.mark.parametrize("exponent", [-149, -140, -100, 0, 100, 120])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_gram_bounds_of_narrow_matrices_need_no_scaling(exponent: int, dtype: torch.dtype) -> None:
    """Float32 / complex64 entries go into the Gram iteration without the power-of-two scaling
    (their float64 squares neither overflow nor underflow): still >= the exact norm at float32's
    extreme magnitudes (subnormal 2^-149 to near 2^128), and inf for a NaN or inf entry."""
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(4, 7, 5, generator=gen, dtype=torch.float64)
    if dtype.is_complex:
        base = torch.complex(base, torch.randn(4, 7, 5, generator=gen, dtype=torch.float64))
    mats = (base * 2.0**exponent).to(dtype)
    # the exact norm of the stored entries, computed after an exact power-of-two scaling
    exact = torch.linalg.matrix_norm(mats.to(torch.complex128) * 2.0 ** (-exponent), ord=2)
    for iters in (0, 2, 6):
        bound = norms._gram_bounds(mats, iters) * 2.0 ** (-exponent)
        assert bool((bound >= exact * (1 - 1e-14)).all()), iters
        assert bool((bound <= exact * 3.0).all())
    mats[1, 2, 3] = float("inf")
    mats[2, 0, 0] = float("nan")
    bounds = norms._gram_bounds(mats, 6)
    assert math.isinf(float(bounds[1])) and math.isinf(float(bounds[2]))
    assert math.isfinite(float(bounds[0])) and math.isfinite(float(bounds[3]))
