"""Certified robustness of Lipschitz models: a certified L2 radius for every prediction.

A clipless model ``f = g o P`` is its leading :class:`clipless.nn.InputNorm` map ``P`` followed by
layers ``g`` whose certified Lipschitz constant ``K`` (:func:`clipless.bounds.report`,
``model_lipschitz``: the product of the layers' certified ``lipschitz()`` bounds, rounded up) bounds
``||g(a) - g(b)|| <= K ||a - b||`` in L2. If ``x`` is predicted as class ``c`` with margin
``m = z_c - z_j`` over the runner-up ``j``, each logit difference ``z_c - z_i`` is
``sqrt(2) K``-Lipschitz, so no perturbation whose image under ``P`` moves by less than
``t = m / (sqrt(2) K)`` can change the prediction (Tsuzuku, Sato and Sugiyama, NeurIPS 2018).
When the model ends in a :class:`clipless.nn.Linear` head ``W`` the pairwise constants
``K_body ||W_c - W_i||`` replace ``sqrt(2) K`` (tighter, never looser: ``||W_c - W_i|| <= sqrt(2)
||W||_2``); the larger of the two certified displacements is used.

**The input map is part of the certificate.** The radius is stated in the space the user feeds
the model (:func:`certify` takes raw inputs), so the displacement ``t`` allowed at ``P``'s output
is converted back through ``P``:

* ``mode="ball"``, no centre or whitening: ``P`` is the Euclidean projection onto a ball of
  radius ``R``, 1-Lipschitz and with outputs at most ``2R`` apart: the radius is at least ``t``,
  infinite when ``t > 2R`` (every input gets the same class), and larger for an input outside
  the ball, where ``P`` contracts (:func:`_ball_move`).
* ``mode="sphere"`` (``x -> R x / ||x||``), or a released centre / whitening (``x -> P_R(A (x /
  ||x|| - mu))``): the normalisation ``x / ||x||`` is not Lipschitz near 0, so no global
  constant exists. The certificate is local and exact for that step: over the ball of radius
  ``r`` around ``x`` the unit vector moves by at most ``chord(r / ||x||) = sqrt(2 - 2 sqrt(1 -
  (r / ||x||)^2))`` (the chord of the widest angle, ``arcsin(r / ||x||)``; 2 once ``r > ||x||``),
  the whitening ``A`` (channel mixing) multiplies it by at most its certified ``||A||_2``, and a
  final sphere projection ``v -> R v / ||v||`` is again a chord at ``||v||``; a final ball
  projection contracts like the sphere map for points outside the ball (:func:`_ball_move`).
  These bounds are non-decreasing in ``r``, and the radius is found by bisection on them.

**What is not certified.** A front-end applied *before* the model (``clipless train --features
scatter``: a scattering transform followed by a per-sample group normalisation, which is not
Lipschitz) is outside the model: radii of such a run are in the space of the *features*, not of
the pixels (:attr:`RobustAccuracy.space`). The bounds are for the exact-arithmetic function of
the stored weights: the logits are evaluated in float64 on a copy of the model and the margin is
reduced by a slack (``MARGIN_SLACK`` relative to the logits' size) for the forward pass's
rounding, which is tiny in float64 but not proved; a float32 evaluation of the same model can
disagree with the float64 prediction where the margin is ~1e-6, i.e. where the radius is ~0.

L-infinity: ``||d||_2 <= sqrt(n) ||d||_inf`` for ``n`` input entries, so ``r_inf = r_2 /
sqrt(n)`` (rounded down) is a certified L-infinity radius; it is loose by up to ``sqrt(n)``.

>>> import torch
>>> from clipless import models
>>> model = models.linear((4,), num_classes=3, input_norm=10.0)
>>> cert = certify(model, torch.randn(5, 4))
>>> cert.radii.shape, bool((cert.radii >= 0).all())
(torch.Size([5]), True)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from clipless import _validate
from clipless import nn as cnn
from clipless._certified import NUMERIC_MARGIN, mul
from clipless.bounds import _leading_module, report
from clipless.nn.export import mix_channels
from clipless.norms import dense_norm

__all__ = [
    "MARGIN_SLACK",
    "NORMS",
    "Certificate",
    "LipschitzSummary",
    "RobustAccuracy",
    "certified_accuracy",
    "certify",
    "empirical_accuracy",
    "lipschitz_summary",
    "pgd_l2",
]

NORMS = ("l2", "linf")

MARGIN_SLACK = 1e-9
"""Relative slack removed from every float64 margin (times ``1 + max |z|``): the forward pass's
rounding in float64 (not a proved bound; module docstring)."""

# Every float64 quantity below (a norm, a quotient, a square root) is within a few ulps (or,
# for norms of n entries, n ulps) of its exact value; shrinking lower bounds and growing upper
# bounds by this relative margin keeps each one on the safe side.
_DOWN = 1.0 - 4.0 * NUMERIC_MARGIN
_UP = 1.0 + 4.0 * NUMERIC_MARGIN
_SQRT2_UP = math.nextafter(math.sqrt(2.0), math.inf)


@dataclass(frozen=True)
class LipschitzSummary:
    """The certified constants of a model, from :func:`lipschitz_summary`.

    ``body`` bounds the Lipschitz constant (L2 -> L2) of the map from the leading ``InputNorm``'s
    output to the logits. ``pairwise`` is ``None`` unless the model ends in a ``Linear`` head
    ``W`` (``C`` logits); then ``pairwise[c, j]`` (float64, ``C x C``) bounds the constant of
    ``z_c - z_j`` on the same map, ``K_pre ||W_c - W_j||`` with ``K_pre`` the certified constant of
    the layers between the ``InputNorm`` and the head (for one logit, ``1 x 1``: ``K_pre
    ||W_0||``, the constant of ``z``). ``input_map`` names the ``InputNorm`` map (``"ball"``,
    ``"sphere"``, ``"normalised-ball"`` or ``"normalised-sphere"``: with a released centre or
    whitening); ``input_lipschitz`` is its global constant (1 for ``"ball"``, ``inf`` otherwise)
    and ``total`` bounds the raw input -> logits constant (``inf`` when no global one exists:
    the radii are then local, see :func:`certify`). ``radius`` is the ``InputNorm`` radius ``R``
    and ``whiten_norm`` the certified ``||A||_2`` of its whitening (1 without one).
    """

    body: float
    pairwise: torch.Tensor | None
    input_map: str
    input_lipschitz: float
    total: float
    radius: float
    whiten_norm: float


@dataclass(frozen=True)
class Certificate:
    """Certified predictions of one batch (:func:`certify`).

    ``predictions`` (int64) are the float64 model's classes (argmax, or ``z > 0`` for a single
    logit); ``radii`` (float64, ``inf`` allowed) are certified L2 radii in the model's input space:
    no perturbation ``d`` with ``||d||_2 < radii[i]`` changes ``predictions[i]``. ``input_dim`` is
    the number of entries of one input (for :meth:`linf_radii`).
    """

    predictions: torch.Tensor
    radii: torch.Tensor
    input_dim: int
    lipschitz: LipschitzSummary

    def linf_radii(self) -> torch.Tensor:
        """Certified L-infinity radii ``r_2 / sqrt(n)``, rounded down."""
        return self.radii / (math.sqrt(self.input_dim) * _UP)

    def robust(self, labels: torch.Tensor, radius: float, norm: str = "l2") -> torch.Tensor:
        """Boolean mask: correctly predicted and certified beyond ``radius`` (strictly).

        Args:
            labels: the true labels, one per sample.
            radius: the radius, ``>= 0``.
            norm: ``"l2"`` or ``"linf"`` (:meth:`linf_radii`).
        """
        radii = _norm_radii(self, norm)
        return (self.predictions == labels.reshape(-1).to(self.predictions.device)) & (
            radii > _radius(radius)
        )


@dataclass(frozen=True)
class RobustAccuracy:
    """Clean and certified robust accuracy of a model on labelled data (:func:`certified_accuracy`).

    ``certified[k]`` is the fraction of the ``num_samples`` samples correctly classified with a
    certified radius above ``radii[k]`` (in ``norm``); ``median_radius`` is the (lower) median over
    all samples of the certified radius, counted as 0 for a wrong prediction: the radius that half
    the samples reach correctly classified. ``space`` names what the radii are measured in:
    ``"input"`` (the model's input) unless the caller says otherwise (``"features"`` for a model
    behind a feature front-end).
    """

    accuracy: float
    radii: tuple[float, ...]
    certified: tuple[float, ...]
    median_radius: float
    num_samples: int
    norm: str = "l2"
    space: str = "input"

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (radii as strings map to certified accuracies)."""
        return {
            "norm": self.norm,
            "space": self.space,
            "accuracy": self.accuracy,
            "certified_accuracy": {
                f"{r:g}": a for r, a in zip(self.radii, self.certified, strict=True)
            },
            "median_certified_radius": self.median_radius,
            "num_samples": self.num_samples,
        }


