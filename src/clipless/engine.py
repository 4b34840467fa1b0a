"""``PrivacyEngine``: the one front door to clipless DP training.

``make_private`` validates the model (every module must have a certified Lipschitz bound), replaces
the data loader by a Poisson-sampling loader (docs/design.md, "Adjacency and normalisation"),
switches the loss to ``reduction="sum"`` (the optimizer divides by the expected batch size),
calibrates the noise for a target ``(epsilon, delta)`` if asked, projects the initial weights, and
wraps the optimizer in a :class:`clipless.optim.DPOptimizer`. Accounting lives in a
:class:`clipless.accounting.PrivacyLedger` (torch-free) that records every step.

The mechanism is Clipless DP-SGD (Béthune et al. 2024, Algorithm 1) with ``scaling="bound"`` and
Lip-DP-SGD (thesis Algorithm 8) with ``scaling="per-sample"`` / ``"threshold"`` and
``constraint="clip"`` or ``"fix"``; they are modes of one implementation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch.utils.data import DataLoader

from clipless import _validate, accounting, bounds, constraints, mechanism, models, sampling
from clipless._io import atomic_write_with
from clipless._records import refuse_repeated_records
from clipless.allocation import get_allocation
from clipless.mechanism import MechanismSpec, PrivacyConfig
from clipless.nn import ParametricLipschitzModule
from clipless.norms import all_finite
from clipless.optim import DPOptimizer, switch_to_full_float32

__all__ = ["CheckpointMismatchError", "MechanismSpec", "PrivacyEngine", "RunOptions"]


_OPACUS_ONLY: dict[str, str] = {
    "max_grad_norm": (
        "there is no per-sample gradient clipping in clipless: each layer's sensitivity is "
        "certified from the Lipschitz bounds of the (public) weights and the loss constant. The "
        "logit-level analogue of a clipping threshold is a clipless.nn.LossGradientClip(c) layer "
        "at the end of the model; scaling='threshold' bounds the layer-input norms instead"
    ),
    "clipping": "there is no clipping (see max_grad_norm); choose scaling= instead",
    "grad_sample_mode": "no per-sample gradients are computed: the step costs a normal backward",
    "batch_first": "inputs are always [batch, ...]",
    "loss_reduction": (
        "give the loss to make_private(loss=...): it is switched to reduction='sum' and the noisy "
        "sum is divided by the expected batch size"
    ),
    "noise_generator": "pass PrivacyEngine(seed=...) for reproducible experiments",
    "clip_per_layer": "there is no clipping; noise='per-layer' allocates noise per tensor",
    "total_steps": "use steps=",
}


_DEFAULT_THREADS = torch.get_num_threads()  # torch's default, unless set before the import

_ACCOUNTANT_HINTS = {
    "prv": (
        " (Opacus's default, privacy random variables): use accountant='pld', the default here, "
        "privacy loss distributions, the tight numerical accountant that is PRV's counterpart"
    ),
    "gdp": (
        " (Opacus's Gaussian accountant rests on a central-limit approximation, not a certified "
        "upper bound): use accountant='pld'"
    ),
}


class CheckpointMismatchError(ValueError):
    """A checkpoint (or ledger file) that does not belong to this engine's run.

    Raised by :meth:`PrivacyEngine.load_state_dict`: another accountant or neighbouring relation,
    another privacy configuration, a ledger file that does not continue the checkpoint's, or a
    checkpoint older than what this engine already recorded. Nothing has changed when it is
    raised.
    """


class PrivacyEngine:
    """Make a model, optimizer and data loader differentially private.

    >>> engine = PrivacyEngine(accountant="pld")          # doctest: +SKIP
    >>> model, optimizer, loader = engine.make_private(   # doctest: +SKIP
    ...     module=model, optimizer=optimizer, data_loader=loader, loss=loss,
    ...     target_epsilon=1.0, target_delta=1e-5, epochs=10)
    >>> engine.get_epsilon(1e-5)                           # doctest: +SKIP

    Args:
        accountant: ``"pld"`` (privacy loss distributions, the default) or ``"rdp"`` (Renyi DP,
            cheaper and looser); :mod:`clipless.accounting`.
        seed: seeds the noise generator (``seed``) and the Poisson sampler (``seed + 1``), an
            int in ``[0, 2**63 - 1)``, for reproducible experiments only (warns: whoever knows
            it can remove the noise). ``None`` (default): both seeded from the OS CSPRNG.
        secure_mode: Opacus's flag; only ``False`` is accepted (a cryptographically secure
            generator with hardened floating-point noise is not implemented).

    Raises:
        ValueError: an unknown accountant (Opacus's ``"prv"`` / ``"gdp"`` with the nearest
            choice), ``secure_mode=True`` or a seed out of range.
        TypeError: a seed that is not an int.

    After ``make_private``, :attr:`accountant` is the :class:`clipless.accounting.PrivacyLedger`
    (``engine.accountant.get_epsilon(delta)`` works as in Opacus) and :attr:`config` the frozen
    :class:`clipless.mechanism.PrivacyConfig`.
    """

    def __init__(
        self, accountant: str = "pld", *, seed: int | None = None, secure_mode: bool = False
    ) -> None:
        if accountant not in mechanism.ACCOUNTANTS:
            hint = _ACCOUNTANT_HINTS.get(accountant, "") if isinstance(accountant, str) else ""
            raise ValueError(f"accountant must be 'pld' or 'rdp'; got {accountant!r}{hint}")
        if secure_mode:
            raise ValueError(
                "secure_mode=True is not supported (the generators are seeded from the OS CSPRNG "
                "but are not cryptographically secure, nor is the floating-point noise hardened "
                "against Mironov 2012)"
            )
        if seed is not None and not _validate.is_int(seed):
            raise TypeError(f"seed must be an int or None; got {type(seed).__name__}")
        if seed is not None and not 0 <= seed < 2**63 - 1:
            # the noise generator takes seed, the Poisson sampler seed + 1 (torch: < 2^64)
            raise ValueError(f"seed must be an int in [0, 2**63 - 1) or None; got {seed!r}")
        if seed is not None:
            warnings.warn(
                f"PrivacyEngine(seed={seed}) makes the noise and the batches a function of the "
                "seed: anyone who learns or guesses it can remove the noise. Use it for "
                "reproducible experiments only, and seed=None (the OS CSPRNG) for a release; "
                "the guarantee's mechanism says the generators were seeded",
                stacklevel=2,
            )
        self.accountant_kind = accountant
        self.seed = seed
        self.ledger = accounting.PrivacyLedger(
            accountant=cast(accounting.AccountantKind, accountant)
        )
        self.optimizer: DPOptimizer | None = None
        self.data_loader: DataLoader[Any] | None = None
        self._config: PrivacyConfig | None = None
        self._target_delta: float | None = None

    @property
    def accountant(self) -> accounting.PrivacyLedger:
        """The privacy ledger (Opacus: ``engine.accountant.get_epsilon(delta)``)."""
        return self.ledger

    @property
    def unproven(self) -> bool:
        """``True`` when the mechanism has no DP proof (``scaling="batch-max"``)."""
        return self._config is not None and not self._config.proven

    # ------------------------------------------------------------------ setup
    def make_private(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        loss: torch.nn.Module | None = None,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        epochs: int | None = None,
        steps: int | None = None,
        mechanism: MechanismSpec | None = None,
        options: RunOptions | None = None,
        max_grad_norm: float | None = None,
        poisson_sampling: bool = True,
        **opacus_options: Any,
    ) -> tuple[torch.nn.Module, DPOptimizer, DataLoader[Any]]:
        """Return ``(module, optimizer, data_loader)`` ready for private training.

        Args:
            module, optimizer, data_loader: the model (every module with a certified Lipschitz
                bound), its optimizer (every parameter it holds is noised) and the training
                data's loader, replaced by a Poisson loader of the same expected batch size.
                Its sampler must be torch's default (sequential or shuffling): one that selects
                or weights records is refused (pass a ``torch.utils.data.Subset``), as is a
                dataset reaching one record through two indices (:mod:`clipless._records`).
            loss: a clipless loss (Opacus's ``criterion=``): its certified Lipschitz constant
                enters the noise; it is switched to ``reduction="sum"`` (the optimizer divides
                by the expected batch size), so backpropagate this instance.
            noise_multiplier: ``sigma`` (with ``noise="per-layer"`` every noised tensor gets
                ``sigma`` and the step's effective multiplier is ``sigma / sqrt(D)``). Give it,
                or ``target_epsilon`` and ``target_delta`` with ``epochs`` (or ``steps``): the
                smallest multiplier meeting the target is calibrated and the run planned for
                that many steps (the optimizer refuses a step past the plan; ``extend``
                re-plans). A ``target_delta`` (or a ``delta`` read later) above ``1 / n`` warns.
            mechanism: the :class:`clipless.mechanism.MechanismSpec` (noise allocation,
                scaling, constraint, neighbouring relation, ...; default ``MechanismSpec()``).
            options: the :class:`RunOptions` that do not change the mechanism (ledger file,
                certification schedule, data validation, input shape; default
                ``RunOptions()``).
            max_grad_norm, poisson_sampling: Opacus's keywords, refused with the reason
                (there is no clipping; sampling is always Poisson).

        The keywords ``noise``, ``scaling``, ``constraint``, ``max_norm``, ``neighbouring``,
        ``thresholds``, ``allow_unproven``, ``sample_rate`` (now ``mechanism=``) and
        ``ledger_path``, ``certify_every``, ``validate_data``, ``allow_mean_reduced_loss``,
        ``input_shape`` (now ``options=``) are still accepted, with a ``DeprecationWarning``.

        Returns:
            The module (its initial weights projected by the constraint), a
            :class:`clipless.optim.DPOptimizer` and the Poisson data loader.

        Raises:
            ValueError, TypeError: a model without certified bounds, a plain torch loss, a
                mode without a DP proof unless allowed, contradictory arguments, a record that
                would make a step fail (``options.validate_data``).

        A model whose :class:`clipless.nn.InputNorm` carries a released mean or moment has
        that release composed with the steps in the calibration and recorded in the ledger
        before the first step, so the target epsilon covers both. The optimizer enforces the
        contract the noise relies on (:mod:`clipless.optim`).
        """
        if self.optimizer is not None:
            raise RuntimeError("this PrivacyEngine already made a model private; use a new engine")
        loss = _loss_argument(loss, opacus_options)
        spec, opts = moved_keywords(mechanism, options, opacus_options, stacklevel=3)
        _refuse_opacus_options(opacus_options, max_grad_norm, poisson_sampling)
        _check_setup(module, optimizer, loss, spec, noise_multiplier, target_epsilon)
        budget = _Budget(noise_multiplier, target_epsilon, target_delta, epochs, steps)
        _check_budget(budget, spec)
        loader = self._poisson_loader(data_loader, spec.sample_rate)
        input_shape = _shape_tuple(
            _infer_input_shape(loader) if opts.input_shape is None else opts.input_shape
        )
        noised = _noised(module, optimizer)
        _prepare_loss(loss)
        planned = budget.planned_steps(loader.sample_rate)
        # Everything the step relies on is checked before any state changes.
        report = bounds.report(module, loss, input_shape)
        config = self._prepare_config(module, noised, report, spec, loader, budget, planned)
        _prepare_data(loader, report, loss, module, opts)
        self._start_ledger(module, spec.neighbouring)
        _prepare_module(module, spec)
        self.optimizer = self._prepare_optimizer(
            optimizer, module, loss, input_shape, config, opts, loader, noised
        )
        _warn_default_threads(module)
        self._target_delta = target_delta
        self._config = config
        self.data_loader = loader
        return module, self.optimizer, loader

    def _prepare_config(
        self,
        module: torch.nn.Module,
        noised: list[torch.nn.Parameter],
        report: bounds.BoundReport,
        spec: MechanismSpec,
        loader: sampling.PoissonDataLoader,
        budget: _Budget,
        planned: int | None,
    ) -> PrivacyConfig:
        """The run's :class:`PrivacyConfig` for ``planned`` steps, its multiplier calibrated
        when a target is given."""
        q, n = loader.sample_rate, loader.num_samples
        config = self._config_for(
            module, noised, report, spec, q, n, planned, budget.noise_multiplier
        )
        if budget.target_epsilon is None:
            return config
        if budget.target_delta is None:
            raise ValueError("target_delta is required with target_epsilon")
        _warn_large_delta(budget.target_delta, n, "target_delta", stacklevel=4)
        assert planned is not None
        return config.calibrate(budget.target_epsilon, budget.target_delta, planned)

    def _prepare_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        module: torch.nn.Module,
        loss: torch.nn.Module,
        input_shape: tuple[int, ...],
        config: PrivacyConfig,
        opts: RunOptions,
        loader: sampling.PoissonDataLoader,
        noised: list[torch.nn.Parameter],
    ) -> DPOptimizer:
        """The :class:`DPOptimizer` around ``optimizer``, its noise drawn from a generator on
        the parameters' device (seeded only when this engine was)."""
        generator = torch.Generator(device=noised[0].device)
        generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        private = DPOptimizer(
            optimizer,
            module=module,
            loss=loss,
            input_shape=input_shape,
            config=config,
            ledger=self.ledger,
            generator=generator,
            ledger_path=opts.ledger_path,
            certify_every=opts.certify_every,
            data_loader=loader,
        )
        private.allow_mean_reduced_loss = opts.allow_mean_reduced_loss
        return private

    def _poisson_loader(
        self, data_loader: DataLoader[Any], sample_rate: float | None
    ) -> sampling.PoissonDataLoader:
        """``data_loader`` as a Poisson loader (itself when it is one and no rate is given)."""
        if isinstance(data_loader, sampling.PoissonDataLoader) and sample_rate is None:
            return data_loader
        # The batch choice must be secret (amplification by subsampling): the sampler draws
        # from the OS CSPRNG unless this engine was given a seed (reproducible experiments).
        sampler_gen = None
        if self.seed is not None:
            sampler_gen = torch.Generator().manual_seed(self.seed + 1)
        return sampling.as_poisson_loader(
            data_loader, sample_rate=sample_rate, generator=sampler_gen
        )

    def _config_for(
        self,
        module: torch.nn.Module,
        noised: list[torch.nn.Parameter],
        report: bounds.BoundReport,
        spec: MechanismSpec,
        q: float,
        n: int,
        planned: int | None,
        noise_multiplier: float | None,
    ) -> PrivacyConfig:
        """The :class:`PrivacyConfig` of ``spec`` for this model and loader (before calibration:
        multiplier 1 when none is given)."""
        noised_ids = {id(p) for p in noised}
        names = [name for name, p in module.named_parameters() if id(p) in noised_ids]
        # per-layer noise composes one Gaussian mechanism per group of layer uses, not one per
        # tensor (a weight and its bias are one: mechanism.py, "Noise allocation")
        counted = mechanism.per_layer_mechanisms(report, names)
        return PrivacyConfig(
            noise_multiplier=1.0 if noise_multiplier is None else noise_multiplier,
            sample_rate=q,
            num_samples=n,
            num_tensors=len(noised),
            noise=spec.noise,
            scaling=spec.scaling,
            constraint=spec.constraint,
            max_norm=spec.max_norm,
            neighbouring=spec.neighbouring,
            accountant=self.accountant_kind,
            steps=planned,
            thresholds=spec.thresholds,
            allow_unproven=spec.allow_unproven,
            releases=input_releases(module),
            num_mechanisms=get_allocation(spec.noise).num_mechanisms(counted, len(noised)),
        )

    def _start_ledger(self, module: torch.nn.Module, neighbouring: str) -> None:
        """A fresh ledger for this run, holding the releases the model carries."""
        self.ledger = accounting.PrivacyLedger(
            accountant=cast(accounting.AccountantKind, self.accountant_kind),
            neighbouring=cast(accounting.Neighbouring, neighbouring),
            # tells this run's ledger file from another run's with the same mechanism (a resume
            # adopts only a file that continues its own ledger: PrivacyLedger.extends)
            metadata={"run_id": _run_id(self.seed)},
        )
        # spent before the first step (the model carries them)
        for label, sigma in input_release_labels(module):
            self.ledger.record_release(sigma, label=label)

    def make_private_with_epsilon(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        loss: torch.nn.Module | None = None,
        target_epsilon: float,
        target_delta: float,
        epochs: int | None = None,
        steps: int | None = None,
        mechanism: MechanismSpec | None = None,
        options: RunOptions | None = None,
        **opacus_options: Any,
    ) -> tuple[torch.nn.Module, DPOptimizer, DataLoader[Any]]:
        """Opacus's name for :meth:`make_private` with a target ``(epsilon, delta)``.

        Args:
            module, optimizer, data_loader, loss, mechanism, options: as in :meth:`make_private`.
            target_epsilon, target_delta: the budget the smallest noise multiplier is
                calibrated to meet over the planned steps.
            epochs, steps: the plan's length, ``epochs`` passes over the data
                (``epochs * max(1, round(1 / q))`` steps) or ``steps`` steps; one is required.

        Returns:
            As :meth:`make_private`.

        Raises:
            ValueError: a ``noise_multiplier`` (this method calibrates it), or what
                :meth:`make_private` refuses.
        """
        if opacus_options.get("noise_multiplier") is not None:
            raise ValueError(
                "make_private_with_epsilon calibrates the noise: drop noise_multiplier"
            )
        opacus_options.pop("noise_multiplier", None)
        spec, opts = moved_keywords(mechanism, options, opacus_options, stacklevel=3)
        return self.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            loss=loss,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            epochs=epochs,
            steps=steps,
            mechanism=spec,
            options=opts,
            **opacus_options,
        )

    # ------------------------------------------------------------- accounting
    def _opt(self) -> DPOptimizer:
        if self.optimizer is None:
            raise RuntimeError("call make_private first")
        return self.optimizer

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (recomputed from the ledger).

        Args:
            delta: the guarantee's delta, in ``(0, 1)``; above ``1 / n`` warns.

        Returns:
            The smallest epsilon the accountant certifies for the steps and releases recorded.
            A run that used an unproven mode warns that the number is not a DP guarantee.
        """
        if self._config is not None:
            _warn_large_delta(delta, self._config.num_samples, "delta")
        if not self.ledger.is_dp_guarantee or self.unproven:
            warnings.warn(
                "an unproven mode (scaling='batch-max') was used: this epsilon is NOT a DP "
                "guarantee",
                stacklevel=2,
            )
        return self.ledger.epsilon(delta)

    def would_exceed(self, epsilon_budget: float, delta: float, count: int = 1) -> bool:
        """True if ``count`` more steps would push epsilon above ``epsilon_budget``.

        Args:
            epsilon_budget: the epsilon not to exceed.
            delta: the delta at which epsilon is read.
            count: how many more steps of this run's mechanism (default one).

        Raises:
            RuntimeError: before :meth:`make_private`.
        """
        opt = self._opt()
        return self.ledger.would_exceed(
            epsilon_budget, delta, count=count, event=opt.config.step_event()
        )

    @property
    def steps_remaining(self) -> int | None:
        """Steps left in the plan, or ``None`` when no number of steps was planned."""
        return self._opt().steps_remaining

    def extend(self, *, steps: int, delta: float | None = None) -> float | None:
        """Plan ``steps`` more steps at the same noise (an explicit decision to spend more).

        Args:
            steps: how many steps to add to the plan (a positive int), counted from the plan's
                end or from the steps already taken, whichever is later.
            delta: the delta of the returned epsilon; ``None`` (default): ``make_private``'s
                ``target_delta``.

        Returns:
            The epsilon at ``delta`` that the run will have spent at the end of the new plan (it
            exceeds the original target, which is the point), or ``None`` when there is no
            delta (a run given ``noise_multiplier`` and no ``delta`` here).

        Raises:
            ValueError: ``steps`` not a positive int.
            RuntimeError: before :meth:`make_private`.
        """
        if delta is None:
            delta = self._target_delta
        opt = self._opt()
        steps = _validate.positive_int("steps", steps, wrong_type=ValueError)
        config = opt.config
        base = config.steps if config.steps is not None else self.ledger.steps
        new = config.with_steps(max(base, self.ledger.steps) + steps)
        opt.config = new
        self._config = new
        if delta is None:
            return None
        return new.epsilon(delta)

    def guarantee(self, delta: float) -> accounting.PrivacyGuarantee:
        """A frozen description of what has been spent so far, read from the ledger.

        The ledger records each step's ``proven`` flag, so a run that ever used an unproven mode
        reports ``is_dp_guarantee=False`` here, in the saved ledger and in ``ledger.guarantee``.

        Args:
            delta: the guarantee's delta, in ``(0, 1)``; above ``1 / n`` warns.

        Returns:
            The :class:`clipless.accounting.PrivacyGuarantee` (epsilon, delta, steps, accountant,
            neighbouring relation and the mechanism in words).

        Raises:
            RuntimeError: before :meth:`make_private`.
        """
        config = self._opt().config
        _warn_large_delta(delta, config.num_samples, "delta")
        event = config.step_event()
        gaussian = accounting.gaussian_step_event(
            config.accounting_noise_multiplier, config.sample_rate
        )
        kind = "Poisson-subsampled Gaussian" if event == gaussian else f"steps of {event!r}"
        mechanism_name = f"{kind}, clipless {config.scaling} scaling, {config.noise} noise"
        if self.seed is not None:
            mechanism_name += ", generators seeded by the caller (reproducible: experiments only)"
        return self.ledger.guarantee(delta, mechanism=mechanism_name)

    @property
    def config(self) -> dict[str, Any]:
        """The public hyper-parameters of the mechanism (:class:`PrivacyConfig` as a dict)."""
        if self._config is None:
            return {}
        out = self._config.to_dict()
        out["effective_noise_multiplier"] = self._config.effective_noise_multiplier
        return out

    @property
    def privacy_config(self) -> PrivacyConfig:
        """The frozen :class:`clipless.mechanism.PrivacyConfig` of every step."""
        return self._opt().config

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The engine's resumable state (its privacy ledger and noise/sampler generators);
        save it with the model and optimizer and restore it with :meth:`load_state_dict`.

        **Keep it secret** (as secret as the training data): the generator states let whoever
        holds them regenerate every batch choice and noise draw of the run, and so remove the
        noise from the released weights. Publish weights and the ledger, never this state.
        """
        opt = self._opt()
        state: dict[str, Any] = {
            "ledger": self.ledger.to_dict(),
            "generator": opt.generator.get_state(),
            "config": opt.config.to_dict(),
            "bounds": {
                name: layer.bound_state()
                for name, layer in opt.module.named_modules()
                if isinstance(layer, ParametricLipschitzModule)
            },
        }
        sampler_gen = _sampler_generator(self.data_loader)
        if sampler_gen is not None:
            state["sampler_generator"] = sampler_gen.get_state()
        return state

    def save_checkpoint(
        self,
        *,
        path: str | os.PathLike[str],
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        checkpoint_dict: Mapping[str, Any] | None = None,
        **opacus_options: Any,
    ) -> None:
        """Opacus's ``save_checkpoint``: write the model, the optimizer (if given), the engine's
        :meth:`state_dict` and ``checkpoint_dict``'s extra entries to ``path``.

        The file is written atomically and readable by its owner only (``0o600``): it holds the
        noise and sampling generators' states (:meth:`state_dict`: keep it as secret as the
        data). Opacus's scheduler arguments have no counterpart (the noise is planned once).

        Args:
            path: the file to write (replaced atomically).
            module: the model whose ``state_dict`` is saved.
            optimizer: its optimizer, whose ``state_dict`` is saved too (``None``: not saved).
            checkpoint_dict: extra entries stored alongside (epoch counters, schedulers, ...).

        Raises:
            TypeError: an Opacus scheduler or ``torch.save`` keyword (no counterpart here).
            RuntimeError: before :meth:`make_private`.
        """
        _refuse_checkpoint_options(opacus_options)
        state: dict[str, Any] = dict(checkpoint_dict or {})
        state["module_state_dict"] = module.state_dict()
        state["privacy_engine_state_dict"] = self.state_dict()
        if optimizer is not None:
            state["optimizer_state_dict"] = optimizer.state_dict()
        atomic_write_with(path, lambda handle: torch.save(state, handle), mode=0o600)

    def load_checkpoint(
        self,
        *,
        path: str | os.PathLike[str],
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        **opacus_options: Any,
    ) -> dict[str, Any]:
        """Opacus's ``load_checkpoint``: restore what :meth:`save_checkpoint` wrote into
        ``module``, ``optimizer`` and this engine (call :meth:`make_private` with the run's
        arguments first); returns the whole checkpoint dictionary.

        Read with ``torch.load(weights_only=True)``. The engine is restored by
        :meth:`load_state_dict` (the ledger never goes backwards; another run's checkpoint
        raises :class:`CheckpointMismatchError`).

        Args:
            path: a file written by :meth:`save_checkpoint`.
            module: the model to load the saved weights into.
            optimizer: the optimizer to load the saved state into, if saved (``None``: skipped).

        Returns:
            The whole checkpoint dictionary (with ``checkpoint_dict``'s extra entries).

        Raises:
            ValueError: a file that is not a checkpoint of :meth:`save_checkpoint`.
            TypeError: an Opacus scheduler or ``torch.load`` keyword.
            CheckpointMismatchError: another run's checkpoint (:meth:`load_state_dict`).
            RuntimeError: before :meth:`make_private`.
        """
        _refuse_checkpoint_options(opacus_options)
        self._opt()
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or "privacy_engine_state_dict" not in state:
            raise ValueError(f"{os.fspath(path)} is not a checkpoint of save_checkpoint")
        self.load_state_dict(state["privacy_engine_state_dict"])
        module.load_state_dict(state["module_state_dict"])
        if optimizer is not None and "optimizer_state_dict" in state:
            optimizer.load_state_dict(state["optimizer_state_dict"])
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint taken by :meth:`state_dict` of an engine with the same config.

        The ledger never goes backwards: a checkpoint whose ledger has fewer steps than this
        engine has already recorded is refused (those steps were spent). With a ``ledger_path``
        whose file records more than the checkpoint (steps taken after it, before a crash), the
        file's ledger is kept (with a warning) if it continues the checkpoint's ledger
        (:meth:`clipless.accounting.PrivacyLedger.extends`); a file that does not is another
        run's, and :class:`CheckpointMismatchError` is raised, as for another configuration.
        Unless this engine has a ``seed``, the noise and sampler generators are then reseeded
        from the OS CSPRNG instead of taking the saved states (as :func:`clipless.training.fit`
        does on resume): those would draw the lost steps' noise and batches again, and two runs
        resumed from one checkpoint would draw the same noise on different gradients (their
        difference would cancel it). A seeded engine restores them (bit-identical resume, for
        experiments).
        The mechanism must be the same (a checkpoint of another configuration is refused, naming
        the difference); a longer plan saved by :meth:`extend` is kept.

        Args:
            state: a dictionary returned by :meth:`state_dict` (a checkpoint's
                ``"privacy_engine_state_dict"``).

        Raises:
            CheckpointMismatchError: another accountant, neighbouring relation or
                configuration, a ledger file of another run, or a checkpoint older than the
                steps already recorded.
            RuntimeError: before :meth:`make_private`.
        """
        opt = self._opt()
        ledger, lost = self._checkpoint_ledger(state, opt)
        saved = state.get("config")
        if isinstance(saved, Mapping) and "num_tensors" in saved:
            self._restore_config(PrivacyConfig.from_dict(saved), opt)
        self.ledger = ledger
        opt.ledger = ledger
        saved_bounds = state.get("bounds") or {}
        for name, layer in opt.module.named_modules():
            if isinstance(layer, ParametricLipschitzModule) and name in saved_bounds:
                layer.load_bound_state(saved_bounds[name])
        self._restore_randomness(state, opt, lost)
        opt._ledger_file_checked = None  # the next write reads the file again

    def _checkpoint_ledger(
        self, state: Mapping[str, Any], opt: DPOptimizer
    ) -> tuple[accounting.PrivacyLedger, bool]:
        """The ledger to resume with, and whether steps after the checkpoint were lost: the
        checkpoint's, or the ``ledger_path`` file's when it continues it with more steps."""
        ledger = accounting.PrivacyLedger.from_dict(state["ledger"])
        if (ledger.accountant, ledger.neighbouring) != (
            self.ledger.accountant,
            self.ledger.neighbouring,
        ):
            raise CheckpointMismatchError(
                "checkpoint ledger uses a different accountant or neighbouring"
            )
        lost = False
        writes = opt.data_parallel is None or opt.data_parallel.writes_ledger
        path = opt.ledger_path
        on_disk = accounting.PrivacyLedger.from_json_if_exists(path) if path and writes else None
        if path is not None and on_disk is not None and on_disk.records_more_than(ledger):
            _check_ledger_file(on_disk, ledger, path, opt)
            ledger, lost = on_disk, True
        if ledger.steps < self.ledger.steps:
            raise CheckpointMismatchError(
                f"the checkpoint's ledger records {ledger.steps} steps but this engine has "
                f"already recorded {self.ledger.steps}: loading it would roll the accounting back"
            )
        return ledger, lost

    def _restore_config(self, theirs: PrivacyConfig, opt: DPOptimizer) -> None:
        """Refuse a checkpoint of another configuration; keep the longer of the two plans."""
        mine = opt.config
        diff = [
            f.name
            for f in dataclasses.fields(PrivacyConfig)
            if f.name != "steps" and getattr(theirs, f.name) != getattr(mine, f.name)
        ]
        if diff:
            hint = ""
            if "num_mechanisms" in diff and theirs.num_mechanisms is None:
                hint = (
                    "; the checkpoint was saved by a clipless that counted every tensor as a "
                    "mechanism of per-layer noise (num_mechanisms None): finish that run with "
                    "the version that started it"
                )
            raise CheckpointMismatchError(
                "the checkpoint was taken with another privacy configuration: "
                + ", ".join(
                    f"{k} {getattr(theirs, k)!r} (checkpoint) vs {getattr(mine, k)!r} (now)"
                    for k in diff
                )
                + hint
            )
        if theirs.steps is not None and (mine.steps is None or theirs.steps > mine.steps):
            opt.config = mine.with_steps(theirs.steps)
            self._config = opt.config

    def _restore_randomness(self, state: Mapping[str, Any], opt: DPOptimizer, lost: bool) -> None:
        """The saved generators when seeded (a bit-identical resume), else fresh ones."""
        opt.generator.set_state(state["generator"])
        sampler_gen = _sampler_generator(self.data_loader)
        if sampler_gen is not None and "sampler_generator" in state:
            sampler_gen.set_state(state["sampler_generator"])
        if self.seed is None:
            fresh_randomness(opt, self.data_loader)
        elif lost:
            warnings.warn(
                "this engine is seeded: the restored generators draw the noise and batches of "
                "the steps lost after the checkpoint again (experiments only)",
                stacklevel=3,
            )


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How :meth:`PrivacyEngine.make_private` runs, apart from the mechanism (which is the
    :class:`clipless.mechanism.MechanismSpec`): none of these changes a noise scale or epsilon.

    Args:
        ledger_path: write the ledger there (atomically) before every step's noise is drawn, so
            a crash never loses accounting (``None``: in memory only).
        certify_every: ``k`` lets the projection carry a certified bound between exact
            certifications every ``k`` steps (:mod:`clipless.constraints`).
        validate_data: check once that every record is finite, of the model's dtype, and has a
            target the loss accepts, so that no record can make a step fail when it is sampled
            (a failure with probability ``q`` per step would break delta).
        allow_mean_reduced_loss: a backward pass before the first step whose every per-sample
            loss gradient is at most ``L / B`` (a mean-reduced loss) warns instead of raising
            :class:`clipless.optim.PrivacyContractError` (a model whose gradients really are
            that small, e.g. fine-tuning a converged one).
        input_shape: one example's shape (default: read from the dataset's first record).

    Raises:
        TypeError, ValueError: a value of the wrong type or out of range, named.
    """

    ledger_path: str | os.PathLike[str] | None = None
    certify_every: int = 1
    validate_data: bool = True
    allow_mean_reduced_loss: bool = False
    input_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        every = _positive_int("certify_every", self.certify_every)
        object.__setattr__(self, "certify_every", every)
        for name in ("validate_data", "allow_mean_reduced_loss"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{name} must be True or False; got {type(getattr(self, name)).__name__}"
                )
        path = self.ledger_path
        if path is not None and not isinstance(path, str | os.PathLike):
            raise TypeError(
                f"ledger_path must be a str, an os.PathLike or None; got {type(path).__name__}"
            )
        if self.input_shape is not None:
            object.__setattr__(self, "input_shape", _shape_tuple(self.input_shape))


_MECHANISM_KEYWORDS = tuple(f.name for f in dataclasses.fields(MechanismSpec))
_RUN_KEYWORDS = tuple(f.name for f in dataclasses.fields(RunOptions))


def moved_keywords(
    spec: MechanismSpec | None,
    options: RunOptions | None,
    keywords: dict[str, Any],
    *,
    stacklevel: int,
) -> tuple[MechanismSpec, RunOptions]:
    """``(mechanism, options)`` of ``make_private``, folding in (and popping from
    ``keywords``) the keywords that moved into them, with a ``DeprecationWarning`` naming the
    new spelling. A moved keyword given with the value that now holds it is a ``TypeError``."""
    out: list[Any] = []
    for value, kind, arg, names in (
        (spec, MechanismSpec, "mechanism", _MECHANISM_KEYWORDS),
        (options, RunOptions, "options", _RUN_KEYWORDS),
    ):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{arg} must be a {kind.__name__} or None; got {type(value).__name__}")
        moved = {k: keywords.pop(k) for k in names if k in keywords}
        if moved and value is not None:
            raise TypeError(f"give {sorted(moved)} inside {arg}={kind.__name__}(...), not both")
        if moved:
            spelled = ", ".join(f"{k}=..." for k in moved)
            warnings.warn(
                f"make_private({', '.join(moved)}=) is deprecated: pass "
                f"{arg}={kind.__name__}({spelled})",
                DeprecationWarning,
                stacklevel=stacklevel,
            )
        out.append(kind(**moved) if value is None else value)
    return out[0], out[1]


def _check_ledger_file(
    on_disk: accounting.PrivacyLedger,
    ledger: accounting.PrivacyLedger,
    path: str | os.PathLike[str],
    opt: DPOptimizer,
) -> None:
    """A ledger file recording more than the checkpoint must continue it (else it is another
    run's) and, outside ``clipless.distributed``, is kept with a warning."""
    same = (on_disk.accountant, on_disk.neighbouring) == (ledger.accountant, ledger.neighbouring)
    if not same or not on_disk.extends(ledger):
        raise CheckpointMismatchError(
            f"ledger_path {os.fspath(path)!r} records more than the checkpoint but does "
            "not continue its ledger, so it is another run's; pass this run's own "
            "ledger_path"
        )
    if opt.data_parallel is not None:
        raise ValueError(
            f"ledger_path {os.fspath(path)!r} records {on_disk.steps} steps but "
            f"the checkpoint only {ledger.steps}: under clipless.distributed resume with "
            "clipless.training.fit(resume=...), which gives every rank rank 0's largest "
            "ledger and fresh randomness"
        )
    warnings.warn(
        f"{os.fspath(path)} records {on_disk.steps} steps but the checkpoint "
        f"only {ledger.steps}: the steps after the checkpoint were spent and stay in the "
        "ledger",
        stacklevel=4,
    )


@dataclasses.dataclass(frozen=True)
class _Budget:
    """``make_private``'s arguments that fix the noise: a multiplier, or a target with the
    run's length."""

    noise_multiplier: float | None
    target_epsilon: float | None
    target_delta: float | None
    epochs: int | None
    steps: int | None

    def planned_steps(self, q: float) -> int | None:
        """The steps the run is planned for (``None``: a multiplier and no length given)."""
        if self.target_epsilon is None and self.epochs is None and self.steps is None:
            return None
        return _total_steps(self.epochs, self.steps, q)


def _check_budget(budget: _Budget, spec: MechanismSpec) -> None:
    """Contradictory budget arguments, refused before anything is read."""
    if budget.noise_multiplier is not None and budget.target_delta is not None:
        raise ValueError(
            "target_delta is used with target_epsilon only (to calibrate the noise); with "
            "noise_multiplier, choose delta when reading the guarantee "
            "(engine.get_epsilon(delta), engine.guarantee(delta))"
        )
    if budget.epochs is not None and budget.steps is not None:
        raise ValueError("give epochs or steps, not both (steps would override epochs)")
    if spec.constraint is None and spec.max_norm != 1.0:
        # a warning, not an error: runs saved with it (the CLI's --max-norm with --constraint
        # none) must still resume
        warnings.warn(
            f"max_norm={spec.max_norm!r} is the projection's operator-norm bound, but "
            "constraint=None projects nothing: it is unused",
            stacklevel=3,
        )


def _prepare_loss(loss: torch.nn.Module) -> None:
    """Sum-reduce the loss: the optimizer divides by the expected batch size."""
    if getattr(loss, "reduction", "sum") != "sum":
        setattr(loss, "reduction", "sum")  # noqa: B010 - typed as Tensor | Module


def _prepare_data(
    loader: sampling.PoissonDataLoader,
    report: bounds.BoundReport,
    loss: torch.nn.Module,
    module: torch.nn.Module,
    opts: RunOptions,
) -> None:
    """Refuse a dataset that reaches a record twice (always: structural, cheap) and, with
    ``opts.validate_data``, one holding a record that would make a step fail."""
    refuse_repeated_records(loader.dataset)
    if opts.validate_data:
        _validate_dataset(loader.dataset, report, loss, _float_dtype(module))


def _prepare_module(module: torch.nn.Module, spec: MechanismSpec) -> None:
    """Project the initial weights (public, so free) and set the step's float32 precision."""
    if spec.constraint is not None:
        constraints.project(module, mode=spec.constraint, max_norm=spec.max_norm)  # type: ignore[arg-type]
    _prepare_precision(module)


def _check_setup(
    module: object,
    optimizer: object,
    loss: torch.nn.Module,
    spec: MechanismSpec,
    noise_multiplier: float | None,
    target_epsilon: float | None,
) -> None:
    """The checks of ``make_private`` that read no data (each error names its argument)."""
    from clipless import nn

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    nn.validate(module)
    if not callable(getattr(loss, "lipschitz", None)):
        raise TypeError(
            f"loss must be a clipless loss with a certified lipschitz() (e.g. "
            f"clipless.nn.CrossEntropyLoss); got {type(loss).__name__}. Plain torch losses "
            "have no certified constant; clipless.nn has a twin of the usual ones"
        )
    if spec.scaling == "batch-max" and not spec.allow_unproven:
        raise ValueError(
            "scaling='batch-max' is not differentially private (thesis Algorithm 8 line 11 "
            "rescales every sample by the batch maximum); pass allow_unproven=True to use it "
            "for reproduction only"
        )
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier or target_epsilon")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )


def input_releases(module: torch.nn.Module) -> tuple[float, ...]:
    """Noise multipliers of the releases the model's ``InputNorm`` layers carry.

    Per :class:`clipless.nn.InputNorm` (in module order): its released mean (``center``), then its
    released channel second moment (``whiten``); a module object reached twice counts once (it
    applies one released value).
    """
    return tuple(sigma for _, sigma in input_release_labels(module))


def input_release_labels(module: torch.nn.Module) -> tuple[tuple[str, float], ...]:
    """``(label, noise multiplier)`` of :func:`input_releases`, for the ledger."""
    from clipless.nn.input import releases_in

    return tuple((label, sigma) for _, label, sigma in releases_in(module))


def _warn_default_threads(module: torch.nn.Module) -> None:
    """Warn when a convolutional model trains on a CPU with torch's default thread count.

    A converted CNN's step took 17-25 s with the default (one thread per core) against 1.0 s
    with one thread (issue 38). ``OMP_NUM_THREADS`` set in the environment, or a count other
    than the one torch had when clipless was imported, is a choice: no warning then."""
    from clipless import nn

    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or threads <= 1 or threads != _DEFAULT_THREADS:
        return
    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    if not convs or any(p.device.type != "cpu" for p in module.parameters()):
        return
    warnings.warn(
        f"torch uses {threads} threads (its default) and the model has "
        "convolutions: on a CPU, a converted CNN's private step was 17-25 times slower than "
        "with one thread. Call torch.set_num_threads(1) before training, or set "
        "OMP_NUM_THREADS (which silences this warning) to the count you want",
        RuntimeWarning,
        stacklevel=3,
    )


def _loss_argument(loss: torch.nn.Module | None, options: dict[str, Any]) -> torch.nn.Module:
    """``loss=``, or Opacus's ``criterion=`` (the same object: its reduction is switched to
    ``"sum"``, so the training loop must backpropagate this instance)."""
    criterion = options.pop("criterion", None)
    if loss is not None and criterion is not None:
        raise TypeError("give loss= or Opacus's criterion=, not both (they are the same argument)")
    if loss is None and criterion is None:
        raise TypeError(
            "make_private needs loss= a clipless.nn loss (Opacus's criterion=), whose certified "
            "Lipschitz constant enters the noise; backpropagate that instance"
        )
    chosen = loss if loss is not None else criterion
    assert chosen is not None
    return chosen


def _refuse_checkpoint_options(options: Mapping[str, Any]) -> None:
    for key in options:
        if key in ("noise_scheduler", "grad_clip_scheduler"):
            if options[key] is not None:
                raise TypeError(
                    f"{key}: clipless plans the noise once for the whole run (no scheduler); "
                    "save and restore nothing for it"
                )
        elif key in ("module_state_dict_kwargs", "torch_save_kwargs", "torch_load_kwargs"):
            if options[key]:
                raise TypeError(f"{key} is not supported (the file is read with weights_only)")
        else:
            raise TypeError(f"unexpected keyword argument {key!r}")


def _refuse_opacus_options(
    options: Mapping[str, Any], max_grad_norm: float | None, poisson_sampling: bool
) -> None:
    if max_grad_norm is not None:
        raise TypeError(f"max_grad_norm: {_OPACUS_ONLY['max_grad_norm']}")
    if poisson_sampling is not True:
        raise ValueError(
            "poisson_sampling must be True: the accounting is for Poisson sampling, and the "
            "loader is always replaced by a Poisson loader"
        )
    for key in options:
        hint = _OPACUS_ONLY.get(key)
        if hint is not None:
            raise TypeError(f"{key}: {hint}")
    if options:
        raise TypeError(f"make_private got unexpected keyword arguments {sorted(options)}")


def _noised(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    own = {id(p) for p in module.parameters()}
    params: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in own:
                raise ValueError(
                    "optimizer holds a parameter that is not in module; every optimised "
                    "parameter needs a certified sensitivity"
                )
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if not params:
        raise ValueError("module has no trainable parameters in the optimizer")
    return params


def _float_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's floating parameters (the dtype its forward expects)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


_TARGET_CHUNK = 65536  # rows per loss evaluation when checking the targets
_TARGET_KINDS = 64  # distinct scalar targets checked together (labels; beyond: regression)


def _validate_dataset(
    dataset: Any, report: bounds.BoundReport, loss: torch.nn.Module, dtype: torch.dtype
) -> None:
    """Every record finite, of the model's dtype, and with a target the loss accepts.

    A record that makes a step fail only when it is sampled would break delta (a failure with
    probability ``q`` per step), so everything a step checks about one record is checked here
    once: finiteness, the features' dtype, integer labels in ``[0, num_logits)`` (named in the
    error), and then whatever the loss itself refuses (binary labels outside ``{0, 1}`` /
    ``{-1, 1}``, probabilities outside ``[0, 1]``, probability rows not summing to 1, shapes): the
    loss is evaluated on zero logits of the model's output shape with the real targets, in
    chunks, and the first refused record is named. One vectorised pass over a ``TensorDataset``;
    other datasets are read once in large batches.
    """
    from torch.utils.data import TensorDataset

    checker = _DatasetCheck(report, loss, dtype)
    if isinstance(dataset, TensorDataset):
        checker.check(0, tuple(dataset.tensors))
    else:
        offset = 0
        for batch in DataLoader(dataset, batch_size=4096, shuffle=False):
            parts = tuple(batch) if isinstance(batch, tuple | list) else (batch,)
            tensors = tuple(p for p in parts if isinstance(p, torch.Tensor))
            if tensors:
                checker.check(offset, tensors)
                offset += int(tensors[0].shape[0])
    checker.check_kinds()


class _DatasetCheck:
    """The checks of :func:`_validate_dataset`, chunk by chunk, and the targets seen so far."""

    def __init__(self, report: bounds.BoundReport, loss: torch.nn.Module, dtype: torch.dtype):
        self.report, self.loss, self.dtype = report, loss, dtype
        # One record per distinct scalar target, across the chunks: a rule about which targets
        # may share a batch (binary labels in {0, 1} or in {-1, 1}, never both) is checked on
        # them together. Up to _TARGET_KINDS distinct values (labels); beyond, the targets are a
        # continuous regression target, which no clipless loss restricts jointly.
        self.kinds: dict[float, torch.Tensor] = {}
        self.kinds_full = False

    def refusal(self, t: torch.Tensor) -> Exception | None:
        logits = torch.zeros(
            (t.shape[0], *self.report.output_shape), dtype=self.dtype, device=t.device
        )
        try:
            with torch.no_grad():
                self.loss(logits, t)
        except (ValueError, RuntimeError, TypeError, IndexError) as exc:
            return exc
        return None

    def check_targets(self, index_offset: int, target: torch.Tensor) -> None:
        name = type(self.loss).__name__
        for start in range(0, int(target.shape[0]), _TARGET_CHUNK):
            stop = min(start + _TARGET_CHUNK, int(target.shape[0]))
            if self.refusal(target[start:stop]) is None:
                continue
            for row in range(start, stop):  # error path only: find the first refused record
                exc = self.refusal(target[row : row + 1])
                if exc is not None:
                    raise ValueError(
                        f"record {index_offset + row}: the loss ({name}) refuses its target, so "
                        f"any step that samples it would fail: {exc}"
                    ) from exc
            exc = self.refusal(target[start:stop])
            raise ValueError(
                f"records {index_offset + start}-{index_offset + stop - 1}: the loss "
                f"({name}) refuses their targets: {exc}"
            ) from exc
        if self.kinds_full or not target.numel() or target[0].numel() != 1:
            return
        values, first = torch.unique(target.reshape(-1), return_inverse=True)
        if len(self.kinds) + int(values.numel()) > _TARGET_KINDS:
            self.kinds_full = True
            return
        for i, value in enumerate(values.tolist()):
            if value not in self.kinds:
                row = int((first == i).nonzero()[0, 0])
                self.kinds[value] = target[row : row + 1]

    def check_kinds(self) -> None:
        if self.kinds_full or len(self.kinds) < 2:
            return
        exc = self.refusal(torch.cat(list(self.kinds.values())))
        if exc is not None:
            raise ValueError(
                f"the loss ({type(self.loss).__name__}) refuses a batch holding the targets "
                f"{sorted(self.kinds)} together, and Poisson batches can draw any mix of "
                f"records: {exc}"
            ) from exc

    def check(self, index_offset: int, tensors: tuple[torch.Tensor, ...]) -> None:
        for position, t in enumerate(tensors):
            t = torch.as_tensor(t)
            if t.is_floating_point() or t.is_complex():
                self.check_floats(index_offset, position, t)
            elif position == 1 and self.report.num_logits > 1 and t.ndim == 1:
                bad = (t < 0) | (t >= self.report.num_logits)
                if bool(bad.any()):
                    row = index_offset + int(bad.nonzero()[0, 0])
                    raise ValueError(
                        f"record {row} has label {int(t[row - index_offset])}, outside the "
                        f"model's {self.report.num_logits} classes "
                        f"[0, {self.report.num_logits})"
                    )
        if len(tensors) >= 2:  # (x, y, ...): the target is y, as fit and the optimizer read it
            self.check_targets(index_offset, torch.as_tensor(tensors[1]))

    def check_floats(self, index_offset: int, position: int, t: torch.Tensor) -> None:
        # one aminmax pass (norms.all_finite: ~20x faster than isfinite on a large dataset);
        # the per-row search only runs when something is not finite
        bad = None
        if t.ndim and not all_finite(t):
            bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)
        if bad is not None and bool(bad.any()):
            local = int(bad.nonzero()[0, 0])
            row = index_offset + local
            at = (~torch.isfinite(t[local])).nonzero()[0].tolist()
            what = "features" if position == 0 else f"item {position}"
            place = f"{what}[{', '.join(map(str, [row, *at]))}]"
            raise ValueError(
                f"the training data has a non-finite value (NaN or inf) in record {row}, "
                f"at {place} (item {position} of the record, index {tuple(at)} within "
                "it); clean or drop it before training"
            )
        # (other model dtypes are refused by the optimizer, with their own message)
        dtype = self.dtype
        certified = dtype in (torch.float32, torch.float64)
        if position == 0 and t.is_floating_point() and t.dtype != dtype and certified:
            raise ValueError(
                f"the training data's features are {t.dtype} but the model's parameters "
                f"are {dtype}: convert one of them (e.g. x.to({dtype}) or "
                f"model.to({t.dtype})) before make_private"
            )


def _run_id(seed: int | None) -> str:
    """A random run id, or one derived from the seed (a seeded run is reproducible)."""
    if seed is None:
        return secrets.token_hex(16)
    return hashlib.sha256(f"clipless run {seed}".encode()).hexdigest()[:32]


def _prepare_precision(module: torch.nn.Module) -> None:
    """Float32 computed in float32: CUDA's default TF32 convolutions (and TF32 / bfloat16
    products where enabled) round beyond the noise's float32 margin, and the optimizer would
    refuse every step. Switched off here, process-wide, with a warning that says so."""
    setting = switch_to_full_float32(module)
    if setting is not None:
        warnings.warn(
            f"make_private switched float32 to full precision for this process ({setting} "
            "rounds float32 products to TF32 or bfloat16, beyond the rounding margin the noise "
            "covers): clipless.optim.full_float32_precision() was called",
            RuntimeWarning,
            stacklevel=3,
        )


def _warn_large_delta(delta: object, n: int, name: str, stacklevel: int = 3) -> None:
    """Warn when ``delta > 1 / n``: such a claim allows releasing a record outright.

    ``delta = 1 / n`` itself (the thesis's tabular protocol) does not warn.
    """
    real = _validate.is_real(delta)
    if real and float(delta) * n > 1.0 + 1e-9:  # type: ignore[arg-type]
        warnings.warn(
            f"{name}={delta!r} is above 1/n (n = {n} training records): an (epsilon, delta) "
            "claim with delta > 1/n is met by a mechanism that publishes a random record "
            "outright, so it protects little; use a delta of at most 1/n, and preferably much "
            "smaller (e.g. 1e-5)",
            stacklevel=stacklevel,
        )


def _shape_tuple(shape: object) -> tuple[int, ...]:
    """``input_shape`` as a tuple of positive ints (one int is a 1-D shape)."""
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, Iterable) or isinstance(shape, str | bytes):
        raise TypeError(
            f"input_shape must be a tuple of positive ints (one example's shape); got {shape!r}"
        )
    return models._shape(shape)


