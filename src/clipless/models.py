"""Ready-made Lipschitz models: :func:`mlp` and :func:`convnet` (what ``clipless train`` builds).

Every layer comes from :mod:`clipless.nn`, so every layer has a certified Lipschitz bound and the
model passes :func:`clipless.nn.validate`. Both start with :class:`clipless.nn.InputNorm`, which
makes ``input_norm`` a certified bound on the inputs' norm whatever the data. The plain-torch
twin of a model (same function, ordinary ``torch.nn`` layers, for inference or for a non-private
baseline) is :func:`clipless.nn.vanilla_export` ``(model)``.

>>> import torch
>>> model = convnet((1, 8, 8), channels=(4, 8), num_classes=10, input_norm=2.0)
>>> model(torch.zeros(3, 1, 8, 8)).shape
torch.Size([3, 10])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from clipless import nn

__all__ = ["MODEL_KINDS", "POOLS", "build", "convnet", "linear", "mlp"]

MODEL_KINDS = ("linear", "mlp", "cnn")
POOLS = ("l2", "avg")


def _widths(name: str, widths: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(w) for w in widths)
    if not out or any(w < 2 or w % 2 for w in out):
        raise ValueError(f"{name} must be even widths >= 2 (GroupSort pairs); got {widths!r}")
    return out


def mlp(
    input_shape: Sequence[int],
    hidden: Sequence[int],
    num_classes: int,
    input_norm: float = 1.0,
    bias: bool = False,
    input_mode: str = "ball",
) -> nn.Sequential:
    """``InputNorm(input_norm) [-> Flatten] -> (Linear -> GroupSort(2)) x len(hidden) -> Linear``.

    One logit per class. ``Flatten`` is inserted when a sample has more than one dimension (images).
    ``bias=False`` by default: each bias is one more noised tensor.
    """
    hidden = _widths("hidden", hidden)
    layers: list[torch.nn.Module] = [nn.InputNorm(float(input_norm), input_mode)]  # all dims
    if len(input_shape) > 1:
        layers.append(nn.Flatten())
    width = math.prod(int(s) for s in input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h, bias=bias), nn.GroupSort(2)]
        width = h
    layers.append(nn.Linear(width, int(num_classes), bias=bias))
    return nn.Sequential(*layers)


def linear(
    input_shape: Sequence[int],
    num_classes: int,
    input_norm: float = 1.0,
    bias: bool = True,
    input_mode: str = "ball",
) -> nn.Sequential:
    """``InputNorm(input_norm) [-> Flatten] -> Linear``: a linear model (logistic regression).

    With one layer and per-sample gradient scaling no weight constraint is needed for privacy:
    the layer's sensitivity is the loss constant (or the :class:`clipless.nn.LossGradientClip`
    norm) whatever its weights. On Adult at epsilon 0.414 it matches the MLP
    (``benchmarks/RESULTS.md``, Adult lever table). ``bias=True`` by default: the bias and the
    weight share one sensitivity (their joint per-sample gradient is scaled together).
    """
    layers: list[torch.nn.Module] = [nn.InputNorm(float(input_norm), input_mode)]
    if len(input_shape) > 1:
        layers.append(nn.Flatten())
    width = math.prod(int(s) for s in input_shape)
    layers.append(nn.Linear(width, int(num_classes), bias=bias))
    return nn.Sequential(*layers)


def convnet(
    input_shape: Sequence[int] = (1, 28, 28),
    channels: Sequence[int] = (16, 32),
    num_classes: int = 10,
    input_norm: float = 1.0,
    pool: str = "l2",
    bias: bool = False,
    input_mode: str = "ball",
) -> nn.Sequential:
    """A small Lipschitz ConvNet for ``C x H x W`` images (default: Fashion-MNIST, 1 x 28 x 28).

    ``InputNorm(input_norm) -> (Conv2d 3x3 same-padding, no bias -> GroupSort(2) -> pool 2x2) x
    len(channels) -> Flatten -> Linear``. ``pool`` is ``"l2"`` (:class:`clipless.nn.L2NormPool2d`,
    Lipschitz 1, the replacement for max pooling) or ``"avg"`` (:class:`clipless.nn.AvgPool2d`,
    Lipschitz 1/2). Each pooling halves the image (floor), so the image must be at least
    ``2 ** len(channels)`` pixels on each side. ``bias`` applies to the final ``Linear`` only; the
    convolutions are bias-free. With the defaults this is the CNN of
    ``benchmarks/fashion_mnist.py``.
    """
    if len(input_shape) != 3:
        raise ValueError(
            f"convnet needs images of shape (channels, height, width); got input shape "
            f"{tuple(input_shape)}"
        )
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}; got {pool!r}")
    channels = _widths("channels", channels)
    c, h, w = (int(s) for s in input_shape)
    if min(h, w) < 2 ** len(channels):
        raise ValueError(
            f"a {h}x{w} image is too small for {len(channels)} 2x2 poolings; use at most "
            f"{max(0, int(math.log2(max(1, min(h, w)))))} convolution stages"
        )
    layers: list[torch.nn.Module] = [nn.InputNorm(float(input_norm), input_mode)]
    for out_channels in channels:
        layers += [
            nn.Conv2d(c, out_channels, 3, padding=1, bias=False),
            nn.GroupSort(2),
            nn.L2NormPool2d(2) if pool == "l2" else nn.AvgPool2d(2),
        ]
        c, h, w = out_channels, h // 2, w // 2
    layers += [nn.Flatten(), nn.Linear(c * h * w, int(num_classes), bias=bias)]
    return nn.Sequential(*layers)


def build(
    kind: str,
    input_shape: Sequence[int],
    hidden: Sequence[int],
    num_classes: int,
    input_norm: float = 1.0,
    bias: bool = False,
    pool: str = "l2",
    input_mode: str = "ball",
) -> nn.Sequential:
    """``linear`` (``hidden`` must be empty), ``mlp`` or ``cnn`` (:func:`convnet`, ``hidden`` =
    channels per convolution stage). ``input_mode``: the first layer's
    :class:`clipless.nn.InputNorm` mode (``"ball"`` clips each sample to ``input_norm``,
    ``"sphere"`` normalises it to that norm)."""
    if kind == "linear":
        if tuple(hidden):
            raise ValueError(f"a linear model has no hidden layers; got hidden={tuple(hidden)!r}")
        return linear(input_shape, num_classes, input_norm, bias, input_mode)
    if kind == "mlp":
        return mlp(input_shape, hidden, num_classes, input_norm, bias, input_mode)
    if kind == "cnn":
        return convnet(input_shape, hidden, num_classes, input_norm, pool, bias, input_mode)
    raise ValueError(f"model must be one of {MODEL_KINDS}; got {kind!r}")
