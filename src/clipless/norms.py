"""Certified operator norms of dense matrices and 2-D convolutions.

Certified *upper* bounds on the L2 operator norm of dense matrices (:func:`dense_norm`: exact SVD,
or Gram iteration -- Delattre et al. 2023, "Efficient bound of Lipschitz constant for
convolutional layers by Gram iteration") and of 2-D multi-channel convolutions (:func:`conv_norm`:
the FFT symbol of the kernel -- Sedghi, Gupta & Long 2019, "The singular values of convolutional
layers" -- or the multiplicity bound ``sqrt(k_eff) ||K reshaped (c_out, c_in kh kw)||_2``).
:func:`power_iteration` gives a *lower* bound, for steering projections and diagnostics only.

Every number returned here is a Python float computed in float64 arithmetic and, where it comes
from floating-point linear algebra, multiplied by ``1 + NUMERIC_MARGIN`` (see that constant).

Layering: this module depends on torch and :mod:`clipless._certified` only; the layers of
:mod:`clipless.nn` build on it, and :mod:`clipless.bounds` (backpropagation for bounds) on both.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from clipless import _certified, _workspace
from clipless._certified import UNIT_ROUNDOFF, inflate
from clipless._certified import gamma as _gamma

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "NUMERIC_MARGIN",
    "PowerIterationResult",
    "conv_multiplicity",
    "conv_norm",
    "conv_power_iteration",
    "dense_norm",
    "gram_iteration",
    "matrix_products_only",
    "norm_tensor",
    "power_iteration",
]

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

_SVD_MAX_DIM = 1024  # "auto" on the CPU beyond Cholesky's range: eigh up to this, then Gram
_GRAM_AUTO_ITERS = 12  # "auto" Gram iteration: within rank^(2^-13) (0.08% at rank 1024)
_GRAM_CONV_ITERS = 10  # per-frequency matrices (rank <= channels): within rank^(2^-11)
ACCELERATOR_PATH_ON_CPU = False
"""Certify by matrix products on the CPU as on an accelerator (profiling only; slower there)."""
_CHOLESKY_MAX_DIM = 4096  # "auto" on the CPU: Cholesky certificate when 64 < min(m, n) <= this
_EXPLICIT_MAX_DIM = 1024  # conv "auto": exact SVD of the explicit matrix when c_in H W <= this
_EXPLICIT_MAX_NUMEL = 2**22  # ... and the matrix has at most this many entries


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


def _as_pair(value: int | tuple[int, ...] | list[int], name: str) -> tuple[int, int]:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


# --------------------------------------------------------------------------------------------
# Dense matrices
# --------------------------------------------------------------------------------------------


def _gram_rounding_factor(rows: int, cols: int, complex_: bool) -> float:
    """A-priori factor ``1 / (1 - a)`` covering the rounding of a float64 Gram iteration.

    Proof sketch (``u`` unit roundoff, ``r = min(rows, cols)`` bounds every iterate's rank,
    ``k = max(rows, cols)`` every inner dimension, ``s(.)`` the spectral norm, ``F(.)`` the
    Frobenius norm, ``F <= sqrt(r) s``). One step rescales ``H' = fl(H / c)`` (entrywise relative
    error ``u``, so ``s(H') >= (s(H) / c)(1 - u sqrt(r))``) and forms ``fl(H'^H H') = H'^H H' + E``
    with ``||E||_2 <= ||E||_F <= gamma_k F(H')^2 <= gamma_k r (1 + u)^2 (s(H) / c)^2``
    (``gamma_k = k u / (1 - k u)``; doubled, with ``k + 4``, for complex arithmetic). Hence
    ``s(H_next) >= (s(H) / c)^2 (1 - a)``, with ``a`` as computed below, and unrolling ``T``
    steps gives ``s(W) <= prod_t c_t^(2^-t) s(H_T)^(2^-T) (1 - a)^-(1 - 2^-T)``.
    """
    r = float(min(rows, cols))
    k = float(max(rows, cols)) + (4.0 if complex_ else 0.0)
    gamma = k * UNIT_ROUNDOFF / (1.0 - k * UNIT_ROUNDOFF)
    if complex_:
        gamma *= 2.0
    a = 2.0 * UNIT_ROUNDOFF * math.sqrt(r) + gamma * r * (1.0 + UNIT_ROUNDOFF) ** 2
    if a >= 0.5:
        raise ValueError(
            f"matrices of shape ({rows}, {cols}) are too large for a float64 Gram bound"
        )
    return 1.0 / (1.0 - a)


def gram_iteration(mats: torch.Tensor, iters: int) -> torch.Tensor:
    """Batched certified upper bounds on spectral norms by Gram iteration (Delattre et al. 2023).

    ``mats`` has shape ``(..., m, n)`` (real or complex; computed in float64 / complex128); the
    result has shape ``(...)`` (float64) and satisfies ``result >= ||mats[i]||_2`` entrywise.
    Raises ``ValueError`` for a non-finite input; :func:`_gram_bounds` is the same bound without
    that check (no host read: an infinite bound for a non-finite matrix).

    Proof. With ``G_0 = W`` and ``G_{t+1} = G_t^H G_t``, the singular values of ``G_t`` are
    ``sigma_i(W)^(2^t)``, so ``||W||_2 = ||G_t||_2^(2^-t) <= ||G_t||_F^(2^-t)``; the ratio to the
    true norm is ``(sum_i (sigma_i / sigma_1)^(2^(t+1)))^(2^-(t+1)) <= rank^(2^-(t+1))``, which
    tends to 1 doubly exponentially. To avoid overflow every iterate is divided by its Frobenius
    norm ``c_t`` and the scales are carried as ``prod_t c_t^(2^-t)``. An iterate's spectral
    norm is bounded by ``min(||H||_F, sqrt(||H||_1 ||H||_inf))`` (Hoelder; the second is exact for
    diagonal iterates, i.e. orthogonal ``W``); the result is the smaller of that bound and the
    previous step's Frobenius bound (rounding can make the last step's the worse, rarely).
    Rounding of the products is covered by :func:`_gram_rounding_factor` (its factor bounds the
    accumulated error after any number of steps); the final norms, ``log`` and ``exp`` (scales
    carried in the log domain) add a relative error of at most a few hundred ``u``, inside
    :data:`NUMERIC_MARGIN`.
    """
    if not isinstance(mats, torch.Tensor) or mats.dim() < 2:
        raise ValueError("mats must be a tensor of shape (..., m, n)")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be a non-negative int, got {iters!r}")
    if not all_finite(mats):
        raise ValueError("mats must be finite")
    return _gram_bounds(mats, iters)


def _hoelder_fro(h: torch.Tensor) -> torch.Tensor:
    """``min(||H||_F, sqrt(||H||_1 ||H||_inf))`` per matrix: both bound ``||H||_2``."""
    a = h.abs()
    fro = torch.linalg.vector_norm(h, dim=(-2, -1))
    hoelder = torch.sqrt(a.sum(-2).amax(-1) * a.sum(-1).amax(-1))
    return torch.minimum(fro, hoelder)


_NARROW = (torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex32)


def _gram_bounds(mats: torch.Tensor, iters: int) -> torch.Tensor:
    """:func:`gram_iteration` without host reads: ``inf`` where a matrix is not finite."""
    complex_ = mats.is_complex()
    h = mats.detach().to(torch.complex128 if complex_ else torch.float64)
    rows, cols = h.shape[-2], h.shape[-1]
    factor = _gram_rounding_factor(rows, cols, complex_) * (1.0 + NUMERIC_MARGIN)
    batch = h.shape[:-2]
    if h.numel() == 0:
        return torch.zeros(batch, dtype=torch.float64, device=h.device)
    if min(rows, cols) == 1:
        iters = 0  # a vector's Frobenius norm is its spectral norm: iterating gains nothing
    if mats.dtype in _NARROW:
        # entries of at most float32's range square exactly in float64 with neither overflow
        # nor underflow (|x| in [2^-149, 2^128]): the first Frobenius norm needs no scaling, and
        # it is finite exactly when every entry is
        log_scale = torch.zeros(batch, dtype=torch.float64, device=h.device)
        finite = None
    else:
        h, log_scale, finite = _scaled_to_unit(h)
    # Put the smaller dimension last once, so every Gram matrix is min(m, n) square.
    if rows < cols:
        h = h.mH
    # Step t divides the iterate by its Frobenius norm c_t; log_scale + sum_t 2^-t log c_t is
    # then the bound from ||G_t||_F, summed once after the loop (one operator, not four per
    # step). c_0 is 0 only for a zero matrix (the first iterate's squares cannot underflow, later
    # ones have norm >= 1 / rank): its NaN iterates are replaced by the exact bound 0 at the end.
    first = torch.linalg.vector_norm(h, dim=(-2, -1), keepdim=True)
    cs = []
    for t in range(iters):
        c = first if t == 0 else torch.linalg.vector_norm(h, dim=(-2, -1), keepdim=True)
        cs.append(c)
        h = h.div_(c) if t else h / c
        h = _gram_product(h)
    zero = (first == 0).reshape(batch)
    if finite is None:
        finite = torch.isfinite(first).reshape(batch)
    best = torch.full_like(log_scale, math.inf)
    if cs:
        weights = torch.pow(0.5, torch.arange(iters, dtype=torch.float64, device=h.device))
        log_scale = log_scale + (torch.log(torch.cat(cs, dim=-1)) * weights).sum(-1).reshape(batch)
        best = log_scale
    # The last iterate's Hoelder / Frobenius bound usually improves on the last c_t, but with
    # rounding not always: the result is the smaller of the two.
    best = torch.minimum(best, log_scale + torch.log(_hoelder_fro(h)) * (2.0**-iters))
    bound = torch.exp(best) * factor
    # a subnormal result has lost relative precision: the smallest normal number bounds it
    bound = torch.where(zero, torch.zeros_like(bound), bound.clamp_min(_TINY))
    return torch.where(finite, bound, torch.full_like(bound, math.inf))


def _gram_product(h: torch.Tensor) -> torch.Tensor:
    """``h^H h``: ``mm`` / ``bmm`` directly for real 2-D / 3-D iterates (``matmul`` dispatches
    through a few more operators, each a launch-sized overhead on an accelerator)."""
    if h.dim() > 3:
        return h.mH @ h
    left = h.mH if h.is_complex() else h.mT
    return torch.mm(left, h) if h.dim() == 2 else torch.bmm(left, h)


def _scaled_to_unit(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h 2^-e, e log 2, finite)`` per matrix, ``2^e`` the power of two bringing the largest
    entry into ``[0.5, 1)``: exact (entries pushed below the subnormal range change the norm by
    less than ``sqrt(m n) 2^-1074``, far inside NUMERIC_MARGIN), and the first Frobenius norm can
    then neither overflow nor underflow (entries beyond ``2^+-512`` made it inf or 0, and the
    bound 0). Two factors, because ``2^-e`` alone overflows for the smallest subnormal ``e``.
    A non-finite matrix becomes zero, its ``finite`` false."""
    amax = h.abs().flatten(-2).amax(dim=-1)
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, torch.ones_like(amax))
    h = torch.where(finite[..., None, None], h, torch.zeros_like(h))
    _, e = torch.frexp(amax)
    half = torch.div(e, 2, rounding_mode="floor")
    one = torch.ones_like(amax)
    h = h * torch.ldexp(one, -half)[..., None, None] * torch.ldexp(one, half - e)[..., None, None]
    return h, e.to(torch.float64) * math.log(2.0), finite


