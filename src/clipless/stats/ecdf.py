"""Differentially private empirical cumulative distribution functions (thesis chapter 6).

:func:`ecdf` releases ``F(tau_i) = #{x <= tau_i} / n`` at every threshold of a public
:class:`~clipless.stats.grid.Grid` with a counting mechanism of :mod:`clipless.stats.counting`
(``mechanism="auto"``: the shape of smallest exact error at this ``N``, relation and budget,
:func:`~clipless.stats.counting.default_mechanism`; ``"binary"``: the thesis's binary tree of
:mod:`clipless.stats.tree`, Theorem 6.3.1 for replace-one, Lemma 6.3.1 / Theorem 6.3.2 for
add/remove), exact discrete noise (Canonne, Kamath, Steinke 2020), least-squares consistency (Hay et
al. 2010) and optional monotone smoothing (thesis section 6.3.2, in
:mod:`clipless.stats.smoothing`). Everything after the noisy vector is post-processing.

**Clamping.** A value below ``tau_1`` counts as ``tau_1`` and a value above ``tau_N`` as
``tau_N``: the release is the ECDF of the clamped data, so ``F(tau_N) = 1`` before noise.

**Normalisation.** Under ``replace_one`` the dataset size ``n`` is public: counts are divided
by ``n = len(values)``. Under ``add_remove`` ``n`` is private. Two sound options: (a) the last
released prefix count ``P_N`` already *is* a noisy total (every value is counted at ``tau_N``
after clamping) and costs nothing; (b) spend a fraction (10%) of epsilon on a separate
discrete-Laplace count. (b) inflates the variance at every threshold by ``1/0.9^2 = 1.23`` to buy
a better denominator, while in (a) the denominator's error is positively correlated with each
numerator's (shared tree nodes) and cancels near the top of the curve. Measured (``X_pois(1)``,
``N = 2^15``, ``epsilon = 1``, 40 releases, mean squared error of ``F``): (a) ``2.26e-6`` vs (b)
``2.61e-6`` for the plain release, ``1.30e-6`` vs ``1.43e-6`` with consistency. So (a) is used:
``n_hat = max(P_N, 1)`` (the plain or the consistent ``P_N``), and the released ``F(tau_N)`` is
exactly 1 (set before smoothing when ``P_N < 1``, where the division alone would leave ``P_N``).

**Which release is most accurate.** :func:`release_accuracy` measures it for the binary tree
(the k-ary tree and the factorisation are 2-15x better still, ``docs/statistics.md``). On the
thesis's ``X_pois(1)`` data (section 6.6.2, ``N = 2^15``, ``L = 15``, ``epsilon = 1``, 20
releases, mean squared error of ``F`` over the thresholds):

=============  ===========================  ====================================
neighbouring   plain thesis release          ``consistency=True`` (least squares)
=============  ===========================  ====================================
replace_one    ``8.8e-6`` (exact ``7.65e-6``)  ``4.4e-6`` (exact ``4.06e-6``)
add_remove     ``2.3e-6``                    ``1.3e-6``
=============  ===========================  ====================================

The exact values are ``mean_i Var_i / n^2`` (:func:`~clipless.stats.tree.prefix_variance`):
``(L+1) = 16`` node variances for the plain release against ``(L+2)/2 = 8.5`` for least
squares. Consistency is therefore recommended; it is off by default only to reproduce the
thesis's estimator. Smoothing (isotonic, or the thesis's l1/l2 problem) is post-processing on
top and makes the function a proper CDF.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from clipless import _validate
from clipless.stats.counting import CountRelease, Mechanism, release_prefix_counts
from clipless.stats.grid import Grid
from clipless.stats.noise import seeded_rng, to_fraction
from clipless.stats.smoothing import isotonic, smooth_counts, smooth_tree
from clipless.stats.tree import (
    Neighbouring,
    NoiseKind,
    TreeRelease,
    _check_neighbouring,
    _check_noise,
    consistent_prefix_sums,
    prefix_variance,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["DPECDF", "Smoothing", "ecdf", "from_release", "release_accuracy"]

Smoothing = Literal["isotonic", "l1", "l2"]


def _record_vector(name: str, values: ArrayLike, allow_empty: bool) -> NDArray[np.float64]:
    """``values`` as float64, one record per entry. ``allow_empty``: under add/remove the size is
    private, so an empty dataset must be released like any other (an error would tell it from a
    one-record one)."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{name} must be an array of real numbers: {exc}") from None
    if arr.ndim != 1:
        # flattening would count a d-column row as d records: d times the declared epsilon
        raise ValueError(
            f"{name} must be one-dimensional (one value per record), got shape {arr.shape}"
        )
    if arr.size == 0 and not allow_empty:
        raise ValueError(
            f"{name} must be non-empty under replace_one (n = 0 is public there; under "
            "add_remove an empty dataset is released)"
        )
    return arr


