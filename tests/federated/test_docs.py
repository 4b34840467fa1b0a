"""docs/federated.md's Python example runs as written (and its assertion holds)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "federated.md"


def test_federated_doc_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})


def test_the_several_machines_commands_run_as_written(tmp_path: Path) -> None:
    """The bash block of "Running on several machines", on one machine: its commands with the
    example hosts replaced by free local ports and ``run1`` by a temporary folder; the secret
    paths are the ones ``init`` writes. Owners 0 and 1 run owner 2's command with their index
    and one value each, as the block's comment says."""
    import shlex
    import socket
    import subprocess
    import sys

    text = DOC.read_text().split("## Running on several machines", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    assert block is not None
    lines = re.sub(r"\\\n\s*", " ", block.group(1)).splitlines()
    commands = [shlex.split(line) for line in lines if line.startswith("clipless federated")]
    assert [c[2] for c in commands] == ["init", "serve", "dealer", "owner", "analyst"]
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])

    def local(argv: list[str]) -> list[str]:
        out = []
        for arg in argv:
            for j, port in enumerate(ports):
                arg = arg.replace(f"srv{j}.example.org:7000", f"127.0.0.1:{port}")
            arg = arg.replace("run1", str(tmp_path / "run1")).replace("0.0.0.0", "127.0.0.1")
            out.append(arg)
        return [sys.executable, "-m", "clipless.federated.cli", *out[2:]]

    init, serve, dealer, owner, analyst = (local(c) for c in commands)
    subprocess.run(init, check=True, capture_output=True, timeout=60)
    procs = []
    try:
        for j in range(2):
            argv = [a.replace("server-0", f"server-{j}") for a in serve]
            argv[argv.index("--index") + 1] = str(j)
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE))
        procs.append(subprocess.Popen(dealer, stdout=subprocess.PIPE))
        for i, values in ((0, "0.1"), (1, "0.5"), (2, None)):
            argv = [a.replace("owner-2", f"owner-{i}") for a in owner]
            argv[argv.index("--index") + 1] = str(i)
            if values is not None:
                argv[argv.index("--values") + 1] = values
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE))
        done = subprocess.run(analyst, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        table = done.stdout.splitlines()
        assert table[0] == "threshold  F" and len(table) == 1 + 64
        for proc in procs:
            assert proc.wait(60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
