"""``clipless ecdf``, ``roc``, ``quantiles`` and ``hl``: DP statistics of CSV columns.

Wiring (done in the main ``clipless`` command)::

    sub = parser.add_subparsers(dest="command", required=True)
    add_ecdf_parser(sub)
    add_roc_parser(sub)
    add_quantiles_parser(sub)
    add_hl_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)

Each command returns an exit code: 0 on success, 2 on bad input (after a one-line message on
stderr that names the offending argument, like argparse's own errors). The CSV is read with the
standard :mod:`csv` module (first row = header) by one function, :func:`read_columns`, which
parses numbers and labels and names a bad cell by argument, data row, file line and column
(pandas is not needed for one or two columns, and its ``read_csv`` turns ``NA``, ``null`` or an
empty cell into NaN silently). Error messages never echo numbers from the data.

The grid bounds are required arguments on purpose: they must be public, chosen without looking at
the data (thesis section 6.3.1 takes them from the data, which leaks; see
:mod:`clipless.stats.grid`). ``--seed`` makes the noise reproducible and is for testing only: a
seeded generator is not cryptographically secure.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
from numpy.typing import NDArray

from clipless.stats._progress import Progress
from clipless.stats.calibration import hosmer_lemeshow
from clipless.stats.counting import MAX_BRANCHING as _MAX_BRANCHING
from clipless.stats.ecdf import ecdf
from clipless.stats.grid import Grid
from clipless.stats.noise import secure_rng, seeded_rng
from clipless.stats.quantiles import quantiles
from clipless.stats.roc import roc

_MAX_SIZE = 10**8  # clipless.stats.Grid's largest grid
# the phases of ecdf and roc, for the progress estimate (clipless.stats._progress)
_PHASES = [("releasing the DP ECDF", "release", 1.0), ("writing the CSV files", "csv", 1.0),
           ("plotting", "plot", 1.0)]  # fmt: skip
_PHASES_ROC = [("releasing the DP ROC curve", "release", 1.0),
               ("writing the CSV files", "csv", 0.75), ("plotting", "plot", 1.0)]  # fmt: skip

if TYPE_CHECKING:
    from clipless.stats.calibration import Binning, Split
    from clipless.stats.counting import Mechanism
    from clipless.stats.ecdf import Smoothing
    from clipless.stats.tree import Neighbouring

__all__ = [
    "add_ecdf_parser",
    "add_hl_parser",
    "add_quantiles_parser",
    "add_roc_parser",
    "ecdf_command",
    "hl_command",
    "main",
    "quantiles_command",
    "roc_command",
]

_NEIGHBOURING = {
    "replace_one": "replace_one",
    "replace-one": "replace_one",
    "add_remove": "add_remove",
    "add-remove": "add_remove",
}
_TRUE = ("1", "true", "yes", "y", "t", "1.0")
_FALSE = ("0", "false", "no", "n", "f", "0.0")
#: The label spellings ``roc`` and ``hl`` accept; their ``--help`` says so.
LABEL_SPELLINGS = (
    f"{', '.join(_TRUE[:-1])} (positive) or {', '.join(_FALSE[:-1])} (negative), any case; "
    f"also {_TRUE[-1]} and {_FALSE[-1]}"
)


class BadInputError(ValueError):
    """Bad command-line input; ``str()`` names the argument."""


# --------------------------------------------------------------------------------------------
# parsers
# --------------------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    _budget_args(p)
    _release_args(p)
    _output_args(p)


def _budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epsilon", required=True, help="privacy budget (> 0), pure epsilon-DP")
    p.add_argument(
        "--neighbouring",
        default="replace_one",
        help="replace_one (n public, default) or add_remove",
    )


def _release_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--smoothing",
        default="isotonic",
        help="isotonic (default), l1 or l2 (thesis eq. 6.3.6), or none",
    )
    p.add_argument(
        "--mechanism",
        default="auto",
        help="counting mechanism: auto (default = k-ary with the branching, released levels "
        "and level budgets of smallest exact error at this --size and epsilon, the flat "
        "histogram included; never worse than it or a uniform b-ary tree, "
        "benchmarks/RESULTS.md), k-ary, or binary (the "
        "thesis's tree, to reproduce it), or smooth-binary (Andersson & Pagh 2023: the same "
        "variance at every threshold, higher on average than k-ary). factorization needs "
        "zCDP, which the command line does not offer",
    )
    p.add_argument(
        "--branching",
        default=None,
        help="k for --mechanism k-ary, 2 to 65536 (default: the exact optimum for --size and "
        "epsilon)",
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", default=None, help="reproducible, NOT secure noise (tests only)")
    p.add_argument(
        "--out",
        required=True,
        help="output directory (created if needed); files of an earlier release there are not "
        "overwritten without --force",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite the files of an earlier release in --out",
    )


def _column_grid(p: argparse.ArgumentParser) -> None:
    """The CSV file, its numeric column and the public grid (``ecdf``, ``quantiles``)."""
    p.add_argument("file", metavar="FILE.csv", help="CSV file with a header row")
    p.add_argument("--column", required=True, help="name of the numeric column")
    p.add_argument("--lower", required=True, help="public lower bound of the grid")
    p.add_argument("--upper", required=True, help="public upper bound of the grid")
    p.add_argument("--size", required=True, help="number of grid thresholds (2 to 10**8)")


def _labelled_column(p: argparse.ArgumentParser, flag: str, what: str) -> None:
    """The CSV file, its numeric column ``flag`` and its 0/1 label column (``roc``, ``hl``)."""
    p.add_argument("file", metavar="FILE.csv", help="CSV file with a header row")
    p.add_argument(flag, required=True, help=what)
    p.add_argument("--label", required=True, help=f"column of binary labels: {LABEL_SPELLINGS}")


def add_ecdf_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``ecdf`` to an ``argparse`` sub-parser collection; returns the new parser."""
    p = subparsers.add_parser(
        "ecdf",
        help="DP empirical CDF of a CSV column (writes ecdf.csv, quantiles.csv, ecdf.png)",
        description="Release a DP empirical CDF of one numeric CSV column on a public grid "
        "(thesis chapter 6; by default the consistent k-ary tree with optimised level budgets, "
        "see docs/statistics.md) and print its quantiles.",
    )
    _column_grid(p)
    p.add_argument(
        "--quantiles",
        default="0.25,0.5,0.75",
        help="comma-separated levels in [0, 1] to print and write to quantiles.csv (default "
        "0.25,0.5,0.75; any number of them costs no extra budget: they are read off the one "
        "released CDF)",
    )
    _common(p)
    p.set_defaults(func=ecdf_command)
    return p