def _as_values(
    values: ArrayLike, allow_empty: bool = False, name: str = "values"
) -> NDArray[np.float64]:
    """:func:`_record_vector` without NaN (``+-inf`` are clamped to the grid's ends like every
    value outside it)."""
    arr = _record_vector(name, values, allow_empty)
    if np.any(np.isnan(arr)):
        raise ValueError(f"{name} must be numbers (no NaN; +-inf are clamped to the grid)")
    return arr


def _binary_labels(labels: ArrayLike, n: int, of: str) -> NDArray[np.bool_]:
    """``labels`` (0/1 or booleans, one per entry of ``of``, of length ``n``) as ``label == 1``."""
    y = np.asarray(labels)
    if y.ndim != 1 or y.size != n:
        raise ValueError(
            f"labels must be one-dimensional with the length of {of} ({n}), got shape {y.shape}"
        )
    if y.dtype != bool and not (
        np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)
    ):
        raise TypeError(f"labels must be 0/1 or booleans, got dtype {y.dtype}")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 or 1 (negative/positive)")
    return np.asarray(y == 1, dtype=np.bool_)


def _as_grid(grid: Grid | ArrayLike) -> Grid:
    if isinstance(grid, Grid):
        return grid
    return Grid.from_thresholds(np.asarray(grid, dtype=np.float64))


