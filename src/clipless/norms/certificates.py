"""Certified rounding and the Gram-matrix certificates the norms are built from.

The primitives every certificate of :mod:`clipless.norms` uses: the relative margin
:data:`NUMERIC_MARGIN` (with the argument for its size), finiteness checks, the choice between the
CPU's factorisations and an accelerator's matrix products (:func:`matrix_products_only`), and the
certified ``max_i ||A_i||_2`` over a batch of complex matrices (:func:`_max_norm_tall`: one Gram
product and one complex Cholesky factorisation per matrix at a common level, or one batched
``eigvalsh``), the certificate of a convolution's per-frequency matrices. Each certificate's
precondition, claim and proof are in its constructor's docstring.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from clipless import _certified
from clipless._certified import UNIT_ROUNDOFF, inflate
from clipless._certified import gamma as _gamma

if TYPE_CHECKING:
    import numpy as np

NUMERIC_MARGIN: float = _certified.NUMERIC_MARGIN
"""Relative inflation applied to every certified bound computed with floating-point linear algebra.

Why ``1e-9`` suffices in float64 (unit roundoff ``u = 2**-53 ~ 1.1e-16``):

* *SVD.* LAPACK's SVD is backward stable: the computed singular values are the exact singular
  values of ``A + E`` with ``||E||_2 <= p(m, n) u ||A||_2`` and ``p`` a modest multiple of
  ``max(m, n)``. By Weyl's inequality the computed largest singular value is within
  ``p(m, n) u`` (relative) of the true one: below ``1e-10`` for every ``max(m, n) <= 10**5``.
