"""Tests of :mod:`clipless.training` with the real engine on a tiny synthetic problem."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless.nn as cnn
from clipless.accounting import PrivacyLedger
from clipless.engine import MechanismSpec, PrivacyEngine, RunOptions
from clipless.training import (
    CHECKPOINT_NAME,
    LEDGER_NAME,
    FitResult,
    evaluate,
    fit,
    load_checkpoint,
    plot_training,
    training_loss,
)

DELTA = 1e-5
N = 64


def _data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)


def _setup(
    *,
    sigma: float = 4.0,
    batch_size: int = 16,
    seed: int = 0,
    scaling: str = "per-sample",
) -> tuple[Any, Any, Any, Any, PrivacyEngine, DataLoader[Any]]:
    torch.manual_seed(seed)
    data = _data()
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(4, 8), cnn.GroupSort(2), cnn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loader = DataLoader(
        data, batch_size=batch_size, generator=torch.Generator().manual_seed(seed + 1)
    )
    loss = cnn.CrossEntropyLoss()
    engine = PrivacyEngine(accountant="pld", seed=seed + 2)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        loss=loss,
        noise_multiplier=sigma,
        mechanism=MechanismSpec(scaling=scaling),
        options=RunOptions(input_shape=(4,)),
    )
    return model, optimizer, loader, loss, engine, DataLoader(data, batch_size=N)


def _noise(x: torch.Tensor) -> torch.Tensor:
    """An augmentation that draws from torch's global RNG (restored on resume)."""
    return x + 0.05 * torch.randn_like(x)


# ----------------------------------------------------------------------------------- budget
def test_budget_stop_happens_before_exceeding(tmp_path: Path) -> None:
    model, optimizer, loader, loss, engine, test_loader = _setup(sigma=8.0)
    opt = engine.optimizer
    assert opt is not None
    # a budget that allows a number of steps that is not a multiple of the epoch length
    probe = PrivacyLedger("pld")
    probe.record(opt.effective_noise_multiplier, opt.sample_rate, count=10)
    budget = probe.epsilon(DELTA) * 1.0001
    result = fit(
        model,
        optimizer,
        loader,
        loss,
        engine=engine,
        epochs=50,
        delta=DELTA,
        eval_loader=test_loader,
        epsilon_budget=budget,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    assert result.stop_reason == "budget"
    assert result.steps == 10 and engine.ledger is not None and engine.ledger.steps == 10
    assert result.epsilon <= budget and engine.get_epsilon(DELTA) <= budget
    # one more step would exceed: checked independently of the engine's own answer
    assert engine.would_exceed(budget, DELTA)
    one_more = PrivacyLedger.from_dict(engine.ledger.to_dict())
    one_more.record(opt.effective_noise_multiplier, opt.sample_rate)
    assert one_more.epsilon(DELTA) > budget
    # the ledger and a checkpoint were saved at the stop; the last record is partial
    saved = PrivacyLedger.from_json(tmp_path / LEDGER_NAME)
    assert saved.to_dict() == engine.ledger.to_dict()
    state = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert state["stop_reason"] == "budget"
    assert result.history[-1]["complete"] is False
    assert result.history[-1]["steps"] == 10
    # resuming with the same budget takes no step
    model2, optimizer2, loader2, loss2, engine2, _ = _setup(sigma=8.0)
    again = fit(
        model2,
        optimizer2,
        loader2,
        loss2,
        engine=engine2,
        epochs=50,
        delta=DELTA,
        epsilon_budget=budget,
        checkpoint_dir=tmp_path,
        resume=True,
        progress=False,
    )
    assert again.stop_reason == "budget" and again.steps == 10


def test_training_goes_on_after_a_budget_stop() -> None:
    """fit draws the batch of the step it then refuses to take: a later fit with a larger budget
    continues on the same loader (the optimizer checks one Poisson batch per step)."""
    model, optimizer, loader, loss, engine, _ = _setup(sigma=8.0)
    probe = PrivacyLedger("pld")
    probe.record(optimizer.effective_noise_multiplier, optimizer.sample_rate, count=3)
    first = fit(
        model, optimizer, loader, loss, engine=engine, epochs=5, delta=DELTA,
        epsilon_budget=probe.epsilon(DELTA) * 1.0001, progress=False,
    )  # fmt: skip
    assert first.stop_reason == "budget" and first.steps == 3
    more = fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA, progress=False)
    assert more.steps == 3 + len(loader) and more.stop_reason == "completed"