def fresh_randomness(optimizer: object, loader: object) -> None:
    """Reseed the noise and the Poisson sampler from the OS CSPRNG (rank 0's, broadcast)."""
    parallel = getattr(optimizer, "data_parallel", None)
    device = parallel.device if parallel is not None else torch.device("cpu")
    seeds = torch.tensor([secrets.randbits(63), secrets.randbits(63)], device=device)
    if parallel is not None:  # the ranks sample one global batch: one seed for all
        parallel.broadcast([seeds])
    noise_seed, sampler_seed = (int(v) for v in seeds.tolist())
    generator = getattr(optimizer, "generator", None)
    if isinstance(generator, torch.Generator):
        generator.manual_seed(noise_seed)
    sampler = _sampler_generator(loader)  # type: ignore[arg-type]
    if sampler is not None:
        sampler.manual_seed(sampler_seed)


def _sampler_generator(loader: DataLoader[Any] | None) -> torch.Generator | None:
    sampler = getattr(loader, "batch_sampler", None)
    gen = getattr(sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def _positive_int(name: str, value: object) -> int:
    if not _validate.is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def _total_steps(epochs: int | None, steps: int | None, q: float) -> int:
    if steps is not None:
        return _positive_int("steps", steps)
    if epochs is None:
        raise ValueError("epochs (or steps) is required with target_epsilon")
    return _positive_int("epochs", epochs) * max(1, round(1.0 / q))


def _infer_input_shape(loader: DataLoader[Any]) -> tuple[int, ...]:
    dataset = loader.dataset
    try:
        first = dataset[0]
    except Exception as exc:
        raise ValueError("cannot infer input_shape from the dataset; pass input_shape=") from exc
    x = first[0] if isinstance(first, tuple | list) else first
    return tuple(torch.as_tensor(x).shape)
