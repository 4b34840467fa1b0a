"""The FFT certificate of :func:`clipless.norms.conv_norm` by complex Cholesky factorisations.

``_max_spectral_norm`` certifies ``max_f ||K(f)||_2`` over the per-frequency complex matrices of
a convolution: one Gram product per frequency and one complex Cholesky factorisation of
``c^2 I - fl(K(f)^H K(f))`` at a common level (``_cholesky_max_norm``; sides > 48), or one
batched ``eigvalsh`` (sides <= 48). Every test here but the one on small sides lowers that
threshold to 16, so that the Cholesky path runs on matrices small enough for exact references
(explicit Jacobians) to stay cheap. References: exact singular values (LAPACK SVD) of the
matrices themselves, and of the explicit Jacobian of ``F.conv2d``. Tightness stated and pinned:
the bound is within ``2e-6`` (relative) of the exact value (the common level is lifted by
``3e-6`` above the steering estimate of ``||.||^2``, i.e. ``1.5e-6`` on the norm).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from clipless import norms
from clipless.norms import conv_norm

TIGHT = 2e-6  # bound / exact - 1 of the Cholesky certificate


@pytest.fixture(autouse=True)
def _one_thread_cholesky_from_17(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(norms, "_CONV_EIGH_MAX_DIM", 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _complex_with_singular_values(
    rows: int, cols: int, sv: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    u = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.complex128, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.complex128, generator=gen))[0]
    s = torch.zeros(rows, cols, dtype=torch.complex128)
    k = min(rows, cols)
    s[range(k), range(k)] = sv[:k].to(torch.complex128)
    return u @ s @ v.mH


def _tall(batch: torch.Tensor) -> torch.Tensor:
    """A complex batch made tall (transposed if wide: same singular values), contiguous."""
    if batch.shape[-2] < batch.shape[-1]:
        batch = batch.mT
    return batch.contiguous()


def _exact_max(batch: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(batch.to(torch.complex128), ord=2).max())


def _batches() -> list[tuple[str, torch.Tensor]]:
    """Adversarial batches of per-frequency matrices (sides > 16: the Cholesky path)."""
    gen = torch.Generator().manual_seed(7)
    rows, cols, f = 40, 30, 12
    out = []
    # Near-degenerate top singular values ACROSS frequencies: the maximum is ambiguous to 1e-15.
    gaps = [0.0, 1e-15, 1e-13, 1e-11, 1e-9, 1e-7, 1e-6, 3e-6, 1e-5, 1e-4, 1e-3, 1e-2]
    out.append(
        (
            "tied across frequencies",
            torch.stack(
                [
                    _complex_with_singular_values(
                        rows, cols, torch.linspace(1.0 - g, 0.2, cols), gen
                    )
                    for g in gaps
                ]
            ),
        )
    )
    # ... and within each frequency (clustered top).
    top = 1.0 - torch.logspace(-15, -1, cols)
    out.append(
        (
            "clustered within and across",
            torch.stack(
                [_complex_with_singular_values(rows, cols, top * (1 - g), gen) for g in gaps]
            ),
        )
    )
    # One frequency dominates, the others are tiny; the dominating one is last.
    dom = [_complex_with_singular_values(rows, cols, torch.rand(cols, generator=gen), gen)]
    dom = dom * (f - 1) + [_complex_with_singular_values(rows, cols, torch.ones(cols) * 50, gen)]
    out.append(("one dominates", torch.stack(dom)))
    # Huge condition numbers, rank one, unitary (all singular values equal), wide matrices.
    out.append(
        (
            "cond 1e15",
            torch.stack(
                [
                    _complex_with_singular_values(rows, cols, torch.logspace(0, -15, cols), gen)
                    for _ in range(f)
                ]
            ),
        )
    )
    out.append(
        (
            "rank one",
            torch.stack(
                [
                    _complex_with_singular_values(rows, cols, torch.eye(cols)[0] * (1 + i), gen)
                    for i in range(f)
                ]
            ),
        )
    )
    out.append(
        (
            "unitary",
            torch.stack(
                [_complex_with_singular_values(cols, cols, torch.ones(cols), gen) for _ in range(f)]
            ),
        )
    )
    out.append(
        (
            "wide",
            torch.stack(
                [
                    _complex_with_singular_values(cols, rows, torch.linspace(2, 1, cols), gen)
                    for _ in range(f)
                ]
            ),
        )
    )
    # Zero frequencies next to non-zero ones.
    zeros = torch.stack(
        [_complex_with_singular_values(rows, cols, torch.linspace(1, 0.5, cols), gen)] * 3
        + [torch.zeros(rows, cols, dtype=torch.complex128)] * 3
    )
    out.append(("some zero", zeros))
    return out


@pytest.mark.parametrize(("name", "batch"), _batches(), ids=[n for n, _ in _batches()])
def test_cholesky_certificate_is_certified_and_tight(name: str, batch: torch.Tensor) -> None:
    exact = _exact_max(batch)
    bound = norms._max_spectral_norm(batch)
    assert exact <= bound <= exact * (1 + TIGHT), (name, bound / exact - 1)
    # The same through the Cholesky routine itself (no eigvalsh fallback needed here).
    calls: list[int] = []
    original = norms._eigh_certificate

    def spy(*args: object) -> float:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    try:
        norms._eigh_certificate = spy  # type: ignore[assignment]
        direct = norms._cholesky_max_norm(_tall(batch))
    finally:
        norms._eigh_certificate = original
    assert direct == bound or exact <= direct <= exact * (1 + TIGHT)
    assert not calls, (name, len(calls))


def test_complex64_batches_are_certified() -> None:
    gen = torch.Generator().manual_seed(8)
    batch = torch.stack(
        [
            _complex_with_singular_values(36, 24, torch.linspace(1, 0.1, 24) * (1 + 1e-7 * i), gen)
            for i in range(6)
        ]
    ).to(torch.complex64)
    exact = _exact_max(batch)  # of the complex64 values, exactly widened
    assert exact <= norms._max_spectral_norm(batch) <= exact * (1 + TIGHT)


@pytest.mark.parametrize("exponent", [-1060, -1000, -300, 300, 1000])
def test_extreme_scales(exponent: int) -> None:
    """Components near the subnormal range, beyond the 2^(+-256) window (scaled exactly by a
    power of two first) and near overflow."""
    gen = torch.Generator().manual_seed(9)
    base = torch.stack(
        [_complex_with_singular_values(30, 20, torch.linspace(1.0, 0.1, 20), gen) for _ in range(4)]
    )
    half = exponent // 2
    batch = base * 2.0**half * 2.0 ** (exponent - half)
    back = batch * 2.0 ** (-half) * 2.0 ** (-(exponent - half))  # exact: scaling up
    exact = _exact_max(back) * 2.0**exponent if exponent < 0 else _exact_max(base) * 2.0**exponent
    bound = norms._max_spectral_norm(batch)
    assert exact <= bound <= exact * (1 + TIGHT) + 2.0**-1000


def test_all_zero_and_empty() -> None:
    assert norms._max_spectral_norm(torch.zeros(5, 20, 18, dtype=torch.complex128)) == 0.0
    assert norms._max_spectral_norm(torch.zeros(0, 20, 18, dtype=torch.complex128)) == 0.0
    assert conv_norm(torch.zeros(24, 20, 3, 3), padding=1, input_size=6, method="fft") == 0.0


def test_small_sides_take_one_batched_eigvalsh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sides <= 48 (the default threshold): one batched eigvalsh, within NUMERIC_MARGIN-scale
    of the exact value; the Cholesky routine is not called."""
    monkeypatch.setattr(norms, "_CONV_EIGH_MAX_DIM", 48)
    monkeypatch.setattr(norms, "_cholesky_max_norm", None)  # would raise if called
    gen = torch.Generator().manual_seed(10)
    for rows, cols in ((3, 2), (16, 40), (30, 16), (1, 5), (60, 48)):
        batch = torch.stack(
            [
                _complex_with_singular_values(
                    rows, cols, torch.linspace(1.0 - 1e-12 * i, 0.5, min(rows, cols)), gen
                )
                for i in range(50)
            ]
        )
        exact = _exact_max(batch)
        assert exact <= norms._max_spectral_norm(batch) <= exact * (1 + 1e-8)