def test_budget_already_spent_takes_no_step() -> None:
    model, optimizer, loader, loss, engine, _ = _setup()
    result = fit(
        model,
        optimizer,
        loader,
        loss,
        engine=engine,
        epochs=3,
        delta=DELTA,
        epsilon_budget=1e-6,
        progress=False,
    )
    assert result.stop_reason == "budget" and result.steps == 0 and result.epsilon == 0.0


# ----------------------------------------------------------------------------------- resume
def _run(tmp: Path | None, epochs: int, resume: bool) -> tuple[FitResult, Any, PrivacyEngine]:
    model, optimizer, loader, loss, engine, test_loader = _setup(batch_size=32)
    result = fit(
        model,
        optimizer,
        loader,
        loss,
        engine=engine,
        epochs=epochs,
        delta=DELTA,
        eval_loader=test_loader,
        checkpoint_dir=tmp,
        resume=resume,
        ema_decay=0.9,
        augment=_noise,
        augmult=2,
        progress=False,
    )
    return result, model, engine


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    full, full_model, full_engine = _run(tmp_path / "full", 3, resume=False)
    first, _, _ = _run(tmp_path / "split", 1, resume=False)
    assert first.epochs_completed == 1
    resumed, resumed_model, resumed_engine = _run(tmp_path / "split", 3, resume=True)
    assert resumed.epochs_completed == 3 and len(resumed.history) == 3
    assert full_engine.ledger is not None and resumed_engine.ledger is not None
    assert resumed_engine.ledger.to_dict() == full_engine.ledger.to_dict()
    assert resumed.epsilon == full.epsilon
    assert (tmp_path / "split" / LEDGER_NAME).read_text() == (
        tmp_path / "full" / LEDGER_NAME
    ).read_text()
    # same seeds: the same batches, noise and augmentations, hence the same weights
    for (name, a), b in zip(
        full_model.state_dict().items(), resumed_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert full.ema_model is not None and resumed.ema_model is not None
    for a, b in zip(full.ema_model.parameters(), resumed.ema_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [r["test_accuracy"] for r in resumed.history] == [
        r["test_accuracy"] for r in full.history
    ]


def test_resume_without_checkpoint_starts_fresh_and_bad_path_fails(tmp_path: Path) -> None:
    model, optimizer, loader, loss, engine, _ = _setup()
    result = fit(
        model,
        optimizer,
        loader,
        loss,
        engine=engine,
        epochs=1,
        delta=DELTA,
        checkpoint_dir=tmp_path,
        resume=True,
        progress=False,
    )
    assert result.epochs_completed == 1
    with pytest.raises(FileNotFoundError, match="resume"):
        fit(
            model,
            optimizer,
            loader,
            loss,
            engine=engine,
            epochs=1,
            delta=DELTA,
            resume=tmp_path / "missing.pt",
            progress=False,
        )


def _crash_at_forward(n: int, *, epochs: int, checkpoint_dir: Path) -> PrivacyEngine:
    """Run ``fit`` with checkpoints until its ``n``-th training forward raises
    ``KeyboardInterrupt`` (through ``augment``); returns the engine that took the steps."""
    model, optimizer, loader, loss, engine, _ = _setup()
    calls = {"n": 0}

    def exploding(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return x

    with pytest.raises(KeyboardInterrupt):
        fit(
            model,
            optimizer,
            loader,
            loss,
            engine=engine,
            epochs=epochs,
            delta=DELTA,
            augment=exploding,
            checkpoint_dir=checkpoint_dir,
            progress=False,
        )
    return engine


def test_a_new_run_never_overwrites_a_ledger_of_spent_steps(tmp_path: Path) -> None:
    """A crash before the first checkpoint leaves a ledger and no checkpoint: neither a fresh run
    nor ``resume=True`` may start over it (the earlier steps' privacy would be forgotten)."""
    _crash_at_forward(3, epochs=2, checkpoint_dir=tmp_path)  # before any checkpoint
    assert not (tmp_path / CHECKPOINT_NAME).exists()
    spent = PrivacyLedger.from_json(tmp_path / LEDGER_NAME).steps
    assert spent == 2
    before = (tmp_path / LEDGER_NAME).read_bytes()
    for resume in (True, False):
        model, optimizer, loader, loss, engine, _ = _setup()
        with pytest.raises(FileExistsError, match="records 2 private steps"):
            fit(
                model,
                optimizer,
                loader,
                loss,
                engine=engine,
                epochs=1,
                delta=DELTA,
                checkpoint_dir=tmp_path,
                resume=resume,
                progress=False,
            )
        assert (tmp_path / LEDGER_NAME).read_bytes() == before


def test_crash_keeps_the_accounting(tmp_path: Path) -> None:
    """A crash mid-epoch writes the ledger; resume keeps the steps spent after the checkpoint."""
    engine = _crash_at_forward(7, epochs=3, checkpoint_dir=tmp_path)  # second epoch (4 steps each)
    assert engine.ledger is not None
    spent = engine.ledger.steps
    state = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    checkpointed = PrivacyLedger.from_dict(state["engine"]["ledger"]).steps
    assert spent > checkpointed  # steps after the last checkpoint were spent
    assert PrivacyLedger.from_json(tmp_path / LEDGER_NAME).steps == spent
    model2, optimizer2, loader2, loss2, engine2, _ = _setup()
    with pytest.warns(UserWarning, match="spent"):
        result = fit(
            model2,
            optimizer2,
            loader2,
            loss2,
            engine=engine2,
            epochs=2,
            delta=DELTA,
            checkpoint_dir=tmp_path,
            resume=True,
            progress=False,
        )
    assert result.steps == spent + (2 - state["epoch"]) * len(loader2)


# ---------------------------------------------------------------------------------- metrics
def test_metrics_files_and_plot(tmp_path: Path) -> None:
    model, optimizer, loader, loss, engine, test_loader = _setup()
    seen: list[dict[str, Any]] = []
    result = fit(
        model,
        optimizer,
        loader,
        loss,
        engine=engine,
        epochs=2,
        delta=DELTA,
        eval_loader=test_loader,
        metrics_path=tmp_path / "metrics.json",
        progress=True,
        on_epoch_end=seen.append,
    )
    assert [r["epoch"] for r in seen] == [1, 2]
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["stop_reason"] == "completed" and data["epochs_completed"] == 2
    assert data["epsilon"] == pytest.approx(result.epsilon) and data["delta"] == DELTA
    fields = {
        "epoch",
        "steps",
        "train_loss",
        "train_accuracy",
        "test_loss",
        "test_accuracy",
        "epsilon",
        "delta",
        "lr",
        "time_s",
        "complete",
    }
    for record in data["history"]:
        assert fields <= set(record)
        assert 0.0 <= record["test_accuracy"] <= 1.0
    assert data["history"][-1]["epsilon"] == pytest.approx(result.epsilon)
    assert data["history"][0]["epsilon"] < data["history"][1]["epsilon"]
    with open(tmp_path / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 and fields <= set(rows[0])
    assert float(rows[1]["epsilon"]) == pytest.approx(result.epsilon)
    png = plot_training(data, tmp_path / "training.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_training(result, tmp_path / "again.png").stat().st_size > 1000
    _check_training_figure(data)


def _check_training_figure(data: dict[str, Any]) -> None:
    """training.png's panels hold the history's loss, accuracy and epsilon, point by point."""
    from clipless.training import training_figure

    history = data["history"]
    epochs = [r.get("epoch_progress", r["epoch"]) for r in history]
    ax_loss, ax_acc, ax_eps = training_figure(data).axes
    for ax, name in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        assert ax.get_title() == name
        train, test = ax.lines
        assert list(train.get_xdata()) == epochs and list(test.get_xdata()) == epochs
        assert list(train.get_ydata()) == [r[f"train_{name}"] for r in history]
        assert list(test.get_ydata()) == [r[f"test_{name}"] for r in history]
        assert "not a DP release" in train.get_label()
    assert list(ax_eps.lines[0].get_ydata()) == [r["epsilon"] for r in history]


def test_empty_poisson_batches_still_step() -> None:
    """With q = 1/64 most batches are empty; each still adds noise and is accounted for."""
    model, optimizer, loader, loss, engine, _ = _setup(batch_size=1)
    result = fit(
        model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA, progress=False
    )
    assert result.steps == len(loader)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_loop_reads_the_device_once_per_step_on_the_accelerator_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the accelerator path a step reads the host once; the loop adds no read per step: its
    running loss and accuracy stay on the device until the epoch's end (or every 16th step),
    and a biased layer's output bound (its bias's norm) is not computed for the plan. The
    sampler's reads of its CPU indices are not device reads and are left out."""
    import traceback

    from clipless import norms

    monkeypatch.setattr(norms, "ACCELERATOR_PATH_ON_CPU", True)
    model, optimizer, loader, loss, engine, _ = _setup(batch_size=8)
    reads: list[str] = []

    def counting(name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = traceback.extract_stack(limit=3)[0].filename
            if not caller.endswith(("sampling.py", "dataloader.py")):
                reads.append(f"{name} from {caller}")
            return original(self, *args, **kwargs)

        return read

    for name in ("tolist", "item", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    result = fit(
        model, optimizer, loader, loss, engine=engine, epochs=2, delta=DELTA, progress=False
    )
    assert result.steps == 16
    # one per step, one per epoch for its totals, and the 16th step's progress reading
    assert len(reads) <= result.steps + 2 + 1, reads


def test_evaluate_accuracy() -> None:
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    y = torch.tensor([0, 1, 1, 1])
    scores = evaluate(model, DataLoader(TensorDataset(x, y), batch_size=3))
    assert scores == {"accuracy": 0.75}


def test_evaluate_reads_the_device_once_with_the_per_batch_sums_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loss and correct count stay on the device until the end, one read in all, and the
    mean loss has the bits of summing each batch's ``float`` in order, as a Python loop does."""
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(70, 5, generator=gen), torch.randint(0, 3, (70,), generator=gen)
    loader = list(DataLoader(TensorDataset(x, y), batch_size=16))  # its seed read happens here
    loss = torch.nn.CrossEntropyLoss(reduction="sum")
    with torch.no_grad():
        sums = [float(loss(model(bx), by)) for bx, by in loader]
        hits = sum(int((model(bx).argmax(-1) == by).sum()) for bx, by in loader)
    reads: list[str] = []
    for name in ("tolist", "item", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *a: Any, _n: str = name, _o: Any = original, **k: Any) -> Any:
            reads.append(_n)
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)
    scores = evaluate(model, loader, loss)
    monkeypatch.undo()
    reference = 0.0
    for value in sums:
        reference += value
    assert scores == {"accuracy": hits / 70, "loss": reference / 70}
    assert reads == ["tolist"]


# -------------------------------------------------------------------------- augmultiplicity
def test_augmult_keeps_each_samples_contribution_within_the_sensitivity() -> None:
    """Per sample: the mean of K scaled copy-gradients is bounded by the layer's sensitivity."""
    model, _optimizer, _loader, loss, engine, _ = _setup(scaling="per-sample")
    opt = engine.optimizer
    assert opt is not None
    sens = opt.sensitivities()
    names = [n for n, _ in model.named_parameters()]
    data = _data(3)
    g = torch.Generator().manual_seed(5)

    def wild(x: torch.Tensor) -> torch.Tensor:  # far-apart copies: no cancellation to hide behind
        return 5.0 * x + 3.0 * torch.randn(x.shape, generator=g)

    largest = dict.fromkeys(names, 0.0)
    for i in range(16):
        x, y = data.tensors[0][i : i + 1], data.tensors[1][i : i + 1]
        for augment, k in ((wild, 8), (lambda t: t, 4), (None, 1)):
            model.zero_grad()
            value, logits, _ = training_loss(
                model, loss, x, y, augment=augment, augmult=k, optimizer=opt
            )
            opt._pending.clear()  # measured without stepping
            assert logits.shape[0] == k
            value.backward()
            for name, p in model.named_parameters():
                assert p.grad is not None
                norm = float(p.grad.norm())
                largest[name] = max(largest[name], norm / sens[name])
                assert norm <= sens[name] * (1 + 1e-6), (name, k, norm, sens[name])
    assert max(largest.values()) > 0.05  # the bound is not vacuous here
    # identical copies: the mean equals the single-copy contribution
    x, y = data.tensors[0][:3], data.tensors[1][:3]
    model.zero_grad()
    training_loss(model, loss, x, y)[0].backward()
    single = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    training_loss(model, loss, x, y, augment=lambda t: t, augmult=5, optimizer=opt)[0].backward()
    for a, p in zip(single, model.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epochs": 0}, "epochs"),
        ({"delta": 1.5}, "delta"),
        ({"epsilon_budget": -1.0}, "epsilon_budget"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"augmult": 0}, "augmult"),
        ({"augmult": 3}, "augment"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], match: str) -> None:
    model, optimizer, loader, loss, engine, _ = _setup()
    args: dict[str, Any] = {"epochs": 1, "delta": DELTA, **kwargs}
    with pytest.raises(ValueError, match=match):
        fit(model, optimizer, loader, loss, engine=engine, progress=False, **args)


def test_loss_must_sum() -> None:
    model, optimizer, loader, _loss, engine, _ = _setup()
    with pytest.raises(ValueError, match="reduction"):
        fit(
            model,
            optimizer,
            loader,
            cnn.CrossEntropyLoss(reduction="mean"),
            engine=engine,
            epochs=1,
            delta=DELTA,
            progress=False,
        )


def _unseeded(ledger_path: Path | None = None) -> tuple[Any, Any, Any, Any, PrivacyEngine]:
    """As ``_setup`` but with the noise and the sampling from the OS CSPRNG (the default)."""
    torch.manual_seed(0)
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(4, 8), cnn.GroupSort(2), cnn.Linear(8, 2))
    loss = cnn.CrossEntropyLoss()
    engine = PrivacyEngine(accountant="pld")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(_data(), batch_size=16),
        loss=loss,
        noise_multiplier=4.0,
        options=RunOptions(input_shape=(4,), ledger_path=ledger_path),
    )
    return model, optimizer, loader, loss, engine


def _steps_after_the_checkpoint(model: Any, optimizer: Any, loader: Any, loss: Any, k: int) -> None:
    """Steps taken after the last checkpoint by a run that then crashed."""
    batches = iter(loader)
    for _ in range(k):
        x, y = next(batches)
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("where", ["ledger_path", "checkpoint copied elsewhere"])
def test_a_resume_never_forgets_steps_taken_after_the_checkpoint(
    where: str, tmp_path: Path
) -> None:
    """Audit findings: a user ledger_path went from 15 steps back to 11 on resume, and resuming
    from a copy of an older checkpoint rolled the run folder's ledger back (50 steps taken, 30
    recorded). The resumed run also redrew the saved generators' noise for new gradients."""
    run, own = tmp_path / "run", tmp_path / "own-ledger.json"
    ledger_path = own if where == "ledger_path" else None
    model, optimizer, loader, loss, engine = _unseeded(ledger_path)
    fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
        checkpoint_dir=run, progress=False)  # fmt: skip
    checkpointed = engine.ledger.steps
    _steps_after_the_checkpoint(model, optimizer, loader, loss, 3)  # then the crash
    spent = checkpointed + 3
    written = own if where == "ledger_path" else run / LEDGER_NAME
    assert PrivacyLedger.from_json(written).steps == spent
    resume: Path | bool = True
    if where == "checkpoint copied elsewhere":
        other = tmp_path / "copy"
        other.mkdir()
        (other / CHECKPOINT_NAME).write_bytes((run / CHECKPOINT_NAME).read_bytes())
        resume = other / CHECKPOINT_NAME
    saved = load_checkpoint(run / CHECKPOINT_NAME)["engine"]["generator"]
    model, optimizer, loader, loss, engine = _unseeded(ledger_path)
    with pytest.warns(UserWarning, match="were spent and stay in the ledger"):
        result = fit(model, optimizer, loader, loss, engine=engine, epochs=2, delta=DELTA,
                     checkpoint_dir=run, resume=resume, progress=False)  # fmt: skip
    # the 3 lost steps stay counted, and epoch 2 adds one epoch (as many steps as epoch 1)
    assert result.epochs_completed == 2 and checkpointed > 0
    assert engine.ledger.steps == spent + checkpointed
    assert PrivacyLedger.from_json(written).steps == engine.ledger.steps
    # fresh noise after the lost steps, not the checkpoint's generator state again
    assert not torch.equal(optimizer.generator.get_state(), saved)


def test_metrics_files_are_owner_only(tmp_path: Path) -> None:
    """The per-epoch training loss and accuracy are not DP releases: owner-only, like the
    checkpoint (audit finding: they were world-readable)."""
    import stat

    from clipless.training import write_metrics

    record = {"epoch": 1, "train_loss": 0.5, "train_accuracy": 0.9, "epsilon": 0.1}
    json_path, csv_path = write_metrics({"history": [record]}, tmp_path / "metrics.json")
    png = plot_training([record], tmp_path / "training.png")
    for path in (json_path, csv_path, png):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


# ------------------------------------------------------------- audit of fit (twelfth session)
def test_two_resumes_of_one_checkpoint_draw_fresh_noise(tmp_path: Path) -> None:
    """Audit finding: two runs resumed from one checkpoint (two variants, a copied folder)
    restored the same generator states when no step was lost, so they drew the same noise and
    batches and the difference of their releases cancelled the noise. Unseeded, a resume now
    always reseeds."""
    run = tmp_path / "run"
    model, optimizer, loader, loss, engine = _unseeded()
    fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
        checkpoint_dir=run, progress=False)  # fmt: skip
    saved = load_checkpoint(run / CHECKPOINT_NAME)
    states = []
    for branch in ("b", "c"):
        folder = tmp_path / branch
        folder.mkdir()
        for name in (CHECKPOINT_NAME, LEDGER_NAME):
            (folder / name).write_bytes((run / name).read_bytes())
        model, optimizer, loader, loss, engine = _unseeded()
        fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
            checkpoint_dir=folder, resume=True, progress=False)  # fmt: skip
        states.append((optimizer.generator.get_state(), loader.batch_sampler.generator.get_state()))
    for noise, sampler in states:
        assert not torch.equal(noise, saved["engine"]["generator"])
        assert not torch.equal(sampler, saved["engine"]["sampler_generator"])
    assert not torch.equal(states[0][0], states[1][0])


