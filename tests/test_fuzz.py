"""Fuzzing of public functions and CLI commands with bad inputs (hypothesis).

Every bad input gives a named error: a ``ValueError`` / ``TypeError`` (or a documented subclass)
whose message names the argument, never an ``IndexError``, ``ZeroDivisionError``, ``KeyError``,
``MemoryError`` or an error raised deep inside torch or numpy; a CLI command prints one
``error:`` line on stderr (after argparse's usage line for parse errors), exits with status 2 and
prints no traceback.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _mechanism import split_options
from clipless import accounting
from clipless.accounting import PrivacyLedger
from clipless.cli import main
from clipless.stats import Grid, discrete_gaussian, discrete_laplace, ecdf, roc, seeded_rng

# `make test` replays a fixed set of examples (derandomized: CI stays reproducible); a deep,
# randomised run: CLIPLESS_FUZZ_EXAMPLES=400 pytest tests/test_fuzz.py
FUZZ = settings(
    max_examples=int(os.environ.get("CLIPLESS_FUZZ_EXAMPLES", "40")),
    derandomize="CLIPLESS_FUZZ_EXAMPLES" not in os.environ,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

NAMED = (ValueError, TypeError)

bad_numbers = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, -1e-300, -0.0]),
    st.floats(max_value=0.0),
)
not_numbers = st.one_of(st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2))


def _named(exc: BaseException, *names: str) -> None:
    assert isinstance(exc, NAMED), repr(exc)
    text = str(exc)
    assert any(n in text for n in names), f"{text!r} names none of {names}"


# --------------------------------------------------------------------------------- accounting
@FUZZ
@given(
    # 0 (no privacy) and inf (releases nothing) are documented, accepted multipliers
    sigma=st.one_of(
        st.sampled_from([math.nan, -1.0, -1e-300, -math.inf]),
        st.floats(max_value=-1e-9),
        not_numbers,
    ),
    q=st.one_of(bad_numbers, st.floats(min_value=1.0, exclude_min=True), not_numbers),
)
def test_accounting_epsilon_names_bad_arguments(sigma: object, q: object) -> None:
    for args, names in (
        ((sigma, 0.1, 10, 1e-5), ("noise_multiplier",)),
        ((1.0, q, 10, 1e-5), ("sample_rate",)),
    ):
        with pytest.raises(NAMED) as info:
            accounting.epsilon(*args)  # type: ignore[arg-type]
        _named(info.value, *names)


@FUZZ
@given(
    eps=st.one_of(bad_numbers, not_numbers),
    delta=st.one_of(st.floats(min_value=1.0), st.floats(max_value=0.0), not_numbers),
    steps=st.one_of(st.integers(max_value=0), st.floats(), not_numbers),
)
def test_calibration_names_bad_arguments(eps: object, delta: object, steps: object) -> None:
    for args, name in (
        ((eps, 1e-5, 0.1, 10), "epsilon"),
        ((1.0, delta, 0.1, 10), "delta"),
        ((1.0, 1e-5, 0.1, steps), "steps"),
    ):
        with pytest.raises(NAMED) as info:
            accounting.calibrate_noise(*args)  # type: ignore[arg-type]
        _named(info.value, name)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@FUZZ
@given(
    key=st.sampled_from(["accountant", "neighbouring", "entries", "metadata", "version"]),
    value=json_values,
    entry_key=st.sampled_from(["noise_multiplier", "sample_rate", "count", "start_step"]),
    entry_value=json_values,
)
def test_malformed_ledgers_are_refused_with_value_error(
    key: str, value: object, entry_key: str, entry_value: object
) -> None:
    good = PrivacyLedger()
    good.record(1.0, 0.1, count=3)
    data = good.to_dict()
    broken = dict(data, **{key: value})
    with contextlib.suppress(ValueError):
        PrivacyLedger.from_dict(broken)
    entry = dict(data["entries"][0], **{entry_key: entry_value})
    try:
        ledger = PrivacyLedger.from_dict(dict(data, entries=[entry]))
    except ValueError:
        return
    # accepted: it must then be a sound ledger (valid steps, finite epsilon computation)
    assert ledger.steps >= 1
    assert ledger.epsilon(1e-5) >= 0.0


@FUZZ
@given(text=st.text(max_size=40))
def test_ledger_files_with_garbage_are_value_errors(tmp_path: Path, text: str) -> None:
    path = tmp_path / "ledger.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="ledger"):
        PrivacyLedger.from_json(path)


# ---------------------------------------------------------------------------------- statistics
@FUZZ
@given(
    values=st.one_of(
        # a NaN among +-inf (which are clamped to the grid like any value outside it)
        st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), max_size=3).map(
            lambda bad: [0.1, *bad, math.nan]
        ),
        st.just([]),
        # non-numeric text ("0" or " 1" would parse as a number, which is accepted)
        st.lists(st.text(alphabet="bcdgh", max_size=3), min_size=1, max_size=3),
        st.just([[0.1, 0.2], [0.3]]),
    ),
)
def test_ecdf_rejects_bad_values(values: object) -> None:
    with pytest.raises(NAMED) as info:
        ecdf(values, Grid(0, 1, size=8), 1.0, rng=seeded_rng(0))  # type: ignore[arg-type]
    _named(info.value, "values")


@FUZZ
@given(eps=st.one_of(bad_numbers, not_numbers, st.booleans()))
def test_ecdf_and_roc_reject_bad_epsilon(eps: object) -> None:
    with pytest.raises(NAMED) as info:
        ecdf([0.1, 0.2], Grid(0, 1, size=8), eps, rng=seeded_rng(0))  # type: ignore[arg-type]
    _named(info.value, "epsilon")
    with pytest.raises(NAMED) as info:
        roc([0.1, 0.2], [0, 1], Grid(0, 1, size=8), eps, rng=seeded_rng(0))  # type: ignore[arg-type]
    _named(info.value, "epsilon")


@FUZZ
@given(
    labels=st.one_of(
        st.just([0, 2]),
        st.just([0.5, 1]),
        st.just([0]),
        st.just([math.nan, 1]),
        st.just(["a", "b"]),
    )
)
def test_roc_rejects_bad_labels(labels: object) -> None:
    with pytest.raises(NAMED) as info:
        roc([0.1, 0.2], labels, Grid(0, 1, size=8), 1.0, rng=seeded_rng(0))  # type: ignore[arg-type]
    _named(info.value, "labels", "scores")


@FUZZ
@given(
    lower=st.one_of(st.floats(allow_nan=True), not_numbers),
    upper=st.one_of(st.floats(allow_nan=True), not_numbers),
    size=st.one_of(st.integers(max_value=1), st.integers(min_value=10**9), st.floats()),
)
def test_grid_rejects_bad_specifications(lower: object, upper: object, size: object) -> None:
    try:
        grid = Grid(lower, upper, size=size)  # type: ignore[arg-type]
    except NAMED as exc:
        _named(exc, "lower", "upper", "size", "thresholds")
        return
    assert len(grid) >= 1 and np.all(np.diff(grid.thresholds) > 0)


def test_huge_grids_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="size"):
        Grid(0, 1, size=10**10)
    with pytest.raises(ValueError, match="precision"):
        Grid(0, 1, precision=1e-12)


@FUZZ
@given(
    scale=st.one_of(bad_numbers, not_numbers),
    size=st.one_of(st.integers(max_value=-1), st.just(10**15), st.just((2, -1))),
)
def test_samplers_name_bad_arguments(scale: object, size: object) -> None:
    with pytest.raises(NAMED) as info:
        discrete_laplace(scale, 3, seeded_rng(0))  # type: ignore[arg-type]
    _named(info.value, "scale")
    with pytest.raises(NAMED) as info:
        discrete_laplace(1.0, size, seeded_rng(0))  # type: ignore[arg-type]
    _named(info.value, "size")
    with pytest.raises(NAMED) as info:
        discrete_gaussian(scale, 3, seeded_rng(0))  # type: ignore[arg-type]
    _named(info.value, "sigma")


# ---------------------------------------------------------------------------------- training
def _engine_args() -> dict[str, object]:
    from torch.utils.data import DataLoader, TensorDataset

    from clipless import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.InputNorm(1.0), nn.Linear(3, 2, bias=False))
    data = TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
    return {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "data_loader": DataLoader(data, batch_size=5),
        "loss": nn.CrossEntropyLoss(),
    }


@FUZZ
@given(
    option=st.sampled_from(
        [
            "noise_multiplier",
            "target_epsilon",
            "target_delta",
            "max_norm",
            "sample_rate",
            "epochs",
            "steps",
            "certify_every",
            "noise",
            "scaling",
            "constraint",
            "neighbouring",
        ]
    ),
    value=st.one_of(bad_numbers, not_numbers, st.booleans(), st.just("")),
)
def test_make_private_names_bad_options(option: str, value: object) -> None:
    import clipless

    kwargs: dict[str, object] = {"noise_multiplier": 1.0}
    if option in ("target_epsilon", "target_delta", "epochs", "steps"):
        kwargs = {"target_epsilon": 1.0, "target_delta": 1e-5, "epochs": 1}
    if option == "constraint" and value is None:
        return  # None is an accepted constraint (no projection)
    if option == "sample_rate" and value is None:
        return  # None is the default (the loader's rate)
    kwargs[option] = value
    if option in ("epochs", "steps") and value is None:
        return  # the other one defines the plan
    if option == "steps":
        kwargs.pop("epochs")
    try:
        clipless.PrivacyEngine(seed=0).make_private(**split_options({**_engine_args(), **kwargs}))
    except NAMED as exc:
        names = {"target_epsilon": "epsilon", "target_delta": "delta"}
        _named(exc, option, names.get(option, option), "sample_rate")
        return
    pytest.fail(f"make_private accepted {option}={value!r}")


def test_make_private_rejects_non_finite_and_mismatched_data() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    import clipless

    for row, value in ((4, math.nan), (17, -math.inf), (0, math.inf)):
        args = _engine_args()
        x = torch.randn(20, 3)
        x[row, 1] = value
        args["data_loader"] = DataLoader(TensorDataset(x, torch.randint(0, 2, (20,))))
        # named where it is: x[row, 1] (the issue 38 report: "record 17, field 0" for x[17, 3])
        with pytest.raises(ValueError, match=rf"in record {row}, at features\[{row}, 1\]"):
            clipless.PrivacyEngine(seed=0).make_private(**args, noise_multiplier=1.0)
    args = _engine_args()
    args["data_loader"] = DataLoader(TensorDataset(torch.randn(20, 3), torch.full((20,), 7)))
    with pytest.raises(ValueError, match="label"):
        clipless.PrivacyEngine(seed=0).make_private(**args, noise_multiplier=1.0)
    args = _engine_args()
    args["data_loader"] = DataLoader(TensorDataset(torch.randn(20, 4), torch.zeros(20).long()))
    with pytest.raises(NAMED):
        clipless.PrivacyEngine(seed=0).make_private(**args, noise_multiplier=1.0)


# ---------------------------------------------------------------------------------------- CLI
def _one_error_line(err: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err


TRAIN_OPTIONS = {
    "--epsilon": ["0", "-1", "nan", "inf", "abc", ""],
    "--delta": ["0", "1", "2", "nan", "x"],
    "--epochs": ["0", "-3", "1.5", "many"],
    "--batch-size": ["0", "-1", "10000000", "q"],
    "--lr": ["0", "-0.1", "nan", "inf"],
    "--hidden": ["3", "0", "a,b", ",", "-2,4"],
    "--max-norm": ["0", "-1", "inf"],
    "--momentum": ["1", "-0.5", "nan"],
    "--device": ["gpu", "cuda:x", "", "ÿ"],
    "--dataset": ["nope", "", "données"],
    "--threads": ["0", "-1"],
}


@FUZZ
@given(
    option=st.sampled_from(sorted(TRAIN_OPTIONS)),
    data=st.data(),
)
def test_cli_train_bad_options_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, data: st.DataObject
) -> None:
    value = data.draw(st.sampled_from(TRAIN_OPTIONS[option]))
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--no-progress", "--quiet", option, value])
    err = capsys.readouterr().err
    assert code == 2, (option, value, err)
    _one_error_line(err)
    assert option in err or option.lstrip("-") in err, err
    assert not (out / "ledger.json").exists()


@FUZZ
@given(
    option=st.sampled_from(["--sigma", "--trials", "--steps", "--delta", "--confidence"]),
    value=st.sampled_from(["0", "-1", "nan", "inf", "x", "1e400", "", "10"]),
)
def test_cli_audit_bad_options(capsys: pytest.CaptureFixture[str], option: str, value: str) -> None:
    ok = {("--sigma", "10"), ("--steps", "10")}
    if (option, value) in ok:
        return
    code = main(["audit", option, value])
    err = capsys.readouterr().err
    assert code == 2, (option, value, err)
    _one_error_line(err)
    assert option in err


csv_cells = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["nan", "inf", "-inf", "", " ", "1e999", "0x10", "½", "１"]),
)


@FUZZ
@given(
    header=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),
    rows=st.lists(st.lists(csv_cells, min_size=0, max_size=4), max_size=4),
    column=st.text(min_size=1, max_size=6),
    lower=st.sampled_from(["0", "1", "nan", "x", "-inf"]),
    size=st.sampled_from(["8", "0", "1", "-5", "1e3", "100000000000"]),
    epsilon=st.sampled_from(["1", "0", "-1", "nan", "inf", "e"]),
)
def test_cli_ecdf_malformed_csv_and_options(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    header: list[str],
    rows: list[list[str]],
    column: str,
    lower: str,
    size: str,
    epsilon: str,
) -> None:
    path = tmp_path / "data.csv"
    lines = [",".join(header)] + [",".join(r) for r in rows]
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))
    out = tmp_path / "out"
    argv = ["ecdf", str(path), "--column", column, "--lower", lower, "--upper", "2"]
    argv += ["--size", size, "--epsilon", epsilon, "--seed", "1", "--out", str(out)]
    code = main(argv)
    captured = capsys.readouterr()
    if code == 0:  # a valid release: a complete CSV with one row per threshold
        released = (out / "ecdf.csv").read_text(encoding="utf-8").splitlines()
        assert len(released) == int(size) + 1
        values = [float(r.split(",")[1]) for r in released[1:]]
        assert all(0.0 <= v <= 1.0 for v in values) and values == sorted(values)
        return
    assert code == 2, captured.err
    _one_error_line(captured.err)


def test_cli_ecdf_unreadable_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--column", "x", "--lower", "0", "--upper", "1", "--size", "8", "--epsilon", "1"]
    cases = {
        "missing": tmp_path / "missing.csv",
        "folder": tmp_path,
        "binary": tmp_path / "binary.csv",
        "latin1": tmp_path / "latin1.csv",
    }
    cases["binary"].write_bytes(b"\x00\xff\xfe\x00garbage")
    cases["latin1"].write_bytes("x\n0.5\ncaf\xe9\n".encode("latin-1"))
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the output folder should be")
    for name, path in cases.items():
        code = main(["ecdf", str(path), *base, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        _one_error_line(err)
    good = tmp_path / "good.csv"
    good.write_text("x\n0.5\n")
    code = main(["ecdf", str(good), *base, "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert code == 2, err
    _one_error_line(err)
    assert "--out" in err


def test_cli_train_resume_with_corrupt_run_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    (out / "config.json").write_text("{ torn")
    code = main(["train", "--out", str(out), "--resume", "--no-progress", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    _one_error_line(err)
    (out / "config.json").write_text(json.dumps({"format": "clipless-run-v1", "options": {}}))
    code = main(["train", "--out", str(out), "--resume", "--no-progress", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    _one_error_line(err)


def test_cli_resume_of_a_damaged_checkpoint_or_ledger_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = tmp_path / "run"
    argv = [
        "train",
        "--epochs",
        "1",
        "--model",
        "mlp",
        "--hidden",
        "4,4",
        "--no-progress",
        "--quiet",
    ]
    assert main([*argv, "--out", str(run), "--unsafe-seed", "1"]) == 0
    capsys.readouterr()
    for name, garbage in (("checkpoint.pt", b"garbage"), ("ledger.json", b"{ torn")):
        damaged = tmp_path / name
        shutil.copytree(run, damaged)
        (damaged / name).write_bytes(garbage)
        before = (damaged / "ledger.json").read_bytes()
        assert main(["train", "--out", str(damaged), "--resume", "--no-progress"]) == 2
        err = capsys.readouterr().err
        _one_error_line(err)
        assert name in err and "--resume" in err
        assert (damaged / "ledger.json").read_bytes() == before  # left as it is
