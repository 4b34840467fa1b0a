"""``clipless quantiles`` / ``clipless hl`` and the plots' noise bands."""

from __future__ import annotations

import argparse
import csv
import stat
from pathlib import Path

import numpy as np
import pytest

from clipless.cli import main as clipless_main
from clipless.stats import Grid, ecdf, hosmer_lemeshow, quantiles, roc, seeded_rng
from clipless.stats.cli import add_hl_parser, add_quantiles_parser


def run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clipless")
    sub = p.add_subparsers(dest="command", required=True)
    add_quantiles_parser(sub)
    add_hl_parser(sub)
    args = p.parse_args(argv)
    return int(args.func(args))


def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def read_rows(path: Path) -> tuple[list[str], np.ndarray]:
    with path.open(newline="") as fh:
        rows = list(csv.reader(fh))
    return rows[0], np.array(rows[1:], dtype=np.float64)


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray, np.ndarray]:
    gen = np.random.default_rng(0)
    age = gen.integers(0, 101, 1500).astype(np.float64)
    p = gen.uniform(0, 1, 1500)
    y = (gen.uniform(0, 1, 1500) < p).astype(np.int64)
    rows: list[list[object]] = [
        [repr(float(a)), repr(float(q)), "yes" if t else "no"]
        for a, q, t in zip(age, p, y, strict=True)
    ]
    return write_csv(tmp_path / "d.csv", ["age", "p", "y"], rows), age, p, y


