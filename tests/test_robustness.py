"""Certified robustness (:mod:`clipless.robustness`): radii against attacks and exact references.

* Exact reference: for a linear model whose inputs stay inside the ``InputNorm`` ball, the
  minimal L2 adversarial distance is ``min_j (z_c - z_j) / ||W_c - W_j||`` in closed form; the
  certificate must equal it (the pairwise head constants make it exact) and the generic
  ``margin / (sqrt(2) K)`` must not exceed it. With a sphere projection, a brute-force scan of a
  2-D input plane gives an upper bound on the true minimal distance the radius must stay under.
* Attack: a PGD L2 attack (:func:`clipless.robustness.pgd_l2`, on torch: normalised-gradient
  steps on the margin, random starts, projection onto the ball) never changes a certified
  prediction within its radius, on every model of the zoo (linear, MLP, ConvNet with L2 /
  average pooling, ResNet, GNP) and every ``InputNorm`` map (ball, sphere, centred and
  whitened); the same attack a little beyond the radius breaks predictions (it is not vacuous).
"""

from __future__ import annotations

import math

import pytest
import torch

import clipless.nn as cnn
from clipless import models
from clipless.constraints import project
from clipless.robustness import (
    Certificate,
    LipschitzSummary,
    RobustAccuracy,
    _ball_move,
    _chord,
    certified_accuracy,
    certify,
    empirical_accuracy,
    lipschitz_summary,
    pgd_l2,
)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _perturb(model: torch.nn.Module, seed: int, spread: float = 1.5) -> None:
    """Random weights (and biases) of random scale, away from the orthogonal initialisation."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            fan = p[0].numel() if p.ndim > 1 else p.numel()
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * spread / math.sqrt(fan))


def _norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t.reshape(len(t), -1), dim=1)


def _centred_whitened(
    model: cnn.Sequential, shape: tuple[int, ...], seed: int, mode: str
) -> cnn.Sequential:
    """The model with a (random, public) centre and whitening in its InputNorm."""
    first = model[0]
    assert isinstance(first, cnn.InputNorm)
    gen = torch.Generator().manual_seed(seed)
    center = 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    center = center / torch.linalg.vector_norm(center)
    c = shape[0]
    whiten = torch.eye(c, dtype=torch.float64) + 0.5 * torch.randn(c, c, generator=gen).double()
    model[0] = cnn.InputNorm(first.max_norm, mode, center, 0.5, whiten, 0.5)
    return model.double()


def _zoo(name: str) -> tuple[cnn.Sequential, tuple[int, ...]]:
    """Small instances of every builder of :mod:`clipless.models` (float64)."""
    image = (2, 8, 8)
    if name == "linear":
        model, shape = models.linear((12,), 4, input_norm=3.0), (12,)
    elif name == "linear-binary":
        model, shape = models.linear((12,), 1, input_norm=3.0), (12,)
    elif name == "mlp":
        model, shape = models.mlp((12,), (16, 8), 5, input_norm=2.0, bias=True), (12,)
    elif name == "mlp-image":
        model, shape = models.mlp(image, (16,), 3, input_norm=2.0), image
    elif name == "cnn-l2":
        model, shape = models.convnet(image, (4, 8), 5, input_norm=2.0, pool="l2"), image
    elif name == "cnn-avg":
        model, shape = models.convnet(image, (4,), 5, input_norm=2.0, pool="avg"), image
    elif name == "resnet":
        model, shape = models.resnet(image, 4, 1, 5, stages=2, input_norm=2.0), image
    elif name == "resnet-add":
        model = models.resnet(image, 4, 1, 5, stages=2, input_norm=2.0, residual="add")
        shape = image
    elif name == "gnp":
        model, shape = models.gnp_convnet(image, (8, 32), 5, input_norm=2.0), image
    else:
        raise AssertionError(name)
    return model.double(), shape


ZOO = ["linear", "linear-binary", "mlp", "mlp-image", "cnn-l2", "cnn-avg", "resnet", "resnet-add"]
ZOO += ["gnp"]


def _inputs(shape: tuple[int, ...], n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    scales = torch.linspace(0.3, 3.0, n, dtype=torch.float64)  # inside and outside the ball
    return x / _norm(x).reshape(-1, *[1] * len(shape)) * scales.reshape(-1, *[1] * len(shape))


def _prepare(name: str, variant: str, seed: int) -> tuple[cnn.Sequential, tuple[int, ...]]:
    model, shape = _zoo(name)
    _perturb(model, seed)
    if variant == "orthogonal":  # what `clipless train` does to the deep models: near-GNP
        project(model, "orthogonal", 1.0, bjorck_iters=15)
    elif variant in ("sphere", "centred-ball", "centred-sphere"):
        first = model[0]
        if variant == "sphere":
            model[0] = cnn.InputNorm(first.max_norm, "sphere")
        else:
            model = _centred_whitened(model, shape, seed, variant.split("-")[1])
    return model.double(), shape


VARIANTS = ["random", "orthogonal", "sphere", "centred-ball", "centred-sphere"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ZOO)
def test_pgd_never_breaks_a_certified_prediction(name: str, variant: str) -> None:
    model, shape = _prepare(name, variant, seed=len(name) + 7 * VARIANTS.index(variant))
    x = _inputs(shape, 12, seed=3)
    cert = certify(model, x)
    assert cert.radii.dtype == torch.float64 and bool((cert.radii >= 0).all())
    with torch.no_grad():
        z = model(x)
    pred = (z[:, 0] > 0).long() if z.shape[1] == 1 else z.argmax(dim=1)
    assert torch.equal(cert.predictions, pred)
    certified = cert.radii > 0
    assert int(certified.sum()) >= 3, "too few certified samples for the test to mean anything"
    # at the certified radius (a hair inside: the radius is a supremum over an open ball)
    eps = torch.where(certified, cert.radii * (1 - 1e-6), torch.zeros_like(cert.radii))
    worst = pgd_l2(model, x, pred, eps)
    assert bool((worst[certified] > 0).all()), (worst, cert.radii)


@pytest.mark.parametrize(
    ("name", "factor"),
    [("linear", 1.01), ("mlp", 1.5), ("gnp", 1.5), ("cnn-l2", 6.0), ("resnet", 10.0)],
)
def test_pgd_breaks_predictions_beyond_the_radius(name: str, factor: float) -> None:
    """The attack of the test above is not vacuous: beyond the radius it flips predictions. How
    far beyond measures the certificate's slack on near-orthogonal weights: none for the linear
    model (exact), ~1.5x for the GNP network and the MLP, 4-6x for the 3x3 ConvNet (its
    convolutions are not GNP), 6-10x for the ResNet (GroupNorm and the averaged residual)."""
    model, shape = _prepare(name, "orthogonal", seed=11)
    x = _inputs(shape, 12, seed=4)
    cert = certify(model, x)
    finite = torch.isfinite(cert.radii) & (cert.radii > 0)
    assert int(finite.sum()) >= 10
    eps = torch.where(finite, factor * cert.radii, torch.zeros_like(cert.radii))
    worst = pgd_l2(model, x, cert.predictions, eps)
    assert int((worst[finite] < 0).sum()) >= int(finite.sum()) // 2


def test_linear_model_radius_is_the_exact_minimal_adversarial_distance() -> None:
    model, shape = _zoo("linear")
    model[0] = cnn.InputNorm(1e3, "ball")  # every input and perturbation stays inside the ball
    model = model.double()
    _perturb(model, seed=5, spread=2.0)
    x = _inputs(shape, 40, seed=6)
    cert = certify(model, x)
    w, b = model[1].weight.detach(), model[1].bias.detach()
    z = x @ w.T + b
    c = z.argmax(dim=1)
    exact = torch.stack(
        [
            min(
                (z[i, c[i]] - z[i, j]) / torch.linalg.vector_norm(w[c[i]] - w[j])
                for j in range(4)
                if j != c[i]
            )
            for i in range(len(x))
        ]
    )
    # the radius gives up 4e-9 R (R = 1e3) for the projection's rounding, nothing else
    torch.testing.assert_close(cert.radii, exact, rtol=1e-7, atol=5e-6)
    assert bool((cert.radii <= exact).all())  # a certificate never exceeds the truth
    # the generic margin / (sqrt(2) K) is a weaker certificate: never above the exact distance
    lip = cert.lipschitz
    top2 = z.topk(2, dim=1).values
    generic = (top2[:, 0] - top2[:, 1]) / (math.sqrt(2) * lip.body)
    assert bool((generic <= exact * (1 + 1e-12)).all())
    assert float(lip.body) == pytest.approx(float(torch.linalg.matrix_norm(w, ord=2)), rel=1e-6)
    # and the exact distance is attained: a step of 1.0001 times it along the worst direction flips
    i = 0
    j = min(
        (k for k in range(4) if k != c[i]),
        key=lambda k: float((z[i, c[i]] - z[i, k]) / torch.linalg.vector_norm(w[c[i]] - w[k])),
    )
    direction = (w[j] - w[c[i]]) / torch.linalg.vector_norm(w[j] - w[c[i]])
    moved = model((x[i] + 1.0001 * exact[i] * direction)[None])
    assert int(moved.argmax()) != int(c[i])


def test_linear_binary_radius_is_the_distance_to_the_hyperplane() -> None:
    model, shape = _zoo("linear-binary")
    model[0] = cnn.InputNorm(1e3, "ball")
    model = model.double()
    _perturb(model, seed=8)
    x = _inputs(shape, 20, seed=9)
    cert = certify(model, x)
    w, b = model[1].weight.detach()[0], model[1].bias.detach()[0]
    exact = (x @ w + b).abs() / torch.linalg.vector_norm(w)
    torch.testing.assert_close(cert.radii, exact, rtol=1e-7, atol=5e-6)
    assert bool((cert.radii <= exact).all())
    assert torch.equal(cert.predictions, ((x @ w + b) > 0).long())


def test_projection_onto_a_small_ball_makes_far_predictions_constant() -> None:
    """Outputs of the ball projection are at most 2R apart: a margin above 2 sqrt(2) K R is
    certified for every perturbation (radius inf), and the model's output cannot flip at all."""
    model, shape = _zoo("linear")
    model[0] = cnn.InputNorm(0.01, "ball")
    model = model.double()
    _perturb(model, seed=1)
    with torch.no_grad():
        model[1].bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    x = _inputs(shape, 6, seed=2)
    cert = certify(model, x)
    assert bool(torch.isinf(cert.radii).all()) and bool((cert.predictions == 0).all())


