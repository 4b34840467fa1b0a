"""Clean, certified and PGD robust accuracy against epsilon: a clipless model and its Opacus twin.

Reads the JSON lines that ``benchmarks/robust_twins.py --out`` appends (one per model: its side,
seed, target epsilon, clean accuracy, certified accuracy on the whole test set per radius, PGD
accuracy on the attacked samples per radius) and draws
``plots/robust_epsilon_<dataset>.png`` (``..._adult-<pair>.png`` for Adult's two pairs): per
side, the median over seeds against epsilon of the clean accuracy, of the clipless certified
accuracy and of both sides' PGD accuracy at each chosen L2 radius, with each seed's value as a
small dot when there is more than one seed. On Adult a grey dashed line marks the majority class's
share of the test set, which a constant classifier scores at every radius.

``RESULTS.md`` section 50, Fashion-MNIST::

    CLIPLESS_DATA=/tmp/i39data/root PYTHONPATH=src python benchmarks/robust_twins.py \\
        --dataset fashion-mnist --pair gnp --seeds 1,2,3 --epochs 5 --pgd-samples 1000 \\
        --epsilon 1,2,3,8 --out benchmarks/out/robust_twins.jsonl
    python benchmarks/plot_robust_epsilon.py --dataset fashion-mnist

Section 51, MNIST (10k subset), where PGD attacks all 2,000 test images::

    CLIPLESS_DATA=/tmp/mn PYTHONPATH=src python benchmarks/robust_twins.py \\
        --dataset mnist-10k --pair gnp --seeds 1,2,3 --epochs 15 --pgd-samples 2000 \\
        --epsilon 1,2,3,8 --out benchmarks/out/robust_twins_mnist.jsonl
    python benchmarks/plot_robust_epsilon.py --dataset mnist-10k \\
        --json benchmarks/out/robust_twins_mnist.jsonl

Section 53, Adult's linear and MLP pairs at its default 0.414 (delta 1/n) and at 1, 2, 3 and 8::

    PYTHONPATH=src python benchmarks/robust_twins.py --dataset adult --pair linear --seeds 0,1,2 \\
        --pgd-samples 16281 --epsilon 0.414,1,2,3,8 \\
        --out benchmarks/out/robust_twins_adult_linear.jsonl
    python benchmarks/plot_robust_epsilon.py --dataset adult --pair linear \\
        --json benchmarks/out/robust_twins_adult_linear.jsonl

and the same with ``--pair mlp`` and ``robust_twins_adult_mlp.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "out" / "robust_twins.jsonl"

# (side, key, label, colour): a solid line for the clean accuracy, dashed for certified, dotted
# for PGD; clipless blue, Opacus orange as in plots/accuracy_epsilon_*.png's first two lines
CURVES = (
    ("clipless", "clean", "clipless clean", "tab:blue", "-"),
    ("opacus", "clean", "Opacus twin clean", "tab:orange", "-"),
    ("clipless", "certified", "clipless certified", "tab:blue", "--"),
    ("clipless", "pgd", "clipless PGD", "tab:blue", ":"),
    ("opacus", "pgd", "Opacus twin PGD", "tab:orange", ":"),
)
MARKERS = ("^", "s", "D", "v")  # per radius; the clean accuracy is "o"


class Setting(NamedTuple):
    """How a dataset is named on its plot."""

    title: str  # the dataset's name in the title
    opacus: str  # the Opacus model's name: a "twin" only where the architecture is the same
    delta: str  # the x label's delta
    unit: str  # what the test set holds, for the title's PGD line
    majority: float | None  # the majority class's share of the test set, drawn when known


# Adult's test set: 12,435 of its 16,281 records earn <= 50K (RESULTS.md section 40)
ADULT_MAJORITY = 12435 / 16281
SETTINGS = {
    "adult": Setting("Adult", "Opacus", "1/n", "records", ADULT_MAJORITY),
    "fashion-mnist": Setting("fashion-mnist", "Opacus twin", "1e-5", "images", None),
    "mnist-10k": Setting("mnist-10k", "Opacus twin", "1e-5", "images", None),
}
PAIR_NAMES = {"linear": "linear", "mlp": "MLP"}  # in the title, after the dataset's name


def load(path: Path, dataset: str, pair: str) -> list[dict[str, Any]]:
    """The rows of ``path`` for ``dataset`` / ``pair`` that have a target epsilon."""
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: run benchmarks/robust_twins.py --out {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        r
        for r in rows
        if r.get("dataset") == dataset
        and r.get("pair") == pair
        and r.get("target_epsilon") is not None
    ]


def series(
    rows: list[dict[str, Any]], side: str, key: str, radius: float | None
) -> dict[float, list[float]]:
    """Per target epsilon, each seed's ``key`` accuracy of ``side`` (at ``radius`` unless clean)."""
    points: dict[float, list[float]] = {}
    for r in rows:
        if r["side"] != side or key not in r:
            continue
        if radius is None:
            value = r[key]
        elif radius in r["radii"]:
            value = r[key][r["radii"].index(radius)]
        else:
            continue
        points.setdefault(float(r["target_epsilon"]), []).append(float(value))
    return points


