"""The privacy ledger: every step's ``dp_accounting`` event, saved as JSON, epsilon recomputable.

An entry holds the event of a run of identical steps. A Poisson-subsampled Gaussian step (every
step of the built-in noise allocations) is written as its ``noise_multiplier`` and
``sample_rate``, the format ledgers have always had (version 1); any other event as
``{"event": ...}`` (:func:`~clipless.accounting.events.event_to_dict`), which makes the file
version 2. Both versions are read.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dp_accounting import dp_event

from clipless._io import atomic_write
from clipless.accounting._checks import (
    DEFAULT_PLD_DISCRETIZATION,
    AccountantKind,
    Neighbouring,
    _check_count,
    _check_delta,
    _check_epsilon,
    _check_noise_multiplier,
    _check_release,
    _check_sample_rate,
)
from clipless.accounting.accountant import Accountant, _Settings
from clipless.accounting.events import event_from_dict, event_to_dict, gaussian_step_event
from clipless.accounting.guarantee import PrivacyGuarantee

__all__ = [
    "LEDGER_EVENT_VERSION",
    "LEDGER_FORMAT",
    "LEDGER_VERSION",
    "LedgerEntry",
    "LedgerRelease",
    "PrivacyLedger",
]

LEDGER_FORMAT = "clipless.PrivacyLedger"
#: The version written when every entry is a Poisson-subsampled Gaussian step.
LEDGER_VERSION = 1
#: The version written when an entry is another event (this clipless reads both).
LEDGER_EVENT_VERSION = 2

_NEVER = 1 << 62
_MECHANISM_REFS = "Abadi et al. 2016; Mironov et al. 2019"


def _gaussian_parameters(event: dp_event.DpEvent) -> tuple[float, float] | None:
    """``(sigma, q)`` when ``event`` is a Poisson-subsampled (or plain) Gaussian, else ``None``."""
    if isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(
        event.event, dp_event.GaussianDpEvent
    ):
        found = (event.event.noise_multiplier, event.sampling_probability)
    elif isinstance(event, dp_event.GaussianDpEvent):
        found = (event.noise_multiplier, 1.0)
    else:
        return None
    try:
        sigma = _check_noise_multiplier(found[0])
        q = _check_sample_rate(found[1])
    except (TypeError, ValueError):
        return None
    return (sigma, q) if gaussian_step_event(sigma, q) == event else None


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """``count`` consecutive identical steps of ``event``, starting at step index ``start_step``.

    ``event`` is the step's ``dp_accounting`` event (the plan's
    :meth:`~clipless.mechanism.NoisePlan.dp_event`); ``proven`` is ``False`` for steps taken in
    an unproven mode (batch-max scaling). ``parameters`` is ``(noise_multiplier, sample_rate)``
    when ``event`` is :func:`gaussian_step_event`'s (``None`` otherwise): such steps are saved
    in the version-1 format.
    """

    event: dp_event.DpEvent
    count: int
    start_step: int
    label: str | None = None
    proven: bool = True
    parameters: tuple[float, float] | None = None

    @classmethod
    def gaussian(
        cls,
        noise_multiplier: float,
        sample_rate: float,
        count: int,
        start_step: int,
        label: str | None = None,
        proven: bool = True,
    ) -> LedgerEntry:
        """Steps of :func:`gaussian_step_event` ``(noise_multiplier, sample_rate)``.

        Args:
            noise_multiplier: every step's ``std / G``.
            sample_rate: the Poisson sampling probability ``q``.
            count: how many consecutive steps.
            start_step: the index of the first.
            label, proven: as in :meth:`PrivacyLedger.record`.
        """
        sigma, q = float(noise_multiplier), float(sample_rate)
        event = gaussian_step_event(sigma, q)
        return cls(event, count, start_step, label, proven, (sigma, q))

    @property
    def noise_multiplier(self) -> float:
        """The Gaussian step's multiplier (``std / G``); NaN for another event."""
        return math.nan if self.parameters is None else self.parameters[0]

    @property
    def sample_rate(self) -> float:
        """The Gaussian step's Poisson rate; NaN for another event."""
        return math.nan if self.parameters is None else self.parameters[1]

    @property
    def stop_step(self) -> int:
        """One past the last step index of this entry."""
        return self.start_step + self.count

    def to_dict(self) -> dict[str, Any]:
        """The entry as JSON-ready values: a Gaussian step as its ``noise_multiplier`` (an
        infinite one as the string ``"inf"``) and ``sample_rate``, any other as its event."""
        head: dict[str, Any]
        if self.parameters is None:
            head = {"event": event_to_dict(self.event)}
        else:
            sigma: float | str = self.parameters[0]
            if math.isinf(self.parameters[0]):
                sigma = "inf"  # strict JSON has no Infinity
            head = {"noise_multiplier": sigma, "sample_rate": self.parameters[1]}
        return {
            **head,
            "count": self.count,
            "start_step": self.start_step,
            "label": self.label,
            "proven": self.proven,
        }


