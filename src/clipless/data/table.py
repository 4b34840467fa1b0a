"""Your own table (CSV or Parquet) with a label column, under public per-column transforms.

``clipless train --data FILE.csv --label COL --classes A,B --columns SPEC`` trains on it (or on
``FILE.parquet``, read with ``pyarrow``: ``pip install 'clipless[parquet]'``). Every
transform is declared, never fitted on the data (a mean, a range or a category list read from
the private records would be a release of them):

* ``NAME=LO..HI``: a numeric column mapped linearly from ``[LO, HI]`` onto ``[-1, 1]`` and
  clipped there; a missing value (empty, ``NA``, ``nan``) becomes 0, the middle of the range;
* ``NAME=A|B|C``: a categorical column one-hot encoded on the declared values; a value outside
  them (or missing) gives the zero vector.

Columns are separated by ``;``. Columns of the file that are not declared are not used. Each
declared column contributes at most 1 to a record's squared norm, so ``sqrt(#columns)`` is a
certified input bound (:func:`max_norm`). The label's values are declared too (``--classes``):
they decide the model's outputs; a record whose label is not one of them is refused, with its row.

A Parquet file gives the same tensors as the same table written as CSV, with the same errors: a
null is a missing value, an integer or floating column is read as numbers, and every other value
is read as its text (``str``), as a CSV file would hold it: a numeric column of strings is parsed
as in a CSV file, and a boolean or date column there is refused as not a number. (A float32
column is widened exactly; a CSV writer may have printed it with fewer digits, a nearby double.)
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from clipless.data.registry import DatasetInfo

__all__ = ["Column", "is_parquet", "load_table", "max_norm", "parse_classes", "parse_columns"]

_MISSING = {"", "na", "nan", "null", "none", "?"}
#: File names read as Parquet (a file that starts with Parquet's magic bytes is too).
PARQUET_SUFFIXES = (".parquet", ".pq")
_PARQUET_MAGIC = b"PAR1"
#: Share of the records held out for the test accuracy when no ``--test-data`` is given.
TEST_FRACTION = 0.2
#: Seed of that split: public and fixed, so a resumed run gets the same split.
SPLIT_SEED = 0


@dataclass(frozen=True)
class Column:
    """One declared column: a numeric range (``low``, ``high``) or a category list."""

    name: str
    low: float | None = None
    high: float | None = None
    categories: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        """Number of features it becomes."""
        return len(self.categories) if self.categories else 1

    def encode(self, value: str) -> list[float]:
        text = value.strip()
        if self.categories:
            return [1.0 if text == c else 0.0 for c in self.categories]
        if text.lower() in _MISSING:
            return [0.0]
        number = float(text)  # ValueError: named with the row by the caller
        if math.isnan(number):
            return [0.0]
        assert self.low is not None and self.high is not None
        scaled = 2.0 * (number - self.low) / (self.high - self.low) - 1.0
        return [min(1.0, max(-1.0, scaled))]

    def describe(self) -> str:
        if self.categories:
            return f"{self.name}: one-hot on {'|'.join(self.categories)}"
        return f"{self.name}: [{self.low:g}, {self.high:g}] -> [-1, 1], clipped"


def parse_columns(spec: str) -> tuple[Column, ...]:
    """``"age=17..90;sex=Male|Female"`` -> the declared columns.

    Args:
        spec: ``;``-separated ``NAME=LO..HI`` (a numeric column scaled from ``[LO, HI]`` to
            ``[-1, 1]``, finite ``LO < HI``) or ``NAME=A|B|...`` (a one-hot column of distinct
            categories), each name once.

    Raises:
        ValueError: a malformed declaration, a name declared twice, or no column.
    """
    columns: list[Column] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, sep, rule = (s.strip() for s in part.partition("="))
        if not sep or not name or not rule:
            raise ValueError(f"{part!r} is not NAME=LO..HI or NAME=A|B|...")
        if any(c.name == name for c in columns):
            raise ValueError(f"column {name!r} is declared twice")
        columns.append(_column(name, rule))
    if not columns:
        raise ValueError("declares no column")
    return tuple(columns)


def _column(name: str, rule: str) -> Column:
    if ".." in rule and "|" not in rule:
        low_text, _, high_text = rule.partition("..")
        try:
            low, high = float(low_text), float(high_text)
        except ValueError:
            raise ValueError(f"{name}={rule}: LO..HI must be two numbers") from None
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"{name}={rule}: LO..HI must be finite with LO < HI")
        return Column(name, low=low, high=high)
    categories = tuple(c.strip() for c in rule.split("|"))
    if any(not c for c in categories) or len(set(categories)) != len(categories):
        raise ValueError(f"{name}={rule}: categories must be distinct and non-empty")
    return Column(name, categories=categories)


def parse_classes(text: str) -> tuple[str, ...]:
    """``"no,yes"`` -> ``("no", "yes")``.

    Args:
        text: comma-separated label values, in class order: at least two, distinct and
            non-empty.

    Raises:
        ValueError: fewer than two values, an empty one, or a repeated one.
    """
    classes = tuple(c.strip() for c in text.split(","))
    if len(classes) < 2 or any(not c for c in classes) or len(set(classes)) != len(classes):
        raise ValueError(f"must be at least two distinct comma-separated values, got {text!r}")
    return classes


def max_norm(columns: tuple[Column, ...]) -> float:
    """``sqrt(#columns)``: every column is in ``[-1, 1]`` or has at most one 1.

    Args:
        columns: the declared columns (:func:`parse_columns`).
    """
    return math.sqrt(len(columns))


def is_parquet(path: Path) -> bool:
    """Whether ``path`` is read as Parquet: its suffix, or its first bytes (``OSError`` if it
    cannot be opened)."""
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return True
    with path.open("rb") as handle:
        return handle.read(len(_PARQUET_MAGIC)) == _PARQUET_MAGIC


def _read(
    path: Path, label: str, classes: tuple[str, ...], columns: tuple[Column, ...]
) -> TensorDataset:
    if is_parquet(path):
        return _read_parquet(path, label, classes, columns)
    return _read_csv(path, label, classes, columns)


def _missing_columns(
    path: Path, header: list[str], label: str, columns: tuple[Column, ...]
) -> None:
    absent = [c.name for c in columns if c.name not in header]
    if label not in header:
        absent.insert(0, label)
    if absent:
        raise ValueError(f"{path} has no column {', '.join(map(repr, absent))}")


def _label_error(path: Path, number: int, value: str, classes: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"{path}, data row {number}: label {value!r} is not one of --classes {','.join(classes)}"
    )


def _number_error(path: Path, number: int, column: Column, value: object) -> ValueError:
    return ValueError(
        f"{path}, data row {number}: column {column.name!r} holds {value!r}, not a number"
    )


def _read_csv(
    path: Path, label: str, classes: tuple[str, ...], columns: tuple[Column, ...]
) -> TensorDataset:
    rows: list[list[float]] = []
    targets: list[int] = []
    with path.open(newline="", encoding="utf-8-sig") as handle:  # a BOM (Excel) is skipped
        reader = csv.DictReader(handle)
        _missing_columns(path, list(reader.fieldnames or []), label, columns)
        for number, record in enumerate(reader, start=1):
            value = (record.get(label) or "").strip()
            if value not in classes:
                raise _label_error(path, number, value, classes)
            features: list[float] = []
            for column in columns:
                try:
                    features += column.encode(record.get(column.name) or "")
                except ValueError:
                    raise _number_error(path, number, column, record.get(column.name)) from None
            rows.append(features)
            targets.append(classes.index(value))
    if not rows:
        raise ValueError(f"{path} holds no data row")
    return TensorDataset(torch.tensor(rows, dtype=torch.float32), torch.tensor(targets))


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            "reading a Parquet file needs pyarrow: pip install 'clipless[parquet]'"
        ) from None
    return pq


def _read_parquet(
    path: Path, label: str, classes: tuple[str, ...], columns: tuple[Column, ...]
) -> TensorDataset:
    """:func:`_read_csv` for a Parquet file, column by column; the error is the one the CSV
    reader raises first (the earliest row; in a row, the label, then the columns in order)."""
    pq = _pyarrow_parquet()
    try:
        names = list(pq.read_schema(path).names)
    except ValueError as exc:  # pyarrow.ArrowInvalid: not a Parquet file
        raise ValueError(f"{path} is not a readable Parquet file ({exc})") from None
    _missing_columns(path, names, label, columns)
    table = pq.read_table(path, columns=[label, *(c.name for c in columns)])
    if table.num_rows == 0:
        raise ValueError(f"{path} holds no data row")
    failures: list[tuple[int, int, ValueError]] = []
    texts = [_text(v) for v in table.column(label).to_pylist()]
    index = {c: i for i, c in enumerate(classes)}
    bad = next((i for i, t in enumerate(texts) if t not in index), None)
    if bad is not None:
        failures.append((bad, 0, _label_error(path, bad + 1, texts[bad], classes)))
    blocks: list[np.ndarray] = []
    for position, column in enumerate(columns, start=1):
        block, failed = _encode_parquet(table.column(column.name), column)
        if failed is not None:
            row, value = failed
            failures.append((row, position, _number_error(path, row + 1, column, value)))
        blocks.append(block)
    if failures:
        raise min(failures, key=lambda f: f[:2])[2]
    targets = np.array([index[t] for t in texts], dtype=np.int64)
    features = torch.from_numpy(np.concatenate(blocks, axis=1)).to(torch.float32)
    return TensorDataset(features, torch.from_numpy(targets))


def _text(value: object) -> str:
    """A Parquet value as the CSV reader sees its field (``None``: an empty field)."""
    return "" if value is None else (value if isinstance(value, str) else str(value)).strip()


def _encode_parquet(values: Any, column: Column) -> tuple[np.ndarray, tuple[int, object] | None]:
    """``(block, failure)``: the column's ``(rows, width)`` float64 features as
    :meth:`Column.encode` computes them, and the first row that holds no number (with its
    value), if any."""
    import pyarrow as pa

    if column.categories:
        texts = np.array([_text(v) for v in values.to_pylist()], dtype=object)
        return np.stack([texts == c for c in column.categories], axis=1).astype(np.float64), None
    kind = values.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_null(kind):
        numbers = values.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    else:  # text (or decimal, boolean, ...): parsed as the CSV reader parses its field
        raw = values.to_pylist()
        numbers = np.empty(len(raw), dtype=np.float64)
        for row, value in enumerate(raw):
            text = _text(value)
            try:
                numbers[row] = math.nan if text.lower() in _MISSING else float(text)
            except ValueError:
                return numbers[:, None], (row, value)
    return _scale(numbers, column)[:, None], None


def _scale(numbers: np.ndarray, column: Column) -> np.ndarray:
    """:meth:`Column.encode` of numbers (NaN: missing), in the same float64 operations."""
    assert column.low is not None and column.high is not None
    scaled = 2.0 * (numbers - column.low) / (column.high - column.low) - 1.0
    scaled = np.minimum(1.0, np.maximum(-1.0, scaled))
    scaled[np.isnan(numbers)] = 0.0
    return scaled


def public_split(data: TensorDataset, what: str) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)``: :data:`TEST_FRACTION` of the records held out, chosen with the public
    :data:`SPLIT_SEED` (a function of the count only); ``what`` names the data in the error."""
    n = len(data)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    cut = n - max(1, round(TEST_FRACTION * n))
    if cut < 1:
        raise ValueError(f"{what}: too few to hold out a test set")
    x, y = data.tensors
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(
        x[order[cut:]], y[order[cut:]]
    )


def load_table(
    path: str | Path,
    label: str,
    classes: tuple[str, ...],
    columns: tuple[Column, ...],
    test_path: str | Path | None = None,
) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    """``(train, test, info)`` from a CSV or Parquet file (:func:`is_parquet`).

    Args:
        path: the CSV file (with a header row) or Parquet file.
        label: the label column's name.
        classes: the label values, in class order (:func:`parse_classes`).
        columns: the feature columns and their public transforms (:func:`parse_columns`).
        test_path: a second file, of either kind, for the test set (``None``:
            :data:`TEST_FRACTION` of the records, chosen with the public :data:`SPLIT_SEED`).

    Raises:
        ValueError: a label also declared as a feature, or a file that does not match the
            declared columns and classes.
        ImportError: a Parquet file without ``pyarrow`` (the message names the extra).
    """
    if label in {c.name for c in columns}:
        raise ValueError(f"the label {label!r} is also declared as a feature column")
    data = _read(Path(path), label, classes, columns)
    if test_path is not None:
        train, test = data, _read(Path(test_path), label, classes, columns)
    else:
        train, test = public_split(data, f"{path} has {len(data)} data row(s)")
    names = tuple(
        f"{c.name}={v}" if c.categories else c.name for c in columns for v in (c.categories or [""])
    )
    info = DatasetInfo(
        name=f"table:{Path(path).name}",
        input_shape=(sum(c.width for c in columns),),
        num_classes=len(classes),
        class_names=classes,
        num_train=len(train),
        num_test=len(test),
        preprocessing="public per-column transforms: " + "; ".join(c.describe() for c in columns),
        source=str(path),
        license="the user's own data",
        feature_names=names,
    )
    return train, test, info
