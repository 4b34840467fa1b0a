"""Continual counting: DP running counts of a stream (thesis Theorem 6.3.2).

The binary mechanism of Dwork, Naor, Pitassi and Rothblum (STOC 2010) and Chan, Shi and Song
(TISSEC 2011), in the thesis's form: for a stream ``x_1, ..., x_T`` with ``T <= horizon``,
``L = ceil(log2 horizon)``, release at every step

    ``s_hat_t = sum_{i <= t} x_i + sum_{l=0..L} eta_{ceil(t / 2^l), l}``,

one noise per dyadic node, drawn (exactly, :mod:`clipless.stats.noise`) the first time a node is
needed. The released sequence is the path-sum post-processing of the tree release of
:mod:`clipless.stats.tree`, with the stream positions as leaves.

**Sensitivity.** Adjacent streams differ in one element; with elements in ``{0, ..., bound}``
that element changes by at most ``bound`` and the prefix sums change on a suffix, which the
signed dyadic representation writes with at most ``ceil((L+1)/2)`` nodes (Lemma 6.3.1,
Theorem 6.3.2; proof in :mod:`clipless.stats.tree`). So the node vector has L1 sensitivity
``bound * ceil((L+1)/2)`` and squared L2 sensitivity ``bound^2 * ceil((L+1)/2)``:

* ``noise="laplace"``: discrete Laplace of scale ``bound * ceil((L+1)/2) / epsilon``:
  ``epsilon``-DP;
* ``noise="gaussian"``: discrete Gaussian with ``sigma^2 = bound^2 ceil((L+1)/2) / (2 rho)``:
  ``rho``-zCDP (Theorem 6.3.2's ``N(0, ceil((L+1)/2) z^2)`` is ``1/(2 z^2)``-zCDP).

Both ``neighbouring`` notions (``"add_remove"``: an element is present or replaced by 0;
``"replace_one"``: one element's value replaced) change one position by at most ``bound``, so
they share this sensitivity. The guarantee is for a stream fixed in advance (as Theorem 6.3.2);
adaptively chosen streams are not covered by that theorem. Each released value has variance
``(L+1) Var(eta)``.

**Factorisation** (``mechanism="factorization"``, Gaussian noise only; Fichtenberger,
Henzinger, Upadhyay, ICML 2023; Henzinger, Upadhyay, Upadhyay, SODA 2023). The integer square
root factor ``Lt`` of :mod:`clipless.stats.counting` is lower triangular, so its release ``w_t =
(Lt x)_t + Z_t`` and the estimate ``s_hat_t = (A Lt^-1 w)_t`` only need the stream so far: a
streaming mechanism. One element changed by at most ``bound`` moves ``Lt x`` by at most
``bound`` times a column of ``Lt``: squared L2 sensitivity ``bound^2 St(T)``
(:func:`~clipless.stats.counting.factorization_sensitivity`, an exact integer), so discrete
Gaussian ``Z`` with ``sigma^2 >= bound^2 St(T) / (2 rho)`` is ``rho``-zCDP for a stream fixed
in advance (CKS 2020). Variance at step ``t``: ``Var(Z) sum_(k <= t) g_k^2``, growing like
``ln(t) / pi`` (the binary mechanism's grows like ``log2(T)``). Each step costs ``O(t)``
(``O(T^2)`` over the stream; fine for ``T`` up to ~``10^5``). The k-ary tree is not offered
here: its gain comes from least squares over the whole tree, which a stream cannot wait for.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from clipless import _validate
from clipless.stats.counting import (
    _estimator_coefficients,
    factorization_integer_coefficients,
    factorization_sensitivity,
)
from clipless.stats.grid import tree_depth
from clipless.stats.noise import (
    conservative_scale,
    discrete_gaussian,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_variance,
    resolve_rng,
    to_fraction,
)
from clipless.stats.tree import Neighbouring, NoiseKind, _check_neighbouring, tree_sensitivity

__all__ = ["ContinualCounter", "HorizonExceededError"]


class HorizonExceededError(RuntimeError):
    """More stream elements than the counter's horizon (its privacy analysis) allows."""


