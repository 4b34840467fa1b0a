"""argparse types shared by the command-line modules (no heavy imports: ``python -m
clipless.federated.cli`` loads this without torch)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: str, low: float, high: float, *, open_low: bool = True) -> Callable[[str], float]:
    """A finite number in ``(low, high)`` (``[low, high)`` with ``open_low=False``); the error
    says ``expected {kind}``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if open_low else value >= low) and value < high
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}")
        return value

    return parse


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]`` (``high=None``: no upper end)."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            span = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {text!r}")
        return value

    return parse
