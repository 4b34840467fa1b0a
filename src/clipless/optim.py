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
   parameters, global module hooks, or saved-tensor hooks; also one whose model carries other
   input releases than at ``make_private`` (they are accounted once, then), one inside a
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
   ``make_private(..., allow_mean_reduced_loss=True)``) and warns once after it.
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

import contextlib
import dataclasses
import math
import numbers
import os
import secrets
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.modules.module as _module_hooks

from clipless import _workspace, accounting, bounds, constraints, mechanism
from clipless import nn as _cnn
from clipless._bits import same_bits
from clipless.mechanism import CONSTRAINTS, NOISE_STRATEGIES, NoisePlan, PrivacyConfig
from clipless.nn import ParametricLipschitzModule
from clipless.nn._functional import _wrapped
from clipless.nn.input import releases_in
from clipless.nn.validate import _HOOK_KINDS, foreign_hooks
from clipless.sampling import PoissonDataLoader

if TYPE_CHECKING:
    from clipless.accounting import PrivacyLedger
    from clipless.bounds import BoundReport

__all__ = [
    "CONSTRAINTS",
    "NOISE_STRATEGIES",
    "AdamBC",
    "DPOptimizer",
    "PlanExhaustedError",
    "PrivacyContractError",
    "draw_noise",
]


