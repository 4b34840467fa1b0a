"""Adult income at epsilon 0.414, delta 1/n: clipless against Opacus DP-SGD in one harness.

The thesis's tabular protocol (Table 5.4) on Adult: the fixed train/test split, the library's
public per-record transform (:func:`clipless.data.load_adult`: numeric features scaled by public
ranges, one-hot categories with ``'?'`` encoded as all zeros; 104 features, 138 with the public
bins of ``preprocessing=public-bins``, 146 with ``public-bins-fine``, the CLI's default), delta =
1/n, Poisson sampling, the final epoch's test accuracy (no selection on the test set).

* ``clipless``: a :mod:`clipless.models` MLP (or a linear model, ``hidden=()``), every setting of
  the privacy mechanism a knob (``constraint``, ``scaling``, ``noise``, the output-cotangent clip
  ``clip`` = :class:`clipless.nn.LossGradientClip`, ``temperature``, ``input_norm``, optimiser).
  Accounting: PLD, calibrated to the target epsilon.
* ``opacus``: Opacus 1.6 ``PrivacyEngine.make_private_with_epsilon`` (PRV accountant, Poisson
  sampling, flat clipping) on a plain ``Linear-ReLU-Linear`` MLP (features)-64-2 with biases,
  SGD; the issue's reference setting is batch 1024, 30 epochs, lr 2, clip 1 (median 0.8504
  over 5 seeds, measured by the issue on its own 108-feature encoding).
* ``nonprivate``: the same plain MLP with Adam (``hidden=()``: a linear model), a ceiling;
* ``logreg``: logistic regression trained to convergence (full-batch L-BFGS), the linear ceiling.

``--set dataset=fashion-mnist`` runs the same comparison on Fashion-MNIST (epsilon 3, delta
1e-5 unless ``epsilon=...``; ``hidden=()`` for the linear model).

Run ``python benchmarks/adult.py --method clipless --seeds 0 1 2 --set lr=0.01 clip=0.3`` (one
setting, one JSON line with every seed's accuracy, the median, the epsilon spent and the
gradient-to-bound ratios). The rows of the lever table in ``benchmarks/RESULTS.md`` section 8 are
each one such command.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless
from clipless import models, nn
from clipless.data import data_root, load_dataset
from clipless.data.tabular import adult_max_norm, load_adult
from clipless.diagnostics import sensitivity_use
from clipless.engine import MechanismSpec, RunOptions
from clipless.features import (
    apply_features,
    build_features,
    release_channel_moment,
    release_mean,
    whitening,
)
from clipless.nn.export import mix_channels
from clipless.optim import AdamBC
from clipless.training import WeightEMA

OUT_DIR = Path(__file__).resolve().parent / "out"
EPSILON = 0.414
# Per dataset: the target epsilon and delta (None: 1/n, the thesis protocol) and the public input
# radius of the CLI (clipless.cli._default_input_norm).
DATASETS: dict[str, dict[str, Any]] = {
    "adult": {"epsilon": EPSILON, "delta": None, "input_norm": math.sqrt(13.0)},
    "fashion-mnist": {"epsilon": 3.0, "delta": 1e-5, "input_norm": 7.0},
    "mnist-10k": {"epsilon": 3.0, "delta": 1e-5, "input_norm": 7.0},
    # thesis Table 5.4 budgets (benchmarks/tabular.py)
    "german-credit": {"epsilon": 3.852, "delta": None, "input_norm": math.sqrt(20.0)},
    "breast-cancer": {"epsilon": 1.672, "delta": None, "input_norm": math.sqrt(30.0)},
}

CLIPLESS_DEFAULTS: dict[str, Any] = {
    "hidden": (64,),
    "dataset": "adult",
    "epsilon": None,  # None: the dataset's (DATASETS)
    "input_norm": None,  # None: the CLI's public default for the dataset
    "bias": False,
    "constraint": "orthogonal",
    "max_norm": 1.0,
    "scaling": "per-sample",
    "noise": "global",
    "temperature": 1.0,
    "clip": None,  # LossGradientClip(c) after the last layer
    "optimizer": "sgd",  # or "adam", "adambc" (clipless.optim.AdamBC; bc_floor, bc_ratio)
    "bc_floor": 1e-12,
    "bc_ratio": 0.0,
    "lr": 0.02,
    "momentum": 0.9,
    "batch": 128,
    "epochs": 30,
    "loss": "ce",
    "margin": 1.0,
    "ema": None,  # decay of an EMA of the weights (evaluated instead of the last iterate)
    "schedule": "constant",  # or "cosine": lr * (1 + cos(pi t / T)) / 2, or "step": lr until
    # drop_at * T steps, then lr * drop
    "drop_at": 0.5,
    "drop": 0.1,
    "freeze_first": False,  # a public random first layer, not trained (its weights never noised)
    "features": "none",  # or "scatter": clipless.features.Scattering2d before the model
    "input_mode": "ball",  # InputNorm: "ball" (clip to input_norm) or "sphere" (normalise to it)
    "threshold": None,  # scaling="threshold": T_k = threshold * input radius for every layer
    "ratios": True,  # measure gradient_to_bound at the end (256 samples, sensitivity_use)
    # noise multiplier of the private input mean that InputNorm subtracts (None: no centring;
    # clipless.features.release_mean, accounted by the engine with the steps)
    "center": None,
    # noise multiplier of the private channel second moment whose shrunk inverse square root
    # InputNorm applies after the centring (None: no whitening; clipless.features.whitening)
    "whiten": None,
    "shrink": 1.0,  # whitening's shrinkage (clipless.features.whitening)
    "floor": True,  # lift by at least the release noise's spectral norm (whitening's floor)
    "preprocessing": None,  # Adult's transform (None: the loader's default; "public-bins", ...)
    "device": "cpu",  # where the model and each batch live ("cuda" on a GPU machine)
    # "flip": every training sample is two rows, the image and its horizontal mirror (through the
    # feature front-end), and its gradient contribution is their mean (augmentation multiplicity
    # 2, DPOptimizer.sample_multiplicity: the sensitivity and the noise are unchanged)
    "augment": None,
}
# The linear setting chosen on Adult (RESULTS.md 23e / 24a): public fine bins, bias, Adam.
LINEAR_SETTING: dict[str, Any] = {
    "preprocessing": "public-bins-fine",
    "hidden": (),
    "bias": True,
    "constraint": None,
    "optimizer": "adam",
    "lr": 0.003,
    "temperature": 0.1,
    "clip": 0.3,
    "ema": 0.9,
    "batch": 2035,
    "ratios": False,
}

OPACUS_DEFAULTS: dict[str, Any] = {
    "dataset": "adult",
    "epsilon": None,
    "hidden": (64,),
    "lr": 2.0,
    "momentum": 0.0,
    "max_grad_norm": 1.0,
    "batch": 1024,
    "epochs": 30,
    "features": "none",
    "optimizer": "sgd",  # or "adam" (lr then Adam's)
    # centre every sample by the same released mean as clipless's ``center`` (x - ||x|| mu: the
    # features keep their scale, so lr and clip keep their meaning); the release's small cost is
    # NOT in Opacus's accountant (its epsilon is the steps' only): a slight advantage to Opacus
    "center": None,
    # as clipless's: x -> ||x|| W (x / ||x|| - mu) with the same released W (not in the accountant)
    "whiten": None,
    "shrink": 1.0,
    "floor": True,
    "preprocessing": None,
    "device": "cpu",
    "grad_sample_mode": "hooks",  # or "ghost": Opacus's ghost clipping (same update, faster)
    # "flip": as clipless's; the model sees [batch, 2, features] and Opacus's per-sample gradient
    # is the mean over the two rows (its sequence dimension) before the clip
    "augment": None,
}


def _full_float32(device: torch.device) -> None:
    """No TF32 on CUDA, for both libraries: clipless refuses it (its rounding exceeds the noise's
    float32 margin: ``clipless.optim.reduced_float32_precision``), so Opacus runs the same way."""
    if device.type == "cuda":
        from clipless.optim import full_float32_precision

        full_float32_precision()


def load(
    dataset: str = "adult", features: str = "none", preprocessing: str | None = None
) -> tuple[TensorDataset, TensorDataset]:
    """The dataset, through the public feature front-end ``features`` (cached in ``out/``).

    ``preprocessing`` (Adult only): the loader's per-record transform (``None``: its default;
    ``"public-bins"``: :data:`clipless.data.tabular.ADULT_BINS`).
    """
    if preprocessing is not None:
        if dataset != "adult":
            raise SystemExit(f"preprocessing=... is for adult only, not {dataset}")
        train, test, info = load_adult(data_root(), False, preprocessing)
    else:
        train, test, info = load_dataset(dataset, download=False)
    if features == "none":
        return train, test
    cache = OUT_DIR / f"features-{dataset}-{features}.pt"
    if cache.is_file():
        tensors = torch.load(cache)
        return TensorDataset(*tensors["train"]), TensorDataset(*tensors["test"])
    phi = build_features(features, info.input_shape)
    assert phi is not None
    train, test = apply_features(phi, train), apply_features(phi, test)
    OUT_DIR.mkdir(exist_ok=True)
    torch.save({"train": train.tensors, "test": test.tensors}, cache)
    return train, test


def flip_views(cfg: dict[str, Any], train: TensorDataset) -> TensorDataset:
    """``train`` with ``augment="flip"``: ``[n, 2, *shape]``, each image and its mirror image.

    The mirror is taken on the raw image (last axis) and then sent through the same public
    feature front-end; its features are cached in ``out/`` next to the originals.
    """
    if cfg["augment"] != "flip":
        raise SystemExit(f"augment must be None or 'flip'; got {cfg['augment']!r}")
    if cfg["dataset"] not in ("fashion-mnist", "mnist-10k"):
        raise SystemExit(f"augment=flip is for image datasets, not {cfg['dataset']}")
    x, y = train.tensors
    cache = OUT_DIR / f"features-{cfg['dataset']}-{cfg['features']}-flip.pt"
    if cache.is_file():
        mirrored = torch.load(cache)
    else:
        raw, _, info = load_dataset(cfg["dataset"], download=False)
        images = TensorDataset(raw.tensors[0].flip(-1), raw.tensors[1])
        if cfg["features"] != "none":
            phi = build_features(cfg["features"], info.input_shape)
            assert phi is not None
            images = apply_features(phi, images)
        mirrored = images.tensors[0]
        OUT_DIR.mkdir(exist_ok=True)
        torch.save(mirrored, cache)
    return TensorDataset(torch.stack([x, mirrored], dim=1), y)


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    model.eval()
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in data.tensors)
    acc = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return acc


def privacy(cfg: dict[str, Any], n: int) -> tuple[float, float]:
    """``(epsilon, delta)`` of a setting: its own, else the dataset's (delta ``None``: 1/n)."""
    spec = DATASETS[cfg["dataset"]]
    epsilon = cfg["epsilon"] if cfg["epsilon"] is not None else spec["epsilon"]
    return float(epsilon), float(spec["delta"] if spec["delta"] is not None else 1.0 / n)


