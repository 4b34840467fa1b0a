"""Mechanism-level audit of a DP training step: attack the released noisy update.

Jagielski, Ullman and Oprea 2020 ("Auditing differentially private machine learning"), Nasr,
Song, Thakurta, Papernot and Carlini 2021 ("Adversary instantiation"): the strongest adversary of
DP-SGD sees every released noisy gradient and knows everything but whether one canary record is in
the data. This audit instantiates that adversary for one step (or ``steps`` steps at fixed weights)
of the library's own mechanism and returns an empirical lower bound on epsilon to set against the
claimed one.

**Setup (add/remove-one, white box).** A small Lipschitz MLP (``InputNorm -> Linear -> GroupSort``
x2 ``-> Linear``, square orthogonal layers, so that every layer preserves norms and the canary can
reach every layer's sensitivity) is made private by :class:`clipless.PrivacyEngine` with sample
rate ``q = 1`` (every record in every batch: the step is a plain Gaussian mechanism, and the audit
tests what the library controls, the sensitivities and the noise; amplification by subsampling is
``dp_accounting``'s theorem). ``D`` is ``m`` copies of a record of small input norm; ``D'`` adds
the **canary**: an input of maximal norm (the ``InputNorm`` radius) whose direction maximises the
model's logit margin, labelled with the class the model finds least likely, so that its loss
gradient at the logits approaches the loss constant ``L`` and its contribution to every layer
approaches the certified bound ``G_k``. Under ``scaling="batch-max"`` the same canary raises the
batch maximum of every layer's input norm and so shrinks every other record's contribution: the
sum moves by about ``m`` times the sensitivity the noise was calibrated to.

**What runs through the library.** The clean sums on ``D`` and ``D'`` are one forward and backward
pass each through the private model (the optimizer's hooks: the frozen
:class:`~clipless.mechanism.NoisePlan`, the scaled kernels, the cotangent clip at the output); the
plan is the one :meth:`clipless.optim.DPOptimizer.step` would use; the noise is drawn by
:func:`clipless.optim.draw_noise` from the plan's standard deviations with the optimizer's
generator, in batches of independent draws; the release is ``(sum + noise) / (q N)``. Only the
repetition is vectorised (the sums are computed once: the weights do not change within the audit).

**Test.** The released updates are projected on the most distinguishing direction, the
likelihood-ratio direction of the two Gaussians, ``Sigma^-1 (mu' - mu)`` (per-coordinate noise
variances of the plan), summed over the ``steps`` steps, and :func:`clipless.audit.bounds.
epsilon_lower_bound` turns the two score samples into a Clopper-Pearson lower bound. The claim is
``PrivacyConfig.epsilon(delta, steps)`` (PLD accountant).

``sensitivity_ratio`` is the exact (noise-free) part of the audit: the Mahalanobis distance between
the two clean releases times the effective noise multiplier, i.e. the canary's contribution
relative to the sensitivity the noise was calibrated for; a sound mechanism has it ``<= 1``.
At ``q = 1`` the release is a Gaussian mechanism whose privacy curve is determined by that
distance, so a ratio above 1 *proves* the claim false, with no statistics: the verdict
(:attr:`StepAudit.violated`) is "false" when the ratio exceeds 1 or the statistical lower bound
exceeds the claim. The statistical bound alone is limited by the number of trials (about
``10^4`` held-out releases cannot certify an epsilon above 2-4), so a mechanism with 0.6 times
the noise in one layer passes it and is caught only by the ratio.

The canaries, the model and the mechanism's noise come from independent streams
(:func:`clipless.audit._seeds.independent_seeds`).
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import DataLoader, TensorDataset

from clipless import _validate
from clipless.audit._modes import AUDIT_MODES
from clipless.audit.bounds import (
    GaussianFit,
    ThresholdTest,
    epsilon_lower_bound,
    gaussian_epsilon_lower_bound,
)

__all__ = ["AUDIT_MODES", "StepAudit", "audit_step"]

_DIM = 8
_CLASSES = 2


@dataclass(frozen=True)
class StepAudit:
    """Result of :func:`audit_step` (see the module docstring).

    ``claimed_epsilon`` is what the accountant reports for ``steps`` steps at ``delta``;
    ``proven`` is ``False`` for ``batch-max``, whose claim is invalid. ``test`` holds the lower
    bound (``test.epsilon``) and the threshold test behind it. ``scores_without`` and
    ``scores_with`` are the projected releases on ``D`` and ``D'`` (for plots).
    """

    mode: str
    noise: str
    steps: int
    trials: int
    delta: float
    noise_multiplier: float
    claimed_epsilon: float
    proven: bool
    sensitivity_ratio: float
    test: ThresholdTest
    scores_without: NDArray[np.float64] = field(repr=False)
    scores_with: NDArray[np.float64] = field(repr=False)
    gaussian: GaussianFit | None = None
    """The Gaussian-DP fit of all the scores (:func:`~clipless.audit.bounds.
    gaussian_epsilon_lower_bound`): its estimate and its lower bound, rigorous under the step's
    Gaussian output model; reported beside the distribution-free bound, not in
    :attr:`violated`."""

    @property
    def epsilon_lower_bound(self) -> float:
        """The empirical lower bound (with probability ``test.confidence``)."""
        return self.test.epsilon

    @property
    def confidence(self) -> float:
        """The confidence of the statistical lower bound."""
        return self.test.confidence

    @property
    def exceeds_sensitivity(self) -> bool:
        """The canary's exact contribution exceeds the calibrated sensitivity (beyond float64
        rounding): the claimed epsilon is false, with certainty."""
        return self.sensitivity_ratio > 1.0 + 1e-6

    @property
    def violated(self) -> bool:
        """The claim is shown false: exactly (:attr:`exceeds_sensitivity`) or statistically
        (the lower bound exceeds it, with probability :attr:`confidence`)."""
        return self.exceeds_sensitivity or self.epsilon_lower_bound > self.claimed_epsilon

    def lines(self) -> list[str]:
        """Human-readable report (what ``clipless audit`` prints)."""
        claim = "a DP guarantee" if self.proven else "NOT a guarantee: batch-max has no DP proof"
        if self.exceeds_sensitivity:
            verdict = (
                "the claimed epsilon is false (exact: the canary's contribution exceeds the "
                f"calibrated sensitivity {self.sensitivity_ratio:.4g} times)"
            )
        elif self.epsilon_lower_bound > self.claimed_epsilon:
            verdict = (
                f"above the claim: the claimed epsilon is false (with {100 * self.confidence:g}%"
                " confidence)"
            )
        else:
            verdict = "below the claim (consistent with it)"
        out = [
            f"mechanism: scaling={self.mode}, noise={self.noise}, sigma={self.noise_multiplier:g},"
            f" q=1, {self.steps} step(s), add/remove one canary; {self.trials} releases per "
            f"neighbouring dataset; canary contribution / calibrated sensitivity = "
            f"{self.sensitivity_ratio:.4g}",
            f"claimed epsilon: {self.claimed_epsilon:.4f} (delta {self.delta:g}, PLD accountant; "
            f"{claim})",
        ]
        g = self.gaussian
        if g is not None:
            side = "above" if g.epsilon_lower > self.claimed_epsilon else "below"
            out.append(
                f"Gaussian-DP fit of all {2 * self.trials} scores: estimate mu {g.mu_estimate:.4g},"
                f" epsilon {g.epsilon_estimate:.4f} (an estimate, not a bound); rigorous lower "
                f"bound epsilon {g.epsilon_lower:.4f} (mu >= {g.mu_lower:.4g}, "
                f"{100 * g.confidence:g}% confidence, exact t and chi-square intervals; valid "
                f"because the step's releases are Gaussian) -- {side} the claim"
            )
        return [
            *out,
            f"empirical lower bound: {self.epsilon_lower_bound:.4f} ({100 * self.confidence:g}% "
            f"confidence, Clopper-Pearson; TPR {self.test.tpr:.4g} >= {self.test.tpr_lower:.4g}, "
            f"FPR {self.test.fpr:.4g} <= {self.test.fpr_upper:.4g} on "
            f"{self.test.evaluation_trials} held-out releases each) -- {verdict}",
        ]

    def plot(self, path: str | Path) -> Path:
        """Histograms of the two score distributions and the selected threshold (PNG)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 3.6), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        both = np.concatenate([self.scores_without, self.scores_with])
        bins = np.linspace(float(both.min()), float(both.max()), 80).tolist()
        ax.hist(self.scores_without, bins=bins, alpha=0.6, density=True, label="D (no canary)")
        ax.hist(self.scores_with, bins=bins, alpha=0.6, density=True, label="D' (with canary)")
        ax.axvline(self.test.threshold, color="k", linestyle="--", label="threshold")
        ax.set_xlabel("release projected on the most distinguishing direction")
        ax.set_ylabel("density")
        ax.set_title(
            f"{self.mode}: claimed eps {self.claimed_epsilon:.2f}, "
            f"lower bound {self.epsilon_lower_bound:.2f}",
            fontsize=10,
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(path)
        if not out.suffix:  # savefig would append .png; return the file actually written
            out = out.with_suffix(".png")
        supported = fig.canvas.get_supported_filetypes()
        if out.suffix[1:].lower() not in supported:
            raise ValueError(
                f"path: {out.suffix!r} is not an image format matplotlib writes "
                f"({', '.join(sorted(supported))})"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
        return out


def audit_mlp(radius: float, width: int, outputs: int, seed: int) -> torch.nn.Module:
    """The audited network in float64, initialised from ``seed`` (the global generator's state is
    restored): inputs projected on the ball of ``radius``, then three bias-free ``Linear``
    layers of ``width`` (the last with ``outputs``) with ``GroupSort(2)`` between them (also the
    gradient-canary audit's)."""
    from clipless import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.InputNorm(radius),
            nn.Linear(width, width, bias=False),
            nn.GroupSort(2),
            nn.Linear(width, width, bias=False),
            nn.GroupSort(2),
            nn.Linear(width, outputs, bias=False),
        ).double()


def make_audited(
    model: torch.nn.Module,
    loss: torch.nn.Module,
    data: tuple[torch.Tensor, torch.Tensor],
    noise_seed: int | None,
    mechanism: Mapping[str, Any],
    **calibration: Any,
) -> tuple[Any, Any, Any]:
    """``(engine, model, optimizer)``: ``make_private`` of an audit (also the gradient-canary
    audit's), with the audit's own seeded engine (an experiment, no release), a zero learning
    rate, all of ``data`` as one batch at sample rate 1 and orthogonal weights; ``mechanism``
    holds the rest of the :class:`~clipless.MechanismSpec`, ``calibration`` the noise
    (``noise_multiplier`` or the target epsilon, delta and steps)."""
    import clipless

    with warnings.catch_warnings():  # the audit's own seeded engine: an experiment, no release
        warnings.filterwarnings("ignore", message=r"PrivacyEngine\(seed=")
        engine = clipless.PrivacyEngine(seed=noise_seed)
    model, opt, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(*data), batch_size=data[0].shape[0]),
        loss=loss,
        mechanism=clipless.MechanismSpec(sample_rate=1.0, constraint="orthogonal", **mechanism),
        **calibration,
    )
    return engine, model, opt


