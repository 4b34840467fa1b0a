"""The longest functions of some modules, in code lines (non-blank, non-comment lines of the
``def``, its docstring left out): ``python benchmarks/function_lengths.py FILE.py ...``."""

from __future__ import annotations

import ast
import sys


def code_lines(source: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = source.splitlines()
    skip: set[int] = set()
    first = node.body[0] if node.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        skip = set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    end = node.end_lineno or node.lineno
    return sum(
        1
        for number in range(node.lineno, end + 1)
        if number not in skip and lines[number - 1].strip()
        if not lines[number - 1].strip().startswith("#")
    )


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                rows.append((code_lines(source, node), f"{path}:{node.lineno} {node.name}"))
    rows.sort(reverse=True)
    for count, name in rows[:10]:
        print(f"{count:5d}  {name}")
    over = {n: sum(c > n for c, _ in rows) for n in (50, 60, 100)}
    print(
        f"functions: {len(rows)}; over 50: {over[50]}, over 60: {over[60]}, over 100: {over[100]}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
