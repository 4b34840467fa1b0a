"""``clipless train --tensorboard DIR`` and clipless.callbacks.TensorBoardLogger: the event files
hold exactly the values metrics.json reports (issue 38)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless.nn as cnn
from clipless.callbacks import TENSORBOARD_SCALARS, TensorBoardLogger
from clipless.cli import main
from clipless.engine import PrivacyEngine, RunOptions
from clipless.training import fit

accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
tensor_util = pytest.importorskip("tensorboard.util.tensor_util")

ARGV = ["train", "--dataset", "breast-cancer", "--epochs", "3", "--unsafe-seed", "4"]
ARGV += ["--no-progress", "--quiet"]


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``folder``: tag -> [(step, value)], by step."""
    events = accumulator.EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: sorted(
            (e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)
        )
        for tag in events.Tags()["tensors"]
    }


def test_cli_event_files_equal_metrics_json(tmp_path: Path) -> None:
    out, board = tmp_path / "run", tmp_path / "tb"
    assert main([*ARGV, "--out", str(out), "--tensorboard", str(board)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    scalars = _scalars(board)
    history = metrics["history"]
    assert [r["epoch"] for r in history] == [1, 2, 3]
    for key, tag in TENSORBOARD_SCALARS.items():
        assert scalars[tag] == [(r["epoch"], r[key]) for r in history], tag  # exact, not close
    assert scalars["privacy/epsilon"][-1] == (3, metrics["epsilon"])
    certified = metrics["robustness"]["certified_accuracy"]
    assert len(certified) == 4
    for radius, accuracy in certified.items():
        assert scalars[f"robustness/certified_accuracy_r{radius}"] == [(3, accuracy)]
    assert len(scalars) == len(TENSORBOARD_SCALARS) + len(certified)
    assert board.stat().st_mode & 0o777 == 0o700  # train values are computed on private data


def test_library_callback_with_fit(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(4, 2))
    engine = PrivacyEngine(accountant="pld", seed=1)
    loss = cnn.CrossEntropyLoss()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=50),
        loss=loss,
        noise_multiplier=2.0,
        options=RunOptions(input_shape=(4,)),
    )
    with TensorBoardLogger(tmp_path / "tb") as log:
        result = fit(model, optimizer, loader, loss, engine=engine, epochs=2, delta=1e-5,
                     progress=False, on_epoch_end=log)  # fmt: skip
    scalars = _scalars(tmp_path / "tb")
    assert scalars["train/loss"] == [(r["epoch"], r["train_loss"]) for r in result.history]
    assert scalars["privacy/epsilon"] == [(r["epoch"], r["epsilon"]) for r in result.history]
    assert scalars["privacy/epsilon"][-1] == (2, result.epsilon)
    assert "test/accuracy" not in scalars  # no eval_loader: no test values, none written


def test_missing_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'clipless\[tensorboard\]'"):
        TensorBoardLogger(tmp_path / "tb")
    out = tmp_path / "run"
    assert main([*ARGV, "--out", str(out), "--tensorboard", str(tmp_path / "tb")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--tensorboard" in last and "pip install 'clipless[tensorboard]'" in last
    assert not out.exists() and not (tmp_path / "tb").exists()  # refused before any write


def test_a_file_is_no_log_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tb").write_text("")
    argv = [*ARGV, "--out", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")]
    assert main(argv) == 2
    assert "argument --tensorboard: expected a folder" in capsys.readouterr().err
