"""The certified-bound cache of parametric layers never serves a stale value."""

from __future__ import annotations

import torch

from clipless import nn


def test_bound_cache_sees_writes_through_data() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 4, bias=False)
    first = layer.lipschitz()
    assert layer.lipschitz() == first  # cached
    layer.weight.data.mul_(3.0)  # does not bump the version counter
    exact = float(torch.linalg.matrix_norm(layer.weight.detach().double(), 2))
    assert layer.lipschitz() >= exact
    assert abs(layer.lipschitz() / first - 3.0) < 1e-6


def test_conv_bound_cache_keyed_on_input_size() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 2, 3, padding=1)
    small = conv.lipschitz(input_size=(3, 3))
    large = conv.lipschitz(input_size=(12, 12))
    assert conv.lipschitz(input_size=(3, 3)) == small
    assert large >= small * (1 - 1e-9)  # zero-padded norm grows with the input
    with torch.no_grad():
        conv.weight.add_(1.0)
    assert conv.lipschitz(input_size=(3, 3)) != small
