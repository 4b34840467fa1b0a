"""Group normalisation with a certified constant (thesis eq. 5.2.1-5.2.2, Table 5.1)."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from clipless import _certified
from clipless.nn import _checks
from clipless.nn._base import LipschitzModule
from clipless.nn._functional import thesis_group_norm
from clipless.nn.export import PlainGroupNorm

__all__ = ["GroupNorm"]


class GroupNorm(LipschitzModule):
    """The thesis's normalisation ``(x - mean) / max(alpha, std)`` per sample and group.

    Input ``[batch, num_channels, *]``; channels are split into ``num_groups`` contiguous groups and
    each group (its channels and all their positions, ``m`` entries) is normalised with its own
    mean and population standard deviation. No affine parameters, no eps (``alpha > 0`` plays its
    role). Thesis eq. 5.2.1 uses ``max(1, std)``; Table 5.1 and the Lip-DP-SGD paper generalise
    to ``max(alpha, std)``.

    **Lipschitz constant 1/alpha** (thesis Table 5.1). Proof. For one group let ``P`` be the
    centring ``x -> x - mean(x) 1`` (an orthogonal projection, so 1-Lipschitz) and ``c = P x``.
    The population std is ``||c|| / sqrt(m)``, so with ``r = alpha sqrt(m)``

        ``f(x) = c / max(alpha, ||c|| / sqrt(m)) = (1/alpha) c min(1, r / ||c||)
        = (1/alpha) Pi_r(P x)``,

    where ``Pi_r`` is the Euclidean projection onto the ball of radius ``r``, which is
    non-expansive (projection onto a closed convex set). Hence ``f`` is ``1/alpha``-Lipschitz on
    each group; the groups are disjoint blocks of coordinates, so
    ``||f(x) - f(y)||^2 = sum_g ||f_g(x_g) - f_g(y_g)||^2 <= alpha^-2 ||x - y||^2``. The constant is
    attained near any input whose groups have ``std < alpha`` (there ``f = P / alpha``).
    (The thesis's eq. 5.2.2 bounds only the ``1/max`` factor; the projection argument also covers
    the derivative of ``std``.)

    **Output bound.** ``||f_g(x)|| = min(||c_g|| / alpha, sqrt(m))`` and ``||c_g|| <= ||x_g||``, so
    ``||f(x)|| <= min(X / alpha, sqrt(n))`` with ``n`` the entries per sample (recorded by each
    forward in :attr:`sample_numel`; ``X / alpha`` alone until then).
    """

    sample_numel: int | None

    def __init__(self, num_groups: int, num_channels: int, alpha: float = 1.0) -> None:
        super().__init__()
        self.num_groups = _checks.positive_int("num_groups", num_groups)
        self.num_channels = _checks.positive_int("num_channels", num_channels)
        if num_channels % num_groups != 0:
            raise ValueError(
                f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})"
            )
        self.alpha = _checks.positive_float("alpha", alpha)
        if self.alpha < 2.0**-60:  # alpha^2 (the variance floor) must stay a normal float32
            raise ValueError(f"alpha must be >= 2^-60 (alpha^2 floors the variance), got {alpha}")
        self.sample_numel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 2 or x.shape[1] != self.num_channels:
            raise ValueError(
                f"GroupNorm expects an input of shape [batch, {self.num_channels}, ...], got "
                f"{tuple(x.shape)}"
            )
        self.sample_numel = math.prod(int(d) for d in x.shape[1:])
        return thesis_group_norm(x, self.num_groups, self.alpha)

    def lipschitz(self) -> float:
        """``1 / alpha`` (class docstring), rounded up to a float64 when it is not exact."""
        return _certified.upper(1 / Fraction(self.alpha))

    def output_bound(self, input_bound: float) -> float:
        """``min(X / alpha, sqrt(n))``."""
        x_bound = _checks.as_bound("input_bound", input_bound)
        bound = _certified.mul(x_bound, self.lipschitz())
        if self.sample_numel is not None:
            bound = min(bound, _certified.sqrt(self.sample_numel))
        return bound

    def vanilla_export(self) -> torch.nn.Module:
        return PlainGroupNorm(self.num_groups, self.alpha)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, alpha={self.alpha}"
