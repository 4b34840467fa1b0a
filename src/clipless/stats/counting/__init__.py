r"""Counting mechanisms for all prefix counts, as one choice (``mechanism=``).

Every mechanism here releases, from the integer leaf counts ``c_1..c_N`` of a public grid, an
estimate of every prefix count ``C_i = c_1 + ... + c_i``. The DP part is one noisy vector; the
estimate is post-processing of it. One module per mechanism, each with its precondition, claim
and proof in its docstring, beside its constructor:

* ``"binary"``: the thesis's binary tree (signed-node release, :mod:`clipless.stats.tree`).
* ``"k-ary"``: the full ``k``-ary tree of counts with level budgets and least-squares consistency
  (:mod:`clipless.stats.counting.kary`). Pure DP or zCDP, exact discrete noise.
* ``"factorization"``: the square-root factorisation of the prefix-sum matrix
  (:mod:`clipless.stats.counting.factorization`), exact discrete Gaussian noise, zCDP.
* ``"smooth-binary"``: the smooth binary mechanism, equal variance at every threshold
  (:mod:`clipless.stats.counting.smooth_binary`). Pure DP or zCDP, exact discrete noise.
* ``"auto"``: the one with the smallest exact mean error at the release's ``N``, relation and
  budget (:mod:`clipless.stats.counting.choice`: :func:`default_mechanism`,
  :func:`counting_plan`).

:mod:`clipless.stats.counting.release` holds what they share (:class:`CountRelease`).
:func:`release_prefix_counts` dispatches on ``mechanism``.
"""

from __future__ import annotations

import random
from typing import Any

from numpy.typing import ArrayLike

# the imports "_x as _x" re-export private names that clipless.stats.continual,
# clipless.federated, the tests and the benchmarks import from here
from clipless.stats.counting.choice import (
    _tree_score as _tree_score,
)
from clipless.stats.counting.choice import (
    best_branching,
    counting_plan,
    default_mechanism,
    level_shares,
)
from clipless.stats.counting.factorization import (
    _estimator_coefficients as _estimator_coefficients,
)
from clipless.stats.counting.factorization import (
    _release_factorization,
    exact_convolve,
    factorization_coefficients,
    factorization_integer_coefficients,
    factorization_score,
    factorization_sensitivity,
)
from clipless.stats.counting.kary import (
    MAX_BRANCHING as MAX_BRANCHING,
)
from clipless.stats.counting.kary import (
    CountingPlan,
    exact_level_variances,
    kary_consistent_leaves,
    kary_depth,
    kary_estimate,
    kary_node_counts,
    kary_params,
    kary_prefix_covariance_with_last,
    kary_prefix_variance,
    kary_released_nodes,
    kary_sensitivity,
)
from clipless.stats.counting.kary import (
    _kary_kappa as _kary_kappa,
)
from clipless.stats.counting.kary import (
    _release_kary as _release_kary,
)
from clipless.stats.counting.release import (
    MECHANISMS,
    CountRelease,
    Mechanism,
    NodeNoiseSource,
    _check_mechanism,
)
from clipless.stats.counting.release import (
    _condition_on_total as _condition_on_total,
)
from clipless.stats.counting.smooth_binary import (
    _release_smooth_binary,
    smooth_binary_labels,
    smooth_binary_node_counts,
    smooth_binary_nodes,
    smooth_binary_sensitivity,
    smooth_binary_shape,
)
from clipless.stats.noise import resolve_rng
from clipless.stats.tree import (
    Neighbouring,
    NoiseKind,
    TreeRelease,
    _check_neighbouring,
    _leaf_counts_array,
    noise_budget,
    release_counts,
)

__all__ = [
    "MECHANISMS",
    "CountRelease",
    "CountingPlan",
    "Mechanism",
    "NodeNoiseSource",
    "best_branching",
    "counting_plan",
    "default_mechanism",
    "exact_convolve",
    "exact_level_variances",
    "factorization_coefficients",
    "factorization_integer_coefficients",
    "factorization_score",
    "factorization_sensitivity",
    "kary_consistent_leaves",
    "kary_depth",
    "kary_estimate",
    "kary_node_counts",
    "kary_params",
    "kary_prefix_covariance_with_last",
    "kary_prefix_variance",
    "kary_released_nodes",
    "kary_sensitivity",
    "level_shares",
    "release_prefix_counts",
    "smooth_binary_labels",
    "smooth_binary_node_counts",
    "smooth_binary_nodes",
    "smooth_binary_sensitivity",
    "smooth_binary_shape",
]