_CHOLESKY_MARGINS = (3e-6, 1e-4, 1e-2)  # relative lift of the target c^2 above the estimate
_TINY = 2.0**-1022  # smallest normal float64: absolute allowance for underflow
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
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor, got shape {getattr(weight, 'shape', None)}")
    if method not in ("auto", "svd", "eigh", "gram", "cholesky"):
        raise ValueError(
            f"method must be 'auto', 'svd', 'eigh', 'gram' or 'cholesky', got {method!r}"
        )
    if isinstance(gram_iters, bool) or not isinstance(gram_iters, int) or gram_iters < 0:
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


# --------------------------------------------------------------------------------------------
# Convolutions
# --------------------------------------------------------------------------------------------


def _check_conv_args(
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    input_size: tuple[int, int] | None,
) -> None:
    if min(kernel_size) < 1:
        raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
    if min(stride) < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if min(padding) < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    if padding_mode not in ("zeros", "circular"):
        raise ValueError(f"padding_mode must be 'zeros' or 'circular', got {padding_mode!r}")
    if input_size is None:
        return
    for n, k, p in zip(input_size, kernel_size, padding, strict=True):
        if n < 1:
            raise ValueError(f"input_size must be >= 1, got {input_size}")
        if n + 2 * p < k:
            raise ValueError(
                f"input_size {input_size} with padding {padding} is smaller than the kernel "
                f"{kernel_size}: no output"
            )
        if padding_mode == "circular" and p > n:
            raise ValueError(
                f"circular padding {padding} larger than the input size {input_size} (torch "
                "refuses to wrap around more than once)"
            )


