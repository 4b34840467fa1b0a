"""The privacy argument of one DP step: from certified bounds to a frozen noise plan.

This module and :mod:`clipless.bounds` hold the whole argument from a bound to a noise scale
(docs/design.md, "Training: the mathematics"; Béthune et al. 2024, Algorithm 1 and its "local" /
"global" noise; Lip-DP-SGD, thesis Algorithm 8):

1. :class:`PrivacyConfig` (frozen, serialisable) is the mechanism: sampling rate, noise multiplier
   and its allocation, the gradient-scaling mode, the weight constraint, the neighbouring relation,
   the accountant and the planned number of steps. :meth:`PrivacyConfig.calibrate` returns a new
   one whose multiplier meets a target ``(epsilon, delta)``; :class:`MechanismSpec` is the part
   of it a caller chooses. Settings that change no noise scale (certification schedule, ledger
   path, data validation: :class:`clipless.engine.RunOptions`; seeds) are not part of it.
2. Each step, :func:`clipless.bounds.report` certifies, from the weights the forward pass uses
   (public: they are the output of earlier private steps), a bound ``G_k`` on one sample's
   cotangent at the output of every parametric layer ``k``, starting from the loss constant ``L``
   at the model's output.
3. :func:`plan_step` turns the config and that report into a :class:`NoisePlan`: per-tensor
   sensitivities, per-tensor noise standard deviations, the effective multiplier of the step, the
   ``dp_accounting`` event, the scaling thresholds the forward pass uses, the cotangent bound the
   optimizer enforces at the model output, and whether the step is proven DP. The noise
   allocation (per-tensor stds, effective multiplier, event) is a registered
   :class:`clipless.allocation.NoiseAllocation` named by ``PrivacyConfig.noise``.
4. :class:`clipless.optim.DPOptimizer` applies exactly that plan and records exactly its event
   (:meth:`NoisePlan.dp_event`) in the ledger; :meth:`PrivacyConfig.epsilon` and
   :meth:`PrivacyConfig.calibrate` compose the same event.

**Why the plan's sensitivities hold.** Under gradient scaling (:mod:`clipless.nn._scaled`) one
sample's contribution to the (weight, bias) gradient of one *use* of layer ``k`` has norm at most
the cotangent bound ``G_k`` at that use, divided by the sample multiplicity ``K`` (``K`` augmented
copies of one sample each contribute at most ``G_k / K``). The optimizer clips every row's
cotangent at the model output to ``L`` (:class:`clipless.optim.DPOptimizer`), so ``G_k`` holds
whatever *per-example* loss, reduction, scale or extra term produced the backward pass (a loss
coupling the examples of a batch is outside the contract: see :mod:`clipless.optim`). A parameter
used several times (a module reused, or weights tied across modules) receives the sum of its uses'
contributions, so its bound is the *sum* of their ``G`` (triangle inequality). Add/remove
neighbours change the sum by one contribution; replace-one by the difference of two, which
doubles every sensitivity (``sensitivity_factor = 2``).

**Noise allocation** (the two built in, :mod:`clipless.allocation`). ``"per-layer"``: tensor
``p`` gets noise ``sigma * Delta_p``, and the step is one Gaussian mechanism with
``sigma_eff = sigma / sqrt(D)`` when the squared Mahalanobis sensitivity
``sum_p ||c_p||^2 / (sigma Delta_p)^2`` of one sample's contributions ``c_p`` is at most
``D / sigma^2``. Every term is at most ``1 / sigma^2``, so ``D`` = the number of noised
tensors is always valid. Tensors that one layer use produces together (a weight and its bias)
are not independent mechanisms, though: one sample's *joint* (weight, bias) contribution has
norm at most ``G_k``, so for ``std_p = sigma Delta_p`` with ``Delta_p = G_k`` the pair's squared
Mahalanobis sensitivity is
``(||c_w||^2 + ||c_b||^2) / (sigma G_k)^2 <= 1 / sigma^2``, that of ONE mechanism. In general,
for a connected group ``c`` of layer uses sharing parameters (``Delta_p`` the sum of the ``G`` of
the uses touching ``p``), with ``a_{u,p} = ||c_{u,p}|| / G_u`` (``sum_p a_{u,p}^2 <= 1`` for every
use ``u``) and the weights ``w_{u,p} = G_u / Delta_p`` (summing to at most 1 over ``u``, as
``Delta_p`` is rounded up): ``||sum_u c_{u,p}||^2 / Delta_p^2 <= (sum_u w_{u,p} a_{u,p})^2 <=
sum_u w_{u,p} a_{u,p}^2`` (Cauchy-Schwarz), and summing over ``p`` gives at
most ``sum_u sum_p a_{u,p}^2 <= U_c``, the group's number of uses; each term is also at most 1,
so at most ``P_c``, its number of tensors. Per-layer noise is therefore ``D = sum_c min(U_c,
P_c)`` mechanisms, not one per tensor (:func:`per_layer_mechanisms`; for a network of distinct
layers, with or without biases, ``D`` = the number of layers with a noised tensor; configs saved
before this counted every tensor, ``num_mechanisms = None``, which over-counts and stays valid).
``"global"``: one Gaussian mechanism on the concatenation of all noised gradients, whose L2
sensitivity is ``G = sqrt(sum_c B_c^2)`` over the connected groups ``c`` of layer uses that
share a parameter, ``B_c`` the sum of their ``G_k``; every tensor gets ``sigma G`` and
``sigma_eff = sigma``.
Both are one Poisson-subsampled Gaussian mechanism per step, accounted with ``dp_accounting``.

**Floating point.** The bounds are computed in float64 with upward rounding, but the training step
itself runs in the parameters' dtype. Every sensitivity is inflated by a relative margin
(:func:`rounding_margin`) of two parts. (a) :data:`ROUNDING_MARGIN` (``2^-12`` in float32,
``2^-40`` in float64) covers the rounding of each row's own arithmetic (its forward, its cotangent,
its clip and scaling; the largest excess measured over 288 end-to-end float32 configurations was
``6.7e-8``, 3,600 times below it): an engineering allowance, not a proof. (b) The batch sum, the
one operation that mixes rows, is covered by a proof (:func:`rounding_margin`), as a function of
the dtype, the largest number of uses of one tensor, and a *public* bound on the batch size (the
dataset size plus one, never the private batch): float32 sums alone exceeded the planned
sensitivity (1.000167 times it at ``B = 8192``). Half precision (float16 / bfloat16) is
refused because its rounding (measured excess ``1.4e-3`` in bfloat16, overflow in float16) is not
covered.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from clipless import _validate, accounting
from clipless.accounting import _checks as _accounting_checks
from clipless.accounting._checks import _check_releases
from clipless.allocation import (
    NoiseAllocation,
    UseGroup,
    allocation_names,
    get_allocation,
    mechanism_count,
)
from clipless.nn._scaled import BATCH_MAX, SCALING_MODES, SUM_CHUNK_TERMS, SUM_MAX_CHUNKS

if TYPE_CHECKING:
    import dp_accounting

    from clipless.bounds import BoundReport

__all__ = [
    "BATCH_MAX",
    "CONSTRAINTS",
    "NEIGHBOURING",
    "NOISE_STRATEGIES",
    "ROUNDING_MARGIN",
    "SCALING_MODES",
    "MechanismSpec",
    "NoisePlan",
    "PrivacyConfig",
    "per_layer_mechanisms",
    "plan_step",
    "rounding_margin",
    "thresholds_for",
    "use_bound",
]

#: The built-in noise allocations (:mod:`clipless.allocation`; registered ones:
#: :func:`clipless.allocation.allocation_names`).
NOISE_STRATEGIES: tuple[str, ...] = allocation_names()
CONSTRAINTS: tuple[str, ...] = ("clip", "fix", "orthogonal")
NEIGHBOURING: tuple[str, ...] = _accounting_checks.NEIGHBOURING_RELATIONS
ACCOUNTANTS: tuple[str, ...] = _accounting_checks.ACCOUNTANTS
#: The per-row part of the relative inflation of every sensitivity, by parameter dtype name
#: (module docstring, (a)); :func:`rounding_margin` adds the batch sum's.
ROUNDING_MARGIN: Mapping[str, float] = MappingProxyType({"float32": 2.0**-12, "float64": 2.0**-40})
#: Unit roundoff of the parameters' dtype.
_UNIT: Mapping[str, float] = MappingProxyType({"float32": 2.0**-24, "float64": 2.0**-53})


def _gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error of ``n`` rounded additions."""
    return n * u / (1.0 - n * u)