def _plane_ball(n: float, r: float, angles: int = 4001, rings: int = 400) -> torch.Tensor:
    """Points of the disc of radius ``r`` around ``n e_1`` in the plane (where the worst case
    of both bounds below lies: the plane of ``x`` and the perturbation)."""
    theta = torch.linspace(0, 2 * math.pi, angles, dtype=torch.float64)
    rho = torch.linspace(0, r, rings, dtype=torch.float64)[:, None]
    return torch.stack([n + rho * torch.cos(theta), rho * torch.sin(theta)], -1).reshape(-1, 2)


def _project(ys: torch.Tensor, radius: float | None) -> torch.Tensor:
    """The unit vector (``radius=None``, 0 for 0) or the projection onto the ball of ``radius``."""
    norms = torch.linalg.vector_norm(ys, dim=1, keepdim=True)
    if radius is None:
        return torch.where(norms > 0, ys / norms.clamp(min=1e-300), torch.zeros_like(ys))
    return ys * (radius / norms.clamp(min=1e-300)).clamp(max=1.0)


@pytest.mark.parametrize("s", [1e-9, 0.05, 0.5, 0.9, 0.999, 1.0, 1.2])
def test_chord_bounds_the_move_of_the_unit_vector_and_is_tight(s: float) -> None:
    n = 2.5
    f64 = torch.float64
    bound = float(_chord(torch.tensor([s * n], dtype=f64), torch.tensor([n], dtype=f64)))
    ys = _plane_ball(n, s * n)
    moved = torch.linalg.vector_norm(
        _project(ys, None) - torch.tensor([1.0, 0.0], dtype=f64), dim=1
    )
    assert float(moved.max()) <= bound + 1e-15  # the scan's own rounding (absolute ~1e-16)
    if s <= 1:  # tight (the grid's resolution apart); small s without cancellation
        assert float(moved.max()) >= bound * (1 - 1e-3) or s == 1e-9
        assert bound == pytest.approx(2 * math.sin(math.asin(s) / 2), rel=1e-8)
    else:  # the disc holds the origin's other side
        assert bound == 2.0


