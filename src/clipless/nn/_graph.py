"""Reading a traced ``forward`` for :func:`clipless.nn.convert`.

Which functions and tensor methods of a :mod:`torch.fx` graph compute a torch layer
(:func:`_function_module`), how the tracer records in-place operators (:class:`_Proxy`), and the
decomposition of the graph into a chain of nodes with ``x + f(x)`` / ``(x + f(x)) / 2`` skips
(:class:`_Structure`), refusing in-place operations whose out-of-place rewrite would compute
other values (:meth:`_Structure.check_mutations`) and explaining every operation without a
certified equivalent (:func:`_why_not`).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from clipless import _validate
from clipless.nn._base import LipschitzModule
from clipless.nn._twins import _ViewFlatten
from clipless.nn.activations import Flatten


class _UnconvertibleError(Exception):
    """A traced graph that is not a chain with ``x + f(x)`` skips (internal)."""

    def __init__(self, node: torch.fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.node = node
        self.reason = reason


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
        return _module_of(node, _sig_leaky, torch.nn.LeakyReLU, "negative_slope")
    if target is F.relu6:
        return _module_of(node, _sig_unary, torch.nn.ReLU6)
    if target in _HARDTANH:
        return _module_of(node, _sig_hardtanh, torch.nn.Hardtanh, "min_val", "max_val")
    if target in _ELU:
        return _module_of(node, _sig_elu, torch.nn.ELU, "alpha")
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
    if not _validate.is_int(n) or n < 1:
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


def _module_of(
    node: torch.fx.Node,
    sig: Callable[..., None],
    module: Callable[..., torch.nn.Module],
    *names: str,
) -> torch.nn.Module | None:
    """``module`` built from the arguments ``names`` of the call ``node`` bound to ``sig``
    (``None``: the call does not match ``sig``)."""
    bound = _bind(sig, node)
    return None if bound is None else module(*(bound.arguments[n] for n in names))


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
            return _module_of(node, _sig_flatten, torch.nn.Flatten, "start_dim", "end_dim")
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
            return _module_of(node, _sig_method_flatten, torch.nn.Flatten, "start_dim", "end_dim")
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
    operators, so it would trace ``h += t`` as ``h = h + t``, and a name bound to ``h`` before it
    (``x0 = x; x += f(x); ... x + x0``) would read the old value in the graph but the updated one
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
