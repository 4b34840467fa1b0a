"""Clean, certified and empirical (PGD) robust accuracy of models trained by ``clipless train``.

For each model kind, epsilon and seed: ``clipless train`` on the dataset (CPU, ``--unsafe-seed``
for reproducibility), then on the test set

* the certified robust accuracy at each L2 radius (``metrics.json``'s ``robustness``, from
  :mod:`clipless.robustness`: a lower bound on the true robust accuracy), and
* the empirical robust accuracy under :func:`clipless.robustness.pgd_l2` (40 steps, 3 restarts)
  at the same radii (an upper bound on it), on the first ``--pgd-samples`` test samples (all by
  default).

The true robust accuracy lies between the two. Prints a markdown table of medians over the seeds
(``benchmarks/RESULTS.md`` section 35).

Usage::

    PYTHONPATH=src python benchmarks/robustness.py --dataset digits --models linear,mlp,cnn,gnp \\
        --epsilons 3 --seeds 1,2,3 --epochs 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clipless.cli import load_trained_model, main
from clipless.data import load_dataset
from clipless.robustness import pgd_l2

HIDDEN = {"linear": "", "mlp": "64,64", "cnn": "8,16", "gnp": "4,16"}


def _train(
    out: Path,
    dataset: str,
    kind: str,
    epsilon: float,
    seed: int,
    epochs: int,
    extra: Sequence[str] = (),
) -> None:
    """``clipless train`` of ``kind`` into ``out``; ``extra``: more CLI options (e.g. ``--lr``)."""
    argv = ["train", "--dataset", dataset, "--model", kind, "--epsilon", str(epsilon)]
    if HIDDEN[kind]:
        argv += ["--hidden", HIDDEN[kind]]
    argv += list(extra)
    argv += ["--epochs", str(epochs), "--unsafe-seed", str(seed), "--seed", str(seed)]
    argv += ["--features", "none", "--threads", "1", "--quiet", "--no-progress", "--out", str(out)]
    if main(argv) != 0:
        raise SystemExit(f"clipless train failed: {' '.join(argv)}")


def _empirical(run: Path, dataset: str, radii: list[float], samples: int) -> list[float]:
    model = load_trained_model(run / "model.pt").double().eval()
    _, test, _ = load_dataset(dataset)
    x, y = test.tensors[0][:samples].double(), test.tensors[1][:samples]
    with torch.no_grad():
        correct = model(x).argmax(dim=1) == y
    out = []
    for r in radii:
        worst = pgd_l2(model, x, y, r) if r > 0 else torch.ones(len(x), dtype=x.dtype)
        out.append(float((correct & (worst > 0)).double().mean()))
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models:
            for epsilon in args.epsilons:
                for seed in args.seeds:
                    out = Path(tmp) / f"{kind}-{epsilon}-{seed}"
                    start = time.perf_counter()
                    _train(out, args.dataset, kind, epsilon, seed, args.epochs)
                    metrics = json.loads((out / "metrics.json").read_text())
                    rob = metrics["robustness"]
                    rows.append(
                        {
                            "model": kind,
                            "epsilon": epsilon,
                            "seed": seed,
                            "clean": rob["accuracy"],
                            "certified": [rob["certified_accuracy"][f"{r:g}"] for r in args.radii],
                            "median_radius": rob["median_certified_radius"],
                            "pgd": _empirical(out, args.dataset, args.radii, args.pgd_samples),
                            "lipschitz": rob["lipschitz"]["after_input_map"],
                            "time_s": time.perf_counter() - start,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def _table(rows: list[dict[str, Any]], radii: list[float]) -> str:
    head = "| model | epsilon | clean | " + " | ".join(f"certified / PGD at {r:g}" for r in radii)
    lines = [head + " | median certified radius | K |", "|---" * (5 + len(radii)) + "|"]
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["epsilon"]), []).append(row)
    for (kind, epsilon), group in groups.items():
        med = statistics.median
        cells = [
            f"{100 * med(g['certified'][i] for g in group):.1f}% / "
            f"{100 * med(g['pgd'][i] for g in group):.1f}%"
            for i in range(len(radii))
        ]
        lines.append(
            f"| {kind} | {epsilon:g} | {100 * med(g['clean'] for g in group):.1f}% | "
            + " | ".join(cells)
            + f" | {med(g['median_radius'] for g in group):.3f} | "
            f"{med(g['lipschitz'] for g in group):.3f} |"
        )
    return "\n".join(lines)


def main_benchmark() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--models", default="linear,mlp,cnn,gnp")
    parser.add_argument("--epsilons", default="3")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument(
        "--pgd-samples", type=int, default=None, help="attack only the first N test samples"
    )
    args = parser.parse_args()
    args.models = args.models.split(",")
    args.epsilons = [float(e) for e in args.epsilons.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.radii = [0.1, 0.25, 0.5, 1.0]  # clipless train's radii (metrics.json)
    torch.set_num_threads(1)
    rows = run(args)
    print(_table(rows, args.radii))


if __name__ == "__main__":
    main_benchmark()
