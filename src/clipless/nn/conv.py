"""2-D convolution with certified bounds (thesis Theorem 5.2.1 and Table 5.1, "Convolutional")."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from clipless import _certified, _validate, norms
from clipless.nn import _checks, _scaled
from clipless.nn._base import ParametricLipschitzModule
from clipless.nn._functional import norm_upper, round_up, sample_norms_upper
from clipless.nn.export import with_copies

__all__ = ["Conv2d"]

PADDING_MODES = ("zeros", "circular")


class Conv2d(ParametricLipschitzModule):
    """2-D convolution (no dilation, no groups) with certified Lipschitz and gradient bounds.

    Arguments follow :class:`torch.nn.Conv2d`; ``kernel_size``, ``stride`` and ``padding`` are ints
    or ``(h, w)`` pairs (stored as pairs), ``padding_mode`` is ``"zeros"`` or ``"circular"``. The
    bias defaults to ``False`` because its per-sample gradient sums over all ``P`` output positions
    (norm up to ``sqrt(P) G``, docs/design.md "Per-sample parameter gradient").
    ``input_size=(H, W)`` fixes the spatial input size (a forward with another size then raises);
    when it is ``None`` the layer records the size of the last forward in :attr:`input_size`, and
    the bounds below use it.

    Certified constants, for a cotangent ``||dy|| <= G`` and input ``||x|| <= X``:

    * input-Lipschitz constant: the operator norm of the convolution, certified by
      :func:`clipless.norms.conv_norm` (FFT symbol for a known input size; the size-free
      ``sqrt(k_eff) ||K||_2`` otherwise). This replaces the ``sqrt(h'w') ||K||_F`` of
      the thesis (Theorem 5.2.1, Table 5.1) and of Barczewski & Ramon 2024, which is valid but much
      looser (docs/design.md "Layers and losses").
    * weight gradient: ``grad_K = Dy Patches(x)`` with ``Dy`` the ``out x P`` cotangent and
      ``Patches(x)`` the ``P x (in h' w')`` patch matrix, so
      ``||grad_K||_F <= ||Dy||_F ||Patches(x)||_F <= G sqrt(k_eff) X``, where every input pixel is
      read by at most ``k_eff`` (output position, kernel offset) pairs
      (:func:`clipless.norms.conv_multiplicity`; ``k_eff = h'w'`` at stride 1 with zero padding,
      the ``sqrt(h'w')`` of thesis Theorem 5.2.1).
    * bias gradient: ``grad_b[o] = sum_p dy[o, p]``, so ``||grad_b|| <= sqrt(P) G`` (Cauchy-Schwarz
      over the ``P = H_out W_out`` positions).
    * jointly ``||(grad_K, grad_b)|| <= ||dy|| ||[Patches(x), 1_P]||_F
      <= ||dy|| sqrt(k_eff ||x||^2 + P)``: :meth:`sample_norm_factor`.
    * output bound: ``Lip X + sqrt(P) ||b||``.

    The weight is initialised orthogonally (rows of the ``out x (in h' w')`` matrix) and divided by
    ``sqrt(ceil(h'/s_h) ceil(w'/s_w))``, which makes the size-free bound at most 1 for zero padding.

    When :attr:`scaling_threshold` is set, the forward routes through
    :func:`clipless.nn._scaled.scaled_conv2d` (reads ``stride``, ``padding``, ``padding_mode``).
    """

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    padding_mode: str
    input_size: tuple[int, int] | None
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        padding_mode: str = "zeros",
        bias: bool = False,
        input_size: tuple[int, int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_channels = _checks.positive_int("in_channels", in_channels)
        self.out_channels = _checks.positive_int("out_channels", out_channels)
        self.kernel_size = _checks.int_pair("kernel_size", kernel_size, 1)
        self.stride = _checks.int_pair("stride", stride, 1)
        self.padding = _checks.int_pair("padding", padding, 0)
        _validate.choice("padding_mode", padding_mode, PADDING_MODES)
        self.padding_mode = padding_mode
        _validate.flag("bias", bias)
        self._fixed_input_size = input_size is not None
        self.input_size = None
        if input_size is not None:
            self.input_size = _checks.int_pair("input_size", input_size, 1)
            self._check_size(self.input_size, "input_size")
        kh, kw = self.kernel_size
        dtype = _checks.parameter_dtype(dtype)
        self.weight = torch.nn.Parameter(
            torch.empty(out_channels, in_channels, kh, kw, device=device, dtype=dtype)
        )
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_channels, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _check_size(self, size: tuple[int, int], what: str) -> None:
        for dim, (n, k, p) in enumerate(zip(size, self.kernel_size, self.padding, strict=True)):
            if n + 2 * p < k:
                raise ValueError(
                    f"{what}={size}: padded size {n + 2 * p} in dimension {dim} is smaller than "
                    f"kernel_size={self.kernel_size}"
                )
            if self.padding_mode == "circular" and p > n:
                raise ValueError(
                    f"{what}={size}: circular padding={self.padding} cannot exceed the input size"
                )

    def reset_parameters(self) -> None:
        """Orthogonal rows, scaled so that ``sqrt(ceil(h'/s_h) ceil(w'/s_w)) ||K||_2 = 1``."""
        kh, kw = self.kernel_size
        sh, sw = self.stride
        with torch.no_grad():
            torch.nn.init.orthogonal_(self.weight)
            self.weight.div_(math.sqrt(math.ceil(kh / sh) * math.ceil(kw / sw)))
            if self.bias is not None:
                self.bias.zero_()

    # ------------------------------------------------------------------ forward
    def _conv_forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The convolution itself (circular padding through :func:`torch.nn.functional.pad`)."""
        if self.padding_mode == "circular":
            ph, pw = self.padding
            if ph or pw:
                x = F.pad(x, (pw, pw, ph, ph), mode="circular")
            return F.conv2d(x, weight, bias, self.stride)
        return F.conv2d(x, weight, bias, self.stride, self.padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_weight()
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"Conv2d expects an input of shape [batch, {self.in_channels}, H, W], got "
                f"{tuple(x.shape)}"
            )
        size = (int(x.shape[2]), int(x.shape[3]))
        if self._fixed_input_size:
            if size != self.input_size:
                raise ValueError(
                    f"Conv2d was built with input_size={self.input_size} but received spatial "
                    f"size {size}; its certified bounds would not apply"
                )
        else:
            self._check_size(size, "input spatial size")
            self.input_size = size
        if self.scaling_threshold is not None:
            return _scaled.scaled_conv2d(x, self.weight, self.bias, self.scaling_threshold, self)
        return self._conv_forward(x, self.weight, self.bias)

    # ------------------------------------------------------------------ geometry
    def _check_weight(self) -> None:
        """The bounds read ``kernel_size`` and the channels: the weight must have that shape.

        A weight replaced by (or tied to) one of another kernel size would otherwise be certified
        with the declared geometry (``k_eff`` of a 1x1 kernel for a 3x3 weight: 1.58x above the
        planned sensitivity in an audit).
        """
        expected = (self.out_channels, self.in_channels, *self.kernel_size)
        if tuple(self.weight.shape) != expected:
            raise ValueError(
                f"Conv2d.weight has shape {tuple(self.weight.shape)} but the layer was built for "
                f"{expected} (out_channels, in_channels, *kernel_size): its bounds use the "
                "declared geometry; build a Conv2d of the weight's shape instead"
            )

    def _size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        self._check_weight()
        if input_size is None:
            return self.input_size
        size = _checks.int_pair("input_size", input_size, 1)
        self._check_size(size, "input_size")
        return size

    def multiplicity(self, input_size: tuple[int, int] | None = None) -> int:
        """``k_eff``: the most (output position, kernel offset) pairs that read one input pixel.

        From :func:`clipless.norms.conv_multiplicity` for ``input_size`` (default: the recorded
        :attr:`input_size`; ``None`` gives the size-free value).
        """
        size = self._size(input_size)
        key = (self.kernel_size, self.stride, self.padding, self.padding_mode, size)
        # asked in every forward and bound report: memoised per geometry on the layer
        memo: dict[tuple[object, ...], int] = self.__dict__.setdefault("_multiplicities", {})
        try:
            value = memo.get(key)
        except TypeError:  # an attribute set to a list: computed (and checked) every call
            value = None
        if value is None:
            value = int(
                norms.conv_multiplicity(
                    self.kernel_size, self.stride, self.padding, self.padding_mode, size
                )
            )
            with contextlib.suppress(TypeError):
                memo[key] = value
        return value

    def output_positions(self, input_size: tuple[int, int] | None = None) -> int:
        """``P = H_out W_out`` for ``input_size`` (default: the recorded :attr:`input_size`)."""
        size = self._size(input_size)
        if size is None:
            raise RuntimeError(
                "Conv2d does not know its input size: pass input_size= to the constructor or run "
                "one forward pass (the bias bounds depend on the number of output positions)"
            )
        out = 1
        for n, k, s, p in zip(size, self.kernel_size, self.stride, self.padding, strict=True):
            out *= (n + 2 * p - k) // s + 1
        return out

    # ------------------------------------------------------------------ bounds
    def _bound_key(self) -> tuple[object, ...]:
        return (self.stride, self.padding, self.padding_mode, self._size(None))

    def lipschitz(self, input_size: tuple[int, int] | None = None) -> float:
        """Certified operator norm (:func:`clipless.norms.conv_norm`), for ``input_size``.

        ``input_size`` defaults to the recorded :attr:`input_size`; when neither is known the
        size-free bound ``sqrt(k_eff) ||K||_2`` (valid for every input size) is returned.
        """
        size = self._size(input_size)
        key = (self.stride, self.padding, self.padding_mode, size)
        return self._cached_bound(
            key,
            lambda: norms.conv_norm(
                self.weight.detach(),
                stride=self.stride,
                padding=self.padding,
                padding_mode=self.padding_mode,
                input_size=size,
            ),
        )

    def lipschitz_tensor(self) -> torch.Tensor:
        """:meth:`lipschitz` at the recorded input size as a 0-dim float64 tensor on the weight's
        device, not memoised (:func:`clipless.norms.norm_tensor`: no host read on an
        accelerator)."""
        with torch.no_grad():
            return norms.evaluate_plans([self.lipschitz_plan()])[0]

    def lipschitz_plan(self) -> norms.NormPlan:
        """:meth:`lipschitz_tensor` as a plan (:func:`clipless.norms.evaluate_plans` batches
        many layers' Gram iterations)."""
        return norms.norm_plan(
            self.weight,
            stride=self.stride,
            padding=self.padding,
            padding_mode=self.padding_mode,
            input_size=self._size(None),
        )

    def output_bound(self, input_bound: float) -> float:
        """``Lip X + sqrt(P) ||b||`` (the bias adds ``b_o`` at each of the ``P`` positions).

        Rounded up, as every bound here (:mod:`clipless._certified`).
        """
        x_bound = _checks.as_bound("input_bound", input_bound)
        out = _certified.mul(self.lipschitz(), x_bound)
        if self.bias is not None:
            root_p = _certified.sqrt(self.output_positions())
            out = _certified.add(out, _certified.mul(root_p, norm_upper(self.bias)))
        return out

    def gradient_bounds(self, input_bound: float, cotangent_bound: float) -> dict[str, float]:
        """``{"weight": G sqrt(k_eff) X, "bias": G sqrt(P)}`` (class docstring)."""
        x_bound = _checks.as_bound("input_bound", input_bound)
        g_bound = _checks.as_bound("cotangent_bound", cotangent_bound)
        root_k = _certified.sqrt(self.multiplicity())
        out = {"weight": _certified.mul(_certified.mul(g_bound, root_k), x_bound)}
        if self.bias is not None:
            out["bias"] = _certified.mul(g_bound, _certified.sqrt(self.output_positions()))
        return out

    def sample_norm_factor(self, x: torch.Tensor) -> torch.Tensor:
        """``sqrt(k_eff ||x_i||^2 + P)`` with a bias, ``sqrt(k_eff) ||x_i||`` without.

        ``k_eff`` and ``P`` are those of ``x``'s own spatial size; a certified upper bound in
        float64, rounded up to x.dtype.
        """
        return round_up(self.sample_norm_factor_wide(x), x.dtype)

    def sample_norm_factor_wide(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`sample_norm_factor` in float64, before the rounding to ``x.dtype``."""
        if x.ndim != 4:
            raise ValueError(f"Conv2d.sample_norm_factor expects [batch, C, H, W], got {x.shape}")
        size = (int(x.shape[2]), int(x.shape[3]))
        # certified ||x_i||^2 (sample_norms_upper), times k_eff and plus P in float64, with
        # 2^-51 relative for those two float64 operations and the square root
        sq = sample_norms_upper(x).square() * float(self.multiplicity(size))
        if self.bias is not None:
            sq = sq + float(self.output_positions(size))
        return torch.sqrt(sq * (1.0 + 2.0**-50))

    def norm_factor_bound(self, input_bound: float) -> float:
        """``sqrt(k_eff X^2 + P)`` with a bias, ``sqrt(k_eff) X`` without (rounded up)."""
        x_bound = _checks.as_bound("input_bound", input_bound)
        sq = _certified.mul(_certified.mul(float(self.multiplicity()), x_bound), x_bound)
        if self.bias is not None:
            sq = _certified.add(sq, float(self.output_positions()))
        return _certified.sqrt(sq)

    def vanilla_export(self) -> torch.nn.Module:
        """A ``torch.nn.Conv2d`` (same padding mode) with copies of the weight and bias."""
        w = self.weight.detach()
        plain = torch.nn.Conv2d(
            self.in_channels,
            self.out_channels,
            self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            padding_mode="circular" if self.padding_mode == "circular" else "zeros",
            bias=self.bias is not None,
            device=w.device,
            dtype=w.dtype,
        )
        return with_copies(plain, w, self.bias)

    def extra_repr(self) -> str:
        s = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}"
        )
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode!r}"
        s += f", bias={self.bias is not None}"
        if self.input_size is not None:
            s += f", input_size={self.input_size}"
        return s
