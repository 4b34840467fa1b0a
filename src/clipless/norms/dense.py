"""Certified spectral norms of dense matrices: SVD, ``eigh``, Cholesky certificate, Gram iteration.

:func:`dense_norm` returns a certified upper bound on ``||W||_2`` for one real or complex matrix
(float64 arithmetic, inflated by ``1 + NUMERIC_MARGIN``); ``"auto"`` picks the cheapest
certificate for the device and size. The Cholesky certificate's proof is in
:func:`_cholesky_norm`, the ``eigh`` certificate's in :func:`dense_norm` and :func:`_eigh_norm`,
Gram iteration's in :func:`clipless.norms.iterations.gram_iteration`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from clipless import _certified, _validate, _workspace
from clipless._certified import UNIT_ROUNDOFF, inflate
from clipless.norms.certificates import (
    _SAFE_EXPONENT,
    _TINY,
    _aminmax,
    all_finite,
    matrix_products_only,
)
from clipless.norms.iterations import _gram_bounds

if TYPE_CHECKING:
    import numpy as np

_SVD_MAX_DIM = 1024  # "auto" on the CPU beyond Cholesky's range: eigh up to this, then Gram
_GRAM_AUTO_ITERS = 12  # "auto" Gram iteration: within rank^(2^-13) (0.08% at rank 1024)

_CHOLESKY_MAX_DIM = 4096  # "auto" on the CPU: Cholesky certificate when 64 < min(m, n) <= this

_CHOLESKY_MARGINS = (3e-6, 1e-4, 1e-2)  # relative lift of the target c^2 above the estimate

_GRAM_BLOCK_BYTES = 2**20  # rows of W converted to float64 at a time by the Cholesky certificate


class _Estimate(NamedTuple):
    """ARPACK's estimate of ``lambda_max`` (steering only) and its Ritz vector (warm start)."""

    value: float
    vector: object


def _top_eigenvalue_estimate(gram: object, v0: object = None) -> _Estimate | None:
    """``lambda_max`` of a symmetric float64 matrix by ARPACK (Lanczos; steering only).

    ``gram`` is a NumPy array of which only the upper triangle is read (BLAS ``dsymv``). An
    *estimate*: it only chooses the level ``c^2`` that :func:`_cholesky_norm` then proves with a
    Cholesky factorisation. ``None`` when ARPACK does not converge or the matrix is tiny.
    """
    import numpy as np
    from scipy.linalg import blas
    from scipy.sparse.linalg import ArpackError, LinearOperator, eigsh

    assert isinstance(gram, np.ndarray)
    n = int(gram.shape[0])
    if n < 3:
        return None

    def matvec(x: np.ndarray) -> np.ndarray:
        return blas.dsymv(1.0, gram, np.ascontiguousarray(x).reshape(-1), lower=0)

    a = LinearOperator((n, n), matvec=matvec, dtype=np.float64)
    if isinstance(v0, np.ndarray) and v0.shape == (n,) and np.all(np.isfinite(v0)) and v0.any():
        start = v0
    else:  # a fixed pseudo-random start: the same matrix always gets the same bound
        start = np.random.default_rng(0x5EED + n).standard_normal(n)
    try:
        # A bounded number of restarts (typically 1-4 are needed): eigh takes over otherwise.
        vals, vecs = eigsh(a, k=1, which="LA", tol=1e-6, v0=start, maxiter=200)
    except (ArpackError, ValueError):
        return None
    value = float(vals[0])
    if not math.isfinite(value):
        return None
    return _Estimate(value, vecs[:, 0].copy())


