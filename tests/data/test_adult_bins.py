"""Adult's public binning of the numeric columns (``load_adult(preprocessing="public-bins")``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from clipless.data import tabular as tab

_COLUMNS = tab._ADULT_COLUMNS


def _row(**values: object) -> str:
    """One raw UCI row: a fixed person, with ``values`` (keys with ``_`` for ``-``) changed."""
    base = {
        "age": 39,
        "workclass": "State-gov",
        "fnlwgt": 77516,
        "education": "Bachelors",
        "education-num": 13,
        "marital-status": "Never-married",
        "occupation": "Adm-clerical",
        "relationship": "Not-in-family",
        "race": "White",
        "sex": "Male",
        "capital-gain": 2174,
        "capital-loss": 0,
        "hours-per-week": 40,
        "native-country": "United-States",
        "income": "<=50K",
    }
    base.update({k.replace("_", "-"): v for k, v in values.items()})
    return ", ".join(str(base[c]) for c in _COLUMNS)


def _parse(rows: list[str], preprocessing: str) -> list[dict[str, float]]:
    x, _ = tab._parse_adult("\n".join(rows) + "\n", preprocessing)
    names = tab._adult_feature_names(preprocessing)
    assert x.shape == (len(rows), len(names))
    return [dict(zip(names, r.tolist(), strict=True)) for r in x]


def _hot(record: dict[str, float], column: str) -> list[str]:
    """The names of the 1s of ``column``'s bins in ``record`` (the rest must be exact 0s)."""
    bins = tab._adult_bin_names(column)
    assert all(record[b] in (0.0, 1.0) for b in bins)
    return [b for b in bins if record[b] == 1.0]


def test_feature_names_and_counts() -> None:
    assert len(tab._adult_feature_names("public-ranges")) == 104
    bins = tab._adult_feature_names("public-bins")
    assert len(bins) == 138 and len(set(bins)) == 138
    assert bins[:5] == tab._ADULT_NUMERIC  # the scaled columns first, then the bins
    assert bins[5:17] == tuple(
        ["age<20"] + [f"age[{a},{a + 5})" for a in range(20, 70, 5)] + ["age>=70"]
    )
    assert bins[17:25] == (
        "hours-per-week<15",
        "hours-per-week[15,30)",
        "hours-per-week[30,35)",
        "hours-per-week[35,40)",
        "hours-per-week[40,41)",
        "hours-per-week[41,49)",
        "hours-per-week[49,60)",
        "hours-per-week>=60",
    )
    assert bins[25:32] == (
        "capital-gain<1",
        "capital-gain[1,1000)",
        "capital-gain[1000,3162.28)",
        "capital-gain[3162.28,10000)",
        "capital-gain[10000,31622.8)",
        "capital-gain[31622.8,99999)",
        "capital-gain>=99999",
    )
    assert bins[39:] == tab._adult_feature_names("public-ranges")[5:]  # the categories
    only = tab._adult_feature_names("public-bins-only")
    assert len(only) == 133 and only == bins[5:]


@pytest.mark.parametrize(
    ("age", "expected"),
    [
        (17, "age<20"),
        (19, "age<20"),
        (20, "age[20,25)"),
        (24, "age[20,25)"),
        (25, "age[25,30)"),
        (69, "age[65,70)"),
        (70, "age>=70"),
        (90, "age>=70"),
    ],
)
def test_age_bins_at_their_edges(age: int, expected: str) -> None:
    (record,) = _parse([_row(age=age)], "public-bins")
    assert _hot(record, "age") == [expected]
    assert record["age"] == pytest.approx(age / 100)  # the scaled value is kept


