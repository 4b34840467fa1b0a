"""Noise allocations: how one step's noise is shared among the noised tensors.

An allocation is one class (a subclass of :class:`NoiseAllocation`) registered under a name with
:func:`register_allocation`; :class:`clipless.mechanism.PrivacyConfig` names it in its ``noise``
field, and the CLI's and the audit's ``--noise`` choices are :func:`allocation_names`. It
decides three things, each part of the privacy argument (:mod:`clipless.mechanism`, "Noise
allocation"):

- the standard deviation of every noised tensor (:meth:`NoiseAllocation.stds`), from the
  certified sensitivities of the step;
- the step's effective multiplier ``sigma_eff`` (:meth:`NoiseAllocation.effective_multiplier`)
  and its inverse, used to calibrate ``sigma`` for a target ``(epsilon, delta)``;
- the step's ``dp_accounting`` event (:meth:`NoiseAllocation.step_event`): what the optimizer
  records in the ledger and what the calibration composes. By default one Poisson-subsampled
  Gaussian of multiplier ``sigma_eff`` (in ``dp_accounting``'s convention).

Its soundness is its author's obligation, as for the two built in: given that one example
changes each noised tensor's sum by at most its certified sensitivity (and each group of uses
sharing a parameter jointly by at most the group's bound), the noise of :meth:`stds` must make
the step at least as private as :meth:`step_event` says.

A new allocation is one subclass in one file::

    @register_allocation
    class Mine(NoiseAllocation):
        name = "mine"
        def effective_multiplier(self, config): ...
        def noise_multiplier_for(self, config, effective): ...
        def stds(self, config, groups, sensitivities): ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple, TypeVar

if TYPE_CHECKING:
    import dp_accounting

    from clipless.mechanism import PrivacyConfig

__all__ = [
    "GlobalNoise",
    "NoiseAllocation",
    "PerLayerNoise",
    "UseGroup",
    "allocation_names",
    "get_allocation",
    "mechanism_count",
    "register_allocation",
    "unregister_allocation",
]


class UseGroup(NamedTuple):
    """Layer uses connected by a shared noised parameter (:mod:`clipless.mechanism`).

    ``members``: the noised tensors they touch; ``bound``: the sum of the uses' sensitivities
    (rounded up); ``uses``: how many uses.
    """

    members: tuple[str, ...]
    bound: float
    uses: int


def _up(value: float) -> float:
    return math.nextafter(float(value), math.inf)


class NoiseAllocation:
    """How the noise of one step is allocated among its noised tensors (module docstring).

    Subclasses set :attr:`name` and implement :meth:`effective_multiplier`,
    :meth:`noise_multiplier_for` and :meth:`stds`; :meth:`step_event`, :meth:`check` and
    :meth:`num_mechanisms` have defaults. Instances hold no state: one serves every config.
    """

    #: The name a :class:`~clipless.mechanism.PrivacyConfig` stores in its ``noise`` field.
    name: ClassVar[str]

    def effective_multiplier(self, config: PrivacyConfig) -> float:
        """``sigma_eff``: the step as one Gaussian mechanism's multiplier (over the
        sensitivities, before the neighbouring factor of ``dp_accounting``'s convention)."""
        raise NotImplementedError

    def noise_multiplier_for(self, config: PrivacyConfig, effective: float) -> float:
        """The ``noise_multiplier`` whose :meth:`effective_multiplier` is ``effective``."""
        raise NotImplementedError

    def stds(
        self, config: PrivacyConfig, groups: Sequence[UseGroup], sensitivities: Mapping[str, float]
    ) -> dict[str, float]:
        """Every noised tensor's noise standard deviation (keys of ``sensitivities``, each the
        certified bound of the tensor: the sum of the uses touching it)."""
        raise NotImplementedError

    def step_event(self, accounting_multiplier: float, sample_rate: float) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of one step at ``accounting_multiplier`` (the effective
        multiplier times the neighbouring factor): a Poisson-subsampled Gaussian by default."""
        from clipless.accounting import gaussian_step_event  # the CLI's parser imports this module

        return gaussian_step_event(accounting_multiplier, sample_rate)

    def check(self, config: PrivacyConfig, groups: Sequence[UseGroup]) -> None:
        """Raise :class:`ValueError` if the model's structure no longer fits ``config``."""

    def num_mechanisms(self, counted: int, num_tensors: int) -> int | None:
        """What ``make_private`` stores as :attr:`PrivacyConfig.num_mechanisms`, given the
        ``counted`` mechanisms of the model (:func:`clipless.mechanism.per_layer_mechanisms`)."""
        return None