def test_a_resume_reads_the_runs_own_ledger_path_from_the_checkpoint(tmp_path: Path) -> None:
    """Audit finding: with make_private(ledger_path=own), a hard kill after the checkpoint left
    the steps in ``own`` only, and a resume that did not pass ``own`` again forgot them."""
    run, own = tmp_path / "run", tmp_path / "own-ledger.json"
    model, optimizer, loader, loss, engine = _unseeded(own)
    fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
        checkpoint_dir=run, progress=False)  # fmt: skip
    checkpointed = engine.ledger.steps
    _steps_after_the_checkpoint(model, optimizer, loader, loss, 3)  # then a hard kill
    assert PrivacyLedger.from_json(run / LEDGER_NAME).steps == checkpointed
    model, optimizer, loader, loss, engine = _unseeded()  # resumed without ledger_path
    with pytest.warns(UserWarning, match="were spent and stay in the ledger"):
        fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
            checkpoint_dir=run, resume=True, progress=False)  # fmt: skip
    assert engine.ledger.steps == checkpointed + 3


def test_resume_in_the_same_process_after_an_interruption(tmp_path: Path) -> None:
    """Audit finding: after Ctrl-C inside fit, fit(resume=True) on the same objects was refused
    ("2 batches were drawn"): the batch drawn before the interruption was never trained on."""
    model, optimizer, loader, loss, engine, _ = _setup()
    calls = {"n": 0}

    def interrupt_at_6(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt  # during epoch 2 (4 steps per epoch)
        return x

    with pytest.raises(KeyboardInterrupt):
        fit(model, optimizer, loader, loss, engine=engine, epochs=3, delta=DELTA,
            checkpoint_dir=tmp_path, augment=interrupt_at_6, progress=False)  # fmt: skip
    with pytest.warns(UserWarning, match="were spent"):
        result = fit(model, optimizer, loader, loss, engine=engine, epochs=3, delta=DELTA,
                     checkpoint_dir=tmp_path, resume=True, progress=False)  # fmt: skip
    assert result.stop_reason == "completed" and result.epochs_completed == 3


def test_bad_fit_arguments_fail_before_the_first_step(tmp_path: Path) -> None:
    """Audit findings: a non-callable on_epoch_end and a metrics path over the ledger failed
    (or destroyed the ledger) after an epoch of privacy was spent; NumPy scalars were refused
    with messages that contradicted their values."""
    model, optimizer, loader, loss, engine, _ = _setup()
    with pytest.raises(TypeError, match="on_epoch_end must be callable"):
        fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
            on_epoch_end=1, progress=False)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(ValueError, match="the run's ledger or checkpoint"):
        fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
            checkpoint_dir=tmp_path, metrics_path=tmp_path / "ledger", progress=False)  # fmt: skip
    assert engine.ledger.steps == 0
    result = fit(model, optimizer, loader, loss, engine=engine, epochs=np.int64(1),  # type: ignore[arg-type]
                 delta=np.float32(1e-5), ema_decay=np.float32(0.9),  # type: ignore[arg-type]
                 metrics_path=tmp_path / "out" / "metrics", progress=False)  # fmt: skip
    assert result.metrics_path == tmp_path / "out" / "metrics.json"
    assert result.metrics_path.is_file() and result.steps == len(loader)


