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
        **kw,
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
