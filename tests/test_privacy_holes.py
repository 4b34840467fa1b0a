"""Issue 35: five paths a review found through which one example contributed more than the noise
covers, each now refused or closed by construction.

Contributions are measured through the real training path in the noise's own metric,
``sqrt(sum_p ||c_p||^2 / std_p^2) * plan.accounting_noise_multiplier`` (at most 1: calibrated).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import clipless
from _mechanism import split_options
from clipless import nn
from clipless.optim import PrivacyContractError

DIM = 5
N = 200


def _data(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(0, 2, (n,), generator=g))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.InputNorm(2.0), nn.Linear(DIM, 8), nn.GroupSort(2), nn.Linear(8, 2))


def _private(model: torch.nn.Module | None = None, dataset=None, **kw):
    model = model if model is not None else _model()
    engine = clipless.PrivacyEngine(seed=0)
    kw.setdefault("noise_multiplier", 1.0)
    m, o, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset if dataset is not None else _data(), batch_size=20),
        loss=kw.pop("loss", nn.CrossEntropyLoss()),
        **split_options(kw),
    )
    return engine, m, o, dl


def _ratio(m: torch.nn.Module, plan) -> float:
    """One example's contribution (the gradients now held) in the noise's metric."""
    sq = sum(
        (p.grad.double().norm().item() / plan.stds[name]) ** 2
        for name, p in m.named_parameters()
        if p.grad is not None and name in plan.stds
    )
    return math.sqrt(sq) * plan.accounting_noise_multiplier


# ------------------------------------------------------------------ 4. Python modes
class _Times100(TorchDispatchMode):
    """The review's mode: every matrix product's result multiplied by 100."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 100 if func is torch.ops.aten.mm.default else out


class _MatmulTimes100(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 100 if func is torch.Tensor.__matmul__ else out


@pytest.mark.parametrize(
    ("mode", "around"),
    [
        (_Times100, "backward"),
        (_Times100, "forward"),
        (_Times100, "step"),
        (_MatmulTimes100, "forward"),
        (_MatmulTimes100, "step"),
    ],
)
def test_a_python_mode_around_the_guarded_pass_is_refused(mode, around: str) -> None:
    """Review finding 4: a dispatch mode multiplying ``aten.mm`` by 100 around ``backward()`` put
    1650 times the sensitivity into an accepted step. Every mode is refused (an observing mode
    cannot be told from a changing one), at the forward, in the backward and at the step. (A
    function mode around ``backward()`` receives ``Tensor.backward`` itself and is switched off
    while it runs it: it sees no operator of the pass.)"""
    _, m, o, _dl = _private()
    o.data_loader = None
    x, y = _data().tensors[0][:1] * 50, _data().tensors[1][:1]
    o.zero_grad()
    with pytest.raises(PrivacyContractError, match="Mode"):
        with mode() if around == "forward" else _null():
            out = m(x)
        with mode() if around == "backward" else _null():
            o.loss(out, y).backward()
        with mode() if around == "step" else _null():
            o.step()
    assert o.ledger.steps == 0


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_a_default_device_context_is_not_a_foreign_mode() -> None:
    _, m, o, _ = _private()
    o.data_loader = None
    x, y = _data().tensors[0][:4], _data().tensors[1][:4]
    with torch.device("cpu"):
        o.zero_grad()
        o.loss(m(x), y).backward()
        o.step()
    assert o.ledger.steps == 1


# ------------------------------------------------------- 2. records present twice
def _repeats():
    data = _data()
    x, y = data.tensors
    balanced = torch.utils.data.Subset(data, [0, 0, 0, *range(1, N)])
    return {
        "subset with repeated indices": balanced,
        "nested subsets": torch.utils.data.Subset(
            torch.utils.data.Subset(data, list(range(50))), [3, 4, 5, 3]
        ),
        "a negative index": torch.utils.data.Subset(data, [N - 1, -1]),
        "a tensor index": torch.utils.data.Subset(data, torch.tensor([7, 8, 7])),
        "the same dataset concatenated": torch.utils.data.ConcatDataset([data, data]),
        "two datasets over the same rows": torch.utils.data.ConcatDataset(
            [TensorDataset(x, y), TensorDataset(x[:10], y[:10])]
        ),
        "subsets of one dataset, concatenated": torch.utils.data.ConcatDataset(
            [torch.utils.data.Subset(data, [1, 2]), torch.utils.data.Subset(data, [2, 3])]
        ),
    }


@pytest.mark.parametrize("case", sorted(_repeats()))
def test_a_dataset_holding_a_record_twice_is_refused(case: str) -> None:
    """Review finding 2: ``Subset(ds, [0, 0, 0, 1, ...])`` (oversampling, the path a refused
    ``WeightedRandomSampler`` pointed to) was taken as distinct records: a record present twice
    contributed 2.0 times its sensitivity, three times 3.0, and was sampled as often. Refused at
    make_private, before any state changes."""
    engine = clipless.PrivacyEngine(seed=0)
    model = _model()
    with pytest.raises(ValueError, match=r"data_loader\.dataset holds a record"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_repeats()[case], batch_size=20),
            loss=nn.CrossEntropyLoss(),
            noise_multiplier=1.0,
        )
    assert engine.optimizer is None


