"""clipless.data.folder and ``clipless train --data DIR`` (an image folder, issue 38)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clipless.cli import main
from clipless.data.folder import load_image_folder


def _folder(
    root: Path, per_class: int, size: tuple[int, int] = (12, 10), rgb: bool = False
) -> Path:
    """Two classes told apart by brightness: class ``dark`` pixels below 80, ``light`` above
    170 (PNG, lossless)."""
    g = torch.Generator().manual_seed(0)
    for name, low in (("dark", 0), ("light", 170)):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            shape = (size[1], size[0], 3) if rgb else (size[1], size[0])
            pixels = torch.randint(low, low + 80, shape, generator=g, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(root / name / f"{i:03d}.png")
    (root / "dark" / ".hidden.png").write_bytes(b"not an image")  # hidden: skipped
    (root / "light" / "notes.txt").write_text("not an image either")  # other extension: skipped
    return root


def test_the_loader_reads_pixels_exactly_with_a_public_split(tmp_path: Path) -> None:
    root = _folder(tmp_path / "imgs", 10)
    train, test, info = load_image_folder(root)
    assert info.class_names == ("dark", "light") and info.input_shape == (1, 10, 12)
    assert (info.num_train, info.num_test) == (16, 4)
    x = torch.cat([train.tensors[0], test.tensors[0]])
    y = torch.cat([train.tensors[1], test.tensors[1]])
    first = torch.from_numpy(np.array(Image.open(root / "dark" / "000.png"))).float().reshape(-1)
    matches = [i for i in range(len(x)) if torch.equal(x[i].reshape(-1), first / 255.0)]
    assert len(matches) == 1 and int(y[matches[0]]) == 0  # pixel / 255 exactly, its label
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    again = load_image_folder(root)  # the split is public and fixed
    assert torch.equal(again[0].tensors[0], train.tensors[0])
    swapped = load_image_folder(root, classes=("light", "dark"))
    assert swapped[2].class_names == ("light", "dark")  # --classes orders the folders
    labels = torch.cat([swapped[0].tensors[1], swapped[1].tensors[1]])
    assert torch.equal(labels.bincount(), y.bincount().flip(0))


def test_rgb_and_a_separate_test_folder(tmp_path: Path) -> None:
    train_root = _folder(tmp_path / "train", 4, rgb=True)
    test_root = _folder(tmp_path / "test", 2, rgb=True)
    train, test, info = load_image_folder(train_root, test_path=test_root)
    assert info.input_shape == (3, 10, 12) and (len(train), len(test)) == (8, 4)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("sizes", "2 sizes"),
        ("one class", "at least two"),
        ("empty class", "holds no image"),
        ("corrupt", "not a readable image"),
    ],
)
def test_bad_folders_are_refused_by_name(tmp_path: Path, damage: str, message: str) -> None:
    root = _folder(tmp_path / "imgs", 3)
    if damage == "sizes":
        Image.new("L", (5, 5)).save(root / "dark" / "odd.png")
    elif damage == "one class":
        for p in (root / "light").iterdir():
            p.unlink()
        (root / "light").rmdir()
    elif damage == "empty class":
        for p in (root / "light").glob("*.png"):
            p.unlink()
    else:
        (root / "dark" / "broken.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(ValueError, match=message):
        load_image_folder(root)
    with pytest.raises(ValueError, match="no subfolder for class"):
        load_image_folder(_folder(tmp_path / "other", 2), classes=("dark", "grey"))


def test_cli_trains_on_an_image_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _folder(tmp_path / "imgs", 150)
    out = tmp_path / "run"
    argv = ["train", "--data", str(root), "--epsilon", "3", "--epochs", "5", "--out", str(out)]
    argv += ["--no-progress", "--quiet", "--unsafe-seed", "3"]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epsilon"] <= 3.0
    assert metrics["final"]["test_accuracy"] > 0.75  # brightness separates them; chance 0.5
    config = json.loads((out / "config.json").read_text())
    assert config["options"]["input_norm"] == math.sqrt(120)  # sqrt(C H W): pixels in [0, 1]
    assert config["options"]["dataset"] is None
    assert main([*argv, "--resume"]) == 0
    capsys.readouterr()
    assert main([*argv, "--label", "y", "--force"]) == 2
    assert "--label" in capsys.readouterr().err
