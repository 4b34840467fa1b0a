"""The fixed costs of a ``clipless train`` run on Fashion-MNIST's scattering features.

``python benchmarks/run_overhead.py`` (one thread; needs the Fashion-MNIST files, ``make data``)
times, on the real 60,000 x 81 x 7 x 7 training features, what a run does besides its steps
(``benchmarks/RESULTS.md`` section 21):

* the features: computed (``apply_features``, timed on the first 4,096 images and scaled to
  70,000) against loaded from the cache (``cached_features``; hashing the images included);
* the dataset check of ``make_private``: ``torch.isfinite(x).all()`` against one ``aminmax``
  pass (``clipless.norms.all_finite``);
* the two releases (``release_mean``, ``release_channel_moment``) and the one-off mapping of the
  training features by the released centring and whitening (``InputNorm.premap_``), against one
  epoch of mapping every batch inside ``InputNorm`` (29 batches of 2,048);
* one epsilon evaluation (PLD, the CLI's defaults: sigma 1.3989, q = 2048 / 60000, 870 steps, two
  releases), the first at a given (sigma, q) against the later ones at other step counts (the
  budget lookahead and the per-epoch epsilon), and dp_accounting's own ``PLDAccountant``.

The feature cache goes to a temporary folder, removed at the end.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import dp_accounting
import torch
from dp_accounting.pld import PLDAccountant
from torch.utils.data import TensorDataset

from clipless import nn
from clipless.accounting import epsilon
from clipless.data import load_dataset
from clipless.features import (
    Scattering2d,
    apply_features,
    cached_features,
    release_channel_moment,
    release_mean,
    whitening,
)
from clipless.norms import all_finite


def timed(label: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = fn()
    print(f"| {label} | {time.perf_counter() - start:.2f} s |", flush=True)
    return out


def main() -> None:
    torch.set_num_threads(1)
    train, _, _ = load_dataset("fashion-mnist")
    phi = Scattering2d((1, 28, 28))
    print("| part | time |\n|---|---|")
    head = TensorDataset(train.tensors[0][:4096], train.tensors[1][:4096])
    start = time.perf_counter()
    apply_features(phi, head)
    per_image = (time.perf_counter() - start) / 4096
    print(
        f"| scattering features of 70,000 images, computed (scaled from 4,096) | "
        f"{per_image * 70000:.1f} s |"
    )
    with tempfile.TemporaryDirectory() as cache:
        feats, _, _ = cached_features(phi, train, cache)
        timed(
            "the 60,000 training features, loaded from the cache (hash included)",
            lambda: cached_features(phi, train, cache),
        )
    x = feats.tensors[0]
    timed(
        "finiteness of the features, torch.isfinite(x).all()", lambda: bool(torch.isfinite(x).all())
    )
    timed("finiteness of the features, one aminmax (norms.all_finite)", lambda: all_finite(x))
    gen = torch.Generator().manual_seed(0)
    mu = timed("release_mean", lambda: release_mean(x, 20.0, generator=gen))
    moment = timed("release_channel_moment", lambda: release_channel_moment(x, 20.0, generator=gen))
    w = whitening(moment, mu, noise_multiplier=20.0, num_samples=len(x))
    layer = nn.InputNorm(2.0, "sphere", center=mu, center_noise=20.0, whiten=w, whiten_noise=20.0)
    batches = [x[i : i + 2048] for i in range(0, 29 * 2048, 2048)]
    timed("InputNorm on every batch of one epoch (29 x 2,048)", lambda: [layer(b) for b in batches])
    timed("InputNorm.premap_ of the 60,000 features, once", lambda: layer.premap_(x.clone()))
    sigma, q, steps = 1.3989, 2048 / 60000, 870
    timed(
        "epsilon, first evaluation at (sigma, q)",
        lambda: epsilon(sigma, q, steps, 1e-5, releases=(20.0, 20.0)),
    )
    timed(
        "epsilon, same (sigma, q), another step count",
        lambda: epsilon(sigma, q, steps - 29, 1e-5, releases=(20.0, 20.0)),
    )

    def reference() -> float:
        acc = PLDAccountant()
        acc.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
                steps - 58,
            )
        )
        acc.compose(dp_accounting.GaussianDpEvent(20.0))
        acc.compose(dp_accounting.GaussianDpEvent(20.0))
        return float(acc.get_epsilon(1e-5))

    timed("epsilon, dp_accounting's PLDAccountant (every evaluation)", reference)


if __name__ == "__main__":
    main()
