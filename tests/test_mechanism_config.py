"""PrivacyConfig serialisation with scaling thresholds (a read-only mapping)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless
from clipless import models, nn
from clipless.engine import MechanismSpec
from clipless.mechanism import PrivacyConfig


def test_config_with_thresholds_round_trips() -> None:
    config = PrivacyConfig(
        noise_multiplier=1.5,
        sample_rate=0.1,
        num_samples=100,
        num_tensors=2,
        scaling="threshold",
        thresholds={"1": 0.5, "3": 0.25},
    )
    data = config.to_dict()
    assert data["thresholds"] == {"1": 0.5, "3": 0.25} and data["scaling"] == "threshold"
    assert PrivacyConfig.from_dict(json.loads(json.dumps(data))) == config


def test_engine_config_with_threshold_scaling() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 6), torch.randint(0, 2, (64,))
    model = models.mlp((6,), (4,), 2, input_norm=1.0)
    paths = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    engine = clipless.PrivacyEngine(seed=0)
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
        loss=nn.CrossEntropyLoss(),
        noise_multiplier=1.0,
        epochs=1,
        mechanism=MechanismSpec(scaling="threshold", thresholds=dict.fromkeys(paths, 0.5)),
    )
    assert engine.config["thresholds"] == dict.fromkeys(paths, 0.5)


def test_a_boolean_sample_rate_is_refused() -> None:
    """``True`` is an int equal to 1: it passed the range check and meant "every record"."""
    import pytest

    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
        PrivacyConfig(noise_multiplier=1.0, sample_rate=True, num_samples=10, num_tensors=1)


def test_calibrate_never_records_a_multiplier_below_the_calibrated_one(monkeypatch) -> None:
    """Audit finding: per-layer noise converts dp_accounting's multiplier to
    ``sigma_acc / factor * sqrt(D)`` and back, which rounded below ``sigma_acc`` in ~5% of
    cases (1 ulp): the ledger's multiplier must be at least the one whose epsilon was checked."""
    import random

    from clipless import mechanism

    rng = random.Random(1)
    for _ in range(500):
        s_acc = math.exp(rng.uniform(math.log(0.3), math.log(20.0)))
        monkeypatch.setattr(mechanism.accounting, "calibrate_noise", lambda *a, s=s_acc, **k: s)
        for neighbouring in ("add_remove", "replace_one"):
            config = PrivacyConfig(
                noise_multiplier=1.0,
                sample_rate=0.01,
                num_samples=1000,
                num_tensors=rng.randint(2, 40),
                noise="per-layer",
                neighbouring=neighbouring,
            )
            out = config.calibrate(1.0, 1e-5, 10)
            assert s_acc <= out.accounting_noise_multiplier <= s_acc * (1 + 1e-15)


def test_from_dict_drops_thresholds_saved_with_another_scaling() -> None:
    """Configs saved before thresholds were refused with other scalings still load."""
    from clipless.mechanism import PrivacyConfig

    saved = PrivacyConfig(noise_multiplier=1.0, sample_rate=0.5, num_samples=4, num_tensors=1)
    data = {**saved.to_dict(), "thresholds": {"1": 0.5}}
    assert PrivacyConfig.from_dict(data).thresholds is None
    with pytest.raises(ValueError, match="threshold' only"):
        PrivacyConfig(**{**saved.to_dict(), "thresholds": {"1": 0.5}})


@pytest.mark.parametrize("bad", [0, 5, 1.5, True, "2"])
def test_num_mechanisms_must_be_an_integer_between_one_and_num_tensors(bad) -> None:
    with pytest.raises(ValueError, match="num_mechanisms"):
        PrivacyConfig(
            noise_multiplier=1.0, sample_rate=0.1, num_samples=100, num_tensors=4,
            noise="per-layer", num_mechanisms=bad,
        )  # fmt: skip
    config = PrivacyConfig(
        noise_multiplier=2.0, sample_rate=0.1, num_samples=100, num_tensors=4,
        noise="per-layer", num_mechanisms=2,
    )  # fmt: skip
    assert config.effective_noise_multiplier == pytest.approx(2.0 / math.sqrt(2), rel=1e-15)
