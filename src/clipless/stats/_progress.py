"""Progress with an estimate, on stderr, for statistics releases that take long.

``clipless ecdf --size 100000000`` (the largest grid) runs for many minutes; without a word
the user cannot tell a slow run from a stuck one. :class:`Progress` knows the phases of a
command and a rough cost per grid threshold of each (measured on one CPU core, see
:data:`SECONDS_PER_THRESHOLD`); when the whole estimate exceeds :data:`PROGRESS_AFTER_S` it
prints each phase's start with the estimated time left, a line every :data:`PROGRESS_EVERY_S`
seconds while a phase runs, and its end. The estimate of the phases still to come is rescaled by
how the finished ones compared with theirs (a faster or slower machine). Below the threshold it
prints nothing, so short releases stay quiet.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TextIO

__all__ = ["PROGRESS_AFTER_S", "PROGRESS_EVERY_S", "SECONDS_PER_THRESHOLD", "Progress"]

#: Report progress only when the estimated total exceeds this many seconds.
PROGRESS_AFTER_S = 5.0
#: Seconds between two progress lines while a phase runs.
PROGRESS_EVERY_S = 30.0
#: Rough seconds per grid threshold of each phase (one core, OMP_NUM_THREADS=1, a 10**6 grid:
#: release 5.3 s, CSV 2.0 s, plot 5.6 s; linear in the grid size from 10**5 on).
SECONDS_PER_THRESHOLD = {"release": 5.5e-6, "csv": 2.0e-6, "plot": 5.6e-6}

_clock = time.monotonic  # a module attribute, so that a test can drive the estimate


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """The phases of one command, ``(name, kind, weight)``: the estimate of a phase is
    ``weight * size * SECONDS_PER_THRESHOLD[kind]``. Use :meth:`phase` around each, in order."""

    def __init__(
        self,
        command: str,
        size: int,
        phases: Sequence[tuple[str, str, float]],
        stream: TextIO | None = None,
    ) -> None:
        self.command, self.stream = command, stream if stream is not None else sys.stderr
        self.estimates = {n: w * size * SECONDS_PER_THRESHOLD[k] for n, k, w in phases}
        self.order = [n for n, _, _ in phases]
        self.enabled = sum(self.estimates.values()) > PROGRESS_AFTER_S
        self.spent = self.expected = 0.0  # actual and estimated seconds of the finished phases

    def _say(self, text: str) -> None:
        print(f"clipless {self.command}: {text}", file=self.stream, flush=True)

    def _left(self, name: str, elapsed: float) -> str:
        """The estimated time left in all, ``elapsed`` seconds into phase ``name``. The finished
        phases rescale the estimate; a phase running past its own estimate rescales the phases
        after it by how far it has run over."""
        scale = self.spent / self.expected if self.expected > 0 else 1.0
        now = scale * self.estimates[name]
        later = sum(self.estimates[n] for n in self.order[self.order.index(name) + 1 :])
        if elapsed <= now:
            return f"about {_duration(now - elapsed + scale * later)} left in all"
        over = "longer than estimated"
        return over if later == 0 else f"{over}; then about {_duration(later * elapsed / now)}"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Report phase ``name`` (start, every :data:`PROGRESS_EVERY_S` s, end) if enabled."""
        if not self.enabled:
            yield
            return
        step = f"[{self.order.index(name) + 1}/{len(self.order)}] {name}"
        self._say(f"{step} (estimate: {self._left(name, 0.0)})")
        start = _clock()
        done = threading.Event()

        def beat() -> None:
            while not done.wait(PROGRESS_EVERY_S):
                elapsed = _clock() - start
                self._say(f"{step}: {_duration(elapsed)} elapsed, {self._left(name, elapsed)}")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
        took = _clock() - start
        self.spent += took
        self.expected += self.estimates[name]
        self._say(f"{step}: done in {_duration(took)}")
