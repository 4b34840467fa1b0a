"""Independent random streams for an audit (canaries, model, mechanism noise)."""

from __future__ import annotations

import numpy as np


def independent_seeds(seed: int, count: int) -> list[int]:
    """``count`` seeds of statistically independent streams derived from one user seed.

    The audits' statistics need the mechanism's randomness to be independent of the canaries
    and of which canaries were included (Steinke, Nasr and Jagielski 2023, the premise of their
    Theorem 3): seeding the noise generator with the seed of the canary stream made the first
    noise draws replay the canary directions exactly. :class:`numpy.random.SeedSequence` spawns
    children whose streams do not overlap."""
    children = np.random.SeedSequence(seed).spawn(count)
    return [int(c.generate_state(1, dtype=np.uint64)[0]) >> 1 for c in children]
