"""Exact integer noise: discrete Laplace and discrete Gaussian samplers.

The DP-ECDF adds noise to integer counts, so it uses integer-valued noise sampled **exactly**
(no floating point in the sampling path), following Canonne, Kamath and Steinke, "The Discrete
Gaussian for Differential Privacy" (NeurIPS 2020, arXiv:2004.00010), Algorithms 1-3:

* Algorithm 1: ``Bernoulli(exp(-gamma))`` for rational ``gamma >= 0`` from ``Bernoulli(p)``
  with rational ``p`` only;
* Algorithm 2: the discrete Laplace ``P(Z = z) ∝ exp(-|z| / scale)`` for rational
  ``scale = t / s``: ``X = U + t V`` (``U`` uniform on ``{0..t-1}`` accepted with probability
  ``exp(-U/t)``, ``V`` geometric), ``Y = floor(X / s)``, a random sign, rejecting ``-0``;
* Algorithm 3: the discrete Gaussian ``P(Z = z) ∝ exp(-z^2 / (2 sigma^2))`` for rational
  ``sigma^2``, by rejection from a discrete Laplace of integer scale ``floor(sigma) + 1``.

Every random decision is a comparison between uniform random integers and exact rationals,
so the output distribution is exactly the stated one (no floating-point rounding, no
"floating-point Laplace" attack of Mironov 2012). A ``float`` parameter is converted exactly
with :class:`fractions.Fraction` (its binary value, e.g. ``0.1`` is
``3602879701896397 / 2**55``).

**Randomness.** The only source is a :class:`random.Random` instance used for uniform bytes
(``randbytes``) and uniform integers (``randrange``). The default, :func:`secure_rng`, is
:class:`secrets.SystemRandom` (the operating system's CSPRNG); :func:`seeded_rng` gives a
reproducible Mersenne Twister **for tests only** (not cryptographically secure).

**Speed (design choice).** A pure-Python transcription of Algorithms 1-3 costs tens of
microseconds per sample; the tree mechanism at ``N = 2**15`` needs ``~5 * 10**5`` samples. The
samplers are therefore vectorised with numpy on 64-bit words: uniform integers below a bound
``m <= 2**62`` come from masked rejection sampling on random words (exact), and
``Bernoulli(u / (t K))`` is ``Bernoulli(1/K) AND [W < u]`` with ``W`` uniform below ``t`` (exact,
since ``{0..tK-1}`` is the product of ``{0..K-1}`` and ``{0..t-1}``). The vectorised discrete
Laplace needs the scale's numerator and denominator (in lowest terms) below ``2**62``; other
scales, and batches of at most 48 samples (where numpy's per-call overhead dominates), use the
exact scalar transcription with Python integers (same distribution). The discrete
Gaussian's acceptance test uses Python integers for its exact rational exponent and 64-bit
words for the comparisons (ties, probability ``2**-64``, are resolved exactly). Measured on one
core: ~0.5 s for 500k discrete Laplace samples. OpenDP offers the same samplers but is not a
dependency here; these are small enough to own and test.
"""

from __future__ import annotations

import math
import random
import secrets
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from clipless import _validate

__all__ = [
    "RealLike",
    "conservative_scale",
    "discrete_gaussian",
    "discrete_gaussian_pmf",
    "discrete_gaussian_variance",
    "discrete_laplace",
    "discrete_laplace_pmf",
    "discrete_laplace_variance",
    "secure_rng",
    "seeded_rng",
    "to_fraction",
]

RealLike = int | float | Fraction | np.integer | np.floating

_FAST_LIMIT = 1 << 62
# one call draws at most this many samples (8 GiB of int64): a named error instead of numpy's
# MemoryError for an absurd size
_MAX_SAMPLES = 1 << 30
_INT64_MAX = (1 << 63) - 1
# below this many samples the scalar exact path is faster than numpy's per-call overhead
_SMALL_BATCH = 48


# --------------------------------------------------------------------------------------------
# randomness sources
# --------------------------------------------------------------------------------------------


