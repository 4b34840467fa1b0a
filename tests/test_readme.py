"""The README's quick start runs as written and spends at most its target epsilon."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run() -> None:
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, "README has no python block"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(README), "exec"), {})
        for block in blocks[1:]:
            exec(compile(block, str(README), "exec"), {})
    printed = out.getvalue()
    quartiles = [float(v) for v in re.search(r"DP quartiles: \[(.*?)\]", printed).group(1).split()]
    assert quartiles == sorted(quartiles) and 30 < quartiles[1] < 60
    assert 0.75 < float(re.search(r"DP AUC: ([0-9.]+)", printed).group(1)) < 0.95
    epsilon = float(re.search(r"epsilon = ([0-9.]+)", printed).group(1))
    accuracy = float(re.search(r"test accuracy = ([0-9.]+)", printed).group(1))
    assert 0.9 < epsilon <= 1.0
    assert 0.0 <= accuracy <= 1.0
