"""Robustness of clipless models and their Opacus-trained twins at the same epsilon.

For each seed, a clipless model and an Opacus DP-SGD model are trained on the same data at the
same (epsilon, delta), each library with its own accountant and Poisson sampling, and on the test
set each is given:

* its clean accuracy (the whole test set);
* the certified robust accuracy at each L2 radius (clipless only, whole test set:
  :func:`clipless.robustness.certified_accuracy`, a lower bound on the true robust accuracy; an
  Opacus model has no certified constant);
* the empirical robust accuracy under the same PGD attack (both, the first ``--pgd-samples`` test
  samples: :func:`clipless.robustness.empirical_accuracy`, L2, 40 steps, 3 restarts; an upper
  bound). The clipless model's certified accuracy on those same samples is printed beside it.

Pairs (``--pair``), each side in the setting its own harness chose (no new tuning):

* ``adult linear``: the CLI's Adult setting (linear, ``public-bins-fine`` features, Adam,
  temperature 0.1, loss-gradient clip 0.3, EMA 0.9, batch n/16) against Opacus's chosen linear
  trial (SGD lr 2, clip 1, batch 1024, 30 epochs): :mod:`benchmarks.adult`, RESULTS.md 24a.
* ``adult mlp``: :mod:`benchmarks.adult`'s default MLPs (one hidden layer of 64; clipless
  orthogonal, GroupSort, SGD 0.02, batch 128; Opacus ReLU, SGD lr 2, clip 1, batch 1024), the
  loader's default 104 features, 30 epochs.
* ``fashion-mnist gnp``: ``clipless train --model gnp --hidden 4,16`` on raw pixels (the CLI's
  defaults: ``InputNorm`` radius 7, Adam 0.01, temperature 0.1, EMA 0.9, batch 2048) against the
  plain twin of the same architecture (:func:`clipless.nn.vanilla_export`: the same ball
  projection, GroupSort and 2x2 stride-2 convolutions without the constraint) trained by
  :func:`benchmarks.fashion_mnist.train_opacus` (ghost clipping, SGD lr 4, clip 1, logits / T with
  T = 1/8, batch 2048), the same number of epochs (default 5).
* ``mnist-10k gnp``: the same pair on MNIST's 10k subset (the registry's stratified 80/20 split:
  8,000 train, 2,000 test images), each side at the CLI's defaults for that dataset (``InputNorm``
  radius 7, expected batch 500 = n / 16), default 15 epochs. Its test set is ordered by digit
  (the first 1,000 images are digits 0-4 only), so attack all of it: ``--pgd-samples 2000``.
* ``fashion-mnist tb``: ``clipless train --model gnp --hidden 4,16 --lr 0.005`` (RESULTS.md 46d's
  best raw-pixel model, ``--epochs``, default 5) against Opacus DP-SGD with the Tramèr-Boneh
  end-to-end CNN at the paper's Fashion-MNIST setting (:mod:`benchmarks.tramer_boneh`: tanh CNN
  of 26,010 parameters on pixels in [0, 1], SGD lr 4, momentum 0.9, clip 0.1, batch 2048,
  ``--tb-epochs``, default 40), its noise from Opacus's PRV accountant at the same epsilon.

The image pairs read train and test sets through :func:`clipless.data.load_dataset`, and their
Opacus side uses the CLI's default delta 1e-5; the ``gnp`` twins also take its batch
:func:`clipless.spec.default_batch_size` and its ``InputNorm`` radius
:func:`clipless.spec.default_input_norm`, as ``clipless train`` does.

Radii are in the space the models read: Adult's public per-record transform (a changed category
moves the input by sqrt(2)), the images' pixels in [0, 1]. Opacus is optional: without it the
script says so and exits.

``--epsilon`` takes one target or a comma-separated list; both sides train at each, and with
``--out FILE`` every model's row (its target epsilon, seed, test-set size, clean / certified /
PGD accuracies) is appended to ``FILE`` as one JSON line, the seeds already there skipped on a
rerun: ``benchmarks/plot_robust_epsilon.py`` draws them against epsilon.

Usage (``benchmarks/RESULTS.md`` sections 40, 48, 50, 51, 52 and 53)::

    PYTHONPATH=src python benchmarks/robust_twins.py --dataset adult --pair linear --seeds 0,1,2
    CLIPLESS_DATA=/tmp/i39data/root PYTHONPATH=src python benchmarks/robust_twins.py \\
        --dataset fashion-mnist --pair gnp --seeds 1,2,3 --epochs 5 --pgd-samples 1000
    CLIPLESS_DATA=/tmp/mn PYTHONPATH=src python benchmarks/robust_twins.py \\
        --dataset mnist-10k --pair gnp --seeds 1,2,3 --epochs 15 --pgd-samples 2000
    CLIPLESS_DATA=/tmp/i39data/root PYTHONPATH=src python benchmarks/robust_twins.py \\
        --dataset fashion-mnist --pair gnp --seeds 1,2,3 --epochs 5 --pgd-samples 1000 \\
        --epsilon 1,2,3,8 --out benchmarks/out/robust_twins.jsonl
    CLIPLESS_DATA=/tmp/mn PYTHONPATH=src python benchmarks/robust_twins.py \\
        --dataset mnist-10k --pair gnp --seeds 1,2,3 --epochs 15 --pgd-samples 2000 \\
        --epsilon 1,2,3,8 --out benchmarks/out/robust_twins_mnist.jsonl
    CLIPLESS_DATA=/tmp/i39data/root PYTHONPATH=src python benchmarks/robust_twins.py \\
        --dataset fashion-mnist --pair tb --seeds 1,2,3 --epochs 5 --pgd-samples 1000 \\
        --out benchmarks/out/robust_twins_tb.jsonl
    PYTHONPATH=src python benchmarks/robust_twins.py --dataset adult --pair linear \\
        --seeds 0,1,2 --pgd-samples 16281 --epsilon 0.414,1,2,3,8 \\
        --out benchmarks/out/robust_twins_adult_linear.jsonl

and the last with ``--pair mlp`` into ``robust_twins_adult_mlp.jsonl``. Adult's 0.414 given
explicitly is the harness's default target (delta 1/n at every epsilon), so it trains the same
models as no ``--epsilon``; only with a number is the row drawn on the plot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adult
import fashion_mnist
import robustness
import tramer_boneh

from clipless import models
from clipless.cli import load_trained_model
from clipless.data import load_dataset
from clipless.robustness import certified_accuracy, empirical_accuracy
from clipless.spec import default_batch_size, default_input_norm

RADII = [0.1, 0.25, 0.5, 1.0]

# the chosen settings of benchmarks/adult.py (RESULTS.md 24a for linear; the harness defaults
# for mlp)
ADULT_PAIRS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "linear": (
        adult.LINEAR_SETTING,
        {"preprocessing": "public-bins-fine", "hidden": ()},
    ),
    "mlp": ({"ratios": False}, {}),
}
# Opacus's twin of the GNP ConvNet (fashion_mnist.OPACUS_GRID's lr 4 / T 1/8, at the CLI's batch)
OPACUS_GNP = {"lr": 4.0, "max_grad_norm": 1.0, "temperature": 1 / 8}
GNP_WIDTHS = (4, 16)
DELTA = 1e-5  # the CLI's default delta
IMAGE_EPOCHS = {"fashion-mnist": 5, "mnist-10k": 15}  # --epochs' default per image dataset


PAIRS = {"adult": ("linear", "mlp"), "fashion-mnist": ("gnp", "tb"), "mnist-10k": ("gnp",)}
TB_CLIPLESS_LR = 0.005  # the best raw-pixel GNP ConvNet of RESULTS.md 46d


def _require_opacus() -> None:
    if importlib.util.find_spec("opacus") is None:
        raise SystemExit(
            "robust_twins.py needs Opacus for the twins (pip install 'opacus>=1.6'); it is not "
            "installed in this environment"
        )


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside Opacus's ``GradSampleModule``, its per-sample hooks removed (the
    attack's backward passes would otherwise feed them); a clipless model as it is."""
    to_standard = getattr(model, "to_standard_module", None)
    return model if to_standard is None else to_standard()


