"""The Gaussian noise of a private step, drawn from the plan's standard deviations."""

from __future__ import annotations

import torch

from clipless.mechanism import NoisePlan

__all__ = ["draw_noise"]


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