@dataclass(frozen=True, eq=False)
class DPECDF:
    """A released DP empirical CDF: the values at the thresholds of a public grid.

    Attributes:
        grid: the public thresholds ``tau_1 < ... < tau_N``.
        values: released ``F(tau_i)``, float64 (not necessarily monotone or within [0, 1] unless
            smoothed).
        counts: released noisy prefix counts before normalisation (the plain or consistent
            estimate).
        epsilon, rho: the guarantee: ``epsilon``-DP (Laplace noise) or ``rho``-zCDP (Gaussian
            noise).
        neighbouring: ``"replace_one"`` or ``"add_remove"``.
        n: the normaliser: the public size (replace-one) or the private released total.
        n_private: whether :attr:`n` is a released (noisy) quantity.
        variance: exact per-threshold variance of :attr:`counts` (the noise is public knowledge).
        release: the underlying :class:`~clipless.stats.tree.TreeRelease` (``mechanism="binary"``)
            or :class:`~clipless.stats.counting.CountRelease` (``"k-ary"``, ``"factorization"``).
    """

    grid: Grid
    values: NDArray[np.float64] = field(repr=False)
    counts: NDArray[np.float64] = field(repr=False)
    epsilon: float | None
    neighbouring: Neighbouring
    n: float
    n_private: bool
    noise: NoiseKind
    rho: float | None
    smoothing: Smoothing | None
    consistency: bool
    variance: NDArray[np.float64] = field(repr=False)
    release: TreeRelease | CountRelease = field(repr=False)

    def evaluate(self, t: ArrayLike) -> Any:
        """The released step function: ``F`` at the largest threshold ``<= t``; 0 below ``tau_1``.

        Args:
            t: a point or an array of points (not NaN).

        Returns:
            A float for a scalar ``t``, an array for an array.
        """
        arr = np.asarray(t, dtype=np.float64)
        if np.any(np.isnan(arr)):
            raise ValueError("t must not be NaN")
        idx = np.searchsorted(self.grid.thresholds, arr, side="right") - 1
        out = np.where(idx >= 0, self.values[np.maximum(idx, 0)], 0.0)
        return float(out) if out.ndim == 0 else out

    __call__ = evaluate

    def quantile(self, p: ArrayLike) -> Any:
        """Inverse by search (thesis Algorithm 9): the first threshold with ``F >= p``.

        Algorithm 9 bisects on the released function; on a non-decreasing function it returns
        the smallest threshold ``tau_i`` with ``F(tau_i) >= p``, which is what this returns,
        vectorised with :func:`numpy.searchsorted` on the running maximum of :attr:`values`.
        When the released values are not monotone (no smoothing), bisection may stop at any
        up-crossing of ``p``; the running maximum makes the answer the *first* one, a
        deterministic choice (exactly Algorithm 9 applied to the monotone envelope). If ``p`` is
        never reached, ``tau_N`` is returned (the bisection's upper end). Post-processing.

        Args:
            p: a level or an array of levels, each in ``[0, 1]``.

        Returns:
            A threshold (float) for a scalar ``p``, an array for an array.
        """
        arr = np.asarray(p, dtype=np.float64)
        if np.any(~np.isfinite(arr)) or np.any((arr < 0) | (arr > 1)):
            raise ValueError("p must lie in [0, 1]")
        envelope = np.maximum.accumulate(self.values)
        idx = np.searchsorted(envelope, arr, side="left")
        idx = np.minimum(idx, len(self.grid) - 1)
        out = self.grid.thresholds[idx]
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict[str, NDArray[np.float64]]:
        """``{"threshold", "value", "count", "variance"}``, numpy arrays (copies)."""
        return {
            "threshold": self.grid.thresholds.copy(),
            "value": np.array(self.values, dtype=np.float64),
            "count": np.array(self.counts, dtype=np.float64),
            "variance": np.array(self.variance, dtype=np.float64),
        }

    def to_frame(self) -> Any:
        """:meth:`to_dict` as a pandas DataFrame (needs pandas, an optional dependency)."""
        try:
            import pandas as pd
        except ImportError as exc:
            raise ImportError(
                "DPECDF.to_frame() needs pandas (pip install pandas); use to_dict() instead"
            ) from exc
        return pd.DataFrame(self.to_dict())

    def band(self, z: float = 1.96) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """``values -+ z sd``, the sd of the noise in :attr:`counts` divided by :attr:`n`.

        Post-processing: it reads only the public :attr:`variance` and released values. A
        noise-only band: it ignores the smoothing (the unweighted isotonic projection of the
        ``k``-ary tree cannot increase the error) and, under add/remove, the noise in the
        released normaliser.

        Args:
            z: the band's half-width in standard deviations, finite and ``>= 0``.

        Returns:
            ``(lower, upper)``, one value per threshold.
        """
        if not math.isfinite(z) or z < 0:
            raise ValueError(f"z must be a finite number >= 0, got {z!r}")
        half = z * np.sqrt(np.asarray(self.variance, dtype=np.float64)) / self.n
        return self.values - half, self.values + half

    def plot(
        self,
        ax: Axes | None = None,
        true_values: ArrayLike | None = None,
        band: bool = True,
        **kwargs: Any,
    ) -> Axes:
        """Step plot of the released function; returns the Axes.

        Uses the object-oriented matplotlib API (no pyplot state), so it works with the Agg
        backend.

        Args:
            ax: the Axes to draw on (``None``: a new figure's).
            true_values: raw (non-private!) data whose exact ECDF at the same thresholds is
                drawn for comparison, e.g. in benchmarks (``None``: not drawn).
            band: shade :meth:`band` (``+-1.96`` sd of the noise, a noise-only band).
            kwargs: passed to the step plot of the released function.
        """
        if ax is None:
            from matplotlib.figure import Figure

            ax = Figure().add_subplot()
        label = kwargs.pop("label", f"DP ECDF ({self._budget_label()})")
        (line,) = ax.step(self.grid.thresholds, self.values, where="post", label=label, **kwargs)
        if band:
            lo, hi = self.band()
            ax.fill_between(
                self.grid.thresholds, lo, hi, step="post", color=line.get_color(), alpha=0.2,
                linewidth=0, label="±1.96 sd of the noise (noise-only band)",
            )  # fmt: skip
            ax.set_ylim(-0.05, 1.05)
        if true_values is not None:
            data = _as_values(true_values)
            exact = np.cumsum(self.grid.counts(data)) / data.size
            ax.step(self.grid.thresholds, exact, where="post", label="exact (non-private)")
        ax.set_xlabel("threshold")
        ax.set_ylabel("F")
        ax.legend()
        return ax

    def _budget_label(self) -> str:
        if self.epsilon is not None:
            return f"ε={self.epsilon:g}"
        return f"ρ={self.rho:g}"


