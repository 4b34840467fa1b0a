"""``clipless federated simulate``: output lines, bad arguments, the subprocess path."""

from __future__ import annotations

import re

import pytest

from clipless.cli import main


def test_simulate_prints_release_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "federated", "simulate", "--owners", "4", "--servers", "3", "--protocol", "shares",
        "--size", "5", "--epsilon", "2", "--spawn", "fork", "--timeout", "20",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("\n") >= 5 + 5
    total = int(re.search(r"^total: (\d+) bytes$", out, re.M).group(1))  # type: ignore[union-attr]
    roles = {m[0]: int(m[1]) for m in re.findall(r"^  (\w+): (\d+) bytes$", out, re.M)}
    assert set(roles) == {"owner", "server", "dealer", "analyst"}
    assert sum(roles.values()) == total
    assert re.search(r"^wall time: [\d.]+ s$", out, re.M)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--servers", "1"], "--servers must be >= 2"),
        (["--protocol", "fss", "--servers", "3"], "exactly 2 servers"),
        (["--epsilon", "0"], "--epsilon must be > 0"),
        (["--noise-key", "abc"], "--noise-key"),
    ],
)
def test_simulate_bad_arguments(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["federated", "simulate", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_simulate_subprocesses_fss(capsys: pytest.CaptureFixture[str]) -> None:
    # the real command path: every party a `python -m clipless.federated.cli` process
    code = main([
        "federated", "simulate", "--owners", "3", "--protocol", "fss", "--size", "4",
        "--epsilon", "1", "--timeout", "60",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^total: \d+ bytes$", out, re.M)
