"""DP-ECDF benchmarks (thesis chapter 6, section 6.6): accuracy, smoothing, runtime.

Reproduces, on the thesis's synthetic ``X_pois(lambda)`` dataset (section 6.6.2: ``N = 2^15``
values, ``Pois(lambda)`` records at each value ``i``):

* **accuracy table** -- mean squared error over all thresholds, in counts^2, of the plain
  replace-one tree (thesis Theorem 6.3.1: ``2 (L+1)^3 / epsilon^2``), the add/remove tree
  (Lemma 6.3.1: half the node sensitivity), least-squares consistency, and smoothing (l1, l2,
  isotonic), all pure epsilon-DP;
* **Figure 6.6.1** -- smoothing error ratio ``||F - F_smooth||^2 / ||F - F_hat||^2`` against
  epsilon (lambda = 3); **Figure 6.6.2** -- the same against lambda (epsilon = 1);
* **Figure 6.6.3** -- mean squared error of ``F`` and of the inverse ``F^-1`` against epsilon;
* **Figure 6.6.7 / runtime** -- time to solve the smoothing problem (eq. 6.3.6) with this
  package's solvers against CVXOPT (the thesis's solver) on the same instances.

Run (from the repository root)::

    .venv/bin/python benchmarks/ecdf.py --quick          # about a minute
    .venv/bin/python benchmarks/ecdf.py                  # full (N = 2^15, 20 runs per point)
    .venv/bin/python benchmarks/ecdf.py --cvxopt-python /tmp/benchvenv/bin/python

CVXOPT is not a dependency of the package: the timing section runs it in a separate interpreter
(``--cvxopt-python``; e.g. ``python3 -m venv /tmp/benchvenv && /tmp/benchvenv/bin/pip install
numpy scipy cvxopt``) as ``python benchmarks/ecdf.py --cvxopt-worker FILE.npz``, a mode that
imports only numpy, scipy and cvxopt. Plots go to ``benchmarks/out/`` (git-ignored) with a
JSON of every number.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

OUT = Path(__file__).resolve().parent / "out"


# --------------------------------------------------------------------------------------------
# smoothing problem formulations shared with the CVXOPT worker (numpy/scipy only)
# --------------------------------------------------------------------------------------------


def incidence(N: int, L: int) -> sp.coo_matrix:
    """Dyadic-graph incidence matrix K ((N+1) x M): the reformulation d + K nu >= 0."""
    rows, cols, vals, off = [], [], [], 0
    for lev in range(L + 1):
        m = -(-N // (1 << lev))
        j = np.arange(m)
        rows += [j << lev, np.minimum((j + 1) << lev, N)]
        cols += [off + j, off + j]
        vals += [np.ones(m), -np.ones(m)]
        off += m
    return sp.coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(N + 1, off)
    )


def path_matrix(N: int, L: int) -> sp.coo_matrix:
    """Path-sum matrix A (N x M): y = P + A nu, as written in the thesis's eq. 6.3.6."""
    rows, cols, off = [], [], 0
    for lev in range(L + 1):
        m = -(-N // (1 << lev))
        i = np.arange(N)
        rows.append(i)
        cols.append(off + (i >> lev))
        off += m
    return sp.coo_matrix(
        (np.ones(N * (L + 1)), (np.concatenate(rows), np.concatenate(cols))), shape=(N, off)
    )


def increments(P: np.ndarray, n: float) -> np.ndarray:
    d = np.empty(P.size + 1)
    d[0] = P[0]
    d[1:-1] = np.diff(P)
    d[-1] = n - P[-1]
    return d


def cvxopt_worker(path: str) -> None:
    """Solve every instance of ``path`` with CVXOPT; print a JSON list of results."""
    from cvxopt import matrix, solvers, spmatrix

    solvers.options["show_progress"] = False

    def spm(a: Any) -> Any:
        a = sp.coo_matrix(a)
        return spmatrix(a.data.tolist(), a.row.tolist(), a.col.tolist(), size=a.shape)

    data = np.load(path)
    out = []
    for key in sorted(k for k in data.files if k.startswith("P_")):
        _, N_s, seed_s = key.split("_")
        N = int(N_s)
        L = int(N - 1).bit_length()
        P = data[key].astype(np.float64)
        n = float(data[f"n_{N_s}_{seed_s}"])
        forms = ["incidence"] + (["literal"] if int(data["literal_max"]) >= N else [])
        for form in forms:
            for norm in ("l1", "l2"):
                # the fast formulation is timed like ours (best of `repeats`); the literal one
                # once (it takes minutes)
                reps = int(data["repeats"]) if form == "incidence" else 1
                best = np.inf
                for _ in range(reps):
                    t0 = time.perf_counter()
                    sol, obj = _cvxopt_solve(form, norm, N, L, P, n, matrix, solvers, spm)
                    best = min(best, time.perf_counter() - t0)
                out.append(
                    {
                        "N": N, "seed": int(seed_s), "form": form, "norm": norm,
                        "seconds": best, "objective": obj, "status": str(sol["status"]),
                        "repeats": reps,
                    }
                )  # fmt: skip
                print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    print(json.dumps(out))


def _cvxopt_solve(
    form: str, norm: str, N: int, L: int, P: np.ndarray, n: float, matrix: Any, solvers: Any,
    spm: Any,
) -> tuple[Any, float]:  # fmt: skip
    """One CVXOPT solve: the reformulation ("incidence") or the thesis's literal eq. 6.3.6."""
    if form == "incidence":
        K = incidence(N, L)
        M = K.shape[1]
        d = increments(P, n)
        if norm == "l2":
            sol = solvers.qp(spm(sp.identity(M)), matrix(np.zeros(M)), spm(-K), matrix(d))
            x = np.array(sol["x"]).ravel()
            obj = float(x @ x)
        else:
            eye = sp.identity(M)
            G = sp.vstack(
                [sp.hstack([-K, sp.coo_matrix((N + 1, M))]), sp.hstack([eye, -eye]),
                 sp.hstack([-eye, -eye])]
            )  # fmt: skip
            h = np.concatenate([d, np.zeros(2 * M)])
            c = np.concatenate([np.zeros(M), np.ones(M)])
            sol = solvers.lp(matrix(c), spm(G), matrix(h))
            obj = float(sol["primal objective"])
    else:  # variables [F', nu]: F' = F_hat + A nu / n, F' monotone in [0, 1]
        A = path_matrix(N, L).tocsr()
        M = A.shape[1]
        Dm = sp.diags([np.ones(N - 1), -np.ones(N - 1)], [0, 1], shape=(N - 1, N))
        e1 = sp.coo_matrix(([-1.0], ([0], [0])), shape=(1, N))
        eN = sp.coo_matrix(([1.0], ([0], [N - 1])), shape=(1, N))
        Gf = sp.vstack([Dm, e1, eN])
        h = np.concatenate([np.zeros(N - 1), [0.0, 1.0]])
        Aeq = sp.hstack([sp.identity(N), -A / n])
        if norm == "l2":
            Pm = sp.block_diag([sp.coo_matrix((N, N)), sp.identity(M)])
            G = sp.hstack([Gf, sp.coo_matrix((N + 1, M))])
            sol = solvers.qp(
                spm(Pm), matrix(np.zeros(N + M)), spm(G), matrix(h), spm(Aeq),
                matrix(P / n),
            )  # fmt: skip
            x = np.array(sol["x"]).ravel()[N:]
            obj = float(x @ x)
        else:
            eye = sp.identity(M)
            G = sp.vstack(
                [sp.hstack([Gf, sp.coo_matrix((N + 1, 2 * M))]),
                 sp.hstack([sp.coo_matrix((M, N)), eye, -eye]),
                 sp.hstack([sp.coo_matrix((M, N)), -eye, -eye])]
            )  # fmt: skip
            hh = np.concatenate([h, np.zeros(2 * M)])
            c = np.concatenate([np.zeros(N + M), np.ones(M)])
            Aeq2 = sp.hstack([Aeq, sp.coo_matrix((N, M))])
            sol = solvers.lp(matrix(c), spm(G), matrix(hh), spm(Aeq2), matrix(P / n))
            obj = float(sol["primal objective"])
    return sol, obj


# --------------------------------------------------------------------------------------------
# accuracy experiments (use the package)
# --------------------------------------------------------------------------------------------


def thesis_mse(L: int, eps: float) -> float:
    """Theorem 6.3.1: 2 (L+1)^3 / epsilon^2, counts^2 (the thesis omits the 1/n^2)."""
    return 2 * (L + 1) ** 3 / eps**2


def accuracy_table(N: int, lam: float, eps_list: list[float], runs: int) -> list[dict[str, Any]]:
    from clipless.stats import Grid, ecdf, poisson_dataset, seeded_rng
    from clipless.stats.smoothing import smooth_counts

    data = poisson_dataset(lam, N, seed=0)
    grid = Grid(1, N, size=N)
    n = data.size
    exact = np.cumsum(grid.counts(data)) / n
    # "cl2": the l2 tree problem solved on the *consistent* prefix counts (smooth_counts);
    # ecdf() itself does not combine consistency with l1/l2
    variants: list[tuple[str, str, str | None, bool]] = [
        ("replace-one plain (thesis)", "replace_one", None, False),
        ("replace-one + l1 (eq. 6.3.6)", "replace_one", "l1", False),
        ("replace-one + l2 (eq. 6.3.6)", "replace_one", "l2", False),
        ("replace-one + isotonic", "replace_one", "isotonic", False),
        ("replace-one + consistency", "replace_one", None, True),
        ("replace-one + consistency + isotonic", "replace_one", "isotonic", True),
        ("replace-one + consistency + l2 (smooth_counts)", "replace_one", "cl2", True),
        ("add/remove plain", "add_remove", None, False),
        ("add/remove + l2", "add_remove", "l2", False),
        ("add/remove + consistency", "add_remove", None, True),
        ("add/remove + consistency + isotonic", "add_remove", "isotonic", True),
        ("add/remove + consistency + l2 (smooth_counts)", "add_remove", "cl2", True),
    ]
    rows = []
    for eps in eps_list:
        errs: dict[str, list[float]] = {v[0]: [] for v in variants}
        times: dict[str, float] = {v[0]: 0.0 for v in variants}
        rng = seeded_rng(1000 + int(eps * 1000))
        for _ in range(runs):
            states = {nb: None for nb in ("replace_one", "add_remove")}
            for name, nb, smoothing, consistency in variants:
                if states[nb] is None:
                    states[nb] = rng.getstate()  # type: ignore[assignment]
                rng.setstate(states[nb])  # type: ignore[arg-type]  # paired: same noise
                t0 = time.perf_counter()
                sm = None if smoothing == "cl2" else smoothing
                F = ecdf(data, grid, eps, nb, sm, consistency=consistency, rng=rng)  # type: ignore[arg-type]
                values = F.values
                if smoothing == "cl2":
                    values = smooth_counts(F.counts, F.n, "l2").values
                times[name] += time.perf_counter() - t0
                errs[name].append(float(np.mean((values - exact) ** 2)) * n * n)
        L = grid.depth
        for name, *_ in variants:
            mse = float(np.mean(errs[name]))
            rows.append(
                {
                    "epsilon": eps, "variant": name, "mse_counts2": mse,
                    "thesis_counts2": thesis_mse(L, eps), "ratio": thesis_mse(L, eps) / mse,
                    "seconds_per_release": times[name] / runs, "runs": runs, "N": N,
                    "lambda": lam,
                }
            )  # fmt: skip
    return rows


def smoothing_ratios(N: int, pairs: list[tuple[float, float]], runs: int) -> list[dict[str, Any]]:
    """Figures 6.6.1/6.6.2: ||F - F_smooth||^2 / ||F - F_hat||^2 (summed over runs)."""
    from clipless.stats import Grid, poisson_dataset, release_counts, seeded_rng
    from clipless.stats.smoothing import isotonic, smooth_tree

    grid = Grid(1, N, size=N)
    rows = []
    for lam, eps in pairs:
        data = poisson_dataset(lam, N, seed=0)
        n = data.size
        exact = np.cumsum(grid.counts(data)) / n
        raw, sm = 0.0, {"l1": 0.0, "l2": 0.0, "isotonic": 0.0}
        rng = seeded_rng(7 + int(1000 * eps) + int(100 * lam))
        for _ in range(runs):
            rel = release_counts(grid.counts(data), eps, "replace_one", rng=rng)
            F_hat = rel.prefix_counts / n
            raw += float(np.sum((F_hat - exact) ** 2))
            sm["l1"] += float(np.sum((smooth_tree(rel, n, "l1") - exact) ** 2))
            sm["l2"] += float(np.sum((smooth_tree(rel, n, "l2") - exact) ** 2))
            sm["isotonic"] += float(np.sum((isotonic(F_hat) - exact) ** 2))
        rows.append({"lambda": lam, "epsilon": eps, **{k: v / raw for k, v in sm.items()}})
    return rows


def inverse_errors(N: int, lam: float, eps_list: list[float], runs: int) -> list[dict[str, Any]]:
    """Figure 6.6.3: MSE of F and of F^-1 (Algorithm 9 search) at uniform points."""
    from clipless.stats import Grid, ecdf, poisson_dataset, seeded_rng

    data = poisson_dataset(lam, N, seed=0)
    grid = Grid(1, N, size=N)
    n = data.size
    exact = np.cumsum(grid.counts(data)) / n
    ps = (np.arange(999) + 1) / 1000
    true_inv = grid.thresholds[np.minimum(np.searchsorted(exact, ps, side="left"), N - 1)]
    rows = []
    for eps in eps_list:
        rng = seeded_rng(99 + int(eps * 1000))
        acc: dict[str, list[float]] = {}
        for _ in range(runs):
            state = rng.getstate()
            for smoothing in (None, "l2", "isotonic"):
                rng.setstate(state)
                F = ecdf(data, grid, eps, smoothing=smoothing, rng=rng)  # type: ignore[arg-type]
                name = smoothing or "raw"
                acc.setdefault(f"F {name}", []).append(float(np.mean((F.values - exact) ** 2)))
                inv = F.quantile(ps)
                acc.setdefault(f"F^-1 {name}", []).append(float(np.mean((inv - true_inv) ** 2)))
        rows.append({"epsilon": eps, **{k: float(np.mean(v)) for k, v in acc.items()}})
    return rows


# --------------------------------------------------------------------------------------------
# runtime against CVXOPT
# --------------------------------------------------------------------------------------------


def timing(
    sizes: list[int], literal_max: int, seeds: int, cvxopt_python: str | None, repeats: int
) -> dict[str, Any]:
    from clipless.stats import Grid, poisson_dataset, release_counts, seeded_rng
    from clipless.stats.smoothing import smooth_counts

    OUT.mkdir(parents=True, exist_ok=True)
    inst: dict[str, Any] = {"literal_max": literal_max, "repeats": repeats}
    ours = []
    for N in sizes:
        data = poisson_dataset(3.0, N, seed=0)
        grid = Grid(1, N, size=N)
        for seed in range(seeds):
            rel = release_counts(grid.counts(data), 1.0, "replace_one", rng=seeded_rng(seed))
            P, n = np.asarray(rel.prefix_counts), data.size
            inst[f"P_{N}_{seed}"] = P
            inst[f"n_{N}_{seed}"] = n
            for norm in ("l1", "l2"):
                for method in ("auto", "generic"):
                    best = np.inf
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        res = smooth_counts(P, n, norm, method=method)  # type: ignore[arg-type]
                        best = min(best, time.perf_counter() - t0)
                    ours.append(
                        {
                            "N": N, "seed": seed, "norm": norm, "method": res.method,
                            "seconds": best, "objective": res.objective,
                        }
                    )  # fmt: skip
                    print(f"  ours N={N} {norm} {res.method}: {best:.3f}s", flush=True)
    path = OUT / "smoothing_instances.npz"
    np.savez(path, **inst)
    result: dict[str, Any] = {"ours": ours, "cvxopt": None}
    if cvxopt_python:
        proc = subprocess.run(
            [cvxopt_python, __file__, "--cvxopt-worker", str(path)],
            capture_output=True,
            text=True,
            check=True,
        )
        result["cvxopt"] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------------------------
# plots and tables
# --------------------------------------------------------------------------------------------


def plot_all(results: dict[str, Any], prefix: str = "") -> None:
    from matplotlib.figure import Figure

    OUT.mkdir(parents=True, exist_ok=True)
    for key, xname, fname, title in (
        ("fig661", "epsilon", "ecdf_fig661_smoothing_vs_epsilon.png", "λ = 3"),
        ("fig662", "lambda", "ecdf_fig662_smoothing_vs_lambda.png", "ε = 1"),
    ):
        rows = results.get(key)
        if not rows:
            continue
        fig = Figure(figsize=(5, 3.5))
        ax = fig.add_subplot()
        x = [r[xname] for r in rows]
        for name in ("l1", "l2", "isotonic"):
            ax.plot(x, [r[name] for r in rows], marker="o", label=name)
        ax.axhline(1.0, color="grey", linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel(xname)
        ax.set_ylabel("‖F − F_smooth‖² / ‖F − F̂‖²")
        ax.set_title(f"Effect of smoothing on the DP error ({title})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / (prefix + fname), dpi=120)
    rows = results.get("fig663")
    if rows:
        fig = Figure(figsize=(9, 3.5))
        for k, kind in enumerate(("F ", "F^-1 ")):
            ax = fig.add_subplot(1, 2, k + 1)
            for name in ("raw", "l2", "isotonic"):
                ax.plot(
                    [r["epsilon"] for r in rows],
                    [r[kind + name] for r in rows],
                    marker="o",
                    label=name,
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("epsilon")
            ax.set_title(f"MSE of {kind.strip()}")
            ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / f"{prefix}ecdf_fig663_inverse.png", dpi=120)
    rows = results.get("accuracy")
    if rows:
        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        names = list(dict.fromkeys(r["variant"] for r in rows))
        for name in names:
            sub = [r for r in rows if r["variant"] == name]
            ax.plot([r["epsilon"] for r in sub], [r["mse_counts2"] for r in sub], marker=".",
                    label=name)  # fmt: skip
        sub = [r for r in rows if r["variant"] == names[0]]
        ax.plot([r["epsilon"] for r in sub], [r["thesis_counts2"] for r in sub], "k--",
                label="2(L+1)³/ε² (Thm 6.3.1)")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("epsilon")
        ax.set_ylabel("MSE (counts²)")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(OUT / f"{prefix}ecdf_accuracy.png", dpi=120)


def print_tables(results: dict[str, Any]) -> None:
    rows = results.get("accuracy") or []
    if rows:
        print("\n| epsilon | variant | MSE (counts^2) | thesis 2(L+1)^3/eps^2 | thesis / MSE |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['epsilon']:g} | {r['variant']} | {r['mse_counts2']:.4g} | "
                f"{r['thesis_counts2']:.4g} | {r['ratio']:.2f}x |"
            )
    for key, xname in (("fig661", "epsilon"), ("fig662", "lambda")):
        rows = results.get(key) or []
        if rows:
            print(f"\n| {xname} | l1 | l2 | isotonic |  ({key}: smoothed / raw squared error)")
            print("|---|---|---|---|")
            for r in rows:
                print(f"| {r[xname]:g} | {r['l1']:.3f} | {r['l2']:.3f} | {r['isotonic']:.3f} |")
    rows = results.get("fig663") or []
    if rows:
        keys = [k for k in rows[0] if k != "epsilon"]
        print("\n| epsilon | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for r in rows:
            print(f"| {r['epsilon']:g} | " + " | ".join(f"{r[k]:.3g}" for k in keys) + " |")
    t = results.get("timing")
    if t:
        print("\n| N | norm | solver | seconds (min) | objective |")
        print("|---|---|---|---|---|")
        for r in t["ours"]:
            print(
                f"| {r['N']} | {r['norm']} | clipless {r['method']} | {r['seconds']:.3f} | "
                f"{r['objective']:.6g} |"
            )
        for r in t["cvxopt"] or []:
            print(
                f"| {r['N']} | {r['norm']} | CVXOPT ({r['form']}, {r['status']}) | "
                f"{r['seconds']:.3f} | {r['objective']:.6g} |"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few runs")
    parser.add_argument("--runs", type=int, default=None, help="runs per point")
    parser.add_argument("--cvxopt-python", default=None, help="interpreter with cvxopt")
    parser.add_argument("--cvxopt-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--only", default="accuracy,fig661,fig662,fig663,timing", help="comma-separated parts"
    )
    args = parser.parse_args(argv)
    if args.cvxopt_worker:
        cvxopt_worker(args.cvxopt_worker)
        return
    parts = set(args.only.split(","))
    if args.quick:
        N, runs = 1 << 12, args.runs or 3
        eps_list = [0.1, 1.0]
        sizes, literal_max, seeds, repeats = [1 << 8, 1 << 12], 1 << 8, 1, 2
    else:
        N, runs = 1 << 15, args.runs or 20
        eps_list = [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
        sizes, literal_max, seeds, repeats = [1 << 8, 1 << 10, 1 << 12, 1 << 15], 1 << 10, 2, 3
    results: dict[str, Any] = {"N": N, "runs": runs}
    t0 = time.perf_counter()
    if "accuracy" in parts:
        print("accuracy table ...", flush=True)
        acc_eps = [0.1, 1.0] if args.quick else [0.1, 1.0, 10.0]
        results["accuracy"] = accuracy_table(N, 1.0, acc_eps, runs)
    if "fig661" in parts:
        print("figure 6.6.1 ...", flush=True)
        results["fig661"] = smoothing_ratios(N, [(3.0, e) for e in eps_list], runs)
    if "fig662" in parts:
        print("figure 6.6.2 ...", flush=True)
        lams = [0.3, 3.0, 30.0] if args.quick else [0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]
        results["fig662"] = smoothing_ratios(N, [(lam, 1.0) for lam in lams], runs)
    if "fig663" in parts:
        print("figure 6.6.3 ...", flush=True)
        results["fig663"] = inverse_errors(N, 3.0, eps_list, runs)
    if "timing" in parts:
        print("smoothing runtime ...", flush=True)
        results["timing"] = timing(sizes, literal_max, seeds, args.cvxopt_python, repeats)
    results["wall_seconds"] = time.perf_counter() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    name = OUT / ("ecdf_results_quick.json" if args.quick else "ecdf_results.json")
    if name.is_file():  # a partial run (--only) updates the parts it ran
        results = {**json.loads(name.read_text()), **results}
    name.write_text(json.dumps(results, indent=1))
    plot_all(results, "quick_" if args.quick else "")
    print_tables(results)
    print(f"\nwall time {results['wall_seconds']:.0f}s; plots and JSON in {OUT}")


if __name__ == "__main__":
    main()