def ecdf(
    values: ArrayLike,
    grid: Grid | ArrayLike,
    epsilon: float | None,
    neighbouring: Neighbouring = "replace_one",
    smoothing: Smoothing | None = "isotonic",
    noise: NoiseKind = "laplace",
    consistency: bool = True,
    n: int | None = None,
    rng: random.Random | None = None,
    *,
    rho: float | None = None,
    mechanism: Mechanism = "auto",
    branching: int | None = None,
    node_noise: Any = None,
) -> DPECDF:
    """Release a DP empirical CDF of ``values`` at the thresholds of a public ``grid``.

    Thesis chapter 6: tree mechanism (Theorem 6.3.1 replace-one, scale ``(L+1)/epsilon``;
    Lemma 6.3.1 / Theorem 6.3.2 add/remove, scale ``ceil((L+1)/2)/epsilon``), exact discrete
    Laplace or Gaussian noise (CKS 2020), least-squares consistency (Hay et al. 2010), smoothing
    (section 6.3.2). The whole output is ``epsilon``-DP (or ``rho``-zCDP).

    Args:
        values: the private data, finite reals; clamped to ``[tau_1, tau_N]``.
        grid: a :class:`~clipless.stats.grid.Grid` (or explicit thresholds), chosen without the
            data.
        epsilon: ``> 0``, for Laplace noise; ``None`` with ``noise="gaussian"`` and ``rho``.
        neighbouring: ``"replace_one"`` (``n`` public) or ``"add_remove"`` (``n`` private, estimated
            by the released total, see the module docstring).
        smoothing: ``"isotonic"`` (the default: pool-adjacent-violators on the values, weighted by
            the inverse variances); ``"l1"``/``"l2"``: the thesis's problem 6.3.6 over tree
            corrections; ``None``: the raw (consistent) values, which the noise can make
            non-monotone and push outside [0, 1]. Smoothed values are non-decreasing within [0, 1].
            The default is ``"isotonic"`` because a released CDF should be monotone, and smoothing
            is post-processing of the noisy release: it costs no privacy. ``clipless ecdf`` and
            :func:`clipless.stats.roc` use the same default.
        noise: ``"laplace"`` (pure DP) or ``"gaussian"`` (zCDP, needs ``rho``).
        consistency: use the least-squares prefix counts (about half the variance of the thesis's
            plain release; the default). ``False`` reproduces the thesis's estimator. Combines with
            every smoothing (``"l1"``/``"l2"`` then solve problem 6.3.6 on the consistent counts).
        n: under ``replace_one``, the public size; must equal ``len(values)`` (defaults to it). Not
            allowed under ``add_remove``, where the size is private.
        rng: :class:`random.Random`; default a cryptographically secure source.
        rho: zCDP budget for Gaussian noise.
        mechanism: the counting mechanism (:mod:`clipless.stats.counting`). ``"auto"`` (default):
            the one with the smallest exact error at this grid size, relation and budget
            (:func:`~clipless.stats.counting.default_mechanism`; under pure DP the ``k``-ary tree of
            :func:`~clipless.stats.counting.counting_plan`, the flat histogram included).
            ``"binary"``: the thesis's tree (reproduces the thesis; with ``consistency=False`` its
            plain estimator). ``"k-ary"``: consistent ``k``-ary tree with optimised level budgets.
            ``"factorization"``: square-root factorisation (Gaussian only). ``"smooth-binary"``: the
            smooth binary mechanism (Andersson & Pagh 2023), the same variance at every threshold.
            All use exact discrete noise. ``docs/statistics.md`` says which to choose.
        branching: ``k`` for ``"k-ary"`` (default: the exact optimum for this grid size and budget).
        node_noise: optional keyed node-noise source replacing ``rng`` (:class:`clipless.federated.
            NodeNoise` or ``SummedNoise``; :func:`~clipless.stats.counting.release_prefix_counts`).
            The federated releases compute the ``"binary"`` or the ``"k-ary"`` tree, so with
            ``node_noise`` ``"auto"`` resolves to ``"k-ary"`` with the plan of
            :func:`~clipless.stats.counting.counting_plan` (under zCDP also where the central
            default is the factorisation; with ``consistency=False`` to ``"binary"``); other
            mechanisms are refused.

    >>> from clipless.stats import Grid, seeded_rng
    >>> F = ecdf([0.1, 0.4, 0.4, 0.9], Grid(0, 1, size=11), epsilon=1e9, rng=seeded_rng(0))
    >>> F.values[[0, 1, 4, 9, 10]].tolist()
    [0.0, 0.25, 0.75, 1.0, 1.0]
    """
    _check_neighbouring(neighbouring)
    data = _as_values(values, allow_empty=neighbouring == "add_remove")
    g = _as_grid(grid)
    if smoothing not in (None, "isotonic", "l1", "l2"):
        raise ValueError(f"smoothing must be None, 'isotonic', 'l1' or 'l2', got {smoothing!r}")
    _check_noise(noise)
    _validate.flag("consistency", consistency)
    if noise == "laplace" and epsilon is not None:
        to_fraction(epsilon, "epsilon")
    if neighbouring == "replace_one":
        if n is None:
            n_pub = data.size
        else:
            n = _validate.integer("n", n)
            if int(n) != data.size:
                raise ValueError(
                    f"n must equal len(values) = {data.size} under replace_one, got {n}"
                )
            n_pub = int(n)
    elif n is not None:
        raise ValueError(
            "n must be None under add_remove: the size is private and the released total is "
            "used instead"
        )

    if node_noise is not None:
        if mechanism not in ("auto", "binary", "k-ary"):
            raise ValueError(
                f"node_noise (the federated release) computes the binary or the k-ary tree; "
                f"mechanism must be 'auto', 'binary' or 'k-ary' with it, got {mechanism!r}"
            )
        if mechanism == "auto" and consistency is not False:
            mechanism = "k-ary"  # the plan of counting_plan, as federated_ecdf releases it
    if mechanism == "auto" and consistency is False:
        mechanism = "binary"  # the thesis's plain estimator exists for the binary tree only
    if mechanism != "binary" and not consistency:
        raise ValueError(
            "consistency=False (the thesis's plain estimator) exists only for "
            "mechanism='binary'; the k-ary and factorisation estimates are least squares "
            "(pass mechanism='binary' to reproduce the thesis)"
        )
    release = release_prefix_counts(
        g.counts(data),
        epsilon,
        neighbouring,
        noise,
        rng,
        rho,
        mechanism=mechanism,
        branching=branching,
        node_noise=node_noise,
    )
    return from_release(
        release,
        g,
        n=n_pub if neighbouring == "replace_one" else None,
        smoothing=smoothing,
        consistency=consistency,
    )


