"""``clipless train --data FILE.parquet``: the same tensors, errors and run as the same table
written as CSV (clipless.data.table, issue 38)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from clipless.cli import main
from clipless.data.table import is_parquet, load_table, parse_columns

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

COLUMNS = "age=20..80;hours=0..100;score=-1.5..2.5;sex=Male|Female;grade=1|2|3"
HEADER = ["id", "age", "hours", "score", "sex", "grade", "income"]


def _write_both(tmp_path: Path, rows: list[list[object]], types: list[object]) -> tuple[Path, Path]:
    """The table as CSV (a null: an empty field) and as Parquet, with the column ``types``."""
    csv_path = tmp_path / "t.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(HEADER)
        writer.writerows([["" if v is None else v for v in row] for row in rows])
    columns = list(zip(*rows, strict=True))
    table = pa.table(
        {
            name: pa.array(list(col), type=t)
            for name, col, t in zip(HEADER, columns, types, strict=True)
        }
    )
    parquet_path = tmp_path / "t.parquet"
    pq.write_table(table, parquet_path)
    return csv_path, parquet_path


TYPES = [pa.int64(), pa.int32(), pa.float64(), pa.string(), pa.string(), pa.int64(), pa.string()]


def _rows(n: int, seed: int = 0) -> list[list[object]]:
    g = torch.Generator().manual_seed(seed)
    rows: list[list[object]] = []
    for i in range(n):
        age = int(torch.randint(10, 95, (1,), generator=g))  # some outside 20..80: clipped
        hours = None if i % 7 == 0 else int(torch.randint(0, 101, (1,), generator=g))
        score = float(torch.randn((), generator=g, dtype=torch.float64)) * 1.3
        score_text = "NA" if i % 11 == 0 else repr(score)  # a numeric column stored as text
        sex = ["Male", "Female", "Other", None][i % 4]
        grade = 1 + i % 4  # 4: not a declared category
        income = "yes" if age + (hours or 50) / 2 + score * 10 > 85 else "no"
        rows.append([i, age, hours, score_text, sex, grade, income])
    return rows


def test_parquet_and_csv_give_bit_identical_tensors(tmp_path: Path) -> None:
    csv_path, parquet_path = _write_both(tmp_path, _rows(500), TYPES)
    assert is_parquet(parquet_path) and not is_parquet(csv_path)
    columns = parse_columns(COLUMNS)
    a = load_table(csv_path, "income", ("no", "yes"), columns)
    b = load_table(parquet_path, "income", ("no", "yes"), columns)
    for csv_part, parquet_part in zip(a[:2], b[:2], strict=True):
        for x, y in zip(csv_part.tensors, parquet_part.tensors, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.view(torch.int32) if x.is_floating_point() else x,
                               y.view(torch.int32) if y.is_floating_point() else y)  # fmt: skip
    assert a[2].input_shape == b[2].input_shape == (8,)
    # the file's transforms hit every case: clipped, missing, unknown category, text numbers
    x = a[0].tensors[0]
    assert (x[:, 0] == 1).any() and (x[:, 0] == -1).any() and (x[:, 1] == 0).any()
    assert (x[:, 3:5].sum(dim=1) == 0).any() and (x[:, 5:].sum(dim=1) == 0).any()


def test_a_parquet_file_is_known_by_its_content_too(tmp_path: Path) -> None:
    _, parquet_path = _write_both(tmp_path, _rows(20), TYPES)
    renamed = parquet_path.rename(tmp_path / "export.dat")
    assert is_parquet(renamed)
    train, _, _ = load_table(renamed, "income", ("no", "yes"), parse_columns(COLUMNS))
    assert train.tensors[0].shape == (16, 8)


def _first_error(path: Path, label: str = "income") -> str:
    with pytest.raises(ValueError) as caught:
        load_table(path, label, ("no", "yes"), parse_columns(COLUMNS))
    return str(caught.value).replace(str(path), "FILE")


@pytest.mark.parametrize(
    ("change", "text", "words"),
    [
        ({(3, 1): "old"}, {1}, "data row 4: column 'age' holds 'old'"),
        ({(2, 6): "maybe", (5, 1): "x"}, {1}, "data row 3: label 'maybe'"),
        ({(2, 2): "x", (2, 6): "maybe"}, {2}, "data row 3: label 'maybe'"),
        ({(1, 2): "x", (1, 1): "y"}, {1, 2}, "data row 2: column 'age' holds 'y'"),
        ({(4, 3): "1e"}, set(), "data row 5: column 'score' holds '1e'"),
    ],
)
def test_bad_records_give_the_csv_readers_error(
    tmp_path: Path, change: dict[tuple[int, int], object], text: set[int], words: str
) -> None:
    """The first error in the CSV reader's order: the earliest row, then the label, then the
    columns in their declared order (``text``: the columns stored as strings)."""
    rows = [
        [str(v) if j in text and v is not None else v for j, v in enumerate(r)] for r in _rows(10)
    ]
    for (row, col), value in change.items():
        rows[row][col] = value
    types = [pa.string() if j in text else t for j, t in enumerate(TYPES)]
    csv_path, parquet_path = _write_both(tmp_path, rows, types)
    message = _first_error(parquet_path)
    assert message == _first_error(csv_path)
    assert words in message


def test_a_boolean_or_missing_column_is_refused(tmp_path: Path) -> None:
    table = pa.table({"age": [True, False], "income": ["no", "yes"]})
    path = tmp_path / "b.parquet"
    pq.write_table(table, path)
    with pytest.raises(ValueError, match="data row 1: column 'age' holds True, not a number"):
        load_table(path, "income", ("no", "yes"), parse_columns("age=0..1"))
    with pytest.raises(ValueError, match="has no column 'salary', 'hours'"):
        load_table(path, "salary", ("no", "yes"), parse_columns("age=0..1;hours=0..9"))
    pq.write_table(table.slice(0, 0), path)
    with pytest.raises(ValueError, match="holds no data row"):
        load_table(path, "income", ("no", "yes"), parse_columns("age=0..1"))
    path.write_text("age,income\n1,no\n")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        load_table(path, "income", ("no", "yes"), parse_columns("age=0..1"))


def test_without_pyarrow_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, parquet_path = _write_both(tmp_path, _rows(10), TYPES)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'clipless\[parquet\]'"):
        load_table(parquet_path, "income", ("no", "yes"), parse_columns(COLUMNS))
    argv = ["train", "--data", str(parquet_path), "--label", "income", "--classes", "no,yes"]
    argv += ["--columns", COLUMNS, "--out", str(tmp_path / "run"), "--no-progress", "--quiet"]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--data" in last and "pip install 'clipless[parquet]'" in last


def test_cli_trains_the_same_run_from_parquet_and_csv(tmp_path: Path) -> None:
    csv_path, parquet_path = _write_both(tmp_path, _rows(600), TYPES)
    runs = []
    for path in (csv_path, parquet_path):
        out = tmp_path / f"run-{path.suffix[1:]}"
        argv = ["train", "--data", str(path), "--label", "income", "--classes", "no,yes"]
        argv += ["--columns", COLUMNS, "--epsilon", "3", "--epochs", "3", "--out", str(out)]
        argv += ["--no-progress", "--quiet", "--unsafe-seed", "5"]
        assert main(argv) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        model = torch.load(out / "model.pt", weights_only=False)
        runs.append((metrics, model))
    (a, model_a), (b, model_b) = runs
    assert a["final"]["test_accuracy"] > 0.7  # it learns (chance: about 0.5)
    strip = ("time_s",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in a["history"]] == [
        {k: v for k, v in r.items() if k not in strip} for r in b["history"]
    ]
    assert a["epsilon"] == b["epsilon"] and a["robustness"] == b["robustness"]
    state_a, state_b = model_a["state_dict"], model_b["state_dict"]
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
