"""DP statistics (thesis chapter 6): DP empirical CDFs released with the binary tree mechanism,
exact discrete noise, quantiles by inversion, continual counting.

* :class:`Grid` -- public thresholds (never derived from the data).
* :func:`ecdf` / :class:`DPECDF` -- the release, its evaluation, quantiles and plot.
* :func:`release_counts` / :class:`TreeRelease` -- the tree mechanism on integer leaf counts
  (thesis Theorem 6.3.1, Lemma 6.3.1, Theorem 6.3.2), with :func:`consistent_prefix_sums`
  (least squares, Hay et al. 2010).
* :func:`discrete_laplace`, :func:`discrete_gaussian` -- exact samplers (Canonne, Kamath,
  Steinke 2020) from :func:`secure_rng` (default) or :func:`seeded_rng` (tests).
* :func:`release_prefix_counts` / :class:`CountRelease` -- the counting mechanism as a choice
  (``mechanism="binary" | "k-ary" | "factorization" | "smooth-binary"``,
  :mod:`clipless.stats.counting`).
* :func:`quantiles` / :class:`QuantileRelease`, :func:`rank_error` -- many quantiles from one
  released CDF (:mod:`clipless.stats.quantiles`).
* :class:`ContinualCounter` -- running counts of a stream (Theorem 6.3.2).
* :func:`isotonic`, :func:`smooth_tree`, :func:`smooth_counts` -- monotone smoothing
  (pool-adjacent-violators; the thesis's problem 6.3.6 in L1 or L2).
* :func:`roc` / :class:`DPROC` -- DP ROC curves and AUC (section 6.5.1).
* :func:`hosmer_lemeshow` / :class:`HLResult` -- DP Hosmer-Lemeshow (Algorithm 10, Thm 6.5.1).
"""

from clipless.stats.calibration import HLResult, hosmer_lemeshow, nonprivate_hosmer_lemeshow
from clipless.stats.continual import ContinualCounter, HorizonExceededError
from clipless.stats.counting import CountRelease, release_prefix_counts
from clipless.stats.ecdf import DPECDF, ecdf, poisson_dataset, release_accuracy
from clipless.stats.grid import Grid, tree_depth
from clipless.stats.noise import (
    discrete_gaussian,
    discrete_gaussian_pmf,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_pmf,
    discrete_laplace_variance,
    secure_rng,
    seeded_rng,
)
from clipless.stats.quantiles import QuantileRelease, quantiles, rank_error
from clipless.stats.roc import DPROC, nonprivate_roc, roc
from clipless.stats.smoothing import SmoothedCounts, isotonic, smooth_counts, smooth_tree
from clipless.stats.tree import (
    TreeRelease,
    consistent_prefix_sums,
    node_counts_from_leaves,
    path_sums,
    prefix_variance,
    release_counts,
    tree_path_matrix,
    tree_sensitivity,
)

__all__ = [
    "DPECDF",
    "DPROC",
    "ContinualCounter",
    "CountRelease",
    "Grid",
    "HLResult",
    "HorizonExceededError",
    "QuantileRelease",
    "SmoothedCounts",
    "TreeRelease",
    "consistent_prefix_sums",
    "discrete_gaussian",
    "discrete_gaussian_pmf",
    "discrete_gaussian_variance",
    "discrete_laplace",
    "discrete_laplace_pmf",
    "discrete_laplace_variance",
    "ecdf",
    "hosmer_lemeshow",
    "isotonic",
    "node_counts_from_leaves",
    "nonprivate_hosmer_lemeshow",
    "nonprivate_roc",
    "path_sums",
    "poisson_dataset",
    "prefix_variance",
    "quantiles",
    "rank_error",
    "release_accuracy",
    "release_counts",
    "release_prefix_counts",
    "roc",
    "secure_rng",
    "seeded_rng",
    "smooth_counts",
    "smooth_tree",
    "tree_depth",
    "tree_path_matrix",
    "tree_sensitivity",
]
