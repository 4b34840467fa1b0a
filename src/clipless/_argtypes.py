"""argparse types shared by the command-line modules (no heavy imports: ``python -m
clipless.federated.cli`` loads this without torch)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


def parsed(
    convert: Callable[[str], _T], ok: Callable[[_T], bool], expected: str, invalid: str = ""
) -> Callable[[str], _T]:
    """``convert(text)`` where ``ok`` holds; otherwise the error ``expected {expected}`` (or
    ``expected {invalid}`` for a value that converts but is out of range, when given)."""

    def parse(text: str) -> _T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {invalid or expected}, got {text!r}")
        return value

    return parse


def number(kind: str, low: float, high: float, *, open_low: bool = True) -> Callable[[str], float]:
    """A finite number in ``(low, high)`` (``[low, high)`` with ``open_low=False``); the error
    says ``expected {kind}``."""

    def ok(value: float) -> bool:
        return math.isfinite(value) and (value > low if open_low else value >= low) and value < high

    return parsed(float, ok, kind)


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]`` (``high=None``: no upper end)."""
    span = f"[{low}, {high}]" if high is not None else f">= {low}"
    return parsed(int, lambda v: v >= low and (high is None or v <= high), f"an integer {span}")


DEVICES = "cpu, cuda, cuda:N, mps, auto"


def device(text: str) -> str:
    """A device name :data:`DEVICES` accepts, lower-cased (resolved later, where torch is loaded:
    ``clipless.pipeline.resolve_device``)."""
    value = text.strip().lower()
    if value in ("cpu", "cuda", "mps", "auto"):
        return value
    if value.startswith("cuda:") and value[5:].isdigit():
        return value
    raise argparse.ArgumentTypeError(f"expected one of {DEVICES}; got {text!r}")