@dataclasses.dataclass(frozen=True)
class LedgerRelease:
    """One one-shot Gaussian release of a statistic of the whole dataset (``q = 1``).

    ``noise_multiplier`` is ``std / G`` with ``G`` the bound on one example's contribution (the
    convention of every entry), e.g. the private mean of unit-normalised inputs
    (:func:`clipless.features.release_mean`). Releases are composed with the steps but are not
    steps: they do not count in :attr:`PrivacyLedger.steps`.
    """

    noise_multiplier: float
    label: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The release as JSON-ready values (an infinite multiplier is the string ``"inf"``)."""
        sigma: float | str = self.noise_multiplier
        if math.isinf(self.noise_multiplier):
            sigma = "inf"  # strict JSON has no Infinity
        return {"noise_multiplier": sigma, "label": self.label}


_RELEASE_KEYS = frozenset(("noise_multiplier", "label"))

_ENTRY_KEYS = frozenset(
    ("noise_multiplier", "sample_rate", "count", "start_step", "label", "proven")
)
_EVENT_ENTRY_KEYS = frozenset(("event", "count", "start_step", "label", "proven"))
_LEDGER_KEYS = frozenset(
    (
        "format",
        "version",
        "accountant",
        "neighbouring",
        "value_discretization_interval",
        "rdp_orders",
        "entries",
        "releases",
        "metadata",
    )
)

#: Distinct step events (by :func:`_key`) and how many steps of each, in first-recorded order.
_Groups = tuple[tuple[str, int], ...]


def _key(event: dp_event.DpEvent) -> str:
    """A canonical, hashable spelling of ``event`` (events holding lists are unhashable)."""
    return json.dumps(event_to_dict(event), sort_keys=True)


def _describe(event: dp_event.DpEvent, count: int) -> str:
    found = _gaussian_parameters(event)
    if found is None:
        return f"{count} x {event!r}"
    return f"{count} x (sigma={found[0]:.6g}, q={found[1]:.6g})"


def _step_event(
    noise_multiplier: float | None, sample_rate: float | None, event: dp_event.DpEvent | None
) -> dp_event.DpEvent:
    """``event``, or :func:`gaussian_step_event` of the other two (exactly one of the forms)."""
    if event is not None:
        if noise_multiplier is not None or sample_rate is not None:
            raise TypeError("give event= or (noise_multiplier, sample_rate), not both")
        if not isinstance(event, dp_event.DpEvent):
            raise TypeError(f"event must be a dp_accounting DpEvent; got {type(event).__name__}")
        return event
    if noise_multiplier is None or sample_rate is None:
        raise TypeError("give event= or both noise_multiplier and sample_rate")
    sigma = _check_noise_multiplier(noise_multiplier)
    return gaussian_step_event(sigma, _check_sample_rate(sample_rate))


class PrivacyLedger(_Settings):
    """Every step's ``dp_accounting`` event, enough to recompute epsilon from the saved file alone.

    ``record_event(event, count=1)`` appends steps of any event (the optimizer records its plan's
    :meth:`~clipless.mechanism.NoisePlan.dp_event`); ``record(noise_multiplier, sample_rate)``
    those of :func:`gaussian_step_event`. Consecutive identical steps (same event, label and
    proven flag) are merged into one :class:`LedgerEntry`, so a run with a fixed noise multiplier
    is one entry. :meth:`epsilon` composes ``SelfComposedDpEvent(event, n)`` for every distinct
    event (composition commutes, so order does not matter). :meth:`to_json` writes atomically
    (temporary file in the same directory, ``fsync``, ``os.replace``). :meth:`would_exceed`
    answers the training loop's "may I take one more step?" so that it stops *before* the budget
    is exceeded.

    :meth:`record_release` adds a one-shot Gaussian release of the whole dataset (a
    :class:`LedgerRelease`, e.g. a private input mean), composed with the steps in every epsilon,
    delta and look-ahead; it is saved under ``"releases"`` (written only when there is one).

    Args:
        accountant: ``"pld"`` (default) or ``"rdp"`` (:class:`~clipless.accounting.Accountant`).
        neighbouring: ``"add_remove"`` (default) or ``"replace_one"``.
        value_discretization_interval, orders: the accountant's settings.
        metadata: any JSON-serialisable mapping stored with the ledger (dataset size, run
            id...); ``None``: empty.

    Raises:
        ValueError, TypeError: a setting out of range or not among the choices.
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
        super().__init__(accountant, neighbouring, value_discretization_interval, orders)
        self._custom_orders = orders is not None
        # Validates events without composing them (rdp + replace_one refuses q < 1 steps).
        self._checker = self._make_accountant()
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a mapping or None; got {type(metadata).__name__}")
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._entries: list[LedgerEntry] = []
        self._releases: list[LedgerRelease] = []
        self._eps_cache: dict[tuple[_Groups, tuple[float, ...], float], float] = {}
        self._events: dict[str, dp_event.DpEvent] = {}  # by _key
        self._brackets: dict[tuple[Any, ...], list[int]] = {}

    # ----------------------------------------------------------------------- properties
    @property
    def accountant(self) -> str:
        """``"pld"`` or ``"rdp"``."""
        return self._kind

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        """Every recorded event, oldest first (runs of identical steps are one entry)."""
        return tuple(self._entries)

    @property
    def steps(self) -> int:
        """Number of steps recorded."""
        return self._entries[-1].stop_step if self._entries else 0

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus's ``accountant.history``: ``(noise_multiplier, sample_rate, steps)`` for each
        run of identical steps, oldest first (:attr:`entries` has the events, labels and step
        indices; a step that is not a Poisson-subsampled Gaussian has NaN parameters)."""
        return [(e.noise_multiplier, e.sample_rate, e.count) for e in self._entries]

    def __len__(self) -> int:
        """Opacus's ``len(accountant)``: the number of :attr:`history` entries (not of steps:
        :attr:`steps` counts those)."""
        return len(self._entries)

    def __bool__(self) -> bool:
        return True  # a ledger is a ledger even before its first step (not a container)

    @property
    def is_dp_guarantee(self) -> bool:
        """``False`` if any recorded step used an unproven mode."""
        return all(e.proven for e in self._entries)

    # --------------------------------------------------------------------------- record
    @property
    def releases(self) -> tuple[LedgerRelease, ...]:
        """The one-shot releases recorded so far (not counted in :attr:`steps`)."""
        return tuple(self._releases)

    def record_release(self, noise_multiplier: float, *, label: str | None = None) -> None:
        """Record one Gaussian release of a statistic of the whole dataset (``q = 1``).

        Args:
            noise_multiplier: the release's ``std / G``, in ``(0, inf]``.
            label: what was released, stored with it (``None``: unlabelled).

        Raises:
            ValueError, TypeError: a multiplier of 0, negative or not a number; a label that is
                not a str.
        """
        sigma = _check_release(noise_multiplier, "noise_multiplier")
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a str or None; got {type(label).__name__}")
        self._checker.check_supported(gaussian_step_event(sigma, 1.0))
        self._releases.append(LedgerRelease(sigma, label))

    def record(
        self,
        noise_multiplier: float,
        sample_rate: float,
        count: int = 1,
        *,
        label: str | None = None,
        proven: bool = True,
    ) -> None:
        """Append ``count`` Poisson-subsampled Gaussian steps (:func:`gaussian_step_event`).

        Args:
            noise_multiplier: every step's ``std / G``, in ``[0, inf]``.
            sample_rate: the Poisson sampling probability ``q``, in ``(0, 1]``.
            count: how many steps, an int ``>= 1``.
            label: stored with the entry (steps with another label start a new entry).
            proven: ``False`` for steps of a mode without a DP proof (:attr:`is_dp_guarantee`
                is then ``False``).
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        self._append(gaussian_step_event(sigma, q), count, label, proven, (sigma, q))

    def record_event(
        self,
        event: dp_event.DpEvent,
        count: int = 1,
        *,
        label: str | None = None,
        proven: bool = True,
    ) -> None:
        """Append ``count`` steps of ``event`` (one step's ``dp_accounting`` event).

        Args:
            event: one step's event (e.g. :meth:`clipless.mechanism.NoisePlan.dp_event`).
            count, label, proven: as in :meth:`record`.

        Raises:
            TypeError: ``event`` not a ``DpEvent``.
            ValueError: an event the ledger file cannot hold or the accountant cannot compose.
        """
        if not isinstance(event, dp_event.DpEvent):
            raise TypeError(f"event must be a dp_accounting DpEvent; got {type(event).__name__}")
        event_to_dict(event)  # refuses what the file could not hold, before it is recorded
        self._append(event, count, label, proven, _gaussian_parameters(event))

    def _append(
        self,
        event: dp_event.DpEvent,
        count: int,
        label: str | None,
        proven: bool,
        parameters: tuple[float, float] | None,
    ) -> None:
        n = _check_count(count, "count", minimum=1)
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a str or None; got {type(label).__name__}")
        if not isinstance(proven, bool):
            raise TypeError(f"proven must be a bool; got {type(proven).__name__}")
        # Refuse what the accountant cannot account for *before* it enters the ledger.
        self._checker.check_supported(event)
        last = self._entries[-1] if self._entries else None
        entry = LedgerEntry(event, n, self.steps, label, proven, parameters)
        if last is not None and dataclasses.replace(last, count=n, start_step=self.steps) == entry:
            self._entries[-1] = dataclasses.replace(last, count=last.count + n)
        else:
            self._entries.append(entry)

    # -------------------------------------------------------------------------- epsilon
    def _make_accountant(self) -> Accountant:
        return Accountant(
            self._kind,  # type: ignore[arg-type]
            self._neighbouring,  # type: ignore[arg-type]
            value_discretization_interval=self._vdi,
            orders=self._orders,
        )

    def _groups(self) -> dict[str, int]:
        """Steps per distinct event (by :func:`_key`), in first-recorded order."""
        groups: dict[str, int] = {}
        for e in self._entries:
            key = _key(e.event)
            self._events.setdefault(key, e.event)
            groups[key] = groups.get(key, 0) + e.count
        return groups

    def _compose(self, acc: Accountant, groups: Mapping[str, int]) -> None:
        for key, n in groups.items():
            if n > 0:
                acc.compose(dp_event.SelfComposedDpEvent(self._events[key], n))
        for r in self._releases:
            acc.compose(gaussian_step_event(r.noise_multiplier, 1.0))

    def _epsilon_of(self, groups: Mapping[str, int], delta: float) -> float:
        frozen: _Groups = tuple((k, n) for k, n in groups.items() if n > 0)
        releases = tuple(r.noise_multiplier for r in self._releases)
        cached = self._eps_cache.get((frozen, releases, delta))
        if cached is not None:
            return cached
        acc = self._make_accountant()
        try:
            self._compose(acc, dict(frozen))
            eps = acc.epsilon(delta)
        except (OverflowError, FloatingPointError):
            # dp_accounting's arithmetic overflows only for extreme multipliers (e.g. sigma
            # 1e-308 or 1e308, never produced by calibration); infinity is always a sound
            # upper bound on epsilon, so report it rather than crash.
            eps = math.inf
        if len(self._eps_cache) > 256:
            self._eps_cache.clear()
        self._eps_cache[(frozen, releases, delta)] = eps
        return eps

    def to_dp_event(self) -> dp_event.DpEvent:
        """The whole ledger as one ``DpEvent`` (grouped by distinct step event, then the
        releases)."""
        return dp_event.ComposedDpEvent(
            [dp_event.SelfComposedDpEvent(self._events[k], n) for k, n in self._groups().items()]
            + [gaussian_step_event(r.noise_multiplier, 1.0) for r in self._releases]
        )

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``.

        Args:
            delta: in ``(0, 1)``.
        """
        return self._epsilon_of(self._groups(), _check_delta(delta))

    def get_epsilon(self, delta: float) -> float:
        """Opacus's name for :meth:`epsilon` (``engine.accountant.get_epsilon(delta)``).

        Args:
            delta: in ``(0, 1)``.
        """
        return self.epsilon(delta)

    def delta(self, epsilon: float) -> float:
        """Delta spent so far at ``epsilon`` (1, a sound bound, where dp_accounting overflows).

        Args:
            epsilon: finite and ``>= 0``.
        """
        acc = self._make_accountant()
        try:
            self._compose(acc, self._groups())
            return float(acc.delta(epsilon))
        except (OverflowError, FloatingPointError):  # extreme multipliers, as in _epsilon_of
            return 1.0

    def guarantee(self, delta: float, mechanism: str | None = None) -> PrivacyGuarantee:
        """A frozen :class:`PrivacyGuarantee` for everything recorded so far.

        Args:
            delta: the guarantee's delta, in ``(0, 1)``.
            mechanism: the mechanism in words (``None``: described from the recorded events).
        """
        groups = self._groups()
        params = {_gaussian_parameters(self._events[k]) for k in groups}
        sigmas = {p[0] for p in params if p is not None}
        rates = {p[1] for p in params if p is not None}
        gaussian = None not in params
        if mechanism is None:
            parts = [_describe(self._events[k], n) for k, n in groups.items()]
            mechanism = f"Poisson-subsampled Gaussian ({_MECHANISM_REFS})"
            if not gaussian:
                mechanism = "dp_accounting events: " + ", ".join(parts)
            elif len(groups) > 1:
                mechanism += ": " + ", ".join(parts)
            if self._releases:
                mechanism += ", and " + ", ".join(
                    f"a Gaussian release{'' if r.label is None else ' (' + r.label + ')'} "
                    f"(sigma={r.noise_multiplier:.6g})"
                    for r in self._releases
                )
        return PrivacyGuarantee(
            epsilon=self.epsilon(delta),
            delta=delta,
            accountant=self._kind,
            neighbouring=self._neighbouring,
            sample_rate=next(iter(rates)) if gaussian and len(rates) == 1 else None,
            noise_multiplier=next(iter(sigmas)) if gaussian and len(sigmas) == 1 else None,
            steps=self.steps,
            mechanism=mechanism,
            is_dp_guarantee=self.is_dp_guarantee,
        )

    # ---------------------------------------------------------------------- lookahead
    def would_exceed(
        self,
        epsilon_budget: float,
        delta: float,
        noise_multiplier: float | None = None,
        sample_rate: float | None = None,
        count: int = 1,
        *,
        event: dp_event.DpEvent | None = None,
    ) -> bool:
        """True if ``count`` more steps of ``event`` (or of :func:`gaussian_step_event`
        ``(noise_multiplier, sample_rate)``) would exceed the budget.

        "Exceed" means the epsilon at ``delta`` after those steps is strictly above
        ``epsilon_budget``. Repeated calls are cheap: for a given budget, delta and step the
        ledger keeps a bracket on the number of such steps that fit (found with ``O(log T)``
        epsilon evaluations the first time the answer is "exceeds", exact to one step) and
        reuses it while only such steps are recorded. Soundness of the reuse: the true epsilon
        never decreases with more steps, and the computed epsilon is an upper bound on it, so
        "computed epsilon(m) <= budget" implies "true epsilon(n) <= budget" for every
        ``n <= m``.

        Args:
            epsilon_budget: the epsilon not to exceed, ``> 0``.
            delta: in ``(0, 1)``.
            noise_multiplier, sample_rate: the Gaussian step, when ``event`` is not given.
            count: how many more steps, an int ``>= 1``.
            event: the step's ``dp_accounting`` event (instead of the Gaussian's two numbers).

        Raises:
            TypeError: neither ``event`` nor both Gaussian numbers.
            ValueError: an argument out of range or an event the accountant cannot compose.
        """
        budget = _check_epsilon(epsilon_budget, "epsilon_budget")
        d = _check_delta(delta)
        step = _step_event(noise_multiplier, sample_rate, event)
        n = _check_count(count, "count", minimum=1)
        self._checker.check_supported(step)
        groups = self._groups()
        key_step = _key(step)
        self._events.setdefault(key_step, step)
        current = groups.pop(key_step, 0)
        others: _Groups = tuple(groups.items())
        total = current + n
        cache_key = (budget, d, key_step, others, tuple(self._releases))
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
            "version": (
                LEDGER_VERSION
                if all(e.parameters is not None for e in self._entries)
                else LEDGER_EVENT_VERSION
            ),
            "accountant": self._kind,
            "neighbouring": self._neighbouring,
            "value_discretization_interval": self._vdi,
            "rdp_orders": list(self._orders) if self._custom_orders else None,
            "entries": [e.to_dict() for e in self._entries],
            **({"releases": [r.to_dict() for r in self._releases]} if self._releases else {}),
            "metadata": copy.deepcopy(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger from :meth:`to_dict` output.

        Args:
            data: a dictionary written by :meth:`to_dict` (a ledger file's JSON object).

        Raises:
            ValueError: a malformed ledger, another format, or an unsupported version.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"privacy ledger must be a JSON object; got {type(data).__name__}")
        if data.get("format") != LEDGER_FORMAT:
            raise ValueError(
                f"not a privacy ledger: 'format' is {data.get('format')!r}, expected "
                f"{LEDGER_FORMAT!r}"
            )
        version = data.get("version")
        if version not in (LEDGER_VERSION, LEDGER_EVENT_VERSION) or isinstance(version, bool):
            raise ValueError(
                f"unsupported privacy ledger version {version!r} (this clipless reads versions "
                f"{LEDGER_VERSION} and {LEDGER_EVENT_VERSION})"
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
            ledger._entries.append(ledger._entry_from_dict(i, raw, events=version != 1))
        releases = data.get("releases", [])
        if not isinstance(releases, list):
            raise ValueError("malformed privacy ledger: 'releases' must be a list")
        for i, raw in enumerate(releases):
            if not isinstance(raw, Mapping) or set(raw) != _RELEASE_KEYS:
                keys = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
                raise ValueError(
                    f"malformed privacy ledger: releases[{i}] must have exactly the keys "
                    f"{sorted(_RELEASE_KEYS)}; got {keys}"
                )
            sigma_raw = raw["noise_multiplier"]
            try:
                ledger.record_release(
                    math.inf if sigma_raw == "inf" else sigma_raw, label=raw["label"]
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"malformed privacy ledger: releases[{i}]: {exc}") from exc
        return ledger

    def _entry_from_dict(self, i: int, raw: object, *, events: bool) -> LedgerEntry:
        """``entries[i]`` of a saved ledger, as written (no re-merging); ``events``: a version
        that may hold ``{"event": ...}`` entries."""
        keys = _ENTRY_KEYS
        if events and isinstance(raw, Mapping) and "event" in raw:
            keys = _EVENT_ENTRY_KEYS
        if not isinstance(raw, Mapping) or set(raw) != keys:
            got = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
            raise ValueError(
                f"malformed privacy ledger: entries[{i}] must have exactly the keys "
                f"{sorted(keys)}; got {got}"
            )
        if raw["start_step"] != self.steps or isinstance(raw["start_step"], bool):
            raise ValueError(
                f"malformed privacy ledger: entries[{i}].start_step is {raw['start_step']!r}, "
                f"expected {self.steps} (entries must be contiguous)"
            )
        try:
            count = _check_count(raw["count"], f"entries[{i}].count", minimum=1)
            if keys is _EVENT_ENTRY_KEYS:
                event = event_from_dict(raw["event"])
                parameters = _gaussian_parameters(event)
            else:
                sigma_raw = raw["noise_multiplier"]
                sigma = _check_noise_multiplier(
                    math.inf if sigma_raw == "inf" else sigma_raw, f"entries[{i}].noise_multiplier"
                )
                q = _check_sample_rate(raw["sample_rate"], f"entries[{i}].sample_rate")
                event, parameters = gaussian_step_event(sigma, q), (sigma, q)
            if raw["label"] is not None and not isinstance(raw["label"], str):
                raise TypeError(f"entries[{i}].label must be a string or null")
            if not isinstance(raw["proven"], bool):
                raise TypeError(f"entries[{i}].proven must be true or false")
            self._checker.check_supported(event)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed privacy ledger: {exc}") from exc
        return LedgerEntry(event, count, self.steps, raw["label"], raw["proven"], parameters)

    def to_json(self, path: str | os.PathLike[str], *, mode: int | None = None) -> None:
        """Write the ledger to ``path`` atomically (temp file in the same directory, fsync,
        ``os.replace``): a crash leaves either the old file or the new one, never a torn one.

        Args:
            path: the JSON file.
            mode: the file's permissions (``None``: those of the file it replaces, else what
                ``open`` gives under the umask; ``clipless train`` and ``fit`` pass ``0o600``,
                and the optimizer's per-step writes then keep it).
        """
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        if mode is None:
            with contextlib.suppress(OSError):
                mode = stat.S_IMODE(os.stat(path).st_mode)
        atomic_write(path, text, mode=mode)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> PrivacyLedger:
        """Read a ledger written by :meth:`to_json`.

        Args:
            path: the JSON file.

        Raises:
            ValueError: a malformed file (named).
            OSError: a file that cannot be opened.
        """
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

    @classmethod
    def from_json_if_exists(cls, path: str | os.PathLike[str]) -> PrivacyLedger | None:
        """:meth:`from_json`, or ``None`` when there is no file at ``path``.

        Args:
            path: the ledger file.

        Raises:
            ValueError: an unreadable or malformed file (naming ``ledger_path``): it may record
                privacy already spent.
        """
        if not os.path.isfile(path):
            return None
        try:
            return cls.from_json(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"ledger_path {os.fspath(path)!r} cannot be read ({exc}); it may record privacy "
                "already spent: move it aside, or pass another ledger_path"
            ) from None

    def records_more_than(self, other: PrivacyLedger) -> bool:
        """Does this ledger record steps or releases that ``other`` does not?"""
        return self.steps > other.steps or len(self._releases) > len(other._releases)

    def extends(self, other: PrivacyLedger) -> bool:
        """Does this ledger continue ``other``: the same accountant and relation, ``other``'s
        releases first, and ``other``'s steps as its first steps (identical entries, the last one
        possibly continued)?

        A ledger file written by the run a checkpoint came from always extends the checkpoint's
        ledger (steps are only appended). A file that does not is another run's record, e.g.
        the ledger of a new run started where a moved run's folder used to be. When both carry a
        ``metadata["run_id"]`` (``make_private`` sets one), they must be equal, which also tells
        apart two runs of one configuration.

        Args:
            other: the earlier ledger (a checkpoint's).
        """
        if (self.accountant, self.neighbouring) != (other.accountant, other.neighbouring):
            return False
        mine_id, their_id = self.metadata.get("run_id"), other.metadata.get("run_id")
        if mine_id is not None and their_id is not None and mine_id != their_id:
            return False  # another run (ledgers written before run ids fall back to the entries)
        if self._releases[: len(other._releases)] != other._releases:
            return False
        mine, theirs = self._entries, other._entries
        if len(mine) < len(theirs):
            return False
        if not theirs:
            return True
        if mine[: len(theirs) - 1] != theirs[:-1]:
            return False
        last, here = theirs[-1], mine[len(theirs) - 1]
        return dataclasses.replace(here, count=last.count) == last and here.count >= last.count

    def check_overwrite(self, path: str | os.PathLike[str]) -> None:
        """Refuse to write this ledger over a file at ``path`` that records more spending.

        The ledger file is the record of the privacy spent on the data. Overwriting it with a
        smaller ledger (a fresh run given an old run's ``ledger_path``, or a hand-written resume
        from a checkpoint older than the file) would forget spent steps; ``FileExistsError``.
        ``engine.load_state_dict`` adopts such a file when it restores a checkpoint (the larger
        ledger is kept), and :func:`clipless.training.fit` does the same; otherwise move the file
        aside. A check, not a lock: two runs must not share one path.

        Args:
            path: the ledger file about to be written.

        Raises:
            FileExistsError: the file records more steps or releases than this ledger.
            ValueError: an unreadable file there (it may record privacy already spent).
        """
        on_disk = PrivacyLedger.from_json_if_exists(path)
        if on_disk is None or not on_disk.records_more_than(self):
            return
        raise FileExistsError(
            f"ledger_path {os.fspath(path)!r} records {on_disk.steps} private steps and "
            f"{len(on_disk.releases)} release(s), more than this run's ledger ({self.steps} "
            f"steps, {len(self.releases)} release(s)); restore that run's checkpoint to "
            "continue it, or pass another ledger_path"
        )

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(accountant={self._kind!r}, neighbouring={self._neighbouring!r}, "
            f"steps={self.steps}, entries={len(self._entries)})"
        )
