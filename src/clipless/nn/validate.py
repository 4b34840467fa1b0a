"""``validate(module)``: reject models containing modules without a certified bound.

Clipless DP-SGD derives every layer's sensitivity from certified constants (docs/design.md,
"A privacy claim is a proof obligation"); one uncertified module (a ``torch.nn.BatchNorm2d``, a
plain ``torch.nn.Linear``, a ``Dropout``) silently voids the guarantee. Like Opacus's
``ModuleValidator``, :func:`validate` walks the whole tree and reports *every* offending module at
once, with the clipless replacement where one exists.
"""

from __future__ import annotations

import torch

from clipless._hooks import _Hook
from clipless.nn._base import LipschitzModule, ParametricLipschitzModule

__all__ = ["validate"]

_HOOK_KINDS = ("forward_pre", "forward", "backward_pre", "backward")

_NORM = "clipless.nn.GroupNorm (the thesis's (x - mean)/max(alpha, std), Lipschitz 1/alpha)"

# (torch class, advice); the first isinstance match wins.
_SUGGESTIONS: tuple[tuple[type[torch.nn.Module], str], ...] = (
    (torch.nn.Linear, "use clipless.nn.Linear"),
    (torch.nn.Bilinear, "no clipless replacement; use clipless.nn.Linear on concatenated inputs"),
    (torch.nn.Conv2d, "use clipless.nn.Conv2d"),
    (
        torch.nn.Conv1d,
        "clipless.nn.convert certifies it (a clipless.nn.Conv2d with a 1 x k kernel between "
        "clipless.nn.Unflatten(2, (1, -1)) and clipless.nn.Flatten(2, 3))",
    ),
    (torch.nn.Sequential, "use clipless.nn.Sequential"),
    (torch.nn.modules.batchnorm._BatchNorm, f"use {_NORM}"),
    (torch.nn.LayerNorm, f"use {_NORM}"),
    (torch.nn.GroupNorm, f"use {_NORM}"),
    (torch.nn.modules.instancenorm._InstanceNorm, f"use {_NORM}"),
    (
        torch.nn.MaxPool2d,
        "use clipless.nn.MaxPool2d (overlapping windows: Lipschitz sqrt(windows per pixel)) or "
        "clipless.nn.L2NormPool2d",
    ),
    (torch.nn.AdaptiveMaxPool2d, "use clipless.nn.L2NormPool2d with a fixed kernel_size"),
    (torch.nn.AvgPool2d, "use clipless.nn.AvgPool2d"),
    (torch.nn.AdaptiveAvgPool2d, "use clipless.nn.AvgPool2d with a fixed kernel_size"),
    (torch.nn.LPPool2d, "use clipless.nn.L2NormPool2d"),
    (torch.nn.ReLU, "use clipless.nn.ReLU (or clipless.nn.GroupSort, gradient norm preserving)"),
    (torch.nn.Tanh, "use clipless.nn.Tanh"),
    (torch.nn.LeakyReLU, "use clipless.nn.LeakyReLU"),
    (torch.nn.Hardtanh, "use clipless.nn.Hardtanh (ReLU6 is Hardtanh(0, 6))"),
    (torch.nn.ELU, "use clipless.nn.ELU"),
    (torch.nn.Sigmoid, "use clipless.nn.Sigmoid"),
    (torch.nn.Flatten, "use clipless.nn.Flatten"),
    (
        torch.nn.Softmax,
        "remove it and put it in the loss (clipless.nn.CrossEntropyLoss takes logits)",
    ),
    (
        torch.nn.LogSoftmax,
        "remove it and put it in the loss (clipless.nn.CrossEntropyLoss takes logits)",
    ),
    (
        torch.nn.modules.dropout._DropoutNd,
        "remove it (dropout has no useful Lipschitz certificate; DP noise already regularises)",
    ),
    (torch.nn.Identity, "remove it (or use an empty clipless.nn.Sequential())"),
    (
        torch.nn.Embedding,
        "no certified embedding: its input is an index, not a vector of bounded norm, so no "
        "input bound X0 reaches it; feed a public one-hot (or bag-of-words) encoding to "
        "clipless.nn.Linear(vocab, dim, bias=False), which computes the same lookup with a "
        "certified bound (docs/opacus-migration.md, 'Layers without a certified twin')",
    ),
    (
        torch.nn.EmbeddingBag,
        "no certified embedding: feed a public bag-of-words encoding to clipless.nn.Linear",
    ),
    (
        torch.nn.modules.rnn.RNNBase,
        "no certified recurrent layer: a recurrence's Lipschitz bound grows as L^T with the "
        "sequence length T (and an LSTM's gates multiply activations); use a torch.nn.Conv1d "
        "over the sequence (clipless.nn.convert certifies it), or per-sample clipping "
        "(Opacus's DPLSTM) for recurrent models",
    ),
    (
        torch.nn.modules.rnn.RNNCellBase,
        "no certified recurrent cell (the recurrence's bound grows as L^T); use "
        "a torch.nn.Conv1d over the sequence (clipless.nn.convert certifies it)",
    ),
    (
        torch.nn.MultiheadAttention,
        "no certified attention: dot-product attention multiplies activations and is not "
        "Lipschitz on unbounded inputs (Kim et al. 2021); use a torch.nn.Conv1d or an MLP on "
        "pooled features",
    ),
    (
        torch.nn.Transformer,
        "no certified attention (dot-product attention is not Lipschitz); see "
        "docs/opacus-migration.md, 'Layers without a certified twin'",
    ),
    (
        torch.nn.TransformerEncoderLayer,
        "no certified attention (dot-product attention is not Lipschitz)",
    ),
    (
        torch.nn.TransformerDecoderLayer,
        "no certified attention (dot-product attention is not Lipschitz)",
    ),
    (
        torch.nn.modules.loss._Loss,
        "losses do not belong in the model; pass a clipless.nn loss to the engine",
    ),
)

