"""Weight constraints applied after each optimizer step: ``clip``, ``fix`` and ``orthogonal``.

:func:`project` is the projection ``Pi`` of docs/design.md "Weight constraints". It runs in place
under :func:`torch.no_grad` on the weights the optimizer has just produced. Those weights are
already a private release (noisy gradient, earlier private weights), so projecting them is
post-processing and costs no privacy. It returns, for every parametric layer
(:class:`clipless.nn.Linear`, :class:`clipless.nn.Conv2d`), a *certified* upper bound on the
layer's Lipschitz constant after the projection. That number is the ``Lip_k`` that
backpropagation for bounds may use.

Modes (one mechanism with three parameters, docs/design.md "One mechanism, many modes"):

``"clip"``
    Lip-DP-SGD's ``ClipWeights`` (Barczewski & Ramon 2024, Algorithm 1 lines 21-31; thesis
    Algorithm 8): ``c = min(C, ||W||)`` and ``W <- c W / ||W||``. A layer whose certified bound
    is already ``<= C`` is left untouched, bit for bit. A larger one is rescaled so that its
    certified bound is ``<= C``. As in that paper, ``||.||`` is the operator norm (spectral
    normalisation). Here it is always a certified *upper* bound ``ub`` from
    :mod:`clipless.norms`, through the layer's own :meth:`~clipless.nn.Linear.lipschitz`, so the
    result is certified even though ``ub`` may exceed the true norm.
``"fix"``
    Fix-Lip-DP-SGD (same paper, section 4.1: ``u_k <- C`` in line 24 of Algorithm 1) and the
    Clipless DP-SGD paper, whose constraint ``Pi`` maps onto spectrally normalised weights
    (section 1, after eq. 3). Every layer is rescaled so that its certified bound equals ``C``.
    Floating-point rounding makes the result fall a hair below ``C`` (relative gap about
    ``1e-7`` times the ratio ``m ||W||_F / ub`` defined below). A zero weight stays zero.
``"orthogonal"``
    First a few Björck iterations (Björck & Bowie 1971, "An iterative algorithm for computing the
    best estimate of an orthogonal matrix", SIAM J. Numer. Anal. 8(2)): first order,
    ``X <- X (1.5 I - 0.5 X^T X)``. They start from ``X = W / ub_2`` with ``ub_2`` a certified
    bound on ``||W||_2`` (:func:`clipless.norms.dense_norm`), so ``||X||_2 <= 1 < sqrt(3)``,
    which is inside the region where the iteration converges. Each iteration maps every singular
    value through ``f(s) = 1.5 s - 0.5 s^3``, which is increasing on ``[0, 1]`` and fixes 1. The
    result is multiplied back by ``ub_2``, so the top singular value keeps its scale and the
    others are pulled up to it. Then comes the certified ``clip`` above. This is the GNP
    parametrisation of Anil, Lucas & Grosse 2019 ("Sorting out Lipschitz function
    approximation", ICML). The Lip-DP-SGD paper also performs a Björck orthogonalisation inside
    ``ClipWeights`` (section 3.3, "for fast and near-orthogonal convolutions", after Li et al.
    2019, "Orthogonal deep neural networks", IEEE TPAMI). The Björck step is applied *to the
    stored weights*, a few iterations per call, so orthogonality is reached over successive
    steps rather than by re-parametrising every forward.
    For :class:`~clipless.nn.Conv2d` the iteration acts on the kernel reshaped to
    ``(c_out, c_in kh kw)``, as deel-lip and the GNP literature do. This is only an
    *approximation* of an orthogonal convolution: an orthogonal reshaped kernel does not make
    the convolution orthogonal. Its operator norm lies between ``||K_mat||_2`` and
    ``sqrt(k_eff) ||K_mat||_2``. The certified rescale that follows uses the convolution's own
    certified bound, so the guarantee is exact even though orthogonality is approximate.
    Exception: when kernel = stride and there is no padding (``k_eff = 1``, e.g. the 2x2 stride-2
    convolutions of :func:`clipless.models.gnp_convnet`), the convolution applies ``K_mat`` to
    disjoint patches, so an orthogonal ``K_mat`` *is* an orthogonal convolution (GNP when
    ``c_out <= c_in kh kw``; checked against the Jacobian's SVD in ``tests/test_models.py``).

**Rounding.** After ``W' = fl(s W)`` with ``s = C / ub``, rounding to the weight's dtype
(float32: unit roundoff ``u = 2^-24``) can *raise* the norm slightly. By the triangle inequality,
``||W'|| <= s ub + m ||W' - s W||_F``. Here ``m = 1`` for a dense layer, and for a convolution
``m = sqrt(k_eff)`` (:meth:`clipless.nn.Conv2d.multiplicity`; ``||conv(E)|| <= sqrt(k_eff)
||E_mat||_2 <= sqrt(k_eff) ||E||_F``, proof in :func:`clipless.norms.conv_multiplicity`).
The residual ``||W' - s W||_F`` is computed in float64 and inflated to cover float64 rounding
(:func:`_fro_upper`). The scale is chosen as ``s = C' / (ub + slack)``, with ``C'`` equal to
``C`` less a ``NUMERIC_MARGIN`` for the float64 arithmetic. ``slack`` is first 3/4 of the
a-priori bound ``|fl(s w) - s w| <= (u + 2^-52) |s w|`` (typical rounding errors are about half
of it), then twice the rounding error that candidate measured, then the a-priori bound itself
(plus the subnormal spacing), which always passes.
Each candidate is *verified* with the inequality above before it is written. If none verifies
(never observed), the rounded weight is recertified exactly. So the returned bound is certified
for the weights actually stored.

**Carried bounds (``certify_every > 1``).** docs/design.md "Performance practice". An exact
certification (an SVD, or for a convolution the FFT symbol with one SVD per frequency) can cost
more than the step itself. After each projection the layer keeps ``(W_ref, ub_ref)``: a copy of the
projected weight and its certified bound. For the next weight ``W``,
``||W|| <= ub_ref + m ||W - W_ref||_F`` (triangle inequality, with ``m`` as above). This holds for
*any* change of the weights (optimizer step, manual edit), not only small ones. The right-hand side
is computed in float64 and inflated, so it is certified. It is used in place of an exact
certification unless (a) the exact one is due (every ``certify_every`` calls), (b) the carried bound
would force a rescale by more than the tolerance (``carried > (1 + tolerance) C``) *and* it may be
looser than that, or (c) in ``clip`` and ``orthogonal`` modes, the product since the last exact
certification of how much each carried rescale may have shrunk beyond need
(``carried / max(C, carried - looseness)``) would exceed ``1 + tolerance``. Looseness is judged by
two upper estimates of ``carried - exact``: the chain's accumulated slack (each carried step adds at
most ``2 m ||W - W_ref||_F``, because the certifiers are themselves ``m``-Lipschitz in the Frobenius
norm of the weight) and ``carried - lb``, with ``lb`` the power-iteration *lower* bound below. A
carried bound is never below the truth. Using it can only shrink the weights more than an exact
certification would: by about a factor ``1 + tolerance`` per chain at most, which ``clip`` does not
recover later (it never scales up). Rule of thumb: the carried bound grows by ``m ||dW||_F`` per
step. For a random 64x64x3x3 convolution ``m ||W||_F / ||W|| ~ 12``, so it pays off while steps
change the weight by less than about ``tolerance / 12`` (relative, Frobenius).

On an accelerator (:func:`clipless.norms.matrix_products_only`) the carried bound is computed on
the device from a device copy of ``ub_ref`` (no copy to the device per call), no power iteration
runs, and conditions (b) and (c), judged with the slack alone, are read back with the call's
bounds: when they hold, the *next* call certifies exactly. A layer whose weight is shared with
another layer is certified exactly every call there (each layer's rescale changes the weight the
other's bound describes).

**Power iteration steers, never certifies** (docs/design.md "Certified means upper bound"). Each
call runs a warm-started power iteration (:func:`clipless.norms.power_iteration` /
:func:`clipless.norms.conv_power_iteration`) whose vector is kept on the layer between calls,
in :func:`projection_state` (``.vector``, updated in place). Its lower bound decides when an exact
recertification is worth its cost and reports the tightness ``ub / lb``. It never enters a
returned bound.

The per-layer state lives in a plain attribute of the layer (not a buffer, so it stays out of the
``state_dict``). It is rebuilt, and an exact certification forced, whenever the weight's
shape/dtype/device or a convolution's geometry (stride, padding, recorded ``input_size``) changes.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from clipless import _certified, _validate, _workspace, norms
from clipless import nn as cnn
from clipless._certified import NUMERIC_MARGIN, UNIT_ROUNDOFF, inflate
from clipless.nn import Conv2d, Linear

__all__ = ["MODES", "Mode", "ProjectionState", "project", "projection_state"]

Mode = Literal["clip", "fix", "orthogonal"]
MODES: tuple[str, ...] = ("clip", "fix", "orthogonal")

_Layer = Linear | Conv2d
_STATE_ATTR = "_clipless_projection"
_EPS64 = 2.0 * UNIT_ROUNDOFF  # twice the float64 unit roundoff
_FIRST_POWER_ITERS = 20  # cold start of the steering power iteration
_WARM_POWER_ITERS = 2  # per call afterwards (warm-started)
_POWER_SEED = 0x5EED  # dedicated generator: never consumes the global RNG stream


@dataclass(eq=False)
class ProjectionState:
    """Per-layer state kept between calls of :func:`project` (read it for diagnostics only).

    Attributes:
        key: weight shape/dtype/device and convolution geometry; a change resets the state.
        vector: the power-iteration vector (warm start), updated *in place* across calls.
        lower_bound: power-iteration LOWER bound on the layer norm after the last projection
            (an estimate for diagnostics; ``upper_bound / lower_bound`` is the tightness).
        upper_bound: certified bound after the last projection (what :func:`project` returned).
        reference: copy of the weight after the last projection (only when ``certify_every > 1``).
        calls: number of projections of this layer since the state was (re)built.
        calls_since_exact: projections since the last exact certification.
        exact_certifications: number of exact certifications (calls of the layer's
            ``lipschitz()``) made by :func:`project` since the state was (re)built.
        slack: steering estimate of how much ``upper_bound`` may exceed the exact certifier's
            value (0 after an exact certification, grows by ``2 m ||W - W_ref||_F`` per carried
            step, scaled with the weights).
        carried_waste: product, over the carried calls since the last exact certification, of
            how much each rescale from a carried bound may have shrunk beyond need (1 after an
            exact certification); an exact certification is made once it would exceed
            ``1 + tolerance`` (they compound: ``"clip"`` never scales back up).
        recertify: the accelerator path's verdict on its last carried call (made after the
            call, from the values its one read brought back): certify exactly at the next one.
        device_bound: the accelerator path's ``upper_bound`` as a 0-dim tensor on the weight's
            device, where the next carried bound is computed (no copy to the device per call).
        pending: the verdict of the last projection while it is still on the device (a private
            step's projection; the fields above describe the call before it until it is read).
    """

    key: tuple[object, ...]
    vector: torch.Tensor | None = None
    lower_bound: float = 0.0
    upper_bound: float = math.inf
    reference: torch.Tensor | None = None
    calls: int = 0
    calls_since_exact: int = 0
    exact_certifications: int = 0
    slack: float = 0.0
    carried_waste: float = 1.0
    recertify: bool = False
    device_bound: torch.Tensor | None = None
    pending: _Seal | None = None


def projection_state(layer: torch.nn.Module) -> ProjectionState | None:
    """The :class:`ProjectionState` that :func:`project` keeps on ``layer`` (``None`` before)."""
    state = getattr(layer, _STATE_ATTR, None)
    return state if isinstance(state, ProjectionState) else None


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_args(
    mode: object, max_norm: object, certify_every: object, tolerance: object, bjorck_iters: object
) -> float:
    _validate.choice("mode", mode, MODES)
    c = _validate.finite_positive("max_norm", max_norm)
    _validate.positive_int("certify_every", certify_every)
    _validate.nonnegative_int("bjorck_iters", bjorck_iters)
    _validate.finite_nonnegative("tolerance", tolerance)
    return c


def _parametric_layers(model: torch.nn.Module) -> list[tuple[str, _Layer]]:
    layers: list[tuple[str, _Layer]] = []
    unknown: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, Linear | Conv2d):
            layers.append((path, module))
        elif isinstance(module, cnn.ParametricLipschitzModule):
            unknown.append(f"{path or '<root>'} ({type(module).__qualname__})")
    if unknown:
        raise TypeError(
            "project() constrains clipless.nn.Linear and clipless.nn.Conv2d only; it does not "
            "know how to rescale these parametric layers: " + ", ".join(unknown)
        )
    return layers


# --------------------------------------------------------------------------------------------
# Certified float64 helpers
# --------------------------------------------------------------------------------------------


def _fro_upper(t: torch.Tensor) -> float:
    """Certified upper bound on ``||t_true||_F`` from its float64 evaluation ``t``.

    ``t`` may carry one float64 rounding per entry (relative ``2^-53``, e.g. a difference); the
    sum of ``n`` squares in any order has relative error ``<= gamma_n``, and the square root one
    more rounding: the factor ``1 + (n + 4) 2^-52`` covers all of them (``n 2^-52 < 1/2``).
    """
    n = t.numel()
    if n == 0:
        return 0.0
    t = t.to(torch.float64)
    value = float(torch.linalg.vector_norm(t).item())
    if 2.0**-400 <= value < math.inf:
        # No square overflowed (the sum would be infinite); squares that underflow (entries
        # below 2^-537) lower the sum by at most n 2^-1074, i.e. the norm by sqrt(n) 2^-537,
        # inside the relative allowance: (n + 4) 2^-53 value >= (n + 4) 2^-453 is left after
        # the sum's rounding.
        return value * (1.0 + (n + 4) * _EPS64)
    lo, hi = norms._aminmax(t)
    biggest = max(-float(lo), float(hi))
    if not math.isfinite(biggest):
        return math.inf
    if biggest == 0.0:
        return 0.0
    # Entries so small that their squares underflow (or so large that they overflow): scale by
    # the exact power of two bringing the largest into [1, 2) (entries that underflow when
    # scaling down move the norm by at most sqrt(n) 2^-1074), then the same argument, with the
    # absolute allowance sqrt(n) 2^-537 added in scaled units.
    e = -math.frexp(biggest)[1] + 1
    scaled = t * 2.0 ** (e // 2) * 2.0 ** (e - e // 2)
    value = float(torch.linalg.vector_norm(scaled).item()) * (1.0 + (n + 4) * _EPS64)
    value = _certified.add(value, math.sqrt(n) * 2.0**-537 * (1.0 + _EPS64))
    return _certified.add(math.ldexp(value, -e), 2.0**-1074)


def _multiplicity(layer: _Layer) -> float:
    """``m`` with ``||layer operator of E|| <= m ||E||_F`` for a weight perturbation ``E``.

    Dense: ``||E||_2 <= ||E||_F`` (``m = 1``). Convolution: ``sqrt(k_eff)`` for the geometry that
    the layer's ``lipschitz()`` certifies (recorded ``input_size``, or size-free).
    """
    if isinstance(layer, Conv2d):
        return _certified.sqrt(layer.multiplicity())
    return 1.0


def _unit_roundoff(dtype: torch.dtype) -> tuple[float, float]:
    """``(u, sub)``: unit roundoff and smallest subnormal of a floating dtype."""
    info = torch.finfo(dtype)
    return float(info.eps) / 2.0, float(info.smallest_normal) * float(info.eps)


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------


def _key(layer: _Layer) -> tuple[object, ...]:
    w = layer.weight
    key: tuple[object, ...] = (type(layer), tuple(w.shape), w.dtype, w.device)
    if isinstance(layer, Conv2d):
        key += (layer.stride, layer.padding, layer.padding_mode, layer.input_size)
    return key


def _state_for(layer: _Layer) -> ProjectionState:
    key = _key(layer)
    state = projection_state(layer)
    if state is None or state.key != key:
        state = ProjectionState(key=key)
        object.__setattr__(layer, _STATE_ATTR, state)  # plain attribute, not in state_dict
    return state


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------


def _bjorck(weight: torch.Tensor, iters: int) -> None:
    """``iters`` first-order Björck steps on ``weight`` reshaped ``(out, -1)``, scale preserved.

    ``X_0 = W / ub_2`` with ``ub_2 >= ||W||_2`` certified, so every singular value of ``X_0`` is in
    ``[0, 1]`` and stays there (``f(s) = 1.5 s - 0.5 s^3`` maps ``[0, 1]`` onto itself, increasing):
    convergence to the orthogonal polar factor (full-rank part), Björck & Bowie 1971. The smaller
    Gram matrix is formed (``X (X^T X)`` or ``(X X^T) X``, equal).
    """
    if iters == 0:
        return
    mat = weight.detach().reshape(weight.shape[0], -1)
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32
    # a tensor (no host read on an accelerator); a zero weight stays zero (scale 1 below)
    scale = norms.norm_tensor(mat)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(work)
    x = mat.to(work) / scale
    tall = x.shape[0] >= x.shape[1]
    for _ in range(iters):
        x = 1.5 * x - 0.5 * (x @ (x.mT @ x) if tall else (x @ x.mT) @ x)
    weight.copy_((x * scale).reshape(weight.shape).to(weight.dtype))


def _lower_bound(layer: _Layer, state: ProjectionState) -> float:
    """Warm-started power iteration: a LOWER bound (steering only); ``state.vector`` in place."""
    w = layer.weight.detach()
    size = layer.input_size if isinstance(layer, Conv2d) else None
    if isinstance(layer, Conv2d):
        if size is None:
            return 0.0  # the operator's domain is unknown: no steering, carried bound only
        shape: tuple[int, ...] = (int(w.shape[1]), *size)
    else:
        shape = (int(w.shape[1]),)
    v = state.vector
    cold = (
        v is None
        or tuple(v.shape) != shape
        or v.dtype != w.dtype
        or v.device != w.device
        or not norms.all_finite(v)
        or float(torch.linalg.vector_norm(v)) == 0.0
    )
    if cold:
        gen = torch.Generator().manual_seed(_POWER_SEED)
        init = torch.randn(shape, generator=gen, dtype=torch.float64).to(w.device, w.dtype)
    else:
        assert v is not None
        init = v
    iters = _FIRST_POWER_ITERS if cold else _WARM_POWER_ITERS
    if isinstance(layer, Conv2d) and size is not None:
        result = norms.conv_power_iteration(
            w,
            stride=layer.stride,
            padding=layer.padding,
            padding_mode=layer.padding_mode,
            input_size=size,
            iters=iters,
            init=init,
        )
    else:
        result = norms.power_iteration(w, iters=iters, init=init)
    new = result.vector.detach().to(w.dtype)
    if v is None or cold:
        state.vector = new.clone()
    else:
        v.copy_(new)  # same tensor object across calls
    lower = float(result.lower_bound)
    return lower if math.isfinite(lower) else 0.0


def _certified_bound(
    layer: _Layer,
    state: ProjectionState,
    mode: str,
    max_norm: float,
    m: float,
    lower: float,
    certify_every: int,
    tolerance: float,
) -> float:
    """Exact certification (the layer's ``lipschitz()``) or the carried bound (module docstring)."""
    reference = state.reference
    due = certify_every == 1 or reference is None or state.calls_since_exact + 1 >= certify_every
    if not due:
        assert reference is not None
        w = layer.weight.detach()
        gap = m * _fro_upper(w.to(torch.float64) - reference.to(torch.float64))
        carried = inflate(state.upper_bound + gap)
        # Recertify early only when the carried bound would force a rescale by more than the
        # tolerance AND it may be looser than that: two upper estimates of how far ``carried``
        # may exceed the exact certifier's value are the chain's accumulated slack (the
        # certifiers are m-Lipschitz in the Frobenius norm of the weight, so each carried step
        # adds at most ``2 gap``) and ``carried - lb`` (power iteration: steering only).
        big_rescale = carried > (1.0 + tolerance) * max_norm
        slack = state.slack + 2.0 * gap
        looseness = min(slack, carried - lower) if lower > 0.0 else slack
        # What a rescale from the carried bound may shrink beyond need: the exact certifier's
        # value is at least carried - looseness, so at most carried / max(C, carried -
        # looseness). "clip" never scales back up, so these compound over a chain: certify
        # exactly once their product since the last exact certification would pass the
        # tolerance ("fix" is rescaled to C from the exact bound at the chain's end).
        waste = 1.0
        if carried > max_norm:
            waste = carried / max(max_norm, carried - looseness)
        compounding = mode != "fix" and state.carried_waste * waste > 1.0 + tolerance
        if not ((big_rescale and looseness > tolerance * carried) or compounding):
            state.calls_since_exact += 1
            state.slack = slack
            state.carried_waste *= waste
            return carried
    # certified (clipless.norms, float64, NUMERIC_MARGIN), without memoising a copy of a weight
    # that may be rescaled at once: _project_layer seeds the bound of the weight it keeps
    with layer.unmemoised():
        ub = float(layer.lipschitz())
    state.calls_since_exact = 0
    state.exact_certifications += 1
    state.slack = 0.0
    state.carried_waste = 1.0
    return ub


_CHUNK = 2**17  # float64 entries (1 MiB) converted at a time by _subtract


def _subtract(work: torch.Tensor, other: torch.Tensor) -> None:
    """``work -= other`` for a float64 ``work``, converting ``other`` about 1 MiB at a time.

    ``work.sub_(other)`` would first make a float64 copy of all of ``other`` (as large as the
    weight's float64 copy: 8 MiB for a ``1024 x 1024`` layer, the step's memory peak). The
    conversion is exact and each entry is subtracted once either way, so the result is bitwise
    the same. Contiguous CPU tensors only; others take ``sub_``.
    """
    if work.device.type != "cpu" or not (work.is_contiguous() and other.is_contiguous()):
        work.sub_(other)
        return
    flat, src = work.view(-1), other.view(-1)
    n = flat.numel()
    buffer = _workspace.scratch("float64.rows", (min(n, _CHUNK),), torch.float64)
    for start in range(0, n, _CHUNK):
        part = buffer[: min(_CHUNK, n - start)]
        part.copy_(src[start : start + _CHUNK])
        flat[start : start + _CHUNK].sub_(part)


def _rescale(layer: _Layer, ub: float, max_norm: float, m: float) -> tuple[float, float]:
    """Rescale ``layer.weight`` (certified bound ``ub``) so the stored weight's bound is ``<= C``.

    Returns ``(certified bound after, scale used)``; see "Rounding" in the module docstring.
    """
    weight = layer.weight
    shape = tuple(weight.shape)
    # Reused buffers (clipless._workspace: no page faults per step). The weight is written only
    # at the end, so each candidate starts again from its exact float64 copy in ``work``.
    work = _workspace.scratch("float64.work", shape, torch.float64, weight.device)
    candidate = _workspace.scratch("weight.draft", shape, weight.dtype, weight.device)
    work.copy_(weight.detach())  # exact
    n = work.numel()
    fro = _fro_upper(work)
    u, sub = _unit_roundoff(weight.dtype)
    target = max_norm / (1.0 + 4.0 * NUMERIC_MARGIN)

    def certify(scale: float) -> float:
        work.copy_(weight.detach()).mul_(scale)  # s W, one float64 rounding per entry
        candidate.copy_(work)  # fl(s W) in the weight's dtype
        if not norms.all_finite(candidate):
            return math.inf
        # ||fl(sW) - sW||_F: float64 residual (one rounding in s*W, one in the difference).
        _subtract(work, candidate)  # s W - fl(s W), one more float64 rounding per entry
        resid = _fro_upper(work) + _EPS64 * scale * fro
        return inflate(scale * ub + m * resid)

    # Slack per unit scale: first 3/4 of the a-priori rounding bound (typical rounding errors
    # are about half of it, so one candidate usually verifies), then what that candidate
    # measured, grown, then the a-priori bound itself.
    apriori = m * ((u + 2.0 * _EPS64) * fro) * 1.01
    subnormal = m * math.sqrt(n) * sub  # absolute rounding error of subnormal entries
    scale = max(target - subnormal, 0.0) / (ub + 0.75 * apriori)
    bound = certify(scale)
    if not math.isfinite(bound) or (scale == 0.0 and ub > 0.0):
        # a candidate beyond the dtype's range (e.g. "fix" to a C a float16 weight cannot
        # hold): the later, smaller scales would only zero the weight
        raise ValueError(
            f"rescaling the weight to a norm of {max_norm:g} overflows its dtype {weight.dtype} "
            f"(scale {scale:g}); choose a smaller max_norm or a wider dtype"
        )
    measured = max(0.0, bound / (1.0 + NUMERIC_MARGIN) / scale - ub) if scale > 0 else apriori
    for slack in [None, 2.0 * measured + 0.5 * apriori, apriori]:
        if slack is not None:
            scale = max(target - subnormal, 0.0) / (ub + slack)
            bound = certify(scale)
        if bound <= max_norm:
            weight.copy_(candidate)
            return bound, scale
    # Unreachable in exact analysis; stay certified anyway by recertifying the stored weight.
    if not norms.all_finite(candidate):
        raise ValueError(f"rescaling the weight by {scale:g} overflows its dtype {weight.dtype}")
    weight.copy_(candidate)
    bound = float(layer.lipschitz())
    if bound > max_norm:  # pragma: no cover - defensive
        raise RuntimeError(f"could not rescale the weight to a certified bound <= {max_norm}")
    return bound, scale


def _project_layer(
    path: str,
    layer: _Layer,
    mode: str,
    max_norm: float,
    certify_every: int,
    tolerance: float,
    bjorck_iters: int,
) -> float:
    weight = layer.weight
    if not norms.all_finite(weight):
        raise ValueError(
            f"the weight of layer {path or '<root>'!r} is not finite (NaN or inf); lower the "
            "learning rate or check the inputs"
        )
    state = _state_for(layer)
    state.calls += 1
    m = _multiplicity(layer)
    if mode == "orthogonal":
        _bjorck(weight, bjorck_iters)
    # the power iteration only steers carried bounds: without them it would be wasted work
    lower = _lower_bound(layer, state) if certify_every > 1 else 0.0
    ub = _certified_bound(layer, state, mode, max_norm, m, lower, certify_every, tolerance)
    if ub > max_norm or (mode == "fix" and ub > 0.0):
        bound, scale = _rescale(layer, ub, max_norm, m)
    else:
        bound, scale = ub, 1.0
    state.upper_bound = bound
    state.device_bound = None  # the accelerator path's copy is stale: it certifies afresh
    # The certified bound of the weight just written: lipschitz() (hence the bound report that
    # calibrates the next step's noise) reuses it instead of certifying the same weight again.
    layer.seed_bound(bound)
    state.lower_bound = lower * scale
    state.slack *= scale
    if certify_every > 1:
        if state.reference is None:
            state.reference = weight.detach().clone()
        else:
            state.reference.copy_(weight.detach())
    else:
        state.reference = None
    return bound


# --------------------------------------------------------------------------------------------
# The accelerator path: every layer certified and rescaled on its device, one host read
# --------------------------------------------------------------------------------------------

_ROUND_UP_T = 1.0 + 8.0 * _EPS64  # covers the few round-to-nearest tensor operations below


def _fro_upper_t(t: torch.Tensor) -> torch.Tensor:
    """:func:`_fro_upper` as a 0-dim float64 tensor, branch-free.

    Entries of a dtype no wider than float32 square exactly in float64, with neither overflow nor
    underflow (``|x|`` in ``[2^-149, 2^128]``): the float64 sum has only the ``(n + 4) u``
    relative error. Float64 entries are first scaled by the power of two bringing the largest
    into ``[0.5, 1)`` (exact but for underflow, whose loss is inside the ``sqrt(n) 2^-537``
    allowance), as ``_fro_upper`` does outside ``[2^-400, 2^400]``."""
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        value = torch.linalg.vector_norm(t, dtype=torch.float64)
        value = value * ((1.0 + (t.numel() + 4) * _EPS64) * _ROUND_UP_T)
        return torch.where(torch.isfinite(value), value, torch.full_like(value, math.inf))
    n = t.numel()
    amax = t.abs().amax()
    usable = torch.isfinite(amax) & (amax > 0)
    _, e = torch.frexp(torch.where(usable, amax, torch.ones_like(amax)))
    half = torch.div(e, 2, rounding_mode="floor")
    one = torch.ones_like(amax)
    scaled = t * torch.ldexp(one, -half) * torch.ldexp(one, half - e)
    value = torch.linalg.vector_norm(scaled) * (1.0 + (n + 4) * _EPS64)
    value = (value + math.sqrt(n) * 2.0**-537 * (1.0 + _EPS64)) * _ROUND_UP_T
    value = torch.ldexp(value, e) + 2.0**-1074
    value = torch.where(amax > 0, value, torch.zeros_like(value))
    return torch.where(torch.isfinite(amax), value, torch.full_like(value, math.inf))


def _rescale_t(
    weights: Sequence[torch.Tensor],
    ub: torch.Tensor,
    max_norm: float,
    consts: torch.Tensor,
    need: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_rescale` without host reads, for layers whose weights share a device and dtype:
    ``(bound after, scale, verified)``, each a vector over the layers.

    ``consts`` (from :func:`_rescale_constants`) holds per layer ``m`` and ``m sqrt(n) sub``.
    Where ``need`` holds a weight is multiplied in its own dtype by ``s``, the scale the whole
    a-priori slack allows (``s`` rounded down into the dtype, so the real product is ``s W`` with
    ``s`` exactly known); elsewhere by exactly 1, which keeps it bit for bit.

    Claim: the stored weight ``C = fl(s W)`` has ``||C|| <= bound <= max_norm``. Proof: each
    entry rounds once, ``|c_ij - s w_ij| <= u s |w_ij| + sub`` (relative error ``u`` in the
    normal range, absolute ``sub`` below it), so ``||C - s W||_F <= u s ||W||_F + sqrt(n) sub``;
    the layer's bound is homogeneous and its perturbation is at most ``m`` times the kernel's
    Frobenius norm (module docstring), so ``||C|| <= s ub + m (u s fro + sqrt(n) sub)``,
    evaluated in float64 and rounded up (``_ROUND_UP_T``, ``NUMERIC_MARGIN``). With
    ``s <= (target - m sqrt(n) sub) / (ub + m (u + 2 eps) fro)`` that is at most
    ``target (1 + margin) <= max_norm``. No entry overflows while ``s fro`` stays below the
    dtype's largest value (every ``|s w_ij| <= s fro``), checked too: ``verified`` is false only
    where ``s`` is not positive or the product could overflow (a non-finite weight or bound;
    "fix" beyond the dtype's range)."""
    dtype = weights[0].dtype
    fro = _fro_upper_vector(weights)
    m, subnormal = consts.unbind(0)
    u = _unit_roundoff(dtype)[0]
    target = max_norm / (1.0 + 4.0 * NUMERIC_MARGIN)
    apriori = m * ((u + 2.0 * _EPS64) * fro) * 1.01
    free = (target - subnormal).clamp_min(0.0)
    scale = (free / (ub + apriori)) * (1.0 - 4.0 * _EPS64)  # rounded down: <= the exact ratio
    s = scale.to(dtype)
    s = torch.where(s.to(torch.float64) > scale, torch.nextafter(s, torch.zeros_like(s)), s)
    s64 = s.to(torch.float64)  # exact
    resid = m * (u * (s64 * fro) * _ROUND_UP_T) + subnormal
    bound = (s64 * ub + resid) * ((1.0 + NUMERIC_MARGIN) * _ROUND_UP_T)
    safe = s64 * fro * (1.0 + 4.0 * _EPS64) <= float(torch.finfo(dtype).max)
    ok = torch.isfinite(bound) & (bound <= max_norm) & (s64 > 0) & safe
    write = need & ok
    factors = torch.where(write, s, torch.ones_like(s)).unbind()
    for weight, factor in zip(weights, factors, strict=True):
        weight.mul_(factor)
    one = torch.ones_like(scale)
    return torch.where(need, bound, ub), torch.where(write, s64, one), ok | ~need


def _fro_upper_vector(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`_fro_upper_t` of each weight, as one vector: the narrow dtypes' float64 norms are
    stacked and inflated together (one operator for all layers instead of four per layer)."""
    if weights[0].dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return torch.stack([_fro_upper_t(w.detach()) for w in weights])
    norms_ = torch.stack(
        [torch.linalg.vector_norm(w.detach(), dtype=torch.float64) for w in weights]
    )
    n = max(w.numel() for w in weights)  # (n + 4) u for the largest covers every layer
    value = norms_ * ((1.0 + (n + 4) * _EPS64) * _ROUND_UP_T)
    return torch.where(torch.isfinite(value), value, torch.full_like(value, math.inf))


_CONSTANTS: dict[tuple[object, ...], torch.Tensor] = {}


def _rescale_constants(layers: list[_Layer]) -> torch.Tensor:
    """``[[m], [m sqrt(n) sub]]`` per layer on the layers' device, cached by value: public
    geometry, built once rather than copied to the device every step (a blocking copy)."""
    weight = layers[0].weight
    sub = _unit_roundoff(weight.dtype)[1]
    ms = [_multiplicity(layer) for layer in layers]
    rows = (
        tuple(ms),
        tuple(
            m * math.sqrt(layer.weight.numel()) * sub for m, layer in zip(ms, layers, strict=True)
        ),
    )
    key = (weight.device, rows)
    cached = _CONSTANTS.get(key)
    if cached is None:
        if len(_CONSTANTS) > 64:
            _CONSTANTS.clear()
        cached = _CONSTANTS[key] = torch.tensor(rows, dtype=torch.float64, device=weight.device)
    return cached


def _project_on_device(
    layers: list[tuple[str, _Layer]],
    mode: str,
    max_norm: float,
    schedule: _Schedule,
    defer: bool = False,
) -> dict[str, float] | None:
    """:func:`project` computed on the weights' device (the accelerator path of
    :func:`clipless.norms.matrix_products_only`): the layers of each device and dtype are
    certified (exactly or by their carried bounds) and rescaled as vectors, and the bounds leave
    the device in one transfer per device.

    ``defer`` (the private step's projection): when every layer is on one device and none
    shares its weight, nothing is read; each layer is seeded with the provisional bound
    ``max_norm`` under a :class:`_Seal` (returns None). A verified rescale leaves a certified
    bound ``<= max_norm`` in every mode (:func:`_rescale_t`), so the provisional bound holds
    exactly when the seal's verdict is good, and the next private step reads that verdict with
    its checks, before its noise."""
    _settle_pending(layer for _, layer in layers)
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, _Layer]]] = {}
    for path, layer in layers:
        state = _state_for(layer)
        state.calls += 1
        if mode == "orthogonal":
            _bjorck(layer.weight, schedule.bjorck_iters)
        groups.setdefault((layer.weight.device, layer.weight.dtype), []).append((path, layer))
    # a weight shared by several layers is rescaled once per layer in a call, so no layer's
    # bound after its own rescale describes the stored weight: such layers never carry
    uses = collections.Counter(id(layer.weight) for _, layer in layers)
    results, exact = [], []
    for group in groups.values():
        members = [layer for _, layer in group]
        carry = [schedule.every > 1 and uses[id(layer.weight)] == 1 for layer in members]
        due = [
            not keep or _due(_state_for(layer), schedule.every)
            for layer, keep in zip(members, carry, strict=True)
        ]
        consts = _rescale_constants(members)
        ub, gap = _group_bounds(members, due, consts[0])
        need = ((ub > max_norm) if mode != "fix" else (ub > 0)) | ~torch.isfinite(ub)
        weights = [layer.weight for layer in members]
        bound, scale, verified = _rescale_t(weights, ub, max_norm, consts, need)
        _keep_references(members, bound, carry)
        results.append(torch.stack((ub, bound, scale, verified.to(torch.float64), gap)).T)
        exact += due
    ordered = [entry for group in groups.values() for entry in group]
    if defer and len({key[0] for key in groups}) == 1 and max(uses.values()) == 1:
        seal = _Seal(torch.cat(results), ordered, exact, mode, max_norm, schedule)
        for _, layer in ordered:
            _state_for(layer).pending = seal
            layer.seed_bound(max_norm, seal=seal)
        return None
    values = _read(results)
    out: dict[str, float] = {}
    rows = [row for block in values for row in block]
    for (path, layer), row, certified in zip(ordered, rows, exact, strict=True):
        shared = uses[id(layer.weight)] > 1
        outcome = _Outcome(row[0], row[1], row[2], row[3] > 0, row[4], certified, shared)
        out[path] = _settle(path, layer, outcome, mode, max_norm, schedule)
    return {path: out[path] for path, _ in layers}


class _Seal:
    """The verdict of a deferred device projection (:func:`_project_on_device` with ``defer``):
    its rows stay on the device until the private step's read, or the first other use of a
    provisional bound, brings them back (:class:`clipless.nn._base.BoundSeal`)."""

    def __init__(
        self,
        values: torch.Tensor,
        ordered: list[tuple[str, _Layer]],
        exact: list[bool],
        mode: str,
        max_norm: float,
        schedule: _Schedule,
    ) -> None:
        self.values = values
        self.done = False
        self._layers = ordered
        self._exact = exact
        self._mode, self._max_norm, self._schedule = mode, max_norm, schedule

    def settle(self, rows: list[list[float]] | None = None) -> None:
        """Judge every layer's row as :func:`_project_on_device` does after its read, and
        replace each provisional bound by the certified one (or drop them all and raise the
        first layer's error)."""
        if self.done:
            return
        self.done = True
        values = self.values.tolist() if rows is None else rows
        settled: dict[int, float | None] = {}
        try:
            for (path, layer), row, exact in zip(self._layers, values, self._exact, strict=True):
                outcome = _Outcome(row[0], row[1], row[2], row[3] > 0, row[4], exact, False)
                if outcome.verified and not outcome.bound <= self._max_norm:  # pragma: no cover
                    raise AssertionError(f"layer {path!r}: a verified rescale above max_norm")
                settled[id(layer)] = _settle(
                    path, layer, outcome, self._mode, self._max_norm, self._schedule, seed=False
                )
        finally:
            for _, layer in self._layers:
                _state_for(layer).pending = None
                layer.settle_seal(self, settled.get(id(layer)))
        self.values = self.values[:0]  # the rows are no longer needed on the device


def _settle_pending(layers: Iterable[_Layer]) -> None:
    """Settle the seals the layers' last deferred projections left (one read each; none after
    a private step, whose read settled them)."""
    for layer in layers:
        state = projection_state(layer)
        if state is not None and state.pending is not None:
            state.pending.settle()


@dataclass(frozen=True)
class _Schedule:
    """The certification schedule of one :func:`project` call."""

    every: int
    tolerance: float
    bjorck_iters: int


def _due(state: ProjectionState, every: int) -> bool:
    """Whether a layer that may carry its bound is certified exactly at this call."""
    return (
        state.reference is None
        or state.device_bound is None
        or state.recertify
        or state.calls_since_exact + 1 >= every
    )


def _group_bounds(
    layers: list[_Layer], exact: list[bool], ms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(certified bound, gap)`` of each layer, as vectors on the layers' device: the exact
    certificate (matrix products) where ``exact``, else the carried bound
    ``ub_ref + m ||W - W_ref||_F`` (module docstring) with its ``gap = m ||W - W_ref||_F``.

    The carried bound is the host path's: ``m`` and the Frobenius bound are certified upper
    bounds, and the product, the sum and the product by ``1 + NUMERIC_MARGIN`` are three
    round-to-nearest operations (relative error below ``4 2^-53``, far inside the margin)."""
    plans = [layer.lipschitz_plan() for layer, e in zip(layers, exact, strict=True) if e]
    certified = iter(norms.evaluate_plans(plans)) if plans else iter(())
    carried = [i for i, e in enumerate(exact) if not e]
    if not carried:
        ub_all = torch.stack(list(certified))
        return ub_all, torch.zeros_like(ub_all)
    pairs, refs = [], []
    for i in carried:
        state = _state_for(layers[i])
        assert state.reference is not None and state.device_bound is not None
        pairs.append((layers[i].weight.detach(), state.reference))
        refs.append(state.device_bound)
    # rows picked by views: an index tensor would be a copy to the device (a sync there)
    m = ms if len(carried) == len(layers) else torch.stack([ms[i] for i in carried])
    gap = _diff_fro_upper(pairs) * m
    ub = (torch.stack(refs) + gap) * (1.0 + NUMERIC_MARGIN)
    gaps = dict(zip(carried, gap.unbind(), strict=True))
    ubs = dict(zip(carried, ub.unbind(), strict=True))
    zero = torch.zeros((), dtype=torch.float64, device=ms.device)
    ub_list = [next(certified) if e else ubs[i] for i, e in enumerate(exact)]
    gap_list = [zero if e else gaps[i] for i, e in enumerate(exact)]
    return torch.stack(ub_list), torch.stack(gap_list)


def _diff_fro_upper(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Certified ``||W - W_ref||_F`` of each ``(W, W_ref)``, as one vector; each float64
    difference is reduced before the next is formed (one at a time at the memory peak).

    Two values of a dtype no wider than float32 are multiples of ``2^-149`` below ``2^128``:
    their float64 difference is 0 or at least ``2^-149`` and below ``2^129`` in magnitude, so
    its square neither underflows nor overflows, and the float64 norm has only the ``(n + 4) u``
    error of :func:`_fro_upper` (which also covers the difference's one rounding per entry).
    Float64 weights take :func:`_fro_upper_t`, which scales first."""
    if pairs[0][0].dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return torch.stack([_fro_upper_t(w.double() - r.double()) for w, r in pairs])
    value = torch.stack([torch.linalg.vector_norm(w.double() - r.double()) for w, r in pairs])
    n = max(w.numel() for w, _ in pairs)
    value = value * ((1.0 + (n + 4) * _EPS64) * _ROUND_UP_T)
    return torch.where(torch.isfinite(value), value, torch.full_like(value, math.inf))


def _keep_references(layers: list[_Layer], bound: torch.Tensor, carry: list[bool]) -> None:
    """After the rescale: the weight and certified bound of each layer that may carry its bound,
    where its next carried bound starts from."""
    for layer, value, keep in zip(layers, bound.unbind(), carry, strict=True):
        state = _state_for(layer)
        if not keep:
            state.reference, state.device_bound = None, None
            continue
        state.device_bound = value
        if state.reference is None:
            state.reference = layer.weight.detach().clone()
        else:
            state.reference.copy_(layer.weight.detach())


@dataclass(frozen=True)
class _Outcome:
    """One layer's row of the device projection, on the host."""

    ub: float
    bound: float
    scale: float
    verified: bool
    gap: float
    exact: bool
    shared: bool  # the weight is shared with another layer (rescaled again after this one)


def _read(blocks: list[torch.Tensor]) -> list[list[list[float]]]:
    """The values of ``blocks`` (2-D, float64) on the host: one transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(blocks):
        by_device.setdefault(t.device, []).append(i)
    values: list[list[list[float]]] = [[] for _ in blocks]
    for indices in by_device.values():
        flat = torch.cat([blocks[i] for i in indices]).tolist()
        start = 0
        for i in indices:
            values[i] = flat[start : start + blocks[i].shape[0]]
            start += blocks[i].shape[0]
    return values


def _settle(
    path: str,
    layer: _Layer,
    row: _Outcome,
    mode: str,
    max_norm: float,
    schedule: _Schedule,
    seed: bool = True,
) -> float:
    """Record one layer's device projection on the host (or raise what :func:`_project_layer`
    raises: a non-finite weight, a rescale beyond the dtype), and judge a carried call as
    :func:`_certified_bound` judges it before: on the device the verdict comes after the call,
    from its one read, so the *next* call is exact when this one may have over-shrunk beyond
    the tolerance (the slack is the only looseness estimate: no power iteration runs here)."""
    if not math.isfinite(row.ub):
        raise ValueError(
            f"the weight of layer {path or '<root>'!r} is not finite (NaN or inf); lower the "
            "learning rate or check the inputs"
        )
    if not row.verified:  # pragma: no cover - the a-priori slack verifies unless dtype overflows
        raise ValueError(
            f"rescaling the weight of layer {path or '<root>'!r} to a certified norm of at most "
            f"the constraint overflows its dtype {layer.weight.dtype}; choose a smaller max_norm "
            "or a wider dtype"
        )
    state = _state_for(layer)
    if row.exact:
        state.calls_since_exact, state.slack, state.carried_waste = 0, 0.0, 1.0
        state.exact_certifications += 1
        state.recertify = False
    else:
        state.calls_since_exact += 1
        state.slack += 2.0 * row.gap
        waste = row.ub / max(max_norm, row.ub - state.slack) if row.ub > max_norm else 1.0
        state.carried_waste *= waste
        loose = row.ub > (1.0 + schedule.tolerance) * max_norm
        loose = loose and state.slack > schedule.tolerance * row.ub
        compounding = mode != "fix" and state.carried_waste > 1.0 + schedule.tolerance
        state.recertify = loose or compounding
    state.slack *= row.scale
    state.upper_bound = row.bound
    state.lower_bound = 0.0
    if row.shared:
        # ``bound`` certifies the weight after this layer's rescale, not after the other
        # layers' ones (``"fix"`` may scale up): the caller certifies the stored weight
        layer.forget_bound()
    elif seed:
        layer.seed_bound(row.bound)
    return row.bound


def project(
    model: torch.nn.Module,
    mode: Mode = "clip",
    max_norm: float = 1.0,
    *,
    certify_every: int = 1,
    tolerance: float = 0.01,
    bjorck_iters: int = 3,
) -> dict[str, float]:
    """Project every parametric layer of ``model`` onto its constraint set, in place.

    Args:
        model: a clipless model (checked by :func:`clipless.nn.validate`).
        mode: ``"clip"`` (Lip-DP-SGD ``ClipWeights``: rescale only layers whose certified bound
            exceeds ``max_norm``), ``"fix"`` (Fix-Lip-DP-SGD / Clipless DP-SGD: rescale every layer
            to a certified bound of ``max_norm``) or ``"orthogonal"`` (Björck iterations toward an
            orthogonal weight, then ``"clip"``). Details and proofs: module docstring.
        max_norm: ``C``, the per-layer Lipschitz constraint (finite, ``> 0``).
        certify_every: exact certification every this many calls per layer. In between, a
            certified carried bound ``ub_ref + m ||W - W_ref||_F`` is used (1, the default:
            exact every call).
        tolerance: relative over-shrink accepted from a carried bound. An exact certification
            is made early when the carried bound would rescale by more than ``1 + tolerance``
            and may be that loose, or when the over-shrinks of the carried calls since the last
            exact certification compound past it (module docstring). On an accelerator (one
            read per call) this verdict is made after the call, so the next call is the exact
            one: a single carried call may shrink beyond the tolerance. ``clip`` never scales
            back up, so over many chains the weight can still settle below ``C`` under
            noise-like updates (measured: 9% below after 100 calls of steps of 0.8% of ``C``
            at ``certify_every=20``); ``certify_every=1`` never over-shrinks. Irrelevant when
            ``certify_every=1``.
        bjorck_iters: first-order Björck iterations per call in ``"orthogonal"`` mode.

    Returns:
        ``{module path: certified upper bound on the layer's Lipschitz constant after the
        projection}`` for every :class:`~clipless.nn.Linear` and :class:`~clipless.nn.Conv2d`, in
        ``named_modules()`` order. ``clip`` / ``orthogonal`` give values ``<= max_norm``;
        ``fix`` gives ``max_norm`` up to a relative ``~1e-7 m ||W||_F / ub`` rounding gap
        (0 for a zero weight). A :class:`~clipless.nn.Conv2d` that has not run a forward yet is
        certified with the size-free bound, which holds for every input size but is looser: run
        one forward first (as :func:`clipless.bounds.report` does).

    Raises:
        ValueError: a bad ``mode``, ``max_norm``, ``certify_every``, ``tolerance`` or
            ``bjorck_iters`` value, or a non-finite weight.
        TypeError: ``model`` is not a clipless model, contains a parametric layer that is not a
            ``Linear`` / ``Conv2d``, or an argument has the wrong type.
    """
    c = _check_args(mode, max_norm, certify_every, tolerance, bjorck_iters)
    cnn.validate(model)
    out = _project(model, mode, c, _Schedule(certify_every, float(tolerance), bjorck_iters))
    assert out is not None
    return out


def project_in_step(model: torch.nn.Module, mode: str, max_norm: float, certify_every: int) -> None:
    """:func:`project` as the private step runs it (arguments checked when it was configured):
    on an accelerator its verdict stays on the device, sealed, until the next step's one read
    (:func:`_project_on_device` with ``defer``)."""
    _project(model, mode, max_norm, _Schedule(certify_every, 0.01, 3), defer=True)


def _project(
    model: torch.nn.Module, mode: str, c: float, schedule: _Schedule, defer: bool = False
) -> dict[str, float] | None:
    """The projection of :func:`project` (arguments checked); None when its verdict is sealed."""
    layers = _parametric_layers(model)
    with torch.no_grad():
        if all(norms.matrix_products_only(m.weight) for _, m in layers):
            out = _project_on_device(layers, mode, c, schedule, defer)
            if out is None:
                return None
        else:
            every, tolerance, iters = schedule.every, schedule.tolerance, schedule.bjorck_iters
            out = {
                path: _project_layer(path, layer, mode, c, every, tolerance, iters)
                for path, layer in layers
            }
        # A weight shared by several layers was projected once per layer: the values of the
        # earlier layers are stale (their certified lipschitz() is not: it checks the weight).
        owners = collections.Counter(id(layer.weight) for _, layer in layers)
        for path, layer in layers:
            if owners[id(layer.weight)] > 1:
                out[path] = float(layer.lipschitz())
    return out