def _radius(value: object) -> float:
    if not _validate.is_real(value) or not value >= 0:
        raise ValueError(f"radius must be a number >= 0; got {value!r}")
    return float(value)


def _norm_radii(cert: Certificate, norm: str) -> torch.Tensor:
    _validate.choice("norm", norm, NORMS)
    return cert.radii if norm == "l2" else cert.linf_radii()


def _input_norm(model: torch.nn.Module) -> cnn.InputNorm:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a clipless model (torch.nn.Module); got {type(model)}")
    first = _leading_module(model)
    if (
        isinstance(model, torch.nn.Sequential)
        and len(model) == 2
        and isinstance(_leading_module(model[1]), cnn.InputNorm)
    ):
        raise ValueError(
            f"model starts with a {type(model[0]).__name__} front-end, which is not certified, "
            "before its InputNorm; certify model[1] on model[0](x) (radii in feature space, "
            "docs/robustness.md)"
        )
    if not isinstance(first, cnn.InputNorm):
        raise ValueError(
            "model must start with a clipless.nn.InputNorm (the models of clipless.models do); "
            f"its first layer is {type(first).__name__}"
        )
    if first.inputs_premapped:
        raise ValueError(
            "model's InputNorm has inputs_premapped=True (it only projects data mapped by "
            "premap_): certify a model that maps raw inputs (a reloaded model, or a copy with "
            "inputs_premapped = False)"
        )
    return first