def _multiplicity_1d(n: int, k: int, s: int, p: int, circular: bool) -> int:
    """Largest number of (output, tap) pairs reading one input pixel, by direct enumeration."""
    n_out = (n + 2 * p - k) // s + 1
    counts = [0] * n
    for o in range(n_out):
        for j in range(k):
            i = o * s + j - p
            if circular:
                counts[i % n] += 1
            elif 0 <= i < n:
                counts[i] += 1
    return max(counts)


def _size_free_multiplicity_1d(k: int, s: int, p: int, circular: bool) -> int:
    base = -(-k // s)
    if not circular or p == 0 or (s == 1 and 2 * p <= k - 1):
        return base
    return 3 * base


def conv_multiplicity(
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int],
    padding: int | tuple[int, int],
    padding_mode: str,
    input_size: int | tuple[int, int] | None,
) -> int:
    """Exact ``k_eff``: the most (output position, kernel offset) pairs that read one input pixel.

    Output ``o`` reads, through tap ``j``, the padded position ``o s + j``, i.e. input pixel
    ``o s + j - p`` (zeros: counted only inside ``[0, n)``; circular: taken modulo ``n``, so one
    pixel can be read through several wrapped copies). The count is separable, so the 2-D maximum
    is the product of the two 1-D maxima, each found by enumeration.

    Uses. (1) Per-sample conv weight gradient:
    ``grad_K[co, ci, j] = sum_o dy[co, o] x[ci, i(o, j)]``; by Cauchy-Schwarz
    ``||grad_K||_F^2 <= ||dy||^2 sum_{o, j} ||x[:, i(o, j)]||^2 <= k_eff ||dy||^2 ||x||^2``.
    (2) Operator norm: ``||y||^2 = sum_o ||K_mat patch_o||^2 <= ||K_mat||_2^2 k_eff
    ||x||^2`` (:func:`conv_norm`, method ``"frobenius"``).

    ``input_size=None`` gives a size-free bound, valid for every input size: ``ceil(kh/sh) *
    ceil(kw/sw)`` for zero padding (the taps reading pixel ``i`` satisfy ``j = i + p - o s``: one
    residue class modulo ``s`` in ``[0, k)``), and for circular padding when each dimension has
    stride 1 and ``2 p <= k - 1`` (the outputs read at most ``n`` distinct residues of the ``k``
    taps modulo ``n``) or ``p = 0``. Otherwise, for circular padding, the pixel has at most 3
    padded copies (torch requires ``p <= n``), each read at most ``ceil(k/s)`` times: the
    size-free value is ``3 ceil(k/s)`` in that dimension.
    """
    ks = _as_pair(kernel_size, "kernel_size")
    st = _as_pair(stride, "stride")
    pd = _as_pair(padding, "padding")
    size = None if input_size is None else _as_pair(input_size, "input_size")
    _check_conv_args(ks, st, pd, padding_mode, size)
    circular = padding_mode == "circular"
    if size is None:
        return math.prod(
            _size_free_multiplicity_1d(k, s, p, circular)
            for k, s, p in zip(ks, st, pd, strict=True)
        )
    return math.prod(
        _multiplicity_1d(n, k, s, p, circular) for n, k, s, p in zip(size, ks, st, pd, strict=True)
    )


class _Polyphase(NamedTuple):
    """Per-dimension description of a strided convolution as a stride-1 circular convolution."""

    phase: list[int]  # input phase b_j of tap j
    shift: list[int]  # position a_j - min(a) of tap j on the coarse grid
    grid: int  # circular grid size on which the taps are folded
    duplication: int  # max number of identical output rows (circular wrap of outputs)
    copies: int  # max number of padded copies of one input pixel (relaxed circular case)
    decimation: int  # the polyphase stride the kernel is built with


