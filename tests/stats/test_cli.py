"""``clipless ecdf`` / ``clipless roc`` on temporary CSV files."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from clipless.stats.cli import add_ecdf_parser, add_roc_parser, main

HUGE = "1e12"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clipless")
    sub = p.add_subparsers(dest="command", required=True)
    add_ecdf_parser(sub)
    add_roc_parser(sub)
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args))


def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def read_csv(path: Path) -> tuple[list[str], np.ndarray]:
    with path.open(newline="") as fh:
        rows = list(csv.reader(fh))
    return rows[0], np.array(rows[1:], dtype=np.float64)


@pytest.fixture
def income(tmp_path: Path) -> Path:
    values = np.arange(1, 101)  # 1..100: quartiles 25, 50, 75 on an integer grid
    rows = [[f"id{i}", v, i % 2] for i, v in enumerate(values)]
    return write_csv(tmp_path / "data.csv", ["id", "income", "flag"], rows)


def test_ecdf_command_outputs(
    income: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = run(
        [
            "ecdf", str(income), "--column", "income", "--lower", "0", "--upper", "100",
            "--size", "101", "--epsilon", HUGE, "--seed", "3", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    header, table = read_csv(out / "ecdf.csv")
    assert header == ["threshold", "value"]
    np.testing.assert_allclose(table[:, 0], np.arange(101))
    np.testing.assert_allclose(table[:, 1], np.arange(101) / 100)  # noise ~ 1e-11: exact
    assert (out / "ecdf.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "q25=25 median=50 q75=75" in printed
    assert "1e+12-DP under replace-one" in printed


@pytest.mark.parametrize("smoothing", ["none", "l1", "l2"])
def test_ecdf_command_smoothing(
    income: Path, tmp_path: Path, smoothing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / smoothing
    code = main(
        [
            "ecdf", str(income), "--column", "income", "--lower", "0", "--upper", "100",
            "--size", "64", "--epsilon", "0.5", "--smoothing", smoothing,
            "--neighbouring", "add-remove", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    _, table = read_csv(out / "ecdf.csv")
    assert table.shape == (64, 2)
    if smoothing != "none":
        assert np.all(np.diff(table[:, 1]) >= 0)
        assert table[:, 1].min() >= 0 and table[:, 1].max() <= 1
    assert "quartiles:" in capsys.readouterr().out


def test_roc_command_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    s = np.round(np.clip(rng.normal(0.4 + 0.2 * y, 0.15), 0, 1), 2)
    path = write_csv(
        tmp_path / "scores.csv", ["score", "label"], [[a, b] for a, b in zip(s, y, strict=True)]
    )
    out = tmp_path / "roc"
    code = run(
        ["roc", str(path), "--score", "score", "--label", "label", "--size", "101",
         "--epsilon", HUGE, "--seed", "1", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    header, table = read_csv(out / "roc.csv")
    assert header == ["threshold", "fpr", "tpr"]
    assert table.shape == (101, 3)
    assert np.all(np.diff(table[:, 1]) <= 0) and np.all(np.diff(table[:, 2]) <= 0)
    assert (out / "roc.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    auc = float(printed.split("AUC=")[1].split()[0])
    assert auc == pytest.approx(roc_auc_score(y, s), abs=1e-6)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--column", "missing"], "--column: no column 'missing'"),
        (["--column", "id"], "--column: data row 1 is not a number"),
        (["--epsilon", "0"], "--epsilon: must be > 0"),
        (["--epsilon", "abc"], "--epsilon: expected a number"),
        (["--epsilon", "nan"], "--epsilon: must be finite"),
        (["--size", "1"], "--size: must be >= 2"),
        (["--upper", "-5"], "--upper: must be > --lower"),
        (["--neighbouring", "swap"], "--neighbouring: must be replace_one or add_remove"),
        (["--smoothing", "spline"], "--smoothing: must be isotonic, l1, l2 or none"),
        (["--seed", "-1"], "--seed: must be >= 0"),
    ],
)
def test_ecdf_bad_input_exits_2(
    income: Path,
    tmp_path: Path,
    extra: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = {
        "--column": "income", "--lower": "0", "--upper": "100", "--size": "16",
        "--epsilon": "1", "--out": str(tmp_path / "o"),
    }  # fmt: skip
    for key, value in zip(extra[::2], extra[1::2], strict=True):
        base[key] = value
    argv = ["ecdf", str(income)] + [x for kv in base.items() for x in kv]
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("clipless ecdf: error: ") and needle in err


def test_bad_files_and_labels_exit_2(
    income: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "o")
    common = ["--lower", "0", "--upper", "1", "--size", "8", "--epsilon", "1", "--out", out]
    assert run(["ecdf", str(tmp_path / "nope.csv"), "--column", "x", *common]) == 2
    assert "FILE.csv: no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert run(["ecdf", str(empty), "--column", "x", *common]) == 2
    assert "is empty" in capsys.readouterr().err
    header_only = write_csv(tmp_path / "h.csv", ["x"], [])
    assert run(["ecdf", str(header_only), "--column", "x", *common]) == 2
    assert "no data rows" in capsys.readouterr().err
    # audit finding: under add/remove the size is private, so an empty dataset is released
    # (the library did; the command refused it, telling it from a one-row file)
    assert run(["ecdf", str(header_only), "--column", "x", *common,
                "--neighbouring", "add_remove"]) == 0  # fmt: skip
    both = write_csv(tmp_path / "hs.csv", ["s", "y"], [])
    assert run(["roc", str(both), "--score", "s", "--label", "y", *common,
                "--neighbouring", "add_remove"]) == 0  # fmt: skip
    bad_labels = write_csv(tmp_path / "l.csv", ["s", "y"], [[0.1, 0], [0.2, 2]])
    assert run(["roc", str(bad_labels), "--score", "s", "--label", "y", *common[6:]]) == 2
    assert "--label: data row 2 ('2') is not a binary label" in capsys.readouterr().err
    assert run(["roc", str(income), "--score", "income", "--label", "nope", *common]) == 2
    assert "--label: no column 'nope'" in capsys.readouterr().err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert run(["roc", str(income), "--score", "income", "--label", "flag", "--epsilon", "1",
                "--out", str(a_file)]) == 2  # fmt: skip
    assert "--out: " in capsys.readouterr().err


def test_missing_required_argument_is_an_argparse_error(income: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["ecdf", str(income), "--column", "income"])
    assert exc.value.code == 2


def test_cli_and_api_share_the_smoothing_and_neighbouring_defaults():
    import argparse
    import inspect

    from clipless.stats import ecdf, roc
    from clipless.stats.cli import add_ecdf_parser, add_roc_parser

    sub = argparse.ArgumentParser().add_subparsers()
    for add, api in ((add_ecdf_parser, ecdf), (add_roc_parser, roc)):
        parser = add(sub)
        defaults = inspect.signature(api).parameters
        assert parser.get_default("smoothing") == defaults["smoothing"].default == "isotonic"
        assert parser.get_default("neighbouring") == defaults["neighbouring"].default


def test_ecdf_mechanism_and_quantile_options(
    income: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "q"
    base = [
        "ecdf", str(income), "--column", "income", "--lower", "0", "--upper", "100",
        "--size", "101", "--epsilon", HUGE, "--seed", "1", "--out", str(out),
    ]  # fmt: skip
    assert run([*base, "--quantiles", "0.1,0.9", "--mechanism", "k-ary", "--branching", "4"]) == 0
    printed = capsys.readouterr().out
    assert "mechanism=k-ary (k=4)" in printed and "q0.1=10 q0.9=90" in printed
    header, table = read_csv(out / "quantiles.csv")
    assert header == ["level", "quantile"]
    np.testing.assert_allclose(table, [[0.1, 10], [0.9, 90]])
    assert run([*base, "--mechanism", "binary"]) == 2  # the earlier release's files are kept
    assert "--force" in capsys.readouterr().err
    base.append("--force")
    assert run([*base, "--mechanism", "binary"]) == 0
    assert "mechanism=binary" in capsys.readouterr().out
    assert run([*base, "--mechanism", "factorization"]) == 2
    assert "--mechanism" in capsys.readouterr().err
    assert run([*base, "--quantiles", "0.5,1.5"]) == 2
    assert "--quantiles" in capsys.readouterr().err
    assert run([*base, "--mechanism", "binary", "--branching", "4"]) == 2
    assert run([*base, "--quantiles", "0.1,0.9", "--mechanism", "smooth-binary"]) == 0
    printed = capsys.readouterr().out
    assert "mechanism=smooth-binary" in printed and "q0.1=10 q0.9=90" in printed
    assert run([*base, "--mechanism", "smooth-binary", "--branching", "4"]) == 2


def test_cli_and_api_share_the_mechanism_default():
    import argparse
    import inspect

    from clipless.stats import ecdf, roc
    from clipless.stats.cli import add_ecdf_parser, add_roc_parser

    sub = argparse.ArgumentParser().add_subparsers()
    for add, api in ((add_ecdf_parser, ecdf), (add_roc_parser, roc)):
        parser = add(sub)
        assert (
            parser.get_default("mechanism")
            == inspect.signature(api).parameters["mechanism"].default
            == "auto"
        )


def test_an_earlier_release_is_not_overwritten_and_bad_outputs_fail_first(
    income: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CLI audit: a second release into one --out overwrote the first without notice (its budget
    was spent); an unwritable --out failed after the release was computed; '' wrote into the
    working directory; the grid and --quantiles errors did not name their option."""
    out = tmp_path / "r"
    base = [
        "ecdf", str(income), "--column", "income", "--lower", "0", "--upper", "100",
        "--size", "11", "--epsilon", HUGE, "--seed", "1",
    ]  # fmt: skip
    assert run([*base, "--out", str(out)]) == 0
    first = (out / "ecdf.csv").read_bytes()
    capsys.readouterr()
    assert run([*base, "--out", str(out), "--seed", "2"]) == 2
    assert "already holds ecdf.csv" in capsys.readouterr().err
    assert (out / "ecdf.csv").read_bytes() == first
    for argv, named in (
        (["--out", ""], "--out"),
        (["--out", "/proc/clipless-test"], "--out"),
        (["--out", str(tmp_path / "s"), "--size", "100000001"], "--size"),
        (["--out", str(tmp_path / "s"), "--branching", "70000"], "--branching"),
        (["--out", str(tmp_path / "s"), "--quantiles", "0.5,,0.7"], "--quantiles"),
        (["--out", str(tmp_path / "s"), "--lower=-1e308", "--upper", "1e308"], "--lower/--upper"),
    ):
        assert run([*base, *argv]) == 2
        assert named in capsys.readouterr().err, argv