def _pairwise(model: torch.nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor | None:
    """:attr:`LipschitzSummary.pairwise` of a flat ``Sequential(InputNorm, ..., Linear[,
    LossGradientClip ...])`` (``None`` for another layout)."""
    if not isinstance(model, cnn.Sequential) or not isinstance(model[0], cnn.InputNorm):
        return None
    children = list(model)
    end = len(children)
    while end > 1 and isinstance(children[end - 1], cnn.LossGradientClip):  # identity forward
        end -= 1
    last = children[end - 1]
    if end < 2 or not isinstance(last, cnn.Linear):
        return None
    body = cnn.Sequential(*children[: end - 1])  # shares the modules: no copy
    k_pre = report(body, cnn.CrossEntropyLoss(), input_shape).model_lipschitz
    w = last.weight.detach().to(torch.float64).cpu()
    if len(w) == 1:
        rows = torch.linalg.vector_norm(w, dim=1, keepdim=True)
    else:  # row by row: a [C, C, d] difference tensor would be large
        rows = torch.stack([torch.linalg.vector_norm(w - w[c], dim=1) for c in range(len(w))])
    return rows * k_pre * _UP


def lipschitz_summary(model: torch.nn.Module, input_shape: Sequence[int]) -> LipschitzSummary:
    """The certified constants :func:`certify` uses (class :class:`LipschitzSummary`).

    The constants come from :func:`clipless.bounds.report` (which also checks that the model's
    forward is the composition it certifies) and :func:`clipless.norms.dense_norm`.

    Args:
        model: a clipless model starting with an :class:`~clipless.nn.InputNorm` that maps raw
            inputs.
        input_shape: one sample's shape (no batch dimension).

    Raises:
        ValueError: a model without a leading ``InputNorm`` (or with a front-end before it), or
            one whose forward is not the composition the bounds certify.
    """
    first = _input_norm(model)
    shape = tuple(int(d) for d in input_shape)
    body = report(model, cnn.CrossEntropyLoss(), shape).model_lipschitz
    pairwise = _pairwise(model, shape)
    normalised = first.center is not None or first.whiten is not None
    input_map = ("normalised-" if normalised else "") + first.mode
    whiten = 1.0 if first.whiten is None else dense_norm(first.whiten.detach().double().cpu())
    lip_in = float(first.lipschitz())
    return LipschitzSummary(
        body=float(body),
        pairwise=pairwise,
        input_map=input_map,
        input_lipschitz=lip_in,
        total=math.inf if math.isinf(lip_in) else mul(lip_in, body),
        radius=float(first.max_norm),
        whiten_norm=float(whiten),
    )


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        z = model(x)
    if not isinstance(z, torch.Tensor) or z.ndim < 1 or z.shape[0] != x.shape[0]:
        raise ValueError("the model must return logits of shape [batch, num_classes]")
    return z.reshape(z.shape[0], -1)


def _allowed_displacement(
    z: torch.Tensor, lip: LipschitzSummary
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions and a lower bound ``t`` on how far ``P(x)`` may move without changing them."""
    scale = 1.0 + z.abs().amax(dim=1)
    if z.shape[1] == 1:  # one logit: class 1 iff z > 0, margin |z|, no sqrt(2)
        pred = (z[:, 0] > 0).long()
        margin = (z[:, 0].abs() - MARGIN_SLACK * scale).clamp(min=0.0)
        k = lip.body if lip.pairwise is None else min(lip.body, float(lip.pairwise[0, 0]))
        return pred, margin / (k * _UP) * _DOWN
    top2 = z.topk(2, dim=1)
    pred = top2.indices[:, 0]
    margin = (top2.values[:, 0] - top2.values[:, 1] - MARGIN_SLACK * scale).clamp(min=0.0)
    t = margin / (mul(_SQRT2_UP, lip.body) * _UP)
    if lip.pairwise is not None:
        gaps = z.gather(1, pred[:, None]) - z - MARGIN_SLACK * scale[:, None]  # [n, C]
        pair = lip.pairwise.to(z.device)[pred]  # [n, C]
        # pair 0: z_c - z_j is constant (equal rows), so a positive gap never closes
        ratio = torch.where(pair > 0, gaps.clamp(min=0.0) / pair, torch.full_like(pair, math.inf))
        ratio = torch.where(gaps > 0, ratio, torch.zeros_like(ratio))
        ratio.scatter_(1, pred[:, None], math.inf)  # the predicted class itself
        t = torch.maximum(t, ratio.amin(dim=1))
    return pred, t * _DOWN


def _chord(d: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Upper bound on ``||y / ||y|| - x / ||x|| ||`` over ``||y - x|| <= d``, ``||x|| = n``.

    The widest angle between ``y`` and ``x`` is ``arcsin(d / n)`` while ``d <= n``, whose chord is
    ``sqrt(2 - 2 sqrt(1 - s^2)) = s sqrt(2 / (1 + sqrt(1 - s^2)))`` with ``s = d / n`` (the second
    form has no cancellation for small ``s``); beyond, ``y`` may reach through the origin: 2
    (also for ``n = 0``; the normalisation maps 0 to 0, so 1 would do).
    """
    s = d / n.clamp(min=1e-300)
    inside = s * torch.sqrt(2.0 / (1.0 + torch.sqrt((1.0 - s * s).clamp(min=0.0))))
    out = torch.where((s <= 1.0) & (n > 0), inside * _UP, torch.full_like(s, 2.0))
    return out.clamp(max=2.0)


def _ball_move(d: torch.Tensor, n: torch.Tensor, radius: float) -> torch.Tensor:
    """Upper bound on ``||P(w) - P(v)||`` over ``||w - v|| <= d``, ``||v|| = n``, for the
    projection ``P`` onto the ball of radius ``R``.

    ``P`` is 1-Lipschitz (``d``) with outputs at most ``2R`` apart; and for ``n > R``, writing
    ``P(w) = min(||w||, R) u(w)`` and ``P(v) = R u(v)`` (``u`` the unit vector),
    ``||P(w) - P(v)|| <= (R - min(||w||, R)) + R ||u(w) - u(v)|| <= max(0, d - (n - R)) + R
    chord(d, n)``: outside the ball the projection contracts like the sphere map ``R / n``.
    """
    excess = (d - (n - radius) + 4.0 * NUMERIC_MARGIN * (n + radius)).clamp(min=0.0)
    outside = excess + radius * _chord(d, n)
    bound = torch.where(n > radius, torch.minimum(d, outside), d)
    return bound.clamp(max=2.0 * radius) * _UP


def _flat_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1)


#: bisection steps of :func:`_radii`: the interval shrinks to 2^-80 of its start
_BISECTIONS = 80


def _radii(
    x: torch.Tensor, t: torch.Tensor, first: cnn.InputNorm, lip: LipschitzSummary
) -> torch.Tensor:
    """Certified input radii from the allowed displacements ``t`` at the InputNorm's output.

    ``move(r)`` bounds how far the InputNorm's output moves for an input moved by ``r``; it is
    non-decreasing in ``r``, so the largest ``r`` with ``move(r) < t`` is found by bisection,
    keeping as the answer a point where the bound has been checked (never the midpoint's guess).
    A ``move`` that stays below ``t`` for every ``r`` (its saturated value, at ``r`` beyond
    ``||x||``) gives ``inf``.
    """
    # the implemented projection scales by R' / N(x), N(x) >= ||x|| a certified norm bound and
    # R' <= R: its outputs differ from the exact map's by a relative ~n u, covered here
    t = (t - 4.0 * NUMERIC_MARGIN * lip.radius).clamp(min=0.0)
    x_norm = _flat_norm(x) * _DOWN
    v_norm = x_norm
    if lip.input_map.startswith("normalised"):
        v_norm = (_flat_norm(_normalised(x, first)) * _DOWN - _absolute_error(first, lip)).clamp(
            min=0.0
        )

    def move(r: torch.Tensor) -> torch.Tensor:
        if lip.input_map.startswith("normalised"):  # A (x / ||x|| - mu), then the projection
            d = _chord(r, x_norm) * (lip.whiten_norm * _UP)
        else:
            d = r
        if lip.input_map.endswith("sphere"):
            return (lip.radius * _chord(d, v_norm)).clamp(max=2.0 * lip.radius) * _UP
        return _ball_move(d, v_norm, lip.radius)

    high = 2.0 * (x_norm + lip.radius) + 1.0  # beyond ||x||: every chord is 2, move saturated
    unbounded = move(high) < t
    low = torch.zeros_like(t)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (low + high)
        ok = move(mid) < t
        low = torch.where(ok, mid, low)
        high = torch.where(ok, high, mid)
    return torch.where(unbounded, torch.full_like(low, math.inf), low)


def _normalised(x: torch.Tensor, first: cnn.InputNorm) -> torch.Tensor:
    """``A (x / ||x|| - mu)`` in float64 (a zero sample gives ``-A mu``, as in InputNorm)."""
    norms = _flat_norm(x)
    scale = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
    v = x * scale.reshape(-1, *([1] * (x.ndim - 1)))
    if first.center is not None:
        v = v - first.center.to(v)
    if first.whiten is not None:
        v = mix_channels(v, first.whiten.to(v))
    return v


def _absolute_error(first: cnn.InputNorm, lip: LipschitzSummary) -> float:
    """A slack for the cancellation in ``x / ||x|| - mu`` (absolute, float64)."""
    mu = 0.0 if first.center is None else float(torch.linalg.vector_norm(first.center.double()))
    return 4.0 * NUMERIC_MARGIN * lip.whiten_norm * (1.0 + mu)


def _float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).double().eval()