def rounding_margin(dtype_name: str, batch_bound: int = 1, uses: int = 1) -> float:
    """The relative sensitivity margin for parameters of dtype ``dtype_name`` (e.g. ``"float32"``)
    when at most ``batch_bound`` examples (a public bound: the dataset size plus one) enter one
    step's sum and a noised tensor is used at most ``uses`` times by the model.

    ``ROUNDING_MARGIN[dtype] + 2 B (g64 + gamma_{uses+1}(u)) (1 + ROUNDING_MARGIN[dtype])``, with
    ``B = batch_bound``, ``u`` the dtype's unit roundoff and ``g64 = gamma_{2^22}(2^-53)``.

    *Proof.* Let ``c_r`` be row ``r``'s contribution to a tensor as the scaled kernel forms it
    (covered, row by row, by :data:`ROUNDING_MARGIN`) and ``A = sum_r |c_r|`` coordinatewise; the
    rows of one example have norms summing to at most the use's ``G`` (``K`` copies, each ``G /
    K``), so ``||A|| <= sum_r ||c_r|| <= B Delta`` (for a convolution, ``|c_r|`` sums ``|dy| |x|``
    over positions, whose norm obeys the same certified factor). The kernels
    (:mod:`clipless.nn._scaled`) form the products in float64 (exact for float32 operands) and sum
    at most :data:`SUM_CHUNK_TERMS` of them per chunk, then at most :data:`SUM_MAX_CHUNKS` chunk
    sums, in float64: error ``<= (gamma_{2^20} + gamma_{2^20}) A <= gamma_{2^21} A`` (any order
    of summation: Higham, *Accuracy and Stability*, 4.2). Rounding that to the dtype, adding the
    uses of a tensor (``uses - 1`` additions) and, under :mod:`clipless.distributed`, the ranks'
    float32 gradients in float64 (at most 2^20 ranks) then rounding once more, add at most
    ``gamma_{2^20}(2^-53) A + gamma_{uses+1}(u) (1 + g64) A``. So the computed gradient sum of a
    dataset is within ``e = (g64 + gamma_{uses+1}(u)) (1 + 2^-30) B Delta`` of the exact sum of
    its rows, and two neighbouring datasets' computed sums differ by at most the exact difference
    (at most ``Delta (1 + ROUNDING_MARGIN)``) plus ``2 e``. The dominant term is the rounding of
    the sum itself to the dtype (``|S| u``, ``|S|`` up to ``B Delta``): in float32, about
    ``B 2^-22`` (``0.014`` at ``B = 60,001``); in float64, ``B 2^-30``. Raises
    :class:`ValueError` for dtypes whose rounding is not covered.
    """
    name = str(dtype_name).removeprefix("torch.")
    if name not in ROUNDING_MARGIN:
        raise ValueError(
            f"parameters must be float32 or float64 for private training, got {name} (half "
            "precision's rounding exceeds the certified sensitivities)"
        )
    _validate.positive_int("batch_bound", batch_bound, wrong_type=ValueError)
    _validate.positive_int("uses", uses, wrong_type=ValueError)
    base = ROUNDING_MARGIN[name]
    g64 = _gamma(2 * SUM_CHUNK_TERMS + SUM_MAX_CHUNKS + 2, 2.0**-53)
    per_example = (g64 + _gamma(int(uses) + 1, _UNIT[name])) * (1.0 + 2.0**-30)
    return _up(base + _up(2.0 * int(batch_bound) * per_example * (1.0 + base)))


