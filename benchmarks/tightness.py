"""Tightness and cost of the certified bounds in :mod:`clipless.bounds`.

Three measurements, printed as tables:

1. **Sensitivities** -- on seeded random small ``clipless.nn`` models (the builder of
   ``tests/test_sensitivities.py``: convolutions with every stride / padding / padding mode,
   residual blocks in both modes, GroupNorm, pooling, LossGradientClip, every loss; inputs mostly
   far outside the ``InputNorm`` ball), the ratio (largest exact per-sample gradient norm over the
   batch) / (certified bound), per layer type and parameter. 1 means tight. The inputs are random,
   not adversarial, so the ratios are lower bounds on the true tightness.
2. **conv_norm** -- exact operator norm (SVD of the explicit Jacobian) / bound for the FFT,
   Frobenius and the thesis's ``sqrt(kh kw) ||K||_F`` bounds on random small layers.
3. **Cost** -- ``conv_norm`` on a random 64x64x3x3 kernel with 32x32 inputs (0.45 s with
   per-frequency SVDs when first measured on 2 cores) and ``dense_norm`` on a 2000x1500 matrix.

Run from the repository root::

    .venv/bin/python benchmarks/tightness.py            # about a minute on 2 loaded cores
    .venv/bin/python benchmarks/tightness.py --cases 500
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from clipless.norms import conv_norm, dense_norm  # noqa: E402
from test_norms import conv_jacobian_norm  # noqa: E402
from test_sensitivities import TIGHTNESS, RandomChooser, build_case, check_case  # noqa: E402


def _row(name: str, values: list[float]) -> str:
    return (
        f"  {name:22s} n={len(values):5d}  median {statistics.median(values):.3f}  "
        f"min {min(values):.3f}  max {max(values):.3f}"
    )


def sensitivity_tightness(cases: int) -> None:
    TIGHTNESS.clear()
    for seed in range(cases):
        check_case(build_case(RandomChooser(seed)))  # asserts every bound holds
    print(f"\n[1] per-sample gradient norm / certified bound, {cases} random models (1 = tight)")
    for key in sorted(TIGHTNESS):
        print(_row(key, TIGHTNESS[key]))


def conv_tightness(count: int) -> None:
    gen = torch.Generator().manual_seed(7)
    ratios: dict[str, list[float]] = {"fft": [], "frobenius": [], "seeds sqrt(khkw)|K|_F": []}
    done = 0
    while done < count:
        c_out, c_in = (int(v) for v in torch.randint(1, 5, (2,), generator=gen))
        k = int(torch.randint(1, 6, (), generator=gen))
        s = int(torch.randint(1, 4, (), generator=gen))
        p = int(torch.randint(0, 3, (), generator=gen))
        n = int(torch.randint(4, 11, (), generator=gen))
        mode = "circular" if bool(torch.rand((), generator=gen) < 0.5) else "zeros"
        if n + 2 * p < k or (mode == "circular" and p > n):
            continue
        done += 1
        w = torch.randn(c_out, c_in, k, k, generator=gen, dtype=torch.float64)
        exact = conv_jacobian_norm(w, (s, s), (p, p), mode, (n, n))
        args = {"stride": s, "padding": p, "padding_mode": mode, "input_size": n}
        ratios["fft"].append(exact / conv_norm(w, method="fft", **args))  # type: ignore[arg-type]
        ratios["frobenius"].append(exact / conv_norm(w, method="frobenius", **args))  # type: ignore[arg-type]
        if mode == "zeros":
            seeds = k * float(torch.linalg.vector_norm(w))
            ratios["seeds sqrt(khkw)|K|_F"].append(exact / seeds)
    print(f"\n[2] conv_norm: exact / bound, {count} random layers (n 4..10, k 1..5, s 1..3)")
    for key, values in ratios.items():
        print(_row(key, values))


def timing(repeats: int) -> None:
    print(f"\n[3] cost (best of {repeats}, seconds)")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, 3, 3, generator=gen)
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        for method in ("fft", "frobenius", "auto"):
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                value = conv_norm(w, padding=1, input_size=32, method=method)  # type: ignore[arg-type]
                best = min(best, time.perf_counter() - t0)
            label = f"{method:9s} {threads} thread(s)"
            print(f"  conv_norm 64x64x3x3 on 32x32, {label}: {best:.3f} s  bound {value:.2f}")
    seeds = 3.0 * float(torch.linalg.vector_norm(w.double()))
    print(f"  (seeds' sqrt(kh kw) ||K||_F = {seeds:.1f})")
    mat = torch.randn(2000, 1500, generator=gen)
    for method in ("svd", "gram"):
        t0 = time.perf_counter()
        value = dense_norm(mat, method=method)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - t0
        print(f"  dense_norm 2000x1500 {method:4s}: {elapsed:.2f} s  bound {value:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="random models for [1]")
    parser.add_argument("--convs", type=int, default=150, help="random layers for [2]")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats for [3]")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sensitivity_tightness(args.cases)
    conv_tightness(args.convs)
    torch.set_num_threads(threads)
    timing(args.repeats)


if __name__ == "__main__":
    main()
