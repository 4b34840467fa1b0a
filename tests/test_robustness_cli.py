"""``clipless train``'s certified robust accuracy in metrics.json and ``clipless evaluate RUN_DIR``.

References: :func:`clipless.robustness.certified_accuracy` recomputed on the reloaded model and
the raw test set (the run's numbers must be the same), and for a run on scattering features the
certificate of the model on the *unmapped* features (the train command premaps its tensors in
place; a certificate computed on the premapped ones would differ).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clipless._robustness_cli import DEFAULT_RADII
from clipless.cli import load_trained_model, main
from clipless.data import load_dataset
from clipless.robustness import certified_accuracy, certify, pgd_l2


def _train(out: Path, *extra: str) -> None:
    argv = ["train", "--dataset", "digits", *extra, "--epsilon", "3", "--accountant", "rdp"]
    argv += ["--epochs", "2", "--batch-size", "256", "--no-progress", "--unsafe-seed", "1"]
    assert main([*argv, "--threads", "1", "--out", str(out)]) == 0


def test_train_reports_and_evaluate_reproduces_certified_accuracy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gnp"
    _train(out, "--model", "gnp", "--hidden", "4,16")
    printed = capsys.readouterr().out
    assert "certified robust accuracy (L2, input space)" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    rob = metrics["robustness"]
    assert rob["space"] == "input" and rob["norm"] == "l2"
    assert list(rob["certified_accuracy"]) == [f"{r:g}" for r in DEFAULT_RADII]
    assert rob["lipschitz"]["input_map"] == "ball"
    assert (out / "robustness.png").stat().st_size > 0
    _, test, _ = load_dataset("digits")
    x, y = test.tensors
    expected = certified_accuracy(load_trained_model(out / "model.pt"), x, y, DEFAULT_RADII)
    assert rob["certified_accuracy"] == expected.to_dict()["certified_accuracy"]
    assert rob["accuracy"] == pytest.approx(metrics["final"]["test_accuracy"], abs=1e-12)
    assert max(rob["certified_accuracy"].values()) > 0  # a model that certifies something
    # the trained model's certificates hold against the attack too
    model = load_trained_model(out / "model.pt").double().eval()
    cert = certify(model, x[:60])
    inside = torch.where(cert.radii > 0, cert.radii * (1 - 1e-6), torch.zeros_like(cert.radii))
    assert int((cert.radii > 0).sum()) >= 20
    worst = pgd_l2(model, x[:60].double(), cert.predictions, inside)
    assert bool((worst[cert.radii > 0] > 0).all())
    # evaluate: the same numbers from the saved run
    assert main(["evaluate", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == rob
    assert main(["evaluate", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"test accuracy {100 * rob['accuracy']:.2f}%" in text and "r=0.5:" in text
    assert main(["evaluate", str(out), "--norm", "linf", "--radii", "0.01,0.05", "--json"]) == 0
    linf = json.loads(capsys.readouterr().out)
    direct = certified_accuracy(
        load_trained_model(out / "model.pt"), x, y, [0.01, 0.05], norm="linf"
    )
    assert linf["certified_accuracy"] == direct.to_dict()["certified_accuracy"]


def test_scatter_run_certifies_the_unmapped_features(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("kymatio")
    monkeypatch.setenv("CLIPLESS_DATA", str(tmp_path / "cache"))
    out = tmp_path / "scatter"
    _train(out, "--features", "scatter")
    rob = json.loads((out / "metrics.json").read_text())["robustness"]
    assert rob["space"] == "features" and rob["lipschitz"]["input_map"] == "normalised-sphere"
    assert rob["lipschitz"]["total"] is None  # the normalisation has no global constant
    loaded = load_trained_model(out / "model.pt")
    front, model = loaded[0], loaded[1]
    _, test, _ = load_dataset("digits")
    with torch.no_grad():
        features = front(test.tensors[0])
    expected = certified_accuracy(model, features, test.tensors[1], DEFAULT_RADII)
    assert rob["certified_accuracy"] == pytest.approx(expected.to_dict()["certified_accuracy"])
    capsys.readouterr()
    assert main(["evaluate", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["certified_accuracy"] == pytest.approx(rob["certified_accuracy"])
    assert "features space" in _evaluate_text(out, capsys)


def _evaluate_text(out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["evaluate", str(out)]) == 0
    return capsys.readouterr().out


def test_evaluate_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate", str(tmp_path / "nothing")]) == 2
    assert "RUN_DIR" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path), "--radii", "0.1,-1"]) == 2
    assert "--radii" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path), "--radii", "a"]) == 2
    (tmp_path / "model.pt").write_bytes(b"")
    assert main(["evaluate", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path), "--device", "tpu"]) == 2
    assert "argument --device: expected one of" in capsys.readouterr().err