def _attacked(rows: list[dict[str, Any]], unit: str = "images") -> str:
    """Which test samples PGD attacked, for the title: all of them when ``pgd_samples`` covers
    the test set (rows written before ``test_samples`` existed leave the count open)."""
    attacked = min(int(r["pgd_samples"]) for r in rows)
    tested = {int(r["test_samples"]) for r in rows if "test_samples" in r}
    if len(tested) == 1 and attacked >= min(tested):
        return f"all {min(tested):,} test {unit}"
    return f"the first {attacked:,} test {unit}"


def output_path(dataset: str, pair: str) -> Path:
    """``plots/robust_epsilon_<dataset>.png``; a dataset with several pairs (Adult) adds the
    pair's name."""
    name = dataset if pair == "gnp" else f"{dataset}-{pair}"
    return HERE / "plots" / f"robust_epsilon_{name}.png"


def plot(
    rows: list[dict[str, Any]], dataset: str, pair: str, radii: list[float], path: Path
) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setting = SETTINGS.get(dataset, Setting(dataset, "Opacus twin", "1e-5", "samples", None))
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    for side, key, label, colour, style in CURVES:
        pairs = [(None, "o")] if key == "clean" else list(zip(radii, MARKERS, strict=False))
        for radius, marker in pairs:
            points = series(rows, side, key, radius)
            if not points:
                continue
            eps = sorted(points)
            med = [100 * statistics.median(points[e]) for e in eps]
            seeds = min(len(points[e]) for e in eps)
            label = label.replace("Opacus twin", setting.opacus)
            name = label if radius is None else f"{label}, r = {radius:g}"
            name += f" (median of {seeds} seeds)" if seeds > 1 else " (1 seed)"
            ax.plot(eps, med, marker=marker, color=colour, linestyle=style, label=name)
            if max(len(v) for v in points.values()) > 1:
                xs = [e for e in eps for _ in points[e]]
                ys = [100 * v for e in eps for v in points[e]]
                ax.scatter(xs, ys, s=8, color=colour, alpha=0.4, marker=marker)
    if setting.majority is not None:
        ax.axhline(
            100 * setting.majority,
            color="grey",
            linestyle="--",
            linewidth=1,
            label=f"majority class ({100 * setting.majority:.1f}%): a constant classifier, any r",
        )
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ticks = sorted({float(r["target_epsilon"]) for r in rows})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel(f"epsilon (delta = {setting.delta})")
    ax.set_ylabel("test accuracy (%)")
    title = setting.title if pair == "gnp" else f"{setting.title} {PAIR_NAMES.get(pair, pair)}"
    against = "its Opacus twin" if setting.opacus == "Opacus twin" else setting.opacus
    ax.set_title(
        f"{title}: clipless and {against}, L2 robust accuracy\n"
        f"(certified: the whole test set; PGD: {_attacked(rows, setting.unit)})",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    # below the axes: the lines fill the whole height
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument(
        "--pair", default=None, help="adult: linear | mlp (default linear); else gnp"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="robust_twins.py --out")
    parser.add_argument("--radii", default="0.25,0.5", help="comma-separated L2 radii to draw")
    args = parser.parse_args()
    try:
        radii = [float(r) for r in args.radii.split(",")]
    except ValueError:
        raise SystemExit(
            f"--radii must be comma-separated numbers, e.g. 0.25,0.5; got {args.radii!r}"
        ) from None
    args.pair = args.pair or ("linear" if args.dataset == "adult" else "gnp")
    rows = load(args.json, args.dataset, args.pair)
    if not rows:
        raise SystemExit(f"{args.json} holds no {args.dataset} {args.pair} rows with an epsilon")
    plot(rows, args.dataset, args.pair, radii, output_path(args.dataset, args.pair))


if __name__ == "__main__":
    main()
