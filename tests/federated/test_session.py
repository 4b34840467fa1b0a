"""Parties as separate processes over TCP loopback: the release, the bytes, the failures."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from clipless.federated import NodeNoise, federated_ecdf
from clipless.federated.dcf import domain_bits, key_bytes
from clipless.federated.noise import tree_context, tree_key
from clipless.federated.session import make_session, simulate
from clipless.federated.transport import (
    TAG_BYTES,
    AuthenticationError,
    PartyDroppedError,
    PartyTimeoutError,
    ProtocolError,
)
from clipless.stats import Grid, ecdf

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork start method")

KEY = bytes([9]) * 16
FRAME = 23 + TAG_BYTES  # header + HMAC tag around every payload


def _values(n: int, seed: int = 0) -> list[list[float]]:
    return [[float(v)] for v in np.random.default_rng(seed).uniform(0, 1, n)]


@pytest.mark.parametrize("protocol,servers", [("shares", 3), ("fss", 2)])
def test_tcp_release_equals_central_and_bytes_match_formula(protocol: str, servers: int) -> None:
    owners, size = _values(6), 10
    res = simulate(
        protocol, owners, servers, size, 0.8, timeout=20.0, noise_keys=[KEY], mechanism="binary"
    )
    grid = Grid(0, 1, size=size)
    bound = NodeNoise(tree_key(KEY, tree_context(grid.thresholds, "ecdf")))
    central = ecdf(np.concatenate(owners), grid, 0.8, node_noise=bound, mechanism="binary")
    assert res.ecdf is not None
    assert res.ecdf.values.tobytes() == central.values.tobytes()
    fed = federated_ecdf(
        owners,
        Grid(0, 1, size=size),
        0.8,
        protocol=protocol,  # type: ignore[arg-type]
        servers=servers,
        noise_keys=[KEY],
        mechanism="binary",  # what the TCP session releases
    )
    assert res.prefix_counts.tolist() == fed.prefix_counts.tolist()
    # bytes on the wire, exactly: every payload is framed (23-byte header + 32-byte tag)
    n, m, nodes = len(owners), servers, 2 * 16 - 1
    if protocol == "shares":
        owner_bytes = n * ((m - 1) * (FRAME + 16) + FRAME + 8 * size)
    else:
        owner_bytes = n * m * (FRAME + key_bytes(domain_bits(size)))
    dealer_bytes = (m - 1) * (FRAME + 16) + FRAME + 8 * nodes
    server_bytes = m * ((n + 1) * FRAME + FRAME + 8 * nodes)  # ACKs + one result each
    roles = res.by_role()
    assert roles == {
        "owner": owner_bytes,
        "dealer": dealer_bytes,
        "server": server_bytes,
        "analyst": m * FRAME,
    }
    assert res.total == sum(roles.values())


def test_distributed_noise_over_tcp_pointwise() -> None:
    owners = _values(4, 1)
    res = simulate(
        "shares",
        owners,
        2,
        8,
        1.0,
        timeout=20.0,
        noise_sharing="distributed",
        points=[1, 5, 7],
        noise_keys=[KEY, bytes(16)],
    )
    fed = federated_ecdf(
        owners,
        Grid(0, 1, size=8),
        1.0,
        noise_sharing="distributed",
        thresholds=[1, 5, 7],
        noise_keys=[KEY, bytes(16)],
    )
    assert res.prefix_counts.tolist() == fed.prefix_counts.tolist()
    assert "dealer" not in res.by_role()


def test_killed_owner_is_named() -> None:
    with pytest.raises(PartyDroppedError, match="owner 1") as info:
        simulate("shares", _values(3), 2, 4, 1.0, timeout=4.0, faults={"owner 1": "die"})
    assert info.value.party == "owner 1"


def test_killed_server_is_named() -> None:
    with pytest.raises(PartyDroppedError, match="server 1") as info:
        simulate("fss", _values(2), 2, 4, 1.0, timeout=2.0, kill_server=1)
    assert info.value.party == "server 1"


def test_slow_owner_times_out_named() -> None:
    with pytest.raises(PartyTimeoutError, match="owner 0") as info:
        simulate("shares", _values(2), 2, 4, 1.0, timeout=1.0, faults={"owner 0": "sleep"})
    assert info.value.party == "owner 0"


def test_tampered_message_is_rejected() -> None:
    """A frame that fails its HMAC is dropped (anyone can send one); the run ends at the
    timeout with an error naming the party whose verified message never came, and why."""
    with pytest.raises(AuthenticationError, match=r"owner 2.*HMAC") as info:
        simulate("shares", _values(3), 2, 4, 1.0, timeout=4.0, faults={"owner 2": "tamper"})
    assert info.value.party == "owner 2"


@pytest.mark.parametrize("protocol,servers", [("shares", 3), ("fss", 2)])
def test_unauthenticated_connections_change_nothing(protocol: str, servers: int) -> None:
    """Audit finding: one connection to a server's port that did not authenticate (garbage, a
    wrong key, a misaddressed frame, a header alone) ended the run, and an idle one stalled
    the single-threaded server until its deadline. Now each owner's message is surrounded by
    such connections (and replayed after its ACK) and the release is bit-identical to the
    in-process one."""
    owners = _values(4, seed=3)
    faults = {f"owner {i}": "stranger" for i in range(4)}
    res = simulate(protocol, owners, servers, 8, 1.0, timeout=20.0, noise_keys=[KEY],
                   faults=faults, mechanism="binary")  # fmt: skip
    fed = federated_ecdf(owners, Grid(0, 1, size=8), 1.0, protocol=protocol,  # type: ignore[arg-type]
                         servers=servers, noise_keys=[KEY], mechanism="binary")  # fmt: skip
    assert res.prefix_counts.tolist() == fed.prefix_counts.tolist()


def test_malformed_share_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="malformed share from owner 1") as info:
        simulate("shares", _values(2), 2, 4, 1.0, timeout=10.0, faults={"owner 1": "short"})
    assert info.value.party == "owner 1"


def test_session_bad_input() -> None:
    with pytest.raises(ValueError, match="protocol"):
        make_session("flower", 2, 2, 4, 1.0)
    with pytest.raises(ValueError, match="2 servers"):
        make_session("fss", 2, 3, 4, 1.0)
    with pytest.raises(ValueError, match="servers"):
        make_session("shares", 2, 1, 4, 1.0)
    # checked at init, not by the dealer or the servers mid-run (audit finding)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        make_session("shares", 2, 2, 4, -1.0)
    with pytest.raises(ValueError, match="epsilon must be finite"):
        make_session("shares", 2, 2, 4, float("nan"))
    with pytest.raises(ValueError, match="timeout must be"):
        make_session("shares", 2, 2, 4, 1.0, timeout=-5)
    with pytest.raises(ValueError, match=r"points: thresholds must be grid indices in \[0, 4\)"):
        make_session("shares", 2, 2, 4, 1.0, points=[0, 9])


@pytest.mark.parametrize(
    "protocol,servers,neighbouring,message",
    [
        ("shares", 2, "swap", "neighbouring must be 'replace_one' or 'add_remove', got 'swap'"),
        ("fss", 3, "replace_one", "uses exactly 2 servers (a two-party DCF), got servers=3"),
        ("fss", 2, "add_remove", "protocol='fss' needs neighbouring='replace_one'"),
    ],
)
def test_protocol_checks_word_alike(
    protocol: str, servers: int, neighbouring: str, message: str
) -> None:
    """The in-process ECDF and ROC and the TCP session refuse the same combinations with the
    same sentence."""
    from clipless.federated import federated_roc

    grid = Grid(0, 1, size=4)
    calls = [
        lambda: federated_ecdf([[0.5]], grid, 1.0, protocol=protocol, servers=servers,  # type: ignore[arg-type]
                               neighbouring=neighbouring),  # type: ignore[arg-type]
        lambda: federated_roc([[0.5]], [[1]], grid, 1.0, protocol=protocol, servers=servers,  # type: ignore[arg-type]
                              neighbouring=neighbouring),  # type: ignore[arg-type]
        lambda: make_session(protocol, 2, servers, 4, 1.0, neighbouring=neighbouring),  # type: ignore[arg-type]
    ]  # fmt: skip
    said = set()
    for call in calls:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            call()
        said.add(str(info.value))
    assert len(said) == 1


@pytest.mark.parametrize("protocol,servers", [("shares", 3), ("fss", 2)])
def test_tcp_roc_equals_in_process(protocol: str, servers: int) -> None:
    from clipless.federated import federated_roc

    rng = np.random.default_rng(5)
    labels = [[int(v)] for v in rng.integers(0, 2, 8)]
    scores = [[float(rng.normal(0.3 + 0.4 * y[0], 0.2))] for y in labels]
    res = simulate(protocol, scores, servers, 9, 1.0, timeout=20.0, noise_keys=[KEY],
                   statistic="roc", owner_labels=labels)  # fmt: skip
    ref, _ = federated_roc(scores, labels, Grid(0, 1, size=9), 1.0, protocol=protocol,  # type: ignore[arg-type]
                           servers=servers, noise_keys=[KEY])  # fmt: skip
    assert res.roc is not None
    assert res.roc.fpr.tobytes() == ref.fpr.tobytes()
    assert res.roc.tpr.tobytes() == ref.tpr.tobytes()
    assert res.roc.auc() == ref.auc()


def test_default_public_n_needs_one_value_per_owner() -> None:
    """Audit finding: ``init`` sets the public n to the number of owners by default, and three
    owners holding three values each released an ECDF rising to 3.0 with no error."""
    from clipless.federated.session import run_owner

    session, secret = make_session("shares", 3, 2, 8, 1.0)
    assert session.one_value_per_owner
    with pytest.raises(ValueError, match="one value per owner"):
        run_owner(session, secret["owner 0"], 0, [0.1, 0.2, 0.3])
    session, _ = make_session("shares", 3, 2, 8, 1.0, n_values=3)
    assert not session.one_value_per_owner  # explicit n: any split among owners


def _tls_pair():
    """A session's server 0 and owner 0 TLS contexts and link key (for inbox-level tests)."""
    from clipless.federated.session import _credentials
    from clipless.federated.tls import client_context, server_context

    session, secret = make_session("shares", 1, 2, 4, 1.0)
    server, owner = secret["server 0"], secret["owner 0"]
    return (
        server_context(_credentials(session, server)),
        client_context(_credentials(session, owner)),
        owner.links["server 0"],
    )


