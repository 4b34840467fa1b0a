"""Tests of :func:`clipless.constraints.project` against exact references.

References: the exact spectral norm of a dense weight (``torch.linalg.matrix_norm``, float64) and
of a small convolution (SVD of its explicit matrix, built by applying it to the standard basis in
float64); exact per-sample gradients from ``torch.func`` (``vmap(grad)``) against
:func:`clipless.bounds.sensitivities` after projection.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, vmap

from _exact import conv_exact, dense_exact, exact
from clipless import bounds, constraints, norms
from clipless import nn as cnn
from clipless.constraints import project, projection_state

REL = 1e-6
Layer = cnn.Linear | cnn.Conv2d


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors only: intra-op threads just contend on the shared 2-core runner (7x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_linear(
    rows: int, cols: int, norm: float, seed: int, dtype: torch.dtype = torch.float32
) -> cnn.Linear:
    """A Linear whose weight is Gaussian, scaled to exact spectral norm ``norm`` (approximately)."""
    layer = cnn.Linear(cols, rows, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    w = w * (norm / float(torch.linalg.matrix_norm(w, ord=2)))
    with torch.no_grad():
        layer.weight.copy_(w.to(dtype))
    return layer


def make_conv(
    c_in: int,
    c_out: int,
    kernel: int,
    stride: int,
    padding: int,
    padding_mode: str,
    size: int,
    norm: float,
    seed: int,
) -> cnn.Conv2d:
    """A Conv2d (input size recorded by one forward) with a Gaussian kernel of exact norm ~norm."""
    layer = cnn.Conv2d(
        c_in, c_out, kernel, stride=stride, padding=padding, padding_mode=padding_mode
    )
    layer(torch.zeros(1, c_in, size, size))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
        layer.weight.mul_(norm / conv_exact(layer))
    return layer


LAYERS: dict[str, Callable[[float, int], Layer]] = {
    "dense-wide": lambda norm, seed: make_linear(6, 11, norm, seed),
    "dense-tall": lambda norm, seed: make_linear(13, 5, norm, seed),
    "dense-square": lambda norm, seed: make_linear(9, 9, norm, seed),
    "conv-zeros": lambda norm, seed: make_conv(2, 3, 3, 1, 1, "zeros", 6, norm, seed),
    "conv-strided": lambda norm, seed: make_conv(3, 2, 3, 2, 1, "zeros", 7, norm, seed),
    "conv-circular": lambda norm, seed: make_conv(2, 2, 3, 1, 1, "circular", 5, norm, seed),
}


# --------------------------------------------------------------------------------------------
# Single layers, each mode
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [1.0, 2.5])
@pytest.mark.parametrize("factor", [10.0, 0.1])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_clip(kind: str, factor: float, max_norm: float) -> None:
    layer = LAYERS[kind](factor * max_norm, 1)
    before = layer.weight.detach().clone()
    certified_before = layer.lipschitz()
    out = project(layer, "clip", max_norm)
    assert list(out) == [""]
    bound = out[""]
    assert bound <= max_norm * (1 + REL)
    assert layer.lipschitz() <= max_norm * (1 + REL)
    assert exact(layer) <= max_norm * (1 + REL)
    assert exact(layer) <= bound * (1 + 1e-12)
    if factor < 1:
        assert torch.equal(layer.weight.detach(), before)  # below C: untouched, bit for bit
        assert bound == certified_before
    else:
        assert bound >= max_norm * (1 - REL)  # rescaled onto the boundary, not below it
        assert not torch.equal(layer.weight.detach(), before)


@pytest.mark.parametrize("max_norm", [1.0, 2.5])
@pytest.mark.parametrize("factor", [10.0, 0.1])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_fix(kind: str, factor: float, max_norm: float) -> None:
    layer = LAYERS[kind](factor * max_norm, 2)
    bound = project(layer, "fix", max_norm)[""]
    assert bound <= max_norm
    assert abs(bound - max_norm) <= REL * max_norm
    assert abs(layer.lipschitz() - max_norm) <= REL * max_norm
    assert exact(layer) <= max_norm * (1 + REL)
    assert exact(layer) <= bound * (1 + 1e-12)


def test_fix_zero_weight_stays_zero() -> None:
    layer = cnn.Linear(4, 3)
    with torch.no_grad():
        layer.weight.zero_()
    assert project(layer, "fix", 1.0) == {"": 0.0}
    assert not bool(layer.weight.any())


@pytest.mark.parametrize("kind", ["dense-wide", "dense-tall", "dense-square"])
def test_orthogonal_dense(kind: str) -> None:
    layer = LAYERS[kind](7.0, 3)
    sv0 = torch.linalg.svdvals(layer.weight.detach().double())
    assert float(sv0.min() / sv0.max()) < 0.5  # far from orthogonal at the start
    for _ in range(30):
        bound = project(layer, "orthogonal", 1.0)[""]
        assert bound <= 1.0
        assert exact(layer) <= 1.0 * (1 + REL)
    sv = torch.linalg.svdvals(layer.weight.detach().double())
    assert float(sv.min() / sv.max()) > 0.999
    assert float(sv.max()) >= 1.0 - 1e-5  # at C: scale kept, then clipped


def test_orthogonal_keeps_scale_below_c() -> None:
    """Björck preserves the top singular value; below C nothing is rescaled (clip semantics)."""
    layer = make_linear(8, 8, 0.5, 4)
    for _ in range(30):
        project(layer, "orthogonal", 1.0)
    sv = torch.linalg.svdvals(layer.weight.detach().double())
    assert float(sv.min()) > 0.5 * 0.999
    # Björck scales back by a certified bound: the accelerator's Gram iteration is up to ~1e-4
    # looser than the CPU's certificate before the weight is orthogonal, which the scale keeps
    drift = 1e-3 if norms.ACCELERATOR_PATH_ON_CPU else 1e-5
    assert float(sv.max()) <= 0.5 * (1 + drift)


@pytest.mark.parametrize("kind", ["conv-zeros", "conv-strided", "conv-circular"])
def test_orthogonal_conv(kind: str) -> None:
    layer = LAYERS[kind](5.0, 5)
    assert isinstance(layer, cnn.Conv2d)
    for _ in range(30):
        bound = project(layer, "orthogonal", 1.0)[""]
        assert bound <= 1.0
        assert conv_exact(layer) <= 1.0 * (1 + REL)
        assert conv_exact(layer) <= bound * (1 + 1e-12)
    mat = layer.weight.detach().double().reshape(layer.out_channels, -1)
    sv = torch.linalg.svdvals(mat)
    assert float(sv.min() / sv.max()) > 0.999  # the reshaped kernel is (near) orthogonal


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    log_norm=st.floats(-3.0, 3.0),
    max_norm=st.floats(0.01, 100.0),
    mode=st.sampled_from(["clip", "fix", "orthogonal"]),
    double=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_rescale_is_certified_for_the_stored_weights(
    rows: int,
    cols: int,
    log_norm: float,
    max_norm: float,
    mode: str,
    double: bool,
    seed: int,
) -> None:
    """Rounding the rescaled weight to its dtype never breaks the certified bound."""
    dtype = torch.float64 if double else torch.float32
    layer = make_linear(rows, cols, 10.0**log_norm, seed, dtype=dtype)
    for _ in range(3):
        bound = project(layer, mode, max_norm)[""]  # type: ignore[arg-type]
        truth = dense_exact(layer.weight)
        assert truth <= bound * (1 + 1e-12)
        assert bound <= max_norm
        if mode == "fix":
            assert bound >= max_norm * (1 - REL)


# --------------------------------------------------------------------------------------------
# Carried bounds (certify_every > 1)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path's carried bounds (power-iteration steering, each verdict before its call),
    in the accelerator-path run too (the accelerator's: tests/test_carried_on_device.py)."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", False)


def _perturb(layer: Layer, rel: float, seed: int, aligned: bool = False) -> None:
    """Add a step of relative Frobenius size ``rel``: random, or along the weight (worst case)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = layer.weight
        step = w.detach().clone() if aligned else torch.randn(w.shape, generator=gen)
        layer.weight.add_(step * (rel * float(w.norm()) / float(step.norm())))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 24),
    cols=st.integers(1, 24),
    steps=st.lists(st.floats(1e-6, 2.0), min_size=1, max_size=6),
    max_norm=st.sampled_from([0.3, 1.0, 1e3]),
    mode=st.sampled_from(["clip", "fix", "orthogonal"]),
    aligned=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_carried_bound_is_an_upper_bound_dense(
    rows: int,
    cols: int,
    steps: list[float],
    max_norm: float,
    mode: str,
    aligned: bool,
    seed: int,
) -> None:
    layer = make_linear(rows, cols, 1.0, seed)
    project(layer, mode, max_norm, certify_every=10**6, tolerance=1e9)  # type: ignore[arg-type]
    for i, rel in enumerate(steps):
        _perturb(layer, rel, seed + i + 1, aligned)
        bound = project(layer, mode, max_norm, certify_every=10**6, tolerance=1e9)[""]  # type: ignore[arg-type]
        assert dense_exact(layer.weight) <= bound * (1 + 1e-12)
        if mode != "fix" or max_norm < 1e3:
            assert bound <= max_norm
    state = projection_state(layer)
    assert state is not None
    assert state.exact_certifications == 1  # every later bound was carried
    assert state.calls == len(steps) + 1


@settings(max_examples=20, deadline=None)
@given(
    c_in=st.integers(1, 3),
    c_out=st.integers(1, 3),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 1),
    circular=st.booleans(),
    size=st.integers(3, 6),
    steps=st.lists(st.floats(1e-5, 1.0), min_size=1, max_size=4),
    mode=st.sampled_from(["clip", "fix"]),
    aligned=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_carried_bound_is_an_upper_bound_conv(
    c_in: int,
    c_out: int,
    kernel: int,
    stride: int,
    padding: int,
    circular: bool,
    size: int,
    steps: list[float],
    mode: str,
    aligned: bool,
    seed: int,
) -> None:
    layer = make_conv(
        c_in, c_out, kernel, stride, padding, "circular" if circular else "zeros", size, 2.0, seed
    )
    project(layer, mode, 1.0, certify_every=10**6, tolerance=1e9)  # type: ignore[arg-type]
    for i, rel in enumerate(steps):
        _perturb(layer, rel, seed + i + 1, aligned)
        bound = project(layer, mode, 1.0, certify_every=10**6, tolerance=1e9)[""]  # type: ignore[arg-type]
        assert conv_exact(layer) <= bound * (1 + 1e-12)
        assert bound <= 1.0
    state = projection_state(layer)
    assert state is not None and state.exact_certifications == 1


def test_carried_conv_increment_needs_the_multiplicity() -> None:
    """Constant kernels: the DC frequency makes ``||conv(dK)|| = sqrt(k_eff) ||dK||_F`` exactly.

    Circular 3x3 convolution with padding 1 on one channel: ``||conv(c 1)|| = 9 c`` and
    ``||c 1||_F = 3 c``, so the carried bound ``9 c + 3 ||dK||_F`` is exactly tight: any factor
    smaller than ``sqrt(k_eff) = 3`` on the increment would under-estimate.
    """
    layer = cnn.Conv2d(1, 1, 3, padding=1, padding_mode="circular")
    layer(torch.zeros(1, 1, 4, 4))
    with torch.no_grad():
        layer.weight.fill_(0.1)
    first = project(layer, "clip", 100.0, certify_every=100, tolerance=1e9)[""]
    assert first == pytest.approx(0.9, rel=1e-6)
    with torch.no_grad():
        layer.weight.add_(0.05)
    bound = project(layer, "clip", 100.0, certify_every=100, tolerance=1e9)[""]
    truth = conv_exact(layer)
    assert truth == pytest.approx(1.35, rel=1e-6)
    assert truth <= bound <= truth * (1 + 1e-6)  # certified and tight
    state = projection_state(layer)
    assert state is not None and state.exact_certifications == 1


@pytest.mark.usefixtures("host_path")
def test_certify_every_schedules_exact_certifications() -> None:
    layer = make_conv(2, 2, 3, 1, 1, "zeros", 5, 0.5, 7)  # below C: clip never rescales
    calls = 0
    original = layer.lipschitz

    def counting(*args: object, **kwargs: object) -> float:
        nonlocal calls
        calls += 1
        return original()

    layer.lipschitz = counting  # type: ignore[method-assign]
    for i in range(10):
        _perturb(layer, 1e-3, i)
        project(layer, "clip", 1.0, certify_every=4)
    assert calls == 3  # calls 1, 5 and 9
    state = projection_state(layer)
    assert state is not None and state.exact_certifications == 3


@pytest.mark.usefixtures("host_path")
def test_carried_bound_recertifies_when_too_loose() -> None:
    """``fix`` always rescales: with tolerance 0 every call certifies exactly; large, none does."""
    strict = make_linear(5, 4, 3.0, 8)
    lax = make_linear(5, 4, 3.0, 8)
    for i in range(5):
        _perturb(strict, 1e-2, i)
        _perturb(lax, 1e-2, i)
        project(strict, "fix", 1.0, certify_every=100, tolerance=0.0)
        project(lax, "fix", 1.0, certify_every=100, tolerance=10.0)
    s_strict, s_lax = projection_state(strict), projection_state(lax)
    assert s_strict is not None and s_strict.exact_certifications == 5
    assert s_lax is not None and s_lax.exact_certifications == 1


@pytest.mark.usefixtures("host_path")
@pytest.mark.parametrize(("increment", "expected"), [(0.005, 3), (0.05, 7)])
def test_small_rescales_use_the_carried_bound(increment: float, expected: int) -> None:
    """``clip`` at the boundary: a carried rescale by less than ``1 + tolerance`` is accepted,
    until the rescales compound past it.

    Each step raises the carried bound by ``increment`` (``m ||dW||_F``) and the exact norm by
    less. With the default tolerance 0.01 every single rescale of the 0.005 steps stays below
    ``1.01``, but what they may have shrunk beyond need compounds (``clip`` never scales back
    up): an exact certification is made once the product would pass ``1.01`` (calls 2 and 5
    here; before the audit's fix none was, and the weight drifted below ``C``). Steps of 0.05
    force one every call.
    """
    layer = make_conv(2, 3, 3, 1, 1, "zeros", 5, 3.0, 10)
    project(layer, "clip", 1.0, certify_every=100)
    for i in range(6):
        rel = increment / (math.sqrt(layer.multiplicity()) * float(layer.weight.detach().norm()))
        _perturb(layer, rel, 20 + i, aligned=True)  # pushes the norm above C every time
        bound = project(layer, "clip", 1.0, certify_every=100)[""]
        assert conv_exact(layer) <= bound * (1 + 1e-12)
        assert bound <= 1.0
        assert conv_exact(layer) >= 1.0 / 1.01**2
    state = projection_state(layer)
    assert state is not None and state.exact_certifications == expected


@pytest.mark.usefixtures("host_path")
def test_geometry_change_forces_exact_certification() -> None:
    layer = make_conv(2, 2, 3, 1, 1, "zeros", 5, 0.5, 9)
    project(layer, "clip", 1.0, certify_every=100)
    project(layer, "clip", 1.0, certify_every=100)
    state = projection_state(layer)
    assert state is not None and state.exact_certifications == 1
    layer(torch.zeros(1, 2, 7, 7))  # a new input size: the conv operator changed
    bound = project(layer, "clip", 1.0, certify_every=100)[""]
    new_state = projection_state(layer)
    assert new_state is not None and new_state is not state
    assert new_state.exact_certifications == 1
    assert new_state.vector is not None and tuple(new_state.vector.shape) == (2, 7, 7)
    assert conv_exact(layer) <= bound * (1 + 1e-12)


def test_training_loop_with_carried_bounds_stays_certified() -> None:
    model = cnn.Sequential(
        cnn.InputNorm(1.0),
        cnn.Conv2d(2, 4, 3, padding=1),
        cnn.GroupSort(2),
        cnn.Flatten(),
        cnn.Linear(4 * 5 * 5, 3),
    )
    model(torch.zeros(1, 2, 5, 5))
    conv, dense = model[1], model[4]
    assert isinstance(conv, cnn.Conv2d) and isinstance(dense, cnn.Linear)
    modes: tuple[constraints.Mode, ...] = ("clip", "fix", "orthogonal")
    for mode in modes:
        for step in range(8):
            for i, p in enumerate(model.parameters()):
                gen = torch.Generator().manual_seed(100 * step + i)
                with torch.no_grad():
                    p.add_(1e-3 * torch.randn(p.shape, generator=gen))
            out = project(model, mode, 1.0, certify_every=3)
            assert set(out) == {"1", "4"}
            assert conv_exact(conv) <= out["1"] * (1 + 1e-12)
            assert dense_exact(dense.weight) <= out["4"] * (1 + 1e-12)
            assert max(out.values()) <= 1.0


# --------------------------------------------------------------------------------------------
# Whole models: sensitivities still bound exact per-sample gradients after projection
# --------------------------------------------------------------------------------------------


def _dense_model() -> tuple[cnn.Sequential, tuple[int, ...]]:
    model = cnn.Sequential(
        cnn.InputNorm(1.5),
        cnn.Linear(6, 8),
        cnn.GroupSort(2),
        cnn.Linear(8, 8, bias=False),
        cnn.ReLU(),
        cnn.Linear(8, 3),
    )
    return model, (6,)


def _residual_model() -> tuple[cnn.Sequential, tuple[int, ...]]:
    model = cnn.Sequential(
        cnn.InputNorm(1.0),
        cnn.Linear(5, 6),
        cnn.Residual(
            cnn.Sequential(cnn.Linear(6, 6), cnn.GroupSort(2), cnn.Linear(6, 6)), mode="average"
        ),
        cnn.ReLU(),
        cnn.Linear(6, 4),
    )
    return model, (5,)


def _conv_model() -> tuple[cnn.Sequential, tuple[int, ...]]:
    model = cnn.Sequential(
        cnn.InputNorm(2.0),
        cnn.Conv2d(2, 4, 3, padding=1),
        cnn.GroupSort(2),
        cnn.Residual(
            cnn.Sequential(cnn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), cnn.ReLU())
        ),
        cnn.Conv2d(4, 2, 3, stride=2, padding=1),
        cnn.Flatten(),
        cnn.Linear(2 * 3 * 3, 3),
    )
    return model, (2, 5, 5)


MODELS = {"dense": _dense_model, "residual": _residual_model, "conv": _conv_model}


def _per_sample_grad_norms(
    model: torch.nn.Module, loss: cnn.CrossEntropyLoss, x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    params = {name: p.detach() for name, p in model.named_parameters()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return {
        n: torch.linalg.vector_norm(g.reshape(g.shape[0], -1).double(), dim=1)
        for n, g in grads.items()
    }


@pytest.mark.parametrize("mode", ["clip", "fix", "orthogonal"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_sensitivities_bound_per_sample_gradients_after_projection(name: str, mode: str) -> None:
    torch.manual_seed(11)
    model, shape = MODELS[name]()
    model(torch.zeros(1, *shape))
    with torch.no_grad():  # push every layer far from the constraint, both ways
        for i, p in enumerate(model.parameters()):
            p.mul_(4.0 if i % 2 == 0 else 0.2).add_(0.1 * torch.randn_like(p))
    out = project(model, mode, 1.0)  # type: ignore[arg-type]
    layers = dict(model.named_modules())
    for path, bound in out.items():
        assert isinstance(layers[path], cnn.Linear | cnn.Conv2d)
        assert bound <= 1.0
        assert exact(layers[path]) <= bound * (1 + 1e-12)
    assert len(out) == sum(isinstance(m, cnn.Linear | cnn.Conv2d) for m in model.modules())
    loss = cnn.CrossEntropyLoss(reduction="sum")
    sens = bounds.sensitivities(model, loss, shape)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(32, *shape, generator=gen) * torch.logspace(-1, 1.5, 32).reshape(
        -1, *([1] * len(shape))
    )
    labels = torch.randint(0, 4 if name == "residual" else 3, (32,), generator=gen)
    y = F.one_hot(labels, 4 if name == "residual" else 3).float()
    norms = _per_sample_grad_norms(model, loss, x, y)
    for pname, n in norms.items():
        assert float(n.max()) <= sens[pname] * (1 + 1e-6), pname
        assert float(n.max()) > 0.0


# --------------------------------------------------------------------------------------------
# Arguments, state, bookkeeping
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"mode": "spectral"}, ValueError, "mode"),
        ({"mode": None}, ValueError, "mode"),
        ({"max_norm": 0.0}, ValueError, "max_norm"),
        ({"max_norm": -1.0}, ValueError, "max_norm"),
        ({"max_norm": math.inf}, ValueError, "max_norm"),
        ({"max_norm": math.nan}, ValueError, "max_norm"),
        ({"max_norm": "1"}, TypeError, "max_norm"),
        ({"certify_every": 0}, ValueError, "certify_every"),
        ({"certify_every": 2.0}, TypeError, "certify_every"),
        ({"tolerance": -0.1}, ValueError, "tolerance"),
        ({"tolerance": math.nan}, ValueError, "tolerance"),
        ({"bjorck_iters": -1}, ValueError, "bjorck_iters"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], name: str) -> None:
    layer = make_linear(3, 3, 2.0, 0)
    before = layer.weight.detach().clone()
    with pytest.raises(error, match=name):
        project(layer, **kwargs)  # type: ignore[arg-type]
    assert torch.equal(layer.weight.detach(), before)


def test_rejects_non_clipless_models_and_non_finite_weights() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Linear"):
        project(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    last = cnn.Linear(2, 2)
    model = cnn.Sequential(cnn.Linear(2, 2), cnn.ReLU(), last)
    with torch.no_grad():
        last.weight[0, 0] = math.nan
    with pytest.raises(ValueError, match="'2'"):
        project(model)


def test_power_iteration_steers_carried_bounds_only() -> None:
    """Exact certification at every call (the default) runs no power iteration."""
    layer = make_linear(6, 5, 3.0, 1)
    project(layer, "clip", 1.0)
    state = projection_state(layer)
    assert state is not None and state.vector is None and state.lower_bound == 0.0


@pytest.mark.usefixtures("host_path")
def test_power_iteration_state_persists_and_spares_global_rng() -> None:
    for layer in (make_linear(6, 5, 3.0, 1), make_conv(2, 3, 3, 1, 1, "zeros", 5, 3.0, 1)):
        rng = torch.random.get_rng_state()
        project(layer, "clip", 1.0, certify_every=2)
        state = projection_state(layer)
        assert state is not None and state.vector is not None
        vector, snapshot = state.vector, state.vector.clone()
        _perturb(layer, 0.3, 5)
        project(layer, "fix", 1.0, certify_every=2)
        again = projection_state(layer)
        assert again is state and again.vector is vector  # same tensor object ...
        assert not torch.equal(vector, snapshot)  # ... updated in place
        assert torch.equal(torch.random.get_rng_state(), rng)
        # the lower bound is a lower bound (steering only), tightness ub / lb >= 1
        assert 0.0 < state.lower_bound <= exact(layer) * (1 + 1e-5)
        assert state.upper_bound >= exact(layer)


def test_returns_every_parametric_layer_in_order() -> None:
    model, shape = _conv_model()
    model(torch.zeros(1, *shape))
    out = project(model, "fix", 0.7)
    assert list(out) == ["1", "3.branch.0", "4", "6"]
    for path, module in model.named_modules():
        if path in out:
            assert abs(module.lipschitz() - 0.7) <= REL * 0.7
    assert constraints.MODES == ("clip", "fix", "orthogonal")


def test_projection_seeds_the_layer_bound_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """After project(), lipschitz() returns the projection's certified bound without a new SVD."""
    from clipless import norms as norms_module

    torch.manual_seed(0)
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(20, 20, bias=False))
    with torch.no_grad():
        model[1].weight.mul_(10.0)
    returned = project(model, mode="clip", max_norm=1.0)
    calls = []
    original = norms_module.dense_norm
    monkeypatch.setattr(
        norms_module, "dense_norm", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    assert model[1].lipschitz() == returned["1"]
    assert not calls
    exact = float(torch.linalg.matrix_norm(model[1].weight.detach().double(), 2))
    assert exact <= returned["1"] <= 1.0
    with torch.no_grad():
        model[1].weight.add_(0.01)
    model[1].lipschitz()
    assert calls  # a changed weight is certified afresh


# --------------------------------------------------------------------------------------------
# Findings of an audit of the projections (each failed before its fix)
# --------------------------------------------------------------------------------------------


def test_a_saved_conv_bound_is_not_restored_at_another_input_size() -> None:
    """bound_state held the value and the weight's digest but not the geometry: a bound certified
    at 4x4 was restored onto the same weight at 16x16 (0.99999993 reported, exact 1.1734)."""
    gen = torch.Generator().manual_seed(0)
    small = cnn.Conv2d(2, 3, 3, padding=1, input_size=(4, 4))
    with torch.no_grad():
        small.weight.copy_(torch.randn(small.weight.shape, generator=gen) * 0.3)
    project(cnn.Sequential(small), mode="clip", max_norm=1.0)
    state = small.bound_state()
    assert state is not None and state["key"] == repr(small._bound_key())
    big = cnn.Conv2d(2, 3, 3, padding=1, input_size=(16, 16))
    same = cnn.Conv2d(2, 3, 3, padding=1, input_size=(4, 4))
    for layer in (big, same):
        with torch.no_grad():
            layer.weight.copy_(small.weight)
    assert not big.load_bound_state(state)
    assert big.lipschitz() >= conv_exact(big) > 1.1
    assert same.load_bound_state(state) and same.lipschitz() == state["value"]
    assert not same.load_bound_state({k: v for k, v in state.items() if k != "key"})


@pytest.mark.parametrize("scale", [5e-324, 1e-300, 1e-165, 1.0, 1e155, 1e300])
def test_the_device_frobenius_bound_is_certified_at_every_magnitude(scale: float) -> None:
    """_fro_upper_t (the accelerator path's rescale) is >= the exact Frobenius norm, computed in
    exact rationals, and within 1e-12 of the host's _fro_upper; 0 for 0, inf for inf."""
    from fractions import Fraction

    gen = torch.Generator().manual_seed(3)
    t = torch.randn(9, 7, generator=gen, dtype=torch.float64) * scale
    exact_sq = sum((Fraction(v) ** 2 for v in t.reshape(-1).tolist()), Fraction(0))
    bound = float(constraints._fro_upper_t(t))
    assert Fraction(bound) ** 2 >= exact_sq
    assert bound <= constraints._fro_upper(t) * (1 + 1e-12) + 2.0**-1070
    assert float(constraints._fro_upper_t(torch.zeros(3, 3, dtype=torch.float64))) == 0.0
    assert float(constraints._fro_upper_t(torch.full((2,), math.inf, dtype=torch.float64))) == (
        math.inf
    )


@pytest.mark.parametrize("scale", [1e-45, 1e-40, 1e-20, 1.0, 1e19, 1e37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_frobenius_bound_of_narrow_weights(scale: float, dtype: torch.dtype) -> None:
    """For float32 / bfloat16 entries (squared exactly in float64, no scaling) _fro_upper_t is
    >= the exact Frobenius norm in rationals, at subnormal and near-overflow magnitudes, tight
    to 1e-12; NaN and inf give inf."""
    from fractions import Fraction

    gen = torch.Generator().manual_seed(4)
    t = (torch.randn(33, 17, generator=gen, dtype=torch.float64) * scale).to(dtype)
    exact_sq = sum((Fraction(v) ** 2 for v in t.double().reshape(-1).tolist()), Fraction(0))
    bound = float(constraints._fro_upper_t(t))
    assert Fraction(bound) ** 2 >= exact_sq
    assert Fraction(bound) ** 2 <= exact_sq * Fraction(1 + 1e-12) ** 2 + Fraction(2.0**-1000)
    for bad in (math.nan, math.inf):
        t[3, 4] = bad
        assert float(constraints._fro_upper_t(t)) == math.inf


@pytest.mark.parametrize("scale", [1e-165, 1e-300, 1e155, 1e300])
def test_the_carried_gap_and_the_rescale_at_extreme_magnitudes(scale: float) -> None:
    """_fro_upper squared without scaling: float64 entries near 1e-165 gave a gap of 0 and a
    carried bound of 0 (exact 5e-165); entries near 1e155 gave inf, and the rescale then wrote
    an all-zero weight."""
    gen = torch.Generator().manual_seed(1)
    step = torch.randn(12, 10, generator=gen, dtype=torch.float64) * scale
    assert constraints._fro_upper(step) >= float(torch.linalg.vector_norm(step / scale)) * scale
    layer = cnn.Linear(10, 12, bias=False, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.zero_()
    model = cnn.Sequential(layer)
    for _ in range(3):
        with torch.no_grad():
            layer.weight.add_(torch.randn(12, 10, generator=gen, dtype=torch.float64) * scale)
        bound = project(model, mode="clip", max_norm=1.0, certify_every=4)["0"]
        truth = dense_exact(layer.weight)
        assert truth > 0.0 and bound >= truth and layer.lipschitz() >= truth
        assert truth <= 1.0


def test_a_rescale_beyond_the_dtype_is_an_error_not_a_zero_weight() -> None:
    layer = cnn.Linear(8, 8, bias=False).to(torch.float16)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"overflows its dtype torch\.float16"):
        project(cnn.Sequential(layer), mode="fix", max_norm=1e5)  # float16 max 65504


@pytest.mark.usefixtures("host_path")
def test_carried_rescales_do_not_compound_past_the_tolerance() -> None:
    """Each carried call could shrink by up to 1 + tolerance and 'clip' never scales back up:
    noise-like steps of 0.77% of C left the weight at 0.869 C after one chain of 20."""
    gen = torch.Generator().manual_seed(0)
    layer = cnn.Linear(64, 64)
    model = cnn.Sequential(layer)
    for _ in range(20):
        with torch.no_grad():
            layer.weight.add_(torch.randn(64, 64, generator=gen) * 1.2e-4)
        project(model, mode="clip", max_norm=1.0, certify_every=20, tolerance=0.01)
    state = projection_state(layer)
    assert state is not None and state.carried_waste <= 1.01
    assert dense_exact(layer.weight) > 0.96  # 0.869 before


@pytest.mark.parametrize("certify_every", [1, 3])
@pytest.mark.parametrize("device_path", [False, True])
def test_project_returns_fresh_values_for_a_shared_weight(
    device_path: bool, certify_every: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two convolutions of one weight: ``fix`` rescales it once per layer (up, too), so neither
    layer's bound after its own rescale describes the stored weight; each returned value and
    each memoised bound does (the device path seeded the stale one before)."""
    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", device_path)
    a = cnn.Conv2d(2, 3, 3, padding=1, input_size=(6, 6))
    b = cnn.Conv2d(2, 3, 3, stride=2, padding=1, input_size=(6, 6))
    b.weight = a.weight
    model = cnn.Sequential(a, b)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        with torch.no_grad():
            a.weight.add_(torch.randn(a.weight.shape, generator=gen) * 0.1)
        out = project(model, mode="fix", max_norm=1.0, certify_every=certify_every, tolerance=1e9)
        assert out["0"] >= conv_exact(a) and out["1"] >= conv_exact(b)
        assert float(a.lipschitz()) >= conv_exact(a) and float(b.lipschitz()) >= conv_exact(b)


@pytest.mark.parametrize("scale", [10.0, 0.5])  # rescaled, and left as it is
def test_projection_keeps_one_copy_of_the_weight(scale: float) -> None:
    """The projection certifies without memoising a copy of a weight it may rescale at once;
    the bound cache then holds one copy, of the weight kept, with its certified bound (the
    transient second copy was 4 MiB of the 1024-wide MLP's step peak: RESULTS.md 26f)."""
    torch.manual_seed(0)
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(20, 20, bias=False))
    with torch.no_grad():
        model[1].weight.mul_(scale)
    copies = []

    class Spy(dict):  # count the copies the bound cache is given
        def __setitem__(self, key, value):
            if key == "_bound_cache":
                copies.append(value[0])
            super().__setitem__(key, value)

    model[1].__dict__ = Spy(model[1].__dict__)
    returned = project(model, mode="clip", max_norm=1.0)
    assert len(copies) == 1
    cached = model[1].__dict__["_bound_cache"]
    assert torch.equal(cached[0], model[1].weight.detach()) and cached[2] == returned["1"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 3e3, 1e30])
def test_the_device_rescale_is_certified_in_every_dtype(
    dtype: torch.dtype, magnitude: float
) -> None:
    """_rescale_t (the accelerator path) writes a weight whose exact spectral norm (SVD in
    float64) is <= its returned bound <= max_norm, leaves a weight that needs no rescale bit for
    bit, and reports an overflowing "fix" as unverified without writing it."""
    gen = torch.Generator().manual_seed(5)
    layer = cnn.Linear(24, 16, bias=False, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 24, generator=gen, dtype=torch.float64) * magnitude)
    before = layer.weight.detach().clone()
    exact = float(torch.linalg.matrix_norm(before.double(), ord=2))
    ub = torch.tensor(exact * (1 + 1e-6), dtype=torch.float64)
    consts = constraints._rescale_constants([layer])

    def rescale(max_norm: float, need: bool) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return constraints._rescale_t(
                [layer.weight], ub.reshape(1), max_norm, consts, torch.tensor([need])
            )

    kept, scale, ok = rescale(1.0, False)
    assert bool(ok) and float(scale) == 1.0 and float(kept) == float(ub)
    assert torch.equal(layer.weight.detach().view(-1), before.view(-1))
    bound, scale, ok = rescale(0.5, True)
    stored = float(torch.linalg.matrix_norm(layer.weight.detach().double(), ord=2))
    assert bool(ok) and stored <= float(bound) <= 0.5
    assert float(bound) >= 0.5 * (1 - 1e-5)
    if dtype == torch.float32 and magnitude >= 1.0:  # "fix" to entries past float32's largest
        with torch.no_grad():
            layer.weight.copy_(before)
        _, _, ok = rescale(1e39, True)
        assert not bool(ok) and torch.equal(layer.weight.detach(), before)
