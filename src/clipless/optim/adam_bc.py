"""DP-AdamBC (Tang et al. 2024): Adam whose second moment is corrected for the noise."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from clipless import _validate

__all__ = ["AdamBC"]


class AdamBC(torch.optim.Optimizer):
    """Adam with the privacy noise's variance removed from its second moment (DP-AdamBC).

    Tang, Shpilevskiy and Lécuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply
    Bias Correction)", AAAI 2024, Algorithm 1. The private gradient is ``g~ = g + z / B`` with
    ``z`` Gaussian of the plan's standard deviation ``s`` (per tensor) and ``B`` the expected batch
    size, so Adam's second moment estimates ``E[g^2] + (s / B)^2``: the noise's variance
    ``Phi = (s / B)^2`` dominates every coordinate whose signal is small, and DP-Adam then behaves
    like DP-SGD with a rescaled step (the paper's observation). This optimizer subtracts it:

    ``m_t = b1 m + (1 - b1) g~``, ``v_t = b2 v + (1 - b2) g~^2``,
    ``phi_t = b2 phi + (1 - b2) Phi_t``,
    ``p -= lr (m_t / (1 - b1^t)) / sqrt(max((v_t - phi_t) / (1 - b2^t), floor))``.

    ``phi_t`` is the same moving average of the per-step noise variance as ``v_t``'s, so the
    correction is exact in expectation when the noise scale changes between steps (certified
    bounds follow the weights). ``floor`` (the paper's ``gamma'``) keeps the denominator away
    from zero where ``v_t - phi_t`` is small or negative: ``max(floor, floor_ratio * phi_t /
    (1 - b2^t))``, i.e. an absolute floor and one relative to the noise variance.

    **Privacy.** Post-processing: ``Phi`` is computed from the plan's public noise scale and the
    public expected batch size, and everything else is a function of the released noisy
    gradients. :class:`DPOptimizer` passes the variances before each inner step
    (:meth:`set_noise_variance`); used alone (no variance given) this is Adam with ``eps``
    inside the square root.

    Measured here (``benchmarks/RESULTS.md`` section 22a): no gain over Adam on Adult or on
    Fashion-MNIST's scattering features (linear models); a ``floor_ratio`` below ~0.3 loses.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        floor: float = 1e-12,
        floor_ratio: float = 0.0,
    ) -> None:
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2); got {betas!r}")
        for name, value, lo, hi in (
            ("lr", lr, 0.0, math.inf),
            ("betas[0]", betas[0], 0.0, 1.0),
            ("betas[1]", betas[1], 0.0, 1.0),
        ):
            if not (_validate.is_real(value) and lo <= value < hi):
                raise ValueError(f"{name} must be a number in [{lo}, {hi}); got {value!r}")
        if not (_validate.is_real(floor) and 0.0 < floor < math.inf):
            raise ValueError(f"floor must be a positive finite number; got {floor!r}")
        if not (_validate.is_real(floor_ratio) and 0.0 <= floor_ratio < math.inf):
            raise ValueError(f"floor_ratio must be a finite number >= 0; got {floor_ratio!r}")
        defaults = {
            "lr": float(lr),
            "betas": (float(betas[0]), float(betas[1])),
            "floor": float(floor),
            "floor_ratio": float(floor_ratio),
        }
        super().__init__(params, defaults)
        self._variance: dict[torch.nn.Parameter, float] = {}

    def set_noise_variance(self, variances: dict[torch.nn.Parameter, float]) -> None:
        """Per-coordinate variance of the noise in each parameter's gradient, for the next step."""
        for var in variances.values():
            if not (isinstance(var, float) and 0.0 <= var < math.inf):
                raise ValueError(f"noise variance must be a finite float >= 0; got {var!r}")
        self._variance = dict(variances)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        variance, self._variance = self._variance, {}
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["noise_avg"] = 0.0
                state["step"] += 1
                t = state["step"]
                state["exp_avg"].lerp_(grad, 1.0 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
                state["noise_avg"] = b2 * state["noise_avg"] + (1.0 - b2) * variance.get(p, 0.0)
                c2 = 1.0 - b2**t
                phi = state["noise_avg"] / c2
                floor = max(group["floor"], group["floor_ratio"] * phi)
                denom = (state["exp_avg_sq"] / c2).sub_(phi).clamp_(min=floor).sqrt_()
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1.0 - b1**t))
        return loss
