"""``clipless train --model gnp`` with a variant of the GNP ConvNet or of the loss, for
``benchmarks/RESULTS.md`` section 46 (issue 39, item 1).

The variants are built from the library's tested layers in this process only (``src/`` is not
changed):

* ``--odd pad``: before a 2x2 stride-2 convolution, an odd map is zero-padded by one row and
  column on each side (``Conv2d(..., padding=1)``). The stride-2 windows then read the pad,
  pixels 0, then (1, 2), ..., (n-2, n-1): every real pixel exactly once, none dropped (the
  CLI's gnp model drops the last row and column of an odd map). With a square ``K_mat`` the
  layer is an isometry of the real pixels (``J^T J = I``), 1-Lipschitz but not GNP (the cotangents
  of the positions that read padding are lost). Its certificate is the layer's own
  (:func:`clipless.norms.conv_norm` handles zero padding); :func:`check_padded_bound` compares
  it with the SVD of the explicit Jacobian at the 7x7 map the model uses.
* ``--mix N``: N more ``1x1 Conv2d(c, c) -> GroupSort(2)`` pairs after stage ``--mix-stage``
  (0-based; default the last stage), at that stage's map and width (square
  ``K_mat``: exactly GNP after Björck).
* ``--loss hinge:M`` / ``--loss hkr:ALPHA:M``: :class:`clipless.nn.MulticlassHingeLoss` /
  :class:`clipless.nn.HKRLoss` instead of the CLI's cross-entropy; the engine reads the loss's
  certified Lipschitz constant as it does for the cross-entropy. The run folder's config.json
  does not know of the swap: it still lists the CLI's temperature.

Everything after ``--`` goes to ``clipless train`` (defaults: fashion-mnist, ``--model gnp``).

Usage::

    CLIPLESS_DATA=/tmp/i39data/root PYTHONPATH=src python benchmarks/gnp_variants.py --odd pad \\
        -- --hidden 4,16,64 --epsilon 3 --epochs 5 --features none --unsafe-seed 1 --seed 1 \\
        --threads 1 --no-progress --out /tmp/gnp39/runs/pad64
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.autograd.functional import jacobian

import clipless.nn as cnn
from clipless import models, pipeline
from clipless.cli import main
from clipless.constraints import project


def variant_gnp(odd: str, mix: int, mix_stage: int = -1) -> Any:
    """A drop-in for :func:`clipless.models.gnp_convnet` with the ``--odd`` / ``--mix`` change."""

    def build(
        input_shape: Sequence[int],
        channels: Sequence[int],
        num_classes: int = 10,
        input_norm: float = 1.0,
        bias: bool = False,
    ) -> cnn.Sequential:
        c, h, w = (int(v) for v in input_shape)
        layers: list[torch.nn.Module] = [cnn.InputNorm(float(input_norm))]
        at = mix_stage % len(channels)
        for i, out in enumerate(channels):
            pad = (h % 2, w % 2) if odd == "pad" else (0, 0)
            conv = cnn.Conv2d(c, out, 2, stride=2, padding=pad, bias=False)
            layers += [conv, cnn.GroupSort(2)]
            c, h, w = out, (h + 2 * pad[0]) // 2, (w + 2 * pad[1]) // 2
            if i == at:
                for _ in range(mix):
                    layers += [cnn.Conv2d(c, c, 1, bias=False), cnn.GroupSort(2)]
        layers += [cnn.Flatten(), cnn.Linear(c * h * w, num_classes, bias=bias)]
        return cnn.Sequential(*layers)

    return build


def make_loss(spec: str) -> Any:
    """A loss factory taking the CLI's ``temperature=`` (ignored by the margin losses)."""
    kind, *values = spec.split(":")
    if kind == "hinge" and len(values) == 1:
        return lambda temperature: cnn.MulticlassHingeLoss(margin=float(values[0]))
    if kind == "hkr" and len(values) == 2:
        alpha, margin = float(values[0]), float(values[1])
        return lambda temperature: cnn.HKRLoss(alpha=alpha, margin=margin)
    raise SystemExit(f"--loss must be ce, hinge:MARGIN or hkr:ALPHA:MARGIN; got {spec!r}")


@contextlib.contextmanager
def loss_in_make_private(factory: Any) -> Iterator[None]:
    """``pipeline._make_private`` builds ``nn.CrossEntropyLoss(temperature=T)``: swap that one
    name for the duration of the call (nothing else reads it there)."""
    original = pipeline._make_private

    def patched(*args: Any, **kwargs: Any) -> Any:
        saved = cnn.CrossEntropyLoss
        cnn.CrossEntropyLoss = factory  # type: ignore[misc]
        try:
            return original(*args, **kwargs)
        finally:
            cnn.CrossEntropyLoss = saved  # type: ignore[misc]

    pipeline._make_private = patched
    try:
        yield
    finally:
        pipeline._make_private = original


def check_padded_bound(seed: int = 0) -> float:
    """The padded 16 -> 64 stage at 7x7, random then Björck-projected weights: certified
    constant >= the top singular value of the explicit Jacobian; returns the smallest ratio."""
    torch.manual_seed(seed)
    conv = cnn.Conv2d(16, 64, 2, stride=2, padding=1, bias=False).double()
    x = torch.randn(1, 16, 7, 7, dtype=torch.float64)
    ratios = []
    for projected in (False, True):
        if projected:
            for _ in range(10):
                project(cnn.Sequential(conv), mode="orthogonal", max_norm=1.0, bjorck_iters=10)
        conv(x)  # records the input size the certificate uses
        jac = jacobian(conv, x)  # type: ignore[no-untyped-call]
        sv = torch.linalg.svdvals(jac.reshape(-1, x.numel()))
        bound = conv.lipschitz()
        if float(sv.max()) > bound:
            raise AssertionError(f"certified {bound} below the exact norm {float(sv.max())}")
        ratios.append(bound / float(sv.max()))
        if projected:  # an isometry of the real pixels: every singular value 1
            torch.testing.assert_close(sv, torch.ones_like(sv), atol=1e-6, rtol=0)
    return min(ratios)


def main_variants(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--odd", choices=("crop", "pad"), default="crop")
    parser.add_argument("--mix", type=int, default=0)
    parser.add_argument("--mix-stage", type=int, default=-1)
    parser.add_argument("--loss", default="ce")
    parser.add_argument("train", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    train = [a for a in args.train if a != "--"]
    print(f"padded 7x7 stage: certified / exact norm >= {check_padded_bound():.6f}")
    models.gnp_convnet = variant_gnp(args.odd, args.mix, args.mix_stage)
    base = ["train", "--dataset", "fashion-mnist", "--model", "gnp"]
    if args.loss == "ce":
        return main(base + train)
    with loss_in_make_private(make_loss(args.loss)):
        return main(base + train)


if __name__ == "__main__":
    raise SystemExit(main_variants())
