"""A DP optimizer that wraps any :class:`torch.optim.Optimizer` without per-sample gradients.

docs/design.md, "Training: the mathematics"; Clipless DP-SGD (Béthune et al. 2024, Algorithm 1,
"local" and "global" noise) and Lip-DP-SGD (thesis Algorithm 8). The privacy argument of every
noise scale is in :mod:`clipless.mechanism` (and the bounds it uses in :mod:`clipless.bounds`); this
module applies the plan and **enforces the assumptions the plan relies on**, so that a hand-written
loop cannot void the guarantee. One step:

1. *Forward* (a hook on the model, training mode with gradients enabled): the input's shape is
   checked against ``input_shape`` (the bounds were certified for it); the bound report is
   computed at the weights this forward uses and frozen into a :class:`clipless.mechanism.NoisePlan`
   (sensitivities, noise stds, scaling thresholds, event); the thresholds are set on the layers.
   An eval-mode forward with gradients enabled, or a trained layer called outside a forward of the
   model (a submodule or a slice such as ``model[1:]``), is marked instead: a backward pass through
   it *taints* every gradient it accumulates into a noised parameter (input gradients are free).
   A training forward is refused while hooks that clipless did not place could change what the
   guarded pass computes: forward, backward or gradient hooks on the model's modules and noised
   parameters, global module hooks, saved-tensor hooks, or a Python dispatch or function mode
   (:mod:`clipless._modes`; also refused in the backward and at the step), and under
   :mod:`clipless.distributed` an input other than this rank's shard (:mod:`clipless._shards`);
   also one whose model carries other input releases than at ``make_private`` (they are
   accounted once, then), one inside a
   ``torch.func`` transform on parameters that require a gradient (no output guard runs there),
   and one in which a parameter is replaced by another tensor that requires a gradient
   (``torch.func.functional_call``, or a transform over a weight: its gradient would reach the
   parameter outside the scaled kernels' bound).
   A backward pass with ``create_graph=True`` through an unguarded output is refused.
2. *Backward*: the model output passes through a guard whose backward clips every row's cotangent
   to the certified loss constant ``L`` (norm in float64) and zeroes non-finite rows, so no
   *per-example* loss, scale, reduction or extra term of the output can exceed the sensitivity the
   noise was calibrated to; for the certified loss with ``reduction="sum"`` this is a no-op. The
   clip bounds one example's contribution only when row ``i``'s cotangent depends on example
   ``i`` alone, i.e. when the loss is a sum of per-example terms: a loss that couples the examples
   of a batch (weights normalised over the batch, hard-example mining, contrastive or batch-
   statistic terms) is outside the contract and cannot be detected. The guard also checks that the
   weights of every parametric layer (noised or frozen) have not been changed since the forward
   pass. When every row's cotangent is at most ``L / B`` (a mean-reduced loss: its gradients are
   ``B`` times too small, and the run trains at chance) it raises before the first step (unless
   ``make_private(..., options=RunOptions(allow_mean_reduced_loss=True))``) and warns once
   after it.
3. :meth:`DPOptimizer.step` refuses a step that is not one private gradient: two backward passes
   through the model since the last step (gradient accumulation: one sample could contribute
   twice), gradients that did not come only from the one guarded backward pass (hooks on every
   noised parameter see each accumulation: one from another backward pass, from a tainted one, or
   into a gradient that already held something other than zeros or the last released gradient; or
   a gradient changed in place or replaced after the backward pass), parameters added to the
   optimizer after ``make_private``, a step that does not follow exactly one batch handed out by
   the Poisson loader of ``make_private`` (:attr:`DPOptimizer.data_loader`: none means other data
   or a batch stepped twice, two or more a skipped batch), or a step past the number of steps the
   budget was planned for. The training forward may not have more rows than that batch (times
   the sample multiplicity). The wrapped optimizer refuses to step on its own (a step
   pre-hook; also once this optimizer is gone, until :meth:`DPOptimizer.detach`). Then
   (write-ahead accounting) the plan's event is recorded in the ledger with its ``proven`` flag
   and persisted, Gaussian noise of the plan's standard deviations is added on the parameters'
   device, the sum is divided by the *expected* batch size ``q N``, the wrapped optimizer steps,
   and the weights are projected (``clip`` / ``fix`` / ``orthogonal``, post-processing).

What the checks cannot see: a parameter used directly in the same backward pass as the guarded
output (``loss = loss + f(x, model[1].weight)``: its gradient joins the guarded one before it is
accumulated), writes through ``.data`` or a NumPy view that keep a gradient's norm (they bypass
autograd's version counters; the gradient's float64 norm is recorded at accumulation and
compared at :meth:`DPOptimizer.step`, so a rescaled gradient is refused), a second torch
optimizer over the same parameters, a batch that is not the one the Poisson loader yielded but
has no more rows, and losses that couple examples (2.). A data-independent term such as an L2
penalty on the weights is harmless for privacy, but use the optimizer's ``weight_decay`` instead.

The noise comes from :func:`torch.normal` with a dedicated :class:`torch.Generator` (on the
parameters' device) seeded from the operating system's CSPRNG unless a seed is given. Like Opacus
without ``secure_mode``, floating-point Gaussian sampling is not hardened against the attacks of
Mironov (2012); the statistical release of :mod:`clipless.stats` uses exact discrete samplers.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.modules.module as _module_hooks

from clipless import _autograd, _deferred, _shards, _workspace
from clipless._bits import same_bits_tensor
from clipless._errors import PrivacyContractError
from clipless._hooks import _GradHook, _Hook
from clipless._modes import foreign_mode
from clipless.mechanism import NoisePlan, PrivacyConfig
from clipless.nn import ParametricLipschitzModule
from clipless.nn._base import BoundSeal, deferred_weight_checks
from clipless.nn._functional import _wrapped
from clipless.nn.input import releases_in
from clipless.nn.validate import _HOOK_KINDS, foreign_hooks
from clipless.norms import matrix_products_only
from clipless.optim.precision import _DENSE_LAYERS, reduced_float32_precision
from clipless.sampling import PoissonDataLoader

if TYPE_CHECKING:
    from clipless.accounting import PrivacyLedger

__all__ = ["ContractGuard"]

# Where each refusal of the guard is explained at length.
_SEE = "(docs/privacy.md, 'Training')"


@dataclasses.dataclass(eq=False)
class _Pass:
    """One forward pass in training mode: its frozen plan and the weights it used."""

    plan: NoisePlan
    weights: tuple[torch.Tensor, ...]
    params: tuple[torch.nn.Parameter, ...]
    owner: ContractGuard

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        """The guard: enforce the per-row cotangent bound ``L`` (module doc, 2)."""
        self.owner._on_backward(self)
        return _enforce_bound(grad, self.plan.output_bound, self.owner)


@dataclasses.dataclass(eq=False)
class _Unguarded:
    """A forward whose gradients the noise does not cover, and why (module doc, 1)."""

    owner: ContractGuard
    reason: str

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Taint the running backward pass: every gradient it accumulates into a noised
        parameter is refused at :meth:`DPOptimizer.step`; input gradients pass unchanged.

        A backward with ``create_graph=True`` (gradients on during the backward) is refused: the
        graph of its input gradient reaches the parameters without passing this mark again, so
        a later backward through it (an input-gradient penalty) would not be tainted."""
        if torch.is_grad_enabled():
            raise PrivacyContractError(
                f"a backward pass with create_graph=True through {self.reason}: a gradient "
                "taken later through its result would reach the parameters unguarded; a "
                "penalty on input gradients is not supported"
            )
        self.owner._in_backward(tainted=self.reason)
        return grad


