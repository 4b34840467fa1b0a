"""Gram iteration (certified upper bounds) and power iteration (lower bounds, steering only).

:func:`gram_iteration` bounds the spectral norms of a batch of matrices by matrix products alone
(Delattre et al. 2023, "Efficient bound of Lipschitz constant for convolutional layers by Gram
iteration"), with the rounding of a float64 iteration covered a priori
(:func:`_gram_rounding_factor`): the certificate an accelerator computes. :func:`power_iteration`
gives a *lower* bound, for steering projections and diagnostics only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from clipless import _validate
from clipless._certified import UNIT_ROUNDOFF
from clipless.norms.certificates import _TINY, NUMERIC_MARGIN, all_finite


def _gram_rounding_factor(rows: int, cols: int, complex_: bool) -> float:
    """A-priori factor ``1 / (1 - a)`` covering the rounding of a float64 Gram iteration.

    Precondition: ``a < 1/2`` for the shape (``ValueError`` otherwise).

    Claim: after ``T`` computed steps of :func:`_gram_bounds` on a ``rows x cols`` matrix ``W``
    (scales ``c_t``, last iterate ``H_T``),
    ``s(W) <= prod_t c_t^(2^-t) s(H_T)^(2^-T) (1 - a)^-(1 - 2^-T)``, for every ``T``.

    Proof sketch (``u`` unit roundoff, ``r = min(rows, cols)`` bounds every iterate's rank,
    ``k = max(rows, cols)`` every inner dimension, ``s(.)`` the spectral norm, ``F(.)`` the
    Frobenius norm, ``F <= sqrt(r) s``). One step rescales ``H' = fl(H / c)`` (entrywise relative
    error ``u``, so ``s(H') >= (s(H) / c)(1 - u sqrt(r))``) and forms ``fl(H'^H H') = H'^H H' + E``
    with ``||E||_2 <= ||E||_F <= gamma_k F(H')^2 <= gamma_k r (1 + u)^2 (s(H) / c)^2``
    (``gamma_k = k u / (1 - k u)``; doubled, with ``k + 4``, for complex arithmetic). Hence
    ``s(H_next) >= (s(H) / c)^2 (1 - a)``, with ``a`` as computed below, and unrolling ``T``
    steps gives ``s(W) <= prod_t c_t^(2^-t) s(H_T)^(2^-T) (1 - a)^-(1 - 2^-T)``.

    A step that does not rescale (``c_t = 1``, :func:`_normalised_steps`) is the same step
    without the division's rounding. Underflow adds at most ``k 2^-1075`` to an entry of a
    product, ``r k 2^-1075`` to ``||E||_F``; every iterate at most two unscaled steps after a
    division by its Frobenius norm has ``s >= r^-2 (1 - a)^3 >= 2^-60`` (``F = 1`` there and
    ``s >= F / sqrt(r)``; ``r < 2^26`` when ``a < 1/2``), so that term is below ``2^-900`` of
    ``s^2``: inside :data:`NUMERIC_MARGIN` with the final roundings.
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

    Precondition: ``mats`` finite, of a shape :func:`_gram_rounding_factor` accepts; ``iters >=
    0`` (``ValueError`` otherwise).

    Claim: ``result[i] >= ||mats[i]||_2`` for every matrix ``i``; up to rounding, it exceeds it
    by at most the factor ``rank^(2^-(iters+1))``.

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
    if not _validate.is_int(iters) or iters < 0:
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


def _gram_bounds(mats: torch.Tensor, iters: int, *, unscaled: bool = False) -> torch.Tensor:
    """:func:`gram_iteration` without host reads: ``inf`` where a matrix is not finite.

    ``unscaled``: the caller has proved that no square of an entry overflows float64 and that
    the squares that underflow change the first Frobenius norm by less than NUMERIC_MARGIN
    (relative), so the power-of-two scaling is skipped; implied for float32 and narrower
    entries, whose squares are exact in float64."""
    complex_ = mats.is_complex()
    h = mats.detach().to(torch.complex128 if complex_ else torch.float64)
    rows, cols = h.shape[-2], h.shape[-1]
    factor = _gram_rounding_factor(rows, cols, complex_) * (1.0 + NUMERIC_MARGIN)
    batch = h.shape[:-2]
    if h.numel() == 0:
        return torch.zeros(batch, dtype=torch.float64, device=h.device)
    if min(rows, cols) == 1:
        iters = 0  # a vector's Frobenius norm is its spectral norm: iterating gains nothing
    if unscaled or mats.dtype in _NARROW:
        # entries of at most float32's range square exactly in float64 with neither overflow
        # nor underflow (|x| in [2^-149, 2^128]): the first Frobenius norm needs no scaling, and
        # it is finite exactly when every entry is
        log_scale: torch.Tensor | None = None
        finite = None
    else:
        h, log_scale, finite = _scaled_to_unit(h)
    # Put the smaller dimension last once, so every Gram matrix is min(m, n) square.
    if rows < cols:
        h = h.mH
    # A normalised step t divides the iterate by its Frobenius norm c_t (the others take
    # c_t = 1); log_scale + sum_t 2^-t log c_t is then the bound from ||G_t||_F, summed once
    # after the loop (one operator, not four per step). c_0 is 0 only for a zero matrix (the
    # first iterate's squares cannot underflow, later ones have norm >= r^-4): its NaN iterates
    # are replaced by the exact bound 0 at the end.
    first = torch.linalg.vector_norm(h, dim=(-2, -1), keepdim=True)
    cs = []
    scaled = _normalised_steps(iters)
    for t in range(iters):
        if t in scaled:
            c = first if t == 0 else torch.linalg.vector_norm(h, dim=(-2, -1), keepdim=True)
            cs.append(c)
            h = h.div_(c) if t else h / c
        h = _gram_product(h)
    zero = (first == 0).reshape(batch)
    if finite is None:
        finite = torch.isfinite(first).reshape(batch)
    # The last iterate's Hoelder / Frobenius bound (log ``last``) usually improves on its
    # Frobenius norm, 1 after the division, but with rounding not always: the result takes the
    # smaller of the two, ``min(last, 0)``.
    best = torch.log(_hoelder_fro(h)) * (2.0**-iters)
    if cs:
        steps = torch.log(torch.cat(cs, dim=-1)) @ _halvings(scaled, h.device)
        best = steps.reshape(batch) + best.clamp_max(0.0)
    if log_scale is not None:
        best = best + log_scale
    bound = torch.exp(best) * factor
    # a subnormal result has lost relative precision: the smallest normal number bounds it
    bound = torch.where(zero, 0.0, bound.clamp_min(_TINY))
    return torch.where(finite, bound, math.inf)


def _normalised_steps(iters: int) -> tuple[int, ...]:
    """The steps that divide the iterate by its Frobenius norm: the first, the last, and enough
    between that at most two steps in a row skip it (each skip saves a reduction and a division;
    the iterates stay within ``[r^-2, 1]`` in spectral norm, :func:`_gram_rounding_factor`)."""
    return tuple(t for t in range(iters) if t == 0 or (iters - 1 - t) % 3 == 0)


_HALVINGS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _halvings(steps: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[2^-t for t in steps]`` (float64, exact) on ``device``, built once."""
    key = (steps, device)
    cached = _HALVINGS.get(key)
    if cached is None:
        exponents = torch.tensor(steps, dtype=torch.float64)
        cached = _HALVINGS[key] = torch.pow(0.5, exponents).to(device)
    return cached


class GramRequest(NamedTuple):
    """One call of :func:`_gram_bounds`: ``mats`` of shape ``(..., m, n)``, ``iters`` steps,
    ``unscaled`` as there."""

    mats: torch.Tensor
    iters: int
    unscaled: bool = False


# Matrices padded into one batch may cost this factor more products than their own chains, plus
# this many multiply-adds, which launch-bound small chains absorb. Large float64 chains are
# bound by their products (two 1024-square chains of 12 steps: ~50 GFLOP), so the factor stays
# small: padding saves launches, never whole chains' worth of products.
_PAD_WASTE = 1.25
_PAD_FREE_FLOPS = 2.0**22


def _gram_bounds_many(requests: Sequence[GramRequest]) -> list[torch.Tensor]:
    """:func:`_gram_bounds` of every request, as one chain of batched products per bucket.

    Requests on one device with the same kind (real / complex) and number of steps are sorted by
    size and bucketed while zero-padding them to the bucket's largest shape wastes at most
    :data:`_PAD_WASTE` of the products (and :data:`_PAD_FREE_FLOPS`): one chain of kernels per
    bucket instead of one per request. A bucket of one request is :func:`_gram_bounds` itself.

    Claim: each result bounds its request's spectral norms as :func:`_gram_bounds` does. Proof:
    a ``k x n`` matrix ``W`` (oriented ``k >= n``) placed in the corner of a ``K x N`` zero matrix
    ``P`` has the same non-zero singular values, so ``||P||_2 = ||W||_2``; :func:`_gram_bounds`
    certifies ``||P||_2`` with the rounding factor of the padded shape (larger ``K`` and ``N``
    only enlarge it), and its per-matrix scaling (``amax``) is unchanged by the zeros.
    """
    results: dict[int, torch.Tensor] = {}
    groups: dict[tuple[torch.device, bool, int], list[int]] = {}
    for i, req in enumerate(requests):
        rows, cols = req.mats.shape[-2], req.mats.shape[-1]
        iters = 0 if min(rows, cols) == 1 else req.iters
        groups.setdefault((req.mats.device, req.mats.is_complex(), iters), []).append(i)
    for (_, _, iters), members in groups.items():
        for bucket in _buckets([requests[i] for i in members], members, iters):
            bounds = _bucket_bounds([requests[i] for i in bucket], iters)
            results.update(zip(bucket, bounds, strict=True))
    return [results[i] for i in range(len(requests))]


def _bucket_bounds(reqs: list[GramRequest], iters: int) -> list[torch.Tensor]:
    """The bounds of one bucket's requests, from one chain."""
    if len(reqs) == 1:
        return [_gram_bounds(reqs[0].mats, reqs[0].iters, unscaled=reqs[0].unscaled)]
    padded, unscaled = _padded(reqs)
    flat = _gram_bounds(padded, iters, unscaled=unscaled)
    out, start = [], 0
    for req in reqs:
        batch = req.mats.shape[:-2]
        count = math.prod(batch)
        out.append(flat[start : start + count].reshape(batch))
        start += count
    return out


def _oriented(shape: torch.Size) -> tuple[int, int, int]:
    """``(matrices, larger dimension, smaller dimension)`` of a ``(..., m, n)`` shape."""
    rows, cols = int(shape[-2]), int(shape[-1])
    return math.prod(shape[:-2]), max(rows, cols), min(rows, cols)


def _chain_flops(count: int, big: int, small: int, iters: int) -> float:
    """Multiply-adds of :func:`_gram_bounds` on ``count`` matrices of ``big x small``."""
    if iters == 0:
        return float(count * big * small)
    return float(count) * (big * small * small + (iters - 1) * small**3)


def _buckets(reqs: list[GramRequest], ids: list[int], iters: int) -> list[list[int]]:
    """Greedy buckets of request ids (largest first) within the padding allowance."""
    order = sorted(range(len(reqs)), key=lambda j: _oriented(reqs[j].mats.shape)[1:], reverse=True)
    buckets: list[list[int]] = []
    count = big = small = 0
    own = 0.0
    for j in order:
        c, b, s = _oriented(reqs[j].mats.shape)
        mine = _chain_flops(c, b, s, iters)
        if buckets:
            padded = _chain_flops(count + c, max(big, b), max(small, s), iters)
            if padded <= _PAD_WASTE * (own + mine) + _PAD_FREE_FLOPS:
                buckets[-1].append(ids[j])
                count, big, small, own = count + c, max(big, b), max(small, s), own + mine
                continue
        buckets.append([ids[j]])
        count, big, small, own = c, b, s, mine
    return buckets


def _padded(reqs: list[GramRequest]) -> tuple[torch.Tensor, bool]:
    """The requests' matrices oriented ``big x small`` and zero-padded into one batch
    (float64 or complex128), and whether every request may skip the scaling."""
    shapes = [_oriented(r.mats.shape) for r in reqs]
    big, small = max(s[1] for s in shapes), max(s[2] for s in shapes)
    first = reqs[0].mats
    dtype = torch.complex128 if first.is_complex() else torch.float64
    out = torch.zeros((sum(s[0] for s in shapes), big, small), dtype=dtype, device=first.device)
    start = 0
    for req, (count, b, s) in zip(reqs, shapes, strict=True):
        mats = req.mats.detach().reshape(count, *req.mats.shape[-2:])
        if mats.shape[-2] < mats.shape[-1]:
            mats = mats.mH
        out[start : start + count, :b, :s] = mats
        start += count
    unscaled = all(r.unscaled or r.mats.dtype in _NARROW for r in reqs)
    return out, unscaled


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
    if not _validate.is_int(iters) or iters < 1:
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
