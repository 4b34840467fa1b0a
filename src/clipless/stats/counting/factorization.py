r"""The square-root factorisation of the prefix-sum matrix, with exact discrete Gaussian noise.

(Fichtenberger, Henzinger, Upadhyay, ICML 2023; Henzinger, Upadhyay, Upadhyay, SODA 2023.) zCDP
only.

**Precondition.** Integer leaf counts on a public grid of ``N <= 2^22`` leaves with ``n < 2^41``
values; a budget ``rho`` (discrete Gaussian noise only); under ``replace_one`` the size ``n`` is
public.

**Claim.** ``w = Lt x + Z`` (:func:`_release_factorization`) is ``rho``-zCDP under the relation;
the prefix estimate ``A Lt^-1 w`` and its conditioning on the public ``n`` are post-processing.

**Proof.** ``A`` (lower-triangular ones, ``N x N``) equals ``L L`` with ``L``
the lower-triangular Toeplitz matrix of ``c_k = binom(2k, k) / 4^k`` (the series of
``(1 - t)^(-1/2)``; ``c_0 = 1``, ``c_k = c_(k-1) (2k - 1) / (2k)``, computed in ``O(N)``). To
keep the noise *exact* (integer query, discrete Gaussian) the mechanism uses the integer
factor ``Lt`` with coefficients ``ct_k = round(2^20 c_k)`` (positive, non-increasing), releases
``w = Lt x + Z`` with ``Z`` i.i.d. discrete Gaussian (Canonne, Kamath, Steinke 2020), and
estimates the prefix counts by ``A Lt^-1 w = A x + A Lt^-1 Z`` (unbiased; ``A Lt^-1`` is
Toeplitz with coefficients ``g ~ c / 2^20``, computed by Newton's iteration on power series;
all products by FFT, ``O(N log N)``). ``Lt x`` is computed exactly in integers
(:func:`exact_convolve`: float FFTs on limbs small enough that a rigorous error bound is below
1/4, then rounded). *Sensitivity.* Changing one leaf count by 1 moves ``Lt x`` by a column of
``Lt``, squared norm at most ``St(N) = sum_(k<N) ct_k^2`` (column 0): the add/remove
sensitivity. Moving a value from leaf ``a`` to ``b = a + d`` moves it by ``Lt (e_b - e_a)``,
squared norm ``f(a, d)``; ``f(a, d) - f(a + 1, d) = (ct_(N-a-1) - ct_(N-a-d-1))^2 >= 0`` (the
only terms that leave the window), so the replace-one sensitivity is ``max_d f(0, d) = max_d
[St(N) + St(N - d) - 2 sum_(j < N-d) ct_j ct_(j+d)]``, all ``d`` at once by an exact integer
autocorrelation. Both are exact integers (tested against brute force). ``Z`` with ``sigma^2 >=
Delta_2^2 / (2 rho)`` (rational, rounded up) is ``rho``-zCDP (CKS 2020, Theorem 14).
*Error.* ``Var(Chat_i) = Var(Z_1) sum_(k <= i) g_k^2 ~ (Delta_2^2 / 2 rho) S(i+1) / 4^20``, i.e.
``S(N) S(i+1) / (2 rho)`` with ``S(m) = sum_(k<m) c_k^2 ~ 1 + ln(m) / pi``: the average is close
to the lower bound for any factorisation (the factorisation norm of ``A`` lies within
``0.701 .. 0.846`` of ``1 + ln(N) / pi``, Henzinger, Kalinin, Upadhyay 2025; Fichtenberger,
Henzinger, Upadhyay 2023). Under ``replace_one`` the public total is used: the estimate is
conditioned on ``C_N = n`` (Gaussian conditioning, post-processing). Pure DP is not offered:
the L1 norm of a column grows like ``sqrt(N)``.
"""

from __future__ import annotations

import random
from fractions import Fraction
from functools import lru_cache