def secure_rng() -> random.Random:
    """The default randomness source: :class:`secrets.SystemRandom` (OS CSPRNG)."""
    return secrets.SystemRandom()


def seeded_rng(seed: int) -> random.Random:
    """A reproducible source for tests and examples. **Not** cryptographically secure.

    Args:
        seed: the seed of the :class:`random.Random` (anyone who knows it knows the draws).
    """
    seed = _validate.integer("seed", seed)
    return random.Random(int(seed))


def resolve_rng(rng: random.Random | None) -> random.Random:
    """``rng`` itself, or a fresh :func:`secure_rng` when ``None``."""
    if rng is None:
        return secure_rng()
    if not isinstance(rng, random.Random):
        raise TypeError(
            "rng must be a random.Random instance (secure_rng() or seeded_rng(seed)) or None, "
            f"got {type(rng).__name__}"
        )
    return rng


def to_fraction(value: RealLike, name: str, *, positive: bool = True) -> Fraction:
    """Exact conversion of an int, float or Fraction to a Fraction (validating it).

    Args:
        value: an int, a finite float or a :class:`~fractions.Fraction` (NumPy scalars too).
        name: the argument's name, for the error.
        positive: refuse a value ``<= 0``.

    Raises:
        TypeError: not a real number.
        ValueError: not finite, or ``<= 0`` with ``positive``.
    """
    if not _validate.is_real(value):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(float(value)):
            raise ValueError(f"{name} must be finite, got {value}")
        out = Fraction(float(value))
    elif isinstance(value, np.integer):
        out = Fraction(int(value))
    else:
        out = Fraction(value)
    if positive and out <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return out


