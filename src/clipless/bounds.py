"""Backpropagation for bounds (Béthune et al. 2024, Algorithm 1; docs/design.md "Cotangent bound").

:func:`report` propagates the public input bound ``X_0`` forwards through a ``clipless.nn`` model
and the cotangent bound ``G = L`` (Lipschitz constant of the loss in the logits) backwards, and
collects every parametric layer's per-sample gradient bounds; :func:`sensitivities` flattens them
to one bound per parameter name. Bound arithmetic is in Python floats (float64), every product and
sum rounded upward (:mod:`clipless._certified`).

The certified operator norms these bounds rest on live in :mod:`clipless.norms`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.nn.modules.module as _module_hooks

from clipless import _validate
from clipless import nn as cnn
from clipless._bits import same_bits
from clipless._certified import UNIT_ROUNDOFF, add, mul, sqrt, up
from clipless._modes import foreign_mode

__all__ = [
    "BoundReport",
    "LayerBound",
    "report",
    "sensitivities",
]


@dataclass(frozen=True)
class LayerBound:
    """Bounds for one parametric layer occurrence (Béthune et al. 2024, Algorithm 1, lines 2, 6, 7).

    ``input_bound`` ``X >= ||x||`` for the layer's input, ``cotangent_bound`` ``G >=
    ||dloss/dy||`` for its output (one sample, ``reduction="sum"`` units), ``lipschitz`` its
    certified input-Lipschitz constant, ``norm_factor_bound`` its bound on
    ``sample_norm_factor`` for inputs of norm ``<= X``, and ``gradient_bounds`` the layer's
    ``gradient_bounds(X, G)`` keyed by full parameter names (as in ``model.named_parameters()``;
    a read-only mapping).
    """

    path: str
    input_bound: float
    cotangent_bound: float
    lipschitz: float
    norm_factor_bound: float
    gradient_bounds: Mapping[str, float]


@dataclass(frozen=True)
class BoundReport:
    """Result of :func:`report`: ``X_0``, the loss constant ``L``, one entry per parametric layer.

    ``layers`` are in forward order (a module used twice appears twice); ``model_lipschitz`` is a
    certified Lipschitz constant of the model after its leading ``InputNorm``. ``output_shape``
    is one example's output shape (the model's output without its batch dimension).
    """

    input_bound: float
    loss_lipschitz: float
    num_logits: int
    layers: tuple[LayerBound, ...]
    model_lipschitz: float
    output_shape: tuple[int, ...] = ()

    def sensitivities(self) -> dict[str, float]:
        """Per-parameter bounds, summed over occurrences (triangle inequality for shared layers)."""
        out: dict[str, float] = {}
        for layer in self.layers:
            for name, bound in layer.gradient_bounds.items():
                out[name] = add(out[name], bound) if name in out else float(bound)
        return out

    def total_sensitivity(self) -> float:
        """``sqrt(sum_p Delta_p^2)``: a bound on one sample's whole-model gradient norm."""
        squares = math.fsum(v * v for v in self.sensitivities().values())
        return sqrt(up(squares * (1.0 + 4.0 * UNIT_ROUNDOFF)))


