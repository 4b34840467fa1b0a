"""Losses that are Lipschitz in the logits, with certified constants.

Requirement 1 of the Clipless DP-SGD paper: ``z -> loss(z, y)`` must be ``L``-Lipschitz in the
logits ``z`` for *every* label ``y``; ``L`` starts the backpropagation of bounds (Béthune et al.
2024, Algorithm 1, line 4; thesis Table 5.1, section 2.5). Conventions shared by every loss here:

* each sample has its own loss ``l_i`` (a sum over its outputs where the loss is elementwise);
  ``reduction="none"`` returns ``[l_1, ..., l_b]`` (shape ``[batch]``; note that torch's
  elementwise losses would return ``[batch, K]``), ``"sum"`` their sum and ``"mean"`` their mean;
* an empty batch (logits of shape ``[0, ...]``) is accepted by every loss: ``"none"`` returns an
  empty ``[0]`` tensor, ``"sum"`` returns 0 and ``"mean"`` also returns 0 (rather than torch's
  ``nan`` for the mean of nothing), so that a Poisson-sampled empty batch contributes nothing;
  backward works and gives an empty gradient;
* targets are validated: a loss raises :class:`ValueError` naming ``target`` when it is not
  finite or outside the range its certified constant assumes (class indices in ``[0, K)``,
  probability rows on the simplex, binary probabilities in ``[0, 1]``);
* ``lipschitz(num_logits)`` is a certified upper bound, for any label and any logits, on
  ``||d l_i / d z_i||_2``, the gradient of one sample's loss with respect to its own logit vector
  of length ``num_logits`` (at kinks autograd returns a convex combination of one-sided gradients,
  whose norm is no larger). All constants are rounded up in exact rational arithmetic.

Tightness (the supremum of the gradient norm equals the constant): every constant here is tight;
for ``CrossEntropyLoss`` and ``BCEWithLogitsLoss`` it is a supremum approached as logits diverge,
for the piecewise-linear losses it is attained.
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F

from clipless import _certified, _deferred
from clipless.nn import _checks

__all__ = [
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "HKRLoss",
    "HuberLoss",
    "KRLoss",
    "L1Loss",
    "LipschitzLoss",
    "MulticlassHingeLoss",
]


def _num_logits(num_logits: int) -> int:
    return _checks.positive_int("num_logits", num_logits)


def _batch_of(input: torch.Tensor) -> int:
    if input.ndim < 1:
        raise ValueError("the loss expects logits of shape [batch, ...]")
    return int(input.shape[0])


def _check_same_shape(input: torch.Tensor, target: torch.Tensor) -> None:
    if input.shape != target.shape:
        raise ValueError(
            f"target must have the shape of input {tuple(input.shape)}, got {tuple(target.shape)}"
        )


def _checkable(target: torch.Tensor) -> bool:
    """Whether ``target``'s values can be checked: non-empty and outside ``torch.func`` transforms.

    Under ``vmap`` (used for exact per-sample gradients in tests and audits) a data-dependent
    check cannot run; the values were (or can be) checked outside the transform.
    """
    if not target.numel():
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(target)


def _check_finite(input: torch.Tensor, target: torch.Tensor) -> None:
    if target.dtype.is_floating_point and _checkable(target):
        ok = target.isfinite().all()
        _deferred.check(input, ok, "target must be finite (no NaN or infinity)")


def _sum_per_sample(losses: torch.Tensor) -> torch.Tensor:
    """Sum elementwise losses ``[batch, ...]`` over each sample's outputs (``[batch]``).

    Unlike ``reshape(batch, -1)``, this also works for an empty batch.
    """
    if losses.ndim == 1:
        return losses
    return losses.flatten(1).sum(dim=1)


def _probability_rows(input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Probability targets ``[batch, K]``: finite, ``>= 0``, each row summing to 1.

    The sum is checked in float64 with tolerance ``max(1e-5, eps)`` of the target's dtype (the
    rounding of ``K`` values that sum to 1 exactly moves the sum by at most ``eps / 2``); the rows
    are then divided by their sum so that they lie on the simplex (up to rounding), which the
    bound ``sqrt(2) / T`` assumes (the gradient is ``p sum(y) - y``).
    """
    _check_same_shape(input, target)
    sums = target.double().sum(dim=1)
    if not _checkable(target):
        return (target.double() / sums[:, None]).to(input.dtype)
    accepted = "class probabilities (finite, >= 0, each row summing to 1) or class indices"
    if not bool(target.isfinite().all()):
        raise ValueError(f"target must be {accepted}; it holds NaN or infinity")
    if bool((target < 0).any()):
        raise ValueError(f"target must be {accepted}; it holds negative values")
    tol = max(1e-5, torch.finfo(target.dtype).eps)
    worst = float((sums - 1.0).abs().max())
    if worst > tol:
        raise ValueError(
            f"target must be {accepted}; a row's sum differs from 1 by {worst:.3g} "
            f"(tolerance {tol:.3g})"
        )
    return (target.double() / sums[:, None]).to(input.dtype)


