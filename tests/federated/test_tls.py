"""TLS on the federated links, over real local sockets: certificates from ``make_session``,
a peer from another session's CA or with another party's name refused with a named error, a
byte tampered in transit refused, and the session files versioned.

(A whole release over TLS equal bit for bit to the central release with the same noise key, as
before TLS: ``test_session.test_tcp_release_equals_central_and_bytes_match_formula``.)"""

from __future__ import annotations

import json
import multiprocessing
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from clipless.federated.session import (
    _credentials,
    _Inbox,
    make_session,
    run_analyst,
    run_dealer,
    run_owner,
    run_server,
)
from clipless.federated.sessionfile import PartySecret, Session, load_secret, load_session
from clipless.federated.tls import certificate_name, client_context, server_context
from clipless.federated.transport import (
    AuthenticationError,
    FederatedError,
    connect,
    encode_frame,
)


def _serve(session: Session, secret: PartySecret, j: int) -> tuple[Session, Any]:
    """Fork server ``j`` on a fresh port; the session with its address, and the process."""
    ctx = multiprocessing.get_context("fork")
    listener = socket.create_server(("127.0.0.1", 0))
    session = session.with_servers_at([*session.servers_at, listener.getsockname()])
    proc = ctx.Process(target=run_server, args=(session, secret, j, listener), daemon=True)
    proc.start()
    listener.close()
    return session, proc


def _stop(*procs: Any) -> None:
    for proc in procs:
        proc.kill()
        proc.join()


def test_init_certificates_name_each_party_and_chain_to_the_session_ca() -> None:
    session, secret = make_session("shares", 2, 2, 4, 1.0)
    for name, sec in secret.items():
        assert certificate_name(sec.tls_cert) == name == sec.party
        server_context(_credentials(session, sec))  # key and certificate load, CA parses
    assert "PRIVATE KEY" not in json.dumps(session.to_json())  # the CA key is nowhere
    assert all("PRIVATE KEY" not in s.tls_cert for s in secret.values())
    assert repr(secret["owner 0"]) == "PartySecret(party='owner 0')"  # never the keys


def test_a_server_with_a_certificate_from_another_ca_is_refused() -> None:
    """The owner checks the server against its session's CA before sending anything."""
    session, secret = make_session("shares", 1, 2, 4, 1.0, timeout=5.0)
    other, other_secret = make_session("shares", 1, 2, 4, 1.0, timeout=5.0)
    session, proc = _serve(session, secret["server 0"], 0)
    # server 0 presents its own CA's certificate; this client trusts only `other`'s CA
    client = client_context(_credentials(other, other_secret["owner 0"]))
    try:
        with pytest.raises(AuthenticationError, match=r"does not verify against this session's CA"):
            connect(*session.servers_at[0], ("server", 0), time.monotonic() + 5, client)
    finally:
        _stop(proc)


def test_an_owner_with_a_certificate_from_another_ca_is_refused() -> None:
    """The owner of another session (another CA) is refused by the server's TLS layer: the
    owner's error names the server's refusal, not a timeout."""
    session, secret = make_session("shares", 1, 2, 4, 1.0, timeout=5.0)
    _, other_secret = make_session("shares", 1, 2, 4, 1.0, timeout=5.0)
    session, p0 = _serve(session, secret["server 0"], 0)
    session, p1 = _serve(session, secret["server 1"], 1)
    # trusts this session's CA (so the handshake reaches the server's check), foreign certificate
    foreign = other_secret["owner 0"]
    stranger = PartySecret("owner 0", foreign.links, foreign.tls_key, foreign.tls_cert)
    try:
        with pytest.raises(
            AuthenticationError, match=r"server 0 refused the TLS connection"
        ) as info:
            run_owner(session, stranger, 0, [0.5])
        assert "UNKNOWN_CA" in str(info.value) and info.value.party == "server 0"
    finally:
        _stop(p0, p1)


def test_a_server_with_another_partys_certificate_is_refused() -> None:
    """Server 1's files served at server 0's address (swapped files): same CA, wrong name."""
    session, secret = make_session("shares", 1, 2, 4, 1.0, timeout=5.0)
    session, proc = _serve(session, secret["server 1"], 1)  # listening where server 0 is expected
    client = client_context(_credentials(session, secret["owner 0"]))
    try:
        with pytest.raises(AuthenticationError, match=r"is server 1's, not server 0's"):
            connect(*session.servers_at[0], ("server", 0), time.monotonic() + 5, client)
    finally:
        _stop(proc)


