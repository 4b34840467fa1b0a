"""``validate(module)``: reject models containing modules without a certified bound.

Clipless DP-SGD derives every layer's sensitivity from certified constants (docs/design.md,
"A privacy claim is a proof obligation"); one uncertified module (a ``torch.nn.BatchNorm2d``, a
plain ``torch.nn.Linear``, a ``Dropout``) silently voids the guarantee. Like Opacus's
``ModuleValidator``, :func:`validate` walks the whole tree and reports *every* offending module at
once, with the clipless replacement where one exists (the registry of :mod:`clipless.nn._twins`,
which :func:`clipless.nn.convert` shares).
"""

from __future__ import annotations

import torch

from clipless._hooks import _Hook
from clipless.nn._base import LipschitzModule, ParametricLipschitzModule
from clipless.nn._twins import advice

__all__ = ["validate"]

_HOOK_KINDS = ("forward_pre", "forward", "backward_pre", "backward")
_HOOK_ATTRIBUTES = tuple((kind, f"_{kind}_hooks") for kind in _HOOK_KINDS)


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

    Args:
        module: the module whose own hooks are listed.

    Returns:
        One phrase per kind of foreign hook (e.g. ``"a forward-pre hook"``); empty when none.
    """
    found = []
    for kind, attribute in _HOOK_ATTRIBUTES:
        hooks = getattr(module, attribute, None)
        if hooks and any(not isinstance(h, _Hook) for h in hooks.values()):
            found.append(f"a {kind.replace('_', '-')} hook")
    return found


def validate(module: torch.nn.Module) -> None:
    """Check that every module in the tree carries a certified bound; raise otherwise.

    A module passes when it is a :class:`~clipless.nn.LipschitzModule`, carries no module hook
    that clipless did not place (a forward hook can change the output its bound certifies), and,
    if it has trainable parameters of its own, is a :class:`~clipless.nn.ParametricLipschitzModule`
    (whose ``gradient_bounds`` covers them). All descendants are checked, including the children
    of clipless containers and of non-clipless modules.

    Args:
        module: the model (or any module) to check.

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
            problems.append(f"  - {where} ({_type_name(sub)}): {advice(sub)}")
        elif (
            sub._parameters
            and not isinstance(sub, ParametricLipschitzModule)
            and any(p is not None and p.requires_grad for p in sub._parameters.values())
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
