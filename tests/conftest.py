"""Fixtures shared by the test modules of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from _simdevice import SimDeviceUnavailableError, simulated_device


@pytest.fixture
def simgpu() -> Iterator[torch.device]:
    """The simulated accelerator of ``tests/_simdevice.py`` (``simgpu:0``: CPU kernels, CUDA's
    device rules), active for the test; skipped where the installed torch cannot register it."""
    try:
        with simulated_device() as device:
            yield device
    except SimDeviceUnavailableError as exc:
        pytest.skip(f"no simulated device: {exc}")
