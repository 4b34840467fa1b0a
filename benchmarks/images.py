"""Accuracy against epsilon on image datasets: clipless and Opacus in one harness, a Pareto plot.

Runs :mod:`benchmarks.adult`'s runners (same data, same epsilon and delta 1e-5, Poisson sampling,
final-epoch test accuracy, no selection on the test set) for each epsilon of ``--epsilons`` and
each seed, appends one JSON line per run to ``out/images.jsonl`` (a rerun skips what is there),
then draws ``plots/accuracy_epsilon_<dataset>.png``: the median over seeds per method against
epsilon, with the published anchors named in issue 10 as markers.

Methods (each a fixed setting, chosen by the trials of ``RESULTS.md`` sections 14 and 17):

* ``clipless-scatter``: ScatterNet features (:class:`clipless.features.Scattering2d`), linear
  model without bias, inputs normalised onto the unit sphere, Adam 0.02, temperature 0.1,
  loss-gradient clip 0.1, batch 2048, 20 epochs, no EMA (``clipless train --dataset
  fashion-mnist`` uses radius 2 at Adam 0.01, the same logit dynamics, clip 0.3, 30 epochs, EMA);
* ``clipless-centered``: the same, with the private input mean subtracted (``center=20``:
  :func:`clipless.features.release_mean`, composed with the steps by the accountant; section 17),
  which ``clipless train`` does by default with features;
* ``clipless-whitened``: ``clipless-centered`` whose centred features are also mixed by the
  shrunk inverse square root of their released channel covariance (``whiten=20``:
  :func:`clipless.features.release_channel_moment` and :func:`clipless.features.whitening`,
  composed with the steps; section 20), which ``clipless train`` does by default with features;
* ``opacus-centered``: ``opacus-scatter`` on features centred by the same released mean (its
  small cost is not in Opacus's accountant: a slight advantage to Opacus);
* ``opacus-scatter``: Opacus DP-SGD on the same features (linear model), SGD lr 4, momentum 0.9,
  clip 0.1, batch 2048, 20 epochs: the best of three Opacus trials (Tramer and Boneh's batch
  8192 / 40 epochs and lr 1 were worse, section 14);
* ``clipless-pixels`` / ``opacus-pixels``: the linear models on raw pixels of section 8b.

``python benchmarks/images.py --dataset fashion-mnist --methods clipless-scatter --epsilons 1 2 3 8
--seeds 0 1 2`` then ``python benchmarks/images.py --plot``. The plot also draws, when
``out/tune.jsonl`` exists, the clipless and Opacus settings chosen by ``benchmarks/tune.py`` with
the same 9 trials per epsilon (``RESULTS.md`` section 18).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adult

OUT = adult.OUT_DIR / "images.jsonl"
PLOT = Path(__file__).resolve().parent / "plots" / "accuracy_epsilon.png"

# the clipless ScatterNet setting of sections 14 and 17 (the centred and whitened variants add
# their releases to it)
CLIPLESS_SCATTER: dict[str, Any] = {
    "features": "scatter",
    "hidden": (),
    "bias": False,
    "constraint": None,
    "optimizer": "adam",
    "lr": 0.02,
    "temperature": 0.1,
    "clip": 0.1,
    "batch": 2048,
    "epochs": 20,
    "input_mode": "sphere",
    "input_norm": 1.0,
}

METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "clipless-scatter": ("clipless", CLIPLESS_SCATTER),
    "clipless-centered": ("clipless", {**CLIPLESS_SCATTER, "center": 20.0}),
    "clipless-whitened": (
        "clipless",
        {**CLIPLESS_SCATTER, "center": 20.0, "whiten": 20.0, "shrink": 1.0},
    ),
    "opacus-centered": (
        "opacus",
        {
            "features": "scatter",
            "hidden": (),
            "lr": 4.0,
            "momentum": 0.9,
            "max_grad_norm": 0.1,
            "batch": 2048,
            "epochs": 20,
            "center": 20.0,
        },
    ),
    "opacus-scatter": (
        "opacus",
        {
            "features": "scatter",
            "hidden": (),
            "lr": 4.0,
            "momentum": 0.9,
            "max_grad_norm": 0.1,
            "batch": 2048,
            "epochs": 20,
        },
    ),
    "clipless-pixels": (
        "clipless",
        {
            "hidden": (),
            "bias": True,
            "constraint": None,
            "optimizer": "adam",
            "lr": 0.01,
            "temperature": 0.1,
            "clip": 0.1,
            "batch": 2048,
            "epochs": 20,
        },
    ),
    "opacus-pixels": (
        "opacus",
        {
            "hidden": (),
            "lr": 4.0,
            "momentum": 0.9,
            "max_grad_norm": 0.1,
            "batch": 2048,
            "epochs": 20,
        },
    ),
}

# Published or issue-stated anchors (epsilon, accuracy, label) for Fashion-MNIST, delta 1e-5.
ANCHORS = {
    "fashion-mnist": [
        (3.0, 0.897, "Tramer & Boneh 2021, ScatterNet (DP-SGD)"),
        (3.0, 0.8715, "Opacus 1.6, Tramer-Boneh CNN (issue 10)"),
        (1.0, 0.839, "Opacus 1.6, Tramer-Boneh CNN (issue 10)"),
        (1.0, 0.75, "Clipless DP-SGD paper"),
        (2.0, 0.77, "Clipless DP-SGD paper"),
    ]
}


def _done() -> set[tuple[str, str, float, int, str]]:
    if not OUT.is_file():
        return set()
    rows = [json.loads(line) for line in OUT.read_text().splitlines() if line.strip()]
    return {
        (r["dataset"], r["method"], float(r["epsilon"]), int(r["seed"]), _key(r.get("set", {})))
        for r in rows
    }


def _key(overrides: dict[str, Any]) -> str:
    return json.dumps(overrides, sort_keys=True)


def run(
    dataset: str,
    methods: list[str],
    epsilons: list[float],
    seeds: list[int],
    extra: dict[str, Any] | None = None,
) -> None:
    """Every (method, epsilon, seed) not yet in ``out/images.jsonl``; ``extra`` overrides every
    method's setting (e.g. a smaller batch for a smaller dataset) and is recorded in the row."""
    extra = dict(extra or {})
    done = _done()
    cache: dict[str, Any] = {}
    for method in methods:
        runner, setting = METHODS[method]
        features = setting.get("features", "none")
        if features not in cache:
            cache[features] = adult.load(dataset, features)
        for epsilon in epsilons:
            for seed in seeds:
                if (dataset, method, float(epsilon), seed, _key(extra)) in done:
                    continue
                overrides = {**setting, **extra, "dataset": dataset, "epsilon": float(epsilon)}
                result = adult.run_setting(runner, overrides, [seed], cache[features])
                row = {
                    "dataset": dataset,
                    "method": method,
                    "epsilon": float(epsilon),
                    "seed": seed,
                    "set": extra,
                    "accuracy": result["accuracies"][0],
                    "epsilon_spent": result["epsilon"],
                    "time_s": result["time_s"],
                }
                OUT.parent.mkdir(exist_ok=True)
                with OUT.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def plot(dataset: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = OUT.read_text() if OUT.is_file() else ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = [r for r in rows if r["dataset"] == dataset and not r.get("set")]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in METHODS:
        points: dict[float, list[float]] = {}
        for r in rows:
            if r["method"] == method:
                points.setdefault(r["epsilon"], []).append(r["accuracy"])
        if not points:
            continue
        eps = sorted(points)
        med = [100 * statistics.median(points[e]) for e in eps]
        label = f"{method} (median of {min(len(v) for v in points.values())}+ seeds)"
        ax.plot(eps, med, marker="o", label=label)
    # benchmarks/tune.py: the same trials per method and epsilon (Fashion-MNIST: section 18's 9;
    # mnist-10k: section 27b's three stages, 26 each)
    tuned, stages = {
        "fashion-mnist": ("tune.jsonl", ("",)),
        "mnist-10k": ("tune-mnist.jsonl", ("-mnist", "-mnist-low", "-mnist-budget")),
    }.get(dataset, ("", ()))
    if stages and (adult.OUT_DIR / tuned).is_file():
        import tune

        chosen = tune.selected(adult.OUT_DIR / tuned)
        trials = "9" if dataset == "fashion-mnist" else "the same 18 or 26"
        for name in ("clipless", "opacus"):
            points = {}
            for e in sorted({e for _, e in chosen}):
                best = tune.best_of_stages(chosen, [name + stage for stage in stages], e)
                if best is not None:
                    points[e] = best[1]
            if points:
                eps = sorted(points)
                med = [100 * points[e]["median"] for e in eps]
                seeds = min(len(points[e]["accuracies"]) for e in eps)
                label = (
                    f"{name}, best of {trials} trials per epsilon (tune.py, median of {seeds} "
                    "seeds)"
                )
                ax.plot(eps, med, marker="s", linestyle="--", label=label)
    markers = iter(["x", "+", "1", "2", "3", "4", "*", "d"])
    marker_of: dict[str, str] = {}
    for epsilon, accuracy, label in ANCHORS.get(dataset, []):
        first = label not in marker_of
        marker = marker_of.setdefault(label, next(markers))
        ax.scatter(
            [epsilon],
            [100 * accuracy],
            marker=marker,
            s=60,
            color="black",
            label=label if first else None,
        )
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([1, 2, 3, 8], ["1", "2", "3", "8"])
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("test accuracy, final epoch (%)")
    ax.set_title(f"{dataset}: accuracy against epsilon")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = PLOT.with_name(f"accuracy_epsilon_{dataset}.png")
    fig.savefig(path, dpi=110)
    print(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--methods", nargs="*", default=["clipless-centered"], choices=METHODS)
    parser.add_argument("--epsilons", nargs="*", type=float, default=[1.0, 2.0, 3.0, 8.0])
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="for all methods")
    parser.add_argument("--plot", action="store_true", help="only draw the plot from the JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    extra = {}
    for item in args.set:
        key, _, value = item.partition("=")
        extra[key] = adult.parse_value(value)
    if not args.plot:
        run(args.dataset, args.methods, args.epsilons, args.seeds, extra)
    plot(args.dataset)


if __name__ == "__main__":
    main()