# ------------------------------------------------------------------- the level only steers


def _gram_and_lambda(seed: int) -> tuple[object, float, norms._Rounding]:
    gen = torch.Generator().manual_seed(seed)
    a = _complex_with_singular_values(50, 40, 1.0 - torch.linspace(0, 0.5, 40), gen)
    gram = norms._tall_gram(a)
    return gram, float(torch.linalg.matrix_norm(a, ord=2)) ** 2, norms._rounding(50, 40)


def test_a_level_below_the_truth_fails_or_still_certifies() -> None:
    """Below ``lambda_max`` the complex factorisation breaks down, or what it certifies (with
    the rounding terms) is still above ``lambda_max``; far above, it certifies that level."""
    gram, lam, rnd = _gram_and_lambda(11)
    for rel in (1e-1, 1e-4, 1e-8, 1e-11, 1e-13, 1e-15, 0.0):
        result = norms._certify_level(gram, lam * (1 - rel), rnd)  # type: ignore[arg-type]
        if rel >= 1e-8:
            assert result is None, rel  # c^2 I - A^H A is clearly indefinite
        if result is not None:
            assert result >= lam, rel
    high = norms._certify_level(gram, 2.25 * lam, rnd)  # type: ignore[arg-type]
    assert high is not None
    assert high == pytest.approx(2.25 * lam, rel=1e-9)
    just_above = norms._certify_level(gram, lam * (1 + 1e-9), rnd)  # type: ignore[arg-type]
    assert just_above is not None and lam <= just_above <= lam * (1 + 2e-9)