def _tls_client(port: int, ctx, parts: list[bytes], go: list) -> tuple:
    """A thread that connects over TLS and sends ``parts[0]``, then each later part once
    ``go`` holds an event for it; returns (thread, socket holder)."""
    import socket
    import threading

    holder: list = []

    def run() -> None:
        sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)))
        holder.append(sock)
        sock.sendall(parts[0])
        for part, event in zip(parts[1:], go, strict=True):
            event.wait(10)
            sock.sendall(part)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, holder


def test_the_inbox_survives_more_connections_than_its_cap() -> None:
    """Review finding: dropping the oldest connection at the cap while it had an event later in
    the same batch raised KeyError (a crash any stranger could cause). Here the listener becomes
    ready (a third connection) before the oldest connection sends more bytes, so one select
    returns both, in that order; the verified frame still arrives afterwards."""
    import socket
    import time

    from clipless.federated.session import _Inbox
    from clipless.federated.transport import encode_frame

    server_tls, owner_tls, key = _tls_pair()
    sid = bytes(16)
    me, peer = ("server", 0), ("owner", 0)
    listener = socket.create_server(("127.0.0.1", 0))
    inbox = _Inbox(listener, {"owner 0": key}, sid, me, cap=2, tls=server_tls)
    port = listener.getsockname()[1]
    first = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    for c in first:
        c.sendall(b"\x16\x03")  # the start of a TLS record: accepted, handshake pending
    assert inbox.poll(time.monotonic() + 0.3) == []
    third = socket.create_connection(("127.0.0.1", port))  # the listener is ready first...
    time.sleep(0.05)
    first[0].sendall(b"F1")  # ...then the oldest connection, dropped when the third is accepted
    time.sleep(0.05)
    assert inbox.poll(time.monotonic() + 0.3) == []
    thread, _ = _tls_client(port, owner_tls, [encode_frame(key, sid, peer, me, 1, b"payload")], [])
    got: list = []
    deadline = time.monotonic() + 5.0
    while not got and time.monotonic() < deadline:
        got = inbox.poll(min(deadline, time.monotonic() + 0.5))
    thread.join(5)
    assert [f.payload for _, f in got] == [b"payload"]
    assert inbox.unidentified >= 2  # dropped at the cap, never an exception
    inbox.close()
    for c in [*first, third, *(conn for conn, _ in got)]:
        c.close()
    listener.close()


