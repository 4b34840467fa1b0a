"""Crash-safe file writes shared by the ledger, checkpoints, metrics and the dataset cache.

Imports only the standard library (:mod:`clipless.accounting` must stay free of torch).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "atomic_write_with"]


def _default_mode() -> int:
    """``0o666`` minus the process umask (what ``open(path, "w")`` would give)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_with(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, mode: int | None = None
) -> Path:
    """Call ``write(handle)`` on a temporary file beside ``path``, fsync it, then rename it.

    A crash leaves either the old file or the new one, never a torn one; the directory is fsynced
    after the rename so that the rename itself is durable (POSIX; best effort elsewhere).
    ``mode`` defaults to what a plain ``open`` would give (``0o666`` minus the umask).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _default_mode() if mode is None else mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return target


def atomic_write(
    path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None
) -> Path:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically (:func:`atomic_write_with`)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    return atomic_write_with(path, lambda handle: handle.write(payload), mode=mode)