import numpy as np
import scipy.signal
from numpy.typing import ArrayLike, NDArray

from clipless.stats.counting.release import (
    CountRelease,
    _condition_on_total,
    _count_release,
    _noise_param,
)
from clipless.stats.noise import discrete_gaussian, discrete_gaussian_variance
from clipless.stats.tree import Neighbouring, _check_neighbouring

_FACT_MAX_N = 1 << 22


@lru_cache(maxsize=16)
def factorization_coefficients(num_leaves: int) -> NDArray[np.float64]:
    """``c_k = binom(2k, k) / 4^k``, ``k < N``, by the recurrence ``c_k = c_(k-1)(2k-1)/(2k)``.

    >>> factorization_coefficients(4).tolist()
    [1.0, 0.5, 0.375, 0.3125]
    """
    if num_leaves < 1:
        raise ValueError(f"num_leaves must be >= 1, got {num_leaves}")
    k = np.arange(1, num_leaves, dtype=np.float64)
    ratios = (2.0 * k - 1.0) / (2.0 * k)
    out = np.concatenate([[1.0], np.cumprod(ratios)])
    out.setflags(write=False)
    return out


_FFT_K = 21  # Higham (2002), Theorem 24.2: each FFT errs by <= log2(M) * ~7u (relative, 2-norm)


def _fft_error_bound(m: int, a_l1: float, b_l2: float) -> float:
    """Upper bound on ``|fl(a * b) - a * b|_inf`` for the FFT convolution of length ``m``.

    Three FFTs of length ``M = 2^ceil(log2 m)`` (forward, forward, inverse) each with relative
    2-norm error ``<= log2(M) eta``, ``eta ~ 7u`` (Higham, "Accuracy and Stability of Numerical
    Algorithms", 2nd ed., section 24.1, Theorem 24.2), on vectors whose exact product has 2-norm
    ``<= ||a||_1 ||b||_2``; ``_FFT_K log2(M) + 2`` units cover the three transforms, the
    pointwise product and its rounding with a factor ~3 to spare. Used with a further factor 2
    below (``0.25`` instead of ``0.5``).
    """
    log_m = max(1, (m - 1).bit_length())
    return (_FFT_K * log_m + 2) * 2.0**-53 * a_l1 * b_l2


def _limbs(a: NDArray[np.int64], bits: int) -> list[NDArray[np.int64]]:
    out = []
    rest = a.copy()
    mask = (1 << bits) - 1
    while np.any(rest):
        out.append(rest & mask)
        rest = rest >> bits
    return out or [np.zeros_like(a)]


def exact_convolve(a: ArrayLike, b: ArrayLike, size: int) -> NDArray[np.int64]:
    """The first ``size`` entries of the convolution of two non-negative int64 vectors, exactly.

    Small inputs: :func:`numpy.convolve` (integer arithmetic). Large ones: both vectors are cut
    into ``bits``-bit limbs so small that every limb product's FFT error bound
    (:func:`_fft_error_bound`) is below ``1/4``; each limb product is then the rounding of its
    float FFT convolution, exactly, and the limbs recombine in int64. The result must fit in
    int64: ``max(a) * sum(b) < 2^62`` is checked. ``O(N log N)`` per limb pair.
    """
    x = np.asarray(a, dtype=np.int64)
    y = np.asarray(b, dtype=np.int64)
    if np.any(x < 0) or np.any(y < 0):
        raise ValueError("exact_convolve needs non-negative integers")
    if (
        float(x.max(initial=0)) * float(y.sum()) >= 2.0**62
        or float(y.max(initial=0)) * float(x.sum()) >= 2.0**62
    ):
        raise OverflowError("the convolution does not fit in int64")
    if x.size * y.size <= 1 << 22:
        return np.convolve(x, y)[:size].astype(np.int64)
    m = x.size + y.size - 1
    bits = 31
    while bits > 1:
        xl, yl = _limbs(x, bits), _limbs(y, bits)
        worst = max(
            min(
                _fft_error_bound(
                    m, float(p.sum()), float(np.sqrt(np.sum(q.astype(np.float64) ** 2)))
                ),
                _fft_error_bound(
                    m, float(q.sum()), float(np.sqrt(np.sum(p.astype(np.float64) ** 2)))
                ),
            )
            for p in xl
            for q in yl
        )
        if worst < 0.25:
            break
        bits -= 1
    else:  # pragma: no cover - only for astronomically large inputs
        return np.convolve(x, y)[:size].astype(np.int64)
    out = np.zeros(size, dtype=np.int64)
    for i, p in enumerate(xl):
        for j, q in enumerate(yl):
            if not (np.any(p) and np.any(q)):
                continue
            f = scipy.signal.fftconvolve(p.astype(np.float64), q.astype(np.float64))[:size]
            r = np.rint(f)
            if np.max(np.abs(f - r), initial=0.0) >= 0.25:  # pragma: no cover - contradicts bound
                raise ArithmeticError("FFT error above its certified bound")
            out += r.astype(np.int64) << (bits * (i + j))
    return out


