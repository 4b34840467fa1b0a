"""Clipping-bias diagnostics from exact per-sample gradients (thesis chapter 5, 5.2.4 and 5.3.4).

DP-SGD replaces each per-sample gradient ``g_i`` by ``clip_C(g_i) = g_i min(1, C / ||g_i||)``
before averaging. The noiseless DP-SGD update is then ``mean_i clip_C(g_i)``, which is in general
*not* the gradient of the loss: its zeros are not the loss's stationary points, so DP-SGD
converges (up to noise) to a different point. Clipless never clips a parameter gradient (the
sensitivity is bounded through certified Lipschitz constants instead), so its noiseless update is
the true mean gradient and has no such bias. The thesis (section 5.2.4, "Avoiding the bias of
gradient clipping") works out a linear-regression example with asymmetric errors, and its
Figure 5.3.3 plots ``||mean_i g_i - mean_i clip_C(g_i)||`` during training; :func:`clipping_bias`
computes that quantity for any model and data set.

Worked example (``tests/test_diagnostics.py``): ``y = a x + b + e``, ``x ~ U[0, 1]``, ``e = +9``
w.p. 0.1 and ``-1`` w.p. 0.9, loss ``(f(x) - y)^2``, ``C = 1``. At ``(a, b)`` the clipped mean
gradient is ``0.8 (sqrt(2) - 1, asinh(1))``, norm 0.7791 (as in the thesis), and it vanishes at
``(a - 0.01765, b - 0.94221)``; the thesis prints ``+`` signs, but clipping caps the rare large
positive errors, so the biased fit lies *below* the true line (the signs printed belong to the
mirrored errors ``-9`` / ``+1``). The unclipped mean gradient vanishes at ``(a, b)``.

:func:`clipping_profile` measures, from one pass of per-sample gradients, how much clipping at
several thresholds distorts the averaged gradient of a real model: the bias norm, its size
relative to the true mean gradient, the cosine between the clipped and the true mean, and the
fraction of samples clipped (``benchmarks/clipping_bias.py`` runs it along a DP-SGD training run on
Adult, the thesis's Figure 5.3.3(b)).

The per-sample gradients are exact: ``torch.func.vmap(torch.func.grad(...))`` over
``torch.func.functional_call`` of the model on one sample at a time. The clip is the flat
(all-parameter) L2 clip of DP-SGD (Abadi et al. 2016; Opacus's default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad, vmap

__all__ = [
    "ClippingStats",
    "clipped_mean_gradient",
    "clipping_bias",
    "clipping_profile",
    "mean_gradient",
    "per_sample_gradients",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def per_sample_gradients(
    model: torch.nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Exact per-sample gradients ``{name: [n, *param.shape]}`` of ``loss_fn(model(x_i), y_i)``.

    ``loss_fn(output, target)`` is called on a batch of one sample (leading dimension 1) and must
    return a scalar, e.g. ``torch.nn.CrossEntropyLoss(reduction="sum")``. Only parameters with
    ``requires_grad`` are differentiated; buffers are used as they are (call ``model.eval()``
    first for a deterministic model). ``chunk_size`` bounds how many samples ``vmap`` processes at
    once (memory), without changing the result.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("x and y must be torch.Tensor of shape [n, ...]")
    if x.ndim < 1 or y.ndim < 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(
            f"x and y must have the same leading (sample) dimension n >= 1, "
            f"got x {tuple(x.shape)} and y {tuple(y.shape)}"
        )
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError("x must hold finite values (a NaN or inf input gives NaN gradients)")
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    if not params:
        raise ValueError("model has no parameter with requires_grad=True")
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        loss = loss_fn(out, yi.unsqueeze(0))
        if loss.ndim != 0:
            raise ValueError(
                "loss_fn must return a scalar for one sample (use reduction='sum'), "
                f"got shape {tuple(loss.shape)}"
            )
        return loss

    grads: dict[str, torch.Tensor] = vmap(
        grad(loss_one), in_dims=(None, 0, 0), chunk_size=chunk_size
    )(params, x, y)
    return grads


def _weights(sample_weight: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    """Normalised non-negative sample weights (uniform ``1/n`` when ``None``)."""
    if sample_weight is None:
        return torch.full((n,), 1.0 / n, dtype=like.dtype, device=like.device)
    w = torch.as_tensor(sample_weight, dtype=like.dtype, device=like.device)
    if w.shape != (n,):
        raise ValueError(f"sample_weight must have shape ({n},), got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or float(w.sum()) <= 0.0:
        raise ValueError("sample_weight must be finite, >= 0, with a positive sum")
    return w / w.sum()


def _weighted_mean(
    grads: dict[str, torch.Tensor], w: torch.Tensor, scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    f = w if scale is None else w * scale
    return {k: torch.tensordot(f, g, dims=1) for k, g in grads.items()}


def _flat_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample L2 norm over all parameters together (DP-SGD's flat clip)."""
    sq = sum(g.reshape(g.shape[0], -1).pow(2).sum(dim=1) for g in grads.values())
    assert isinstance(sq, torch.Tensor)
    return sq.sqrt()


