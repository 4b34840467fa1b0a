"""The usual Opacus tutorial script (an MLP on scikit-learn's digits), ported to clipless.

Each ported line keeps the original Opacus line as a comment above it (``# opacus:``); the
mapping is explained in docs/opacus-migration.md. Runs in a few seconds on a CPU:

    PYTHONPATH=src python examples/opacus_port.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# opacus: from opacus import PrivacyEngine
# opacus: from opacus.validators import ModuleValidator
# opacus: from opacus.utils.batch_memory_manager import BatchMemoryManager
import clipless.nn as cnn
from clipless import MechanismSpec, PrivacyEngine

EPOCHS = 10
BATCH_SIZE = 256
LR = 0.1
TARGET_EPSILON = 3.0
TARGET_DELTA = 1e-5


class MLP(nn.Module):
    """An ordinary torch model, written as for Opacus (BatchNorm, Dropout included)."""

    def __init__(self, d_in: int = 64, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, width)
        self.bn = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.fc1(x)))
        h = h + F.relu(self.fc2(h))  # a skip connection
        return self.out(self.drop(h))


def main() -> None:
    digits = load_digits()
    x = torch.tensor(digits.data / 8.0 - 1.0, dtype=torch.float32)  # 64 pixels in [-1, 1]
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=BATCH_SIZE)

    model = MLP()
    # opacus: model = ModuleValidator.fix(model)
    # opacus: ModuleValidator.validate(model, strict=True)
    # input_norm: the public bound on a sample's norm (64 pixels in [-1, 1]: at most sqrt(64) = 8).
    model, report = cnn.convert(model, input_norm=8.0)
    cnn.validate(model)
    for entry in report.substitutions + report.removed:
        print(f"converted {entry.path or '<root>'}: {entry.original} -> {entry.replacement}")

    # opacus: criterion = nn.CrossEntropyLoss()
    criterion = cnn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    # opacus: privacy_engine = PrivacyEngine(accountant="prv", secure_mode=False)
    privacy_engine = PrivacyEngine(accountant="pld")

    # opacus: model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
    # opacus:     module=model, optimizer=optimizer, data_loader=train_loader,
    # opacus:     criterion=criterion,
    # opacus:     target_epsilon=TARGET_EPSILON, target_delta=TARGET_DELTA, epochs=EPOCHS,
    # opacus:     max_grad_norm=1.0,
    # opacus: )
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        loss=criterion,  # required: its certified Lipschitz constant enters the noise
        target_epsilon=TARGET_EPSILON,
        target_delta=TARGET_DELTA,
        epochs=EPOCHS,
        # operator-norm constraint of every layer (NOT max_grad_norm)
        mechanism=MechanismSpec(max_norm=1.0),
    )
    print(f"noise multiplier: {optimizer.noise_multiplier:.3f}")

    for epoch in range(EPOCHS):
        model.train()
        # opacus: with BatchMemoryManager(data_loader=train_loader,
        # opacus:         max_physical_batch_size=32, optimizer=optimizer) as memory_safe_loader:
        # opacus:     for images, target in memory_safe_loader:
        for images, target in train_loader:  # no per-sample gradients: no memory manager
            optimizer.zero_grad()
            loss = criterion(model(images), target)  # empty Poisson batches give 0
            loss.backward()
            optimizer.step()
        # opacus: epsilon = privacy_engine.accountant.get_epsilon(delta=TARGET_DELTA)
        epsilon = privacy_engine.accountant.get_epsilon(delta=TARGET_DELTA)
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        print(f"epoch {epoch + 1:2d}: test accuracy {accuracy:.3f}, epsilon {epsilon:.2f}")

    # opacus: print(privacy_engine.get_epsilon(TARGET_DELTA))
    print(f"final epsilon: {privacy_engine.get_epsilon(TARGET_DELTA):.3f} at delta={TARGET_DELTA}")
    print(privacy_engine.guarantee(TARGET_DELTA))


if __name__ == "__main__":
    main()