class _Walker:
    """The two passes of Béthune et al.'s Algorithm 1 over a tree of clipless containers.

    ``Sequential`` is walked child by child, ``Residual`` through its branch; every other module is
    a leaf, described by its ``lipschitz()`` and ``output_bound()``. Forward (line 2):
    ``X_out = output_bound(X_in)`` (Residual: ``scale (X + X_branch)``). Backward (line 7; chain
    rule and submultiplicativity, docs/design.md "Cotangent bound"): a leaf maps ``G_out`` to
    ``G_out Lip``; ``LossGradientClip(c)`` to ``min(G_out, c)`` (its backward clips every sample's
    cotangent to norm ``c``, whatever came from above); a Residual ``scale (x + g(x))`` passes
    ``scale G_out`` into its branch and returns ``min(scale G_out + G_branch_in, G_out Lip)``,
    because ``||scale (dy + J_g^T dy)|| <= scale ||dy|| + ||J_g^T (scale dy)||``.
    """

    def __init__(
        self,
        shapes: Mapping[int, tuple[int, ...]],
        skip: torch.nn.Module,
        output_bounds: bool = True,
    ) -> None:
        self.shapes = shapes
        self.skip = skip
        self.output_bounds = output_bounds
        self.input_bounds: dict[tuple[str, int], float] = {}
        self.entries: list[tuple[str, torch.nn.Module, float, float]] = []
        self.cache: dict[int, float] = {}
        self.visits: dict[int, int] = {}

    def lipschitz(self, module: torch.nn.Module) -> float:
        """Certified constant (cached: the weights do not change during one report)."""
        key = id(module)
        if key not in self.cache:
            self.cache[key] = self._lipschitz(module)
        return self.cache[key]

    def _lipschitz(self, module: torch.nn.Module) -> float:
        """Certified constant of a module; Conv2d gets the input size recorded by the hooks."""
        if module is self.skip:
            return 1.0  # the leading InputNorm: no cotangent is needed below it
        shape = self.shapes.get(id(module))
        if isinstance(module, cnn.Conv2d) and shape is not None and len(shape) >= 2:
            return float(module.lipschitz(input_size=(int(shape[-2]), int(shape[-1]))))
        if isinstance(module, cnn.Sequential):
            value = 1.0
            for child in module:
                value = mul(value, self.lipschitz(child))
            return value
        if isinstance(module, cnn.Residual):
            return mul(float(module.scale), add(1.0, self.lipschitz(module.branch)))
        if not isinstance(module, cnn.LipschitzModule):
            raise TypeError(f"{type(module).__name__} is not a clipless.nn.LipschitzModule")
        return float(module.lipschitz())

    def forward(self, module: torch.nn.Module, path: str, x_bound: float) -> float:
        self.input_bounds[(path, id(module))] = x_bound
        self.visits[id(module)] = self.visits.get(id(module), 0) + 1
        if isinstance(module, cnn.Sequential):
            for name, child in _children(module):
                x_bound = self.forward(child, _join(path, name), x_bound)
            return x_bound
        if isinstance(module, cnn.Residual):
            branch = self.forward(module.branch, _join(path, "branch"), x_bound)
            return mul(float(module.scale), add(x_bound, branch))
        if isinstance(module, cnn.InputNorm) or (
            self.output_bounds and isinstance(module, cnn.LipschitzModule)
        ):
            return float(module.output_bound(x_bound))
        if isinstance(module, cnn.LipschitzModule):
            return math.inf  # not asked for (report's output_bounds)
        raise TypeError(f"module {path or '<root>'} is not a clipless.nn.LipschitzModule")

    def backward(self, module: torch.nn.Module, path: str, g_bound: float) -> float:
        if isinstance(module, cnn.Sequential):
            for name, child in reversed(_children(module)):
                g_bound = self.backward(child, _join(path, name), g_bound)
            return g_bound
        if isinstance(module, cnn.Residual):
            g_branch = mul(float(module.scale), g_bound)
            through = self.backward(module.branch, _join(path, "branch"), g_branch)
            return min(add(g_branch, through), mul(g_bound, self.lipschitz(module)))
        if isinstance(module, cnn.LossGradientClip):
            return min(g_bound, float(module.max_norm))
        if isinstance(module, cnn.ParametricLipschitzModule):
            x_bound = self.input_bounds[(path, id(module))]
            self.entries.append((path, module, x_bound, g_bound))
        return mul(g_bound, self.lipschitz(module))


