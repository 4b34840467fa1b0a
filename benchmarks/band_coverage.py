"""Empirical coverage of the plots' noise-only band (DPECDF.band, +-1.96 sd).

For each seed: one release of an ECDF of fixed data; the fraction of thresholds (the last,
exact one excluded) where the exact ECDF lies inside the band. Printed per mechanism and
smoothing; 0.95 is the nominal coverage of the unsmoothed Gaussian approximation.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/band_coverage.py
"""

from __future__ import annotations

import numpy as np

from clipless.stats import Grid, ecdf, seeded_rng


def coverage(mechanism: str, smoothing: str | None, neighbouring: str, seeds: int = 200) -> float:
    data = np.random.default_rng(0).binomial(100, 0.3, 2000).astype(np.float64)
    grid = Grid(0, 100, size=101)
    exact = np.cumsum(grid.counts(data)) / data.size
    inside = []
    for seed in range(seeds):
        f = ecdf(
            data, grid, 1.0, neighbouring, smoothing, rng=seeded_rng(seed), mechanism=mechanism
        )  # type: ignore[arg-type]
        lo, hi = f.band()
        inside.append(np.mean((exact[:-1] >= lo[:-1]) & (exact[:-1] <= hi[:-1])))
    return float(np.mean(inside))


def main() -> None:
    print("epsilon 1, n 2000 (Binomial(100, 0.3)), grid 0..100 (101 thresholds), 200 seeds")
    for nb in ("replace_one", "add_remove"):
        for mech in ("k-ary", "binary"):
            for sm in (None, "isotonic"):
                cov = coverage(mech, sm, nb)
                print(f"{nb:12s} {mech:7s} smoothing={sm!s:9s} coverage {cov:.3f}")


if __name__ == "__main__":
    main()
