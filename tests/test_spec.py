"""The training specification of ``clipless train`` (:mod:`clipless.spec`): its option table,
its default rules and checks, and the run configuration it writes and reads back."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from _interrupt import ctrl_c_at_evaluation
from clipless._train_options import TRAIN_OPTIONS
from clipless.cli import _train_actions, build_parser, main
from clipless.spec import (
    LEGACY_OPTIONS,
    RUN_OPTIONS,
    OptionError,
    TrainSpec,
    read_run_config,
)

# config.json of ``clipless train --dataset breast-cancer --epochs 2 --unsafe-seed 7`` as written
# by clipless 0.1.0 before the spec existed (commit 5af2c34; its version and commit left out)
CONFIG_BEFORE_THE_SPEC: dict[str, Any] = {
    "format": "clipless-run-v1",
    "options": {
        "dataset": "breast-cancer",
        "data": None,
        "test_data": None,
        "label": None,
        "classes": None,
        "columns": None,
        "preprocessing": None,
        "features": "none",
        "model": "linear",
        "hidden": [],
        "pool": "l2",
        "bias": True,
        "input_norm": 5.477225575051661,
        "input_mode": "ball",
        "center_noise": 0.0,
        "whiten_noise": 0.0,
        "whiten_shrink": None,
        "temperature": 0.1,
        "loss_clip": 0.3,
        "epsilon": 1.0,
        "delta": 1e-05,
        "accountant": "pld",
        "neighbouring": "add_remove",
        "noise": "global",
        "scaling": "per-sample",
        "constraint": "none",
        "max_norm": 1.0,
        "epochs": 2,
        "batch_size": 128,
        "lr": 0.01,
        "optimizer": "adam",
        "momentum": 0.9,
        "ema": 0.9,
        "seed": 0,
        "unsafe_seed": 7,
    },
    "dataset": "breast-cancer",
    "preprocessing": None,
    "model": "linear",
    "hidden": [],
    "pool": None,
    "bias": True,
    "features": "none",
    "input_shape": [30],
    "num_classes": 2,
    "input_norm": 5.477225575051661,
    "input_mode": "ball",
    "center_noise": None,
    "whiten_noise": None,
    "whiten_shrink": None,
    "temperature": 0.1,
    "loss_clip": 0.3,
    "lr": 0.01,
    "optimizer": "adam",
    "momentum": None,
    "batch_size": 128,
    "sample_rate": 0.2807017543859649,
    "num_samples": 456,
    "epochs": 2,
    "seed": 0,
    "unsafe_seed": 7,
    "target_epsilon": 1.0,
    "delta": 1e-05,
    "noise_multiplier": 3.4138689624153384,
    "effective_noise_multiplier": 3.4138689624153384,
    "accountant": "pld",
    "neighbouring": "add_remove",
    "constraint": "none",
    "max_norm": 1.0,
    "scaling": "per-sample",
    "noise": "global",
    "ema": 0.9,
    "device": "cpu",
}
ARGV = ["train", "--dataset", "breast-cancer", "--epochs", "2", "--unsafe-seed", "7"]
ARGV += ["--no-progress", "--quiet"]


def _spec(argv: list[str]) -> TrainSpec:
    args = build_parser().parse_args(argv)
    return TrainSpec.from_namespace(args)


def test_every_option_is_one_table_entry_and_one_spec_field() -> None:
    table = [o.dest for o in TRAIN_OPTIONS]
    assert len(table) == len(set(table))
    assert set(table) == {f.name for f in fields(TrainSpec)} - {"given"}
    parser = {a.dest for a in _train_actions(build_parser())} - {"help"}
    assert parser == set(table)
    assert all(o.flag == "--" + o.dest.replace("_", "-") for o in TRAIN_OPTIONS)
    # the run options in the order config.json has always listed them
    assert list(RUN_OPTIONS) == list(CONFIG_BEFORE_THE_SPEC["options"])
    assert set(LEGACY_OPTIONS) < set(RUN_OPTIONS)


def test_the_spec_defaults_are_the_parser_defaults() -> None:
    assert _spec(["train"]) == TrainSpec()


def test_static_default_rules() -> None:
    spec = TrainSpec().with_static_defaults()
    assert (spec.model, spec.hidden, spec.constraint) == ("linear", (), "none")
    cnn = replace(TrainSpec(), model="cnn").with_static_defaults()
    assert (cnn.hidden, cnn.constraint) == ((16, 32), "orthogonal")
    kept = replace(TrainSpec(), model="mlp", hidden=(4,), constraint="clip").with_static_defaults()
    assert (kept.hidden, kept.constraint) == ((4,), "clip")


def test_data_default_rules_follow_the_features() -> None:
    plain = TrainSpec(model="linear").with_data_defaults("digits", (1, 8, 8))
    assert (plain.features, plain.bias, plain.input_mode) == ("none", True, "ball")
    assert (plain.loss_clip, plain.center_noise, plain.whiten_noise) == (0.3, 0.0, 0.0)
    assert plain.whiten_shrink is None
    images = TrainSpec(model="linear").with_data_defaults("fashion-mnist", (1, 28, 28))
    assert (images.features, images.bias, images.input_mode) == ("scatter", False, "sphere")
    assert (images.loss_clip, images.center_noise, images.whiten_noise) == (0.1, 20.0, 20.0)
    assert images.whiten_shrink == 1.0
    trained = images.with_training_defaults(60000).with_input_norm("fashion-mnist", (1, 28, 28))
    assert (trained.lr, trained.batch_size, trained.input_norm) == (0.005, 2048, 2.0)
    adult = TrainSpec(dataset="adult", model="linear", features="none")
    assert adult.with_training_defaults(100).lr == 0.003


@pytest.mark.parametrize(
    ("spec", "step", "named"),
    [
        (TrainSpec(model="linear", whiten_shrink=2.0), "data", "--whiten-shrink"),
        (TrainSpec(model="linear", features="scatter"), "data", "--features"),
        (TrainSpec(batch_size=500), "training", "--batch-size"),
        (TrainSpec(model="cnn"), "model", "--model"),
        (TrainSpec(epsilon=60.0), "model", "--epsilon"),
        (TrainSpec(preprocessing="public-bins"), "source", "--preprocessing"),
        (TrainSpec(label="y"), "source", "--label"),
        (
            TrainSpec(data="x.csv", label="y", classes="a,b", given=frozenset({"data"})),
            "source",
            "--columns",
        ),
        (TrainSpec(data="x.csv"), "source", "--data"),  # and --dataset (the default, given)
    ],
)
def test_each_rule_names_its_option(spec: TrainSpec, step: str, named: str) -> None:
    with pytest.raises(OptionError, match=f"^argument {named}: ") as caught:
        if step == "data":
            spec.with_data_defaults("breast-cancer", (30,))
        elif step == "training":
            spec.with_training_defaults(456)
        elif step == "model":
            spec.check_model_and_budget("breast-cancer", (30,))
        else:
            spec.with_source()
    assert caught.value.argument == named
    assert isinstance(caught.value, ValueError)


def test_adopt_takes_the_saved_options_and_the_legacy_values(tmp_path: Path) -> None:
    saved = json.loads(json.dumps(CONFIG_BEFORE_THE_SPEC))
    for newer in ("features", "loss_clip", "input_mode", "center_noise", "whiten_noise"):
        del saved["options"][newer]  # a run saved before these options existed
    resume = replace(_spec(["train", "--resume"]), given=frozenset({"resume"}))
    spec = resume.adopt(saved, tmp_path)
    assert (spec.features, spec.loss_clip, spec.input_mode) == ("none", 0.0, "ball")
    assert spec.hidden == () and spec.unsafe_seed == 7 and spec.batch_size == 128
    given = replace(_spec(["train", "--lr", "0.5"]), given=frozenset({"lr"}))
    differs = r"^argument --lr: the run in .* --lr \(run: 0.01, given: 0.5\)"
    with pytest.raises(OptionError, match=differs):
        given.adopt(saved, tmp_path)


def test_a_run_config_written_before_the_spec_is_resumed(tmp_path: Path) -> None:
    """The spec writes config.json as the code before it did (same keys, order and values),
    and ``--resume`` continues an interrupted run from the config.json that code wrote."""
    out = tmp_path / "run"
    with ctrl_c_at_evaluation(2), pytest.warns(UserWarning, match="seed"):
        assert main([*ARGV, "--out", str(out)]) == 130
    written = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("clipless_version", "git_commit")} == (
        CONFIG_BEFORE_THE_SPEC
    )
    assert list(written)[: len(CONFIG_BEFORE_THE_SPEC)] == list(CONFIG_BEFORE_THE_SPEC)
    (out / "config.json").write_text(json.dumps(CONFIG_BEFORE_THE_SPEC, indent=2))
    assert read_run_config(out) == CONFIG_BEFORE_THE_SPEC
    with pytest.warns(UserWarning):
        assert main(["train", "--out", str(out), "--resume", "--no-progress", "--quiet"]) == 0
    config = json.loads((out / "metrics.json").read_text())["config"]
    assert config["resumed"] is True and config["epochs"] == 2
    assert config["noise_multiplier"] == CONFIG_BEFORE_THE_SPEC["noise_multiplier"]
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["architecture"]["input_norm"] == CONFIG_BEFORE_THE_SPEC["input_norm"]


def test_from_namespace_keeps_what_was_given() -> None:
    args = build_parser().parse_args(["train", "--hidden", "8,8"])
    args.given = {"hidden"}
    spec = TrainSpec.from_namespace(args)
    assert spec.hidden == (8, 8) and spec.given == frozenset({"hidden"})
    assert TrainSpec.from_namespace(argparse.Namespace()).given_options == frozenset(RUN_OPTIONS)
