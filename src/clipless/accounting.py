"""Privacy accounting: ``dp_accounting`` events, epsilon, noise calibration, the privacy ledger.

This module imports no torch, directly or indirectly (DESIGN.md, "Principles: accounting is
framework-free"); a test imports it in a fresh interpreter and checks ``sys.modules``.

The mechanism
-------------
One training step of clipless DP-SGD releases the per-layer noisy sums of the (scaled) per-example
gradients of a Poisson sample of rate ``q`` (every example included independently with
probability ``q``). Layer ``k`` receives Gaussian noise of standard deviation ``sigma_k * G_k``
where ``G_k`` bounds the norm of one example's contribution to that layer. Whitening each layer by
its noise scale shows that the step is *one* Gaussian mechanism with effective noise multiplier
``sigma_eff = (sum_k sigma_k^-2)^(-1/2)`` (DESIGN.md, "Noise strategies";
:func:`effective_noise_multiplier`). Such a step is the Poisson-subsampled ("sampled") Gaussian
mechanism of Abadi et al. 2016 (Deep learning with differential privacy) and Mironov, Talwar and
Zhang 2019 (Renyi differential privacy of the sampled Gaussian mechanism), described here as
``PoissonSampledDpEvent(q, GaussianDpEvent(sigma_eff))`` (:func:`gaussian_step_event`) and composed
``T`` times (:func:`dpsgd_event`).

Noise-multiplier convention
---------------------------
``noise_multiplier`` is always ``std / G`` where ``G`` bounds the L2 norm of **one example's
contribution** (the add/remove-one sensitivity of the sum). This is ``dp_accounting``'s convention
for ``GaussianDpEvent`` ("if ||v_i|| <= C, the noise multiplier is s / C"). It does not change with
the neighbouring relation: under replace-one the accountant itself accounts for the difference
``||g - g'|| <= 2 G`` between the replaced example and its replacement (see below). Pass the
multiplier relative to ``G``, never one already halved or doubled for replace-one.

Accountants
-----------
* ``"pld"`` (default): privacy loss distributions, Doroshenko, Ghazi, Kamath, Kumar and
  Manurangsi 2022 (Connect the dots: tighter discrete approximations of privacy loss distributions)
  through ``dp_accounting.pld.PLDAccountant``. The discretisation is *pessimistic by construction*
  (every privacy loss is rounded up, the truncated tail mass is counted as infinite loss), so the
  reported epsilon is an upper bound on the true one, tight to about the discretisation interval.
  Default interval :data:`DEFAULT_PLD_DISCRETIZATION` ``= 1e-4`` (``dp_accounting``'s default):
  measured on 2 CPU cores, ``sigma = 1, q = 0.01, T = 1e3..1e5, delta = 1e-5`` costs 0.5-1.5 s per
  epsilon and overestimates by about ``1e-5`` relative (``1e-3``: 8x faster, ``1e-3`` relative).
* ``"rdp"``: Renyi DP (Mironov 2017; Mironov et al. 2019 for the sampled Gaussian) through
  ``dp_accounting.rdp.RdpAccountant`` with :data:`DEFAULT_RDP_ORDERS`. Cheap, looser than PLD
  (typically 5-15 % larger epsilon).

Neighbouring relations
----------------------
* ``"add_remove"`` (default; DESIGN.md "Adjacency and normalisation"): add or remove one example.
* ``"replace_one"``: replace one example by another. Both have contribution norm at most ``G``, so
  their difference has norm up to ``2 G`` ("replace-one doubles sensitivities").

  - Without subsampling (``q = 1``) this is exactly the Gaussian mechanism with sensitivity
    ``2 G``: ``epsilon_replace(sigma) == epsilon_add_remove(sigma / 2)``.
  - With Poisson subsampling the PLD accountant uses ``dp_accounting``'s ``REPLACE_ONE`` privacy
    loss distribution: the pair ``P = (1-q) N(0, sigma^2) + q N(-1, sigma^2)`` versus
    ``Q = (1-q) N(0, sigma^2) + q N(+1, sigma^2)`` (units of ``G``): the replaced example and its
    replacement contribute antipodal vectors of norm ``G``, each present with probability ``q``.
    We rely on this pair *dominating* every replace-one pair ``((1-q) N(0) + q N(u),
    (1-q) N(0) + q N(v))`` with ``||u||, ||v|| <= 1`` in every hockey-stick divergence (so the
    composition theorem for dominating pairs, Zhu, Dong and Wang 2022, Theorem 10, applies);
    ``tests/test_accounting.py`` checks this domination numerically on a 2-D grid of
    configurations. It sits between the two naive bounds:
    ``epsilon_add_remove(sigma) <= epsilon_replace(sigma) <= epsilon_add_remove(sigma / 2)``
    (tested), with equality on the right at ``q = 1``.
  - The RDP accountant of ``dp_accounting`` 0.6 does not support ``PoissonSampledDpEvent`` under
    ``REPLACE_ONE``, and for a plain ``GaussianDpEvent`` under ``REPLACE_ONE`` it uses sensitivity
    ``C`` instead of ``2 C`` (google/differential-privacy issue #378: epsilon underestimated).
    clipless therefore never hands ``REPLACE_ONE`` to the RDP accountant: for ``q = 1`` it composes
    the exact equivalent ``GaussianDpEvent(sigma / 2)`` under add/remove, and for ``q < 1`` it
    raises ``ValueError`` (use ``accountant="pld"``). (The add/remove pair at sensitivity ``2 G``
    does not dominate the replace-one pair in every divergence, so its RDP is not a proven bound.)

Degenerate noise
----------------
``noise_multiplier = 0`` is accepted and means *no privacy* (``dp_accounting``'s
``NonPrivateDpEvent``: epsilon is ``inf`` and delta is 1). ``noise_multiplier = inf`` means an
infinitely noisy step that releases nothing (``NoOpDpEvent``; a layer with ``G_k = 0``).
Negative or NaN multipliers are rejected.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from clipless._io import atomic_write

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_PLD_DISCRETIZATION",
    "DEFAULT_RDP_ORDERS",
    "LEDGER_FORMAT",
    "LEDGER_VERSION",
    "NEIGHBOURING_RELATIONS",
    "Accountant",
    "AccountantKind",
    "LedgerEntry",
    "Neighbouring",
    "PrivacyGuarantee",
    "PrivacyLedger",
    "calibrate_noise",
    "dpsgd_event",
    "effective_noise_multiplier",
    "epsilon",
    "gaussian_step_event",
]

AccountantKind = Literal["pld", "rdp"]
Neighbouring = Literal["add_remove", "replace_one"]

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
NEIGHBOURING_RELATIONS: tuple[str, ...] = ("add_remove", "replace_one")

DEFAULT_PLD_DISCRETIZATION = 1e-4
"""Default ``value_discretization_interval`` of the PLD accountant (module docstring)."""

DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS
)
"""``dp_accounting``'s default orders: 1.1..10.9 by 0.1, 11..63, 128, 256, 512, 1024."""

