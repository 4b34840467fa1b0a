"""Fixtures shared by the test modules of this folder.

``CLIPLESS_TEST_ACCELERATOR_PATH=1`` runs the tests with the certificates and projections an
accelerator runs (:data:`clipless.norms.ACCELERATOR_PATH_ON_CPU`: matrix products only, one host
read per projection), so that the CPU-only CI also checks the path a GPU takes (``make test``
re-runs the certification, projection and contract tests this way).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from _simdevice import SimDeviceUnavailableError, simulated_device
from clipless import norms


@pytest.fixture(autouse=True)
def _accelerator_path() -> Iterator[None]:
    forced = os.environ.get("CLIPLESS_TEST_ACCELERATOR_PATH") == "1"
    previous = norms.ACCELERATOR_PATH_ON_CPU
    norms.ACCELERATOR_PATH_ON_CPU = forced or previous
    try:
        yield
    finally:
        norms.ACCELERATOR_PATH_ON_CPU = previous


@pytest.fixture
def simgpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """The simulated accelerator of ``tests/_simdevice.py`` (``simgpu:0``: CPU kernels, CUDA's
    device rules), active for the test; skipped where the installed torch cannot register it.
    Its function mode (the simulation itself, not a user's) is exempt from the optimizer's
    refusal of Python modes around training (:mod:`clipless._modes`)."""
    from _simdevice import _DeviceMode
    from clipless import _modes

    monkeypatch.setattr(
        _modes, "EXEMPT_FUNCTION_MODES", (*_modes.EXEMPT_FUNCTION_MODES, _DeviceMode)
    )
    try:
        with simulated_device() as device:
            yield device
    except SimDeviceUnavailableError as exc:
        pytest.skip(f"no simulated device: {exc}")
