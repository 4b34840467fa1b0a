"""clipless.bounds: the one-way layering of the certified modules.

Backpropagation for bounds itself (:func:`clipless.bounds.report`, :func:`sensitivities`) is
tested in ``test_sensitivities.py``; the certified norms in ``test_norms.py``.
"""

from __future__ import annotations

import ast
import math
import pathlib
import subprocess
import sys

import pytest

from clipless import bounds

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "clipless"


def _imported_modules(path: pathlib.Path, *, typing_only: bool = True) -> set[str]:
    """Every ``clipless`` module a file imports, at any level (module top or inside functions);
    ``typing_only=False`` leaves out the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(n)
        for block in ast.walk(tree)
        if not typing_only
        and isinstance(block, ast.If)
        and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for n in ast.walk(block)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clipless"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("clipless"))
    return found


def test_layering_is_one_way() -> None:
    """``_certified`` -> ``norms`` -> ``nn`` -> ``bounds``: nothing below imports what is above."""
    below_nn = {"clipless.nn", "clipless.bounds", "clipless.constraints"}
    norms_files = sorted(str(p.relative_to(SRC)) for p in (SRC / "norms").glob("*.py"))
    assert norms_files, "the clipless.norms package has no modules"
    for name, forbidden in (
        ("_certified.py", {"clipless.norms", *below_nn}),
        ("_workspace.py", {"clipless"}),  # torch only: norms, constraints and optim use it
        ("_autograd.py", {"clipless"}),  # torch only: nn's kernels and the optimizer use it
        ("_deferred.py", {"clipless"}),  # torch only: the losses and the guard use it
        ("_validate.py", {"clipless"}),  # standard library only: every layer validates with it
        *((path, below_nn) for path in norms_files),
    ):
        imported = _imported_modules(SRC / name)
        assert not {m for m in imported if any(m.startswith(f) for f in forbidden)}, name
    above_nn = (
        "clipless.bounds",
        "clipless.constraints",
        "clipless.mechanism",
        "clipless.optim",
        "clipless.engine",
        "clipless.training",
        "clipless.cli",
    )
    for path in sorted((SRC / "nn").glob("*.py")):
        imported = _imported_modules(path)
        assert not {m for m in imported if m.startswith(above_nn)}, path.name
    for name in ("_errors.py", "_hooks.py"):  # below nn: torch and each other only
        imported = _imported_modules(SRC / name)
        assert imported <= {"clipless._errors", "clipless._errors.PrivacyContractError"}, name


def test_the_norms_modules_import_one_way() -> None:
    """Inside ``clipless.norms``: certificates <- iterations <- dense <- convolution."""
    order = ("certificates", "iterations", "dense", "convolution")
    for rank, name in enumerate(order):
        imported = _imported_modules(SRC / "norms" / f"{name}.py")
        inside = {m.split(".")[2] for m in imported if m.startswith("clipless.norms.")}
        assert inside <= set(order[:rank]), (name, inside)


def test_certified_and_norms_import_alone() -> None:
    """``clipless.norms`` loads without ``clipless.nn`` (and ``_certified`` without torch)."""
    code = (
        "import sys; import clipless._certified; assert 'torch' not in sys.modules; "
        "import clipless.norms; "
        "assert not any(m.startswith(('clipless.nn', 'clipless.bounds')) for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_conv_reused_at_two_input_sizes_is_refused() -> None:
    """Audit finding: one Conv2d applied to a 5x5 and then a 3x3 input was certified for 3x3 at
    both uses (a conv's norm depends on the input size): the layer below got a per-sample
    contribution of 19 against a planned sensitivity of 9."""
    import torch

    import clipless.nn as cnn

    conv = cnn.Conv2d(1, 1, 3, bias=False)
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Conv2d(1, 1, 1, bias=False), conv, conv)
    with pytest.raises(ValueError, match=r"Conv2d '3' is applied to inputs of 2 shapes"):
        bounds.report(model, cnn.CrossEntropyLoss(), (1, 5, 5))
    tied = cnn.Conv2d(1, 1, 3, bias=False)
    tied.weight = conv.weight  # one Conv2d per size, sharing the weight: accepted
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Conv2d(1, 1, 1, bias=False), conv, tied)
    report = bounds.report(model, cnn.CrossEntropyLoss(), (1, 5, 5))
    assert len(report.layers) == 3
    assert torch.equal(tied.weight, conv.weight)


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle() -> None:
    """The modules of ``clipless`` import one another without a cycle, function-level imports
    included (a package's ``__init__`` re-exporting its own submodules is not an edge)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in files:
                return ".".join(parts[:k])
        return None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = {resolve(n) for n in _imported_modules(path, typing_only=False)}
        graph[module] = {t for t in targets if t and t != module and not t.startswith(module + ".")}
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in done:
            return
        if module in visiting:
            cycle = [*visiting[visiting.index(module) :], module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        visiting.append(module)
        for target in sorted(graph[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_a_report_without_output_bounds_has_the_same_cotangent_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``output_bounds=False`` (the private step's plan under per-sample scaling) leaves the
    cotangent bounds, hence the sensitivities, as they are, and reads no bias norm."""
    import torch

    from clipless import nn as cnn

    torch.manual_seed(0)
    model = cnn.Sequential(
        cnn.InputNorm(2.0),
        cnn.Linear(6, 5),
        cnn.GroupSort(1),
        cnn.Linear(5, 4, bias=True),
        cnn.Sigmoid(),
        cnn.Linear(4, 3),
    )
    loss = cnn.CrossEntropyLoss()
    full = bounds.report(model, loss, (6,))
    reads = []
    original = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(t.shape) or original(t))
    partial = bounds.report(model, loss, (6,), output_bounds=False)
    assert reads == []
    assert [lb.cotangent_bound for lb in partial.layers] == [
        lb.cotangent_bound for lb in full.layers
    ]
    assert [lb.lipschitz for lb in partial.layers] == [lb.lipschitz for lb in full.layers]
    assert partial.layers[0].input_bound == full.layers[0].input_bound == 2.0
    assert all(lb.input_bound == float("inf") for lb in partial.layers[1:])
    assert all(math.isfinite(lb.input_bound) for lb in full.layers)
    assert partial.model_lipschitz == full.model_lipschitz
