"""The model zoo (:mod:`clipless.models`): ``resnet`` and ``gnp_convnet``.

References, on tiny float64 instances (each test well under a second):

* exact per-sample gradients (``torch.func.vmap(grad(...))``, the property test of
  ``tests/test_sensitivities.py``, reused through its ``check_case``) against the certified
  per-parameter gradient bounds, input bounds ``X_k`` and cotangent bounds ``G_k`` of
  :func:`clipless.bounds.report`, before and after each weight projection;
* the SVD of the explicit Jacobian (``torch.autograd.functional.jacobian``) of every residual
  block, transition and whole feature map against its certified Lipschitz constant;
* for the GNP ConvNet after Björck orthogonalisation, every singular value of the feature map's
  Jacobian equal to 1 (``J J^T = I``: gradient-norm preserving), and for a 3x3 convolution the
  same projection giving a spread spectrum (1-Lipschitz only), as the docstrings state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.autograd.functional import jacobian

import clipless.nn as cnn
from clipless import bounds, models
from clipless.constraints import project
from test_sensitivities import RTOL, Case, check_case


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _perturb(model: torch.nn.Module, seed: int, spread: float = 1.5) -> None:
    """Random weights of random scale (so bounds are exercised away from the orthogonal init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen, dtype=p.dtype)
                * spread
                / math.sqrt(p[0].numel())
            )


def _inputs(shape: tuple[int, ...], batch: int, radius: float, seed: int) -> torch.Tensor:
    """Inputs at norms far inside, on and far outside the InputNorm ball."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, *shape), generator=gen, dtype=torch.float64)
    x = x / torch.linalg.vector_norm(x.reshape(batch, -1), dim=1).reshape(-1, *[1] * len(shape))
    scales = torch.tensor([0.05, 1.0, 30.0, 0.3, 1e3][:batch], dtype=torch.float64) * radius
    return x * scales.reshape(-1, *[1] * len(shape))


TINY = {
    "resnet-l2": lambda: models.resnet((1, 6, 6), 2, 1, 3, input_norm=2.0),
    "resnet-avg-add": lambda: models.resnet(
        (1, 6, 6), (2, 4), 1, 3, input_norm=2.0, downsample="avg", residual="add", alpha=0.5
    ),
    "resnet-conv-rgb": lambda: models.resnet(
        (3, 4, 4), 2, 2, 3, input_norm=1.5, downsample="conv", groups=1, bias=True
    ),
    "gnp": lambda: models.gnp_convnet((1, 4, 4), (4, 16), 3, input_norm=2.0),
}
SHAPES = {"resnet-l2": (1, 6, 6), "resnet-avg-add": (1, 6, 6), "resnet-conv-rgb": (3, 4, 4)}
SHAPES["gnp"] = (1, 4, 4)


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("mode", [None, "clip", "fix", "orthogonal"])
def test_certified_gradient_bounds_hold_for_exact_per_sample_gradients(
    name: str, mode: str | None
) -> None:
    torch.manual_seed(0)
    model = TINY[name]().double()
    _perturb(model, seed=len(name))
    if mode is not None:
        project(model, mode=mode, max_norm=1.0)
    shape = SHAPES[name]
    radius = float(model[0].max_norm)
    x = _inputs(shape, 5, radius, seed=1)
    loss = cnn.CrossEntropyLoss(temperature=0.5, reduction="sum")
    y = torch.tensor([0, 1, 2, 1, 0])
    case = Case(model, loss, shape, x, y, name)  # type: ignore[arg-type]
    check_case(case)  # per-parameter, input and cotangent bounds vs exact per-sample values


def _singular_values(fn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Singular values of the explicit Jacobian of ``fn`` at one sample ``x`` (batch of 1)."""
    return torch.linalg.svdvals(jacobian(fn, x).reshape(-1, x.numel()))


def _blocks(model: cnn.Sequential) -> list[torch.nn.Module]:
    return [m for m in model if not isinstance(m, cnn.InputNorm)]