@pytest.mark.parametrize(("n", "d"), [(3.0, 0.5), (3.0, 1.5), (3.0, 2.5), (1.0, 0.3), (2.1, 4)])
def test_ball_move_bounds_the_projection(n: float, d: float) -> None:
    radius = 2.0
    f64 = torch.float64
    bound = float(_ball_move(torch.tensor([d], dtype=f64), torch.tensor([n], dtype=f64), radius))
    ys = _plane_ball(n, d)
    here = _project(torch.tensor([[n, 0.0]]).double(), radius)
    moved = torch.linalg.vector_norm(_project(ys, radius) - here, dim=1)
    assert float(moved.max()) <= bound
    assert bound <= d * (1 + 1e-8)  # never worse than the 1-Lipschitz bound
    if n - radius > d:  # entirely outside the ball: the sphere map's contraction, tight
        assert float(moved.max()) >= bound * (1 - 1e-3)
        assert bound < d * radius / (n - d) * (1 + 1e-8)


@pytest.mark.parametrize("variant", ["ball", "sphere", "centred-sphere", "centred-ball"])
def test_local_radius_stays_under_a_brute_force_scan(variant: str) -> None:
    """2-D inputs: the smallest flipping perturbation found on a dense polar grid is an upper
    bound of the exact minimal distance, which the certified radius must not exceed."""
    model = models.linear((2,), 3, input_norm=1.5).double()
    _perturb(model, seed=21, spread=2.0)
    if variant in ("ball", "sphere"):  # most inputs lie outside the ball of radius 1.5
        model[0] = cnn.InputNorm(1.5, variant)
    else:
        model = _centred_whitened(model, (2,), 3, variant.split("-")[1])
    x = _inputs((2,), 8, seed=22)
    cert = certify(model, x)
    theta = torch.linspace(0, 2 * math.pi, 721, dtype=torch.float64)
    rho = torch.linspace(1e-4, 6.0, 1200, dtype=torch.float64)
    grid = torch.stack([rho[:, None] * torch.cos(theta), rho[:, None] * torch.sin(theta)], -1)
    grid, rho_all = grid.reshape(-1, 2), rho[:, None].expand(-1, len(theta)).reshape(-1)
    ok = 0
    for i in range(len(x)):
        with torch.no_grad():
            flips = model(x[i] + grid).argmax(dim=1) != cert.predictions[i]
        if bool(flips.any()):
            scan = float(rho_all[flips].min())
            assert float(cert.radii[i]) <= scan, (i, float(cert.radii[i]), scan)
            ok += bool(cert.radii[i] > 0.05 * scan)
    assert ok >= 3  # the radii are not trivially small