def test_a_resume_checks_epochs_and_starts_the_ema_from_the_resumed_weights(
    tmp_path: Path,
) -> None:
    """Audit findings: epochs below the checkpoint's returned "completed" silently, and an EMA
    added on resume started from the initial weights instead of the checkpoint's."""
    model, optimizer, loader, loss, engine, _ = _setup()
    fit(model, optimizer, loader, loss, engine=engine, epochs=2, delta=DELTA,
        checkpoint_dir=tmp_path, progress=False)  # fmt: skip
    model, optimizer, loader, loss, engine, _ = _setup()
    with pytest.raises(ValueError, match="completed 2 epochs but epochs=1"):
        fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
            checkpoint_dir=tmp_path, resume=True, progress=False)  # fmt: skip
    model, optimizer, loader, loss, engine, _ = _setup()
    with pytest.warns(UserWarning, match="without an EMA"):
        result = fit(model, optimizer, loader, loss, engine=engine, epochs=2, delta=DELTA,
                     checkpoint_dir=tmp_path, resume=True, ema_decay=0.9,
                     progress=False)  # fmt: skip
    assert result.ema_model is not None
    for a, b in zip(result.ema_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)  # the resumed weights, not the initial ones


def test_fit_refuses_the_training_loader_for_evaluation_and_restarts_after_an_error() -> None:
    """Review findings: eval_loader=train_loader failed at epoch 2, after an epoch of privacy;
    fit called again after an exception mid-epoch was refused ("2 batches were drawn")."""
    model, optimizer, loader, loss, engine, _ = _setup()
    with pytest.raises(ValueError, match="eval_loader is the private training loader"):
        fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
            eval_loader=loader, progress=False)  # fmt: skip
    calls = {"n": 0}

    def fail_at_3(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("out of memory")
        return x

    with pytest.raises(MemoryError):
        fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
            augment=fail_at_3, progress=False)  # fmt: skip
    again = fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
                progress=False)  # fmt: skip
    assert again.stop_reason == "completed" and engine.ledger.steps == 2 + len(loader)