def test_a_bad_cell_is_named_by_column_line_and_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN in the second named column is reported under that column's argument and header
    name, at its data row and file line (a blank line in between shifts the line, not the row)."""
    path = tmp_path / "d.csv"
    path.write_text("id,score,label\na,0.1,1\n\nb,0.2,0\nc,nan,1\n")
    out = str(tmp_path / "o")
    argv = ["roc", str(path), "--score", "score", "--label", "label", "--epsilon", "1"]
    assert run([*argv, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith(
        f"--score: data row 3 is NaN (column 'score', line 5 of {str(path)!r})"
    )
    path.write_text("id,score,label\na,0.1,1\nb,0.2,maybe\n")
    assert run([*argv, "--out", out]) == 2
    err = capsys.readouterr().err
    assert "--label: data row 2 ('maybe') is not a binary label (column 'label', line 3" in err
    assert "accepted: 1, true, yes, y, t (positive) or 0, false, no, n, f (negative)" in err


@pytest.mark.parametrize(
    ("yes", "no"),
    [("1", "0"), ("TRUE", "false"), ("Yes", "no"), ("t", "F"), ("1.0", "0.0"), ("Y", "N")],
)
def test_every_label_spelling_that_help_lists_is_read(
    tmp_path: Path, yes: str, no: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from clipless.stats.cli import LABEL_SPELLINGS, read_columns

    help_text = " ".join(
        parser()._subparsers._group_actions[0].choices["roc"].format_help().split()
    )  # type: ignore[union-attr]
    assert " ".join(f"column of binary labels: {LABEL_SPELLINGS}".split()) in help_text
    path = write_csv(tmp_path / "l.csv", ["y"], [[yes], [no], [yes]])
    (labels,) = read_columns(str(path), [("y", "--label", "label")])
    assert labels.tolist() == [1, 0, 1]


def test_long_releases_report_progress_with_an_estimate(
    income: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the threshold forced to 0 a small release reports each phase's start (with the
    estimate left), heartbeat lines and its end on stderr, in order; stdout and the files are
    those of a quiet run. At the default threshold a small release prints no progress."""
    from clipless.stats import _progress

    argv = ["ecdf", str(income), "--column", "income", "--lower", "0", "--upper", "100",
            "--size", "4000", "--epsilon", "1", "--seed", "5"]  # fmt: skip
    assert run([*argv, "--out", str(tmp_path / "quiet")]) == 0
    quiet = capsys.readouterr()
    assert "clipless ecdf:" not in quiet.err
    monkeypatch.setattr(_progress, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(_progress, "PROGRESS_EVERY_S", 0.001)
    assert run([*argv, "--out", str(tmp_path / "loud")]) == 0
    loud = capsys.readouterr()
    assert loud.out.replace("loud", "quiet") == quiet.out
    for name in ("ecdf.csv", "quantiles.csv"):
        assert (tmp_path / "loud" / name).read_bytes() == (tmp_path / "quiet" / name).read_bytes()
    lines = [line for line in loud.err.splitlines() if line.startswith("clipless ecdf: [")]
    starts = [i for i, line in enumerate(lines) if "(estimate: " in line]
    ends = [i for i, line in enumerate(lines) if ": done in " in line]
    assert [lines[i].split("]")[0][-3:] for i in starts] == ["1/3", "2/3", "3/3"]
    assert lines[starts[0]].startswith("clipless ecdf: [1/3] releasing the DP ECDF (estimate: ")
    assert len(ends) == 3 and all(s < e for s, e in zip(starts, ends, strict=True))


def test_the_progress_estimate_rescales_by_the_finished_phases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The estimate left: the per-threshold costs at the start; once a phase took twice its
    estimate, the phases still to come are expected to take twice theirs too."""
    import io

    from clipless.stats import _progress

    now = [0.0]
    monkeypatch.setattr(_progress, "_clock", lambda: now[0])
    monkeypatch.setattr(_progress, "PROGRESS_EVERY_S", 3600.0)
    phases = [("a", "csv", 2.0), ("b", "csv", 1.0)]
    stream = io.StringIO()
    progress = _progress.Progress("ecdf", 10**7, phases, stream)  # 40 s + 20 s
    assert progress.enabled
    assert progress._left("a", 10.0) == "about 50 s left in all"
    assert progress._left("a", 80.0) == "longer than estimated; then about 40 s"
    assert progress._left("b", 30.0) == "longer than estimated"
    with progress.phase("a"):
        now[0] += 80.0  # twice the estimate of 40 s
    with progress.phase("b"):
        now[0] += 40.0
    assert stream.getvalue().splitlines() == [
        "clipless ecdf: [1/2] a (estimate: about 60 s left in all)",
        "clipless ecdf: [1/2] a: done in 80 s",
        "clipless ecdf: [2/2] b (estimate: about 40 s left in all)",
        "clipless ecdf: [2/2] b: done in 40 s",
    ]
    assert not _progress.Progress("ecdf", 10**5, phases, stream).enabled  # 0.6 s: quiet