def test_add_remove_sessions_publish_no_n() -> None:
    """Audit finding: under add/remove the number of values is private (neighbours differ in
    it), but the session published it (``n_values`` = the owners, one value each, or
    ``--n-values``). Now there is none; owners hold any number of values, and the TCP release
    equals the central add/remove one."""
    session, _ = make_session("shares", 3, 2, 8, 1.0, neighbouring="add_remove")
    assert session.n_values is None and not session.one_value_per_owner
    with pytest.raises(ValueError, match="n_values must be None under neighbouring='add_remove'"):
        make_session("shares", 3, 2, 8, 1.0, neighbouring="add_remove", n_values=3)
    owners, size = [[0.1, 0.35], [], [0.5, 0.52, 0.9]], 10
    res = simulate(
        "shares", owners, 2, size, 0.8, timeout=20.0, noise_keys=[KEY], neighbouring="add_remove",
        mechanism="binary",
    )  # fmt: skip
    grid = Grid(0, 1, size=size)
    bound = NodeNoise(tree_key(KEY, tree_context(grid.thresholds, "ecdf")))
    central = ecdf(
        np.concatenate(owners), grid, 0.8, node_noise=bound, neighbouring="add_remove",
        mechanism="binary",
    )  # fmt: skip
    assert res.ecdf is not None
    assert res.ecdf.values.tobytes() == central.values.tobytes()