def _sensitivity_factor(neighbouring: str) -> float:
    return 2.0 if neighbouring == "replace_one" else 1.0


@dataclass(frozen=True)
class PrivacyConfig:
    """The mechanism of every training step, frozen and serialisable (module docstring).

    ``noise_multiplier`` is ``sigma``: with ``noise="global"`` the step's effective multiplier,
    with ``"per-layer"`` every noised tensor's (``sigma_eff = sigma / sqrt(D)``). Multipliers are
    relative to the sensitivities ``Delta`` (which already include the factor 2 of replace-one);
    :attr:`accounting_noise_multiplier` converts to ``dp_accounting``'s convention.
    ``steps`` is the number of steps the privacy budget was planned for (``None``: not planned;
    the caller accounts). ``thresholds`` (layer path -> ``T_k``) is used by
    ``scaling="threshold"`` only. ``releases`` are the ``dp_accounting`` noise multipliers of
    one-shot Gaussian releases made before training (e.g. the private input mean of an
    :class:`clipless.nn.InputNorm` with ``center``); :meth:`epsilon` and :meth:`calibrate`
    compose them with the steps.
    """

    noise_multiplier: float
    sample_rate: float
    num_samples: int
    num_tensors: int
    noise: str = "global"
    scaling: str = "per-sample"
    constraint: str | None = "orthogonal"
    max_norm: float = 1.0
    neighbouring: str = "add_remove"
    accountant: str = "pld"
    steps: int | None = None
    thresholds: Mapping[str, float] | None = None
    allow_unproven: bool = False
    releases: tuple[float, ...] = ()
    num_mechanisms: int | None = None

    def __post_init__(self) -> None:
        # numbers.Real / Integral (NumPy scalars included) are stored as Python floats / ints
        sigma = _validate.finite_positive("noise_multiplier", self.noise_multiplier)
        object.__setattr__(self, "noise_multiplier", sigma)
        q = _validate.probability(
            "sample_rate", self.sample_rate, open_low=True, wrong_type=ValueError
        )
        object.__setattr__(self, "sample_rate", q)
        for name in ("num_samples", "num_tensors"):
            count = _validate.positive_int(name, getattr(self, name), wrong_type=ValueError)
            object.__setattr__(self, name, count)
        get_allocation(self.noise)  # a registered allocation, or the error naming them
        _validate.choice("scaling", self.scaling, SCALING_MODES)
        if self.scaling == "batch-max" and not self.allow_unproven:
            raise ValueError(
                "scaling='batch-max' is not differentially private (docs/design.md, 'Gradient "
                "scaling'); pass allow_unproven=True to use it for reproduction only"
            )
        if self.constraint is not None and self.constraint not in CONSTRAINTS:
            raise ValueError(
                f"constraint must be one of {CONSTRAINTS} or None; got {self.constraint!r}"
            )
        c = _validate.finite_positive("max_norm", self.max_norm, wrong_type=ValueError)
        object.__setattr__(self, "max_norm", c)
        _validate.choice("neighbouring", self.neighbouring, NEIGHBOURING)
        _validate.choice("accountant", self.accountant, ACCOUNTANTS)
        if self.steps is not None:
            if not _validate.is_int(self.steps) or self.steps < 1:
                raise ValueError(f"steps must be an integer >= 1 or None; got {self.steps!r}")
            object.__setattr__(self, "steps", int(self.steps))
        _validate.flag("allow_unproven", self.allow_unproven)
        if self.thresholds is not None and self.scaling != "threshold":
            raise ValueError(
                f"thresholds are used by scaling='threshold' only; got scaling={self.scaling!r} "
                "with thresholds (drop them, or choose scaling='threshold')"
            )
        if self.thresholds is not None:
            object.__setattr__(self, "thresholds", MappingProxyType(dict(self.thresholds)))
        object.__setattr__(self, "releases", _check_releases(self.releases))
        d = self.num_mechanisms
        if d is not None:
            if not _validate.is_int(d):
                raise ValueError(f"num_mechanisms must be None or an integer; got {d!r}")
            if not 1 <= d <= self.num_tensors:
                raise ValueError(
                    f"num_mechanisms must be in [1, num_tensors = {self.num_tensors}]; got {d!r}"
                )
            object.__setattr__(self, "num_mechanisms", int(d))

    # ----------------------------------------------------------------- derived
    @property
    def proven(self) -> bool:
        """``False`` for modes without a DP proof (``batch-max``): never report their epsilon."""
        return self.scaling != "batch-max"

    @property
    def sensitivity_factor(self) -> float:
        """2 under replace-one (an example and its replacement), 1 under add/remove."""
        return _sensitivity_factor(self.neighbouring)

    @property
    def allocation(self) -> NoiseAllocation:
        """The registered :class:`clipless.allocation.NoiseAllocation` named by ``noise``."""
        return get_allocation(self.noise)

    @property
    def mechanisms(self) -> int:
        """``D`` of per-layer noise: ``num_mechanisms``, or ``num_tensors`` when not given."""
        return self.num_tensors if self.num_mechanisms is None else self.num_mechanisms

    @property
    def effective_noise_multiplier(self) -> float:
        """``sigma_eff`` of one step, relative to the sensitivities (by the allocation)."""
        return self.allocation.effective_multiplier(self)

    @property
    def accounting_noise_multiplier(self) -> float:
        """Noise std over one example's bound ``G``: ``dp_accounting``'s convention.

        Its ``REPLACE_ONE`` relation itself accounts for a difference of ``2 G`` between an
        example and its replacement, so under replace-one (``Delta = 2 G``) this is
        ``2 sigma_eff``; under add/remove it is ``sigma_eff``.
        """
        return self.effective_noise_multiplier * self.sensitivity_factor

    @property
    def expected_batch_size(self) -> float:
        """``q N``: the noisy sum is divided by it, never by the realised (private) batch size."""
        return self.sample_rate * self.num_samples

    def step_event(self) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of one step (the allocation's: by default a
        Poisson-subsampled Gaussian); :meth:`NoisePlan.dp_event` is the same event."""
        return self.allocation.step_event(self.accounting_noise_multiplier, self.sample_rate)

    def epsilon(self, delta: float, steps: int | None = None) -> float:
        """Epsilon after ``steps`` (default: the planned number) of :meth:`step_event`,
        composed with the :attr:`releases`."""
        n = self.steps if steps is None else steps
        if n is None:
            raise ValueError("steps is required: this config has no planned number of steps")
        return accounting.event_epsilon(
            accounting.repeated(self.step_event(), n),
            delta,
            accountant=self.accountant,  # type: ignore[arg-type]
            neighbouring=self.neighbouring,  # type: ignore[arg-type]
            releases=self.releases,
        )

    # -------------------------------------------------------------- calibrate
    def calibrate(self, epsilon: float, delta: float, steps: int) -> PrivacyConfig:
        """A copy whose noise multiplier is the smallest meeting ``(epsilon, delta)`` in ``steps``.

        The search (:func:`clipless.accounting.calibrate_noise`) composes ``steps`` of the
        allocation's :meth:`step_event` at a trial multiplier in ``dp_accounting``'s convention;
        the result is converted back to this config's multiplier.
        """
        allocation, q = self.allocation, self.sample_rate
        sigma_acc = accounting.calibrate_noise(
            epsilon,
            delta,
            q,
            steps,
            accountant=self.accountant,  # type: ignore[arg-type]
            neighbouring=self.neighbouring,  # type: ignore[arg-type]
            releases=self.releases,
            make_event=lambda s: accounting.repeated(allocation.step_event(s, q), steps),
        )
        sigma_eff = sigma_acc / self.sensitivity_factor
        sigma = allocation.noise_multiplier_for(self, sigma_eff)
        out = dataclasses.replace(self, noise_multiplier=sigma, steps=int(steps))
        # The conversion rounds: the multiplier the ledger records (converted back) must not
        # fall below the calibrated one, whose epsilon was checked (at most a few ulps).
        while out.accounting_noise_multiplier < sigma_acc:
            sigma = math.nextafter(sigma, math.inf)
            out = dataclasses.replace(out, noise_multiplier=sigma)
        return out

    def with_steps(self, steps: int | None) -> PrivacyConfig:
        """A copy planned for ``steps`` steps (used to extend a run explicitly)."""
        return dataclasses.replace(self, steps=steps)

    # -------------------------------------------------------------- serialise
    def to_dict(self) -> dict[str, Any]:
        # every field is a scalar except ``thresholds``, a read-only mapping that
        # ``dataclasses.asdict`` cannot deep-copy (it pickles a ``mappingproxy``)
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["thresholds"] = None if self.thresholds is None else dict(self.thresholds)
        out["releases"] = list(self.releases)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown PrivacyConfig fields {unknown}")
        fields = dict(data)
        if "releases" in fields:  # a list in JSON; configs saved before releases have none
            fields["releases"] = tuple(fields["releases"])
        if fields.get("scaling", "per-sample") != "threshold":
            # configs saved before thresholds were refused with other scalings (they were
            # unused there): loading such a checkpoint drops them
            fields["thresholds"] = None
        return cls(**fields)


@dataclass(frozen=True)
class MechanismSpec:
    """The mechanism chosen for :meth:`clipless.PrivacyEngine.make_private`: everything of a
    :class:`PrivacyConfig` that the caller chooses (``make_private`` adds what the model, the
    data and the calibration determine). Checked when the config is built.

    Args:
        noise: the registered noise allocation (:mod:`clipless.allocation`): ``"global"`` or
            ``"per-layer"`` built in.
        scaling: the gradient scaling mode (:data:`SCALING_MODES`; ``"batch-max"`` has no DP
            proof and needs ``allow_unproven``).
        constraint: the projection after each step (:data:`CONSTRAINTS`, or ``None``:
            nothing is projected and the noise follows the certified norms of the current,
            public weights). ``"orthogonal"`` keeps the layers gradient-norm preserving, so
            every certified cotangent bound stays close to the true cotangents.
        max_norm: the layers' operator-norm constraint ``C`` (not the input radius, which is
            the model's ``InputNorm(max_norm=...)``).
        neighbouring: ``"add_remove"`` or ``"replace_one"`` (doubles every sensitivity).
        thresholds: layer path -> ``T_k``, with ``scaling="threshold"`` only.
        allow_unproven: accept a mode without a DP proof (reproduction only).
        sample_rate: the Poisson rate (default: the loader's batch size over the dataset size).
    """

    noise: str = "global"
    scaling: str = "per-sample"
    constraint: str | None = "orthogonal"
    max_norm: float = 1.0
    neighbouring: str = "add_remove"
    thresholds: Mapping[str, float] | None = None
    allow_unproven: bool = False
    sample_rate: float | None = None

    def __post_init__(self) -> None:
        _validate.flag("allow_unproven", self.allow_unproven)
        if isinstance(self.thresholds, Mapping):  # the config checks the values
            object.__setattr__(self, "thresholds", MappingProxyType(dict(self.thresholds)))


@dataclass(frozen=True)
class NoisePlan:
    """Exactly what one step does, computed before its gradient exists (module docstring).

    ``sensitivities`` and ``stds`` are keyed by parameter name (``model.named_parameters()``),
    over the noised tensors only. ``output_bound`` is the per-row cotangent norm the optimizer
    enforces at the model output (the loss constant ``L``); ``thresholds`` the scaling threshold
    of each parametric module (by path) and ``multiplicity`` the number of rows per sample.
    """

    names: tuple[str, ...]
    sensitivities: Mapping[str, float]
    stds: Mapping[str, float]
    noise_multiplier: float
    effective_noise_multiplier: float
    accounting_noise_multiplier: float
    sample_rate: float
    expected_batch_size: float
    output_bound: float
    thresholds: Mapping[str, float | str]
    multiplicity: int
    rounding_margin: float
    proven: bool
    groups: tuple[tuple[str, ...], ...] = field(default=())
    event: dp_accounting.DpEvent | None = None

    def dp_event(self) -> dp_accounting.DpEvent:
        """The step's ``dp_accounting`` event, what the optimizer records in the ledger: the
        allocation's :meth:`PrivacyConfig.step_event` (a plan built by hand without one: the
        Poisson-subsampled Gaussian of :attr:`accounting_noise_multiplier`)."""
        if self.event is not None:
            return self.event
        return accounting.gaussian_step_event(self.accounting_noise_multiplier, self.sample_rate)


def thresholds_for(
    report: BoundReport,
    mode: str,
    thresholds: Mapping[str, float] | None = None,
    *,
    allow_unproven: bool = False,
) -> dict[str, float | str]:
    """Per-module scaling thresholds ``T_k`` (module path -> value) for a scaling ``mode``.

    The threshold only trades bias against variance; it never enters the privacy argument
    (:mod:`clipless.nn._scaled`). ``"bound"``: the certified bound on the norm factor propagated
    from the input bound (Clipless DP-SGD, Béthune et al. 2024, Algorithm 1 line 2); a module used
    several times gets the largest of its uses' bounds (when it is reached at several paths,
    :class:`clipless.optim.DPOptimizer` applies the largest of their values). ``"per-sample"``:
    0. ``"threshold"``: the given value for every parametric module path. ``"batch-max"``: the
    batch maximum (unproven).
    """
    _validate.choice("scaling", mode, SCALING_MODES)
    paths = list(dict.fromkeys(layer.path for layer in report.layers))
    if mode == "bound":
        out: dict[str, float | str] = {}
        for lb in report.layers:
            prev = out.get(lb.path)
            value = float(lb.norm_factor_bound)
            out[lb.path] = value if not isinstance(prev, float) else max(prev, value)
        return out
    if mode == "per-sample":
        return dict.fromkeys(paths, 0.0)
    if mode == "batch-max":
        if not allow_unproven:
            raise ValueError(
                "scaling='batch-max' is not differentially private (docs/design.md, 'Gradient "
                "scaling'); pass allow_unproven=True to use it for reproduction only"
            )
        return dict.fromkeys(paths, BATCH_MAX)
    if thresholds is None:
        raise ValueError("thresholds is required with scaling='threshold': {layer path: T_k >= 0}")
    missing = [p for p in paths if p not in thresholds]
    unknown = [p for p in thresholds if p not in paths]
    if missing or unknown:
        raise ValueError(
            f"thresholds must name exactly the parametric layers {paths}; "
            f"missing {missing}, unknown {unknown}"
        )
    result: dict[str, float | str] = {}
    for p in paths:
        t = float(thresholds[p])
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"thresholds[{p!r}] must be a finite number >= 0; got {t!r}")
        result[p] = t
    return result


def _up(value: float) -> float:
    return math.nextafter(float(value), math.inf)


def _most_uses(report: BoundReport, noised: frozenset[str]) -> int:
    """The largest number of layer uses that touch one noised tensor (at least 1)."""
    counts: dict[str, int] = {}
    for lb in report.layers:
        for name in lb.gradient_bounds:
            if name in noised:
                counts[name] = counts.get(name, 0) + 1
    return max(counts.values(), default=1)


def use_bound(cotangent_bound: float, config: PrivacyConfig, margin: float) -> float:
    """Sensitivity of one use of a layer: ``G_k`` times the neighbouring factor and the margin."""
    return _up(float(cotangent_bound) * (1.0 + margin) * config.sensitivity_factor)


def _groups(uses: Sequence[tuple[str, float, frozenset[str]]]) -> list[UseGroup]:
    """Connected groups of layer uses sharing a noised parameter: (members, the sum of the uses'
    bounds, the number of uses)."""
    parent = list(range(len(uses)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, (_, _, params) in enumerate(uses):
        for name in params:
            if name in owner:
                parent[find(i)] = find(owner[name])
            else:
                owner[name] = i
    sums: dict[int, float] = {}
    members: dict[int, set[str]] = {}
    counts: dict[int, int] = {}
    for i, (_, bound, params) in enumerate(uses):
        root = find(i)
        sums[root] = _up(sums.get(root, 0.0) + bound)
        members.setdefault(root, set()).update(params)
        counts[root] = counts.get(root, 0) + 1
    return [UseGroup(tuple(sorted(members[r])), sums[r], counts[r]) for r in sums]


def per_layer_mechanisms(report: BoundReport, names: Iterable[str]) -> int:
    """How many Gaussian mechanisms per-layer noise on the noised tensors ``names`` composes:
    ``D = sum_c min(U_c, P_c)`` over the connected groups of layer uses (module docstring,
    "Noise allocation"); at most the number of tensors. Depends on the model's structure only."""
    noised = frozenset(names)
    uses = [
        (lb.path, 0.0, touched)
        for lb in report.layers
        if (touched := frozenset(n for n in lb.gradient_bounds if n in noised))
    ]
    return mechanism_count(_groups(uses))


