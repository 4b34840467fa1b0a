"""Poisson sampling: the data loader whose batches the privacy accounting assumes.

Every step draws a fresh batch in which each of the ``N`` examples is included *independently*
with probability ``q`` (the sampled Gaussian mechanism of Abadi et al. 2016, Mironov, Talwar and
Zhang 2019; docs/design.md, "Adjacency and normalisation"). Batch sizes are therefore random,
``Binomial(N, q)``, and may be **zero**: an empty batch is still a step (the optimizer adds noise to
a zero gradient and the ledger counts it), so it is yielded, as correctly shaped empty tensors.
The noisy sum is divided by the *expected* batch size ``q N`` (:attr:`expected_batch_size`),
never by the realised one.

Sampling is vectorised: one ``torch.rand(N)`` in float64 per step (uniform on the grid
``k 2^-53``), compared with ``q`` rounded down to that grid (inclusion probability at most ``q``,
and within ``2^-53`` of it), then ``nonzero``. The sampling randomness comes from a
``torch.Generator`` kept on the sampler (``loader.batch_sampler.generator``) so checkpoints can save
and restore it; it is not a cryptographically secure source.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)

from clipless import _validate

__all__ = [
    "EmptyBatchCollate",
    "PoissonDataLoader",
    "PoissonSampler",
    "as_poisson_loader",
    "default_steps",
    "poisson_loader",
]

_FORBIDDEN_LOADER_KWARGS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def default_steps(sample_rate: float) -> int:
    """Steps in one "epoch" of Poisson sampling: ``max(1, round(1 / q))``."""
    return max(1, round(1.0 / _validate.probability("sample_rate", sample_rate, open_low=True)))


class PoissonSampler(Sampler[list[int]]):
    """Batch sampler: ``steps`` batches, each example included independently with probability
    ``sample_rate``.

    Yields lists of distinct indices in increasing order, possibly empty. ``steps`` defaults to
    ``round(1 / sample_rate)`` (one expected pass over the data). ``generator`` defaults to a
    private ``torch.Generator`` seeded from the operating system's CSPRNG (:mod:`secrets`): the
    amplification by subsampling assumes the batch choice is secret, so it must not be
    predictable from a public seed such as ``torch.manual_seed``. Pass a seeded generator for
    reproducible experiments (which then forgo that assumption).

    >>> g = torch.Generator().manual_seed(0)
    >>> sampler = PoissonSampler(10, 0.3, steps=3, generator=g)
    >>> [len(b) for b in sampler], len(sampler), sampler.expected_batch_size
    ([2, 2, 4], 3, 3.0)
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.num_samples = _validate.positive_int("num_samples", num_samples)
        self.sample_rate = _validate.probability("sample_rate", sample_rate, open_low=True)
        self.steps = (
            default_steps(self.sample_rate)
            if steps is None
            else _validate.positive_int("steps", steps)
        )
        if generator is None:
            generator = torch.Generator().manual_seed(secrets.randbits(63))
        elif not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None; got {type(generator).__name__}"
            )
        self.generator = generator

    @property
    def expected_batch_size(self) -> float:
        """``q N``: the divisor of the noisy gradient sum."""
        return self.sample_rate * self.num_samples

    def sample(self) -> torch.Tensor:
        """One Poisson batch as a 1-D int64 tensor of distinct increasing indices (maybe empty)."""
        u = torch.rand(
            self.num_samples, generator=self.generator, dtype=torch.float64, device="cpu"
        )
        # u is uniform on the grid k 2^-53: u < floor(q 2^53) 2^-53 has probability
        # floor(q 2^53) 2^-53 <= q exactly (u < q would be ceil(q 2^53) 2^-53, a hair above q).
        threshold = math.floor(self.sample_rate * 2.0**53) * 2.0**-53
        return torch.nonzero(u < threshold, as_tuple=True)[0]

    def __iter__(self) -> Iterator[list[int]]:
        # one FIFO per pass: the loader pops one (size, fingerprint) per batch it hands out
        # (batches come out in sampling order, however far the workers prefetch)
        drawn: deque[tuple[int, int]] = deque()
        self._drawn = drawn
        for _ in range(self.steps):
            indices = self.sample()
            drawn.append((int(indices.numel()), _fingerprint(indices)))
            yield indices.tolist()

    def __len__(self) -> int:
        return self.steps


def _fingerprint(indices: torch.Tensor) -> int:
    """A 52-bit digest of a batch's indices (exact in a float64, for an all-reduce)."""
    data = indices.to(torch.int64).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 12