def _run_parties(session, secret, owners) -> None:
    import multiprocessing as mp
    import socket

    from clipless.federated.session import run_analyst, run_dealer, run_owner, run_server

    ctx = mp.get_context("fork")
    procs = []
    for j in range(session.servers):
        listener = socket.create_server(("127.0.0.1", 0))
        at = ("127.0.0.1", listener.getsockname()[1])
        session = session.with_servers_at([*session.servers_at, at])
        procs.append(
            ctx.Process(target=run_server, args=(session, secret[f"server {j}"], j, listener))
        )
        procs[-1].start()
        listener.close()
    procs.append(ctx.Process(target=run_dealer, args=(session, secret["dealer 0"])))
    procs[-1].start()
    for i, values in enumerate(owners):
        procs.append(ctx.Process(target=run_owner, args=(session, secret[f"owner {i}"], i, values)))
        procs[-1].start()
    try:
        run_analyst(session, secret["analyst 0"])
    finally:
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()


def test_fss_servers_check_the_public_n() -> None:
    """Audit finding: a public n (``n_values``) other than the owners' total scaled the released
    ECDF silently (1.5 at the top of the grid). The fss servers receive one key per value, so
    they know the total and refuse a wrong n."""
    session, secret = make_session("fss", 2, 2, 8, 1.0, n_values=2, timeout=10.0)
    with pytest.raises(ProtocolError, match=r"sent 3 DCF keys .* public n is 2"):
        _run_parties(session, secret, [[0.1, 0.2], [0.3]])


