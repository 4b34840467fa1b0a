"""One prepared GPU benchmark (issue 34): step time, peak memory, launches and synchronisations.

Run on a machine with CUDA, from the repository root (``make bench-gpu`` does it, with the
wheels that machine lacks; see ``benchmarks/gpu/run.sh``)::

    python benchmarks/gpu_speed.py [--budget 270] [--out DIR]

Models (:mod:`train_speed`): the MLP 784-1024-1024-10, ``convnet((1,28,28),(32,64))``,
``convnet((3,32,32),(64,128,256))`` and the Clipless paper's Figure 4 CNNs (~130K, ~500K, ~2M
parameters on 3x32x32); batches 256, 1024, 4096; configurations ``nonprivate`` (the plain twin),
``clipless-ps`` / ``clipless-bound`` (the two scalings), ``clipless-carried`` (per-sample scaling,
``certify_every=10``: exact certificates one step in ten, carried bounds between), ``opacus``
(hooks; skipped when its per-sample gradients would exceed ``--max-grad-sample-gib``) and
``opacus-ghost`` when Opacus imports. Every configuration of a (model, batch) cell starts from the
same weights; float32 computed in float32 everywhere (TF32 off, which clipless requires). Reported
per cell: the median over ``--rounds`` interleaved rounds of the CUDA-synchronised time of
``--steps`` steps, the ratio to the non-private step, and the peak memory of one step above the
resting state (``torch.cuda.max_memory_allocated``). For each model at batch 256, one clipless step
is traced with the CUDA profiler: kernel launches, ``cudaStreamSynchronize``, device-to-host
copies, the device-busy time and the costliest kernels (host-bound or device-bound, and on what).
``--device cpu`` is a smoke run of the script itself (small ``--batches``; no CUDA statistics).
The sweep stops at ``--budget`` seconds (cells not reached are listed as skipped); results go to
stdout (Markdown) and ``DIR/gpu_speed.json`` (``$OUT`` when set, else ``benchmarks/out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_speed as ts

from clipless.optim import full_float32_precision

ts.CIFAR_CNNS.setdefault("cnn3", (64, 128, 256))  # the CIFAR-sized CNN
MODELS = ("mlp", "cnn", "cnn3", "cnn130k", "cnn500k", "cnn2m")
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself (no timings worth reading)
BATCHES = (256, 1024, 4096)


def _configs() -> list[str]:
    configs = ["nonprivate", "clipless-ps", "clipless-bound", "clipless-carried"]
    try:
        import opacus  # noqa: F401
    except ImportError:
        return configs
    return [*configs, "opacus", "opacus-ghost"]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time(runner: ts.Runner, steps: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        runner.step()
    _sync()
    return (time.perf_counter() - start) / steps


def _peak(runner: ts.Runner) -> int:
    if DEVICE != "cuda":  # a smoke run on the CPU: no CUDA memory statistics
        runner.step()
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rest = torch.cuda.memory_allocated()
    runner.step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - rest)


def _trace(runner: ts.Runner) -> dict[str, int]:
    """Kernel launches and synchronisations of one step (CUDA profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if DEVICE == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        runner.step()
        _sync()
    names = [e.name for e in prof.events()]
    return {
        "kernel_launches": sum(n in ("cudaLaunchKernel", "cudaLaunchKernelExC") for n in names),
        "stream_syncs": sum(n == "cudaStreamSynchronize" for n in names),
        "host_copies": sum(n == "aten::_local_scalar_dense" for n in names)
        + sum("DtoH" in n for n in names),
        **_device_time(prof),
    }


def _device_time(prof: Any) -> dict[str, Any]:
    """The step's device-busy time and its costliest kernels: where the device time goes (a
    float64 convolution, the certificates' products) against how long the host kept it waiting
    (busy time far below the step time means launches and Python bound the step)."""
    rows = []
    for row in prof.key_averages():
        us = getattr(row, "self_device_time_total", None)
        if us is None:  # torch < 2.4
            us = getattr(row, "self_cuda_time_total", 0.0)
        if us and us > 0:
            rows.append((float(us), row.key, int(row.count)))
    rows.sort(reverse=True)
    return {
        "device_busy_ms": sum(us for us, _, _ in rows) / 1000.0,
        "top_kernels": [
            {"ms": us / 1000.0, "calls": calls, "name": name[:90]} for us, name, calls in rows[:10]
        ],
    }


def cell(model: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    x, y = ts.synthetic_batch(batch, 0, ts.input_shape(model))
    runners: dict[str, ts.Runner] = {}
    row: dict[str, Any] = {"model": model, "batch": batch, "configs": {}}
    for config in _configs():
        try:
            runners[config] = ts.make_runner(
                config,
                model,
                x,
                y,
                sigma=1.0,
                lr=0.05,
                seed=0,
                max_grad_sample_gib=args.max_grad_sample_gib,
                device=DEVICE,
            )
        except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
            row["configs"][config] = {"skipped": str(exc)}
    for r in runners.values():
        for _ in range(args.warmup):
            r.step()
    times: dict[str, list[float]] = {c: [] for c in runners}
    for _ in range(args.rounds):  # interleaved
        for config, r in runners.items():
            times[config].append(_time(r, args.steps))
    base = statistics.median(times["nonprivate"]) if "nonprivate" in times else None
    for config, r in runners.items():
        median = statistics.median(times[config])
        row["configs"][config] = {
            "ms": 1000 * median,
            "ratio": None if base is None else median / base,
            "peak_mib": _peak(r) / 2**20,
        }
        if batch == args.batches[0] and config == "clipless-ps":
            row["configs"][config]["trace"] = _trace(r)
    del runners
    torch.cuda.empty_cache()
    return row


def _markdown(rows: list[dict[str, Any]], configs: list[str], traced: int) -> str:
    head = "| model | batch | " + " | ".join(configs) + " |"
    lines = [head, "|" + "---|" * (len(configs) + 2)]
    for row in rows:
        cells = []
        for config in configs:
            c = row["configs"].get(config, {})
            if "ms" not in c:
                cells.append("skipped")
                continue
            ratio = "" if c["ratio"] is None else f" ({c['ratio']:.2f}x)"
            cells.append(f"{c['ms']:.2f} ms{ratio}, {c['peak_mib']:.0f} MiB")
        lines.append(f"| {row['model']} | {row['batch']} | " + " | ".join(cells) + " |")
    traces = [(r["model"], r["configs"].get("clipless-ps", {}).get("trace")) for r in rows]
    lines.append("")
    lines.append(
        f"| model (clipless-ps, B = {traced}) | kernel launches | stream syncs | host copies "
        "| device busy ms | costliest kernels (ms) |"
    )
    lines.append("|---|---|---|---|---|---|")
    for model, t in traces:
        if t:
            top = "; ".join(f"{k['name'][:40]} {k['ms']:.2f}" for k in t["top_kernels"][:3])
            lines.append(
                f"| {model} | {t['kernel_launches']} | {t['stream_syncs']} | {t['host_copies']} "
                f"| {t['device_busy_ms']:.2f} | {top} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for the sweep")
    parser.add_argument("--max-grad-sample-gib", type=float, default=16.0)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ts.OUT_DIR))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_speed.py needs a CUDA device (--device cpu: a smoke run)")
    warnings.simplefilter("ignore")  # the seeded engines' warning
    full_float32_precision()
    start = time.perf_counter()
    rows, skipped = [], []
    for model in args.models:
        for batch in args.batches:
            if time.perf_counter() - start > args.budget:
                skipped.append(f"{model}@{batch}")
                continue
            try:
                rows.append(cell(model, batch, args))
            except Exception:  # one failing cell must not lose the others' figures
                skipped.append(f"{model}@{batch}: {traceback.format_exc(limit=3)}")
            print(f"done {model}@{batch} at {time.perf_counter() - start:.0f} s", flush=True)
    configs = _configs()
    print(_markdown(rows, configs, args.batches[0]))
    if skipped:
        print("skipped:", *skipped, sep="\n  ")
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "seconds": time.perf_counter() - start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_speed.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "skipped": skipped}, indent=1)
    )


if __name__ == "__main__":
    main()
