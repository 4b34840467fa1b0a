"""The protocol every clipless layer implements.

A clipless layer is a :class:`torch.nn.Module` that can certify, from its current (public) weights
alone, three things used by "backpropagation for bounds" (Béthune et al. 2024, Algorithm 1; thesis
Table 5.1):

* :meth:`LipschitzModule.lipschitz` -- an upper bound on its input-Lipschitz constant (L2 -> L2),
* :meth:`LipschitzModule.output_bound` -- an upper bound on the L2 norm of one sample's output given
  an upper bound on the L2 norm of that sample's input,
* for parametric layers, :meth:`ParametricLipschitzModule.gradient_bounds` -- an upper bound on the
  L2 norm of one sample's gradient with respect to each of its own parameters, given the input bound
  and a bound on the norm of the cotangent (the gradient of the loss with respect to its output).

All three are Python floats computed in float64. "Certified" means an upper bound that holds for
every input; estimates (power iteration) never qualify.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Protocol

import torch

from clipless import _certified
from clipless._bits import same_bits, same_bits_tensor
from clipless.norms import matrix_products_only

__all__ = [
    "LipschitzModule",
    "ParametricLipschitzModule",
]


class LipschitzModule(torch.nn.Module):
    """Base class of every clipless layer and container (see module docstring)."""

    def lipschitz(self) -> float:
        """Certified upper bound on the L2 input-Lipschitz constant at the current weights."""
        raise NotImplementedError

    def output_bound(self, input_bound: float) -> float:
        """Certified upper bound on ``||f(x)||_2`` for one sample with ``||x||_2 <= input_bound``.

        The default, ``lipschitz() * input_bound``, is valid for maps with ``f(0) = 0``; layers with
        an offset (a bias, a sigmoid) override it. Rounded up (:func:`clipless._certified.mul`).
        """
        return _certified.mul(self.lipschitz(), float(input_bound))

    def vanilla_export(self) -> torch.nn.Module:
        """A plain :mod:`torch.nn` module computing the same function, for inference.

        Used by :func:`clipless.nn.vanilla_export`; custom layers implement it to be exportable.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement vanilla_export()")

    def extra_repr(self) -> str:  # pragma: no cover - cosmetic
        return super().extra_repr()


