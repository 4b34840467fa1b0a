"""Does a public feature cross raise Adult's converged linear ceiling? (issue 10; RESULTS.md 22c)

Non-private logistic regression (full-batch L-BFGS, as ``benchmarks/adult.py --method logreg``)
on the ``public-bins`` features with one-hot crosses appended. The crosses are fixed a priori:
those of TensorFlow's "wide and deep" census tutorial (education x occupation, age group x
education x occupation, native country x occupation) and two more (marital status x sex,
relationship x education). ``benchmarks/adult_crosses.py`` (section 16d) trained the private and
non-private models on five other crosses; this script asks for the converged linear ceiling.
Run ``.venv/bin/python benchmarks/adult_crosses_logreg.py`` after ``make data`` (about 2
minutes on one core).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from clipless.data import data_root, tabular

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adult

CROSSES = {
    "education x occupation": ("education", "occupation"),
    "age group x education x occupation": ("age", "education", "occupation"),
    "native country x occupation": ("native-country", "occupation"),
    "marital status x sex": ("marital-status", "sex"),
    "relationship x education": ("relationship", "education"),
}
AGE_EDGES = np.asarray(tabular.ADULT_BINS["age"], dtype=np.float64)


def records(text: str) -> list[dict[str, str]]:
    out = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.strip().split(",")]
        if len(fields) == len(tabular._ADULT_COLUMNS):
            out.append(dict(zip(tabular._ADULT_COLUMNS, fields, strict=True)))
    return out


def _value(record: dict[str, str], column: str) -> str:
    if column == "age":  # the public census age group of ADULT_BINS
        return str(int(np.searchsorted(AGE_EDGES, float(record["age"]), side="right")))
    return record[column]


def cross(rows: list[dict[str, str]], columns: tuple[str, ...]) -> np.ndarray:
    """One-hot of the combination of ``columns`` over the public category lists."""
    levels = [
        [str(i) for i in range(AGE_EDGES.size + 1)] if c == "age" else tabular._ADULT_CATEGORIES[c]
        for c in columns
    ]
    index = {combo: i for i, combo in enumerate(itertools.product(*levels))}
    out = np.zeros((len(rows), len(index)))
    for i, r in enumerate(rows):
        j = index.get(tuple(_value(r, c) for c in columns))
        if j is not None:  # '?' and unlisted values: no 1
            out[i, j] = 1.0
    return out


def logreg(x: np.ndarray, y: np.ndarray, xt: np.ndarray, yt: np.ndarray, l2: float = 0.0) -> float:
    """``benchmarks/adult.py``'s ``logreg`` method (seed 0) on these arrays."""
    train = TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))
    test = TensorDataset(torch.tensor(xt, dtype=torch.float32), torch.tensor(yt))
    return float(adult.run_logreg({"l2": l2}, 0, train, test)["accuracy"])


def main() -> None:
    root = Path(data_root()) / "adult"
    train_text = (root / "adult.data").read_text()
    test_text = (root / "adult.test").read_text()
    x, y = tabular._parse_adult(train_text, "public-bins")
    xt, yt = tabular._parse_adult(test_text, "public-bins")
    rows, test_rows = records(train_text), records(test_text)
    print(f"public-bins: {x.shape[1]} features, {logreg(x, y, xt, yt):.4f}", flush=True)
    blocks = {name: (cross(rows, cols), cross(test_rows, cols)) for name, cols in CROSSES.items()}
    for name, (a, at) in blocks.items():
        acc = logreg(np.hstack([x, a]), y, np.hstack([xt, at]), yt)
        print(f"+ {name}: {a.shape[1]} more, {acc:.4f}", flush=True)
    wide = ("education x occupation", "age group x education x occupation")
    a = np.hstack([x, *(blocks[n][0] for n in wide)])
    at = np.hstack([xt, *(blocks[n][1] for n in wide)])
    for l2 in (0.0, 1e-5, 1e-4):
        acc = logreg(a, y, at, yt, l2)
        print(f"+ both wide-and-deep crosses, L2 {l2:g}: {acc:.4f}", flush=True)


if __name__ == "__main__":
    main()
