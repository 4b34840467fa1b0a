"""The model file ``clipless train`` writes (``model.pt``): its format names and its reader.

Apart from :mod:`clipless.cli` and :mod:`clipless.pipeline` so that the training pipeline, the
command line and ``clipless evaluate`` read it without importing one another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["MODEL_FORMAT", "load_trained_model", "whiten_placeholder"]

MODEL_FORMAT = "clipless-model-v2"  # v2: the architecture names its kind (mlp / cnn)
MODEL_FORMAT_V1 = "clipless-mlp-v1"  # an MLP; still read


def whiten_placeholder(input_shape: Any) -> Any:
    """A ``C x C`` zero matrix for the model's whitening buffer (filled by a state dict)."""
    import torch

    channels = int(next(iter(input_shape)))
    return torch.zeros(channels, channels, dtype=torch.float64)


def load_trained_model(path: str | Path) -> Any:
    """Rebuild the model saved by ``clipless train`` (``model.pt``) with its trained weights.

    Reads both formats: ``clipless-model-v2`` (an MLP or a ConvNet, named by
    ``architecture["kind"]``) and the older ``clipless-mlp-v1`` (an MLP). The model is on the CPU.
    """
    import torch

    from clipless import models

    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (MODEL_FORMAT, MODEL_FORMAT_V1):
        raise ValueError(f"{path} is not a model saved by `clipless train`")
    arch = state["architecture"]
    # placeholders of the right shapes: load_state_dict fills in the released mean and mixing
    center = torch.zeros(arch["input_shape"]) if arch.get("center_noise") else None
    whiten = whiten_placeholder(arch["input_shape"]) if arch.get("whiten_noise") else None
    model = models.build(models.Architecture.from_dict(arch), center=center, whiten=whiten)
    model.load_state_dict(state["state_dict"])
    features = str(arch.get("features", "none"))
    if features != "none":  # the public front-end first: the returned model takes raw images
        from clipless.features import build_features

        front = build_features(features, arch["image_shape"])
        assert front is not None
        return torch.nn.Sequential(front, model).eval()
    return model
