"""Step-time cost of the float64 batch sums of the scaled kernels (issue 35, case 3).

The scaled kernels (:mod:`clipless.nn._scaled`) sum every parameter gradient over the batch in
float64, by chunks, and round it once (the rounding margin's proof,
:func:`clipless.mechanism.rounding_margin`). This times a clipless step (``scaling="per-sample"``,
the models of :mod:`train_speed`) with those sums against the same step with the former float32
sums (the kernels' three summing helpers swapped for float32 ones during its steps), interleaved
in one process (``train_speed.time_steps``), and reports the median step times and the median of
the paired ratios.

Run ``python benchmarks/sum_precision.py [--models mlp cnn] [--batch 256] [--reps 5]``;
``--ops`` times the CNN's two convolution weight gradients alone instead.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.grad import conv2d_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_speed as ts

from clipless.nn import _scaled


def _float32_sums() -> dict[str, Callable[..., torch.Tensor]]:
    """The kernels' summing helpers as they were before issue 35 (float32, one product)."""

    def weight_sum(dys: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dys.t() @ x

    def rows_sum(t: torch.Tensor, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return t.sum(dim=dims)

    def conv_weight_sum(x: Any, weight: Any, dys: Any, stride: Any, padding: Any) -> torch.Tensor:
        return conv2d_weight(x, weight.shape, dys, stride=stride, padding=padding)

    return {"_weight_sum": weight_sum, "_rows_sum": rows_sum, "_conv_weight_sum": conv_weight_sum}


def _swapped(step: Callable[[], None], helpers: dict[str, Any]) -> Callable[[], None]:
    def run() -> None:
        saved = {k: getattr(_scaled, k) for k in helpers}
        for k, v in helpers.items():
            setattr(_scaled, k, v)
        try:
            step()
        finally:
            for k, v in saved.items():
                setattr(_scaled, k, v)

    return run


def _ms(f: Callable[[], object], n: int = 3) -> float:
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e3


def conv_ops(batch: int) -> None:
    """The weight gradient of the CNN's two convolutions alone: float32 (mkldnn), float64, and
    one float32 ``conv2d_weight`` per example summed in float64 (row-local float32 rounding: an
    alternative that keeps float32 kernels, not used)."""
    print("| conv (in, out, size) | float32 (ms) | float64 (ms) | per-example float32 (ms) |")
    print("|---|---|---|---|")
    for cin, cout, hw in ((1, 32, 28), (32, 64, 14)):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, cin, hw, hw, generator=g)
        dy = torch.randn(batch, cout, hw, hw, generator=g)
        shape = (cout, cin, 3, 3)
        f32 = _ms(functools.partial(conv2d_weight, x, shape, dy, padding=1))
        f64 = _ms(functools.partial(conv2d_weight, x.double(), shape, dy.double(), padding=1))
        each = _ms(functools.partial(_per_example, x, shape, dy))
        print(f"| {cin}, {cout}, {hw}x{hw} | {f32:.1f} | {f64:.1f} | {each:.1f} |")


def _per_example(x: torch.Tensor, shape: tuple[int, ...], dy: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        total += conv2d_weight(x[i : i + 1], shape, dy[i : i + 1], padding=1)
    return total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=ts.MODELS)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ops", action="store_true", help="time the convolutions' weight gradients")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    if args.ops:
        conv_ops(args.batch)
        return
    print("| model | batch | float32 sums (ms) | float64 sums (ms) | paired ratio |")
    print("|---|---|---|---|---|")
    for name in args.models:
        xb, yb = ts.synthetic_batch(args.batch, 0, ts.input_shape(name))
        runners = []
        for label in ("float64", "float32"):
            r = ts.make_runner("clipless-ps", name, xb, yb, sigma=1.0, lr=0.05, seed=0)
            if label == "float32":
                r.step = _swapped(r.step, _float32_sums())
            r.name = label
            runners.append(r)
        times = ts.time_steps(runners, reps=args.reps, warmup=2, target=0.5)["times"]
        ratio = ts.paired_ratio(times, "float64", "float32")
        print(
            f"| {name} | {args.batch} | {1e3 * statistics.median(times['float32']):.1f} | "
            f"{1e3 * statistics.median(times['float64']):.1f} | {ratio:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