_FACT_BITS = 20


@lru_cache(maxsize=16)
def factorization_integer_coefficients(num_leaves: int) -> NDArray[np.int64]:
    """``ct_k = round(2^20 c_k)``: the integer Toeplitz factor actually used (module doc).

    Positive and non-increasing (rounding is monotone and ``c`` decreases), which the
    replace-one sensitivity argument needs; checked here.
    """
    if num_leaves > _FACT_MAX_N:
        raise ValueError(f"the factorisation is implemented for N <= 2^22, got {num_leaves}")
    c = factorization_coefficients(num_leaves)
    out = np.rint(c * float(1 << _FACT_BITS)).astype(np.int64)
    if out[-1] < 1 or np.any(np.diff(out) > 0):  # pragma: no cover - impossible for N <= 2^22
        raise AssertionError("integer factor coefficients must be positive, non-increasing")
    out.setflags(write=False)
    return out


@lru_cache(maxsize=16)
def factorization_sensitivity(num_leaves: int, neighbouring: Neighbouring) -> int:
    """Squared L2 sensitivity of ``Lt x`` (``Lt``: lower-triangular Toeplitz of
    :func:`factorization_integer_coefficients`): an exact integer for add/remove (``St(N) =
    sum_k ct_k^2``) and for replace-one (``max_d [St(N) + St(N-d) - 2 sum_j ct_j ct_(j+d)]``,
    module docstring; the autocorrelation by :func:`exact_convolve`)."""
    _check_neighbouring(neighbouring)
    ct = factorization_integer_coefficients(num_leaves)
    sq = ct * ct  # <= 2^40 each; N <= 2^22 keeps every sum below 2^62
    cums = np.concatenate([[0], np.cumsum(sq)])
    total = int(cums[-1])
    if neighbouring == "add_remove" or num_leaves == 1:
        return total
    n = num_leaves
    auto = exact_convolve(ct, ct[::-1], 2 * n - 1)[n - 1 :]  # auto[d] = sum_j ct_j ct_(j+d)
    d = np.arange(1, n)
    f = total + cums[n - d] - 2 * auto[d]
    return int(np.max(f))


def _lower_toeplitz_apply(c: NDArray[np.float64], x: NDArray[np.float64]) -> NDArray[np.float64]:
    return np.asarray(scipy.signal.fftconvolve(c, x)[: x.size], dtype=np.float64)