def public_radius(cfg: dict[str, Any]) -> float:
    """The CLI's public input radius of the dataset (Adult: of its ``preprocessing``)."""
    if cfg["dataset"] == "adult" and cfg.get("preprocessing") is not None:
        return adult_max_norm(cfg["preprocessing"])
    return float(DATASETS[cfg["dataset"]]["input_norm"])


def clipless_model(cfg: dict[str, Any], train: TensorDataset) -> torch.nn.Module:
    x, y = train.tensors
    shape, classes = tuple(x.shape[1:]), int(y.max()) + 1
    radius = cfg["input_norm"] or (
        math.sqrt(x[0].numel())  # the norm of group-normalised features (Scattering2d)
        if cfg["features"] != "none"
        else public_radius(cfg)
    )
    hidden = tuple(cfg["hidden"])
    if hidden:
        model = models.mlp(shape, hidden, classes, input_norm=radius, bias=cfg["bias"])
    else:
        model = models.linear(shape, classes, input_norm=radius, bias=cfg["bias"])
    if cfg["input_mode"] != "ball" or cfg["center"] or cfg["whiten"]:
        center, whiten = released_input(cfg, x)
        model[0] = nn.InputNorm(
            radius,
            mode=cfg["input_mode"],
            center=center,
            center_noise=float(cfg["center"]) if cfg["center"] else None,
            whiten=whiten,
            whiten_noise=float(cfg["whiten"]) if cfg["whiten"] else None,
        )
    if cfg["clip"] is not None:
        model.append(nn.LossGradientClip(float(cfg["clip"])))
    return model


