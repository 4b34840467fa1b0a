"""Opacus spellings mapped or refused with a pointer (issue 38): criterion=, accountant="prv",
accountant.history / len(accountant), save_checkpoint / load_checkpoint, extend's epsilon."""

from __future__ import annotations

import os
import stat
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless
from _mechanism import split_options
from clipless import nn

N, DIM = 200, 6


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, DIM, generator=g), torch.randint(0, 2, (N,), generator=g))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.InputNorm(2.0), nn.Linear(DIM, 8), nn.GroupSort(2), nn.Linear(8, 2))


def _engine(**kw):
    model = _model()
    engine = clipless.PrivacyEngine(seed=0)
    kw.setdefault("noise_multiplier", 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the seed's warning
        out = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=20),
            **split_options(kw),
        )
    return (engine, *out)


def _steps(optimizer, model, loader, loss, count: int) -> None:
    batches = iter(loader)
    for _ in range(count):
        x, y = next(batches)
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()


def test_criterion_is_opacus_name_for_loss() -> None:
    crit = nn.CrossEntropyLoss()  # mean-reduced until make_private switches it
    engine, model, optimizer, loader = _engine(criterion=crit)
    assert optimizer.loss is crit and crit.reduction == "sum"
    _steps(optimizer, model, loader, crit, 2)
    assert engine.accountant.steps == 2
    with pytest.raises(TypeError, match="loss= or Opacus's criterion=, not both"):
        _engine(loss=nn.CrossEntropyLoss(), criterion=nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match=r"needs loss= a clipless.nn loss \(Opacus's criterion=\)"):
        _engine()
    engine = clipless.PrivacyEngine()
    model = _model()
    _, optimizer, _ = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=20),
        criterion=nn.CrossEntropyLoss(),
        target_epsilon=2.0,
        target_delta=1e-3,
        epochs=1,
    )
    assert optimizer.loss.reduction == "sum"


@pytest.mark.parametrize(("name", "words"), [("prv", "PRV's counterpart"), ("gdp", "central")])
def test_opacus_accountants_point_at_pld(name: str, words: str) -> None:
    with pytest.raises(ValueError, match=words) as info:
        clipless.PrivacyEngine(accountant=name)
    assert "accountant='pld'" in str(info.value)


def test_accountant_history_and_len_as_in_opacus() -> None:
    engine, model, optimizer, loader = _engine(loss=nn.CrossEntropyLoss())
    assert len(engine.accountant) == 0 and engine.accountant.history == []
    assert bool(engine.accountant)  # a ledger, not an empty container
    _steps(optimizer, model, loader, optimizer.loss, 3)
    sigma, q = optimizer.accounting_noise_multiplier, optimizer.sample_rate
    assert engine.accountant.history == [(sigma, q, 3)]
    assert len(engine.accountant) == 1


def test_save_and_load_checkpoint_resume_the_run(tmp_path) -> None:
    path = tmp_path / "ckpt.pt"
    engine, model, optimizer, loader = _engine(loss=nn.CrossEntropyLoss())
    _steps(optimizer, model, loader, optimizer.loss, 2)
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, checkpoint_dict={"e": 1})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # holds the generators' states
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _steps(optimizer, model, loader, optimizer.loss, 1)  # the uninterrupted run's third step
    after = {k: v.clone() for k, v in model.state_dict().items()}

    engine2, model2, optimizer2, loader2 = _engine(loss=nn.CrossEntropyLoss())
    ckpt = engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    assert ckpt["e"] == 1 and engine2.accountant.steps == 2
    for k, v in model2.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
    _steps(optimizer2, model2, loader2, optimizer2.loss, 1)  # same seed: the same third step
    for k, v in model2.state_dict().items():
        torch.testing.assert_close(v, after[k], rtol=0, atol=0)
    with pytest.raises(TypeError, match="no scheduler"):
        engine2.save_checkpoint(path=path, module=model2, noise_scheduler=object())


def test_extend_returns_the_new_epsilon_at_the_target_delta() -> None:
    engine, *_ = _engine(
        loss=nn.CrossEntropyLoss(),
        noise_multiplier=None,
        target_epsilon=1.0,
        target_delta=1e-3,
        steps=5,
    )
    new = engine.extend(steps=5)
    assert new is not None and new > 1.0
    assert new == engine.privacy_config.epsilon(1e-3)
    assert engine.extend(steps=1, delta=1e-2) == engine.privacy_config.epsilon(1e-2)


def _conv_engine() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.InputNorm(2.0), nn.Conv2d(1, 2, 3, padding=1, bias=False), nn.Flatten(), nn.Linear(32, 2)
    )
    data = TensorDataset(torch.randn(40, 1, 4, 4), torch.randint(0, 2, (40,)))
    clipless.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10),
        loss=nn.CrossEntropyLoss(),
        noise_multiplier=1.0,
    )


def test_default_threads_with_a_conv_model_warn(monkeypatch) -> None:
    from clipless import engine

    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(engine, "_DEFAULT_THREADS", 2)  # torch's default on a 2-core CPU
    try:
        torch.set_num_threads(2)
        with pytest.warns(RuntimeWarning, match=r"torch.set_num_threads\(1\)"):
            _conv_engine()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            _engine(loss=nn.CrossEntropyLoss())  # no convolution: no warning
            monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a choice: no warning
            _conv_engine()
            monkeypatch.delenv("OMP_NUM_THREADS")
            torch.set_num_threads(1)
            _conv_engine()
            monkeypatch.setattr(engine, "_DEFAULT_THREADS", 4)
            torch.set_num_threads(2)  # not the default: chosen (the CLI's --threads)
            _conv_engine()
    finally:
        torch.set_num_threads(threads)
