"""``clipless train`` on the simulated accelerator, for every model kind: the CPU-side check of
issue 34's "every command works with --device cuda".

``python benchmarks/device_check.py`` (about a minute on one thread) runs each configuration below
twice through the whole command (``clipless.cli.main``): once with its ``--device`` resolved to
the simulated device ``simgpu`` of ``tests/_simdevice.py`` (CPU kernels, CUDA's mixed-device and
generator rules: code that mixes devices fails there as it fails on a GPU), once on the CPU. It
prints, per configuration, whether the device run finished and whether its saved model and
history equal the CPU run's bit for bit (``benchmarks/RESULTS.md`` section 36). Exit status 1 if
any did not. Only the bundled datasets (digits, breast-cancer): nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _simdevice import _DeviceMode, simulated_device  # a test helper, found through sys.path
from clipless import _modes, cli, norms

# the simulation's own function mode is not a user's mode around training
_modes.EXEMPT_FUNCTION_MODES = (*_modes.EXEMPT_FUNCTION_MODES, _DeviceMode)
# an accelerator certifies by matrix products: the CPU reference runs take the same path
norms.ACCELERATOR_PATH_ON_CPU = True

COMMON = ["--epochs", "1", "--epsilon", "3", "--no-progress", "--quiet", "--unsafe-seed", "3"]
CONFIGS: dict[str, list[str]] = {
    "breast-cancer (defaults)": ["--dataset", "breast-cancer"],
    "digits scatter features (centre, whitening)": ["--dataset", "digits", "--features", "scatter"],
    "digits mlp per-layer bound ema": [
        "--dataset", "digits", "--model", "mlp", "--hidden", "32,32",
        "--noise", "per-layer", "--scaling", "bound", "--ema", "0.9",
    ],
    "digits cnn adam clip": [
        "--dataset", "digits", "--model", "cnn", "--hidden", "4,8",
        "--optimizer", "adam", "--constraint", "clip",
    ],
    "digits resnet": ["--dataset", "digits", "--model", "resnet", "--hidden", "4,8"],
    "digits gnp": ["--dataset", "digits", "--model", "gnp", "--hidden", "4,8"],
}  # fmt: skip


def _run(argv: list[str], device: torch.device, out: Path) -> tuple[Any, Any]:
    real = cli._resolve_device
    cli._resolve_device = lambda spec: device
    try:
        code = cli.main(["train", *argv, *COMMON, "--out", str(out)])
    finally:
        cli._resolve_device = real
    if code != 0:
        raise RuntimeError(f"clipless train exited {code}")
    history = json.loads((out / "metrics.json").read_text())["history"]
    state = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    return [{k: v for k, v in r.items() if k != "time_s"} for r in history], state


def main() -> int:
    torch.set_num_threads(1)
    failed = 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp, simulated_device() as device:
        for name, argv in CONFIGS.items():
            started = time.perf_counter()
            try:
                on_device = _run(argv, device, Path(tmp) / f"{len(rows)}-device")
            except Exception:  # reported, then the next configuration
                traceback.print_exc()
                rows.append((name, "FAILED", "-", time.perf_counter() - started))
                failed += 1
                continue
            seconds = time.perf_counter() - started
            on_cpu = _run(argv, torch.device("cpu"), Path(tmp) / f"{len(rows)}-cpu")
            same = on_device[0] == on_cpu[0] and on_device[1].keys() == on_cpu[1].keys()
            same = same and all(torch.equal(v, on_cpu[1][k]) for k, v in on_device[1].items())
            failed += not same
            rows.append((name, "ran", "yes" if same else "NO", seconds))
    print("| configuration | on simgpu | model and history equal to the CPU run's | seconds |")
    print("|---|---|---|---|")
    for name, ran, same, seconds in rows:
        print(f"| {name} | {ran} | {same} | {seconds:.1f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
