"""Public threshold grids for DP empirical distribution functions.

A DP-ECDF is released at thresholds ``tau_1 < ... < tau_N``. The grid must be **public**: fixed
from a specification (bounds plus a size or a precision, a linear or a logarithmic spacing, or an
explicit list) before looking at the data. The thesis (chapter 6, section 6.3.1) takes
``tau_1 = min`` and ``tau_N = max`` of the data; that choice leaks the extreme values themselves
(a neighbouring dataset with a different minimum publishes a different grid, with probability 1),
so it is not offered here. Values outside ``[tau_1, tau_N]`` are clamped by the mechanisms.

The tree mechanism (:mod:`clipless.stats.tree`) uses ``L = ceil(log2 N)`` levels above the leaves;
:attr:`Grid.depth` reports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from clipless import _validate

__all__ = ["Grid"]

Scale = Literal["linear", "log"]


def finite_vector(arr: NDArray[np.float64], name: str, empty: str = "must be non-empty") -> None:
    """Refuse an ``arr`` that is not one-dimensional, is empty (the message ``name empty``) or
    holds NaN or infinity (also the smoothing's inputs)."""
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} {empty}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite (no NaN or infinity)")


def _validate_thresholds(thresholds: NDArray[np.float64], name: str) -> None:
    finite_vector(thresholds, name, "must contain at least one threshold")
    if thresholds.size > 1 and not np.all(np.diff(thresholds) > 0):
        bad = int(np.argmin(np.diff(thresholds) > 0))
        raise ValueError(
            f"{name} must be strictly increasing; {name}[{bad}] = {thresholds[bad]!r} >= "
            f"{name}[{bad + 1}] = {thresholds[bad + 1]!r}"
        )


