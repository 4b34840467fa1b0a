"""The simulated-accelerator tests (``tests/simdevice_cases.py``), run in a fresh interpreter.

Registering the simulated device (torch's PrivateUse1 backend) is process-wide and cannot be
undone: torch then takes it for the accelerator (``torch.random.fork_rng`` asks it for RNG
states it does not have), and an autograd engine that started before the registration has no
queue for its device. So the cases run in their own process, which registers the device before
its first backward pass; this test fails with their output when any of them fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_the_simulated_device_cases_pass_in_their_own_process() -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent / "src")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            str(TESTS / "simdevice_cases.py"),
        ],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]
