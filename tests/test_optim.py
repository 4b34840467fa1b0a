"""clipless.optim.AdamBC: the bias-corrected Adam update against a scalar reference, and the
noise variance DPOptimizer hands it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless
from clipless import nn
from clipless.engine import MechanismSpec
from clipless.optim import AdamBC


def _reference(grads, variances, lr, betas, floor, ratio):
    """Tang et al. (2024), Algorithm 1, one scalar coordinate, in Python floats."""
    b1, b2 = betas
    p, m, v, phi = 0.0, 0.0, 0.0, 0.0
    out = []
    for t, (g, var) in enumerate(zip(grads, variances, strict=True), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        phi = b2 * phi + (1 - b2) * var
        c2 = 1 - b2**t
        low = max(floor, ratio * phi / c2)
        p -= lr * (m / (1 - b1**t)) / math.sqrt(max(v / c2 - phi / c2, low))
        out.append(p)
    return out


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_update_matches_the_scalar_reference(ratio):
    grads = [0.5, -0.2, 0.05, 0.3, -0.01, 0.02]
    variances = [0.04, 0.01, 0.01, 0.0, 0.2, 0.05]
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = AdamBC([p], lr=0.1, betas=(0.8, 0.9), floor=1e-6, floor_ratio=ratio)
    got = []
    for g, var in zip(grads, variances, strict=True):
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.set_noise_variance({p: var})
        opt.step()
        got.append(float(p.detach()))
    want = _reference(grads, variances, 0.1, (0.8, 0.9), 1e-6, ratio)
    assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    # the first step by hand: v^ = 0.25, phi^ = 0.04, so p = -0.1 * 0.5 / sqrt(0.21)
    assert want[0] == pytest.approx(-0.1 * 0.5 / math.sqrt(0.21), rel=1e-15)


def test_the_floors():
    """A coordinate whose second moment is all noise steps by lr m^ / sqrt(floor)."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = AdamBC([p], lr=1.0, betas=(0.0, 0.5), floor=1e-4, floor_ratio=0.25)
    p.grad = torch.tensor([0.1, 0.001], dtype=torch.float64)
    opt.set_noise_variance({p: 0.04})  # phi^ = 0.04 > v^ for both coordinates
    opt.step()
    # denominators: sqrt(max(1e-4, 0.25 * 0.04)) = 0.1 for both (v^ - phi^ < 0)
    assert p.tolist() == pytest.approx([-1.0, -0.01], rel=1e-15)
    q = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = AdamBC([q], lr=1.0, betas=(0.0, 0.5), floor=1e-4)
    q.grad = torch.tensor([0.001], dtype=torch.float64)
    opt.step()  # no variance given: Adam with eps inside the root, sqrt(max(1e-6, 1e-4))
    assert q.tolist() == pytest.approx([-0.1], rel=1e-15)


def test_without_noise_it_is_adam_up_to_eps():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    b = torch.nn.Parameter(a.detach().clone())
    ours = AdamBC([a], lr=0.01, floor=1e-30)
    adam = torch.optim.Adam([b], lr=0.01, eps=0.0)
    for _ in range(5):
        g = torch.randn(4, 3, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        adam.step()
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_variance_is_for_one_step_only():
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = AdamBC([p], lr=0.1, betas=(0.9, 0.99))
    p.grad = torch.ones(1, dtype=torch.float64)
    opt.set_noise_variance({p: 0.5})
    opt.step()
    opt.step()  # nothing given: this step's noise variance is 0
    assert opt.state[p]["noise_avg"] == pytest.approx(0.99 * 0.01 * 0.5, rel=1e-15)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr must be"),
        ({"betas": (0.9,)}, "betas must be a pair"),
        ({"betas": (1.0, 0.9)}, r"betas\[0\] must be"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\] must be"),
        ({"floor": 0.0}, "floor must be a positive"),
        ({"floor": math.inf}, "floor must be a positive"),
        ({"floor_ratio": -1.0}, "floor_ratio must be"),
        ({"floor_ratio": math.nan}, "floor_ratio must be"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamBC([torch.nn.Parameter(torch.zeros(1))], **kwargs)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, 1])
def test_bad_variance_is_named(bad):
    p = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="noise variance must be"):
        AdamBC([p]).set_noise_variance({p: bad})


class _Spy(AdamBC):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def set_noise_variance(self, variances):
        self.seen.append(dict(variances))
        super().set_noise_variance(variances)