def test_distinct_records_in_subsets_and_concatenations_are_accepted() -> None:
    data = _data()
    x, y = data.tensors
    for dataset in (
        torch.utils.data.Subset(data, [5, 1, -3, 0]),
        torch.utils.data.ConcatDataset(
            [TensorDataset(x[:100], y[:100]), TensorDataset(x[100:], y[100:])]
        ),
        torch.utils.data.ConcatDataset(
            [torch.utils.data.Subset(data, [1, 2]), torch.utils.data.Subset(data, [3, 4])]
        ),
        TensorDataset(x[:1].expand(10, DIM), y[:10]),  # equal values, distinct records
    ):
        _private(dataset=dataset)


# ------------------------------------------------------ 1. batch-mixing augmentation
def _mix_flip(x: torch.Tensor) -> torch.Tensor:
    """The review's transform: every row averaged with its mirror row in the batch."""
    return 0.5 * x + 0.5 * x.flip(0)


def _mixup(x: torch.Tensor) -> torch.Tensor:
    lam = 0.3
    return lam * x + (1 - lam) * x[torch.randperm(x.shape[0])]


def _canary_ratio(o, m, augment, canaries: int = 30, batch: int = 6) -> float:
    """Worst contribution of one example to the batch's gradient sum (with it minus without it),
    through ``training_loss(..., augment=, optimizer=o)`` (what :func:`fit` runs), in the noise's
    metric."""
    from clipless.training import training_loss

    x_all, y_all = _data().tensors
    plan = o.current_plan()
    worst = 0.0
    for c in range(canaries):
        rows = [c, *range(100, 100 + batch - 1)]
        grads = []
        for keep in (rows, rows[1:]):
            o.zero_grad(set_to_none=True)
            x, y = x_all[keep] * 50, y_all[keep]
            torch.manual_seed(c)  # the same random draws with and without the canary
            training_loss(m, o.loss, x, y, augment=augment, optimizer=o)[0].backward()
            o._pending.clear()  # measured without stepping
            grads.append({n: p.grad.double().clone() for n, p in m.named_parameters()})
        sq = sum(((grads[0][n] - grads[1][n]).norm().item() / plan.stds[n]) ** 2 for n in plan.stds)
        worst = max(worst, math.sqrt(sq) * plan.accounting_noise_multiplier)
    return worst


@pytest.mark.parametrize("augment", [_mix_flip, _mixup])
def test_an_augmentation_cannot_mix_the_examples_of_a_batch(augment) -> None:
    """Review finding 1: ``fit(..., augment=lambda x: 0.5 * x + 0.5 * x.flip(0))`` gave one
    example 1.94 times its calibrated contribution (the row count is unchanged: no check fired).
    ``augment`` now runs on every row alone (``training.per_sample``, vmap): the same transform
    sees a batch of one and cannot reach another example. Measured as the difference of the
    batch gradients with and without each canary."""
    _, m, o, _ = _private()
    o.data_loader = None
    worst = _canary_ratio(o, m, augment)
    assert 0.5 < worst <= 1.0