def test_quantiles_command_prints_and_writes_the_release(
    data: tuple[Path, np.ndarray, np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    file, age, _, _ = data
    out = tmp_path / "q"
    argv = ["quantiles", str(file), "--column", "age", "--lower", "0", "--upper", "100"]
    argv += ["--size", "101", "--levels", "0.1,0.5,0.9", "--epsilon", "0.5", "--seed", "7"]
    assert clipless_main([*argv, "--out", str(out)]) == 0  # registered in the main command
    ref = quantiles(age, Grid(0, 100, size=101), [0.1, 0.5, 0.9], 0.5, rng=seeded_rng(7))
    header, rows = read_rows(out / "quantiles.csv")
    assert header == ["level", "quantile"]
    np.testing.assert_array_equal(rows[:, 0], [0.1, 0.5, 0.9])
    np.testing.assert_array_equal(rows[:, 1], ref.values)
    assert stat.S_IMODE((out / "quantiles.csv").stat().st_mode) == 0o600  # as every output
    printed = capsys.readouterr().out
    assert " ".join(f"q{q:g}={v:.6g}" for q, v in ref.to_dict().items()) in printed
    assert "0.5-DP under replace-one" in printed


def test_hl_command_prints_and_writes_the_release(
    data: tuple[Path, np.ndarray, np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    file, _, p, y = data
    out = tmp_path / "hl"
    argv = ["hl", str(file), "--probability", "p", "--label", "y", "--epsilon", "2"]
    assert run([*argv, "--groups", "8", "--seed", "4", "--out", str(out)]) == 0
    ref = hosmer_lemeshow(p, y, 2.0, 8, "replace_one", seeded_rng(4))
    header, rows = read_rows(out / "hl.csv")
    assert header == list(ref.to_dict())
    np.testing.assert_array_equal(rows, np.column_stack(list(ref.to_dict().values())))
    assert stat.S_IMODE((out / "hl.csv").stat().st_mode) == 0o600
    printed = capsys.readouterr().out
    assert f"H={ref.statistic:.6g} dof=6 p={ref.p_value:.4g} (plug-in)" in printed
    assert f"p={ref.noise_aware_p_value():.4g} (noise-aware)" in printed


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--groups", "2"], "--groups"),
        (["--groups", "x"], "--groups"),
        (["--binning", "deciles"], "--binning"),
        (["--split", "loose"], "--split"),
        (["--epsilon", "0"], "--epsilon"),
        (["--neighbouring", "swap"], "--neighbouring"),
        (["--probability", "age"], "--probability"),  # ages are outside [0, 1]
        (["--label", "p"], "--label"),  # not binary
        (["--label", "missing"], "--label"),
    ],
)
def test_hl_bad_input_exits_2_naming_the_argument(
    data: tuple[Path, np.ndarray, np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    named: str,
) -> None:
    base = {"--probability": "p", "--label": "y", "--epsilon": "1"}
    base.update(dict(zip(extra[::2], extra[1::2], strict=True)))
    argv = ["hl", str(data[0]), "--out", str(tmp_path / "o")]
    argv += [x for kv in base.items() for x in kv]
    assert clipless_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clipless hl: error: " + named) and "\n" not in err, err
    assert not (tmp_path / "o" / "hl.csv").exists()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--levels", "0.1,2"], "--levels"),
        (["--levels", "a,b"], "--levels"),
        (["--levels", ""], "--levels"),
        (["--column", "nope"], "--column"),
        (["--upper", "-1"], "--upper"),
        (["--size", "1"], "--size"),
        (["--mechanism", "factorization"], "--mechanism"),
    ],
)
def test_quantiles_bad_input_exits_2_naming_the_argument(
    data: tuple[Path, np.ndarray, np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    named: str,
) -> None:
    base = {"--column": "age", "--lower": "0", "--upper": "100", "--size": "101"}
    base["--epsilon"] = "1"
    base.update(dict(zip(extra[::2], extra[1::2], strict=True)))
    argv = ["quantiles", str(data[0]), "--out", str(tmp_path / "o")]
    argv += [x for kv in base.items() for x in kv]
    assert clipless_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clipless quantiles: error: " + named) and "\n" not in err, err


def _band_polygon_y(ax: object) -> np.ndarray:
    (coll,) = ax.collections  # type: ignore[attr-defined]
    return np.unique(np.round(coll.get_paths()[0].vertices[:, 1], 12))


@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
def test_ecdf_band_is_1_96_noise_sd_from_the_public_variance(neighbouring: str) -> None:
    values = np.random.default_rng(1).integers(0, 64, 400)
    f = ecdf(values, Grid(0, 63, size=64), 0.5, neighbouring, rng=seeded_rng(2))  # type: ignore[arg-type]
    lo, hi = f.band()
    expected = 1.96 * np.sqrt(f.variance) / f.n
    np.testing.assert_allclose((hi - lo) / 2, expected, rtol=1e-12)
    np.testing.assert_allclose((hi + lo) / 2, f.values, rtol=1e-12)
    assert expected[:-1].min() > 0.01  # wide enough that a wrong width fails (the total is known)
    ax = f.plot()
    plotted = _band_polygon_y(ax)
    np.testing.assert_allclose(plotted, np.unique(np.round(np.concatenate([lo, hi]), 12)))
    assert any("noise-only" in t.get_text() for t in ax.get_legend().get_texts())
    assert not f.plot(band=False).collections


def test_roc_band_is_1_96_noise_sd_of_each_class() -> None:
    gen = np.random.default_rng(3)
    labels = gen.integers(0, 2, 600)
    scores = np.clip(gen.normal(0.35 + 0.3 * labels, 0.2), 0, 1)
    curve = roc(scores, labels, Grid(0, 1, size=32), 1.0, rng=seeded_rng(5))
    half = curve.band()
    for key, part in (("fpr", curve.negatives), ("tpr", curve.positives)):
        np.testing.assert_allclose(half[key], 1.96 * np.sqrt(part.variance) / part.n)
    ax = curve.plot()
    vertical, horizontal = ax.collections
    ys = np.unique(np.round(vertical.get_paths()[0].vertices[:, 1], 12))
    want = np.concatenate([curve.tpr - half["tpr"], curve.tpr + half["tpr"]])
    np.testing.assert_allclose(ys, np.unique(np.round(want, 12)))
    xs = np.unique(np.round(horizontal.get_paths()[0].vertices[:, 0], 12))
    want = np.concatenate([curve.fpr - half["fpr"], curve.fpr + half["fpr"]])
    np.testing.assert_allclose(xs, np.unique(np.round(want, 12)))
    assert any("noise-only" in t.get_text() for t in ax.get_legend().get_texts())


def test_band_rejects_a_bad_z() -> None:
    f = ecdf([1.0, 2.0], Grid(0, 3, size=4), 1.0, rng=seeded_rng(0))
    with pytest.raises(ValueError, match="z must be"):
        f.band(-1.0)