def _empty_like(collated: Any) -> Any:
    """The structure of a collated batch with the batch dimension cut to 0 (same dtypes, same
    trailing shapes, same container types)."""
    if isinstance(collated, torch.Tensor):
        if collated.dim() == 0:
            raise ValueError("collate_fn returned a 0-dim tensor: cannot infer a batch dimension")
        return collated[:0].clone()
    if isinstance(collated, Mapping):
        items = {k: _empty_like(v) for k, v in collated.items()}
        try:
            return type(collated)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(collated, tuple) and hasattr(collated, "_fields"):  # namedtuple
        return type(collated)(*(_empty_like(v) for v in collated))
    if isinstance(collated, tuple):
        return tuple(_empty_like(v) for v in collated)
    if isinstance(collated, list):
        # default_collate returns a list of per-position batches for list samples, and a plain
        # list of the values for non-tensor leaves (strings): empty in both senses.
        if all(isinstance(v, torch.Tensor | Mapping | tuple | list) for v in collated) and collated:
            return [_empty_like(v) for v in collated]
        return []
    return collated


def _clone_structure(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, Mapping):
        items = {k: _clone_structure(v) for k, v in value.items()}
        try:
            return type(value)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_clone_structure(v) for v in value))
    if isinstance(value, tuple):
        return tuple(_clone_structure(v) for v in value)
    if isinstance(value, list):
        return [_clone_structure(v) for v in value]
    return value


class _Gathered(tuple[torch.Tensor, ...]):
    """A batch of a :class:`TensorDataset` already gathered by one index per tensor."""


class _GatheringTensorDataset(TensorDataset):
    """The same tensors as a :class:`TensorDataset`, fetched a whole batch at a time.

    ``DataLoader`` calls ``__getitems__(indices)`` when a dataset has it: one ``tensor[indices]``
    per tensor instead of a Python loop over the batch's samples and a ``torch.stack`` (at batch
    2048 on Adult the loop took most of a step). The result collates to exactly what
    ``default_collate`` gives for the per-sample path: a list of batched tensors.
    """

    def __init__(self, base: TensorDataset) -> None:
        self.tensors = base.tensors

    def __getitems__(self, indices: Sequence[int]) -> _Gathered:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return _Gathered(t[idx] for t in self.tensors)


class EmptyBatchCollate:
    """Wraps a collate function so that an empty batch yields correctly shaped empty tensors.

    ``template`` is the structure returned for an empty batch: the collation of one sample with
    the batch dimension cut to 0 (computed from ``dataset[0]`` when the loader is built). A fresh
    copy is returned each time. Picklable (for worker processes) when ``collate_fn`` is.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], template: Any) -> None:
        self.collate_fn = collate_fn
        self.template = template

    def __call__(self, batch: Sequence[Any]) -> Any:
        if isinstance(batch, _Gathered):
            return list(batch)
        if len(batch) == 0:
            return _clone_structure(self.template)
        return self.collate_fn(list(batch))


class _CountingIterator:
    """The loader's iterator, counting the batches it hands out (:class:`PoissonDataLoader`)."""

    def __init__(self, loader: PoissonDataLoader, inner: Iterator[Any]) -> None:
        self._loader = loader
        self._inner = inner

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        loader = self._loader
        loader._yielded += 1
        drawn = getattr(loader.poisson_sampler, "_drawn", None)
        in_order = getattr(loader, "in_order", True)
        size, fingerprint = drawn.popleft() if drawn and in_order else (None, None)
        loader._last_size, loader._last_fingerprint = size, fingerprint
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


