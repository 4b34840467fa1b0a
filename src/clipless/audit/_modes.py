"""The audit modes, torch-free: the command line checks ``--mode`` before loading torch."""

from __future__ import annotations

AUDIT_MODES: tuple[str, ...] = ("per-sample", "bound", "threshold", "batch-max")