@pytest.mark.parametrize("spread", [0.05, 1.5])
@pytest.mark.parametrize("name", sorted(TINY))
def test_block_lipschitz_bounds_dominate_jacobian_svd(name: str, spread: float) -> None:
    """Each layer/block's certified constant >= the top singular value of its Jacobian.

    Small weights (``spread`` 0.05) make the skip path dominate a residual block (its constant
    is then close to ``scale``), large ones the branch.
    """
    torch.manual_seed(0)
    model = TINY[name]().double()
    _perturb(model, seed=7, spread=spread)
    shape = SHAPES[name]
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for trial, scale in enumerate([0.01, 1.0, 20.0]):
        # a fresh input at several scales: GroupNorm's max(alpha, std) switches regime
        h = torch.randn((1, *shape), generator=gen, dtype=torch.float64) * scale
        for module in _blocks(model):
            x = h.detach()
            if isinstance(module, cnn.Linear | cnn.Flatten):
                h = module(h)
                continue
            top = float(_singular_values(module, x).max())
            bound = module.lipschitz()
            assert top <= bound * (1 + RTOL), (name, trial, type(module).__name__, top, bound)
            checked += 1
            h = module(h)
    assert checked >= 3 * 3
    # the whole model after InputNorm: the product bound of bounds.report
    body = cnn.Sequential(*list(model)[1:])
    rep = bounds.report(model, cnn.CrossEntropyLoss(), shape)
    x = torch.randn((1, *shape), generator=gen, dtype=torch.float64)
    assert float(_singular_values(body, x).max()) <= rep.model_lipschitz * (1 + RTOL)


def test_resnet_blocks_are_one_lipschitz_after_projection() -> None:
    """With ``alpha = 1``, ``mode="average"`` and convolutions projected to <= 1, every block
    (and the model) is certified 1-Lipschitz; with ``residual="add"`` a block certifies 2."""
    for residual, expected in (("average", 1.0), ("add", 2.0)):
        torch.manual_seed(0)
        model = models.resnet((1, 8, 8), 4, 2, 10, residual=residual).double()
        _perturb(model, seed=1, spread=4.0)
        model(torch.zeros(1, 1, 8, 8, dtype=torch.float64))  # records the conv input sizes
        project(model, mode="clip", max_norm=1.0)
        blocks = [m for m in model.modules() if isinstance(m, cnn.Residual)]
        assert len(blocks) == 4
        for block in blocks:
            assert block.lipschitz() <= expected * (1 + 1e-6)
    rep = bounds.report(model, cnn.CrossEntropyLoss(), (1, 8, 8))
    assert len(rep.layers) == 1 + 2 * 4 + 1 + 1  # stem, 2 convs per block, 1x1, final


def _bjorck_to_convergence(model: torch.nn.Module) -> None:
    for _ in range(10):
        project(model, mode="orthogonal", max_norm=1.0, bjorck_iters=10)


def test_gnp_convnet_is_gradient_norm_preserving_after_orthogonal_projection() -> None:
    """All singular values of the feature map's Jacobian are 1 (square K_mat: J orthogonal)."""
    torch.manual_seed(0)
    model = models.gnp_convnet((1, 8, 8), (4, 16), 10).double()
    _perturb(model, seed=2, spread=3.0)
    _bjorck_to_convergence(model)
    features = cnn.Sequential(*list(model)[1:-2])  # the convolutions and GroupSorts
    x = torch.randn(1, 1, 8, 8, dtype=torch.float64)
    sv = _singular_values(features, x)
    assert sv.numel() == 64
    torch.testing.assert_close(sv, torch.ones_like(sv), atol=1e-6, rtol=0)
    # the final dense layer (10 x 64) has orthonormal rows: J^T is an isometry on the logits
    w = model[-1].weight.detach()
    torch.testing.assert_close(w @ w.T, torch.eye(10, dtype=torch.float64), atol=1e-6, rtol=0)
    # hence the whole network (after InputNorm) preserves every cotangent's norm
    body = cnn.Sequential(*list(model)[1:])
    jac = jacobian(body, x).reshape(10, 64)
    g = torch.randn(7, 10, dtype=torch.float64)
    torch.testing.assert_close(
        torch.linalg.vector_norm(g @ jac, dim=1), torch.linalg.vector_norm(g, dim=1)
    )
    # and the certified bound of each layer is 1 up to the rescale's margin
    for m in model.modules():
        if isinstance(m, cnn.Conv2d | cnn.Linear):
            assert 1 - 1e-5 <= m.lipschitz() <= 1 + 1e-6