def test_a_flood_of_idle_connections_does_not_push_out_a_party() -> None:
    """Audit finding: at the inbox's cap the *oldest* unfinished connection was dropped, so a
    stranger opening idle connections pushed out an owner part-way through its message. The
    connection with the fewest bytes received goes now (a stranger's TLS handshake never
    finishes: it has received none)."""
    import socket
    import threading
    import time

    from clipless.federated.session import _Inbox
    from clipless.federated.transport import encode_frame

    server_tls, owner_tls, key = _tls_pair()
    sid = bytes(16)
    me, peer = ("server", 0), ("owner", 0)
    listener = socket.create_server(("127.0.0.1", 0))
    inbox = _Inbox(listener, {"owner 0": key}, sid, me, cap=4, tls=server_tls)
    port = listener.getsockname()[1]
    frame = encode_frame(key, sid, peer, me, 1, b"x" * 4096)
    rest = threading.Event()
    thread, _ = _tls_client(port, owner_tls, [frame[:100], frame[100:]], [rest])
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # the handshake and the first 100 bytes
        assert inbox.poll(time.monotonic() + 0.1) == []
    flood = []
    for _ in range(12):  # three times the cap, idle
        flood.append(socket.create_connection(("127.0.0.1", port)))
        inbox.poll(time.monotonic() + 0.05)
    rest.set()
    got: list = []
    deadline = time.monotonic() + 5.0
    while not got and time.monotonic() < deadline:
        got = inbox.poll(min(deadline, time.monotonic() + 0.5))
    thread.join(5)
    assert [f.payload for _, f in got] == [b"x" * 4096]
    assert inbox.unidentified >= 8  # the idle strangers were dropped instead
    inbox.close()
    for c in [*flood, *(conn for conn, _ in got)]:
        c.close()
    listener.close()


def test_a_party_resends_after_its_connection_drops() -> None:
    """A connection that drops before the ACK (here during the TLS handshake) is opened again
    and the message resent."""
    import socket
    import threading
    import time

    from clipless.federated.session import _credentials, _send_one
    from clipless.federated.tls import client_context, server_context
    from clipless.federated.transport import ACK, Counter, recv_frame, send_frame

    session, secret = make_session("shares", 1, 2, 4, 1.0)
    key = secret["owner 0"].links["server 0"]
    sid = bytes.fromhex(session.session_id)
    listener = socket.create_server(("127.0.0.1", 0))
    session = session.with_servers_at([("127.0.0.1", listener.getsockname()[1])])
    server_tls = server_context(_credentials(session, secret["server 0"]))
    received = []

    def server() -> None:
        first, _ = listener.accept()
        first.recv(10)  # a few bytes, then the connection is dropped
        first.close()
        raw, _ = listener.accept()
        conn = server_tls.wrap_socket(raw, server_side=True)
        frame = recv_frame(conn, {"owner 0": key}, sid, ("server", 0), time.monotonic() + 5, "o")
        received.append(frame.payload)
        send_frame(conn, key, sid, ("server", 0), ("owner", 0), ACK, b"", Counter())
        conn.close()

    thread = threading.Thread(target=server)
    thread.start()
    counter = Counter()
    owner_tls = client_context(_credentials(session, secret["owner 0"]))
    _send_one(
        session, {"server 0": key}, owner_tls, ("owner", 0), 0, 1, b"y" * 200_000, counter,
        time.monotonic() + 10.0,
    )  # fmt: skip
    thread.join(10)
    listener.close()
    assert received == [b"y" * 200_000]


@pytest.mark.parametrize("keys", ["00" * 16, bytes(16)])
def test_one_key_instead_of_a_list_is_named(keys) -> None:
    with pytest.raises(TypeError, match="noise_keys must be a list of 16-byte keys"):
        make_session("shares", 2, 2, 8, 1.0, noise_keys=keys)
    with pytest.raises(TypeError, match="noise_keys must be a list of 16-byte keys"):
        federated_ecdf([[0.1]], Grid(0, 1, size=8), 1.0, noise_keys=keys)
    with pytest.raises(ValueError, match="smoothing must be None"):
        federated_ecdf([[0.1]], Grid(0, 1, size=8), 1.0, smoothing="foo")  # type: ignore[arg-type]


