r"""A differentially private Hosmer-Lemeshow calibration test (thesis section 6.5.2, Algorithm 10,
Theorem 6.5.1).

The Hosmer-Lemeshow statistic of a probabilistic classifier partitions the records into ``Q``
groups of increasing predicted probability ("deciles of risk") and compares observed and
expected counts of positives and negatives in each group (thesis eq. 6.5.1):

    ``H = sum_q (O_1q - E_1q)^2 / E_1q + (O_0q - E_0q)^2 / E_0q``,

``O_1q`` (``O_0q``) the number of positives (negatives) and ``E_1q = sum p``
(``E_0q = sum (1 - p)``) the predicted ones in group ``q``; under good calibration ``H`` is
roughly chi-squared with ``Q - 2`` degrees of freedom.

**Algorithm 10, as implemented.** With ``epsilon' = epsilon / (Delta_F + Delta_G)``:

1. (``binning="quantile"``, the thesis) release a DP ECDF of the predicted probabilities on a
   public grid of ``[0, 1]`` with per-node Laplace scale ``1/epsilon'``
   (:func:`~clipless.stats.ecdf.ecdf` with budget ``Delta_F epsilon'``,
   ``Delta_F`` = :func:`~clipless.stats.tree.tree_sensitivity`, ``L+1`` under replace-one as in
   the thesis), and set the group boundaries ``t_q = F^{-1}(q/Q)``, ``q = 1..Q-1``, by search
   (Algorithm 9: the smallest threshold with ``F >= q/Q``). ``binning="uniform"`` uses the
   public boundaries ``t_q = q/Q`` instead and spends nothing here (``Delta_F = 0``).
2. For each group ``(t_{q-1}, t_q]`` (``t_0 = -inf``, ``t_Q = +inf``) release the four sums
   ``E_1q, E_0q, O_1q, O_0q``, each with independent discrete Laplace noise of scale
   ``1/epsilon'`` (lines 7-8).
3. Compute ``H`` from the noisy table; the p-value is ``chi2.sf(H, Q - 2)``.

**Privacy (Theorem 6.5.1).** Step 1 is ``Delta_F epsilon'``-DP (tree mechanism). Given the
released boundaries (adaptive sequential composition of pure DP), a neighbouring change moves one
record between at most two groups (replace-one) or adds/removes it in one group (add/remove).
In an affected group each of the four sums moves by at most 1:

* ``split="thesis"``: the thesis counts every affected statistic at ``epsilon'``: ``Delta_G = 8``
  under replace-one (2 groups x 4 statistics, Theorem 6.5.1) and ``4`` under add/remove
  (the same argument with one group), so ``epsilon' = epsilon / (L + 9)`` for replace-one.
* ``split="tight"``: the four sums of one group move *together* by exactly 2 in L1
  (``|dE_1| + |dE_0| = p + (1 - p) = 1`` and exactly one of ``O_1, O_0`` moves by 1), and by at
  most ``2|p - p'| + 2 <= 4`` when a record changes within one group; so the table's L1
  sensitivity is ``Delta_G = 4`` (replace-one) or ``2`` (add/remove) and Laplace noise of scale
  ``1/epsilon'`` on every entry costs ``Delta_G epsilon'``. This is a tighter constant with its
  proof here; it halves (replace-one) or quarters the noise budget of step 2.

Total ``(Delta_F + Delta_G) epsilon' = epsilon`` (exact rational arithmetic; Laplace scales are
only ever rounded *up*, :func:`~clipless.stats.noise.conservative_scale`).

**Deviations from the thesis, with reasons.**

* Groups are half-open, ``(t_{q-1}, t_q]``. Algorithm 10's ``M[l, u]`` uses closed intervals, so
  a record lying on a boundary would be counted in two groups, breaking the "at most two groups"
  step of the proof.
* The predicted probabilities are rounded to multiples of ``2^-20`` before summation so that
  ``E_1q, E_0q`` are integers in units of ``2^-20`` and take *exact* discrete Laplace noise
  (scale ``2^20 / epsilon'`` in those units), avoiding floating-point Laplace (Mironov 2012).
  Rounding is a fixed per-record map, so the sensitivity argument is unchanged; the rounding
  changes a group sum by at most ``n_q 2^-21``.
* Noisy expected counts can be tiny or negative (the thesis reports large errors from small
  ``E_1q``, section 6.6.6). The statistic divides by ``max(E, min_expected)`` and uses the noisy
  observed counts as released; this is post-processing.
* The p-value is the plug-in ``chi2.sf(H, Q - 2)``: it ignores the DP noise (the noisy ``H`` is
  not chi-squared), so it is conservative or anti-conservative depending on the noise level.
  Treat it as descriptive unless ``epsilon`` is large relative to ``Q (L + 9) / n``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal, cast

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.stats import chi2

from clipless import _validate
from clipless.stats.ecdf import DPECDF, _binary_labels, _record_vector, ecdf
from clipless.stats.grid import Grid
from clipless.stats.noise import conservative_scale, discrete_laplace, resolve_rng, to_fraction
from clipless.stats.tree import Neighbouring, _check_neighbouring, tree_sensitivity

_P_SLACK = 1e-9
"""Probabilities this far outside ``[0, 1]`` (floating-point rounding) are clipped, not refused."""

__all__ = ["HLResult", "hosmer_lemeshow", "nonprivate_hosmer_lemeshow"]

Binning = Literal["quantile", "uniform"]
Split = Literal["thesis", "tight"]

_RESOLUTION_BITS = 20
_DEFAULT_GRID_SIZE = 1024


@dataclass(frozen=True, eq=False)
class HLResult:
    """A released (DP) Hosmer-Lemeshow test.

    Attributes:
        statistic: ``H`` computed from the noisy table (eq. 6.5.1), denominators floored at
            ``min_expected``.
        p_value: ``chi2.sf(statistic, dof)`` (plug-in: ignores the DP noise).
        dof: ``Q - 2``.
        boundaries: ``Q + 1`` group edges ``[0, t_1, ..., t_{Q-1}, 1]``; group ``q`` is
            ``(t_{q-1}, t_q]`` (the first also takes everything ``<= t_1``, the last everything
            ``> t_{Q-1}``).
        observed, expected: ``(Q, 2)`` noisy tables; column 0 = negatives (``O_0q``, ``E_0q``),
            column 1 = positives (``O_1q``, ``E_1q``).
        epsilon: total budget; ``epsilon = epsilon_ecdf + epsilon_groups``.
        epsilon_ecdf, epsilon_groups: the split (Algorithm 10 line 3): ``Delta_F epsilon'`` and
            ``Delta_G epsilon'``.
        neighbouring, binning, split: as passed to :func:`hosmer_lemeshow`.
        noise_scale: laplace scale of every table entry, in counts (``1/epsilon'``, rounded up).
        min_expected: the floor of the denominators.
        ecdf: the DP ECDF of the probabilities used for the boundaries (``None`` for uniform bins).
    """

    statistic: float
    p_value: float
    dof: int
    boundaries: NDArray[np.float64] = field(repr=False)
    observed: NDArray[np.float64] = field(repr=False)
    expected: NDArray[np.float64] = field(repr=False)
    epsilon: float
    epsilon_ecdf: float
    epsilon_groups: float
    neighbouring: Neighbouring
    binning: Binning
    split: Split
    noise_scale: float
    min_expected: float
    ecdf: DPECDF | None = field(repr=False)

    @property
    def groups(self) -> int:
        """``Q``."""
        return int(self.observed.shape[0])

    def noise_aware_p_value(self, draws: int = 4000, seed: int = 0) -> float:
        """A p-value that accounts for the DP noise, by simulation from the released table.

        Post-processing (it reads only released values and the public noise scale). Under the
        null of perfect calibration, each draw takes group sizes
        ``n_q = (O_0q + O_1q + E_0q + E_1q) / 2`` and rates ``pi_q = E_1q / (E_0q + E_1q)``
        from the released table (clipped to valid ranges), draws ``O_1q ~ Binomial(n_q, pi_q)``
        (variance ``>=`` the Poisson-binomial one of the true model), sets
        ``E_1q = n_q pi_q``, adds Laplace noise of :attr:`noise_scale` to the four entries and
        recomputes ``H``; the p-value is ``(1 + #{H_sim >= H}) / (1 + draws)``. An
        approximation (the released ``E`` stand in for the true ones), but unlike
        :attr:`p_value` it does not read DP noise as miscalibration.

        Args:
            draws: the number of simulated statistics, a positive int.
            seed: seeds the simulation (public: it reads no data).
        """
        if not _validate.is_int(draws) or draws < 1:
            raise ValueError(f"draws must be a positive int, got {draws!r}")
        gen = np.random.default_rng(seed)
        obs, exp_ = np.asarray(self.observed), np.asarray(self.expected)
        size = np.maximum(np.rint((obs.sum(axis=1) + exp_.sum(axis=1)) / 2), 0).astype(np.int64)
        total_e = exp_.sum(axis=1)
        rate = np.clip(
            np.where(total_e > 0, exp_[:, 1] / np.where(total_e > 0, total_e, 1), 0.5), 0, 1
        )
        Q = size.size
        o1 = gen.binomial(size, rate, size=(draws, Q)).astype(np.float64)
        e1 = np.broadcast_to(size * rate, (draws, Q))
        noise = gen.laplace(0.0, self.noise_scale, size=(4, draws, Q))
        sim_o = np.stack([size - o1 + noise[0], o1 + noise[1]], axis=2)
        sim_e = np.stack([size - e1 + noise[2], e1 + noise[3]], axis=2)
        h = np.sum((sim_o - sim_e) ** 2 / np.maximum(sim_e, self.min_expected), axis=(1, 2))
        return float((1 + np.sum(h >= self.statistic)) / (1 + draws))

    def to_dict(self) -> dict[str, NDArray[np.float64]]:
        """The group table as arrays: lower/upper edge, ``O_0, O_1, E_0, E_1`` per group."""
        return {
            "lower": self.boundaries[:-1].copy(),
            "upper": self.boundaries[1:].copy(),
            "observed_0": self.observed[:, 0].copy(),
            "observed_1": self.observed[:, 1].copy(),
            "expected_0": self.expected[:, 0].copy(),
            "expected_1": self.expected[:, 1].copy(),
        }


def _probabilities_labels(
    probabilities: ArrayLike, labels: ArrayLike, allow_empty: bool = False
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    p = _record_vector("probabilities", probabilities, allow_empty)
    if not np.all(np.isfinite(p)) or np.any((p < -_P_SLACK) | (p > 1 + _P_SLACK)):
        raise ValueError("probabilities must be finite and within [0, 1]")
    # a sigmoid's rounding (1 + 2^-52) is not an error in the data: clip it
    p = np.clip(p, 0.0, 1.0)
    return p, _binary_labels(labels, p.size, "probabilities").astype(np.int64)


def _check_groups(groups: int) -> int:
    groups = _validate.integer("groups", groups)
    if not 3 <= groups <= 2**16:
        raise ValueError(
            f"groups must be between 3 (the test has groups - 2 degrees) and 65536, got {groups}"
        )
    return int(groups)


def _statistic(
    observed: NDArray[np.float64], expected: NDArray[np.float64], min_expected: float
) -> float:
    return float(np.sum((observed - expected) ** 2 / np.maximum(expected, min_expected)))


def _group_sums(
    p: NDArray[np.float64], y: NDArray[np.int64], inner: NDArray[np.float64], Q: int
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Per group: record count, sum of rounded ``p`` (units ``2^-20``), number of positives."""
    group = np.searchsorted(inner, p, side="left")
    k = 1 << _RESOLUTION_BITS
    p_int = np.rint(p * k).astype(np.int64)
    size = np.bincount(group, minlength=Q).astype(np.int64)
    s1 = np.bincount(group, weights=p_int, minlength=Q)
    pos = np.bincount(group, weights=y, minlength=Q)
    return size, np.rint(s1).astype(np.int64), np.rint(pos).astype(np.int64)


def _hl_options(
    binning: object, split: object, min_expected: object, grid: Grid | None
) -> tuple[Grid, float]:
    """``hosmer_lemeshow``'s options checked; the grid defaulted."""
    if binning not in ("quantile", "uniform"):
        raise ValueError(f"binning must be 'quantile' or 'uniform', got {binning!r}")
    if split not in ("thesis", "tight"):
        raise ValueError(f"split must be 'thesis' or 'tight', got {split!r}")
    floor = _validate.real("min_expected", min_expected)
    if not np.isfinite(floor) or floor <= 0:
        raise ValueError(f"min_expected must be finite and > 0, got {floor}")
    if grid is None:
        return Grid(0.0, 1.0, size=_DEFAULT_GRID_SIZE), floor
    if not isinstance(grid, Grid):
        raise TypeError(f"grid must be a Grid, got {type(grid).__name__}")
    return grid, floor


def _noisy_tables(
    size: NDArray[np.int64],
    s1: NDArray[np.int64],
    pos: NDArray[np.int64],
    eps_unit: Fraction,
    gen: random.Random,
) -> tuple[NDArray[np.float64], NDArray[np.float64], Fraction]:
    """The noised ``(observed, expected)`` tables (read-only, ``Q x 2``) and the counts' noise
    scale: each group's size, fixed-point probability sum and positives, with discrete
    Laplace noise at ``epsilon' = eps_unit`` per unit of sensitivity (Algorithm 10)."""
    q = size.shape[0]
    k = 1 << _RESOLUTION_BITS
    sum_scale = conservative_scale(Fraction(k) / eps_unit)
    count_scale = conservative_scale(Fraction(1) / eps_unit)
    noise_sums = discrete_laplace(sum_scale, (q, 2), gen)
    noise_counts = discrete_laplace(count_scale, (q, 2), gen)
    expected = np.empty((q, 2))
    expected[:, 1] = (s1 + noise_sums[:, 1]) / k
    expected[:, 0] = (k * size - s1 + noise_sums[:, 0]) / k
    observed = np.empty((q, 2))
    observed[:, 1] = pos + noise_counts[:, 1]
    observed[:, 0] = size - pos + noise_counts[:, 0]
    for arr in (expected, observed):
        arr.setflags(write=False)
    return observed, expected, count_scale


def hosmer_lemeshow(
    probabilities: ArrayLike,
    labels: ArrayLike,
    epsilon: float,
    groups: int = 10,
    neighbouring: Neighbouring = "replace_one",
    rng: random.Random | None = None,
    *,
    grid: Grid | None = None,
    binning: Binning = "quantile",
    split: Split = "thesis",
    min_expected: float = 1.0,
) -> HLResult:
    """DP Hosmer-Lemeshow test (thesis Algorithm 10, Theorem 6.5.1): ``epsilon``-DP.

    Args:
        probabilities: predicted probabilities of the positive class, within [0, 1].
        labels: 0/1 (or booleans), same length.
        epsilon: total budget ``> 0``, split as in Algorithm 10 (module docstring).
        groups: ``Q >= 3`` (the thesis uses 10).
        neighbouring: ``"replace_one"`` (the thesis's setting) or ``"add_remove"``.
        rng: :class:`random.Random`; default a cryptographically secure source.
        grid: public grid for the ECDF of the probabilities (default ``Grid(0, 1, size=1024)``,
            ``L = 10``); its resolution bounds that of the group boundaries.
        binning: ``"quantile"`` (thesis: DP deciles of risk) or ``"uniform"`` (public bins ``q/Q``).
        split: ``"thesis"`` (8 group statistics charged, Theorem 6.5.1) or ``"tight"`` (the exact L1
            sensitivity of the group table, 4; proof in the module docstring).
        min_expected: ``> 0``: floor of the denominators ``E`` in the statistic (post-processing).

    The plug-in :attr:`HLResult.p_value` ignores the noise; at moderate ``epsilon`` prefer
    :meth:`HLResult.noise_aware_p_value` (post-processing, no extra budget).
    """
    _check_neighbouring(neighbouring)
    p, y = _probabilities_labels(probabilities, labels, allow_empty=neighbouring == "add_remove")
    Q = _check_groups(groups)
    eps = to_fraction(epsilon, "epsilon")
    grid, min_expected = _hl_options(binning, split, min_expected, grid)
    gen = resolve_rng(rng)

    groups_affected = 2 if neighbouring == "replace_one" else 1
    delta_g = groups_affected * (4 if split == "thesis" else 2)
    delta_f = tree_sensitivity(grid.depth, neighbouring) if binning == "quantile" else 0
    eps_unit = eps / (delta_f + delta_g)  # epsilon' of Algorithm 10, exact

    released: DPECDF | None = None
    if binning == "quantile":
        n_public = p.size if neighbouring == "replace_one" else None
        released = ecdf(
            p,
            grid,
            # an exact Fraction (ecdf converts any real with noise.to_fraction), so that the
            # two parts add up to epsilon exactly
            cast(float, delta_f * eps_unit),
            neighbouring,
            n=n_public,
            rng=gen,
            mechanism="binary",  # Algorithm 10's split is stated for the thesis's tree
        )
        inner = np.asarray(released.quantile(np.arange(1, Q) / Q), dtype=np.float64)
    else:
        inner = np.arange(1, Q, dtype=np.float64) / Q

    observed, expected, count_scale = _noisy_tables(*_group_sums(p, y, inner, Q), eps_unit, gen)
    statistic = _statistic(observed, expected, float(min_expected))
    boundaries = np.concatenate([[0.0], inner, [1.0]])
    boundaries.setflags(write=False)
    return HLResult(
        statistic=statistic,
        p_value=float(chi2.sf(statistic, Q - 2)),
        dof=Q - 2,
        boundaries=boundaries,
        observed=observed,
        expected=expected,
        epsilon=float(epsilon),
        epsilon_ecdf=float(delta_f * eps_unit),
        epsilon_groups=float(delta_g * eps_unit),
        neighbouring=neighbouring,
        binning=binning,
        split=split,
        noise_scale=float(count_scale),
        min_expected=float(min_expected),
        ecdf=released,
    )


def nonprivate_hosmer_lemeshow(
    probabilities: ArrayLike,
    labels: ArrayLike,
    groups: int = 10,
    boundaries: ArrayLike | None = None,
    min_expected: float = 1e-12,
) -> tuple[float, float]:
    """The classical, **non-private** Hosmer-Lemeshow statistic and p-value.

    For tests and benchmarks only (it reads the data). Without ``boundaries`` the groups are the
    usual deciles of risk: the records sorted by probability and split into ``groups`` groups of
    (almost) equal size. With ``boundaries`` (the ``Q - 1`` inner edges, or the ``Q + 1`` edges
    of :attr:`HLResult.boundaries`) the groups are ``(t_{q-1}, t_q]``, as in the DP test.

    Args:
        probabilities: predicted probabilities of the positive class, within [0, 1].
        labels: 0/1 (or booleans), same length.
        groups: ``Q >= 3``.
        boundaries: the group edges (``None``: deciles of risk).
        min_expected: floor of the denominators ``E`` in the statistic.

    Returns:
        ``(statistic, p_value)``, the p-value from a chi-squared law with ``Q - 2`` degrees of
        freedom.
    """
    p, y = _probabilities_labels(probabilities, labels)
    Q = _check_groups(groups)
    if boundaries is None:
        order = np.argsort(p, kind="stable")
        group = np.empty(p.size, dtype=np.int64)
        group[order] = np.arange(p.size) * Q // p.size
    else:
        edges = np.asarray(boundaries, dtype=np.float64)
        inner = edges[1:-1] if edges.size == Q + 1 else edges
        if inner.size != Q - 1:
            raise ValueError(f"boundaries must have {Q - 1} or {Q + 1} entries, got {edges.size}")
        group = np.searchsorted(inner, p, side="left")
    e1 = np.bincount(group, weights=p, minlength=Q)
    size = np.bincount(group, minlength=Q).astype(np.float64)
    o1 = np.bincount(group, weights=y, minlength=Q)
    observed = np.stack([size - o1, o1], axis=1)
    expected = np.stack([size - e1, e1], axis=1)
    stat = _statistic(observed, expected, min_expected)
    return stat, float(chi2.sf(stat, Q - 2))
