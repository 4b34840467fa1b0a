"""Clipping bias on Adult (thesis Figure 5.3.3(b)): how far DP-SGD's clipped mean gradient is from
the true mean gradient along a real DP-SGD run, from exact ``torch.func`` per-sample gradients.

Part 1 (``dpsgd``): Opacus 1.6 DP-SGD trains the plain MLP 104-32-2 (ReLU, biases) on Adult at
epsilon 0.414, delta 1/n (SGD lr 2, flat clipping at C = 1, expected batch 2035, 30 epochs,
Poisson sampling; the Opacus setting of ``benchmarks/tabular.py``). Before training and after every
epoch, the current weights are copied into a plain twin and :func:`clipless.diagnostics.
clipping_profile` is evaluated on a fixed probe of 500 training records (the thesis averages over
500 instances) at thresholds 0.1, 0.3, 1, 3, 10: the norm of the bias ``||g - clip(g)||`` (the
figure's blue curve), the norm of the clipped mean ``||clip(g)||`` (red), the true mean's norm,
the cosine between the two means and the fraction of records clipped.

Part 2 (``clipless``): the clipless CLI-default linear model (``benchmarks/tabular.py``'s
``cli-default`` without the EMA, so that the evaluated model is the trained one) has no
parameter-gradient clipping, but its update is not the plain mean gradient either: each sample's
contribution is divided by its input norm (``scaling="per-sample"``) and its logit cotangent is
clipped at 0.3 (``LossGradientClip``). Its direction distortion is measured the same way: the
cosine between the true mean gradient (exact per-sample gradients of the plain export) and the
mean of the contributions the private backward actually produces (``per_sample_gradients`` of
the trained private model: its scaled kernels and its ``LossGradientClip`` run under ``vmap``).

Run ``python benchmarks/clipping_bias.py --seeds 0 1 2`` (a few minutes on one core); results in
``benchmarks/out/clipping_bias.json`` and Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adult
import tabular

from clipless import nn
from clipless.cli import default_batch_size
from clipless.diagnostics import clipping_profile, per_sample_gradients

OUT_DIR = Path(__file__).resolve().parent / "out"
THRESHOLDS = (0.1, 0.3, 1.0, 3.0, 10.0)
PROBE = 500


def probe(train: TensorDataset) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = train.tensors
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(12345))[:PROBE]
    return x[idx].double(), y[idx]


def dpsgd_trajectory(
    seed: int, train: TensorDataset, px: torch.Tensor, py: torch.Tensor, epochs: int
) -> list[dict[str, Any]]:
    trial = {"optimizer": "sgd", "lr": 2.0, "epochs": epochs}
    cfg = tabular.config("opacus", "adult", len(train), trial)
    torch.manual_seed(seed)
    model = adult.plain_mlp(tuple(cfg["hidden"]), train)
    twin = adult.plain_mlp(tuple(cfg["hidden"]), train).double()
    epsilon, delta = adult.privacy(cfg, len(train))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    engine, model, opt, loader, ce = adult.opacus_private(cfg, model, opt, train, epsilon, delta)
    ce_sum = torch.nn.CrossEntropyLoss(reduction="sum")
    rows = []

    def record(epoch: int) -> None:
        twin.load_state_dict({k: v.double() for k, v in model._module.state_dict().items()})
        stats = clipping_profile(twin, ce_sum, px, py, THRESHOLDS)
        rows.append({"epoch": epoch, "stats": [asdict(s) for s in stats]})

    record(0)
    for epoch in range(1, cfg["epochs"] + 1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for x, y in loader:
                if len(y) == 0:
                    continue
                opt.zero_grad()
                ce(model(x), y).backward()
                opt.step()
        record(epoch)
    rows[-1]["test_accuracy"] = adult.accuracy(model, adult.load("adult")[1])
    rows[-1]["epsilon"] = engine.get_epsilon(delta)
    return rows


def clipless_distortion(
    seed: int,
    train: TensorDataset,
    test: TensorDataset,
    px: torch.Tensor,
    py: torch.Tensor,
    epochs: int,
) -> dict[str, Any]:
    cfg = tabular.config("cli-default", "adult", len(train), {"ema": None, "epochs": epochs})
    result = adult.run_clipless(cfg, seed, train, test)
    model = result["model"]
    temperature = float(cfg["temperature"])
    loss_sum = nn.CrossEntropyLoss(temperature=temperature, reduction="sum")
    plain = nn.vanilla_export(model).double()
    true = per_sample_gradients(plain, loss_sum, px, py)
    g = torch.cat([v.reshape(PROBE, -1) for v in true.values()], dim=1)
    # the contributions the private backward produces (scaled kernels + LossGradientClip), by
    # torch.func on the private model itself (the scaled kernels have a vmap rule)
    loss = nn.CrossEntropyLoss(temperature=temperature, reduction="sum")
    private = per_sample_gradients(model, loss, px.float(), py)
    h = torch.cat([v.reshape(PROBE, -1).double() for v in private.values()], dim=1)
    mg, mh = g.mean(0), h.mean(0)
    cosine = float(mg @ mh / (mg.norm() * mh.norm()))
    logits = plain(px)
    cot = torch.softmax(logits / temperature, 1) - torch.nn.functional.one_hot(py, 2)
    cot_norm = cot.norm(dim=1) / temperature
    return {
        "test_accuracy": result["accuracy"],
        "epsilon": result["epsilon"],
        "cosine_true_vs_private_update": cosine,
        "fraction_cotangent_clipped": float((cot_norm > float(cfg["clip"])).double().mean()),
        "flat_clip_profile_same_model": [
            asdict(s) for s in clipping_profile(plain, loss_sum, px, py, THRESHOLDS)
        ],
    }


def fmt_dpsgd(runs: list[list[dict[str, Any]]]) -> str:
    c1 = THRESHOLDS.index(1.0)
    lines = [
        "DP-SGD (Opacus, clip C = 1), probe of 500 training records, median over seeds",
        "",
        "| epoch | bias at C=1 | clipped-mean norm | true-mean norm | cosine | fraction clipped |",
        "|---|---|---|---|---|---|",
    ]
    last = len(runs[0]) - 1
    for e in sorted({e for e in (0, 1, 2, 5, 10, 20, last) if e <= last}):
        rows = [r[e]["stats"][c1] for r in runs]
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        lines.append(
            f"| {e} | {med['bias']:.4f} | {med['clipped_norm']:.4f} | {med['mean_norm']:.4f} | "
            f"{med['cosine']:.4f} | {med['fraction_clipped']:.3f} |"
        )
    lines += [
        "",
        "Final weights, every threshold, median over seeds",
        "",
        "| C | bias | relative error | cosine | fraction clipped | mean scale |",
        "|---|---|---|---|---|---|",
    ]
    for j, t in enumerate(THRESHOLDS):
        rows = [r[-1]["stats"][j] for r in runs]
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        lines.append(
            f"| {t:g} | {med['bias']:.4f} | {med['relative_error']:.3f} | {med['cosine']:.4f} | "
            f"{med['fraction_clipped']:.3f} | {med['mean_scale']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--parts", nargs="*", default=["dpsgd", "clipless"])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train, test = adult.load("adult")
    px, py = probe(train)
    out: dict[str, Any] = {
        "thresholds": THRESHOLDS,
        "probe": PROBE,
        "batch": default_batch_size(len(train)),
        "seeds": args.seeds,
    }
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / "clipping_bias.json"
    if "dpsgd" in args.parts:
        out["dpsgd"] = [dpsgd_trajectory(s, train, px, py, args.epochs) for s in args.seeds]
        path.write_text(json.dumps(out, indent=1))
        print(fmt_dpsgd(out["dpsgd"]), flush=True)
        print(
            "test accuracy:",
            [r[-1]["test_accuracy"] for r in out["dpsgd"]],
            "epsilon:",
            out["dpsgd"][0][-1]["epsilon"],
        )
    if "clipless" in args.parts:
        out["clipless"] = [
            clipless_distortion(s, train, test, px, py, args.epochs) for s in args.seeds
        ]
        path.write_text(json.dumps(out, indent=1))
        for s, r in zip(args.seeds, out["clipless"], strict=True):
            print(
                f"clipless CLI default (no EMA), seed {s}: acc {r['test_accuracy']:.4f}, "
                f"cosine(true mean, private update) {r['cosine_true_vs_private_update']:.4f}, "
                f"cotangent clipped {r['fraction_cotangent_clipped']:.3f}"
            )


if __name__ == "__main__":
    main()
