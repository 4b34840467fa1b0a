"""One-run audit with white-box gradient canaries (Steinke, Nasr and Jagielski 2023, section 6).

The input-space one-run audit (:func:`clipless.audit.audit_one_run`) gives 0 at realistic
budgets: its canaries are far from the worst case. Here the canaries are **gradients**: canary
``i`` is, in every noised tensor ``p``, a unit direction ``u_{i,p}`` times the plan's sensitivity
``Delta_p`` (the most one record may contribute), so that each canary is exactly as
distinguishable as the claimed epsilon allows and no more. Each of the ``m`` canaries is
included independently with probability 1/2; an included canary's gradient is added to the
clean gradient sum of every step, and the optimizer's own :meth:`DPOptimizer.add_noise
<clipless.optim.DPOptimizer.add_noise>` (the code :meth:`~clipless.optim.DPOptimizer.step` runs:
:func:`clipless.optim.draw_noise` at the plan's standard deviations, then division by the
expected batch size) turns it into the released gradient. The auditor scores canary ``i`` by the
likelihood-ratio statistic of the summed releases, ``sum_p Delta_p <R_p - clean_p, u_{i,p}> /
sigma_p^2``, guesses "included" for the ``k`` highest scores and "excluded" for the ``k`` lowest,
and :func:`clipless.audit.one_run.one_run_epsilon_lower_bound` turns the number of correct guesses
into the lower bound.

**Why it is rigorous.** The theorem (their Theorem 3) needs only that the release is
``(epsilon, delta)``-DP with respect to adding or removing any one canary, and that the inclusion
bits are independent of the mechanism's randomness. A canary's gradient has norm ``Delta_p`` in
every tensor, within what one record of the plan may contribute (the audit model has bias-free
layers used once each, so every group of the plan is one tensor: the canary's global norm is the
plan's ``G`` and, under per-layer noise, its Mahalanobis norm ``sqrt(D) / sigma``), so adding or
removing it is a neighbouring dataset of the claim; the bits come from the canary stream, the
noise from the engine's generator seeded from an independent stream.

**Directions.** Within each tensor the ``m`` directions are exactly orthonormal and dense:
columns of a randomised Hadamard transform (random coordinates, random signs, distinct random
columns of the Sylvester matrix), so one canary's score sees no other canary's gradient and the
scores are independent given the bits (the idealised setting of the paper's section 6). This
needs ``m`` at most the size of every noised tensor (rounded down to a power of two).

**Sampling.** ``q = 1`` (every record in every step), as in :func:`clipless.audit.audit_step`:
the audit tests the sensitivities and the noise the library controls; amplification by
subsampling is ``dp_accounting``'s theorem. The ``steps`` releases are summed (at ``q = 1`` the
sum is sufficient). The claim is the PLD accountant's epsilon for ``steps`` steps.

**The number of guesses** is fixed before the run: by default the ``2k`` that maximises the bound
expected when the mechanism is exactly as private as its plan (scores ``mu b_i + N(0, 1)``, ``mu``
the canary's whitened norm, public), so choosing it looks at no score.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from scipy import stats as _stats

from clipless import _validate
from clipless.audit.one_run import one_run_epsilon_lower_bound
from clipless.audit.step import audit_mlp, make_audited

__all__ = ["GradientCanaryAudit", "audit_gradient_canaries", "planned_guesses"]

_RADIUS = 10.0
_RIGOROUS = ("per-sample", "bound", "threshold")


@dataclass(frozen=True)
class GradientCanaryAudit:
    """Result of :func:`audit_gradient_canaries` (module docstring)."""

    mode: str
    noise: str
    steps: int
    delta: float
    claimed_epsilon: float
    canary_mu: float
    canaries: int
    guesses: int
    correct: int
    epsilon_lower_bound: float
    confidence: float

    @property
    def violated(self) -> bool:
        """The lower bound exceeds the claim: the claimed epsilon is false (with
        :attr:`confidence`)."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    def lines(self) -> list[str]:
        """Human-readable report."""
        verdict = (
            f"above the claim: the claimed epsilon is false (with {100 * self.confidence:g}% "
            "confidence)"
            if self.violated
            else "below the claim (consistent with it)"
        )
        return [
            f"mechanism: scaling={self.mode}, noise={self.noise}, q=1, {self.steps} step(s); "
            f"{self.canaries} white-box gradient canaries at the planned sensitivity (whitened "
            f"norm over all steps {self.canary_mu:.4g}), each included with probability 1/2",
            f"claimed epsilon: {self.claimed_epsilon:.4f} (delta {self.delta:g}, PLD accountant;"
            " a DP guarantee)",
            f"one-run lower bound: {self.epsilon_lower_bound:.4f} ({100 * self.confidence:g}% "
            f"confidence, Steinke et al. 2023; {self.correct}/{self.guesses} correct guesses) -- "
            f"{verdict}",
        ]


