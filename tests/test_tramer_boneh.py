"""``benchmarks/tramer_boneh.py``: the published architecture and the Opacus side's noise."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tramer_boneh


def test_layers_have_the_published_shapes_and_parameter_count() -> None:
    model = tramer_boneh.tramer_boneh_cnn()
    shapes = []
    for layer in model:
        layer.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape[1:])))
    model(torch.zeros(2, 1, 28, 28))
    assert shapes == [
        (16, 13, 13),  # conv 16, 8x8, stride 2, padding 2
        (16, 13, 13),
        (16, 12, 12),  # max-pool 2, stride 1
        (32, 5, 5),  # conv 32, 4x4, stride 2
        (32, 5, 5),
        (32, 4, 4),
        (512,),
        (32,),
        (32,),
        (10,),
    ]
    # weights + biases: 16*64+16, 32*16*16+32, 512*32+32, 32*10+10
    assert sum(p.numel() for p in model.parameters()) == 1040 + 8224 + 16416 + 330 == 26010
    parametric = [type(m).__name__ for m in model if any(True for _ in m.parameters())]
    assert parametric == ["Conv2d", "Conv2d", "Linear", "Linear"]
    assert sum(isinstance(m, torch.nn.Tanh) for m in model) == 3


def test_fashion_mnist_noise_spends_epsilon_3_with_opacus_accountants() -> None:
    pytest.importorskip("opacus")
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    # the noise make_private_with_epsilon chose for the run of RESULTS.md 52 (Opacus 1.6's PRV
    # search: 60,000 images, batch 2048 -> sample rate 1/30, 40 epochs of 30 steps)
    accountant = PRVAccountant()
    accountant.history = [(1.796875, 1 / 30, 40 * 30)]
    assert 2.99 <= accountant.get_epsilon(1e-5) <= 3.0
    # the paper's 2.15 (29 batches of 2048 an epoch) spends epsilon 3 under its accountant: RDP
    # with the classic conversion eps = min_a rdp(a) + log(1 / delta) / (a - 1)
    orders = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(
        q=2048 / 60_000, noise_multiplier=tramer_boneh.PUBLISHED_NOISE, steps=40 * 29, orders=orders
    )
    eps = min(r + math.log(1e5) / (a - 1) for r, a in zip(rdp, orders, strict=True))
    assert eps == pytest.approx(3.0, abs=0.01)


def test_train_tb_calibrates_noise_to_the_target_epsilon() -> None:
    pytest.importorskip("opacus")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(600, 1, 28, 28, generator=g), torch.arange(600) % 10)
    model, info = tramer_boneh.train_tb(data, 3.0, 1e-5, seed=0, epochs=1, batch=20)
    # sample rate 1/30 and 30 steps, as one epoch of Fashion-MNIST at batch 2048: the same noise
    # as the 1-epoch smoke run of robust_twins.py --pair tb
    assert info["sample_rate"] == pytest.approx(1 / 30) and info["steps"] == 30
    assert info["noise_multiplier"] == 0.78125
    assert 2.99 <= info["epsilon"] <= 3.0
    assert isinstance(model, torch.nn.Sequential)  # the plain module, Opacus's hooks removed
