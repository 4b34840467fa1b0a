"""Every docstring example (``>>>``) in the package runs and prints what it shows.

Found by walking ``src/clipless`` for modules whose source has ``>>>``, so a new example is
checked without being listed here (``clipless.sampling`` and ``clipless.accounting`` also have
their own tests)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src"


def _modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "clipless").rglob("*.py")):
        if ">>>" not in path.read_text():
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def test_the_walk_finds_the_known_examples() -> None:
    found = set(_modules())
    assert {"clipless.sampling", "clipless.models", "clipless.stats.ecdf"} <= found


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
