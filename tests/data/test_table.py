"""clipless.data.table and ``clipless train --data FILE.csv`` (issue 38)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from clipless.cli import main
from clipless.data.table import Column, load_table, max_norm, parse_classes, parse_columns

COLUMNS = "age=20..80;hours=0..100;sex=Male|Female"


def _write(path: Path, rows: list[list[object]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "age", "hours", "sex", "income"])
        writer.writerows(rows)
    return path


def test_public_transforms_are_exact_and_never_fitted(tmp_path: Path) -> None:
    rows = [
        [0, 20, 50, "Male", "no"],
        [1, 80, "", "Female", "yes"],
        [2, 200, "NA", "Other", "yes"],  # clipped; missing -> 0; unknown category -> zeros
        [3, 35, 0, "", "no"],
        [4, -10, 100, "Female", "no"],
    ]
    path = _write(tmp_path / "t.csv", rows)
    columns = parse_columns(COLUMNS)
    assert columns == (
        Column("age", 20.0, 80.0),
        Column("hours", 0.0, 100.0),
        Column("sex", categories=("Male", "Female")),
    )
    train, test, info = load_table(path, "income", ("no", "yes"), columns, test_path=path)
    expected = torch.tensor(
        [
            [-1.0, 0.0, 1.0, 0.0],
            [1.0, 0.0, 0.0, 1.0],
            [1.0, 0.0, 0.0, 0.0],
            [-0.5, -1.0, 0.0, 0.0],
            [-1.0, 1.0, 0.0, 1.0],
        ]
    )
    torch.testing.assert_close(train.tensors[0], expected, rtol=0, atol=1e-7)
    assert train.tensors[1].tolist() == [0, 1, 1, 0, 0]
    assert info.input_shape == (4,) and info.num_classes == 2 and len(test) == 5
    assert info.feature_names == ("age", "hours", "sex=Male", "sex=Female")
    # the certified input bound: every record's norm is at most sqrt(#columns)
    assert float(train.tensors[0].norm(dim=1).max()) <= max_norm(columns) == math.sqrt(3)


def test_held_out_split_is_fixed_and_disjoint(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.csv", [[i, 20 + i % 60, i % 100, "Male", "no"] for i in range(50)])
    columns = parse_columns(COLUMNS)
    a_train, a_test, info = load_table(path, "income", ("no", "yes"), columns)
    _, b_test, _ = load_table(path, "income", ("no", "yes"), columns)
    assert (len(a_train), len(a_test)) == (40, 10) == (info.num_train, info.num_test)
    torch.testing.assert_close(a_test.tensors[0], b_test.tensors[0], rtol=0, atol=0)
    both = torch.cat([a_train.tensors[0], a_test.tensors[0]])
    assert len({tuple(r.tolist()) for r in both}) == 50  # a partition of the 50 distinct rows


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("age", "not NAME=LO..HI"),
        ("age=80..20", "LO < HI"),
        ("age=a..b", "two numbers"),
        ("sex=Male||Female", "distinct and non-empty"),
        ("age=1..2;age=3..4", "declared twice"),
        (";", "declares no column"),
    ],
)
def test_bad_column_specs(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_columns(spec)


def test_bad_records_are_named_with_their_row(tmp_path: Path) -> None:
    columns = parse_columns(COLUMNS)
    path = _write(tmp_path / "t.csv", [[0, 30, 1, "Male", "no"], [1, 30, 1, "Male", "maybe"]])
    with pytest.raises(ValueError, match="data row 2: label 'maybe'"):
        load_table(path, "income", ("no", "yes"), columns)
    path = _write(tmp_path / "u.csv", [[0, "old", 1, "Male", "no"]])
    with pytest.raises(ValueError, match="data row 1: column 'age' holds 'old'"):
        load_table(path, "income", ("no", "yes"), columns)
    with pytest.raises(ValueError, match="no column 'salary'"):
        load_table(path, "salary", ("no", "yes"), columns)
    with pytest.raises(ValueError, match="also declared as a feature"):
        load_table(path, "age", ("no", "yes"), columns)
    with pytest.raises(ValueError, match="two distinct"):
        parse_classes("yes")


def _separable(path: Path, n: int) -> Path:
    g = torch.Generator().manual_seed(0)
    age = torch.randint(20, 81, (n,), generator=g)
    hours = torch.randint(0, 101, (n,), generator=g)
    rows = [
        [i, int(a), int(h), "Male" if i % 2 else "Female", "yes" if a + h > 100 else "no"]
        for i, (a, h) in enumerate(zip(age, hours, strict=True))
    ]
    return _write(path, rows)


def test_cli_trains_on_a_csv_with_a_label_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _separable(tmp_path / "people.csv", 2000)
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--label", "income", "--classes", "no,yes"]
    argv += ["--columns", COLUMNS, "--epsilon", "3", "--epochs", "10", "--out", str(out)]
    argv += ["--no-progress", "--quiet", "--unsafe-seed", "3"]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epsilon"] <= 3.0
    accuracy = metrics["final"]["test_accuracy"]
    assert accuracy > 0.85, accuracy  # chance: about 0.5
    config = json.loads((out / "config.json").read_text())
    assert config["options"]["input_norm"] == math.sqrt(3)
    assert config["options"]["dataset"] is None and config["options"]["label"] == "income"
    assert main([*argv, "--resume"]) == 0  # the same table and split: resumable
    capsys.readouterr()
    assert main([*argv[:1], "--dataset", "digits", *argv[1:], "--force"]) == 2
    assert "--dataset or --data" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--data", "{csv}", "--classes", "no,yes", "--columns", COLUMNS], "--label"),
        (["--data", "{csv}", "--label", "income", "--columns", COLUMNS], "--classes"),
        (["--data", "{csv}", "--label", "income", "--classes", "no,yes"], "--columns"),
        (["--label", "income"], "--label"),
        (["--data", "{csv}", "--label", "x", "--classes", "no,yes", "--columns", COLUMNS], "x"),
        (
            ["--data", "{tmp}/none.csv", "--label", "x", "--classes", "a,b", "--columns", "a=1|2"],
            "cannot read",
        ),
        (["--columns", "age=9..1"], "--columns"),
    ],
)
def test_cli_table_errors_exit_2_naming_the_argument(
    extra: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _separable(tmp_path / "people.csv", 20)
    extra = [a.replace("{csv}", str(data)).replace("{tmp}", str(tmp_path)) for a in extra]
    argv = ["train", *extra, "--out", str(tmp_path / "run"), "--no-progress", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err.strip().splitlines()[-1], err


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfage,income\n30,no\n70,yes\n")
    train, _, _ = load_table(path, "income", ("no", "yes"), parse_columns("age=20..80"), path)
    assert train.tensors[0].flatten().tolist() == pytest.approx([-2 / 3, 2 / 3])
