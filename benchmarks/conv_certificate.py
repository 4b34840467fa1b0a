"""One convolution certification: complex Cholesky certificate vs one eigvalsh per frequency.

Times ``clipless.norms.conv_norm(w, padding=1, input_size=n, method="fft")`` on the kernels of
benchmarks/RESULTS.md section 12e (the wide layers of the Figure 4 CNNs: 152x64x3x3 at 8x8,
288x144x3x3 at 16x16, 576x288x3x3 at 8x8; float32 weights ``randn * 0.02``), interleaved in one
process against the previous path (the same polyphase symbol, each frequency certified by the
largest eigenvalue of its float64 Gram matrix plus the product's rounding term:
``_eigh_norm``, section 12e), and optionally against an older checkout of ``norms.py``
(``--before PATH``, e.g. extracted by ``git archive``). Reports the median of ``--reps``
timings, the tightness ``bound / exact - 1`` (exact = the largest singular value of the symbol
by LAPACK SVD, times the same duplication factor), and the load average.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/conv_certificate.py --reps 5
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from clipless import norms

KERNELS = [(152, 64, 8), (288, 144, 16), (576, 288, 8)]  # (c_out, c_in, input size), 3x3, pad 1


def eigh_per_frequency(w: torch.Tensor, n: int) -> float:
    """The previous path: one ``_eigh_norm`` (Gram + eigvalsh) per frequency of the symbol."""
    dims = (norms._polyphase_1d(n, 3, 1, 1, False),) * 2
    flat = norms._symbol_tensor(w, dims, (1, 1))
    return norms.inflate(max(norms._eigh_norm(m) for m in flat))


def exact(w: torch.Tensor, n: int) -> float:
    dims = (norms._polyphase_1d(n, 3, 1, 1, False),) * 2
    symbol = norms._symbol_tensor(w, dims, (1, 1))
    return float(torch.linalg.matrix_norm(symbol, ord=2).max())


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("norms_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--before", type=Path, default=None, help="an older norms.py to time too")
    args = p.parse_args()
    torch.set_num_threads(1)
    before = load(args.before) if args.before is not None else None
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    rows = []
    for c_out, c_in, n in KERNELS:
        w = torch.randn(c_out, c_in, 3, 3, generator=torch.Generator().manual_seed(0)) * 0.02
        runs: dict[str, tuple[object, object]] = {
            "eigh per frequency": (eigh_per_frequency, (w, n)),
            "Cholesky (now)": (
                lambda w=w, n=n: norms.conv_norm(w, padding=1, input_size=n, method="fft"),
                (),
            ),
        }
        if before is not None:
            runs["before (checkout)"] = (
                lambda w=w, n=n: before.conv_norm(w, padding=1, input_size=n, method="fft"),
                (),
            )
        norms.conv_norm(w[:20, :20], padding=1, input_size=n, method="fft")  # warm imports
        times: dict[str, list[float]] = {k: [] for k in runs}
        values: dict[str, float] = {}
        for _ in range(args.reps):
            for name, (fn, fargs) in runs.items():
                t = time.perf_counter()
                values[name] = fn(*fargs)  # type: ignore[operator]
                times[name].append(time.perf_counter() - t)
        ref = exact(w, n)
        rows.append((c_out, c_in, n, times, values, ref))
        print(f"load average after {c_out}x{c_in}: {os.getloadavg()}", file=sys.stderr)
    names = list(rows[0][3])
    print("| kernel | input | " + " | ".join(f"{k} (ms)" for k in names) + " | speed-up | "
          + " | ".join(f"{k}: bound / exact - 1" for k in names) + " |")  # fmt: skip
    print("|" + "---|" * (3 + 2 * len(names)))
    for c_out, c_in, n, times, values, ref in rows:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        speed = med["eigh per frequency"] / med["Cholesky (now)"]
        tight = " | ".join(f"{values[k] / ref - 1:.1e}" for k in names)
        print(
            f"| {c_out}x{c_in}x3x3 | {n}x{n} | "
            + " | ".join(f"{med[k]:.0f}" for k in names)
            + f" | {speed:.2f}x | {tight} |"
        )
    assert all(math.isfinite(v) for r in rows for v in r[4].values())


if __name__ == "__main__":
    main()
