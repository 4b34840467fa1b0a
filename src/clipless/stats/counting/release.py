"""What the counting mechanisms share: the release value, the choice set, the budget check and
the conditioning on a public total.

Every mechanism of :mod:`clipless.stats.counting` releases, from the integer leaf counts
``c_1..c_N`` of a public grid, an estimate of every prefix count ``C_i = c_1 + ... + c_i``. The DP
part is one noisy vector; the estimate, and everything in this module, is post-processing of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal, Protocol

import numpy as np
from numpy.typing import NDArray

from clipless.stats.grid import tree_depth
from clipless.stats.noise import (
    conservative_scale,
    discrete_gaussian,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_variance,
)
from clipless.stats.tree import Neighbouring, NoiseKind, noise_scale

Mechanism = Literal["auto", "binary", "k-ary", "factorization", "smooth-binary"]


MECHANISMS: tuple[str, ...] = ("auto", "binary", "k-ary", "factorization", "smooth-binary")


def _check_mechanism(mechanism: str) -> None:
    if mechanism not in MECHANISMS:
        raise ValueError(
            f"mechanism must be one of {', '.join(repr(m) for m in MECHANISMS)}, got {mechanism!r}"
        )


class NodeNoiseSource(Protocol):
    """Keyed node noise (:class:`clipless.federated.NodeNoise`): the exact noise of nodes
    ``(levels[i], index[i])`` at parameter ``param``, the same wherever it is recomputed."""

    def nodes(
        self, kind: NoiseKind, param: Fraction, levels: NDArray[np.int64], index: NDArray[np.int64]
    ) -> NDArray[np.int64]: ...


@dataclass(frozen=True, eq=False)
class CountRelease:
    """Output of :func:`release_prefix_counts` for ``"k-ary"``, ``"factorization"`` and
    ``"smooth-binary"``.

    Attributes:
        mechanism: ``"k-ary"``, ``"factorization"`` or ``"smooth-binary"``.
        num_leaves: ``N``.
        prefix_counts: the (least-squares / factorised) estimates of the ``N`` prefix counts,
            float64.
        variance: exact per-threshold variance of :attr:`prefix_counts` (given the noise
            parameters).
        noisy: the DP vector itself (node values for ``k``-ary, concatenated by level; ``L x + z``
            for the factorisation).
        noise, noise_param, noise_scale, node_variance: ``"laplace"``/``"gaussian"``; exact scale
            ``b`` or ``sigma^2`` (``k``-ary: one per level, ``None`` for a level that is not
            released); ``b`` or ``sigma`` (of the leaves); variance of one noise draw (of the
            leaves).
        sensitivity: L1 sensitivity (Laplace) or squared L2 sensitivity (Gaussian) of the noisy
            vector (``k``-ary: the most nodes one change moves, over the released levels: ``per``
            times their number, ``per = 1`` add/remove, ``2`` replace-one).
        shares: ``k``-ary: the budget fraction of each noisy level (:func:`level_shares`).
        branching: ``k`` (``None`` for the factorisation).
        neighbouring, epsilon, rho: the guarantee.
    """

    mechanism: str
    num_leaves: int
    prefix_counts: NDArray[np.float64] = field(repr=False)
    variance: NDArray[np.float64] = field(repr=False)
    noisy: NDArray[np.float64] = field(repr=False)
    noise: NoiseKind
    noise_param: Fraction | float | tuple[Fraction | None, ...]
    noise_scale: float
    node_variance: float
    sensitivity: float
    branching: int | None
    neighbouring: Neighbouring
    epsilon: float | None
    rho: float | None
    shares: tuple[Fraction, ...] | None = None

    @property
    def depth(self) -> int:
        """Binary depth ``ceil(log2 N)`` (used by the thesis's l1/l2 smoothing graph)."""
        return tree_depth(self.num_leaves)


def _condition_on_total(
    prefix: NDArray[np.float64],
    variance: NDArray[np.float64],
    cov_last: NDArray[np.float64],
    total: float,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The linear estimate ``prefix`` conditioned on its last entry being ``total`` (public).

    ``Chat_i - Cov(Chat_i, Chat_N) / Var(Chat_N) (Chat_N - n)``, variance
    ``Var(Chat_i) - Cov(Chat_i, Chat_N)^2 / Var(Chat_N)``: the best linear unbiased estimate
    given the extra exact equation (post-processing of the release with a public value).
    """
    n_pub = float(total)
    var_n = float(variance[-1])
    prefix = np.array(prefix, dtype=np.float64)
    variance = np.array(variance, dtype=np.float64)
    if var_n > 0:
        prefix = prefix - cov_last / var_n * (prefix[-1] - n_pub)
        variance = np.maximum(variance - cov_last**2 / var_n, 0.0)
    prefix[-1] = n_pub
    variance[-1] = 0.0
    return prefix, variance


def _count_release(
    mechanism: str,
    estimate: tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]],
    noise: NoiseKind,
    param: Fraction,
    node_variance: float,
    sensitivity: int,
    neighbouring: Neighbouring,
    guarantee: tuple[float | None, float | None],
) -> CountRelease:
    """The :class:`CountRelease` of a mechanism with one noise parameter ``param`` (the exact
    ``b`` or ``sigma^2``) for every node: ``estimate`` is ``(prefix_counts, variance, noisy)``,
    made read-only here, and ``guarantee`` is ``(epsilon, rho)``. The ``k``-ary release passes
    its leaves' parameter and then sets one per level, ``k`` and the shares."""
    prefix, variance, noisy = estimate
    for a in estimate:
        a.setflags(write=False)
    return CountRelease(
        mechanism=mechanism,
        num_leaves=int(prefix.size),
        prefix_counts=prefix,
        variance=variance,
        noisy=noisy,
        noise=noise,
        noise_param=param,
        noise_scale=noise_scale(noise, param),
        node_variance=node_variance,
        sensitivity=float(sensitivity),
        branching=None,
        neighbouring=neighbouring,
        epsilon=guarantee[0],
        rho=guarantee[1],
    )


def _noise_param(sensitivity: int, noise: NoiseKind, budget: Fraction) -> Fraction:
    """The exact noise parameter of a vector with L1 (Laplace) or squared L2 (Gaussian)
    sensitivity ``Delta`` at budget ``epsilon`` or ``rho``: discrete Laplace scale ``b >= Delta
    / epsilon`` (``epsilon``-DP) or discrete Gaussian ``sigma^2 >= Delta / (2 rho)``
    (``rho``-zCDP, Canonne, Kamath, Steinke 2020, Theorem 14), rounded up."""
    if noise == "laplace":
        return conservative_scale(Fraction(sensitivity) / budget)
    return conservative_scale(Fraction(sensitivity) / (2 * budget))


def _param_variance(param: Fraction, noise: NoiseKind) -> float:
    """The exact variance of one draw of the noise of parameter ``param`` (``b`` or
    ``sigma^2``)."""
    if noise == "laplace":
        return discrete_laplace_variance(param)
    return discrete_gaussian_variance(param)


def _draw(noise: NoiseKind, param: Fraction, size: int, gen: random.Random) -> NDArray[np.int64]:
    """``size`` independent draws of the exact noise of parameter ``param`` from ``gen``."""
    if noise == "laplace":
        return discrete_laplace(param, size, gen)
    return discrete_gaussian(None, size, gen, sigma2=param)
