r"""Differentially private ROC curves and AUC (thesis chapter 6, section 6.5.1).

A ROC curve is a pair of class-conditional ECDFs of the classifier's scores: with
``F_0(t) = #{negatives with score <= t} / n_0`` and ``F_1(t)`` the same for the positives, the
threshold ``t`` (predict positive when ``score > t``) has false positive rate
``FPR(t) = 1 - F_0(t)`` and true positive rate ``TPR(t) = 1 - F_1(t)``. The thesis releases the
two count functions with the tree mechanism; the curve, its smoothing and the AUC are
post-processing. (Convention: as in scikit-learn a *higher* score means "more likely positive";
the thesis's section 6.5.1 uses the mirror convention ``c_0(x) <= t``, which only relabels
thresholds.)

**Privacy (derivation).** Each class's leaf counts are released by
:func:`~clipless.stats.tree.release_counts` under its ``add_remove`` calibration: one value added
to or removed from a class moves at most ``Delta_ar = ceil((L+1)/2)`` node values of that class's
tree by 1 (Lemma 6.3.1), and nothing in the other tree.

* ``neighbouring="add_remove"``: adding or removing one record ``(score, label)`` touches only
  the tree of its label, so releasing *each* tree at the full ``epsilon`` (Laplace scale
  ``Delta_ar / epsilon``) is ``epsilon``-DP for the pair (parallel composition: the likelihood
  ratio of the joint output is that of the one tree that changed).
* ``neighbouring="replace_one"``: replacing ``(s, y)`` by ``(s', y')`` either stays within a
  class (``y = y'``: one tree changes by ``chi_{s'} - chi_s``, at most ``L+1`` nodes, thesis
  Theorem 6.3.1) or **switches class** (``y != y'``: tree ``y`` loses ``chi_s`` and tree ``y'``
  gains ``chi_{s'}``, at most ``Delta_ar`` nodes in *each*). The joint node vector therefore
  has L1 (and squared L2) sensitivity ``max(L+1, 2 Delta_ar) = 2 ceil((L+1)/2)``, so each tree
  gets Laplace scale ``2 Delta_ar / epsilon``: i.e. each class is released at ``epsilon / 2``
  with the add/remove calibration. (Equivalently: a replacement is one removal plus one
  addition, each ``epsilon/2``-DP by the first bullet, and group privacy gives ``epsilon``.)
  This is the same noise as a *single* replace-one ECDF when ``L`` is odd (``L+1`` even) and one
  node-unit more when ``L`` is even, and half of what the naive split (each class at
  ``epsilon/2`` with the replace-one constant ``L+1``) would use. For Gaussian noise the same
  squared-L2 bound gives ``rho``-zCDP with ``rho/2`` per class (direct sensitivity argument; the
  group-privacy route would lose a factor 2).
* **Class sizes.** Under replace-one only ``n = n_0 + n_1`` is public; ``n_0`` and ``n_1`` are
  private (a class switch changes both). They are never read from the data: each class's
  normaliser is its own released total ``max(P_N, 1)`` (every score is counted at ``tau_N`` after
  clamping, so the last noisy prefix count *is* a noisy class size; post-processing, no extra
  budget), exactly as :func:`~clipless.stats.ecdf.ecdf` does under add/remove. A class may be
  empty: no data-dependent error is raised (that would leak).

The thesis writes that two ``epsilon/2``-DP functions combine into a ``2 epsilon``-DP release;
composition gives ``epsilon`` and is what is used here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from clipless import _validate
from clipless.stats.counting import CountRelease, Mechanism, release_prefix_counts
from clipless.stats.ecdf import DPECDF, Smoothing, _as_values, _binary_labels, from_release
from clipless.stats.grid import Grid
from clipless.stats.noise import resolve_rng, to_fraction
from clipless.stats.tree import (
    Neighbouring,
    NoiseKind,
    TreeRelease,
    _check_neighbouring,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["DPROC", "nonprivate_roc", "roc"]


@dataclass(frozen=True, eq=False)
class DPROC:
    """A released DP ROC curve (thesis section 6.5.1).

    Attributes:
        thresholds: the public grid thresholds ``tau_1 < ... < tau_N``.
        fpr, tpr: ``1 - F_0(tau_i)`` and ``1 - F_1(tau_i)``: the rates of "score > tau_i" among the
            negatives and the positives. Non-increasing in ``i`` and within [0, 1] when smoothed.
        negatives, positives: the two class-conditional releases
            (:class:`~clipless.stats.ecdf.DPECDF`; each with its own component guarantee, see the
            module docstring).
        epsilon, rho: the guarantee of the whole release: ``epsilon``-DP (Laplace) or ``rho``-zCDP
            (Gaussian) under ``neighbouring``.
        neighbouring, smoothing: as passed to :func:`roc`.
    """

    thresholds: NDArray[np.float64] = field(repr=False)
    fpr: NDArray[np.float64] = field(repr=False)
    tpr: NDArray[np.float64] = field(repr=False)
    negatives: DPECDF = field(repr=False)
    positives: DPECDF = field(repr=False)
    epsilon: float | None
    rho: float | None
    neighbouring: Neighbouring
    smoothing: Smoothing | None

    def curve(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """``(fpr, tpr)`` from ``(1, 1)`` (threshold below every score) through every grid
        threshold to ``(0, 0)``."""
        fpr = np.concatenate([[1.0], self.fpr, [0.0]])
        tpr = np.concatenate([[1.0], self.tpr, [0.0]])
        return fpr, tpr

    def auc(self) -> float:
        """Area under the released curve by the trapezoid rule, endpoints included.

        Post-processing. With no noise and a grid containing every score this is the
        Mann-Whitney AUC with ties counted 1/2 (scikit-learn's ``roc_auc_score``). Without
        smoothing the curve may fold back; the trapezoid then gives a signed area.
        """
        fpr, tpr = self.curve()
        return float(np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2.0))

    def band(self, z: float = 1.96) -> dict[str, NDArray[np.float64]]:
        """Half-widths ``z sd`` of the noise in :attr:`fpr` and :attr:`tpr` at each threshold.

        From the public variances of the two class-conditional releases
        (:meth:`~clipless.stats.ecdf.DPECDF.band`): a noise-only band.

        Args:
            z: the half-width in standard deviations, finite and ``>= 0``.

        Returns:
            ``{"fpr": ..., "tpr": ...}``, one half-width per threshold.
        """
        lo_neg, hi_neg = self.negatives.band(z)
        lo_pos, hi_pos = self.positives.band(z)
        return {"fpr": (hi_neg - lo_neg) / 2, "tpr": (hi_pos - lo_pos) / 2}

    def plot(
        self,
        ax: Axes | None = None,
        true_curve: tuple[ArrayLike, ArrayLike] | None = None,
        band: bool = True,
        **kwargs: Any,
    ) -> Axes:
        """Plot the released curve (and the chance diagonal); returns the Axes.

        Object-oriented matplotlib (no pyplot).

        Args:
            ax: the Axes to draw on (``None``: a new figure's).
            true_curve: an ``(fpr, tpr)`` pair drawn for comparison, e.g. the non-private curve
                from :func:`nonprivate_roc` in a benchmark (``None``: not drawn).
            band: shade ``tpr -+ 1.96`` sd (vertical) and ``fpr -+ 1.96`` sd (horizontal) at
                the grid thresholds (:meth:`band`, noise-only).
            kwargs: passed to the plot of the released curve.
        """
        if ax is None:
            from matplotlib.figure import Figure

            ax = Figure().add_subplot()
        fpr, tpr = self.curve()
        budget = f"ε={self.epsilon:g}" if self.epsilon is not None else f"ρ={self.rho:g}"
        label = kwargs.pop("label", f"DP ROC ({budget}, AUC={self.auc():.3f})")
        (line,) = ax.plot(fpr, tpr, label=label, **kwargs)
        if band:
            half = self.band()
            style: dict[str, Any] = {"color": line.get_color(), "alpha": 0.15, "linewidth": 0}
            ax.fill_between(
                self.fpr, self.tpr - half["tpr"], self.tpr + half["tpr"],
                label="±1.96 sd of the noise in TPR / FPR (noise-only band)", **style,
            )  # fmt: skip
            ax.fill_betweenx(
                self.tpr, self.fpr - half["fpr"], self.fpr + half["fpr"], **style
            )  # fmt: skip
        if true_curve is not None:
            tf = np.asarray(true_curve[0], dtype=np.float64)
            tt = np.asarray(true_curve[1], dtype=np.float64)
            ax.plot(tf, tt, color="black", linewidth=1.0, label="exact (non-private)")
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
        ax.set_aspect("equal")
        ax.legend(loc="lower right")
        return ax


def _scores_labels(
    scores: ArrayLike, labels: ArrayLike, allow_empty: bool = False
) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
    s = _as_values(scores, allow_empty, name="scores")
    return s, _binary_labels(labels, s.size, "scores")


def _as_grid(grid: Grid | ArrayLike) -> Grid:
    if isinstance(grid, Grid):
        return grid
    return Grid.from_thresholds(np.asarray(grid, dtype=np.float64))


def _class_ecdf(
    release: TreeRelease | CountRelease, grid: Grid, smoothing: Smoothing | None, consistency: bool
) -> DPECDF:
    """Normalise one class's release by its own released total (the add/remove branch of
    :func:`~clipless.stats.ecdf.ecdf`) and smooth it. Post-processing only."""
    return from_release(release, grid, n=None, smoothing=smoothing, consistency=consistency)


def roc(
    scores: ArrayLike,
    labels: ArrayLike,
    grid: Grid | ArrayLike,
    epsilon: float | None,
    neighbouring: Neighbouring = "replace_one",
    smoothing: Smoothing | None = "isotonic",
    rng: random.Random | None = None,
    *,
    noise: NoiseKind = "laplace",
    rho: float | None = None,
    consistency: bool = True,
    mechanism: Mechanism = "auto",
    branching: int | None = None,
) -> DPROC:
    """Release a DP ROC curve of a classifier's ``scores`` against binary ``labels``.

    Thesis section 6.5.1: two class-conditional DP ECDFs of the scores on a public ``grid``
    (tree mechanism, exact discrete noise); the curve, smoothing and AUC are post-processing.
    The epsilon split and the handling of the private class sizes are derived in the module
    docstring: under ``add_remove`` each class gets the full ``epsilon``, under ``replace_one``
    each gets ``epsilon/2`` with the add/remove calibration (a class switch changes both).

    Args:
        scores: classifier scores (higher = more likely positive), not NaN; clamped to the grid.
        labels: 0/1 (or booleans), same length.
        grid: public thresholds (a :class:`~clipless.stats.grid.Grid` or an increasing list), chosen
            without looking at the scores.
        epsilon: total budget (``> 0``) for Laplace noise; ``None`` with ``noise="gaussian"``.
        neighbouring: ``"replace_one"`` or ``"add_remove"``.
        smoothing: ``"isotonic"`` (default: a monotone curve), ``"l1"``/``"l2"`` (thesis eq. 6.3.6)
            or ``None`` (raw; the curve may fold back).
        rng: :class:`random.Random`; default a cryptographically secure source.
        noise, rho: ``"laplace"`` (pure ``epsilon``-DP) or ``"gaussian"`` with a total ``rho``
            (zCDP).
        consistency: least-squares consistent prefix counts per class (about half the variance; the
            default, as in :func:`~clipless.stats.ecdf.ecdf`; combines with every smoothing).
        mechanism, branching: the counting mechanism per class (:mod:`clipless.stats.counting`), as
            in :func:`~clipless.stats.ecdf.ecdf`. Each class is released under its add/remove
            calibration. The derivation above carries over because, for every mechanism, a
            within-class replacement moves that class's noisy vector by at most twice the add/remove
            sensitivity: ``k``-ary, at most ``2h`` nodes by 1 against ``h + 1`` (L1 and squared L2);
            factorisation, ``||L e_b - L e_a||^2 <= 2 S(N)`` because the columns of ``L`` are
            non-negative (``<L e_a, L e_b> >= 0``). A class switch moves each class by one
            add/remove step, paid by the ``epsilon/2`` (``rho/2``) per class.
    """
    _check_neighbouring(neighbouring)
    s, pos = _scores_labels(scores, labels, allow_empty=neighbouring == "add_remove")
    g = _as_grid(grid)
    if smoothing not in (None, "isotonic", "l1", "l2"):
        raise ValueError(f"smoothing must be None, 'isotonic', 'l1' or 'l2', got {smoothing!r}")
    _validate.flag("consistency", consistency)
    if mechanism == "auto" and consistency is False:
        mechanism = "binary"  # the thesis's plain estimator exists for the binary tree only
    if mechanism != "binary" and not consistency:
        raise ValueError("consistency=False exists only for mechanism='binary'")
    gen = resolve_rng(rng)
    eps_class: float | None = None
    rho_class: float | None = None
    if noise == "laplace":
        if epsilon is None:
            raise ValueError("epsilon is required for noise='laplace'")
        if rho is not None:
            raise ValueError("rho is only for noise='gaussian'")
        eps_class = class_budget(epsilon, "epsilon", neighbouring)
    elif noise == "gaussian":
        if epsilon is not None:
            raise ValueError("noise='gaussian' is calibrated by rho (zCDP); pass epsilon=None")
        if rho is None:
            raise ValueError("rho is required for noise='gaussian'")
        rho_class = class_budget(rho, "rho", neighbouring)
    else:
        raise ValueError(f"noise must be 'laplace' or 'gaussian', got {noise!r}")

    curves = []
    for cls in (False, True):
        counts = g.counts(s[pos == cls])
        rel = release_prefix_counts(
            counts,
            eps_class,
            "add_remove",
            noise,
            gen,
            rho_class,
            mechanism=mechanism,
            branching=branching,
        )
        curves.append(_class_ecdf(rel, g, smoothing, consistency))
    return roc_from_classes(g, curves[0], curves[1], epsilon, rho, neighbouring, smoothing)


def class_budget(value: float | None, name: str, neighbouring: Neighbouring) -> float | None:
    """Each class's ``epsilon`` (or ``rho``): half of ``value`` under replace-one, all of it
    under add/remove; ``None`` stays ``None``. Halving a float is exact, so the two classes
    compose to exactly ``value``."""
    if value is None:
        return None
    return float(to_fraction(value, name)) / (2 if neighbouring == "replace_one" else 1)


def roc_from_classes(
    g: Grid,
    negatives: DPECDF,
    positives: DPECDF,
    epsilon: float | None,
    rho: float | None,
    neighbouring: Neighbouring,
    smoothing: Smoothing | None,
) -> DPROC:
    """The :class:`DPROC` of the two released class ECDFs (post-processing): read-only
    ``fpr = 1 - F_neg`` and ``tpr = 1 - F_pos`` on ``g``'s thresholds (also the federated ROC's)."""
    fpr = 1.0 - np.asarray(negatives.values)
    tpr = 1.0 - np.asarray(positives.values)
    for arr in (fpr, tpr):
        arr.setflags(write=False)
    return DPROC(
        thresholds=g.thresholds,
        fpr=fpr,
        tpr=tpr,
        negatives=negatives,
        positives=positives,
        epsilon=None if epsilon is None else float(epsilon),
        rho=None if rho is None else float(rho),
        neighbouring=neighbouring,
        smoothing=smoothing,
    )


def nonprivate_roc(
    scores: ArrayLike, labels: ArrayLike, grid: Grid | ArrayLike
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The exact ``(fpr, tpr)`` curve at the grid thresholds, endpoints included.

    **Not private** (it reads the data): for tests, benchmarks and the ``true_curve`` of
    :meth:`DPROC.plot`. Empty classes give rates of 0.

    Args:
        scores, labels, grid: as in :func:`roc`.

    Returns:
        ``(fpr, tpr)``, each of ``len(grid) + 2`` values from 1 down to 0.
    """
    s, pos = _scores_labels(scores, labels)
    g = _as_grid(grid)
    out = []
    for cls in (False, True):
        c = np.cumsum(g.counts(s[pos == cls])).astype(np.float64)
        rates = 1.0 - c / c[-1] if c[-1] > 0 else np.zeros_like(c)
        out.append(np.concatenate([[1.0], rates, [0.0]]))
    return out[0], out[1]
