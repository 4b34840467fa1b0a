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

Also the CNNs of the Clipless paper's Figure 4 (``cnn130k``, ``cnn500k``, ``cnn2m``: ~130K, ~500K
and ~2M parameters on 3x32x32 inputs; :data:`train_speed.CIFAR_CNNS`), each up to its
``--max-batch`` (defaults in :data:`MAX_BATCH`: where one step fits in a few seconds on one
core). Outputs besides the tables: one PNG per model (median step time and step peak memory
against batch size, one line per configuration; ``speed_<model>.png`` in ``--plot-dir``) and a
Markdown table of the clipless overhead per step (scaling = clipless forward+backward minus the
non-private one; noise; inner step; projection, of which exact certification; bound refresh;
accounting). ``--quick`` = 2 repetitions, 1 warm-up step, one timed step per repetition, no
certification table. ``--plot-from A.json B.json`` redraws the plots (and tables) from earlier
runs without timing anything.

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
# Largest batch per model by default (one non-private step of cnn2m at B = 64 already takes
# seconds on one core; the sweep must stay within minutes on two shared cores).
MAX_BATCH = {"mlp": 4096, "cnn": 1024, "cnn130k": 1024, "cnn500k": 256, "cnn2m": 64}


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


def certificate_parts(reps: int = 5, n: int = 1024) -> dict[str, float]:
    """Median ms of the parts of one Cholesky certification of an ``n x n`` float32 layer, and of
    the randomised-certificate alternative (docs/speed.md): ``W x`` products and the Chebyshev
    recurrence ``p(A) x`` (``A = W^T W``, ``k = 112`` and ``51`` steps: eps 0.02 and 0.1 at
    ``beta = 1e-12``), float64 and float32. Weights: orthogonal plus DP-sized noise."""
    import numpy as np
    from scipy.linalg import blas, lapack

    from clipless import norms

    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    w32 = (q + 0.3 * torch.randn(n, n, generator=gen, dtype=torch.float64) / 64).float()
    w64 = w32.double()
    level = float(torch.linalg.matrix_norm(w64, ord=2)) ** 2
    gram = blas.dsyrk(1.0, np.asarray(w64.numpy()).T, trans=0, lower=0)
    ritz = norms._top_eigenvalue_estimate(gram)
    assert ritz is not None

    def potrf() -> None:
        b = np.negative(gram, order="F")
        b[np.diag_indices(n)] += level * (1 + 3e-6)
        lapack.dpotrf(b, lower=0, clean=0, overwrite_a=1)

    def chebyshev(w: torch.Tensor, k: int) -> float:
        x = torch.randn(n, dtype=w.dtype, generator=gen)

        def b_op(v: torch.Tensor) -> torch.Tensor:
            return (2.0 / level) * (w.mT @ (w @ v)) - v

        y0, y1 = x, b_op(x)
        for _ in range(k - 1):
            y0, y1 = y1, 2.0 * b_op(y1) - y0
        return float(y1.norm())

    x64 = torch.randn(n, dtype=torch.float64, generator=gen)
    x32 = x64.float()
    parts = {
        "to float64": lambda: w32.to(torch.float64),
        "dsyrk": lambda: blas.dsyrk(1.0, np.asarray(w64.numpy()).T, trans=0, lower=0),
        "ARPACK estimate, cold": lambda: norms._top_eigenvalue_estimate(gram),
        "ARPACK estimate, warm (previous Ritz vector)": lambda: norms._top_eigenvalue_estimate(
            gram, ritz.vector
        ),
        "dpotrf": potrf,
        "dense_norm total": lambda: norms.dense_norm(w32),
        "dsyrk + dpotrf": lambda: (blas.dsyrk(1.0, np.asarray(w64.numpy()).T, trans=0), potrf()),
        "W x float64": lambda: w64 @ x64,
        "W x float32": lambda: w32 @ x32,
        "Chebyshev k=112 float64": lambda: chebyshev(w64, 112),
        "Chebyshev k=51 float64": lambda: chebyshev(w64, 51),
        "Chebyshev k=112 float32": lambda: chebyshev(w32, 112),
        "Chebyshev k=51 float32": lambda: chebyshev(w32, 51),
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(reps):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def print_overhead_table(profiles: dict[str, Any]) -> None:
    """Markdown: where the clipless step's time goes (ms per step), next to the non-private step."""
    rows = []
    for key, prof in profiles.items():
        model, batch, config = key.split("/")
        if not config.startswith("clipless"):
            continue
        plain = profiles.get(f"{model}/{batch}/nonprivate")
        if plain is None:
            continue
        ms = {k: 1000 * v for k, v in prof["step_parts"].items()}
        cert = 1000 * sum(v["seconds_per_step"] for v in prof["certification"].values())
        fb = 1000 * (prof["forward+loss"] + prof["backward"])
        fb_plain = 1000 * (plain["forward+loss"] + plain["backward"])
        step = 1000 * prof["optimizer.step"]
        parts = sum(ms.values())
        total = fb + step
        total_plain = fb_plain + 1000 * plain["optimizer.step"]
        rows.append(
            f"| {model} | {batch[2:]} | {config} | {total_plain:.1f} | {total:.1f} "
            f"({total / total_plain:.2f}x) | {fb - fb_plain:+.1f} "
            f"| {ms['noise (add_noise)']:.1f} | {ms['inner SGD step']:.1f} "
            f"| {ms['projection (constraints.project)']:.1f} | {cert:.1f} "
            f"| {ms['bound refresh (DPOptimizer.refresh)']:.1f} "
            f"| {ms['accounting (ledger.record)']:.2f} | {step - parts:.1f} |"
        )
    if not rows:
        return
    print(
        "\nWhere the clipless step's time goes (ms per step; cProfile; certification = exact "
        "dense_norm/conv_norm calls, inside projection and bound refresh)\n\n"
        "| model | B | config | non-private step | clipless step | scaling (fwd+bwd extra) "
        "| noise | inner step | projection | certification | bound refresh | accounting "
        "| other step |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))


def plot(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per model: median step time and step peak memory against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for model in dict.fromkeys(r["model"] for r in results):
        rows = sorted((r for r in results if r["model"] == model), key=lambda r: r["batch"])
        configs = list(dict.fromkeys(c for r in rows for c in r["configs"]))
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
        for config in configs:
            pts = [(r["batch"], r["configs"][config]) for r in rows if config in r["configs"]]
            ax_t.plot(
                [b for b, _ in pts], [1000 * c["median_step_s"] for _, c in pts], "o-", label=config
            )
            mem = [(b, c["step_peak_bytes"] / 2**20) for b, c in pts if c.get("step_peak_bytes")]
            if mem:
                ax_m.plot([b for b, _ in mem], [m for _, m in mem], "o-", label=config)
        for ax, label in ((ax_t, "median step time (ms)"), (ax_m, "step peak memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=7)
        fig.suptitle(f"{model}: clipless vs non-private vs Opacus (CPU, 1 thread)", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"speed_{model}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


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
    p.add_argument(
        "--max-batch",
        nargs="+",
        default=[],
        metavar="MODEL=B",
        help=f"largest batch per model (defaults {MAX_BATCH})",
    )
    p.add_argument("--quick", action="store_true", help="2 reps, 1 warm-up, 1 step per rep")
    p.add_argument("--no-certification", action="store_true", help="skip the 6a table")
    p.add_argument("--plot-dir", type=Path, default=OUT.parent, help="where the PNGs go")
    p.add_argument("--plot-from", nargs="+", type=Path, default=None, help="only redraw")
    p.add_argument(
        "--certificate-parts",
        action="store_true",
        help="only time the parts of one Cholesky certification and the randomised alternative",
    )
    args = p.parse_args(argv)
    if args.certificate_parts:
        torch.set_num_threads(args.threads)
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=args.threads)
        print(f"# load average {os.getloadavg()}")
        for name, ms in certificate_parts().items():
            print(f"| {name} | {ms:.2f} |")
        print(f"# load average {os.getloadavg()}")
        return
    if args.plot_from:
        merged = [r for f in args.plot_from for r in json.loads(f.read_text())["results"]]
        profs = {
            k: v for f in args.plot_from for k, v in json.loads(f.read_text())["profiles"].items()
        }
        ts.print_tables(merged)
        print_overhead_table(profs)
        for path in plot(merged, args.plot_dir):
            print(f"wrote {path}")
        return
    max_batch = dict(MAX_BATCH, cnn=args.cnn_max_batch)
    for item in args.max_batch:
        name, _, value = item.partition("=")
        if name not in ts.MODELS or not value.isdigit():
            p.error(f"--max-batch: expected MODEL=B with MODEL in {ts.MODELS}; got {item!r}")
        max_batch[name] = int(value)
    if args.quick:
        args.reps, args.warmup, args.target_seconds = 2, 1, 0.0

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    try:  # the Cholesky certificate runs in SciPy's BLAS: give it the same number of threads
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=args.threads)
    except ImportError:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    certify = {} if args.no_certification else certification_costs()
    if certify:
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
            if batch > max_batch[model_name]:
                continue
            xb, yb = ts.synthetic_batch(batch, 0, ts.input_shape(model_name))
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
            if not args.no_profile and batch == min(args.profile_batch, max_batch[model_name]):
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
    print_overhead_table(profiles)
    for path in plot(results, args.plot_dir):
        print(f"wrote {path}")
    print(f"\nload average start {env['loadavg_start']}, end {env['loadavg_end']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