def test_a_per_sample_augmentation_is_unchanged_and_draws_per_row() -> None:
    from clipless.training import per_sample

    x = torch.randn(6, 3)
    torch.testing.assert_close(per_sample(lambda t: 2 * t.flip(1), x), 2 * x.flip(1))
    noisy = per_sample(lambda t: t + torch.randn_like(t), torch.zeros(6, 3))
    assert len({tuple(r.tolist()) for r in noisy}) == 6  # independent draws per row
    with pytest.raises(ValueError, match="vmap"):
        per_sample(lambda t: t * float(t.sum().item()), x)
    with pytest.raises(ValueError, match="one row per input row"):
        per_sample(lambda t: torch.cat([t, t]), x)


# ---------------------------------------- 5. a data-parallel rank training on other rows
def _shard_worker(rank: int, world: int, port: int, out: str) -> None:
    import os
    import sys
    from pathlib import Path

    import torch.distributed as dist

    from clipless import distributed
    from clipless.training import training_loss

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen: dict[str, str] = {}
    try:
        _, m, o, loader = _private(loss=nn.CrossEntropyLoss())
        distributed.make_data_parallel(o, loader)
        batches = iter(loader)

        def attempt(name: str, rows) -> None:
            xb, yb = next(batches)
            try:
                o.zero_grad()
                x, y = rows(xb, yb)
                o.loss(m(x), y).backward()
                o.step()
                seen[name] = "accepted"
            except PrivacyContractError as exc:
                seen[name] = str(exc)
                o.discard_batch()

        attempt("shard", lambda x, y: distributed.shard(x, y, loader=loader))
        attempt("first rows", lambda x, y: (x[: len(x) // world], y[: len(y) // world]))
        attempt(
            "first rows after shard()",
            lambda x, y: (
                distributed.shard(x, y, loader=loader) and x[: len(x) // world],
                y[: len(y) // world],
            ),
        )
        xb, yb = next(batches)
        x, y = distributed.shard(xb, yb, loader=loader)
        o.zero_grad()
        value = training_loss(m, o.loss, x, y, augment=lambda t: t.flip(1), augmult=2, optimizer=o)
        value[0].backward()
        o.step()
        seen["augmented shard"] = "accepted"
        torch.save(seen, Path(out) / f"shard{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def test_a_rank_training_on_other_rows_than_its_shard_is_refused(tmp_path) -> None:
    """Review finding 5: every rank training on ``x[: len(x) // world]`` instead of its shard gave
    1.54 (the first examples counted on both ranks) and was accepted: the check compared row
    counts only. ``shard()`` now records an exact digest of the rows it handed out, and the
    training forward requires exactly those rows (an augmented forward only through
    ``training_loss``, which checks the shard first)."""
    import socket

    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    torch.multiprocessing.spawn(_shard_worker, args=(2, port, str(tmp_path)), nprocs=2)
    for rank in range(2):
        seen = torch.load(tmp_path / f"shard{rank}.pt")
        assert seen["shard"] == "accepted" and seen["augmented shard"] == "accepted"
        assert "is not the" in seen["first rows"], seen
        assert "is not the" in seen["first rows after shard()"], seen


# ------------------------------------------------------- 3. rounding of the batch sum
def _batch_sum_ratio(batch: int, dim: int, seed: int = 0) -> float:
    """The review's setting: ``InputNorm(2, sphere) -> Linear(dim, 2, bias=False) ->
    LossGradientClip(0.1)``, a batch of ``batch`` near-duplicates of the canary (canary + 1e-3
    noise, same label) in float32; the difference of the computed gradient sums with and without
    the canary, in the noise's metric (the planned sensitivity, margin included)."""
    g = torch.Generator().manual_seed(seed)
    canary = torch.randn(1, dim, generator=g)
    x = canary + 1e-3 * torch.randn(batch, dim, generator=g)
    x[0] = canary[0]
    y = torch.zeros(batch, dtype=torch.long)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.InputNorm(2.0, mode="sphere"),
        nn.Linear(dim, 2, bias=False),
        nn.LossGradientClip(0.1),
    )
    _, m, o, _ = _private(model=model, dataset=TensorDataset(x, y), constraint=None)
    o.data_loader = None
    plan = o.current_plan()
    sums = []
    for rows in (slice(0, batch), slice(1, batch)):
        o.zero_grad(set_to_none=True)
        o.loss(m(x[rows]), y[rows]).backward()
        o._pending.clear()  # measured without stepping
        sums.append({n: p.grad.double().clone() for n, p in m.named_parameters()})
    sq = sum(((sums[0][n] - sums[1][n]).norm().item() / plan.stds[n]) ** 2 for n in plan.stds)
    return math.sqrt(sq) * plan.accounting_noise_multiplier


def test_the_rounding_of_a_large_batch_sum_is_covered() -> None:
    """Review finding 3: in float32 the computed batch sum with and without one example differed
    by 1.000167 times the planned sensitivity at B = 8192 (d = 1), growing like ``2^-24 B``: the
    constant margin covered one row's arithmetic, not a sum of ``B`` rows. The scaled kernels
    now sum in float64 and the margin covers the sum's rounding for any batch of at most the
    dataset size plus one (``mechanism.rounding_margin``)."""
    worst = max(_batch_sum_ratio(8192, 1, seed) for seed in range(3))
    assert 0.9 < worst <= 1.0


def test_the_rounding_margin_grows_with_the_public_batch_bound() -> None:
    from clipless import mechanism

    base = mechanism.ROUNDING_MARGIN["float32"]
    one = mechanism.rounding_margin("float32")
    big = mechanism.rounding_margin("float32", batch_bound=60_001)
    # dominated by rounding the sum to float32, 2 B gamma_2(2^-24); float64 terms 0.3%
    assert big == pytest.approx(base + 2 * 60_001 * 2 * 2.0**-24, rel=5e-3)
    assert one < mechanism.rounding_margin("float32", batch_bound=2) < big
    assert mechanism.rounding_margin("float32", batch_bound=10, uses=3) > (
        mechanism.rounding_margin("float32", batch_bound=10)
    )
    assert mechanism.rounding_margin("float64", batch_bound=60_001) < 1e-4
    for bad in ({"batch_bound": 0}, {"uses": 0}, {"batch_bound": 1.5}, {"uses": True}):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            mechanism.rounding_margin("float32", **bad)


@pytest.mark.parametrize("conv", [False, True])
def test_the_scaled_kernels_sum_the_batch_in_float64(conv: bool) -> None:
    """The weight gradient is the float64 sum of the rows' float32 contributions, rounded once."""
    torch.manual_seed(0)
    layer = nn.Conv2d(2, 3, 3, padding=1, bias=True) if conv else nn.Linear(5, 3)
    layer.scaling_threshold = 1.0
    x = torch.randn(300, 2, 6, 6) if conv else torch.randn(300, 5)
    out = layer(x)
    dy = torch.randn_like(out)
    out.backward(dy)
    from clipless.nn._scaled import _divisors

    inv = _divisors(layer, x, 1.0)
    dys = (dy * inv.view(-1, *([1] * (dy.ndim - 1)))).double()
    if conv:
        from torch.nn.grad import conv2d_weight

        ref = conv2d_weight(x.double(), layer.weight.shape, dys, padding=1)
        ref_b = dys.sum(dim=(0, 2, 3))
    else:
        ref = dys.t() @ x.double()
        ref_b = dys.sum(0)
    torch.testing.assert_close(layer.weight.grad, ref.float(), rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, ref_b.float(), rtol=0, atol=0)
