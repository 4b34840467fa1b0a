"""Atomic writes: a failure mid-write leaves the previous file intact and no temporary file."""

from __future__ import annotations

import os

import pytest

from clipless._io import atomic_write, atomic_write_with


def test_failed_write_keeps_old_file(tmp_path) -> None:
    path = tmp_path / "ledger.json"
    atomic_write(path, "old\n")

    def torn(handle) -> None:
        handle.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_with(path, torn)
    assert path.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["ledger.json"]


def test_mode(tmp_path) -> None:
    path = atomic_write(tmp_path / "secret.pt", b"x", mode=0o600)
    assert path.stat().st_mode & 0o777 == 0o600
