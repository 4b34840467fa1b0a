"""Exploratory (3 seeds): Adult public-bins plus public crosses of one-hot groups, linear models.

Each cross is the outer product of two one-hot groups of the ``public-bins`` features (education x
occupation, relationship x education, age group x hours group, relationship x age group, sex x
occupation): a fixed per-record map, so no privacy cost; each cross is one more group with at most
one 1, so the public input radius becomes ``sqrt(17 + 5)``. Prints the non-private linear model
(Adam 1e-3, batch 256, 30 epochs) and the clipless CLI setting for Adult (lr 0.003, T 0.1, loss
clip 0.3, EMA 0.9, batch 2035) at epsilon 0.414, delta 1/n, seeds 0-2 (``benchmarks/RESULTS.md``
section 16d). Run ``python benchmarks/adult_crosses.py``.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adult

from clipless.data.tabular import _adult_feature_names

CROSSES = [("edu", "occ"), ("rel", "edu"), ("age", "hrs"), ("rel", "age"), ("sex", "occ")]
PREFIXES = {
    "edu": ("education=",),
    "occ": ("occupation=",),
    "rel": ("relationship=",),
    "sex": ("sex=",),
    "age": ("age<", "age[", "age>="),
    "hrs": ("hours-per-week<", "hours-per-week[", "hours-per-week>="),
}


def main() -> None:
    torch.set_num_threads(1)
    names = _adult_feature_names("public-bins")
    groups = {
        g: [i for i, n in enumerate(names) if n.startswith(prefixes)]
        for g, prefixes in PREFIXES.items()
    }
    train, test = adult.load("adult", "none", "public-bins")

    def augment(data: TensorDataset) -> TensorDataset:
        x, y = data.tensors
        blocks = [x]
        for a, b in CROSSES:
            xa, xb = x[:, groups[a]], x[:, groups[b]]
            blocks.append((xa[:, :, None] * xb[:, None, :]).reshape(len(x), -1))
        return TensorDataset(torch.cat(blocks, 1), y)

    tr, te = augment(train), augment(test)
    print(f"features {tr.tensors[0].shape[1]}")
    seeds = [0, 1, 2]
    plain = {**adult.OPACUS_DEFAULTS, "hidden": ()}
    accs = [adult.run_nonprivate(plain, s, tr, te)["accuracy"] for s in seeds]
    print(f"non-private linear + crosses: {accs} median {statistics.median(accs):.4f}")
    cfg = {
        **adult.CLIPLESS_DEFAULTS,
        **adult.LINEAR_SETTING,
        "preprocessing": "public-bins",  # the features it is given (the crosses' base)
        "input_norm": math.sqrt(17 + len(CROSSES)),
    }
    accs = [adult.run_clipless(cfg, s, tr, te)["accuracy"] for s in seeds]
    print(f"clipless linear + crosses: {accs} median {statistics.median(accs):.4f}")


if __name__ == "__main__":
    main()
