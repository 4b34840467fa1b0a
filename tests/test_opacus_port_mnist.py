"""Opacus's examples/mnist.py, ported with the literal edits of docs/opacus-migration.md
("Porting a training loop"), on synthetic 28 x 28 images (issue 38's "done when").

The model and the training loop are Opacus's, written here; the comments mark the edits. The
faithful loop (criterion built inside ``train``) must fail loudly, the ported one must learn.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import clipless.nn as cnn
from clipless import PrivacyEngine
from clipless.optim import PrivacyContractError

MEAN, STD = 0.1307, 0.3081  # the example's transforms.Normalize


class SampleConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2, 1)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2, 1)
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def _images(n: int, seed: int) -> TensorDataset:
    """Two classes: a bright top half or a bright bottom half, [0, 1] pixels, normalised."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = 0.2 * torch.rand(n, 1, 28, 28, generator=g)
    rows = torch.arange(28).reshape(1, 1, 28, 1)
    bright = (rows < 14) == (y.reshape(-1, 1, 1, 1) == 0)
    x = torch.where(bright, x + 0.8, x)
    return TensorDataset((x - MEAN) / STD, y)


def train(model, train_loader, optimizer, faithful: bool) -> list[float]:
    """The example's ``train`` (device and tqdm dropped)."""
    model.train()
    # edit 1: the loss instance given to make_private, not one built here
    criterion = nn.CrossEntropyLoss() if faithful else optimizer.loss
    losses = []
    for data, target in train_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item() / max(1, len(target)))
    return losses


def _ported(faithful: bool):
    torch.manual_seed(0)
    train_loader = DataLoader(_images(512, 0), batch_size=64)
    # edit 2: convert; edit 3: input_norm from the normalisation (sqrt(d) max(m, 1 - m) / std)
    x0 = math.sqrt(28 * 28) * max(MEAN, 1 - MEAN) / STD
    model, report = cnn.convert(SampleConvNet(), input_norm=x0)
    assert report.exact  # overlapping max pools and view(-1, 512) have certified twins
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0)  # the example's lr
    privacy_engine = PrivacyEngine(secure_mode=False)  # edit 4: accountant="prv" dropped
    criterion = cnn.CrossEntropyLoss()  # edit 5: a clipless loss, temperature 1
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        criterion=criterion,
        noise_multiplier=0.5,
    )  # max_grad_norm dropped
    return privacy_engine, model, optimizer, train_loader


def test_the_faithful_loop_fails_loudly_instead_of_training_at_chance() -> None:
    _, model, optimizer, loader = _ported(faithful=True)
    with pytest.raises(PrivacyContractError, match="mean-reduced"):
        train(model, loader, optimizer, faithful=True)


def test_the_ported_loop_learns() -> None:
    """Eight steps (one epoch; each certifies the convolutions' norms, the step's main cost):
    the summed loss leaves chance (log 10 = 2.30 per sample), where the mean-reduced one of the
    faithful loop stayed at 2.30 (issue 38)."""
    torch.set_num_threads(1)
    engine, model, optimizer, loader = _ported(faithful=False)
    losses = train(model, loader, optimizer, faithful=False)
    assert engine.accountant.steps == len(losses) == 8
    assert losses[0] > 2.0 and max(losses[-2:]) < 1.7, losses
    assert 0 < engine.get_epsilon(1e-5) < math.inf