def _no_branching(branching: int | None) -> None:
    if branching is not None:
        raise ValueError("branching is only for mechanism='k-ary'")


def release_prefix_counts(
    leaf_counts: ArrayLike,
    epsilon: float | None,
    neighbouring: Neighbouring = "replace_one",
    noise: NoiseKind = "laplace",
    rng: random.Random | None = None,
    rho: float | None = None,
    *,
    mechanism: Mechanism = "auto",
    branching: int | None = None,
    node_noise: Any = None,
) -> TreeRelease | CountRelease:
    """Release every prefix count of ``leaf_counts`` with the chosen counting ``mechanism``.

    The proofs are in the docstrings of :mod:`~clipless.stats.counting.kary` and its siblings.

    Args:
        leaf_counts: non-negative integer counts per leaf (values in ``(tau_{i-1}, tau_i]``).
            Under ``replace_one`` the size ``n = sum(leaf_counts)`` is public and used exactly.
        epsilon: pure DP budget for ``noise="laplace"`` (``> 0``); ``None`` for Gaussian noise.
        neighbouring: ``"replace_one"`` or ``"add_remove"``.
        noise: ``"laplace"`` (discrete Laplace, ``epsilon``-DP) or ``"gaussian"`` (discrete
            Gaussian, ``rho``-zCDP).
        rng: :class:`random.Random`; default a cryptographically secure source.
        rho: zCDP budget for Gaussian noise.
        mechanism: ``"auto"`` (default, :func:`default_mechanism`: the smallest exact error at
            this ``N``, relation and budget), ``"binary"``
            (:func:`~clipless.stats.tree.release_counts`), ``"k-ary"``, ``"factorization"``
            (Gaussian only) or ``"smooth-binary"`` (equal variance at every threshold).
        branching: ``k`` of ``"k-ary"`` only (default: :func:`counting_plan`'s; the levels and
            shares are chosen for the budget either way).
        node_noise: for ``"binary"`` and ``"k-ary"``, a keyed node-noise source
            (:class:`clipless.federated.NodeNoise`, or ``SummedNoise`` whose ``copies``
            multiply the variances) replacing the draw from ``rng``; node ``(l, j)`` gets its
            noise at level ``l``'s parameter, so the federated release with the same source is
            equal bit for bit.

    Returns:
        A :class:`TreeRelease` for ``"binary"``, else a :class:`CountRelease`.

    Raises:
        ValueError: an unknown mechanism or relation, a budget that does not fit the noise,
            ``branching`` or ``node_noise`` with a mechanism that has none.
    """
    _check_mechanism(mechanism)
    _check_neighbouring(neighbouring)
    if mechanism == "binary":
        _no_branching(branching)
        return release_counts(
            leaf_counts, epsilon, neighbouring, noise, rng, rho, node_noise=node_noise
        )
    counts = _leaf_counts_array(leaf_counts)
    budget, eps_out, rho_out = noise_budget(noise, epsilon, rho)
    gen = resolve_rng(rng)
    N = int(counts.size)
    if mechanism == "auto":  # with a branching given, the k-ary tree with that k
        mechanism = (
            "k-ary" if branching is not None else default_mechanism(noise, N, neighbouring, budget)
        )
    if mechanism == "k-ary":
        plan = counting_plan(N, neighbouring, noise, budget, branching)
        return _release_kary(
            counts, plan, neighbouring, noise, budget, gen, eps_out, rho_out, node_noise
        )
    if node_noise is not None:
        raise ValueError(
            f"node_noise is for mechanism 'binary' or 'k-ary' (the federated releases), got "
            f"{mechanism!r}"
        )
    _no_branching(branching)
    if mechanism == "smooth-binary":
        return _release_smooth_binary(counts, neighbouring, noise, budget, gen, eps_out, rho_out)
    if noise != "gaussian":
        raise ValueError(
            "mechanism='factorization' needs noise='gaussian' (zCDP): its L1 sensitivity grows "
            "like sqrt(N), so under pure DP use 'k-ary'"
        )
    return _release_factorization(counts, neighbouring, budget, gen, rho_out)
