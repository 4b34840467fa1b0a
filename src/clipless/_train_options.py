"""The options of ``clipless train``, each defined once: its flag, its parser (type, choices,
default, help), whether it defines the run (kept by ``--resume``) and the value a run saved before
it existed was trained with. :mod:`clipless.cli` builds the parser from :data:`TRAIN_OPTIONS`;
:mod:`clipless.spec` reads the same table for the run configuration."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from clipless import _argtypes
from clipless._argtypes import DEVICES, number, parsed

__all__ = ["ALLOCATIONS", "DATASETS", "NO_LEGACY", "TRAIN_OPTIONS", "TrainOption", "option"]

DEFAULT_HIDDEN: dict[str, tuple[int, ...]] = {
    "linear": (),
    "mlp": (16, 16),
    "cnn": (16, 32),
    "resnet": (16, 32),
    "gnp": (4, 16),
}
IMAGE_MODELS = ("cnn", "resnet", "gnp")
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
"""``--lr`` default with a feature front-end: on whitened scattering features of Fashion-MNIST at
epsilon 3 it beat 0.01 (CLI, 5 runs each: 90.5% against 90.0%; ``benchmarks/RESULTS.md`` section
20)."""
LOSS_CLIP = 0.3
"""Default ``--loss-clip`` (Adult's measurements, ``benchmarks/RESULTS.md`` section 8)."""
FEATURES_LOSS_CLIP = 0.1
"""Default ``--loss-clip`` with a feature front-end: on centred scattering features of
Fashion-MNIST 0.1 beat 0.3 at epsilon 3 (89.85% against 89.70%, medians of 3 seeds) and at
epsilon 1 (``benchmarks/RESULTS.md`` sections 14 and 17)."""
FEATURES_INPUT_NORM = 2.0
"""Default ``--input-norm`` with a feature front-end: the sphere radius. With Adam the logits move
``lr * radius`` per step, so radius 2 at lr 0.01 is the measured best radius 1 at lr 0.02 (on
whitened features, radius 2 at the default lr 0.005 is the harness's best radius 1 at lr 0.01)."""
# the largest --epsilon calibrated with the PLD accountant (epsilon 60 took 26 s and 1 GB on
# breast-cancer; 100 did not finish in 40 s): clipless.accounting.PLD_MAX_EPSILON, not imported
# here so that --help stays fast
PLD_MAX_EPSILON = 50.0


# ------------------------------------------------------------------------------ value parsers
_positive_float = parsed(
    float, lambda v: math.isfinite(v) and v > 0, "a number > 0", "a finite number > 0"
)
_nonnegative_float = parsed(
    float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0", "a finite number >= 0"
)
_probability = number("a number in (0, 1)", 0.0, 1.0)
_unit_interval = number("a number in [0, 1)", 0.0, 1.0, open_low=False)
_positive_int = parsed(int, lambda v: v >= 1, "a positive integer")
_nonnegative_int = parsed(int, lambda v: v >= 0, "an integer >= 0")


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


def _bounded(parse: Any, high: float, why: str) -> Any:
    """``parse`` with an upper end ``high`` (named in the error with ``why``)."""

    def check(text: str) -> Any:
        value = parse(text)
        if value > high:
            top = f"{int(high)}" if float(high).is_integer() else f"{high:g}"
            raise argparse.ArgumentTypeError(f"expected at most {top} ({why}), got {text!r}")
        return value

    return check


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


def _checked_by_table(parser: str) -> Callable[[str], str]:
    """An argparse type keeping the text ``clipless.data.table.<parser>`` accepts (its
    ``ValueError`` as the message; the module is imported only when the option is given)."""

    def check(text: str) -> str:
        from clipless.data import table

        try:
            getattr(table, parser)(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


_table_columns = _checked_by_table("parse_columns")
_table_classes = _checked_by_table("parse_classes")


NO_LEGACY: Any = object()
"""The ``legacy`` of an option that every saved run configuration holds."""
DATASETS: Any = object()
"""Placeholder for ``--dataset``'s choices: the registry is read when the parser is built."""
ALLOCATIONS: Any = object()
"""Placeholder for ``--noise``'s choices: the allocations registered when the parser is built."""


def live_choices(choices: Any) -> Any:
    """``choices`` with a registry placeholder (:data:`DATASETS`, :data:`ALLOCATIONS`) replaced
    by the registry's names now, so that what is registered after import is offered."""
    if choices is DATASETS:
        from clipless.data import available_datasets

        return list(available_datasets())
    if choices is ALLOCATIONS:
        from clipless.allocation import allocation_names

        return list(allocation_names())
    return choices


@dataclass(frozen=True)
class TrainOption:
    """One ``clipless train`` option: ``--{dest with dashes}`` in parser group ``group`` ("" the
    command's own, ``"again"`` the --resume / --force pair, ``"table"`` the --data arguments)."""

    dest: str
    group: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    run: bool = False
    legacy: Any = NO_LEGACY

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


def _opt(
    flag: str, group: str, *, run: bool = False, legacy: Any = NO_LEGACY, **kw: Any
) -> TrainOption:
    assert flag.startswith("--")
    return TrainOption(flag[2:].replace("-", "_"), group, kw, run, legacy)


TRAIN_OPTIONS: tuple[TrainOption, ...] = (
    _opt(
        "--dataset",
        "",
        run=True,
        default="breast-cancer",
        choices=DATASETS,
        help="dataset name",
    ),
    _opt(
        "--data",
        "table",
        run=True,
        legacy=None,
        default=None,
        help="your own data instead of --dataset: a CSV or Parquet file (header row; needs "
        "--label, --classes and --columns) or an image folder (one subfolder of same-size images "
        "per class; pixels / 255). 20%% of the records (a fixed public split) are the test set "
        "unless --test-data",
    ),
    _opt(
        "--test-data",
        "table",
        run=True,
        legacy=None,
        default=None,
        help="with --data: a CSV or Parquet file (or an image folder) for the test set",
    ),
    _opt(
        "--label",
        "table",
        run=True,
        legacy=None,
        default=None,
        help="with --data: the label column",
    ),
    _opt(
        "--classes",
        "table",
        run=True,
        legacy=None,
        default=None,
        type=_table_classes,
        help="with --data: the label's values, comma-separated (public: they decide the "
        "outputs); for an image folder, the subfolders to use, in order (default: all)",
    ),
    _opt(
        "--columns",
        "table",
        run=True,
        legacy=None,
        default=None,
        type=_table_columns,
        help="with --data: the features and their public transforms, ';'-separated: NAME=LO..HI "
        "(numeric, scaled onto [-1, 1] and clipped; missing -> 0) or NAME=A|B|C (one-hot; other "
        "values -> zeros). Never fitted on the data; undeclared columns are not used",
    ),
    _opt(
        "--preprocessing",
        "",
        run=True,
        legacy=None,
        choices=("public-ranges", "public-bins", "public-bins-only", "public-bins-fine"),
        default=None,
        help="adult only: its fixed public per-record transform (clipless.data.load_adult): "
        "public-ranges = scaled numeric columns + one-hot categories; public-bins = the same plus "
        "one-hot bins of age, hours and capital at public edges (capital: half-decades); "
        "public-bins-only = without the scaled columns; public-bins-fine = public-bins with the "
        "capital columns on quarter-decades. No statistic of the data, no privacy cost. Default: "
        f"{ADULT_PREPROCESSING} (benchmarks/RESULTS.md sections 16 and 23e)",
    ),
    _opt(
        "--data-root",
        "",
        default=None,
        help="dataset cache (None: $CLIPLESS_DATA or ~/.cache/clipless)",
    ),
    _opt(
        "--out",
        "",
        default="runs/demo",
        help="output folder (the run folder)",
    ),
    _opt(
        "--tensorboard",
        "",
        default=None,
        metavar="DIR",
        help="also write each epoch's train loss and accuracy, test loss and accuracy, epsilon "
        "spent and learning rate, and at the end the certified robust accuracy, as TensorBoard "
        "scalars in DIR (clipless.callbacks.TensorBoardLogger; needs pip install "
        "'clipless[tensorboard]')",
    ),
    _opt(
        "--resume",
        "again",
        action="store_true",
        help="continue the run in --out (its checkpoint, ledger and saved configuration; the "
        "options that define the run may be left out, and must not differ)",
    ),
    _opt(
        "--force",
        "again",
        action="store_true",
        help="start a new run in --out even if it holds one: the old run is moved to "
        "OUT.old-<timestamp> (its ledger is kept, nothing is deleted); refused for a symbolic "
        "link and for the folder the command runs in",
    ),
    _opt(
        "--device",
        "",
        type=_argtypes.device,
        default="cpu",
        help=f"where to train: {DEVICES} (auto: cuda if available, else mps, else cpu)",
    ),
    _opt(
        "--epsilon",
        "privacy",
        run=True,
        type=_positive_float,
        default=1.0,
        help="epsilon budget (at most 50 with --accountant pld, whose calibration beyond it "
        "is intractable)",
    ),
    _opt(
        "--delta",
        "privacy",
        run=True,
        type=_delta,
        default=1e-5,
        help="delta, in (0, 0.1]; a delta above 1/n warns (such a claim protects little)",
    ),
    _opt(
        "--accountant",
        "privacy",
        run=True,
        choices=("pld", "rdp"),
        default="pld",
        help="privacy accountant",
    ),
    _opt(
        "--neighbouring",
        "privacy",
        run=True,
        choices=("add_remove", "replace_one"),
        default="add_remove",
        help="neighbouring relation (replace_one doubles every sensitivity)",
    ),
    _opt(
        "--noise",
        "privacy",
        run=True,
        choices=ALLOCATIONS,
        default="global",
        help="noise allocation across layers (docs/design.md 'Noise strategies')",
    ),
    _opt(
        "--scaling",
        "privacy",
        run=True,
        choices=("per-sample", "bound"),
        default="per-sample",
        help="per-layer gradient scaling: each sample by its own input norm (per-sample), or "
        "every sample by the certified bound (bound: Clipless DP-SGD)",
    ),
    _opt(
        "--constraint",
        "privacy",
        run=True,
        choices=("clip", "fix", "orthogonal", "none"),
        default=None,
        help="weight projection after each step (orthogonal: Bjorck steps then a certified "
        "rescale, gradient-norm preserving; clip: rescale only above --max-norm; fix: always; "
        "none: no projection, the noise follows the certified norms of the current weights, "
        "which are public). Default: orthogonal (as PrivacyEngine.make_private), none for "
        "--model linear (one layer's sensitivity does not depend on its weights)",
    ),
    _opt(
        "--max-norm",
        "privacy",
        run=True,
        type=_positive_float,
        default=1.0,
        help="per-layer Lipschitz bound C (unused with --constraint none, the linear model's "
        "default: another value warns)",
    ),
    _opt(
        "--input-norm",
        "privacy",
        run=True,
        type=_positive_float,
        default=None,
        help="input norm bound X_0 enforced by InputNorm (default: a public bound of the "
        "dataset's fixed transform: sqrt(17) for adult with public-bins(-fine), sqrt(13) with "
        "public-ranges, sqrt(12) with public-bins-only, sqrt(20) for german-credit, "
        "max(1, sqrt(pixels) / 4) for images, sqrt(number of features) otherwise; 2 with a "
        "--features front-end)",
    ),
    _opt(
        "--input-mode",
        "privacy",
        run=True,
        legacy="ball",
        choices=("ball", "sphere"),
        default=None,
        help="how InputNorm enforces X_0: ball = clip each sample's norm to it, sphere = "
        "normalise every sample to it (each sample then uses its whole sensitivity). Default: "
        "sphere with --features, ball otherwise (benchmarks/RESULTS.md)",
    ),
    _opt(
        "--center-noise",
        "privacy",
        run=True,
        legacy=0.0,
        type=_release_noise,
        default=None,
        help="subtract the private mean of the unit-normalised training inputs from every sample "
        "before InputNorm (clipless.features.release_mean: one Gaussian release with this noise "
        "multiplier, composed with the training steps by the accountant, so --epsilon covers "
        "both); 0: no centring, else at least 0.1. Default: 20 with --features (about +0.3 "
        "points on fashion-mnist for a ~0.01 share of epsilon 3, benchmarks/RESULTS.md section "
        "17), else 0",
    ),
    _opt(
        "--whiten-noise",
        "privacy",
        run=True,
        legacy=0.0,
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
    ),
    _opt(
        "--whiten-shrink",
        "privacy",
        run=True,
        legacy=None,
        type=_positive_float,
        default=None,
        help="shrinkage of --whiten-noise: the covariance's eigenvalues are lifted by this many "
        "times their mean before the inverse square root (larger: closer to no whitening). "
        "Default: 1",
    ),
    _opt(
        "--model",
        "model and training",
        run=True,
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
    ),
    _opt(
        "--features",
        "model and training",
        run=True,
        legacy="none",
        choices=("none", "scatter"),
        default=None,
        help="a public feature front-end applied to every image before the model: scatter = "
        "wavelet scattering (J=2, L=8) with per-sample group normalisation (clipless.features, "
        "Tramer and Boneh 2021; computed by kymatio). It uses no data, so it costs no privacy. "
        "Default: scatter for --model linear on images of at least 16x16 pixels (fashion-mnist, "
        "mnist-10k; the most accurate setting measured, benchmarks/RESULTS.md), else none",
    ),
    _opt(
        "--feature-cache",
        "model and training",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the computed features under the dataset cache (DATA_ROOT/features, about "
        "1.1 GB for fashion-mnist's scattering features; as sensitive as the data) and load them "
        "in later runs on the same data, map and library versions instead of recomputing them "
        "(clipless.features.cached_features); the results are the same either way",
    ),
    _opt(
        "--hidden",
        "model and training",
        run=True,
        type=_hidden,
        default=None,
        help="hidden widths (mlp), convolution channels (cnn, gnp) or widths per stage (resnet), "
        "e.g. 64,64; the noise grows with the number of weights: small datasets want small "
        "models (default: 16,16 for mlp, 16,32 for cnn and resnet, 4,16 for gnp)",
    ),
    _opt(
        "--pool",
        "model and training",
        run=True,
        choices=("l2", "avg"),
        default="l2",
        help="cnn pooling and resnet downsampling: L2-norm pooling (Lipschitz 1) or average "
        "pooling (Lipschitz 1/2)",
    ),
    _opt(
        "--epochs",
        "model and training",
        run=True,
        type=_bounded(_positive_int, 100_000, "a run's steps"),
        default=30,
        help="epochs",
    ),
    _opt(
        "--batch-size",
        "model and training",
        run=True,
        type=_positive_int,
        default=None,
        help="expected (Poisson) batch size (default: n/16 clamped to [128, 2048], at most n: "
        "DP-SGD wants large batches; measured in benchmarks/RESULTS.md)",
    ),
    _opt(
        "--lr",
        "model and training",
        run=True,
        type=_bounded(_positive_float, 1e4, "a step beyond float32's range"),
        default=None,
        help=f"learning rate (default: {DEFAULT_LR:g}; {ADULT_LR:g} for adult, the best "
        f"validation trial of benchmarks/RESULTS.md section 16; {FEATURES_LR:g} with --features, "
        "section 20)",
    ),
    _opt(
        "--optimizer",
        "model and training",
        run=True,
        choices=("sgd", "adam"),
        default="adam",
        help="optimizer (Adam is insensitive to the gradients' scale, which the temperature and "
        "--loss-clip change)",
    ),
    _opt(
        "--momentum",
        "model and training",
        run=True,
        type=_unit_interval,
        default=0.9,
        help="SGD momentum in [0, 1) (post-processing of the noisy gradients)",
    ),
    _opt(
        "--bias",
        "model and training",
        run=True,
        action=argparse.BooleanOptionalAction,
        default=None,
        help="biases on the linear layers (default: on for --model linear without a --features "
        "front-end, whose bias shares its weight's sensitivity; off with a front-end and for "
        "mlp and cnn, where each bias is one more noised tensor; the cnn's convolutions stay "
        "bias-free)",
    ),
    _opt(
        "--temperature",
        "model and training",
        run=True,
        type=_temperature,
        default=0.1,
        help="cross-entropy temperature: logits / T (a Lipschitz model's logits are small; "
        "T < 1 sharpens its softmax); in [1e-4, 1e4]",
    ),
    _opt(
        "--loss-clip",
        "model and training",
        run=True,
        legacy=0.0,
        type=_nonnegative_float,
        default=None,
        help="clip each sample's loss gradient (the logits' cotangent) to this norm "
        "(clipless.nn.LossGradientClip after the model, Clipless DP-SGD section 3.1): the "
        "sensitivity of every layer scales with it instead of the loss constant sqrt(2)/T, so "
        "the noise shrinks with it while most samples keep their full signal; 0: no clip. "
        "Default: 0.1 with --features (fashion-mnist, benchmarks/RESULTS.md section 17), else 0.3",
    ),
    _opt(
        "--ema",
        "model and training",
        run=True,
        type=_unit_interval,
        default=0.9,
        help="EMA decay of the weights; the EMA model is evaluated and saved (0: no EMA)",
    ),
    _opt(
        "--seed",
        "model and training",
        run=True,
        type=_bounded(_nonnegative_int, 2**32 - 1, "numpy's seed range"),
        default=0,
        help="seed of the initial weights",
    ),
    _opt(
        "--unsafe-seed",
        "model and training",
        run=True,
        type=_bounded(_nonnegative_int, 2**62, "torch's seed range"),
        default=None,
        help="ALSO seed the batch sampling and the DP noise (reproducible runs for testing; "
        "anyone who knows it can recompute the noise, so the epsilon is no guarantee against "
        "them). Default: both come from the operating system's CSPRNG",
    ),
    _opt(
        "--threads",
        "model and training",
        type=_bounded(_positive_int, 1024, "torch's thread pool"),
        default=1,
        help="torch intra-op threads (small models run fastest on one)",
    ),
    _opt(
        "--certify-every",
        "model and training",
        type=_bounded(_positive_int, 10**6, "steps"),
        default=1,
        metavar="K",
        help="certify each layer's bound exactly every K steps and carry a certified bound "
        "(ub + m ||W - W_ref||_F) between: the same privacy, a cheaper step (on a GPU, no "
        "certificate's products on the carried steps); it pays when a step moves the weights "
        "by well under 1%% of --max-norm (small learning rates): larger steps are certified "
        "exactly anyway",
    ),
    _opt(
        "--nproc",
        "model and training",
        type=_bounded(_positive_int, 256, "local processes"),
        default=1,
        help="data-parallel training in this many local processes (torch.distributed, gloo on "
        "the CPU; the same model and epsilon as one process, docs/distributed.md); under "
        "torchrun leave it at 1: the ranks come from torchrun",
    ),
    _opt(
        "--no-progress",
        "model and training",
        action="store_true",
        help="no progress bar",
    ),
    _opt(
        "--quiet",
        "model and training",
        action="store_true",
        help="no per-epoch lines",
    ),
)
_BY_DEST = {o.dest: o for o in TRAIN_OPTIONS}


def option(dest: str) -> TrainOption:
    """The option stored as ``dest``."""
    return _BY_DEST[dest]
