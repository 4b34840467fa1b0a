"""``convert(model)``: turn a plain torch model into its certified clipless twin.

The analogue of Opacus's ``ModuleValidator.fix`` (:func:`clipless.nn.validate` is the analogue of
``ModuleValidator.validate``). Each module is mapped to a clipless layer with a certified bound
where one exists; the result always starts with a :class:`~clipless.nn.InputNorm` (the certified
input bound ``X_0`` of :mod:`clipless.bounds`). Every decision is recorded in a
:class:`ConversionReport`:

* **twins** compute exactly the original function (weights copied): ``Linear``, ``Conv2d`` (no
  groups, no dilation, ``padding_mode`` zeros or circular), ``Conv1d`` (the same, as a ``Conv2d``
  with a ``1 x k`` kernel), ``ReLU``, ``Tanh``, ``Sigmoid``, ``LeakyReLU``, ``Hardtanh`` /
  ``ReLU6`` (``min_val <= 0 <= max_val``), ``ELU`` (``alpha >= 0``), ``Flatten``
  (``start_dim >= 1``), ``AvgPool2d`` (``count_include_pad=True``, floor mode; overlapping windows
  too, Lipschitz ``sqrt(m / (kh kw))``), ``MaxPool2d`` with overlapping
  or padded windows (:class:`~clipless.nn.MaxPool2d`, Lipschitz ``sqrt(m)``), ``Sequential``;
* **substitutions** change the function: ``MaxPool2d(k)`` (stride = kernel, no padding) ->
  :class:`~clipless.nn.L2NormPool2d` (same windows), ``BatchNorm*`` / ``LayerNorm`` /
  ``GroupNorm`` / ``InstanceNorm*`` -> :class:`~clipless.nn.GroupNorm` (per-sample statistics;
  batch statistics mix samples, which voids per-sample sensitivity; affine parameters are
  dropped);
* **removals**: ``Dropout*`` and ``Identity`` (identities in eval mode);
* **insertion**: a leading ``InputNorm(max_norm=input_norm)`` when the model has none;
* **unconvertible**: everything else (other activations, attention, recurrent layers,
  ``Embedding``, ...; docs/opacus-migration.md "Layers without a certified twin").

A custom module (its own ``forward``) is traced with :func:`torch.fx.symbolic_trace`, in eval
mode (a branch on ``self.training`` takes its eval-mode side). When the graph is a chain of
module calls and of the functions ``relu``/``tanh``/``sigmoid``/``leaky_relu``/``hardtanh``/
``relu6``/``elu``/``flatten``/``view(x.size(0), -1)``/``view(-1, N)`` (a
``Flatten(features=N)`` that refuses samples of another size, which the view would mix)/
``max_pool2d``/``avg_pool2d``/``dropout(..., training=self.training)``
(with constant sizes), with skip connections ``x + f(x)`` or ``(x + f(x)) / 2``, it is rebuilt
as a :class:`~clipless.nn.Sequential` with :class:`~clipless.nn.Residual` blocks
(``mode="add"`` / ``"average"``). Anything else is reported as unconvertible with the fx node
and the reason: concatenation, products of activations, data-dependent control flow, direct use
of parameters, several inputs or outputs, indexing, ``F.dropout`` with its default ``training=True``
(it drops in eval mode too), and an in-place operation whose overwritten tensor is read again
or whose result is unused (``h.mul_(3)``, ``h + F.relu(h, inplace=True)``; ``h += f(h)`` is a
skip connection). A module carrying forward or backward hooks is unconvertible (the hooks
change its function and would not be carried over).

Every blocker is listed in one pass (:attr:`ConversionEntry.blocker`): when a traced forward is
not such a chain, each of its layers and operations without a certified equivalent is reported
(layers first, then operations), and then the structural reason unless it is one of them; a
forward that cannot be traced still has its children's blockers listed.

Function preservation: when the report has no substitutions (:attr:`ConversionReport.exact`),
the converted model computes the original model's function in eval mode for every input inside
the ``InputNorm`` ball. (The engine then projects the weights onto its operator-norm constraint,
which changes the function again if the original weights violate it.)
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx
import torch.nn.functional as F

from clipless.nn import _checks, _twins
from clipless.nn._base import LipschitzModule
from clipless.nn._twins import _ViewFlatten
from clipless.nn.activations import Flatten
from clipless.nn.containers import Residual, Sequential
from clipless.nn.export import PlainResidual
from clipless.nn.input import InputNorm
from clipless.nn.validate import _type_name, foreign_hooks

__all__ = ["ConversionEntry", "ConversionReport", "convert"]

EntryKind = Literal["twin", "substituted", "removed", "inserted", "unconvertible"]
BlockerKind = Literal["module", "operation", "structure"]
_BLOCKER_ORDER = {"module": 0, "operation": 1, None: 1, "structure": 2}


@dataclass(frozen=True)
class ConversionEntry:
    """One decision of :func:`convert`.

    Attributes:
        path: the module's qualified name in the original model (``""`` for the root); for an
            operation of a traced ``forward``, the path of the module whose forward it is in.
        original: the original type (``"torch.nn.BatchNorm2d"``) or operation
            (``"call_function torch.cat"``).
        replacement: the clipless module put in its place (its repr), or ``None`` when the module
            was removed or could not be converted.
        reason: why (and, for an unconvertible module, what to do instead).
        kind: ``"twin"`` (same function, weights copied), ``"substituted"`` (a different,
            certified function), ``"removed"`` (identity in eval mode), ``"inserted"`` (the
            leading ``InputNorm``) or ``"unconvertible"``.
        node: the :mod:`torch.fx` node name when the entry comes from a traced ``forward``.
        blocker: for an unconvertible entry, what blocks: ``"module"`` (a layer without a
            certified equivalent), ``"operation"`` (a function or tensor method of a traced
            ``forward``) or ``"structure"`` (how the forward combines them); ``None`` otherwise.
    """

    path: str
    original: str
    replacement: str | None
    reason: str
    kind: EntryKind
    node: str | None = None
    blocker: BlockerKind | None = None

    def __str__(self) -> str:
        where = repr(self.path) if self.path else "<root>"
        if self.node is not None:
            where += f" (fx node {self.node!r})"
        target = self.replacement if self.replacement is not None else "-"
        return f"{where}: {self.original} -> {target} [{self.kind}] {self.reason}"


@dataclass(frozen=True)
class ConversionReport:
    """Everything :func:`convert` did, in model order (:class:`ConversionEntry` each)."""

    entries: tuple[ConversionEntry, ...]

    @property
    def unconvertible(self) -> tuple[ConversionEntry, ...]:
        """Modules and operations without a certified clipless equivalent.

        The real blockers first: layers, then operations, then the structural reasons (how a
        traced forward combines them), each group in model order.
        """
        found = [e for e in self.entries if e.kind == "unconvertible"]
        return tuple(sorted(found, key=lambda e: _BLOCKER_ORDER[e.blocker]))

    @property
    def substitutions(self) -> tuple[ConversionEntry, ...]:
        """Replacements that change the function (e.g. max pooling -> L2-norm pooling)."""
        return tuple(e for e in self.entries if e.kind == "substituted")

    @property
    def removed(self) -> tuple[ConversionEntry, ...]:
        """The entries of modules that were removed (not replaced) by the conversion."""
        return tuple(e for e in self.entries if e.kind == "removed")

    @property
    def ok(self) -> bool:
        """True when everything was converted (the result passes :func:`clipless.nn.validate`)."""
        return not self.unconvertible

    @property
    def exact(self) -> bool:
        """True when the converted model computes the original function.

        In eval mode and for inputs inside the ``InputNorm`` ball: no substitutions and nothing
        unconvertible (removed modules are identities in eval mode).
        """
        return self.ok and not self.substitutions

    def __str__(self) -> str:
        lines = [f"ConversionReport ({len(self.entries)} entries):"]
        lines += [f"  - {entry}" for entry in self.entries]
        return "\n".join(lines)


class _UnconvertibleError(Exception):
    """A traced graph that is not a chain with ``x + f(x)`` skips (internal)."""

    def __init__(self, node: torch.fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.node = node
        self.reason = reason


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class _Outcome:
    """What the converter records for one leaf module (the registry's :class:`_twins.Outcome`)."""

    def __init__(self, converter: _Converter, module: torch.nn.Module, path: str, name: str):
        self.converter, self.module, self.path, self.name = converter, module, path, name

    def twin(self, new: torch.nn.Module, reason: str = "certified twin") -> torch.nn.Module:
        self.converter.record(self.path, self.name, new, reason, "twin")
        return new

    def substitute(self, new: torch.nn.Module, reason: str) -> torch.nn.Module:
        self.converter.record(self.path, self.name, new, reason, "substituted")
        return new

    def removed(self, reason: str) -> None:
        self.converter.record(self.path, self.name, None, reason, "removed")

    def unconvertible(self, reason: str) -> torch.nn.Module:
        self.converter.record(self.path, self.name, None, reason, "unconvertible")
        return _deepcopy(self.module)

    def sequential(self, items: list[tuple[str, torch.nn.Module | None]]) -> torch.nn.Module:
        return self.converter.sequential(items)


class _Converter:
    def __init__(self) -> None:
        self.entries: list[ConversionEntry] = []
        self.memo: dict[int, torch.nn.Module | None] = {}

    def record(
        self,
        path: str,
        original: str,
        replacement: torch.nn.Module | None,
        reason: str,
        kind: EntryKind,
        node: str | None = None,
        blocker: BlockerKind | None = None,
    ) -> None:
        text = None
        if replacement is not None:
            text = f"clipless.nn.{type(replacement).__name__}({replacement.extra_repr()})"
        if kind == "unconvertible" and blocker is None:
            blocker = "operation" if node is not None else "module"
        self.entries.append(ConversionEntry(path, original, text, reason, kind, node, blocker))

    def hooked(self, module: torch.nn.Module, path: str) -> bool:
        """Record ``module`` as unconvertible if it carries hooks clipless did not place."""
        hooks = foreign_hooks(module)
        if hooks:
            self.record(
                path,
                _type_name(module),
                None,
                f"has {' and '.join(hooks)} (they change its function, and the converted model "
                "would not carry them); remove them before converting",
                "unconvertible",
            )
        return bool(hooks)

    # ------------------------------------------------------------------ modules
    def module(self, module: torch.nn.Module, path: str) -> torch.nn.Module | None:
        """The converted module (``None``: removed); unconvertible ones are deep-copied."""
        key = id(module)
        if key not in self.memo:
            self.memo[key] = self._module(module, path)
        return self.memo[key]

    def _module(self, module: torch.nn.Module, path: str) -> torch.nn.Module | None:
        name = _type_name(module)
        if self.hooked(module, path):
            return _deepcopy(module)
        if isinstance(module, LipschitzModule):
            return _deepcopy(module)
        if type(module) is torch.nn.Sequential:
            return self.sequential(
                [
                    (child_name, self.module(child, _join(path, child_name)))
                    for child_name, child in module._modules.items()
                    if child is not None
                ]
            )
        leaf = self.leaf(module, path, name)
        if leaf is not _NOT_A_LEAF:
            return leaf
        return self.traced(module, path)

    def leaf(self, m: torch.nn.Module, path: str, name: str) -> Any:
        """The converted leaf (``None``: removed), by its registry entry (:mod:`._twins`);
        ``_NOT_A_LEAF`` for a custom module with its own ``forward`` (traced instead)."""
        outcome = _Outcome(self, m, path, name)
        rule = _twins.converter(m)
        if rule is not None:
            return rule(m, outcome)
        if type(m).__module__.startswith("torch.") or not _has_own_forward(m):
            return outcome.unconvertible(_twins.advice(m))
        return _NOT_A_LEAF

    # --------------------------------------------------------------- containers
    def sequential(self, items: list[tuple[str, torch.nn.Module | None]]) -> torch.nn.Module:
        """A clipless ``Sequential`` of the converted items (a torch one if some are not)."""
        kept = OrderedDict((name, module) for name, module in items if module is not None)
        if all(isinstance(m, LipschitzModule) for m in kept.values()):
            return Sequential(kept)
        return torch.nn.Sequential(kept)

    def residual(self, branch: torch.nn.Module, mode: str) -> torch.nn.Module:
        if isinstance(branch, LipschitzModule):
            return Residual(branch, mode=mode)
        return PlainResidual(branch, 1.0 if mode == "add" else 0.5)

    # ------------------------------------------------------------------ tracing
    def traced(self, module: torch.nn.Module, path: str) -> torch.nn.Module:
        name = _type_name(module)
        # traced in eval mode: the converted model computes the eval-mode function (a branch on
        # self.training, or F.dropout(..., training=self.training), is read in that mode)
        tracer = _Tracer()
        # an inlined module's code is traced into the graph, but not its backward hooks
        if any(self.hooked(sub, sub_path) for sub_path, sub in _inlined(module, tracer, path)):
            return _deepcopy(module)
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        try:
            graph_module = torch.fx.GraphModule(module, tracer.trace(module))
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.scan_children(module, path)
            self.record(
                path,
                name,
                None,
                f"torch.fx.symbolic_trace failed ({type(exc).__name__}: {first_line}); only "
                "forwards without data-dependent control flow can be converted",
                "unconvertible",
                blocker="structure",
            )
            return _deepcopy(module)
        finally:
            for m, training in modes:
                m.training = training
        try:
            structure = _Structure(graph_module.graph).build()
        except _UnconvertibleError as exc:
            # list every blocker of this forward at once: its layers and operations without a
            # certified equivalent first, then the structural reason (unless it is one of them)
            flagged = self.scan(graph_module, module, path)
            if exc.node.name not in flagged:
                self.record(
                    path,
                    name,
                    None,
                    f"{_describe(exc.node)}: {exc.reason}; only chains of layers with skip "
                    "connections x + f(x) or (x + f(x)) / 2 can be converted",
                    "unconvertible",
                    node=exc.node.name,
                    blocker="structure",
                )
            return _deepcopy(module)
        return self.build(structure, module, path)

    def scan_children(self, module: torch.nn.Module, path: str) -> None:
        """Record the blockers among the children of a module whose forward cannot be traced."""
        probe = _Converter()
        for child_name, child in module.named_children():
            probe.module(child, _join(path, child_name))
        self.entries.extend(e for e in probe.entries if e.kind == "unconvertible")

    def scan(
        self, graph_module: torch.fx.GraphModule, owner: torch.nn.Module, path: str
    ) -> set[str]:
        """Record every called layer and operation of a traced forward that has no certified
        equivalent (modules first, then operations); return the names of the flagged nodes.

        Arithmetic (``+``, ``*``, ``/``, their in-place forms) is left to the structural check,
        which decides whether it is a skip connection; dead values are not counted.
        """
        probe = _Converter()  # converts without recording twins into this report
        flagged: dict[str, list[ConversionEntry]] = {}
        operations: list[ConversionEntry] = []
        for node in graph_module.graph.nodes:
            if not node.users and not _mutates(node):
                continue
            if node.op == "call_module":
                before = len(probe.entries)
                target = str(node.target)
                probe.module(owner.get_submodule(target), _join(path, target))
                found = [e for e in probe.entries[before:] if e.kind == "unconvertible"]
                if found:
                    flagged[node.name] = found
                continue
            if node.op not in ("call_function", "call_method") or _is_helper(node):
                continue
            substitute = _function_module(node)
            if substitute is not None:
                before = len(probe.entries)
                try:
                    probe.leaf(substitute, path, _describe(node))
                except (TypeError, ValueError) as exc:
                    probe.record(path, _describe(node), None, str(exc), "unconvertible")
                for e in probe.entries[before:]:
                    if e.kind == "unconvertible":
                        operations.append(
                            dataclasses.replace(e, node=node.name, blocker="operation")
                        )
                        flagged[node.name] = []
                continue
            if _is_arithmetic(node):
                continue
            reason = _why_not(node)
            operations.append(
                ConversionEntry(
                    path, _describe(node), None, reason, "unconvertible", node.name, "operation"
                )
            )
            flagged[node.name] = []
        for found in flagged.values():
            self.entries.extend(found)
        self.entries.extend(operations)
        return set(flagged)

    def build(self, items: list[Any], owner: torch.nn.Module, path: str) -> torch.nn.Module:
        out: list[tuple[str, torch.nn.Module | None]] = []
        for item in items:
            if isinstance(item, _ResidualSpec):
                branch = self.build(item.branch, owner, path)
                out.append((item.node.name, self.residual(branch, item.mode)))
                continue
            node: torch.fx.Node = item
            if node.op == "call_module":
                target = str(node.target)
                out.append(
                    (node.name, self.module(owner.get_submodule(target), _join(path, target)))
                )
                continue
            substitute = _function_module(node)
            assert substitute is not None  # _Structure accepted it
            before = len(self.entries)
            try:
                converted = self.leaf(substitute, path, _describe(node))
            except (TypeError, ValueError) as exc:
                self.record(path, _describe(node), None, str(exc), "unconvertible", node.name)
                converted = None
            for i in range(before, len(self.entries)):
                e = self.entries[i]
                reason = e.reason
                if node.target in ("view", "reshape"):
                    reason += " (view/reshape to [batch, -1] is a flatten)"
                self.entries[i] = dataclasses.replace(
                    e,
                    reason=reason,
                    node=node.name,
                    blocker="operation" if e.kind == "unconvertible" else None,
                )
            out.append((node.name, converted))
        return self.sequential(out)


_NOT_A_LEAF = object()


def _inlined(
    module: torch.nn.Module, tracer: torch.fx.Tracer, path: str
) -> list[tuple[str, torch.nn.Module]]:
    """The descendants whose ``forward`` the tracer inlines (reached through non-leaves only)."""
    out = []
    for name, child in module.named_children():
        child_path = _join(path, name)
        if not tracer.is_leaf_module(child, child_path):
            out.append((child_path, child))
            out.extend(_inlined(child, tracer, child_path))
    return out


def _deepcopy(module: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(module)


def _has_own_forward(module: torch.nn.Module) -> bool:
    return type(module).forward is not torch.nn.Module.forward


def _describe(node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "output":
        return "the forward"
    if node.op == "call_function":
        public = next(
            (k for k, v in vars(F).items() if v is target and not k.startswith("_")), None
        )
        if public is not None:
            return f"call_function torch.nn.functional.{public}"
        qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", str(target))
        module = getattr(target, "__module__", None) or ""
        module = {"torch._C._nn": "torch.nn.functional", "_operator": "operator"}.get(
            module, module
        )
        if module == "torch._C._VariableFunctions" or module.startswith("torch._C"):
            module = "torch"
        if module == "torch":
            qual = getattr(target, "__name__", qual)  # not torch._VariableFunctionsClass.cat
        return f"call_function {module + '.' if module else ''}{qual}"
    if node.op == "call_method":
        return f"call_method Tensor.{target}"
    return f"{node.op} {target}"


# --------------------------------------------------------------------------- functions
# Stubs give the signatures of the functions and methods a traced forward may call.
def _sig_unary(input: Any, inplace: bool = False) -> None: ...
def _sig_flatten(input: Any, start_dim: int = 0, end_dim: int = -1) -> None: ...
def _sig_method_flatten(self: Any, start_dim: int = 0, end_dim: int = -1) -> None: ...
def _sig_dropout(
    input: Any, p: float = 0.5, training: bool = True, inplace: bool = False
) -> None: ...
def _sig_method_unary(self: Any) -> None: ...
def _sig_leaky(input: Any, negative_slope: float = 0.01, inplace: bool = False) -> None: ...
def _sig_hardtanh(
    input: Any, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False
) -> None: ...
def _sig_elu(input: Any, alpha: float = 1.0, inplace: bool = False) -> None: ...


def _activation_module(node: torch.fx.Node) -> torch.nn.Module | None:
    """LeakyReLU, Hardtanh / ReLU6 and ELU called as functions (``None``: none of them)."""
    target = node.target
    if target in _LEAKY:
        bound = _bind(_sig_leaky, node)
        return None if bound is None else torch.nn.LeakyReLU(bound.arguments["negative_slope"])
    if target is F.relu6:
        return None if _bind(_sig_unary, node) is None else torch.nn.ReLU6()
    if target in _HARDTANH:
        bound = _bind(_sig_hardtanh, node)
        if bound is None:
            return None
        return torch.nn.Hardtanh(bound.arguments["min_val"], bound.arguments["max_val"])
    if target in _ELU:
        bound = _bind(_sig_elu, node)
        return None if bound is None else torch.nn.ELU(bound.arguments["alpha"])
    return None


def _view_features(node: torch.fx.Node) -> int | None:
    """``N`` of ``x.view(-1, N)`` / ``x.reshape(-1, N)`` with a constant ``N`` (else None)."""
    if node.kwargs or len(node.args) < 2:
        return None
    shape = node.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if len(shape) != 2 or shape[0] != -1:
        return None
    n = shape[1]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return None
    return n


_RELU = {torch.relu, F.relu, torch.relu_, F.relu_}
_LEAKY = {F.leaky_relu, F.leaky_relu_}
_HARDTANH = {F.hardtanh, F.hardtanh_, F.relu6}
_ELU = {F.elu, F.elu_}
_TANH = {torch.tanh, F.tanh}
_SIGMOID = {torch.sigmoid, F.sigmoid}
_DROPOUT = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout}
_ADD = {operator.add, torch.add, operator.iadd}


def _bind(sig: Callable[..., None], node: torch.fx.Node) -> inspect.BoundArguments | None:
    try:
        bound = inspect.signature(sig).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def _function_module(node: torch.fx.Node) -> torch.nn.Module | None:
    """The torch module a function/method node computes on its first argument (``None``: none).

    Arguments other than the input must be constants (a size computed from a tensor, as in
    ``F.avg_pool2d(h, h.size(3))``, is not a module's constant), except in ``view``/``reshape``,
    whose ``x.size(0)`` is checked by :func:`_batch_flatten_source`.
    """
    target = node.target
    constants = not any(
        isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values())
    )
    if not constants and target not in ("view", "reshape"):
        return None
    if node.op == "call_function":
        if target in _RELU or target in _TANH or target in _SIGMOID:
            if _bind(_sig_unary, node) is None:
                return None
            if target in _RELU:
                return torch.nn.ReLU()
            return torch.nn.Tanh() if target in _TANH else torch.nn.Sigmoid()
        activation = _activation_module(node)
        if activation is not None:
            return activation
        if target is torch.flatten:
            bound = _bind(_sig_flatten, node)
            if bound is None:
                return None
            return torch.nn.Flatten(bound.arguments["start_dim"], bound.arguments["end_dim"])
        if target in _DROPOUT:
            bound = _bind(_sig_dropout, node)
            # traced in eval mode; training=True (F.dropout's default) drops in eval mode too
            if bound is None or bound.arguments["training"] is not False:
                return None
            return torch.nn.Dropout()
        if target in (F.max_pool2d, F.avg_pool2d):
            try:
                fn = torch.nn.MaxPool2d if target is F.max_pool2d else torch.nn.AvgPool2d
                return fn(*node.args[1:], **node.kwargs)  # type: ignore[arg-type]
            except TypeError:
                return None
        return None
    if node.op == "call_method":
        if target in ("relu", "tanh", "sigmoid", "relu_", "tanh_", "sigmoid_"):
            if _bind(_sig_method_unary, node) is None:
                return None
            kind = str(target).rstrip("_")
            return {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}[
                kind
            ]()
        if target == "flatten":
            bound = _bind(_sig_method_flatten, node)
            if bound is None:
                return None
            return torch.nn.Flatten(bound.arguments["start_dim"], bound.arguments["end_dim"])
        if target in ("view", "reshape") and _batch_flatten_source(node) is not None:
            return torch.nn.Flatten(1, -1)
        features = _view_features(node) if target in ("view", "reshape") else None
        if features is not None:
            return _ViewFlatten(features)
    return None


def _is_batch_size_of(node: Any, source: torch.fx.Node) -> bool:
    """``source.size(0)`` or ``source.shape[0]``."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_method" and node.target == "size":
        return bool(len(node.args) == 2 and node.args[0] is source and node.args[1] == 0)
    if node.op == "call_function" and node.target is operator.getitem:
        base, index = node.args
        return bool(
            index == 0
            and isinstance(base, torch.fx.Node)
            and (
                (
                    base.op == "call_function"
                    and base.target is getattr
                    and base.args[0] is source
                    and base.args[1] == "shape"
                )
                or (base.op == "call_method" and base.target == "size" and base.args == (source,))
            )
        )
    return False


def _batch_flatten_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of ``x.view(b, -1)`` (and ``reshape``), ``b`` the batch size read from ``x`` or
    from a value ``x`` was computed from (every such value has the batch size as its first
    dimension: the chain's operations map samples to samples), else None. ``x.view(-1, n)`` is not
    accepted: it is a flatten only when ``n`` is the sample's size, which tracing does not know."""
    if node.kwargs or len(node.args) < 2:
        return None
    source = node.args[0]
    if not isinstance(source, torch.fx.Node):
        return None
    shape = node.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if len(shape) != 2:
        return None
    first, second = shape
    if second != -1 or not isinstance(first, torch.fx.Node):
        return None
    for base in (source, *_ancestors(source)):
        if _is_batch_size_of(first, base):
            return source
    return None


def _is_helper(node: torch.fx.Node) -> bool:
    """Shape queries feeding a ``view(x.size(0), -1)``: not data flow."""
    if node.op == "call_method" and node.target == "size":
        return True
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",):
        return True
    if node.op == "call_function" and node.target is operator.getitem:
        base = node.args[0]
        return isinstance(base, torch.fx.Node) and _is_helper(base)
    return False


class _Proxy(torch.fx.Proxy):
    """Records ``h += t`` as ``operator.iadd`` (and so on): ``torch.fx.Proxy`` has no in-place
    operators, so ``h += t`` was traced as ``h = h + t``, and a name bound to ``h`` before it
    (``x0 = x; x += f(x); ... x + x0``) read the old value in the graph but the updated one
    eagerly."""

    def _inplace(self, op: Callable[[Any, Any], Any], other: Any) -> torch.fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    def __iadd__(self, other: Any) -> torch.fx.Proxy:
        return self._inplace(operator.iadd, other)

    def __isub__(self, other: Any) -> torch.fx.Proxy:
        return self._inplace(operator.isub, other)

    def __imul__(self, other: Any) -> torch.fx.Proxy:
        return self._inplace(operator.imul, other)

    def __itruediv__(self, other: Any) -> torch.fx.Proxy:
        return self._inplace(operator.itruediv, other)


class _Tracer(torch.fx.Tracer):
    """Leaves: every torch.nn module and clipless module; custom modules are traced through."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, LipschitzModule) or type(m) is torch.nn.Sequential:
            return True
        return type(m).__module__.startswith("torch.") or not _has_own_forward(m)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _Proxy(node, self)


@dataclass
class _ResidualSpec:
    branch: list[Any]
    mode: str
    node: torch.fx.Node  # the add (or the division / multiplication for "average")
    source: torch.fx.Node


class _Structure:
    """Decompose a traced graph into a chain of nodes with nested ``x + f(x)`` blocks."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.sources: dict[torch.fx.Node, int] = {}  # residual source -> number of skips from it
        self.used: set[torch.fx.Node] = set()

    def build(self) -> list[Any]:
        nodes = list(self.graph.nodes)
        for n in nodes:
            if n.op == "get_attr":
                raise _UnconvertibleError(
                    n, f"reads the attribute self.{n.target} directly (wrap it in a module)"
                )
        output = next(n for n in nodes if n.op == "output")
        result = output.args[0]
        if not isinstance(result, torch.fx.Node):
            raise _UnconvertibleError(output, "the forward must return a single tensor")
        inputs = [n for n in nodes if n.op == "placeholder" and n.users]
        if len(inputs) != 1:
            names = ", ".join(n.name for n in inputs)
            raise _UnconvertibleError(
                output,
                f"the forward must use exactly one input tensor, it uses {len(inputs)} ({names})",
            )
        items = self.chain(inputs[0], result)
        self.used.add(inputs[0])
        self.check_users()
        self.check_mutations()
        return items

    def check_mutations(self) -> None:
        """Refuse an in-place operation unless the converted (out-of-place) chain computes the
        same values: it must feed the chain (a dead ``h.mul_(3)`` still changes ``h``), and no
        operation after it may read the tensor it overwrote, directly or through a view (``h +
        F.relu(h, inplace=True)`` adds ``relu(h)`` twice). ``h += f(h)`` and ``F.relu(f(x),
        inplace=True)`` pass."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in self.graph.nodes:
            if not _mutates(node):
                continue
            if node not in self.used:
                raise _UnconvertibleError(
                    node, "an in-place operation whose result the forward does not use"
                )
            target = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
            aliases = _aliases(target) if isinstance(target, torch.fx.Node) else set()
            for alias in aliases:
                later = [
                    u
                    for u in alias.users
                    if u is not node
                    and u not in aliases
                    and order[u] > order[node]
                    and not _is_helper(u)  # x.size(0) reads the shape, not the data
                ]
                if later:
                    raise _UnconvertibleError(
                        node,
                        f"overwrites a tensor in place that {later[0].name!r} reads afterwards "
                        "(the converted layers compute out of place, so that value would differ)",
                    )

    def chain(self, src: torch.fx.Node, dst: torch.fx.Node) -> list[Any]:
        """The items mapping the value ``src`` to the value ``dst``, in call order."""
        items: list[Any] = []
        node = dst
        while node is not src:
            if node.op == "placeholder":
                raise _UnconvertibleError(
                    node, "the value is reached by two paths that are not a skip x + f(x)"
                )
            self.used.add(node)
            residual = self.residual(node)
            if residual is not None:
                items.append(residual)
                node = residual.source
                continue
            items.append(node)
            node = self.unary_input(node)
        items.reverse()
        return items

    def residual(self, node: torch.fx.Node) -> _ResidualSpec | None:
        add, mode = node, "add"
        halved = _halved(node)
        if halved is not None:
            add, mode = halved, "average"
            self.used.add(add)
        if not _is_add(add):
            return None
        operands = [*add.args, *add.kwargs.values()]
        tensors = [a for a in operands if isinstance(a, torch.fx.Node)]
        if len(operands) != 2 or len(tensors) != 2:
            raise _UnconvertibleError(
                add,
                "adds a constant or uses alpha= (only skip connections x + f(x) are certified)",
            )
        a, b = tensors
        if a is b:
            return _ResidualSpec([], mode, node, a)
        if a in _ancestors(b):
            source, end = a, b
        elif b in _ancestors(a):
            source, end = b, a
        else:
            raise _UnconvertibleError(
                add,
                "adds two tensors neither of which is computed from the other alone (only skip "
                "connections x + f(x) have a certified bound)",
            )
        branch = self.chain(source, end)
        self.sources[source] = self.sources.get(source, 0) + 1
        return _ResidualSpec(branch, mode, node, source)

    def unary_input(self, node: torch.fx.Node) -> torch.fx.Node:
        if node.op == "call_module":
            if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], torch.fx.Node):
                raise _UnconvertibleError(node, "the module is called with several arguments")
            return node.args[0]
        if node.op in ("call_function", "call_method") and _function_module(node) is not None:
            source = node.args[0]
            others = [a for a in (*node.args[1:], *node.kwargs.values()) if _is_data(a)]
            if isinstance(source, torch.fx.Node) and not others:
                return source
        raise _UnconvertibleError(node, _why_not(node))

    def check_users(self) -> None:
        for n in self.graph.nodes:
            if n not in self.used:
                continue
            # dead code (a value computed and never used) does not count
            users = [u for u in n.users if u in self.used or u.op == "output"]
            expected = 1 + self.sources.get(n, 0)
            if len(users) != expected:
                names = ", ".join(repr(u.name) for u in users)
                raise _UnconvertibleError(
                    n,
                    f"its value is used by {len(users)} operations ({names}) where the chain "
                    f"with skip connections x + f(x) uses it {expected} time(s)",
                )


# what _Proxy records for h += t and friends (item assignment fails to trace)
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv}
# operations whose result shares storage with their first argument
_VIEWS = {
    "view",
    "view_as",
    "reshape",
    "reshape_as",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "transpose",
    "t",
    "permute",
    "expand",
    "expand_as",
    "narrow",
    "select",
    "unfold",
    "as_strided",
    "detach",
    "contiguous",
    "getitem",
    "__getitem__",
    "split",
    "chunk",
    "unbind",
    "movedim",
    "swapaxes",
    "swapdims",
    "diagonal",
    "real",
    "imag",
    "view_as_real",
    "view_as_complex",
}


def _name(node: torch.fx.Node) -> str:
    target = node.target
    return str(target) if isinstance(target, str) else str(getattr(target, "__name__", target))


def _mutates(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes into its first argument (or an ``out=`` tensor)."""
    if node.op == "call_module":
        # conservative for a leaf container: any in-place member (but dropout, traced in eval
        # mode, writes nothing)
        sub = _called_module(node)
        return sub is not None and any(
            getattr(m, "inplace", False) is True
            and not isinstance(m, torch.nn.modules.dropout._DropoutNd)
            for m in sub.modules()
        )
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in _DROPOUT:  # eval-mode dropout writes nothing; training=True is refused
        bound = _bind(_sig_dropout, node)
        return bound is None or (
            bound.arguments["inplace"] is True and bound.arguments["training"] is not False
        )
    if node.target in _INPLACE_OPERATORS or "out" in node.kwargs:
        return True
    if node.kwargs.get("inplace") is True:
        return True
    name = _name(node)
    if name.endswith("_") and not name.endswith("__"):
        return True
    if node.op == "call_function" and node.target in (
        *_RELU,
        *_LEAKY,
        *_HARDTANH,
        *_ELU,
        F.threshold,
    ):
        return any(a is True for a in node.args[1:])
    return False


def _called_module(node: torch.fx.Node) -> torch.nn.Module | None:
    owner = node.graph.owning_module
    return owner.get_submodule(str(node.target)) if owner is not None else None


_VIEW_MODULES = (
    torch.nn.Identity,
    torch.nn.modules.dropout._DropoutNd,  # the identity in eval mode (the traced mode)
    torch.nn.Flatten,
    torch.nn.Unflatten,
    Flatten,
)


def _is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value may share its input's storage (a view, or a module returning
    its input: ``Identity``, eval-mode ``Dropout``, ``Flatten`` of a 2-d tensor)."""
    if node.op in ("call_function", "call_method"):
        return _name(node) in _VIEWS
    if node.op != "call_module":
        return False
    sub = _called_module(node)

    def view_like(m: torch.nn.Module) -> bool:
        if isinstance(m, torch.nn.Sequential):
            return all(view_like(c) for c in m)
        return isinstance(m, _VIEW_MODULES)

    return sub is not None and view_like(sub)


def _aliases(node: torch.fx.Node) -> set[torch.fx.Node]:
    """``node`` and every value that may share its storage: the values it is a view of, and
    the views taken of any of them."""
    root = node
    while _is_view(root) and root.args:
        base = root.args[0]
        if not isinstance(base, torch.fx.Node):
            break
        root = base
    out: set[torch.fx.Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        stack.extend(u for u in n.users if _is_view(u))
    return out


def _is_data(value: Any) -> bool:
    """A node argument that carries data (not a shape query)."""
    if isinstance(value, torch.fx.Node):
        return not _is_helper(value)
    if isinstance(value, (tuple, list)):
        return any(_is_data(v) for v in value)
    return False


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _is_add(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _ADD
    return node.op == "call_method" and node.target in ("add", "__add__")


def _halved(node: torch.fx.Node) -> torch.fx.Node | None:
    """``s`` when ``node`` is ``s / 2``, ``s * 0.5`` or ``0.5 * s`` with ``s`` an addition."""
    if node.kwargs or len(node.args) != 2:
        return None
    divide = (
        node.op == "call_function"
        and node.target in (operator.truediv, operator.itruediv, torch.div)
    ) or (node.op == "call_method" and node.target in ("div", "__truediv__"))
    multiply = (
        node.op == "call_function" and node.target in (operator.mul, operator.imul, torch.mul)
    ) or (node.op == "call_method" and node.target in ("mul", "__mul__"))
    a, b = node.args
    candidates = []
    if divide and b == 2:
        candidates = [a]
    elif multiply:
        candidates = [x for x, y in ((a, b), (b, a)) if y == 0.5]
    for s in candidates:
        if isinstance(s, torch.fx.Node) and _is_add(s):
            return s
    return None


_ARITHMETIC = {
    "add", "__add__", "__radd__", "iadd", "add_",
    "sub", "__sub__", "__rsub__", "isub", "sub_",
    "mul", "__mul__", "__rmul__", "imul", "mul_",
    "truediv", "__truediv__", "itruediv", "div", "div_",
}  # fmt: skip


def _is_arithmetic(node: torch.fx.Node) -> bool:
    """``+ - * /`` and their in-place forms: whether they form a skip connection is structural."""
    return _name(node) in _ARITHMETIC


def _why_not(node: torch.fx.Node) -> str:
    target = node.target
    name = str(getattr(target, "__name__", target))
    if target in (torch.cat, torch.stack, torch.concat, torch.hstack, torch.vstack):
        return "concatenates tensors (clipless has no certified concatenation)"
    tensor_args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if name in ("mul", "matmul", "bmm", "einsum", "__mul__", "__matmul__") and len(tensor_args) > 1:
        return "multiplies two activations (not Lipschitz: no certified bound)"
    if name in ("truediv", "div", "__truediv__") and len(tensor_args) > 1:
        return "divides by an activation (not Lipschitz: no certified bound)"
    if target in _DROPOUT:
        return (
            "dropout with training=True (F.dropout's default) drops in eval mode too; pass "
            "training=self.training"
        )
    if node.op in ("call_function", "call_method") and any(
        isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values())
    ):
        return (
            "an argument other than the input is computed from a tensor (e.g. a size read "
            "with x.size()); use a constant"
        )
    if name in ("mul", "__mul__", "imul", "truediv", "itruediv", "div", "__truediv__"):
        return "scales by a constant (no certified rule outside (x + f(x)) / 2)"
    if name in ("sub", "__sub__", "isub", "add", "__add__", "iadd"):
        return "arithmetic other than a skip connection x + f(x)"
    if target is operator.getitem:
        return (
            "indexes a tensor or unpacks a tuple (a layer returning several values, a time step "
            "or a slice); clipless has no certified indexing"
        )
    return "no certified clipless equivalent for this operation"


def convert(
    model: torch.nn.Module, input_norm: float | None = None, *, strict: bool = True
) -> tuple[torch.nn.Module, ConversionReport]:
    """Convert a plain torch model into its clipless twin; return ``(converted, report)``.

    The analogue of Opacus's ``ModuleValidator.fix`` (module docstring for the mapping). ``model``
    is not modified: parameters are copied into new clipless layers. The result is a
    :class:`clipless.nn.Sequential` whose first layer is an :class:`~clipless.nn.InputNorm`.

    Args:
        model: any :class:`torch.nn.Module`.
        input_norm: ``max_norm`` of the leading ``InputNorm`` to insert (the certified input bound
            ``X_0``: every sample is projected onto the L2 ball of that radius). Required when the
            model does not already start with an ``InputNorm``; when it does, it must be ``None``
            or equal to that ``max_norm``.
        strict: raise :class:`TypeError` listing everything that could not be converted (as
            :func:`clipless.nn.validate` does). With ``strict=False`` the report lists them and the
            unconvertible modules are kept (deep-copied) in the returned model, which then does
            not pass :func:`clipless.nn.validate`.

    Raises:
        TypeError: ``model`` is not a module, or (``strict=True``) something is unconvertible.
        ValueError: ``input_norm`` is missing, invalid, or contradicts the model's ``InputNorm``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    if input_norm is not None:
        input_norm = _checks.positive_float("input_norm", input_norm)
    converter = _Converter()
    converted = converter.module(model, "")
    if converted is None:  # the whole model was a Dropout or an Identity
        converted = Sequential()
    if not isinstance(converted, (Sequential, torch.nn.Sequential)):
        converted = converter.sequential([("0", converted)])
    leading = _leading(converted)
    if isinstance(leading, InputNorm):
        if input_norm is not None and input_norm != leading.max_norm:
            raise ValueError(
                f"input_norm={input_norm} contradicts the model's leading "
                f"clipless.nn.InputNorm(max_norm={leading.max_norm}); omit input_norm"
            )
    else:
        if input_norm is None:
            raise ValueError(
                "the model does not start with a clipless.nn.InputNorm, so convert needs "
                "input_norm=X0: every input sample is projected onto the L2 ball of radius X0, "
                "which makes X0 the certified input bound that clipless.bounds propagates. "
                "Choose it from public knowledge of the data (e.g. sqrt(#features) for features "
                "scaled to [-1, 1]); a radius below the data's norms shrinks those samples"
            )
        norm = InputNorm(input_norm)
        converter.record(
            "", "(none)", norm, "required by the bounds: certifies ||x|| <= X0", "inserted"
        )
        converter.entries.insert(0, converter.entries.pop())
        items = [("input_norm", norm), *converted._modules.items()]
        converted = converter.sequential(items)
    converted.train(model.training)
    report = ConversionReport(tuple(converter.entries))
    if strict and report.unconvertible:
        problems = report.unconvertible
        count = len(problems)
        noun = "module or operation has" if count == 1 else "modules or operations have"
        raise TypeError(
            f"{count} {noun} no certified clipless equivalent; convert(..., strict=False) returns "
            "the partial conversion and its report:\n" + "\n".join(f"  - {e}" for e in problems)
        )
    return converted, report


def _leading(model: torch.nn.Module) -> torch.nn.Module | None:
    module: torch.nn.Module | None = model
    while isinstance(module, torch.nn.Sequential):
        module = module[0] if len(module) > 0 else None
    return module
