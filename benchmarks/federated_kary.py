"""Federated error against the central default's, on the same data (issue 37, item 3).

Data: a lognormal + normal mixture (``n`` values split over ``--owners`` owners) on a grid of
``N`` thresholds. For every cell of {N} x {epsilon} x {replace-one, add/remove}:

* exact mean per-threshold variance (counts^2) of the released prefix counts: the federated
  default (``federated_ecdf``, protocol ``shares``, dealer), the central default
  (``release_prefix_counts``) and the federated binary tree (the previous federated release);
* the measured mean squared CDF error over ``--repeats`` releases (fresh keys / fresh noise),
  federated default against central default, and a bit-for-bit check against
  ``ecdf(node_noise=fed.noise_source)`` on the first repeat;
* wall time per federated release.

Usage::

    python benchmarks/federated_kary.py --sizes 12 15 --epsilons 0.1 1 10 --repeats 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from clipless.federated import federated_ecdf
from clipless.stats import Grid, ecdf
from clipless.stats.counting import release_prefix_counts
from clipless.stats.tree import TreeRelease, prefix_variance


def mixture(n: int, seed: int) -> np.ndarray:
    gen = np.random.default_rng(seed)
    k = gen.random(n) < 0.6
    return np.where(k, gen.lognormal(0.0, 0.5, n), gen.normal(4.0, 0.8, n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[12, 15], help="log2 N values")
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    p.add_argument("--n", type=int, default=20000, help="number of values")
    p.add_argument("--owners", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    values = mixture(args.n, 0)
    owners = np.array_split(values, args.owners)
    print(
        "| N | relation | epsilon | fed default var | central default var | fed binary var "
        "| fed / central MSE (measured) | bit for bit | fed time (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for lg in args.sizes:
        N = 1 << lg
        grid = Grid(-1.0, 7.0, size=N)
        counts = grid.counts(values)
        exact = np.cumsum(counts) / values.size
        for nb in ("replace_one", "add_remove"):
            for eps in args.epsilons:
                fed_mse, cen_mse, times = [], [], []
                same = True
                for rep in range(args.repeats):
                    t0 = time.perf_counter()
                    fed = federated_ecdf(owners, grid, eps, neighbouring=nb, smoothing=None)  # type: ignore[arg-type]
                    times.append(time.perf_counter() - t0)
                    assert fed.ecdf is not None and fed.release is not None
                    fed_mse.append(float(np.mean((fed.ecdf.values - exact) ** 2)))
                    cen = ecdf(values, grid, eps, nb, None)  # type: ignore[arg-type]
                    cen_mse.append(float(np.mean((cen.values - exact) ** 2)))
                    if rep == 0:
                        ref = ecdf(values, grid, eps, nb, None, node_noise=fed.noise_source)  # type: ignore[arg-type]
                        same = ref.values.tobytes() == fed.ecdf.values.tobytes()
                        fed_var = float(np.mean(fed.release.variance))  # type: ignore[union-attr]
                        rel = release_prefix_counts(counts, eps, nb)  # type: ignore[arg-type]
                        cen_var = float(np.mean(rel.variance))  # type: ignore[union-attr]
                        binary = federated_ecdf(
                            owners, grid, eps, neighbouring=nb, smoothing=None, mechanism="binary",  # type: ignore[arg-type]
                        )  # fmt: skip
                        assert isinstance(binary.release, TreeRelease)
                        bin_var = float(np.mean(prefix_variance(binary.release, consistent=True)))
                print(
                    f"| 2^{lg} | {nb} | {eps:g} | {fed_var:.4g} | {cen_var:.4g} | {bin_var:.4g} "
                    f"| {np.mean(fed_mse) / np.mean(cen_mse):.2f} | {same} "
                    f"| {np.mean(times):.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
