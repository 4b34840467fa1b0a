"""What a randomised spectral-norm certificate would cost next to the deterministic one.

``docs/speed.md`` ("A randomised certificate") derives how many Chebyshev steps ``k`` a test with
a Gaussian start needs to certify ``||W||^2 < a (1 + eps)`` with failure probability ``beta``.
With a block of ``m`` independent Gaussian columns the test reads the Frobenius norm of
``p(A) X``, whose square is at least ``p(lambda_1)^2 chi^2_m``; ``P(chi^2_m <= s) <= (s / 2)^(m/2)
/ Gamma(m/2 + 1)`` lets a block use a much lower degree. This script prints ``k`` for block sizes
1-64 (``n = 1024``, ``beta = 1e-12``, ``eps`` 0.1 / 0.02 / 0.005) and times, on one thread:
the deterministic certificate (``clipless.norms.dense_norm``; its Gram product and Cholesky
factorisation alone), and products by ``W`` and ``W^T`` with blocks of 1-32 columns in float64
and float32. Nothing here is used by the library (the randomised certificate is not
implemented). Run ``python benchmarks/randomised_cost.py``; ``benchmarks/RESULTS.md`` section 19d.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from clipless import norms

N = 1024
BETA = 1e-12
EPSILONS = (0.1, 0.02, 0.005)


def steps_needed(n: int, m: int, beta: float, eps: float) -> int:
    """Chebyshev degree ``k`` with ``T_k(1 + 2 eps) > sqrt(n m / s)``, ``s`` the ``beta``-quantile
    bound of ``chi^2_m`` (``(s/2)^(m/2) / Gamma(m/2 + 1) = beta``)."""
    s = 2.0 * math.exp((math.log(beta) + math.lgamma(m / 2 + 1)) / (m / 2))
    return math.ceil(math.acosh(math.sqrt(n * m / s)) / math.acosh(1 + 2 * eps))


def median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[repeats // 2]


def main() -> None:
    torch.set_num_threads(1)
    print(f"Chebyshev steps k (n = {N}, beta = {BETA:g}; eps = {EPSILONS}):")
    for m in (1, 4, 8, 16, 32, 64):
        print(f"  block {m:2d}: {[steps_needed(N, m, BETA, e) for e in EPSILONS]}")
    gen = torch.Generator().manual_seed(0)
    w64 = torch.linalg.qr(torch.randn(N, N, dtype=torch.float64, generator=gen))[0]
    w64 = (0.9 * w64).contiguous()
    eye = torch.eye(N, dtype=torch.float64)

    def gram_cholesky() -> None:
        torch.linalg.cholesky_ex(eye - 0.99 * (w64.T @ w64))

    w32 = w64.float().contiguous()
    print(f"dense_norm (float32 weight): {median_ms(lambda: norms.dense_norm(w32)):.1f} ms")
    print(f"Gram product + Cholesky (float64): {median_ms(gram_cholesky):.1f} ms")
    for w in (w64, w32):
        for m in (1, 8, 16, 32):
            x = torch.randn(N, m, dtype=w.dtype, generator=gen)

            def pairs(w: torch.Tensor = w, x: torch.Tensor = x) -> None:
                for _ in range(20):
                    w.T @ (w @ x)

            ms = median_ms(pairs) / 20
            k = steps_needed(N, m, BETA, 0.02)
            print(
                f"{w.dtype!s:14s} block {m:2d}: {ms:.3f} ms per W, W^T pair; "
                f"k = {k} at eps 0.02: {k * ms:.1f} ms"
            )


if __name__ == "__main__":
    main()
