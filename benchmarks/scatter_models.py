"""Nonlinear models on Fashion-MNIST's scattering maps (81 x 7 x 7), epsilon 3 (issue 39).

Both sides read the same features: :class:`clipless.features.Scattering2d` (kymatio, J = 2,
L = 8, then a per-sample group normalisation in 27 groups), kept as maps ``[n, 81, 7, 7]``.

* ``--method opacus --model tb-cnn``: Tramèr and Boneh's ScatterNet CNN for (Fashion-)MNIST
  (``MNIST_CNN`` of github.com/ftramer/Handcrafted-DP, ``models.py``, with ``in_channels = 81``):
  ``GroupNorm(27, 81, affine=False) -> Conv 3x3 stride 2 pad 1 (81 -> 16) -> tanh -> Conv 3x3
  pad 1 (16 -> 32) -> tanh -> Linear(512, 32) -> tanh -> Linear(32, 10)``, 33,066 parameters.
  Their Fashion-MNIST command (README: ``cnns.py --dataset=fmnist --use_scattering
  --batch_size=2048 --lr=4 --input_norm=GroupNorm --num_groups=27 --noise_multiplier=2.15``;
  momentum 0.9 and clip 0.1 are ``cnns.py``'s defaults, 2.15 is epsilon 3 after 40 epochs) run
  under Opacus 1.6 ``make_private_with_epsilon`` (PRV accountant, Poisson sampling), 40 epochs.
  The model's GroupNorm is per-sample (no privacy cost) and is the front-end's own: our features
  are exactly TB's ``GroupNorm(27)`` of the raw scattering, so it is not applied twice
  (:func:`tb_cnn`, ``tests/test_scatter_models.py``).
* ``--method clipless``: a :mod:`clipless.nn` model after the section-20 input map
  (``InputNorm``: sphere of radius ``input_norm``, minus the released mean, times the released
  channel whitening; both releases accounted), ``--set model=...``:

  - ``linear``: ``Flatten -> Linear(3969, 10)`` (the CLI's model, RESULTS.md 20c);
  - ``split``: a public, frozen 1x1 convolution ``81 -> 162`` whose output channel ``2c`` is
    ``x_c`` and ``2c + 1`` is 0, then ``GroupSort(2)``: each pair becomes ``(min(x_c, 0),
    max(x_c, 0))``, so the trained linear head reads ``x`` and ``|x|`` (a piecewise-linear
    additive model). The conv has orthonormal columns (an isometry): the head's input keeps the
    norm of ``x`` and its certified bound is the linear model's. Only the head is noised;
  - ``conv1x1``: the same convolution, trained (initialised at ``split``); ``width`` other than
    162 starts from an orthogonal draw instead;
  - ``mlp``: section 29c's ``Flatten -> Linear(3969, width) -> GroupSort(2) -> Linear``.

  ``constraint`` (``none`` / ``orthogonal`` / ``clip``) and ``noise`` (``global`` /
  ``per-layer``) are the mechanism's; PLD accounting calibrated to epsilon 3, delta 1e-5,
  Poisson sampling, final-epoch test accuracy. With ``certify=True`` the clipless model's
  certified L2 robust accuracy is measured **in the scattering feature space** (the radius is a
  distance between 81 x 7 x 7 feature maps, whose norm is ``sqrt(3969) = 63`` after the group
  normalisation; the front-end's Lipschitz constant from pixels is not certified, so this is not
  a pixel-space guarantee).

Features come from ``$CLIPLESS_DATA/features`` (the CLI's cache): a cached tensor of the right
shape is used when 64 of its rows (fixed indices) equal the front-end's output exactly; else
:func:`clipless.features.cached_features` computes and caches them.

Usage (RESULTS.md section 54)::

    CLIPLESS_DATA=/tmp/i39data/root PYTHONPATH=src python benchmarks/scatter_models.py \\
        --method opacus --model tb-cnn --seeds 0
    CLIPLESS_DATA=/tmp/i39data/root PYTHONPATH=src python benchmarks/scatter_models.py \\
        --method clipless --seeds 0 --set model=split lr=0.01 clip=0.2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adult

import clipless
from clipless import nn
from clipless.data import data_root, load_dataset
from clipless.engine import MechanismSpec, RunOptions
from clipless.features import Scattering2d, cached_features
from clipless.robustness import certified_accuracy

OUT = Path(__file__).resolve().parent / "out" / "scatter_models.jsonl"
EPSILON, DELTA = 3.0, 1e-5

CLIPLESS: dict[str, Any] = {
    "model": "linear",  # linear / split / conv1x1 / mlp
    "width": 162,  # conv1x1's output channels or mlp's hidden width (even)
    "constraint": "none",
    "noise": "global",
    "max_norm": 1.0,
    "input_norm": 1.0,
    "center": 20.0,
    "whiten": 20.0,
    "shrink": 1.0,
    "floor": True,
    "lr": 0.01,
    "temperature": 0.1,
    "clip": 0.2,
    "batch": 2048,
    "epochs": 20,
    "certify": False,
    "radii": (0.25, 0.5, 1),  # feature-space L2 radii for certify=True (feature norms ~40-50)
}
OPACUS: dict[str, Any] = {
    "model": "tb-cnn",
    "lr": 4.0,
    "momentum": 0.9,
    "max_grad_norm": 0.1,
    "batch": 2048,
    "epochs": 40,
    "grad_sample_mode": "hooks",
}


def _rows_match(phi: torch.nn.Module, x: torch.Tensor, cached: torch.Tensor) -> bool:
    idx = torch.linspace(0, len(x) - 1, 64).long()
    with torch.no_grad():
        return bool(torch.equal(phi(x[idx]), cached[idx]))


def scatter_maps(phi: Scattering2d, data: TensorDataset, folder: Path) -> TensorDataset:
    """``data`` through ``phi`` as ``[n, 81, 7, 7]`` maps, read from a verified cached file of
    ``folder`` when one holds them (its key may predate a source edit that did not change the
    output), else computed and cached by :func:`cached_features`."""
    x, y = data.tensors
    shape = (len(x), *phi.output_shape)
    for path in sorted(folder.glob("*.pt")) if folder.is_dir() else []:
        if path.stat().st_size < 4 * math.prod(shape):
            continue
        saved = torch.load(path, map_location="cpu", weights_only=True)
        t = saved.get("features") if isinstance(saved, dict) else None
        if isinstance(t, torch.Tensor) and tuple(t.shape) == shape and _rows_match(phi, x, t):
            return TensorDataset(t, y)
    return cached_features(phi, data, folder)[0]


def load_maps() -> tuple[TensorDataset, TensorDataset]:
    train, test, info = load_dataset("fashion-mnist", download=False)
    phi = Scattering2d(info.input_shape)
    folder = data_root() / "features"
    return scatter_maps(phi, train, folder), scatter_maps(phi, test, folder)


def tb_cnn(channels: int = 81, groups: int = 0) -> torch.nn.Sequential:
    """Tramèr and Boneh's ``MNIST_CNN`` on ``channels x 7 x 7`` scattering maps (module doc).

    ``groups = 0`` (default) leaves out their leading ``GroupNorm(groups, channels,
    affine=False)``: :class:`Scattering2d` has already applied it (its output *is* TB's
    ``GroupNorm(27)`` of the raw scattering), and a second one is not the identity, because the
    raw groups' variances (1e-7 to 1e-5 on Fashion-MNIST) are of the order of its ``eps = 1e-5``.
    """
    norm: torch.nn.Module = (
        torch.nn.GroupNorm(groups, channels, affine=False) if groups else torch.nn.Identity()
    )
    return torch.nn.Sequential(
        norm,
        torch.nn.Conv2d(channels, 16, 3, stride=2, padding=1),
        torch.nn.Tanh(),
        torch.nn.Conv2d(16, 32, 3, stride=1, padding=1),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 10),
    )


def split_weight(channels: int) -> torch.Tensor:
    """The 1x1 kernel ``[2C, C, 1, 1]`` mapping channel ``c`` to ``2c`` and zero to ``2c + 1``
    (orthonormal columns: ``K^T K = I``)."""
    w = torch.zeros(2 * channels, channels, 1, 1)
    w[2 * torch.arange(channels), torch.arange(channels)] = 1.0
    return w


def _body(cfg: dict[str, Any], c: int, h: int, w: int) -> list[torch.nn.Module]:
    kind, width = cfg["model"], int(cfg["width"])
    if kind == "linear":
        return [nn.Flatten(), nn.Linear(c * h * w, 10, bias=False)]
    if kind == "mlp":
        return [
            nn.Flatten(),
            nn.Linear(c * h * w, width, bias=False),
            nn.GroupSort(2),
            nn.Linear(width, 10, bias=False),
        ]
    if kind not in ("split", "conv1x1"):
        raise SystemExit(f"model must be linear, split, conv1x1 or mlp; got {kind!r}")
    if kind == "split":
        width = 2 * c
    conv = nn.Conv2d(c, width, 1, bias=False)
    with torch.no_grad():
        if width == 2 * c:
            conv.weight.copy_(split_weight(c))
        else:
            torch.nn.init.orthogonal_(conv.weight.view(width, c))
    if kind == "split":
        conv.weight.requires_grad_(False)  # public and fixed: never noised
    return [conv, nn.GroupSort(2), nn.Flatten(), nn.Linear(width * h * w, 10, bias=False)]


def clipless_model(cfg: dict[str, Any], train: TensorDataset) -> nn.Sequential:
    x = train.tensors[0]
    c, h, w = (int(s) for s in x.shape[1:])
    center, whiten = adult.released_input(cfg, x)
    first = nn.InputNorm(
        float(cfg["input_norm"]),
        mode="sphere",
        center=center,
        center_noise=float(cfg["center"]) if cfg["center"] else None,
        whiten=whiten,
        whiten_noise=float(cfg["whiten"]) if cfg["whiten"] else None,
    )
    return nn.Sequential(first, *_body(cfg, c, h, w), nn.LossGradientClip(float(cfg["clip"])))


def run_clipless(
    cfg: dict[str, Any], seed: int, train: TensorDataset, test: TensorDataset
) -> dict[str, Any]:
    torch.manual_seed(seed)
    cfg = {**cfg, "_seed": seed}
    model: torch.nn.Module = clipless_model(cfg, train)
    loss = nn.CrossEntropyLoss(temperature=float(cfg["temperature"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = clipless.PrivacyEngine(accountant="pld", seed=seed)
    constraint = None if cfg["constraint"] in (None, "none") else cfg["constraint"]
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(trainable, lr=float(cfg["lr"])),
        data_loader=DataLoader(train, batch_size=int(cfg["batch"])),
        loss=loss,
        target_epsilon=EPSILON,
        target_delta=DELTA,
        epochs=int(cfg["epochs"]),
        mechanism=MechanismSpec(
            max_norm=float(cfg["max_norm"]), constraint=constraint, noise=cfg["noise"]
        ),
        options=RunOptions(input_shape=tuple(train.tensors[0].shape[1:])),
    )
    start = time.perf_counter()
    curve = []
    for _ in range(int(cfg["epochs"])):
        for x, y in loader:
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()
        curve.append(round(100 * adult.accuracy(model, test), 2))
    out: dict[str, Any] = {
        "accuracy": curve[-1],
        "curve": curve,
        "epsilon": engine.get_epsilon(DELTA),
        "sigma": engine.config["noise_multiplier"],
        "time_s": round(time.perf_counter() - start, 1),
    }
    if cfg["certify"]:
        x, y = test.tensors
        with torch.no_grad():
            robust = certified_accuracy(
                model, x, y, [float(r) for r in cfg["radii"]], space="features"
            )
        out["certified"] = dict(zip(map(str, robust.radii), robust.certified, strict=True))
    return out


def run_opacus(
    cfg: dict[str, Any], seed: int, train: TensorDataset, test: TensorDataset
) -> dict[str, Any]:
    torch.manual_seed(seed)
    if cfg["model"] != "tb-cnn":
        raise SystemExit(f"opacus runs model=tb-cnn only; got {cfg['model']!r}")
    model = tb_cnn(int(train.tensors[0].shape[1]))
    opt = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]), momentum=cfg["momentum"])
    engine, model, opt, loader, ce = adult.opacus_private(cfg, model, opt, train, EPSILON, DELTA)
    start = time.perf_counter()
    curve = []
    for _ in range(int(cfg["epochs"])):
        for x, y in loader:
            if len(y) == 0:
                continue
            opt.zero_grad()
            ce(model(x), y).backward()
            opt.step()
        curve.append(round(100 * adult.accuracy(model, test), 2))
    return {
        "accuracy": curve[-1],
        "best_epoch_accuracy": max(curve),  # Tramèr and Boneh's selection (on the test set)
        "curve": curve,
        "epsilon": engine.get_epsilon(DELTA),
        "sigma": opt.noise_multiplier,
        "time_s": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("clipless", "opacus"), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--model", default=None, help="shorthand for --set model=...")
    args = parser.parse_args()
    base = CLIPLESS if args.method == "clipless" else OPACUS
    overrides = {k: adult.parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.model is not None:
        overrides["model"] = args.model
    unknown = set(overrides) - set(base)
    if unknown:
        raise SystemExit(f"--set: unknown key(s) {sorted(unknown)}; known: {sorted(base)}")
    cfg = {**base, **overrides}
    torch.set_num_threads(1)
    train, test = load_maps()
    runner = run_clipless if args.method == "clipless" else run_opacus
    OUT.parent.mkdir(exist_ok=True)
    for seed in args.seeds:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = runner(cfg, seed, train, test)
        row = {"method": args.method, "seed": seed, "overrides": overrides, **result}
        line = json.dumps(row, default=list)
        print(line, flush=True)
        with OUT.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