* *Symbol (DFT).* The per-frequency matrices ``K(f) = sum_a P_a w(f)^a`` of :func:`conv_norm`
  are evaluated directly from the few kernel taps ``P_a``: the phases of each dimension are
  computed from ``(f a mod N) / N`` with error ``<= 4u``, their product (the 2-D phase) with
  error ``<= 14u``, and each real or imaginary component of an entry is a sum over the ``t`` taps
  (error ``gamma_t`` relative to the sum of moduli), so every entry is off by at most
  ``2 (t + 10) u sum_a |P_a|`` and ``||K~(f) - K(f)||_2 <= 2 (t + 10) u sum_a ||P_a||_F <=
  2 (t + 10) u sqrt(t) ||P||_F``, while ``max_f ||K(f)||_2 >= ||P||_F / sqrt(min(c_out, c_in'))``
  (Parseval): relative error ``<= 2 (t + 10) u sqrt(t min(c_out, c_in'))``, below ``1e-11`` for
  every practical layer (``t = 49`` taps and 4096 channels: ``6e-12``).
* *Gram matrices, sums.* Forming ``A^H A`` perturbs it by ``gamma_k ||A||_F^2 <=
  k r u ||A||_2^2`` (inner dimension ``k``, rank ``r``); small for the per-frequency matrices here.
  The Gram *iteration* of large matrices gets its own a-priori factor
  (:func:`_gram_rounding_factor`), so the margin is never stretched by matrix size there.

Converting float32 weights to float64 is exact, so the bounds certify the float32 weights the
network actually uses.
"""

ACCELERATOR_PATH_ON_CPU = False
"""Certify by matrix products on the CPU as on an accelerator (profiling only; slower there)."""

_TINY = 2.0**-1022  # smallest normal float64: absolute allowance for underflow

_SAFE_EXPONENT = 256  # no 2^e scaling while the largest component is within 2^(+-256)


def all_finite(t: torch.Tensor) -> bool:
    """``torch.isfinite(t).all()``, through one ``aminmax`` reduction (no boolean temporary).

    NaN propagates through ``min``/``max`` and an infinite entry is the minimum or the maximum,
    so both extremes are finite exactly when every entry is. About 10x faster than
    ``isfinite(t).all()`` on a million float entries; complex tensors use the real view.
    """
    if t.numel() == 0:
        return True
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if not t.is_floating_point():
        return True
    lo, hi = _aminmax(t.detach())
    return bool(torch.isfinite(torch.stack((lo, hi))).all())


def _aminmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.aminmax`` of a matrix stored in either order.

    ``torch.aminmax`` is ~40x slower on a transposed (column-major) matrix than on a row-major one
    (torch 2.x CPU: 17 ms against 0.35 ms for 1024 x 1024 float64, e.g. a weight built from a QR
    factor or a ``.mT`` view); the minimum and maximum do not depend on the order, so a
    transposed matrix is reduced through its row-major transpose.
    """
    if t.dim() >= 2 and not t.is_contiguous() and t.mT.is_contiguous():
        t = t.mT
    return torch.aminmax(t)


def matrix_products_only(t: torch.Tensor) -> bool:
    """Whether ``"auto"`` certifies ``t``'s norms by matrix products alone (Gram iteration).

    Off the CPU (CUDA, MPS, ...): an accelerator multiplies matrices at full speed but runs
    eigen-decompositions, SVDs and factorisations slowly, with host synchronisations (measured on
    an H200: one float64 ``eigvalsh`` of a 1024-square Gram matrix ~8 ms, against ~0.05 ms for a
    product of that size), so Gram iteration is the faster certificate there. On the CPU the
    Cholesky certificate costs about one Gram product plus a third, far less than the ~12
    products of a tight Gram iteration. :data:`ACCELERATOR_PATH_ON_CPU` forces the accelerator
    path on the CPU (benchmarks use it to profile what a GPU step runs).
    """
    return ACCELERATOR_PATH_ON_CPU or t.device.type != "cpu"


def _inflated(t: torch.Tensor) -> torch.Tensor:
    """``t (1 + NUMERIC_MARGIN)`` as a tensor; the extra ``4u`` covers the product's rounding."""
    return t * ((1.0 + NUMERIC_MARGIN) * (1.0 + 4.0 * UNIT_ROUNDOFF))


def _as_tensor(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64, device=like.device)


_CONV_EIGH_MAX_DIM = 48  # per-frequency Gram side up to which "fft" takes one batched eigvalsh
_CONV_LANCZOS_STEPS = 10  # Lanczos steps per frequency to rank the frequencies (steering only)
_CONV_CANDIDATES = 3  # frequencies whose refined estimate sets the common level
_CONV_REFINE_EIGH_MAX_DIM = 128  # refined estimate by eigvalsh up to this side, else Lanczos
_CONV_REFINE_STEPS = 40  # Lanczos steps of a refined estimate
_CONV_CHOLESKY_LIFT = 3e-6  # relative lift of the common level above the steering eigenvalue


def _lanczos_top(gram: np.ndarray, steps: int) -> float:
    """Largest Ritz value of a short Lanczos run on a Hermitian matrix (steering only).

    ``gram`` is a complex128 NumPy array (Fortran order) of which only the upper triangle is read
    (BLAS ``zhemv``). A Ritz value is a Rayleigh quotient, so up to rounding it is a *lower*
    estimate of ``lambda_max``; it only ranks the frequencies for :func:`_cholesky_max_norm`.
    The start vector is a fixed pseudo-random one: the same matrix always gets the same value.
    """
    import numpy as np
    from scipy.linalg import blas

    n = int(gram.shape[0])
    k = min(steps, n)
    rng = np.random.default_rng(0x5EED + n)
    q = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    q /= np.linalg.norm(q)
    basis = np.zeros((k, n), dtype=np.complex128)
    alpha = np.zeros(k)
    beta = np.zeros(k)
    m = k
    for j in range(k):
        basis[j] = q
        w = blas.zhemv(1.0, gram, q, lower=0)
        coef = basis[: j + 1].conj() @ w  # full reorthogonalisation (classical Gram-Schmidt)
        alpha[j] = coef[j].real
        w -= coef @ basis[: j + 1]
        b = float(np.linalg.norm(w))
        if j == k - 1 or not b > 1e-12 * max(abs(alpha[j]), 1e-300):
            m = j + 1
            break
        beta[j] = b
        q = w / b
    tri = np.diag(alpha[:m]) + np.diag(beta[: m - 1], 1) + np.diag(beta[: m - 1], -1)
    return float(np.linalg.eigvalsh(tri)[-1])


def _tall_gram(mat: torch.Tensor) -> np.ndarray:
    """``conj(A^H A)`` (upper triangle) of a tall ``k x n`` complex128 ``A`` by BLAS ``zherk``.

    The row-major ``A`` is the column-major ``n x k`` matrix ``A^T``, so ``zherk`` reads it
    without a copy and returns ``A^T (A^T)^H = conj(A^H A)``: the Gram matrix of ``conj(A)``,
    whose singular values are those of ``A``. ``zherk`` sets the imaginary parts of the diagonal
    to zero; the lower triangle is left at zero (only the upper one is ever read).
    """
    import numpy as np
    from scipy.linalg import blas

    return blas.zherk(1.0, np.asarray(mat.numpy()).T, trans=0, lower=0)


def _refined_estimate(gram: np.ndarray) -> float:
    """An accurate estimate of ``lambda_max`` (steering only): ``eigvalsh`` for sides up to
    :data:`_CONV_REFINE_EIGH_MAX_DIM`, else a longer Lanczos run (a few times cheaper there)."""
    n = int(gram.shape[0])
    if n <= _CONV_REFINE_EIGH_MAX_DIM:
        return _eigh_level(gram)
    return _lanczos_top(gram, _CONV_REFINE_STEPS)


def _eigh_level(gram: np.ndarray) -> float:
    """Computed largest eigenvalue of the Hermitian matrix stored in ``gram``'s upper triangle."""
    return float(torch.linalg.eigvalsh(torch.from_numpy(gram), UPLO="U")[-1].item())


class _Rounding(NamedTuple):
    """Rounding constants of :func:`_cholesky_max_norm` for ``k x n`` matrices, ``k >= n``."""

    gram: float  # 2 gamma_{2k}: ||fl(A^H A) - A^H A||_F <= gram ||A||_F^2
    chol: float  # 2 gamma_{4n+2}: |R^H R - B| <= chol |R|^T |R|
    sums: float  # 1 + (n + 4) 2u: covers fsum and max of n float64 numbers, and their use
    absolute: float  # per unit of max(1, level): underflow in the products and the factorisation


def _rounding(k: int, n: int) -> _Rounding:
    return _Rounding(
        gram=2.0 * _gamma(2 * k),
        chol=2.0 * _gamma(4 * n + 2),
        sums=1.0 + (n + 4) * 2.0 * UNIT_ROUNDOFF,
        absolute=16.0 * (k + n + 2) * n * _TINY,
    )


def _frobenius2(gram: np.ndarray, rnd: _Rounding) -> float:
    """Upper bound on ``||A||_F^2 = tr(A^H A)`` from the computed Gram matrix's diagonal.

    ``fl(A^H A)_ii = ||a_i||^2 + e_i`` with ``|e_i| <= 2 gamma_{2k} ||a_i||^2`` (step 1 of
    :func:`_cholesky_max_norm`), so ``||A||_F^2 <= (tr fl(A^H A) + n 2^-1022 16) / (1 - 2 gamma)``.
    """
    import numpy as np

    trace = math.fsum(np.diagonal(gram).real.tolist()) * rnd.sums
    return (max(trace, 0.0) + rnd.absolute) / (1.0 - rnd.gram) * (1.0 + 4.0 * UNIT_ROUNDOFF)


def _certify_level(gram: np.ndarray, c2: float, rnd: _Rounding) -> float | None:
    """``c^2 + tau >= lambda_max(A^H A)`` if ``c^2 I - fl(A^H A)`` factorises, else ``None``.

    Steps 2-4 of the proof in :func:`_cholesky_max_norm` (one LAPACK ``zpotrf``).
    """
    import numpy as np
    from scipy.linalg import lapack

    n = int(gram.shape[0])
    b = np.negative(gram, order="F")
    b[np.diag_indices(n)] += c2  # rounds the real parts of the diagonal only
    _, info = lapack.zpotrf(b, lower=0, clean=0, overwrite_a=1)
    if int(info) != 0:
        return None
    b_diag = c2 - np.diagonal(gram).real  # the diagonal of B again (zpotrf overwrote it)
    trace = math.fsum(b_diag.tolist()) * rnd.sums
    bmax = float(np.abs(b_diag).max()) * rnd.sums
    scale = max(1.0, c2)
    tau = (
        rnd.chol / (1.0 - rnd.chol) * max(trace, 0.0)
        + UNIT_ROUNDOFF * bmax
        + rnd.gram * _frobenius2(gram, rnd)
        + rnd.absolute * scale
    )
    return _certified.add(c2, tau * (1.0 + 4.0 * UNIT_ROUNDOFF))


def _eigh_certificate(gram: np.ndarray, lam: float, rnd: _Rounding) -> float:
    """``lambda_max(A^H A) <= lam (1 + margin) + 2 gamma_{2k} ||A||_F^2`` (``lam`` by eigvalsh).

    ``eigvalsh`` is backward stable: ``lam`` is an exact eigenvalue of ``fl(A^H A) + F`` with
    ``||F|| <= p(n) u ||fl(A^H A)||``, covered by ``NUMERIC_MARGIN``; the product's rounding is
    step 1 of :func:`_cholesky_max_norm`. This is the ``"eigh"`` argument of :func:`dense_norm`.
    """
    tau = rnd.gram * _frobenius2(gram, rnd) + rnd.absolute * max(1.0, lam)
    return inflate(_certified.add(inflate(max(lam, 0.0)), tau * (1.0 + 4.0 * UNIT_ROUNDOFF)))


def _cholesky_max_norm(flat: torch.Tensor) -> float:
    """Certified ``max_i ||A_i||_2`` over a batch of complex matrices (CPU, complex128).

    ``flat`` has shape ``(F, k, n)``, ``k >= n`` (the layout :func:`_symbol_matrices`
    computes). Its components lie within ``2^(+-257)`` (the caller, :func:`_max_norm_tall`,
    scales them by a power of two otherwise), so nothing overflows. One Gram matrix per matrix
    and ONE common level ``c^2`` for the whole batch: a complex Cholesky factorisation of
    ``c^2 I - fl(A_i^H A_i)`` that runs to completion proves ``||A_i||_2^2 <= c^2 + tau_i`` (the
    complex Hermitian analogue of :func:`_cholesky_norm`).

    Precondition: ``flat`` finite complex128 on the CPU, ``k >= n``, components within
    ``2^(+-257)``; conventional BLAS/LAPACK kernels (as stated in the proof).

    Claim: the result is ``>= max_i ||flat[i]||_2``.

    Steering (never enters the bound). Each Gram matrix gets a short Lanczos run
    (:func:`_lanczos_top`, :data:`_CONV_LANCZOS_STEPS` steps) that ranks the frequencies; the
    :data:`_CONV_CANDIDATES` best-ranked get an accurate estimate (:func:`_refined_estimate`:
    ``eigvalsh``, or a longer Lanczos run for large sides), and the common level is the largest
    of these lifted by a relative :data:`_CONV_CHOLESKY_LIFT`. A frequency whose factorisation
    breaks down (the ranking missed it: its top eigenvalue is above the level) is retried once
    at its own refined level, and certified by the ``eigvalsh`` of its (already computed) Gram
    matrix if that fails too (:func:`_eigh_certificate`, as tight). The Gram products are
    never recomputed.

    Proof for one matrix (``u = 2^-53``, ``gamma_j = j u / (1 - j u)``, norms spectral unless
    marked, ``|.|`` the entrywise modulus). Let ``A`` be ``k x n``, ``k >= n``, with columns
    ``a_i = x_i + i y_i`` (``x_i, y_i`` real). Assumed: conventional BLAS/LAPACK kernels (every
    product of two real numbers formed once, sums in any order, fused multiply-adds allowed; no
    3M/Strassen-type complex multiplication), as for the dense proof.

    1. *Gram product* (:func:`_tall_gram`, ``zherk``). The real part of ``(A^H A)_ij`` is the
       real inner product ``x_i^T x_j + y_i^T y_j`` and its imaginary part ``x_i^T y_j -
       y_i^T x_j``: each is a sum of ``2k`` products of real numbers, whose computed value in
       any order has error at most ``gamma_{2k}`` times the sum of the products' moduli
       (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. (3.5); this real
       embedding replaces his complex constant ``sqrt(2) gamma_{k+2}``, Lemma 3.5, which
       assumes complex multiplication done in one specific way). Adding the two moduli,
       ``|E1_ij| <= gamma_{2k} m_i^T m_j`` with ``m_i = |x_i| + |y_i|``, so ``||E1|| <= ||E1||_F
       <= gamma_{2k} sum_i ||m_i||^2 <= 2 gamma_{2k} ||A||_F^2`` (``(|x| + |y|)^2 <= 2 (x^2 +
       y^2)``). ``||A||_F^2`` itself is bounded from the computed diagonal (:func:`_frobenius2`).
    2. ``B = fl(c^2 I - G~)`` rounds only the real parts of the diagonal: ``B = c^2 I - G~ + E2``,
       ``E2`` real diagonal, ``|E2_ii| <= u |B_ii|``. ``zpotrf`` reads the upper triangle and the
       real part of the diagonal only, so ``B`` is the Hermitian matrix they define.
    3. *Cholesky* (``zpotrf`` runs to completion, ``info = 0``): ``R`` upper triangular with a
       real positive diagonal and ``R^H R = B + dB``. Higham's Theorem 10.3 (real case,
       ``|dB| <= gamma_{n+1} |R^T| |R|``) rests on Lemma 8.4 applied to each entry; in complex
       arithmetic each entry ``r_ij = (b_ij - sum_{l<i} conj(r_li) r_lj) / r_ii`` (or ``r_jj =
       sqrt(b_jj - sum_{l<j} |r_lj|^2)``) has real and imaginary parts that are real expressions
       ``(c - sum of P <= 2(n - 1) real products) / r_ii`` (or a square root). Evaluated in any
       order, with a division or a multiplication by the rounded reciprocal of ``r_ii`` (or a
       rounded square root), every term carries at most ``2P + 2 <= 4n + 2`` relative rounding
       factors once the identity is divided through by ``c``'s own factor (Higham, Lemma 3.1),
       so ``|c - sum p - r_ii y| <= gamma_{4n+2} (sum |p| + |r_ii y|)`` for each part; adding
       the real and imaginary parts as in step 1, ``|dB_ij| <= 2 gamma_{4n+2} (|R|^T |R|)_ij``.
       (A blocked ``zpotrf`` with conventional level-3 BLAS only reorders these sums.) Then as
       in :func:`_cholesky_norm`: by Cauchy-Schwarz on the columns ``r_j`` of ``R``,
       ``||dB|| <= ||dB||_F <= g sum_j ||r_j||^2 <= g / (1 - g) tr(B)``, ``g = 2 gamma_{4n+2}``,
       and ``B + dB = R^H R`` is positive semi-definite: ``lambda_min(B) >= -||dB||``.
    4. ``c^2 I - A^H A = B - E2 + E1``, hence ``lambda_max(A^H A) <= c^2 + tau`` with
       ``tau = g / (1 - g) tr(B) + u max_i |B_ii| + 2 gamma_{2k} ||A||_F^2`` plus an absolute
       allowance ``16 (k + n + 2) n 2^-1022 max(1, c^2)`` for underflow (each underflowing real
       operation adds at most ``2^-1074`` in absolute terms, at most ``4 (k + n + 2)`` of them per
       entry, each multiplied by at most ``max(1, c)``: the allowance has a factor ``2^48`` to
       spare). ``tr(B)``, ``max |B_ii|`` and the diagonal sum of step 1 are evaluated in float64
       (``math.fsum``, correctly rounded) and inflated by ``1 + (n + 4) 2u``.

    The bound returned is ``sqrt(max_i (c_i^2 + tau_i))`` over the batch (``c_i = c`` where the
    factorisation succeeded, the ``eigvalsh`` certificate elsewhere), rounded up. Tightness: the
    level is within ``3e-6`` (relative) of the largest steering eigenvalue, i.e. of the exact
    maximum up to ``eigvalsh``'s ``~1e-15``; the bound is within ``~1.5e-6`` of the exact norm
    (``tau`` is ``~n u`` relative). Cost: the Gram products (``zherk``: ``k n^2 / 2`` complex
    multiply-adds each, half of a general product), :data:`_CONV_LANCZOS_STEPS` Hermitian
    matrix-vector products and one ``zpotrf`` (``n^3 / 3`` complex multiply-adds) per matrix,
    and a few refined estimates.
    """
    import numpy as np

    f_count, k, n = (int(d) for d in flat.shape)
    rnd = _rounding(k, n)
    grams = [_tall_gram(m) for m in flat]
    ritz = np.array([_lanczos_top(g, _CONV_LANCZOS_STEPS) for g in grams])
    order = np.argsort(-ritz, kind="stable")[: min(_CONV_CANDIDATES, f_count)]
    refined = {int(i): _refined_estimate(grams[int(i)]) for i in order}
    level = max(max(refined.values()), 0.0) * (1.0 + _CONV_CHOLESKY_LIFT)
    worst = 0.0
    for i, g in enumerate(grams):
        certified = _certify_level(g, level, rnd)
        if certified is None and i not in refined:  # the ranking missed it: its own level
            own = max(_refined_estimate(g), level) * (1.0 + _CONV_CHOLESKY_LIFT)
            certified = _certify_level(g, own, rnd)
        if certified is None:  # the estimate was not accurate enough: eigvalsh certifies it
            certified = _eigh_certificate(g, _eigh_level(g), rnd)
        worst = max(worst, certified)
    return _certified.sqrt(worst)


def _batched_eigh_max_norm(flat: torch.Tensor) -> float:
    """``max_i ||A_i||_2`` certified by one batched ``eigvalsh`` of the Gram matrices (CPU).

    For small matrices (side ``<=`` :data:`_CONV_EIGH_MAX_DIM`), where one batched LAPACK call
    beats a Python loop of factorisations: ``||A_i||_2^2 <= lambda~_i (1 + margin) + 2
    gamma_{2k} ||A_i||_F^2`` plus the underflow allowance, each term as in
    :func:`_eigh_certificate` (the Gram products by a batched complex ``zgemm``: step 1 of
    :func:`_cholesky_max_norm` bounds every computed entry, in either triangle). The few
    float64 operations combining the terms are covered by a factor ``1 + 16u``.

    Precondition: as :func:`_cholesky_max_norm`. Claim: the result is ``>= max_i ||flat[i]||_2``.
    """
    a = flat
    k, n = int(a.shape[-2]), int(a.shape[-1])
    rnd = _rounding(k, n)
    gram = a.mH @ a
    lam = torch.linalg.eigvalsh(gram)[:, -1].clamp(min=0.0)
    trace = torch.diagonal(gram, dim1=-2, dim2=-1).real.sum(-1).clamp(min=0.0) * rnd.sums
    fro2 = (trace + rnd.absolute) / (1.0 - rnd.gram)
    value = lam * (1.0 + NUMERIC_MARGIN) + rnd.gram * fro2 + rnd.absolute * lam.clamp(min=1.0)
    worst = float(value.max().item()) * (1.0 + 16.0 * UNIT_ROUNDOFF)
    return inflate(_certified.sqrt(worst))


def _max_norm_tall(flat: torch.Tensor) -> float:
    """Certified ``max_i ||flat[i]||_2``, ``flat`` complex of shape ``(F, k, n)``, ``k >= n``, CPU.

    The components are first brought within ``2^(+-257)`` by an exact power-of-two scaling when
    they are not already (extreme weights only; entries that underflow when scaling down move
    each matrix by at most ``sqrt(2 k n) 2^-1075`` in Frobenius norm, added back). Then matrices
    with ``n <=`` :data:`_CONV_EIGH_MAX_DIM` go through one batched ``eigvalsh``
    (:func:`_batched_eigh_max_norm`) and larger ones through one Gram product and one complex
    Cholesky factorisation each at a common level (:func:`_cholesky_max_norm`).

    Precondition: ``flat`` finite, on the CPU. Claim: the result is ``>= max_i ||flat[i]||_2``.
    """
    k, n = int(flat.shape[-2]), int(flat.shape[-1])
    if flat.numel() == 0:
        return 0.0
    flat = flat.to(torch.complex128).contiguous()
    lo, hi = torch.aminmax(torch.view_as_real(flat))
    biggest = max(-float(lo), float(hi))
    if biggest == 0.0:
        return 0.0
    e = -math.frexp(biggest)[1] + 1  # 2^e * biggest in [1, 2)
    lost = 0.0  # Frobenius norm (scaled units) of what underflowed when scaling down
    if abs(e) > _SAFE_EXPONENT:
        flat = flat * 2.0 ** (e // 2) * 2.0 ** (e - e // 2)  # exact but for underflow
        if e < 0:
            lost = math.sqrt(2.0 * k * n) * 2.0**-1074
    else:
        e = 0
    small = n <= _CONV_EIGH_MAX_DIM
    scaled = _batched_eigh_max_norm(flat) if small else _cholesky_max_norm(flat)
    # ldexp is exact unless the result is subnormal (then 2^-1074 covers its rounding).
    return _certified.add(math.ldexp(_certified.add(scaled, lost), -e), 2.0**-1074)
