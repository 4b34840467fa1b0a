"""Device names of the command line resolved to a ``torch.device`` (``--device`` of ``train``,
``audit`` and ``evaluate``), or refused when this machine lacks them."""

from __future__ import annotations

from typing import Any

from clipless._argtypes import DEVICES
from clipless.spec import OptionError

__all__ = ["resolve_device"]


def resolve_device(name: str) -> Any:
    """The ``torch.device`` of a name :func:`clipless._argtypes.device` accepted (``auto``: CUDA,
    else MPS, else the CPU); :class:`~clipless.spec.OptionError` naming ``--device`` when it is
    not available here."""
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise OptionError(
                "--device",
                f"{name} is not available (torch.cuda.is_available() is False: no CUDA GPU or a "
                f"CPU-only torch); accepted: {DEVICES}",
            )
        index = int(name[5:]) if ":" in name else 0
        count = torch.cuda.device_count()
        if index >= count:
            raise OptionError(
                "--device",
                f"{name} is not available ({count} CUDA device(s): cuda:0 to cuda:{count - 1})",
            )
        return torch.device(name)
    if name == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise OptionError(
                "--device",
                f"mps is not available (torch.backends.mps.is_available() is False); "
                f"accepted: {DEVICES}",
            )
    return torch.device(name)