def _both(
    model: torch.nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    max_grad_norm: float,
    sample_weight: torch.Tensor | None,
    chunk_size: int | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(mean gradient, clipped mean gradient) from one pass of per-sample gradients."""
    C = float(max_grad_norm)
    if not math.isfinite(C) or C <= 0.0:
        raise ValueError(f"max_grad_norm must be a finite float > 0, got {max_grad_norm!r}")
    grads = per_sample_gradients(model, loss_fn, x, y, chunk_size=chunk_size)
    norms = _flat_norms(grads)
    scale = C / torch.clamp(norms, min=C)  # == min(1, C / norm), and 1 at norm 0
    w = _weights(sample_weight, x.shape[0], norms)
    return _weighted_mean(grads, w), _weighted_mean(grads, w, scale)


def mean_gradient(
    model: torch.nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    sample_weight: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """The (weighted) mean per-sample gradient ``sum_i w_i g_i / sum_i w_i``: the noiseless update
    of clipless (thesis 5.3.4, ``g^{LIP-DP-SGD}``). See :func:`per_sample_gradients`."""
    grads = per_sample_gradients(model, loss_fn, x, y, chunk_size=chunk_size)
    w = _weights(sample_weight, x.shape[0], next(iter(grads.values())))
    return _weighted_mean(grads, w)


def clipped_mean_gradient(
    model: torch.nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    max_grad_norm: float,
    *,
    sample_weight: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """The (weighted) mean of per-sample gradients clipped to L2 norm ``max_grad_norm``.

    ``sum_i w_i g_i min(1, C / ||g_i||) / sum_i w_i`` with ``||g_i||`` the norm over all
    parameters together: the noiseless DP-SGD update (thesis 5.3.4, ``g^{DP-SGD}``; the averaged
    clipped gradient ``g~`` of section 5.2.4). ``sample_weight`` (shape ``[n]``, non-negative)
    turns a quadrature grid into an exact discretisation of a population expectation.
    """
    return _both(model, loss_fn, x, y, max_grad_norm, sample_weight, chunk_size)[1]


def clipping_bias(
    model: torch.nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    max_grad_norm: float,
    *,
    sample_weight: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> float:
    """``||mean_i g_i - mean_i clip_C(g_i)||_2`` over all parameters: the error DP-SGD's clipping
    makes in the noiseless update (thesis Figure 5.3.3, blue curve).

    Zero when no sample is clipped; clipless's update (no parameter-gradient clipping) has no
    such error. Arguments as in :func:`clipped_mean_gradient`.
    """
    plain, clipped = _both(model, loss_fn, x, y, max_grad_norm, sample_weight, chunk_size)
    sq = sum(float((plain[k] - clipped[k]).pow(2).sum()) for k in plain)
    return math.sqrt(sq)


@dataclass(frozen=True)
class ClippingStats:
    """How flat clipping at ``max_grad_norm`` distorts the (weighted) mean gradient.

    With ``g`` the mean per-sample gradient and ``c`` the mean of the clipped ones (all parameters
    flattened together): ``bias = ||g - c||`` (thesis Figure 5.3.3, blue), ``clipped_norm =
    ||c||`` (red), ``mean_norm = ||g||``, ``relative_error = bias / ||g||`` (``inf`` when
    ``g = 0`` and ``bias > 0``, ``0`` when both vanish), ``cosine = <g, c> / (||g|| ||c||)``
    (``nan`` when either is zero), ``fraction_clipped`` = the (weighted) fraction of samples with
    ``||g_i|| > max_grad_norm``, and ``mean_scale`` = the (weighted) mean of
    ``min(1, C / ||g_i||)``. Computed in float64.
    """

    max_grad_norm: float
    bias: float
    mean_norm: float
    clipped_norm: float
    relative_error: float
    cosine: float
    fraction_clipped: float
    mean_scale: float


def clipping_profile(
    model: torch.nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    thresholds: Sequence[float],
    *,
    sample_weight: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> list[ClippingStats]:
    """:class:`ClippingStats` at every clipping threshold, from one pass of per-sample gradients.

    DP-SGD's noiseless update at threshold ``C`` is ``c = mean_i g_i min(1, C / ||g_i||)``
    (Abadi et al. 2016, flat clipping); clipless's is ``g = mean_i g_i`` (thesis 5.3.4). The
    thesis (section 5.2.4) argues that the difference biases DP-SGD's fixed point; this measures it
    on any model and data. Arguments as in :func:`clipped_mean_gradient`.
    """
    try:
        values = [float(t) for t in thresholds]
    except TypeError:
        raise TypeError(
            f"thresholds must be a sequence of max_grad_norm values, e.g. [0.1, 1.0]; got "
            f"{thresholds!r}"
        ) from None
    if not values:
        raise ValueError("thresholds must hold at least one max_grad_norm")
    for t in values:
        if not math.isfinite(t) or t <= 0.0:
            raise ValueError(f"thresholds must be finite floats > 0, got {t!r}")
    grads = per_sample_gradients(model, loss_fn, x, y, chunk_size=chunk_size)
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1).double()
    norms = flat.norm(dim=1)
    w = _weights(sample_weight, flat.shape[0], flat)
    mean = w @ flat
    mean_norm = float(mean.norm())
    out = []
    for t in values:
        scale = t / torch.clamp(norms, min=t)  # min(1, C / ||g_i||), 1 at norm 0
        clipped = (w * scale) @ flat
        bias = float((mean - clipped).norm())
        clipped_norm = float(clipped.norm())
        relative = bias / mean_norm if mean_norm > 0.0 else (math.inf if bias > 0.0 else 0.0)
        denom = mean_norm * clipped_norm
        cosine = float(mean @ clipped) / denom if denom > 0.0 else math.nan
        out.append(
            ClippingStats(
                max_grad_norm=t,
                bias=bias,
                mean_norm=mean_norm,
                clipped_norm=clipped_norm,
                relative_error=relative,
                cosine=cosine,
                fraction_clipped=float(w @ (norms > t).double()),
                mean_scale=float(w @ scale),
            )
        )
    return out