def test_orthogonal_projection_of_a_3x3_convolution_is_not_gnp() -> None:
    """What the docstrings say: Björck on K_mat of a 3x3 convolution gives a 1-Lipschitz but
    not gradient-norm-preserving operator (singular values spread well below 1)."""
    torch.manual_seed(0)
    conv = cnn.Conv2d(4, 4, 3, padding=1, bias=False).double()
    _perturb(conv, seed=3)
    conv(torch.zeros(1, 4, 6, 6, dtype=torch.float64))
    _bjorck_to_convergence(cnn.Sequential(conv))
    x = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    sv = _singular_values(conv, x)
    assert float(sv.max()) <= conv.lipschitz() * (1 + RTOL) <= 1 + 1e-6
    assert float(sv.min()) < 0.5  # far from orthogonal


def test_resnet_and_gnp_shapes_twins_and_errors() -> None:
    torch.manual_seed(0)
    for model, shape in (
        (models.resnet((1, 28, 28), 4, 1, 10), (1, 28, 28)),
        (models.resnet((3, 32, 32), 4, 1, 10, stages=3, downsample="conv"), (3, 32, 32)),
        (models.gnp_convnet((3, 32, 32), (12, 48), 10), (3, 32, 32)),
    ):
        cnn.validate(model)
        x = torch.rand(2, *shape)
        assert model(x).shape == (2, 10)
        twin = cnn.vanilla_export(model)
        assert not any(isinstance(m, cnn.LipschitzModule) for m in twin.modules())
        torch.testing.assert_close(twin(x), model(x))
    widths = [
        m.out_channels
        for m in models.resnet((3, 32, 32), 4, 1, 10, stages=3).modules()
        if isinstance(m, cnn.Conv2d) and m.kernel_size == (1, 1)
    ]
    assert widths == [8, 16]
    with pytest.raises(ValueError, match="channels, height, width"):
        models.resnet((784,), 4, 1, 10)
    with pytest.raises(ValueError, match="too small"):
        models.resnet((1, 4, 4), 2, 1, 10, stages=4)
    with pytest.raises(ValueError, match="downsample"):
        models.resnet((1, 8, 8), 2, 1, 10, downsample="max")
    with pytest.raises(ValueError, match="groups"):
        models.resnet((1, 8, 8), 6, 1, 10, groups=4)
    with pytest.raises(ValueError, match="depth"):
        models.resnet((1, 8, 8), 2, -1, 10)
    with pytest.raises(ValueError, match="width"):
        models.resnet((1, 8, 8), 3, 1, 10)
    with pytest.raises(ValueError, match="too small"):
        models.gnp_convnet((1, 4, 4), (4, 16, 64), 10)


def test_build_dispatches_the_new_kinds() -> None:
    res = models.build(models.Architecture("resnet", (1, 8, 8), (4, 8), 10, pool="avg"))
    assert sum(isinstance(m, cnn.Residual) for m in res.modules()) == 2
    assert any(isinstance(m, cnn.AvgPool2d) for m in res.modules())
    gnp = models.build(models.Architecture("gnp", (1, 8, 8), (4, 16), 10))
    assert [m.kernel_size for m in gnp.modules() if isinstance(m, cnn.Conv2d)] == [(2, 2)] * 2
    assert set(models.MODEL_KINDS) >= {"resnet", "gnp"}