@pytest.mark.parametrize(
    ("hours", "expected"),
    [
        (1, "<15"),
        (14, "<15"),
        (15, "[15,30)"),
        (34, "[30,35)"),
        (35, "[35,40)"),
        (39, "[35,40)"),
        (40, "[40,41)"),
        (41, "[41,49)"),
        (48, "[41,49)"),
        (49, "[49,60)"),
        (60, ">=60"),
        (99, ">=60"),
    ],
)
def test_hours_bins_are_the_cps_groups(hours: int, expected: str) -> None:
    (record,) = _parse([_row(hours_per_week=hours)], "public-bins")
    assert _hot(record, "hours-per-week") == ["hours-per-week" + expected]


@pytest.mark.parametrize(
    ("dollars", "expected"),
    [
        (0, "<1"),
        (1, "[1,1000)"),
        (999, "[1,1000)"),
        (1000, "[1000,3162.28)"),
        (3162, "[1000,3162.28)"),
        (3163, "[3162.28,10000)"),
        (9999, "[3162.28,10000)"),
        (10000, "[10000,31622.8)"),
        (31623, "[31622.8,99999)"),
        (99998, "[31622.8,99999)"),
        (99999, ">=99999"),
    ],
)
def test_capital_bins_half_decades_and_the_top_code(dollars: int, expected: str) -> None:
    (gain,) = _parse([_row(capital_gain=dollars, capital_loss=0)], "public-bins")
    assert _hot(gain, "capital-gain") == ["capital-gain" + expected]
    assert _hot(gain, "capital-loss") == ["capital-loss<1"]
    (loss,) = _parse([_row(capital_gain=0, capital_loss=dollars)], "public-bins")
    assert _hot(loss, "capital-loss") == ["capital-loss" + expected]
    assert _hot(loss, "capital-gain") == ["capital-gain<1"]


@pytest.mark.parametrize(
    ("dollars", "expected"),
    [
        (0, "<1"),
        (999, "[1,1000)"),
        (1000, "[1000,1778.28)"),
        (1778, "[1000,1778.28)"),
        (1779, "[1778.28,3162.28)"),
        (5623, "[3162.28,5623.41)"),
        (5624, "[5623.41,10000)"),
        (10000, "[10000,17782.8)"),
        (56234, "[31622.8,56234.1)"),
        (56235, "[56234.1,99999)"),
        (99998, "[56234.1,99999)"),
        (99999, ">=99999"),
    ],
)
def test_fine_capital_bins_are_quarter_decades(dollars: int, expected: str) -> None:
    """``public-bins-fine``: the capital columns on 10**(k/4) edges; the rest as public-bins."""
    (fine,) = _parse([_row(capital_gain=dollars, capital_loss=dollars)], "public-bins-fine")
    for column in ("capital-gain", "capital-loss"):
        bins = tab._adult_bin_names(column, tab.ADULT_BINS_FINE)
        assert len(bins) == 11 and all(fine[b] in (0.0, 1.0) for b in bins)
        assert [b for b in bins if fine[b] == 1.0] == [column + expected]
    assert len(tab._adult_feature_names("public-bins-fine")) == 146
    (coarse,) = _parse([_row(capital_gain=dollars, capital_loss=dollars)], "public-bins")
    capital_bins = {
        *tab._adult_bin_names("capital-gain"), *tab._adult_bin_names("capital-loss")
    }  # fmt: skip
    for name, value in coarse.items():  # every other feature unchanged
        if name not in capital_bins:
            assert fine[name] == value, name