class _OutputMark(torch.autograd.Function):
    """Identity forward on a model output; its backward is its record's (:class:`_Pass`: the
    guard; :class:`_Unguarded`: the taint)."""

    @staticmethod
    def forward(x: torch.Tensor, record: _Pass | _Unguarded) -> torch.Tensor:
        # a copy, not a view: a view's ``_base`` is the unguarded output (an audit backpropagated
        # 100 times a loss of ``out._base`` next to the guarded loss, and the step accepted it)
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.record = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.record.backward(grad), None


def _enforce_bound(grad: torch.Tensor, bound: float, owner: ContractGuard) -> torch.Tensor:
    """Zero non-finite rows, clip every row to norm ``bound`` (float64 norms, safe radius).

    Whether every row is at most ``L / B`` (a mean-reduced loss) is kept as a tensor, read with
    the step's other checks (:meth:`DPOptimizer._read_checks`): no host read here."""
    if grad.shape[0] == 0:
        return grad
    clipped, norms = _clip_rows(grad, bound)
    rows = grad.shape[0] // max(1, owner._multiplicity)
    if not owner._mean_warning_given and rows >= 8:
        largest = norms.max()
        owner._warnings.append((largest, bound, rows))
    return clipped


def _mean_warning(largest: float, bound: float, rows: int) -> str | None:
    """The mean-reduced-loss message, when every row's cotangent was at most ``L / B``."""
    if not 0.0 < largest <= bound / rows * (1.0 + 1e-6):
        return None
    return (
        f"every sample's loss gradient at the model output has norm <= L/B = {bound:.4g}/"
        f"{rows} (largest {largest:.3g}): the loss looks mean-reduced. Its gradients are B "
        "times too small for the noise, which is calibrated to one sample's summed loss; use "
        "reduction='sum' (make_private sets it on the loss it is given: backpropagate "
        "optimizer.loss, not a loss built in the training loop)"
    )


