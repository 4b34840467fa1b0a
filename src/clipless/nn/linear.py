"""Dense layer with a certified operator norm (thesis eq. 5.2.3 and Table 5.1, "Dense")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clipless import _certified, _validate, norms
from clipless.nn import _checks, _scaled
from clipless.nn._base import ParametricLipschitzModule
from clipless.nn._functional import norm_upper, round_up, sample_norms_upper
from clipless.nn.export import with_copies

__all__ = ["Linear"]


class Linear(ParametricLipschitzModule):
    """``y = x W^T + b`` on inputs of shape ``[batch, in_features]``, with certified bounds.

    Certified constants (thesis Table 5.1 "Dense", eq. 5.2.3; Béthune et al. 2024, Algorithm 1):

    * input-Lipschitz constant: the spectral norm ``||W||_2``, certified by
      :func:`clipless.norms.dense_norm` (exact SVD for small matrices, a Cholesky certificate of
      ``c^2 I - W^T W`` for mid-size ones on the CPU, Gram iteration for the largest);
    * output bound: ``||W x + b|| <= ||W||_2 X + ||b||``;
    * per-sample parameter gradients, for a cotangent ``dy`` with ``||dy|| <= G``:
      ``grad_W = dy x^T`` has ``||grad_W||_F = ||dy|| ||x|| <= G X`` and ``grad_b = dy`` has norm
      ``<= G``; jointly ``||(grad_W, grad_b)|| = ||dy|| sqrt(||x||^2 + 1)`` (equality), which is
      :meth:`sample_norm_factor`.

    Weights are initialised orthogonally (``torch.nn.init.orthogonal_``, so ``||W||_2 = 1``: a
    1-Lipschitz, gradient-norm-preserving start) and the bias at zero.

    When :attr:`scaling_threshold` is set (by the engine), the forward routes through
    :func:`clipless.nn._scaled.scaled_linear`, which rescales each sample's parameter gradient.
    """

    in_features: int
    out_features: int
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = _checks.positive_int("in_features", in_features)
        self.out_features = _checks.positive_int("out_features", out_features)
        _validate.flag("bias", bias)
        dtype = _checks.parameter_dtype(dtype)
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Orthogonal weight (spectral norm 1), zero bias."""
        with torch.no_grad():
            torch.nn.init.orthogonal_(self.weight)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"Linear expects an input of shape [batch, {self.in_features}], got "
                f"{tuple(x.shape)} (use clipless.nn.Flatten first for multi-dimensional inputs)"
            )
        if self.scaling_threshold is not None:
            return _scaled.scaled_linear(x, self.weight, self.bias, self.scaling_threshold, self)
        return F.linear(x, self.weight, self.bias)

    def lipschitz(self) -> float:
        """Certified ``||W||_2`` (:func:`clipless.norms.dense_norm`; thesis eq. 5.2.3)."""
        return self._cached_bound(None, lambda: norms.dense_norm(self.weight.detach()))

    def lipschitz_tensor(self) -> torch.Tensor:
        """A certified ``||W||_2`` of the current weight as a 0-dim float64 tensor on its device,
        not memoised (:func:`clipless.norms.norm_tensor`: no host read on an accelerator)."""
        return norms.norm_tensor(self.weight)

    def lipschitz_plan(self) -> norms.NormPlan:
        """:meth:`lipschitz_tensor` as a plan (:func:`clipless.norms.evaluate_plans` batches
        many layers' Gram iterations)."""
        return norms.norm_plan(self.weight)

    def output_bound(self, input_bound: float) -> float:
        """``||W||_2 X + ||b||_2`` (triangle inequality), rounded up."""
        x_bound = _checks.as_bound("input_bound", input_bound)
        out = _certified.mul(self.lipschitz(), x_bound)
        if self.bias is not None:
            out = _certified.add(out, norm_upper(self.bias))
        return out

    def gradient_bounds(self, input_bound: float, cotangent_bound: float) -> dict[str, float]:
        """``{"weight": G X, "bias": G}`` (``||dy x^T||_F = ||dy|| ||x||``; ``grad_b = dy``)."""
        x_bound = _checks.as_bound("input_bound", input_bound)
        g_bound = _checks.as_bound("cotangent_bound", cotangent_bound)
        out = {"weight": _certified.mul(g_bound, x_bound)}
        if self.bias is not None:
            out["bias"] = g_bound
        return out

    def sample_norm_factor(self, x: torch.Tensor) -> torch.Tensor:
        """``sqrt(||x_i||^2 + 1)`` with a bias, ``||x_i||`` without.

        A certified upper bound (:func:`~clipless.nn._functional.sample_norms_upper`, float64)
        rounded upward to ``x.dtype``, as scaling needs.
        """
        return round_up(self.sample_norm_factor_wide(x), x.dtype)

    def sample_norm_factor_wide(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`sample_norm_factor` in float64, before the rounding to ``x.dtype``."""
        norms = sample_norms_upper(x)
        if self.bias is None:
            return norms
        return torch.sqrt((norms.square() + 1.0) * (1.0 + 2.0**-50))

    def norm_factor_bound(self, input_bound: float) -> float:
        """``sqrt(X^2 + 1)`` with a bias, ``X`` without (rounded up)."""
        x_bound = _checks.as_bound("input_bound", input_bound)
        if self.bias is not None:
            return _certified.sqrt(_certified.add(_certified.mul(x_bound, x_bound), 1.0))
        return x_bound

    def vanilla_export(self) -> torch.nn.Module:
        """A ``torch.nn.Linear`` with copies of the weight and bias."""
        w = self.weight.detach()
        plain = torch.nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=w.device,
            dtype=w.dtype,
        )
        return with_copies(plain, w, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