def test_certified_accuracy_counts_and_linf() -> None:
    model, shape = _prepare("mlp", "orthogonal", seed=2)
    x = _inputs(shape, 30, seed=1)
    cert = certify(model, x)
    y = cert.predictions.clone()
    y[:5] = (y[:5] + 1) % 5  # five wrong labels
    radii = [0.0, float(cert.radii.median()), 1e9]
    acc = certified_accuracy(model, x, y, radii)
    assert isinstance(acc, RobustAccuracy) and acc.num_samples == 30
    assert acc.accuracy == pytest.approx(25 / 30)
    ok = cert.predictions == y
    for r, a in zip(radii, acc.certified, strict=True):
        assert a == pytest.approx(float((ok & (cert.radii > r)).double().mean()))
    assert acc.certified[0] <= acc.accuracy and acc.certified[-1] == 0.0
    linf = certified_accuracy(model, x, y, [0.01], norm="linf")
    expected = float((ok & (cert.radii / math.sqrt(12) > 0.01)).double().mean())
    assert linf.certified[0] == pytest.approx(expected) and linf.norm == "linf"
    # an L-infinity radius is an L2 radius divided by sqrt(n): a certified L-inf ball is inside
    # the L2 ball (||d||_2 <= sqrt(n) ||d||_inf)
    assert bool((cert.linf_radii() * math.sqrt(12) <= cert.radii).all())
    d = acc.to_dict()
    assert d["certified_accuracy"][f"{radii[1]:g}"] == acc.certified[1]
    assert d["space"] == "input" and d["norm"] == "l2"


