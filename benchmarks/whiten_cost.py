"""Cost of the whitening in ``InputNorm``: the forward pass with and without it, interleaved.

``python benchmarks/whiten_cost.py [batch]`` (default 2048): two ``InputNorm`` layers on a
``batch x 81 x 7 x 7`` input (Fashion-MNIST's scattering features), one centred and one centred
and whitened by an orthogonal ``81 x 81`` matrix, called alternately 25 times on one thread;
prints the medians of the last 20 calls (``benchmarks/RESULTS.md`` section 20f).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from clipless import nn


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    x = torch.randn(batch, 81, 7, 7)
    mu = torch.randn(81, 7, 7) * 0.01
    w = torch.linalg.qr(torch.randn(81, 81, dtype=torch.float64))[0]
    centred = nn.InputNorm(1.0, "sphere", center=mu, center_noise=20.0)
    whitened = nn.InputNorm(
        1.0, "sphere", center=mu, center_noise=20.0, whiten=w, whiten_noise=20.0
    )
    times: dict[str, list[float]] = {"centred": [], "whitened": []}
    for _ in range(25):
        for name, layer in (("centred", centred), ("whitened", whitened)):
            start = time.perf_counter()
            layer(x)
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name}: {1000 * statistics.median(t[5:]):.1f} ms")


if __name__ == "__main__":
    main()