def add_roc_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``roc`` to an ``argparse`` sub-parser collection; returns the new parser."""
    p = subparsers.add_parser(
        "roc",
        help="DP ROC curve and AUC of scores against 0/1 labels (writes roc.csv, roc.png)",
        description="Release a DP ROC curve (two class-conditional DP ECDFs of the scores, "
        "thesis section 6.5.1) and print its AUC.",
    )
    _labelled_column(p, "--score", "column of scores (higher = positive)")
    p.add_argument("--lower", default="0", help="public lower bound of the grid (default 0)")
    p.add_argument("--upper", default="1", help="public upper bound of the grid (default 1)")
    p.add_argument("--size", default="1024", help="number of grid thresholds (default 1024)")
    _common(p)
    p.set_defaults(func=roc_command)
    return p


def add_quantiles_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``quantiles`` to an ``argparse`` sub-parser collection; returns the new parser."""
    p = subparsers.add_parser(
        "quantiles",
        help="DP quantiles of a CSV column, any number for one budget (writes quantiles.csv)",
        description="Release DP quantiles of one numeric CSV column: one DP CDF on a public "
        "grid (as clipless ecdf), inverted at every requested level (post-processing, so the "
        "budget does not depend on the number of levels; clipless.stats.quantiles).",
    )
    _column_grid(p)
    p.add_argument(
        "--levels",
        default="0.25,0.5,0.75",
        help="comma-separated levels in [0, 1] (default 0.25,0.5,0.75)",
    )
    _common(p)
    p.set_defaults(func=quantiles_command)
    return p


