"""A DP optimizer that wraps any :class:`torch.optim.Optimizer` without per-sample gradients.

docs/design.md, "Training: the mathematics"; Clipless DP-SGD (Béthune et al. 2024, Algorithm 1,
"local" and "global" noise) and Lip-DP-SGD (thesis Algorithm 8). The privacy argument of every
noise scale is in :mod:`clipless.mechanism` (and the bounds it uses in :mod:`clipless.bounds`).
The package:

- :mod:`~clipless.optim.optimizer`: :class:`DPOptimizer`, whose :meth:`~DPOptimizer.step` reads
  as the mechanism: guard -> record -> noise -> inner step -> projection;
- :mod:`~clipless.optim.guard`: the contract the noise relies on, enforced (hooks, taint, the
  checks read once per step; its docstring states the contract in full);
- :mod:`~clipless.optim.noise`: :func:`draw_noise`;
- :mod:`~clipless.optim.precision`: float32 computed in float32 (TF32 and bfloat16 settings);
- :mod:`~clipless.optim.adam_bc`: :class:`AdamBC` (DP-AdamBC).
"""

from __future__ import annotations

from clipless._errors import PlanExhaustedError, PrivacyContractError
from clipless.mechanism import CONSTRAINTS, NOISE_STRATEGIES
from clipless.optim.adam_bc import AdamBC
from clipless.optim.noise import draw_noise
from clipless.optim.optimizer import DPOptimizer
from clipless.optim.precision import (
    full_float32_precision,
    reduced_float32_precision,
    switch_to_full_float32,
)

__all__ = [
    "CONSTRAINTS",
    "NOISE_STRATEGIES",
    "AdamBC",
    "DPOptimizer",
    "PlanExhaustedError",
    "PrivacyContractError",
    "draw_noise",
    "full_float32_precision",
    "reduced_float32_precision",
    "switch_to_full_float32",
]
