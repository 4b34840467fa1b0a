"""``PrivacyEngine``: the one front door to clipless DP training.

``make_private`` validates the model (every module must have a certified Lipschitz bound), replaces
the data loader by a Poisson-sampling loader (DESIGN.md, "Adjacency and normalisation"), switches
the loss to ``reduction="sum"`` (the optimizer divides by the expected batch size), calibrates the
noise for a target ``(epsilon, delta)`` if asked, projects the initial weights, and wraps the
optimizer in a :class:`clipless.optim.DPOptimizer`. Accounting lives in a
:class:`clipless.accounting.PrivacyLedger` (torch-free) that records every step.

The mechanism is Clipless DP-SGD (seed Algorithm 1) with ``scaling="bound"`` and Lip-DP-SGD
(thesis Algorithm 8) with ``scaling="per-sample"`` / ``"threshold"`` and ``constraint="clip"`` or
``"fix"``; they are modes of one implementation.
"""

from __future__ import annotations

import math
import os
import secrets
import warnings
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.utils.data import DataLoader

from clipless import accounting
from clipless.optim import CONSTRAINTS, NOISE_STRATEGIES, DPOptimizer
from clipless.scaling import SCALING_MODES

__all__ = ["PrivacyEngine"]

NEIGHBOURING = ("add_remove", "replace_one")