class PoissonDataLoader(DataLoader[Any]):
    """A ``DataLoader`` whose batches are Poisson samples of rate ``sample_rate``.

    Uses :class:`PoissonSampler` as ``batch_sampler`` and a collate function that turns empty
    batches into empty tensors shaped like ``collate_fn([dataset[0]])``. Other keyword arguments
    (``num_workers``, ``pin_memory``, ``worker_init_fn``...) go to ``DataLoader``; ``batch_size``,
    ``shuffle``, ``sampler``, ``batch_sampler`` and ``drop_last`` are refused (the sampler decides).
    ``generator`` drives the *sampling* (see :class:`PoissonSampler`); pass ``loader_generator``
    for ``DataLoader``'s own ``generator`` (worker seeds).

    Attributes: :attr:`sample_rate` ``q``, :attr:`num_samples` ``N``, :attr:`expected_batch_size`
    ``q N``, :attr:`steps` (``len(loader)``), :attr:`batches_yielded` and :attr:`last_batch_size`
    (what the optimizer of :meth:`clipless.engine.PrivacyEngine.make_private` checks: one Poisson
    batch per step, and no more rows in the training forward than the batch has examples).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        sample_rate: float,
        *,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        loader_generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        bad = sorted(set(kwargs) & set(_FORBIDDEN_LOADER_KWARGS))
        if bad:
            raise TypeError(
                f"PoissonDataLoader does not accept {bad}: batches are Poisson samples of rate "
                "sample_rate (use sample_rate and steps)"
            )
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "Poisson sampling needs a map-style dataset (with __len__ and __getitem__); got an "
                f"IterableDataset ({type(dataset).__name__})"
            )
        try:
            num_samples = len(dataset)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TypeError(
                f"dataset must have a length for Poisson sampling; got {type(dataset).__name__}"
            ) from exc
        if num_samples == 0:
            raise ValueError("dataset is empty: Poisson sampling needs at least one example")
        sampler = PoissonSampler(num_samples, sample_rate, steps, generator)
        if isinstance(dataset, _GatheringTensorDataset):  # from a PoissonDataLoader: re-decide
            dataset = TensorDataset(*dataset.tensors)
        base_collate = default_collate if collate_fn is None else collate_fn
        if isinstance(base_collate, EmptyBatchCollate):
            base_collate = base_collate.collate_fn
        template = _empty_like(base_collate([dataset[0]]))
        if base_collate is default_collate and type(dataset) is TensorDataset:
            dataset = _GatheringTensorDataset(dataset)  # same tensors, batched indexing
        super().__init__(
            dataset,
            batch_sampler=sampler,
            collate_fn=EmptyBatchCollate(base_collate, template),
            generator=loader_generator,
            **kwargs,
        )
        self.poisson_sampler = sampler
        self._yielded = 0
        self._last_size: int | None = None
        self._last_fingerprint: int | None = None

    def __iter__(self) -> _CountingIterator:  # type: ignore[override]
        """DataLoader's iterator, counting the batches handed out (after any prefetching)."""
        return _CountingIterator(self, super().__iter__())

    @property
    def batches_yielded(self) -> int:
        """Batches this loader has handed out so far, over all its iterations."""
        return self._yielded

    @property
    def last_batch_fingerprint(self) -> int | None:
        """A digest of the indices of the last batch handed out (``None`` before the first, or
        when batches may come out of order): :func:`clipless.distributed.shard` compares it
        across ranks."""
        return self._last_fingerprint

    @property
    def last_batch_size(self) -> int | None:
        """The number of examples the sampler drew for the last batch handed out (``None``
        before the first batch, or when batches may come out of order: ``in_order=False``).
        Counted from the sampled indices, not from the collated tensors, so a collate that
        emits several rows per example does not raise it."""
        return self._last_size

    @property
    def sample_rate(self) -> float:
        """``q``: the probability that one example is in one batch."""
        return self.poisson_sampler.sample_rate

    @property
    def num_samples(self) -> int:
        """``N``: the dataset size."""
        return self.poisson_sampler.num_samples

    @property
    def expected_batch_size(self) -> float:
        """``q N``: the divisor of the noisy gradient sum."""
        return self.poisson_sampler.expected_batch_size

    @property
    def steps(self) -> int:
        """Batches per iteration over the loader (``len(loader)``)."""
        return self.poisson_sampler.steps

    @classmethod
    def from_data_loader(
        cls,
        loader: DataLoader[Any],
        sample_rate: float | None = None,
        *,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ) -> PoissonDataLoader:
        """A Poisson loader over ``loader.dataset`` with ``loader``'s collate and worker settings.

        ``sample_rate`` defaults to ``batch_size / len(dataset)`` (capped at 1), so the expected
        batch size equals the original one (Opacus's ``DPDataLoader.from_data_loader`` uses
        ``1 / len(loader)``, about the same when the loader keeps its last partial batch).
        """
        if not isinstance(loader, DataLoader):
            raise TypeError(f"loader must be a torch DataLoader; got {type(loader).__name__}")
        dataset = loader.dataset
        if not isinstance(loader, PoissonDataLoader) and not isinstance(dataset, IterableDataset):
            _refuse_custom_sampler(loader)
        if sample_rate is None:
            if isinstance(loader, PoissonDataLoader):
                sample_rate = loader.sample_rate
            else:
                batch_size = loader.batch_size
                if batch_size is None:
                    batch_size = getattr(loader.batch_sampler, "batch_size", None)
                if not isinstance(batch_size, int) or batch_size < 1:
                    raise ValueError(
                        "cannot infer sample_rate from a DataLoader without an integer batch_size; "
                        "pass sample_rate"
                    )
                try:
                    n = len(dataset)  # type: ignore[arg-type]
                except TypeError as exc:
                    raise TypeError(
                        "dataset must have a length for Poisson sampling; got "
                        f"{type(dataset).__name__}"
                    ) from exc
                if n == 0:
                    raise ValueError(
                        "dataset is empty: Poisson sampling needs at least one example"
                    )
                sample_rate = min(1.0, batch_size / n)
        kwargs: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "persistent_workers": loader.persistent_workers,
            "pin_memory_device": loader.pin_memory_device,
        }
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        return cls(
            dataset,
            sample_rate,
            steps=steps,
            generator=generator,
            collate_fn=loader.collate_fn,
            loader_generator=loader.generator,
            **kwargs,
        )


