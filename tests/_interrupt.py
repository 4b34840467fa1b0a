"""A Ctrl-C in the middle of a training run, for the resume and interruption tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def ctrl_c_at_evaluation(call: int) -> Iterator[None]:
    """Inside, ``clipless.training.evaluate`` raises ``KeyboardInterrupt`` at its ``call``-th
    call (the end of epoch ``call``); the real one is restored on leaving."""
    import clipless.training as training

    real = training.evaluate
    calls = 0

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    training.evaluate = interrupted  # type: ignore[assignment]
    try:
        yield
    finally:
        training.evaluate = real
