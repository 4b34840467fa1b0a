"""The smooth binary mechanism (Andersson & Pagh 2023) next to the other counting mechanisms.

Exact per-threshold variances of the prefix counts (``CountRelease.variance`` /
``tree.prefix_variance``, exact given the discrete noise parameters; no Monte Carlo needed),
add/remove, before normalisation: mean and max over the ``N`` thresholds, in counts^2, for
``smooth-binary``, ``factorization``, ``k-ary`` (default ``k``) and the binary tree (least
squares), under rho-zCDP (``--rho``) and pure epsilon-DP (``--epsilon``). A Monte Carlo check
of the smooth binary variance (``--repeats`` releases at the smallest size) is printed too.

Usage::

    PYTHONPATH=src python benchmarks/smooth_binary.py --sizes 10 12 15 18 --repeats 200
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from clipless.stats import seeded_rng
from clipless.stats.counting import (
    CountRelease,
    release_prefix_counts,
    smooth_binary_sensitivity,
    smooth_binary_shape,
)
from clipless.stats.tree import TreeRelease, prefix_variance


def _var(rel: TreeRelease | CountRelease) -> np.ndarray:
    if isinstance(rel, CountRelease):
        return np.asarray(rel.variance)
    return np.asarray(prefix_variance(rel, consistent=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 12, 15, 18])
    ap.add_argument("--rho", type=float, default=0.5)
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    print(
        "| N | h, k, Delta | privacy | smooth-binary mean (= max) | factorization mean / max "
        "| k-ary mean / max | binary mean / max | smooth / factorization | smooth / binary "
        "| smooth time ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in args.sizes:
        N = 1 << e
        counts = np.zeros(N, dtype=np.int64)
        h, k = smooth_binary_shape(N)
        delta = smooth_binary_sensitivity(N, "add_remove")
        for noise, eps, rho in (("gaussian", None, args.rho), ("laplace", args.epsilon, None)):
            row = {}
            t_smooth = 0.0
            mechs = ["smooth-binary", "k-ary", "binary"]
            if noise == "gaussian":
                mechs.insert(1, "factorization")
            for mech in mechs:
                t0 = time.perf_counter()
                rel = release_prefix_counts(
                    counts, eps, "add_remove", noise, seeded_rng(e), rho, mechanism=mech
                )
                if mech == "smooth-binary":
                    t_smooth = 1e3 * (time.perf_counter() - t0)
                v = _var(rel)
                row[mech] = (float(v.mean()), float(v.max()))
            sm = row["smooth-binary"][0]
            fa = row.get("factorization")
            fa_txt = f"{fa[0]:.4g} / {fa[1]:.4g}" if fa else "-"
            ratio = f"{sm / fa[0]:.2f}" if fa else "-"
            priv = f"rho={args.rho}" if noise == "gaussian" else f"eps={args.epsilon}"
            print(
                f"| 2^{e} | {h}, {k}, {delta} | {priv} | {sm:.4g} | {fa_txt} "
                f"| {row['k-ary'][0]:.4g} / {row['k-ary'][1]:.4g} "
                f"| {row['binary'][0]:.4g} / {row['binary'][1]:.4g} | {ratio} "
                f"| {sm / row['binary'][0]:.2f} | {t_smooth:.0f} |"
            )
    # Monte Carlo check of the stated (flat) variance
    N = 1 << min(args.sizes)
    counts = np.random.default_rng(0).poisson(3.0, N)
    rng = seeded_rng(1)
    errs = np.stack(
        [
            release_prefix_counts(
                counts, None, "add_remove", "gaussian", rng, args.rho, mechanism="smooth-binary"
            ).prefix_counts
            - np.cumsum(counts)
            for _ in range(args.repeats)
        ]
    )
    rel = release_prefix_counts(
        counts, None, "add_remove", "gaussian", rng, args.rho, mechanism="smooth-binary"
    )
    emp = errs.var(axis=0)
    print(
        f"\nMonte Carlo, N = 2^{min(args.sizes)}, {args.repeats} releases, rho = {args.rho}: "
        f"stated variance {float(rel.variance[0]):.4g} at every threshold; empirical mean "
        f"{emp.mean():.4g}, 5th-95th percentile over thresholds {np.percentile(emp, 5):.4g}-"
        f"{np.percentile(emp, 95):.4g}"
    )


if __name__ == "__main__":
    main()
