"""The Tramèr-Boneh end-to-end CNN for 28 x 28 grey images, trained by Opacus DP-SGD.

The architecture and the Fashion-MNIST setting are those of Tramèr & Boneh, "Differentially
Private Learning Needs Better Features (or Much More Data)", ICLR 2021 (code:
github.com/ftramer/Handcrafted-DP, ``models.MNIST_CNN`` and the README's end-to-end command
``cnns.py --dataset=fmnist --batch_size=2048 --lr=4 --noise_multiplier=2.15``, whose noise spends
epsilon 3 at delta 1e-5 in 40 epochs; the CNN of Papernot et al., "Tempered Sigmoid Activations
for Deep Learning with Differential Privacy", AAAI 2021):

* conv 16 filters 8x8, stride 2, padding 2, tanh, max-pool 2x2 stride 1;
* conv 32 filters 4x4, stride 2, tanh, max-pool 2x2 stride 1;
* linear 512 -> 32, tanh, linear 32 -> 10 (26,010 parameters);
* inputs: pixels / 255 (``transforms.ToTensor()``, no other normalisation), so the model reads
  pixel space [0, 1] as it is and attack radii are in pixels;
* DP-SGD: SGD lr 4, momentum 0.9, per-sample clip 0.1, plain cross-entropy (mean), batch 2048,
  40 epochs.

Here Opacus samples batches by Poisson sampling (the paper shuffled fixed batches) and calibrates
the noise multiplier with its PRV accountant to the target (epsilon, delta), as
:func:`benchmarks.fashion_mnist.train_opacus` does; the paper's 2.15 came from an RDP accountant.
:mod:`benchmarks.robust_twins` (``--pair tb``) trains it and measures it beside clipless.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# the paper's Fashion-MNIST end-to-end setting (Handcrafted-DP README; cnns.py's defaults for
# momentum and clip)
TB_SETTING: dict[str, Any] = {
    "lr": 4.0,
    "momentum": 0.9,
    "max_grad_norm": 0.1,
    "batch": 2048,
    "epochs": 40,
}
PUBLISHED_NOISE = 2.15  # the README's noise multiplier for 40 epochs (RDP accountant)


def tramer_boneh_cnn(num_classes: int = 10) -> nn.Sequential:
    """The end-to-end CNN of ``Handcrafted-DP``'s ``MNIST_CNN`` for ``1 x 28 x 28`` inputs."""
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=8, stride=2, padding=2),  # 28 -> 13
        nn.Tanh(),
        nn.MaxPool2d(kernel_size=2, stride=1),  # 13 -> 12
        nn.Conv2d(16, 32, kernel_size=4, stride=2),  # 12 -> 5
        nn.Tanh(),
        nn.MaxPool2d(kernel_size=2, stride=1),  # 5 -> 4
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.Tanh(),
        nn.Linear(32, num_classes),
    )


def train_tb(
    train: TensorDataset,
    epsilon: float,
    delta: float,
    seed: int,
    epochs: int = TB_SETTING["epochs"],
    batch: int = TB_SETTING["batch"],
    lr: float = TB_SETTING["lr"],
    momentum: float = TB_SETTING["momentum"],
    max_grad_norm: float = TB_SETTING["max_grad_norm"],
) -> tuple[nn.Module, dict[str, Any]]:
    """The Tramèr-Boneh CNN trained by Opacus DP-SGD at ``(epsilon, delta)``: Poisson sampling at
    sample rate ``1 / ceil(n / batch)``, ghost clipping (the same clipped sum as per-sample
    hooks), the noise multiplier from Opacus's PRV accountant. Returns the plain trained module
    and the run's privacy record."""
    from opacus import PrivacyEngine as OpacusEngine

    torch.manual_seed(seed)
    model = tramer_boneh_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    engine = OpacusEngine(accountant="prv")
    private, opt, criterion, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(train, batch_size=batch),
        criterion=nn.CrossEntropyLoss(),
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        poisson_sampling=True,
        grad_sample_mode="ghost",
    )
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            criterion(private(x), y).backward()
            opt.step()
    info = {
        "epsilon": engine.get_epsilon(delta),
        "noise_multiplier": opt.noise_multiplier,
        "sample_rate": loader.sample_rate,
        "steps": len(loader) * epochs,
        "setting": {**TB_SETTING, "epochs": epochs, "batch": batch, "lr": lr},
    }
    return private.to_standard_module(), info
