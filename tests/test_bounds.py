"""clipless.bounds: backward-compatible re-exports of the norms, and the one-way layering.

Backpropagation for bounds itself (:func:`clipless.bounds.report`, :func:`sensitivities`) is
tested in ``test_sensitivities.py``; the certified norms in ``test_norms.py``.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from clipless import bounds, norms

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "clipless"


@pytest.mark.parametrize("name", norms.__all__)
def test_norms_are_reexported(name: str) -> None:
    assert name in bounds.__all__
    assert getattr(bounds, name) is getattr(norms, name)


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every ``clipless`` module a file imports, at any level (module top or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clipless"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("clipless"))
    return found


def test_layering_is_one_way() -> None:
    """``_certified`` -> ``norms`` -> ``nn`` -> ``bounds``: nothing below imports what is above."""
    below_nn = {"clipless.nn", "clipless.bounds", "clipless.constraints"}
    for name, forbidden in (
        ("_certified.py", {"clipless.norms", *below_nn}),
        ("norms.py", below_nn),
    ):
        imported = _imported_modules(SRC / name)
        assert not {m for m in imported if any(m.startswith(f) for f in forbidden)}, name
    for path in sorted((SRC / "nn").glob("*.py")):
        imported = _imported_modules(path)
        assert not {m for m in imported if m.startswith("clipless.bounds")}, path.name


def test_certified_and_norms_import_alone() -> None:
    """``clipless.norms`` loads without ``clipless.nn`` (and ``_certified`` without torch)."""
    code = (
        "import sys; import clipless._certified; assert 'torch' not in sys.modules; "
        "import clipless.norms; "
        "assert not any(m.startswith(('clipless.nn', 'clipless.bounds')) for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
