"""Image datasets: scikit-learn's 8x8 digits and Fashion-MNIST (idx files).

Pixel scalings are fixed (divide by the public maximum pixel value), so no statistic of the
training data enters the pre-processing.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import TensorDataset

from clipless.data.cache import (
    DatasetNotFoundError,
    atomic_write_bytes,
    download_verified,
    sha256_bytes,
)
from clipless.data.registry import (
    DatasetInfo,
    make_tensor_dataset,
    register_dataset,
    stratified_datasets,
)

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_FILES",
    "FASHION_MNIST_SYSTEM_DIRS",
    "load_digits",
    "load_fashion_mnist",
    "read_idx",
]

SPLIT_SEED = 0


# --------------------------------------------------------------------------------------------
# Digits 8x8 (scikit-learn)
# --------------------------------------------------------------------------------------------


def load_digits() -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    """scikit-learn's handwritten digits: 1,797 images ``1 x 8 x 8`` in ``[0, 1]`` (``/ 16``).

    Fixed stratified 80/20 split (seed :data:`SPLIT_SEED`); 10 classes.
    """
    from sklearn.datasets import load_digits as _sk_load

    bunch = _sk_load()
    images = np.asarray(bunch.images, dtype=np.float64)[:, None, :, :] / 16.0
    y = np.asarray(bunch.target, dtype=np.int64)
    return stratified_datasets(
        images,
        y,
        name="digits",
        input_shape=(1, 8, 8),
        num_classes=10,
        class_names=tuple(str(c) for c in range(10)),
        preprocessing="pixel / 16 (fixed; the pixel range 0..16 is public)",
        source="scikit-learn (sklearn.datasets.load_digits, bundled)",
        license="CC BY 4.0 (UCI)",
    )


def _digits_loader(root: Path, download: bool) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    del root, download  # bundled with scikit-learn
    return load_digits()


# --------------------------------------------------------------------------------------------
# idx format (MNIST family)
# --------------------------------------------------------------------------------------------

_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(data: bytes) -> np.ndarray:
    """Parse the bytes of an idx file (LeCun's MNIST format; gzip-compressed or not).

    Header: two zero bytes, a type code, the number of dimensions ``d``, then ``d`` big-endian
    int32 sizes; then the values in C order.

    Args:
        data: the file's bytes.

    Returns:
        The array, of the file's shape and type.

    Raises:
        ValueError: not an idx file, an unknown type code, or a truncated file.
    """
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError("not an idx file (bad magic number)")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"idx: unknown type code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError("idx: truncated header")
    shape = struct.unpack(f">{ndim}i", data[4:header])
    dtype = _IDX_DTYPES[code]
    count = int(np.prod(shape)) if shape else 1
    if len(data) != header + count * dtype.itemsize:
        raise ValueError(
            f"idx: expected {count * dtype.itemsize} data bytes for shape {shape}, "
            f"found {len(data) - header}"
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


# --------------------------------------------------------------------------------------------
# Fashion-MNIST
# --------------------------------------------------------------------------------------------

FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_MNIST_FILES: dict[str, str] = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
"""SHA-256 of the *decompressed* idx files (measured on Debian's ``dataset-fashion-mnist``
0.0~git20200523.55506a9-1). Hashing the decompressed bytes makes the check independent of how a
mirror recompressed the ``.gz`` files (Debian's differ from upstream's, the content does not)."""

FASHION_MNIST_SYSTEM_DIRS: list[Path] = [Path("/usr/share/datasets/fashion-mnist")]
"""Known install locations (Debian package ``dataset-fashion-mnist``)."""

FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
    "Ankle boot",
)  # fmt: skip


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def _fashion_missing_message(root: Path) -> str:
    places = ", ".join(str(p) for p in [root / "fashion-mnist", *FASHION_MNIST_SYSTEM_DIRS])
    return (
        f"Fashion-MNIST files not found (looked in {places}; a download was not possible or not "
        "allowed). Fix: `apt-get update && apt-get install -y dataset-fashion-mnist` (Debian), "
        "or `make data` / `clipless data fetch fashion-mnist`, or put "
        "{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz in "
        f"{root / 'fashion-mnist'} (or set $CLIPLESS_DATA)."
    )


def _fashion_locate(root: Path) -> dict[str, Path] | None:
    for folder in [root / "fashion-mnist", *FASHION_MNIST_SYSTEM_DIRS]:
        found = {stem: _find_idx(folder, stem) for stem in FASHION_MNIST_FILES}
        if all(p is not None for p in found.values()):
            return {k: v for k, v in found.items() if v is not None}
    return None


def fetch_fashion_mnist(
    root: Path, source: Path | None = None, *, allow_network: bool = True
) -> list[Path]:
    """Put the four Fashion-MNIST ``.gz`` files into ``root / "fashion-mnist"`` (verified).

    Sources, in order: ``source`` (a folder), the cache, the Debian install location, the
    canonical download. Every file's decompressed SHA-256 is checked against the pinned value.

    Args:
        root: the cache directory (:func:`~clipless.data.data_root`).
        source: a folder holding the four files; ``None``: the sources after it.
        allow_network: try the network sources (``False``: local sources only).

    Returns:
        The paths of the four ``.gz`` files in the cache.

    Raises:
        ValueError: a file whose SHA-256 is not the pinned one.
        DatasetNotFoundError: no source had the four files.
    """
    target = root / "fashion-mnist"
    folders = [source] if source is not None else [target, *FASHION_MNIST_SYSTEM_DIRS]
    out: list[Path] = []
    for stem, sha in FASHION_MNIST_FILES.items():
        dst = target / (stem + ".gz")
        data: bytes | None = None
        for folder in folders:
            found = _find_idx(folder, stem)
            if found is not None:
                data = found.read_bytes()
                break
        if data is None and source is None and allow_network:
            try:
                data = download_verified(
                    FASHION_MNIST_URL + stem + ".gz", sha, digest_of=gzip.decompress
                )
            except (OSError, ValueError) as exc:
                raise DatasetNotFoundError(
                    _fashion_missing_message(root) + f" Download error: {exc}"
                ) from exc
        if data is None:
            raise DatasetNotFoundError(_fashion_missing_message(root))
        raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        if sha256_bytes(raw) != sha:
            raise ValueError(f"SHA-256 mismatch for Fashion-MNIST file {stem}")
        if not dst.is_file():
            atomic_write_bytes(dst, data if data[:2] == b"\x1f\x8b" else gzip.compress(raw))
        out.append(dst)
    return out


def load_fashion_mnist(
    root: Path, download: bool = True
) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    """Fashion-MNIST: 60,000 train + 10,000 test images ``1 x 28 x 28`` in ``[0, 1]`` (``/ 255``).

    Lookup: cache (``root / "fashion-mnist"``), Debian's ``/usr/share/datasets/fashion-mnist``,
    then (if ``download``) the canonical address with pinned SHA-256; else a
    :class:`~clipless.data.DatasetNotFoundError` naming ``apt-get install dataset-fashion-mnist``.

    Args:
        root: the cache directory (:func:`~clipless.data.data_root`).
        download: fetch the files from the network when they are found nowhere else.

    Raises:
        DatasetNotFoundError: the four ``.gz`` files are found nowhere and ``download`` is
            ``False`` (the message names the Debian package).
    """
    files = _fashion_locate(root)
    if files is None:
        if not download:
            raise DatasetNotFoundError(_fashion_missing_message(root))
        fetch_fashion_mnist(root)
        files = _fashion_locate(root)
        if files is None:  # pragma: no cover - fetch either wrote the files or raised
            raise DatasetNotFoundError(_fashion_missing_message(root))
    arrays = {stem: read_idx(path.read_bytes()) for stem, path in files.items()}

    def images(stem: str) -> np.ndarray:
        return arrays[stem].astype(np.float32)[:, None, :, :] / np.float32(255.0)

    x_train, y_train = images("train-images-idx3-ubyte"), arrays["train-labels-idx1-ubyte"]
    x_test, y_test = images("t10k-images-idx3-ubyte"), arrays["t10k-labels-idx1-ubyte"]
    info = DatasetInfo(
        name="fashion-mnist",
        input_shape=(1, 28, 28),
        num_classes=10,
        class_names=FASHION_MNIST_CLASSES,
        num_train=int(x_train.shape[0]),
        num_test=int(x_test.shape[0]),
        preprocessing="pixel / 255 (fixed)",
        source="Zalando Fashion-MNIST (offline: Debian package dataset-fashion-mnist)",
        license="MIT (Zalando)",
    )
    return (
        make_tensor_dataset(x_train, y_train.astype(np.int64)),
        make_tensor_dataset(x_test, y_test.astype(np.int64)),
        info,
    )


register_dataset(
    "digits",
    _digits_loader,
    summary="Digits 8x8 (scikit-learn), 1,797 x 1x8x8, 10 classes (bundled)",
    bundled=True,
)
register_dataset(
    "fashion-mnist",
    load_fashion_mnist,
    summary="Fashion-MNIST, 60,000 + 10,000 x 1x28x28, 10 classes (Debian dataset-fashion-mnist)",
    fetch=fetch_fashion_mnist,
)