def _is_binary(input: torch.Tensor) -> bool:
    """Single-logit (binary) problems: logits of shape ``[batch]`` or ``[batch, 1]``."""
    return input.ndim == 1 or (input.ndim == 2 and input.shape[1] == 1)


def _signed_labels(input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary labels in ``{0, 1}`` or ``{-1, 1}`` as ``-1.0 / +1.0`` of shape ``[batch]``."""
    target = target.reshape(-1)
    if target.shape[0] != input.shape[0]:
        raise ValueError(
            f"target must hold one binary label per sample ({input.shape[0]}), got "
            f"{tuple(target.shape)}"
        )
    if _checkable(target):
        valid = (target == 1) | (target == 0) | (target == -1)
        mixed = (target == 0).any() & (target == -1).any()
        message = "binary target must hold labels in {0, 1} or in {-1, 1}"
        _deferred.check(input, valid.all() & ~mixed, message)
    one = torch.ones((), dtype=input.dtype, device=input.device)
    return torch.where(target > 0, one, -one)


def _class_indices(input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Class-index targets of shape ``[batch]`` with values in ``[0, K)``."""
    if input.ndim != 2:
        raise ValueError(f"multiclass logits must have shape [batch, K], got {tuple(input.shape)}")
    if target.shape != (input.shape[0],) or target.dtype.is_floating_point:
        raise ValueError(
            f"target must be integer class indices of shape [{input.shape[0]}], got "
            f"{tuple(target.shape)} ({target.dtype})"
        )
    num_classes = input.shape[1]
    if not _checkable(target):
        return target.long()
    # clamped, so that a bad index cannot fault a device kernel before the check is read
    clamped = target.long().clamp(0, num_classes - 1)
    in_range = torch.eq(clamped, target).all()
    _deferred.check(input, in_range, f"target class indices must lie in [0, {num_classes})")
    return clamped


def _hinge_per_sample(input: torch.Tensor, target: torch.Tensor, margin: float) -> torch.Tensor:
    if _is_binary(input):
        y = _signed_labels(input, target)
        return torch.relu(margin - y * input.reshape(-1))
    idx = _class_indices(input, target)
    true_logit = input.gather(1, idx[:, None]).squeeze(1)
    is_true = torch.arange(input.shape[1], device=input.device) == idx[:, None]  # vmap-safe one_hot
    others = input.masked_fill(is_true, -torch.inf)
    return torch.relu(margin - true_logit + others.amax(dim=1))


def _kr_per_sample(input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if _is_binary(input):
        y = _signed_labels(input, target)
        return -y * input.reshape(-1)
    idx = _class_indices(input, target)
    true_logit = input.gather(1, idx[:, None]).squeeze(1)
    num_classes = input.shape[1]
    return -true_logit + (input.sum(dim=1) - true_logit) / (num_classes - 1)


class LipschitzLoss(torch.nn.Module):
    """Base class: per-sample loss, ``reduction`` and the certified ``lipschitz(num_logits)``."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _checks.reduction(reduction)

    def per_sample(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-sample losses, shape ``[batch]``."""
        raise NotImplementedError

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        losses = self.per_sample(input, target)
        if self.reduction == "sum":
            return losses.sum()
        if self.reduction == "mean":
            # the mean of an empty batch is 0 (module docstring), not torch's nan
            return losses.mean() if losses.numel() else losses.sum()
        return losses

    def lipschitz(self, num_logits: int = 1) -> float:
        """Certified bound on ``||d l_i / d z_i||`` for any label and logits (module docstring)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


class CrossEntropyLoss(LipschitzLoss):
    """Softmax cross-entropy of ``logits / temperature``: ``-log softmax(z / T)_y``.

    ``target``: class indices (integer, shape ``[batch]``, values in ``[0, K)``) or class
    probabilities (floating point, shape ``[batch, K]``, finite, ``>= 0``, each row summing to 1
    within ``max(1e-5, eps)`` of the target's dtype; accepted rows are renormalised to sum to 1).
    Anything else raises :class:`ValueError`.

    **Lipschitz constant ``sqrt(2) / T``** (thesis Table 5.1, "Softmax Cross-entropy";
    Béthune et al. 2024, Requirement 1). The gradient is ``(p - y) / T`` with ``p = softmax(z/T)``
    and ``y`` a point of the probability simplex; two points of the simplex are at most ``sqrt(2)``
    apart (for a one-hot ``y``: ``||p - e_y||^2 = (1 - p_y)^2 + sum_{j != y} p_j^2
    <= 2 (1 - p_y)^2 <= 2``). Tight as a supremum (``p`` concentrating on a wrong class). The thesis
    writes the temperature on the loss (``CE / T``) rather than on the logits; both have gradient
    norm at most ``sqrt(2) / T``. For ``num_logits = 1`` the gradient is 0 and the bound is loose.
    """

    def __init__(self, temperature: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.temperature = _checks.positive_float("temperature", temperature)

    def per_sample(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.ndim != 2:
            raise ValueError(f"logits must have shape [batch, K], got {tuple(input.shape)}")
        if target.dtype.is_floating_point:
            target = _probability_rows(input, target)
        else:
            target = _class_indices(input, target)
        return F.cross_entropy(input / self.temperature, target, reduction="none")

    def lipschitz(self, num_logits: int = 1) -> float:
        _num_logits(num_logits)
        return _certified.upper(Fraction(_certified.sqrt_upper(2)) / Fraction(self.temperature))

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, reduction={self.reduction!r}"


class BCEWithLogitsLoss(LipschitzLoss):
    """Binary cross-entropy with logits, summed over each sample's outputs.

    ``l_i = sum_j [-y_j log sigma(z_j) - (1 - y_j) log(1 - sigma(z_j))]`` with ``y_j in [0, 1]``;
    ``target`` has the shape of ``input`` (``[batch]`` or ``[batch, K]``).

    **Lipschitz constant ``sqrt(K)``** (``K = num_logits``; 1 for one logit, docs/design.md
    "Layers and losses"). The gradient is ``sigma(z) - y`` with each entry in ``(-1, 1)`` since
    ``y_j in [0, 1]``, so its norm is below ``sqrt(K)``; tight as a supremum (``y_j = 0``,
    ``z_j -> +inf``). Summing (rather than averaging, as torch's ``reduction="mean"`` does over
    outputs) keeps one sample's loss a function of its own logit vector.
    """

    def per_sample(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _batch_of(input)
        _check_same_shape(input, target)
        if _checkable(target) and not bool(((target >= 0) & (target <= 1)).all()):
            raise ValueError(
                "target must hold probabilities in [0, 1] (finite; the bound sqrt(K) needs it)"
            )
        losses = F.binary_cross_entropy_with_logits(input, target.to(input.dtype), reduction="none")
        return _sum_per_sample(losses)

    def lipschitz(self, num_logits: int = 1) -> float:
        return _certified.sqrt_upper(_num_logits(num_logits))


class MulticlassHingeLoss(LipschitzLoss):
    """Multiclass (Crammer-Singer) hinge ``max(0, m - z_y + max_{j != y} z_j)``; binary hinge.

    Logits ``[batch, K]`` with ``K >= 2`` and class-index targets; for one logit (``[batch]`` or
    ``[batch, 1]``) the binary hinge ``max(0, m - y z)`` with labels in ``{0, 1}`` or ``{-1, 1}``.

    **Lipschitz constant**: ``K >= 2``: ``sqrt(2)`` -- where the hinge is active its gradient is
    ``e_j - e_y`` (``j`` the best wrong class), of norm ``sqrt(2)``, else 0 (attained: tight).
    ``K = 1``: 1 (gradient ``-y``; attained). The thesis (section 2.5, Table 5.1) uses the averaged
    variant ``sum_{j != y} max(0, m - z_y + z_j) / K`` with constant 1 (its exact value is
    ``sqrt((K-1)/K)``); we use the Crammer-Singer form, as deel-lip's multiclass hinge does.
    """

    def __init__(self, margin: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.margin = _checks.nonnegative_float("margin", margin)

    def per_sample(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _hinge_per_sample(input, target, self.margin)

    def lipschitz(self, num_logits: int = 1) -> float:
        return 1.0 if _num_logits(num_logits) == 1 else _certified.sqrt_upper(2)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, reduction={self.reduction!r}"


class KRLoss(LipschitzLoss):
    """Per-sample Kantorovich-Rubinstein loss (Serrurier et al. 2021, as in deel-lip).

    Binary (one logit, labels in ``{0, 1}`` or ``{-1, 1}``): ``-y z``. Multiclass (``[batch, K]``,
    class indices): ``-z_y + mean_{j != y} z_j`` (one-vs-all KR estimate for one sample).

    **Lipschitz constant** (linear in ``z``, so its gradient is constant and the constant exact):
    binary 1; multiclass ``||-e_y + (1/(K-1)) sum_{j != y} e_j|| = sqrt(1 + 1/(K-1))
    = sqrt(K / (K - 1))``.
    """

    def per_sample(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _kr_per_sample(input, target)

    def lipschitz(self, num_logits: int = 1) -> float:
        k = _num_logits(num_logits)
        return 1.0 if k == 1 else _certified.sqrt_upper(Fraction(k, k - 1))


class HKRLoss(LipschitzLoss):
    """Hinge-regularised KR loss: ``KR + alpha * hinge(margin)`` (Serrurier et al. 2021).

    Same label conventions as :class:`KRLoss` and :class:`MulticlassHingeLoss`.

    **Lipschitz constant.** The triangle inequality gives ``L_KR + alpha L_hinge``; we certify the
    exact supremum, which is never larger. Binary: the gradient is ``-y (1 + alpha [active])``:
    ``1 + alpha`` (= the sum). Multiclass: where the hinge is inactive the gradient is the KR one
    (norm ``sqrt(K/(K-1))``); where active it is
    ``-(1 + alpha) e_y + (alpha + 1/(K-1)) e_j + (1/(K-1)) sum_{i != y, j} e_i`` with squared norm
    ``(1 + alpha)^2 + (alpha + 1/(K-1))^2 + (K-2)/(K-1)^2 = (K/(K-1)) (1 + 2 alpha) + 2 alpha^2``,
    which dominates. So ``L = sqrt((K/(K-1))(1 + 2 alpha) + 2 alpha^2)``: equal to the sum
    ``sqrt(2)(1 + alpha)`` for ``K = 2`` and below it for ``K > 2`` (e.g. ``K = 10``,
    ``alpha = 1``: 2.31 vs 2.47). Attained, hence tight.
    """

    def __init__(self, alpha: float = 1.0, margin: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.alpha = _checks.nonnegative_float("alpha", alpha)
        self.margin = _checks.nonnegative_float("margin", margin)

    def per_sample(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        kr = _kr_per_sample(input, target)
        return kr + self.alpha * _hinge_per_sample(input, target, self.margin)

    def lipschitz(self, num_logits: int = 1) -> float:
        k = _num_logits(num_logits)
        a = Fraction(self.alpha)
        if k == 1:
            return _certified.upper(1 + a)
        return _certified.sqrt_upper(Fraction(k, k - 1) * (1 + 2 * a) + 2 * a * a)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, margin={self.margin}, reduction={self.reduction!r}"


class L1Loss(LipschitzLoss):
    """Absolute error summed over each sample's outputs: ``sum_j |z_j - y_j|`` (MAE).

    **Lipschitz constant ``sqrt(K)``**: the gradient is ``sign(z - y)``, entries in ``[-1, 1]``
    (1 for one output; docs/design.md "Layers and losses"). Attained.
    """

    def per_sample(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _batch_of(input)
        _check_same_shape(input, target)
        _check_finite(input, target)
        return _sum_per_sample((input - target).abs())

    def lipschitz(self, num_logits: int = 1) -> float:
        return _certified.sqrt_upper(_num_logits(num_logits))


class HuberLoss(LipschitzLoss):
    """Huber loss (as :func:`torch.nn.functional.huber_loss`) summed over each sample's outputs.

    ``h(r) = r^2 / 2`` for ``|r| <= delta``, ``delta (|r| - delta / 2)`` otherwise.

    **Lipschitz constant ``delta sqrt(K)``**: ``h'(r) = clamp(r, -delta, delta)`` (``delta`` for
    one output; docs/design.md "Layers and losses"). Attained when every ``|r_j| >= delta``.
    """

    def __init__(self, delta: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.delta = _checks.positive_float("delta", delta)

    def per_sample(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _batch_of(input)
        _check_same_shape(input, target)
        _check_finite(input, target)
        losses = F.huber_loss(input, target.to(input.dtype), reduction="none", delta=self.delta)
        return _sum_per_sample(losses)

    def lipschitz(self, num_logits: int = 1) -> float:
        k = _num_logits(num_logits)
        return _certified.upper(Fraction(self.delta) * Fraction(_certified.sqrt_upper(k)))

    def extra_repr(self) -> str:
        return f"delta={self.delta}, reduction={self.reduction!r}"