@functools.lru_cache(maxsize=64)
def planned_guesses(mu: float, canaries: int, delta: float, confidence: float) -> int:
    """The even number of guesses ``2k`` maximising the expected bound for scores ``mu b + Z``.

    The ``k`` highest and ``k`` lowest of ``m`` scores: the top-``k`` threshold ``t`` solves
    ``(Phi(mu - t) + Phi(-t)) / 2 = k / m`` and the expected precision is ``Phi(mu - t) /
    (Phi(mu - t) + Phi(-t))`` (symmetric at the bottom). Uses public values only.
    """
    best, best_value = 2, -1.0
    k = 1
    while 2 * k <= canaries:
        frac = k / canaries

        def excess(t: float, frac: float = frac) -> float:
            return 0.5 * (_stats.norm.sf(t - mu) + _stats.norm.sf(t)) - frac

        t = _bisect(excess, -50.0, 50.0)
        hi, lo = float(_stats.norm.sf(t - mu)), float(_stats.norm.sf(t))
        precision = hi / (hi + lo) if hi + lo > 0 else 0.5
        correct = math.floor(2 * k * precision)
        value = one_run_epsilon_lower_bound(canaries, 2 * k, correct, delta, confidence)
        if value > best_value:
            best, best_value = 2 * k, value
        k = max(k + 1, int(k * 1.25))
    return best


def _bisect(f: Any, lo: float, hi: float) -> float:
    """The root of a decreasing ``f`` in ``[lo, hi]``."""
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """The (unnormalised, Sylvester-ordered) Walsh-Hadamard transform along the last axis."""
    n = x.shape[-1]
    y, h = x, 1
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape)


