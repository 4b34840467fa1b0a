"""A DP optimizer that wraps any :class:`torch.optim.Optimizer` without per-sample gradients.

DESIGN.md, "Training: the mathematics"; Clipless DP-SGD (seed Algorithm 1, "local" and "global"
noise) and Lip-DP-SGD (thesis Algorithm 8). One step:

1. the model's backward has produced, for every parameter tensor ``p``, the *sum* over the
   Poisson batch of the per-sample (scaled) gradients, each of L2 norm at most ``Delta_p``: the
   cotangent bound ``G_k`` of its layer (:mod:`clipless.scaling`, :mod:`clipless.bounds`),
   computed from the weights the forward used (public: they are the output of earlier private
   steps);
2. Gaussian noise of standard deviation ``sigma_p * Delta_p`` is added to each tensor's sum;
3. the noisy sum is divided by the *expected* batch size ``q N`` (never the realised one, which is
   private under Poisson sampling);
4. the wrapped optimizer steps; then the weights are projected (``clip`` / ``fix`` /
   ``orthogonal``, :func:`clipless.constraints.project`), which is post-processing;
5. the step is recorded in the privacy ledger as one Poisson-subsampled Gaussian mechanism with the
   effective noise multiplier ``sigma_eff = (sum_p sigma_p^-2)^(-1/2)``.

Noise strategies: ``"global"`` gives every tensor the same standard deviation ``sigma * G`` with
``G = sqrt(sum_k Delta_k^2)`` over layers (one Gaussian mechanism on the concatenated gradient,
``sigma_eff = sigma``); ``"per-layer"`` gives tensor ``p`` the standard deviation
``sigma * Delta_p`` (``sigma_eff = sigma / sqrt(D)`` over ``D`` parameter tensors). Both are
the same mechanism.

The noise comes from :func:`torch.normal` with a dedicated :class:`torch.Generator` seeded from the
operating system's CSPRNG (``secrets``) unless a seed is given. Like Opacus without ``secure_mode``,
floating-point Gaussian sampling is not hardened against the attacks of Mironov (2012); the
statistical release of :mod:`clipless.stats` uses exact discrete samplers instead.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from clipless import scaling as _scaling

if TYPE_CHECKING:
    from clipless.accounting import PrivacyLedger
    from clipless.bounds import BoundReport

__all__ = ["CONSTRAINTS", "NOISE_STRATEGIES", "DPOptimizer", "NoiseStrategy"]

NoiseStrategy = Literal["global", "per-layer"]
NOISE_STRATEGIES: tuple[str, ...] = ("global", "per-layer")
CONSTRAINTS: tuple[str, ...] = ("clip", "fix", "orthogonal")


class DPOptimizer(torch.optim.Optimizer):
    """Differentially private wrapper around ``optimizer`` (see the module docstring).

    Built by :meth:`clipless.PrivacyEngine.make_private`; it shares ``param_groups`` and ``state``
    with the wrapped optimizer, so learning-rate schedulers and ``state_dict`` work as usual.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: torch.nn.Module,
        loss: torch.nn.Module,
        input_shape: tuple[int, ...],
        noise_multiplier: float,
        sample_rate: float,
        num_samples: int,
        ledger: PrivacyLedger,
        noise: str = "global",
        scaling: str = "per-sample",
        thresholds: Mapping[str, float] | None = None,
        allow_unproven: bool = False,
        constraint: str | None = "clip",
        max_norm: float = 1.0,
        sensitivity_factor: float = 1.0,
        generator: torch.Generator | None = None,
        ledger_path: str | os.PathLike[str] | None = None,
        certify_every: int = 1,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}"
            )
        if noise not in NOISE_STRATEGIES:
            raise ValueError(f"noise must be one of {NOISE_STRATEGIES}; got {noise!r}")
        if constraint is not None and constraint not in CONSTRAINTS:
            raise ValueError(f"constraint must be one of {CONSTRAINTS} or None; got {constraint!r}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(
                f"noise_multiplier must be a finite number > 0; got {noise_multiplier}"
            )
        if not (0.0 < sample_rate <= 1.0):
            raise ValueError(f"sample_rate must be in (0, 1]; got {sample_rate}")
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be a finite number > 0; got {max_norm}")
        self.original_optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = {}
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = {}
        self.module = module
        self.loss = loss
        self.input_shape = tuple(input_shape)
        self.noise_multiplier = float(noise_multiplier)
        self.noise = noise
        self.sample_rate = float(sample_rate)
        self.num_samples = int(num_samples)
        self.expected_batch_size = self.sample_rate * self.num_samples
        self.ledger = ledger
        self.scaling = scaling
        self.thresholds = dict(thresholds) if thresholds is not None else None
        self.allow_unproven = allow_unproven
        self.constraint = constraint
        self.max_norm = float(max_norm)
        self.sensitivity_factor = float(sensitivity_factor)
        if generator is None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(secrets.randbits(63))
        self.generator = generator
        self.ledger_path = ledger_path
        self.certify_every = int(certify_every)
        self._names = self._parameter_names()
        self.refresh()

    # ------------------------------------------------------------------ bounds
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        by_param = {p: n for n, p in self.module.named_parameters()}
        names: dict[torch.nn.Parameter, str] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p not in by_param:
                    raise ValueError(
                        "optimizer holds a parameter that is not in module; every optimised "
                        "parameter needs a certified sensitivity"
                    )
                names[p] = by_param[p]
        return names

    def bound_report(self) -> BoundReport:
        """The certified bounds at the current weights.

        Recomputed on every call (a one-sample forward): the expensive part, each layer's
        certified norm, is memoised by the layer on an exact copy of its weight, so a weight
        changed by any means (even through ``.data``) is always recertified.
        """
        from clipless import bounds

        return bounds.report(self.module, self.loss, self.input_shape)

    def refresh(self) -> None:
        """Recompute bounds at the current weights and set the scaling thresholds for them."""
        report = self.bound_report()
        values = _scaling.thresholds_for(
            report, self.scaling, self.thresholds, allow_unproven=self.allow_unproven
        )
        _scaling.apply_thresholds(self.module, values)

    def sensitivities(self, report: BoundReport | None = None) -> dict[str, float]:
        """``Delta_p`` per parameter name: the L2 bound on one sample's scaled contribution.

        Under the scaling modes every parameter of layer ``k`` has sensitivity ``G_k``, times
        ``sensitivity_factor`` (2 for replace-one neighbours, DESIGN.md "Adjacency").
        ``report`` defaults to the bounds at the current weights.
        """
        report = report if report is not None else self.bound_report()
        out: dict[str, float] = {}
        for lb in report.layers:
            # A layer used several times contributes once per use: the bounds add up.
            for name in lb.gradient_bounds:
                out[name] = out.get(name, 0.0) + lb.cotangent_bound * self.sensitivity_factor
        return out

    def layer_sensitivities(self, report: BoundReport | None = None) -> dict[str, float]:
        """Joint sensitivity of each parametric layer's optimised parameters (path -> bound).

        The scaling divides a sample's contribution to a layer's weight *and* bias jointly by
        ``max(n_i, T_k)`` with ``n_i`` bounding the joint gradient norm (``sqrt(||x||^2 + 1)`` for
        a dense layer with a bias), so the concatenated (weight, bias) contribution has norm at
        most ``G_k`` (times the neighbouring factor), not ``sqrt(2) G_k``.
        """
        report = report if report is not None else self.bound_report()
        optimised = set(self._names.values())
        out: dict[str, float] = {}
        for lb in report.layers:
            if any(name in optimised for name in lb.gradient_bounds):
                out[lb.path] = out.get(lb.path, 0.0) + lb.cotangent_bound * self.sensitivity_factor
        return out

    def noise_stds(self) -> dict[str, float]:
        """Standard deviation of the Gaussian noise added to each parameter's summed gradient.

        ``global``: one Gaussian mechanism on the concatenation of all optimised gradients, whose
        L2 sensitivity is ``G = sqrt(sum_k Delta_k^2)`` over layers (:meth:`layer_sensitivities`);
        every tensor gets std ``sigma G``. ``per-layer``: tensor ``p`` gets ``sigma Delta_p``.
        """
        report = self.bound_report()
        delta = self.sensitivities(report)
        names = list(self._names.values())
        missing = [n for n in names if n not in delta]
        if missing:
            raise ValueError(f"no certified sensitivity for parameters {missing}")
        if self.noise == "global":
            layers = self.layer_sensitivities(report)
            total = math.sqrt(math.fsum(v**2 for v in layers.values()))
            return dict.fromkeys(names, self.noise_multiplier * total)
        return {n: self.noise_multiplier * delta[n] for n in names}

    @property
    def effective_noise_multiplier(self) -> float:
        """``sigma_eff`` of the whole step, relative to the sensitivities ``Delta_p``."""
        if self.noise == "global":
            return self.noise_multiplier
        return self.noise_multiplier / math.sqrt(len(self._names))

    @property
    def accounting_noise_multiplier(self) -> float:
        """The multiplier recorded in the ledger: noise std over one example's norm bound ``G``.

        This is ``dp_accounting``'s convention (its ``REPLACE_ONE`` relation itself accounts for
        a difference of ``2 G`` between an example and its replacement), so under replace-one,
        where ``Delta_p = 2 G_p``, it is ``2 sigma_eff``; under add/remove it is ``sigma_eff``.
        """
        return self.effective_noise_multiplier * self.sensitivity_factor

    # -------------------------------------------------------------------- step
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def add_noise(self) -> None:
        """Add the calibrated noise to every gradient and divide by the expected batch size."""
        stds = self.noise_stds()
        for p, name in self._names.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            noise = torch.normal(
                0.0, stds[name], size=p.shape, generator=self.generator, device="cpu"
            )
            p.grad.add_(noise.to(device=p.device, dtype=p.grad.dtype))
            p.grad.div_(self.expected_batch_size)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Noise, inner step, projection, accounting (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Write-ahead accounting: the step is recorded (and persisted, with a ledger_path) before
        # any noisy value exists, so a crash can only over-count, never under-count.
        self.ledger.record(self.accounting_noise_multiplier, self.sample_rate)
        if self.ledger_path is not None:
            self.ledger.to_json(self.ledger_path)
        self.add_noise()
        self.original_optimizer.step()
        if self.constraint is not None:
            from clipless import constraints

            constraints.project(
                self.module,
                mode=self.constraint,  # type: ignore[arg-type]
                max_norm=self.max_norm,
                certify_every=self.certify_every,
            )
        self.refresh()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (
            f"DPOptimizer({type(self.original_optimizer).__name__}, noise={self.noise!r}, "
            f"noise_multiplier={self.noise_multiplier}, sample_rate={self.sample_rate}, "
            f"scaling={self.scaling!r}, constraint={self.constraint!r}, max_norm={self.max_norm})"
        )
