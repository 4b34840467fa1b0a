"""One example's contribution through the five paths of issue 35, in the noise's own metric.

``sqrt(sum_p ||c_p||^2 / std_p^2) * plan.accounting_noise_multiplier`` (at most 1: calibrated),
measured through the real training path with the helpers of ``tests/test_privacy_holes.py``.
Run it against a source tree to compare (``PYTHONPATH=<tree>/src python
benchmarks/privacy_holes.py``): a refused path prints the error it raises.

1. batch-mixing augmentation through ``training_loss(augment=, optimizer=)`` (what ``fit``
   runs), worst over 100 canaries of a batch of 6 (with minus without the canary);
2. a record present ``m`` times in ``Subset(ds, [i] * m + ...)``: the rows the loader yields when
   it draws every copy, worst over 39 records;
3. the batch sum's rounding: the review's float32 model with ``B`` near-duplicates of a canary;
4. a dispatch mode multiplying every ``aten.mm`` by 100 around ``backward()``;
5. every one of two ranks training on ``x[: len(x) // 2]``: the all-reduced sum is twice one
   process's gradient of those rows, so a canary among them contributes twice its single
   contribution (derived in one process; ``tests/test_privacy_holes.py`` checks the refusal with
   two gloo processes).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_privacy_holes as h


def _refused(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return f"{fn(*args):.6f}"
    except (ValueError, RuntimeError) as exc:
        return f"refused ({type(exc).__name__}: {str(exc)[:70]}...)"


def augmentation() -> None:
    for name, aug in (
        ("0.5 x + 0.5 x.flip(0)", h._mix_flip),
        ("mixup 0.3", h._mixup),
        ("none", None),
    ):
        _, m, o, _ = h._private()
        o.data_loader = None
        print(f"1. augment {name}: {_refused(h._canary_ratio, o, m, aug, 100)}")


def _copies_ratio(copies: int) -> float:
    data = h._data()
    ds = torch.utils.data.Subset(data, [0] * copies + list(range(1, h.N)))
    _, m, o, _ = h._private(dataset=ds)
    o.data_loader = None
    plan = o.current_plan()
    worst = 0.0
    for i in range(1, 40):
        ds.indices[:copies] = [i] * copies
        x = torch.stack([ds[j][0] for j in range(copies)]) * 20
        y = torch.stack([ds[j][1] for j in range(copies)])
        o.zero_grad()
        o.loss(m(x), y).backward()
        worst = max(worst, h._ratio(m, plan))
        o._pending.clear()
    return worst


def repeated_records() -> None:
    for copies in (1, 2, 3):
        print(f"2. a record {copies} times: {_refused(_copies_ratio, copies)}")


def batch_sum() -> None:
    for batch, dim in ((8192, 1), (32768, 1), (131072, 30)):
        worst = max(h._batch_sum_ratio(batch, dim, s) for s in range(3))
        print(f"3. B = {batch}, d = {dim}: {worst:.6f}")


def _mode_ratio() -> float:
    _, m, o, _ = h._private()
    o.data_loader = None
    plan = o.current_plan()
    worst = 0.0
    for i in range(20):
        x, y = h._data().tensors[0][i : i + 1] * 50, h._data().tensors[1][i : i + 1]
        o.zero_grad()
        out = m(x)
        with h._Times100():
            o.loss(out, y).backward()
        worst = max(worst, h._ratio(m, plan))
        o._pending.clear()
    return worst


def _first_rows_ratio() -> float:
    """Two ranks on the same first rows: the reduced sum holds each of them twice."""
    _, m, o, _ = h._private()
    o.data_loader = None
    plan = o.current_plan()
    worst = 0.0
    for i in range(40):
        x, y = h._data().tensors[0][i : i + 1] * 20, h._data().tensors[1][i : i + 1]
        o.zero_grad()
        o.loss(m(x), y).backward()
        worst = max(worst, 2 * h._ratio(m, plan))
        o._pending.clear()
    return worst


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    augmentation()
    repeated_records()
    batch_sum()
    print(f"4. aten.mm x 100 around backward(): {_refused(_mode_ratio)}")
    print(f"5. two ranks on x[: len(x) // 2] (derived, one process): {_first_rows_ratio():.6f}")


if __name__ == "__main__":
    main()