def _polyphase_1d(n: int, k: int, s: int, p: int, circular: bool) -> _Polyphase:
    """Exact polyphase embedding of the 1-D strided correlation ``y[o] = sum_j w[j] xpad[o s + j]``.

    Write the pixel read by tap ``j`` at output ``o`` as ``o s + j - p = (o + a_j) s + b_j`` with
    ``b_j = (j - p) mod s`` and ``a_j = floor((j - p) / s)``. With the polyphase components
    ``x_b[m] = x[m s + b]`` (a permutation of the pixels: an isometry) the layer is
    ``y[o] = sum_j w[j] x_{b_j}[o + a_j]``: a stride-1 correlation with ``s`` times more input
    channels and taps ``a_j`` spanning ``span <= ceil(k / s)`` positions.

    * Zero padding: every ``x_b`` lives on ``m in [0, ceil(n / s))``; the outputs form a crop (and
      zero rows) of the full correlation, which equals the circular correlation on a grid of size
      ``N = ceil(n / s) + span - 1`` applied to the zero-extended components (no index wraps onto
      a non-zero entry). Crop and zero-extension have norm <= 1.
    * Circular padding with ``s | n``: ``x_b[m]`` is ``n / s``-periodic in ``m``, so the layer is
      exactly a circular correlation on the grid ``n / s``, except that the ``n_out`` outputs
      repeat rows with period ``n / s``: each row at most ``ceil(n_out s / n)`` times, a factor
      ``sqrt(duplication)`` on the norm. For ``s = 1`` and ``2 p = k - 1`` this is Sedghi et
      al.'s exact circulant.
    * Circular padding with ``s`` not dividing ``n``: relax. ``xpad = P x`` with ``||P||^2`` the
      largest number of padded copies of a pixel, and the valid strided correlation of ``xpad``
      (a zero-padding-free layer on ``n + 2p`` pixels) is embedded as in the zero-padding case.
      :func:`_polyphase_candidates` offers a second embedding of the circular cases.
    """
    if circular and n % s != 0:
        length = n + 2 * p
        relaxed = _polyphase_1d(length, k, s, 0, circular=False)
        copies = max(sum(1 for q in range(length) if (q - p) % n == i) for i in range(n))
        return relaxed._replace(copies=copies)
    a = [(j - p) // s for j in range(k)]
    b = [(j - p) % s for j in range(k)]
    a_min = min(a)
    span = max(a) - a_min + 1
    if circular:
        grid = n // s
        n_out = (n + 2 * p - k) // s + 1
        duplication = -(-n_out // grid)
    else:
        grid = -(-n // s) + span - 1
        duplication = 1
    return _Polyphase(
        phase=b,
        shift=[x - a_min for x in a],
        grid=grid,
        duplication=duplication,
        copies=1,
        decimation=s,
    )


def _polyphase_candidates(n: int, k: int, s: int, p: int, circular: bool) -> list[_Polyphase]:
    """Embeddings of one dimension of the layer, each valid; the certificate takes the best.

    Every candidate's ``decimation`` is the polyphase stride its kernel is built with. Zero
    padding has one embedding (:func:`_polyphase_1d`). Circular padding has two, each an upper
    bound, the second exact in the common "same" case:

    * the padded copies: ``xpad = P x`` with ``||P||^2`` the largest number of padded copies of a
      pixel (usually 2; 1 for ``p = 0``), then the valid strided correlation of ``xpad``
      embedded as in the zero-padding case (a crop of a circulant: an upper bound);
    * the circulant: output ``o`` reads ``x[(o s + j - p) mod n]``, i.e. it is output
      ``t = (o s) mod n`` of the stride-1 circular correlation on ``Z_n``. With
      ``g = gcd(s, n)`` every such ``t`` is a multiple of ``g``, and ``o -> (o s) mod n`` has
      period ``n / g``, so the layer is ``R A_g`` with ``A_g`` the stride-``g`` circular layer
      (``g | n``: the exact polyphase circulant on the grid ``n / g``) and ``R`` a selection of
      its rows, each taken at most ``ceil(n_out / (n / g))`` times: ``||R||^2`` is that count
      (``R^T R`` is diagonal). Exact when ``s | n`` and ``n_out = n / s`` (each row once: the
      "same" padding of Sedghi et al.).

    Measured against the exact norm on random kernels (``k = 3``, ``p = 1``, ``s = 2``, odd
    ``n``), the padded copies alone were 1.75-2.1x above it and the circulant 1.2-1.3x. The two
    dimensions pick their embeddings independently (the layer's index maps act on each dimension
    separately).
    """
    if not circular:
        return [_polyphase_1d(n, k, s, p, circular=False)]
    length = n + 2 * p
    copies = max(sum(1 for q in range(length) if (q - p) % n == i) for i in range(n))
    copied = _polyphase_1d(length, k, s, 0, circular=False)._replace(copies=copies)
    g = math.gcd(s, n)
    n_out = (n + 2 * p - k) // s + 1
    circulant = _polyphase_1d(n, k, g, p, circular=True)._replace(duplication=-(-n_out // (n // g)))
    if g == s and n_out == n // s:
        return [circulant]
    return [copied, circulant]


def _phases(grid: int, frequencies: int, span: int, device: torch.device) -> torch.Tensor:
    """``exp(-2 pi i f a / grid)`` for ``f < frequencies``, ``a < span`` (``f a`` mod grid)."""
    f = torch.arange(frequencies, device=device)
    a = torch.arange(span, device=device)
    turns = torch.remainder(torch.outer(f, a), grid).to(torch.float64) / grid
    return torch.polar(torch.ones_like(turns), turns * (-2.0 * math.pi))


def _polyphase_kernel(
    weight: torch.Tensor, dims: tuple[_Polyphase, _Polyphase], strides: tuple[int, int]
) -> torch.Tensor:
    """The polyphase kernel ``P``, shape ``(c_out, c_in sh sw, span_h, span_w)``, float64."""
    c_out, c_in, kh, kw = (int(d) for d in weight.shape)
    ph, pw = dims
    sh, sw = strides
    w = weight.detach().to(torch.float64)
    span_h, span_w = max(ph.shift) + 1, max(pw.shift) + 1
    poly = torch.zeros((c_out, c_in, sh, sw, span_h, span_w), dtype=torch.float64, device=w.device)
    for jh in range(kh):
        for jw in range(kw):
            poly[:, :, ph.phase[jh], pw.phase[jw], ph.shift[jh], pw.shift[jw]] = w[:, :, jh, jw]
    return poly.reshape(c_out, c_in * sh * sw, span_h, span_w)


def _polyphase_symbol(
    weight: torch.Tensor, dims: tuple[_Polyphase, _Polyphase], strides: tuple[int, int]
) -> torch.Tensor:
    """Per-frequency matrices ``K(f)``, shape ``(Nh, Nw//2+1, c_out, c_in sh sw)``, complex128.

    ``K(f) = sum_a P[:, :, a] exp(-2 pi i (f_h a_h / Nh + f_w a_w / Nw))`` with ``P`` the polyphase
    kernel: the 2-D DFT of ``P`` folded onto the ``Nh x Nw`` grid (what ``rfft2`` of the folded
    kernel computes), evaluated directly because a kernel has few taps. Only ``f_w <= Nw // 2`` is
    needed: ``K(-f) = conj(K(f))`` for a real kernel has the same singular values.
    """
    ph, pw = dims
    poly = _polyphase_kernel(weight, dims, strides).to(torch.complex128)
    span_h, span_w = int(poly.shape[2]), int(poly.shape[3])
    e_h = _phases(ph.grid, ph.grid, span_h, poly.device)
    e_w = _phases(pw.grid, pw.grid // 2 + 1, span_w, poly.device)
    partial = torch.einsum("oiab,wb->oiaw", poly, e_w)
    return torch.einsum("oiaw,ha->hwoi", partial, e_h).contiguous()


def _symbol_matrices(
    weight: torch.Tensor, dims: tuple[_Polyphase, _Polyphase], strides: tuple[int, int]
) -> torch.Tensor:
    """The matrices of :func:`_polyphase_symbol`, flat and tall: shape ``(F, k, n)``, ``k >= n``.

    ``K(f)`` (``c_out >= c_in sh sw``) or ``K(f)^T`` (otherwise; same singular values), for the
    ``F = Nh (Nw // 2 + 1)`` frequencies, complex128. One matrix product
    ``phi (F x t) @ P (t x c_out c_in')`` over the ``t`` taps (about 1.5x faster than the two
    ``einsum`` of :func:`_polyphase_symbol`). Each phase ``phi = e_h e_w`` is one complex product
    of two phases of :func:`_phases` (error ``<= 4u`` each), so its error is ``<= 12u``, and each
    entry of ``K(f)`` is an inner product over the ``t`` taps: see :data:`NUMERIC_MARGIN`.
    """
    ph, pw = dims
    poly = _polyphase_kernel(weight, dims, strides)
    c_out, c_in2, span_h, span_w = (int(d) for d in poly.shape)
    taps = poly.permute(2, 3, 0, 1)  # (span_h, span_w, c_out, c_in')
    if c_out < c_in2:
        taps = taps.transpose(2, 3)
    k, n = max(c_out, c_in2), min(c_out, c_in2)
    taps = taps.reshape(span_h * span_w, k * n).to(torch.complex128)
    e_h = _phases(ph.grid, ph.grid, span_h, poly.device)
    e_w = _phases(pw.grid, pw.grid // 2 + 1, span_w, poly.device)
    phi = (e_h[:, None, :, None] * e_w[None, :, None, :]).reshape(-1, span_h * span_w)
    return (phi @ taps).reshape(-1, k, n)


_CONV_EIGH_MAX_DIM = 48  # per-frequency Gram side up to which "fft" takes one batched eigvalsh
_CONV_LANCZOS_STEPS = 10  # Lanczos steps per frequency to rank the frequencies (steering only)
_CONV_CANDIDATES = 3  # frequencies whose refined estimate sets the common level
_CONV_REFINE_EIGH_MAX_DIM = 128  # refined estimate by eigvalsh up to this side, else Lanczos
_CONV_REFINE_STEPS = 40  # Lanczos steps of a refined estimate
_CONV_CHOLESKY_LIFT = 3e-6  # relative lift of the common level above the steering eigenvalue
_SAFE_EXPONENT = 256  # no 2^e scaling while the largest component is within 2^(+-256)


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


def _max_spectral_norm(mats: torch.Tensor) -> float:
    """Certified upper bound on ``max_i ||mats[i]||_2`` over a batch of complex matrices.

    On the CPU: :func:`_max_norm_tall` (on the transposes when the matrices are wide: same
    singular values); within ``~1.5e-6`` of the exact value for
    sides above :data:`_CONV_EIGH_MAX_DIM` (Cholesky certificate), within ``NUMERIC_MARGIN``
    below. Off the CPU (:func:`matrix_products_only`): one batched Gram iteration of every
    frequency's matrix (:func:`_gram_bounds`, :data:`_GRAM_CONV_ITERS` steps).
    """
    rows, cols = int(mats.shape[-2]), int(mats.shape[-1])
    flat = mats.reshape(-1, rows, cols)
    if matrix_products_only(flat):  # one batched chain of products, one host read
        return float(_gram_bounds(flat, _GRAM_CONV_ITERS).max().item())
    return _max_norm_tall(flat.mT if rows < cols else flat)


def _grids(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    circular: bool,
    input_size: tuple[int, int],
) -> Iterator[tuple[tuple[_Polyphase, _Polyphase], tuple[int, int], int]]:
    """Every pair of per-dimension embeddings (:func:`_polyphase_candidates`) with its
    decimation and the number of copies (duplication x copies) its symbol's norm is scaled by."""
    kh, kw = weight.shape[-2:]
    for dims in itertools.product(
        _polyphase_candidates(input_size[0], kh, stride[0], padding[0], circular),
        _polyphase_candidates(input_size[1], kw, stride[1], padding[1], circular),
    ):
        copies = dims[0].duplication * dims[1].duplication * dims[0].copies * dims[1].copies
        yield dims, (dims[0].decimation, dims[1].decimation), copies


def _conv_norm_fft(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    circular: bool,
    input_size: tuple[int, int],
) -> float:
    if matrix_products_only(weight):
        return float(_conv_fft_tensor(weight, stride, padding, circular, input_size).item())
    bounds = [
        inflate(_max_norm_tall(_symbol_matrices(weight, dims, decimation)) * math.sqrt(copies))
        for dims, decimation, copies in _grids(weight, stride, padding, circular, input_size)
    ]
    return min(bounds)


def _conv_norm_frobenius(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    input_size: tuple[int, int] | None,
) -> float:
    kh, kw = weight.shape[-2:]
    k_eff = conv_multiplicity((kh, kw), stride, padding, padding_mode, input_size)
    mat = weight.detach().reshape(weight.shape[0], -1)
    return inflate(math.sqrt(k_eff) * dense_norm(mat))


def _conv_apply(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
) -> torch.Tensor:
    """torch's Conv2d semantics (circular padding through ``F.pad``), without bias."""
    if padding_mode == "circular":
        ph, pw = padding
        x = torch.nn.functional.pad(x, (pw, pw, ph, ph), mode="circular")
        return torch.nn.functional.conv2d(x, weight, stride=stride)
    return torch.nn.functional.conv2d(x, weight, stride=stride, padding=padding)


def _small(
    weight: torch.Tensor, stride: tuple[int, int], padding: tuple[int, int], size: tuple[int, int]
) -> bool:
    c_out, c_in, kh, kw = (int(d) for d in weight.shape)
    d_in = c_in * size[0] * size[1]
    d_out = c_out
    for n, k, s, p in zip(size, (kh, kw), stride, padding, strict=True):
        d_out *= (n + 2 * p - k) // s + 1
    return d_in <= _EXPLICIT_MAX_DIM and d_in * d_out <= _EXPLICIT_MAX_NUMEL


def _explicit_matrix(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    input_size: tuple[int, int],
) -> torch.Tensor:
    """The transpose of the layer's matrix (same norm), in float64: the convolution applied to
    every basis image."""
    c_in = int(weight.shape[1])
    d_in = c_in * input_size[0] * input_size[1]
    basis = torch.eye(d_in, dtype=torch.float64, device=weight.device)
    out = _conv_apply(
        basis.reshape(d_in, c_in, *input_size),
        weight.detach().to(torch.float64),
        stride,
        padding,
        padding_mode,
    )
    return out.reshape(d_in, -1)


def _conv_norm_explicit(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    input_size: tuple[int, int],
) -> float:
    matrix = _explicit_matrix(weight, stride, padding, padding_mode, input_size)
    # On the CPU the SVD for small matrices, else the Gram matrix's top eigenvalue with its
    # rounding term (within ~1e-9 of the exact norm and ~5x cheaper than the SVD at 784 x 3136);
    # Gram iteration on an accelerator. The few roundings of circular wrap-around sums (relative
    # ~t u) are inside the NUMERIC_MARGIN dense_norm applies.
    method: Literal["svd", "eigh", "gram"] = "svd" if min(matrix.shape) <= 64 else "eigh"
    if matrix_products_only(matrix):
        method = "gram"
    return dense_norm(matrix, method=method, gram_iters=_GRAM_AUTO_ITERS)


def conv_norm(
    weight: torch.Tensor,
    *,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    padding_mode: str = "zeros",
    input_size: int | tuple[int, int] | None,
    method: Literal["auto", "fft", "frobenius", "explicit"] = "auto",
) -> float:
    """Certified upper bound on the operator norm of ``x -> conv2d(x, weight, stride, padding)``.

    The operator acts on inputs of spatial size ``input_size`` (``None``: any size), with torch's
    ``Conv2d`` semantics (cross-correlation, ``padding_mode`` ``"zeros"`` or ``"circular"``).

    ``"fft"`` (Sedghi, Gupta & Long 2019, Theorem 6): a multi-channel circular convolution on an
    ``Nh x Nw`` grid is block-diagonalised by the 2-D DFT, so its operator norm is exactly
    ``max_f ||K(f)||_2`` over the ``c_out x c_in`` matrices of DFT coefficients of the kernel
    (the DFT of the few taps evaluated directly in complex128 -- what ``rfft2`` of the zero-padded
    kernel gives, about twice as fast; ``K(-f) = conj(K(f))`` for a real kernel, so half the
    frequencies suffice; each frequency's norm is certified from the largest eigenvalue of its
    float64 Gram matrix with the product's rounding covered, as ``dense_norm(method="eigh")``). A
    stride-``s`` layer is written exactly as a stride-1 layer on the polyphase components of the
    input (``c_in s_h s_w`` channels, kernel ``ceil(k/s)``), and zero padding embeds into the
    circular convolution on a grid of ``ceil(n/s) + ceil(k/s) - 1`` (``n + k - 1`` for stride 1):
    see :func:`_polyphase_1d` for the argument (crop, zero-extension and subsampling have norm
    <= 1). Circular padding is certified by the smaller of two embeddings per dimension
    (:func:`_polyphase_candidates`), exact when ``s | n`` and each output row is distinct
    (Sedghi et al.'s "same" case); otherwise an upper bound (when the stride does not divide the
    input size, measured up to 1.9x above the exact norm on small random kernels).
    Needs ``input_size``.

    ``"frobenius"``: ``sqrt(k_eff) ||K reshaped (c_out, c_in kh kw)||_2`` with ``k_eff`` from
    :func:`conv_multiplicity` (proof there). It is never looser than the
    ``sqrt(kh kw) ||K||_F`` of the thesis and Barczewski & Ramon 2024 (``k_eff <= kh kw`` for zero
    padding and ``||.||_2 <= ||.||_F``), which is also valid. With ``input_size=None`` it uses the
    size-free ``k_eff``.

    ``"explicit"``: the layer's matrix (the convolution applied in float64 to every basis image:
    each entry is one kernel weight, or with circular wrap-around a sum of the few weights that
    read the same pixel, so it is exact up to one rounding per addition) certified by
    :func:`dense_norm` (``"eigh"`` on the CPU, within ~1e-10 of the exact norm; Gram iteration on
    an accelerator). Needs
    ``input_size``; cost grows like ``(c_in H W)^2 (c_out H_out W_out)``.

    ``"auto"``: ``"explicit"`` for small layers (``c_in H W <= 1024``), else the smaller of
    ``"fft"`` and ``"frobenius"`` (both certified) when ``input_size`` is known, else
    ``"frobenius"``.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4:
        raise ValueError("weight must be a 4-D tensor (c_out, c_in, kh, kw)")
    if method not in ("auto", "fft", "frobenius", "explicit"):
        raise ValueError(f"method must be 'auto', 'fft', 'frobenius' or 'explicit', got {method!r}")
    st = _as_pair(stride, "stride")
    pd = _as_pair(padding, "padding")
    size = None if input_size is None else _as_pair(input_size, "input_size")
    ks = (int(weight.shape[-2]), int(weight.shape[-1]))
    _check_conv_args(ks, st, pd, padding_mode, size)
    with torch.no_grad():
        if not all_finite(weight):
            raise ValueError("weight must be finite")
        if weight.numel() == 0:
            return 0.0
        if size is None and method in ("fft", "explicit"):
            raise ValueError(f"method={method!r} needs input_size")
        if method == "explicit" or (
            method == "auto" and size is not None and _small(weight, st, pd, size)
        ):
            assert size is not None
            return _conv_norm_explicit(weight, st, pd, padding_mode, size)
        if method == "frobenius" or size is None:
            return _conv_norm_frobenius(weight, st, pd, padding_mode, size)
        fft = _conv_norm_fft(weight, st, pd, padding_mode == "circular", size)
        if method == "fft":
            return fft
        return min(fft, _conv_norm_frobenius(weight, st, pd, padding_mode, size))


# --------------------------------------------------------------------------------------------
# Certificates as device tensors (no host read on an accelerator)
# --------------------------------------------------------------------------------------------


def _inflated(t: torch.Tensor) -> torch.Tensor:
    """``t (1 + NUMERIC_MARGIN)`` as a tensor; the extra ``4u`` covers the product's rounding."""
    return t * ((1.0 + NUMERIC_MARGIN) * (1.0 + 4.0 * UNIT_ROUNDOFF))


def _as_tensor(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64, device=like.device)


_TAP_PHASES: dict[tuple[object, ...], torch.Tensor] = {}


def _tap_phases(
    kernel: tuple[int, int],
    dims: tuple[_Polyphase, _Polyphase],
    strides: tuple[int, int],
    device: torch.device,
) -> torch.Tensor:
    """``B[j, c, f, :]``: (real, imaginary) of ``phi_f(j)`` where tap ``j`` falls in polyphase
    class ``c`` (its input phases), 0 elsewhere; shape ``(kh kw, sh sw, F, 2)``, float64.

    ``phi_f(j) = e_h(f_h, a_h(j)) e_w(f_w, a_w(j))``, one complex product of two phases of
    :func:`_phases` (error ``<= 12u``, as in :func:`_symbol_matrices`). Public geometry only:
    built once per layer geometry and device (a blocking host-to-device copy), then cached."""
    key = (kernel, tuple((tuple(d.phase), tuple(d.shift), d.grid) for d in dims), strides, device)
    cached = _TAP_PHASES.get(key)
    if cached is not None:
        return cached
    (kh, kw), (ph, pw), (sh, sw) = kernel, dims, strides
    e_h = _phases(ph.grid, ph.grid, max(ph.shift) + 1, torch.device("cpu"))
    e_w = _phases(pw.grid, pw.grid // 2 + 1, max(pw.shift) + 1, torch.device("cpu"))
    table = torch.zeros((kh, kw, sh * sw, ph.grid, pw.grid // 2 + 1), dtype=torch.complex128)
    for jh in range(kh):
        for jw in range(kw):
            phi = e_h[:, ph.shift[jh], None] * e_w[None, :, pw.shift[jw]]
            table[jh, jw, ph.phase[jh] * sw + pw.phase[jw]] = phi
    flat = torch.view_as_real(table.reshape(kh * kw, sh * sw, -1)).contiguous()
    if len(_TAP_PHASES) > 256:
        _TAP_PHASES.clear()
    _TAP_PHASES[key] = cached = flat.to(device)
    return cached


def _symbol_tensor(
    weight: torch.Tensor, dims: tuple[_Polyphase, _Polyphase], strides: tuple[int, int]
) -> torch.Tensor:
    """The per-frequency matrices of :func:`_polyphase_symbol` as ``(F, c_out, c_in sh sw)``,
    from one real matrix product of the taps with :func:`_tap_phases` (a handful of operators
    where the polyphase kernel's assembly runs one per tap). Each real or imaginary component is
    a sum over the ``kh kw`` taps of a tap times a phase component (zero outside the tap's
    class, exactly): the error analysis of :data:`NUMERIC_MARGIN` ("Symbol (DFT)") applies."""
    c_out, c_in, kh, kw = (int(d) for d in weight.shape)
    table = _tap_phases((kh, kw), dims, strides, weight.device)
    taps = weight.detach().to(torch.float64).reshape(c_out * c_in, kh * kw)
    classes, freqs = int(table.shape[1]), int(table.shape[2])
    out = torch.mm(taps, table.reshape(kh * kw, -1)).reshape(c_out, c_in, classes, freqs, 2)
    out = torch.view_as_complex(out.permute(3, 0, 1, 2, 4).contiguous())
    return out.reshape(freqs, c_out, c_in * classes)


def _conv_fft_tensor(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    circular: bool,
    input_size: tuple[int, int],
) -> torch.Tensor:
    """:func:`_conv_norm_fft` on the accelerator path, as a tensor (no host read)."""
    bounds = []
    for dims, decimation, copies in _grids(weight, stride, padding, circular, input_size):
        top = _gram_bounds(_symbol_tensor(weight, dims, decimation), _GRAM_CONV_ITERS).max()
        bounds.append(_inflated(top * _certified.sqrt(copies)))
    return torch.stack(bounds).min()


def _conv_tensor(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    size: tuple[int, int] | None,
) -> torch.Tensor:
    """``conv_norm(..., method="auto")`` on the accelerator path, as a tensor."""
    kh, kw = (int(weight.shape[-2]), int(weight.shape[-1]))
    k_eff = conv_multiplicity((kh, kw), stride, padding, padding_mode, size)
    mat = weight.detach().reshape(weight.shape[0], -1)
    # With zero padding the FFT bound (below) is the exact norm of a circulant containing the
    # layer, at most the size-free sqrt(k_eff) ||K_mat||_2 in every case measured (equal for
    # all-ones kernels): the size-free bound is then only a guard, in its no-iteration form.
    iters = 0 if size is not None and padding_mode == "zeros" else _GRAM_AUTO_ITERS
    frob = _inflated(_gram_bounds(mat, iters) * _certified.sqrt(k_eff))
    if size is None:
        return frob
    if _small(weight, stride, padding, size):
        matrix = _explicit_matrix(weight, stride, padding, padding_mode, size)
        return _gram_bounds(matrix, _GRAM_AUTO_ITERS)
    fft = _conv_fft_tensor(weight, stride, padding, padding_mode == "circular", size)
    return torch.minimum(fft, frob)


def norm_tensor(
    weight: torch.Tensor,
    *,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    padding_mode: str = "zeros",
    input_size: int | tuple[int, int] | None = None,
) -> torch.Tensor:
    """The certified bound of ``"auto"`` as a 0-dim float64 tensor on ``weight``'s device.

    A 2-D ``weight``: :func:`dense_norm`; a 4-D one: :func:`conv_norm` with the geometry given.
    On an accelerator (:func:`matrix_products_only`) it is computed there without a host read
    (``inf`` for a non-finite weight), so that many layers' bounds leave the device in one
    transfer; on the CPU it is the float the functions above return.
    """
    with torch.no_grad():
        w = weight.detach()
        if w.dim() == 2:
            if not matrix_products_only(w):
                return _as_tensor(dense_norm(w), w)
            return _gram_bounds(w, _GRAM_AUTO_ITERS)
        st, pd = _as_pair(stride, "stride"), _as_pair(padding, "padding")
        size = None if input_size is None else _as_pair(input_size, "input_size")
        _check_conv_args((int(w.shape[-2]), int(w.shape[-1])), st, pd, padding_mode, size)
        if not matrix_products_only(w) or w.numel() == 0:
            value = conv_norm(w, stride=st, padding=pd, padding_mode=padding_mode, input_size=size)
            return _as_tensor(value, w)
        bound = _conv_tensor(w, st, pd, padding_mode, size)
        return torch.where(torch.isfinite(bound), bound, torch.full_like(bound, math.inf))


# --------------------------------------------------------------------------------------------
# Power iteration (LOWER bounds: steering and diagnostics only)
# --------------------------------------------------------------------------------------------


class PowerIterationResult(NamedTuple):
    """``lower_bound <= ||A||_2`` (up to rounding) and the last right vector (to warm-start)."""

    lower_bound: float
    vector: torch.Tensor


def power_iteration(
    op: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    *,
    input_shape: tuple[int, ...] | None = None,
    iters: int = 20,
    init: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> PowerIterationResult:
    """A LOWER bound on the operator norm of a linear map, by power iteration on ``A^* A``.

    **Never use it as a privacy bound**: ``||A v|| / ||v|| <= ||A||_2`` for every ``v``, so the
    estimate can only be too small. It is meant to steer projections (e.g. pick the direction to
    shrink) and for diagnostics (tightness of certified bounds), with the returned vector reused
    as ``init`` across steps.

    ``op`` is a matrix (``input_shape`` defaults to its column count) or a callable linear map on
    tensors of shape ``input_shape`` (the adjoint is taken by autograd, ``torch.func.vjp``).
    """
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters!r}")
    if isinstance(op, torch.Tensor):
        if op.dim() != 2:
            raise ValueError("a matrix op must be 2-D")
        matrix = op.detach()

        def _matvec(v: torch.Tensor) -> torch.Tensor:
            return matrix @ v

        forward: Callable[[torch.Tensor], torch.Tensor] = _matvec

        shape: tuple[int, ...] = (int(matrix.shape[1]),) if input_shape is None else input_shape
        dtype, device = matrix.dtype, matrix.device
    elif callable(op):
        if input_shape is None:
            raise ValueError("input_shape is required when op is a callable")
        forward = op
        shape = tuple(input_shape)
        dtype, device = torch.get_default_dtype(), None
    else:
        raise TypeError("op must be a 2-D tensor or a callable linear map")
    if init is not None:
        v = init.detach().clone()
        if tuple(v.shape) != tuple(shape):
            raise ValueError(f"init has shape {tuple(v.shape)}, expected {shape}")
        dtype, device = v.dtype, v.device
    else:
        v = torch.randn(shape, generator=generator, dtype=dtype)
        if device is not None:
            v = v.to(device)
    estimate = 0.0
    for _ in range(iters):
        norm = torch.linalg.vector_norm(v)
        if float(norm) == 0.0:
            return PowerIterationResult(0.0, v)
        v = v / norm
        # torch.func.vjp differentiates whatever the outer grad mode; with it off outside, no
        # outer graph reaches the op's parameters (a live private layer stays usable as op)
        with torch.no_grad():
            av, vjp = torch.func.vjp(forward, v)[:2]
        estimate = float(torch.linalg.vector_norm(av).item())
        v = vjp(av)[0].detach()
    norm = torch.linalg.vector_norm(v)
    return PowerIterationResult(estimate, v / norm if float(norm) > 0 else v)


def conv_power_iteration(
    weight: torch.Tensor,
    *,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    padding_mode: str = "zeros",
    input_size: int | tuple[int, int],
    iters: int = 20,
    init: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> PowerIterationResult:
    """LOWER bound on :func:`conv_norm`'s operator (power iteration; steering/diagnostics only)."""
    st = _as_pair(stride, "stride")
    pd = _as_pair(padding, "padding")
    size = _as_pair(input_size, "input_size")
    w = weight.detach()

    def op(x: torch.Tensor) -> torch.Tensor:
        return _conv_apply(x[None], w, st, pd, padding_mode)[0]

    if init is None:
        init = torch.randn((w.shape[1], *size), generator=generator, dtype=w.dtype).to(w.device)
    return power_iteration(op, input_shape=(int(w.shape[1]), *size), iters=iters, init=init)