def _measure(
    model: torch.nn.Module,
    test: TensorDataset,
    radii: list[float],
    samples: int,
    certify: bool,
) -> dict[str, Any]:
    """Clean accuracy, certified accuracy (all samples, and the attacked ones) and PGD accuracy."""
    model = model.double().eval()
    x, y = test.tensors[0].double(), test.tensors[1]
    xs, ys = x[:samples], y[:samples]
    row: dict[str, Any] = {
        "test_samples": len(y),
        "clean": empirical_accuracy(model, x, y, [0.0])[0],
    }
    if certify:
        row["certified"] = list(certified_accuracy(model, x, y, radii).certified)
        row["certified_attacked"] = list(certified_accuracy(model, xs, ys, radii).certified)
    row["pgd"] = list(empirical_accuracy(model, xs, ys, radii))
    return row


def _adult(pair: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    ours, theirs = ADULT_PAIRS[pair]
    data = adult.load("adult", "none", ours.get("preprocessing"))
    rows = []
    for side, runner, base, overrides in (
        ("clipless", adult.run_clipless, adult.CLIPLESS_DEFAULTS, ours),
        ("opacus", adult.run_opacus, adult.OPACUS_DEFAULTS, theirs),
    ):
        cfg = {**base, **overrides, "epsilon": args.epsilon}
        if args.epochs is not None:
            cfg["epochs"] = args.epochs
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = runner(cfg, seed, *data)
        model = _plain(result["model"])
        row = _measure(model, data[1], args.radii, args.pgd_samples, side == "clipless")
        rows.append({"side": side, "seed": seed, "epsilon": result["epsilon"], **row})
        rows[-1]["time_s"] = time.perf_counter() - start
    return rows


def _clipless_gnp(
    dataset: str, seed: int, args: argparse.Namespace, epochs: int, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``clipless train --model gnp --hidden 4,16`` (plus the CLI options ``extra``) on
    ``dataset``, measured with its certificate."""
    _, test, _ = load_dataset(dataset, download=False)
    start = time.perf_counter()
    robustness.HIDDEN["gnp"] = ",".join(str(w) for w in GNP_WIDTHS)
    with tempfile.TemporaryDirectory() as tmp:
        robustness._train(Path(tmp), dataset, "gnp", args.epsilon, seed, epochs, extra)
        spent = json.loads((Path(tmp) / "metrics.json").read_text())["epsilon"]
        model = load_trained_model(Path(tmp) / "model.pt")
    row = _measure(model, test, args.radii, args.pgd_samples, certify=True)
    return {"side": "clipless", "seed": seed, "epsilon": spent, **row} | {
        "time_s": time.perf_counter() - start
    }


def _image_gnp(dataset: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``clipless train --model gnp --hidden 4,16`` against its plain Opacus twin on ``dataset``
    (the registry's train / test split), both at the CLI's defaults for that dataset."""
    epochs = args.epochs or IMAGE_EPOCHS[dataset]
    rows = [_clipless_gnp(dataset, seed, args, epochs)]
    train, test, info = load_dataset(dataset, download=False)
    start = time.perf_counter()
    torch.manual_seed(seed)
    radius = default_input_norm(dataset, info.input_shape)
    initial = models.gnp_convnet(info.input_shape, GNP_WIDTHS, info.num_classes, input_norm=radius)
    batch = default_batch_size(len(train))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin, info_opacus = fashion_mnist.train_opacus(
            "gnp", train, args.epsilon, DELTA, epochs, batch, seed, initial=initial, **OPACUS_GNP
        )
    twin = _plain(twin)
    row = _measure(twin, test, args.radii, args.pgd_samples, certify=False)
    rows.append({"side": "opacus", "seed": seed, "epsilon": info_opacus["epsilon_spent"], **row})
    rows[-1]["time_s"] = time.perf_counter() - start
    return rows


def _image_tb(dataset: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``clipless train --model gnp --hidden 4,16 --lr 0.005`` (RESULTS.md 46d) against Opacus
    DP-SGD with the Tramèr-Boneh CNN at the paper's setting (:mod:`benchmarks.tramer_boneh`)."""
    epochs = args.epochs or IMAGE_EPOCHS[dataset]
    rows = [_clipless_gnp(dataset, seed, args, epochs, ("--lr", str(TB_CLIPLESS_LR)))]
    rows[-1]["lr"] = TB_CLIPLESS_LR
    train, test, _ = load_dataset(dataset, download=False)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = tramer_boneh.train_tb(train, args.epsilon, DELTA, seed, epochs=args.tb_epochs)
    row = _measure(model, test, args.radii, args.pgd_samples, certify=False)
    rows.append({"side": "opacus", "seed": seed, "model": "tramer-boneh-cnn", **info, **row})
    rows[-1]["time_s"] = time.perf_counter() - start
    return rows


def _cell(group: list[dict[str, Any]], key: str, i: int) -> str:
    if key not in group[0]:
        return "—"
    return f"{100 * statistics.median(g[key][i] for g in group):.1f}%"


def _table(rows: list[dict[str, Any]], radii: list[float]) -> str:
    """Medians over the seeds: certified (all) / certified (attacked) / PGD per radius."""
    head = "| side | epsilon | clean | " + " | ".join(
        f"r = {r:g}: certified / certified (attacked) / PGD" for r in radii
    )
    lines = [head + " |", "|---" * (3 + len(radii)) + "|"]
    for side in ("clipless", "opacus"):
        group = [row for row in rows if row["side"] == side]
        if not group:
            continue
        cells = [
            " / ".join(_cell(group, key, i) for key in ("certified", "certified_attacked", "pgd"))
            for i in range(len(radii))
        ]
        eps = statistics.median(g["epsilon"] for g in group)
        clean = 100 * statistics.median(g["clean"] for g in group)
        lines.append(f"| {side} | {eps:.3f} | {clean:.2f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _epsilons(text: str | None, dataset: str) -> list[float | None]:
    """``--epsilon``: one positive number or a comma-separated list of them; unset, the
    dataset's default (Adult: ``None``, the harness's 0.414 at delta 1/n; the images: 3)."""
    if text is None:
        return [None] if dataset == "adult" else [3.0]
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise SystemExit(
            "--epsilon must be a positive number or a comma-separated list of them "
            f"(e.g. 1,2,3,8); got {text!r}"
        )
    return list(values)


def _done(path: Path | None, key: dict[str, Any]) -> set[int]:
    """Seeds whose two sides ``path`` already holds for this setting (a rerun skips them)."""
    if path is None or not path.is_file():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sides: dict[int, set[str]] = {}
    for row in rows:
        if all(row.get(k) == v for k, v in key.items()):
            sides.setdefault(row["seed"], set()).add(row["side"])
    return {seed for seed, got in sides.items() if got >= {"clipless", "opacus"}}


def _run(args: argparse.Namespace, epsilon: float | None) -> list[dict[str, Any]]:
    """Both sides for each seed at one target epsilon, appended to ``--out`` as they finish."""
    key = {
        "dataset": args.dataset,
        "pair": args.pair,
        "target_epsilon": epsilon,
        "epochs": args.epochs,
        "pgd_samples": args.pgd_samples,
        "radii": args.radii,
    }
    if args.pair == "tb":
        key["tb_epochs"] = args.tb_epochs
    done = _done(args.out, key)
    args.epsilon = epsilon
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        if seed in done:
            print(f"epsilon {epsilon}, seed {seed}: already in {args.out}", flush=True)
            continue
        if args.dataset == "adult":
            new = _adult(args.pair, seed, args)
        elif args.pair == "tb":
            new = _image_tb(args.dataset, seed, args)
        else:
            new = _image_gnp(args.dataset, seed, args)
        for row in new:
            row = {**key, **row}
            print(json.dumps(row), flush=True)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with args.out.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=tuple(PAIRS), default="adult")
    parser.add_argument(
        "--pair", default=None, help="adult: linear | mlp; fashion-mnist: gnp | tb; mnist-10k: gnp"
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=None, help="default: each harness's")
    parser.add_argument(
        "--epsilon",
        default=None,
        help="target epsilon, or a comma-separated list (both sides train at each); "
        "default: adult 0.414 (delta 1/n), else 3",
    )
    parser.add_argument(
        "--tb-epochs",
        type=int,
        default=tramer_boneh.TB_SETTING["epochs"],
        help="--pair tb: the Tramèr-Boneh CNN's epochs (default: the paper's 40)",
    )
    parser.add_argument("--pgd-samples", type=int, default=1000)
    parser.add_argument("--radii", default=None, help="comma-separated L2 radii")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="append one JSON line per model to this file (the seeds it holds are skipped); "
        "benchmarks/plot_robust_epsilon.py reads it",
    )
    args = parser.parse_args()
    pairs = PAIRS[args.dataset]
    args.pair = args.pair or pairs[0]
    if args.pair not in pairs:
        raise SystemExit(f"--pair must be one of {pairs} for {args.dataset}; got {args.pair!r}")
    args.radii = [float(r) for r in args.radii.split(",")] if args.radii else RADII
    epsilons = _epsilons(args.epsilon, args.dataset)
    _require_opacus()
    torch.set_num_threads(1)
    for epsilon in epsilons:
        rows = _run(args, epsilon)
        if rows:
            print(_table(rows, args.radii))


if __name__ == "__main__":
    main()
