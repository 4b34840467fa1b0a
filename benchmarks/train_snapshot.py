"""``clipless train`` before and after a refactor: ten short seeded runs, bit for bit.

    PYTHONPATH=<old checkout>/src python benchmarks/train_snapshot.py snap /tmp/before
    PYTHONPATH=<new checkout>/src python benchmarks/train_snapshot.py snap /tmp/after
    python benchmarks/train_snapshot.py compare /tmp/before/snap.pt /tmp/after/snap.pt

``snap`` runs every configuration below with ``--unsafe-seed 7`` (each model kind, SGD and Adam,
both accountants and neighbouring relations, per-layer noise, bound scaling, the scattering
front-end with and without the cache, released centring and whitening, adult, a CSV table, and a
``--resume`` of a finished run) and saves each run's weights, epsilon, ``model.pt``
architecture, ``config.json``, ``metrics.json`` (times, version and commit left out) and ledger.
``compare`` reports every difference (exit 1 if any). About 30 s of CPU on breast-cancer,
digits and adult (adult needs its cached files; kymatio for the scattering runs).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

SEEDED = ["--no-progress", "--quiet", "--unsafe-seed", "7"]


def _runs(root: Path, table: Path) -> dict[str, list[str]]:
    columns = "a=0..10;b=u|v|w;c=-5..5"
    return {
        "linear": ["--dataset", "breast-cancer", "--epochs", "3"],
        "mlp_sgd": [
            "--dataset",
            "digits",
            "--model",
            "mlp",
            "--hidden",
            "16,16",
            "--optimizer",
            "sgd",
            "--epochs",
            "2",
            "--accountant",
            "rdp",
            "--ema",
            "0",
        ],
        "cnn": [
            "--dataset",
            "digits",
            "--model",
            "cnn",
            "--hidden",
            "4,8",
            "--epochs",
            "1",
            "--noise",
            "per-layer",
            "--neighbouring",
            "replace_one",
        ],
        "resnet": [
            "--dataset",
            "digits",
            "--model",
            "resnet",
            "--hidden",
            "4,8",
            "--epochs",
            "1",
            "--pool",
            "avg",
            "--scaling",
            "bound",
        ],
        "gnp": [
            "--dataset",
            "digits",
            "--model",
            "gnp",
            "--epochs",
            "1",
            "--constraint",
            "clip",
            "--bias",
        ],
        "scatter": [
            "--dataset",
            "digits",
            "--features",
            "scatter",
            "--epochs",
            "2",
            "--accountant",
            "rdp",
            "--data-root",
            str(root / "cache"),
        ],
        "scatter_nowhite": [
            "--dataset",
            "digits",
            "--features",
            "scatter",
            "--epochs",
            "1",
            "--whiten-noise",
            "0",
            "--center-noise",
            "5",
            "--no-feature-cache",
            "--input-mode",
            "ball",
        ],
        "adult": ["--dataset", "adult", "--epochs", "1", "--epsilon", "0.5"],
        "table": [
            "--data",
            str(table),
            "--label",
            "y",
            "--classes",
            "no,yes",
            "--columns",
            columns,
            "--epochs",
            "2",
            "--model",
            "mlp",
            "--hidden",
            "4",
        ],
        "whiten_shrink": [
            "--dataset",
            "digits",
            "--epochs",
            "1",
            "--whiten-noise",
            "10",
            "--whiten-shrink",
            "2",
            "--center-noise",
            "10",
        ],
    }


def _table(path: Path) -> None:
    rng = random.Random(0)
    lines = ["a,b,c,y"]
    for _ in range(300):
        a, b, c = rng.uniform(0, 10), rng.choice(["u", "v", "w"]), rng.uniform(-5, 5)
        lines.append(f"{a},{b},{c},{'yes' if a + (b == 'u') * 3 > 6 else 'no'}")
    path.write_text("\n".join(lines) + "\n")


def _record(out: Path, root: Path) -> dict[str, Any]:
    model = torch.load(out / "model.pt", weights_only=True)
    metrics = json.loads((out / "metrics.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for part in (config, metrics["config"]):
        part.pop("git_commit", None)
        part.pop("clipless_version", None)
    for row in metrics["history"]:
        row.pop("time_s", None)
    metrics.pop("final", None)
    return {
        "state": model["state_dict"],
        "arch": model["architecture"],
        "eps": model["epsilon"],
        "metrics": json.dumps(metrics, sort_keys=True, default=str).replace(str(root), "ROOT"),
        "config": json.dumps(config, sort_keys=True).replace(str(root), "ROOT"),
        "ledger": (out / "ledger.json").read_text(),
    }


def snap(root: Path) -> None:
    from clipless.cli import main

    shutil.rmtree(root, ignore_errors=True)
    (root / "cache").mkdir(parents=True)
    _table(root / "table.csv")
    records = {}
    for name, argv in _runs(root, root / "table.csv").items():
        out = root / name
        if main(["train", *argv, *SEEDED, "--out", str(out)]) != 0:
            raise SystemExit(f"{name}: clipless train failed")
        if name == "linear" and main(["train", "--out", str(out), "--resume", *SEEDED]) != 0:
            raise SystemExit("linear --resume failed")
        records[name] = _record(out, root)
        print(name, "epsilon", records[name]["eps"], flush=True)
    torch.save(records, root / "snap.pt")


def compare(before: Path, after: Path) -> int:
    a = torch.load(before, weights_only=False)
    b = torch.load(after, weights_only=False)
    differences = 0
    for name in a:
        for key in ("arch", "eps", "config", "metrics", "ledger"):
            if a[name][key] != b[name][key]:
                differences += 1
                print(f"{name}: {key} differs\n  before {a[name][key]}\n  after  {b[name][key]}")
        x, y = a[name]["state"], b[name]["state"]
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            differences += 1
            print(f"{name}: weights differ")
    print(f"runs {len(a)}, differences {differences}")
    return 1 if differences else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["snap"]:
        snap(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        raise SystemExit(__doc__)