def test_wrong_steering_is_caught_and_grams_are_not_recomputed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ranking that misses the top frequency and a refined estimate below the truth: the
    factorisations at the too-low level fail, the missed frequencies are certified on their own
    (a retry at their own level, then eigvalsh), and every Gram product is formed once."""
    batch = _batches()[0][1]  # tied across frequencies
    exact = _exact_max(batch)
    grams: list[int] = []
    fallbacks: list[int] = []
    original_gram, original_eigh = norms._tall_gram, norms._eigh_certificate

    def counting_gram(mat: torch.Tensor) -> object:
        grams.append(1)
        return original_gram(mat)

    def counting_eigh(*args: object) -> float:
        fallbacks.append(1)
        return original_eigh(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(norms, "_tall_gram", counting_gram)
    monkeypatch.setattr(norms, "_eigh_certificate", counting_eigh)
    # Rank the frequencies backwards (the truly largest last), and aim 10% low everywhere.
    original_lanczos = norms._lanczos_top
    monkeypatch.setattr(norms, "_lanczos_top", lambda g, steps: -float(abs(g).sum()))
    original_refined = norms._refined_estimate
    monkeypatch.setattr(norms, "_refined_estimate", lambda g: 0.9 * original_refined(g))
    bound = norms._cholesky_max_norm(_tall(batch))
    assert exact <= bound <= exact * (1 + TIGHT)
    assert len(grams) == batch.shape[0]
    assert fallbacks  # the 10%-low own levels failed too: eigvalsh certified those
    # An estimate far above the truth is certified as such: the bound never rests on it.
    monkeypatch.setattr(norms, "_lanczos_top", original_lanczos)
    monkeypatch.setattr(norms, "_refined_estimate", lambda g: 4.0 * original_refined(g))
    high = norms._cholesky_max_norm(_tall(batch))
    assert high == pytest.approx(2.0 * exact, rel=1e-5)


# -------------------------------------------------------------- convolutions, explicit Jacobian


def _jacobian_norm(
    w: torch.Tensor, stride: int, padding: int, mode: str, size: tuple[int, int]
) -> float:
    c_in = w.shape[1]
    d = c_in * size[0] * size[1]
    basis = torch.eye(d, dtype=torch.float64).reshape(d, c_in, *size)
    if mode == "circular":
        basis = F.pad(basis, (padding,) * 4, mode="circular")
        out = F.conv2d(basis, w.double(), stride=stride)
    else:
        out = F.conv2d(basis, w.double(), stride=stride, padding=padding)
    return float(torch.linalg.matrix_norm(out.reshape(d, -1), ord=2))


def _einsum_symbol(
    w: torch.Tensor, dims: tuple[object, object], strides: tuple[int, int]
) -> torch.Tensor:
    """Reference: the polyphase kernel assembled tap by tap and its DFT as two complex einsums,
    shape ``(Nh, Nw // 2 + 1, c_out, c_in sh sw)``."""
    c_out, c_in, kh, kw = (int(d) for d in w.shape)
    ph, pw = dims
    sh, sw = strides
    span_h, span_w = max(ph.shift) + 1, max(pw.shift) + 1  # type: ignore[attr-defined]
    poly = torch.zeros((c_out, c_in, sh, sw, span_h, span_w), dtype=torch.float64)
    for jh in range(kh):
        for jw in range(kw):
            index = (ph.phase[jh], pw.phase[jw], ph.shift[jh], pw.shift[jw])  # type: ignore[attr-defined]
            poly[(slice(None), slice(None), *index)] = w[:, :, jh, jw].double()
    poly = poly.reshape(c_out, c_in * sh * sw, span_h, span_w).to(torch.complex128)
    e_h = norms._phases(ph.grid, ph.grid, span_h, poly.device)  # type: ignore[attr-defined]
    e_w = norms._phases(pw.grid, pw.grid // 2 + 1, span_w, poly.device)  # type: ignore[attr-defined]
    partial = torch.einsum("oiab,wb->oiaw", poly, e_w)
    return torch.einsum("oiaw,ha->hwoi", partial, e_h).contiguous()


def _symbol_max(w: torch.Tensor, stride: int, padding: int, mode: str, n: int) -> float:
    dims = (norms._polyphase_1d(n, w.shape[2], stride, padding, mode == "circular"),) * 2
    sym = _einsum_symbol(w, dims, (stride, stride))
    factor = math.sqrt(dims[0].duplication * dims[1].duplication * dims[0].copies ** 2)
    return _exact_max(sym.reshape(-1, *sym.shape[-2:])) * factor


@pytest.mark.parametrize(("c_out", "c_in", "stride"), [(24, 18, 1), (10, 30, 1), (20, 6, 2)])
def test_symbol_matrices_match_the_einsum_symbol(c_out: int, c_in: int, stride: int) -> None:
    """The flat tall symbol (one real matrix product) is the tap-by-tap einsum symbol, to
    rounding, in the orientation k >= n (transposed when c_out < c_in s^2)."""
    w = torch.randn(c_out, c_in, 3, 3, generator=torch.Generator().manual_seed(14))
    dims = (
        norms._polyphase_1d(7, 3, stride, 1, False),
        norms._polyphase_1d(6, 3, stride, 1, False),
    )
    sym = _einsum_symbol(w, dims, (stride, stride))
    sym = sym.reshape(-1, *sym.shape[-2:])
    flat = norms._symbol_matrices(w, dims, (stride, stride))
    expect = _tall(sym)
    assert flat.shape == expect.shape
    assert flat.shape[-2] >= flat.shape[-1]
    assert torch.allclose(flat, expect, rtol=0, atol=1e-13 * float(w.abs().max()))


def _orthogonal(n: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed)))[0]