def certify(
    model: torch.nn.Module,
    x: torch.Tensor,
    *,
    batch_size: int = 1024,
    lipschitz: LipschitzSummary | None = None,
) -> Certificate:
    """Certified L2 radius of the prediction of ``model`` on every sample of ``x``.

    The model is copied to float64 (the original is untouched) and evaluated on the device of its
    parameters.

    Args:
        model: a clipless model (it starts with an ``InputNorm`` mapping raw inputs).
        x: a non-empty, finite floating tensor ``[n, ...]`` of inputs as the model takes them.
        batch_size: how many samples are evaluated at a time.
        lipschitz: a :func:`lipschitz_summary` of the same model, computed once for several
            calls (``None``: computed here).

    Returns:
        A :class:`Certificate`: every sample's prediction and certified L2 radius.

    Raises:
        ValueError: a model :func:`lipschitz_summary` refuses, or ``x`` empty, non-finite or
            not floating.
    """
    _input_norm(model)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2 or len(x) == 0:
        raise ValueError("x must be a non-empty floating tensor of samples [n, ...]")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x must be finite (the model maps a non-finite sample to zero)")
    batch_size = _validate.positive_int("batch_size", batch_size, wrong_type=ValueError)
    if lipschitz is None:
        lipschitz = lipschitz_summary(model, tuple(x.shape[1:]))
    wide = _float64_copy(model)
    first_wide = _input_norm(wide)
    device = next((p.device for p in wide.parameters()), torch.device("cpu"))
    preds, radii = [], []
    for i in range(0, len(x), batch_size):
        chunk = x[i : i + batch_size].to(device=device, dtype=torch.float64)
        pred, t = _allowed_displacement(_logits(wide, chunk), lipschitz)
        preds.append(pred.cpu())
        radii.append(_radii(chunk, t, first_wide, lipschitz).cpu())
    return Certificate(
        predictions=torch.cat(preds),
        radii=torch.cat(radii),
        input_dim=math.prod(int(d) for d in x.shape[1:]),
        lipschitz=lipschitz,
    )


