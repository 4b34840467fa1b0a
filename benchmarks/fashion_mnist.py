"""Fashion-MNIST accuracy: clipless DP training against Opacus DP-SGD at the same (epsilon, delta).

Both sides train the *same architecture* from the *same initial weights* for the same number of
epochs with Poisson sampling at the same expected batch size, and both calibrate their noise to the
target ``(epsilon, delta)`` with their own accountant (clipless: PLD; Opacus: PRV), then report the
epsilon their accountant gives after training:

* clipless: the Lipschitz model (``InputNorm`` -> layers -> GroupSort ...), ``constraint="clip"``
  (every layer's certified Lipschitz bound kept ``<= max_norm``), ``noise="global"``,
  ``CrossEntropyLoss(temperature)``; no per-sample gradient is computed;
* Opacus: the :func:`clipless.nn.vanilla_export` twin of the same initial model (same
  ``InputNorm`` preprocessing, same GroupSort activations, no Lipschitz constraint), plain
  cross-entropy on ``logits / temperature``, flat per-sample clipping at ``max_grad_norm``.
  Per-sample gradients use ghost clipping (``grad_sample_mode="ghost"``), which computes exactly
  the same clipped sum as the hooks mode, faster for dense layers.

Hyper-parameters. Each side gets the same number of settings (a small grid, ``--grid``), every
setting trained at every epsilon; the setting reported per epsilon is the one with the best
accuracy on a validation split held out from the training set (the last ``--val`` training
images; the test set is used only for the reported number). As usual in DP benchmarks the tuning
itself is not accounted for in epsilon.

Data: Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (``apt-get install -y
dataset-fashion-mnist``) or ``$CLIPLESS_DATA``; pixels / 255, no other preprocessing.

Run ``python benchmarks/fashion_mnist.py`` (5 epochs, about 12 minutes on one core) or with
``--quick`` (one epoch, one setting per side, epsilon 8). Results: a Markdown table on stdout and
``benchmarks/out/fashion_mnist[_quick].json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import clipless
from clipless import constraints, models, nn
from clipless.engine import MechanismSpec

OUT_DIR = Path(__file__).resolve().parent / "out"

# Three settings per side, chosen after a one-epoch pilot at epsilon 8 (validation accuracy; see
# benchmarks/RESULTS.md): clipless prefers small steps and a low temperature (its noise
# is calibrated to the certified bound sqrt(2) / T per layer), Opacus a clipping norm of 1.
CLIPLESS_GRID: list[dict[str, Any]] = [
    {"lr": 0.01, "temperature": 1 / 16, "scaling": "per-sample"},
    {"lr": 0.003, "temperature": 1 / 16, "scaling": "per-sample"},
    {"lr": 0.003, "temperature": 1 / 32, "scaling": "per-sample"},
]
OPACUS_GRID: list[dict[str, Any]] = [
    {"lr": 1.0, "max_grad_norm": 1.0, "temperature": 1 / 8},
    {"lr": 4.0, "max_grad_norm": 1.0, "temperature": 1 / 8},
    {"lr": 1.0, "max_grad_norm": 1.0, "temperature": 1 / 16},
]


# Channels per stage of the image models (``--hidden`` overrides the chosen one).
WIDTHS: dict[str, tuple[int, ...]] = {"cnn": (16, 32), "resnet": (16, 32), "gnp": (4, 16)}


def build_model(arch: str) -> torch.nn.Module:
    """The Lipschitz model (:mod:`clipless.models`; inputs ``1 x 28 x 28``, 10 classes)."""
    if arch == "mlp":
        return models.mlp((1, 28, 28), (256, 256), 10, input_norm=1.0, bias=False)
    if arch == "cnn":
        return models.convnet((1, 28, 28), WIDTHS["cnn"], 10, input_norm=1.0, pool="l2")
    if arch == "resnet":  # what `clipless train --model resnet` builds (one block per stage)
        return models.resnet((1, 28, 28), WIDTHS["resnet"], 1, 10, input_norm=1.0)
    if arch == "gnp":
        return models.gnp_convnet((1, 28, 28), WIDTHS["gnp"], 10, input_norm=1.0)
    raise ValueError(f"unknown architecture {arch!r}")


def load_data(val: int) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    from clipless.data import load_fashion_mnist

    root = Path(os.environ.get("CLIPLESS_DATA", Path.home() / ".cache" / "clipless"))
    train, test, _ = load_fashion_mnist(root, download=False)
    x, y = train.tensors
    n = x.shape[0] - val
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:]), test


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    if x.shape[0] == 0:  # --val 0: no validation split
        return math.nan
    correct = 0
    for i in range(0, x.shape[0], 2000):
        correct += int((model(x[i : i + 2000]).argmax(1) == y[i : i + 2000]).sum())
    model.train()
    return correct / x.shape[0]


def initial_model(arch: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(arch)
    constraints.project(model, mode="clip", max_norm=1.0)  # what make_private does first
    return model


def train_clipless(
    arch: str,
    train: TensorDataset,
    epsilon: float,
    delta: float,
    epochs: int,
    batch: int,
    seed: int,
    lr: float,
    temperature: float,
    scaling: str,
    max_norm: float = 1.0,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    model = initial_model(arch, seed)
    loss = nn.CrossEntropyLoss(temperature=temperature)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine = clipless.PrivacyEngine(accountant="pld", seed=seed)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(train, batch_size=batch),
        loss=loss,
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        mechanism=MechanismSpec(
            max_norm=max_norm, constraint="clip", scaling=scaling, noise="global"
        ),
    )
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()
    info = {
        "epsilon_spent": engine.get_epsilon(delta),
        "noise_multiplier": engine.config["noise_multiplier"],
        "sample_rate": engine.config["sample_rate"],
        "steps": engine.ledger.steps if engine.ledger is not None else None,
    }
    return nn.vanilla_export(model), info


def train_opacus(
    arch: str,
    train: TensorDataset,
    epsilon: float,
    delta: float,
    epochs: int,
    batch: int,
    seed: int,
    lr: float,
    max_grad_norm: float,
    temperature: float,
    initial: torch.nn.Module | None = None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``initial``: the clipless model whose plain twin Opacus trains (default: ``arch``'s
    :func:`initial_model`, ``InputNorm`` radius 1)."""
    from opacus import PrivacyEngine as OpacusEngine

    plain = nn.vanilla_export(initial if initial is not None else initial_model(arch, seed))
    opt = torch.optim.SGD(plain.parameters(), lr=lr)
    engine = OpacusEngine(accountant="prv")
    torch.manual_seed(seed)
    model, opt, criterion, loader = engine.make_private_with_epsilon(
        module=plain,
        optimizer=opt,
        data_loader=DataLoader(train, batch_size=batch),
        criterion=torch.nn.CrossEntropyLoss(),
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        poisson_sampling=True,
        grad_sample_mode="ghost",
    )
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            criterion(model(x) / temperature, y).backward()
            opt.step()
    info = {
        "epsilon_spent": engine.get_epsilon(delta),
        "noise_multiplier": opt.noise_multiplier,
        "sample_rate": getattr(loader, "sample_rate", 1 / len(loader)),
        "steps": len(loader) * epochs,
    }
    return model, info