@pytest.mark.parametrize("run_b", ["another configuration", "the same command"])
def test_a_moved_run_never_adopts_the_ledger_of_the_run_started_in_its_place(
    run_b: str, tmp_path: Path
) -> None:
    """CLI audit finding: after ``--force`` moved run A aside and run B started in A's folder,
    resuming A took B's ledger (the path A's checkpoint recorded) as its own: A's 370 steps at
    its own sigma became B's 399 at another, and A reported 0.50 where it had spent 0.97. The
    review: a B of A's own configuration looked like A's continuation (same entries); the
    ledgers' run ids tell them apart."""
    run, moved = tmp_path / "run", tmp_path / "run.old"
    model, optimizer, loader, loss, engine = _unseeded()
    fit(model, optimizer, loader, loss, engine=engine, epochs=1, delta=DELTA,
        checkpoint_dir=run, progress=False)  # fmt: skip
    own_steps = engine.ledger.steps
    run.rename(moved)
    if run_b == "the same command":
        model_b, opt_b, loader_b, loss_b, engine_b = _unseeded()
    else:  # another sigma and more steps
        torch.manual_seed(1)
        model_b = cnn.Sequential(cnn.InputNorm(1.0), cnn.Linear(4, 2))
        engine_b, loss_b = PrivacyEngine(accountant="pld"), cnn.CrossEntropyLoss()
        model_b, opt_b, loader_b = engine_b.make_private(
            module=model_b,
            optimizer=torch.optim.SGD(model_b.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=8),
            loss=loss_b,
            noise_multiplier=9.0,
        )
    fit(model_b, opt_b, loader_b, loss_b, engine=engine_b, epochs=3, delta=DELTA,
        checkpoint_dir=run, progress=False)  # fmt: skip
    assert engine_b.ledger.steps > own_steps
    model, optimizer, loader, loss, engine = _unseeded()
    with pytest.warns(UserWarning, match="another run's ledger and is ignored"):
        fit(model, optimizer, loader, loss, engine=engine, epochs=2, delta=DELTA,
            checkpoint_dir=moved, resume=True, progress=False)  # fmt: skip
    entries = PrivacyLedger.from_json(moved / LEDGER_NAME).entries
    assert {e.noise_multiplier for e in entries} == {engine.ledger.entries[0].noise_multiplier}
    assert engine.ledger.steps == 2 * own_steps  # A's own two epochs, nothing of B's
    assert PrivacyLedger.from_json(moved / LEDGER_NAME).steps == 2 * own_steps
    assert PrivacyLedger.from_json(run / LEDGER_NAME).steps == engine_b.ledger.steps  # B intact


def test_the_weight_average_is_the_per_tensor_formula_bit_for_bit() -> None:
    """``WeightEMA.update`` (fused per-tensor arithmetic) computes ``d * ema + (1 - d) w`` as
    ``mul_`` then ``add_`` would, in each parameter's dtype, with the warm-up decay."""
    from clipless.training import WeightEMA

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).double())
    ema = WeightEMA(model, decay=0.99)
    expected = [p.detach().clone() for p in model.parameters()]
    for t in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        d = min(0.99, (1.0 + t) / (10.0 + t))
        for e, p in zip(expected, model.parameters(), strict=True):
            e.mul_(d).add_(p.detach(), alpha=1.0 - d)
    assert all(torch.equal(a, e) for a, e in zip(ema.model.parameters(), expected, strict=True))