def poisson_dataset(lam: float, size: int = 1 << 15, seed: int = 0) -> NDArray[np.float64]:
    """The thesis's ``X_pois(lambda)`` (section 6.6.2): for each ``i in 1..size``,
    ``Pois(lambda)`` instances with value ``i``. Grid: ``Grid(1, size, size=size)``.

    Args:
        lam: the Poisson mean ``lambda`` of every value's count.
        size: the number of distinct values ``1..size``.
        seed: seeds NumPy's generator (public synthetic data).
    """
    reps = np.random.default_rng(seed).poisson(lam, size)
    return np.repeat(np.arange(1, size + 1, dtype=np.float64), reps)


def from_release(
    release: TreeRelease | CountRelease,
    grid: Grid,
    *,
    n: int | None,
    smoothing: Smoothing | None = None,
    consistency: bool = True,
) -> DPECDF:
    """Post-process a tree release into a :class:`DPECDF` (no privacy cost).

    Used by :func:`ecdf` and by :func:`clipless.stats.roc` for each class.

    Args:
        release: the noisy prefix counts (:func:`~clipless.stats.counting.release_prefix_counts`).
        grid: the grid the release counted on.
        n: the public size (replace-one); ``None`` normalises by the released total
            ``max(P_N, 1)`` (add/remove, where the size is private).
        smoothing: ``"isotonic"``, ``"l1"``, ``"l2"`` or ``None`` (as in :func:`ecdf`; the
            default here is none).
        consistency: use the least-squares prefix counts of a :class:`TreeRelease` (a
            :class:`CountRelease`'s are least squares already).
    """
    if isinstance(release, CountRelease):
        counts = np.array(release.prefix_counts, dtype=np.float64)
        variance = np.array(release.variance, dtype=np.float64)
        consistency = True  # least squares by construction
    elif consistency:
        counts = np.array(consistent_prefix_sums(release), dtype=np.float64)
        variance = np.array(prefix_variance(release, consistent=True), dtype=np.float64)
    else:
        counts = release.prefix_counts.astype(np.float64)
        variance = np.array(prefix_variance(release, consistent=False), dtype=np.float64)
    if n is not None:
        norm, n_private = float(n), False
    else:
        norm, n_private = max(float(counts[-1]), 1.0), True

    raw = counts / norm
    to_smooth = counts
    if n_private:
        # every record is counted at tau_N (clamping): F(tau_N) = 1 is known, also when the
        # released total is below 1 (then counts[-1] / max(P_N, 1) = P_N)
        raw[-1] = 1.0
        to_smooth = counts.copy()
        to_smooth[-1] = norm
    if smoothing is None:
        out = raw
    elif smoothing == "isotonic":
        weights = None
        # binary tree: inverse-variance weights (its variances vary ~2x along the grid). k-ary /
        # factorisation: unweighted, i.e. the Euclidean projection onto the closed convex set
        # {non-decreasing, within [0, 1]}, which contains the true CDF; a projection onto a
        # convex set is non-expansive, so smoothing never increases the squared error of any
        # release (every noise draw).
        top = float(np.max(variance)) if consistency else 0.0
        if isinstance(release, CountRelease):
            top = 0.0
        if top > 0:
            # inverse-variance weights, bounded so that a (near) noiseless leaf cannot overflow
            weights = top / np.maximum(variance, top * 1e-12)
        out = np.asarray(isotonic(raw, weights=weights))
    elif consistency:
        # Problem 6.3.6 applied to the least-squares prefix counts (smoothing after consistency:
        # both are post-processing; measured the most accurate combination, RESULTS.md).
        out = np.asarray(smooth_counts(to_smooth, norm, smoothing, depth=release.depth).values)
    elif isinstance(release, TreeRelease):
        out = np.asarray(smooth_tree(release, norm, smoothing))
    else:  # pragma: no cover - CountRelease always sets consistency
        raise AssertionError("unreachable")
    out = np.array(out, dtype=np.float64)
    if n_private:
        out[-1] = 1.0  # (the tree's own smoothing path); the smoothed values are within [0, 1]
    for arr in (out, counts, variance):
        arr.setflags(write=False)
    return DPECDF(
        grid=grid,
        values=out,
        counts=counts,
        epsilon=release.epsilon,
        neighbouring=release.neighbouring,
        n=norm,
        n_private=n_private,
        noise=release.noise,
        rho=release.rho,
        smoothing=smoothing,
        consistency=consistency,
        variance=variance,
        release=release,
    )


