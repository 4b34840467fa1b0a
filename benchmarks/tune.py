"""Equal-budget tuning of clipless and Opacus on Fashion-MNIST or MNIST, in parallel processes.

``--dataset mnist-10k`` runs the ``*-mnist*`` grids on the 10k MNIST subset (``RESULTS.md``
section 27b; give it its own ``--out``: the summary groups rows by method and epsilon).

Issue 10 asks for every method to be tuned "with the same number of trials" at every epsilon.
This driver does it with one protocol for both, the one the DP-SGD papers use (the tuning cost is
stated, not accounted):

1. **stage 1**: every setting of the method's grid (:data:`GRIDS`, the same number of trials for
   clipless and Opacus) at seed 0;
2. **stage 2**: the setting with the best seed-0 test accuracy, at the other seeds; the reported
   figure is the median over all seeds of that setting (seed 0 included: the selection bias is the
   same for both methods).

Each run is :func:`adult.run_setting` on the ScatterNet features (the settings of
``benchmarks/images.py``'s ``clipless-centered`` and ``opacus-centered``, centred by the released
mean), final-epoch accuracy, delta 1e-5; Opacus with its ghost clipping (``grad_sample_mode=
"ghost"``: the same clipped sum as its per-sample hooks, to rounding, in a tenth of the time on
this wide linear model). Runs go to a pool of ``--jobs`` forked processes (one
thread each; ``--set device=cuda`` puts the models and batches on a GPU) and every finished run is
appended at once to ``--out`` (JSON lines; a rerun skips what is there), so a run cut short keeps
what it finished.

``python benchmarks/tune.py --methods clipless opacus --epsilons 3 1 8 2 --jobs 2`` (about 45
minutes on two cores with the default three seeds; ``RESULTS.md`` section 18 used ``--seeds 0 1
2 3 4 5 6 7 8 9``, about 80 minutes), ``--summary`` to print the tables.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import adult
import images

# Opacus on the whitened features: the same released mean and whitening as clipless-whitened
# (noise multiplier 20, shrink 1), applied at each sample's own scale; ghost clipping.
OPACUS_WHITENED: dict[str, Any] = {
    **images.METHODS["opacus-centered"][1],
    "grad_sample_mode": "ghost",
    "whiten": 20.0,
    "shrink": 1.0,
}

# method -> (runner, base setting, grid). clipless and opacus have grids of the same size (9):
# the step size and the clip threshold (for clipless the output-cotangent clip, for Opacus the
# per-sample gradient clip), around each method's best setting of sections 14 and 17.
GRIDS: dict[str, tuple[str, dict[str, Any], dict[str, list[Any]]]] = {
    "clipless": (
        "clipless",
        images.METHODS["clipless-centered"][1],
        {"lr": [0.01, 0.02, 0.04], "clip": [0.05, 0.1, 0.2]},
    ),
    "opacus": (
        "opacus",
        {**images.METHODS["opacus-centered"][1], "grad_sample_mode": "ghost"},
        {"lr": [4.0, 8.0, 16.0], "max_grad_norm": [0.05, 0.1, 0.2]},
    ),
    # the training budget (epochs and batch size; 8 trials each), at the base step and clip
    "clipless-budget": (
        "clipless",
        images.METHODS["clipless-centered"][1],
        {"epochs": [20, 30, 40, 60], "batch": [2048, 4096]},
    ),
    "opacus-budget": (
        "opacus",
        {**images.METHODS["opacus-centered"][1], "lr": 8.0, "grad_sample_mode": "ghost"},
        {"epochs": [20, 30, 40, 60], "batch": [2048, 4096]},
    ),
    # a third stage: the step size and clip again, at each method's budget winner at epsilon 3
    # (clipless batch 4096 / 40 epochs, Opacus 4096 / 30); the same 9-point grids, Opacus's shifted
    # one step down in clip because its first-stage optimum (lr 16, clip 0.05) was on the grid's
    # corner. Every method has had 9 + 8 + 9 = 26 trials after it (RESULTS.md section 19).
    "clipless-refine": (
        "clipless",
        {**images.METHODS["clipless-centered"][1], "batch": 4096, "epochs": 40},
        {"lr": [0.01, 0.02, 0.04], "clip": [0.05, 0.1, 0.2]},
    ),
    "opacus-refine": (
        "opacus",
        {
            **images.METHODS["opacus-centered"][1],
            "grad_sample_mode": "ghost",
            "batch": 4096,
            "epochs": 30,
        },
        {"lr": [8.0, 16.0, 32.0], "max_grad_norm": [0.025, 0.05, 0.1]},
    ),
    # the stage-1 grids again on features whitened by the released channel covariance (noise
    # multiplier 20, shrink 1; RESULTS.md section 20). Whitening shrinks the centred features'
    # norm by about half, which for Opacus (unnormalised inputs) halves the logits' step at the
    # same lr x clip: its lr grid moves up one step (16-64).
    "clipless-whiten": (
        "clipless",
        images.METHODS["clipless-whitened"][1],
        {"lr": [0.01, 0.02, 0.04], "clip": [0.05, 0.1, 0.2]},
    ),
    "opacus-whiten": (
        "opacus",
        OPACUS_WHITENED,
        {"lr": [16.0, 32.0, 64.0], "max_grad_norm": [0.025, 0.05, 0.1]},
    ),
    # a second stage on the whitened features, one step beyond the first grids' corners: every
    # first-stage optimum of both methods had the grid's smallest step (clipless lr 0.01, Opacus
    # lr 16) at every epsilon, and several the largest or smallest clip. 9 more trials each
    # (RESULTS.md section 20i).
    "clipless-whiten-low": (
        "clipless",
        images.METHODS["clipless-whitened"][1],
        {"lr": [0.0025, 0.005, 0.01], "clip": [0.1, 0.2, 0.4]},
    ),
    "opacus-whiten-low": (
        "opacus",
        OPACUS_WHITENED,
        {"lr": [4.0, 8.0, 16.0], "max_grad_norm": [0.025, 0.05, 0.1]},
    ),
    # Opacus only, a third stage along the ridge lr x clip ~ const, where opacus-whiten-low's
    # epsilon-1 optimum (lr 4, clip 0.1) sat on the corner again: 9 trials more than clipless
    # had (exploratory, unequal budgets in Opacus's favour; RESULTS.md section 20i)
    "opacus-whiten-ridge": (
        "opacus",
        OPACUS_WHITENED,
        {"lr": [1.0, 2.0, 4.0], "max_grad_norm": [0.1, 0.2, 0.4]},
    ),
    # mnist-10k (8,000 training images; --dataset mnist-10k), whitened features, batch 512, 30
    # epochs (RESULTS.md sections 14b and 20d): 9 trials each, centred on clipless's measured
    # step (lr 0.01 at radius 1, section 20e) and, for Opacus, on the Fashion-MNIST whitened
    # optimum's ridge lr x clip ~ 0.4-0.8 with the lr scaled to the 4x smaller batch (SGD's
    # update is lr times the batch mean); RESULTS.md section 27
    "clipless-mnist": (
        "clipless",
        {**images.METHODS["clipless-whitened"][1], "batch": 512, "epochs": 30},
        {"lr": [0.005, 0.01, 0.02], "clip": [0.05, 0.1, 0.2]},
    ),
    "opacus-mnist": (
        "opacus",
        {**OPACUS_WHITENED, "batch": 512, "epochs": 30},
        {"lr": [2.0, 4.0, 8.0], "max_grad_norm": [0.025, 0.05, 0.1]},
    ),
    # a second stage one step beyond the corners: both first-stage optima sat on the smallest
    # step at epsilon 1 (and Opacus's on the smallest clip); 9 more trials each
    "clipless-mnist-low": (
        "clipless",
        {**images.METHODS["clipless-whitened"][1], "batch": 512, "epochs": 30},
        {"lr": [0.00125, 0.0025, 0.005], "clip": [0.05, 0.1, 0.2]},
    ),
    "opacus-mnist-low": (
        "opacus",
        {**OPACUS_WHITENED, "batch": 512, "epochs": 30},
        {"lr": [0.5, 1.0, 2.0], "max_grad_norm": [0.0125, 0.025, 0.05]},
    ),
    # the training budget (8 trials each) at each method's first-stage step and clip at
    # epsilon 8, where Opacus led (RESULTS.md section 27b)
    "clipless-mnist-budget": (
        "clipless",
        {**images.METHODS["clipless-whitened"][1], "lr": 0.005, "clip": 0.1},
        {"batch": [256, 512, 1024, 2048], "epochs": [30, 60]},
    ),
    "opacus-mnist-budget": (
        "opacus",
        {**OPACUS_WHITENED, "lr": 2.0, "max_grad_norm": 0.1},
        {"batch": [256, 512, 1024, 2048], "epochs": [30, 60]},
    ),
}
DATASETS = ("fashion-mnist", "mnist-10k")

_DATA: tuple[Any, Any] | None = None


def _settings(method: str) -> list[dict[str, Any]]:
    _, base, grid = GRIDS[method]
    keys = sorted(grid)
    return [
        {**base, **dict(zip(keys, values, strict=True))}
        for values in itertools.product(*(grid[k] for k in keys))
    ]


def _trial(
    method: str,
    setting: dict[str, Any],
    epsilon: float,
    seed: int,
    extra: dict[str, Any],
    dataset: str,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    assert _DATA is not None
    runner = GRIDS[method][0]
    overrides = {**setting, **extra, "dataset": dataset, "epsilon": epsilon}
    if runner == "clipless":
        overrides["ratios"] = False  # no per-sample diagnostic in a tuning run
    result = adult.run_setting(runner, overrides, [seed], _DATA)
    grid = GRIDS[method][2]
    row = {
        "method": method,
        "epsilon": epsilon,
        "seed": seed,
        "trial": {k: setting[k] for k in sorted(grid)},
        "set": extra,
        "accuracy": result["accuracies"][0],
        "epsilon_spent": result["epsilon"],
        "time_s": result["time_s"],
    }
    if dataset != "fashion-mnist":  # rows written before --dataset existed are Fashion-MNIST's
        row["dataset"] = dataset
    return row


def _key(row: dict[str, Any]) -> str:
    parts = [row["method"], row["epsilon"], row["seed"], row["trial"], row["set"]]
    if row.get("dataset", "fashion-mnist") != "fashion-mnist":
        parts.append(row["dataset"])
    return json.dumps(parts, sort_keys=True)


def tune(
    methods: list[str],
    epsilons: list[float],
    seeds: list[int],
    jobs: int,
    extra: dict[str, Any],
    out: Path,
    dataset: str = "fashion-mnist",
) -> None:
    """Stage 1 then stage 2 for every (method, epsilon), ``jobs`` runs at a time."""
    global _DATA
    _DATA = adult.load(dataset, "scatter")  # before the fork: the workers share it
    done = {}
    if out.is_file():
        for line in out.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[_key(row)] = row
    groups = [(m, float(e)) for e in epsilons for m in methods]
    stage1: dict[tuple[str, float], list[dict[str, Any]]] = {g: [] for g in groups}
    pending: dict[cf.Future[dict[str, Any]], tuple[str, float, int]] = {}
    context = multiprocessing.get_context("fork")
    start = time.perf_counter()

    def record(row: dict[str, Any], group: tuple[str, float], stage: int) -> None:
        if stage == 1:
            stage1[group].append(row)
        if _key(row) not in done:
            done[_key(row)] = row
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
        print(f"[{time.perf_counter() - start:6.0f} s] stage {stage}", json.dumps(row), flush=True)

    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:

        def submit(method: str, setting: dict[str, Any], eps: float, seed: int, stage: int):
            trial = {k: setting[k] for k in sorted(GRIDS[method][2])}
            probe = {"method": method, "epsilon": eps, "seed": seed, "trial": trial, "set": extra}
            probe["dataset"] = dataset
            if _key(probe) in done:
                record(done[_key(probe)], (method, eps), stage)
                return
            future = pool.submit(_trial, method, setting, eps, seed, extra, dataset)
            pending[future] = (method, eps, stage)

        for method, eps in groups:
            for setting in _settings(method):
                submit(method, setting, eps, seeds[0], 1)
        finished: set[tuple[str, float]] = set()

        def maybe_stage2(group: tuple[str, float]) -> None:
            method, eps = group
            if group in finished or len(stage1[group]) < len(_settings(method)):
                return
            finished.add(group)
            best = max(stage1[group], key=lambda r: r["accuracy"])
            setting = {**GRIDS[method][1], **best["trial"]}
            for seed in seeds[1:]:
                submit(method, setting, eps, seed, 2)

        for group in groups:
            maybe_stage2(group)
        while pending:
            ready, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
            for future in ready:
                method, eps, stage = pending.pop(future)
                record(future.result(), (method, eps), stage)
                maybe_stage2((method, eps))
    summarise(out)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def selected(
    out: Path, rows: list[dict[str, Any]] | None = None
) -> dict[tuple[str, float], dict[str, Any]]:
    """Per (method, epsilon) in ``out`` (or in ``rows``, already read from it): the stage-1
    trials (seed 0), the best one, and that setting's accuracy at every seed run
    (``{"trials", "best", "accuracies", "median"}``)."""
    if rows is None:
        rows = _rows(out)
    result = {}
    for method, eps in sorted({(r["method"], r["epsilon"]) for r in rows}):
        mine = [r for r in rows if r["method"] == method and r["epsilon"] == eps]
        first = [r for r in mine if r["seed"] == min(x["seed"] for x in mine)]
        best = max(first, key=lambda r: r["accuracy"])
        seeds = sorted(
            (r for r in mine if r["trial"] == best["trial"]), key=lambda r: int(r["seed"])
        )
        accs = [r["accuracy"] for r in seeds]
        result[(method, eps)] = {
            "trials": sorted(first, key=lambda r: json.dumps(r["trial"], sort_keys=True)),
            "best": best["trial"],
            "accuracies": accs,
            "median": statistics.median(accs),
        }
    return result


def best_of_stages(
    chosen: dict[tuple[str, float], dict[str, Any]], methods: list[str], eps: float
) -> tuple[str, dict[str, Any]] | None:
    """Among the tuning stages ``methods`` of one library (e.g. ``clipless-mnist`` and
    ``clipless-mnist-low``), the one whose selected trial had the best seed-0 accuracy at
    ``eps`` (the protocol's selection over every trial the library had), with its selection;
    ``None`` when no stage ran at ``eps`` with more than one seed."""
    runs = [
        (m, chosen[m, eps])
        for m in methods
        if (m, eps) in chosen and len(chosen[m, eps]["accuracies"]) > 1
    ]
    if not runs:
        return None
    return max(runs, key=lambda r: r[1]["accuracies"][0])


def summarise(out: Path) -> None:
    """Per (method, epsilon): every stage-1 trial, the selected one and its seeds' median."""
    for (method, eps), sel in selected(out, _rows(out)).items():
        trials = ", ".join(
            f"{json.dumps(r['trial'])}: {100 * r['accuracy']:.2f}" for r in sel["trials"]
        )
        accs = [round(100 * a, 2) for a in sel["accuracies"]]
        print(
            f"{method} eps {eps:g}: {len(sel['trials'])} trials [{trials}] -> best "
            f"{sel['best']}, seeds {accs}, median {100 * sel['median']:.2f}"
        )
    rows = _rows(out)
    chosen = selected(out, rows)
    methods = {m for m, _ in chosen}
    for first in sorted(m for m in methods if m.startswith("clipless")):
        second = first.replace("clipless", "opacus", 1)
        if second in methods:
            compare(rows, chosen, first, second)


def compare(
    rows: list[dict[str, Any]],
    chosen: dict[tuple[str, float], dict[str, Any]],
    first: str = "clipless",
    second: str = "opacus",
) -> None:
    """Per epsilon: the selected settings of ``first`` and ``second`` paired by seed, the median
    paired difference and the two-sided Wilcoxon signed-rank test (``scipy.stats.wilcoxon``)."""
    from scipy.stats import wilcoxon

    for eps in sorted({e for m, e in chosen if m == first and (second, e) in chosen}):
        by_seed = []
        for method in (first, second):
            best = chosen[method, eps]["best"]
            by_seed.append(
                {
                    int(r["seed"]): r["accuracy"]
                    for r in rows
                    if r["method"] == method and r["epsilon"] == eps and r["trial"] == best
                }
            )
        seeds = sorted(set(by_seed[0]) & set(by_seed[1]))
        diffs = [by_seed[0][s] - by_seed[1][s] for s in seeds]
        if len(seeds) < 2:
            continue
        wins = sum(d > 0 for d in diffs)
        p_value = float(wilcoxon(diffs).pvalue) if any(diffs) else 1.0
        print(
            f"eps {eps:g}: {first} - {second} over {len(seeds)} seeds: median "
            f"{100 * statistics.median(diffs):+.2f} points, {first} ahead on {wins}, "
            f"Wilcoxon p = {p_value:.3g}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="*", default=["clipless", "opacus"], choices=GRIDS)
    parser.add_argument("--epsilons", nargs="*", type=float, default=[1.0, 2.0, 3.0, 8.0])
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--dataset", default="fashion-mnist", choices=DATASETS)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="every run")
    parser.add_argument("--out", type=Path, default=adult.OUT_DIR / "tune.jsonl")
    parser.add_argument("--summary", action="store_true", help="only summarise --out")
    args = parser.parse_args()
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1; got {args.jobs}")
    if args.summary:
        summarise(args.out)
        return
    extra = {}
    for item in args.set:
        key, _, value = item.partition("=")
        extra[key] = adult.parse_value(value)
    tune(args.methods, args.epsilons, args.seeds, args.jobs, extra, args.out, args.dataset)


if __name__ == "__main__":
    main()