@pytest.mark.parametrize("noise", ["global", "per-layer"])
def test_dp_optimizer_passes_the_averaged_gradient_noise_variance(noise):
    torch.manual_seed(0)
    model = nn.Sequential(nn.InputNorm(1.0), nn.Linear(5, 8), nn.GroupSort(2), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(200, 5, generator=g), torch.randint(0, 2, (200,), generator=g))
    opt = _Spy(model.parameters(), lr=0.01)
    engine = clipless.PrivacyEngine(accountant="pld", seed=0)
    loss = nn.CrossEntropyLoss()
    m, o, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(data, batch_size=20),
        loss=loss,
        noise_multiplier=1.3,
        mechanism=MechanismSpec(noise=noise, constraint="clip"),
    )
    names = dict(m.named_parameters())
    for step, (x, y) in enumerate(dl):
        if step == 3:
            break
        stds = o.noise_stds()  # the plan at the weights this forward uses
        o.zero_grad()
        loss(m(x), y).backward()
        o.step()
        want = {names[n]: (s / o.expected_batch_size) ** 2 for n, s in stds.items()}
        assert opt.seen[-1] == want
        assert all(v > 0.0 for v in want.values())
    assert len(opt.seen) == 3
    # the moving average of the variances the update subtracts
    p = names["1.weight"]
    b2 = opt.defaults["betas"][1]
    avg = 0.0
    for seen in opt.seen:
        avg = b2 * avg + (1 - b2) * seen[p]
    assert opt.state[p]["noise_avg"] == pytest.approx(avg, rel=1e-15)


def test_state_dict_round_trip_continues_the_same_trajectory():
    torch.manual_seed(0)
    grads = [torch.randn(3, dtype=torch.float64) for _ in range(6)]
    a = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = AdamBC([a], lr=0.05, floor_ratio=0.1)
    for g in grads:
        a.grad = g.clone()
        opt.set_noise_variance({a: 0.3})
        opt.step()
    b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    first = AdamBC([b], lr=0.05, floor_ratio=0.1)
    for g in grads[:3]:
        b.grad = g.clone()
        first.set_noise_variance({b: 0.3})
        first.step()
    second = AdamBC([b], lr=0.05, floor_ratio=0.1)
    second.load_state_dict(first.state_dict())
    for g in grads[3:]:
        b.grad = g.clone()
        second.set_noise_variance({b: 0.3})
        second.step()
    assert torch.equal(a, b)


def test_the_gradient_fingerprint_of_a_large_gradient() -> None:
    """The fingerprint converts a large CPU gradient 1 MiB at a time (no whole float64 copy):
    equal bits give equal fingerprints, any rescale or single change another one, and a
    rescaled large gradient is refused at step() as a small one is."""
    from clipless.optim.guard import _FINGERPRINT_CHUNK, _fingerprint

    g = torch.randn(3 * _FINGERPRINT_CHUNK + 17, generator=torch.Generator().manual_seed(0))
    f = _fingerprint(g)
    assert torch.equal(f, _fingerprint(g.clone()))
    exact = float((g.double() ** 2).sum())
    assert float(f.view(torch.float64)) == pytest.approx(exact, rel=1e-12)  # summation order
    assert not torch.equal(f, _fingerprint(g * (1 + 2.0**-20)))
    h = g.clone()
    h[-1] += 1.0
    assert not torch.equal(f, _fingerprint(h))
    nan = g.clone()
    nan[5] = float("nan")
    assert torch.equal(_fingerprint(nan), _fingerprint(nan.clone()))  # NaN-safe: bits compared

    import clipless
    import clipless.nn as cnn

    torch.manual_seed(0)
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(600, 600), cnn.GroupSort(2),
                           cnn.Linear(600, 3))  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(64, 600), torch.randint(0, 3, (64,)))
    m, o, dl = clipless.PrivacyEngine(seed=0).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=16),
        loss=cnn.CrossEntropyLoss(),
        noise_multiplier=1.0,
    )
    x, y = next(iter(dl))
    o.zero_grad()
    o.loss(m(x), y).backward()
    assert m[1].weight.grad.numel() > _FINGERPRINT_CHUNK
    m[1].weight.grad.data.mul_(20.0)
    with pytest.raises(clipless.optim.PrivacyContractError, match="without autograd seeing it"):
        o.step()


def test_adambc_takes_numpy_numbers_and_refuses_bools() -> None:
    import numpy as np

    from clipless.optim import AdamBC

    p = torch.nn.Parameter(torch.zeros(2))
    opt = AdamBC([p], lr=np.float32(0.1), betas=(np.float64(0.9), 0.99), floor=np.float32(1e-6))
    assert type(opt.defaults["lr"]) is float
    for kwargs in ({"lr": True}, {"floor_ratio": True}, {"betas": (True, 0.9)}):
        with pytest.raises(ValueError):
            AdamBC([p], **kwargs)


def test_dpoptimizer_checks_ledger_path_and_generator() -> None:
    """Audit finding: ledger=None or generator=123 failed only at the first step."""
    from clipless import accounting
    from clipless.optim import DPOptimizer

    model = clipless.nn.Sequential(clipless.nn.InputNorm(1.0), clipless.nn.Linear(3, 2))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    config = clipless.mechanism.PrivacyConfig(
        noise_multiplier=1.0, sample_rate=0.5, num_samples=10, num_tensors=2
    )
    good = {
        "module": model,
        "loss": clipless.nn.CrossEntropyLoss(reduction="sum"),
        "input_shape": (3,),
        "config": config,
        "ledger": accounting.PrivacyLedger(),
    }
    DPOptimizer(base, **good)
    for bad, match in (
        ({"ledger": None}, "ledger must be"),
        ({"ledger_path": 123}, "ledger_path"),
        ({"generator": 123}, "generator"),
    ):
        with pytest.raises(TypeError, match=match):
            DPOptimizer(base, **{**good, **bad})