def _release_generator(cfg: dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(int(cfg.get("_seed", 0)) + 7)


def released_input(
    cfg: dict[str, Any], x: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The released mean (``center``) and whitening matrix (``whiten``) of a setting, or None."""
    center = whiten = None
    if cfg["center"]:
        center = release_mean(x, float(cfg["center"]), generator=_release_generator(cfg))
    if cfg["whiten"]:
        seed = int(cfg.get("_seed", 0)) + 11
        moment = release_channel_moment(
            x, float(cfg["whiten"]), generator=torch.Generator().manual_seed(seed)
        )
        whiten = whitening(
            moment,
            center,
            float(cfg["shrink"]),
            noise_multiplier=float(cfg["whiten"]) if cfg["floor"] else None,
            num_samples=len(x) if cfg["floor"] else None,
        )
    return center, whiten


def clipless_loss(cfg: dict[str, Any]) -> torch.nn.Module:
    if cfg["loss"] == "ce":
        return nn.CrossEntropyLoss(temperature=cfg["temperature"])
    if cfg["loss"] == "hinge":
        return nn.MulticlassHingeLoss(margin=cfg["margin"])
    raise ValueError(f"loss must be 'ce' or 'hinge'; got {cfg['loss']!r}")


def run_clipless(
    cfg: dict[str, Any], seed: int, train: TensorDataset, test: TensorDataset
) -> dict[str, Any]:
    torch.manual_seed(seed)
    n = len(train)
    cfg = {**cfg, "_seed": seed}
    device = torch.device(cfg["device"])
    _full_float32(device)
    model = clipless_model(cfg, train).to(device)
    epsilon, delta = privacy(cfg, n)
    loss = clipless_loss(cfg)
    rows = train if cfg["augment"] is None else flip_views(cfg, train)
    if cfg["freeze_first"]:
        first = next(m for m in model if isinstance(m, nn.Linear))
        with torch.no_grad():  # a random orthogonal map drawn from the public seed
            torch.nn.init.orthogonal_(first.weight)
        for p in first.parameters():
            p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if cfg["optimizer"] == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(trainable, lr=cfg["lr"])
    elif cfg["optimizer"] == "adambc":
        opt = AdamBC(trainable, lr=cfg["lr"], floor=cfg["bc_floor"], floor_ratio=cfg["bc_ratio"])
    else:
        opt = torch.optim.SGD(trainable, lr=cfg["lr"], momentum=cfg["momentum"])
    engine = clipless.PrivacyEngine(accountant="pld", seed=seed)
    thresholds = None
    if cfg["threshold"] is not None:  # a public T_k: a fraction of the public input radius
        radius = cfg["input_norm"] or public_radius(cfg)
        thresholds = {
            name: float(cfg["threshold"]) * radius
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear)
        }
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(rows, batch_size=cfg["batch"]),
        loss=loss,
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=cfg["epochs"],
        mechanism=MechanismSpec(
            max_norm=cfg["max_norm"],
            constraint=cfg["constraint"],
            scaling=cfg["scaling"],
            noise=cfg["noise"],
            thresholds=thresholds,
        ),
        # the shape of one row (one view with augment)
        options=RunOptions(input_shape=tuple(train.tensors[0].shape[1:])),
    )
    ema = WeightEMA(model, cfg["ema"]) if cfg["ema"] else None
    total = cfg["epochs"] * len(loader)
    sched: torch.optim.lr_scheduler.LambdaLR | None = None
    if cfg["schedule"] == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: 0.5 * (1 + math.cos(math.pi * t / total))
        )
    elif cfg["schedule"] == "step":
        at, drop = float(cfg["drop_at"]) * total, float(cfg["drop"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 if t < at else drop)
    start = time.perf_counter()
    for _ in range(cfg["epochs"]):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            if cfg["augment"] is not None:  # [B, K, ...]: row j of sample i is its view j
                views = x.shape[1]
                with opt.sample_multiplicity(views):  # each sample's K rows: its views
                    logits = model(x.reshape(-1, *x.shape[2:]))
                loss(logits, y.repeat_interleave(views)).backward()
            else:
                loss(model(x), y).backward()
            opt.step()
            if ema is not None:
                ema.update(model)
            if sched is not None:
                sched.step()
    return {
        "gradient_to_bound": gradient_to_bound(model, opt, loss, train) if cfg["ratios"] else None,
        "accuracy": accuracy(model if ema is None else ema.model, test),
        "epsilon": engine.get_epsilon(delta),
        "sigma": engine.config["noise_multiplier"],
        "time_s": time.perf_counter() - start,
        "model": model if ema is None else ema.model,  # for benchmarks/clipping_bias.py
    }


def gradient_to_bound(
    model: torch.nn.Module,
    opt: Any,
    loss: torch.nn.Module,
    train: TensorDataset,
    samples: int = 256,
) -> dict[str, float]:
    """Mean over training samples of one sample's (scaled) gradient norm / its certified bound.

    Per parameter, at the final weights: 1 means every sample uses its whole sensitivity (the
    noise is as small as it can be relative to the signal); the Clipless paper's gradient-to-noise
    argument. :func:`clipless.diagnostics.sensitivity_use` on 256 training samples (the same
    samples and values as the one-backward-per-sample loop it replaced, to 1e-8, 9x faster).
    ``model`` and ``loss`` are those ``opt`` was made private with.
    """
    x, y = train.tensors
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(y), generator=g)[:samples]
    report = sensitivity_use(opt, x[idx], y[idx])
    return {name: use.ratio for name, use in report.tensors.items()}


def plain_mlp(hidden: tuple[int, ...], train: TensorDataset) -> torch.nn.Module:
    x, y = train.tensors
    layers: list[torch.nn.Module] = [torch.nn.Flatten()]
    width = math.prod(x.shape[1:])
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, int(y.max()) + 1))
    return torch.nn.Sequential(*layers)


def opacus_private(
    cfg: dict[str, Any],
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    train: TensorDataset,
    epsilon: float,
    delta: float,
) -> tuple[Any, Any, Any, Any, Any]:
    """Opacus 1.6 ``make_private_with_epsilon`` (PRV accountant, Poisson sampling, flat clipping
    at ``cfg["max_grad_norm"]``): ``(engine, model, optimizer, loader, criterion)``.

    ``cfg["grad_sample_mode"]``: ``"hooks"`` (per-sample gradients materialised) or ``"ghost"``
    (Opacus's ghost clipping: the per-sample norms from the activations and output gradients, then
    a second backward of the reweighted loss; the same clipped sum, 10x faster on the wide linear
    model of the scattering features). ``criterion`` is the loss to call in either mode.
    """
    from opacus import PrivacyEngine

    engine = PrivacyEngine(accountant="prv")
    mode = cfg.get("grad_sample_mode", "hooks")
    if mode not in ("hooks", "ghost"):
        raise SystemExit(f"grad_sample_mode must be 'hooks' or 'ghost'; got {mode!r}")
    criterion = torch.nn.CrossEntropyLoss()
    kwargs: dict[str, Any] = (
        {"criterion": criterion, "grad_sample_mode": "ghost"} if mode == "ghost" else {}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = engine.make_private_with_epsilon(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(train, batch_size=cfg["batch"]),
            target_epsilon=epsilon,
            target_delta=delta,
            epochs=cfg["epochs"],
            max_grad_norm=cfg["max_grad_norm"],
            poisson_sampling=True,
            **kwargs,
        )
    if mode == "ghost":
        model, opt, criterion, loader = made
    else:
        model, opt, loader = made
    return engine, model, opt, loader, criterion


def run_opacus(
    cfg: dict[str, Any], seed: int, train: TensorDataset, test: TensorDataset
) -> dict[str, Any]:
    torch.manual_seed(seed)
    n = len(train)
    device = torch.device(cfg["device"])
    _full_float32(device)
    model = plain_mlp(tuple(cfg["hidden"]), train).to(device)
    mu, whiten = released_input({**cfg, "_seed": seed}, train.tensors[0])
    if whiten is not None:  # clipless's InputNorm map, at each sample's own scale
        if cfg["augment"] is not None:
            raise SystemExit("whiten with augment is not offered for opacus")
        train, test = _whitened(train, mu, whiten), _whitened(test, mu, whiten)
        mu = None
    elif mu is not None:
        test = _centred(test, mu)
    views = cfg["augment"] is not None
    if views:  # [B, K, ...] -> [B, K, features]: the layers act on the last axis
        model[0] = torch.nn.Flatten(start_dim=2)  # type: ignore[operator]
        train = flip_views(cfg, train)
    if mu is not None:
        train = _centred(train, mu)
    epsilon, delta = privacy(cfg, n)
    if cfg["optimizer"] == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    else:
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    engine, model, opt, loader, ce = opacus_private(cfg, model, opt, train, epsilon, delta)
    start = time.perf_counter()
    for _ in range(cfg["epochs"]):
        for x, y in loader:
            if len(y) == 0:
                continue
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            if views:  # the per-sample loss is the mean over the sample's K rows
                out = model(x)
                k = out.shape[1]
                flat = out.reshape(-1, out.shape[-1])
                kw = {"shape": tuple(out.shape)} if cfg["grad_sample_mode"] == "ghost" else {}
                ce(flat, y.repeat_interleave(k), **kw).backward()
            else:
                ce(model(x), y).backward()
            opt.step()
    if views:
        model = torch.nn.Sequential(_Unsqueeze(), model, torch.nn.Flatten())
    return {
        "accuracy": accuracy(model, test),
        "epsilon": engine.get_epsilon(delta),
        "sigma": opt.noise_multiplier,
        "time_s": time.perf_counter() - start,
        "model": model,  # Opacus's GradSampleModule (for benchmarks/robust_twins.py)
    }


class _Unsqueeze(torch.nn.Module):
    """``[B, ...] -> [B, 1, ...]``: one view per test sample for a model trained on views."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1)


def _centred(data: TensorDataset, mu: torch.Tensor) -> TensorDataset:
    """``x - ||x|| mu`` for every sample, or every view of ``[n, K, *mu.shape]`` (Opacus's twin of
    the centred ``InputNorm``)."""
    x, y = data.tensors
    lead = x.ndim - mu.ndim
    norms = x.flatten(lead).norm(dim=-1).reshape(*x.shape[:lead], *([1] * mu.ndim))
    return TensorDataset(x - norms * mu, y)


def run_nonprivate(
    cfg: dict[str, Any], seed: int, train: TensorDataset, test: TensorDataset
) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = plain_mlp(tuple(cfg["hidden"]), train)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ce = torch.nn.CrossEntropyLoss()
    loader = DataLoader(train, batch_size=256, shuffle=True)
    for _ in range(cfg["epochs"]):
        for x, y in loader:
            opt.zero_grad()
            ce(model(x), y).backward()
            opt.step()
    return {"accuracy": accuracy(model, test), "epsilon": float("inf")}


def run_logreg(
    cfg: dict[str, Any], seed: int, train: TensorDataset, test: TensorDataset
) -> dict[str, Any]:
    """The non-private linear ceiling: multinomial logistic regression (weights and bias; no
    regularisation unless ``cfg["l2"]`` weighs a penalty ``||W||^2``) trained to convergence by
    full-batch L-BFGS (strong Wolfe line search)."""
    torch.manual_seed(seed)
    l2 = float(cfg.get("l2", 0.0))
    x, y = train.tensors
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(x[0].numel(), int(y.max()) + 1))
    opt = torch.optim.LBFGS(
        model.parameters(),
        max_iter=500,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = torch.nn.functional.cross_entropy(model(x), y) + l2 * (model[1].weight ** 2).sum()
        value.backward()
        return value

    for _ in range(5):
        opt.step(closure)  # type: ignore[no-untyped-call]
    return {"accuracy": accuracy(model, test), "epsilon": float("inf")}


RUNNERS = {
    "clipless": run_clipless,
    "opacus": run_opacus,
    "nonprivate": run_nonprivate,
    "logreg": run_logreg,
}


def _whitened(data: TensorDataset, mu: torch.Tensor | None, whiten: torch.Tensor) -> TensorDataset:
    """``||x|| W (x / ||x|| - mu)`` for every sample (Opacus's twin of the whitened InputNorm)."""
    x, y = data.tensors
    norms = x.flatten(1).norm(dim=1).reshape(-1, *([1] * (x.ndim - 1)))
    u = x / norms.clamp_min(1e-30)
    if mu is not None:
        u = u - mu
    return TensorDataset(norms * mix_channels(u, whiten), y)


def parse_value(text: str) -> Any:
    if text in ("None", "none"):
        return None
    if text in ("True", "False"):
        return text == "True"
    if "," in text or text == "()":
        return tuple(int(v) for v in text.strip("()").split(",") if v)
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def run_setting(
    method: str,
    overrides: dict[str, Any],
    seeds: list[int],
    data: tuple[TensorDataset, TensorDataset],
) -> dict[str, Any]:
    base = OPACUS_DEFAULTS if method in ("opacus", "nonprivate", "logreg") else CLIPLESS_DEFAULTS
    unknown = set(overrides) - set(base)
    if unknown:
        raise SystemExit(
            f"--set: unknown key(s) {sorted(unknown)} for {method}; known: {sorted(base)}"
        )
    cfg = {**base, **overrides}
    runs = [RUNNERS[method](cfg, s, *data) for s in seeds]
    accs = [r["accuracy"] for r in runs]
    return {
        "method": method,
        "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()},
        "seeds": seeds,
        "accuracies": accs,
        "median": statistics.median(accs),
        "epsilon": runs[0]["epsilon"],
        "time_s": statistics.median(r.get("time_s", 0.0) for r in runs),
        "gradient_to_bound": runs[0].get("gradient_to_bound"),
    }


def check_views(
    samples: int = 16, features: int = 12, classes: int = 3, clip: float = 0.05
) -> None:
    """Opacus's update on ``[batch, 2, features]`` inputs (the ``augment=flip`` path) against a
    reference: each sample's gradient of the mean loss over its two rows, clipped at ``clip``,
    summed and divided by the batch size (noise 0, one SGD step at lr 1), in both ``hooks`` and
    ``ghost`` modes. Prints the largest absolute difference of the updated weights."""
    from opacus import PrivacyEngine

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 2, features, generator=gen)
    y = torch.randint(0, classes, (samples,), generator=gen)

    def fresh() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Sequential(
            torch.nn.Flatten(start_dim=2), torch.nn.Linear(features, classes)
        )

    ref = fresh()
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for i in range(samples):
        ref.zero_grad()
        torch.nn.functional.cross_entropy(
            ref(x[i : i + 1]).flatten(0, 1), y[i].repeat(2)
        ).backward()
        grads = [p.grad.clone() for p in ref.parameters() if p.grad is not None]
        factor = min(1.0, clip / (float(torch.cat([g.flatten() for g in grads]).norm()) + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads, strict=True)]
    for mode in ("hooks", "ghost"):
        model = fresh()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        kwargs: dict[str, Any] = (
            {"criterion": torch.nn.CrossEntropyLoss(), "grad_sample_mode": "ghost"}
            if mode == "ghost"
            else {}
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            made = PrivacyEngine(accountant="prv").make_private(
                module=model,
                optimizer=opt,
                data_loader=DataLoader(TensorDataset(x, y), batch_size=samples),
                noise_multiplier=0.0,
                max_grad_norm=clip,
                poisson_sampling=False,
                **kwargs,
            )
            if mode == "ghost":
                model, opt, ce, _ = made
            else:
                model, opt, _ = made
                ce = torch.nn.CrossEntropyLoss()
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            out = model(x)
            kw = {"shape": tuple(out.shape)} if mode == "ghost" else {}
            ce(out.flatten(0, 1), y.repeat_interleave(2), **kw).backward()
            opt.step()
        diff = max(
            float((b - p.detach() - t / samples).abs().max())
            for b, p, t in zip(before, model.parameters(), total, strict=True)
        )
        print(f"{mode}: largest difference from the reference update {diff:.2g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check-views",
        action="store_true",
        help="only compare Opacus's update on two-view inputs with a per-sample reference",
    )
    parser.add_argument("--method", choices=sorted(RUNNERS), default="clipless")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.check_views:
        check_views()
        return
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = parse_value(value)
    data = load(
        overrides.get("dataset", "adult"),
        overrides.get("features", "none"),
        overrides.get("preprocessing"),
    )
    result = run_setting(args.method, overrides, args.seeds, data)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