def train_nonprivate(
    arch: str, train: TensorDataset, epochs: int, batch: int, seed: int, lr: float
) -> torch.nn.Module:
    # the non-private ceiling trains the plain cross-entropy: the private runs' temperature is a
    # lever against the noise, not part of the architecture (an audit noted the difference)
    model = nn.vanilla_export(initial_model(arch, seed))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for x, y in DataLoader(train, batch_size=batch, shuffle=True, generator=g):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--arch", default="mlp", choices=("mlp", "cnn", "resnet", "gnp"))
    p.add_argument("--epsilons", nargs="+", type=float, default=None)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch", type=int, default=512, help="expected (Poisson) batch size")
    p.add_argument("--val", type=int, default=5000, help="validation images held out of train")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", nargs="+", default=["nonprivate", "clipless", "opacus"])
    p.add_argument("--clipless-grid", type=json.loads, default=None, help="JSON list of settings")
    p.add_argument("--opacus-grid", type=json.loads, default=None, help="JSON list of settings")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--nonprivate-lr",
        type=float,
        default=0.05,
        help="SGD lr of the non-private twin (0.05 diverges on the resnet twin; use 0.01)",
    )
    p.add_argument(
        "--hidden", default=None, help="channels per stage (cnn, resnet, gnp), e.g. 8,16"
    )
    args = p.parse_args(argv)
    if args.hidden:
        WIDTHS[args.arch] = tuple(int(v) for v in args.hidden.split(","))
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    epsilons = args.epsilons or ([8.0] if args.quick else [1.0, 8.0])
    epochs = args.epochs or (1 if args.quick else 5)
    grids = {
        "clipless": args.clipless_grid or (CLIPLESS_GRID[:1] if args.quick else CLIPLESS_GRID),
        "opacus": args.opacus_grid or (OPACUS_GRID[:1] if args.quick else OPACUS_GRID),
    }
    name = f"fashion_mnist_{args.arch}" + ("_quick" if args.quick else "") + ".json"
    out_path = args.out or OUT_DIR / name

    train, val, test = load_data(args.val)
    print(f"# Fashion-MNIST {args.arch}: train {len(train)}, val {len(val)}, test {len(test)}")
    print(
        f"# epochs {epochs}, expected batch {args.batch}, delta {args.delta}, load "
        f"{os.getloadavg()}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    if "nonprivate" in args.sides:
        t0 = time.perf_counter()
        lr = args.nonprivate_lr
        model = train_nonprivate(args.arch, train, epochs, 128, args.seed, lr=lr)
        runs.append(
            {
                "side": "nonprivate",
                "epsilon": None,
                "setting": {"lr": lr, "momentum": 0.9, "batch": 128},
                "val_acc": accuracy(model, val),
                "test_acc": accuracy(model, test),
                "seconds": time.perf_counter() - t0,
            }
        )
        print(runs[-1], flush=True)
    for eps in epsilons:
        for side in ("clipless", "opacus"):
            if side not in args.sides:
                continue
            for setting in grids[side]:
                t0 = time.perf_counter()
                trainer = train_clipless if side == "clipless" else train_opacus
                model, info = trainer(
                    args.arch, train, eps, args.delta, epochs, args.batch, args.seed, **setting
                )
                runs.append(
                    {
                        "side": side,
                        "epsilon": eps,
                        "setting": setting,
                        "val_acc": accuracy(model, val),
                        "test_acc": accuracy(model, test),
                        "seconds": time.perf_counter() - t0,
                        **info,
                    }
                )
                print(runs[-1], flush=True)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"args": vars(args) | {"out": str(out_path)}, "epochs": epochs, "runs": runs}
    out_path.write_text(json.dumps(payload, indent=1, default=str))
    print_table(runs)
    print(f"wrote {out_path}")


def print_table(runs: list[dict[str, Any]]) -> None:
    print(
        "\n| side | target eps | selected setting (best val) | val acc | test acc | eps spent "
        "| sigma | settings tried |"
    )
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["side"], r["epsilon"]) for r in runs}, key=lambda k: (k[1] or 0, k[0]))
    for side, eps in keys:
        group = [r for r in runs if r["side"] == side and r["epsilon"] == eps]
        best = max(group, key=lambda r: r["val_acc"])
        spent = best.get("epsilon_spent")
        sigma = best.get("noise_multiplier")
        print(
            f"| {side} | {eps if eps is not None else '∞'} | {best['setting']} | "
            f"{100 * best['val_acc']:.1f}% | {100 * best['test_acc']:.1f}% | "
            f"{'—' if spent is None else f'{spent:.3f}'} | "
            f"{'—' if sigma is None else f'{sigma:.3f}'} | {len(group)} |"
        )


if __name__ == "__main__":
    main()