class ContinualCounter:
    """Release the running count of a stream after every element (thesis Theorem 6.3.2).

    Args:
        epsilon: pure DP budget (``> 0``) for ``noise="laplace"``; ``None`` for Gaussian noise.
        horizon: the most elements the stream may have (the tree covers them), ``>= 1``.
        noise: ``"laplace"`` (discrete Laplace, ``epsilon``-DP) or ``"gaussian"`` (discrete
            Gaussian, ``rho``-zCDP).
        neighbouring: ``"add_remove"`` (default) or ``"replace_one"``; one changed element
            moves a suffix of the running counts either way.
        rng: :class:`random.Random`; default a cryptographically secure source.
        rho: zCDP budget for Gaussian noise.
        bound: the largest value of one element (elements are ints in ``[0, bound]``).
        mechanism: ``"binary"`` (the tree, default) or ``"factorization"`` (square-root
            factorisation, Gaussian only).

    Raises:
        ValueError: a horizon or bound below 1, an unknown noise or mechanism, or a budget that
            does not fit the noise.

    >>> from clipless.stats import seeded_rng
    >>> c = ContinualCounter(epsilon=1e9, horizon=4, rng=seeded_rng(0))
    >>> [c.update(x) for x in (1, 0, 1, 1)]
    [1, 1, 2, 3]
    """

    def __init__(
        self,
        epsilon: float | None,
        horizon: int,
        noise: NoiseKind = "laplace",
        neighbouring: Neighbouring = "add_remove",
        rng: random.Random | None = None,
        *,
        rho: float | None = None,
        bound: int = 1,
        mechanism: str = "binary",
    ) -> None:
        horizon = _validate.integer("horizon", horizon)
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        if not _validate.is_int(bound) or bound < 1:
            raise ValueError(f"bound must be a positive int, got {bound!r}")
        _check_neighbouring(neighbouring)
        if mechanism not in ("binary", "factorization"):
            raise ValueError(
                f"mechanism must be 'binary' or 'factorization' for a stream, got {mechanism!r}"
            )
        if mechanism == "factorization" and noise != "gaussian":
            raise ValueError("mechanism='factorization' needs noise='gaussian' (and rho)")
        self.mechanism = mechanism
        self._rng = resolve_rng(rng)
        self.horizon = int(horizon)
        self.bound = int(bound)
        self.neighbouring: Neighbouring = neighbouring
        self.depth = tree_depth(self.horizon)
        # one changed element moves a suffix of prefix sums: add/remove-type constant
        nodes = tree_sensitivity(self.depth, "add_remove")
        self.noise: NoiseKind = noise
        if noise == "laplace":
            if rho is not None or epsilon is None:
                raise ValueError("noise='laplace' needs epsilon (and no rho)")
            self.epsilon: float | None = float(epsilon)
            self.rho: float | None = None
            self.noise_param: Fraction | float = conservative_scale(
                Fraction(self.bound * nodes) / to_fraction(epsilon, "epsilon")
            )
            self.node_variance = discrete_laplace_variance(self.noise_param)
        elif noise == "gaussian":
            if epsilon is not None or rho is None:
                raise ValueError("noise='gaussian' needs rho (and epsilon=None)")
            self.epsilon, self.rho = None, float(rho)
            self.noise_param = Fraction(self.bound**2 * nodes) / (2 * to_fraction(rho, "rho"))
            self.node_variance = discrete_gaussian_variance(self.noise_param)
        else:
            raise ValueError(f"noise must be 'laplace' or 'gaussian', got {noise!r}")
        self.sensitivity: float = nodes * self.bound
        # noise of the current node at each level: nodes are visited left to right, so only
        # the current root-to-leaf path is ever needed again (memory O(L))
        self._path = [0] * (self.depth + 1)
        self._pool = np.zeros(0, dtype=np.int64)
        self._pool_pos = 0
        self._time = 0
        self._sum = 0
        self._released: list[int] = []
        self._fact_released: list[float] = []
        if mechanism == "factorization":
            s_t = factorization_sensitivity(self.horizon, "add_remove")
            assert self.rho is not None  # checked above for noise='gaussian'
            sigma2 = conservative_scale(
                Fraction(self.bound**2 * s_t) / (2 * to_fraction(self.rho, "rho"))
            )
            self._coef = np.asarray(factorization_integer_coefficients(self.horizon))
            self._g = np.asarray(_estimator_coefficients(self.horizon))
            self._stream: list[int] = []
            self._noisy: list[int] = []
            self.sensitivity = self.bound * math.sqrt(s_t)
            self.noise_param = sigma2
            self.node_variance = discrete_gaussian_variance(sigma2)

    @property
    def time(self) -> int:
        """Number of elements seen."""
        return self._time

    @property
    def released(self) -> NDArray[np.int64] | NDArray[np.float64]:
        """All released running counts so far (floats for the factorisation)."""
        if self.mechanism == "factorization":
            return np.array(self._fact_released, dtype=np.float64)
        return np.array(self._released, dtype=np.int64)

    @property
    def variance(self) -> float:
        """Variance of each released count: ``(L+1) Var(eta)`` (binary); for the
        factorisation the largest one, ``sigma^2 S(T)`` (step ``t`` has ``sigma^2 S(t)``)."""
        if self.mechanism == "factorization":
            return float(self.node_variance * np.sum(self._g**2))
        return (self.depth + 1) * self.node_variance

    def _draw(self, k: int) -> NDArray[np.int64]:
        """``k`` fresh i.i.d. noises, taken from a pool refilled in vectorised batches."""
        if self._pool_pos + k > self._pool.size:
            batch = max(k, min(4096, (1 << (self.depth + 1)) - 1))
            if self.noise == "laplace":
                fresh = discrete_laplace(self.noise_param, batch, self._rng)
            else:
                fresh = discrete_gaussian(None, batch, self._rng, sigma2=self.noise_param)
            self._pool = np.concatenate([self._pool[self._pool_pos :], fresh])
            self._pool_pos = 0
        out = self._pool[self._pool_pos : self._pool_pos + k]
        self._pool_pos += k
        return out

    def update(self, x: int) -> int | float:
        """Feed one element and return the released running count.

        Args:
            x: the element, an int in ``[0, bound]`` (a bool counts as 0 / 1).

        Returns:
            The noisy running count: an int for ``"binary"``, a float for ``"factorization"``.

        Raises:
            TypeError, ValueError: ``x`` not an int in ``[0, bound]``.
            HorizonExceededError: the stream is longer than ``horizon``.
        """
        if isinstance(x, bool):
            x = int(x)
        if not isinstance(x, (int, np.integer)):
            raise TypeError(f"x must be an int in [0, {self.bound}], got {type(x).__name__}")
        if not 0 <= x <= self.bound:
            raise ValueError(f"x must lie in [0, {self.bound}], got {x}")
        if self._time >= self.horizon:
            raise HorizonExceededError(
                f"the counter's horizon of {self.horizon} elements is exhausted; its privacy "
                "analysis covers no more"
            )
        if self.mechanism == "factorization":
            t = self._time
            self._time += 1
            self._sum += int(x)
            self._stream.append(int(x))
            # w_t = (Lt x)_t + Z_t, exact integers; the estimate is (A Lt^-1 w)_t
            lt_x = int(np.dot(self._coef[t::-1], np.asarray(self._stream, dtype=np.int64)))
            self._noisy.append(lt_x + int(self._draw(1)[0]))
            value = float(np.dot(self._g[t::-1], np.asarray(self._noisy, dtype=np.float64)))
            self._fact_released.append(value)
            return value
        leaf = self._time
        new_levels = [lev for lev in range(self.depth + 1) if leaf % (1 << lev) == 0]
        fresh = self._draw(len(new_levels))
        for lev, value in zip(new_levels, fresh.tolist(), strict=True):
            self._path[lev] = value
        self._time += 1
        self._sum += int(x)
        out = self._sum + sum(self._path)
        self._released.append(out)
        return out
