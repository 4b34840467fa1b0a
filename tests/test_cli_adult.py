"""``clipless train --dataset adult``: the recorded ``--preprocessing`` (synthetic rows only)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from clipless.cli import ADULT_LR, ADULT_PREPROCESSING, load_trained_model, main
from clipless.data import tabular as tab


def _rows(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        rich = bool(rng.random() < 0.3)
        fields = [
            str(int(rng.integers(17, 91))),
            "Private",
            "1000",
            "Bachelors" if rich else "HS-grad",
            "13" if rich else "9",
            "Married-civ-spouse" if rich else "Never-married",
            "Exec-managerial" if rich else "?",
            "Husband" if rich else "Own-child",
            "White",
            "Male",
            str(int(rng.choice([0, 15024]))),
            "0",
            str(int(rng.integers(1, 100))),
            "United-States",
            ">50K" if rich else "<=50K",
        ]
        lines.append(", ".join(fields))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def adult_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "adult").mkdir()
    (root / "adult" / "adult.data").write_text(_rows(64, 0))
    (root / "adult" / "adult.test").write_text("|1x3 Cross validator\n" + _rows(16, 1))
    return root


def _train(root: Path, out: Path, *extra: str) -> list[str]:
    argv = ["train", "--dataset", "adult", "--data-root", str(root), "--out", str(out)]
    return [*argv, "--epsilon", "1", "--epochs", "1", "--no-progress", "--quiet", *extra]


def test_adult_default_is_public_bins_fine_recorded_and_the_model_takes_its_features(
    adult_root: Path, tmp_path: Path
) -> None:
    assert ADULT_PREPROCESSING == "public-bins-fine"
    out = tmp_path / "run"
    assert main(_train(adult_root, out, "--unsafe-seed", "1")) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["preprocessing"] == "public-bins-fine"
    assert config["options"]["preprocessing"] == "public-bins-fine"
    assert config["input_shape"] == [146]
    assert config["input_norm"] == math.sqrt(17.0) == tab.adult_max_norm("public-bins-fine")
    assert config["lr"] == ADULT_LR == 0.003  # adult's own default (other datasets: 0.01)
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["architecture"]["preprocessing"] == "public-bins-fine"
    model = load_trained_model(out / "model.pt")
    _, test, _ = tab.load_adult(adult_root, False, state["architecture"]["preprocessing"])
    assert model(test.tensors[0]).shape == (16, 2)
    # resumed with nothing but the data's location given: the recorded transform is kept
    resume = ["train", "--out", str(out), "--resume", "--data-root", str(adult_root)]
    assert main([*resume, "--no-progress", "--quiet"]) == 0


def test_a_run_from_before_the_option_resumes_with_public_ranges(
    adult_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "old"
    assert main(_train(adult_root, out, "--preprocessing", "public-ranges", "--epochs", "2")) == 0
    path = out / "config.json"
    saved = json.loads(path.read_text())
    assert saved["input_shape"] == [104] and saved["input_norm"] == math.sqrt(13.0)
    # what a run folder written before --preprocessing existed looks like
    del saved["options"]["preprocessing"], saved["preprocessing"]
    path.write_text(json.dumps(saved))
    capsys.readouterr()
    resume = ["train", "--out", str(out), "--resume", "--data-root", str(adult_root)]
    assert main([*resume, "--no-progress", "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["preprocessing"] == "public-ranges"
    assert metrics["config"]["input_shape"] == [104]
    assert main([*resume, "--preprocessing", "public-bins"]) == 2
    err = capsys.readouterr().err
    assert "--preprocessing (run: public-ranges, given: public-bins)" in err


def test_preprocessing_is_refused_for_other_datasets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--dataset", "breast-cancer", "--preprocessing", "public-bins"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--preprocessing" in err and "adult only" in err
    assert not (tmp_path / "r").exists()
