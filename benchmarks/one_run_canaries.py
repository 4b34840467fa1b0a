"""One-run audit with white-box gradient canaries (issue 37, RESULTS.md section 33e).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/one_run_canaries.py

For every rigorous scaling mode and noise allocation and claimed epsilon 1, 2, 4, 8 (delta 1e-5,
q = 1, one step, 4096 canaries, the planned number of guesses), the one-run lower bound of
``clipless.audit.audit_gradient_canaries`` on seeds 0-2; then the same with the noise scaled
down 4x (a broken mechanism the audit must catch). Prints one Markdown table row per setting.
``--canaries 16384 --modes per-sample --noises global``: the larger run of section 33e;
``--expected``: the bound expected when the mechanism is exactly as private as claimed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from clipless import mechanism
from clipless.audit import audit_gradient_canaries


@contextmanager
def noise_scaled(factor: float) -> Iterator[None]:
    """Every plan's standard deviations times ``factor`` (the claim unchanged)."""
    real = mechanism.plan_step

    def broken(*args: Any, **kwargs: Any) -> mechanism.NoisePlan:
        plan = real(*args, **kwargs)
        stds = MappingProxyType({k: v * factor for k, v in plan.stds.items()})
        return dataclasses.replace(plan, stds=stds)

    mechanism.plan_step = broken
    try:
        yield
    finally:
        mechanism.plan_step = real


def expected_bounds(canaries: tuple[int, ...]) -> None:
    """The bound expected at the planned guesses for a mechanism exactly as private as claimed:
    scores ``mu b + N(0, 1)``, ``mu`` the Gaussian-DP parameter of the claim, the expected
    fraction of correct guesses (rounded down)."""
    import math

    from scipy import stats
    from scipy.optimize import brentq

    from clipless.audit import planned_guesses
    from clipless.audit.bounds import gaussian_dp_epsilon
    from clipless.audit.one_run import one_run_epsilon_lower_bound

    heads = " | ".join(f"m = {m}: expected bound (r)" for m in canaries)
    print(f"| claimed eps | mu | {heads} |")
    print("|---|---|" + "---|" * len(canaries))
    for epsilon in (1.0, 2.0, 4.0, 8.0):
        mu = brentq(lambda x, e=epsilon: gaussian_dp_epsilon(x, 1e-5) - e, 0.01, 20.0)
        cells = []
        for m in canaries:
            r = planned_guesses(mu, m, 1e-5, 0.95)
            frac = r / 2 / m
            t = brentq(lambda t, u=mu, f=frac: 0.5 * (stats.norm.sf(t - u) + stats.norm.sf(t)) - f,
                       -50.0, 50.0)  # fmt: skip
            hi, lo = stats.norm.sf(t - mu), stats.norm.sf(t)
            v = math.floor(r * hi / (hi + lo))
            cells.append(f"{one_run_epsilon_lower_bound(m, r, v, 1e-5, 0.95):.2f} ({r})")
        print(f"| {epsilon:g} | {mu:.4f} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=4096)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["per-sample", "bound", "threshold"])
    parser.add_argument("--noises", nargs="+", default=["global", "per-layer"])
    parser.add_argument(
        "--expected", action="store_true", help="only the expected bounds at 4096, 16384, 65536"
    )
    args = parser.parse_args()
    if args.expected:
        expected_bounds((4096, 16384, 65536))
        return
    print("| mode | noise | noise scale | claimed eps | bounds (seeds) | guesses | correct |")
    print("|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    settings = [(m, n, 1.0) for m in args.modes for n in args.noises]
    settings.append(("per-sample", "global", 0.25))
    for mode, noise, factor in settings:
        for epsilon in (1.0, 2.0, 4.0, 8.0):
            results = []
            with noise_scaled(factor):
                for seed in range(args.seeds):
                    results.append(
                        audit_gradient_canaries(
                            epsilon, canaries=args.canaries, mode=mode, noise=noise, seed=seed
                        )
                    )
            bounds = ", ".join(f"{r.epsilon_lower_bound:.2f}" for r in results)
            print(
                f"| {mode} | {noise} | {factor:g} | {results[0].claimed_epsilon:.3f} | {bounds} "
                f"| {results[0].guesses} | {', '.join(str(r.correct) for r in results)} |",
                flush=True,
            )
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