_ACTIVATIONS = (
    torch.nn.LeakyReLU,
    torch.nn.ELU,
    torch.nn.GELU,
    torch.nn.SiLU,
    torch.nn.Softplus,
    torch.nn.PReLU,
    torch.nn.ReLU6,
    torch.nn.Hardtanh,
    torch.nn.Mish,
)


def _type_name(module: torch.nn.Module) -> str:
    cls = type(module)
    if cls.__module__.startswith("torch.nn.") and getattr(torch.nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def foreign_hooks(module: torch.nn.Module) -> list[str]:
    """The kinds of module hooks on ``module`` (not its children) that clipless did not place.

    A forward hook can change the module's output (``o * 10`` multiplies every later gradient by
    10), so a hooked layer no longer computes the function its bound certifies. The hooks that
    :func:`clipless.make_private` places (``clipless._hooks._Hook``) are not counted.
    """
    placed = _Hook
    return [
        f"a {kind.replace('_', '-')} hook"
        for kind in _HOOK_KINDS
        if any(
            not isinstance(h, placed)
            for h in (getattr(module, f"_{kind}_hooks", None) or {}).values()
        )
    ]


def _advice(module: torch.nn.Module) -> str:
    for cls, advice in _SUGGESTIONS:
        if isinstance(module, cls):
            return advice
    if isinstance(module, _ACTIVATIONS):
        return "use clipless.nn.GroupSort, clipless.nn.ReLU or clipless.nn.Tanh"
    return (
        "no clipless replacement; build it from clipless.nn layers and containers, or subclass "
        "clipless.nn.LipschitzModule and certify it"
    )


def validate(module: torch.nn.Module) -> None:
    """Check that every module in the tree carries a certified bound; raise otherwise.

    A module passes when it is a :class:`~clipless.nn.LipschitzModule`, carries no module hook
    that clipless did not place (a forward hook can change the output its bound certifies), and,
    if it has trainable parameters of its own, is a :class:`~clipless.nn.ParametricLipschitzModule`
    (whose ``gradient_bounds`` covers them). All descendants are checked, including the children
    of clipless containers and of non-clipless modules.

    Raises:
        TypeError: listing every offending module path (``<root>`` for ``module`` itself), its type
            and the suggested clipless replacement, in one message.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    problems: list[str] = []
    for path, sub in module.named_modules(remove_duplicate=True):
        where = repr(path) if path else "<root>"
        hooks = foreign_hooks(sub)
        if hooks:
            problems.append(
                f"  - {where} ({_type_name(sub)}): has {' and '.join(hooks)}, which can change "
                "the function its bound certifies; remove the hook (register it on a copy)"
            )
        if not isinstance(sub, LipschitzModule):
            problems.append(f"  - {where} ({_type_name(sub)}): {_advice(sub)}")
        elif not isinstance(sub, ParametricLipschitzModule) and any(
            p.requires_grad for p in sub.parameters(recurse=False)
        ):
            problems.append(
                f"  - {where} ({_type_name(sub)}): has trainable parameters but is not a "
                "clipless.nn.ParametricLipschitzModule (no gradient bound); subclass it or "
                "freeze the parameters"
            )
    if problems:
        count = len(problems)
        noun = "module has" if count == 1 else "modules have"
        raise TypeError(
            f"{count} {noun} no certified Lipschitz bound; clipless needs every module of the "
            "model to be a clipless.nn layer:\n" + "\n".join(problems)
        )
