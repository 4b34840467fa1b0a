"""Input pre-processing that certifies the input bound ``X_0`` (Béthune et al. 2024, 3.1)."""

from __future__ import annotations

import math
from typing import Any

import torch

from clipless import _validate
from clipless.nn import _checks
from clipless.nn._base import LipschitzModule
from clipless.nn._functional import project_norm
from clipless.nn.export import PlainInputNorm, input_map

__all__ = ["InputNorm"]

MODES = ("ball", "sphere")


class InputNorm(LipschitzModule):
    """Projects each sample (all non-batch dims) onto the ball or sphere of radius ``max_norm``.

    ``max_norm`` here is the *input radius* ``X_0``; the ``max_norm`` of
    :meth:`clipless.PrivacyEngine.make_private` is the layers' operator-norm constraint ``C``.

    Requirement 2 of the Clipless DP-SGD paper (bounded input, ``||x|| <= X_0``) enforced by the
    model itself; section 3.1, "Controlling X_0 with input pre-processing": projection onto the
    ball ("norm clipping", ``mode="ball"``: ``x min(1, R / ||x||)``) or onto the sphere
    ("normalization", ``mode="sphere"``: ``R x / ||x||``; a zero sample stays zero). As the first
    layer of a model it makes ``X_0 = max_norm`` a certified bound whatever the data:
    :meth:`output_bound` returns ``max_norm`` for every input bound (:mod:`clipless.bounds` reads
    :attr:`max_norm` of a leading ``InputNorm``).

    Lipschitz constant: ``ball`` -> 1 (Euclidean projection onto a closed convex set is
    non-expansive); ``sphere`` -> ``math.inf``: the map is not Lipschitz near 0 (its Jacobian at
    ``x`` is ``(R/||x||)(I - u u^T)``, unbounded as ``x -> 0``). That is harmless for the leading
    layer (nothing trainable before it needs a cotangent bound) but makes any bound that
    propagates through a sphere projection vacuous.

    Roundoff: the scale is computed in float64 and aims at ``R (1 - 4 eps)`` so that the norm of the
    rounded output never exceeds ``R``.

    **Centring** (``center``, ``center_noise``): each sample is first normalised to the unit sphere,
    the released mean ``mu`` of the unit-normalised training samples is subtracted, and the result
    is projected as above: ``x -> P_R(x / ||x|| - mu)``. ``mu`` must come from
    :func:`clipless.features.release_mean` (a Gaussian mechanism on the sum of unit vectors,
    sensitivity 1, noise multiplier ``center_noise``): :meth:`clipless.PrivacyEngine.make_private`
    composes that release with the training steps, so the model carries the privacy cost of its
    own pre-processing. The output bound is still ``max_norm``; ``mu`` is a (private) constant, so
    a sample's output depends on that sample alone. On scattering features the data mean is a
    large common component (norm ~0.5 of unit-norm samples on Fashion-MNIST); removing it gives a
    linear model without bias the offset it cannot learn (``benchmarks/RESULTS.md`` section 17).

    **Whitening** (``whiten``, ``whiten_noise``): after the (optional) centring, the channels of the
    unit-normalised sample (its first axis; ``C x P`` with ``P`` positions) are mixed by the
    ``C x C`` matrix ``W`` before the projection: ``x -> P_R(W (x / ||x|| - mu))``. ``W`` must come
    from :func:`clipless.features.whitening` of a :func:`clipless.features.release_channel_moment`
    release (Gaussian mechanism, sensitivity 1, noise multiplier ``whiten_noise``), which the
    privacy engine composes with the steps like the mean. The output bound is still ``max_norm``
    (the projection comes last), so ``W`` needs no norm bound for privacy; a sample's output still
    depends on that sample alone.

    **Mapping the data once** (:meth:`premap_`): with a released centre or whitening, the map
    before the projection is fixed for the whole run, and on wide inputs it is a large part of a
    training step (about 40% of a linear model's epoch on Fashion-MNIST's scattering features,
    ``benchmarks/RESULTS.md`` sections 20f and 21). :meth:`premap_` applies the full map to a
    data tensor once, in place, and sets :attr:`inputs_premapped`; the layer then applies only
    the projection ``P_R``. That projection is what certifies ``||output|| <= max_norm``, so the
    bound holds whatever is fed (premapped or not: a mistake costs accuracy, never privacy). On
    premapped data the output is the full map's up to the rounding of a second projection (a
    relative ``~1e-7``). ``clipless train`` does this for its feature tensors. The flag is not
    part of the state dict: a saved and reloaded model maps raw inputs.
    """

    def __init__(
        self,
        max_norm: float,
        mode: str = "ball",
        center: torch.Tensor | None = None,
        center_noise: float | None = None,
        whiten: torch.Tensor | None = None,
        whiten_noise: float | None = None,
    ) -> None:
        super().__init__()
        self.max_norm = _checks.positive_float("max_norm", max_norm)
        _validate.choice("mode", mode, MODES)
        self.mode = mode
        if (center is None) != (center_noise is None):
            raise ValueError(
                "center and center_noise go together: center is a released mean "
                "(clipless.features.release_mean) and center_noise the noise multiplier it was "
                "released with, which the privacy engine accounts for"
            )
        if (whiten is None) != (whiten_noise is None):
            raise ValueError(
                "whiten and whiten_noise go together: whiten is clipless.features.whitening of a "
                "release_channel_moment release and whiten_noise that release's noise multiplier"
            )
        if center is not None and (
            not isinstance(center, torch.Tensor) or not bool(torch.isfinite(center).all())
        ):
            raise ValueError("center must be a finite tensor of one sample's shape")
        if whiten is not None:
            if (
                not isinstance(whiten, torch.Tensor)
                or whiten.ndim != 2
                or whiten.shape[0] != whiten.shape[1]
                or not bool(torch.isfinite(whiten).all())
            ):
                raise ValueError("whiten must be a finite square C x C tensor (C channels)")
            if center is not None and center.ndim >= 1 and center.shape[0] != whiten.shape[0]:
                raise ValueError(
                    f"whiten is {tuple(whiten.shape)} but center has {center.shape[0]} channels"
                )
        self.center: torch.Tensor | None
        self.center_noise: torch.Tensor | None
        self.whiten: torch.Tensor | None
        self.whiten_noise: torch.Tensor | None
        self._keep_release("center", center, center_noise)
        self._keep_release("whiten", whiten, whiten_noise)
        self.inputs_premapped = False
        """``True`` once :meth:`premap_` has mapped the data: forward then only projects."""

    def _keep_release(self, name: str, value: torch.Tensor | None, noise: float | None) -> None:
        """Buffers ``name`` (the released value) and ``name + "_noise"`` (its multiplier)."""
        if value is None:
            self.register_buffer(name, None)
            self.register_buffer(f"{name}_noise", None)
            return
        sigma = _checks.positive_float(f"{name}_noise", noise)
        self.register_buffer(name, value.detach().clone())
        self.register_buffer(f"{name}_noise", torch.tensor(sigma, dtype=torch.float64))

    def _apply(self, fn: Any, recurse: bool = True) -> InputNorm:
        """``to`` / ``float`` / ``half`` / ``cuda`` as usual, except that the noise multipliers stay
        float64: the accountant reads them, and a multiplier rounded up by a dtype conversion
        (``model.half().float()``) would under-report epsilon."""
        kept = {
            name: t
            for name in ("center_noise", "whiten_noise")
            if (t := self._buffers.get(name)) is not None
        }
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and after.dtype != torch.float64:
                self._buffers[name] = before.to(device=after.device)
        return self

    @property
    def release_noise(self) -> float | None:
        """Noise multiplier of the released mean in :attr:`center` (``None``: no centring)."""
        return None if self.center_noise is None else float(self.center_noise)

    @property
    def releases(self) -> tuple[tuple[str, float], ...]:
        """``(label, noise multiplier)`` of every release this layer carries, in order: the mean
        (``"input mean"``) and the channel second moment (``"input second moment"``)."""
        out = []
        if self.center_noise is not None:
            out.append(("input mean", float(self.center_noise)))
        if self.whiten_noise is not None:
            out.append(("input second moment", float(self.whiten_noise)))
        return tuple(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 1:
            raise ValueError("InputNorm expects an input of shape [batch, ...]")
        if self.center is not None and tuple(x.shape[1:]) != tuple(self.center.shape):
            raise ValueError(
                f"InputNorm: center has shape {tuple(self.center.shape)} but the samples have "
                f"shape {tuple(x.shape[1:])}"
            )
        if self.inputs_premapped:
            return project_norm(x, self.max_norm, self.mode)
        return input_map(x, self.max_norm, self.mode, self.center, self.whiten)

    @torch.no_grad()
    def premap_(self, x: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
        """Replace each sample of ``x`` (a floating tensor ``[n, ...]``) by this layer's full
        output, in place and ``batch_size`` samples at a time, then set :attr:`inputs_premapped`
        (class docstring). Returns ``x``. Map every tensor the layer will see (training and
        evaluation data) after the layer's buffers are final (after a resumed run's checkpoint is
        loaded or a data-parallel broadcast)."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 1:
            raise ValueError("premap_ expects a floating tensor of samples [n, ...]")
        batch_size = _validate.positive_int("batch_size", batch_size, wrong_type=ValueError)
        if self.center is not None and tuple(x.shape[1:]) != tuple(self.center.shape):
            raise ValueError(
                f"InputNorm: center has shape {tuple(self.center.shape)} but the samples have "
                f"shape {tuple(x.shape[1:])}"
            )
        for i in range(0, len(x), batch_size):
            chunk = x[i : i + batch_size]
            chunk.copy_(input_map(chunk, self.max_norm, self.mode, self.center, self.whiten))
        self.inputs_premapped = True
        return x

    def lipschitz(self) -> float:
        plain = self.center is None and self.whiten is None
        return 1.0 if self.mode == "ball" and plain else math.inf

    def output_bound(self, input_bound: float) -> float:
        """``max_norm``, for every input bound."""
        _checks.as_bound("input_bound", input_bound)
        return self.max_norm

    def vanilla_export(self) -> torch.nn.Module:
        return PlainInputNorm(self.max_norm, self.mode, self.center, self.whiten)

    def extra_repr(self) -> str:
        premapped = ", inputs_premapped=True" if self.inputs_premapped else ""
        return f"max_norm={self.max_norm}, mode={self.mode!r}{premapped}"


def releases_in(module: torch.nn.Module) -> tuple[tuple[InputNorm, str, float], ...]:
    """``(layer, label, noise multiplier)`` of every release the ``InputNorm`` layers of
    ``module`` carry, in module order (a layer reached twice counts once: it applies one released
    value). The engine accounts them; the optimizer refuses a forward once they changed."""
    return tuple(
        (m, label, sigma)
        for m in module.modules()  # modules() yields each module object once
        if isinstance(m, InputNorm)
        for label, sigma in m.releases
    )
