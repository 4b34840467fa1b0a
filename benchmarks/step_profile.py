"""What one steady-state training step runs, on the CPU: operators, host reads, LAPACK calls.

A CPU ``torch.profiler`` trace is the proxy for what a GPU step costs (issue 34): every aten
operator becomes a kernel launch there, and every value read on the host a synchronisation.
For each model (the issue's MLP 784-1024-1024-10, ``convnet((1,28,28),(32,64))`` and
``convnet((3,32,32),(64,128,256))``, as :mod:`train_speed` builds them, batch 256) and each
configuration it reports, for one step after three warm-up steps:

* ``aten ops``: aten operators in the trace (nested ones included, as the profiler lists them);
* ``launch-like``: the operators called from Python that are not views (roughly the kernels a
  GPU launches; nested operators run inside their parent's kernel or on the host);
* ``Python calls``: Python function calls in the step (the host work a GPU waits for when the
  step is bound by its launches rather than its arithmetic);
* ``host reads``: ``aten::_local_scalar_dense`` (``item``, ``float``, ``bool`` of a tensor),
  ``aten::equal`` (a read on an accelerator) and ``Tensor.tolist`` calls;
* ``LAPACK``: torch's linear-algebra decompositions in the trace, plus the SciPy LAPACK / ARPACK
  routines the CPU certificates call (``dpotrf``, ``zpotrf``, ``eigsh``: invisible to the
  profiler, counted by wrapping them);
* ``step ms``: the median over interleaved repetitions (``--reps``) of the step's wall time.

Configurations: ``nonprivate`` (the plain torch twin), ``clipless`` (the default certificates of
the CPU: Cholesky / eigh), ``clipless-accel`` (``norms.ACCELERATOR_PATH_ON_CPU``: what a GPU
runs -- matrix products only, deferred checks, one read per phase; slower on a CPU, shown for its
structure), ``clipless-accel-carried`` (the same with ``certify_every=10``: the measured step
carries its bounds; one step in ten certifies exactly).
``--models mlp-tiny cnn-tiny cnn3-tiny --batch 4`` runs the same structures at tiny widths
(:data:`train_speed.TINY`): their ``step ms`` is the host's work per step, the CPU proxy for a GPU
step bound by its launches.
Run: ``python benchmarks/step_profile.py [--models mlp cnn cnn3] [--reps 5]``;
Markdown on stdout, JSON in ``benchmarks/out/step_profile.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_speed as ts

from clipless import norms

OUT = Path(__file__).resolve().parent / "out" / "step_profile.json"
ISSUE_CNN = "cnn3"
ts.CIFAR_CNNS.setdefault(ISSUE_CNN, (64, 128, 256))  # the issue's CIFAR-sized CNN
CONFIGS = ("nonprivate", "clipless", "clipless-accel", "clipless-accel-carried")
_LAPACK_OPS = ("eig", "svd", "cholesky", "matrix_norm", "linalg_qr", "linalg_solve", "lstsq", "lu_")


@contextmanager
def _counting(owner: Any, name: str, counter: collections.Counter[str]) -> Iterator[None]:
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        counter[name] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)
    try:
        yield
    finally:
        setattr(owner, name, original)


def trace(step: Callable[[], None]) -> dict[str, Any]:
    """Operators, host reads and LAPACK calls of one call of ``step``."""
    from scipy.linalg import lapack
    from scipy.sparse import linalg as sparse_linalg

    calls: collections.Counter[str] = collections.Counter()
    with (
        _counting(torch.Tensor, "tolist", calls),
        _counting(lapack, "dpotrf", calls),
        _counting(lapack, "zpotrf", calls),
        _counting(sparse_linalg, "eigsh", calls),
        profile(activities=[ProfilerActivity.CPU]) as prof,
    ):
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    ops = collections.Counter(e.name for e in events)
    lapack_ops = {k: v for k, v in ops.items() if any(s in k for s in _LAPACK_OPS)}
    lapack_ops.update({k: v for k, v in calls.items() if k != "tolist"})
    return {
        "aten_ops": sum(ops.values()),
        "launch_like": sum(_launch_like(e) for e in events),
        "python_calls": _python_calls(step),
        "host_reads": ops["aten::_local_scalar_dense"] + ops["aten::equal"] + calls["tolist"],
        "lapack": lapack_ops,
    }


# Operators that only describe memory (no kernel on a device).
_VIEWS = frozenset(
    "aten::" + name
    for name in [
        "view",
        "as_strided",
        "transpose",
        "t",
        "mT",
        "mH",
        "detach",
        "reshape",
        "expand",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
        "permute",
        "alias",
        "_reshape_alias",
        "unbind",
        "split",
        "resolve_conj",
        "resolve_neg",
        "empty",
        "empty_strided",
        "empty_like",
        "result_type",
        "lift_fresh",
        "_unsafe_view",
        "view_as_real",
        "real",
        "imag",
        "chunk",
        "narrow",
        "flatten",
        "numpy_T",
        "contiguous",
        "broadcast_tensors",
    ]
)


def _launch_like(event: Any) -> bool:
    """An operator called from Python (not from inside another operator) that is not a view:
    roughly one kernel launch on a device."""
    parent = event.cpu_parent
    nested = parent is not None and parent.name.startswith("aten::")
    return not nested and event.name not in _VIEWS


def _python_calls(step: Callable[[], None]) -> int:
    """Python function calls (and resumptions) in one call of ``step``: the host work a device
    waits for when a step is bound by its launches (deterministic, unlike a time)."""
    count = 0

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        count += event == "call"

    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    return count


def runner(model: str, config: str, batch: int) -> ts.Runner:
    norms.ACCELERATOR_PATH_ON_CPU = config.startswith("clipless-accel")
    x, y = ts.synthetic_batch(batch, 0, ts.input_shape(model))
    name = {"nonprivate": "nonprivate", "clipless-accel-carried": "clipless-carried"}.get(
        config, "clipless-ps"
    )
    return ts.make_runner(name, model, x, y, sigma=1.0, lr=0.1, seed=0)


def measure(model: str, batch: int, reps: int) -> dict[str, Any]:
    runners = {c: runner(model, c, batch) for c in CONFIGS}
    out: dict[str, Any] = {}
    for config, r in runners.items():
        norms.ACCELERATOR_PATH_ON_CPU = config.startswith("clipless-accel")
        for _ in range(3):
            r.step()
        out[config] = trace(r.step)
        out[config]["times"] = []
    for _ in range(reps):  # interleaved
        for config, r in runners.items():
            norms.ACCELERATOR_PATH_ON_CPU = config.startswith("clipless-accel")
            start = time.perf_counter()
            r.step()
            out[config]["times"].append(time.perf_counter() - start)
    norms.ACCELERATOR_PATH_ON_CPU = False
    for row in out.values():
        row["step_ms"] = 1000 * statistics.median(row.pop("times"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", ISSUE_CNN])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the seeded engines' warning
    results = {m: measure(m, args.batch, args.reps) for m in args.models}
    print(
        "| model | configuration | aten ops | launch-like | Python calls | host reads "
        "| LAPACK calls | step ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model, rows in results.items():
        for config, row in rows.items():
            lapack = ", ".join(f"{k} {v}" for k, v in sorted(row["lapack"].items())) or "none"
            print(
                f"| {model} | {config} | {row['aten_ops']} | {row['launch_like']} | "
                f"{row['python_calls']} | {row['host_reads']} | {lapack} | {row['step_ms']:.1f} |"
            )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"batch": args.batch, "results": results}, indent=1))


if __name__ == "__main__":
    main()
