"""Audits of the DP statistics: exact privacy loss of the ECDF tree release, sampled samplers.

**Exact privacy-loss check (small domains).** The randomised part of :func:`clipless.stats.ecdf`
(and of everything built on it) is :func:`clipless.stats.tree.release_counts`: the node vector
``V = theta(c) + eta`` with i.i.d. exact discrete Laplace (or discrete Gaussian) noise on every
node, where ``c`` are the leaf counts of the data on the public grid (:meth:`Grid.counts`, with its
clamping). Everything released afterwards (prefix sums, consistency, smoothing, normalisation,
quantiles) is a function of ``V``: post-processing. For two neighbouring datasets with leaf counts
``c`` and ``c'`` and ``d = theta(c) - theta(c')`` the **privacy loss random variable**
``log P[V = v | c] / P[V = v | c']`` at ``v ~ V | c`` is a sum of independent per-node terms:

* discrete Laplace of scale ``b``: ``(|eta + d_j| - |eta|) / b``, integer multiples of ``1/b`` in
  ``[-|d_j|/b, |d_j|/b]`` with an exactly computable pmf (``eta`` beyond ``|d_j|`` contributes
  ``+-d_j`` with the closed-form tail mass). Their convolution is the exact privacy loss
  distribution; ``delta(epsilon) = E[(1 - e^(epsilon - L))_+]`` is the exact hockey-stick
  divergence (Meiser and Mohammadi 2018; Sommer, Meiser and Mohammadi 2019), and pure
  ``epsilon``-DP holds iff ``delta(epsilon) = 0`` for every neighbouring pair.
* discrete Gaussian of variance parameter ``sigma^2``: the Renyi divergence of order ``alpha`` of
  a shift by ``d_j``, ``1/(alpha-1) log sum_z p(z)^alpha p(z - d_j)^(1-alpha)``, summed exactly over
  the support; ``rho``-zCDP holds iff the sum over nodes is ``<= rho alpha`` for every ``alpha >
  1`` (Bun and Steinke 2016; Canonne, Kamath and Steinke 2020, Proposition 5 / Theorem 14).

:func:`audit_ecdf` enumerates every dataset of ``n`` values over a small set of candidate values
(one per leaf interval, plus values outside the grid that clamping moves to its ends) and every
neighbour (replace one value by any candidate, or add / remove one), computes the leaf counts with
the library's grid, reads the noise parameter from the library's release for that domain, and
returns the largest exact privacy loss (Laplace) or the largest ratio ``D_alpha / (rho alpha)``
(Gaussian) against the claim. This is complementary to the exhaustive sensitivity test of
``tests/stats/test_tree.py``: it checks the noise distribution and the scale the release actually
uses, not only the number of nodes a change touches.

**Sampled audit of the samplers** (:func:`audit_sampler`). The exact analysis above assumes that
the samplers draw from the stated pmf. :func:`audit_sampler` draws ``samples`` values from
:func:`~clipless.stats.noise.discrete_laplace` / :func:`~clipless.stats.noise.discrete_gaussian`
and returns (1) the G-test (likelihood-ratio chi-square) p-value against the exact pmf, cells
with expected count below 5 pooled into the tails, and (2) an empirical epsilon lower bound
(:func:`clipless.audit.bounds.epsilon_lower_bound`, ``delta = 0``) for a counting query of
sensitivity 1 released with that noise, which must stay below ``1 / scale`` for the Laplace.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats as _stats
from scipy.special import logsumexp

from clipless import _validate
from clipless.audit.bounds import ThresholdTest, epsilon_lower_bound

__all__ = [
    "EcdfAudit",
    "PrivacyLossDistribution",
    "SamplerAudit",
    "audit_ecdf",
    "audit_sampler",
    "gaussian_renyi_divergence",
    "laplace_privacy_loss",
]


@dataclass(frozen=True)
class PrivacyLossDistribution:
    """An exact, finitely supported privacy loss distribution on the lattice ``unit * Z``.

    ``P[L = steps[i] * unit] = probs[i]``; ``unit`` is exact (``1 / scale`` as a fraction), so
    comparisons with a claimed epsilon are exact too.
    """

    steps: NDArray[np.int64]
    probs: NDArray[np.float64]
    unit: Fraction

    @property
    def losses(self) -> NDArray[np.float64]:
        """The privacy-loss values of the support (``steps * unit``), as floats."""
        return self.steps.astype(np.float64) * float(self.unit)

    @property
    def max_loss(self) -> Fraction:
        """The largest privacy loss with positive probability (pure DP needs it ``<= epsilon``)."""
        return int(self.steps[self.probs > 0].max()) * self.unit

    def delta(self, epsilon: float | Fraction) -> float:
        """The exact hockey-stick divergence ``E[(1 - e^(epsilon - L))_+]`` (0 if ``L <= eps``)."""
        eps = Fraction(epsilon)
        above = np.array([int(k) * self.unit > eps for k in self.steps.tolist()], dtype=bool)
        if not above.any():
            return 0.0
        gap = -np.expm1(float(eps) - self.losses[above])
        return float(np.sum(self.probs[above] * gap))


def _node_vector(counts: ArrayLike, depth: int) -> NDArray[np.int64]:
    from clipless.stats.tree import node_counts_from_leaves

    return np.concatenate(node_counts_from_leaves(np.asarray(counts, dtype=np.int64), depth))


def _laplace_node_loss(d: int, scale: float) -> dict[int, float]:
    """pmf of ``|eta + d| - |eta|`` for ``eta ~ DLap(scale)`` (integer values in [-|d|, |d|])."""
    if d == 0:
        return {0: 1.0}
    q = math.exp(-1.0 / scale)
    norm = (1.0 - q) / (1.0 + q)
    a = abs(d)
    out: dict[int, float] = {}
    # eta in [-a, a]: enumerate; beyond, the value is +-d (closed-form tails, each q^(a+1)/(1+q))
    for eta in range(-a, a + 1):
        value = abs(eta + d) - abs(eta)
        out[value] = out.get(value, 0.0) + norm * q ** abs(eta)
    tail = q ** (a + 1) / (1.0 + q)
    out[d] = out.get(d, 0.0) + tail  # eta > a: |eta + d| - |eta| = d
    out[-d] = out.get(-d, 0.0) + tail  # eta < -a: = -d
    return out


def laplace_privacy_loss(
    counts: ArrayLike, neighbour_counts: ArrayLike, scale: float | Fraction
) -> PrivacyLossDistribution:
    """Exact privacy loss distribution of the tree release of ``counts`` vs ``neighbour_counts``.

    Discrete Laplace of ``scale`` on every node (module docstring). The leaf counts must have the
    same length (one grid).
    """
    from clipless.stats.grid import tree_depth

    a = np.asarray(counts, dtype=np.int64)
    b = np.asarray(neighbour_counts, dtype=np.int64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 1:
        raise ValueError(f"counts must be two 1-D arrays of one length; got {a.shape}, {b.shape}")
    depth = tree_depth(int(a.size))
    d = _node_vector(a, depth) - _node_vector(b, depth)
    s = float(scale)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"scale must be a finite number > 0; got {scale!r}")
    exact_scale = Fraction(scale)
    total: dict[int, float] = {0: 1.0}
    for dj in d.tolist():
        if dj == 0:
            continue
        node = _laplace_node_loss(int(dj), s)
        nxt: dict[int, float] = {}
        for u, pu in total.items():
            for v, pv in node.items():
                nxt[u + v] = nxt.get(u + v, 0.0) + pu * pv
        total = nxt
    keys = sorted(total)
    return PrivacyLossDistribution(
        steps=np.array(keys, dtype=np.int64),
        probs=np.array([total[k] for k in keys], dtype=np.float64),
        unit=1 / exact_scale,
    )


def _dgauss_renyi_shift(d: int, sigma2: float, alpha: float) -> float:
    """``D_alpha(N_Z(d, s2) || N_Z(0, s2))`` summed exactly over a support covering its mass."""
    if d == 0:
        return 0.0
    sigma = math.sqrt(sigma2)
    # the summand q^alpha p^(1 - alpha) is a Gaussian centred at alpha d (its exponent is
    # -(z - alpha d)^2 / (2 s2) + const); the window covers it and both distributions
    c = alpha * d
    lo = math.floor(min(0.0, c, float(d)) - 14.0 * sigma - 10.0)
    hi = math.ceil(max(0.0, c, float(d)) + 14.0 * sigma + 10.0)
    z = np.arange(lo, hi + 1, dtype=np.float64)
    log_p = -(z**2) / (2.0 * sigma2)  # unnormalised; the normaliser cancels below
    log_q = -((z - d) ** 2) / (2.0 * sigma2)
    log_norm = logsumexp(log_p)
    value = logsumexp(alpha * log_q + (1.0 - alpha) * log_p) - log_norm
    return float(value / (alpha - 1.0))


def gaussian_renyi_divergence(
    counts: ArrayLike, neighbour_counts: ArrayLike, sigma2: float | Fraction, alpha: float
) -> float:
    """Exact Renyi divergence of order ``alpha`` between the two tree releases (discrete Gaussian).

    Both directions are the same by symmetry of the noise (a shift by ``-d``), so one suffices.
    """
    from clipless.stats.grid import tree_depth

    a = np.asarray(counts, dtype=np.int64)
    b = np.asarray(neighbour_counts, dtype=np.int64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 1:
        raise ValueError(f"counts must be two 1-D arrays of one length; got {a.shape}, {b.shape}")
    if not (_validate.is_real(alpha) and alpha > 1 and math.isfinite(alpha)):
        raise ValueError(f"alpha must be a finite number > 1; got {alpha!r}")
    s2 = _validate.finite_positive("sigma2", sigma2)
    depth = tree_depth(int(a.size))
    d = _node_vector(a, depth) - _node_vector(b, depth)
    return math.fsum(_dgauss_renyi_shift(int(dj), s2, float(alpha)) for dj in d.tolist() if dj)


@dataclass(frozen=True)
class EcdfAudit:
    """Result of :func:`audit_ecdf`.

    ``worst`` is the largest exact privacy loss (Laplace: ``max L`` over every neighbouring pair,
    to compare with ``claimed_epsilon``) or the largest ``max_alpha D_alpha / alpha`` (Gaussian:
    to compare with ``claimed_rho``). ``delta_at_claim`` is the largest exact ``delta(epsilon)``
    at the claimed epsilon (0 for a pure DP release). ``pairs`` neighbouring pairs were checked.
    """

    noise: str
    neighbouring: str
    num_leaves: int
    pairs: int
    worst: float
    claimed_epsilon: float | None
    claimed_rho: float | None
    delta_at_claim: float
    worst_pair: tuple[tuple[float, ...], tuple[float, ...]]
    exceeds: bool

    @property
    def holds(self) -> bool:
        """Whether the exact privacy loss respects the claim.

        Laplace: exact rational comparison of every pair's largest loss with epsilon. Gaussian:
        the divergences are sums of floats, compared with a ``1e-9`` relative tolerance.
        """
        if self.noise == "laplace":
            return not self.exceeds and self.delta_at_claim == 0.0
        assert self.claimed_rho is not None
        return self.worst <= self.claimed_rho * (1.0 + 1e-9)


def _candidates(thresholds: Sequence[float]) -> list[float]:
    """One value per leaf interval ``(tau_{i-1}, tau_i]`` and one beyond each end of the grid."""
    t = [float(v) for v in thresholds]
    values = [t[0] - 1.0, t[0]]
    values += [(lo + hi) / 2.0 for lo, hi in itertools.pairwise(t)]
    values.append(t[-1] + 1.0)
    return values


def _neighbours(
    data: tuple[float, ...], candidates: Sequence[float], neighbouring: str
) -> list[tuple[float, ...]]:
    out: list[tuple[float, ...]] = []
    if neighbouring == "replace_one":
        for i in range(len(data)):
            for v in candidates:
                if v != data[i]:
                    out.append(tuple(sorted((*data[:i], v, *data[i + 1 :]))))
    else:
        out.extend(tuple(sorted((*data, v))) for v in candidates)
        out.extend(data[:i] + data[i + 1 :] for i in range(len(data)))
    return out


def audit_ecdf(
    thresholds: Sequence[float],
    size: int,
    *,
    epsilon: float | None = 1.0,
    rho: float | None = None,
    neighbouring: str = "replace_one",
    alphas: Sequence[float] = (1.5, 2.0, 4.0, 16.0, 64.0),
    scale_factor: float = 1.0,
) -> EcdfAudit:
    """Exhaustive exact privacy-loss audit of the ECDF release on a small grid (module docstring).

    Every dataset of ``size`` values over the candidate values, every neighbour. The noise
    parameter is read from :func:`clipless.stats.tree.release_counts` for this grid;
    ``scale_factor`` multiplies it (``< 1`` simulates a broken release, for tests).
    """
    from clipless.stats.grid import Grid
    from clipless.stats.noise import seeded_rng
    from clipless.stats.tree import _check_neighbouring, release_counts

    if not _validate.is_int(size) or not 1 <= size <= 6:
        raise ValueError(f"size must be an integer in [1, 6] (exhaustive audit); got {size!r}")
    _validate.finite_positive("scale_factor", scale_factor)
    if rho is not None:
        alphas = tuple(alphas)
        if not alphas:
            raise ValueError("alphas must hold at least one Renyi order > 1")
        for a in alphas:
            if not (_validate.is_real(a) and math.isfinite(a) and a > 1):
                raise ValueError(f"alphas must be finite numbers > 1; got {a!r}")
    _check_neighbouring(neighbouring)
    grid = Grid.from_thresholds(thresholds)
    taus = list(grid.thresholds)
    if len(taus) > 64:
        raise ValueError(f"at most 64 thresholds for an exhaustive audit; got {len(taus)}")
    noise = "laplace" if rho is None else "gaussian"
    leaves = grid.counts(np.array([taus[0]]))
    release = release_counts(
        leaves,
        epsilon if noise == "laplace" else None,
        neighbouring,  # type: ignore[arg-type]
        noise,  # type: ignore[arg-type]
        seeded_rng(0),
        rho,
    )
    exact_param = Fraction(release.noise_param) * Fraction(scale_factor)
    param = float(exact_param)
    candidates = _candidates(taus)

    def counts(data: tuple[float, ...]) -> NDArray[np.int64]:
        return np.asarray(grid.counts(np.asarray(data, dtype=np.float64)), dtype=np.int64)

    worst, worst_delta, pairs, exceeds = -math.inf, 0.0, 0, False
    worst_pair: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    for data in itertools.combinations_with_replacement(candidates, size):
        c = counts(data)
        for other in _neighbours(data, candidates, neighbouring):
            c2 = counts(other) if other else np.zeros_like(c)
            pairs += 1
            if noise == "laplace":
                pld = laplace_privacy_loss(c, c2, exact_param)
                assert epsilon is not None
                exact_loss = pld.max_loss
                if exact_loss > Fraction(epsilon):
                    exceeds = True
                value = float(exact_loss)
                worst_delta = max(worst_delta, pld.delta(epsilon))
            else:
                value = max(gaussian_renyi_divergence(c, c2, param, a) / a for a in alphas)
            if value > worst:
                worst, worst_pair = value, (data, other)
    return EcdfAudit(
        noise=noise,
        neighbouring=neighbouring,
        num_leaves=len(taus),
        pairs=pairs,
        worst=float(worst),
        claimed_epsilon=None if epsilon is None or noise != "laplace" else float(epsilon),
        claimed_rho=None if rho is None else float(rho),
        delta_at_claim=worst_delta,
        worst_pair=worst_pair,
        exceeds=exceeds,
    )


@dataclass(frozen=True)
class SamplerAudit:
    """Result of :func:`audit_sampler`: G-test against the exact pmf and an epsilon lower bound."""

    kind: str
    parameter: float
    samples: int
    g_statistic: float
    degrees_of_freedom: int
    p_value: float
    claimed_epsilon: float | None
    test: ThresholdTest

    @property
    def epsilon_lower_bound(self) -> float:
        """The sampled epsilon lower bound (with probability ``test.confidence``)."""
        return self.test.epsilon


def _g_test(
    x: NDArray[np.int64], pmf: Callable[[NDArray[np.int64]], NDArray[np.float64]], half: int
) -> tuple[float, int, float]:
    ks = np.arange(-half, half + 1)
    p = pmf(ks)
    observed = np.concatenate(
        [[np.sum(x < -half)], np.bincount(x[np.abs(x) <= half] + half, minlength=ks.size), [0]]
    ).astype(np.float64)
    observed[-1] = np.sum(x > half)
    tail = max(0.0, (1.0 - float(p.sum())) / 2.0)
    expected = x.size * np.concatenate([[tail], p, [tail]])
    keep = expected >= 5.0
    # pool the sparse cells into one
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] < 5.0:
        obs, exp = obs[:-1], exp[:-1]
        exp = exp * obs.sum() / exp.sum()
    res = _stats.power_divergence(obs, exp, lambda_="log-likelihood")
    return float(res.statistic), int(obs.size - 1), float(res.pvalue)


def audit_sampler(
    kind: str,
    parameter: float | Fraction,
    samples: int = 200_000,
    *,
    rng: random.Random | None = None,
    confidence: float = 0.95,
    sampler: Callable[..., Any] | None = None,
) -> SamplerAudit:
    """Sampled audit of an exact discrete sampler (module docstring).

    ``kind`` is ``"laplace"`` (``parameter`` = scale ``b``) or ``"gaussian"`` (``parameter`` =
    ``sigma^2``). ``sampler(parameter, size, rng)`` defaults to the library's sampler (a test
    passes a broken one). The epsilon lower bound compares ``Z`` with ``1 + Z`` (a counting
    query of sensitivity 1); for the Laplace the claim is ``1 / b``.
    """
    from clipless.stats import noise as _noise
    from clipless.stats.tree import _check_noise

    _check_noise(kind, "kind")
    _validate.positive_int("samples", samples, minimum=100, wrong_type=ValueError)
    gen = rng if rng is not None else _noise.secure_rng()
    if sampler is None:
        if kind == "laplace":
            sampler = _noise.discrete_laplace
        else:

            def sampler(p: Any, size: int, r: random.Random) -> Any:
                return _noise.discrete_gaussian(None, size, r, sigma2=p)

    value = _validate.finite_positive("parameter", parameter)
    x = np.asarray(sampler(parameter, samples, gen), dtype=np.int64)
    y = 1 + np.asarray(sampler(parameter, samples, gen), dtype=np.int64)
    if kind == "laplace":

        def pmf(k: NDArray[np.int64]) -> NDArray[np.float64]:
            return _noise.discrete_laplace_pmf(k, parameter)

        half = int(12 * value) + 5
        claimed: float | None = 1.0 / value
    else:

        def pmf(k: NDArray[np.int64]) -> NDArray[np.float64]:
            return _noise.discrete_gaussian_pmf(k, parameter)

        half = int(6 * math.sqrt(value)) + 5
        claimed = None
    g, dof, p_value = _g_test(x, pmf, half)
    test = epsilon_lower_bound(x.astype(np.float64), y.astype(np.float64), 0.0, confidence)
    return SamplerAudit(
        kind=kind,
        parameter=value,
        samples=samples,
        g_statistic=g,
        degrees_of_freedom=dof,
        p_value=p_value,
        claimed_epsilon=claimed,
        test=test,
    )
