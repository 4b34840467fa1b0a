"""clipless.sampling: Poisson batches (inclusion rate, batch-size law, empty batches)."""

from __future__ import annotations

import doctest
import math
import pickle
from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from clipless import sampling
from clipless.sampling import (
    PoissonDataLoader,
    PoissonSampler,
    as_poisson_loader,
    poisson_loader,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images(n: int = 20) -> TensorDataset:
    return TensorDataset(torch.randn(n, 3, 4, 5), torch.arange(n))


def test_doctests() -> None:
    result = doctest.testmod(sampling)
    assert result.attempted >= 1
    assert result.failed == 0


# ----------------------------------------------------------------------------------- the law
def test_inclusion_frequency_is_q() -> None:
    n, q, steps = 100, 0.2, 2000
    counts = np.zeros(n)
    for batch in PoissonSampler(n, q, steps=steps, generator=_gen(0)):
        assert batch == sorted(set(batch))  # distinct, increasing
        assert all(0 <= i < n for i in batch)
        counts[batch] += 1
    # Each index: Binomial(steps, q); all within 5 standard deviations.
    sd = math.sqrt(steps * q * (1 - q))
    assert np.all(np.abs(counts - steps * q) < 5 * sd)
    # Overall frequency: 4 standard errors.
    freq = counts.sum() / (n * steps)
    assert abs(freq - q) < 4 * math.sqrt(q * (1 - q) / (n * steps))


def test_the_inclusion_probability_is_never_above_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit finding: ``u < q`` on the grid ``k 2^-53`` includes with probability
    ``ceil(q 2^53) 2^-53``, a hair above the accounted ``q``. The grid point just below ``q``
    (for a ``q`` off the grid) must not be included; the one below that must be."""
    q = 0.1
    assert q * 2**53 != math.floor(q * 2**53)  # q is off the grid
    edge = math.floor(q * 2**53) * 2.0**-53  # u = edge < q: included by u < q
    below = edge - 2.0**-53
    monkeypatch.setattr(
        sampling.torch,
        "rand",
        lambda n, **kw: torch.tensor([edge, below, 0.0, q], dtype=torch.float64),
    )
    batch = PoissonSampler(4, q, steps=1, generator=_gen(0)).sample()
    assert batch.tolist() == [1, 2]


def test_inclusions_independent_across_examples() -> None:
    n, q, steps = 8, 0.5, 4000
    mat = np.zeros((steps, n))
    for t, batch in enumerate(PoissonSampler(n, q, steps=steps, generator=_gen(1))):
        mat[t, batch] = 1.0
    corr = np.corrcoef(mat.T)
    off = corr[~np.eye(n, dtype=bool)]
    assert np.all(np.abs(off) < 4 / math.sqrt(steps))


def test_batch_sizes_are_binomial() -> None:
    n, q, steps = 50, 0.3, 4000
    sizes = np.array([len(b) for b in PoissonSampler(n, q, steps=steps, generator=_gen(2))])
    assert abs(sizes.mean() - n * q) < 4 * math.sqrt(n * q * (1 - q) / steps)
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.1)
    # Chi-square goodness of fit against Binomial(n, q), tails pooled so every bin expects >= 5.
    pmf = stats.binom.pmf(np.arange(n + 1), n, q)
    lo, hi = 6, 24
    observed = [np.sum(sizes <= lo)] + [np.sum(sizes == k) for k in range(lo + 1, hi)]
    observed.append(np.sum(sizes >= hi))
    expected = [pmf[: lo + 1].sum()] + [pmf[k] for k in range(lo + 1, hi)] + [pmf[hi:].sum()]
    expected_counts = np.array(expected) * steps
    assert expected_counts.min() >= 5
    p_value = stats.chisquare(observed, expected_counts).pvalue
    assert p_value > 1e-3


def test_q_one_takes_everything() -> None:
    sampler = PoissonSampler(7, 1.0, generator=_gen(3))
    assert len(sampler) == 1
    assert list(sampler) == [list(range(7))]


# ------------------------------------------------------------------------------ empty batches
def test_empty_batches_are_yielded_with_shapes() -> None:
    loader = PoissonDataLoader(_images(), 1e-3, steps=50, generator=_gen(4))
    batches = list(loader)
    assert len(batches) == 50
    empty = [b for b in batches if b[0].shape[0] == 0]
    assert len(empty) >= 40  # P(empty) = 0.999^20 ~ 0.98
    x, y = empty[0]
    assert x.shape == (0, 3, 4, 5) and x.dtype == torch.float32
    assert y.shape == (0,) and y.dtype == torch.int64
    # Empty batches go through a model and a sum loss like any other.
    out = torch.nn.Linear(5, 2)(x).sum()
    assert out.item() == 0.0


class _DictData(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "x": torch.full((2, 2), float(i), dtype=torch.float64),
            "label": i % 2,
            "weight": 0.5,
            "name": f"item{i}",
        }


Pair = namedtuple("Pair", ["features", "target"])


class _PairData(Dataset[Any]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return Pair(np.ones(3, dtype=np.float32) * i, np.int32(i))


def test_empty_batch_structures() -> None:
    loader = PoissonDataLoader(_DictData(), 1e-9, steps=2, generator=_gen(5))
    batch = next(iter(loader))
    assert set(batch) == {"x", "label", "weight", "name"}
    assert batch["x"].shape == (0, 2, 2) and batch["x"].dtype == torch.float64
    assert batch["label"].shape == (0,) and batch["label"].dtype == torch.int64
    assert batch["weight"].shape == (0,) and batch["weight"].dtype == torch.float64
    assert batch["name"] == []
    full = next(iter(PoissonDataLoader(_DictData(), 1.0, generator=_gen(5))))
    assert full["x"].shape == (6, 2, 2)

    pair = next(iter(PoissonDataLoader(_PairData(), 1e-9, steps=1, generator=_gen(6))))
    assert isinstance(pair, Pair)
    assert pair.features.shape == (0, 3) and pair.features.dtype == torch.float32
    assert pair.target.shape == (0,) and pair.target.dtype == torch.int32


def test_empty_batch_returns_fresh_tensors() -> None:
    loader = PoissonDataLoader(_images(), 1e-9, steps=2, generator=_gen(7))
    a, b = list(loader)
    assert a[0] is not b[0]


def test_collate_is_picklable_for_workers() -> None:
    loader = PoissonDataLoader(_images(), 0.5, generator=_gen(8))
    restored = pickle.loads(pickle.dumps(loader.collate_fn))
    assert restored([])[0].shape == (0, 3, 4, 5)


# --------------------------------------------------------------------------- reproducibility
def test_seeded_generator_reproducible() -> None:
    def run(seed: int) -> list[list[int]]:
        return list(PoissonSampler(30, 0.2, steps=20, generator=_gen(seed)))

    assert run(11) == run(11)
    assert run(11) != run(12)
    sampler = PoissonSampler(30, 0.2, steps=20, generator=_gen(11))
    assert list(sampler) != list(sampler)  # the second epoch continues the stream


def test_default_generator_is_not_predictable_from_the_global_seed() -> None:
    """The batch choice must stay secret: a public torch.manual_seed does not fix it."""
    torch.manual_seed(123)
    a = [list(PoissonSampler(200, 0.5, steps=3)) for _ in range(2)]
    torch.manual_seed(123)
    b = list(PoissonSampler(200, 0.5, steps=3))
    assert a[0] != b and a[1] != b and a[0] != a[1]
    assert isinstance(PoissonSampler(3, 0.5).generator, torch.Generator)


def test_loader_batches_reproducible_and_generator_reachable() -> None:
    data = _images(40)
    l1 = PoissonDataLoader(data, 0.1, generator=_gen(9))
    l2 = PoissonDataLoader(data, 0.1, generator=_gen(9))
    for (x1, y1), (x2, y2) in zip(l1, l2, strict=True):
        assert torch.equal(y1, y2) and torch.equal(x1, x2)
        assert torch.equal(x1, data.tensors[0][y1])
    # Checkpointing code finds the sampling generator on the batch sampler.
    assert isinstance(l1.batch_sampler, PoissonSampler)
    assert l1.batch_sampler.generator is l1.poisson_sampler.generator


def test_tensor_datasets_are_gathered_in_one_index_with_the_same_batches() -> None:
    """A plain TensorDataset is fetched with one index per tensor (no per-sample loop); the batches
    (empty ones included) are exactly those of the per-sample path with a user collate."""
    data = _images(60)
    fast = PoissonDataLoader(data, 0.05, steps=200, generator=_gen(3))
    slow = PoissonDataLoader(
        data,
        0.05,
        steps=200,
        generator=_gen(3),
        collate_fn=lambda b: torch.utils.data.default_collate(b),
    )
    assert hasattr(fast.dataset, "__getitems__") and not hasattr(slow.dataset, "__getitems__")
    assert fast.dataset.tensors is data.tensors  # type: ignore[attr-defined]
    sizes = []
    for a, b in zip(fast, slow, strict=True):
        assert isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2
        for ta, tb in zip(a, b, strict=True):
            assert ta.shape == tb.shape and ta.dtype == tb.dtype and torch.equal(ta, tb)
        sizes.append(len(a[1]))
    assert 0 in sizes and max(sizes) >= 6  # empty batches and full ones both went through
    again = PoissonDataLoader(fast.dataset, 0.5, collate_fn=lambda b: ("custom", len(b)))
    assert not hasattr(again.dataset, "__getitems__")  # a custom collate sees samples again
    assert next(iter(again))[0] == "custom"
    assert hasattr(PoissonDataLoader.from_data_loader(fast).dataset, "__getitems__")


# -------------------------------------------------------------------------------- attributes
def test_attributes_and_default_steps() -> None:
    loader = PoissonDataLoader(_images(40), 0.3, generator=_gen(10))
    assert loader.sample_rate == 0.3
    assert loader.num_samples == 40
    assert loader.expected_batch_size == pytest.approx(12.0)
    assert loader.steps == len(loader) == 3  # round(1 / 0.3)
    assert len(list(loader)) == 3
    assert len(PoissonSampler(10, 0.004)) == 250
    assert len(PoissonSampler(10, 0.7)) == 1
    assert len(PoissonSampler(10, 0.1, steps=7)) == 7


def test_from_data_loader() -> None:
    data = _images(100)

    def collate(batch: list[Any]) -> tuple[torch.Tensor, torch.Tensor, str]:
        x, y = torch.utils.data.default_collate(batch)
        return x, y, "custom"

    base = DataLoader(data, batch_size=10, shuffle=True, collate_fn=collate, drop_last=True)
    loader = PoissonDataLoader.from_data_loader(base, generator=_gen(13))
    assert loader.sample_rate == pytest.approx(0.1)
    assert loader.expected_batch_size == pytest.approx(10.0)
    assert len(loader) == 10
    _x, _y, tag = next(iter(loader))
    assert tag == "custom"
    empty = loader.collate_fn([])
    assert empty[0].shape == (0, 3, 4, 5)
    assert empty[2] == "custom"  # non-tensor leaves are kept as the template's
    override = PoissonDataLoader.from_data_loader(base, sample_rate=0.25)
    assert override.sample_rate == 0.25
    big = PoissonDataLoader.from_data_loader(DataLoader(data, batch_size=500))
    assert big.sample_rate == 1.0


def test_poisson_loader_dispatch() -> None:
    data = _images(50)
    from_dataset = poisson_loader(data, 0.2, generator=_gen(14))
    assert isinstance(from_dataset, PoissonDataLoader)
    assert poisson_loader(from_dataset) is from_dataset
    assert as_poisson_loader(from_dataset, sample_rate=0.2) is from_dataset
    other = poisson_loader(from_dataset, 0.5)
    assert other is not from_dataset and other.sample_rate == 0.5
    from_loader = as_poisson_loader(DataLoader(data, batch_size=5))
    assert from_loader.sample_rate == pytest.approx(0.1)
    with pytest.raises(ValueError, match="sample_rate is required"):
        poisson_loader(data)
    with pytest.raises(TypeError, match="datasets only"):
        poisson_loader(DataLoader(data, batch_size=5), num_workers=2)


# -------------------------------------------------------------------------------- bad input
class _Stream(IterableDataset[int]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(3)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"sample_rate": 0.0}, ValueError, r"sample_rate must be in \(0, 1\]"),
        ({"sample_rate": 1.5}, ValueError, "sample_rate"),
        ({"sample_rate": math.nan}, ValueError, "sample_rate"),
        ({"sample_rate": "0.1"}, TypeError, "sample_rate"),
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"num_samples": 2.5}, TypeError, "num_samples"),
        ({"steps": 0}, ValueError, "steps"),
        ({"generator": 3}, TypeError, "generator"),
    ],
)
def test_sampler_bad_input(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"num_samples": 10, "sample_rate": 0.1}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        PoissonSampler(**args)


def test_loader_bad_input() -> None:
    with pytest.raises(TypeError, match="batch_size"):
        PoissonDataLoader(_images(), 0.1, batch_size=4)
    with pytest.raises(TypeError, match="shuffle"):
        PoissonDataLoader(_images(), 0.1, shuffle=True)
    with pytest.raises(TypeError, match="IterableDataset"):
        PoissonDataLoader(_Stream(), 0.1)
    with pytest.raises(ValueError, match="empty"):
        PoissonDataLoader(TensorDataset(torch.zeros(0, 2)), 0.1)
    with pytest.raises(ValueError, match="sample_rate"):
        PoissonDataLoader(_images(), 0.0)
    with pytest.raises(TypeError, match="DataLoader"):
        PoissonDataLoader.from_data_loader(_images())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        PoissonDataLoader.from_data_loader(DataLoader(_images(), batch_size=None))


# ------------------------------------------------------------------ counting handed-out batches
def test_the_loader_counts_the_batches_it_hands_out() -> None:
    """What the optimizer checks: batches handed out (not prefetched) and the last one's rows."""
    data = TensorDataset(torch.randn(40, 3), torch.arange(40))
    loader = PoissonDataLoader(data, 0.25, steps=5, generator=torch.Generator().manual_seed(0))
    assert loader.batches_yielded == 0 and loader.last_batch_size is None
    it = iter(loader)
    assert len(it) == 5
    x, _ = next(it)
    assert loader.batches_yielded == 1 and loader.last_batch_size == x.shape[0]
    sizes = [x.shape[0]] + [b[0].shape[0] for b in it]
    assert loader.batches_yielded == 5 and loader.last_batch_size == sizes[-1]
    assert len({*sizes}) > 1  # Poisson sizes: the count follows each batch
    list(loader)  # a second pass counts on
    assert loader.batches_yielded == 10


def test_worker_prefetching_is_not_counted() -> None:
    data = TensorDataset(torch.randn(40, 3), torch.arange(40))
    loader = PoissonDataLoader(data, 0.25, steps=6, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    x, _ = next(it)
    assert loader.batches_yielded == 1  # four more are in flight in the workers
    assert loader.last_batch_size == x.shape[0]  # the batch handed out, not a prefetched one
    sizes = [x.shape[0]]
    for x, _ in it:
        sizes.append(x.shape[0])
        assert loader.last_batch_size == x.shape[0]
    assert loader.batches_yielded == 6 and len(set(sizes)) > 1


def test_rows_of_structured_and_tensorless_batches() -> None:
    class Records(Dataset[Any]):
        def __len__(self) -> int:
            return 30

        def __getitem__(self, i: int) -> Any:
            return {"meta": "r", "x": torch.full((2,), float(i)), "y": i}

    loader = PoissonDataLoader(Records(), 1.0, steps=1)
    next(iter(loader))
    assert loader.last_batch_size == 30
    # the size counts the sampled examples, whatever the collate makes of them (review
    # finding: the leading dimension of the first tensor was read instead)
    words = PoissonDataLoader(
        Records(), 1.0, steps=1, collate_fn=lambda rows: [r["meta"] for r in rows]
    )
    next(iter(words))
    assert words.batches_yielded == 1 and words.last_batch_size == 30
    views = PoissonDataLoader(  # 4 views of each example, as flat rows
        Records(), 1.0, steps=1, collate_fn=lambda rows: torch.stack([r["x"] for r in rows] * 4)
    )
    assert next(iter(views)).shape[0] == 120 and views.last_batch_size == 30


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: DataLoader(
            ds, batch_size=8, sampler=torch.utils.data.SubsetRandomSampler(range(16))
        ),
        lambda ds: DataLoader(
            ds, batch_size=8, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 64, 64)
        ),
        lambda ds: DataLoader(
            ds,
            batch_sampler=torch.utils.data.BatchSampler(
                torch.utils.data.SubsetRandomSampler(range(16)), 8, False
            ),
        ),
        lambda ds: DataLoader(ds, batch_sampler=[[0, 1], [2, 3]]),
    ],
)
def test_a_sampler_that_selects_records_is_refused_not_dropped(make: Any) -> None:
    """Audit finding: a SubsetRandomSampler was dropped, so the Poisson loader drew the records
    meant to be held out (q computed over all 64)."""
    ds = TensorDataset(torch.arange(64.0)[:, None])
    with pytest.raises(ValueError, match="would drop"):
        PoissonDataLoader.from_data_loader(make(ds))


def test_default_samplers_are_replaced_silently() -> None:
    ds = TensorDataset(torch.arange(64.0)[:, None])
    for loader in (DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=8, shuffle=True)):
        assert PoissonDataLoader.from_data_loader(loader).sample_rate == 0.125
