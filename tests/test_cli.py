"""Tests of the ``clipless`` command (argument handling and a short real run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clipless.accounting import PrivacyLedger
from clipless.cli import build_parser, load_trained_model, main
from clipless.data import images as images_mod


def test_help_documents_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("train", "data", "ecdf", "roc", "--epsilon 1.0 --delta 1e-5"):
        assert word in out
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for option in (
        "--dataset",
        "--epsilon",
        "--delta",
        "--epochs",
        "--out",
        "--lr",
        "--batch-size",
        "--max-norm",
        "--constraint",
        "--scaling",
        "--noise",
        "--hidden",
        "--seed",
        "--accountant",
        "--neighbouring",
        "--resume",
    ):
        assert option in out, option


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["train", "--epsilon", "-1"], "--epsilon"),
        (["train", "--epsilon", "abc"], "--epsilon"),
        (["train", "--delta", "1.5"], "--delta"),
        (["train", "--epochs", "0"], "--epochs"),
        (["train", "--hidden", "3,4"], "--hidden"),
        (["train", "--momentum", "1.5"], "--momentum"),
        (["train", "--ema", "1"], "--ema"),
        (["train", "--dataset", "mnist-3d"], "--dataset"),
        (["train", "--constraint", "none"], "--constraint"),
        (["train", "--batch-size", "100000", "--out", "{tmp}"], "--batch-size"),
        (["data", "fetch", "nope"], "name"),
        (["frobnicate"], "COMMAND"),
        ([], "COMMAND"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    argv: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err, err


def test_train_runs_and_writes_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--dataset", "breast-cancer", "--epsilon", "1.0", "--delta", "1e-5"]
    argv += ["--epochs", "2", "--out", str(out), "--no-progress", "--unsafe-seed", "3"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    lines = [line for line in stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2 and "train_acc" in lines[0] and "test_acc" in lines[0]
    assert "epsilon" in lines[0] and "final: test_acc" in stdout
    for name in ("metrics.json", "metrics.csv", "ledger.json", "model.pt", "training.png"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epsilon"] <= 1.0 and metrics["stop_reason"] == "completed"
    assert len(metrics["history"]) == 2
    ledger = PrivacyLedger.from_json(out / "ledger.json")
    assert ledger.epsilon(1e-5) == pytest.approx(metrics["epsilon"])
    assert ledger.epsilon(1e-5) <= 1.0
    model = load_trained_model(out / "model.pt")
    assert model(torch.zeros(3, 30)).shape == (3, 2)
    # resuming a finished run takes no further step and keeps the ledger
    assert main([*argv, "--resume"]) == 0
    assert PrivacyLedger.from_json(out / "ledger.json").to_dict() == ledger.to_dict()


def test_data_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["data", "list"]) == 0
    assert "breast-cancer" in capsys.readouterr().out
    assert main(["data", "fetch", "digits", "--root", str(tmp_path)]) == 0
    assert "nothing to fetch" in capsys.readouterr().out
    monkeypatch.setattr(images_mod, "FASHION_MNIST_SYSTEM_DIRS", [tmp_path / "none"])

    def offline(*args: object, **kwargs: object) -> bytes:
        raise OSError("offline")

    monkeypatch.setattr(images_mod, "download_verified", offline)
    assert main(["data", "fetch", "fashion-mnist", "--root", str(tmp_path)]) == 1
    assert "apt-get install -y dataset-fashion-mnist" in capsys.readouterr().err


def test_parser_defaults_are_the_demo() -> None:
    args = build_parser().parse_args(["train"])
    assert (args.dataset, args.epsilon, args.delta, args.epochs) == ("breast-cancer", 1.0, 1e-5, 30)
    assert args.out == "runs/demo"


def test_python_dash_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "clipless", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("clipless ")


def test_build_mlp_starts_with_input_norm_for_images() -> None:
    from clipless import nn
    from clipless.cli import build_mlp

    model = build_mlp((1, 8, 8), (4,), 10, 2.0)
    assert isinstance(model[0], nn.InputNorm) and isinstance(model[1], nn.Flatten)
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    nn.validate(model)