class ParametricLipschitzModule(LipschitzModule):
    """A layer with trainable parameters whose per-sample gradient norm is bounded analytically.

    Subclasses (``Linear``, ``Conv2d``) also honour :attr:`scaling_threshold`: when it is not
    ``None``, the layer's forward routes through :mod:`clipless.nn._scaled`, which divides each
    sample's contribution to the parameter gradients by
    ``max(sample_norm_factor(x_i), scaling_threshold)``
    (docs/design.md, "Gradient scaling"). The input gradient is never scaled.
    """

    scaling_threshold: float | str | None = None
    #: Rows per sample in the batch (augmentation multiplicity): every row's contribution to the
    #: parameter gradients is further divided by it. Set with the threshold by the optimizer.
    scaling_multiplicity: int = 1

    def gradient_bounds(self, input_bound: float, cotangent_bound: float) -> dict[str, float]:
        """Per-parameter certified bounds on one sample's (unscaled) gradient norm.

        Keys are the names of this module's *direct* parameters (``"weight"``, ``"bias"``).
        ``input_bound`` bounds ``||x||`` and ``cotangent_bound`` bounds ``||dloss/dy||`` for the
        sample.
        """
        raise NotImplementedError

    def sample_norm_factor(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sample ``n_i`` (shape ``[batch]``): ``||grad_params(sample i)|| <= ||dy_i|| n_i``.

        Dense without bias: ``||x_i||``; dense with bias: ``sqrt(||x_i||^2 + 1)``; convolution:
        ``sqrt(k_eff ||x_i||^2 (+ P with a bias))``. Used by the gradient scaling modes.
        """
        raise NotImplementedError

    def sample_norm_factor_wide(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`sample_norm_factor` as a float64 certified upper bound (the scaling's divisor
        on an accelerator: no round trip through ``x.dtype``). Default: the rounded factor."""
        return self.sample_norm_factor(x).to(torch.float64)

    def norm_factor_bound(self, input_bound: float) -> float:
        """Certified upper bound on :meth:`sample_norm_factor` for inputs of norm <= input_bound."""
        raise NotImplementedError

    def _bound_key(self) -> Hashable:
        """The public geometry the default :meth:`lipschitz` certifies for (None for dense)."""
        return None

    def seed_bound(self, value: float, *, seal: BoundSeal | None = None) -> None:
        """Record ``value`` as a certified bound of :meth:`lipschitz` at the *current* weight.

        For callers that certified the current weight themselves (the projections of
        :mod:`clipless.constraints` know the certified bound of the weight they just wrote), so
        that the next :meth:`lipschitz` call need not recompute it. Only an upper bound obtained
        by a certified argument may be recorded here: the value is trusted as long as the weight
        stays bitwise equal.

        ``seal``: ``value`` holds only if a verdict still on the device says so (a projection on
        an accelerator rescaled the weight to at most ``value`` and has not read its outcome
        yet). The private step's plan takes it with the step's one host read
        (:func:`deferred_weight_checks`); every other use settles the seal first (one read),
        which replaces ``value`` by the exact certified bound or raises the projection's error.
        """
        param = getattr(self, "weight")  # noqa: B009
        self.__dict__.pop("_bound_cache", None)  # freed before the copy: no second copy at once
        copy = param.detach().clone()
        self.__dict__["_bound_cache"] = (copy, self._bound_key(), float(value), seal)
        self.__dict__["_bound_stamp"] = _stamp(param)

    def settle_seal(self, seal: BoundSeal, value: float | None) -> None:
        """``seal``'s verdict came back: ``value`` (a certified bound of the weight the seal was
        seeded for, at most the provisional one) replaces the provisional bound; ``None`` (the
        projection failed) drops it. A cache no longer holding ``seal`` is left as it is."""
        cached = self.__dict__.get("_bound_cache")
        if cached is None or cached[3] is not seal:
            return
        if value is None:
            self.forget_bound()
            return
        self.__dict__["_bound_cache"] = (cached[0], cached[1], float(value), None)

    def forget_bound(self) -> None:
        """Drop the memoised bound: the next :meth:`lipschitz` certifies the weight again."""
        self.__dict__.pop("_bound_cache", None)
        self.__dict__.pop("_bound_stamp", None)

    @contextlib.contextmanager
    def unmemoised(self) -> Iterator[None]:
        """Inside, :meth:`lipschitz` certifies a weight not in the cache without keeping a copy
        of it (for a caller that will :meth:`seed_bound` the weight it keeps: the projections
        of :mod:`clipless.constraints`, which may rescale the weight at once)."""
        self.__dict__["_unmemoised"] = True
        try:
            yield
        finally:
            self.__dict__.pop("_unmemoised", None)

    def bound_state(self) -> dict[str, object] | None:
        """The memoised certified bound of the current weight, for checkpoints (or None).

        ``{"value": bound, "sha256": digest of the weight's bytes, "key": the geometry}``:
        :meth:`load_bound_state` restores it only onto a bitwise-equal weight of the same
        geometry (a convolution's bound depends on its input size, stride and padding), so a
        resumed run plans exactly the noise an uninterrupted run would (the bound a projection
        seeded can differ in its last bits from a fresh certification of the same weight; both
        are certified).
        """
        cached = self.__dict__.get("_bound_cache")
        weight = getattr(self, "weight")  # noqa: B009
        if cached is None or not isinstance(weight, torch.Tensor):
            return None
        if cached[3] is not None:
            cached[3].settle()
            cached = self.__dict__.get("_bound_cache")
            if cached is None:  # pragma: no cover - a failed seal raises in settle()
                return None
        w_ref, key, value, _ = cached
        w = weight.detach()
        if key != self._bound_key() or not same_bits(w_ref, w):
            return None
        return {"value": float(value), "sha256": _digest(w), "key": repr(key)}

    def load_bound_state(self, state: Mapping[str, object] | None) -> bool:
        """Restore :meth:`bound_state` if the current weight is the one it was certified for, in
        the same geometry (a state without its geometry, or of another one, is not restored:
        the bound is then certified again)."""
        if not state:
            return False
        if state.get("key") != repr(self._bound_key()):
            return False
        weight = getattr(self, "weight")  # noqa: B009
        if not isinstance(weight, torch.Tensor) or state.get("sha256") != _digest(weight.detach()):
            return False
        value = state.get("value")
        if not isinstance(value, float):
            return False
        self.seed_bound(value)
        return True

    def _cached_bound(self, key: Hashable, compute: Callable[[], float]) -> float:
        """``compute()``, memoised on an exact copy of the weight and ``key``.

        A certified bound is a function of the weight's values (and of public geometry in
        ``key``), so it is reused only when the current weight is *bitwise equal* to the copy the
        bound was computed for (:func:`clipless._bits.same_bits`, O(n), far cheaper than an SVD
        or FFT). Version counters are not trusted: writes through ``.data`` do not bump them.
        """
        param = getattr(self, "weight")  # noqa: B009 - typed as Tensor | Module by nn.Module
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.weight must be a tensor")
        weight = param.detach()
        cached = self.__dict__.get("_bound_cache")
        if cached is not None:
            w_ref, key_ref, value, seal = cached
            checks = _DEFERRED[-1] if _DEFERRED else None
            if key_ref == key and checks is not None and self._stamped(param):
                host = not matrix_products_only(weight)
                checks.flags.append((self, same_bits_tensor(w_ref, weight, numpy_on_cpu=host)))
                if seal is not None and seal not in checks.seals:
                    checks.seals.append(seal)
                return float(value)
            if seal is not None:
                seal.settle()  # one read: the exact bound, or the projection's error
                return self._cached_bound(key, compute)
            if key_ref == key and same_bits(w_ref, weight):
                return float(value)
        value = float(compute())
        if self.__dict__.get("_unmemoised"):
            return value  # the caller records the bound of the weight it keeps (seed_bound)
        self.__dict__.pop("_bound_cache", None)  # freed before the copy: no second copy at once
        self.__dict__["_bound_cache"] = (weight.clone(), key, value, None)
        self.__dict__["_bound_stamp"] = _stamp(param)
        return value

    def _stamped(self, param: torch.Tensor) -> bool:
        """Has autograd seen no write into ``param`` since its bound was memoised?"""
        stamp = self.__dict__.get("_bound_stamp")
        return isinstance(stamp, _Stamp) and stamp.matches(param)


class _Stamp:
    """What identifies a weight's values as far as autograd knows: its storage (held, so that
    its address cannot be reused by a new storage after ``.data`` or ``.to()`` replaced it),
    address, offset and version counter (writes through ``.data`` or a NumPy view do not bump
    the counter: the deferred bitwise check catches those). A copy (``deepcopy``, pickle) of the
    layer gets an empty stamp, which matches nothing: its first plan compares the bits."""

    __slots__ = ("key", "storage")

    def __init__(self, param: torch.Tensor | None) -> None:
        self.storage = None if param is None else param.untyped_storage()
        self.key = None if param is None else _stamp_key(param)

    def matches(self, param: torch.Tensor) -> bool:
        return self.storage is not None and self.key == _stamp_key(param)

    def __deepcopy__(self, memo: dict[int, object]) -> _Stamp:
        return _Stamp(None)

    def __reduce__(self) -> tuple[object, ...]:
        return (_Stamp, (None,))


def _stamp(param: torch.Tensor) -> _Stamp:
    return _Stamp(param)


def _stamp_key(param: torch.Tensor) -> tuple[int, int, int]:
    return (param.data_ptr(), int(param.storage_offset()), param._version)


class BoundSeal(Protocol):
    """The verdict of a projection still on the device (:meth:`ParametricLipschitzModule.
    seed_bound`): ``values`` is what its one read brings back; ``settle(rows)`` records it
    (reading ``values`` itself when ``rows`` is None), raising the projection's error if the
    weight it rescaled is not certified within the provisional bound. Idempotent."""

    done: bool
    values: torch.Tensor

    def settle(self, rows: list[list[float]] | None = None) -> None: ...


@dataclasses.dataclass
class DeferredChecks:
    """What :func:`deferred_weight_checks` collects: ``(layer, bitwise-equal flag)`` pairs and
    the seals of the provisional bounds the plan took."""

    flags: list[tuple[ParametricLipschitzModule, torch.Tensor]]
    seals: list[BoundSeal]


_DEFERRED: list[DeferredChecks] = []


@contextlib.contextmanager
def deferred_weight_checks() -> Iterator[DeferredChecks]:
    """Inside, a memoised bound whose weight autograd has seen unchanged is returned at once, and
    the bitwise comparison that proves it still valid is appended to ``flags`` as a 0-dim
    boolean tensor computed on the weight's device, without a host read; a provisional bound
    (sealed) is returned too, and its seal appended to ``seals``.

    For :class:`clipless.optim.DPOptimizer`, which plans a step from these bounds and reads every
    flag and seal, with its other checks, in one transfer before anything is released; a false
    flag (a weight changed through ``.data`` or a NumPy view) or a failed seal refuses the step.
    A weight whose version counter moved is compared at once, as outside this context.
    """
    checks = DeferredChecks([], [])
    _DEFERRED.append(checks)
    try:
        yield checks
    finally:
        _DEFERRED.pop()


def _digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data + str((tuple(t.shape), t.dtype)).encode()).hexdigest()