def _clip_rows(grad: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The output guard's clip: zero non-finite rows, then scale every row to norm at most
    ``bound`` (float64 norms, a safe radius). Returns the clipped rows and the float64 norms of
    the rows before the scaling. Branch-free, so :func:`clipless.diagnostics.sensitivity_use`
    runs it under ``vmap``."""
    flat = grad.detach().reshape(grad.shape[0], -1)
    finite = torch.isfinite(flat).all(dim=1)
    grad = torch.where(_rows(finite, grad), grad, torch.zeros((), dtype=grad.dtype))
    norms = torch.linalg.vector_norm(grad.detach().reshape(grad.shape[0], -1).double(), dim=1)
    radius = _safe_radius(bound, grad.dtype)
    factor = (radius / norms.clamp_min(1e-300)).clamp(max=1.0)
    return grad * factor.to(grad.dtype).reshape(-1, *([1] * (grad.ndim - 1))), norms


def _rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.reshape(-1, *([1] * (like.ndim - 1)))


def _safe_radius(bound: float, dtype: torch.dtype) -> float:
    """A radius whose rounding in ``dtype`` keeps a rescaled row within ``bound``."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return float(bound) * (1.0 - 8.0 * eps)


_EVAL_BACKWARD = (
    "an eval-mode forward of the private model (no plan is made for it and its output guard runs "
    "only in training mode)"
)
_LAYER_BACKWARD = (
    "a trained layer called outside a forward of the private model (a submodule or a slice such "
    "as model[1:] called directly: no input projection, no output guard)"
)


def _input_releases(module: torch.nn.Module) -> tuple[tuple[int, str, float], ...]:
    """:func:`clipless.nn.input.releases_in` with each layer by identity (what the check keeps)."""
    return tuple((id(m), label, sigma) for m, label, sigma in releases_in(module))


def _outermost(t: torch.Tensor) -> torch.Tensor:
    """``t`` unwrapped to the outermost autograd level (outside every ``torch.func`` level)."""
    functorch = torch._C._functorch
    while _wrapped(t):
        t = functorch.get_unwrapped(t)
    return t


def _outer_grad_enabled() -> bool:
    """Grad mode outside every ``torch.func`` level (each ``grad`` level switches it on inside).

    Read from the outermost grad transform's saved mode; ``True`` (the strict answer) when the
    functorch interpreter stack cannot be read.
    """
    try:
        from torch._C._functorch import (
            CGradInterpreterPtr,
            TransformType,
            get_interpreter_stack,
        )

        for interpreter in get_interpreter_stack() or ():  # outermost first
            if interpreter.key() == TransformType.Grad:
                return bool(CGradInterpreterPtr(interpreter).prevGradMode())
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return True
    return torch.is_grad_enabled()


def _is_transformed(x: object) -> bool:
    """True inside ``torch.func`` transforms (vmap/grad): per-sample reference computations."""
    return isinstance(x, torch.Tensor) and _wrapped(x)


class ContractGuard:
    """The enforcement half of :class:`clipless.optim.DPOptimizer` (module docstring): hooks on the
    model, its parameters and the wrapped optimizer, the taint of unguarded backward passes, the
    queued device checks, and :meth:`_plan_for_step`, which refuses a step that is not one
    private gradient or returns the plan of the one it is. Each check is pinned by a test in
    ``tests/test_contract.py``."""

    # provided by DPOptimizer
    module: torch.nn.Module
    ledger: PrivacyLedger
    input_shape: tuple[int, ...]
    data_parallel: Any
    _dtype: str
    if TYPE_CHECKING:

        @property
        def param_groups(self) -> list[dict[str, Any]]: ...

        def current_plan(self, multiplicity: int = 1) -> NoisePlan: ...

        def _apply(self, plan: NoisePlan) -> None: ...

    def _init_guard(
        self, module: torch.nn.Module, config: PrivacyConfig, data_loader: PoissonDataLoader | None
    ) -> None:
        """The noised parameters and the input releases, checked against ``config``."""
        self._loader: PoissonDataLoader | None = None
        self._drawn_at_step = 0
        self.data_loader = data_loader
        self._names = self._noised_parameters()
        self._releases = _input_releases(module)
        if tuple(sigma for *_, sigma in self._releases) != tuple(config.releases):
            raise ValueError(
                f"the model's InputNorm layers carry the releases "
                f"{[(label, sigma) for _, label, sigma in self._releases]} but config.releases is "
                f"{list(config.releases)}: every release the model applies must be accounted"
            )
        if len(self._names) != config.num_tensors:
            raise ValueError(
                f"config.num_tensors is {config.num_tensors} but the optimizer holds "
                f"{len(self._names)} trainable parameters"
            )

    def _install_guard(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The guard's state and its hooks on the model, the parameters and ``optimizer``."""
        self._multiplicity = 1
        self._pending: list[_Pass] = []
        self._released: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self._mean_warning_given = False
        # Checks whose verdict is a device tensor, read together once per step before anything
        # is released (_read_checks): (flags, the message of a false flag, what each flag is
        # about: a parameter's name, or a layer whose memoised bound a false flag makes stale);
        # messages are formatted only for a false flag (this runs every step)
        self._checks: list[tuple[torch.Tensor, str, list[str | ParametricLipschitzModule]]] = []
        # the seals of provisional bounds the plans took (a projection's verdict still on the
        # device), settled from the same read, before the checks are judged
        self._seals: list[BoundSeal] = []
        # the latest guarded training output: a loss's check of its targets is read with the
        # checks above (clipless._deferred)
        self._last_output: weakref.ref[torch.Tensor] | None = None
        _deferred.listen(self)
        self._warnings: list[tuple[torch.Tensor, float, int]] = []
        #: ``False`` (default): a loss that looks mean-reduced before the first step is an error
        #: (it would train at chance); ``True``: a warning (``make_private``'s argument).
        self.allow_mean_reduced_loss = False
        self._weight_owner: dict[torch.nn.Parameter, ParametricLipschitzModule] = {}
        for layer in module.modules():
            weight = layer._parameters.get("weight")
            if isinstance(layer, ParametricLipschitzModule) and weight is not None:
                self._weight_owner.setdefault(weight, layer)
        #: every parameter whose value the plan depends on (noised ones and frozen layer weights),
        #: by name: compared between each guarded forward and its backward
        by_param = {p: n for n, p in module.named_parameters()}
        self._watched = dict(self._names)
        for weight in self._weight_owner:
            self._watched.setdefault(weight, by_param[weight])
        self._stack: list[_Pass | str | None] = []  # one entry per running top-level forward
        self._guarded_backward = False  # True while a guarded backward pass runs
        self._tainted: str | None = None  # why the running backward pass is not covered
        self._refusal: dict[torch.nn.Parameter, str] = {}
        self._incoming: dict[torch.nn.Parameter, bool] = {}
        self._accumulated: dict[torch.nn.Parameter, tuple[int, int, bool]] = {}
        # an exact fingerprint of each accumulated gradient (its float64 norm's bits): writes
        # through .data or a NumPy view do not bump the version counter
        self._fingerprints: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._stepping = False
        self._hooks: list[Any] = [
            module.register_forward_pre_hook(_Hook(self, "_before_forward"), with_kwargs=True),
            module.register_forward_hook(
                _Hook(self, "_after_forward"), with_kwargs=True, always_call=True
            ),
            optimizer.register_step_pre_hook(_Hook(self, "_before_inner_step")),
        ]
        for sub in module.modules():
            if sub is not module and any(p in self._names for p in sub.parameters(recurse=False)):
                self._hooks.append(sub.register_forward_hook(_Hook(self, "_after_layer_forward")))
        for p in self._names:
            self._hooks.append(p.register_hook(_GradHook(self, p)))
            self._hooks.append(
                p.register_post_accumulate_grad_hook(_Hook(self, "_accumulated_grad"))
            )

    # ------------------------------------------------------------- parameters
    def _noised_parameters(self) -> dict[torch.nn.Parameter, str]:
        """Trainable parameters held by the optimizer, by name (the tensors that get noise)."""
        by_param = {p: n for n, p in self.module.named_parameters()}
        names: dict[torch.nn.Parameter, str] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p not in by_param:
                    raise ValueError(
                        "optimizer holds a parameter that is not in module; every optimised "
                        "parameter needs a certified sensitivity"
                    )
                if p.requires_grad:
                    names[p] = by_param[p]
        if not names:
            raise ValueError("the optimizer holds no trainable parameter of the module")
        outside = [n for p, n in by_param.items() if p.requires_grad and p not in names]
        if outside:
            raise ValueError(
                f"module parameters {outside} require gradients but are not in the optimizer: "
                "their gradients would be neither clipped nor noised; add them to the optimizer "
                "or freeze them (requires_grad_(False))"
            )
        return names

    def _check_parameters(self) -> None:
        current = {p for group in self.param_groups for p in group["params"] if p.requires_grad}
        if current != set(self._names):
            raise PrivacyContractError(
                "the optimizer's trainable parameters changed after make_private (add_param_group "
                "or requires_grad toggled): their noise would not be calibrated; build a new "
                "PrivacyEngine for the new parameter set"
            )

    def _check_precision(self) -> None:
        """Refuse a training forward in a precision the rounding margin does not cover.

        The noise plan's rounding margin is that of the dtype the parameters had at
        ``make_private`` (:func:`clipless.mechanism.rounding_margin`); a later ``model.half()``
        or a forward under ``torch.autocast`` computes the gradient in a lower precision whose
        rounding the margin does not cover."""
        devices = set()
        for p, name in self._names.items():
            if str(p.dtype).removeprefix("torch.") != self._dtype:
                raise PrivacyContractError(
                    f"parameter {name!r} is {p.dtype} but the model was made private in "
                    f"{self._dtype}: the rounding margin of the noise covers only that precision; "
                    "convert the model before make_private (float32 or float64)"
                )
            devices.add(p.device.type)
        if any(torch.is_autocast_enabled(d) for d in devices):
            raise PrivacyContractError(
                "a training forward of the private model under torch.autocast: the gradient "
                "would be computed in a lower precision than the noise's rounding margin "
                "covers; train without autocast (float32 or float64)"
            )
        if self._dtype == "float32":
            # cuDNN's TF32 flag (on by default) concerns convolutions only: a model of known
            # dense layers is not refused for it; anything else counts as a convolution
            convolutions = any(not isinstance(m, _DENSE_LAYERS) for m in self.module.modules())
            setting = reduced_float32_precision(devices, convolutions)
            if setting is not None:
                raise PrivacyContractError(
                    f"{setting}: float32 products would round to TF32 or bfloat16, beyond the "
                    "margin the noise covers; call clipless.optim.full_float32_precision() "
                    f"before training, or train in float64 {_SEE}"
                )

    # ------------------------------------------------------------------ hooks
    def _before_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if not self._stack:  # a backward pass that raised never reset these
            self._guarded_backward = False
            self._tainted = None
        self._stack.append(None)  # popped by _after_forward, which always runs
        if not torch.is_grad_enabled():
            return  # no graph: nothing to protect
        x = args[0] if args else None
        if x is None:
            tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            x = tensors[0] if len(tensors) == 1 else None
        if not isinstance(x, torch.Tensor):
            if module.training:
                raise PrivacyContractError(
                    "call the private model with the input batch as its first argument (or its "
                    "only tensor keyword argument): the input's shape is what the bounds certify"
                )
            self._stack[-1] = "eval"
            return
        if _is_transformed(x):
            self._check_transformed(module)
            return
        self._check_substituted(module)
        if not module.training:
            self._stack[-1] = "eval"  # its output taints a backward pass (_after_forward)
            return
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(
                f"the model was made private for inputs of shape {self.input_shape} (one sample) "
                f"but received a batch of shape {tuple(x.shape)}: the certified bounds depend on "
                "the input shape"
            )
        self._check_precision()
        self._check_foreign_hooks()
        self._check_modes("training forward")
        if _input_releases(self.module) != self._releases:
            raise PrivacyContractError(
                "the model's input releases changed after make_private (an InputNorm with a "
                f"released mean or moment added, replaced or removed) {_SEE}"
            )
        k = self._multiplicity
        if k > 1 and x.shape[0] % k:
            raise ValueError(
                f"sample_multiplicity({k}): the batch has {x.shape[0]} rows, not a multiple of "
                f"{k} (every sample occupies {k} consecutive rows)"
            )
        self._check_rows(int(x.shape[0]), k)
        self._check_shard(x)
        with deferred_weight_checks() as memos:
            plan = self.current_plan(k)
        if memos.flags:
            self._checks.append(
                (
                    torch.stack([flag for _, flag in memos.flags]),
                    _STALE_BOUND,
                    [layer for layer, _ in memos.flags],
                )
            )
        self._seals += [seal for seal in memos.seals if seal not in self._seals]
        self._apply(plan)
        params = tuple(self._watched)
        self._stack[-1] = _Pass(
            plan=plan,
            weights=tuple(self._snapshot(p) for p in params),
            params=params,
            owner=self,
        )

    @property
    def data_loader(self) -> PoissonDataLoader | None:
        """The Poisson loader whose batches the steps train on (``make_private`` sets it).

        With a loader, every step must follow exactly one batch drawn from it, and the training
        forward may have no more rows than that batch (times :meth:`sample_multiplicity`); a
        step that breaks either is refused. Set it to ``None`` to sample the batches yourself
        (e.g. on the GPU): each step must then train on a fresh Poisson sample of rate
        :attr:`sample_rate` of the :attr:`num_samples` examples, which the accounting assumes and
        nothing checks.
        """
        return self._loader

    @data_loader.setter
    def data_loader(self, loader: PoissonDataLoader | None) -> None:
        if loader is not None and not isinstance(loader, PoissonDataLoader):
            raise TypeError(
                "data_loader must be the clipless.sampling.PoissonDataLoader the steps train on "
                f"(or None); got {type(loader).__name__}"
            )
        self._loader = loader
        self._drawn_at_step = 0 if loader is None else loader.batches_yielded

    def _check_rows(self, rows: int, k: int) -> None:
        """Refuse a training forward with more rows than the last Poisson batch (times ``k``).

        More rows than examples means some example occupies several rows (the batch concatenated
        with another, or augmented copies without :meth:`sample_multiplicity`), and contributes
        several times what the noise covers. Fewer rows (rows dropped) are fine. Under
        :mod:`clipless.distributed` the limit is this rank's share (rows ``rank::world``, as
        :func:`clipless.distributed.shard` takes them): a rank training on the whole batch
        (``shard`` forgotten) would make every example count once per rank.
        """
        loader = self.data_loader
        drawn = None if loader is None else loader.last_batch_size
        if drawn is None:
            return
        parallel = self.data_parallel
        share = drawn if parallel is None else len(range(parallel.rank, drawn, parallel.world_size))
        if rows <= k * share:
            return
        copies = f" x {k} copies under sample_multiplicity({k})" if k > 1 else ""
        of = (
            ""
            if parallel is None
            else f" (this rank's share: {share} rows; take it with clipless.distributed.shard)"
        )
        raise PrivacyContractError(
            f"the training forward has {rows} rows but the last batch drawn from the Poisson "
            f"loader has {drawn} examples{of}{copies}: declare K augmented copies with "
            f"optimizer.sample_multiplicity(K) {_SEE}"
        )

    def _check_shard(self, x: torch.Tensor) -> None:
        """Under :mod:`clipless.distributed`, refuse a training forward whose input is not the
        rows :func:`clipless.distributed.shard` handed this rank (:mod:`clipless._shards`)."""
        if self.data_parallel is None:
            return
        why = _shards.check(x)
        if why is not None:
            raise PrivacyContractError(
                f"{why}: under clipless.distributed each rank trains on exactly the rows "
                f"clipless.distributed.shard gave it {_SEE}"
            )

    def _check_batch_drawn(self) -> None:
        """Refuse a step that does not follow exactly one batch of the Poisson loader.

        The accounting composes one subsampled Gaussian per step, each on a fresh, independent
        Poisson sample of the loader's rate. No new batch means the step trained on other data
        (another loader, a batch stepped on twice); two or more mean a batch was skipped
        (skipping an empty batch is not DP: its absence reveals that the batch was empty) or
        several were trained on at once.
        """
        loader = self.data_loader
        if loader is None:
            return
        new = loader.batches_yielded - self._drawn_at_step
        if new == 1:
            return
        if new == 0:
            raise PrivacyContractError(
                "no batch was drawn from the Poisson loader make_private returned since the last "
                f"step: iterate that loader, one step per batch {_SEE}"
            )
        raise PrivacyContractError(
            f"{new} batches were drawn from the Poisson loader since the last step: take one "
            "step per batch, empty ones too, or call optimizer.discard_batch() after a "
            f"batch-independent stop {_SEE}"
        )

    def discard_batch(self) -> None:
        """Forget the batches drawn since the last step and not trained on.

        For a loop that draws a batch and then stops before stepping for a reason that does not
        depend on the batch (:func:`clipless.training.fit` at a budget limit or after an
        exception, a ``break``, a time limit), so that training resumed later starts clean.
        Never call it to skip a batch *because of what it holds*: whether a batch is skipped
        must not depend on its content (an empty batch's absence reveals that it was empty).
        """
        if self.data_loader is not None:
            self._drawn_at_step = self.data_loader.batches_yielded

    def _check_foreign_hooks(self) -> None:
        """Refuse hooks that run inside the guarded pass and that clipless did not place.

        Forward and backward hooks of the model's modules, global module hooks, saved-tensor
        hooks and tensor hooks of the noised parameters run between the input and the gradient
        the noise was calibrated for, and can rescale one example's contribution at will (an
        audit measured 70x to 7000x the planned sensitivity through each kind). Checked before
        every training-mode forward (a few dictionary lengths).
        """
        for kind in _HOOK_KINDS:
            if getattr(_module_hooks, f"_global_{kind}_hooks", None):
                raise PrivacyContractError(
                    f"a global module {kind.replace('_', '-')} hook is registered (torch.nn."
                    f"modules.module.register_module_{kind}_hook): remove it while training "
                    f"privately {_SEE}"
                )
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is not None and top(False) is not None:
            raise PrivacyContractError(
                "saved-tensor hooks are active (torch.autograd.graph.saved_tensors_hooks or "
                f"save_on_cpu around the model): remove them while training privately {_SEE}"
            )
        for name, sub in self.module.named_modules():
            hooks = foreign_hooks(sub)
            if hooks:
                raise PrivacyContractError(
                    f"module {name or '<root>'!r} has {hooks[0]} that clipless did not place: "
                    f"remove it, or register it on a copy of the model {_SEE}"
                )
        for p in self._names:
            self._check_param_hooks(p)

    def _check_param_hooks(self, p: torch.nn.Parameter) -> None:
        """Refuse a tensor hook on a noised parameter that clipless did not place. Checked before
        every training forward and again in the backward pass (by the parameter's own hook, which
        runs first): a hook registered between the forward and the backward and removed before
        the step would otherwise scale the gradient unseen."""
        tensor_hooks = getattr(p, "_backward_hooks", None) or {}
        after = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        if any(not isinstance(h, _GradHook) for h in tensor_hooks.values()) or any(
            not isinstance(h, _Hook) for h in after.values()
        ):
            raise PrivacyContractError(
                f"parameter {self._names.get(p, '?')!r} has a gradient hook that clipless did "
                "not place (register_hook / register_post_accumulate_grad_hook): it can change "
                "the gradient the noise was calibrated for; remove it"
            )

    def _snapshot(self, p: torch.nn.Parameter) -> torch.Tensor:
        """A copy of ``p`` as this forward uses it, for the check in :meth:`_on_backward`.

        A layer weight reuses the copy its bound cache holds (``_bound_cache``,
        :meth:`ParametricLipschitzModule._cached_bound`): the bound report that planned this
        forward has just compared it bitwise with the weight (or replaced it by a fresh copy),
        and the cache only ever *replaces* that tensor, never writes into it. This saves one
        clone of every weight per forward (~1.5 ms for the 1.9 M-parameter MLP on one CPU
        core). Other parameters (biases) are cloned.
        """
        owner = self._weight_owner.get(p)
        cached = owner.__dict__.get("_bound_cache") if owner is not None else None
        if cached is not None:
            ref = cached[0]
            if ref.shape == p.shape and ref.dtype == p.dtype and ref.device == p.device:
                return ref
        return p.detach().clone()

    def _after_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> torch.Tensor | None:
        record = self._stack.pop() if self._stack else None
        if isinstance(output, torch.Tensor) and _is_transformed(output):
            # a plain input and a transformed output: torch.func wrapped a parameter (vjp, grad
            # or jacrev over a weight passed through functional_call), which the input did not
            # show to _before_forward
            self._check_transformed(module)
            return None
        if record is None or not isinstance(output, torch.Tensor):
            return None
        if not output.requires_grad:
            return None
        # an eval-mode forward with gradients enabled is marked "eval": its output taints
        mark = _Unguarded(self, _EVAL_BACKWARD) if isinstance(record, str) else record
        marked: torch.Tensor = _autograd.apply(_OutputMark, output, mark)
        if isinstance(record, _Pass):
            self._last_output = weakref.ref(marked)
        return marked

    def take_check(self, output: torch.Tensor, ok: torch.Tensor, message: str) -> bool:
        """:mod:`clipless._deferred`: on an accelerator, a loss's check of the targets of this
        model's latest guarded training output is read with the step's checks (a false one
        refuses the step with the loss's ``ValueError``)."""
        last = self._last_output() if self._last_output is not None else None
        if last is None or output is not last or not matrix_products_only(ok):
            return False
        self._checks.append((ok.reshape(1), message, [_TARGETS]))
        return True

    def _after_layer_forward(
        self, layer: torch.nn.Module, args: tuple[Any, ...], output: Any
    ) -> torch.Tensor | None:
        """A trained layer called outside a forward of the private model: taint its backward."""
        if self._stack or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
            return None
        if _is_transformed(output):
            self._check_transformed(layer)
            return None
        if not output.requires_grad:
            return None
        marked: torch.Tensor = _autograd.apply(
            _OutputMark, output, _Unguarded(self, _LAYER_BACKWARD)
        )
        return marked

    def _check_substituted(self, module: torch.nn.Module) -> None:
        """Refuse a forward (gradients on, plain input) in which a tensor the model uses as one
        of its parameters requires a gradient but is not one of the live parameters this
        optimizer noises: ``torch.func.functional_call`` substitutes it, and a substitute such
        as ``w.detach() + 100 * (w - w.detach())`` has ``w``'s bits (so the plan, the weight
        snapshots and the output clip all pass) while the gradient reaching ``w`` through it
        is 100 times the scaled one; a ``torch.func`` transform over a parameter (``vjp``,
        ``grad``, ``jacrev``) substitutes a wrapped tensor the same way. Detached substitutes
        (no gradient) are allowed: nothing reaches the trained parameters through them. The
        check is by identity *and name*: live parameters swapped between layers (``m[1].bias,
        m[3].bias = m[3].bias, m[1].bias``) would each get the noise of the other's
        sensitivity (per-layer noise: an audit measured 421 times the planned sensitivity)."""
        foreign = [
            name
            for name, p in module.named_parameters()
            if p.requires_grad and self._names.get(p) != name
        ]
        if foreign:
            raise PrivacyContractError(
                f"parameters {foreign} of the private model are replaced in this forward by "
                "tensors that require a gradient, or moved to another place in the model: pass "
                f"detached tensors for a reference computation {_SEE}"
            )

    def _check_transformed(self, module: torch.nn.Module) -> None:
        """A forward inside a ``torch.func`` transform is not guarded (no output clip, no taint):
        allowed for reference computations on parameters passed detached through
        ``torch.func.functional_call``, but not, in either mode, on parameters that require a
        gradient outside the transform (the live ones, or copies of them): that outer gradient
        would join the guarded one unseen (an input-gradient penalty through
        ``torch.func.grad``, a second pass through ``torch.func.vjp``)."""
        if not _outer_grad_enabled():
            return  # e.g. a Jacobian under torch.no_grad(): no gradient can reach the parameters
        if any(_outermost(p).requires_grad for p in module.parameters()):
            raise PrivacyContractError(
                "a forward of the private model ran inside a torch.func transform on parameters "
                "that require a gradient: pass detached parameters through "
                f"torch.func.functional_call, or run it under torch.no_grad() {_SEE}"
            )

    def _check_modes(self, where: str) -> None:
        """Refuse a Python dispatch or function mode around the guarded pass or the step
        (:mod:`clipless._modes`: it can change any operator's result, the noise draw included)."""
        mode = foreign_mode()
        if mode is not None:
            raise PrivacyContractError(
                f"{mode} is active around the private model's {where}: it intercepts every "
                "operator and can change one example's gradient (or the noise) beyond what the "
                "privacy guarantee covers; exit it while training privately"
            )

    def _on_backward(self, record: _Pass) -> None:
        self._check_modes("backward pass")
        # compared on the device now, refused by step() before anything is released
        pairs = zip(record.params, record.weights, strict=True)
        flags = [same_bits_tensor(p.detach(), w) for p, w in pairs]
        if flags:
            self._checks.append(
                (
                    torch.stack(flags),
                    _CHANGED_SINCE_FORWARD,
                    [self._watched[p] for p in record.params],
                )
            )
        self._pending.append(record)
        self._in_backward(tainted=None)

    def _in_backward(self, tainted: str | None) -> None:
        """A guarded output (``tainted=None``) or an unguarded one is being backpropagated."""
        if not (self._guarded_backward or self._tainted):
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if tainted is None:
            self._guarded_backward = True
        else:
            self._tainted = tainted

    def _end_backward(self) -> None:
        self._guarded_backward = False
        self._tainted = None

    def _before_accumulate(self, p: torch.nn.Parameter) -> None:
        """Before a gradient is accumulated into ``p.grad``: is ``p.grad`` empty (``None``, zeros,
        or the noisy gradient released by the last step)? Read by :meth:`_accumulated_grad`."""
        grad = p.grad
        released = self._clear_release(p, grad)
        self._incoming[p] = grad is None or released or not bool(torch.count_nonzero(grad))

    def _clear_release(self, p: torch.nn.Parameter, grad: torch.Tensor | None) -> bool:
        """Is ``grad`` the noisy gradient the last step released into ``p.grad``? If so, it is
        zeroed: it carries nothing into the next step. Its identity and version are all that
        recognise it, and a write through ``.data`` or a NumPy view changes neither (an audit
        wrote 100 times an unclipped gradient into it that way, and the next step noised and
        applied it as this batch's gradient)."""
        if grad is None or self._released.get(p) != (id(grad), grad._version):
            return False
        with torch.no_grad():
            grad.zero_()
        self._released[p] = (id(grad), grad._version)
        return True

    def _accumulated_grad(self, p: torch.nn.Parameter) -> None:
        grad = p.grad
        if grad is None:
            return
        clean = self._incoming.pop(p, False)
        ok = clean and self._guarded_backward and self._tainted is None
        self._accumulated[p] = (id(grad), grad._version, ok)
        self._fingerprints[p] = _fingerprint(grad)
        if self._tainted is not None:
            self._refusal[p] = f"its backward pass went through {self._tainted}"
        elif not self._guarded_backward:
            self._refusal[p] = "a backward pass outside the private model accumulated into it"
        elif not clean:
            self._refusal[p] = "it already held a gradient from another backward pass"

    def _check_fingerprints(self) -> None:
        """Queue the check that no gradient was changed in place without bumping its version
        counter (``.data``, a NumPy view): its float64 norm must be bitwise the one recorded at
        accumulation (read with the step's other checks)."""
        params = [p for p in self._fingerprints if p.grad is not None]
        if not params:
            return
        before = torch.stack([self._fingerprints[p] for p in params])
        now = torch.stack([_fingerprint(p.grad) for p in params])  # type: ignore[arg-type]
        self._checks.append(
            (
                torch.eq(before, now),
                _CHANGED_AFTER_BACKWARD,
                [self._names[p] for p in params],
            )
        )

    def _read_checks(self) -> None:
        """Read every queued verdict in one transfer (the step's one host read before the
        noise) and refuse the step at the first false one, in the order the checks were made:
        the seals of the last projection first (a failed one raises its own error), then the
        checks, then the mean-reduced-loss warnings."""
        checks, self._checks = self._checks, []
        warnings_, self._warnings = self._warnings, []
        seals = [seal for seal in self._seals if not seal.done]
        self._seals = []
        tensors = [seal.values.reshape(-1) for seal in seals]
        tensors += [flags.reshape(-1) for flags, _, _ in checks]
        tensors += [largest.reshape(1) for largest, _, _ in warnings_]
        if not tensors:
            return
        device = tensors[0].device
        # one concatenation (it promotes the flags to the float64 values), one conversion
        joined = torch.cat([t if t.device == device else t.to(device) for t in tensors])
        values = joined.to(torch.float64).tolist()
        start = 0
        for seal in seals:
            rows, width = seal.values.shape
            part = values[start : start + rows * width]
            seal.settle([part[i * width : (i + 1) * width] for i in range(rows)])
            start += rows * width
        flat = iter(values[start:])
        failures = self._failed_checks(checks, flat)
        failures += self._mean_warnings(warnings_, flat)
        if failures:
            raise failures[0]

    def _failed_checks(
        self,
        checks: list[tuple[torch.Tensor, str, list[str | ParametricLipschitzModule]]],
        flat: Iterator[float],
    ) -> list[Exception]:
        """The errors of the false flags, in order. A layer whose memoised bound proved stale
        forgets it (the next forward certifies the weight again)."""
        failures: list[Exception] = []
        for flags, template, subjects in checks:
            for subject in subjects[: flags.numel()]:
                if next(flat) != 0.0:
                    continue
                if subject is _TARGETS:
                    failures.append(ValueError(template))
                elif isinstance(subject, str):
                    failures.append(PrivacyContractError(template.format(subject)))
                else:
                    subject.forget_bound()
                    name = self._layer_name(subject)
                    failures.append(PrivacyContractError(template.format(name)))
        return failures

    def _mean_warnings(
        self, warnings_: list[tuple[torch.Tensor, float, int]], flat: Iterator[float]
    ) -> list[Exception]:
        """Warn once of a loss that looks mean-reduced; before the first step it is an error
        (unless allowed): it would train at chance."""
        failures: list[Exception] = []
        for _, bound, rows in warnings_:
            message = _mean_warning(next(flat), bound, rows)
            if message is None or self._mean_warning_given:
                continue
            if self.ledger.steps == 0 and not self.allow_mean_reduced_loss:
                failures.append(
                    PrivacyContractError(
                        message + "; make_private(..., options=RunOptions("
                        "allow_mean_reduced_loss=True)) makes this a warning"
                    )
                )
                continue
            self._mean_warning_given = True  # a converged model's gradients can be that small
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        return failures

    def _layer_name(self, layer: ParametricLipschitzModule) -> str:
        for name, module in self.module.named_modules():
            if module is layer:
                return name or "<root>"
        return type(layer).__name__

    def _before_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._stepping:
            raise PrivacyContractError(
                "the optimizer given to make_private was stepped directly: its gradients carry no "
                "noise and the step is not accounted; call step() on the optimizer make_private "
                "returned"
            )

    def _end_step(self) -> None:
        """Forget the step's gradients' records (a refused step consumes its batch too)."""
        if self.data_loader is not None:
            self._drawn_at_step = self.data_loader.batches_yielded
        self._pending = []
        self._accumulated = {}
        self._fingerprints = {}
        self._incoming = {}
        self._refusal = {}
        self._checks, self._warnings = [], []
        self._seals = []

    def _plan_for_step(self) -> NoisePlan:
        """The plan of the one private gradient the step releases (or refuse it)."""
        pending = self._pending
        if len(pending) > 1:
            raise PrivacyContractError(
                f"{len(pending)} backward passes through the model since the last step: take "
                f"one step per backward pass (no gradient accumulation) {_SEE}"
            )
        if pending:
            for p, name in self._names.items():
                grad = p.grad
                if grad is None or self._clear_release(p, grad):
                    continue  # not reached by this backward: nothing, or last step's (zeroed)
                record = self._accumulated.get(p)
                if record is None or record != (id(grad), grad._version, True):
                    why = self._refusal.get(p) if record is not None and not record[2] else None
                    raise PrivacyContractError(
                        f"the gradient of {name!r} did not come only from the guarded backward "
                        "pass of the private model: "
                        + (
                            why
                            or "it was changed after the backward pass (scaled, replaced or added "
                            "to; use the optimizer's own options, e.g. weight_decay=, for such "
                            "terms)"
                        )
                    )
            self._check_fingerprints()
            self._read_checks()
            return pending[0].plan
        for p, name in self._names.items():
            grad = p.grad
            if grad is None or self._clear_release(p, grad):
                continue  # no gradient, or the (zeroed) gradient this optimizer released last step
            if bool(torch.count_nonzero(grad)):
                raise PrivacyContractError(
                    f"parameter {name!r} has a gradient that did not come through a training-mode "
                    "forward and backward pass of the private model since the last step"
                )
        self._checks, self._warnings = [], []  # of forwards never backpropagated
        return self.current_plan(self._multiplicity)  # no gradient: an empty batch


_TARGETS = "<the loss's targets>"  # the subject of a check taken from a loss (take_check)

_STALE_BOUND = (
    "the weight of layer {!r} was changed without autograd seeing it (a write through .data or "
    "a NumPy view) after its certified bound was computed: this step's noise was planned for the "
    "old weight, so the step is refused (the next forward certifies the new weight); change "
    "weights in place under torch.no_grad() instead"
)
_CHANGED_SINCE_FORWARD = (
    "parameter {!r} changed between the forward and the backward pass: the noise was planned "
    "for the weights the forward used"
)
_CHANGED_AFTER_BACKWARD = (
    "the gradient of {!r} was changed after the backward pass without autograd seeing it (a "
    "write through .data or a NumPy view): the noise was calibrated for the gradient the "
    "guarded backward pass accumulated"
)


_FINGERPRINT_CHUNK = 2**17  # float64 entries (1 MiB) converted at a time


def _fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """The bits of ``grad``'s float64 sum of squares, on its device (NaN-safe exact comparison).

    A large contiguous CPU gradient is converted to float64 1 MiB at a time, into a reused
    buffer (``clipless._workspace``): ``vector_norm(..., dtype=float64)`` made a float64 copy of
    the whole gradient, 4 MiB more at the CPU step's memory peak. An accelerator takes the one
    reduction (a loop of small copies there is a loop of kernel launches).
    """
    g = grad.detach()
    n = g.numel()
    if matrix_products_only(g) or not g.is_contiguous() or n <= _FINGERPRINT_CHUNK:
        return torch.linalg.vector_norm(g, dtype=torch.float64).square().view(torch.int64)
    flat = g.view(-1)
    buffer = _workspace.scratch("float64.rows", (_FINGERPRINT_CHUNK,), torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, n, _FINGERPRINT_CHUNK):
        part = buffer[: min(_FINGERPRINT_CHUNK, n - start)]
        part.copy_(flat[start : start + _FINGERPRINT_CHUNK])
        total += torch.dot(part, part)
    return total.view(torch.int64)
