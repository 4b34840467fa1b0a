"""Step time and step peak memory against batch size: clipless vs its non-private twin (issue 11).

A thin driver over :mod:`train_speed` (same models, same runners, same interleaved timing and
the same profiler-based memory measure; see that module's docstring for the method). Defaults
are chosen to finish in a few minutes on two shared cores:

* models ``mlp`` (``InputNorm -> 784 -> 1024 -> 1024 -> 10``, GroupSort, no bias) and ``cnn``
  (two 3x3 conv layers, 32 and 64 channels, L2-norm pooling, dense head), inputs 1x28x28;
* batch sizes 64, 256, 1024, 4096 (``--batch-sizes``; the CNN stops at ``--cnn-max-batch``,
  default 1024, because one non-private CNN step at 4096 takes ~8 s here);
* configurations ``nonprivate`` (the :func:`clipless.nn.vanilla_export` twin), ``clipless-ps``
  (``scaling="per-sample"``), ``clipless-bound`` (``scaling="bound"``), and ``opacus`` /
  ``opacus-ghost`` when Opacus is importable (the ``bench`` extra);
* 3 interleaved repetitions after 2 warm-up steps (``--reps``), each about 0.2 s of steps;
  reported: median step time and the median of the paired ratios to the non-private step;
* a cProfile breakdown of the clipless step (noise, inner step, projection, bound refresh,
  accounting, exact certifications) at batch 256, and the cost of the per-forward weight
  snapshot of :class:`clipless.optim.DPOptimizer`.

Run ``python benchmarks/speed.py`` (or ``make bench-speed``); results go to stdout (Markdown)
and ``benchmarks/out/speed.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_speed as ts

OUT = Path(__file__).resolve().parent / "out" / "speed.json"


def snapshot_cost(model: torch.nn.Module, n: int = 20) -> dict[str, float]:
    """Median seconds of one clone of every parameter and one ``torch.equal`` check of them."""
    params = [p for p in model.parameters() if p.requires_grad]
    clones, checks = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        copy = [p.detach().clone() for p in params]
        t1 = time.perf_counter()
        ok = all(torch.equal(p.detach(), c) for p, c in zip(params, copy, strict=True))
        t2 = time.perf_counter()
        assert ok
        clones.append(t1 - t0)
        checks.append(t2 - t1)
    return {"clone_s": statistics.median(clones), "equal_s": statistics.median(checks)}


def certification_costs(reps: int = 5) -> dict[str, dict[str, float]]:
    """Median seconds and tightness of one certification of the MLP's two wide layers, per method.

    Weights: orthogonal plus a DP-sized perturbation (relative spectral size ~0.3, as one noisy
    step at the benchmark's learning rate), float32 as in training; methods of
    :func:`clipless.norms.dense_norm` interleaved; tightness = bound / exact SVD norm - 1.
    """
    from clipless.norms import dense_norm

    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for rows, cols in ((1024, 784), (1024, 1024)):
        q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))
        w = (q + 0.3 * torch.randn(rows, cols, generator=gen, dtype=torch.float64) / 64).float()
        exact = float(torch.linalg.matrix_norm(w.double(), ord=2))
        times: dict[str, list[float]] = {}
        bounds: dict[str, float] = {}
        for _ in range(reps):
            for method in ("svd", "eigh", "cholesky"):
                t0 = time.perf_counter()
                bounds[method] = dense_norm(w, method=method)  # type: ignore[arg-type]
                times.setdefault(method, []).append(time.perf_counter() - t0)
        for method, ts_ in times.items():
            out[f"{rows}x{cols}/{method}"] = {
                "median_s": statistics.median(ts_),
                "tightness": bounds[method] / exact - 1.0,
            }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(ts.MODELS), choices=ts.MODELS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[64, 256, 1024, 4096])
    p.add_argument("--cnn-max-batch", type=int, default=1024)
    p.add_argument("--configs", nargs="+", default=None, choices=ts.CONFIGS)
    p.add_argument("--certify-every", type=int, default=10, help="for clipless-carried")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--target-seconds", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--profile-batch", type=int, default=256)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument(
        "--certification-only",
        action="store_true",
        help="only time one certification of the MLP's wide layers per dense_norm method",
    )
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    try:  # the Cholesky certificate runs in SciPy's BLAS: give it the same number of threads
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=args.threads)
    except ImportError:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    certify = certification_costs()
    print("# one certification of a wide MLP layer (median ms; bound / exact - 1):")
    for key, v in certify.items():
        print(f"  {key:22s} {1000 * v['median_s']:8.1f} ms   {v['tightness']:.2e}", flush=True)
    if args.certification_only:
        return
    configs = args.configs or ["nonprivate", "clipless-ps", "clipless-bound"]
    if args.configs is None and importlib.util.find_spec("opacus") is not None:
        configs += ["opacus", "opacus-ghost"]
    env = ts.environment(args.threads)
    print(f"# speed: {env}", flush=True)
    results: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    for model_name in args.models:
        for batch in args.batch_sizes:
            if model_name == "cnn" and batch > args.cnn_max_batch:
                continue
            xb, yb = ts.synthetic_batch(batch, 0)
            runners = []
            for config in configs:
                try:
                    runners.append(
                        ts.make_runner(
                            config,
                            model_name,
                            xb,
                            yb,
                            sigma=args.sigma,
                            lr=args.lr,
                            seed=0,
                            max_grad_sample_gib=4.0,
                            certify_every=args.certify_every,
                        )
                    )
                except Exception as exc:
                    print(f"  skip {config} ({type(exc).__name__}: {exc})", flush=True)
            timing = ts.time_steps(runners, args.reps, args.warmup, args.target_seconds)
            times = timing["times"]
            row: dict[str, Any] = {
                "model": model_name,
                "batch": batch,
                "reps": args.reps,
                "loadavg": os.getloadavg(),
                "configs": {},
            }
            for r in runners:
                c: dict[str, Any] = {
                    "median_step_s": statistics.median(times[r.name]),
                    "times_s": times[r.name],
                    "ratio_vs_nonprivate": ts.paired_ratio(times, r.name, "nonprivate"),
                    "ratio_vs_opacus": ts.paired_ratio(times, r.name, "opacus"),
                    "ratio_vs_opacus_ghost": ts.paired_ratio(times, r.name, "opacus-ghost"),
                }
                if not args.no_memory:
                    c["step_peak_bytes"] = ts.step_peak_bytes(r)
                row["configs"][r.name] = c
            results.append(row)
            ts.print_row(row)
            if not args.no_profile and batch == args.profile_batch:
                for r in runners:
                    key = f"{model_name}/B={batch}/{r.name}"
                    if r.name.startswith("clipless"):
                        profiles[key] = ts.profile_clipless(r, xb, yb, n=3)
                        profiles[key]["weight_snapshot"] = snapshot_cost(r.model)
                    elif r.name == "nonprivate":
                        profiles[key] = ts.split_times(r, ts.plain_loss, xb, yb, n=3)
                    else:
                        continue
                    ts.print_profile(key, profiles[key])
                    snap = profiles[key].get("weight_snapshot")
                    if snap:
                        print(
                            f"    weight snapshot per forward: clone {ts.fmt_ms(snap['clone_s'])}"
                            f" ms, check {ts.fmt_ms(snap['equal_s'])} ms"
                        )
            del runners
    env["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "args": vars(args) | {"out": str(args.out)}}
    payload |= {"results": results, "profiles": profiles, "certification": certify}
    args.out.write_text(json.dumps(payload, indent=1, default=str))
    print()
    ts.print_tables(results)
    print(f"\nload average start {env['loadavg_start']}, end {env['loadavg_end']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