def test_one_record_exactly() -> None:
    """Every feature of one hand-made record, '?' values included."""
    row = _row(
        age=52,
        workclass="?",
        education="HS-grad",
        education_num=9,
        occupation="?",
        relationship="Wife",
        sex="Female",
        capital_gain=15024,
        hours_per_week=45,
        native_country="?",
    )
    x, y = tab._parse_adult(row + "\n", "public-bins-only")
    names = tab._adult_feature_names("public-bins-only")
    ones = {
        "age[50,55)",
        "hours-per-week[41,49)",
        "capital-gain[10000,31622.8)",
        "capital-loss<1",
        "education=HS-grad",
        "marital-status=Never-married",
        "relationship=Wife",
        "race=White",
        "sex=Female",
    }
    expected = np.array([1.0 if n in ones else 0.0 for n in names])
    assert np.array_equal(x[0], expected) and y.tolist() == [0]  # '?' columns: all zeros
    x_bins, _ = tab._parse_adult(row + "\n", "public-bins")
    x_ranges, _ = tab._parse_adult(row + "\n", "public-ranges")
    assert np.array_equal(x_bins[0, 5:], x[0])  # public-bins = scaled columns + the above
    assert np.array_equal(x_bins[0, :5], x_ranges[0, :5])
    assert np.array_equal(x_bins[0, 39:], x_ranges[0, 5:])


def _random_rows(rng: np.random.Generator, n: int) -> list[str]:
    rows = []
    for _ in range(n):
        values: dict[str, object] = {}
        for column, cats in tab._ADULT_CATEGORIES.items():
            values[column] = rng.choice([*cats, "?"])
        values["age"] = int(rng.integers(0, 130))
        values["education-num"] = int(rng.integers(0, 20))
        values["hours-per-week"] = int(rng.integers(0, 130))
        for column in ("capital-gain", "capital-loss"):
            values[column] = int(rng.choice([0, rng.integers(0, 200000), 99999]))
        rows.append(", ".join(str(values.get(c, 1 if c == "fnlwgt" else ">50K")) for c in _COLUMNS))
    return rows


@pytest.mark.parametrize("preprocessing", tab.ADULT_PREPROCESSING)
def test_max_norm_is_the_largest_possible_record_norm(preprocessing: str) -> None:
    expected = {"public-ranges": 13, "public-bins": 17, "public-bins-only": 12,
                "public-bins-fine": 17}[preprocessing]  # fmt: skip
    assert tab.adult_max_norm(preprocessing) == math.sqrt(expected)
    rows = _random_rows(np.random.default_rng(0), 300)
    x, _ = tab._parse_adult("\n".join(rows) + "\n", preprocessing)
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert np.linalg.norm(x, axis=1).max() <= tab.adult_max_norm(preprocessing) + 1e-12
    top = _row(
        age=100, education_num=16, capital_gain=99999, capital_loss=99999, hours_per_week=100
    )
    xt, _ = tab._parse_adult(top + "\n", preprocessing)
    assert np.linalg.norm(xt[0]) == pytest.approx(tab.adult_max_norm(preprocessing), abs=1e-12)


def test_cli_default_input_norm_follows_the_preprocessing() -> None:
    from clipless.cli import _default_input_norm

    assert _default_input_norm("adult", (104,)) == math.sqrt(13.0)  # legacy call: public-ranges
    for p in tab.ADULT_PREPROCESSING:
        assert _default_input_norm("adult", (1,), p) == tab.adult_max_norm(p)


def test_bad_preprocessing_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preprocessing must be one of"):
        tab.load_adult(tmp_path, download=False, preprocessing="standardize")
    with pytest.raises(ValueError, match="'public-bins'"):
        tab.adult_max_norm("bins")


def test_load_adult_public_bins_from_a_cache_folder(tmp_path: Path) -> None:
    folder = tmp_path / "adult"
    folder.mkdir()
    (folder / "adult.data").write_text(_row() + "\n" + _row(age=70, income=">50K") + "\n")
    (folder / "adult.test").write_text("|1x3 Cross validator\n" + _row(age=18) + ".\n")
    train, test, info = tab.load_adult(tmp_path, download=False, preprocessing="public-bins")
    assert info.input_shape == (138,) and train.tensors[1].tolist() == [0, 1]
    assert info.feature_names == tab._adult_feature_names("public-bins")
    assert "ADULT_BINS" in info.preprocessing
    record = dict(zip(info.feature_names, test.tensors[0][0].tolist(), strict=True))
    assert record["age<20"] == 1.0 and record["age"] == pytest.approx(0.18)
