"""``dp_accounting`` events of clipless DP-SGD steps (package docstring, "The mechanism").

Also the rewriting of events for the RDP accountant under replace-one neighbours
(:func:`_rdp_replace_one`; package docstring, "Neighbouring relations").
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attr
from dp_accounting import dp_event

from clipless.accounting._checks import _check_count, _check_noise_multiplier, _check_sample_rate

__all__ = [
    "dpsgd_event",
    "effective_noise_multiplier",
    "event_from_dict",
    "event_to_dict",
    "gaussian_step_event",
    "repeated",
]


def effective_noise_multiplier(sigmas: Sequence[float] | Iterable[float]) -> float:
    """The noise multiplier of one step whose layers have multipliers ``sigmas``.

    Layer ``k`` has sensitivity ``G_k`` and noise ``N(0, (sigma_k G_k)^2 I)``; dividing each layer
    by its noise scale turns the step into one Gaussian mechanism with unit noise and sensitivity
    ``sqrt(sum_k sigma_k^-2)``, i.e. noise multiplier ``(sum_k sigma_k^-2)^(-1/2)`` (docs/design.md,
    "Noise strategies"). ``global`` allocation (``sigma_k = sigma G / G_k``,
    ``G = sqrt(sum G_k^2)``) gives ``sigma``; ``per-layer`` (``sigma_k = sigma`` for ``D`` layers)
    gives ``sigma / sqrt(D)``.

    A layer with ``sigma_k = inf`` adds nothing; any ``sigma_k = 0`` makes the step non-private
    (result 0).

    Args:
        sigmas: every layer's noise multiplier ``sigma_k``, each in ``[0, inf]``.

    Returns:
        ``(sum_k sigma_k^-2)^(-1/2)``: 0 if any is 0, ``inf`` if all are.

    Raises:
        ValueError: no multiplier, or one negative or NaN.

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
    ``NonPrivateDpEvent`` and ``sigma == inf`` gives ``NoOpDpEvent`` (package docstring).

    Args:
        noise_multiplier: ``sigma = std / G`` with ``G`` the bound on one example's
            contribution, in ``[0, inf]``.
        sample_rate: the Poisson sampling probability ``q``, in ``(0, 1]`` (default 1: no
            subsampling).

    Raises:
        ValueError, TypeError: a multiplier or rate out of range, or not a number.

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


def repeated(event: dp_event.DpEvent, steps: int) -> dp_event.DpEvent:
    """``steps`` compositions of one step's ``event`` (``SelfComposedDpEvent``; 0: no-op).

    Args:
        event: one step's ``dp_accounting`` event.
        steps: how many times it is composed, an int ``>= 0``.

    Raises:
        TypeError: ``event`` not a ``DpEvent``.
        ValueError: ``steps`` negative or not a whole number.
    """
    if not isinstance(event, dp_event.DpEvent):
        raise TypeError(f"event must be a dp_accounting DpEvent; got {type(event).__name__}")
    count = _check_count(steps, "steps", minimum=0)
    if count == 0:
        return dp_event.NoOpDpEvent()
    return dp_event.SelfComposedDpEvent(event, count)


def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_event.DpEvent:
    """``steps`` compositions of :func:`gaussian_step_event` (``SelfComposedDpEvent``).

    Args:
        noise_multiplier: the step's ``sigma = std / G``, in ``[0, inf]``.
        sample_rate: the Poisson sampling probability ``q``, in ``(0, 1]``.
        steps: the number of steps, an int ``>= 0``.
    """
    count = _check_count(steps, "steps", minimum=0)
    return repeated(gaussian_step_event(noise_multiplier, sample_rate), count)


def _rdp_replace_one(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """Rewrite ``event`` for an add/remove RDP accountant so that it accounts for replace-one.

    Exact for un-subsampled Gaussians (sensitivity ``2 G`` == multiplier halved); anything whose
    replace-one RDP is not known exactly is refused (package docstring).
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


def event_to_dict(event: dp_event.DpEvent) -> dict[str, Any]:
    """``event`` as JSON-ready values: ``{"type": class name, field: value, ...}``, nested
    events as such dicts, an infinite number as the string ``"inf"`` (strict JSON has none).

    Any ``dp_accounting.dp_event`` class round-trips through :func:`event_from_dict`.

    Args:
        event: an event of a ``dp_accounting.dp_event`` class.

    Raises:
        TypeError: not a ``DpEvent``.
        ValueError: a ``DpEvent`` subclass defined elsewhere (the file could not name it), or a
            field that is NaN or of a type JSON cannot hold.

    >>> event_to_dict(gaussian_step_event(1.0, 0.01))["event"]
    {'type': 'GaussianDpEvent', 'noise_multiplier': 1.0}
    """
    if not isinstance(event, dp_event.DpEvent) or not attr.has(type(event)):
        raise TypeError(f"event must be a dp_accounting DpEvent; got {type(event).__name__}")
    if getattr(dp_event, type(event).__name__, None) is not type(event):
        raise ValueError(f"{type(event).__name__} is not a dp_accounting.dp_event class")
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in attr.fields(type(event)):
        out[f.name] = _encode(getattr(event, f.name), f.name)
    return out


def _encode(value: object, name: str) -> Any:
    if isinstance(value, dp_event.DpEvent):
        return event_to_dict(value)
    if isinstance(value, list | tuple):
        return [_encode(v, name) for v in value]
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        if math.isnan(v):
            raise ValueError(f"event field {name} is NaN")
        return v if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    raise ValueError(f"event field {name} has a value of type {type(value).__name__}")


def event_from_dict(data: Mapping[str, Any]) -> dp_event.DpEvent:
    """The event :func:`event_to_dict` wrote.

    Args:
        data: a dictionary written by :func:`event_to_dict`.

    Raises:
        ValueError: an unknown event type or malformed fields (named).
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("type"), str):
        raise ValueError(f"an event must be an object with a 'type'; got {data!r}")
    cls = getattr(dp_event, data["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, dp_event.DpEvent) and attr.has(cls)):
        raise ValueError(f"unknown dp_accounting event type {data['type']!r}")
    names = [f.name for f in attr.fields(cls)]
    if set(data) != {"type", *names}:
        raise ValueError(f"a {data['type']} has exactly the fields {names}; got {sorted(data)}")
    return cls(**{n: _decode(data[n]) for n in names})


def _decode(value: Any) -> Any:
    if isinstance(value, Mapping):
        return event_from_dict(value)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if value in ("inf", "-inf"):
        return float(value)
    return value
