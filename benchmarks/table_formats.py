"""Parquet against CSV for ``clipless train --data`` on the real Adult table.

``python benchmarks/table_formats.py`` (one thread; needs the Adult files, ``make data``) writes
Adult's 32,561 training and 16,281 test rows (15 columns, the label ``income``) as CSV and as
Parquet (numbers as int64, the rest as strings, ``?`` kept), then:

* times ``clipless.data.table.load_table`` on each (train and test file; the median of
  ``--reps`` alternating rounds) and checks that the tensors are bit for bit the same;
* trains ``clipless train --data ... --test-data ...`` on each with the same ``--unsafe-seed``
  and checks that the histories (but their times) and the saved weights are the same.

The columns are declared with public ranges (census conventions: ages 17-90, education 1-16,
hours 1-99, capital at the top-code 99,999) and adult.names' category lists; nothing is fitted.
Results: ``benchmarks/RESULTS.md`` section 43.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from clipless.cli import main
from clipless.data import data_root
from clipless.data.table import load_table, parse_classes, parse_columns
from clipless.data.tabular import _ADULT_CATEGORIES, _ADULT_COLUMNS

NUMERIC = {
    "age": "17..90",
    "education-num": "1..16",
    "capital-gain": "0..99999",
    "capital-loss": "0..99999",
    "hours-per-week": "1..99",
}
INTEGER = {"age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"}
CLASSES = "<=50K,>50K"


def columns_spec() -> str:
    numeric = [f"{name}={rule}" for name, rule in NUMERIC.items()]
    categorical = [f"{name}={'|'.join(values)}" for name, values in _ADULT_CATEGORIES.items()]
    return ";".join(numeric + categorical)


def _rows(path: Path) -> list[list[str]]:
    rows = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == len(_ADULT_COLUMNS):
            fields[-1] = fields[-1].rstrip(".")  # adult.test writes ">50K."
            rows.append(fields)
    return rows


def write_both(rows: list[list[str]], stem: Path) -> tuple[Path, Path]:
    csv_path, parquet_path = stem.with_suffix(".csv"), stem.with_suffix(".parquet")
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(_ADULT_COLUMNS)
        writer.writerows(rows)
    columns = {
        name: pa.array([int(r[j]) for r in rows], pa.int64())
        if name in INTEGER
        else pa.array([r[j] for r in rows], pa.string())
        for j, name in enumerate(_ADULT_COLUMNS)
    }
    pq.write_table(pa.table(columns), parquet_path)
    return csv_path, parquet_path


def _load(train: Path, test: Path) -> tuple[float, tuple[torch.Tensor, ...]]:
    started = time.perf_counter()
    a, b, _ = load_table(
        train, "income", parse_classes(CLASSES), parse_columns(columns_spec()), test
    )
    return time.perf_counter() - started, (*a.tensors, *b.tensors)


def _train(train: Path, test: Path, out: Path, epochs: int) -> tuple[dict, dict]:
    argv = ["train", "--data", str(train), "--test-data", str(test), "--label", "income"]
    argv += ["--classes", CLASSES, "--columns", columns_spec(), "--epochs", str(epochs)]
    argv += ["--out", str(out), "--unsafe-seed", "0", "--no-progress", "--quiet"]
    started = time.perf_counter()
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["wall_s"] = time.perf_counter() - started
    return metrics, torch.load(out / "model.pt", weights_only=False)["state_dict"]


def main_(reps: int, epochs: int) -> None:
    torch.set_num_threads(1)
    root = data_root(None) / "adult"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train = write_both(_rows(root / "adult.data"), folder / "adult")
        test = write_both(_rows(root / "adult.test"), folder / "adult-test")
        for kind, index in (("csv", 0), ("parquet", 1)):
            sizes = [p[index].stat().st_size for p in (train, test)]
            print(f"{kind}: {sizes[0] + sizes[1]:,} bytes (train + test)")
        times: dict[str, list[float]] = {"csv": [], "parquet": []}
        tensors = {}
        for _ in range(reps):
            for kind, index in (("csv", 0), ("parquet", 1)):
                seconds, tensors[kind] = _load(train[index], test[index])
                times[kind].append(seconds)
        same = all(
            torch.equal(a, b) and a.dtype == b.dtype
            for a, b in zip(tensors["csv"], tensors["parquet"], strict=True)
        )
        x = tensors["csv"][0]
        print(f"train {tuple(x.shape)}, test {tuple(tensors['csv'][2].shape)}")
        for kind, values in times.items():
            print(f"load_table {kind}: median {statistics.median(values):.3f} s {values}")
        print(f"tensors bit for bit equal: {same}")
        runs = {kind: _train(train[i], test[i], folder / kind, epochs) for kind, i in
                (("csv", 0), ("parquet", 1))}  # fmt: skip
        (a, wa), (b, wb) = runs["csv"], runs["parquet"]

        def strip(m: dict) -> list:
            return [{k: v for k, v in r.items() if k != "time_s"} for r in m["history"]]

        weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        print(f"histories equal: {strip(a) == strip(b)}; weights equal: {weights}")
        for kind, (m, _) in runs.items():
            print(
                f"{kind}: test accuracy {m['final']['test_accuracy']:.5f} epsilon "
                f"{m['epsilon']:.5f} ({m['steps']} steps), run {m['wall_s']:.1f} s"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    main_(args.reps, args.epochs)
