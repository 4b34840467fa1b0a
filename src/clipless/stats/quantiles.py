r"""Many quantiles for one budget: one DP CDF, inverted (post-processing).

:func:`quantiles` releases a whole DP ECDF once (:func:`~clipless.stats.ecdf.ecdf`, by default
the consistent ``k``-ary tree of :mod:`clipless.stats.counting` with isotonic smoothing) and
returns, for every requested level ``q``, the first threshold whose released CDF value reaches
``q`` (thesis Algorithm 9 on the monotone release, :meth:`~clipless.stats.ecdf.DPECDF.quantile`).
All ``m`` quantiles come from the same release, so the budget does not depend on ``m``: this is
the "quantiles from a CDF" approach that OpenDP uses (``make_quantiles_from_counts`` on its
consistent b-ary tree).

**Error.** If the released prefix counts have standard deviation ``s_i`` at threshold ``i``,
the rank error of a quantile is about the largest deviation of the counts near its threshold:
``O(s)`` per quantile with ``s^2 = O(log^3 N / epsilon^2)`` for trees under pure DP, and the
error of all ``m`` quantiles together grows only like ``sqrt(log m)`` (a maximum of Gaussian-like
deviations). The exponential-mechanism algorithms (JointExp, Gillenwater, Joseph, Kulesza, ICML
2021; the recursive approximate quantiles of Kaplan, Schnapp, Stemmer, ICML 2022) spend the
budget on the quantiles themselves and win when ``m`` is small and the domain is huge;
``benchmarks/RESULTS.md`` (section 9) measures this release's rank error against OpenDP and
diffprivlib on the same data. (The exponential-mechanism variants are not implemented here.)

Privacy: exactly that of the one ECDF release; the inversion reads only released values.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, NDArray

from clipless.stats.counting import Mechanism
from clipless.stats.ecdf import DPECDF, Smoothing, ecdf
from clipless.stats.grid import Grid
from clipless.stats.tree import Neighbouring, NoiseKind

__all__ = ["QuantileRelease", "quantiles", "rank_error"]


@dataclass(frozen=True, eq=False)
class QuantileRelease:
    """Released quantiles: ``values[j]`` is the ``qs[j]``-quantile (a grid threshold).

    ``cdf`` is the underlying :class:`~clipless.stats.ecdf.DPECDF`; further quantiles can be
    read from it (``cdf.quantile(p)``) at no privacy cost.
    """

    qs: NDArray[np.float64] = field(repr=False)
    values: NDArray[np.float64] = field(repr=False)
    cdf: DPECDF = field(repr=False)

    def __repr__(self) -> str:
        """The released values by level, then the guarantee (all public)."""
        pairs = ", ".join(
            f"{float(q)!r}: {float(v)!r}" for q, v in zip(self.qs, self.values, strict=True)
        )
        budget = (
            f"epsilon={self.cdf.epsilon!r}"
            if self.cdf.epsilon is not None
            else f"rho={self.cdf.rho!r}"
        )
        return f"QuantileRelease({{{pairs}}}, {budget}, neighbouring={self.cdf.neighbouring!r})"

    def to_dict(self) -> dict[float, float]:
        """``{level: released quantile}``."""
        return {float(q): float(v) for q, v in zip(self.qs, self.values, strict=True)}


def _levels(qs: ArrayLike) -> NDArray[np.float64]:
    try:
        arr = np.asarray(qs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"qs must be numbers in [0, 1]: {exc}") from None
    arr = np.atleast_1d(arr)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("qs must be a non-empty one-dimensional list of levels in [0, 1]")
    if not np.all(np.isfinite(arr)) or np.any((arr < 0) | (arr > 1)):
        raise ValueError("qs must lie in [0, 1]")
    return arr


def quantiles(
    values: ArrayLike,
    grid: Grid | ArrayLike,
    qs: ArrayLike,
    epsilon: float | None,
    neighbouring: Neighbouring = "replace_one",
    *,
    noise: NoiseKind = "laplace",
    rho: float | None = None,
    mechanism: Mechanism = "auto",
    branching: int | None = None,
    smoothing: Smoothing | None = "isotonic",
    rng: random.Random | None = None,
) -> QuantileRelease:
    """Release the ``qs``-quantiles of ``values`` on a public ``grid`` from one DP CDF.

    The default mechanism is the consistent ``k``-ary tree (the most accurate exact-noise CDF,
    ``docs/statistics.md``); the quantiles are post-processing of the CDF.

    Args:
        values, grid, epsilon, neighbouring: as in :func:`~clipless.stats.ecdf.ecdf`.
        qs: the levels, each in ``[0, 1]`` (any number of them: the budget is the same).
        noise, rho, mechanism, branching, smoothing, rng: as in
            :func:`~clipless.stats.ecdf.ecdf`.

    Returns:
        A :class:`QuantileRelease`: the levels, the released values (grid thresholds) and the
        CDF they were read from.

    >>> from clipless.stats import Grid, seeded_rng
    >>> r = quantiles(range(1, 101), Grid(1, 100, size=100), [0.25, 0.5], 1e9, rng=seeded_rng(0))
    >>> r.values.tolist()
    [25.0, 50.0]
    """
    levels = _levels(qs)
    cdf = ecdf(
        values,
        grid,
        epsilon,
        neighbouring,
        smoothing,
        noise,
        rng=rng,
        rho=rho,
        mechanism=mechanism,
        branching=branching,
    )
    out = np.atleast_1d(np.asarray(cdf.quantile(levels), dtype=np.float64))
    for arr in (levels, out):
        arr.setflags(write=False)
    return QuantileRelease(qs=levels, values=out, cdf=cdf)


def rank_error(
    values: ArrayLike, released: ArrayLike | QuantileRelease, qs: ArrayLike | None = None
) -> NDArray[np.float64]:
    """Rank error of released quantiles, in counts (**not private**: reads the data).

    For level ``q`` and released value ``v``: the distance from the target rank ``q n`` to the
    interval ``[#{x < v}, #{x <= v}]`` of ranks that ``v`` occupies (0 when ``v`` is an exact
    ``q``-quantile, also with ties).

    Args:
        values: the data the quantiles were released from.
        released: a :class:`QuantileRelease`, or an array of released values.
        qs: the levels of an array ``released`` (required then); with a
            :class:`QuantileRelease`, omitted or equal to its levels.

    Returns:
        The rank error of every level, in counts.

    Raises:
        TypeError: an array ``released`` without ``qs``.
        ValueError: ``qs`` that differ from the release's levels, or of another shape.
    """
    data = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if isinstance(released, QuantileRelease):
        if qs is not None and not np.array_equal(_levels(qs), released.qs):
            raise ValueError(
                "qs: must be omitted or equal the QuantileRelease's levels "
                f"{released.qs.tolist()}, got {np.atleast_1d(np.asarray(qs)).tolist()}"
            )
        v, levels = np.asarray(released.values, dtype=np.float64), released.qs
    elif qs is None:
        raise TypeError("qs: required when released is an array of values (levels in [0, 1])")
    else:
        v, levels = np.asarray(released, dtype=np.float64), _levels(qs)
    if v.shape != levels.shape:
        raise ValueError(f"released has shape {v.shape}, qs has {levels.shape}")
    target = levels * data.size
    lo = np.searchsorted(data, v, side="left").astype(np.float64)
    hi = np.searchsorted(data, v, side="right").astype(np.float64)
    return np.maximum(np.maximum(lo - target, target - hi), 0.0)
