"""A dataset that holds one record twice (a check of :meth:`clipless.PrivacyEngine.make_private`).

The accounting assumes that every index of the training dataset is a distinct record, sampled
with probability ``q`` and contributing at most the sensitivity. A record present ``m`` times
contributes up to ``m`` times the sensitivity (measured: 2.0x for two copies, 3.0x for three)
and is sampled ``m`` times as often: oversampling by repeated indices (``Subset(ds, [0, 0, 0,
1, ...])``, the usual class balancing, or ``ConcatDataset([ds, ds])``) breaks record-level DP.
Refusing it is simpler and safer than accounting a multiplicity (group privacy of size ``m``
costs far more than the balancing gains). To balance classes, weight the loss by a public
constant per class (within the certified loss: e.g. a smaller bound for the frequent classes) or
rebalance by dropping records, never by repeating them.

The check follows the dataset's structure: ``Subset`` (nested, negative indices included) and
``ConcatDataset`` down to their leaves; a leaf is identified by its object, and a
``TensorDataset`` by the memory of its first tensor (two ``TensorDataset`` over the same rows, or
over overlapping views of one tensor, are one leaf). Records duplicated by *content* (a tensor
built with repeated rows) cannot be told from distinct records with equal values, and are not
detected: the caller must not copy records.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Subset, TensorDataset

__all__ = ["refuse_repeated_records"]

_Leaves = dict[object, list[np.ndarray]]


def refuse_repeated_records(dataset: Any, argument: str = "data_loader.dataset") -> None:
    """Raise :class:`ValueError` naming ``argument`` if two indices of ``dataset`` reach the same
    record of one underlying dataset (module docstring). Datasets without a length pass."""
    try:
        n = len(dataset)
    except TypeError:
        return
    leaves: _Leaves = {}
    _collect(dataset, np.arange(n, dtype=np.int64), leaves)
    for key, parts in leaves.items():
        positions = np.concatenate(parts)
        unique, counts = np.unique(positions, return_counts=True)
        if len(unique) < len(positions):
            times = int(counts.max())
            raise ValueError(
                f"{argument} holds a record {times} times ({len(positions) - len(unique)} repeated "
                f"indices into {_describe(key)}), which the accounting does not cover; give every "
                "record once (to balance classes, weight the loss by a public constant per class)"
            )


def _collect(dataset: Any, index: np.ndarray, leaves: _Leaves) -> None:
    """Add the leaf positions that the indices ``index`` of ``dataset`` reach to ``leaves``."""
    if isinstance(dataset, Subset):
        inner = dataset.dataset
        indices = dataset.indices
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        try:
            mapped = np.asarray(indices, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):  # not integer positions: a leaf of its own
            leaves.setdefault(("dataset", id(dataset)), []).append(index)
            return
        size = _length(inner)
        if size is not None and size > 0:
            mapped = np.where(mapped < 0, mapped + size, mapped)
        _collect(inner, mapped[index], leaves)
        return
    if isinstance(dataset, ConcatDataset):
        bounds = np.asarray([0, *dataset.cumulative_sizes], dtype=np.int64)
        part = np.searchsorted(bounds, index, side="right") - 1
        for k, inner in enumerate(dataset.datasets):
            chosen = index[part == k]
            if chosen.size:
                _collect(inner, chosen - bounds[k], leaves)
        return
    key, offset, stride = _leaf(dataset)
    leaves.setdefault(key, []).append(offset + stride * index)


def _leaf(dataset: Any) -> tuple[object, int, int]:
    """(identity, offset, stride): index ``i`` of the leaf is position ``offset + stride i``."""
    if isinstance(dataset, TensorDataset) and dataset.tensors:
        t = dataset.tensors[0]
        if t.ndim > 0 and t.layout == torch.strided and t.stride(0) != 0:
            storage = t.untyped_storage()
            item = t.element_size()
            key = ("storage", storage.data_ptr(), t.device)
            return key, int(t.storage_offset()) * item, int(t.stride(0)) * item
    return (("dataset", id(dataset)), 0, 1)


def _describe(key: object) -> str:
    return "one tensor's rows" if isinstance(key, tuple) and key[0] == "storage" else "a dataset"


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None
