"""One training step of a linear model on wide inputs: clipless against the same model unwrapped.

``python benchmarks/wide_input_step.py 2048 3969`` (batch, features: the scattering features of
Fashion-MNIST are 81 x 7 x 7 = 3,969 wide). Both models start with ``InputNorm`` (sphere, radius
1) and end with ``LossGradientClip(0.1)``; the clipless one is made private with a fixed noise
multiplier. Prints the median step time of 7 steps after 2 warm-up steps, and the ratio. Used in
``benchmarks/RESULTS.md`` section 14 to measure the certified per-sample norms in float32.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import clipless
from clipless import models, nn
from clipless.engine import MechanismSpec


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch, width = (int(v) for v in sys.argv[1:3]) if len(sys.argv) > 2 else (2048, 3969)
    x = torch.randn(batch * 4, width)
    y = torch.randint(0, 10, (batch * 4,))

    def make(private: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module]:
        model: torch.nn.Module = models.linear((width,), 10, input_norm=1.0, bias=False)
        model.append(nn.LossGradientClip(0.1))
        loss = nn.CrossEntropyLoss(temperature=0.1)
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        if private:
            engine = clipless.PrivacyEngine(accountant="rdp", seed=0)
            model, opt, _ = engine.make_private(
                module=model,
                optimizer=opt,
                data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
                loss=loss,
                noise_multiplier=1.0,
                epochs=5,
                mechanism=MechanismSpec(constraint=None),
            )
            opt.data_loader = None  # every step trains on the same batch (timing only)
        return model, opt, loss

    times = {}
    for name in ("nonprivate", "clipless"):
        model, opt, loss = make(name == "clipless")

        samples = []
        for i in range(9):
            start = time.perf_counter()
            opt.zero_grad()
            loss(model(x[:batch]), y[:batch]).backward()
            opt.step()
            if i >= 2:  # two warm-up steps
                samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples) * 1e3
    ratio = times["clipless"] / times["nonprivate"]
    print(f"batch {batch} width {width}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items()))
    print(f"ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