def certified_accuracy(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    radii: Sequence[float],
    *,
    norm: str = "l2",
    space: str = "input",
    batch_size: int = 1024,
) -> RobustAccuracy:
    """Clean accuracy and certified robust accuracy at each of ``radii`` (:class:`RobustAccuracy`).

    Args:
        model, x, batch_size: as in :func:`certify`.
        y: integer labels, one per sample of ``x``.
        radii: the radii, each ``>= 0``, in ``norm``.
        norm: ``"l2"`` or ``"linf"`` (the L2 radius divided by ``sqrt(n)``, ``n`` the input
            dimension).
        space: a label recorded in the result, what ``x`` is: ``"input"``, or ``"features"``
            when ``x`` are a front-end's outputs.

    Raises:
        ValueError: an unknown norm, negative radii, labels that do not match ``x``, or what
            :func:`certify` refuses.
    """
    _validate.choice("norm", norm, NORMS)
    if isinstance(radii, (str, bytes)) or not isinstance(radii, Sequence):
        raise ValueError(f"radii must be a sequence of numbers >= 0; got {radii!r}")
    checked = tuple(_radius(r) for r in radii)
    if not isinstance(y, torch.Tensor) or y.reshape(-1).shape[0] != len(x):
        raise ValueError(f"y must be a tensor of {len(x)} labels (one per sample of x)")
    cert = certify(model, x, batch_size=batch_size)
    labels = y.reshape(-1).to(torch.int64)
    correct = cert.predictions == labels
    r = torch.where(correct, _norm_radii(cert, norm), torch.zeros_like(cert.radii))
    n = len(labels)
    return RobustAccuracy(
        accuracy=float(correct.double().mean()),
        radii=checked,
        certified=tuple(float(cert.robust(labels, v, norm).double().mean()) for v in checked),
        median_radius=float(r.median()),  # the lower median for an even n
        num_samples=n,
        norm=norm,
        space=space,
    )


