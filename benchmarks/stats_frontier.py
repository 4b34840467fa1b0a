"""DP prefix counts / CDFs / quantiles at the frontier, against OpenDP and diffprivlib (issue 14).

One run, same data, same privacy parameters, every mechanism:

* clipless ``binary`` (the thesis's tree + least squares), ``k-ary`` (consistent k-ary tree,
  default k) and, under zCDP, ``factorization`` (square-root factorisation);
* OpenDP 0.16 consistent b-ary tree (``make_b_ary_tree`` >> Laplace / Gaussian >>
  ``make_consistent_b_ary_tree`` >> ``make_cdf``) for b in {2, 4, 8, 16} and its own
  ``choose_branching_factor``; the best b is reported;
* quantiles: clipless :func:`clipless.stats.quantiles` (k-ary CDF, isotonic, inversion),
  OpenDP ``make_quantiles_from_counts`` on its best consistent tree (linear interpolation),
  diffprivlib ``tools.quantile`` (exponential mechanism, epsilon split over the quantiles).

Data: the thesis's ``X_pois(1)`` (section 6.6.2) on ``N = 2^10 .. 2^15`` integer thresholds, and
Adult ages (UCI, 32,561 rows, integer thresholds 17..90) when the dataset cache has
``adult/adult.data`` (``$CLIPLESS_DATA`` or ``~/.cache/clipless``; ``clipless data fetch adult``).

Metrics: mean and max over thresholds of the squared CDF error (F units; before smoothing and
after isotonic smoothing), times ``n^2`` where said (counts^2), the mean rank error (counts) of
9 and 99 quantiles, and wall time per release. zCDP: the measured mean per-threshold variance of
the factorisation against its exact value ``sigma^2 mean_i S(i)`` and against
``sigma^2 (1 + ln(N)/pi)``.

Usage::

    python benchmarks/stats_frontier.py --sizes 10 12 15 --repeats 20 --out frontier.json

Prints markdown tables (the RESULTS.md section) and writes the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from clipless.stats import Grid, ecdf, poisson_dataset, seeded_rng
from clipless.stats.counting import best_branching, factorization_coefficients
from clipless.stats.quantiles import quantiles, rank_error

Q9 = np.arange(1, 10) / 10
Q99 = np.arange(1, 100) / 100


def adult_ages() -> np.ndarray | None:
    root = Path(os.environ.get("CLIPLESS_DATA", Path.home() / ".cache" / "clipless"))
    path = root / "adult" / "adult.data"
    if not path.is_file():
        return None
    ages = []
    for line in path.read_text().splitlines():
        parts = line.split(",")
        if len(parts) > 1:
            ages.append(float(parts[0]))
    return np.array(ages)


# ---------------------------------------------------------------------------------------------
# OpenDP
# ---------------------------------------------------------------------------------------------


class OpenDPTree:
    """OpenDP's consistent b-ary tree CDF, calibrated by OpenDP itself."""

    def __init__(self, num_leaves: int, b: int, neighbouring: str, noise: str, budget: float):
        import opendp.prelude as dp

        dp.enable_features("contrib")
        self.dp = dp
        dom = dp.vector_domain(dp.atom_domain(T=int))
        if noise == "laplace":
            met = dp.l1_distance(T=int)
            tree = dp.t.make_b_ary_tree(dom, met, leaf_count=num_leaves, branching_factor=b)
            d_in = 1 if neighbouring == "add_remove" else 2
            self.meas = dp.binary_search_chain(
                lambda s: tree >> dp.m.then_laplace(s), d_in=d_in, d_out=budget
            )
        else:
            met = dp.l2_distance(T=int)
            tree = dp.t.make_b_ary_tree(dom, met, leaf_count=num_leaves, branching_factor=b)
            if neighbouring != "add_remove":
                raise ValueError("OpenDP zCDP compared under add/remove only")
            self.meas = dp.binary_search_chain(
                lambda s: tree >> dp.m.then_gaussian(s), d_in=1, d_out=budget
            )
        self.consistent = dp.t.make_consistent_b_ary_tree(b)
        self.cdf = dp.t.make_cdf()
        self.b = b

    def leaves(self, counts: list[int]) -> np.ndarray:
        return np.asarray(self.consistent(self.meas(counts)), dtype=np.float64)

    def cdf_values(self, leaves: np.ndarray) -> np.ndarray:
        return np.asarray(self.cdf(leaves.tolist()), dtype=np.float64)


