"""``clipless federated simulate``: output lines, bad arguments, the subprocess path."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

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


def test_simulate_roc_prints_auc(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "federated", "simulate", "--owners", "6", "--protocol", "fss", "--size", "5",
        "--epsilon", "2", "--spawn", "fork", "--timeout", "20", "--statistic", "roc",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "threshold  FPR     TPR" in out
    assert re.search(r"^AUC: -?[\d.]+$", out, re.M)
    assert re.search(r"^total: \d+ bytes$", out, re.M)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--servers", "1"], "argument --servers: expected an integer >= 2"),
        (["--protocol", "fss", "--servers", "3"], "exactly 2 servers"),
        (["--epsilon", "0"], "argument --epsilon: expected a finite number > 0"),
        (["--noise-key", "abc"], "--noise-key"),
        # audit findings: tracebacks before
        (["--epsilon", "inf"], "argument --epsilon"),
        (["--timeout", "nan"], "argument --timeout"),
        # an OverflowError traceback (timestamp out of range for platform time_t) before
        (
            ["--owners", "2", "--spawn", "fork", "--timeout", "1e12"],
            "argument --timeout: expected a number of seconds > 0 and <= 2592000 (30 days)",
        ),
        (["--data-seed", "-1"], "argument --data-seed"),
        (["--protocol", "fss", "--neighbouring", "add_remove"], "needs neighbouring='replace_one'"),
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


def test_init_writes_private_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import stat

    out = tmp_path / "run"
    code = main([
        "federated", "init", "--out", str(out), "--owners", "2", "--size", "4",
        "--epsilon", "1", "--server-at", "10.0.0.1:7000", "--server-at", "10.0.0.2:7000",
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    session = json.loads((out / "session.json").read_text())
    assert session["servers_at"] == [["10.0.0.1", 7000], ["10.0.0.2", 7000]]
    assert session["format"] == "clipless-federated-session/2"
    assert session["ca"].startswith("-----BEGIN CERTIFICATE-----")
    names = sorted(p.name for p in (out / "secrets").iterdir())
    assert names == [
        "analyst-0.json", "dealer-0.json", "owner-0.json", "owner-1.json",
        "server-0.json", "server-1.json",
    ]  # fmt: skip
    owner = json.loads((out / "secrets" / "owner-0.json").read_text())
    assert set(owner["links"]) == {"server 0", "server 1"}  # only its own links
    server = json.loads((out / "secrets" / "server-1.json").read_text())
    assert server["links"]["owner 0"] == owner["links"]["server 1"]
    mode = (out / "secrets" / "owner-0.json").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert main(["federated", "init", "--out", str(tmp_path / "x"), "--owners", "2", "--size",
                 "4", "--epsilon", "1", "--server-at", "nohost"]) == 2  # fmt: skip
    assert "HOST:PORT" in capsys.readouterr().err
    # a port above 65535 was wrapped modulo 65536 (99999 reached a listener on 34463)
    assert main(["federated", "init", "--out", str(tmp_path / "y"), "--owners", "2", "--size",
                 "4", "--epsilon", "1", "--server-at", "127.0.0.1:99999",
                 "--server-at", "127.0.0.1:7001"]) == 2  # fmt: skip
    assert "port 1-65535" in capsys.readouterr().err
    assert main(["federated", "init", "--out", str(tmp_path / "z"), "--owners", "2", "--size",
                 "4", "--epsilon", "-1", "--server-at", "127.0.0.1:7000",
                 "--server-at", "127.0.0.1:7001"]) == 2  # fmt: skip
    assert "argument --epsilon: expected a finite number > 0" in capsys.readouterr().err


def _init(out: Path, *extra: str) -> int:
    return main([
        "federated", "init", "--out", str(out), "--owners", "2", "--size", "4", "--epsilon", "1",
        "--server-at", "127.0.0.1:7001", "--server-at", "127.0.0.1:7002", *extra,
    ])  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "{run}/session.json", "--secret", "{run}/secrets/server-0.json", "--index",
          "0", "--port", "70000"], "argument --port: expected an integer [0, 65535]"),
        (["serve", "{tmp}/bad.json", "--secret", "{run}/secrets/server-0.json", "--index", "0"],
         "is not a JSON file"),
        (["serve", "{run}/session.json", "--secret", "{run}/secrets/owner-0.json", "--index",
          "0"], "is not a server's secret"),
        (["serve", "{run}/session.json", "--secret", "{run}/secrets/server-0.json", "--index",
          "5"], "--index 5: this session has servers 0..1"),
        (["owner", "{run}/session.json", "--secret", "{run}/secrets/owner-0.json", "--index",
          "7", "--values", "0.5"], "--index 7: this session has owners 0..1"),
        (["owner", "{run}/session.json", "--secret", "{run}/secrets/server-0.json", "--index",
          "0", "--values", "0.5"], "a server's secret?"),
        (["owner", "{run}/session.json", "--secret", "{run}/secrets/owner-0.json", "--index",
          "0", "--values", "nan"], "values must be finite"),
        (["owner", "{run}/session.json", "--secret", "{run}/secrets/owner-0.json", "--index",
          "0", "--values", "0.5", "--labels", "1"], "labels are for roc"),
        (["init", "--out", "{run}", "--owners", "2", "--size", "4", "--epsilon", "1",
          "--server-at", "h:1", "--server-at", "h:2"], "--out"),
        (["init", "--out", "{tmp}/new", "--owners", "2", "--size", "4", "--epsilon", "1",
          "--n-values", "0", "--server-at", "h:1", "--server-at", "h:2"], "--n-values"),
        (["init", "--out", "{tmp}/new", "--owners", "2", "--size", "4", "--epsilon", "1",
          "--server-at", "h:1", "--server-at", "h:1"], "two servers at one address"),
        (["init", "--out", "{tmp}/new", "--owners", "2", "--size", "4", "--epsilon", "1",
          "--timeout", "1e12", "--server-at", "h:1", "--server-at", "h:2"],
         "argument --timeout: expected a number of seconds > 0 and <= 2592000"),
        (["owner", "{tmp}/slow.json", "--secret", "{run}/secrets/owner-0.json", "--index",
          "0", "--values", "0.5"], "timeout 1000000000000.0 is not a number of seconds"),
    ],
)  # fmt: skip
def test_party_bad_input_is_one_line_before_anything_runs(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Audit findings: a port out of range, a malformed or wrong file, an index out of range
    and bad values gave tracebacks, or ran until the timeout; --n-values 0 ran the protocol and
    lost the release."""
    run = tmp_path / "run"
    assert _init(run) == 0
    (tmp_path / "bad.json").write_text("{bad")
    session = json.loads((run / "session.json").read_text())
    (tmp_path / "slow.json").write_text(json.dumps({**session, "timeout": 1e12}))
    capsys.readouterr()
    argv = [a.replace("{run}", str(run)).replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["federated", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and err.count("\n") <= 12  # usage lines at most, no traceback


def test_init_never_overwrites_a_session(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Audit finding: init --out on a folder with a session.json but no secrets/ replaced the
    session file without a word."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "session.json").write_text('{"an": "earlier session file"}')
    assert _init(run) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "already holds a session.json" in err, err
    assert "Traceback" not in err
    assert (run / "session.json").read_text() == '{"an": "earlier session file"}'
    assert sorted(p.name for p in run.iterdir()) == ["session.json"]  # no secrets/ either


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_listens_at_the_session_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Audit finding: serve without --port listened on a random port, not at the session's
    servers_at, and the owners waited for it until their timeout."""
    import clipless.federated.session
    from clipless.federated.transport import Counter

    bound: list[int] = []

    def run_server(
        sess: object, secret: object, index: int, listener: socket.socket, key: object = None
    ) -> Counter:
        bound.append(listener.getsockname()[1])
        listener.close()
        return Counter()

    monkeypatch.setattr(clipless.federated.session, "run_server", run_server)
    port = _free_port()
    run = tmp_path / "run"
    assert main([
        "federated", "init", "--out", str(run), "--owners", "2", "--size", "4", "--epsilon",
        "1", "--server-at", f"127.0.0.1:{port}", "--server-at", "127.0.0.1:7002",
    ]) == 0  # fmt: skip
    capsys.readouterr()
    serve = ["federated", "serve", str(run / "session.json"), "--index", "0",
             "--secret", str(run / "secrets" / "server-0.json")]  # fmt: skip
    assert main(serve) == 0
    out, err = capsys.readouterr()
    assert bound == [port] and f"listening 127.0.0.1:{port}" in out, (out, err)
    assert "note" not in err
    # another port stays possible (a tunnel or TLS proxy in front), with a note saying so
    assert main([*serve, "--port", "0"]) == 0
    assert bound[1] != port
    assert f"--port 0 is not the session's servers_at[0] 127.0.0.1:{port}" in (
        capsys.readouterr().err
    )


def test_process_counts_are_capped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Audit finding: `simulate --owners` and `train --nproc` started one process each with no
    cap (5000 owners drove this machine's load to 200). Nothing may start here."""
    import clipless.distributed
    import clipless.federated.session

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("processes were started")

    monkeypatch.setattr(clipless.federated.session, "simulate", never)
    monkeypatch.setattr(clipless.distributed, "spawn", never)
    assert main(["federated", "simulate", "--owners", "5000"]) == 2
    assert "argument --owners: expected an integer [1, 1000]" in capsys.readouterr().err
    assert main(["train", "--nproc", "1000"]) == 2
    assert "argument --nproc" in capsys.readouterr().err


def test_analyst_stdout_is_the_table_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 37: the analyst's stdout mixed a JSON status line into the released table; the
    status now goes to stderr (the other parties keep it on stdout, the simulation reads it)."""
    import numpy as np

    import clipless.federated.cli
    import clipless.federated.session
    from clipless.federated.transport import Counter

    counter = Counter()
    counter.sent["server 0"] = 12
    monkeypatch.setattr(
        clipless.federated.session, "run_analyst", lambda s, k: (np.zeros(4, np.int64), counter)
    )
    monkeypatch.setattr(clipless.federated.session, "_finish", lambda *a: "released")
    monkeypatch.setattr(clipless.federated.cli, "_print_release", lambda res: print("TABLE"))
    run = tmp_path / "run"
    assert _init(run) == 0
    capsys.readouterr()
    code = main([
        "federated", "analyst", str(run / "session.json"),
        "--secret", str(run / "secrets" / "analyst-0.json"),
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0
    assert out == "TABLE\n"
    assert json.loads(err.strip().splitlines()[-1]) == {"sent": {"server 0": 12}, "error": None}


def test_serve_noise_key_file_is_the_servers_own(tmp_path: Path) -> None:
    """Issue 37: a distributed server's key is its own: created 0600 with a fresh key when the
    file is absent, read back (the same noise for later queries) when present."""
    import stat

    from clipless.federated.cli import _own_noise_key

    dist = "distributed"
    path = tmp_path / "k"
    key = _own_noise_key(str(path), dist)
    assert key is not None and len(key) == 16
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == key.hex()
    assert _own_noise_key(str(path), dist) == key
    assert _own_noise_key(None, dist) is None
    with pytest.raises(ValueError, match="only for noise_sharing distributed"):
        _own_noise_key(str(path), "dealer")
    path.write_text("abc")
    with pytest.raises(ValueError, match="32 hex digits"):
        _own_noise_key(str(path), dist)


def test_simulate_distributed_subprocesses_with_key_files(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The server processes get their own keys through --noise-key-file (none in any secret):
    the TCP release (the central default's k-ary plan) equals the in-process one and the
    central one with the summed noise of those keys, bit for bit."""
    import numpy as np

    from clipless.federated import federated_ecdf
    from clipless.federated.session import simulate
    from clipless.stats import Grid, ecdf

    keys = [bytes([5 + j]) * 16 for j in range(3)]
    vals = [[0.2], [0.5], [0.7], [0.9]]
    res = simulate("shares", vals, 3, 8, 1.0, spawn="subprocess", timeout=30.0,
                   noise_sharing="distributed", noise_keys=keys)  # fmt: skip
    grid = Grid(0, 1, size=8)
    fed = federated_ecdf(vals, grid, 1.0, servers=3, noise_sharing="distributed",
                         noise_keys=keys)  # fmt: skip
    central = ecdf([v[0] for v in vals], grid, 1.0, node_noise=fed.noise_source)
    assert res.ecdf is not None and fed.ecdf is not None
    assert res.release.mechanism == "k-ary"
    assert np.array_equal(res.ecdf.values, fed.ecdf.values)
    assert np.array_equal(res.ecdf.values, central.values)


def test_party_files_from_another_session_or_version_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A secret whose TLS key is not its certificate's, a secret from another init, and a
    session written before TLS: each a one-line error (exit 2) before any connection."""
    import json

    assert _init(tmp_path / "run") == 0 and _init(tmp_path / "other") == 0
    capsys.readouterr()
    run = tmp_path / "run"
    mine = json.loads((run / "secrets" / "owner-0.json").read_text())
    theirs = json.loads((run / "secrets" / "owner-1.json").read_text())
    mine["tls"]["key"] = theirs["tls"]["key"]
    (tmp_path / "mixed.json").write_text(json.dumps(mine))
    old = json.loads((run / "session.json").read_text())
    del old["format"], old["ca"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    cases = [
        (str(run / "session.json"), str(tmp_path / "mixed.json"),
         "its TLS key and certificate do not load (KEY_VALUES_MISMATCH)"),
        (str(run / "session.json"), str(tmp_path / "other" / "secrets" / "owner-0.json"),
         "its TLS certificate is not owner 0's in this session (a secret from another init?)"),
        (str(tmp_path / "old.json"), str(run / "secrets" / "owner-0.json"),
         "written by an earlier clipless, before the transport used TLS"),
    ]  # fmt: skip
    for session, secret, message in cases:
        argv = ["federated", "owner", session, "--index", "0", "--secret", secret]
        assert main([*argv, "--values", "0.5"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