def _refuse_custom_sampler(loader: DataLoader[Any]) -> None:
    """Refuse a loader whose sampler selects or weights records: Poisson sampling would drop it.

    The Poisson loader draws every record of ``loader.dataset`` with the same probability ``q``
    (what the accountant assumes). Torch's default samplers (sequential, or shuffling the whole
    dataset) only order the records, so replacing them changes nothing else; a
    ``SubsetRandomSampler``, a ``WeightedRandomSampler`` or a custom ``batch_sampler`` choose
    which records are trained on, and silently dropping them would train on records the caller
    meant to leave out. To train on part of a dataset, pass ``torch.utils.data.Subset(dataset,
    indices)`` as the dataset (each index once); weighted sampling and oversampling by repeated
    indices are not supported. Under :mod:`clipless.distributed` every rank passes the plain
    ``DataLoader``: the ranks draw the same Poisson batch and
    :func:`~clipless.distributed.shard` gives each its rows.
    """
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise ValueError(
            f"data_loader has a custom batch_sampler ({type(batch_sampler).__name__}), which "
            "Poisson sampling would drop; pass a DataLoader with a batch_size and no batch_sampler"
        )
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    if type(sampler) not in (SequentialSampler, RandomSampler):
        raise ValueError(
            f"data_loader has the sampler {type(sampler).__name__}, which Poisson sampling would "
            "drop; to train on part of a dataset, pass torch.utils.data.Subset(dataset, indices) "
            "as the dataset"
            + (
                " (under clipless.distributed every rank passes the plain DataLoader)"
                if type(sampler).__name__ == "DistributedSampler"
                else ""
            )
        )


def poisson_loader(
    dataset_or_loader: Dataset[Any] | DataLoader[Any],
    sample_rate: float | None = None,
    *,
    steps: int | None = None,
    generator: torch.Generator | None = None,
    **kwargs: Any,
) -> PoissonDataLoader:
    """A :class:`PoissonDataLoader` from a dataset (``sample_rate`` required) or a ``DataLoader``.

    A ``DataLoader`` is converted by :meth:`PoissonDataLoader.from_data_loader` (its batch size
    gives the default ``sample_rate``); a :class:`PoissonDataLoader` with the requested rate (or
    none requested) and no other option is returned unchanged.
    """
    if isinstance(dataset_or_loader, DataLoader):
        if kwargs:
            raise TypeError(
                f"options {sorted(kwargs)} apply to datasets only; a DataLoader keeps its own"
            )
        if (
            isinstance(dataset_or_loader, PoissonDataLoader)
            and steps is None
            and generator is None
            and (
                sample_rate is None
                or _validate.probability("sample_rate", sample_rate, open_low=True)
                == dataset_or_loader.sample_rate
            )
        ):
            return dataset_or_loader
        return PoissonDataLoader.from_data_loader(
            dataset_or_loader, sample_rate, steps=steps, generator=generator
        )
    if sample_rate is None:
        raise ValueError("sample_rate is required when building a Poisson loader from a dataset")
    return PoissonDataLoader(
        dataset_or_loader, sample_rate, steps=steps, generator=generator, **kwargs
    )


as_poisson_loader = poisson_loader
"""Alias of :func:`poisson_loader` (the name :mod:`clipless.engine` uses)."""
