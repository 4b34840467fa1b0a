"""Epoch callbacks for :func:`clipless.training.fit` (its ``on_epoch_end``).

:class:`TensorBoardLogger` writes each epoch's record as TensorBoard scalars::

    with TensorBoardLogger("runs/tb") as log:
        fit(model, optimizer, loader, loss, engine=engine, epochs=10, delta=1e-5,
            eval_loader=test_loader, on_epoch_end=log)

``clipless train --tensorboard DIR`` does the same, and adds the certified robust accuracy of the
saved model at the last epoch. The scalars are stored in double precision, so they read back
equal to ``metrics.json``'s values. Like ``metrics.json``, they include the train loss and
accuracy, computed on the private data without noise: not DP releases (docs/cli.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from clipless._validate import is_real

__all__ = ["TENSORBOARD_SCALARS", "TensorBoardLogger"]

TENSORBOARD_SCALARS: dict[str, str] = {
    "train_loss": "train/loss",
    "train_accuracy": "train/accuracy",
    "test_loss": "test/loss",
    "test_accuracy": "test/accuracy",
    "epsilon": "privacy/epsilon",
    "lr": "train/lr",
}
"""The history record's fields written each epoch (key -> TensorBoard tag); a field that is
absent or ``None`` (no ``eval_loader``: no test values) is left out."""


def summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; ``ImportError`` naming the extra without the
    ``tensorboard`` package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "TensorBoard logging needs the tensorboard package: pip install 'clipless[tensorboard]'"
        ) from None
    return SummaryWriter


class TensorBoardLogger:
    """An ``on_epoch_end`` callback writing :data:`TENSORBOARD_SCALARS` of every epoch's record
    to event files in ``log_dir`` (step: the record's ``epoch``), in double precision. It never
    stops training (returns ``None``). ``log_dir`` is created owner-only (``0700``) if absent:
    the train values are computed on private data. Under :mod:`clipless.distributed` give it on
    rank 0 only."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        writer_class = summary_writer_class()
        self.log_dir = Path(log_dir)
        if not self.log_dir.exists():
            self.log_dir.mkdir(parents=True, mode=0o700)
        self._writer = writer_class(log_dir=str(self.log_dir))

    def __call__(self, record: Mapping[str, Any]) -> None:
        step = int(record["epoch"])
        for key, tag in TENSORBOARD_SCALARS.items():
            value = record.get(key)
            if is_real(value):
                self.scalar(tag, float(value), step)
        self._writer.flush()

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar, in double precision (read back: ``EventAccumulator.Tensors(tag)``)."""
        self._writer.add_scalar(tag, value, step, new_style=True, double_precision=True)

    def robustness(self, result: Mapping[str, Any], step: int) -> None:
        """The certified robust accuracy at each radius (``clipless.robustness``'s
        ``robustness_metrics`` result) as ``robustness/certified_accuracy_r<radius>``."""
        for radius, accuracy in result["certified_accuracy"].items():
            self.scalar(f"robustness/certified_accuracy_r{radius}", float(accuracy), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
