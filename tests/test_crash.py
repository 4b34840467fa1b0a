"""Crash-proofing: ``clipless train`` killed with SIGKILL at random points, then resumed.

After every kill: ``ledger.json`` is valid (strict JSON, a well-formed ledger), it records at least
as many steps as noise was drawn for (the noise draws are logged, fsynced, by a wrapper around
``clipless.optim.optimizer.draw_noise`` *before* each draw, which makes the check stricter),
the budget is never overspent, and ``checkpoint.pt`` / ``config.json`` are readable whenever they
exist. After the last kill the run is resumed to completion: its ledger equals the ledger of a
run that was never interrupted (the plan caps the steps, so the steps lost with a crash are
spent, not redone).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clipless.accounting import PrivacyLedger
from clipless.training import load_checkpoint

FORK = False  # set by the fast test: fork the current interpreter instead of starting one
SRC = Path(__file__).resolve().parents[1] / "src"
EPSILON, DELTA = 1.0, 1e-5

DRIVER = r"""
import os, sys
import clipless.optim.optimizer as optim  # the module whose step draws the noise

_real = optim.draw_noise
_log = os.environ["CLIPLESS_NOISE_LOG"]


def draw_noise(plan, name, shape, generator, dtype, std=None, out=None):
    if name == plan.names[0]:  # once per step, before any of its noise exists
        fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, b"1\n")
        os.fsync(fd)
        os.close(fd)
    return _real(plan, name, shape, generator, dtype, std, out)


optim.draw_noise = draw_noise
from clipless.cli import main