def _kernels() -> list[tuple[str, torch.Tensor, int, int, str, int]]:
    gen = torch.Generator().manual_seed(12)
    q = _orthogonal(24, 13).double()
    centre = torch.zeros(24, 24, 3, 3, dtype=torch.float64)
    centre[:, :, 1, 1] = q
    sign = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0], [1.0, -1.0, 1.0]])
    u = torch.randn(20, 1, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 18, generator=gen, dtype=torch.float64)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    near_rank_one = (u @ v)[:, :, None, None] * torch.ones(3, 3, dtype=torch.float64)
    return [
        ("random 24x18 zeros", r(24, 18, 3, 3).float(), 1, 1, "zeros", 5),
        ("random stride 2", r(20, 5, 3, 3), 2, 1, "zeros", 6),
        ("random circular same", r(18, 20, 3, 3), 1, 1, "circular", 5),
        ("circular stride 2", r(20, 6, 3, 3).float(), 2, 1, "circular", 6),
        # every frequency has the same top singular value (1x1-like orthogonal kernel) ...
        ("orthogonal centre tap", centre + 1e-9 * r(24, 24, 3, 3), 1, 1, "circular", 4),
        # ... one frequency (the checkerboard) dominates ...
        ("checkerboard", (r(20, 18, 1, 1) * sign).float(), 1, 1, "circular", 4),
        # ... and a near rank-one kernel (condition number ~1e12).
        ("near rank one", near_rank_one + 1e-12 * r(20, 18, 3, 3), 1, 1, "zeros", 5),
        ("tiny scale", r(24, 18, 3, 3) * 1e-200, 1, 1, "zeros", 4),
        ("huge scale", r(24, 18, 3, 3) * 1e200, 1, 1, "circular", 4),
    ]