def _margin(z: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    """``z_cls - max_{j != cls} z_j`` (one logit: ``z`` signed towards ``cls``)."""
    if z.shape[1] == 1:
        return torch.where(cls == 1, z[:, 0], -z[:, 0])
    own = z.gather(1, cls[:, None])[:, 0]
    others = z.scatter(1, cls[:, None], -math.inf)
    return own - others.amax(dim=1)


def pgd_l2(
    model: torch.nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    eps: torch.Tensor | float,
    *,
    steps: int = 40,
    restarts: int = 3,
    seed: int = 0,
) -> torch.Tensor:
    """Empirical robustness by a PGD attack in L2 (Madry et al. 2018): per sample, the smallest
    margin ``z_label - max_{j != label} z_j`` found within ``||d||_2 <= eps`` (< 0: broken).

    An attack gives an *upper* bound on robust accuracy (``(pgd_l2(...) > 0).mean()``), where
    :func:`certify` gives a lower bound; it works on any model returning logits (an Opacus twin
    too). ``eps`` is a number or a tensor of one radius per sample (``inf``: 10 times ``||x||``
    plus 10). Each of ``restarts`` runs takes ``steps`` steps of ``2.5 eps / steps`` along the
    normalised gradient of the margin, each followed by the projection onto the ball; the first
    run starts at ``x``, the others at a random point of the ball. The model is used as it is
    (call ``model.eval()`` first if it has a training mode).

    Args:
        model: any model returning logits.
        x: a floating tensor ``[n, ...]`` of inputs.
        labels: the labels the margin is taken towards, one per sample.
        eps: the L2 radius, ``>= 0``: one number or one per sample (``inf``: 10 times ``||x||``
            plus 10).
        steps: gradient steps per run, ``>= 1``.
        restarts: runs, ``>= 1`` (the first from ``x``).
        seed: seeds the random starts.

    Returns:
        The smallest margin found for every sample (``< 0``: the attack succeeded).
    """
    steps = _validate.positive_int("steps", steps, wrong_type=ValueError)
    restarts = _validate.positive_int("restarts", restarts, wrong_type=ValueError)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2:
        raise ValueError("x must be a floating tensor of samples [n, ...]")
    radius = torch.as_tensor(eps, dtype=x.dtype, device=x.device).reshape(-1)
    if radius.numel() not in (1, len(x)) or bool((radius < 0).any()):
        raise ValueError(f"eps must be a radius >= 0 or one per sample ({len(x)}); got {eps!r}")
    gen = torch.Generator().manual_seed(seed)
    shape = (-1, *([1] * (x.ndim - 1)))
    far = 10.0 * _flat_norm(x.detach()) + 10.0
    radius = torch.where(torch.isinf(radius), far, radius.expand(len(x))).reshape(shape)
    cls = labels.reshape(-1).to(device=x.device, dtype=torch.int64)
    best = torch.full((len(x),), math.inf, dtype=x.dtype, device=x.device)
    for restart in range(restarts):
        delta = torch.zeros_like(x)
        if restart:
            delta = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
            scale = torch.rand(len(x), generator=gen, dtype=x.dtype).to(x.device).reshape(shape)
            delta = delta / _flat_norm(delta).reshape(shape) * radius * scale
        for _ in range(steps):
            delta.requires_grad_(True)
            margin = _margin(model(x + delta).reshape(len(x), -1), cls)
            (grad,) = torch.autograd.grad(margin.sum(), delta)
            with torch.no_grad():
                best = torch.minimum(best, margin.detach())
                step = grad / _flat_norm(grad).clamp(min=1e-30).reshape(shape)
                delta = delta - 2.5 * radius / steps * step
                shrink = (radius / _flat_norm(delta).clamp(min=1e-30).reshape(shape)).clamp(max=1.0)
                delta = delta * shrink
        with torch.no_grad():
            best = torch.minimum(best, _margin(model(x + delta).reshape(len(x), -1), cls))
    return best


def empirical_accuracy(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    radii: Sequence[float],
    *,
    steps: int = 40,
    restarts: int = 3,
    seed: int = 0,
) -> tuple[float, ...]:
    """Empirical robust accuracy under :func:`pgd_l2` at each of ``radii`` (L2, inputs' space).

    The fraction of samples correctly classified (margin ``z_y - max_{j != y} z_j > 0``; one
    logit: ``z`` signed towards ``y``) whose margin :func:`pgd_l2` cannot make ``<= 0`` within the
    radius; radius 0 gives the clean accuracy. An *upper* bound on the true robust accuracy (the
    attack may miss an adversarial point), where :func:`certified_accuracy` gives a lower bound;
    it needs no certificate, so it measures any model returning logits (an Opacus-trained twin
    too). The model is used as it is: call ``model.eval()`` first if it has a training mode.

    Args:
        model: any model returning logits.
        x: a non-empty floating tensor ``[n, ...]`` of inputs.
        y: integer labels, one per sample.
        radii: L2 radii in the inputs' space, each ``>= 0``.
        steps, restarts, seed: the attack's settings (:func:`pgd_l2`).

    Returns:
        The empirical robust accuracy at each radius.
    """
    if isinstance(radii, (str, bytes)) or not isinstance(radii, Sequence):
        raise ValueError(f"radii must be a sequence of numbers >= 0; got {radii!r}")
    checked = tuple(_radius(r) for r in radii)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2 or len(x) == 0:
        raise ValueError("x must be a non-empty floating tensor of samples [n, ...]")
    if not isinstance(y, torch.Tensor) or y.reshape(-1).shape[0] != len(x):
        raise ValueError(f"y must be a tensor of {len(x)} labels (one per sample of x)")
    labels = y.reshape(-1).to(device=x.device, dtype=torch.int64)
    with torch.no_grad():
        correct = _margin(model(x).reshape(len(x), -1), labels) > 0
    out = []
    for r in checked:
        if r == 0:
            out.append(float(correct.double().mean()))
            continue
        worst = pgd_l2(model, x, labels, r, steps=steps, restarts=restarts, seed=seed)
        out.append(float((correct & (worst > 0)).double().mean()))
    return tuple(out)