@dataclass(frozen=True)
class _Directions:
    """``m`` orthonormal directions in a tensor of ``size`` entries (randomised Hadamard)."""

    support: torch.Tensor  # the n coordinates used, n a power of two
    signs: torch.Tensor  # [n] random signs
    columns: torch.Tensor  # [m] distinct columns of the Hadamard matrix

    @classmethod
    def draw(cls, size: int, m: int, gen: torch.Generator) -> _Directions:
        n = 1 << (size.bit_length() - 1)
        support = torch.randperm(size, generator=gen)[:n]
        signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        columns = torch.randperm(n, generator=gen)[:m]
        return cls(support, signs, columns)

    def combine(self, weights: torch.Tensor, size: int) -> torch.Tensor:
        """``sum_i weights_i u_i`` as a flat vector of ``size`` entries."""
        n = self.signs.shape[0]
        coef = torch.zeros(n, dtype=torch.float64)
        coef[self.columns] = weights
        out = torch.zeros(size, dtype=torch.float64)
        out[self.support] = self.signs * _fwht(coef) / math.sqrt(n)
        return out

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``<x, u_i>`` for every direction ``i`` (``x`` flat)."""
        n = self.signs.shape[0]
        return _fwht(self.signs * x[self.support])[self.columns] / math.sqrt(n)


def _released(
    opt: Any,
    plan: Any,
    clean: dict[str, torch.Tensor],
    inserted: dict[str, torch.Tensor],
    steps: int,
) -> dict[str, torch.Tensor]:
    """The sum over ``steps`` steps of ``q N`` times the released gradient (flat, float64)."""
    params = {name: p for p, name in opt._names.items()}
    released = {n: torch.zeros(clean[n].numel(), dtype=torch.float64) for n in plan.names}
    with torch.no_grad():
        for _ in range(steps):
            for n in plan.names:
                added = inserted[n].to(clean[n].device)
                params[n].grad = (clean[n].reshape(-1) + added).reshape(clean[n].shape)
            opt.add_noise(plan)  # what DPOptimizer.step adds: the plan's noise, then / (q N)
            for n in plan.names:
                grad = params[n].grad
                if grad is None:
                    raise RuntimeError(f"add_noise left no gradient for {n!r}")
                released[n] += (grad.reshape(-1).double() * plan.expected_batch_size).cpu()
            opt.zero_grad()
    return released


def _check(
    epsilon: float, delta: float, canaries: int, guesses: int | None, steps: int, width: int,
    confidence: float, seed: int | None,
) -> None:  # fmt: skip
    _validate.finite_positive("epsilon", epsilon)
    for name, value in (("delta", delta), ("confidence", confidence)):
        _validate.probability(name, value, open_low=True, open_high=True, wrong_type=ValueError)
    for name, value, low in (("canaries", canaries, 2), ("steps", steps, 1), ("width", width, 2)):
        _validate.positive_int(name, value, minimum=low, wrong_type=ValueError)
    if width % 2 or width * width < canaries:
        raise ValueError(
            f"width must be even with width^2 >= canaries (every noised tensor holds the "
            f"canaries' orthogonal directions); got width={width}, canaries={canaries}"
        )
    if guesses is not None and (
        not _validate.is_int(guesses) or guesses < 2 or guesses % 2 or guesses > canaries
    ):  # fmt: skip
        raise ValueError(
            f"guesses must be an even integer in [2, canaries] or None; got {guesses!r}"
        )
    if seed is not None and (not _validate.is_int(seed) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0 or None; got {seed!r}")


def audit_gradient_canaries(
    epsilon: float = 1.0,
    *,
    delta: float = 1e-5,
    canaries: int = 4096,
    guesses: int | None = None,
    steps: int = 1,
    mode: str = "per-sample",
    noise: str = "global",
    width: int | None = None,
    records: int = 32,
    confidence: float = 0.95,
    seed: int | None = None,
    device: torch.device | str = "cpu",
) -> GradientCanaryAudit:
    """One run of ``steps`` private steps calibrated to ``(epsilon, delta)`` with white-box
    gradient canaries (module docstring); returns the one-run lower bound beside the claim.

    ``mode`` is the scaling mode, ``noise`` the allocation (``"global"`` or ``"per-layer"``);
    ``width`` the audit model's width (three bias-free ``width x width`` layers; ``width^2 >=
    canaries``; default: the smallest power of two that holds them); ``records`` the number of
    ordinary records in every step; ``guesses`` the fixed ``2k`` (default:
    :func:`planned_guesses`). ``seed`` makes the canaries, their bits, the model and the noise
    reproducible (default: fresh randomness); ``device`` is where the model trains and the noise
    is drawn (the canaries and the scores stay on the CPU).
    """
    import secrets

    from clipless import nn
    from clipless.audit._seeds import independent_seeds
    from clipless.audit.step import _clean_sum

    if width is None:  # the smallest power of two whose square holds the canaries
        valid = isinstance(canaries, int) and canaries >= 2
        width = 1 << max(1, math.ceil(math.log2(canaries) / 2)) if valid else 2
    _check(epsilon, delta, canaries, guesses, steps, width, confidence, seed)
    if mode not in _RIGOROUS:
        raise ValueError(
            f"mode must be one of {', '.join(_RIGOROUS)}; got {mode!r} (batch-max's flaw is in "
            "how it scales the real records' gradients, which gradient canaries bypass: audit it "
            "with audit_step)"
        )
    base = seed if seed is not None else secrets.randbits(62)
    canary_seed, model_seed, noise_seed = independent_seeds(base, 3)
    gen = torch.Generator().manual_seed(canary_seed)
    model = audit_mlp(_RADIUS, width, width, model_seed).to(device)
    loss = nn.CrossEntropyLoss(reduction="sum")
    x0 = torch.randn(records, width, generator=gen, dtype=torch.float64)
    y0 = torch.randint(0, width, (records,), generator=gen)
    thresholds = {p: _RADIUS / 2.0 for p in ("1", "3", "5")} if mode == "threshold" else None
    engine, model, opt = make_audited(
        model,
        loss,
        (x0, y0),
        noise_seed if seed is not None else None,
        {"scaling": mode, "noise": noise, "thresholds": thresholds},
        target_epsilon=float(epsilon),
        target_delta=float(delta),
        steps=steps,
    )
    plan, on_device = _clean_sum(opt, model, loss, x0.to(device), y0.to(device))
    clean = {n: g.cpu() for n, g in on_device.items()}
    if any(len(group) != 1 for group in plan.groups):
        raise RuntimeError("the audit model must have one noised tensor per layer use")
    directions = {n: _Directions.draw(clean[n].numel(), canaries, gen) for n in plan.names}
    bits = torch.rand(canaries, generator=gen) < 0.5
    inserted = {
        n: plan.sensitivities[n] * directions[n].combine(bits.double(), clean[n].numel())
        for n in plan.names
    }
    released = _released(opt, plan, on_device, inserted, steps)
    scores = torch.zeros(canaries, dtype=torch.float64)
    for n in plan.names:
        centred = released[n] - steps * clean[n].reshape(-1).double()
        weight = plan.sensitivities[n] / plan.stds[n] ** 2
        scores += weight * directions[n].project(centred)
    mu = math.sqrt(steps * sum((plan.sensitivities[n] / plan.stds[n]) ** 2 for n in plan.names))
    r = guesses if guesses is not None else planned_guesses(mu, canaries, delta, confidence)
    order = torch.argsort(scores, descending=True)
    k = r // 2
    correct = int(bits[order[:k]].sum()) + int((~bits[order[-k:]]).sum())
    return GradientCanaryAudit(
        mode=mode,
        noise=noise,
        steps=steps,
        delta=float(delta),
        claimed_epsilon=float(engine.privacy_config.epsilon(delta, steps=steps)),
        canary_mu=mu,
        canaries=canaries,
        guesses=r,
        correct=correct,
        epsilon_lower_bound=one_run_epsilon_lower_bound(canaries, r, correct, delta, confidence),
        confidence=float(confidence),
    )