@pytest.mark.parametrize(
    ("name", "w", "stride", "padding", "mode", "n"), _kernels(), ids=[k[0] for k in _kernels()]
)
def test_conv_fft_certificate_against_the_explicit_jacobian(
    name: str, w: torch.Tensor, stride: int, padding: int, mode: str, n: int
) -> None:
    kw = {"stride": stride, "padding": padding, "padding_mode": mode, "input_size": n}
    fft = conv_norm(w, method="fft", **kw)  # type: ignore[arg-type]
    exact = _jacobian_norm(w, stride, padding, mode, (n, n))
    symbol = _symbol_max(w, stride, padding, mode, n)
    assert exact <= fft, name
    assert symbol <= fft <= symbol * (1 + TIGHT), (name, fft / symbol - 1)
    if mode == "circular" and stride == 1 and 2 * padding == w.shape[2] - 1:
        assert fft <= exact * (1 + TIGHT), (name, fft / exact - 1)  # the symbol is exact here
    assert conv_norm(w, **kw) <= fft  # type: ignore[arg-type]  # "auto": min(fft, frobenius)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("name", "w", "stride", "padding", "mode", "n"), _kernels(), ids=[k[0] for k in _kernels()]
)
def test_accelerator_conv_certificate_against_the_explicit_jacobian(
    name: str,
    w: torch.Tensor,
    stride: int,
    padding: int,
    mode: str,
    n: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What "auto" runs off the CPU (batched Gram iteration of the frequency matrices, of the
    explicit matrix for small layers) is never below the exact norm and within 1% of "fft"."""
    w = w.to(dtype)
    if not bool(torch.isfinite(w).all()):
        pytest.skip(f"{name} is not representable in {dtype}")
    kw = {"stride": stride, "padding": padding, "padding_mode": mode, "input_size": n}
    exact = _jacobian_norm(w.double(), stride, padding, mode, (n, n))
    fft_cpu = conv_norm(w, method="fft", **kw)  # type: ignore[arg-type]
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    fft = conv_norm(w, method="fft", **kw)  # type: ignore[arg-type]
    auto = conv_norm(w, **kw)  # type: ignore[arg-type]
    assert exact <= fft <= fft_cpu * 1.01, (name, fft / fft_cpu - 1)
    assert exact <= auto <= exact * 1.01 or auto <= fft, (name, auto / exact - 1)


@pytest.mark.parametrize(
    ("c_out", "c_in", "stride", "padding", "circular"),
    [(24, 18, 1, 1, False), (10, 30, 1, 0, False), (20, 6, 2, 1, False), (8, 5, 2, 1, True)],
)
def test_the_accelerator_symbol_is_the_einsum_symbol(
    c_out: int, c_in: int, stride: int, padding: int, circular: bool
) -> None:
    """_symbol_tensor (one real product with the cached tap phases) equals the complex einsum
    symbol to rounding, for every grid of the geometry, and the cache returns the same table."""
    w = torch.randn(c_out, c_in, 3, 3, generator=torch.Generator().manual_seed(15))
    for dims, decimation, _ in norms._grids(w, (stride, stride), (padding,) * 2, circular, (7, 6)):
        sym = _einsum_symbol(w, dims, decimation)
        expect = sym.reshape(-1, *sym.shape[-2:])
        got = norms._symbol_tensor(w, dims, decimation)
        assert got.shape == expect.shape and got.dtype == torch.complex128
        assert torch.allclose(got, expect, rtol=0, atol=1e-13 * float(w.abs().max()))
        table = norms._tap_phases((3, 3), dims, decimation, w.device)
        assert norms._tap_phases((3, 3), dims, decimation, w.device) is table


@pytest.mark.parametrize("exponent", [-149, -140, -120, -60, 0, 60, 120])
@pytest.mark.parametrize(("stride", "padding", "mode"), [(1, 1, "zeros"), (2, 1, "circular")])
def test_the_unscaled_float32_symbol_at_float32_extremes(
    exponent: int, stride: int, padding: int, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The accelerator's FFT certificate of a float32 kernel (its symbol not scaled before the
    Gram iteration) stays >= the exact norm, from subnormal taps to taps near 2^128; the exact
    norm is that of the float64 Jacobian of the kernel scaled exactly by 2^-exponent."""
    gen = torch.Generator().manual_seed(16)
    w = (torch.randn(6, 4, 3, 3, generator=gen, dtype=torch.float64) * 2.0**exponent).float()
    if exponent == -149:
        w[0, 0, 0, 0] = 2.0**-149  # at least one non-zero subnormal tap
    kw = {"stride": stride, "padding": padding, "padding_mode": mode, "input_size": 7}
    unit = w.double() * 2.0 ** (-exponent)  # exact, float64: the scaled path
    exact = _jacobian_norm(unit, stride, padding, mode, (7, 7))
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    fft = conv_norm(w, method="fft", **kw)  # type: ignore[arg-type]
    scaled = fft * 2.0 ** (-exponent)  # exact: a power of two
    assert exact <= scaled
    assert scaled == pytest.approx(conv_norm(unit, method="fft", **kw), rel=1e-12)  # type: ignore[arg-type]