def test_a_frame_in_another_name_than_the_certificate_is_refused() -> None:
    """Owner 1's certificate, a frame in owner 0's name with owner 0's own link key: the HMAC
    verifies, the name does not -- rejected by the TLS identity, without ending the run."""
    session, secret = make_session("shares", 2, 2, 4, 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    keys = dict(secret["server 0"].links)
    sid = bytes.fromhex(session.session_id)
    inbox = _Inbox(listener, keys, sid, ("server", 0), cap=8,
                   tls=server_context(_credentials(session, secret["server 0"])))  # fmt: skip
    owner1 = client_context(_credentials(session, secret["owner 1"]))
    frame = encode_frame(keys["owner 0"], sid, ("owner", 0), ("server", 0), 1, b"x" * 64)

    def send() -> None:
        raw = socket.create_connection(listener.getsockname())
        with owner1.wrap_socket(raw) as sock:
            sock.sendall(frame)
            time.sleep(0.5)

    thread = threading.Thread(target=send)
    thread.start()
    assert inbox.poll(time.monotonic() + 1.0) == []
    thread.join()
    exc = inbox.rejected["owner 1"]
    assert isinstance(exc, AuthenticationError)
    assert str(exc) == "a frame in the name of owner 0 came over owner 1's TLS connection"
    inbox.close()
    listener.close()


def test_a_library_party_given_another_partys_secret_is_named() -> None:
    session, secret = make_session("shares", 2, 2, 4, 1.0)
    with pytest.raises(ValueError, match="owner 0 was given owner 1's secret"):
        run_owner(session, secret["owner 1"], 0, [0.5])


class _TamperingProxy:
    """Forwards one port to another; flips one byte in the middle of every client->server TLS
    record longer than ``longer`` bytes (application data: handshake records are shorter)."""

    def __init__(self, target: tuple[str, int], longer: int = 4096) -> None:
        self.target, self.longer = target, longer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.flipped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray()
        try:
            while data := src.recv(1 << 16):
                buf += data
                while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[3:5], "big"):
                    size = 5 + int.from_bytes(buf[3:5], "big")
                    record = bytearray(buf[:size])
                    del buf[:size]
                    if record[0] == 0x17 and size > self.longer:
                        record[size // 2] ^= 0x01
                        self.flipped += 1
                    dst.sendall(bytes(record))
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def close(self) -> None:
        self.listener.close()


def test_a_byte_tampered_in_transit_is_refused() -> None:
    """Every long TLS record to server 1 gets one bit flipped on the wire: its TLS layer
    refuses it (bad record MAC), nothing is released, and the error names the sender."""
    session, secret = make_session("shares", 2, 2, 1024, 1.0, timeout=3.0, mechanism="binary")
    session, p0 = _serve(session, secret["server 0"], 0)
    session, p1 = _serve(session, secret["server 1"], 1)
    proxy = _TamperingProxy(session.servers_at[1])
    session = session.with_servers_at([session.servers_at[0], proxy.address])
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=run_dealer, args=(session, secret["dealer 0"]), daemon=True)]
    procs += [
        ctx.Process(target=run_owner, args=(session, secret[f"owner {i}"], i, [0.1 * (i + 1)]),
                    daemon=True)
        for i in range(2)
    ]  # fmt: skip
    for proc in procs:
        proc.start()
    try:
        with pytest.raises(FederatedError) as info:
            run_analyst(session, secret["analyst 0"])
    finally:
        _stop(p0, p1, *procs)
        proxy.close()
    assert isinstance(info.value, AuthenticationError), info.value
    message = str(info.value)
    assert message.startswith("server 1 reports: server 1: no verified message from ")
    assert "BAD_RECORD_MAC" in message and "a record tampered in transit" in message


def test_session_files_are_versioned_and_validated(tmp_path: Path) -> None:
    session, secret = make_session("shares", 2, 2, 4, 1.0)
    assert Session.from_json(json.loads(json.dumps(session.to_json()))) == session
    owner = PartySecret.from_json(json.loads(json.dumps(secret["owner 0"].to_json())))
    assert owner.links == secret["owner 0"].links and owner.tls_key == secret["owner 0"].tls_key
    with pytest.raises(AttributeError):
        session.timeout = 5.0  # type: ignore[misc]
    old = session.to_json()
    del old["format"], old["ca"]
    path = tmp_path / "session.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"earlier clipless, before the transport used TLS.*"
                       r"run clipless federated init again"):  # fmt: skip
        load_session(path)
    path.write_text(json.dumps({"links": {"server 0": "00" * 32}}))
    with pytest.raises(ValueError, match=r"^--secret .*earlier clipless"):
        load_secret(path)
    bad = session.to_json()
    bad["servers_at"] = [["h", 70000]]
    with pytest.raises(ValueError, match="servers_at must hold at most 2"):
        Session.from_json(bad)
    with pytest.raises(ValueError, match="protocol must be one of shares, fss"):
        Session.from_json({**session.to_json(), "protocol": "flower"})


def test_an_ssl_context_is_tls13_with_certificates_required() -> None:
    session, secret = make_session("shares", 1, 2, 4, 1.0)
    for make in (client_context, server_context):
        ctx = make(_credentials(session, secret["owner 0"]))
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