def conservative_scale(scale: Fraction, bits: int = 61) -> Fraction:
    """``scale`` itself if its numerator and denominator fit in ``bits`` bits, else the smallest
    dyadic rational ``>= scale`` whose numerator does (relative increase ``<= 2**(1-bits) /
    scale``, about ``1e-17``).

    Mechanisms use it so that the vectorised exact sampler applies: a *larger* Laplace scale
    ``b' >= Delta/epsilon`` gives privacy loss ``Delta/b' <= epsilon``, so the guarantee is kept
    (the release records the scale actually used). E.g. ``epsilon = 0.01`` as a float is
    ``5764607523034235 / 2**59``, and ``16 / epsilon`` has a 64-bit numerator.

    Args:
        scale: the exact scale (a Laplace ``b`` or a Gaussian ``sigma^2``), ``> 0``.
        bits: the largest numerator and denominator size the sampler takes.

    Raises:
        ValueError: a scale too large for the exact sampler (a budget too small).
    """
    limit = 1 << bits
    if scale.numerator < limit and scale.denominator < limit:
        return scale
    k = bits - (-(-scale.numerator // scale.denominator)).bit_length()
    if k < 0:
        digits = len(str(scale.numerator // scale.denominator))
        raise ValueError(
            f"the noise scale (about 10^{digits - 1}) is too large for the exact sampler: epsilon "
            "(or rho) is too small"
        )
    return Fraction(-(-scale.numerator * (1 << k) // scale.denominator), 1 << k)


def _size_tuple(size: int | tuple[int, ...]) -> tuple[int, ...]:
    if _validate.is_int(size):
        shape: tuple[int, ...] = (int(size),)
    elif isinstance(size, tuple) and all(_validate.is_int(s) for s in size):
        shape = tuple(int(s) for s in size)
    else:
        raise TypeError(f"size must be an int or a tuple of ints, got {size!r}")
    if any(s < 0 for s in shape):
        raise ValueError(f"size must be non-negative, got {size!r}")
    if math.prod(shape) > _MAX_SAMPLES:
        raise ValueError(
            f"size {size!r} asks for {math.prod(shape)} samples; at most {_MAX_SAMPLES} per call"
        )
    return shape


class _Words:
    """Vectorised exact uniform integers from a :class:`random.Random` byte source."""

    __slots__ = ("rng",)

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def words(self, n: int) -> NDArray[np.uint64]:
        if n <= 0:
            return np.empty(0, dtype=np.uint64)
        return np.frombuffer(self.rng.randbytes(8 * n), dtype="<u8").astype(np.uint64)

    def below(self, bound: int | NDArray[np.uint64], n: int) -> NDArray[np.uint64]:
        """``n`` independent uniform integers in ``[0, bound)`` (``1 <= bound <= 2**62``)."""
        out = np.empty(n, dtype=np.uint64)
        if n == 0:
            return out
        if isinstance(bound, np.ndarray):
            bnd = bound.astype(np.uint64, copy=False)
            x = bnd - np.uint64(1)
            for shift in (1, 2, 4, 8, 16, 32):
                x = x | (x >> np.uint64(shift))
            mask_arr = x
            todo = np.arange(n)
            while todo.size:
                w = self.words(todo.size) & mask_arr[todo]
                ok = w < bnd[todo]
                out[todo[ok]] = w[ok]
                todo = todo[~ok]
            return out
        b = int(bound)
        mask = np.uint64((1 << (b - 1).bit_length()) - 1)
        ub = np.uint64(b)
        todo = np.arange(n)
        while todo.size:
            w = self.words(todo.size) & mask
            ok = w < ub
            out[todo[ok]] = w[ok]
            todo = todo[~ok]
        return out


def _bernoulli_inv(k: NDArray[np.uint64], src: _Words) -> NDArray[np.bool_]:
    """``Bernoulli(1/k)`` elementwise."""
    return src.below(k, k.size) == 0


def _bernoulli_exp_frac(u: NDArray[np.uint64], t: int, src: _Words) -> NDArray[np.bool_]:
    """CKS Algorithm 1: ``Bernoulli(exp(-u/t))`` elementwise for integers ``0 <= u < t``."""
    n = u.size
    result = np.empty(n, dtype=bool)
    k = np.ones(n, dtype=np.uint64)
    active = np.arange(n)
    while active.size:
        ka = k[active]
        # Bernoulli(u / (t K)) = Bernoulli(1/K) and [W < u], W uniform on {0..t-1}
        a = _bernoulli_inv(ka, src) & (src.below(t, active.size) < u[active])
        stop = ~a
        result[active[stop]] = (ka[stop] & np.uint64(1)) == 1
        active = active[a]
        k[active] += np.uint64(1)
    return result


def _bernoulli_exp1(n: int, src: _Words) -> NDArray[np.bool_]:
    """CKS Algorithm 1 with ``gamma = 1``: ``Bernoulli(exp(-1))``, ``n`` times."""
    result = np.empty(n, dtype=bool)
    k = np.ones(n, dtype=np.uint64)
    active = np.arange(n)
    while active.size:
        ka = k[active]
        a = _bernoulli_inv(ka, src)
        stop = ~a
        result[active[stop]] = (ka[stop] & np.uint64(1)) == 1
        active = active[a]
        k[active] += np.uint64(1)
    return result


def _geometric_exp1(n: int, src: _Words) -> NDArray[np.int64]:
    """``P(V = v) = (1 - e^-1) e^-v``: successes of ``Bernoulli(exp(-1))`` before a failure."""
    v = np.zeros(n, dtype=np.int64)
    active = np.arange(n)
    while active.size:
        b = _bernoulli_exp1(active.size, src)
        active = active[b]
        v[active] += 1
    return v


def _bernoulli_rational(num: list[int], den: int, src: _Words) -> NDArray[np.bool_]:
    """``Bernoulli(num_i / den)`` elementwise, exactly, for integers ``0 <= num_i <= den``."""
    n = len(num)
    if n == 0:
        return np.empty(0, dtype=bool)
    if den <= _FAST_LIMIT:
        nums = np.array(num, dtype=np.uint64)
        return src.below(den, n) < nums
    # compare 64 uniform bits with the first 64 bits of num/den; resolve ties exactly
    cut = np.empty(n, dtype=np.uint64)
    rems: list[int] = []
    for i, x in enumerate(num):
        q, r = divmod(x << 64, den)
        if q >> 64:  # num == den
            q, r = (1 << 64) - 1, den
        cut[i] = q
        rems.append(r)
    w = src.words(n)
    out = w < cut
    for i in np.flatnonzero(w == cut).tolist():
        out[i] = src.rng.randrange(den) < rems[i]
    return out


def _bernoulli_exp_rational(num: list[int], den: int, src: _Words) -> NDArray[np.bool_]:
    """CKS Algorithm 1 (general ``gamma >= 0``): ``Bernoulli(exp(-num_i/den))`` elementwise."""
    n = len(num)
    whole = [x // den for x in num]
    frac = [x - w * den for x, w in zip(num, whole, strict=True)]
    alive = np.ones(n, dtype=bool)
    whole_arr = np.array([min(w, _INT64_MAX) for w in whole], dtype=np.int64)
    max_whole = int(whole_arr.max()) if n else 0
    for j in range(max_whole):
        idx = np.flatnonzero(alive & (whole_arr > j))
        if idx.size == 0:
            break
        alive[idx] &= _bernoulli_exp1(idx.size, src)
    result = np.zeros(n, dtype=bool)
    active = np.flatnonzero(alive)
    k = np.ones(n, dtype=np.uint64)
    while active.size:
        ka = k[active]
        a = _bernoulli_inv(ka, src) & _bernoulli_rational(
            [frac[i] for i in active.tolist()], den, src
        )
        stop = ~a
        result[active[stop]] = (ka[stop] & np.uint64(1)) == 1
        active = active[a]
        k[active] += np.uint64(1)
    return result


# --------------------------------------------------------------------------------------------
# scalar reference implementations (exact, Python integers only)
# --------------------------------------------------------------------------------------------


def _bernoulli_exp_scalar(gamma: Fraction, rng: random.Random) -> bool:
    """CKS Algorithm 1, scalar, for rational ``gamma >= 0``."""
    while gamma > 1:
        if not _bernoulli_exp_scalar(Fraction(1), rng):
            return False
        gamma -= 1
    k = 1
    while rng.randrange(gamma.denominator * k) < gamma.numerator:
        k += 1
    return k % 2 == 1


def _discrete_laplace_scalar(scale: Fraction, rng: random.Random) -> int:
    """CKS Algorithm 2, scalar: ``P(z) ∝ exp(-|z| / scale)``, ``scale = t/s``."""
    t, s = scale.numerator, scale.denominator
    while True:
        u = rng.randrange(t)
        if not _bernoulli_exp_scalar(Fraction(u, t), rng):
            continue
        v = 0
        while _bernoulli_exp_scalar(Fraction(1), rng):
            v += 1
        y = (u + t * v) // s
        b = rng.randrange(2)
        if b == 1 and y == 0:
            continue
        return -y if b else y


def _discrete_gaussian_scalar(sigma2: Fraction, rng: random.Random) -> int:
    """CKS Algorithm 3, scalar: ``P(z) ∝ exp(-z^2 / (2 sigma2))``."""
    t = math.isqrt(sigma2.numerator // sigma2.denominator) + 1
    while True:
        y = _discrete_laplace_scalar(Fraction(t), rng)
        gamma = (abs(y) - sigma2 / t) ** 2 / (2 * sigma2)
        if _bernoulli_exp_scalar(gamma, rng):
            return y


# --------------------------------------------------------------------------------------------
# public samplers
# --------------------------------------------------------------------------------------------


def _discrete_laplace_fast(t: int, s: int, n: int, src: _Words) -> NDArray[np.int64]:
    """Vectorised CKS Algorithm 2 for ``scale = t/s`` with ``t, s < 2**62``."""
    out = np.empty(n, dtype=np.int64)
    filled = 0
    q, r = divmod(t, s)
    # q v + (u + r v) // s <= INT64_MAX whenever q v, r v <= (INT64_MAX - t) / 2 (u < t)
    vmax = (_INT64_MAX - t) // 2 // max(q, r, 1)
    while filled < n:
        need = n - filled
        m = int(need * 1.8) + 16 if need > 64 else 2 * need + 16
        u = src.below(t, m)
        u = u[_bernoulli_exp_frac(u, t, src)] if t > 1 else u
        v = _geometric_exp1(u.size, src)
        big = v > vmax
        vs = np.where(big, 0, v)
        y = q * vs + (u.astype(np.int64) + r * vs) // s
        if np.any(big):
            for i in np.flatnonzero(big).tolist():
                yi = (int(u[i]) + t * int(v[i])) // s
                if yi > _INT64_MAX:
                    raise OverflowError("discrete Laplace sample does not fit in int64")
                y[i] = yi
        b = src.below(2, u.size).astype(bool)
        keep = ~(b & (y == 0))
        z = np.where(b, -y, y)[keep]
        take = min(z.size, need)
        out[filled : filled + take] = z[:take]
        filled += take
    return out


def discrete_laplace(
    scale: RealLike, size: int | tuple[int, ...], rng: random.Random | None = None
) -> NDArray[np.int64]:
    """Exact discrete Laplace samples, ``P(Z = z) = (1-q)/(1+q) q^|z|``, ``q = exp(-1/scale)``.

    CKS 2020 Algorithm 2. Adding ``discrete_laplace(Delta / epsilon)`` to an integer query of
    L1 sensitivity ``Delta`` is ``epsilon``-DP (CKS 2020, section 2.2 / Ghosh et al. 2009).

    Args:
        scale: ``> 0``; an int, a :class:`~fractions.Fraction`, or a float (converted exactly).
        size: output shape.
        rng: a :class:`random.Random`; ``None`` uses :func:`secure_rng`.

    >>> discrete_laplace(2, 5, seeded_rng(0)).dtype
    dtype('int64')
    """
    frac = to_fraction(scale, "scale")
    shape = _size_tuple(size)
    gen = resolve_rng(rng)
    n = math.prod(shape)
    t, s = frac.numerator, frac.denominator
    if n > _SMALL_BATCH and t < _FAST_LIMIT and s < _FAST_LIMIT:
        flat = _discrete_laplace_fast(t, s, n, _Words(gen))
    else:
        flat = np.array([_discrete_laplace_scalar(frac, gen) for _ in range(n)], dtype=np.int64)
    return flat.reshape(shape)


def discrete_gaussian(
    sigma: RealLike | None,
    size: int | tuple[int, ...],
    rng: random.Random | None = None,
    *,
    sigma2: RealLike | None = None,
) -> NDArray[np.int64]:
    """Exact discrete Gaussian samples, ``P(Z = z) ∝ exp(-z^2 / (2 sigma^2))``.

    CKS 2020 Algorithm 3. Give ``sigma`` (its square is then an exact rational) or, keyword
    only, the rational variance parameter ``sigma2`` (e.g. ``Delta_2^2 / (2 rho)``). Adding it to
    an integer vector query of L2 sensitivity ``Delta_2`` is ``Delta_2^2/(2 sigma^2)``-zCDP
    (CKS 2020, Theorem 14 / Corollary 9). The variance is at most ``sigma^2``
    (:func:`discrete_gaussian_variance`).

    Args:
        sigma: ``> 0``; an int, a :class:`~fractions.Fraction`, or a float (converted exactly);
            ``None`` when ``sigma2`` is given.
        size: output shape.
        rng: a :class:`random.Random`; ``None`` uses :func:`secure_rng`.
        sigma2: the exact variance parameter ``sigma^2`` instead of ``sigma``.

    Raises:
        ValueError: both or neither of ``sigma`` and ``sigma2``, or one that is not ``> 0``.
    """
    if (sigma is None) == (sigma2 is None):
        raise ValueError("give exactly one of sigma and sigma2")
    if sigma is not None:
        s2 = to_fraction(sigma, "sigma") ** 2
    else:
        assert sigma2 is not None
        s2 = to_fraction(sigma2, "sigma2")
    shape = _size_tuple(size)
    gen = resolve_rng(rng)
    src = _Words(gen)
    n = math.prod(shape)
    if n <= _SMALL_BATCH:
        small = [_discrete_gaussian_scalar(s2, gen) for _ in range(n)]
        return np.array(small, dtype=np.int64).reshape(shape)
    a, b = s2.numerator, s2.denominator
    t = math.isqrt(a // b) + 1
    den = 2 * a * b * t * t
    out = np.empty(n, dtype=np.int64)
    filled = 0
    while filled < n:
        need = n - filled
        m = int(need * 1.6) + 16
        y = _discrete_laplace_fast(t, 1, m, src) if t < _FAST_LIMIT else None
        if y is None:
            y = np.array([_discrete_laplace_scalar(Fraction(t), gen) for _ in range(m)])
        tb = t * b
        # gamma = (|y| - sigma^2/t)^2 / (2 sigma^2) = (|y| t b - a)^2 / (2 a b t^2)
        nums = [(abs(v) * tb - a) ** 2 for v in y.tolist()]
        acc = _bernoulli_exp_rational(nums, den, src)
        z = y[acc]
        take = min(z.size, need)
        out[filled : filled + take] = z[:take]
        filled += take
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------
# exact moments and probability mass functions
# --------------------------------------------------------------------------------------------


def discrete_laplace_variance(scale: RealLike) -> float:
    """``Var = 2 q / (1 - q)^2`` with ``q = exp(-1/scale)``; just below ``2 scale^2``.

    (``= 1 / (2 sinh^2(1/(2 scale))) = 2 scale^2 - 1/6 + O(scale^-2)``: the continuous
    Laplace of the same scale has variance ``2 scale^2``.)
    """
    x = 1.0 / float(to_fraction(scale, "scale"))
    q = math.exp(-x)
    one_minus_q = -math.expm1(-x)
    return 2.0 * q / one_minus_q**2


def discrete_laplace_pmf(k: NDArray[np.int64] | int, scale: RealLike) -> NDArray[np.float64]:
    """``P(Z = k) = (1 - q) / (1 + q) q^|k|``, ``q = exp(-1/scale)``.

    Args:
        k: the integer(s) whose probability is returned.
        scale: the discrete Laplace scale, ``> 0``.
    """
    x = 1.0 / float(to_fraction(scale, "scale"))
    kk = np.abs(np.asarray(k, dtype=np.float64))
    return np.asarray(-math.expm1(-x) / (1.0 + math.exp(-x)) * np.exp(-x * kk))


def _gaussian_support(s2: float) -> NDArray[np.float64]:
    half = math.ceil(14.0 * math.sqrt(s2)) + 10
    return np.arange(-half, half + 1, dtype=np.float64)


def discrete_gaussian_pmf(k: NDArray[np.int64] | int, sigma2: RealLike) -> NDArray[np.float64]:
    """``P(Z = k)`` for the discrete Gaussian with variance parameter ``sigma2``.

    Args:
        k: the integer(s) whose probability is returned.
        sigma2: the variance parameter ``sigma^2``, ``> 0``.
    """
    s2 = float(to_fraction(sigma2, "sigma2"))
    support = _gaussian_support(s2)
    norm = float(np.exp(-(support**2) / (2 * s2)).sum())
    kk = np.asarray(k, dtype=np.float64)
    return np.asarray(np.exp(-(kk**2) / (2 * s2)) / norm)


def discrete_gaussian_variance(sigma2: RealLike) -> float:
    """The exact variance (numerical sum over the support; ``<= sigma2``, CKS 2020 Prop. 19)."""
    s2 = float(to_fraction(sigma2, "sigma2"))
    if s2 > 1e9:
        return s2
    support = _gaussian_support(s2)
    w = np.exp(-(support**2) / (2 * s2))
    return float((support**2 * w).sum() / w.sum())
