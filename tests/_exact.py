"""Exact spectral norms of clipless layers (float64 SVDs; the explicit convolution matrix), the
references the certified bounds are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clipless import nn as cnn


def dense_exact(weight: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(weight.detach().double(), ord=2))


def conv_matrix(layer: cnn.Conv2d) -> torch.Tensor:
    """The explicit (float64) matrix of ``layer``'s convolution on its recorded input size."""
    assert layer.input_size is not None
    h, w = layer.input_size
    n = layer.in_channels * h * w
    basis = torch.eye(n, dtype=torch.float64).reshape(n, layer.in_channels, h, w)
    kernel = layer.weight.detach().double().cpu()
    if layer.padding_mode == "circular":
        ph, pw = layer.padding
        out = F.conv2d(F.pad(basis, (pw, pw, ph, ph), mode="circular"), kernel, stride=layer.stride)
    else:
        out = F.conv2d(basis, kernel, stride=layer.stride, padding=layer.padding)
    return out.reshape(n, -1).T


def conv_exact(layer: cnn.Conv2d) -> float:
    return float(torch.linalg.matrix_norm(conv_matrix(layer), ord=2))


def exact(layer: torch.nn.Module) -> float:
    if isinstance(layer, cnn.Conv2d):
        return conv_exact(layer)
    assert isinstance(layer, cnn.Linear)
    return dense_exact(layer.weight)
