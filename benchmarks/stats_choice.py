"""The counting-mechanism choice at the exact noise variance, against the flat histogram (issue 37).

For every cell of {N} x {epsilon} x {add/remove, replace-one} (pure DP, discrete Laplace), exact
numbers (no sampling) for:

* ``default``: what ``mechanism="auto"`` releases now
  (:func:`clipless.stats.counting.counting_plan`);
* ``flat``: the flat discrete-Laplace histogram and its cumulative sums (scale ``1/epsilon``
  add/remove, ``2/epsilon`` replace-one, where it is conditioned on the public ``n``);
* ``uniform b``: the consistent b-ary tree with the same noise on every level (OpenDP's shape,
  here with the public root exact under replace-one), best of b in {2, 4, 8, 16};
* ``old``: the previous default (``best_branching`` / ``level_shares`` optimised for
  ``1/epsilon^2``), loaded from git revision ``--old-rev``, at the exact variance of its noise.

Two metrics (counts^2): ``var`` = the mean per-threshold variance of the released prefix counts
(conditioned on ``C_N = n`` under replace-one) and ``score`` = what the choice minimises (under
add/remove the mean variance of ``Chat_i - (i/N) Chat_N``, the first-order CDF error times
``n^2``; under replace-one the same as ``var``).

Usage::

    python benchmarks/stats_choice.py --sizes 12 15 --epsilons 0.1 1 10
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from types import ModuleType

import numpy as np

from clipless.stats.counting import (
    _condition_on_total,
    _tree_score,
    counting_plan,
    exact_level_variances,
    kary_depth,
    kary_prefix_covariance_with_last,
    kary_prefix_variance,
)


def mean_var(N: int, k: int, shares: tuple[Fraction, ...], nb: str, eps: Fraction) -> float:
    lv = exact_level_variances(shares, nb, "laplace", eps)  # type: ignore[arg-type]
    var = kary_prefix_variance(N, k, lv)
    if nb == "replace_one":
        cov = kary_prefix_covariance_with_last(N, k, lv)
        var = _condition_on_total(np.zeros(N), var, cov, 0.0)[1]
    return float(np.mean(var))


def score(N: int, k: int, shares: tuple[Fraction, ...], nb: str, eps: Fraction) -> float:
    lv = exact_level_variances(shares, nb, "laplace", eps)  # type: ignore[arg-type]
    return _tree_score(N, k, nb, lv)  # type: ignore[arg-type]


def uniform(N: int, b: int, nb: str) -> tuple[Fraction, ...]:
    m = kary_depth(N, b) + (1 if nb == "add_remove" else 0)
    return tuple([Fraction(1, m)] * m)


def flat_shares(nb: str) -> tuple[Fraction, ...]:
    return (Fraction(1), Fraction(0)) if nb == "add_remove" else (Fraction(1),)


def load_old(rev: str) -> ModuleType | None:
    try:
        src = subprocess.run(
            ["git", "show", f"{rev}:src/clipless/stats/counting.py"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    path = Path(tempfile.mkdtemp()) / "old_counting.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_counting", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_counting"] = mod
    spec.loader.exec_module(mod)
    return mod


def levels_txt(shares: tuple[Fraction, ...]) -> str:
    return "{" + ",".join(str(i) for i, w in enumerate(shares) if w > 0) + "}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[12, 15], help="log2 N values")
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    p.add_argument("--old-rev", default="9df5546", help="git revision of the previous default")
    args = p.parse_args()
    old = load_old(args.old_rev)
    print(
        "| N | relation | epsilon | default k, levels | default var | flat var | var ratio "
        "| default score | flat score | best uniform b score (b) | old default var "
        "| old score | choice time (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for lg in args.sizes:
        N = 1 << lg
        for nb in ("add_remove", "replace_one"):
            for e in args.epsilons:
                eps = Fraction(e)
                t0 = time.perf_counter()
                plan = counting_plan(N, nb, "laplace", eps)  # type: ignore[arg-type]
                dt = time.perf_counter() - t0
                dv = mean_var(N, plan.branching, plan.shares, nb, eps)
                fv = mean_var(N, N, flat_shares(nb), nb, eps)
                fs = score(N, N, flat_shares(nb), nb, eps)
                us = {b: score(N, b, uniform(N, b, nb), nb, eps) for b in (2, 4, 8, 16)}
                ub = min(us, key=lambda b: us[b])
                ov = os_ = float("nan")
                if old is not None:
                    ok = old.best_branching(N, nb, "laplace")
                    osh = old.level_shares(N, ok, nb, "laplace")
                    ov = mean_var(N, ok, osh, nb, eps)
                    os_ = score(N, ok, osh, nb, eps)
                print(
                    f"| 2^{lg} | {nb} | {e:g} | {plan.branching}, {levels_txt(plan.shares)} "
                    f"| {dv:.4g} | {fv:.4g} | {dv / fv:.3f} | {plan.score:.4g} | {fs:.4g} "
                    f"| {us[ub]:.4g} ({ub}) | {ov:.4g} | {os_:.4g} | {dt:.2f} |"
                )


if __name__ == "__main__":
    main()
