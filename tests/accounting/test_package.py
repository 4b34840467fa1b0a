"""clipless.accounting as a package: framework-free, doctests, the public names."""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import subprocess
import sys

from clipless import accounting


# ------------------------------------------------------------------------------ framework-free
def test_accounting_does_not_import_torch() -> None:
    code = (
        "import sys; import clipless.accounting as a; "
        "a.epsilon(1.0, 0.5, 2, 1e-5, 'rdp'); "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    env = dict(os.environ)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_doctests() -> None:
    attempted = failed = 0
    for info in pkgutil.iter_modules(accounting.__path__, prefix="clipless.accounting."):
        module = importlib.import_module(info.name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        attempted, failed = attempted + result.attempted, failed + result.failed
    assert attempted >= 4
    assert failed == 0


def test_public_names_are_reexported() -> None:
    """Every public name of every submodule is importable from the package, and listed there."""
    exported = set(accounting.__all__)
    for info in pkgutil.iter_modules(accounting.__path__, prefix="clipless.accounting."):
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", []):
            assert name in exported, (info.name, name)
            assert getattr(accounting, name) is getattr(module, name)
    assert {"AccountantKind", "Neighbouring", "ACCOUNTANTS", "DEFAULT_RDP_ORDERS"} <= exported
    assert all(hasattr(accounting, name) for name in exported)