class Grid:
    """A public, data-independent, strictly increasing set of thresholds.

    Never derive ``lower``/``upper`` from the private data (see the module docstring).

    Args:
        lower, upper: the first and last thresholds (finite; ``lower > 0`` for a log grid).
        size: the number of thresholds, 1 to ``10**8``: ``numpy.linspace(lower, upper, size)``
            (linear) or ``numpy.geomspace(lower, upper, size)`` (log).
        precision: instead of ``size``, the spacing ``> 0``: ``lower, lower + precision, ...``
            up to ``upper`` (linear), or ``lower, lower * (1 + precision), ...`` (log: relative
            precision, as the thesis's ``exp(psi z)`` grid).
        scale: ``"linear"`` or ``"log"``.

    Raises:
        ValueError: both or neither of ``size`` and ``precision``, bounds out of order, or a
            grid of more than ``10**8`` thresholds.

    >>> g = Grid(0.0, 1.0, size=5)
    >>> g.thresholds.tolist(), len(g), g.depth
    ([0.0, 0.25, 0.5, 0.75, 1.0], 5, 3)
    >>> Grid(0, 10, precision=2.5).thresholds.tolist()
    [0.0, 2.5, 5.0, 7.5, 10.0]
    """

    __slots__ = ("_scale", "_thresholds")

    def __init__(
        self,
        lower: float,
        upper: float,
        size: int | None = None,
        precision: float | None = None,
        scale: Scale = "linear",
    ) -> None:
        lo = _validate.finite("lower", lower)
        hi = _validate.finite("upper", upper)
        if scale not in ("linear", "log"):
            raise ValueError(f"scale must be 'linear' or 'log', got {scale!r}")
        if (size is None) == (precision is None):
            raise ValueError("give exactly one of size and precision")
        if scale == "log" and lo <= 0:
            raise ValueError(f"lower must be > 0 for a log grid, got {lo}")
        if size is not None:
            size = _validate.integer("size", size, minimum=1, maximum=10**8)
            if size == 1:
                if hi != lo:
                    raise ValueError("size=1 needs lower == upper")
                values = np.array([lo])
            else:
                if not hi > lo:
                    raise ValueError(f"upper must be > lower, got lower={lo}, upper={hi}")
                values = (
                    np.linspace(lo, hi, size) if scale == "linear" else np.geomspace(lo, hi, size)
                )
                values[0], values[-1] = lo, hi
        else:
            step = _validate.finite_positive("precision", precision)
            if hi < lo:
                raise ValueError(f"upper must be >= lower, got lower={lo}, upper={hi}")
            log = scale == "log"
            steps = math.log(hi / lo) / math.log1p(step) if log else (hi - lo) / step
            # a relative tolerance so that e.g. Grid(0, 1, precision=0.1) ends at 1.0
            count = math.floor(steps * (1 + 1e-12) + 1e-9) + 1
            if count > 10**8:
                raise ValueError(f"precision {step} gives {count} thresholds; use a coarser one")
            k = np.arange(count, dtype=np.float64)
            values = lo + step * k if scale == "linear" else lo * np.exp(k * math.log1p(step))
            values = np.minimum(values, hi)  # only the last can exceed hi, by rounding
        self._set(np.asarray(values, dtype=np.float64), "thresholds", scale)

    def _set(self, thresholds: NDArray[np.float64], name: str, scale: str) -> None:
        _validate_thresholds(thresholds, name)
        thresholds = np.array(thresholds, dtype=np.float64, copy=True)
        thresholds.setflags(write=False)
        self._thresholds = thresholds
        self._scale = scale

    @classmethod
    def from_thresholds(cls, thresholds: ArrayLike | Sequence[float]) -> Grid:
        """A grid from an explicit, public list of strictly increasing finite thresholds.

        Args:
            thresholds: one or more finite thresholds, strictly increasing.

        Raises:
            TypeError: thresholds that are not real numbers.
            ValueError: thresholds that are empty, not finite, or not strictly increasing.
        """
        try:
            arr = np.asarray(thresholds, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"thresholds must be an array of real numbers: {exc}") from None
        obj = cls.__new__(cls)
        obj._set(arr, "thresholds", "explicit")
        return obj

    @property
    def thresholds(self) -> NDArray[np.float64]:
        """The thresholds, a read-only float64 array."""
        return self._thresholds

    @property
    def scale(self) -> str:
        """``"linear"``, ``"log"`` or ``"explicit"``."""
        return self._scale

    @property
    def depth(self) -> int:
        """``L = ceil(log2 N)`` for ``N = len(self)`` (0 when ``N = 1``)."""
        return tree_depth(len(self))

    @property
    def lower(self) -> float:
        """The first threshold."""
        return float(self._thresholds[0])

    @property
    def upper(self) -> float:
        """The last threshold."""
        return float(self._thresholds[-1])

    def __len__(self) -> int:
        return int(self._thresholds.size)

    def __iter__(self) -> Iterator[float]:
        return iter(self._thresholds.tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Grid):
            return NotImplemented
        return bool(np.array_equal(self._thresholds, other._thresholds))

    def __hash__(self) -> int:
        return hash(self._thresholds.tobytes())

    def __repr__(self) -> str:
        bounds = f"lower={self.lower!r}, upper={self.upper!r}"
        return f"Grid(N={len(self)}, {bounds}, scale={self._scale!r})"

    def leaf_index(self, values: ArrayLike) -> NDArray[np.int64]:
        """0-based leaf of each value: the first threshold ``>= value`` (clamped to the grid).

        A value ``x`` is counted in the prefix count of every threshold ``tau_i >= x``; values
        above ``tau_N`` are clamped to ``tau_N`` and values below ``tau_1`` to ``tau_1``.
        """
        arr = np.asarray(values, dtype=np.float64)
        idx = np.searchsorted(self._thresholds, arr, side="left")
        return np.minimum(idx, len(self) - 1).astype(np.int64)

    def counts(self, values: ArrayLike) -> NDArray[np.int64]:
        """Leaf counts: ``counts[i]`` values fall in ``(tau_{i-1}, tau_i]`` (after clamping)."""
        return np.bincount(self.leaf_index(values).ravel(), minlength=len(self)).astype(np.int64)


def tree_depth(num_leaves: int) -> int:
    """``L = ceil(log2 N)``; 0 for ``N = 1``."""
    if num_leaves < 1:
        raise ValueError(f"num_leaves must be >= 1, got {num_leaves}")
    return int(num_leaves - 1).bit_length()
