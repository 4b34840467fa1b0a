"""``benchmarks/scatter_models.py``: Tramèr and Boneh's ScatterNet CNN and the ``split`` model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("kymatio")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("scatter_models", BENCH / "scatter_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tb_cnn_has_their_parameter_count_and_shape() -> None:
    model = _module().tb_cnn()
    # conv 81*16*9 + 16, conv 16*32*9 + 32, fc 512*32 + 32, fc 32*10 + 10 (Handcrafted-DP)
    assert sum(p.numel() for p in model.parameters()) == 11680 + 4640 + 16416 + 330 == 33066
    assert model(torch.randn(3, 81, 7, 7)).shape == (3, 10)


def test_our_features_are_tb_group_norm_so_their_cnn_skips_it() -> None:
    """TB feed the raw scattering to the model's GroupNorm(27); our front-end's output is that
    GroupNorm's output, and a second one would not be the identity (the raw groups' variances
    are of the order of its eps), so ``tb_cnn()`` on our features starts at the convolution."""
    from clipless.features import Scattering2d

    # Fashion-MNIST-like: a dark background with one bright block
    images = torch.zeros(4, 1, 28, 28)
    images[:, :, 6:22, 8:20] = torch.rand(4, 1, 16, 12, generator=torch.Generator().manual_seed(0))
    raw = Scattering2d((1, 28, 28), groups=0)(images)
    ours = Scattering2d((1, 28, 28))(images)
    theirs = _module().tb_cnn(groups=27)
    ours_cnn = _module().tb_cnn()
    ours_cnn.load_state_dict(theirs.state_dict())
    assert ours.shape == (4, 81, 7, 7)
    torch.testing.assert_close(ours, theirs[0](raw), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_cnn(ours), theirs(raw), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(theirs[0](ours), ours, atol=1e-2)


def test_split_reads_x_and_its_absolute_value_through_an_isometry() -> None:
    from clipless import nn

    m = _module()
    w = m.split_weight(81)
    k = w.view(162, 81)
    torch.testing.assert_close(k.T @ k, torch.eye(81))
    body = m._body({"model": "split", "width": 0}, 81, 7, 7)
    conv, sort = body[0], body[1]
    assert isinstance(conv, nn.Conv2d) and not conv.weight.requires_grad
    x = torch.randn(5, 81, 7, 7)
    out = sort(conv(x))
    torch.testing.assert_close(out[:, 0::2], x.clamp(max=0))
    torch.testing.assert_close(out[:, 1::2], x.clamp(min=0))
    assert torch.allclose(out.flatten(1).norm(dim=1), x.flatten(1).norm(dim=1))