sys.exit(main(sys.argv[1:]))
"""


def _argv(out: Path, epochs: int) -> list[str]:
    return [
        "train",
        "--dataset",
        "breast-cancer",
        "--epsilon",
        str(EPSILON),
        "--delta",
        str(DELTA),
        "--epochs",
        str(epochs),
        "--batch-size",
        "64",
        "--model",
        "mlp",
        "--hidden",
        "8,8",
        "--ema",
        "0",
        "--out",
        str(out),
        "--no-progress",
        "--quiet",
        "--unsafe-seed",
        "7",
    ]


def _start(out: Path, epochs: int, log: Path, *extra: str) -> Any:
    if FORK:
        return _Forked([*_argv(out, epochs), *extra], log)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(SRC) + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        CLIPLESS_NOISE_LOG=str(log),
    )
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, *_argv(out, epochs), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


class _Forked:
    """A forked child running ``clipless.cli.main`` (no interpreter start-up, no re-import).

    Same interface as the parts of :class:`subprocess.Popen` used here. The child is a separate
    process killed with SIGKILL like the subprocess one; only the start-up cost differs.

    The child is forked from a ``forkserver`` that has imported clipless (and torch) but never ran
    a parallel region, not from pytest's process: a child forked from a process whose OpenMP
    thread pool (GNU libgomp, used by torch's MKL) has run hangs in its first parallel region
    (here ``torch.linalg.qr`` in ``orthogonal_``), which made this test hang when it ran after
    tests that train in-process (``pytest tests/test_engine.py tests/test_crash.py``).
    """

    def __init__(self, argv: list[str], log: Path) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["clipless.cli", "clipless.optim"])
        self._proc = ctx.Process(target=_forked_main, args=(argv, str(log)), daemon=True)
        self._proc.start()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        assert self._proc.pid is not None
        os.kill(self._proc.pid, sig)

    def communicate(self, timeout: float) -> tuple[bytes, bytes]:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self._proc.kill()
            raise TimeoutError("the forked clipless run did not finish")
        self.returncode = self._proc.exitcode
        return b"", b""


def _forked_main(argv: list[str], log: str) -> None:
    import clipless.optim.optimizer as optim  # the module whose step draws the noise
    from clipless.cli import main

    real = optim.draw_noise

    def draw_noise(plan, name, shape, generator, dtype, std=None, out=None):  # the DRIVER's wrapper
        if name == plan.names[0]:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, b"1\n")
            os.fsync(fd)
            os.close(fd)
        return real(plan, name, shape, generator, dtype, std, out)

    optim.draw_noise = draw_noise
    with open(os.devnull, "w") as sink:
        sys.stdout = sys.stderr = sink
        code = main(argv)
    os._exit(code)


def _draws(log: Path) -> int:
    return log.read_bytes().count(b"\n") if log.exists() else 0


def _check_invariants(out: Path, log: Path) -> int:
    """The invariants that must hold at any instant; returns the ledger's step count."""
    ledger_file = out / "ledger.json"
    steps = 0
    if ledger_file.exists():
        json.loads(ledger_file.read_text(encoding="utf-8"))  # strict JSON, never torn
        ledger = PrivacyLedger.from_json(ledger_file)
        steps = ledger.steps
        if steps:
            assert ledger.epsilon(DELTA) <= EPSILON * (1 + 1e-9), "budget overspent"
    assert _draws(log) <= steps, f"noise drawn for {_draws(log)} steps, ledger has {steps}"
    if (out / "config.json").exists():
        json.loads((out / "config.json").read_text(encoding="utf-8"))
    if (out / "checkpoint.pt").exists():
        state = load_checkpoint(out / "checkpoint.pt")
        assert PrivacyLedger.from_dict(state["engine"]["ledger"]).steps <= steps
    return steps


def _kill_when(
    proc: subprocess.Popen[bytes], out: Path, log: Path, trigger: str, value: float
) -> None:
    """SIGKILL ``proc`` when ``trigger`` happens (or when it exits by itself).

    Fails (after killing it) when the child neither exits nor draws noise for 120 s: a hung child
    must fail the test, not hang it.
    """
    started, base = time.monotonic(), _draws(log)
    progress, seen = started, base
    while proc.poll() is None:
        draws = _draws(log)
        if draws != seen:
            progress, seen = time.monotonic(), draws
        if time.monotonic() - progress > 120:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=60)
            pytest.fail(f"the clipless run made no progress for 120 s ({seen - base} draws)")
        if trigger == "time" and time.monotonic() - started >= value:
            break
        if trigger == "draws" and draws - base >= value:
            break
        if trigger.startswith("tmp:"):
            name = trigger[4:]
            if any(p.name.startswith(f".{name}.") for p in out.glob(".*.tmp")):
                break
            if time.monotonic() - started > 60:
                break
        time.sleep(0.002)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)


def _planned_ledger(out: Path, epochs: int) -> PrivacyLedger:
    """The ledger of the uninterrupted run: every planned step at the calibrated noise."""
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    planned = epochs * max(1, round(1.0 / config["sample_rate"]))
    ledger = PrivacyLedger()
    ledger.record(config["effective_noise_multiplier"], config["sample_rate"], count=planned)
    return ledger


def _crash_and_resume(tmp: Path, epochs: int, kills: list[tuple[str, float]]) -> PrivacyLedger:
    out, log = tmp / "run", tmp / "noise.log"
    for trigger, value in kills:
        has_run = (out / "checkpoint.pt").exists()
        extra = ("--resume",) if has_run else ()
        if not has_run and out.exists():  # killed before its first checkpoint: start over
            proc = _start(out, epochs, log, "--resume")
            _, err = proc.communicate(timeout=120)
            if (out / "config.json").exists():  # a run that cannot be resumed is refused
                assert proc.returncode == 2, err
                assert FORK or err.decode().count("error:") == 1, err
            shutil.rmtree(out)
            log.unlink(missing_ok=True)
        proc = _start(out, epochs, log, *extra)
        _kill_when(proc, out, log, trigger, value)
        _check_invariants(out, log)
    extra = ("--resume",) if (out / "checkpoint.pt").exists() else ()
    if not extra and out.exists():
        shutil.rmtree(out)
        log.unlink(missing_ok=True)
    proc = _start(out, epochs, log, *extra)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]
    steps = _check_invariants(out, log)
    final = PrivacyLedger.from_json(out / "ledger.json")
    assert steps == final.steps
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["epsilon"] == pytest.approx(final.epsilon(DELTA), rel=1e-12)
    assert (out / "model.pt").is_file()
    return final