def opendp_quantiles(leaves: np.ndarray, thresholds: np.ndarray, qs: np.ndarray) -> np.ndarray:
    import opendp.prelude as dp

    edges = np.concatenate([[thresholds[0] - 0.5], thresholds + 0.5]).tolist()
    f = dp.t.make_quantiles_from_counts(bin_edges=edges, alphas=qs.tolist(), interpolation="linear")
    return np.asarray(f(np.maximum(leaves, 0.0).tolist()), dtype=np.float64)


def diffprivlib_quantiles(values: np.ndarray, lo: float, hi: float, qs: np.ndarray, eps: float):
    import sys
    import types
    import warnings

    # diffprivlib 0.6.6's package __init__ imports its models, which fail against current
    # scikit-learn (sklearn.tree._tree.DOUBLE); the quantile tool does not need them.
    sys.modules.setdefault("diffprivlib.models", types.ModuleType("diffprivlib.models"))
    from diffprivlib.tools import quantile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(quantile(values, qs, epsilon=eps, bounds=(lo, hi)), dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------


def _cdf_errors(vals: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    sq = (vals - exact) ** 2
    return float(sq.mean()), float(sq.max())


def run_pure(
    name: str,
    values: np.ndarray,
    grid: Grid,
    eps: float,
    nb: str,
    repeats: int,
    seed: int,
    dpl_repeats: int = 3,
) -> dict[str, Any]:
    counts = grid.counts(values)
    n = values.size
    exact = np.cumsum(counts) / n
    N = len(grid)
    rng = seeded_rng(seed)
    rows: dict[str, dict[str, list[float]]] = {}

    def add(key: str, metric: str, value: float) -> None:
        rows.setdefault(key, {}).setdefault(metric, []).append(value)

    thr = grid.thresholds

    def snap(v: np.ndarray) -> np.ndarray:
        i = np.clip(np.searchsorted(thr, v), 1, N - 1)
        return thr[i - 1 + (np.abs(thr[i] - v) < np.abs(thr[i - 1] - v))]

    kstar = best_branching(N, nb, "laplace", eps)  # type: ignore[arg-type]
    odp_bs = sorted({2, 4, 8, 16})
    odp = {b: OpenDPTree(N, b, nb, "laplace", eps) for b in odp_bs}
    for rep in range(repeats):
        for mech in ("binary", "k-ary"):
            state = rng.getstate()  # the smoothed release below reuses this noise: paired
            t0 = time.perf_counter()
            F = ecdf(values, grid, eps, nb, None, rng=rng, mechanism=mech)  # type: ignore[arg-type]
            add(mech, "time", time.perf_counter() - t0)
            m, mx = _cdf_errors(F.values, exact)
            add(mech, "mse", m)
            add(mech, "max", mx)
            rng.setstate(state)
            sm = ecdf(values, grid, eps, nb, "isotonic", rng=rng, mechanism=mech)  # type: ignore[arg-type]
            add(mech, "mse_iso", _cdf_errors(sm.values, exact)[0])
        t0 = time.perf_counter()
        qr = quantiles(values, grid, Q99, eps, nb, rng=rng)  # type: ignore[arg-type]
        add("k-ary", "qtime", time.perf_counter() - t0)
        add("k-ary", "rank99", float(rank_error(values, qr.values, Q99).mean()))
        add("k-ary", "rank9", float(rank_error(values, qr.cdf.quantile(Q9), Q9).mean()))
        for b, tree in odp.items():
            t0 = time.perf_counter()
            leaves = tree.leaves(counts.tolist())
            cdf = tree.cdf_values(leaves)
            add(f"opendp b={b}", "time", time.perf_counter() - t0)
            m, mx = _cdf_errors(cdf, exact)
            add(f"opendp b={b}", "mse", m)
            add(f"opendp b={b}", "max", mx)
            q99 = opendp_quantiles(leaves, grid.thresholds, Q99)
            q9 = opendp_quantiles(leaves, grid.thresholds, Q9)
            add(f"opendp b={b}", "rank99", float(rank_error(values, q99, Q99).mean()))
            add(f"opendp b={b}", "rank9", float(rank_error(values, q9, Q9).mean()))
            # interpolated values fall between integer data values (ties): also snap them to the
            # nearest grid threshold, which can only help on integer data
            add(f"opendp b={b}", "rank99_snap", float(rank_error(values, snap(q99), Q99).mean()))
            add(f"opendp b={b}", "rank9_snap", float(rank_error(values, snap(q9), Q9).mean()))
        if rep < dpl_repeats and name.startswith("adult"):  # ~13 s per call at n = 32561
            lo, hi = float(grid.thresholds[0]), float(grid.thresholds[-1])
            t0 = time.perf_counter()
            d99 = diffprivlib_quantiles(values, lo, hi, Q99, eps)
            add("diffprivlib", "qtime", time.perf_counter() - t0)
            d9 = diffprivlib_quantiles(values, lo, hi, Q9, eps)
            add("diffprivlib", "rank99", float(rank_error(values, d99, Q99).mean()))
            add("diffprivlib", "rank9", float(rank_error(values, d9, Q9).mean()))
            add("diffprivlib", "rank99_snap", float(rank_error(values, snap(d99), Q99).mean()))
            add("diffprivlib", "rank9_snap", float(rank_error(values, snap(d9), Q9).mean()))
    out = {k: {m: float(np.mean(v)) for m, v in d.items()} for k, d in rows.items()}
    best_b = min(odp_bs, key=lambda b: out[f"opendp b={b}"]["mse"])
    return {
        "data": name,
        "N": N,
        "n": int(n),
        "epsilon": eps,
        "neighbouring": nb,
        "k_default": kstar,
        "opendp_best_b": best_b,
        "rows": out,
    }


def run_zcdp(values: np.ndarray, grid: Grid, rho: float, repeats: int, seed: int) -> dict[str, Any]:
    """Noise-only per-threshold variance (counts^2) under rho-zCDP, add/remove."""
    counts = grid.counts(values)
    N = len(grid)
    truth = np.cumsum(counts)
    rng = seeded_rng(seed)
    res: dict[str, Any] = {"N": N, "rho": rho}
    for mech in ("binary", "k-ary", "factorization"):
        errs, times = [], []
        F = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            F = ecdf(
                values,
                grid,
                None,
                "add_remove",
                None,
                "gaussian",
                rng=rng,
                rho=rho,
                mechanism=mech,  # type: ignore[arg-type]
            )
            times.append(time.perf_counter() - t0)
            errs.append(F.counts - truth)
        e = np.array(errs)
        assert F is not None
        res[mech] = {
            "measured_var": float((e**2).mean()),
            "exact_var": float(np.mean(F.variance)),
            "time": float(np.mean(times)),
        }
        if mech == "factorization":
            c = factorization_coefficients(N)
            s_cum = np.cumsum(c * c)
            # in units of 1/(2 rho): exactly S(N) mean_i S(i) up to the 2^-20 rounding of L
            res[mech]["2rho_var"] = 2 * rho * res[mech]["measured_var"]
            res[mech]["theory_S_meanS"] = float(s_cum[-1] * np.mean(s_cum))
            res[mech]["theory_1_lnN_pi_sq"] = float((1 + math.log(N) / math.pi) ** 2)
    try:
        tree = OpenDPTree(N, 2, "add_remove", "gaussian", rho)
        errs = []
        t0 = time.perf_counter()
        for _ in range(repeats):
            errs.append(np.cumsum(tree.leaves(counts.tolist()))[:N] - truth)
        res["opendp b=2"] = {
            "measured_var": float((np.array(errs) ** 2).mean()),
            "time": (time.perf_counter() - t0) / max(repeats, 1),
        }
    except Exception as exc:  # pragma: no cover - depends on the OpenDP version
        res["opendp b=2"] = {"error": str(exc)}
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 12, 15], help="log2 N values")
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--zcdp-repeats", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--diffprivlib-repeats", type=int, default=3, help="slow: ~13 s per call")
    p.add_argument("--out", default=None, help="JSON file for the raw numbers")
    args = p.parse_args()
    results: dict[str, Any] = {"pure": [], "zcdp": [], "adult": None}
    datasets: list[tuple[str, np.ndarray, Grid]] = []
    for s in args.sizes:
        N = 1 << s
        datasets.append(
            (f"X_pois(1), N=2^{s}", poisson_dataset(1.0, N, seed=args.seed), Grid(1, N, size=N))
        )
    ages = adult_ages()
    if ages is not None:
        datasets.append(("adult ages", ages, Grid(17, 90, size=74)))
        results["adult"] = "adult/adult.data from the dataset cache"
    else:
        print("Adult not in the dataset cache: skipped (clipless data fetch adult)")
    for name, values, grid in datasets:
        for nb in ("add_remove", "replace_one"):
            for eps in args.epsilons:
                r = run_pure(
                    name, values, grid, eps, nb, args.repeats, args.seed, args.diffprivlib_repeats
                )
                results["pure"].append(r)
                print(json.dumps(r), flush=True)
    for s in args.sizes:
        N = 1 << s
        vals = poisson_dataset(1.0, N, seed=args.seed)
        z = run_zcdp(vals, Grid(1, N, size=N), 0.5, args.zcdp_repeats, args.seed)
        results["zcdp"].append(z)
        print(json.dumps(z), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print_tables(results)


def print_tables(results: dict[str, Any]) -> None:
    print(
        "\n| data | nbr | eps | n | clipless binary | clipless k-ary (k) | OpenDP best b (b) |"
        " k-ary/OpenDP | k-ary+iso | max sq err k-ary / OpenDP | time ms k-ary / OpenDP |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["pure"]:
        rows, b = r["rows"], r["opendp_best_b"]
        o, k, bi = rows[f"opendp b={b}"], rows["k-ary"], rows["binary"]
        n2 = r["n"] ** 2
        print(
            f"| {r['data']} | {r['neighbouring']} | {r['epsilon']:g} | {r['n']} | "
            f"{bi['mse'] * n2:.4g} | {k['mse'] * n2:.4g} ({r['k_default']}) | "
            f"{o['mse'] * n2:.4g} ({b}) | {k['mse'] / o['mse']:.2f} | {k['mse_iso'] * n2:.4g} | "
            f"{k['max'] * n2:.4g} / {o['max'] * n2:.4g} | "
            f"{k['time'] * 1e3:.1f} / {o['time'] * 1e3:.1f} |"
        )
    print(
        "\n| data | nbr | eps | rank err 9 q: k-ary / OpenDP / diffprivlib |"
        " rank err 99 q: k-ary / OpenDP / diffprivlib (brackets: snapped to the grid) |"
    )
    print("|---|---|---|---|---|")
    for r in results["pure"]:
        rows, b = r["rows"], r["opendp_best_b"]
        o, k = rows[f"opendp b={b}"], rows["k-ary"]
        d = rows.get("diffprivlib", {})
        d9 = f"{d['rank9']:.1f} ({d.get('rank9_snap', float('nan')):.1f})" if d else "-"
        d99 = f"{d['rank99']:.1f} ({d.get('rank99_snap', float('nan')):.1f})" if d else "-"
        o9 = f"{o['rank9']:.1f} ({o.get('rank9_snap', float('nan')):.1f})"
        o99 = f"{o['rank99']:.1f} ({o.get('rank99_snap', float('nan')):.1f})"
        print(
            f"| {r['data']} | {r['neighbouring']} | {r['epsilon']:g} | "
            f"{k['rank9']:.1f} / {o9} / {d9} | {k['rank99']:.1f} / {o99} / {d99} |"
        )
    print(
        "\n| N | rho | mean var (counts^2): binary / k-ary / factorization / OpenDP b=2 |"
        " factorization, 2 rho var: measured / S(N) mean_i S(i) / (1 + ln N / pi)^2 |"
        " time ms: k-ary / factorization |"
    )
    print("|---|---|---|---|---|")
    for z in results["zcdp"]:
        f = z["factorization"]
        o = z.get("opendp b=2", {}).get("measured_var", float("nan"))
        print(
            f"| {z['N']} | {z['rho']:g} | {z['binary']['measured_var']:.4g} / "
            f"{z['k-ary']['measured_var']:.4g} / {f['measured_var']:.4g} / {o:.4g} | "
            f"{f['2rho_var']:.4g} / {f['theory_S_meanS']:.4g} / {f['theory_1_lnN_pi_sq']:.4g} | "
            f"{z['k-ary']['time'] * 1e3:.1f} / {f['time'] * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