def _canary(model: torch.nn.Module, radius: float, gen: torch.Generator) -> tuple[Any, Any]:
    """A maximal-norm input maximising the logit margin, with the least likely label.

    Random search over the sphere of radius ``radius`` followed by projected gradient ascent on
    the margin (the network is piecewise linear, so the margin is maximised on the sphere).
    """
    model.eval()
    device = next(model.parameters()).device
    x = torch.randn(4096, _DIM, generator=gen, dtype=torch.float64).to(device)
    x = radius * x / x.norm(dim=1, keepdim=True)
    with torch.no_grad():
        z = model(x)
        margin = (z.max(dim=1).values - z.min(dim=1).values).double()
    best = x[int(margin.argmax())].clone().requires_grad_(True)
    for _ in range(200):
        z = model(best.unsqueeze(0))[0]
        gap = z.max() - z.min()
        (grad,) = torch.autograd.grad(gap, best)
        with torch.no_grad():
            best += 0.05 * radius * grad / grad.norm().clamp_min(1e-12)
            best *= radius / best.norm()
    with torch.no_grad():
        x_c = best.detach().unsqueeze(0)
        y_c = model(x_c).argmin(dim=1)
    model.train()
    return x_c, y_c


def _clean_sum(
    opt: Any, model: torch.nn.Module, loss: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[Any, dict[str, torch.Tensor]]:
    """One forward and backward pass through the private model; the plan and the summed gradient.

    The plan is the one :meth:`DPOptimizer.step` would use for this backward pass
    (``_plan_for_step`` refuses anything but exactly one backward pass); the step itself is not
    taken (no noise is drawn, nothing is recorded: the audit data is synthetic).
    """
    opt.zero_grad()
    model.train()
    loss(model(x), y).backward()
    plan = opt._plan_for_step()
    opt._pending = []
    sums = {name: p.grad.detach().clone() for p, name in opt._names.items()}
    opt.zero_grad()
    return plan, sums


def audit_step(
    mode: str = "per-sample",
    *,
    noise: str = "global",
    noise_multiplier: float = 2.0,
    trials: int = 20000,
    steps: int = 1,
    delta: float = 1e-5,
    confidence: float = 0.95,
    records: int = 32,
    radius: float = 10.0,
    allow_unproven: bool = False,
    seed: int | None = None,
    device: torch.device | str = "cpu",
) -> StepAudit:
    """Audit one private training step (or ``steps`` steps at fixed weights): module docstring.

    ``mode`` is the scaling mode (``per-sample``, ``bound``, ``threshold`` with every ``T_k =
    radius / 2``, or ``batch-max``, which needs ``allow_unproven=True``); ``noise`` the noise
    allocation; ``trials`` the number of releases simulated on each neighbouring dataset;
    ``records`` the size of ``D``; ``radius`` the ``InputNorm`` radius. ``seed`` makes the model,
    the canary and the noise reproducible (default: fresh randomness); ``device`` is where the
    model trains and the noise is drawn (the same draws as on the CPU for a seed only where the
    device's generator matches the CPU's).
    """
    _check_audit_arguments(
        mode, trials, steps, records, noise_multiplier, radius, allow_unproven, seed
    )
    delta = _validate.probability(
        "delta", delta, open_low=True, open_high=True, wrong_type=ValueError
    )
    confidence = _validate.probability(
        "confidence", confidence, open_low=True, open_high=True, wrong_type=ValueError
    )
    engine, opt, model, loss, gen, (x0, y0) = _audit_setup(
        mode,
        noise,
        float(noise_multiplier),
        records,
        float(radius),
        allow_unproven,
        seed,
        torch.device(device),
    )
    x_c, y_c = _canary(model, float(radius), gen)
    plan0, sums0 = _clean_sum(opt, model, loss, x0, y0)
    plan1, sums1 = _clean_sum(
        opt, model, loss, torch.cat([x0, x_c.to(x0.dtype)]), torch.cat([y0, y_c])
    )
    if dict(plan0.stds) != dict(plan1.stds):  # the weights did not move: one plan
        raise RuntimeError("the noise plan changed between the two passes")
    plan = plan0
    scale = float(plan.expected_batch_size)
    names = list(plan.names)
    diff = {n: (sums1[n] - sums0[n]) / scale for n in names}
    w = {n: diff[n] / (plan.stds[n] / scale) ** 2 for n in names}
    mahalanobis = math.sqrt(sum(float((diff[n] * w[n]).sum()) for n in names))
    sensitivity_ratio = mahalanobis * float(plan.effective_noise_multiplier)
    means0 = {n: sums0[n] / scale for n in names}
    s0 = _scores(plan, opt.generator, sums0, means0, w, trials, steps)
    s1 = _scores(plan, opt.generator, sums1, means0, w, trials, steps)
    test = epsilon_lower_bound(s0, s1, delta, confidence)
    gaussian = gaussian_epsilon_lower_bound(s0, s1, delta, confidence)
    claimed = engine.privacy_config.epsilon(delta, steps=steps)
    return StepAudit(
        mode=mode,
        noise=noise,
        steps=steps,
        trials=trials,
        delta=delta,
        noise_multiplier=float(noise_multiplier),
        claimed_epsilon=float(claimed),
        proven=bool(plan.proven),
        sensitivity_ratio=sensitivity_ratio,
        test=test,
        scores_without=s0,
        scores_with=s1,
        gaussian=gaussian,
    )


def _check_audit_arguments(
    mode: str,
    trials: int,
    steps: int,
    records: int,
    noise_multiplier: float,
    radius: float,
    allow_unproven: bool,
    seed: int | None,
) -> None:
    """:func:`audit_step`'s arguments, each refused with its name and what is accepted."""
    _validate.choice("mode", mode, AUDIT_MODES)
    if mode == "batch-max" and not allow_unproven:
        raise ValueError(
            "mode 'batch-max' is not differentially private; pass allow_unproven=True to audit it "
            "(the audit shows that its claimed epsilon is false)"
        )
    _validate.positive_int("trials", trials, minimum=20, wrong_type=ValueError)
    _validate.positive_int("steps", steps, wrong_type=ValueError)
    _validate.positive_int("records", records, wrong_type=ValueError)
    _validate.finite_positive("noise_multiplier", noise_multiplier)
    _validate.finite_positive("radius", radius)
    if seed is not None and (not _validate.is_int(seed) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0 or None; got {seed!r}")


def _audit_setup(
    mode: str,
    noise: str,
    noise_multiplier: float,
    records: int,
    radius: float,
    allow_unproven: bool,
    seed: int | None,
    device: torch.device,
) -> tuple[Any, Any, torch.nn.Module, torch.nn.Module, torch.Generator, tuple[torch.Tensor, ...]]:
    """``(engine, optimizer, model, loss, canary generator, (x0, y0))``: the private model
    trained on ``D`` (``records`` copies of one small-norm record, so their batch maximum is
    small), with the canary, the model and the noise from independent streams (module
    docstring)."""
    from clipless import nn
    from clipless.audit._seeds import independent_seeds

    if seed is not None:
        canary_seed, model_seed, noise_seed = independent_seeds(seed, 3)
    else:
        canary_seed, model_seed = independent_seeds(secrets.randbits(62), 2)
        noise_seed = None  # the engine's CSPRNG
    gen = torch.Generator()
    gen.manual_seed(canary_seed)
    model = audit_mlp(radius, _DIM, _CLASSES, model_seed).to(device)
    loss = nn.CrossEntropyLoss(reduction="sum")
    small = torch.randn(1, _DIM, generator=gen, dtype=torch.float64)
    small = 0.05 * radius * small / small.norm()
    x0 = small.repeat(records, 1)
    y0 = torch.zeros(records, dtype=torch.long)
    thresholds = None
    if mode == "threshold":
        thresholds = {path: radius / 2.0 for path in ("1", "3", "5")}
    spec = {
        "scaling": mode,
        "noise": noise,
        "thresholds": thresholds,
        "allow_unproven": allow_unproven,
    }
    engine, model, opt = make_audited(
        model, loss, (x0, y0), noise_seed, spec, noise_multiplier=noise_multiplier
    )
    return engine, opt, model, loss, gen, (x0.to(device), y0.to(device))


def _scores(
    plan: Any,
    generator: torch.Generator,
    sums: Mapping[str, torch.Tensor],
    means0: Mapping[str, torch.Tensor],
    w: Mapping[str, torch.Tensor],
    trials: int,
    steps: int,
) -> NDArray[np.float64]:
    """The likelihood-ratio score of ``trials`` simulated releases of ``sums`` (``steps`` noisy
    copies each), in blocks of about 8,192 draws."""
    from clipless.optim import draw_noise

    names = list(plan.names)
    dtype = sums[names[0]].dtype
    out = np.zeros(trials, dtype=np.float64)
    block = max(1, 8192 // steps)
    for start in range(0, trials, block):
        k = min(block, trials - start)
        total = torch.zeros(k, dtype=torch.float64, device=generator.device)
        for n in names:
            shape = (k * steps, *sums[n].shape)
            noise_draws = draw_noise(plan, n, shape, generator, dtype)
            released = (sums[n] + noise_draws) / plan.expected_batch_size
            centred = (released - means0[n]).reshape(k, steps, -1)
            total += (centred * w[n].reshape(1, 1, -1)).sum(dim=(1, 2)).double()
        out[start : start + k] = total.cpu().numpy()
    return out