def _cholesky_norm(w: torch.Tensor, v0: object = None) -> tuple[float, object] | None:
    """Certified ``||W||_2`` by one Gram product and one Cholesky factorisation (float64, CPU).

    Returns ``(bound, ritz_vector)`` or ``None`` (the caller then falls back to ``eigh``).

    Precondition: ``w`` a finite real matrix on the CPU; conventional BLAS/LAPACK kernels (every
    product of two numbers formed once, sums in any order). ``None`` for anything else.

    Claim: ``bound >= ||W||_2`` whenever a bound is returned.

    Idea: ``||W||_2 <= c`` iff ``c^2 I - W^T W`` is positive semi-definite, and a floating-point
    Cholesky factorisation that *runs to completion* proves a nearby matrix positive
    semi-definite. The level ``c^2`` is an ARPACK (Lanczos) estimate of ``lambda_max(W^T W)``
    lifted by a relative ``3e-6`` (then ``1e-4``, ``1e-2`` if the factorisation breaks down);
    the estimate only steers -- the certificate is the factorisation.

    Proof (``u = 2^-53``, ``gamma_j = j u / (1 - j u)``, norms spectral unless marked). ``W`` is
    first multiplied by a power of two ``2^e`` (as two factors) bringing its largest entry into
    ``[1, 2)``: exact, except that entries may underflow when scaling down, which moves ``W`` by
    at most ``2 sqrt(#entries) 2^-1074`` in Frobenius norm (added to the result before scaling
    back, i.e. ``2^-e`` times that in the original units). Let ``W`` be
    ``k x n``, ``k >= n`` (the transpose otherwise; same norm).

    1. ``G~ = fl(W^T W) = W^T W + E1`` (BLAS ``dsyrk``, upper triangle; the factorisation reads
       no other entry) with ``|E1| <= gamma_k |W|^T |W|`` entrywise (any order of the inner
       products, conventional BLAS; accumulating the product over blocks of rows of ``W`` is one
       such order), so ``||E1|| <= ||E1||_F <= gamma_k ||W||_F^2``.
    2. ``B = fl(c^2 I - G~)`` rounds only the diagonal: ``B = c^2 I - G~ + E2`` with ``E2``
       diagonal, ``|E2_ii| <= u |B_ii|``.
    3. Cholesky of ``B`` runs to completion (``info = 0``): by Higham, *Accuracy and Stability of
       Numerical Algorithms* (2nd ed.), Theorem 10.3, the computed ``R`` satisfies
       ``R^T R = B + dB`` with ``|dB| <= gamma_{n+1} |R^T| |R|`` (any order of the inner
       products: LAPACK's blocked ``potrf`` with conventional level-3 BLAS only reorders them).
       Cauchy-Schwarz on the columns ``r_j`` of ``R``: ``(|R^T||R|)_ij <= ||r_i|| ||r_j||``, and
       the diagonal of the identity gives ``||r_j||^2 <= B_jj + gamma ||r_j||^2``, so
       ``||dB|| <= ||dB||_F <= gamma sum_j ||r_j||^2 <= gamma / (1 - gamma) tr(B)``.
       ``B + dB = R^T R`` is positive semi-definite, so ``lambda_min(B) >= -||dB||``.
    4. ``c^2 I - W^T W = B - E2 + E1``, hence ``lambda_max(W^T W) <= c^2 + tau`` with
       ``tau = gamma_{n+1} / (1 - gamma_{n+1}) tr(B) + u max_i |B_ii| + gamma_k ||W||_F^2`` plus
       an absolute allowance ``8 (k + n + 2) n 2^-1022`` for underflow in the products (the
       bounds above assume none; entries are at most 2 after the scaling, so nothing overflows).
       ``tr(B)`` and ``max |B_ii|`` are evaluated in float64 and inflated by
       ``1 + (n + 4) 2^-52``, ``||W||_F^2`` (the ``math.fsum`` of the blocks' float64 squared
       norms) by ``1 + (k n + 4) 2^-52``, which covers the rounding of their sums; the final
       ``sqrt(c^2 + tau) 2^-e`` is rounded up and inflated by ``1 + NUMERIC_MARGIN``.

    Cost: one ``n x n`` Gram product (``k n^2`` multiply-adds), a few dozen Lanczos matrix-vector
    products and one Cholesky factorisation (``n^3 / 3``): about 0.6 of ``eigvalsh`` on the same
    Gram matrix. Memory: one ``n x n`` float64 buffer (the Gram matrix, factorised in place; a
    failed level forms it again) and about 1 MiB of float64 rows of ``W``, both reused across calls
    (:mod:`clipless._workspace`). Tightness: ``c`` is within ``1.5e-6`` (relative) of the estimate,
    which ARPACK computes to ``~1e-6`` (residual tolerance): the bound is within ``~3e-6`` of the
    exact norm.
    """
    if w.device.type != "cpu" or w.is_complex():
        return None
    import numpy as np
    from scipy.linalg import blas, lapack

    src = w.mT if w.shape[0] < w.shape[1] else w
    k, n = int(src.shape[0]), int(src.shape[1])
    # The largest entry, read from the weight itself: its float64 conversion below is monotone
    # (exact for every floating dtype, round-to-nearest for integers), so it converts to the
    # largest entry of the float64 copy.
    lo, hi = _aminmax(src)
    biggest = max(-float(lo), float(hi))
    if biggest == 0.0:
        return 0.0, v0
    e = -math.frexp(biggest)[1] + 1  # 2^e * biggest in [1, 2)
    # Exact power-of-two factors (two when a single 2.0**e would overflow), in place; much
    # faster than torch.ldexp. Underflow of entries when scaling down (at most one rounding
    # per factor), and of the result when scaling back (subnormal), are covered by
    # ``underflow``.
    factors = [2.0**e] if -1022 <= e <= 1023 else [2.0 ** (e // 2), 2.0 ** (e - e // 2)]
    underflow = (2.0 * math.sqrt(k * n) + 1.0) * 2.0**-1074
    # Reused buffers (clipless._workspace: no page faults per step): the float64 copy of W is
    # made a block of rows at a time (about 1 MiB), and one n x n buffer holds the Gram matrix
    # and then, in place, its Cholesky factor. The k x n row-major block is the column-major
    # n x k matrix block^T, so dsyrk reads it without a copy.
    rows = min(k, max(64, _GRAM_BLOCK_BYTES // (8 * n)))
    block = _workspace.scratch("float64.rows", (rows, n), torch.float64)
    work = _workspace.scratch("float64.work", (n, n), torch.float64).numpy().T  # column-major

    def gram_product() -> tuple[np.ndarray, float]:
        """``fl(W^T W)`` (upper triangle) of the scaled ``W`` into ``work``, and ``||W||_F^2``.

        ``W^T W = sum_b W_b^T W_b`` over blocks of rows ``W_b``, accumulated by BLAS ``dsyrk``
        (upper triangle only: half the work of a general product; ``beta = 0`` first, so the
        buffer's old content is not read, and its lower triangle never is): every entry is a
        float64 sum of its ``k`` products in some order, which is all step 1 of the proof uses.
        The squared Frobenius norm is the exactly rounded sum (``math.fsum``) of the blocks'
        float64 squared norms, within the relative ``(n k + 4) 2^-52`` that ``grow`` allows.
        """
        squares = []
        out = work
        for r0 in range(0, k, rows):
            part = block[: min(rows, k - r0)]
            part.copy_(src[r0 : r0 + rows])  # exact for every floating dtype
            for f in factors:
                part.mul_(f)
            out = blas.dsyrk(
                1.0,
                part.numpy().T,
                beta=0.0 if r0 == 0 else 1.0,
                c=out,
                trans=0,
                lower=0,
                overwrite_c=1,
            )
            squares.append(float(torch.linalg.vector_norm(part).item()) ** 2)
        assert np.shares_memory(out, work)  # dsyrk wrote into the buffer (F-contiguous)
        return out, math.fsum(squares)

    gram, fro2 = gram_product()
    estimate = _top_eigenvalue_estimate(gram, v0)
    if estimate is None:
        return None
    grow = 1.0 + (k * n + 4) * 2.0 * UNIT_ROUNDOFF
    gamma_k = k * UNIT_ROUNDOFF / (1.0 - k * UNIT_ROUNDOFF)
    gamma_n = (n + 1) * UNIT_ROUNDOFF / (1.0 - (n + 1) * UNIT_ROUNDOFF)
    if gamma_n >= 0.5 or gamma_k >= 0.5:
        return None
    absolute = 8.0 * (k + n + 2) * n * _TINY
    grow_n = 1.0 + (n + 4) * 2.0 * UNIT_ROUNDOFF
    for attempt, lift in enumerate(_CHOLESKY_MARGINS):
        if attempt > 0:  # the factorisation overwrote the Gram matrix: form it again
            gram, _ = gram_product()
        c2 = max(estimate.value, 0.0) * (1.0 + lift) + absolute
        g_diag = np.diagonal(gram).copy()
        b = np.negative(gram, out=gram)  # B = c^2 I - G, factorised in place (upper triangle)
        b[np.diag_indices(n)] += c2
        _, info = lapack.dpotrf(b, lower=0, clean=0, overwrite_a=1)
        if int(info) != 0:
            continue
        # dpotrf overwrote the upper triangle (diagonal included): B's diagonal again.
        b_diag = c2 - g_diag
        trace = float(math.fsum(b_diag.tolist())) * grow_n
        bmax = float(np.abs(b_diag).max()) * grow_n
        tau = (
            gamma_n / (1.0 - gamma_n) * max(trace, 0.0)
            + UNIT_ROUNDOFF * bmax
            + gamma_k * fro2 * grow
            + absolute
        )
        scaled = _certified.sqrt(_certified.add(c2, tau * (1.0 + 4.0 * UNIT_ROUNDOFF)))
        lost = math.ldexp(underflow, -e) if e < 0 else 0.0  # underflow in original units
        bound = _certified.add(_certified.add(math.ldexp(scaled, -e), lost), underflow)
        return inflate(_certified.up(bound)), estimate.vector
    return None


def dense_norm(
    weight: torch.Tensor,
    *,
    method: Literal["auto", "svd", "eigh", "gram", "cholesky"] = "auto",
    gram_iters: int = 8,
) -> float:
    """Certified upper bound on the spectral norm ``||W||_2`` of a 2-D matrix (float64).

    ``"svd"``: the exact largest singular value (LAPACK, backward stable) times
    ``1 + NUMERIC_MARGIN``. ``"eigh"``: the largest eigenvalue of the float64 Gram matrix
    ``G = W^T W`` of the smaller side (symmetric LAPACK solver, backward stable; about 1.5x faster
    than the SVD on CPU), with the rounding of the product covered explicitly:
    ``fl(G) = G + E`` with ``|E| <= gamma_k |W|^T |W|`` entrywise (``k`` the inner dimension), so
    ``||E||_2 <= ||E||_F <= gamma_k ||W||_F^2`` and
    ``||W||_2^2 = lambda_max(G) <= lambda_max(fl(G)) + gamma_k ||W||_F^2``.
    ``"gram"``: :func:`gram_iteration` with ``gram_iters`` steps (within
    ``rank^(2^-(gram_iters+1))`` of the truth in the worst case, all singular values equal -- about
    1.4% for rank 1500 at 8 steps, much less for typical spectra; raise ``gram_iters`` for
    near-orthogonal wide layers). ``"cholesky"``: a Cholesky factorisation of
    ``c^2 I - fl(W^T W)`` proves ``||W||_2 <= c`` for ``c`` an ARPACK estimate lifted by ``~1.5e-6``
    (proof and rounding terms in :func:`_cholesky_norm`; within ``~3e-6`` of the exact norm, about
    0.6 of the cost of ``"eigh"``; CPU, real matrices; falls back to ``"eigh"`` if ARPACK or the
    factorisation fails). ``"auto"``: off the CPU (:func:`matrix_products_only`), Gram iteration
    with 12 steps (its bound is the minimum over the steps; measured 0.06% above the exact norm on a
    512-square weight with a tenth of its singular values at the top, exact on orthogonal ones);
    on the CPU, SVD when ``min(m, n) <= 64``, ``"cholesky"`` for real matrices up to
    ``min(m, n) <= 4096``, otherwise ``eigh`` up to ``min(m, n) <= 1024``, else Gram iteration.

    Precondition: ``weight`` finite and 2-D (``ValueError`` otherwise).

    Claim: the result is ``>= ||W||_2`` for every method. Proofs: the ``"svd"`` and ``"eigh"``
    arguments above (with :func:`_eigh_norm` for the scaling), :func:`_cholesky_norm`,
    :func:`clipless.norms.iterations.gram_iteration`.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor, got shape {getattr(weight, 'shape', None)}")
    if method not in ("auto", "svd", "eigh", "gram", "cholesky"):
        raise ValueError(
            f"method must be 'auto', 'svd', 'eigh', 'gram' or 'cholesky', got {method!r}"
        )
    if not _validate.is_int(gram_iters) or gram_iters < 0:
        raise ValueError(f"gram_iters must be a non-negative int, got {gram_iters!r}")
    with torch.no_grad():
        w = weight.detach()
        if weight.numel() == 0:
            return 0.0
        if method == "auto":
            method, gram_iters = _auto_dense_method(w), _GRAM_AUTO_ITERS
        if method == "gram":
            bound = float(_gram_bounds(w, gram_iters).item())
            if not math.isfinite(bound):
                raise ValueError("weight must be finite")
            return bound
        if not all_finite(w):
            raise ValueError("weight must be finite")
        if method == "cholesky":  # copies the weight into float64 itself
            result = _cholesky_norm(w)
            if result is not None:
                return result[0]
        w = w.to(torch.complex128 if w.is_complex() else torch.float64)
        if method == "cholesky":
            return _eigh_norm(w)
        if method == "eigh":
            return _eigh_norm(w)
        return inflate(float(torch.linalg.matrix_norm(w, ord=2).item()))


def _auto_dense_method(w: torch.Tensor) -> Literal["svd", "eigh", "cholesky", "gram"]:
    """``dense_norm``'s ``"auto"`` choice (see :func:`matrix_products_only`)."""
    small = min(w.shape)
    if matrix_products_only(w):
        return "gram"
    if small <= 64:
        return "svd"
    if not w.is_complex() and small <= _CHOLESKY_MAX_DIM:
        return "cholesky"
    return "eigh" if small <= _SVD_MAX_DIM else "gram"


def _eigh_norm(w: torch.Tensor) -> float:
    """``sqrt(lambda_max(fl(W^H W)) + gamma_k ||W||_F^2)``, inflated (see :func:`dense_norm`).

    Precondition: ``w`` finite, float64 or complex128. Claim: the result is ``>= ||W||_2``
    (proof: :func:`dense_norm`'s ``"eigh"`` paragraph, and the scaling below).

    Entries outside ``2^(+-256)`` are first scaled by an exact power of two: a float64 Gram
    product of entries below ``~1e-154`` underflows (the result could then fall *below* the
    norm) and one of entries above ``~1e154`` overflows. Entries that underflow when scaling
    down move ``W`` by at most ``sqrt(2 #entries) 2^-1075`` in Frobenius norm (added, in scaled
    units); within the window, underflow in the products adds at most ``k 2^-1074`` per Gram
    entry against ``lambda_max >= 2^-514``, inside ``NUMERIC_MARGIN``.
    """
    lo, hi = _aminmax(torch.view_as_real(w.resolve_conj()) if w.is_complex() else w)
    biggest = max(-float(lo), float(hi))
    if biggest == 0.0:
        return 0.0
    e = -math.frexp(biggest)[1] + 1  # 2^e * biggest in [1, 2)
    if abs(e) <= _SAFE_EXPONENT:
        return _eigh_norm_unscaled(w)
    w = w * 2.0 ** (e // 2) * 2.0 ** (e - e // 2)  # exact but for underflow
    lost = math.sqrt(2.0 * w.numel()) * 2.0**-1074 if e < 0 else 0.0
    scaled = _certified.add(_eigh_norm_unscaled(w), lost)
    return _certified.add(math.ldexp(scaled, -e), 2.0**-1074)


def _eigh_norm_unscaled(w: torch.Tensor) -> float:
    if w.shape[0] < w.shape[1]:
        w = w.mH
    k = w.shape[0]  # inner dimension of the product
    gamma = k * UNIT_ROUNDOFF / (1.0 - k * UNIT_ROUNDOFF)
    if w.is_complex():
        gamma *= 2.0
    gram = w.mH @ w
    lam = float(torch.linalg.eigvalsh(gram)[-1].item())
    fro2 = float(torch.linalg.vector_norm(w).item()) ** 2
    return inflate(math.sqrt(inflate(max(lam, 0.0) + gamma * fro2 * (1.0 + 4.0 * UNIT_ROUNDOFF))))
