"""Export a clipless model to plain :mod:`torch.nn` modules for inference (``vanilla_export``).

After private training the Lipschitz machinery (certified bounds, gradient scaling hooks, the
loss-gradient clipping layer) is no longer needed. :func:`vanilla_export` returns an equivalent
model built from standard torch modules (``torch.nn.Linear``, ``torch.nn.Conv2d`` with the same
padding mode, ``torch.nn.ReLU``...) and, where torch has no module computing the same function,
the small plain modules below. Those call the same functional code as the clipless layer, so
outputs agree to the last bit where torch offers no exact equivalent and to rounding elsewhere
(deel-torchlip offers the same ``vanilla_export``).
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch

from clipless.nn._base import LipschitzModule
from clipless.nn._functional import group_sort, project_norm, thesis_group_norm

__all__ = [
    "PlainAbs",
    "PlainGroupNorm",
    "PlainGroupSort",
    "PlainInputNorm",
    "PlainResidual",
    "vanilla_export",
]


class PlainGroupSort(torch.nn.Module):
    """Sorts contiguous groups of ``group_size`` entries of dimension 1 (plain GroupSort)."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group_sort(x, self.group_size)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}"


class PlainAbs(torch.nn.Module):
    """Elementwise absolute value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.abs(x)


def mix_channels(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``matrix @ x_i`` on the channel axis (dim 1) of every sample ``x_i`` (``C x P``)."""
    if x.ndim < 2 or x.shape[1] != matrix.shape[0]:
        raise ValueError(
            f"InputNorm: whiten is {tuple(matrix.shape)} but the samples have shape "
            f"{tuple(x.shape[1:])} (their first axis must be the {matrix.shape[0]} channels)"
        )
    w = matrix.to(device=x.device, dtype=x.dtype)
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    if flat.shape[2] == 1:  # flat samples: one matrix product (a batched one is far slower)
        return (flat[:, :, 0] @ w.T).reshape(x.shape)
    return torch.matmul(w, flat).reshape(x.shape)


def input_map(
    x: torch.Tensor,
    max_norm: float,
    mode: str,
    center: torch.Tensor | None = None,
    whiten: torch.Tensor | None = None,
) -> torch.Tensor:
    """``P_R(W (x / ||x|| - mu))`` per sample (InputNorm's map and its twin's): with a released
    ``center`` or ``whiten`` the sample is first normalised to the unit sphere."""
    if center is not None or whiten is not None:
        x = project_norm(x, 1.0, "sphere")
    if center is not None:
        # the data may live on another device than the model's buffers (a CPU dataset mapped
        # once by premap_ while the model trains on a GPU)
        x = x - center.to(device=x.device, dtype=x.dtype)
    if whiten is not None:
        x = mix_channels(x, whiten)
    return project_norm(x, max_norm, mode)


class PlainInputNorm(torch.nn.Module):
    """Projects each sample onto the ball / sphere of radius ``max_norm`` (plain InputNorm)."""

    def __init__(
        self,
        max_norm: float,
        mode: str,
        center: torch.Tensor | None = None,
        whiten: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.max_norm = max_norm
        self.mode = mode
        self.center: torch.Tensor | None
        self.whiten: torch.Tensor | None
        self.register_buffer("center", None if center is None else center.detach().clone())
        self.register_buffer("whiten", None if whiten is None else whiten.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return input_map(x, self.max_norm, self.mode, self.center, self.whiten)

    def extra_repr(self) -> str:
        return f"max_norm={self.max_norm}, mode={self.mode!r}"


class PlainGroupNorm(torch.nn.Module):
    """``(x - mean) / max(alpha, std)`` per sample and group (the thesis's normalisation)."""

    def __init__(self, num_groups: int, alpha: float) -> None:
        super().__init__()
        self.num_groups = num_groups
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return thesis_group_norm(x, self.num_groups, self.alpha)

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, alpha={self.alpha}"


class PlainResidual(torch.nn.Module):
    """``scale * (x + branch(x))``."""

    def __init__(self, branch: torch.nn.Module, scale: float) -> None:
        super().__init__()
        self.branch = branch
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.branch(x)
        return out if self.scale == 1.0 else out * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


_Plain = TypeVar("_Plain", torch.nn.Linear, torch.nn.Conv2d)


def with_copies(plain: _Plain, weight: torch.Tensor, bias: torch.Tensor | None) -> _Plain:
    """``plain`` (a fresh torch layer of the same shape) holding copies of ``weight`` and
    ``bias``: the vanilla export of :class:`clipless.nn.Linear` and :class:`clipless.nn.Conv2d`."""
    with torch.no_grad():
        plain.weight.copy_(weight)
        if bias is not None and plain.bias is not None:
            plain.bias.copy_(bias.detach())
    return plain


def vanilla_export(model: torch.nn.Module) -> torch.nn.Module:
    """Return an equivalent model made of plain torch modules (for inference).

    Every clipless layer is replaced by its :meth:`~clipless.nn.LipschitzModule.vanilla_export`
    (weights are copied, never shared with ``model``). A non-clipless module (e.g. a user's
    wrapper whose ``forward`` calls clipless children) is deep-copied and its clipless
    descendants replaced; a child it registers under two names stays one shared module. A layer
    used twice *inside* a clipless container is exported once per use (the copies start equal but
    are separate parameters). The result has the same ``training`` flag as ``model``; ``model`` is
    left untouched. An :class:`~clipless.nn.InputNorm` whose training data were mapped once
    (:meth:`~clipless.nn.InputNorm.premap_`) is exported as the full map: feed the export raw
    inputs.

    Raises:
        TypeError: ``model`` is not a :class:`torch.nn.Module`, or contains a custom
            :class:`~clipless.nn.LipschitzModule` that does not implement ``vanilla_export()``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    exported = _export(model)
    exported.train(model.training)
    return exported


def _export(module: torch.nn.Module) -> torch.nn.Module:
    if isinstance(module, LipschitzModule):
        try:
            return module.vanilla_export()
        except NotImplementedError as err:
            raise TypeError(
                f"cannot export {type(module).__qualname__}: implement its vanilla_export() method"
            ) from err
    clone = copy.deepcopy(module)
    _replace_children(clone, {})
    return clone


def _replace_children(module: torch.nn.Module, done: dict[int, torch.nn.Module]) -> None:
    # every registered name, duplicates included (named_children() lists a module registered
    # under two names once, which left the second a clipless layer); a child registered twice
    # is exported once and stays shared, as deepcopy keeps it shared in the clone
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        if id(child) in done:
            setattr(module, name, done[id(child)])
        elif isinstance(child, LipschitzModule):
            done[id(child)] = _export(child)
            setattr(module, name, done[id(child)])
        else:
            done[id(child)] = child
            _replace_children(child, done)