def _children(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Children in call order, repeats included (``named_children`` drops a reused module)."""
    return [(name, child) for name, child in module._modules.items() if child is not None]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _leading_module(model: torch.nn.Module) -> torch.nn.Module | None:
    module: torch.nn.Module | None = model
    while isinstance(module, cnn.Sequential):
        module = module[0] if len(module) > 0 else None
    return module


#: Rows of the zero batch of the structural forward: two, so that a module merging the samples
#: of a batch into one row is seen as well as one folding a sample into several rows.
_ROWS = 2


def _zero_input(model: torch.nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    tensors = [*model.parameters(), *model.buffers()]
    ref = next((t for t in tensors if t.is_floating_point()), None)
    if ref is None:
        return torch.zeros((_ROWS, *input_shape))
    return torch.zeros((_ROWS, *input_shape), dtype=ref.dtype, device=ref.device)


def _trusted_forward(module: torch.nn.Module) -> bool:
    """True when ``module``'s forward is one of clipless's own (its bounds were proved for it)."""
    return getattr(type(module).forward, "__module__", "").startswith("clipless.")


def _graph_parameters(output: object) -> set[int]:
    """Ids of the leaf tensors requiring grad that ``output``'s autograd graph reaches."""
    found: set[int] = set()
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        return found
    seen: set[object] = set()
    stack: list[object] = [output.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf (a parameter)
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
        stack.extend(f for f, _ in getattr(fn, "next_functions", ()))
    return found


def _buffer_state(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    return {name: (id(b), b._version) for name, b in model.named_buffers(remove_duplicate=False)}


def _buffers_changed(before: Mapping[str, tuple[int, int]], model: torch.nn.Module) -> list[str]:
    """Buffers written in place (same tensor, new version); re-assigned ones are compared by
    value in the custom leaves (:func:`_leaf_tensors`), new ones are created on first use."""
    return [
        name
        for name, (ident, version) in _buffer_state(model).items()
        if name in before and before[name][0] == ident and before[name][1] != version
    ]


def _leaf_tensors(leaf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the buffers and tensor attributes of ``leaf`` and its submodules (by path)."""
    out: dict[str, torch.Tensor] = {}
    for path, sub in leaf.named_modules(remove_duplicate=False):
        named = [*sub._buffers.items(), *vars(sub).items()]
        for name, t in named:
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                out[_join(path, name)] = t.detach().clone()
    return out


def _changed(before: torch.Tensor | None, after: torch.Tensor) -> bool:
    if before is None:
        return False  # created by this forward (a constant made on first use)
    return not same_bits(before, after.detach())  # NaN patterns compare equal too


def _random_like(args: tuple[object, ...], generator: torch.Generator) -> tuple[object, ...]:
    """``args`` with every floating-point tensor replaced by public standard normal values."""
    out: list[object] = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            noise = torch.randn(a.shape, generator=generator, dtype=torch.float64)
            out.append(noise.to(dtype=a.dtype, device=a.device))
        else:
            out.append(a)
    return tuple(out)


def _check_structure(
    model: torch.nn.Module,
    walker: _Walker,
    calls: Mapping[int, int],
    rows: Mapping[int, int],
    inputs: Mapping[int, tuple[object, ...]],
    output_rows: int,
) -> None:
    """Refuse a model whose forward is not the composition the walk certifies.

    The walk follows the containers' children and trusts each leaf's ``lipschitz()``; what runs
    must match (each check has a reproduction in ``tests/test_sensitivities.py``):

    * every module runs as many times as the walk visits it, and every parametric layer with a
      trainable parameter is visited (one held by a custom leaf, e.g. through a tied weight,
      would add an uncounted use of its parameters; a frozen one is a constant);
    * no ``Sequential`` / ``Residual`` subclass replaces the container's forward (a skip
      ``x + super().forward(x)`` or a reordering keeps the call counts);
    * every visited module receives one row per sample, and so does the model's output: the
      scaled kernels, ``LossGradientClip`` and the output guard bound each *row*, so a leaf that
      folds a sample into several rows (or merges samples into one) would multiply a sample's
      contribution;
    * a custom leaf (a ``LipschitzModule`` whose forward is not clipless's own) uses no parameter
      (a custom parametric layer: only its own): its ``lipschitz()`` certifies a function of
      its input, and a parameter used inside it is a use the gradient bounds do not count. It is
      re-run with gradients on, on its recorded zero input and on a public random one (seeded),
      and its output's autograd graph is searched for parameters; its buffers and tensor
      attributes must keep their values (state updated from the batch is released unnoised).

    A custom leaf's code remains trusted beyond these runs: a use of a parameter, or a state
    update, that happens only for some inputs other than the two tried is not seen.
    """
    modules = {id(m): m for m in model.modules()}

    def where(key: int) -> str:  # only for the messages
        paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        return repr(paths.get(key, "?") or "<root>")

    _refuse_overridden_containers(modules, where)
    _refuse_uncounted_uses(modules, walker, calls, where)
    _refuse_folded_rows(modules, walker, rows, output_rows, where)
    custom = [
        (key, m)
        for key, m in modules.items()
        if key in walker.visits
        and key in inputs
        and not isinstance(m, (cnn.Sequential, cnn.Residual))
        and not _trusted_forward(m)
    ]
    if not custom:
        return
    generator = torch.Generator().manual_seed(0)  # public, fixed: the same check every step
    for key, m in custom:
        _check_custom_leaf(m, inputs[key], generator, where(key))


def _refuse_overridden_containers(
    modules: Mapping[int, torch.nn.Module], where: Callable[[int], str]
) -> None:
    """A ``Sequential`` / ``Residual`` subclass must keep the container's forward."""
    for key, m in modules.items():
        if isinstance(m, cnn.Sequential) and type(m).forward is not cnn.Sequential.forward:
            kind = "Sequential"
        elif isinstance(m, cnn.Residual) and type(m).forward is not cnn.Residual.forward:
            kind = "Residual"
        else:
            continue
        raise ValueError(
            f"module {where(key)} ({type(m).__name__}) overrides the forward of clipless "
            f"{kind}, whose children the bounds follow in order; write the composition as nested "
            "Sequential / Residual"
        )


def _refuse_uncounted_uses(
    modules: Mapping[int, torch.nn.Module],
    walker: _Walker,
    calls: Mapping[int, int],
    where: Callable[[int], str],
) -> None:
    """Every module runs as often as the walk visits it; every trainable layer is visited."""
    for module_id, visits in walker.visits.items():
        if calls.get(module_id, 0) != visits:
            raise ValueError(
                f"module {where(module_id)} ran {calls.get(module_id, 0)} time(s) in a forward "
                f"pass but the bound computation visits it {visits} time(s); write the "
                "composition as nested Sequential / Residual"
            )
    for module_id, layer in modules.items():
        if (
            isinstance(layer, cnn.ParametricLipschitzModule)
            and module_id not in walker.visits
            and any(p.requires_grad for p in layer.parameters())
        ):
            raise ValueError(
                f"parametric layer {where(module_id)} ({type(layer).__name__}) sits inside a "
                "custom module that the bounds treat as one leaf, so its uses are not counted; "
                "put it in clipless Sequential / Residual containers"
            )


def _refuse_folded_rows(
    modules: Mapping[int, torch.nn.Module],
    walker: _Walker,
    rows: Mapping[int, int],
    output_rows: int,
    where: Callable[[int], str],
) -> None:
    """Every visited module, and the output, keep one row per sample."""
    for module_id, n in rows.items():  # the modules that received other than _ROWS rows
        if module_id in walker.visits:
            raise ValueError(
                f"module {where(module_id)} ({type(modules[module_id]).__name__}) received "
                f"{n} row(s) for a batch of {_ROWS} samples; every module must keep one row per "
                "sample (do not fold positions into the batch dimension)"
            )
    if output_rows != _ROWS:
        raise ValueError(
            f"the model returned {output_rows} row(s) for a batch of {_ROWS} samples: the "
            "output must keep one row per sample"
        )


def _check_custom_leaf(
    m: torch.nn.Module, recorded: tuple[object, ...], generator: torch.Generator, name: str
) -> None:
    """A custom leaf keeps its tensors and uses no parameter but its own (see
    :func:`_check_structure`)."""
    state = _leaf_tensors(m)
    own = set()
    if isinstance(m, cnn.ParametricLipschitzModule):
        own = {id(p) for p in m.parameters(recurse=False)}
    used: set[int] = set()
    # the recorded zero input, then a public random one (a branch on the input's values, or a
    # running statistic that zeros leave unchanged, shows there)
    for args in (recorded, _random_like(recorded, generator)):
        with torch.enable_grad():
            used |= _graph_parameters(m(*args))
    changed = [key for key, t in _leaf_tensors(m).items() if _changed(state.get(key), t)]
    if changed:
        raise ValueError(
            f"custom module {name} ({type(m).__name__}) changes its tensor(s) "
            f"{changed} in a training forward: state updated from the batch (running "
            "statistics) is private data released without noise"
        )
    foreign = used - own
    if foreign:
        raise ValueError(
            f"custom module {name} ({type(m).__name__}) uses {len(foreign)} "
            "parameter(s) in its forward that are not its own (no gradient bound counts "
            "those uses); share weights through clipless layers in the containers instead"
        )


def report(
    model: torch.nn.Module,
    loss: object,
    input_shape: tuple[int, ...],
    *,
    output_bounds: bool = True,
) -> BoundReport:
    """Backpropagation for bounds (Béthune et al., Algorithm 1; docs/design.md "Cotangent bound").

    1. ``clipless.nn.validate(model)``; the model must start with an ``InputNorm``, whose
       ``max_norm`` is the certified input bound ``X_0`` (Béthune et al., section 3.1: the model
       projects every input, so ``X_0`` holds whatever the data).
    2. One no-grad forward of ``torch.zeros(2, *input_shape)`` records every module's input shape
       (forward pre-hooks; ``Conv2d``, ``GroupNorm`` and ``Sigmoid`` also record the sizes their
       bounds depend on) and the number of logits per sample.
    3. Forward pass of bounds ``X_k = f_k.output_bound(X_{k-1})`` (line 2).
    4. Backward pass of cotangent bounds from ``G = loss.lipschitz(num_logits)`` (line 4): ``G_k``
       bounds ``||dloss/dy_k||`` for one sample's loss, and ``G_k Lip_k`` is passed below layer
       ``k`` (line 7), with the container rules of :class:`_Walker` (``Residual``, nested
       ``Sequential``, ``LossGradientClip``). ``Conv2d.lipschitz`` receives the recorded size.
    5. Each parametric layer reports ``gradient_bounds(X_{k-1}, G_k)`` (line 6).

    The paper's ``G = L / b`` (a mean over a batch of ``b``) is left to the caller: every bound
    here is for one sample's loss (``reduction="sum"``). Bound arithmetic is in Python floats
    (float64), each product and sum rounded upward (:func:`math.nextafter`). A parametric layer
    hidden inside a custom (non-``Sequential``, non-``Residual``) container is not reached:
    :func:`sensitivities` then raises.

    ``output_bounds=False`` skips step 3 past the ``InputNorm`` layers: every other module's
    output bound is taken as ``inf`` (so are the input, gradient and norm-factor bounds after
    it). The cotangent bounds, hence the sensitivities of the per-sample scaling, do not depend
    on them, and a biased layer's output bound would read its bias's norm from the device (a
    synchronisation per layer and step on an accelerator): the private step's plan asks for
    them only with ``scaling="bound"``, whose thresholds are the norm-factor bounds.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    shape = _sample_shape(input_shape)
    key = _structure_key(model, shape)
    cached = _TRACES.get(model) if key is not None else None
    known = cached is not None and cached[0] == key
    # a structure already validated and checked (the key covers what those checks read)
    first, lip_fn = _report_arguments(model, loss, validate=not known)
    x0 = float(first.max_norm)
    trace = cached[1] if known and cached is not None else _trace_forward(model, shape, first)
    output = trace.output
    assert isinstance(output, torch.Tensor)  # _trace_forward refused anything else
    num_logits = max(1, math.prod(int(d) for d in output.shape[1:]))
    loss_lip = float(lip_fn(num_logits))
    if not (math.isfinite(loss_lip) and loss_lip >= 0.0):
        raise ValueError(f"loss.lipschitz({num_logits}) returned {loss_lip!r}")
    walker = _Walker(trace.shapes, first, output_bounds)
    walker.forward(model, "", x0)
    walker.backward(model, "", loss_lip)
    if not known:
        # The walk follows the containers' children lists: the model that runs must be the one
        # it certifies (call counts, container forwards, one row per sample, parameter-free
        # leaves). Kept for reuse only once checked, with the key of the state the trace leaves
        # (it records sizes on Conv2d / GroupNorm: a forward at another size is a new key).
        rows = int(output.shape[0])
        _check_structure(model, walker, trace.calls, trace.rows, trace.inputs, rows)
        after = _structure_key(model, shape)
        if after is not None:
            _TRACES[model] = (after, trace)
    return BoundReport(
        input_bound=x0,
        loss_lipschitz=loss_lip,
        num_logits=num_logits,
        layers=_layer_bounds(model, walker),
        model_lipschitz=walker.lipschitz(model),
        output_shape=tuple(int(d) for d in output.shape[1:]),
    )


def _sample_shape(input_shape: object) -> tuple[int, ...]:
    """:func:`report`'s ``input_shape`` checked, as a tuple."""
    shape = (input_shape,) if isinstance(input_shape, int) else input_shape
    if (
        not isinstance(shape, tuple | list)
        or not shape
        or any(not _validate.is_int(d) or d < 1 for d in shape)
    ):
        raise ValueError(
            f"input_shape must be a non-empty tuple of positive ints (one sample, no batch "
            f"dimension), got {input_shape!r}"
        )
    return tuple(shape)


def _report_arguments(
    model: torch.nn.Module, loss: object, *, validate: bool = True
) -> tuple[cnn.InputNorm, Callable[[int], float]]:
    """:func:`report`'s model (validated, unless its structure was) and loss checked: the
    leading ``InputNorm`` and the loss's ``lipschitz``."""
    if validate:
        cnn.validate(model)
    lip_fn = getattr(loss, "lipschitz", None)
    if not callable(lip_fn):
        raise TypeError(
            f"loss must be a clipless.nn loss with lipschitz(num_logits), got {type(loss).__name__}"
        )
    first = _leading_module(model)
    if not isinstance(first, cnn.InputNorm):
        raise ValueError(
            "the model must start with a clipless.nn.InputNorm (its max_norm is the certified "
            f"input bound X_0); its first layer is {type(first).__name__}"
        )
    return first, lip_fn


@dataclass
class _Trace:
    """What the no-grad forward of a zero input recorded, per module id."""

    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    reused: dict[int, set[tuple[int, ...]]] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)
    rows: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, tuple[object, ...]] = field(default_factory=dict)
    output: object = None

    def hook(self, module: torch.nn.Module, args: tuple[object, ...]) -> None:
        key = id(module)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.inputs.setdefault(key, args)
        if args and isinstance(args[0], torch.Tensor):
            leading = int(args[0].shape[0]) if args[0].dim() else 0
            if leading != _ROWS:
                self.rows.setdefault(key, leading)  # the first use that breaks the rule
            new = tuple(int(d) for d in args[0].shape[1:])
            old = self.shapes.setdefault(key, new)
            # modules whose bounds depend on the input size (Conv2d's operator norm and k_eff,
            # Sigmoid's and GroupNorm's sample_numel) are certified for ONE size
            if old != new and (isinstance(module, cnn.Conv2d) or hasattr(module, "sample_numel")):
                self.reused.setdefault(key, {old}).add(new)


# The last checked trace of each model with the structure key it left (:func:`report`).
_TRACES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[object, _Trace]] = (
    weakref.WeakKeyDictionary()
)
# Attributes a step changes without changing what the forward computes on a zero input (the
# scaled kernels run the plain product without autograd, whatever the threshold).
_PER_STEP_ATTRIBUTES = frozenset({"scaling_threshold", "scaling_multiplicity"})


def _structure_key(model: torch.nn.Module, shape: tuple[int, ...]) -> object | None:
    """What a clipless model's zero-input forward and the report's structural checks depend on,
    or ``None`` (never reuse).

    Only a model of clipless modules with their own forwards has a key (their zero-input
    forward is a function of it: module tree, classes, modes, public attributes, parameters and
    buffers (shape, dtype, device, whether trained, identity), hooks of every kind, and the
    input shape; none writes a buffer). A custom module, an instance-level forward or an
    active Python mode has none: the report traces and checks it every call. The key covers
    what :func:`clipless.nn.validate` and :func:`_check_structure` read, so a report whose key
    is the one its last check left reuses that trace and those verdicts."""
    if (
        foreign_mode() is not None
        or _module_hooks._global_forward_hooks
        or (_module_hooks._global_forward_pre_hooks)
    ):
        return None
    entries: list[object] = [shape]
    for name, m in model.named_modules(remove_duplicate=False):
        state = vars(m)
        if "forward" in state or not _known_forward(m):
            return None
        # in insertion order: the same attributes set in another order only re-trace
        attributes = [
            (k, _attribute_key(v))
            for k, v in state.items()
            if k[0] != "_" and k not in _PER_STEP_ATTRIBUTES
        ]
        tensors = [
            (k, None if v is None else (v.shape, v.dtype, v.device, v.requires_grad, id(v)))
            for table in (m._parameters, m._buffers)
            for k, v in table.items()
        ]
        hooks = (
            tuple(m._forward_pre_hooks),
            tuple(m._forward_hooks),
            tuple(m._backward_pre_hooks),
            tuple(m._backward_hooks),
        )
        entries.append((name, id(m), type(m), m.training, attributes, tensors, hooks))
    return entries


def _known_forward(module: torch.nn.Module) -> bool:
    """A clipless layer's own forward, or a clipless container's unchanged one."""
    for kind in (cnn.Sequential, cnn.Residual):
        if isinstance(module, kind):
            return type(module).forward is kind.forward
    return _trusted_forward(module)


_PLAIN = frozenset({bool, int, float, str, torch.dtype, torch.device})


def _attribute_key(value: object) -> object:
    """A module attribute as a comparable value: plain data by value, anything else by identity
    (a replaced object is a new key)."""
    if value is None or type(value) in _PLAIN:
        return (type(value), value)
    if isinstance(value, tuple | list):
        return (type(value), tuple(_attribute_key(v) for v in value))
    return (type(value), id(value))


def _trace_forward(
    model: torch.nn.Module, shape: tuple[int, ...], first: torch.nn.Module
) -> _Trace:
    """Run the model once on a zero input under no grad, recording every module's input shape
    and uses (forward pre-hooks), and refuse what the bounds cannot cover: buffers written by
    the forward (running statistics: private data released without noise), a size-dependent
    module used at two sizes (its certified bounds hold for one; ``Conv2d`` layers may share a
    weight instead), the leading ``InputNorm`` reused (only its first use is the certified input
    projection, later uses are not 1-Lipschitz), an output that is not ``[batch, ...]``."""
    trace = _Trace()
    handles = [m.register_forward_pre_hook(trace.hook) for m in model.modules()]
    buffers = _buffer_state(model)
    try:
        with torch.no_grad():
            trace.output = model(_zero_input(model, shape))
    finally:
        for handle in handles:
            handle.remove()
    changed = _buffers_changed(buffers, model)
    if changed:
        raise ValueError(
            f"the training forward changes the model's buffer(s) {changed} (private data "
            "released without noise); use modules whose training forward leaves them alone"
        )
    if trace.reused:
        paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        key, sizes = next(iter(trace.reused.items()))
        kind = type(next(m for m in model.modules() if id(m) == key)).__name__
        raise ValueError(
            f"{kind} {paths.get(key, '?')!r} is applied to inputs of {len(sizes)} shapes "
            f"{sorted(sizes)} but is certified for one input size; use one {kind} per size "
            "(tied weights add their bounds)"
        )
    if trace.calls.get(id(first), 0) > 1:
        raise ValueError(
            "the model's leading InputNorm is applied more than once but only its first use is "
            "certified; use another InputNorm instance where the model normalises again"
        )
    if not isinstance(trace.output, torch.Tensor) or trace.output.dim() < 1:
        raise ValueError("the model must return a tensor of shape [batch, ...]")
    return trace


def _layer_bounds(model: torch.nn.Module, walker: _Walker) -> tuple[LayerBound, ...]:
    """Each parametric layer's bounds from the walk, in forward order, its gradient bounds keyed
    by the model's parameter names."""
    names = {id(p): name for name, p in model.named_parameters()}
    layers: list[LayerBound] = []
    for path, module, x_bound, g_bound in reversed(walker.entries):
        assert isinstance(module, cnn.ParametricLipschitzModule)
        full: dict[str, float] = {}
        for local_name, bound in module.gradient_bounds(x_bound, g_bound).items():
            param = module._parameters.get(local_name)
            if param is None or id(param) not in names:
                raise ValueError(
                    f"{type(module).__name__} at {path!r}: gradient_bounds returned the unknown "
                    f"parameter {local_name!r}"
                )
            full[names[id(param)]] = float(bound)
        layers.append(
            LayerBound(
                path=path,
                input_bound=x_bound,
                cotangent_bound=g_bound,
                lipschitz=walker.lipschitz(module),
                norm_factor_bound=float(module.norm_factor_bound(x_bound)),
                gradient_bounds=MappingProxyType(full),
            )
        )
    return tuple(layers)


def sensitivities(
    model: torch.nn.Module, loss: object, input_shape: tuple[int, ...]
) -> dict[str, float]:
    """Certified bound on one sample's gradient norm for EVERY name of ``model.named_parameters()``.

    From :func:`report` (Béthune et al. 2024, Algorithm 1, ``Delta_d`` of line 6, per parameter
    tensor, for one sample's loss with ``reduction="sum"`` and no gradient scaling); a layer used
    several times gets the sum of its occurrences' bounds (triangle inequality). Frozen parameters
    (``requires_grad=False``) that no layer bounds get 0: they receive no gradient. Raises
    :class:`ValueError` if a trainable parameter is not covered (e.g. it sits in a custom
    container the walker cannot see through).
    """
    result = report(model, loss, input_shape).sensitivities()
    out: dict[str, float] = {}
    missing: list[str] = []
    for name, param in model.named_parameters():
        if name in result:
            out[name] = result[name]
        elif not param.requires_grad:
            out[name] = 0.0
        else:
            missing.append(name)
    if missing:
        raise ValueError(
            "no gradient bound for parameter(s) " + ", ".join(missing) + ": every parametric "
            "layer must be reachable through clipless.nn.Sequential / Residual containers"
        )
    return out