def add_hl_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hl`` to an ``argparse`` sub-parser collection; returns the new parser."""
    p = subparsers.add_parser(
        "hl",
        help="DP Hosmer-Lemeshow calibration test of predicted probabilities (writes hl.csv)",
        description="Release a DP Hosmer-Lemeshow test (thesis Algorithm 10, "
        "clipless.stats.hosmer_lemeshow): the noisy group table, the statistic, the plug-in "
        "p-value and a noise-aware p-value (post-processing).",
    )
    _labelled_column(p, "--probability", "column of predicted probabilities in [0, 1]")
    p.add_argument("--groups", default="10", help="number of groups Q, 3 to 65536 (default 10)")
    p.add_argument(
        "--binning",
        default="quantile",
        help="quantile (default: DP deciles of risk, thesis) or uniform (public bins q/Q)",
    )
    p.add_argument(
        "--split",
        default="thesis",
        help="thesis (default, Theorem 6.5.1) or tight (the exact sensitivity of the table)",
    )
    _budget_args(p)
    _output_args(p)
    p.set_defaults(func=hl_command)
    return p


# --------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------


def _real(value: str, name: str, positive: bool = False) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise BadInputError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(out):
        raise BadInputError(f"{name}: must be finite, got {value!r}")
    if positive and out <= 0:
        raise BadInputError(f"{name}: must be > 0, got {value!r}")
    return out


def _int(value: str, name: str, minimum: int) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise BadInputError(f"{name}: expected an integer, got {value!r}") from None
    if out < minimum:
        raise BadInputError(f"{name}: must be >= {minimum}, got {out}")
    return out


def _budget(args: argparse.Namespace) -> tuple[float, Neighbouring, Any]:
    eps = _real(args.epsilon, "--epsilon", positive=True)
    nb = _NEIGHBOURING.get(str(args.neighbouring))
    if nb is None:
        raise BadInputError(
            f"--neighbouring: must be replace_one or add_remove, got {args.neighbouring!r}"
        )
    if args.seed is None:
        rng = secure_rng()
    else:
        rng = seeded_rng(_int(args.seed, "--seed", minimum=0))
        print("note: --seed gives reproducible, non-secure noise (for tests)", file=sys.stderr)
    return eps, cast("Neighbouring", nb), rng


def _options(args: argparse.Namespace) -> tuple[float, Neighbouring, Smoothing | None, Any]:
    smoothing = str(args.smoothing).lower()
    if smoothing not in ("none", "isotonic", "l1", "l2"):
        raise BadInputError(
            f"--smoothing: must be isotonic, l1, l2 or none, got {args.smoothing!r}"
        )
    eps, nb, rng = _budget(args)
    chosen = None if smoothing == "none" else cast("Smoothing", smoothing)
    return eps, nb, chosen, rng


def _mechanism(args: argparse.Namespace) -> tuple[str, int | None]:
    mech = str(getattr(args, "mechanism", "auto")).lower()
    if mech not in ("auto", "k-ary", "binary", "smooth-binary"):
        hint = " (it needs zCDP noise)" if mech == "factorization" else ""
        raise BadInputError(
            f"--mechanism: must be auto, k-ary, binary or smooth-binary, got {mech!r}{hint}"
        )
    branching = getattr(args, "branching", None)
    k = None
    if branching is not None:
        k = _int(branching, "--branching", minimum=2)
        if k > _MAX_BRANCHING:
            raise BadInputError(f"--branching: must be at most {_MAX_BRANCHING}, got {k}")
        if mech in ("binary", "smooth-binary"):
            raise BadInputError("--branching: only for --mechanism k-ary or auto")
        mech = "k-ary"
    return mech, k


def _levels(value: str, name: str = "--quantiles") -> NDArray[np.float64]:
    items = str(value).split(",")
    if any(not v.strip() for v in items):
        raise BadInputError(f"{name}: expected comma-separated numbers, got {value!r}")
    try:
        out = np.array([float(v) for v in items], dtype=np.float64)
    except ValueError:
        raise BadInputError(f"{name}: expected comma-separated numbers, got {value!r}") from None
    if out.size == 0 or not np.all(np.isfinite(out)) or np.any((out < 0) | (out > 1)):
        raise BadInputError(f"{name}: levels must lie in [0, 1], got {value!r}")
    return out


def _grid(args: argparse.Namespace) -> Any:
    lower = _real(args.lower, "--lower")
    upper = _real(args.upper, "--upper")
    size = _int(args.size, "--size", minimum=2)
    if size > _MAX_SIZE:
        raise BadInputError(f"--size: must be at most {_MAX_SIZE} thresholds, got {size}")
    if not upper > lower:
        raise BadInputError(f"--upper: must be > --lower ({lower:g}), got {upper:g}")
    if not math.isfinite(upper - lower):
        raise BadInputError(
            f"--lower/--upper: the range upper - lower must be a finite number, got "
            f"{lower:g}..{upper:g}"
        )
    return Grid(lower, upper, size=size)


def _out_dir(value: str, files: Sequence[str], force: bool) -> Path:
    """The output folder, created and write-tested *before* the release is computed.

    An earlier release's files there are not overwritten without ``--force``: that release's
    budget was spent, and its output would be lost without a trace.
    """
    if not str(value).strip():
        raise BadInputError("--out: expected a directory, got an empty string")
    out = Path(value)
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out: {value!r} exists and is not a directory")
    existing = [name for name in files if (out / name).exists()]
    if existing and not force:
        raise BadInputError(
            f"--out: {value!r} already holds {', '.join(existing)} from an earlier release; "
            "pass --force to overwrite them, or choose another --out"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise BadInputError(f"--out: cannot write to {value!r}: {exc.strerror or exc}") from None
    return out


Kind = Literal["number", "label"]


def read_columns(
    path: str, columns: Sequence[tuple[str, str, Kind]], allow_empty: bool = False
) -> list[NDArray[Any]]:
    """The named columns of a CSV file (header row first), each parsed as ``kind``: finite or
    infinite floats (``"number"``; +-inf are clamped to the grid like other values outside it)
    or 0/1 labels (``"label"``, :data:`LABEL_SPELLINGS`). ``columns`` holds ``(column name,
    argument name, kind)``; blank lines are skipped. Every error names the argument, the data
    row, the file line and the column (never the value of a number). ``allow_empty``: a header
    without rows is a dataset too (add/remove: the size is private)."""
    cells, lines = _read_cells(path, [(name, arg) for name, arg, _ in columns])
    if not lines and not allow_empty:
        raise BadInputError(
            f"FILE.csv: {path!r} has a header but no data rows (an empty dataset is released "
            "only under --neighbouring add_remove, where the size is private)"
        )
    return [
        _parse(col, [f"column {name!r}, line {n} of {path!r}" for n in lines], arg, kind)
        for col, (name, arg, kind) in zip(cells, columns, strict=True)
    ]


def _read_cells(path: str, columns: Sequence[tuple[str, str]]) -> tuple[list[list[str]], list[int]]:
    """The raw cells of the named columns and the file line of each data row."""
    file = Path(path)
    if not file.is_file():
        raise BadInputError(f"FILE.csv: no such file: {path!r}")
    out: list[list[str]] = [[] for _ in columns]
    lines: list[int] = []
    try:
        with file.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise BadInputError(f"FILE.csv: {path!r} is empty (expected a header row)")
            header = [h.strip() for h in header]
            idx = []
            for name, arg in columns:
                if name not in header:
                    raise BadInputError(
                        f"{arg}: no column {name!r} in {path!r} (columns: {', '.join(header)})"
                    )
                idx.append(header.index(name))
            for row in reader:
                if not row or all(not c.strip() for c in row):
                    continue
                lines.append(reader.line_num)
                for k, (j, (_, arg)) in enumerate(zip(idx, columns, strict=True)):
                    if j >= len(row):
                        raise BadInputError(
                            f"{arg}: line {reader.line_num} of {path!r} has no such field"
                        )
                    out[k].append(row[j].strip())
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise BadInputError(f"FILE.csv: cannot read {path!r}: {exc}") from None
    return out, lines


def _parse(cells: list[str], where: list[str], arg: str, kind: Kind) -> NDArray[Any]:
    """``cells`` as floats or 0/1 labels; ``where[i]`` locates row ``i`` in the file."""
    out = np.empty(len(cells), dtype=np.float64 if kind == "number" else np.int64)
    for i, cell in enumerate(cells):
        if kind == "label":
            c = cell.lower()
            if c not in _TRUE and c not in _FALSE:
                raise BadInputError(
                    f"{arg}: data row {i + 1} ({cell!r}) is not a binary label "
                    f"({where[i]}; accepted: {LABEL_SPELLINGS})"
                )
            out[i] = c in _TRUE
            continue
        try:
            out[i] = float(cell)
        except ValueError:
            raise BadInputError(f"{arg}: data row {i + 1} is not a number ({where[i]})") from None
        if math.isnan(out[i]):
            raise BadInputError(f"{arg}: data row {i + 1} is NaN ({where[i]})")
    return out


def _save(fig: Any, path: Path) -> None:
    """Write the figure atomically (a killed run leaves the old file or the new one), owner-only
    like every output (docs/cli.md: publishing a release is the user's decision)."""
    from clipless._io import atomic_write_with

    fig.tight_layout()
    atomic_write_with(path, lambda handle: fig.savefig(handle, format="png", dpi=120), mode=0o600)


def _write_csv(path: Path, header: list[str], rows: Any) -> None:
    """Write a CSV atomically (temporary file, fsync, rename: never a torn release)."""
    from clipless._io import atomic_write

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write(path, buffer.getvalue(), mode=0o600)


def _guarantee(eps: float, nb: str) -> str:
    return f"{eps:g}-DP under {nb.replace('_', '-')} neighbouring (discrete Laplace noise)"


# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------


def _run(command: Any, args: argparse.Namespace, name: str) -> int:
    try:
        return int(command(args))
    except (BadInputError, ValueError, TypeError) as exc:
        print(f"clipless {name}: error: {exc}", file=sys.stderr)
        return 2


def ecdf_command(args: argparse.Namespace) -> int:
    """``clipless ecdf``: write ``ecdf.csv`` (threshold,value) and ``ecdf.png``; print the
    quartiles of the released (smoothed) function. Returns the exit code."""
    return _run(_ecdf, args, "ecdf")


def roc_command(args: argparse.Namespace) -> int:
    """``clipless roc``: write ``roc.csv`` (threshold,fpr,tpr) and ``roc.png``; print the AUC.
    Returns the exit code."""
    return _run(_roc, args, "roc")


def quantiles_command(args: argparse.Namespace) -> int:
    """``clipless quantiles``: write ``quantiles.csv`` (level,quantile) and print the values.
    Returns the exit code."""
    return _run(_quantiles, args, "quantiles")


def hl_command(args: argparse.Namespace) -> int:
    """``clipless hl``: write ``hl.csv`` (the noisy group table) and print the statistic and
    p-values. Returns the exit code."""
    return _run(_hl, args, "hl")


def _ecdf(args: argparse.Namespace) -> int:
    from matplotlib.figure import Figure  # lazy: matplotlib is slow to import, only plots need it

    eps, nb, smoothing, rng = _options(args)
    mech, k = _mechanism(args)
    levels = _levels(args.quantiles)
    grid = _grid(args)
    (values,) = read_columns(args.file, [(args.column, "--column", "number")], nb == "add_remove")
    out = _out_dir(args.out, ("ecdf.csv", "quantiles.csv", "ecdf.png"), args.force)
    progress = Progress("ecdf", len(grid), _PHASES)
    with progress.phase("releasing the DP ECDF"):
        released = ecdf(values, grid, eps, nb, smoothing, rng=rng, mechanism=mech, branching=k)  # type: ignore[arg-type]
    with progress.phase("writing the CSV files"):
        _write_csv(
            out / "ecdf.csv",
            ["threshold", "value"],
            (
                [repr(t), repr(v)]
                for t, v in zip(grid.thresholds.tolist(), released.values.tolist(), strict=True)
            ),
        )
        q = np.atleast_1d(released.quantile(levels))
        _write_csv(
            out / "quantiles.csv",
            ["level", "quantile"],
            ([repr(lev), repr(v)] for lev, v in zip(levels.tolist(), q.tolist(), strict=True)),
        )
    with progress.phase("plotting"):
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        released.plot(ax=ax)
        ax.legend(loc="lower right")  # "best" scans every point: minutes at 10**8 thresholds
        ax.set_title(f"DP ECDF of {args.column}")
        _save(fig, out / "ecdf.png")
    used = getattr(released.release, "mechanism", "binary")
    kk = getattr(released.release, "branching", None)
    mech_txt = f"{used}" + (f" (k={kk})" if kk else "")
    print(
        f"DP ECDF of {args.column!r}: {_guarantee(eps, nb)}, mechanism={mech_txt}, "
        f"smoothing={smoothing}"
    )
    if np.array_equal(levels, [0.25, 0.5, 0.75]):
        print(f"quartiles: q25={q[0]:.6g} median={q[1]:.6g} q75={q[2]:.6g}")
    else:
        print(
            "quantiles: " + " ".join(f"q{lev:g}={v:.6g}" for lev, v in zip(levels, q, strict=True))
        )
    print(f"wrote {out / 'ecdf.csv'}, {out / 'quantiles.csv'} and {out / 'ecdf.png'}")
    return 0


def _roc(args: argparse.Namespace) -> int:
    from matplotlib.figure import Figure  # lazy: matplotlib is slow to import, only plots need it

    eps, nb, smoothing, rng = _options(args)
    mech, k = _mechanism(args)
    grid = _grid(args)
    scores, labels = read_columns(
        args.file,
        [(args.score, "--score", "number"), (args.label, "--label", "label")],
        nb == "add_remove",
    )
    out = _out_dir(args.out, ("roc.csv", "roc.png"), args.force)
    # two class trees, three columns, two curves: twice the ECDF's phases, roughly
    progress = Progress("roc", 2 * len(grid), _PHASES_ROC)
    with progress.phase("releasing the DP ROC curve"):
        curve = roc(scores, labels, grid, eps, nb, smoothing, rng, mechanism=mech, branching=k)  # type: ignore[arg-type]
    with progress.phase("writing the CSV files"):
        _write_csv(
            out / "roc.csv",
            ["threshold", "fpr", "tpr"],
            (
                [repr(t), repr(f), repr(p)]
                for t, f, p in zip(
                    grid.thresholds.tolist(), curve.fpr.tolist(), curve.tpr.tolist(), strict=True
                )
            ),
        )
    with progress.phase("plotting"):
        fig = Figure(figsize=(5, 5))
        ax = fig.add_subplot()
        curve.plot(ax=ax)
        _save(fig, out / "roc.png")
    print(f"DP ROC of {args.score!r} vs {args.label!r}: {_guarantee(eps, nb)}")
    print(f"AUC={curve.auc():.6f}")
    print(f"wrote {out / 'roc.csv'} and {out / 'roc.png'}")
    return 0


def _quantiles(args: argparse.Namespace) -> int:
    eps, nb, smoothing, rng = _options(args)
    mech, k = _mechanism(args)
    levels = _levels(args.levels, "--levels")
    grid = _grid(args)
    (values,) = read_columns(args.file, [(args.column, "--column", "number")], nb == "add_remove")
    out = _out_dir(args.out, ("quantiles.csv",), args.force)
    progress = Progress("quantiles", len(grid), [("releasing the DP quantiles", "release", 1.0)])
    with progress.phase("releasing the DP quantiles"):
        released = quantiles(
            values,
            grid,
            levels,
            eps,
            nb,
            mechanism=cast("Mechanism", mech),
            branching=k,
            smoothing=smoothing,
            rng=rng,
        )
    _write_csv(
        out / "quantiles.csv",
        ["level", "quantile"],
        ([repr(q), repr(v)] for q, v in released.to_dict().items()),
    )
    print(f"DP quantiles of {args.column!r}: {_guarantee(eps, nb)}, smoothing={smoothing}")
    print(" ".join(f"q{q:g}={v:.6g}" for q, v in released.to_dict().items()))
    print(f"wrote {out / 'quantiles.csv'}")
    return 0


def _hl_choices(args: argparse.Namespace) -> tuple[int, str, str]:
    groups = _int(args.groups, "--groups", minimum=3)
    if groups > 2**16:
        raise BadInputError(f"--groups: must be at most 65536, got {groups}")
    binning, split = str(args.binning).lower(), str(args.split).lower()
    if binning not in ("quantile", "uniform"):
        raise BadInputError(f"--binning: must be quantile or uniform, got {args.binning!r}")
    if split not in ("thesis", "tight"):
        raise BadInputError(f"--split: must be thesis or tight, got {args.split!r}")
    return groups, binning, split


def _hl(args: argparse.Namespace) -> int:
    eps, nb, rng = _budget(args)
    groups, binning, split = _hl_choices(args)
    probs, labels = read_columns(
        args.file,
        [(args.probability, "--probability", "number"), (args.label, "--label", "label")],
        nb == "add_remove",
    )
    outside = np.flatnonzero((probs < 0) | (probs > 1))
    if outside.size:
        raise BadInputError(f"--probability: data row {outside[0] + 1} is outside [0, 1]")
    out = _out_dir(args.out, ("hl.csv",), args.force)
    res = hosmer_lemeshow(
        probs,
        labels,
        eps,
        groups,
        nb,
        rng,
        binning=cast("Binning", binning),
        split=cast("Split", split),
    )
    table = res.to_dict()
    _write_csv(
        out / "hl.csv",
        list(table),
        ([repr(float(v)) for v in row] for row in zip(*table.values(), strict=True)),
    )
    print(
        f"DP Hosmer-Lemeshow of {args.probability!r} vs {args.label!r}: {_guarantee(eps, nb)}, "
        f"{groups} groups ({binning} binning, {split} split)"
    )
    print(
        f"H={res.statistic:.6g} dof={res.dof} p={res.p_value:.4g} (plug-in) "
        f"p={res.noise_aware_p_value():.4g} (noise-aware)"
    )
    print(f"wrote {out / 'hl.csv'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (``python -m clipless.stats.cli ecdf ...``), same as the main CLI."""
    parser = argparse.ArgumentParser(prog="clipless")
    sub = parser.add_subparsers(dest="command", required=True)
    add_ecdf_parser(sub)
    add_roc_parser(sub)
    add_quantiles_parser(sub)
    add_hl_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