@pytest.mark.parametrize(("kind", "hidden"), [("resnet", "4,8")])
def test_cli_trains_the_new_models_on_digits_and_reloads_them(
    kind: str, hidden: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clipless.cli import load_trained_model, main
    from clipless.data import load_dataset

    out = tmp_path / kind
    argv = ["train", "--dataset", "digits", "--model", kind, "--hidden", hidden]
    argv += ["--epsilon", "2", "--accountant", "rdp", "--epochs", "1", "--batch-size", "256"]
    argv += ["--out", str(out), "--no-progress", "--unsafe-seed", "1", "--threads", "1"]
    assert main(argv) == 0
    assert "final: test_acc" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stop_reason"] == "completed" and metrics["epsilon"] <= 2.0
    assert metrics["config"]["model"] == kind
    model = load_trained_model(out / "model.pt")
    cnn.validate(model)
    _, test, _ = load_dataset("digits")
    x, y = test.tensors
    model.eval()
    with torch.no_grad():
        accuracy = int((model(x).argmax(1) == y).sum()) / len(y)
    assert accuracy == pytest.approx(metrics["final"]["test_accuracy"], abs=1e-12)


@pytest.mark.parametrize("kind", ["resnet", "gnp"])
def test_cli_refuses_the_image_models_on_tabular_data(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clipless.cli import main

    argv = ["train", "--dataset", "breast-cancer", "--model", kind, "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "image dataset" in err
    assert not (tmp_path / "x").exists()


def test_bad_shapes_and_widths_name_the_argument() -> None:
    import numpy as np

    with pytest.raises(ValueError, match="width must be a sequence"):
        models.resnet((1, 8, 8), True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input_shape must be"):
        models.build(models.Architecture("mlp", (), (4,), 3))
    with pytest.raises(ValueError, match="input_shape must be a sequence"):
        models.mlp(14, [4], 2)  # type: ignore[arg-type]
    assert models.mlp((4,), [np.int64(4)], 2)[-1].in_features == 4
    assert models.mlp((4,), np.array([4, 6]), 2)[-1].in_features == 6


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_classes": 2.7}, TypeError, "num_classes"),
        ({"num_classes": True}, TypeError, "num_classes"),
        ({"num_classes": "3"}, TypeError, "num_classes"),
        ({"num_classes": 0}, ValueError, "num_classes"),
        ({"input_norm": "5"}, TypeError, "input_norm"),
        ({"input_norm": torch.tensor(3.0)}, TypeError, "input_norm"),
        ({"input_norm": float("inf")}, ValueError, "input_norm"),
        ({"hidden": 8}, ValueError, "hidden"),
    ],
)
def test_builders_refuse_what_they_used_to_coerce(kwargs: dict, error: type, match: str) -> None:
    """Audit finding: int() / float() turned num_classes=2.7 into 2 logits and True into 1."""
    args = {"input_shape": (4,), "hidden": (8,), "num_classes": 3, **kwargs}
    with pytest.raises(error, match=match):
        models.build(models.Architecture("mlp", **args))


def test_builders_accept_numpy_numbers() -> None:
    np = pytest.importorskip("numpy")
    model = models.build(
        models.Architecture("mlp", (4,), (8,), np.int64(3), input_norm=np.float32(2.0))
    )
    assert model[-1].out_features == 3 and model[0].max_norm == 2.0


def test_build_takes_an_architecture_and_the_old_form_warns() -> None:
    """``models.build(kind, input_shape, ...)`` (12 positional arguments at its widest) still
    builds the same model, with a DeprecationWarning; the Architecture round-trips as JSON."""
    center, white = torch.full((4,), 0.1), torch.eye(4, dtype=torch.float64)
    arch = models.Architecture("mlp", (4,), (8,), 3, 2.0, True, "l2", "sphere", 5.0, 6.0)
    assert models.Architecture.from_dict(arch.to_dict()) == models.Architecture(
        "mlp", (4,), (8,), 3, 2.0, True, "l2", "sphere", 5.0, 6.0
    )
    torch.manual_seed(0)
    new = models.build(arch, center=center, whiten=white)
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match="models.Architecture"):
        old = models.build("mlp", (4,), (8,), 3, 2.0, True, "l2", "sphere", center, 5.0, white, 6.0)
    assert new.state_dict().keys() == old.state_dict().keys()
    assert all(torch.equal(new.state_dict()[k], old.state_dict()[k]) for k in new.state_dict())
    assert new[0].mode == "sphere" and new[0].release_noise == 5.0
    with pytest.raises(TypeError, match="center= and whiten="):
        models.build(arch, 3)  # type: ignore[call-overload]