LEDGER_FORMAT = "clipless.PrivacyLedger"
LEDGER_VERSION = 1

_SIGMA_FLOOR = 0.02  # calibration floor: PLDs of smaller multipliers need huge supports
_NR = dp_accounting.NeighboringRelation
_NEVER = 1 << 62
_MECHANISM_REFS = "Abadi et al. 2016; Mironov et al. 2019"


# ----------------------------------------------------------------------------------- validation
def _real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__} {value!r}")
    return float(value)


def _check_epsilon(value: object, name: str = "epsilon", *, allow_zero: bool = False) -> float:
    eps = _real(value, name)
    low_ok = eps >= 0.0 if allow_zero else eps > 0.0
    if not (math.isfinite(eps) and low_ok):
        bound = "[0, inf)" if allow_zero else "(0, inf)"
        raise ValueError(f"{name} must be a finite number in {bound}; got {value!r}")
    return eps


def _check_delta(value: object, name: str = "delta") -> float:
    delta = _real(value, name)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"{name} must be in the open interval (0, 1); got {value!r}")
    return delta


def _check_sample_rate(value: object, name: str = "sample_rate") -> float:
    q = _real(value, name)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"{name} must be in (0, 1]; got {value!r}")
    return q


def _check_noise_multiplier(value: object, name: str = "noise_multiplier") -> float:
    sigma = _real(value, name)
    if math.isnan(sigma) or sigma < 0.0:
        raise ValueError(
            f"{name} must be in [0, inf] (0 means no privacy, inf releases nothing); got {value!r}"
        )
    return sigma


def _check_count(value: object, name: str, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer; got bool {value!r}")
    if isinstance(value, numbers.Integral):
        count = int(value)
    elif isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be an integer >= {minimum}; got non-integer {value!r}")
    else:
        raise TypeError(f"{name} must be an integer; got {type(value).__name__} {value!r}")
    if count < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return count


def _check_kind(value: object) -> str:
    if value not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}; got {value!r}")
    return str(value)


def _check_neighbouring(value: object) -> str:
    if value not in NEIGHBOURING_RELATIONS:
        raise ValueError(f"neighbouring must be one of {NEIGHBOURING_RELATIONS}; got {value!r}")
    return str(value)


def _check_discretization(value: object) -> float:
    vdi = _real(value, "value_discretization_interval")
    if not (math.isfinite(vdi) and 0.0 < vdi <= 0.1):
        raise ValueError(f"value_discretization_interval must be in (0, 0.1]; got {value!r}")
    return vdi


def _check_orders(value: Iterable[object] | None) -> tuple[float, ...]:
    if value is None:
        return DEFAULT_RDP_ORDERS
    orders = tuple(_real(a, "orders[i]") for a in value)
    if not orders or any(not (math.isfinite(a) and a > 1.0) for a in orders):
        raise ValueError(
            f"orders must be a non-empty sequence of finite numbers > 1; got {value!r}"
        )
    return orders


# -------------------------------------------------------------------------------------- events
def effective_noise_multiplier(sigmas: Sequence[float] | Iterable[float]) -> float:
    """The noise multiplier of one step whose layers have multipliers ``sigmas``.

    Layer ``k`` has sensitivity ``G_k`` and noise ``N(0, (sigma_k G_k)^2 I)``; dividing each layer
    by its noise scale turns the step into one Gaussian mechanism with unit noise and sensitivity
    ``sqrt(sum_k sigma_k^-2)``, i.e. noise multiplier ``(sum_k sigma_k^-2)^(-1/2)`` (DESIGN.md,
    "Noise strategies"). ``global`` allocation (``sigma_k = sigma G / G_k``,
    ``G = sqrt(sum G_k^2)``) gives ``sigma``; ``per-layer`` (``sigma_k = sigma`` for ``D`` layers)
    gives ``sigma / sqrt(D)``.

    A layer with ``sigma_k = inf`` adds nothing; any ``sigma_k = 0`` makes the step non-private
    (result 0).

    >>> effective_noise_multiplier([2.0, 2.0, 2.0, 2.0])
    1.0
    """
    values = [_check_noise_multiplier(s, "sigmas[i]") for s in sigmas]
    if not values:
        raise ValueError("sigmas must contain at least one noise multiplier")
    if any(s == 0.0 for s in values):
        return 0.0
    precision = math.fsum(1.0 / (s * s) for s in values if math.isfinite(s))
    if precision == 0.0:
        return math.inf
    return 1.0 / math.sqrt(precision)