def draw_noise(
    plan: NoisePlan,
    name: str,
    shape: tuple[int, ...],
    generator: torch.Generator,
    dtype: torch.dtype,
    std: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gaussian noise of the plan's standard deviation for the noised tensor ``name``.

    ``shape`` is the tensor's shape, or a batch of independent draws ``(n, *shape)`` (the
    privacy audit, :mod:`clipless.audit`, releases thousands of steps at once through this
    function). Drawn on ``generator``'s device. ``std`` replaces the plan's only where the
    caller holds a larger one (data-parallel replicas agree on the largest, never a smaller one).
    ``out`` (of ``shape`` and ``dtype``, on the generator's device) receives the draw instead of
    a new tensor: the same values from the same generator state.
    """
    if std is not None and std < plan.stds[name]:
        raise ValueError(f"std {std} for {name} is below the plan's {plan.stds[name]}")
    scale = plan.stds[name] if std is None else std
    if out is not None:
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != generator.device:
            raise ValueError(
                f"out must have shape {tuple(shape)}, dtype {dtype} and device "
                f"{generator.device}; got {tuple(out.shape)}, {out.dtype}, {out.device}"
            )
        return torch.normal(0.0, scale, size=shape, generator=generator, out=out)
    return torch.normal(
        0.0, scale, size=shape, generator=generator, device=generator.device, dtype=dtype
    )


class PrivacyContractError(RuntimeError):
    """A training step would break an assumption the noise calibration relies on."""


class PlanExhaustedError(PrivacyContractError):
    """The run has taken every step its privacy budget was planned for."""


@dataclasses.dataclass(eq=False)
class _Pass:
    """One forward pass in training mode: its frozen plan and the weights it used."""

    plan: NoisePlan
    weights: tuple[torch.Tensor, ...]
    params: tuple[torch.nn.Parameter, ...]
    owner: DPOptimizer
    backwards: int = 0

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        """The guard: enforce the per-row cotangent bound ``L`` (module doc, 2)."""
        self.owner._on_backward(self)
        return _enforce_bound(grad, self.plan.output_bound, self.owner)


@dataclasses.dataclass(eq=False)
class _Unguarded:
    """A forward whose gradients the noise does not cover, and why (module doc, 1)."""

    owner: DPOptimizer
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


def _enforce_bound(grad: torch.Tensor, bound: float, owner: DPOptimizer) -> torch.Tensor:
    """Zero non-finite rows, clip every row to norm ``bound`` (float64 norms, safe radius)."""
    if grad.shape[0] == 0:
        return grad
    clipped, norms = _clip_rows(grad, bound)
    largest = float(norms.max())
    owner._last_cotangent_norm = largest
    rows = grad.shape[0] // max(1, owner._multiplicity)
    if not owner._mean_warning_given and rows >= 8 and 0.0 < largest <= bound / rows * (1.0 + 1e-6):
        _mean_reduced(owner, bound, rows, largest)
    return clipped


def _mean_reduced(owner: DPOptimizer, bound: float, rows: int, largest: float) -> None:
    """Every row's cotangent is at most ``L / B``: a mean-reduced loss (it trains at chance).

    An error before the run's first step (a fresh model's loss gradients are far above ``L / B``,
    so only a mean-reduced loss, e.g. a ``torch.nn`` or clipless loss built inside the training
    loop, gets there), unless :attr:`DPOptimizer.allow_mean_reduced_loss`; a warning, once, after
    it (a converged model's gradients can be that small)."""
    message = (
        f"every sample's loss gradient at the model output has norm <= L/B = {bound:.4g}/"
        f"{rows} (largest {largest:.3g}): the loss looks mean-reduced. Its gradients are B "
        "times too small for the noise, which is calibrated to one sample's summed loss; use "
        "reduction='sum' (make_private sets it on the loss it is given: backpropagate "
        "optimizer.loss, not a loss built in the training loop)"
    )
    if owner.ledger.steps == 0 and not owner.allow_mean_reduced_loss:
        raise PrivacyContractError(
            message + "; make_private(..., allow_mean_reduced_loss=True) makes this a warning"
        )
    owner._mean_warning_given = True
    warnings.warn(message, RuntimeWarning, stacklevel=3)


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


def reduced_float32_precision(devices: set[str], convolutions: bool = True) -> str | None:
    """The torch setting (a description) under which float32 convolutions or matrix products on
    one of the device types ``devices`` round below float32, or ``None``.

    CUDA runs float32 convolutions in TF32 by default (``torch.backends.cudnn.allow_tf32`` is
    True): a 10-bit mantissa, like half precision, whose rounding exceeds the float32 margin of
    the noise plan (:data:`clipless.mechanism.ROUNDING_MARGIN`; an audit emulating TF32 measured
    one record's contribution at 1.00025 times its planned sensitivity). ``torch.
    set_float32_matmul_precision("high"/"medium")`` allows TF32 or bfloat16 products on CUDA and
    on CPUs with bfloat16 units. torch >= 2.9 keeps these settings per backend
    (``fp32_precision``, ``"none"`` inheriting from the backend, then from
    ``torch.backends.fp32_precision``; the legacy setters write them): those are read. Older
    torch: the legacy flags. :func:`full_float32_precision` turns everything off.
    ``convolutions=False`` (a model of dense layers only) skips the convolution settings.
    """
    backends = torch.backends
    ops = ("conv", "matmul") if convolutions else ("matmul",)
    wanted = []
    if "cuda" in devices:
        wanted += [("cudnn" if op == "conv" else "cuda", op) for op in ops]
    if "cpu" in devices:
        wanted += [("mkldnn", op) for op in ops]
    root = getattr(backends, "fp32_precision", None)
    if isinstance(root, str):  # torch >= 2.9
        for backend, op in wanted:
            parent = getattr(backends, backend, None)
            leaf = getattr(parent, op, None)
            chain = [
                (f"torch.backends.{backend}.{op}.fp32_precision", leaf),
                (f"torch.backends.{backend}.fp32_precision", parent),
                ("torch.backends.fp32_precision", backends),
            ]
            for name, owner in chain:
                try:
                    value = (
                        getattr(owner, "fp32_precision", "none") if owner is not None else "none"
                    )
                except (AttributeError, RuntimeError):
                    value = "none"
                if value != "none":  # the first explicit setting up the chain decides
                    if value != "ieee":
                        return f"{name} is {value!r}"
                    break
        return None
    precision = torch.get_float32_matmul_precision()  # torch < 2.9: the legacy settings
    if precision != "highest":
        return f"torch.get_float32_matmul_precision() is {precision!r}"
    if "cuda" in devices:
        legacy: list[tuple[str, Any]] = [
            ("torch.backends.cuda.matmul.allow_tf32", backends.cuda.matmul)
        ]
        if convolutions:
            legacy.append(("torch.backends.cudnn.allow_tf32", backends.cudnn))
        for name, owner in legacy:
            if getattr(owner, "allow_tf32", False) is True:
                return f"{name} is True"
    return None


# clipless layers that run no convolution (the precision check's cuDNN exemption)
_DENSE_LAYERS: tuple[type, ...] = (
    _cnn.Sequential,
    _cnn.Residual,
    _cnn.Linear,
    _cnn.InputNorm,
    _cnn.GroupSort,
    _cnn.ReLU,
    _cnn.Tanh,
    _cnn.Sigmoid,
    _cnn.Abs,
    _cnn.Flatten,
    _cnn.LossGradientClip,
)


_FP32_LEAVES = (
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("cuda", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "matmul"),
    ("mkldnn", "rnn"),
)


def full_float32_precision() -> None:
    """Turn TF32 and bfloat16 products off, so that float32 is computed in float32 everywhere
    (what :func:`reduced_float32_precision` checks; ``clipless train`` calls this on CUDA).

    torch >= 2.9: every backend's ``fp32_precision`` is set to ``"ieee"`` (writing the legacy
    flags there leaves a setting such as ``torch.backends.fp32_precision = "tf32"`` inherited);
    older torch: ``allow_tf32 = False`` for cuDNN and cuBLAS and the ``"highest"`` matmul
    precision. A global setting of the process, like the flags it writes.
    """
    backends = torch.backends
    leaves = [getattr(getattr(backends, a, None), b, None) for a, b in _FP32_LEAVES]
    new_api = [leaf for leaf in leaves if leaf is not None and hasattr(leaf, "fp32_precision")]
    if new_api:
        for leaf in new_api:
            leaf.fp32_precision = "ieee"
        return
    backends.cudnn.allow_tf32 = False
    backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class _Hook:
    """A model hook calling ``owner.<method>``; copies of the model (EMA, export) drop it.

    The hook holds its optimizer weakly, and a deep copy or pickle of the model gets an inert
    hook: only the model that was made private is enforced.
    """

    def __init__(self, owner: DPOptimizer | None, method: str) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self._method = method

    def __call__(self, *args: Any) -> Any:
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            if self._owner is not None and self._method == "_before_inner_step":
                # the DPOptimizer is gone but its wrapped optimizer is not: a step now would
                # apply the raw private gradient
                raise PrivacyContractError(
                    "this optimizer was wrapped by a DPOptimizer that no longer exists: step the "
                    "DPOptimizer, or call its detach() before using the wrapped optimizer alone"
                )
            return None
        return getattr(owner, self._method)(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return _Hook(None, self._method)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Hook, (None, self._method))


class _GradHook:
    """A noised parameter's tensor hook: tells ``owner`` a gradient is about to be accumulated."""

    def __init__(self, owner: DPOptimizer | None, param: torch.nn.Parameter | None) -> None:
        self._owner = weakref.ref(owner) if owner is not None else None
        self._param = weakref.ref(param) if param is not None else None

    def __call__(self, grad: torch.Tensor) -> None:
        owner = self._owner() if self._owner is not None else None
        param = self._param() if self._param is not None else None
        if owner is not None and param is not None:
            owner._check_param_hooks(param)
            owner._before_accumulate(param)

    def __deepcopy__(self, memo: dict[int, Any]) -> _GradHook:
        return _GradHook(None, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_GradHook, (None, None))


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


class DPOptimizer(torch.optim.Optimizer):
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
        bad = isinstance(certify_every, bool) or not isinstance(certify_every, numbers.Integral)
        if bad or certify_every < 1:
            raise ValueError(f"certify_every must be an integer >= 1; got {certify_every!r}")
        self.certify_every = int(certify_every)
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
        self._multiplicity = 1
        self._pending: list[_Pass] = []
        self._released: dict[torch.nn.Parameter, tuple[int, int]] = {}
        self._current: _Pass | None = None
        self._mean_warning_given = False
        #: ``False`` (default): a loss that looks mean-reduced before the first step is an error
        #: (it would train at chance); ``True``: a warning (``make_private``'s argument).
        self.allow_mean_reduced_loss = False
        self._last_cotangent_norm = 0.0
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
        self.refresh()

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
        rounding the margin does not cover (audit finding: a ``model.half()`` after
        ``make_private`` stepped with the float32 margin)."""
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
                    f"{setting}: float32 convolutions or matrix products then round their "
                    "operands to TF32 or bfloat16 (a 10- or 7-bit mantissa), beyond the rounding "
                    "margin the noise covers (float32's); call "
                    "clipless.optim.full_float32_precision() before training (it sets every "
                    "backend's float32 precision to IEEE; clipless train does this on CUDA), or "
                    "train in float64"
                )

    # ------------------------------------------------------------------ plans
    def bound_report(self) -> BoundReport:
        """The certified bounds at the current weights (layer norms are memoised exactly)."""
        return bounds.report(self.module, self.loss, self.input_shape)

    def current_plan(self, multiplicity: int = 1) -> NoisePlan:
        """The :class:`NoisePlan` a step would use at the current weights."""
        return mechanism.plan_step(
            self.config,
            self.bound_report(),
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
            layer.scaling_threshold = value
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
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1; got {k!r}")
        previous, self._multiplicity = self._multiplicity, k
        try:
            yield
        finally:
            self._multiplicity = previous

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
        if _input_releases(self.module) != self._releases:
            raise PrivacyContractError(
                "the model's input releases changed after make_private (an InputNorm carrying a "
                "released mean or second moment was added, replaced or removed): the accounting "
                "composes the releases the model had then; build the model with its releases "
                "before make_private"
            )
        k = self._multiplicity
        if k > 1 and x.shape[0] % k:
            raise ValueError(
                f"sample_multiplicity({k}): the batch has {x.shape[0]} rows, not a multiple of "
                f"{k} (every sample occupies {k} consecutive rows)"
            )
        self._check_rows(int(x.shape[0]), k)
        plan = self.current_plan(k)
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
            f"loader has {drawn} examples{of}{copies}: an example in several rows contributes "
            "more than the noise covers. Train on the batch the loader yielded; for K augmented "
            "copies of each example (from the loop or from a collate_fn) use "
            "optimizer.sample_multiplicity(K)"
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
                "step: the accounting assumes that every step trains on a fresh Poisson sample of "
                "rate q from that loader (a batch from another loader, or one batch stepped on "
                "twice, is not covered); iterate the returned loader, one step per batch"
            )
        raise PrivacyContractError(
            f"{new} batches were drawn from the Poisson loader since the last step: the "
            "accounting assumes one step per Poisson batch. Skipping a batch because of what it "
            "holds is not covered (an empty one too: take the step, it adds noise and counts), "
            "nor is training on several at once. Draw other data (shapes, evaluation) from the "
            "original loader or dataset, do not prefetch ahead of the loader (its num_workers "
            "and prefetch_factor are counted correctly), and after stopping for a reason that "
            "does not depend on the batch (a break, a time limit) call "
            "optimizer.discard_batch() before going on"
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
                    f"modules.module.register_module_{kind}_hook): it runs inside the private "
                    "model's guarded pass and can change one example's gradient beyond what the "
                    "noise covers; remove it while training privately"
                )
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is not None and top(False) is not None:
            raise PrivacyContractError(
                "saved-tensor hooks are active (torch.autograd.graph.saved_tensors_hooks or "
                "save_on_cpu around the model): their unpack step feeds the backward pass and can "
                "change one example's gradient beyond what the noise covers"
            )
        for name, sub in self.module.named_modules():
            hooks = foreign_hooks(sub)
            if hooks:
                raise PrivacyContractError(
                    f"module {name or '<root>'!r} has {hooks[0]} that clipless did not place: it "
                    "runs inside the guarded pass and can change one example's gradient beyond "
                    "what the noise covers; remove it (or register it on a copy of the model)"
                )
        for p in self._names:
            self._check_param_hooks(p)

    def _check_param_hooks(self, p: torch.nn.Parameter) -> None:
        """Refuse a tensor hook on a noised parameter that clipless did not place. Checked before
        every training forward and again in the backward pass (by the parameter's own hook, which
        runs first): a hook registered between the forward and the backward, and removed before
        the step, scaled the gradient 100 times unseen (audit, RESULTS.md section 30)."""
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
        marked: torch.Tensor = _OutputMark.apply(output, mark)
        return marked

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
        marked: torch.Tensor = _OutputMark.apply(output, _Unguarded(self, _LAYER_BACKWARD))
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
                "tensors that require a gradient, or moved to another place in the model "
                "(torch.func.functional_call, a torch.func transform over a parameter, "
                "parameters swapped between layers): a gradient through them reaches the "
                "trained parameters outside the planned sensitivity, or gets another "
                "parameter's noise. Pass detached tensors for a reference computation "
                "(clipless.diagnostics does), or train the model as make_private saw it"
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
                "a forward of the private model (or of one of its layers) ran inside a "
                "torch.func transform (grad, vjp, vmap, jacrev) on parameters that require a "
                "gradient: that pass has no output clip, so a gradient through it is not "
                "covered by the noise. For a reference computation pass detached parameters "
                "through torch.func.functional_call (clipless.diagnostics does), or run it "
                "under torch.no_grad(); a penalty on input gradients is not supported"
            )

    def _on_backward(self, record: _Pass) -> None:
        for p, w in zip(record.params, record.weights, strict=True):
            if not same_bits(p.detach(), w):
                raise PrivacyContractError(
                    f"parameter {self._watched[p]!r} changed between the forward and the backward "
                    "pass: the noise was planned for the weights the forward used"
                )
        record.backwards += 1
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
        """Refuse a gradient changed in place without bumping its version counter (``.data``,
        a NumPy view): its float64 norm must be bitwise the one recorded at accumulation."""
        params = [p for p in self._fingerprints if p.grad is not None]
        if not params:
            return
        before = torch.stack([self._fingerprints[p] for p in params])
        now = torch.stack([_fingerprint(p.grad) for p in params])  # type: ignore[arg-type]
        if torch.equal(before, now):
            return
        changed = [self._names[p] for p, a, b in zip(params, before, now, strict=True) if a != b]
        raise PrivacyContractError(
            f"the gradient of {changed[0]!r} was changed after the backward pass without autograd "
            "seeing it (a write through .data or a NumPy view): the noise was calibrated for the "
            "gradient the guarded backward pass accumulated"
        )

    def _before_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._stepping:
            raise PrivacyContractError(
                "the optimizer given to make_private was stepped directly: its gradients carry no "
                "noise and the step is not accounted; call step() on the optimizer make_private "
                "returned"
            )

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
        for p, name in self._names.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if parallel is not None and not parallel.adds_noise:
                p.grad.div_(plan.expected_batch_size)
                continue
            shape, dtype = tuple(p.shape), p.grad.dtype
            # a reused buffer (clipless._workspace: no page faults per step), consumed here
            buffer = _workspace.scratch("weight.draft", shape, dtype, self.generator.device)
            noise = draw_noise(plan, name, shape, self.generator, dtype, std=stds[name], out=buffer)
            p.grad.add_(noise.to(p.grad.device))
            p.grad.div_(plan.expected_batch_size)
        observe = getattr(self.original_optimizer, "set_noise_variance", None)
        if observe is not None:  # AdamBC: the noise's variance in each averaged gradient
            observe({p: (stds[n] / plan.expected_batch_size) ** 2 for p, n in self._names.items()})
        if parallel is not None:  # every rank steps with the noisy gradient of the noising rank
            parallel.broadcast([p.grad for p in self._names if p.grad is not None])

    def _plan_for_step(self) -> NoisePlan:
        """The plan of the one private gradient the step releases (or refuse it)."""
        pending = self._pending
        if len(pending) > 1:
            raise PrivacyContractError(
                f"{len(pending)} backward passes through the model since the last step: "
                "accumulating gradients over several backward passes (or backpropagating one "
                "batch twice) lets one sample contribute more than the noise covers; take one "
                "step per backward pass"
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
        return self.current_plan(self._multiplicity)  # no gradient: an empty batch

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Checks, accounting, noise, inner step, projection (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._check_parameters()
            plan = self._plan_for_step()
            remaining = self.steps_remaining
            if remaining is not None and remaining <= 0:
                raise PlanExhaustedError(
                    f"the privacy budget was planned for {self.config.steps} steps and all were "
                    "taken; a further step would spend more than the target epsilon. To train "
                    "longer, call engine.extend(steps=...) (it re-accounts and reports the new "
                    "epsilon)"
                )
            self._check_batch_drawn()
            # Write-ahead accounting: the step is recorded (and persisted, with a ledger_path)
            # before any noisy value exists, so a crash can only over-count, never under-count.
            writes = self.data_parallel is None or self.data_parallel.writes_ledger
            if (
                self.ledger_path is not None
                and writes
                and self._ledger_file_checked != self.ledger_path
            ):
                # Before the first write: the file must not record more than this ledger (a
                # fresh run, or a hand-written resume from an older checkpoint, would forget it).
                self.ledger.check_overwrite(self.ledger_path)
                self._ledger_file_checked = self.ledger_path
            self.ledger.record(
                plan.accounting_noise_multiplier, plan.sample_rate, proven=plan.proven
            )
            if self.ledger_path is not None and writes:
                self.ledger.to_json(self.ledger_path)
            self.add_noise(plan)
        finally:
            if self.data_loader is not None:  # a refused step consumes its batch too
                self._drawn_at_step = self.data_loader.batches_yielded
            self._pending = []
            self._accumulated = {}
            self._fingerprints = {}
            self._incoming = {}
            self._refusal = {}
        self._stepping = True
        try:
            self.original_optimizer.step()
        finally:
            self._stepping = False
        self._released = {
            p: (id(p.grad), p.grad._version) for p in self._names if p.grad is not None
        }
        if self.config.constraint is not None:
            constraints.project(
                self.module,
                mode=self.config.constraint,  # type: ignore[arg-type]
                max_norm=self.config.max_norm,
                certify_every=self.certify_every,
            )
        return loss

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


def _real(value: object) -> bool:
    """A real number (NumPy scalars included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class AdamBC(torch.optim.Optimizer):
    """Adam with the privacy noise's variance removed from its second moment (DP-AdamBC).

    Tang, Shpilevskiy and Lécuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply
    Bias Correction)", AAAI 2024, Algorithm 1. The private gradient is ``g~ = g + z / B`` with
    ``z`` Gaussian of the plan's standard deviation ``s`` (per tensor) and ``B`` the expected batch
    size, so Adam's second moment estimates ``E[g^2] + (s / B)^2``: the noise's variance
    ``Phi = (s / B)^2`` dominates every coordinate whose signal is small, and DP-Adam then behaves
    like DP-SGD with a rescaled step (the paper's observation). This optimizer subtracts it:

    ``m_t = b1 m + (1 - b1) g~``, ``v_t = b2 v + (1 - b2) g~^2``,
    ``phi_t = b2 phi + (1 - b2) Phi_t``,
    ``p -= lr (m_t / (1 - b1^t)) / sqrt(max((v_t - phi_t) / (1 - b2^t), floor))``.

    ``phi_t`` is the same moving average of the per-step noise variance as ``v_t``'s, so the
    correction is exact in expectation when the noise scale changes between steps (certified
    bounds follow the weights). ``floor`` (the paper's ``gamma'``) keeps the denominator away
    from zero where ``v_t - phi_t`` is small or negative: ``max(floor, floor_ratio * phi_t /
    (1 - b2^t))``, i.e. an absolute floor and one relative to the noise variance.

    **Privacy.** Post-processing: ``Phi`` is computed from the plan's public noise scale and the
    public expected batch size, and everything else is a function of the released noisy
    gradients. :class:`DPOptimizer` passes the variances before each inner step
    (:meth:`set_noise_variance`); used alone (no variance given) this is Adam with ``eps``
    inside the square root.

    Measured here (``benchmarks/RESULTS.md`` section 22a): no gain over Adam on Adult or on
    Fashion-MNIST's scattering features (linear models); a ``floor_ratio`` below ~0.3 loses.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        floor: float = 1e-12,
        floor_ratio: float = 0.0,
    ) -> None:
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2); got {betas!r}")
        for name, value, lo, hi in (
            ("lr", lr, 0.0, math.inf),
            ("betas[0]", betas[0], 0.0, 1.0),
            ("betas[1]", betas[1], 0.0, 1.0),
        ):
            if not (_real(value) and lo <= value < hi):
                raise ValueError(f"{name} must be a number in [{lo}, {hi}); got {value!r}")
        if not (_real(floor) and 0.0 < floor < math.inf):
            raise ValueError(f"floor must be a positive finite number; got {floor!r}")
        if not (_real(floor_ratio) and 0.0 <= floor_ratio < math.inf):
            raise ValueError(f"floor_ratio must be a finite number >= 0; got {floor_ratio!r}")
        defaults = {
            "lr": float(lr),
            "betas": (float(betas[0]), float(betas[1])),
            "floor": float(floor),
            "floor_ratio": float(floor_ratio),
        }
        super().__init__(params, defaults)
        self._variance: dict[torch.nn.Parameter, float] = {}

    def set_noise_variance(self, variances: dict[torch.nn.Parameter, float]) -> None:
        """Per-coordinate variance of the noise in each parameter's gradient, for the next step."""
        for var in variances.values():
            if not (isinstance(var, float) and 0.0 <= var < math.inf):
                raise ValueError(f"noise variance must be a finite float >= 0; got {var!r}")
        self._variance = dict(variances)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        variance, self._variance = self._variance, {}
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["noise_avg"] = 0.0
                state["step"] += 1
                t = state["step"]
                state["exp_avg"].lerp_(grad, 1.0 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
                state["noise_avg"] = b2 * state["noise_avg"] + (1.0 - b2) * variance.get(p, 0.0)
                c2 = 1.0 - b2**t
                phi = state["noise_avg"] / c2
                floor = max(group["floor"], group["floor_ratio"] * phi)
                denom = (state["exp_avg_sq"] / c2).sub_(phi).clamp_(min=floor).sqrt_()
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1.0 - b1**t))
        return loss


_FINGERPRINT_CHUNK = 2**17  # float64 entries (1 MiB) converted at a time


def _fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """The bits of ``grad``'s float64 sum of squares, on its device (NaN-safe exact comparison).

    A large contiguous CPU gradient is converted to float64 1 MiB at a time, into a reused
    buffer (``clipless._workspace``): ``vector_norm(..., dtype=float64)`` made a float64 copy of
    the whole gradient, 4 MiB more at the step's memory peak (``benchmarks/RESULTS.md`` 26f).
    """
    g = grad.detach()
    n = g.numel()
    if g.device.type != "cpu" or not g.is_contiguous() or n <= _FINGERPRINT_CHUNK:
        return torch.linalg.vector_norm(g, dtype=torch.float64).square().view(torch.int64)
    flat = g.view(-1)
    buffer = _workspace.scratch("float64.rows", (_FINGERPRINT_CHUNK,), torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, n, _FINGERPRINT_CHUNK):
        part = buffer[: min(_FINGERPRINT_CHUNK, n - start)]
        part.copy_(flat[start : start + _FINGERPRINT_CHUNK])
        total += torch.dot(part, part)
    return total.view(torch.int64)
