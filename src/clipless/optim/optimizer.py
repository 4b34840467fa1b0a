"""The private optimizer: a plan before the gradient exists, then guard -> record -> noise ->
inner step -> projection (:meth:`DPOptimizer.step`). The contract the plan relies on is enforced
by :class:`clipless.optim.guard.ContractGuard`, whose docstring states it in full."""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from clipless import _validate, _workspace, accounting, bounds, constraints, mechanism
from clipless._errors import PlanExhaustedError
from clipless.mechanism import NoisePlan, PrivacyConfig
from clipless.nn import ParametricLipschitzModule
from clipless.optim.guard import ContractGuard
from clipless.optim.noise import draw_noise
from clipless.sampling import PoissonDataLoader

if TYPE_CHECKING:
    from clipless.accounting import PrivacyLedger
    from clipless.bounds import BoundReport

__all__ = ["DPOptimizer"]

_UNSET = object()  # an attribute not set yet


class DPOptimizer(ContractGuard, torch.optim.Optimizer):
    """Differentially private wrapper around ``optimizer`` (see the module docstring).

    Built by :meth:`clipless.PrivacyEngine.make_private`; it shares ``param_groups`` and ``state``
    with the wrapped optimizer, so learning-rate schedulers and ``state_dict`` work as usual.
    ``config`` is the frozen :class:`clipless.mechanism.PrivacyConfig` of every step.
    """

    # The wrapped optimizer's own lists, read through (torch's load_state_dict replaces them on
    # the wrapped optimizer: copies taken at construction went stale, and a scheduler on this
    # optimizer then changed nothing).
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.original_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: torch.nn.Module,
        loss: torch.nn.Module,
        input_shape: tuple[int, ...],
        config: PrivacyConfig,
        ledger: PrivacyLedger,
        generator: torch.Generator | None = None,
        ledger_path: str | os.PathLike[str] | None = None,
        certify_every: int = 1,
        data_loader: PoissonDataLoader | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}"
            )
        if not isinstance(config, PrivacyConfig):
            raise TypeError(f"config must be a PrivacyConfig; got {type(config).__name__}")
        self.original_optimizer = optimizer
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self.module = module
        self.loss = loss
        self.input_shape = tuple(input_shape)
        self.config = config
        self.ledger = ledger
        self.ledger_path = ledger_path
        self._ledger_file_checked: object = None  # the ledger_path read before its first write
        self.certify_every = _validate.positive_int(
            "certify_every", certify_every, wrong_type=ValueError
        )
        if not isinstance(ledger, accounting.PrivacyLedger):
            raise TypeError(
                f"ledger must be a clipless.accounting.PrivacyLedger; got {type(ledger).__name__}"
            )
        if ledger_path is not None and not isinstance(ledger_path, str | os.PathLike):
            raise TypeError(
                f"ledger_path must be a str, an os.PathLike or None; got "
                f"{type(ledger_path).__name__}"
            )
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None; got {type(generator).__name__}"
            )
        self._init_guard(module, config, data_loader)
        dtypes = {p.dtype for p in self._names}
        if len(dtypes) != 1:
            raise ValueError(
                f"all trained parameters must share one dtype; got {sorted(map(str, dtypes))}"
            )
        self._dtype = str(next(iter(dtypes))).removeprefix("torch.")
        mechanism.rounding_margin(self._dtype)  # refuses half precision up front
        device = next(iter(self._names)).device
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(secrets.randbits(63))
        self.generator = generator
        #: Set by :func:`clipless.distributed.make_data_parallel` (None: one process).
        self.data_parallel: Any = None
        self._install_guard(module, optimizer)
        self.refresh()

    # ------------------------------------------------------------------ plans
    def bound_report(self) -> BoundReport:
        """The certified bounds at the current weights (layer norms are memoised exactly)."""
        return bounds.report(self.module, self.loss, self.input_shape)

    def current_plan(self, multiplicity: int = 1) -> NoisePlan:
        """The :class:`NoisePlan` a step would use at the current weights (the forward bounds
        are computed only for the thresholds of ``scaling="bound"``: :func:`bounds.report`)."""
        report = bounds.report(
            self.module,
            self.loss,
            self.input_shape,
            output_bounds=self.config.scaling == "bound",
        )
        return mechanism.plan_step(
            self.config,
            report,
            list(self._names.values()),
            dtype=self._dtype,
            multiplicity=multiplicity,
        )

    def _apply(self, plan: NoisePlan) -> None:
        """Set the plan's scaling threshold and multiplicity on every parametric layer.

        A layer reached at several paths (one module used twice) gets the largest of its paths'
        thresholds (the thresholds only trade bias against variance, never privacy).
        """
        chosen: dict[int, tuple[ParametricLipschitzModule, float | str]] = {}
        for path, value in plan.thresholds.items():
            layer = self.module.get_submodule(path)
            if not isinstance(layer, ParametricLipschitzModule):
                raise TypeError(f"{path!r} is not a clipless parametric layer")
            prev = chosen.get(id(layer))
            if prev is not None and isinstance(prev[1], float) and isinstance(value, float):
                value = max(prev[1], value)
            chosen[id(layer)] = (layer, value)
        for layer, value in chosen.values():
            # written only when changed (most steps): a module attribute write is slow
            state = layer.__dict__
            if state.get("scaling_threshold", _UNSET) != value:
                layer.scaling_threshold = value
            if state.get("scaling_multiplicity", _UNSET) != plan.multiplicity:
                layer.scaling_multiplicity = plan.multiplicity

    def refresh(self) -> NoisePlan:
        """Plan at the current weights and set the layers' scaling thresholds for it."""
        plan = self.current_plan(self._multiplicity)
        self._apply(plan)
        return plan

    @contextlib.contextmanager
    def sample_multiplicity(self, k: int) -> Iterator[None]:
        """Within the block, every sample occupies ``k`` consecutive rows (augmentation copies).

        Each row's contribution to the parameter gradients is divided by ``k`` inside the scaled
        kernels (after the cotangent clipping), so one sample's ``k`` copies together contribute at
        most the layer's sensitivity. Do not divide the loss by ``k`` yourself.
        """
        k = _validate.positive_int("k", k, wrong_type=ValueError)
        previous, self._multiplicity = self._multiplicity, k
        try:
            yield
        finally:
            self._multiplicity = previous

    # ------------------------------------------------------- compatibility API
    @property
    def noise_multiplier(self) -> float:
        return float(self.config.noise_multiplier)

    @property
    def noise(self) -> str:
        return self.config.noise

    @property
    def scaling(self) -> str:
        return self.config.scaling

    @property
    def constraint(self) -> str | None:
        return self.config.constraint

    @property
    def max_norm(self) -> float:
        return float(self.config.max_norm)

    @property
    def sample_rate(self) -> float:
        return float(self.config.sample_rate)

    @property
    def num_samples(self) -> int:
        return int(self.config.num_samples)

    @property
    def expected_batch_size(self) -> float:
        return self.config.expected_batch_size

    @property
    def effective_noise_multiplier(self) -> float:
        """``sigma_eff`` of the whole step, relative to the sensitivities ``Delta_p``."""
        return self.config.effective_noise_multiplier

    @property
    def accounting_noise_multiplier(self) -> float:
        """The multiplier recorded in the ledger (``dp_accounting``'s convention)."""
        return self.config.accounting_noise_multiplier

    def sensitivities(self) -> dict[str, float]:
        """``Delta_p`` per noised parameter at the current weights (:func:`mechanism.plan_step`)."""
        return dict(self.current_plan().sensitivities)

    def layer_sensitivities(self) -> dict[str, float]:
        """Joint (weight, bias) sensitivity of each parametric layer path, summed over uses."""
        plan = self.current_plan()
        out: dict[str, float] = {}
        for lb in self.bound_report().layers:
            names = [n for n in lb.gradient_bounds if n in plan.sensitivities]
            if names:
                g = mechanism.use_bound(lb.cotangent_bound, self.config, plan.rounding_margin)
                out[lb.path] = math.nextafter(out.get(lb.path, 0.0) + g, math.inf)
        return out

    def noise_stds(self) -> dict[str, float]:
        """Noise standard deviation per noised parameter at the current weights."""
        return dict(self.current_plan().stds)

    @property
    def steps_remaining(self) -> int | None:
        """Steps left in the plan (``None`` when the config plans no number of steps)."""
        if self.config.steps is None:
            return None
        return max(0, self.config.steps - self.ledger.steps)

    # -------------------------------------------------------------------- step
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def add_noise(self, plan: NoisePlan | None = None) -> None:
        """Add the plan's noise to every noised gradient and divide by the expected batch size."""
        plan = plan if plan is not None else self.current_plan(self._multiplicity)
        parallel = self.data_parallel
        stds = dict(plan.stds)
        if parallel is not None:  # clipless.distributed: sum the ranks' gradients first
            for p in self._names:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            parallel.reduce([p.grad for p in self._names if p.grad is not None])
            stds = parallel.largest(stds)  # replicas agree; if not, the safe (largest) noise
        grads = []
        for p, name in self._names.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
            if parallel is not None and not parallel.adds_noise:
                continue
            shape, dtype = tuple(p.shape), p.grad.dtype
            # a reused buffer (clipless._workspace: no page faults per step), consumed here
            buffer = _workspace.scratch("weight.draft", shape, dtype, self.generator.device)
            noise = draw_noise(plan, name, shape, self.generator, dtype, std=stds[name], out=buffer)
            p.grad.add_(noise.to(p.grad.device))
        # each gradient divided as div_ would, in one fused launch per device and dtype
        torch._foreach_div_(grads, float(plan.expected_batch_size))
        observe = getattr(self.original_optimizer, "set_noise_variance", None)
        if observe is not None:  # AdamBC: the noise's variance in each averaged gradient
            observe({p: (stds[n] / plan.expected_batch_size) ** 2 for p, n in self._names.items()})
        if parallel is not None:  # every rank steps with the noisy gradient of the noising rank
            parallel.broadcast([p.grad for p in self._names if p.grad is not None])

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One private step: guard -> record -> noise -> inner step -> projection."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            plan = self._admit_step()  # the guard: the plan of one private gradient, or refuse
            self._record(plan)  # write-ahead accounting
            self.add_noise(plan)
        finally:
            self._end_step()
        self._inner_step()
        self._project()
        return loss

    def _admit_step(self) -> NoisePlan:
        """The guard's verdict on the gradients, then the budget: the step's plan, or refuse."""
        self._check_modes("step")
        self._check_parameters()
        plan = self._plan_for_step()
        remaining = self.steps_remaining
        if remaining is not None and remaining <= 0:
            raise PlanExhaustedError(
                f"the privacy budget was planned for {self.config.steps} steps and all were "
                "taken: call engine.extend(steps=...) to train longer at a new epsilon"
            )
        self._check_batch_drawn()
        return plan

    def _record(self, plan: NoisePlan) -> None:
        """Record the step (and persist it, with a ledger_path) before any noisy value exists, so
        a crash can only over-count, never under-count."""
        writes = self.data_parallel is None or self.data_parallel.writes_ledger
        if (
            self.ledger_path is not None
            and writes
            and self._ledger_file_checked != self.ledger_path
        ):
            # Before the first write: the file must not record more than this ledger (a fresh
            # run, or a hand-written resume from an older checkpoint, would forget it).
            self.ledger.check_overwrite(self.ledger_path)
            self._ledger_file_checked = self.ledger_path
        self.ledger.record_event(plan.dp_event(), proven=plan.proven)
        if self.ledger_path is not None and writes:
            self.ledger.to_json(self.ledger_path)

    def _inner_step(self) -> None:
        """The wrapped optimizer's step on the noisy gradient, which is then marked released."""
        self._stepping = True
        try:
            self.original_optimizer.step()
        finally:
            self._stepping = False
        self._released = {
            p: (id(p.grad), p.grad._version) for p in self._names if p.grad is not None
        }

    def _project(self) -> None:
        """The weight constraint (post-processing of released weights)."""
        if self.config.constraint is not None:
            constraints.project_in_step(
                self.module, self.config.constraint, self.config.max_norm, self.certify_every
            )

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Registered on the wrapped optimizer: it runs inside :meth:`step`, after the noise."""
        return self.original_optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Registered on the wrapped optimizer: it runs inside :meth:`step`, after the noise."""
        return self.original_optimizer.register_step_post_hook(hook)

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def detach(self) -> None:
        """Remove the hooks this optimizer placed on the model (the model stays usable)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __repr__(self) -> str:
        c = self.config
        return (
            f"DPOptimizer({type(self.original_optimizer).__name__}, noise={c.noise!r}, "
            f"noise_multiplier={c.noise_multiplier}, sample_rate={c.sample_rate}, "
            f"scaling={c.scaling!r}, constraint={c.constraint!r}, max_norm={c.max_norm})"
        )