def plan_step(
    config: PrivacyConfig,
    report: BoundReport,
    names: Iterable[str],
    *,
    dtype: str = "float32",
    multiplicity: int = 1,
) -> NoisePlan:
    """The frozen :class:`NoisePlan` of one step at the weights ``report`` was certified for.

    ``names`` are the noised parameters (trainable parameters held by the optimizer), ``dtype``
    their dtype name and ``multiplicity`` the number of rows each sample occupies in the batch
    (augmentation multiplicity; the scaled kernels divide every row's contribution by it).
    Raises :class:`ValueError` if a noised parameter has no certified bound.
    """
    noised = tuple(names)
    if not noised:
        raise ValueError("there is no trainable parameter to noise")
    if len(noised) != config.num_tensors:
        raise ValueError(
            f"the config was planned for {config.num_tensors} noised tensors but the optimizer "
            f"holds {len(noised)}: per-layer noise would be mis-calibrated"
        )
    multiplicity = _validate.positive_int("multiplicity", multiplicity, wrong_type=ValueError)
    noised_set = frozenset(noised)
    margin = rounding_margin(
        dtype, batch_bound=int(config.num_samples) + 1, uses=_most_uses(report, noised_set)
    )

    per_tensor: dict[str, float] = {}
    uses: list[tuple[str, float, frozenset[str]]] = []
    for lb in report.layers:
        touched = frozenset(n for n in lb.gradient_bounds if n in noised_set)
        if not touched:
            continue
        g = use_bound(lb.cotangent_bound, config, margin)
        if not math.isfinite(g):
            raise ValueError(
                f"layer {lb.path!r}: its certified sensitivity is {g!r} (input bound "
                f"{lb.input_bound!r}, cotangent bound {lb.cotangent_bound!r}): a layer above it "
                "has no finite Lipschitz constant (e.g. a sphere-mode InputNorm after the first)"
            )
        uses.append((lb.path, g, touched))
        for name in touched:
            per_tensor[name] = _up(per_tensor.get(name, 0.0) + g)
    missing = [n for n in noised if n not in per_tensor]
    if missing:
        raise ValueError(
            f"no certified sensitivity for parameters {missing}: every trained parameter must "
            "belong to a clipless parametric layer reachable through clipless containers"
        )
    sigma = float(config.noise_multiplier)
    groups = _groups(uses)
    allocation = config.allocation
    allocation.check(config, groups)
    stds = allocation.stds(config, groups, {n: per_tensor[n] for n in noised})
    return NoisePlan(
        names=noised,
        sensitivities=MappingProxyType({n: per_tensor[n] for n in noised}),
        stds=MappingProxyType(stds),
        noise_multiplier=sigma,
        effective_noise_multiplier=config.effective_noise_multiplier,
        accounting_noise_multiplier=config.accounting_noise_multiplier,
        sample_rate=float(config.sample_rate),
        expected_batch_size=config.expected_batch_size,
        output_bound=float(report.loss_lipschitz),
        thresholds=MappingProxyType(
            thresholds_for(
                report,
                config.scaling,
                config.thresholds,
                allow_unproven=config.allow_unproven,
            )
        ),
        multiplicity=multiplicity,
        rounding_margin=margin,
        proven=config.proven,
        groups=tuple(g.members for g in groups),
        event=config.step_event(),
    )
