"""``convert(model)``: turn a plain torch model into its certified clipless twin.

The analogue of Opacus's ``ModuleValidator.fix`` (:func:`clipless.nn.validate` is the analogue of
``ModuleValidator.validate``). Each module is mapped to a clipless layer with a certified bound
where one exists (by the registry :data:`clipless.nn._twins.TWINS`, which gives
:func:`~clipless.nn.validate` its advice too; a custom ``forward`` is read by
:mod:`clipless.nn._graph`); the result always starts with a :class:`~clipless.nn.InputNorm`
(the certified input bound ``X_0`` of :mod:`clipless.bounds`). Every decision is recorded in a
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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx

from clipless import _validate
from clipless.nn import _checks, _twins
from clipless.nn._base import LipschitzModule
from clipless.nn._graph import (
    _describe,
    _function_module,
    _has_own_forward,
    _is_arithmetic,
    _is_helper,
    _mutates,
    _ResidualSpec,
    _Structure,
    _Tracer,
    _UnconvertibleError,
    _why_not,
)
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
            ``X_0``: every sample is projected onto the L2 ball of that radius, which makes
            ``X_0`` the bound :mod:`clipless.bounds` propagates). Choose it from public knowledge
            of the data (e.g. ``sqrt(#features)`` for features scaled to ``[-1, 1]``); a radius
            below the data's norms shrinks those samples. Required when the model does not
            already start with an ``InputNorm``; when it does, it must be ``None`` or equal to
            that ``max_norm``.
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
    _validate.flag("strict", strict)
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
                "input_norm=X0 is required when the model does not start with a "
                "clipless.nn.InputNorm: the certified bound on every input's L2 norm, from public "
                "knowledge (e.g. sqrt(#features) for features in [-1, 1])"
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