class PrivacyEngine:
    """Make a model, optimizer and data loader differentially private.

    >>> engine = PrivacyEngine(accountant="pld")          # doctest: +SKIP
    >>> model, optimizer, loader = engine.make_private(   # doctest: +SKIP
    ...     module=model, optimizer=optimizer, data_loader=loader, loss=loss,
    ...     target_epsilon=1.0, target_delta=1e-5, epochs=10)
    >>> engine.get_epsilon(1e-5)                           # doctest: +SKIP
    """

    def __init__(self, accountant: str = "pld", *, seed: int | None = None) -> None:
        if accountant not in ("pld", "rdp"):
            raise ValueError(f"accountant must be 'pld' or 'rdp'; got {accountant!r}")
        self.accountant = accountant
        self.seed = seed
        self.ledger: accounting.PrivacyLedger | None = None
        self.optimizer: DPOptimizer | None = None
        self.unproven = False
        self.data_loader: DataLoader[Any] | None = None
        self._config: dict[str, Any] = {}

    # ------------------------------------------------------------------ setup
    def make_private(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        loss: torch.nn.Module,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        epochs: int | None = None,
        steps: int | None = None,
        max_norm: float = 1.0,
        constraint: str | None = "clip",
        scaling: str = "per-sample",
        noise: str = "global",
        neighbouring: str = "add_remove",
        thresholds: Mapping[str, float] | None = None,
        allow_unproven: bool = False,
        input_shape: tuple[int, ...] | None = None,
        sample_rate: float | None = None,
        ledger_path: str | os.PathLike[str] | None = None,
        certify_every: int = 1,
    ) -> tuple[torch.nn.Module, DPOptimizer, DataLoader[Any]]:
        """Return ``(module, optimizer, data_loader)`` ready for private training.

        Give either ``noise_multiplier`` (``sigma``; with ``noise="per-layer"`` every parameter
        tensor gets ``sigma`` and the step's effective multiplier is ``sigma / sqrt(D)``) or
        ``target_epsilon`` and ``target_delta`` with ``epochs`` (or ``steps``), in which case the
        smallest effective multiplier meeting the target is calibrated. ``neighbouring`` is
        ``"add_remove"`` (default) or ``"replace_one"`` (doubles every sensitivity).
        With ``ledger_path`` the privacy ledger is written (atomically) before every step's noise
        is drawn, so a crash never loses accounting. ``certify_every=k`` lets the projection
        carry a certified bound (``ub + ||dW||_F``, :func:`clipless.constraints.project`) between
        exact certifications, which are the dominant per-step cost for large layers.
        """
        from clipless import bounds, constraints, nn, sampling

        if self.optimizer is not None:
            raise RuntimeError("this PrivacyEngine already made a model private; use a new engine")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
        nn.validate(module)
        if not hasattr(loss, "lipschitz"):
            raise TypeError(
                f"loss must be a clipless loss with a certified lipschitz() (e.g. "
                f"clipless.nn.CrossEntropyLoss); got {type(loss).__name__}"
            )
        if scaling not in SCALING_MODES:
            raise ValueError(f"scaling must be one of {SCALING_MODES}; got {scaling!r}")
        if scaling == "batch-max" and not allow_unproven:
            raise ValueError(
                "scaling='batch-max' is not differentially private (thesis Algorithm 8 line 11 "
                "rescales every sample by the batch maximum); pass allow_unproven=True to use it "
                "for reproduction only"
            )
        if noise not in NOISE_STRATEGIES:
            raise ValueError(f"noise must be one of {NOISE_STRATEGIES}; got {noise!r}")
        if neighbouring not in NEIGHBOURING:
            raise ValueError(f"neighbouring must be one of {NEIGHBOURING}; got {neighbouring!r}")
        if constraint is not None and constraint not in CONSTRAINTS:
            raise ValueError(f"constraint must be one of {CONSTRAINTS} or None; got {constraint!r}")
        if not (isinstance(max_norm, int | float) and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be a finite number > 0; got {max_norm!r}")
        if (
            isinstance(certify_every, bool)
            or not isinstance(certify_every, int)
            or certify_every < 1
        ):
            raise ValueError(f"certify_every must be an integer >= 1; got {certify_every!r}")
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier or target_epsilon")

        if isinstance(data_loader, sampling.PoissonDataLoader) and sample_rate is None:
            loader = data_loader
        else:
            # The batch choice must be secret (amplification by subsampling): the sampler draws
            # from the OS CSPRNG unless this engine was given a seed (reproducible experiments).
            sampler_gen = None
            if self.seed is not None:
                sampler_gen = torch.Generator().manual_seed(self.seed + 1)
            loader = sampling.as_poisson_loader(
                data_loader, sample_rate=sample_rate, generator=sampler_gen
            )
        q = loader.sample_rate
        n = loader.num_samples
        if input_shape is None:
            input_shape = _infer_input_shape(loader)
        num_tensors = sum(1 for p in module.parameters() if p.requires_grad)
        if num_tensors == 0:
            raise ValueError("module has no trainable parameters")

        if getattr(loss, "reduction", "sum") != "sum":
            setattr(loss, "reduction", "sum")  # noqa: B010 - typed as Tensor | Module

        if target_epsilon is not None:
            if target_delta is None:
                raise ValueError("target_delta is required with target_epsilon")
            total_steps = _total_steps(epochs, steps, q)
            # calibrate_noise works in dp_accounting's convention (std / one example's bound G);
            # our multipliers are relative to the sensitivity Delta = factor * G.
            sigma_eff = accounting.calibrate_noise(
                target_epsilon,
                target_delta,
                q,
                total_steps,
                accountant=cast(accounting.AccountantKind, self.accountant),
                neighbouring=cast(accounting.Neighbouring, neighbouring),
            ) / _sensitivity_factor(neighbouring)
            sigma = sigma_eff if noise == "global" else sigma_eff * math.sqrt(num_tensors)
        else:
            assert noise_multiplier is not None
            sigma = float(noise_multiplier)

        self.ledger = accounting.PrivacyLedger(
            accountant=cast(accounting.AccountantKind, self.accountant),
            neighbouring=cast(accounting.Neighbouring, neighbouring),
        )
        # The initial weights are public; projecting them is free.
        if constraint is not None:
            constraints.project(module, mode=constraint, max_norm=max_norm)  # type: ignore[arg-type]
        generator = torch.Generator(device="cpu")
        generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        self.unproven = scaling == "batch-max"
        # Validate that every parameter is covered by a certified bound before training starts.
        bounds.sensitivities(module, loss, tuple(input_shape))
        self.optimizer = DPOptimizer(
            optimizer,
            module=module,
            loss=loss,
            input_shape=tuple(input_shape),
            noise_multiplier=sigma,
            sample_rate=q,
            num_samples=n,
            ledger=self.ledger,
            noise=noise,
            scaling=scaling,
            thresholds=thresholds,
            allow_unproven=allow_unproven,
            constraint=constraint,
            max_norm=max_norm,
            sensitivity_factor=_sensitivity_factor(neighbouring),
            generator=generator,
            ledger_path=ledger_path,
            certify_every=certify_every,
        )
        self.data_loader = loader
        self._config = {
            "noise_multiplier": sigma,
            "effective_noise_multiplier": self.optimizer.effective_noise_multiplier,
            "sample_rate": q,
            "num_samples": n,
            "noise": noise,
            "scaling": scaling,
            "constraint": constraint,
            "max_norm": max_norm,
            "neighbouring": neighbouring,
            "accountant": self.accountant,
        }
        return module, self.optimizer, loader

    # ------------------------------------------------------------- accounting
    def _ledger(self) -> accounting.PrivacyLedger:
        if self.ledger is None:
            raise RuntimeError("call make_private first")
        return self.ledger

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (recomputed from the ledger)."""
        if self.unproven:
            warnings.warn(
                "scaling='batch-max' is not differentially private: this epsilon is NOT a DP "
                "guarantee",
                stacklevel=2,
            )
        return self._ledger().epsilon(delta)

    def would_exceed(self, epsilon_budget: float, delta: float, count: int = 1) -> bool:
        """True if ``count`` more steps would push epsilon above ``epsilon_budget``."""
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("call make_private first")
        return self._ledger().would_exceed(
            epsilon_budget, delta, opt.accounting_noise_multiplier, opt.sample_rate, count=count
        )

    def guarantee(self, delta: float) -> accounting.PrivacyGuarantee:
        """A frozen description of what has been spent so far."""
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("call make_private first")
        ledger = self._ledger()
        return accounting.PrivacyGuarantee(
            epsilon=ledger.epsilon(delta),
            delta=delta,
            accountant=self.accountant,
            neighbouring=self._config["neighbouring"],
            sample_rate=opt.sample_rate,
            noise_multiplier=opt.accounting_noise_multiplier,
            steps=ledger.steps,
            mechanism=(
                f"Poisson-subsampled Gaussian, clipless {self._config['scaling']} scaling, "
                f"{self._config['noise']} noise"
            ),
            is_dp_guarantee=not self.unproven,
        )

    @property
    def config(self) -> dict[str, Any]:
        """The public hyper-parameters of the mechanism."""
        return dict(self._config)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("call make_private first")
        state: dict[str, Any] = {
            "ledger": self._ledger().to_dict(),
            "generator": opt.generator.get_state(),
            "config": dict(self._config),
        }
        sampler_gen = _sampler_generator(self.data_loader)
        if sampler_gen is not None:
            state["sampler_generator"] = sampler_gen.get_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("call make_private first (with the same arguments), then load")
        ledger = accounting.PrivacyLedger.from_dict(state["ledger"])
        if (ledger.accountant, ledger.neighbouring) != (
            self._ledger().accountant,
            self._ledger().neighbouring,
        ):
            raise ValueError("checkpoint ledger uses a different accountant or neighbouring")
        self.ledger = ledger
        opt.ledger = ledger
        opt.generator.set_state(state["generator"])
        sampler_gen = _sampler_generator(self.data_loader)
        if sampler_gen is not None and "sampler_generator" in state:
            sampler_gen.set_state(state["sampler_generator"])


def _sampler_generator(loader: DataLoader[Any] | None) -> torch.Generator | None:
    sampler = getattr(loader, "batch_sampler", None)
    gen = getattr(sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def _sensitivity_factor(neighbouring: str) -> float:
    """Replace-one: one example's contribution g becomes g' with ``||g - g'|| <= 2 G``.

    The noise std is ``sigma * Delta`` with ``Delta = 2 G``; the ledger records ``2 sigma`` under
    dp_accounting's REPLACE_ONE relation, whose multiplier is relative to ``G`` (see
    :attr:`clipless.optim.DPOptimizer.accounting_noise_multiplier`). At sampling rate 1 this makes
    the epsilon of ``(replace_one, sigma)`` equal to that of ``(add_remove, sigma)``.
    """
    return 2.0 if neighbouring == "replace_one" else 1.0


def _total_steps(epochs: int | None, steps: int | None, q: float) -> int:
    if steps is not None:
        if steps <= 0:
            raise ValueError(f"steps must be a positive integer; got {steps}")
        return int(steps)
    if epochs is None:
        raise ValueError("epochs (or steps) is required with target_epsilon")
    if epochs <= 0:
        raise ValueError(f"epochs must be a positive integer; got {epochs}")
    return int(epochs) * max(1, round(1.0 / q))


def _infer_input_shape(loader: DataLoader[Any]) -> tuple[int, ...]:
    dataset = loader.dataset
    try:
        first = dataset[0]
    except Exception as exc:
        raise ValueError("cannot infer input_shape from the dataset; pass input_shape=") from exc
    x = first[0] if isinstance(first, tuple | list) else first
    return tuple(torch.as_tensor(x).shape)
