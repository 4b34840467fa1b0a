"""Containers: ``Sequential`` (composition) and ``Residual`` (skip connection)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from clipless import _certified, _validate
from clipless.nn import _checks
from clipless.nn._base import LipschitzModule
from clipless.nn.export import PlainResidual, vanilla_export
from clipless.nn.validate import validate

__all__ = ["Residual", "Sequential"]

RESIDUAL_MODES = ("add", "average")


class Sequential(LipschitzModule, torch.nn.Sequential):
    """:class:`torch.nn.Sequential` of clipless modules (positional modules or an ``OrderedDict``).

    Composition: ``Lip(f_D o ... o f_1) <= prod_d Lip(f_d)`` (submultiplicativity; thesis
    eq. 5.2.9, Béthune et al. 2024, Algorithm 1), and the output bound is propagated layer by
    layer, ``X_d = f_d.output_bound(X_{d-1})`` (Béthune et al., Algorithm 1, line 2). The
    constructor (and ``append`` / ``insert`` / item assignment) checks that every module is a
    clipless module (:func:`clipless.nn.validate`), raising :class:`TypeError` otherwise.
    """

    def __init__(self, *args: Any) -> None:
        torch.nn.Sequential.__init__(self, *args)
        validate(self)

    def lipschitz(self) -> float:
        """Product of the children's constants (1 for an empty Sequential), rounded up."""
        return _certified.product([m.lipschitz() for m in self._lipschitz_children()])

    def output_bound(self, input_bound: float) -> float:
        """Composition of the children's output bounds."""
        bound = _checks.as_bound("input_bound", input_bound)
        for m in self._lipschitz_children():
            bound = m.output_bound(bound)
        return bound

    def _lipschitz_children(self) -> list[LipschitzModule]:
        children = [m for m in self if isinstance(m, LipschitzModule)]
        if len(children) != len(self):  # only after bypassing the checks (e.g. `+=`)
            validate(self)
        return children

    def append(self, module: torch.nn.Module) -> Sequential:
        _check_module("module", module)
        torch.nn.Sequential.append(self, module)
        return self

    def insert(self, index: int, module: torch.nn.Module) -> Sequential:
        _check_module("module", module)
        torch.nn.Sequential.insert(self, index, module)
        return self

    def __setitem__(self, idx: int, module: torch.nn.Module) -> None:
        _check_module("module", module)
        torch.nn.Sequential.__setitem__(self, idx, module)

    def vanilla_export(self) -> torch.nn.Module:
        """A ``torch.nn.Sequential`` (same child names) of the children's exports."""
        return torch.nn.Sequential(
            OrderedDict((name, _export_child(m)) for name, m in self._modules.items())
        )


def _check_module(name: str, module: Any) -> None:
    if not isinstance(module, LipschitzModule):
        raise TypeError(
            f"{name} must be a clipless.nn.LipschitzModule, got {type(module).__name__}"
        )
    validate(module)


def _export_child(module: torch.nn.Module | None) -> torch.nn.Module:
    if module is None:
        raise TypeError("cannot export an empty (None) child module")
    return vanilla_export(module)


class Residual(LipschitzModule):
    """Skip connection ``x + branch(x)`` (``mode="add"``) or ``(x + branch(x)) / 2`` ("average").

    ``branch`` must be a clipless module whose output has the shape of its input.

    Constants (thesis eq. 5.2.7 after Gouk et al. 2020; docs/design.md "Layers and losses"): with
    ``L_b = branch.lipschitz()``, ``||x + g(x) - y - g(y)|| <= (1 + L_b) ||x - y||``, so "add" has
    Lipschitz ``1 + L_b`` and output bound ``X + branch.output_bound(X)``; "average" halves both,
    so a 1-Lipschitz branch gives a 1-Lipschitz block (a convex combination of two 1-Lipschitz
    maps).

    :attr:`scale` is 1 ("add") or 0.5 ("average"): the factor :mod:`clipless.bounds` applies to
    cotangents entering the branch.
    """

    branch: LipschitzModule

    def __init__(self, branch: torch.nn.Module, mode: str = "add") -> None:
        super().__init__()
        if not isinstance(branch, LipschitzModule):
            raise TypeError(
                f"branch must be a clipless.nn.LipschitzModule, got {type(branch).__name__}"
            )
        _validate.choice("mode", mode, RESIDUAL_MODES)
        self.branch = branch
        self.mode = mode
        self.scale = 1.0 if mode == "add" else 0.5
        validate(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.branch(x)
        if y.shape != x.shape:
            raise ValueError(
                f"Residual: the branch maps shape {tuple(x.shape)} to {tuple(y.shape)}; "
                "they must be equal"
            )
        out = x + y
        return out if self.scale == 1.0 else out * self.scale

    def lipschitz(self) -> float:
        """``scale (1 + Lip(branch))``, rounded up."""
        return _certified.mul(self.scale, _certified.add(1.0, self.branch.lipschitz()))

    def output_bound(self, input_bound: float) -> float:
        """``scale (X + branch.output_bound(X))``, rounded up."""
        x_bound = _checks.as_bound("input_bound", input_bound)
        return _certified.mul(
            self.scale, _certified.add(x_bound, self.branch.output_bound(x_bound))
        )

    def vanilla_export(self) -> torch.nn.Module:
        return PlainResidual(_export_child(self.branch), self.scale)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"
