"""Privacy audits (issue 13): every number of RESULTS.md section "Privacy audits".

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/audit.py --out benchmarks/out/audit.json

1. Mechanism-level audit of one training step (``clipless.audit.audit_step``) for every scaling
   mode, with histograms of the two score distributions (``benchmarks/out/audit_<mode>.png``).
2. Exact privacy loss of the ECDF tree release over every neighbouring pair of small domains
   (``clipless.audit.audit_ecdf``), and sampled audits of the discrete samplers.
3. One-run audits (``clipless.audit.audit_one_run``) on breast-cancer at the calibrated noise, and
   on a synthetic task with the noise removed (a broken pipeline the audit must catch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np


def step_audits(trials: int, out_dir: Path) -> list[dict[str, Any]]:
    from clipless.audit import audit_step

    rows = []
    settings = [
        ("per-sample", "global", 1),
        ("bound", "global", 1),
        ("threshold", "global", 1),
        ("per-sample", "per-layer", 1),
        ("per-sample", "global", 10),
        ("batch-max", "global", 1),
    ]
    for mode, noise, steps in settings:
        started = time.perf_counter()
        result = audit_step(
            mode, noise=noise, trials=trials, steps=steps, seed=13, allow_unproven=True
        )
        elapsed = time.perf_counter() - started
        tag = f"{mode}_{noise}_{steps}"
        result.plot(out_dir / f"audit_{tag}.png")
        for line in result.lines():
            print(line)
        rows.append(
            {
                "mode": mode,
                "noise": noise,
                "steps": steps,
                "trials": trials,
                "claimed_epsilon": result.claimed_epsilon,
                "lower_bound": result.epsilon_lower_bound,
                "sensitivity_ratio": result.sensitivity_ratio,
                "tpr": result.test.tpr,
                "fpr": result.test.fpr,
                "proven": result.proven,
                "seconds": elapsed,
            }
        )
    return rows


def statistics_audits() -> dict[str, Any]:
    from clipless.audit import audit_ecdf, audit_sampler
    from clipless.stats import seeded_rng

    ecdf_rows = []
    for size in (4, 8, 16):
        for neighbouring in ("replace_one", "add_remove"):
            for noise in ("laplace", "gaussian"):
                kwargs: dict[str, Any] = (
                    {"epsilon": 1.0} if noise == "laplace" else {"epsilon": None, "rho": 0.5}
                )
                started = time.perf_counter()
                result = audit_ecdf(list(range(size)), 2, neighbouring=neighbouring, **kwargs)
                ecdf_rows.append(
                    {
                        "thresholds": size,
                        "neighbouring": neighbouring,
                        "noise": noise,
                        "pairs": result.pairs,
                        "worst": result.worst,
                        "claim": 1.0 if noise == "laplace" else 0.5,
                        "delta_at_claim": result.delta_at_claim,
                        "holds": result.holds,
                        "seconds": time.perf_counter() - started,
                    }
                )
                print(ecdf_rows[-1])
    samplers = []
    for kind, parameter in (("laplace", 2.5), ("laplace", 10.0), ("gaussian", 4.0)):
        result = audit_sampler(kind, parameter, 400_000, rng=seeded_rng(1))
        samplers.append(
            {
                "kind": kind,
                "parameter": parameter,
                "samples": 400_000,
                "g_statistic": result.g_statistic,
                "dof": result.degrees_of_freedom,
                "p_value": result.p_value,
                "claimed_epsilon": result.claimed_epsilon,
                "lower_bound": result.epsilon_lower_bound,
            }
        )
        print(samplers[-1])
    return {"ecdf": ecdf_rows, "samplers": samplers}


def one_run_audits() -> list[dict[str, Any]]:
    from clipless import mechanism
    from clipless.audit import audit_one_run
    from clipless.data import load_dataset

    train, test, _ = load_dataset("breast-cancer")
    x, y = (t.numpy() for t in train.tensors)
    xt, yt = (t.numpy() for t in test.tensors)
    rows = []
    for epsilon in (1.0, 8.0):
        started = time.perf_counter()
        result = audit_one_run(
            x, y, canaries=400, guesses=100, epsilon=epsilon, epochs=30, x_test=xt, y_test=yt
        )
        rows.append(
            {
                "task": "breast-cancer",
                "noise": "calibrated",
                **dataclasses.asdict(result),
                "seconds": time.perf_counter() - started,
            }
        )
        print(rows[-1])
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(100, 10))
    ys = (xs @ rng.normal(size=10) > 0).astype(int)
    real = mechanism.plan_step

    def broken(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        stds = MappingProxyType({k: v * 1e-3 for k, v in plan.stds.items()})
        return dataclasses.replace(plan, stds=stds)

    for label, planner in (("calibrated", real), ("x1e-3 (broken)", broken)):
        mechanism.plan_step = planner  # type: ignore[assignment]
        try:
            started = time.perf_counter()
            result = audit_one_run(
                xs,
                ys,
                canaries=400,
                guesses=80,
                epsilon=1.0,
                epochs=60,
                batch_size=50,
                hidden=(64, 64),
                lr=0.2,
                x_test=xs,
                y_test=ys,
            )
        finally:
            mechanism.plan_step = real  # type: ignore[assignment]
        rows.append(
            {
                "task": "synthetic n=100, d=10",
                "noise": label,
                **dataclasses.asdict(result),
                "seconds": time.perf_counter() - started,
            }
        )
        print(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/out/audit.json")
    parser.add_argument("--trials", type=int, default=100_000)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "step": step_audits(args.trials, out.parent),
        "statistics": statistics_audits(),
        "one_run": one_run_audits(),
    }
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
