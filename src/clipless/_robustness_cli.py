"""Certified robustness in the command line (private): ``clipless evaluate RUN_DIR`` and the
``robustness`` entry that ``clipless train`` adds to ``metrics.json``.

Kept out of :mod:`clipless.cli` so that the two evolve separately; imports torch lazily (``clipless
--help`` stays fast). The certificate itself is :mod:`clipless.robustness`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clipless import _argtypes

DEFAULT_RADII = (0.1, 0.25, 0.5, 1.0)
"""L2 radii at which ``clipless train`` and ``clipless evaluate`` report certified accuracy."""

ROBUSTNESS_PLOT = "robustness.png"


def _radii(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers >= 0, e.g. 0.1,0.5; got {text!r}"
        ) from None
    if not values or any(not (math.isfinite(v) and v >= 0) for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated finite numbers >= 0, e.g. 0.1,0.5; got {text!r}"
        )
    return values


def add_evaluate_parser(sub: Any) -> None:
    """Register ``clipless evaluate`` on the sub-command parser ``sub``."""
    p = sub.add_parser(
        "evaluate",
        help="accuracy and certified robust accuracy of a run saved by `clipless train`",
        description=(
            "Reload RUN_DIR/model.pt and the run's test set, and print the test accuracy and the "
            "certified robust accuracy: the fraction of test samples classified correctly with a "
            "certified radius above each --radii value (clipless.robustness: margin / (sqrt(2) "
            "K) with K the model's certified Lipschitz constant, through its InputNorm map). "
            "Radii are in the space the model takes: the raw inputs, or the features of a run "
            "with --features (a scattering front-end is not Lipschitz and is not certified)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by `clipless train`")
    p.add_argument(
        "--radii",
        type=_radii,
        default=DEFAULT_RADII,
        help="comma-separated radii (in --norm) at which to report certified accuracy",
    )
    p.add_argument("--norm", choices=("l2", "linf"), default="l2", help="perturbation norm")
    p.add_argument(
        "--data-root",
        default=None,
        help="dataset cache folder (default: $CLIPLESS_DATA, else ~/.cache/clipless)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--device",
        type=_argtypes.device,
        default="cpu",
        help=f"where the model is evaluated: {_argtypes.DEVICES}",
    )
    p.set_defaults(func=run_evaluate)


def _model_and_front(model_path: Path) -> tuple[Any, Any]:
    """``(model, front-end or None)`` of a saved run (the model takes the front-end's output)."""
    import torch

    from clipless.model_file import load_trained_model

    loaded = load_trained_model(model_path)
    if isinstance(loaded, torch.nn.Sequential) and len(loaded) == 2:
        from clipless.features import Scattering2d

        if isinstance(loaded[0], Scattering2d):
            return loaded[1], loaded[0]
    return loaded, None


def _test_set(config: dict[str, Any], data_root: str | None) -> Any:
    from clipless.data import load_dataset

    name = str(config.get("dataset"))
    if name == "adult":
        from clipless.data import data_root as root
        from clipless.data.tabular import load_adult

        _, test, _ = load_adult(root(data_root), True, str(config.get("preprocessing")))
        return test
    _, test, _ = load_dataset(name, data_root)
    return test


def robustness_metrics(
    model: Any,
    x: Any,
    y: Any,
    radii: Sequence[float] = DEFAULT_RADII,
    *,
    space: str = "input",
    norm: str = "l2",
    plot: Path | None = None,
) -> dict[str, Any]:
    """:func:`clipless.robustness.certified_accuracy` as a JSON-ready dict (``metrics.json``'s
    ``robustness``), with the certified Lipschitz constants; ``plot`` writes the certified accuracy
    against the radius there (PNG)."""
    from clipless.robustness import certified_accuracy, certify

    cert = certify(model, x)
    result = certified_accuracy(model, x, y, radii, norm=norm, space=space).to_dict()
    lip = cert.lipschitz
    result["lipschitz"] = {
        "after_input_map": lip.body,
        "input_map": lip.input_map,
        "total": lip.total if math.isfinite(lip.total) else None,
    }
    if plot is not None:
        _plot(cert, y, norm, space, plot)
    return result


def _plot(cert: Any, y: Any, norm: str, space: str, path: Path) -> None:
    import torch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from clipless._io import atomic_write_with

    radii = cert.radii if norm == "l2" else cert.linf_radii()
    correct = cert.predictions == y.reshape(-1).to(torch.int64)
    r = torch.where(correct, radii, torch.zeros_like(radii))
    finite = r[torch.isfinite(r)]
    top = float(finite.max()) if len(finite) and float(finite.max()) > 0 else 1.0
    grid = torch.linspace(0.0, 1.05 * top, 200, dtype=torch.float64)
    curve = [(r > g).double().mean().item() for g in grid]
    fig = Figure(figsize=(4.8, 3.6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(grid.tolist(), curve)
    ax.set_xlabel(f"{'L2' if norm == 'l2' else 'L-infinity'} radius ({space} space)")
    ax.set_ylabel("certified robust accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write_with(path, lambda handle: fig.savefig(handle, format="png"), mode=0o600)


def train_robustness(
    out: Path, test_x: Any, test_y: Any, features: str, quiet: bool
) -> dict[str, Any]:
    """After ``clipless train``: certify ``out/model.pt`` on the test set (``test_x`` as the model
    takes it: raw inputs, or the features *before* any premapping), add ``robustness`` to
    ``out/metrics.json``, write ``out/robustness.png``, print one line and return the entry."""
    from clipless.training import write_metrics

    model, _ = _model_and_front(out / "model.pt")
    space = "input" if features == "none" else "features"
    result = robustness_metrics(
        model, test_x, test_y, DEFAULT_RADII, space=space, plot=out / ROBUSTNESS_PLOT
    )
    path = out / "metrics.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["robustness"] = result
    write_metrics(data, path)
    if not quiet:
        print(_summary(result), flush=True)
    return result


def _summary(result: dict[str, Any]) -> str:
    norm = "L2" if result["norm"] == "l2" else "L-inf"
    pairs = "  ".join(f"r={r}: {100 * a:.2f}%" for r, a in result["certified_accuracy"].items())
    return (
        f"certified robust accuracy ({norm}, {result['space']} space): {pairs}  "
        f"(median certified radius {result['median_certified_radius']:.4g})"
    )


def run_evaluate(args: argparse.Namespace) -> int:
    """``clipless evaluate RUN_DIR``."""
    out = Path(args.run_dir)
    model_path = out / "model.pt"
    if not model_path.is_file():
        print(
            f"clipless evaluate: error: argument RUN_DIR: {out} has no model.pt (a folder "
            "written by a finished `clipless train`)",
            file=sys.stderr,
        )
        return 2
    config = _run_config(out)
    if config is None:
        print(
            f"clipless evaluate: error: argument RUN_DIR: {out} has no readable config.json "
            "naming its dataset",
            file=sys.stderr,
        )
        return 2
    from clipless import _devices
    from clipless.data import DatasetNotFoundError
    from clipless.spec import OptionError

    try:
        device = _devices.resolve_device(args.device)
    except OptionError as exc:
        print(f"clipless evaluate: error: {exc}", file=sys.stderr)
        return 2
    model, front = _model_and_front(model_path)
    model = model.to(device)
    try:
        test = _test_set(config, args.data_root)
    except (DatasetNotFoundError, ValueError, KeyError) as exc:
        print(f"clipless evaluate: error: cannot load the run's test set: {exc}", file=sys.stderr)
        return 1
    x, y = test.tensors[0], test.tensors[1]
    if front is not None:  # through train's cache (DATA_ROOT/features): computed at most once
        from clipless.data import data_root
        from clipless.features import cached_features

        x = cached_features(front, test, data_root(args.data_root) / "features")[0].tensors[0]
    space = "input" if front is None else "features"
    result = robustness_metrics(model, x, y, args.radii, space=space, norm=args.norm)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{out}: test accuracy {100 * result['accuracy']:.2f}% (n={result['num_samples']})")
        print(_summary(result))
    return 0


def _run_config(out: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and "dataset" in config else None