def test_make_session_bounds_the_timeout() -> None:
    """Audit: a 1e12 s timeout overflowed the socket deadlines (an OverflowError mid-run)."""
    from clipless.federated import session as fs
    from clipless.federated.cli import _MAX_TIMEOUT

    assert fs.MAX_TIMEOUT == _MAX_TIMEOUT
    for bad in (1e12, True, 0.0, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            fs.make_session(
                owners=2, servers=2, protocol="shares", size=4, epsilon=1.0, timeout=bad
            )


def test_no_file_written_by_init_reconstructs_the_distributed_noise(tmp_path) -> None:
    """Issue 37: ``init --noise-sharing distributed`` wrote every server's noise key into the
    secret files from one process, so whoever ran init knew all the noise. Now init writes
    link keys only and each server draws its own key when it serves. The test runs a real
    release from init's files and tries every 16-byte value found in them (raw and bound to
    the tree), alone and summed in twos and threes (the noise is a sum of three server noises):
    none gives the released noise. The noise is wide enough (epsilon 0.05) that a chance
    match among the ~1,300 sums has negligible probability: at epsilon 1 the 4 node noises are
    small integers, and one unrelated sum matched once in a CI run."""
    import itertools
    import json
    import multiprocessing
    import re
    import socket

    from clipless.cli import main
    from clipless.federated.session import (
        _child,
        _context,
        _noise_setup,
        run_analyst,
        run_owner,
        run_server,
    )
    from clipless.federated.sessionfile import load_secret, load_session

    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    at = [f"127.0.0.1:{lst.getsockname()[1]}" for lst in listeners]
    run = tmp_path / "run"
    assert main([
        "federated", "init", "--out", str(run), "--owners", "2", "--servers", "3",
        "--protocol", "shares", "--noise-sharing", "distributed", "--size", "4",
        "--epsilon", "0.05", "--timeout", "20",
        *itertools.chain.from_iterable(("--server-at", a) for a in at),
    ]) == 0  # fmt: skip
    files = [run / "session.json", *sorted((run / "secrets").iterdir())]
    session = load_session(files[0])
    secret = {p.stem.replace("-", " "): load_secret(p) for p in files[1:]}
    docs = [json.loads(p.read_text()) for p in files[1:]]
    assert all(set(d) == {"format", "party", "links", "tls"} for d in docs)  # no noise key

    ctx = multiprocessing.get_context("fork")
    procs, pipes = [], []
    for j, lst in enumerate(listeners):
        pipes.append(ctx.Pipe(duplex=False))
        child = pipes[-1][1]
        args = (session, secret[f"server {j}"], j, lst)
        procs.append(ctx.Process(target=_child, args=(run_server, args, child), daemon=True))
        procs[-1].start()
        lst.close()
    values = [[0.1], [0.8]]
    for i, v in enumerate(values):
        pipes.append(ctx.Pipe(duplex=False))
        child = pipes[-1][1]
        args = (session, secret[f"owner {i}"], i, v)
        procs.append(ctx.Process(target=_child, args=(run_owner, args, child), daemon=True))
        procs[-1].start()
    out, _ = run_analyst(session, secret["analyst 0"])
    for p in procs:
        p.join(30)
    assert [parent.recv()["error"] for parent, _ in pipes] == [None] * 5
    grid = Grid(0, 1, size=4)
    param, _, _, lev, idx, matrix = _noise_setup(session)  # the session's public tree
    assert session.kary is not None  # init's default: the central default's k-ary plan
    true_nodes = matrix @ np.cumsum(grid.counts([0.1, 0.8]))
    released_noise = np.asarray(out, dtype=np.int64) - true_nodes
    assert np.any(released_noise != 0)
    context = _context(session)
    found = set()
    for path in files:
        for hexa in re.findall(r"[0-9a-f]{32,}", path.read_text()):
            raw = bytes.fromhex(hexa[: len(hexa) // 32 * 32])
            found.update(raw[k : k + 16] for k in range(0, len(raw), 16))
    assert len(found) >= 10  # the session id and the link keys
    keys = sorted(found) + [tree_key(k, context) for k in sorted(found)]
    candidates = [NodeNoise(k).nodes("laplace", param, lev.ravel(), idx.ravel()) for k in keys]
    stack = np.stack(candidates)
    for r in (1, 2, 3):
        for combo in itertools.combinations(range(len(stack)), r):
            assert not np.array_equal(stack[list(combo)].sum(axis=0), released_noise)
