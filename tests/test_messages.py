"""Messages that misled a new user (issue 38, item 9), now true."""

from __future__ import annotations

from pathlib import Path

import pytest

from clipless.cli import _interrupted_where, main


def test_interrupt_before_any_step_says_nothing_was_spent(tmp_path: Path) -> None:
    assert "no step was taken, so nothing was spent" in _interrupted_where(tmp_path)
    (tmp_path / "ledger.json").write_text("{}")
    assert "cannot be continued" in _interrupted_where(tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert "continue with --resume" in _interrupted_where(tmp_path)


def test_train_help_names_the_linear_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--model linear, the default" in text and "--data FILE.csv" in text


def test_data_list_gives_adult_width_under_the_cli_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["data", "list"]) == 0
    adult = next(line for line in capsys.readouterr().out.splitlines() if "Adult" in line)
    assert "146 with clipless train's default public-bins-fine" in adult


def test_roc_help_lists_the_accepted_labels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roc", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "1, true, yes, y, t (positive) or 0, false, no, n, f (negative)" in text


def test_nproc_2_ends_without_leaked_semaphores(tmp_path: Path) -> None:
    """Each rank's tqdm lock held a multiprocessing semaphore that ``os._exit`` never released;
    the resource tracker reported it when the command ended (it runs in the command's process
    tree, hence a subprocess here)."""
    import os
    import subprocess
    import sys

    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "clipless", "train", "--dataset", "breast-cancer"]
    argv += ["--epochs", "1", "--nproc", "2", "--quiet", "--out", str(tmp_path / "run")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr
