"""Clipping bias: the thesis's linear-regression example (section 5.2.4), computed exactly.

y = a x + b + e, x ~ U[0, 1], e = +9 w.p. 0.1 and -1 w.p. 0.9 (mean zero), loss (f(x) - y)^2 as in
the thesis, flat clipping at C = 1. The population expectation over x is discretised by the
midpoint rule on N points, each error value weighted by its probability: a deterministic data set.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import root

from _mechanism import split_options
from clipless import mechanism
from clipless.diagnostics import (
    clipped_mean_gradient,
    clipping_bias,
    clipping_profile,
    mean_gradient,
    per_sample_gradients,
)

A, B = 2.0, -0.5  # the true parameters (any values: only theta - (a, b) matters)
N = 20_000


def _sq_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def _population() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xs = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    x = torch.cat([xs, xs]).unsqueeze(1)
    e = torch.cat([torch.full((N,), 9.0), torch.full((N,), -1.0)]).to(torch.float64)
    w = torch.cat(
        [torch.full((N,), 0.1, dtype=torch.float64), torch.full((N,), 0.9, dtype=torch.float64)]
    )
    y = (A * x.squeeze(1) + B + e).unsqueeze(1)
    return x, y, w


def _model(theta1: float, theta2: float) -> torch.nn.Linear:
    m = torch.nn.Linear(1, 1).double()
    with torch.no_grad():
        m.weight.fill_(theta1)
        m.bias.fill_(theta2)
    return m


def _vec(g: dict[str, torch.Tensor]) -> np.ndarray:
    return np.array([float(g["weight"].squeeze()), float(g["bias"].squeeze())])


def test_clipped_gradient_at_true_parameters_has_norm_07791() -> None:
    x, y, w = _population()
    g = _vec(clipped_mean_gradient(_model(A, B), _sq_loss, x, y, 1.0, sample_weight=w))
    # At (a, b) every per-sample gradient -2 e (x, 1) has norm >= 2 > 1, so the clipped mean is
    # (0.9 - 0.1) * int_0^1 (x, 1) / sqrt(1 + x^2) dx = 0.8 (sqrt(2) - 1, asinh(1)).
    exact = 0.8 * np.array([math.sqrt(2.0) - 1.0, math.asinh(1.0)])
    np.testing.assert_allclose(g, exact, rtol=0, atol=1e-8)
    assert round(float(np.linalg.norm(g)), 4) == 0.7791  # the thesis's number
    # the unclipped mean gradient vanishes there (E[e] = 0, midpoint rule exact for x)
    np.testing.assert_allclose(
        _vec(mean_gradient(_model(A, B), _sq_loss, x, y, sample_weight=w)), 0.0, atol=1e-12
    )
    bias = clipping_bias(_model(A, B), _sq_loss, x, y, 1.0, sample_weight=w)
    assert bias == pytest.approx(float(np.linalg.norm(exact)), abs=1e-8)


def test_zero_of_clipped_gradient_is_shifted_and_unclipped_is_not() -> None:
    x, y, w = _population()

    def clipped(d: np.ndarray) -> np.ndarray:
        m = _model(A + d[0], B + d[1])
        return _vec(clipped_mean_gradient(m, _sq_loss, x, y, 1.0, sample_weight=w))

    def plain(d: np.ndarray) -> np.ndarray:
        return _vec(mean_gradient(_model(A + d[0], B + d[1]), _sq_loss, x, y, sample_weight=w))

    sol = root(clipped, x0=[0.0, -0.9], tol=1e-10)
    assert np.linalg.norm(clipped(sol.x)) < 1e-12
    # The thesis prints (a + 0.01765, b + 0.94221): the magnitudes agree to 5 decimals, the signs
    # do not. Clipping caps the rare +9 errors, so the clipped fit moves towards the frequent -1
    # errors, i.e. below the true line; the mirrored errors (-9, +1) give the printed signs.
    np.testing.assert_allclose(sol.x, [-0.01765, -0.94221], rtol=0, atol=5e-6)
    sol_plain = root(plain, x0=[0.3, -0.4], tol=1e-10)
    assert np.linalg.norm(plain(sol_plain.x)) < 1e-12
    np.testing.assert_allclose(sol_plain.x, [0.0, 0.0], atol=1e-9)
    # and at the clipped zero the true gradient is far from zero: DP-SGD's fixed point is biased
    assert np.linalg.norm(plain(sol.x)) > 0.5


def test_mirrored_errors_give_the_thesis_signs() -> None:
    x, y, w = _population()
    y = 2 * (A * x + B) - y  # e -> -e: errors -9 w.p. 0.1, +1 w.p. 0.9

    def clipped(d: np.ndarray) -> np.ndarray:
        m = _model(A + d[0], B + d[1])
        return _vec(clipped_mean_gradient(m, _sq_loss, x, y, 1.0, sample_weight=w))

    sol = root(clipped, x0=[0.0, 0.9], tol=1e-10)
    assert np.linalg.norm(clipped(sol.x)) < 1e-12
    np.testing.assert_allclose(sol.x, [0.01765, 0.94221], rtol=0, atol=5e-6)


def test_per_sample_gradients_match_autograd_and_large_clip_is_unbiased() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model = model.double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0, 1])
    loss = torch.nn.CrossEntropyLoss(reduction="sum")
    grads = per_sample_gradients(model, loss, x, y, chunk_size=2)
    for i in range(5):
        model.zero_grad()
        loss(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(grads[name][i], p.grad, rtol=1e-12, atol=1e-12)
    # no sample reaches the threshold: no clipping, no bias
    norms = torch.sqrt(sum(g.reshape(5, -1).pow(2).sum(1) for g in grads.values()))
    big = float(norms.max()) * 1.01
    assert clipping_bias(model, loss, x, y, big) == 0.0
    # a threshold below every norm: each clipped gradient has norm exactly C
    small = float(norms.min()) / 2
    clipped = clipped_mean_gradient(model, loss, x, y, small)
    expected = {
        k: (g * (small / norms).view(-1, *[1] * (g.ndim - 1))).mean(0) for k, g in grads.items()
    }
    for k in clipped:
        torch.testing.assert_close(clipped[k], expected[k], rtol=1e-12, atol=1e-12)


def test_bad_input_names_the_argument() -> None:
    x, y = torch.zeros(3, 1, dtype=torch.float64), torch.zeros(3, 1, dtype=torch.float64)
    m = _model(0.0, 0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        clipped_mean_gradient(m, _sq_loss, x, y, 0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        clipping_bias(m, _sq_loss, x, y, float("inf"))
    with pytest.raises(ValueError, match="sample_weight"):
        mean_gradient(m, _sq_loss, x, y, sample_weight=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="sample_weight"):
        mean_gradient(m, _sq_loss, x, y, sample_weight=torch.ones(2))
    with pytest.raises(ValueError, match="leading"):
        mean_gradient(m, _sq_loss, x, y[:2])
    with pytest.raises(ValueError, match="scalar"):
        mean_gradient(m, torch.nn.MSELoss(reduction="none"), x, y)
    # audit findings: a bare float and a NaN input
    with pytest.raises(TypeError, match="thresholds must be a sequence"):
        clipping_profile(m, _sq_loss, x, y, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        mean_gradient(m, _sq_loss, torch.full_like(x, float("nan")), y)


def test_loss_gradient_clip_shifts_the_zero_too() -> None:
    """Clipping the logit cotangent (LossGradientClip) is biased in the same way, exactly.

    The cotangent 2 r = -2 e at (a, b) is clipped to -1 (e = 9) or +1 (e = -1), so the mean
    gradient is 0.8 (E[x], 1) = (0.4, 0.8); it vanishes where 0.9 clip(2 (d + 1)) = 0.1, i.e. at
    (a, b - 17/18) (a clip value constant in x makes both equations one).
    """
    from clipless.nn import LossGradientClip

    x, y, w = _population()

    def model(d0: float, d1: float) -> torch.nn.Module:
        return torch.nn.Sequential(_model(A + d0, B + d1), LossGradientClip(1.0))

    def g(d: np.ndarray) -> np.ndarray:
        grads = mean_gradient(model(d[0], d[1]), _sq_loss, x, y, sample_weight=w)
        return np.array([float(grads["0.weight"].squeeze()), float(grads["0.bias"].squeeze())])

    np.testing.assert_allclose(g(np.zeros(2)), [0.4, 0.8], rtol=0, atol=1e-12)
    np.testing.assert_allclose(g(np.array([0.0, -17 / 18])), 0.0, atol=1e-12)


def test_clipping_profile_exact_on_four_samples() -> None:
    """Four hand-made samples with per-sample gradients -2 y_i (x_i, 1) at theta = 0:
    (0, -2), (0, 0.5), (-1, -1), (0, 0); norms 2, 0.5, sqrt(2), 0."""
    x = torch.tensor([[0.0], [0.0], [1.0], [0.0]], dtype=torch.float64)
    y = torch.tensor([[1.0], [-0.25], [0.5], [0.0]], dtype=torch.float64)
    model = _model(0.0, 0.0)
    r2 = math.sqrt(2.0)
    mean = np.array([-1.0, -2.5]) / 4  # (-0.25, -0.625)
    stats = clipping_profile(model, _sq_loss, x, y, [1.0, 3.0, 0.25])
    # C = 1: scales 1/2, 1, 1/sqrt(2), 1
    clipped = np.array([-1 / r2, -1.0 + 0.5 - 1 / r2]) / 4
    s = stats[0]
    assert s.max_grad_norm == 1.0 and s.fraction_clipped == 0.5
    assert s.mean_norm == pytest.approx(float(np.linalg.norm(mean)), abs=1e-15)
    assert s.clipped_norm == pytest.approx(float(np.linalg.norm(clipped)), abs=1e-15)
    assert s.bias == pytest.approx(float(np.linalg.norm(mean - clipped)), abs=1e-15)
    assert s.relative_error == pytest.approx(s.bias / s.mean_norm, abs=1e-15)
    cos = float(mean @ clipped / np.linalg.norm(mean) / np.linalg.norm(clipped))
    assert s.cosine == pytest.approx(cos, abs=1e-15)
    assert s.mean_scale == pytest.approx((0.5 + 1 + 1 / r2 + 1) / 4, abs=1e-15)
    # C = 3: nothing clipped, no bias
    assert stats[1].bias == 0.0 and stats[1].fraction_clipped == 0.0
    assert stats[1].cosine == pytest.approx(1.0, abs=1e-15) and stats[1].mean_scale == 1.0
    # C = 0.25: scales 1/8, 1/2, 1/(4 sqrt 2), 1 -> three of four clipped
    clipped = np.array([-0.25 / r2, -0.25 + 0.25 - 0.25 / r2]) / 4
    assert stats[2].fraction_clipped == 0.75
    assert stats[2].bias == pytest.approx(float(np.linalg.norm(mean - clipped)), abs=1e-15)
    # the same numbers as clipping_bias, one threshold at a time
    assert stats[0].bias == pytest.approx(clipping_bias(model, _sq_loss, x, y, 1.0), abs=1e-15)
    with pytest.raises(ValueError, match="thresholds"):
        clipping_profile(model, _sq_loss, x, y, [])
    with pytest.raises(ValueError, match="thresholds"):
        clipping_profile(model, _sq_loss, x, y, [1.0, -1.0])


def test_clipping_profile_on_the_thesis_example() -> None:
    """At the true (a, b): the mean gradient is 0, every sample is clipped, bias = 0.7791."""
    x, y, w = _population()
    (s,) = clipping_profile(_model(A, B), _sq_loss, x, y, [1.0], sample_weight=w)
    assert s.fraction_clipped == pytest.approx(1.0, abs=1e-12)
    assert round(s.clipped_norm, 4) == 0.7791 and round(s.bias, 4) == 0.7791
    assert s.mean_norm < 1e-12 and s.relative_error > 1e6  # all of the update is bias


# ---------------------------------------------------------------- sensitivity_use (private model)


def _private(model, loss, x, y, **kw):
    import clipless

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    engine = clipless.PrivacyEngine(accountant="pld")
    options = {"max_norm": 1.0, "constraint": "clip", "scaling": "per-sample", **kw}
    model, opt, _ = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, loss=loss,
        target_epsilon=1.0, target_delta=1e-5, epochs=1, **split_options(options),
    )  # fmt: skip
    return model, opt


def _reference_contributions(model, opt, x, y) -> dict[str, torch.Tensor]:
    """Each sample's contribution through the real training path: a training forward and
    backward of a batch of one (the optimizer clips the output cotangent and the layers scale),
    read from ``.grad`` before any step: [n, *shape] per noised tensor."""
    opt.data_loader = None  # batches chosen here, no step taken
    names = list(opt.refresh().sensitivities)
    params = dict(model.named_parameters())
    out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i in range(x.shape[0]):
        opt.zero_grad(set_to_none=True)
        opt.loss(model(x[i : i + 1]), y[i : i + 1]).backward()
        for n in names:
            g = params[n].grad
            out[n].append(torch.zeros_like(params[n]) if g is None else g.detach().clone())
    opt.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in out.items()}


def _norms(v: torch.Tensor) -> torch.Tensor:
    return v.flatten(1).double().norm(dim=1)


def _models():
    from clipless import nn
    from clipless.models import convnet, mlp

    yield "mlp-bias", mlp((10,), (16,), 3, bias=True), (10,), {}
    yield "mlp-global-bound", mlp((10,), (8, 8), 3), (10,), {"scaling": "bound"}
    yield "mlp-per-layer", mlp((10,), (8,), 3, bias=True), (10,), {"noise": "per-layer"}
    yield (
        "linear-clip-threshold",
        nn.Sequential(nn.InputNorm(2.0), nn.Linear(10, 3), nn.LossGradientClip(0.2)),
        (10,),
        {"scaling": "threshold", "thresholds": {"1": 1.5}, "constraint": None},
    )
    yield "convnet", convnet((1, 8, 8), (4, 6), 3, bias=True), (1, 8, 8), {}


@pytest.mark.parametrize("case", list(_models()), ids=lambda c: c[0])
def test_sensitivity_use_is_the_training_path_per_sample(case) -> None:
    """The norms ``sensitivity_use`` reports are those of each sample's contribution through
    a real training backward; they never exceed the planned sensitivity, and the contributions
    of a batch sum to its training gradient."""
    from clipless.diagnostics import sensitivity_use
    from clipless.nn import CrossEntropyLoss

    _, model, shape, kw = case
    torch.manual_seed(0)
    n = 24
    x = torch.randn(n, *shape) * torch.linspace(0.05, 3.0, n).view(-1, *([1] * len(shape)))
    y = torch.randint(0, 3, (n,))
    model, opt = _private(model, CrossEntropyLoss(temperature=0.3), x, y, **kw)
    report = sensitivity_use(opt, x, y)
    ref = _reference_contributions(model, opt, x, y)
    assert set(report.tensors) == set(ref) == set(opt.sensitivities())
    for name, use in report.tensors.items():
        norms = _norms(ref[name])
        assert use.samples == n
        assert use.sensitivity == opt.sensitivities()[name]
        assert use.mean == pytest.approx(float(norms.mean()), rel=1e-5)
        assert use.median == pytest.approx(float(norms.median()), rel=1e-5)
        assert use.max == pytest.approx(float(norms.max()), rel=1e-5)
        assert use.max <= use.sensitivity
        assert 0.0 < use.ratio < 1.0
    assert report.output.sensitivity == opt.current_plan().output_bound
    assert report.output.max <= report.output.sensitivity
    # the batch's training gradient is the sum of the contributions
    opt.zero_grad(set_to_none=True)
    opt.loss(model(x), y).backward()
    for name, p in model.named_parameters():
        if name in ref:
            torch.testing.assert_close(p.grad, ref[name].sum(0), rtol=1e-4, atol=1e-6)
    opt.zero_grad(set_to_none=True)
    # chunking changes nothing
    chunked = sensitivity_use(opt, x, y, chunk_size=5)
    for name, use in report.tensors.items():
        assert chunked.tensors[name].mean == pytest.approx(use.mean, rel=1e-6)


def test_sensitivity_use_of_one_dense_layer_is_its_output_cotangent() -> None:
    """With per-sample scaling a bias-free dense layer's contribution is ``dy_i x_i^T /
    ||x_i||``, of norm exactly ``||dy_i||``: the layer uses what the loss gradient uses."""
    from clipless import nn
    from clipless.diagnostics import sensitivity_use

    torch.manual_seed(3)
    x, y = torch.randn(40, 6) * 3.0, torch.randint(0, 4, (40,))
    model = nn.Sequential(nn.InputNorm(1.0), nn.Linear(6, 4, bias=False))
    model, opt = _private(model, nn.CrossEntropyLoss(temperature=0.05), x, y, constraint=None)
    report = sensitivity_use(opt, x, y)
    use = report.tensors["1.weight"]
    assert use.mean == pytest.approx(report.output.mean, rel=1e-6)
    assert use.max == pytest.approx(report.output.max, rel=1e-6)
    # L = sqrt(2) / T; the tensor's sensitivity is L inflated by the float32 rounding margin
    assert report.output.sensitivity == pytest.approx(math.sqrt(2.0) / 0.05, rel=1e-12)
    margin = opt.current_plan().rounding_margin
    assert margin == mechanism.rounding_margin("float32", batch_bound=41)
    assert use.sensitivity == pytest.approx(report.output.sensitivity * (1 + margin), rel=1e-12)


def test_sensitivity_use_refuses_what_it_cannot_measure() -> None:
    from clipless import nn
    from clipless.diagnostics import sensitivity_use

    torch.manual_seed(4)
    x, y = torch.randn(8, 5), torch.randint(0, 2, (8,))
    model, opt = _private(
        nn.Sequential(nn.InputNorm(1.0), nn.Linear(5, 2)), nn.CrossEntropyLoss(), x, y
    )
    with pytest.raises(TypeError, match="DPOptimizer"):
        sensitivity_use(torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    with pytest.raises(ValueError, match=r"x must have shape \[n, 5\]"):
        sensitivity_use(opt, x[:, :4], y)
    with pytest.raises(ValueError, match="one row per sample"):
        sensitivity_use(opt, x, y[:5])
    with pytest.raises(ValueError, match="chunk_size"):
        sensitivity_use(opt, x, y, chunk_size=0)
    with opt.sample_multiplicity(2), pytest.raises(ValueError, match="sample_multiplicity"):
        sensitivity_use(opt, x, y)
    model, opt = _private(
        nn.Sequential(nn.InputNorm(1.0), nn.Linear(5, 2)), nn.CrossEntropyLoss(), x, y,
        scaling="batch-max", allow_unproven=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="batch-max"):
        sensitivity_use(opt, x, y)
