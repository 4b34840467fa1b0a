"""Opacus's MNIST model (examples/mnist.py), converted: certified constants and the step's cost.

Prints, for the converted ``SampleConvNet`` at its initial weights: the certified Lipschitz
constant of the model and of each overlapping max pool, against the spectral norm of the explicit
Jacobian at a few inputs; then the time of a private step (batch 64, one thread) and the share of
it spent certifying the convolutions' operator norms. Synthetic 28 x 28 inputs (the cost does not
depend on the pixel values). About a minute on one CPU core:

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/opacus_mnist_port.py
"""

from __future__ import annotations

import cProfile
import math
import pstats
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import clipless.nn as cnn
from clipless import PrivacyEngine, bounds


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


def _jacobian_norm(model: nn.Module, x: torch.Tensor) -> float:
    jac = torch.autograd.functional.jacobian(lambda v: model(v[None])[0], x)
    return float(torch.linalg.matrix_norm(jac.reshape(-1, x.numel()), ord=2))


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x0 = math.sqrt(784) * (1 - 0.1307) / 0.3081
    model, report = cnn.convert(SampleConvNet().double(), input_norm=x0)
    rep = bounds.report(model, cnn.CrossEntropyLoss(), (1, 28, 28))
    x = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    x = x * (x0 / 2 / x.flatten(1).norm(dim=1)).reshape(-1, 1, 1, 1)
    exact = max(_jacobian_norm(model, xi) for xi in x)
    pools = [m for m in model.modules() if isinstance(m, cnn.MaxPool2d)]
    print(f"exact conversion: {report.exact}; max pools certified {[p.lipschitz() for p in pools]}")
    print(f"model: certified Lipschitz {rep.model_lipschitz:.4g}, Jacobian norm {exact:.4g}")
    pool = pools[0]
    worst = 0.0
    for i in range(13):
        v = torch.rand(16, 14, 14, dtype=torch.float64)
        v[:, i, i] = 10.0
        worst = max(worst, _jacobian_norm(pool, v[:1]))
    print(f"max_pool2d(x, 2, 1): certified {pool.lipschitz()}, Jacobian norm reached {worst:.6g}")

    model, _ = cnn.convert(SampleConvNet(), input_norm=x0)
    data = TensorDataset(torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,)))
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=64),
        criterion=cnn.CrossEntropyLoss(),
        noise_multiplier=1.0,
    )

    def steps() -> int:
        count = 0
        for xb, yb in loader:
            optimizer.zero_grad()
            optimizer.loss(model(xb), yb).backward()
            optimizer.step()
            count += 1
        return count

    started = time.perf_counter()
    count = steps()
    elapsed = time.perf_counter() - started
    profile = cProfile.Profile()
    profile.runcall(steps)
    stats = pstats.Stats(profile)
    total = sum(row[3] for key, row in stats.stats.items() if key[2] == "step")
    norm = sum(row[3] for key, row in stats.stats.items() if key[2] == "conv_norm")
    print(f"private step (batch 64, 1 thread): {elapsed / count:.3f} s over {count} steps")
    print(f"share of optimizer.step in clipless.norms.conv_norm (profiled): {norm / total:.0%}")


if __name__ == "__main__":
    main()
