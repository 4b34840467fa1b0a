"""Noise calibration: the smallest noise multiplier that meets an ``(epsilon, delta)`` target."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from dp_accounting import dp_event

from clipless.accounting._checks import (
    DEFAULT_PLD_DISCRETIZATION,
    AccountantKind,
    Neighbouring,
    _check_count,
    _check_delta,
    _check_epsilon,
    _check_kind,
    _check_neighbouring,
    _check_releases,
    _check_sample_rate,
    _real,
)
from clipless.accounting.accountant import Accountant, event_epsilon
from clipless.accounting.events import dpsgd_event

__all__ = ["PLD_MAX_EPSILON", "ReleasesExceedTargetError", "calibrate_noise"]

#: The largest target epsilon calibrated with the PLD accountant. Beyond, the multiplier is so
#: small that the privacy-loss distribution's support explodes: epsilon 100 took 28 s and 1000
#: did not return in 150 s (q = 0.25, 4 steps), and the CLI measured 60 at 26 s and 1 GB on
#: breast-cancer. The RDP accountant answers such targets at once (and they protect little).
PLD_MAX_EPSILON = 50.0


class ReleasesExceedTargetError(ValueError):
    """The one-shot releases composed before training already spend the target epsilon."""


_SIGMA_FLOOR = 0.02  # calibration floor: PLDs of smaller multipliers need huge supports


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
    sample_rate: float | None = None,
    steps: int | None = None,
    accountant: AccountantKind = "pld",
    neighbouring: Neighbouring = "add_remove",
    tolerance: float = 1e-3,
    *,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    orders: Sequence[float] | None = None,
    max_noise_multiplier: float = 1e6,
    releases: Sequence[float] = (),
    make_event: Callable[[float], dp_event.DpEvent] | None = None,
) -> float:
    """Smallest noise multiplier (to relative ``tolerance``) with ``epsilon <= target_epsilon``.

    The mechanism is ``make_event(sigma)``, the ``DpEvent`` of the whole run at multiplier
    ``sigma`` (as for ``dp_accounting.calibrate_dp_mechanism``; its epsilon must not increase
    with ``sigma``), composed with the ``releases``. Without ``make_event`` it is ``steps``
    Poisson-subsampled Gaussian steps of rate ``sample_rate``
    (:func:`~clipless.accounting.events.dpsgd_event`). With ``make_event``, ``sample_rate`` and
    ``steps``, if given, only choose where the search starts (the Gaussian's cheap RDP
    calibration); every multiplier it returns was checked on ``make_event``.

    Bracketing followed by an Illinois (safeguarded regula falsi) search on ``log sigma``; the
    bracket always keeps an upper end whose epsilon was *computed* to be within the target, and
    that end is returned, so ``epsilon(result, ...) <= target_epsilon`` holds exactly for the
    same accountant settings, and ``result / (1 + tolerance)`` misses the target.

    Why not ``dp_accounting.calibrate_dp_mechanism`` (with ``LowerEndpointAndGuess`` or
    ``ExplicitBracketInterval``): it runs Brent's method on ``epsilon(sigma)`` itself with an
    *absolute* tolerance in sigma, while the multipliers here span ``0.02..1e6`` and need a
    *relative* one; it does not certify the other side (that ``result / (1 + tolerance)``
    misses the target); and it would return different multipliers in the last digits, which
    changes the calibrated noise of existing runs and the epsilons pinned in the tests. The
    search here works on ``log sigma`` against ``log epsilon`` (close to linear) from the cheap
    RDP calibration, so most PLD calibrations need only a few PLD evaluations.

    Args:
        target_epsilon: the epsilon not to exceed, ``> 0`` (at most :data:`PLD_MAX_EPSILON`
            with PLD).
        target_delta: in ``(0, 1)``.
        sample_rate: the Poisson sampling probability ``q``, in ``(0, 1]`` (with
            ``make_event``: only where the search starts).
        steps: the number of steps, an int ``>= 1`` (likewise).
        accountant: ``"pld"`` (default) or ``"rdp"``.
        neighbouring: ``"add_remove"`` (default) or ``"replace_one"``.
        tolerance: the relative precision on sigma, in ``(0, 1)``.
        value_discretization_interval, orders: the accountant's settings
            (:class:`~clipless.accounting.Accountant`).
        max_noise_multiplier: the largest multiplier tried (finite, ``> 0``).
        releases: noise multipliers of one-shot Gaussian releases composed with the steps (e.g.
            a private input mean, :func:`clipless.features.release_mean`); the steps get what
            they leave of the budget, jointly accounted (not a split of epsilon).
        make_event: ``sigma -> DpEvent`` of the whole run (``None``: :func:`dpsgd_event` of
            ``sample_rate`` and ``steps``, which are then required).

    Returns:
        The multiplier: ``epsilon(result) <= target_epsilon`` and ``result / (1 + tolerance)``
        misses the target.

    Raises:
        ReleasesExceedTargetError: the releases alone already spend the target.
        ValueError: even ``max_noise_multiplier`` misses the target, a PLD target above
            :data:`PLD_MAX_EPSILON` (use ``accountant="rdp"``), an event the accountant cannot
            compose, or an argument out of range.
        TypeError: an argument of the wrong type.
    """
    eps_target = _check_epsilon(target_epsilon, "target_epsilon")
    delta = _check_delta(target_delta, "target_delta")
    if make_event is None and (sample_rate is None or steps is None):
        raise ValueError("calibrate_noise needs sample_rate and steps, or make_event")
    if make_event is not None and not callable(make_event):
        raise TypeError(f"make_event must be callable (sigma -> DpEvent); got {make_event!r}")
    q = None if sample_rate is None else _check_sample_rate(sample_rate)
    n_steps = None if steps is None else _check_count(steps, "steps", minimum=1)
    kind = _check_kind(accountant)
    rel = _check_neighbouring(neighbouring)
    tol = _real(tolerance, "tolerance")
    if not (math.isfinite(tol) and 0.0 < tol < 1.0):
        raise ValueError(f"tolerance must be in (0, 1) (relative, on sigma); got {tolerance!r}")
    sigma_cap = _real(max_noise_multiplier, "max_noise_multiplier")
    if not (math.isfinite(sigma_cap) and sigma_cap > 0.0):
        raise ValueError(f"max_noise_multiplier must be finite and > 0; got {sigma_cap!r}")
    if kind == "pld" and eps_target > PLD_MAX_EPSILON:
        raise ValueError(
            f"target_epsilon={eps_target:g} is above {PLD_MAX_EPSILON:g}, the largest the PLD "
            "accountant calibrates (its support grows without bound as the multiplier shrinks); "
            "use accountant='rdp' for such targets"
        )
    if make_event is None:
        assert q is not None and n_steps is not None
        q_, n_ = q, n_steps
        make_event = lambda sigma: dpsgd_event(sigma, q_, n_)  # noqa: E731
    # refuses (with the reason) an event the accountant cannot compose, e.g. Poisson
    # subsampling under replace-one with RDP
    Accountant(kind, rel, orders=orders).check_supported(make_event(1.0))  # type: ignore[arg-type]
    extra = _check_releases(releases)

    def run_epsilon(event: dp_event.DpEvent) -> float:
        return event_epsilon(
            event,
            delta,
            kind,  # type: ignore[arg-type]
            rel,  # type: ignore[arg-type]
            value_discretization_interval=value_discretization_interval,
            orders=orders,
            releases=extra,
        )

    if extra:
        alone = run_epsilon(dp_event.SelfComposedDpEvent(dp_event.NoOpDpEvent(), 1))
        if alone >= eps_target:
            raise ReleasesExceedTargetError(
                f"the releases {list(extra)} alone spend epsilon {alone:.4g} >= "
                f"target_epsilon={eps_target} at delta={delta}: nothing is left for training"
            )

    def gap(log_sigma: float) -> float:
        # log(epsilon) is close to linear in log(sigma): regula falsi converges in a few steps.
        eps = run_epsilon(make_event(math.exp(log_sigma)))
        return math.log(max(eps, 1e-300)) - math.log(eps_target)

    log_cap = math.log(sigma_cap)
    log_floor = math.log(_SIGMA_FLOOR)
    if q is None or n_steps is None:
        x0, step = math.log(1.0), math.log(2.0)
    else:
        x0, step = _starting_point(eps_target, delta, q, n_steps, kind, rel, orders)
    x0 = min(max(x0, log_floor), log_cap)
    lo, g_lo, hi, g_hi = _bracket(gap, x0, step, log_floor, log_cap, eps_target, delta, sigma_cap)
    return math.exp(_illinois(gap, lo, g_lo, hi, g_hi, math.log1p(tol)))


_Bracket = tuple[float, float, float, float]


def _bracket(
    gap: Callable[[float], float],
    x0: float,
    step: float,
    log_floor: float,
    log_cap: float,
    eps_target: float,
    delta: float,
    sigma_cap: float,
) -> _Bracket:
    """``(lo, gap(lo), hi, gap(hi))`` with ``gap(lo) > 0 >= gap(hi)``, walking from ``x0`` in
    steps doubling in log space (down until the target is missed, or up until it is met)."""
    g0 = gap(x0)
    if g0 <= 0.0:
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
                return lo, g_lo, hi, g_hi
            hi, g_hi = lo, g_lo
            step *= 2.0
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
            return lo, g_lo, hi, g_hi
        lo, g_lo = hi, g_hi
        step *= 2.0


def _illinois(
    gap: Callable[[float], float], lo: float, g_lo: float, hi: float, g_hi: float, log_tol: float
) -> float:
    """The upper end ``hi`` of the bracket closed to ``log_tol`` (invariant ``gap(lo) > 0 >=
    gap(hi)``): Illinois regula falsi, each estimate of the root nudged half a tolerance
    towards the end that moved least recently, so that an accurate estimate closes the bracket
    from that side; bisection after 20 iterations."""
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
    return hi