_REGISTRY: dict[str, NoiseAllocation] = {}
_A = TypeVar("_A", bound=type[NoiseAllocation])


def register_allocation(cls: _A) -> _A:
    """Register a :class:`NoiseAllocation` subclass under its ``name`` (a class decorator).

    Raises :class:`ValueError` if the name is taken by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, NoiseAllocation)):
        raise TypeError(f"cls must be a NoiseAllocation subclass; got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__}.name must be a non-empty string; got {name!r}")
    known = _REGISTRY.get(name)
    if known is not None and type(known) is not cls:
        raise ValueError(f"noise allocation {name!r} is already registered ({type(known)!r})")
    _REGISTRY[name] = cls()
    return cls


def unregister_allocation(name: str) -> None:
    """Remove a registered allocation (a test's; the built-in ones stay)."""
    if name in _BUILTIN:
        raise ValueError(f"the built-in noise allocation {name!r} cannot be unregistered")
    _REGISTRY.pop(name, None)


def allocation_names() -> tuple[str, ...]:
    """The registered allocation names, built-in ones first."""
    return tuple(_REGISTRY)


def get_allocation(name: str) -> NoiseAllocation:
    """The registered allocation ``name``; :class:`ValueError` naming the choices otherwise."""
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"noise must be one of {allocation_names()}; got {name!r}")
    return found


@register_allocation
class GlobalNoise(NoiseAllocation):
    """``"global"``: one Gaussian mechanism on the concatenation of all noised gradients.

    Its L2 sensitivity is ``G = sqrt(sum_c B_c^2)`` over the groups ``c`` of uses sharing a
    parameter (``B_c`` the sum of their bounds); every tensor gets ``sigma G``, and
    ``sigma_eff = sigma``.
    """

    name = "global"

    def effective_multiplier(self, config: PrivacyConfig) -> float:
        return float(config.noise_multiplier)

    def noise_multiplier_for(self, config: PrivacyConfig, effective: float) -> float:
        return effective

    def stds(
        self, config: PrivacyConfig, groups: Sequence[UseGroup], sensitivities: Mapping[str, float]
    ) -> dict[str, float]:
        total = _up(math.sqrt(_up(math.fsum(g.bound * g.bound for g in groups))))
        return dict.fromkeys(sensitivities, _up(float(config.noise_multiplier) * total))


@register_allocation
class PerLayerNoise(NoiseAllocation):
    """``"per-layer"``: tensor ``p`` gets ``sigma Delta_p``; the step is ``D`` Gaussian
    mechanisms, ``sigma_eff = sigma / sqrt(D)`` (``D`` = :attr:`PrivacyConfig.mechanisms`)."""

    name = "per-layer"

    def effective_multiplier(self, config: PrivacyConfig) -> float:
        return float(config.noise_multiplier) / math.sqrt(config.mechanisms)

    def noise_multiplier_for(self, config: PrivacyConfig, effective: float) -> float:
        return effective * math.sqrt(config.mechanisms)

    def stds(
        self, config: PrivacyConfig, groups: Sequence[UseGroup], sensitivities: Mapping[str, float]
    ) -> dict[str, float]:
        sigma = float(config.noise_multiplier)
        return {n: _up(sigma * s) for n, s in sensitivities.items()}

    def check(self, config: PrivacyConfig, groups: Sequence[UseGroup]) -> None:
        count = mechanism_count(groups)
        if count > config.mechanisms:
            raise ValueError(
                f"per-layer noise: the model's layers now form {count} Gaussian mechanisms but "
                f"the config accounts for {config.mechanisms} (its structure changed after "
                "make_private): the noise would be mis-calibrated"
            )

    def num_mechanisms(self, counted: int, num_tensors: int) -> int | None:
        return counted if counted < num_tensors else None


def mechanism_count(groups: Sequence[UseGroup]) -> int:
    """``D = sum_c min(U_c, P_c)`` (:mod:`clipless.mechanism`, "Noise allocation")."""
    return sum(min(g.uses, len(g.members)) for g in groups)


_BUILTIN = frozenset(_REGISTRY)