def release_accuracy(
    values: ArrayLike,
    grid: Grid | ArrayLike,
    epsilon: float,
    neighbouring: Neighbouring = "replace_one",
    repeats: int = 20,
    seed: int = 0,
    smoothing: tuple[Smoothing | None, ...] = (None, "isotonic"),
) -> dict[str, float]:
    """Measured mean squared error of ``F`` at the thresholds, for each release variant.

    Non-private evaluation tool (it reads the data).

    Args:
        values, grid, epsilon, neighbouring: as in :func:`ecdf`.
        repeats: how many releases are averaged.
        seed: seeds the releases' noise (reproducible).
        smoothing: the smoothings compared, each with and without consistency.

    Returns:
        ``{"plain": ..., "consistent": ..., "plain+isotonic": ..., ...}``: the average over the
        releases of ``mean_i (F_hat(tau_i) - F(tau_i))^2``, plus ``"plain_exact"`` /
        ``"consistent_exact"``: the exact noise-only values for ``replace_one``
        (``mean_i Var_i / n^2``).
    """
    data = _as_values(values)
    g = _as_grid(grid)
    exact = np.cumsum(g.counts(data)) / data.size
    results: dict[str, list[float]] = {}
    rng = seeded_rng(seed)
    last: DPECDF | None = None
    for _ in range(repeats):
        state = rng.getstate()
        for consistency in (False, True):
            for sm in smoothing:
                rng.setstate(state)  # same noise for every variant: paired comparison
                F = ecdf(
                    data,
                    g,
                    epsilon,
                    neighbouring,
                    sm,
                    consistency=consistency,
                    rng=rng,
                    mechanism="binary",
                )
                last = F
                name = ("consistent" if consistency else "plain") + (f"+{sm}" if sm else "")
                results.setdefault(name, []).append(float(np.mean((F.values - exact) ** 2)))
    out = {k: float(np.mean(v)) for k, v in results.items()}
    if neighbouring == "replace_one" and last is not None:
        rel = last.release
        assert isinstance(rel, TreeRelease)  # release_accuracy uses the binary tree
        out["plain_exact"] = float(np.mean(prefix_variance(rel, False))) / data.size**2
        out["consistent_exact"] = float(np.mean(prefix_variance(rel, True))) / data.size**2
    return out