def test_certify_leaves_the_model_alone_and_works_in_float32() -> None:
    model, shape = _zoo("cnn-l2")
    model = model.float()
    _perturb(model, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = _inputs(shape, 5, seed=3).float()
    cert = certify(model, x, batch_size=2)
    assert isinstance(cert, Certificate) and isinstance(cert.lipschitz, LipschitzSummary)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and v.dtype == torch.float32
    again = certify(model, x, lipschitz=lipschitz_summary(model, shape))
    torch.testing.assert_close(again.radii, cert.radii)


def test_summary_constants() -> None:
    model, shape = _prepare("gnp", "orthogonal", seed=1)
    lip = lipschitz_summary(model, shape)
    assert lip.input_map == "ball" and lip.input_lipschitz == 1.0
    assert 1.0 - 1e-4 <= lip.body <= 1.0 + 1e-6 and lip.total >= lip.body
    assert lip.pairwise is not None and lip.pairwise.shape == (5, 5)
    # ||W_c - W_j|| <= sqrt(2) ||W||_2, up to the constants' rounding margins
    assert bool((lip.pairwise <= math.sqrt(2) * lip.body * (1 + 1e-6)).all())
    centred, _ = _prepare("linear", "centred-sphere", seed=1)
    lip = lipschitz_summary(centred, (12,))
    assert lip.input_map == "normalised-sphere" and math.isinf(lip.total)
    w = centred[0].whiten
    assert lip.whiten_norm >= float(torch.linalg.matrix_norm(w, ord=2))


def test_errors_name_the_argument() -> None:
    model, shape = _zoo("linear")
    x = _inputs(shape, 3, seed=0)
    with pytest.raises(ValueError, match="InputNorm"):
        certify(cnn.Sequential(cnn.Linear(12, 3)), x)
    with pytest.raises(ValueError, match="front-end"):
        certify(torch.nn.Sequential(torch.nn.Identity(), model), x)
    with pytest.raises(TypeError, match="model"):
        certify("model", x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x must be"):
        certify(model, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="finite"):
        certify(model, x.clone().fill_(math.nan))
    with pytest.raises(ValueError, match="batch_size"):
        certify(model, x, batch_size=0)
    with pytest.raises(ValueError, match="norm must be"):
        certified_accuracy(model, x, torch.zeros(3), [0.1], norm="l1")
    with pytest.raises(ValueError, match="radius"):
        certified_accuracy(model, x, torch.zeros(3), [-1.0])
    with pytest.raises(ValueError, match="radii"):
        certified_accuracy(model, x, torch.zeros(3), 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="labels"):
        certified_accuracy(model, x, torch.zeros(4), [0.1])
    with pytest.raises(ValueError, match="steps"):
        pgd_l2(model, x, torch.zeros(3), 0.1, steps=0)
    with pytest.raises(ValueError, match="eps"):
        pgd_l2(model, x, torch.zeros(3), -0.1)
    with pytest.raises(ValueError, match="eps"):
        pgd_l2(model, x, torch.zeros(3), torch.ones(2))
    premapped, _ = _prepare("linear", "centred-ball", seed=0)
    premapped[0].premap_(x.clone())
    with pytest.raises(ValueError, match="inputs_premapped"):
        certify(premapped, x)


def _plain_linear(
    classes: int, seed: int, n: int = 400, d: int = 12
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain torch linear classifier (no InputNorm: an Opacus twin's kind of model), inputs,
    labels (a fifth of them random, so some predictions are wrong) and each sample's exact
    minimal L2 adversarial distance (0 for a wrong prediction): ``min_j (z_y - z_j) / ||W_y -
    W_j||``, one logit: ``|z| / ||w||``."""
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(d, classes).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(classes, d, generator=gen, dtype=torch.float64))
        lin.bias.copy_(torch.randn(classes, generator=gen, dtype=torch.float64))
    model = torch.nn.Sequential(torch.nn.Flatten(), lin)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        z = model(x)
    w = lin.weight.detach()
    if classes == 1:
        y = (z[:, 0] > 0).long()
        y = torch.where(torch.rand(n, generator=gen) < 0.2, 1 - y, y)
        signed = torch.where(y == 1, z[:, 0], -z[:, 0])
        dist = (signed / torch.linalg.vector_norm(w[0])).clamp(min=0.0)
        return model, x, y, dist
    y = z.argmax(dim=1)
    y = torch.where(
        torch.rand(n, generator=gen) < 0.2, torch.randint(0, classes, (n,), generator=gen), y
    )
    gaps = z.gather(1, y[:, None]) - z
    pair = torch.linalg.vector_norm(w[y][:, None, :] - w[None, :, :], dim=2)
    own = torch.arange(classes)[None] == y[:, None]
    ratio = torch.where(own, torch.full_like(gaps, math.inf), gaps / pair.clamp(min=1e-300))
    correct = gaps.masked_fill(own, math.inf).amin(dim=1) > 0
    return model, x, y, torch.where(correct, ratio.amin(dim=1), torch.zeros_like(gaps[:, 0]))


RADII = [0.0, 0.05, 0.1, 0.3, 0.6, 0.9]


def _exact(dist: torch.Tensor, radii: list[float]) -> list[float]:
    return [float((dist > r).double().mean()) for r in radii]


def test_empirical_accuracy_is_exact_on_a_binary_linear_classifier() -> None:
    """One logit: the margin's gradient is the constant ``+-w``, so PGD reaches the hyperplane
    along its normal and finds every adversarial point inside the radius: the empirical robust
    accuracy is the exact one (no sample's distance is within 1e-6 of a radius here)."""
    model, x, y, dist = _plain_linear(1, seed=3)
    assert not bool(((dist[:, None] - torch.tensor(RADII[1:])).abs() < 1e-6).any())
    exact = _exact(dist, RADII)
    assert exact[0] < 0.9 and exact[-1] > 0.05  # wrong predictions and a spread of distances
    assert empirical_accuracy(model, x, y, RADII) == pytest.approx(exact, abs=1e-12)


def test_empirical_accuracy_brackets_the_exact_robust_accuracy_with_the_certificate() -> None:
    """Five classes: the attack never does better than the exact answer (an empirical robust
    accuracy is never below the true one) and comes within 1 point of it with the default 40
    steps and 3 restarts (its misses: a runner-up class that the gradient path never activates,
    the min over classes being a concave, piecewise-linear margin); the certificate of the same
    weights in a clipless linear model (exact for a linear head) is never above either."""
    model, x, y, dist = _plain_linear(5, seed=1)
    exact = _exact(dist, RADII)
    assert exact[0] < 0.9 and exact[-1] > 0.05
    emp = empirical_accuracy(model, x, y, RADII)
    assert emp[0] == pytest.approx(exact[0], abs=1e-12)  # radius 0: the clean accuracy
    for e, t in zip(emp, exact, strict=True):
        assert t <= e <= t + 0.01
    twin = models.linear((12,), 5, input_norm=1e3).double()  # the ball contains every input
    with torch.no_grad():
        twin[1].weight.copy_(model[1].weight)
        twin[1].bias.copy_(model[1].bias)
    cert = certified_accuracy(twin, x, y, RADII)
    assert cert.certified == pytest.approx(exact, abs=1e-12)  # the head's pairwise constants
    assert all(c <= e for c, e in zip(cert.certified, emp, strict=True))


def test_empirical_accuracy_rejects_bad_arguments() -> None:
    model, x, y, _ = _plain_linear(3, seed=0, n=4)
    with pytest.raises(ValueError, match="radii must be a sequence"):
        empirical_accuracy(model, x, y, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="radius must be a number >= 0"):
        empirical_accuracy(model, x, y, [-1.0])
    with pytest.raises(ValueError, match="y must be a tensor of 4 labels"):
        empirical_accuracy(model, x, y[:3], [0.1])
    with pytest.raises(ValueError, match="x must be a non-empty floating tensor"):
        empirical_accuracy(model, x.long(), y, [0.1])
