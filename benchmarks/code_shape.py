"""Issue 36's measures of a source tree's shape: ``python benchmarks/code_shape.py src/clipless``.

Functions over 50 / 100 code lines (non-blank, non-comment, docstring left out:
:func:`function_lengths.code_lines`) and the longest, functions with >= 10 parameters (``self``
/ ``cls`` not counted), ``raise`` messages over 200 characters (string literals, f-strings and
concatenations; placeholders count as one character), module docstrings of 40+ lines, and
docstrings with an ``Args:`` section.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from function_lengths import code_lines


def _message(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
    if isinstance(node, ast.BinOp):
        return "".join(_message(v) for v in (node.left, node.right))
    return ""


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    count += (a.vararg is not None) + (a.kwarg is not None)
    return count - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def measure(root: Path) -> dict[str, object]:
    lengths: list[tuple[int, str]] = []
    many = long_messages = long_docs = args_sections = 0
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        doc = ast.get_docstring(tree, clean=False)
        long_docs += bool(doc and len(doc.splitlines()) >= 40)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths.append((code_lines(source, node), f"{path.name}:{node.name}"))
                many += _parameters(node) >= 10
                text = ast.get_docstring(node) or ""
                args_sections += bool(re.search(r"^\s*Args:\s*$", text, re.M))
            elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                long_messages += len(_message(node.exc.args[0])) > 200
    lengths.sort(reverse=True)
    return {
        "functions > 50 / > 100": f"{sum(n > 50 for n, _ in lengths)} / "
        f"{sum(n > 100 for n, _ in lengths)}",
        "longest function": f"{lengths[0][0]} ({lengths[0][1]})",
        "functions with >= 10 parameters": many,
        "error messages over 200 characters": long_messages,
        "module docstrings of 40+ lines": long_docs,
        "documented parameter sections": args_sections,
    }


def main(argv: list[str]) -> None:
    for key, value in measure(Path(argv[0] if argv else "src/clipless")).items():
        print(f"| {key} | {value} |")


if __name__ == "__main__":
    main(sys.argv[1:])
