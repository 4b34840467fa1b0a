"""Per-layer tightness of the certified gradient bounds on real data, for trained models.

For a model saved by ``clipless train`` (``model.pt``), on the first ``--samples`` Fashion-MNIST
test images, with the loss the run used (``CrossEntropyLoss(temperature)``, one sample's loss):

* ``true / bound``: mean over samples of the exact per-sample gradient norm of each weight
  (``torch.func.vmap(grad(...))``) divided by the certified bound of
  :func:`clipless.bounds.report` (``G_k X_{k-1}`` times ``sqrt(k_eff)`` for a convolution);
* ``scaled / G``: the same per-sample gradient divided by the layer's ``sample_norm_factor``
  (the ``per-sample`` scaling that ``clipless train`` uses: ``||x_i||``, or ``sqrt(k_eff)
  ||x_i||`` for a convolution), over the layer's sensitivity ``G_k``. This is the
  gradient-to-noise ratio the Clipless DP-SGD seed (section 3.1) argues GNP networks maximise:
  the noise is calibrated to ``G_k``, the signal is the scaled gradient.

Usage::

    PYTHONPATH=src python benchmarks/model_tightness.py RUN_FOLDER [RUN_FOLDER ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.func import functional_call, grad, vmap

from clipless import bounds
from clipless import nn as cnn
from clipless.cli import load_trained_model
from clipless.data import load_dataset


def tightness(run: Path, samples: int) -> list[dict[str, object]]:
    config = json.loads((run / "metrics.json").read_text())["config"]
    model = load_trained_model(run / "model.pt").double()
    model.eval()
    _, test, _ = load_dataset(config["dataset"])
    x, y = test.tensors
    x, y = x[:samples].double(), y[:samples]
    loss = cnn.CrossEntropyLoss(temperature=float(config["temperature"]), reduction="sum")
    shape = tuple(int(d) for d in x.shape[1:])
    rep = bounds.report(model, loss, shape)

    # the input of every parametric layer, per sample
    inputs: dict[str, torch.Tensor] = {}
    layers = {layer.path: model.get_submodule(layer.path) for layer in rep.layers}
    handles = []
    for path, module in layers.items():

        def keep(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], path: str = path) -> None:
            inputs[path] = args[0].detach()

        handles.append(module.register_forward_pre_hook(keep))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()

    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(model, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    rows: list[dict[str, object]] = []
    for layer in rep.layers:
        module = layers[layer.path]
        assert isinstance(module, cnn.ParametricLipschitzModule)
        factor = module.sample_norm_factor(inputs[layer.path]).double()
        for name, bound in layer.gradient_bounds.items():
            g = per_sample[name].reshape(samples, -1)
            norms = torch.linalg.vector_norm(g, dim=1)
            scaled = norms / factor.clamp_min(1e-300)
            rows.append(
                {
                    "run": run.name,
                    "param": name,
                    "kind": type(module).__name__,
                    "true/bound": float((norms / bound).mean()),
                    "scaled/G": float((scaled / layer.cotangent_bound).mean()),
                    "max scaled/G": float((scaled / layer.cotangent_bound).max()),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--samples", type=int, default=256)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| run | parameter | layer | mean true / bound | mean scaled / G_k | max scaled / G_k |")
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        for r in tightness(run, args.samples):
            print(
                f"| {r['run']} | {r['param']} | {r['kind']} | {r['true/bound']:.3f} | "
                f"{r['scaled/G']:.3f} | {r['max scaled/G']:.3f} |"
            )


if __name__ == "__main__":
    main()
