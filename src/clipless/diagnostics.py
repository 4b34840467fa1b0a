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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch.func import functional_call, grad, vjp, vmap

from clipless import _validate

__all__ = [
    "ClippingStats",
    "SensitivityReport",
    "SensitivityUse",
    "clipped_mean_gradient",
    "clipping_bias",
    "clipping_profile",
    "mean_gradient",
    "per_sample_gradients",
    "sensitivity_use",
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

    Only parameters with ``requires_grad`` are differentiated; buffers are used as they are (call
    ``model.eval()`` first for a deterministic model).

    On a model made private, the clipless layers keep the scaling thresholds of the last step, so
    the gradients of their parameters are the *scaled* per-sample gradients (divided by
    ``max(n_i, T_k)``, :mod:`clipless.nn._scaled`), without the optimizer's clip of the output
    cotangent; :func:`sensitivity_use` computes exactly what a step sums.

    Args:
        model: any model.
        loss_fn: ``loss_fn(output, target)``, called on a batch of one sample (leading dimension
            1); it must return a scalar, e.g. ``torch.nn.CrossEntropyLoss(reduction="sum")``.
        x, y: the samples and targets, with the same leading dimension ``n >= 1``; ``x`` finite.
        chunk_size: how many samples ``vmap`` processes at once (memory; ``None``: all), without
            changing the result.

    Raises:
        TypeError: ``x`` or ``y`` not a tensor.
        ValueError: mismatched or empty samples, a non-finite input, a model without trainable
            parameters, or a ``loss_fn`` that does not return a scalar.
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
    of clipless (thesis 5.3.4, ``g^{LIP-DP-SGD}``).

    Args:
        model, loss_fn, x, y, chunk_size: as in :func:`per_sample_gradients`.
        sample_weight: non-negative weights of shape ``[n]`` with a positive sum (``None``:
            uniform).
    """
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
    clipped gradient ``g~`` of section 5.2.4).

    Args:
        model, loss_fn, x, y, chunk_size: as in :func:`per_sample_gradients`.
        max_grad_norm: the clipping threshold ``C``, finite and ``> 0``.
        sample_weight: non-negative weights of shape ``[n]`` with a positive sum, which turn a
            quadrature grid into an exact discretisation of a population expectation (``None``:
            uniform).
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
    such error.

    Args:
        model, loss_fn, x, y, max_grad_norm, sample_weight, chunk_size: as in
            :func:`clipped_mean_gradient`.
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
    on any model and data.

    Args:
        model, loss_fn, x, y, sample_weight, chunk_size: as in :func:`clipped_mean_gradient`.
        thresholds: the clipping thresholds ``C``, each finite and ``> 0`` (at least one).
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


@dataclass(frozen=True)
class SensitivityUse:
    """The norms of the samples' contributions to one summed quantity of a step, against the
    bound the step's noise is calibrated to.

    ``sensitivity`` is the bound (a noised tensor's planned ``Delta_p``, or the loss constant
    ``L`` for the output cotangent); ``mean``, ``median`` and ``max`` are over the samples of the
    contribution norms (float64); ``samples`` is how many. :attr:`ratio` is ``mean /
    sensitivity``.
    """

    sensitivity: float
    mean: float
    median: float
    max: float
    samples: int

    @property
    def ratio(self) -> float:
        """``mean / sensitivity``: the share of its sensitivity a typical sample uses."""
        return self.mean / self.sensitivity


@dataclass(frozen=True)
class SensitivityReport:
    """What :func:`sensitivity_use` measured: ``output`` for the model output's cotangent (after
    the step's clip at the loss constant ``L``) and ``tensors`` for every noised parameter."""

    output: SensitivityUse
    tensors: Mapping[str, SensitivityUse]


def _use(norms: torch.Tensor, sensitivity: float) -> SensitivityUse:
    n = norms.to(torch.float64)
    return SensitivityUse(
        sensitivity=float(sensitivity),
        mean=float(n.mean()),
        median=float(n.median()),
        max=float(n.max()),
        samples=int(n.numel()),
    )


def sensitivity_use(
    optimizer: object,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> SensitivityReport:
    """How much of its planned sensitivity each sample's contribution to a step uses.

    For a :class:`clipless.optim.DPOptimizer` (from ``make_private``) at its current weights,
    and samples ``x`` (one row each, the input shape the model was made private for) with
    targets ``y``: each sample's contribution to the step's gradient sum, exactly as a step
    computes it (the loss gradient at the output clipped to the loss constant ``L`` in float64,
    then backpropagated through the scaled kernels at the plan's thresholds), its norm per noised
    tensor, and the sensitivity ``Delta_p`` the noise of that tensor is calibrated to
    (:func:`clipless.mechanism.plan_step`). No ratio exceeds 1 (the plan's guarantee; the tests
    check it against these exact contributions).

    A ratio far below 1 means the noise is large next to a typical sample's signal: the Clipless
    DP-SGD paper's gradient-to-noise argument (Béthune et al. 2024, section 4) for
    gradient-norm-preserving networks, a higher temperature, a smaller loss-gradient clip or a
    scaling threshold closer to the samples' norm factors (:mod:`clipless.nn._scaled`). The
    ``output`` entry shows how much of ``L`` the loss gradients use.

    **Not private.** The report is computed from the rows you pass and is not covered by the
    training's epsilon: use it on public data, or on data whose privacy you account for
    separately (as the papers state, not account, their tuning cost).

    Computed with ``torch.func`` (``vmap`` of a ``vjp`` over
    ``torch.func.functional_call`` with detached parameters): no training pass, no noise, no
    accounting. The call sets the layers' scaling thresholds for the current weights
    (:meth:`~clipless.optim.DPOptimizer.refresh`), as the next training forward would.

    Args:
        optimizer: the :class:`clipless.optim.DPOptimizer` returned by ``make_private``.
        x: samples, one row each, of the input shape the model was made private for.
        y: their targets.
        chunk_size: how many samples ``vmap`` processes at once (memory; ``None``: all).

    Returns:
        A :class:`SensitivityReport`: per noised tensor (and the output cotangent) the norms of
        the samples' contributions against the calibrated sensitivity.

    Raises:
        TypeError: another optimizer.
        ValueError: the ``"batch-max"`` scaling mode (no per-sample contribution), or samples
            of the wrong shape.
    """
    from clipless.nn._scaled import BATCH_MAX
    from clipless.optim import DPOptimizer
    from clipless.optim.guard import _clip_rows

    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            "optimizer must be the clipless.optim.DPOptimizer returned by "
            f"PrivacyEngine.make_private; got {type(optimizer).__name__}"
        )
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("x and y must be torch.Tensor with one row per sample")
    shape = tuple(optimizer.input_shape)
    if x.ndim < 1 or tuple(x.shape[1:]) != shape or x.shape[0] == 0:
        raise ValueError(
            f"x must have shape [n, {', '.join(map(str, shape))}] with n >= 1 (the input shape "
            f"the model was made private for); got {tuple(x.shape)}"
        )
    if y.ndim < 1 or y.shape[0] != x.shape[0]:
        raise ValueError(
            f"y must have one row per sample of x ({x.shape[0]}); got shape {tuple(y.shape)}"
        )
    if chunk_size is not None and (not _validate.is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an integer >= 1; got {chunk_size!r}")
    chunk_size = None if chunk_size is None else int(chunk_size)  # torch.vmap takes an int only
    plan = optimizer.refresh()
    if plan.multiplicity != 1:
        raise ValueError(
            f"called inside sample_multiplicity({plan.multiplicity}): each sample here is one row"
        )
    if any(t == BATCH_MAX for t in plan.thresholds.values()):
        raise ValueError(
            "scaling='batch-max' divides by the largest factor of the whole batch, so one "
            "sample's contribution is not defined; use a rigorous scaling mode"
        )
    model, loss = optimizer.module, optimizer.loss
    noised = {n: p.detach() for n, p in model.named_parameters() if n in plan.sensitivities}
    frozen = {n: p.detach() for n, p in model.named_parameters() if n not in noised}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    device = next(iter(noised.values())).device
    x, y = x.to(device), y.to(device)

    def contribution(xi: torch.Tensor, yi: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def forward(p: dict[str, torch.Tensor]) -> torch.Tensor:
            out: torch.Tensor = functional_call(
                model, ({**p, **frozen}, buffers), (xi.unsqueeze(0),)
            )
            return out

        out, pull = vjp(forward, noised)[:2]
        # the optimizer's output guard clips this sample's (one-row) loss gradient
        g, _ = _clip_rows(grad(lambda o: loss(o, yi.unsqueeze(0)))(out), plan.output_bound)
        (parts,) = pull(g)
        clipped = torch.linalg.vector_norm(g.double())
        return (clipped, *(torch.linalg.vector_norm(parts[n].double()) for n in noised))

    with torch.no_grad():  # nothing here can reach the live parameters' gradients
        norms = vmap(contribution, chunk_size=chunk_size)(x, y)
    return SensitivityReport(
        output=_use(norms[0], plan.output_bound),
        tensors=MappingProxyType(
            {n: _use(v, plan.sensitivities[n]) for n, v in zip(noised, norms[1:], strict=True)}
        ),
    )