@pytest.mark.skipif(sys.platform == "win32", reason="fork and SIGKILL are POSIX")
def test_kill_during_training_then_resume_matches_the_uninterrupted_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "FORK", True)
    epochs = 3  # 21 steps of 64 expected records on breast-cancer (456 training records)
    final = _crash_and_resume(tmp_path, epochs, [("draws", 9)])
    expected = _planned_ledger(tmp_path / "run", epochs)
    assert final.steps == expected.steps
    assert final.epsilon(DELTA) == pytest.approx(expected.epsilon(DELTA), rel=1e-12)
    assert final.epsilon(DELTA) <= EPSILON


@pytest.mark.slow
def test_random_sigkills_never_lose_or_corrupt_the_ledger(tmp_path: Path) -> None:
    epochs = 6
    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted = _crash_and_resume(reference, epochs, [])
    rng = random.Random(2026)
    for trial in range(2):
        kills: list[tuple[str, float]] = [
            ("tmp:checkpoint.pt", 0),  # during a checkpoint write
            ("tmp:ledger.json", 0),  # during a ledger write
        ]
        kills += [("time", rng.uniform(0.5, 9.0)) for _ in range(3)]
        kills += [("draws", rng.randint(1, 40)) for _ in range(2)]
        rng.shuffle(kills)
        folder = tmp_path / f"trial{trial}"
        folder.mkdir()
        final = _crash_and_resume(folder, epochs, kills)
        assert final.to_dict() == uninterrupted.to_dict()


def _ecdf_child(argv: list[str]) -> None:
    from clipless.cli import main

    with open(os.devnull, "w") as sink:
        sys.stdout = sys.stderr = sink
        code = main(argv)
    os._exit(code)


def _complete_csv(path: Path, rows: set[int]) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "threshold,value"
    assert len(lines) - 1 in rows, len(lines)
    for line in lines[1:]:
        t, v = line.split(",")
        float(t), float(v)


@pytest.mark.skipif(sys.platform == "win32", reason="fork and SIGKILL are POSIX")
def test_killed_ecdf_never_leaves_a_torn_release(tmp_path: Path) -> None:
    import multiprocessing

    import numpy as np

    data = tmp_path / "data.csv"
    values = np.random.default_rng(0).normal(size=3000)
    data.write_text("x\n" + "\n".join(f"{v:.6f}" for v in values) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    base = ["ecdf", str(data), "--column", "x", "--lower", "-4", "--upper", "4"]
    base += ["--epsilon", "1", "--seed", "1", "--out", str(out)]
    ctx = multiprocessing.get_context("forkserver")  # a clean parent: see _Forked
    ctx.set_forkserver_preload(["clipless.cli"])
    first = ctx.Process(target=_ecdf_child, args=([*base, "--size", "1000"],))
    first.start()
    first.join(120)
    assert first.exitcode == 0
    _complete_csv(out / "ecdf.csv", {1000})
    rng = random.Random(5)
    for _ in range(4):
        # --force: a release over the earlier one (without it the command now refuses at once)
        child = ctx.Process(target=_ecdf_child, args=([*base, "--size", "4000", "--force"],))
        child.start()
        time.sleep(rng.uniform(0.0, 1.5))
        if child.exitcode is None:
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)
        child.join(120)
        _complete_csv(out / "ecdf.csv", {1000, 4000})  # the old release or the new, whole
        png = (out / "ecdf.png").read_bytes()
        assert png.startswith(b"\x89PNG") and png.rstrip().endswith(b"\xaeB`\x82")