@lru_cache(maxsize=16)
def _estimator_coefficients(num_leaves: int) -> NDArray[np.float64]:
    """``g``: the Toeplitz coefficients of ``A Lt^-1`` (the series of ``1 / ((1 - t) Ct(t))``),
    by Newton's iteration ``g <- g (2 - h g)`` with FFT products, ``O(N log N)``; float64
    (post-processing only). ``g ~ c / 2^20``."""
    ct = factorization_integer_coefficients(num_leaves).astype(np.float64)
    h = np.concatenate([[ct[0]], np.diff(ct)])  # (1 - t) Ct(t)
    g = np.array([1.0 / h[0]])
    m = 1
    while m < num_leaves:
        m = min(2 * m, num_leaves)
        hg = scipy.signal.fftconvolve(h[:m], g)[:m]
        corr = -hg
        corr[0] += 2.0
        g = scipy.signal.fftconvolve(g, corr)[:m]
    g.setflags(write=False)
    return g


def _factorization_moments(
    num_leaves: int, neighbouring: Neighbouring, node_var: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``Var(Chat_i)`` and ``Cov(Chat_i, Chat_N)`` of the factorisation's estimate, before any
    conditioning, for noise variance ``node_var``."""
    g = _estimator_coefficients(num_leaves)
    variance = node_var * np.cumsum(g * g)
    cov_n = node_var * scipy.signal.fftconvolve(g, g[::-1])[:num_leaves]
    return variance, cov_n


@lru_cache(maxsize=64)
def factorization_score(num_leaves: int, neighbouring: Neighbouring, rho: Fraction) -> float:
    """The factorisation's exact mean error score at ``rho`` (the same score as
    :func:`_tree_score`: conditioned on ``C_N = n`` under replace-one, ``Chat_i - (i/N)
    Chat_N`` under add/remove), with the discrete Gaussian's exact variance."""
    sigma2 = _noise_param(factorization_sensitivity(num_leaves, neighbouring), "gaussian", rho)
    var, cov = _factorization_moments(num_leaves, neighbouring, discrete_gaussian_variance(sigma2))
    if neighbouring == "replace_one":
        return float(np.mean(_condition_on_total(np.zeros(num_leaves), var, cov, 0.0)[1]))
    f = np.arange(1, num_leaves + 1, dtype=np.float64) / num_leaves
    return float(np.mean(var - 2 * f * cov + f * f * var[-1]))


def _release_factorization(
    counts: NDArray[np.int64],
    neighbouring: Neighbouring,
    budget: Fraction,
    gen: random.Random,
    rho_out: float | None,
) -> CountRelease:
    """``mechanism="factorization"`` (module docstring): ``w = Lt x + Z`` with ``Z`` discrete
    Gaussian, the prefix estimate ``A Lt^-1 w``; under replace-one, conditioned on ``C_N = n``."""
    N = int(counts.size)
    sens2 = factorization_sensitivity(N, neighbouring)
    sigma2 = _noise_param(sens2, "gaussian", budget)
    ct = factorization_integer_coefficients(N)
    if float(counts.sum()) * float(ct[0]) >= 2.0**61:
        raise ValueError("too many values for the factorisation's int64 arithmetic (n < 2^41)")
    z = discrete_gaussian(None, N, gen, sigma2=sigma2)
    noisy_int = exact_convolve(ct, counts, N) + z  # Lt x + Z: the only DP step
    noisy_vec = noisy_int.astype(np.float64)
    g = _estimator_coefficients(N)
    prefix = _lower_toeplitz_apply(g, noisy_vec)  # A Lt^-1 (Lt x + Z) = A x + A Lt^-1 Z
    node_var = discrete_gaussian_variance(sigma2)
    variance, cov_n = _factorization_moments(N, neighbouring, node_var)
    if neighbouring == "replace_one":
        # condition on C_N = n (public): Cov(Chat_i, Chat_N) = var sum_j g_(i-j) g_(N-1-j)
        prefix, variance = _condition_on_total(prefix, variance, cov_n, counts.sum())
    return _count_release(
        "factorization", (prefix, variance, noisy_vec), "gaussian", sigma2, node_var, sens2,
        neighbouring, (None, rho_out),
    )  # fmt: skip
