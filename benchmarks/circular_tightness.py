"""Tightness of the convolution certificate for circular padding with a stride.

For each geometry, three seeded float64 kernels (``randn``): the certified bound of
``clipless.norms.conv_norm`` (``method="fft"`` and ``"auto"``) divided by the exact operator norm
(the SVD of the layer's explicit matrix, ``method="explicit"``). With ``--before PATH`` (a
checkout's ``src``, e.g. from ``git archive``) the same rows are printed for that version too.
benchmarks/RESULTS.md section 28a.

    .venv/bin/python benchmarks/circular_tightness.py [--before /tmp/prev/src]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from clipless import norms

# (channels, kernel, stride, padding, input size): odd / non-multiple sizes are the new case
GEOMETRIES = [
    (16, 3, 2, 1, 15),
    (16, 3, 2, 1, 13),
    (8, 3, 2, 1, 21),
    (16, 4, 2, 1, 15),
    (8, 5, 2, 2, 17),
    (16, 3, 3, 1, 16),
    (8, 3, 2, 1, 16),  # s | n, "same" padding: exact
    (16, 3, 1, 0, 12),  # stride 1, no padding
]


def _load(src: str) -> ModuleType:
    path = Path(src) / "clipless" / "norms.py"
    if not path.exists():  # a package's modules import each other: only one file loads alone
        raise SystemExit(f"--before needs a checkout with a single-file norms.py; {path} is absent")
    spec = importlib.util.spec_from_file_location("norms_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(module: ModuleType) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for c, k, s, p, n in GEOMETRIES:
        fft, auto = [], []
        for _ in range(3):
            w = torch.randn(c, c, k, k, generator=gen, dtype=torch.float64)
            kw = {"stride": s, "padding": p, "padding_mode": "circular", "input_size": n}
            exact = norms.conv_norm(w, method="explicit", **kw)
            fft.append(module.conv_norm(w, method="fft", **kw) / exact)
            auto.append(module.conv_norm(w, method="auto", **kw) / exact)
        out.append(
            f"| {c} | {k} | {s} | {p} | {n} | "
            + " ".join(f"{r:.3f}" for r in fft)
            + " | "
            + " ".join(f"{r:.3f}" for r in auto)
            + " |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="a checkout's src directory to compare with")
    args = parser.parse_args()
    versions = [("this checkout", norms)]
    if args.before:
        versions.insert(0, (f"before ({args.before})", _load(args.before)))
    for name, module in versions:
        print(f"\n{name}\n")
        print("| channels | kernel | stride | padding | n | fft / exact | auto / exact |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows(module)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