def gaussian_step_event(noise_multiplier: float, sample_rate: float = 1.0) -> dp_event.DpEvent:
    """One step: ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` (Abadi et al. 2016).

    ``q == 1`` gives the plain ``GaussianDpEvent(sigma)``; ``sigma == 0`` gives
    ``NonPrivateDpEvent`` and ``sigma == inf`` gives ``NoOpDpEvent`` (module docstring).
    ``noise_multiplier`` is ``std / G`` with ``G`` the bound on one example's contribution.

    >>> gaussian_step_event(1.0, 0.01)
    PoissonSampledDpEvent(sampling_probability=0.01, event=GaussianDpEvent(noise_multiplier=1.0))
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sample_rate(sample_rate)
    if sigma == 0.0:
        return dp_event.NonPrivateDpEvent()
    if math.isinf(sigma):
        return dp_event.NoOpDpEvent()
    gaussian = dp_event.GaussianDpEvent(sigma)
    if q == 1.0:
        return gaussian
    return dp_event.PoissonSampledDpEvent(q, gaussian)


def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_event.DpEvent:
    """``steps`` compositions of :func:`gaussian_step_event` (``SelfComposedDpEvent``)."""
    count = _check_count(steps, "steps", minimum=0)
    step = gaussian_step_event(noise_multiplier, sample_rate)
    if count == 0:
        return dp_event.NoOpDpEvent()
    return dp_event.SelfComposedDpEvent(step, count)


# ---------------------------------------------------------------------------------- accountant
def _rdp_replace_one(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """Rewrite ``event`` for an add/remove RDP accountant so that it accounts for replace-one.

    Exact for un-subsampled Gaussians (sensitivity ``2 G`` == multiplier halved); anything whose
    replace-one RDP is not known exactly is refused (module docstring).
    """
    if isinstance(event, dp_event.NoOpDpEvent | dp_event.NonPrivateDpEvent):
        return event
    if isinstance(event, dp_event.GaussianDpEvent):
        return dp_event.GaussianDpEvent(event.noise_multiplier / 2.0)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(_rdp_replace_one(event.event), event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([_rdp_replace_one(e) for e in event.events])
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        if event.sampling_probability == 0.0:
            return dp_event.NoOpDpEvent()
        if event.sampling_probability == 1.0:
            return _rdp_replace_one(event.event)
        raise ValueError(
            "the RDP accountant has no proven bound for replace_one neighbours with Poisson "
            f"subsampling (sample_rate={event.sampling_probability}); use accountant='pld'"
        )
    raise ValueError(
        f"event {event!r} is not supported by the RDP accountant with replace_one neighbours; "
        "use accountant='pld'"
    )


class Accountant:
    """A privacy accountant: compose ``dp_accounting`` events, then ask for epsilon or delta.

    ``kind="pld"`` (default) wraps ``dp_accounting``'s ``PLDAccountant`` (Doroshenko et al.
    2022; pessimistic discretisation ``value_discretization_interval``, default
    :data:`DEFAULT_PLD_DISCRETIZATION`); ``kind="rdp"`` wraps ``RdpAccountant`` with ``orders``
    (default :data:`DEFAULT_RDP_ORDERS`). ``neighbouring`` is ``"add_remove"`` (default) or
    ``"replace_one"``; the treatment of replace-one is documented in the module docstring.

    >>> acc = Accountant("pld")
    >>> acc.compose(gaussian_step_event(1.0, 0.01), count=1000)  # doctest: +ELLIPSIS
    <clipless.accounting.Accountant object at ...>
    >>> round(acc.epsilon(1e-5), 4)
    1.8282
    """

    def __init__(
        self,
        kind: AccountantKind = "pld",
        neighbouring: Neighbouring = "add_remove",
        *,
        value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
        orders: Sequence[float] | None = None,
    ) -> None:
        self._kind = _check_kind(kind)
        self._neighbouring = _check_neighbouring(neighbouring)
        self._vdi = _check_discretization(value_discretization_interval)
        self._orders = _check_orders(orders)
        self._inner: dp_accounting.PrivacyAccountant
        if self._kind == "pld":
            relation = (
                _NR.REPLACE_ONE if self._neighbouring == "replace_one" else _NR.ADD_OR_REMOVE_ONE
            )
            self._inner = pld_privacy_accountant.PLDAccountant(
                neighboring_relation=relation, value_discretization_interval=self._vdi
            )
        else:
            # Always add/remove: replace-one is rewritten by _rdp_replace_one (issue #378).
            self._inner = rdp_privacy_accountant.RdpAccountant(
                orders=list(self._orders), neighboring_relation=_NR.ADD_OR_REMOVE_ONE
            )
        self._ledger = dp_accounting.DpEventBuilder()

    @property
    def kind(self) -> str:
        """``"pld"`` or ``"rdp"``."""
        return self._kind

    @property
    def neighbouring(self) -> str:
        """``"add_remove"`` or ``"replace_one"``."""
        return self._neighbouring

    @property
    def value_discretization_interval(self) -> float:
        """PLD discretisation interval (unused by RDP)."""
        return self._vdi

    @property
    def orders(self) -> tuple[float, ...]:
        """RDP orders (unused by PLD)."""
        return self._orders

    @property
    def ledger(self) -> dp_event.DpEvent:
        """Everything composed so far, as one ``DpEvent`` (as given, before any rewriting)."""
        return self._ledger.build()

    def _translate(self, event: dp_event.DpEvent) -> dp_event.DpEvent:
        if self._kind == "rdp" and self._neighbouring == "replace_one":
            return _rdp_replace_one(event)
        return event

    def check_supported(self, event: dp_event.DpEvent) -> None:
        """Raise ``ValueError`` (with the reason) unless :meth:`compose` accepts ``event``.

        Cheap: walks the event without composing it.
        """
        if not isinstance(event, dp_event.DpEvent):
            raise TypeError(f"event must be a dp_accounting DpEvent; got {type(event).__name__}")
        if not self._inner.supports(self._translate(event)):
            raise ValueError(
                f"the {self._kind} accountant with {self._neighbouring} neighbours does not "
                f"support {event!r}"
            )

    def supports(self, event: dp_event.DpEvent) -> bool:
        """Whether :meth:`compose` accepts ``event``."""
        try:
            self.check_supported(event)
        except ValueError:
            return False
        return True

    def compose(self, event: dp_event.DpEvent, count: int = 1) -> Accountant:
        """Account for ``count`` applications of ``event``; returns ``self``."""
        if not isinstance(event, dp_event.DpEvent):
            raise TypeError(f"event must be a dp_accounting DpEvent; got {type(event).__name__}")
        n = _check_count(count, "count", minimum=0)
        translated = self._translate(event)
        if n == 0:
            self.check_supported(event)
            return self
        try:
            self._inner.compose(translated, n)
        except dp_accounting.UnsupportedEventError as exc:
            raise ValueError(
                f"the {self._kind} accountant with {self._neighbouring} neighbours does not "
                f"support {event!r}: {exc}"
            ) from exc
        self._ledger.compose(event, n)
        return self

    def epsilon(self, delta: float) -> float:
        """Smallest epsilon such that everything composed so far is ``(epsilon, delta)``-DP."""
        d = _check_delta(delta)
        return float(self._inner.get_epsilon(d))

    def delta(self, epsilon: float) -> float:
        """Smallest delta such that everything composed so far is ``(epsilon, delta)``-DP.

        ``epsilon`` may be 0 here (the delta of a pure-DP-style query); it must be finite.
        """
        e = _check_epsilon(epsilon, allow_zero=True)
        return float(self._inner.get_delta(e))


# ---------------------------------------------------------------------------------- functions
def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: AccountantKind = "pld",
    neighbouring: Neighbouring = "add_remove",
    *,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    orders: Sequence[float] | None = None,
) -> float:
    """Epsilon of ``steps`` Poisson-subsampled Gaussian steps at ``delta``.

    >>> round(epsilon(1.0, 0.01, 1000, 1e-5), 4)
    1.8282
    """
    _check_delta(delta)  # validate everything before the (possibly costly) composition
    event = dpsgd_event(noise_multiplier, sample_rate, steps)
    acc = Accountant(
        accountant,
        neighbouring,
        value_discretization_interval=value_discretization_interval,
        orders=orders,
    )
    return acc.compose(event).epsilon(delta)


def _starting_point(
    eps: float,
    delta: float,
    q: float,
    steps: int,
    kind: str,
    neighbouring: str,
    orders: Sequence[float] | None,
) -> tuple[float, float]:
    """``(log sigma, log step)`` to start the bracket search of :func:`calibrate_noise`.

    RDP: moments-accountant scaling (Abadi et al. 2016, Theorem 1), a coarse guess. PLD: the
    (cheap) RDP calibration at 1 % tolerance, which PLD typically beats by 0-15 %; for replace-one
    with subsampling, 1.3 x the add/remove RDP value. Only a starting point: every end of the
    bracket is verified with the requested accountant.
    """
    replace = neighbouring == "replace_one"
    if kind == "rdp":
        guess = max(q * math.sqrt(steps * math.log(1.0 / delta)), 0.5) / eps
        if q == 1.0:
            guess = math.sqrt(2.0 * steps * math.log(1.25 / delta)) / eps
        return math.log(max(guess * (2.0 if replace else 1.0), 0.3)), math.log(2.0)
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # RDP's "order excluded" warnings are irrelevant here
    try:
        rdp_sigma = calibrate_noise(
            eps,
            delta,
            q,
            steps,
            accountant="rdp",
            neighbouring="replace_one" if replace and q == 1.0 else "add_remove",
            tolerance=1e-2,
            orders=orders,
        )
    except ValueError:
        return math.log(1.0), math.log(2.0)
    finally:
        absl_logger.setLevel(level)
    if replace and q < 1.0:
        return math.log(1.3 * rdp_sigma), math.log(1.25)
    return math.log(rdp_sigma), math.log(1.1)


def calibrate_noise(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: AccountantKind = "pld",
    neighbouring: Neighbouring = "add_remove",
    tolerance: float = 1e-3,
    *,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    orders: Sequence[float] | None = None,
    max_noise_multiplier: float = 1e6,
) -> float:
    """Smallest noise multiplier (to relative ``tolerance``) with ``epsilon <= target_epsilon``.

    Bracketing followed by an Illinois (safeguarded regula falsi) search on ``log sigma``; the
    bracket always keeps an upper end whose epsilon was *computed* to be within the target, and
    that end is returned, so ``epsilon(result, ...) <= target_epsilon`` holds exactly for the
    same accountant settings, and ``result / (1 + tolerance)`` misses the target.

    ``steps`` must be at least 1. Raises ``ValueError`` if even ``max_noise_multiplier`` misses.
    """
    eps_target = _check_epsilon(target_epsilon, "target_epsilon")
    delta = _check_delta(target_delta, "target_delta")
    q = _check_sample_rate(sample_rate)
    n_steps = _check_count(steps, "steps", minimum=1)
    kind = _check_kind(accountant)
    rel = _check_neighbouring(neighbouring)
    tol = _real(tolerance, "tolerance")
    if not (math.isfinite(tol) and 0.0 < tol < 1.0):
        raise ValueError(f"tolerance must be in (0, 1) (relative, on sigma); got {tolerance!r}")
    sigma_cap = _real(max_noise_multiplier, "max_noise_multiplier")
    if not (math.isfinite(sigma_cap) and sigma_cap > 0.0):
        raise ValueError(f"max_noise_multiplier must be finite and > 0; got {sigma_cap!r}")
    if kind == "rdp" and rel == "replace_one" and q < 1.0:
        _rdp_replace_one(gaussian_step_event(1.0, q))  # raises the explanatory ValueError

    def gap(log_sigma: float) -> float:
        # log(epsilon) is close to linear in log(sigma): regula falsi converges in a few steps.
        eps = epsilon(
            math.exp(log_sigma),
            q,
            n_steps,
            delta,
            kind,  # type: ignore[arg-type]
            rel,  # type: ignore[arg-type]
            value_discretization_interval=value_discretization_interval,
            orders=orders,
        )
        return math.log(max(eps, 1e-300)) - math.log(eps_target)

    log_cap = math.log(sigma_cap)
    log_floor = math.log(_SIGMA_FLOOR)
    x0, step = _starting_point(eps_target, delta, q, n_steps, kind, rel, orders)
    x0 = min(max(x0, log_floor), log_cap)
    g0 = gap(x0)
    if g0 <= 0.0:  # walk down (steps doubling in log space) until the target is missed
        hi, g_hi = x0, g0
        while True:
            if hi <= log_floor:
                raise ValueError(
                    f"target_epsilon={eps_target} is met even with noise multiplier "
                    f"{math.exp(hi):.3g}; calibration below {_SIGMA_FLOOR} is not supported"
                )
            lo = max(hi - step, log_floor)
            g_lo = gap(lo)
            if g_lo > 0.0:
                break
            hi, g_hi = lo, g_lo
            step *= 2.0
    else:  # walk up until the target is met
        lo, g_lo = x0, g0
        while True:
            if lo >= log_cap:
                raise ValueError(
                    f"no noise multiplier <= max_noise_multiplier={sigma_cap} reaches "
                    f"epsilon={eps_target} at delta={delta}"
                )
            hi = min(lo + step, log_cap)
            g_hi = gap(hi)
            if g_hi <= 0.0:
                break
            lo, g_lo = hi, g_hi
            step *= 2.0

    # Illinois regula falsi on the bracket, invariant gap(lo) > 0 >= gap(hi). Each estimate of
    # the root is nudged half a tolerance towards the end that moved least recently, so that an
    # accurate estimate closes the bracket from that side; bisection after 20 iterations.
    log_tol = math.log1p(tol)
    side = 0
    iteration = 0
    while hi - lo > log_tol:
        iteration += 1
        if iteration > 20 or not (math.isfinite(g_lo) and g_lo > g_hi):
            x = 0.5 * (lo + hi)
        else:
            x = hi - g_hi * (hi - lo) / (g_hi - g_lo)
            x += -0.5 * log_tol if side >= 0 else 0.5 * log_tol
            x = min(max(x, lo + 0.25 * log_tol), hi - 0.25 * log_tol)
        gx = gap(x)
        if gx <= 0.0:
            hi, g_hi = x, gx
            if side == +1:
                g_lo /= 2.0
            side = +1
        else:
            lo, g_lo = x, gx
            if side == -1:
                g_hi /= 2.0
            side = -1
    return math.exp(hi)


# ---------------------------------------------------------------------------------- guarantee
@dataclasses.dataclass(frozen=True)
class PrivacyGuarantee:
    """A frozen description of a privacy claim, separate from the code that trains.

    ``noise_multiplier`` (effective, ``std / G``) and ``sample_rate`` are ``None`` when the steps
    did not all share one value (``mechanism`` then lists them). ``is_dp_guarantee`` is ``False``
    when an unproven mode (e.g. batch-max gradient scaling, DESIGN.md) was used: the numbers are
    then what the accountant *would* report, and ``str()`` says "NOT a DP guarantee".
    """

    epsilon: float
    delta: float
    accountant: str
    neighbouring: str
    sample_rate: float | None
    noise_multiplier: float | None
    steps: int
    mechanism: str
    is_dp_guarantee: bool = True

    def __post_init__(self) -> None:
        eps = _real(self.epsilon, "epsilon")
        if math.isnan(eps) or eps < 0.0:
            raise ValueError(f"epsilon must be in [0, inf]; got {self.epsilon!r}")
        _check_delta(self.delta)
        _check_kind(self.accountant)
        _check_neighbouring(self.neighbouring)
        if self.sample_rate is not None:
            _check_sample_rate(self.sample_rate)
        if self.noise_multiplier is not None:
            _check_noise_multiplier(self.noise_multiplier)
        _check_count(self.steps, "steps", minimum=0)
        if not isinstance(self.mechanism, str):
            raise TypeError(f"mechanism must be a str; got {type(self.mechanism).__name__}")
        if not isinstance(self.is_dp_guarantee, bool):
            raise TypeError(
                f"is_dp_guarantee must be a bool; got {type(self.is_dp_guarantee).__name__}"
            )

    def __str__(self) -> str:
        relation = "add/remove-one" if self.neighbouring == "add_remove" else "replace-one"
        claim = (
            f"(epsilon={self.epsilon:.4g}, delta={self.delta:.3g})-DP under {relation} "
            f"neighbours, {self.accountant.upper()} accountant, {self.steps} steps of "
            f"{self.mechanism}"
        )
        if self.noise_multiplier is not None and self.sample_rate is not None:
            claim += (
                f" (noise multiplier {self.noise_multiplier:.6g}, "
                f"sample rate {self.sample_rate:.6g})"
            )
        if not self.is_dp_guarantee:
            return (
                "NOT a DP guarantee: an unproven mode was used, so the following is only what "
                f"the accountant would report: {claim}"
            )
        return claim

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------- ledger
@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """``count`` consecutive identical steps, starting at step index ``start_step``.

    ``noise_multiplier`` is the step's effective multiplier (``std / G``); ``proven`` is ``False``
    for steps taken in an unproven mode (batch-max scaling).
    """

    noise_multiplier: float
    sample_rate: float
    count: int
    start_step: int
    label: str | None = None
    proven: bool = True

    @property
    def stop_step(self) -> int:
        """One past the last step index of this entry."""
        return self.start_step + self.count

    def to_dict(self) -> dict[str, Any]:
        sigma: float | str = self.noise_multiplier
        if math.isinf(self.noise_multiplier):
            sigma = "inf"  # strict JSON has no Infinity
        return {
            "noise_multiplier": sigma,
            "sample_rate": self.sample_rate,
            "count": self.count,
            "start_step": self.start_step,
            "label": self.label,
            "proven": self.proven,
        }


_ENTRY_KEYS = frozenset(
    ("noise_multiplier", "sample_rate", "count", "start_step", "label", "proven")
)
_LEDGER_KEYS = frozenset(
    (
        "format",
        "version",
        "accountant",
        "neighbouring",
        "value_discretization_interval",
        "rdp_orders",
        "entries",
        "metadata",
    )
)

_Groups = tuple[tuple[tuple[float, float], int], ...]


class PrivacyLedger:
    """Every step's mechanism parameters, enough to recompute epsilon from the saved file alone.

    ``record(noise_multiplier, sample_rate, count=1)`` appends steps; consecutive identical steps
    (same multiplier, rate, label and proven flag) are merged into one :class:`LedgerEntry`, so a
    run with a fixed noise multiplier is one entry. :meth:`epsilon` composes
    ``SelfComposedDpEvent(gaussian_step_event(sigma, q), n)`` for every distinct ``(sigma, q)``
    (composition commutes, so order does not matter). :meth:`to_json` writes atomically (temporary
    file in the same directory, ``fsync``, ``os.replace``). :meth:`would_exceed` answers the
    training loop's "may I take one more step?" so that it stops *before* the budget is exceeded.

    ``metadata`` is any JSON-serialisable mapping stored with the ledger (dataset size, run id...).
    """

    def __init__(
        self,
        accountant: AccountantKind = "pld",
        neighbouring: Neighbouring = "add_remove",
        *,
        value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
        orders: Sequence[float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self._accountant = _check_kind(accountant)
        self._neighbouring = _check_neighbouring(neighbouring)
        self._vdi = _check_discretization(value_discretization_interval)
        self._orders = _check_orders(orders)
        self._custom_orders = orders is not None
        # Validates events without composing them (rdp + replace_one refuses q < 1 steps).
        self._checker = self._make_accountant()
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a mapping or None; got {type(metadata).__name__}")
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._entries: list[LedgerEntry] = []
        self._eps_cache: dict[tuple[_Groups, float], float] = {}
        self._brackets: dict[tuple[Any, ...], list[int]] = {}

    # ----------------------------------------------------------------------- properties
    @property
    def accountant(self) -> str:
        """``"pld"`` or ``"rdp"``."""
        return self._accountant

    @property
    def neighbouring(self) -> str:
        """``"add_remove"`` or ``"replace_one"``."""
        return self._neighbouring

    @property
    def value_discretization_interval(self) -> float:
        return self._vdi

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    @property
    def steps(self) -> int:
        """Number of steps recorded."""
        return self._entries[-1].stop_step if self._entries else 0

    @property
    def is_dp_guarantee(self) -> bool:
        """``False`` if any recorded step used an unproven mode."""
        return all(e.proven for e in self._entries)

    # --------------------------------------------------------------------------- record
    def record(
        self,
        noise_multiplier: float,
        sample_rate: float,
        count: int = 1,
        *,
        label: str | None = None,
        proven: bool = True,
    ) -> None:
        """Append ``count`` steps with effective ``noise_multiplier`` and ``sample_rate``."""
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        n = _check_count(count, "count", minimum=1)
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a str or None; got {type(label).__name__}")
        if not isinstance(proven, bool):
            raise TypeError(f"proven must be a bool; got {type(proven).__name__}")
        # Refuse what the accountant cannot account for *before* it enters the ledger.
        self._checker.check_supported(gaussian_step_event(sigma, q))
        last = self._entries[-1] if self._entries else None
        if last is not None and (
            last.noise_multiplier,
            last.sample_rate,
            last.label,
            last.proven,
        ) == (
            sigma,
            q,
            label,
            proven,
        ):
            self._entries[-1] = dataclasses.replace(last, count=last.count + n)
        else:
            self._entries.append(LedgerEntry(sigma, q, n, self.steps, label, proven))

    # -------------------------------------------------------------------------- epsilon
    def _make_accountant(self) -> Accountant:
        return Accountant(
            self._accountant,  # type: ignore[arg-type]
            self._neighbouring,  # type: ignore[arg-type]
            value_discretization_interval=self._vdi,
            orders=self._orders,
        )

    def _groups(self) -> dict[tuple[float, float], int]:
        groups: dict[tuple[float, float], int] = {}
        for e in self._entries:
            key = (e.noise_multiplier, e.sample_rate)
            groups[key] = groups.get(key, 0) + e.count
        return groups

    def _epsilon_of(self, groups: Mapping[tuple[float, float], int], delta: float) -> float:
        frozen: _Groups = tuple((k, n) for k, n in groups.items() if n > 0)
        cached = self._eps_cache.get((frozen, delta))
        if cached is not None:
            return cached
        acc = self._make_accountant()
        for (sigma, q), n in frozen:
            acc.compose(dp_event.SelfComposedDpEvent(gaussian_step_event(sigma, q), n))
        eps = acc.epsilon(delta)
        if len(self._eps_cache) > 256:
            self._eps_cache.clear()
        self._eps_cache[(frozen, delta)] = eps
        return eps

    def to_dp_event(self) -> dp_event.DpEvent:
        """The whole ledger as one ``DpEvent`` (grouped by distinct ``(sigma, q)``)."""
        return dp_event.ComposedDpEvent(
            [
                dp_event.SelfComposedDpEvent(gaussian_step_event(sigma, q), n)
                for (sigma, q), n in self._groups().items()
            ]
        )

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``."""
        return self._epsilon_of(self._groups(), _check_delta(delta))

    def delta(self, epsilon: float) -> float:
        """Delta spent so far at ``epsilon``."""
        acc = self._make_accountant()
        for (sigma, q), n in self._groups().items():
            acc.compose(dp_event.SelfComposedDpEvent(gaussian_step_event(sigma, q), n))
        return acc.delta(epsilon)

    def guarantee(self, delta: float, mechanism: str | None = None) -> PrivacyGuarantee:
        """A frozen :class:`PrivacyGuarantee` for everything recorded so far."""
        groups = self._groups()
        sigmas = {k[0] for k in groups}
        rates = {k[1] for k in groups}
        if mechanism is None:
            parts = [f"{n} x (sigma={s:.6g}, q={q:.6g})" for (s, q), n in groups.items()]
            mechanism = f"Poisson-subsampled Gaussian ({_MECHANISM_REFS})"
            if len(groups) > 1:
                mechanism += ": " + ", ".join(parts)
        return PrivacyGuarantee(
            epsilon=self.epsilon(delta),
            delta=delta,
            accountant=self._accountant,
            neighbouring=self._neighbouring,
            sample_rate=next(iter(rates)) if len(rates) == 1 else None,
            noise_multiplier=next(iter(sigmas)) if len(sigmas) == 1 else None,
            steps=self.steps,
            mechanism=mechanism,
            is_dp_guarantee=self.is_dp_guarantee,
        )

    # ---------------------------------------------------------------------- lookahead
    def would_exceed(
        self,
        epsilon_budget: float,
        delta: float,
        noise_multiplier: float,
        sample_rate: float,
        count: int = 1,
    ) -> bool:
        """True if ``count`` more steps ``(noise_multiplier, sample_rate)`` would exceed the budget.

        "Exceed" means the epsilon at ``delta`` after those steps is strictly above
        ``epsilon_budget``. Repeated calls are cheap: for a given budget, delta and step the
        ledger keeps a bracket on the number of such steps that fit (found with ``O(log T)``
        epsilon evaluations the first time the answer is "exceeds", exact to one step) and
        reuses it while only such steps are recorded. Soundness of the reuse: the true epsilon
        never decreases with more steps, and the computed epsilon is an upper bound on it, so
        "computed epsilon(m) <= budget" implies "true epsilon(n) <= budget" for every
        ``n <= m``.
        """
        budget = _check_epsilon(epsilon_budget, "epsilon_budget")
        d = _check_delta(delta)
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        n = _check_count(count, "count", minimum=1)
        self._checker.check_supported(gaussian_step_event(sigma, q))
        groups = self._groups()
        key_step = (sigma, q)
        current = groups.pop(key_step, 0)
        others: _Groups = tuple(groups.items())
        total = current + n
        cache_key = (budget, d, key_step, others)
        bracket = self._brackets.get(cache_key)  # [largest known ok, smallest known bad]

        def excess(m: int) -> float:
            """log(epsilon(m) / budget), forced > 0 exactly when epsilon(m) > budget."""
            trial = dict(others)
            trial[key_step] = m
            eps = self._epsilon_of(trial, d)
            if eps > budget:
                return max(math.log(eps / budget), 1e-300)
            return min(math.log(max(eps, 1e-300) / budget), 0.0)

        if bracket is None:
            if len(self._brackets) > 64:
                self._brackets.clear()
            bracket = self._brackets[cache_key] = [-1, _NEVER]
        return not self._refine(bracket, excess, total)

    @staticmethod
    def _refine(bracket: list[int], excess: Callable[[int], float], total: int) -> bool:
        """Whether ``total`` steps fit, updating ``bracket = [largest known fitting count,
        smallest known exceeding count]`` (``-1`` and ``_NEVER`` when unknown).

        A fitting ``total`` is followed by up to three doublings (so a loop that asks before
        every step re-evaluates only ``O(log T)`` times). Once an exceeding count is known the
        bracket is closed to adjacent integers by an Illinois (safeguarded regula falsi) search
        on ``log epsilon`` against ``log count``, which is close to linear, with bisection as the
        fallback; after that every answer is a comparison.
        """
        lo, hi = bracket
        if total <= lo:
            return True
        if total >= hi:
            return False
        e_lo = -math.inf
        e_total = excess(total)
        if e_total <= 0.0:
            lo, e_lo = total, e_total
            for _ in range(3):
                probe = 2 * lo
                if probe >= hi:
                    break
                e_probe = excess(probe)
                if e_probe > 0.0:
                    hi, e_hi = probe, e_probe
                    break
                lo, e_lo = probe, e_probe
        else:
            hi, e_hi = total, e_total
        if hi < _NEVER:
            if e_lo == -math.inf and hi > 1:  # only the exceeding end was evaluated here
                if lo < 1:
                    probe = max(1, hi // 2)
                    e_probe = excess(probe)
                    if e_probe > 0.0:
                        hi, e_hi = probe, e_probe
                    else:
                        lo, e_lo = probe, e_probe
                else:
                    e_lo = excess(lo)
            side = 0
            iteration = 0
            while hi - lo > 1:
                iteration += 1
                usable = lo >= 1 and math.isfinite(e_lo) and math.isfinite(e_hi) and e_hi > e_lo
                if iteration > 12 or not usable:
                    mid = (lo + hi) // 2
                else:
                    t = -e_lo / (e_hi - e_lo)
                    x = math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))
                    # Round towards the end that did not move last, to close the bracket there.
                    mid = math.floor(x) if side >= 0 else math.ceil(x)
                    mid = min(max(mid, lo + 1), hi - 1)
                e_mid = excess(mid)
                if e_mid > 0.0:
                    hi, e_hi = mid, e_mid
                    if side == +1:
                        e_lo /= 2.0
                    side = +1
                else:
                    lo, e_lo = mid, e_mid
                    if side == -1:
                        e_hi /= 2.0
                    side = -1
        bracket[0], bracket[1] = lo, hi
        return total <= lo

    # --------------------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (format tag, version, accountant settings, entries, metadata)."""
        return {
            "format": LEDGER_FORMAT,
            "version": LEDGER_VERSION,
            "accountant": self._accountant,
            "neighbouring": self._neighbouring,
            "value_discretization_interval": self._vdi,
            "rdp_orders": list(self._orders) if self._custom_orders else None,
            "entries": [e.to_dict() for e in self._entries],
            "metadata": copy.deepcopy(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger from :meth:`to_dict` output; ``ValueError`` on a malformed one."""
        if not isinstance(data, Mapping):
            raise ValueError(f"privacy ledger must be a JSON object; got {type(data).__name__}")
        if data.get("format") != LEDGER_FORMAT:
            raise ValueError(
                f"not a privacy ledger: 'format' is {data.get('format')!r}, expected "
                f"{LEDGER_FORMAT!r}"
            )
        version = data.get("version")
        if version != LEDGER_VERSION or isinstance(version, bool):
            raise ValueError(
                f"unsupported privacy ledger version {version!r} (this clipless reads version "
                f"{LEDGER_VERSION})"
            )
        unknown = set(data) - _LEDGER_KEYS
        missing = {"accountant", "neighbouring", "entries"} - set(data)
        if unknown or missing:
            raise ValueError(
                f"malformed privacy ledger: unknown keys {sorted(unknown)}, missing keys "
                f"{sorted(missing)}"
            )
        try:
            ledger = cls(
                data["accountant"],
                data["neighbouring"],
                value_discretization_interval=data.get(
                    "value_discretization_interval", DEFAULT_PLD_DISCRETIZATION
                ),
                orders=data.get("rdp_orders"),
                metadata=data.get("metadata") or {},
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed privacy ledger: {exc}") from exc
        entries = data["entries"]
        if not isinstance(entries, list):
            raise ValueError("malformed privacy ledger: 'entries' must be a list")
        for i, raw in enumerate(entries):
            if not isinstance(raw, Mapping) or set(raw) != _ENTRY_KEYS:
                keys = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
                raise ValueError(
                    f"malformed privacy ledger: entries[{i}] must have exactly the keys "
                    f"{sorted(_ENTRY_KEYS)}; got {keys}"
                )
            sigma_raw = raw["noise_multiplier"]
            if sigma_raw == "inf":
                sigma_raw = math.inf
            if raw["start_step"] != ledger.steps or isinstance(raw["start_step"], bool):
                raise ValueError(
                    f"malformed privacy ledger: entries[{i}].start_step is {raw['start_step']!r}, "
                    f"expected {ledger.steps} (entries must be contiguous)"
                )
            try:
                entry = LedgerEntry(
                    noise_multiplier=_check_noise_multiplier(
                        sigma_raw, f"entries[{i}].noise_multiplier"
                    ),
                    sample_rate=_check_sample_rate(raw["sample_rate"], f"entries[{i}].sample_rate"),
                    count=_check_count(raw["count"], f"entries[{i}].count", minimum=1),
                    start_step=ledger.steps,
                    label=raw["label"],
                    proven=raw["proven"],
                )
                if entry.label is not None and not isinstance(entry.label, str):
                    raise TypeError(f"entries[{i}].label must be a string or null")
                if not isinstance(entry.proven, bool):
                    raise TypeError(f"entries[{i}].proven must be true or false")
                ledger._checker.check_supported(
                    gaussian_step_event(entry.noise_multiplier, entry.sample_rate)
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"malformed privacy ledger: {exc}") from exc
            ledger._entries.append(entry)  # kept as written: no re-merging
        return ledger

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the ledger to ``path`` atomically (temp file in the same directory, fsync,
        ``os.replace``): a crash leaves either the old file or the new one, never a torn one."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        atomic_write(path, text)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> PrivacyLedger:
        """Read a ledger written by :meth:`to_json`; ``ValueError`` naming the file if malformed."""
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)}: not a valid JSON privacy ledger: {exc}") from exc
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{os.fspath(path)}: {exc}") from exc

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(accountant={self._accountant!r}, neighbouring={self._neighbouring!r}, "
            f"steps={self.steps}, entries={len(self._entries)})"
        )
