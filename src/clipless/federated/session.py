"""Owners, servers, a noise dealer and an analyst as separate processes over mutual TLS.

A *session* is a public :class:`~clipless.federated.sessionfile.Session` (protocol, servers,
owners, grid, budget, noise option, timeout, a 16-byte session id, the servers' addresses, the
session's TLS certificate authority) plus, for each party, a
:class:`~clipless.federated.sessionfile.PartySecret` holding only its own TLS key and
certificate (:mod:`clipless.federated.tls`), its link keys (32 bytes per link, HMAC-SHA256, see
:mod:`clipless.federated.transport`) and, for the dealer, its node-noise key (a
``"distributed"`` server draws its own when it serves). Message flow (one message per
connection, each acknowledged):

* owner ``i`` -> server ``j``: ``SHARE`` (a 16-byte seed, or the explicit share for the last
  server) or ``KEYS`` (its DCF keys for server ``j``, ``protocol="fss"``);
* dealer -> server ``j``: ``NOISE`` (a seed, or the explicit shares of all ``2N - 1`` node
  noises for the last server), ``noise_sharing="dealer"`` only;
* analyst -> server ``j``: ``REQUEST``; server -> analyst: ``RESULT`` (its ``8 d``-byte share of
  the output) or ``ERROR`` (the named failure it saw).

Each server waits, until ``timeout`` seconds have passed, for exactly one verified message from
every owner (and the dealer); a missing, dropped, slow, tampered or malformed message ends the
run with an error naming the party -- the release is never computed from partial or unverified
input. Unauthenticated connections (which anyone reaching the port can open) are dropped without
ending or stalling the run: a tampered or cut message is reported at the deadline, an
authenticated malformed one at once (:class:`_Inbox`).

:func:`simulate` launches everything on loopback (``spawn="subprocess"`` runs the ``clipless
federated serve/owner/dealer`` commands, ``spawn="fork"`` forks this process, which is faster
and what the tests use) and returns the release with the byte counts.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from clipless.federated._checks import check_protocol
from clipless.federated.inbox import Inbox
from clipless.federated.noise import tree_context, tree_key
from clipless.federated.sessionfile import (
    MAX_TIMEOUT,
    Neighbouring,
    Noise,
    NoiseSharing,
    PartySecret,
    Protocol,
    Session,
    Statistic,
)
from clipless.federated.tls import Credentials, client_context, make_authority, server_context
from clipless.federated.transport import (
    ACK,
    ERROR,
    ERRORS,
    KEYS,
    NOISE,
    REQUEST,
    RESULT,
    SHARE,
    Counter,
    FederatedError,
    Frame,
    Party,
    PartyDroppedError,
    ProtocolError,
    connect,
    party_name,
    recv_frame,
    send_frame,
)

__all__ = ["SimulationResult", "run_dealer", "run_owner", "run_server", "simulate"]


# --------------------------------------------------------------------------------------------
# session description
# --------------------------------------------------------------------------------------------


def _grid(session: Session) -> Any:
    from clipless.stats.grid import Grid

    return Grid.from_thresholds(np.asarray(session.thresholds, dtype=np.float64))


def _points(session: Session) -> NDArray[np.int64]:
    size = int(session.size)
    pts = session.points
    return np.arange(size, dtype=np.int64) if pts is None else np.asarray(pts, dtype=np.int64)


def _n_bits(session: Session) -> int:
    from clipless.federated.dcf import domain_bits

    return domain_bits(int(session.size))


def _is_roc(session: Session) -> bool:
    return session.statistic == "roc"


def _budget(session: Session) -> tuple[str, float | None, float | None]:
    """``(neighbouring, epsilon, rho)`` of one tree: a ROC's classes are add/remove trees at
    ``epsilon/2`` (replace-one) or ``epsilon`` (add/remove), as in :func:`clipless.stats.roc`."""
    if not _is_roc(session):
        return session.neighbouring, session.epsilon, session.rho
    parts = 2 if session.neighbouring == "replace_one" else 1
    eps, rho = session.epsilon, session.rho
    return (
        "add_remove",
        None if eps is None else float(eps) / parts,
        None if rho is None else float(rho) / parts,
    )


def _plan(session: Session) -> Any:
    """The session's ``k``-ary plan (public, fixed at ``init``), or ``None`` (binary tree)."""
    spec = session.kary
    if spec is None:
        return None
    from clipless.stats.counting import CountingPlan

    shares = tuple(Fraction(w) for w in spec[1])
    return CountingPlan(spec[0], shares, float("nan"))


def _context(session: Session) -> bytes:
    """The released tree's identity (:func:`~clipless.federated.noise.tree_context`)."""
    plan = _plan(session)
    shape = ""
    if plan is not None:
        from clipless.federated.ecdf import kary_shape

        shape = kary_shape(plan)
    return tree_context(session.thresholds, session.statistic, shape)


def _noise_setup(
    session: Session,
) -> tuple[Any, float, int, NDArray[np.int64], NDArray[np.int64], Any]:
    """``(param, node variance, sensitivity, noise levels, noise index, matrix)``; for a
    ``k``-ary session ``param`` is the per-level tuple (the variance and sensitivity entries
    are then unused: :func:`_finish` takes them from the plan)."""
    from clipless.federated.ecdf import noise_parameter, path_nodes, tree_query
    from clipless.stats.grid import tree_depth

    plan = _plan(session)
    if plan is not None:
        from clipless.federated.ecdf import kary_query
        from clipless.stats.counting import kary_params, kary_released_nodes

        size = int(session.size)
        nb, eps, rho = _budget(session)
        budget = _budget_of(session.noise, eps, rho)
        lv, ix = kary_released_nodes(size, plan, nb)  # type: ignore[arg-type]
        params = kary_params(plan, nb, session.noise, budget)  # type: ignore[arg-type]
        return params, 0.0, 0, lv[:, None], ix[:, None], kary_query(size, plan)
    size = int(session.size)
    depth = tree_depth(size)
    nb, eps, rho = _budget(session)
    param, var, delta = noise_parameter(depth, nb, session.noise, eps, rho)  # type: ignore[arg-type]
    if session.points is None:
        lv, ix = _all_nodes(session)
        matrix = tree_query(size)
        if _is_roc(session):
            import scipy.sparse as sp

            matrix = sp.block_diag([matrix, matrix], format="csr")
        return param, var, delta, lv[:, None], ix[:, None], matrix
    lev, idx = path_nodes(_points(session), depth)
    return param, var, delta, lev, idx, None


def _budget_of(noise: str, eps: float | None, rho: float | None) -> Fraction:
    from clipless.stats.tree import noise_budget

    return noise_budget(noise, eps, rho)[0]


def _all_nodes(session: Session) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Every node that carries noise (both class trees, tags 0 and 1, for a ROC)."""
    from clipless.federated.noise import TAG_SHIFT, node_ids

    plan = _plan(session)
    if plan is not None:
        from clipless.stats.counting import kary_released_nodes

        return kary_released_nodes(int(session.size), plan, session.neighbouring)

    depth = int(int(session.size) - 1).bit_length()
    lv, ix = node_ids(depth)
    if _is_roc(session):
        return np.concatenate([lv, lv + (1 << TAG_SHIFT)]), np.concatenate([ix, ix])
    return lv, ix


def _server_addr(session: Session, j: int) -> tuple[str, int]:
    return session.servers_at[j]


# --------------------------------------------------------------------------------------------
# parties
# --------------------------------------------------------------------------------------------


def _credentials(session: Session, secret: PartySecret, me: Party | None = None) -> Credentials:
    """The TLS identity of ``secret``'s party; ``me``: the party it must be (a wrong secret is
    named here, before any connection)."""
    if me is not None and secret.party != party_name(me):
        raise ValueError(f"{party_name(me)} was given {secret.party}'s secret")
    return Credentials(secret.party, secret.tls_cert, secret.tls_key, session.ca)


def _send_one(
    session: Session,
    keys: dict[str, bytes],
    tls: ssl.SSLContext,
    me: Party,
    j: int,
    mtype: int,
    payload: bytes,
    counter: Counter,
    deadline: float,
    fault: str = "",
) -> None:
    """Connect to server ``j``, send one frame, wait for its ``ACK``.

    A connection that drops before the ``ACK`` (e.g. pushed out of a flooded server's inbox)
    is opened again and the same message resent until ``deadline``; the server acknowledges a
    byte-identical replay again and changes nothing."""
    from clipless.federated.transport import encode_frame

    peer: Party = ("server", j)
    sid = bytes.fromhex(session.session_id)
    host, port = _server_addr(session, j)
    after: Callable[[], None] | None = None
    wait = 0.05
    while True:
        try:
            with connect(host, port, peer, deadline, tls) as sock:
                if fault == "tamper":  # test hook: flip one payload bit after signing
                    key = keys[party_name(peer)]
                    bad = bytearray(encode_frame(key, sid, me, peer, mtype, payload))
                    bad[30] ^= 1
                    sock.sendall(bytes(bad))
                    counter.add(me, peer, len(bad))
                elif fault == "short":  # test hook: a well-signed message of the wrong size
                    send_frame(sock, keys[party_name(peer)], sid, me, peer, mtype, payload[:-8],
                               counter)  # fmt: skip
                elif fault == "stranger":  # test hook: unauthenticated connections around it
                    after = _stranger(sock, tls, keys[party_name(peer)], sid, me, peer,
                                      (mtype, payload), counter, deadline)  # fmt: skip
                elif fault == "die":  # test hook: crash half way through the message
                    data = encode_frame(keys[party_name(peer)], sid, me, peer, mtype, payload)
                    sock.sendall(data[: len(data) // 2])
                    os._exit(17)
                else:
                    send_frame(sock, keys[party_name(peer)], sid, me, peer, mtype, payload, counter)
                reply = recv_frame(sock, keys, sid, me, deadline, party_name(peer))
                if reply.mtype != ACK:
                    raise ProtocolError(f"{party_name(peer)} did not acknowledge", party_name(peer))
            break
        except PartyDroppedError:
            if fault or time.monotonic() + wait >= deadline:
                raise
            time.sleep(wait)
            wait = min(2 * wait, 0.5)
    if after is not None:
        after()


def _stranger(
    sock: ssl.SSLSocket,
    tls: ssl.SSLContext,
    key: bytes,
    sid: bytes,
    me: Party,
    peer: Party,
    message: tuple[int, bytes],
    counter: Counter,
    deadline: float,
) -> Callable[[], None]:
    """Test hook (``fault="stranger"``): what anyone who can reach a server's port may send,
    and what a party holding a valid certificate may get wrong.

    Before the owner's real message: an idle TCP connection held open throughout, an HTTP
    request (not TLS), and over TLS with this owner's own certificate a frame signed with a
    wrong key, a frame addressed to another server, a frame in another party's name and a frame
    cut short after its header; after it (and its ACK, read by the caller), a byte-identical
    replay of the message on a fresh connection (the returned function, called once the ACK is
    in). None may change the release."""
    from clipless.federated.transport import encode_frame

    mtype, payload = message
    host, port = sock.getpeername()[:2]
    idle = socket.create_connection((host, port))
    with socket.create_connection((host, port)) as junk:
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n")
    for data in (
        encode_frame(secrets.token_bytes(32), sid, me, peer, mtype, payload),
        encode_frame(key, sid, me, ("server", peer[1] + 1), mtype, payload),
        encode_frame(key, sid, ("owner", me[1] + 1000), peer, mtype, payload),
        encode_frame(key, sid, me, peer, mtype, payload)[:31],  # cut short
    ):
        with connect(host, port, peer, deadline, tls) as bad:
            bad.sendall(data)
    send_frame(sock, key, sid, me, peer, mtype, payload, counter)
    frame = encode_frame(key, sid, me, peer, mtype, payload)

    def replay() -> None:
        # the server may be done by now (its listener closed): a refused replay is fine too
        with (
            contextlib.suppress(OSError, FederatedError),
            connect(host, port, peer, deadline, tls) as again,
        ):
            again.sendall(frame)
            again.settimeout(5.0)
            again.recv(1 << 16)
        idle.close()

    return replay


def run_owner(
    session: Session,
    secret: PartySecret,
    index: int,
    values: Sequence[float],
    fault: str = "",
    labels: Sequence[int] | None = None,
) -> Counter:
    """Owner ``index``: send its share (or DCF key) of ``values`` to every server (for a ROC
    session, of both classes' counts, so that the labels stay hidden).

    Args:
        session: the public session (:func:`make_session`, ``session.json``).
        secret: this owner's secret (its link keys and TLS credentials).
        index: this owner's index, from 0.
        values: its finite values (one, unless the session has a public ``n_values``).
        fault: a test hook (``"sleep"``, ``"tamper"``, ...); ``""``: none.
        labels: with a ROC session, one 0/1 label per value.

    Returns:
        The bytes sent on each of its links (a :class:`~clipless.federated.transport.Counter`).

    Raises:
        ValueError: values that are not finite numbers, or more than one value where the
            session's public ``n`` counts one per owner.
    """
    from clipless.federated.ustat import owner_messages

    me: Party = ("owner", index)
    keys = dict(secret.links)
    tls = client_context(_credentials(session, secret, me))
    counter = Counter()
    deadline = time.monotonic() + float(session.timeout)
    if fault == "sleep":  # test hook: a slow owner
        time.sleep(float(session.timeout) + 0.5)
    thresholds = np.asarray(session.thresholds, dtype=np.float64)
    vals = np.asarray(values, dtype=np.float64)
    if vals.ndim != 1 or not np.all(np.isfinite(vals)):
        raise ValueError(f"owner {index}: values must be finite numbers")
    if session.one_value_per_owner and vals.size != 1:
        # the public n defaults to one value per owner; more would be divided by the wrong n
        raise ValueError(
            f"owner {index}: this session's public n is {session.n_values}, one value per "
            f"owner, but this owner holds {vals.size}; start the session with --n-values (the "
            "total number of values)"
        )
    # as Grid.leaf_index: the first threshold >= value, clamped to the grid
    leaves = np.minimum(np.searchsorted(thresholds, vals, side="left"), thresholds.size - 1).astype(
        np.int64
    )
    m = int(session.servers)
    if _is_roc(session):
        y = np.asarray(labels if labels is not None else [], dtype=np.int64)
        if y.shape != vals.shape or not np.all((y == 0) | (y == 1)):
            raise ValueError(f"owner {index}: one 0/1 label per value is needed")
        if session.protocol == "fss":
            from clipless.federated.dcf import prefix_dcf_keys

            pairs = [prefix_dcf_keys(leaves, (y == c).astype(np.int64), _n_bits(session))
                     for c in (0, 1)]  # fmt: skip
            msgs = [pairs[0][j].to_bytes() + pairs[1][j].to_bytes() for j in (0, 1)]
            mtype = KEYS
        else:
            pts = _points(session)
            u = np.concatenate([
                np.searchsorted(np.sort(leaves[y == c]), pts, side="right") for c in (0, 1)
            ]).astype(np.int64)  # fmt: skip
            msgs, mtype = owner_messages(u, m), SHARE
    elif session.protocol == "fss":
        from clipless.federated.dcf import gen_dcf

        pair = gen_dcf(leaves, _n_bits(session))
        msgs, mtype = [pair[0].to_bytes(), pair[1].to_bytes()], KEYS
    else:
        pts = _points(session)
        u = np.searchsorted(np.sort(leaves), pts, side="right").astype(np.int64)
        msgs, mtype = owner_messages(u, m), SHARE
    for j in range(m):
        _send_one(session, keys, tls, me, j, mtype, msgs[j], counter, deadline, fault)
    return counter


def run_dealer(session: Session, secret: PartySecret) -> Counter:
    """The noise dealer: node-noise shares for every node of the tree, to every server.

    Args:
        session: the public session.
        secret: the dealer's secret (its link keys, TLS credentials and noise key).

    Returns:
        The bytes sent on each of its links.
    """
    from clipless.federated.ustat import NoiseDealer

    me: Party = ("dealer", 0)
    keys = dict(secret.links)
    tls = client_context(_credentials(session, secret, me))
    counter = Counter()
    deadline = time.monotonic() + float(session.timeout)
    param = _noise_setup(session)[0]
    levels, index = _all_nodes(session)
    dealer = NoiseDealer(secret.noise_key or b"", int(session.servers))
    msgs = dealer.messages(session.noise, param, levels, index)
    for j, msg in enumerate(msgs):
        _send_one(session, keys, tls, me, j, NOISE, msg, counter, deadline)
    return counter


_Inbox = Inbox  # the name the tests and earlier code use


def server_noise_key(session: Session, own_key: bytes | None = None) -> bytes:
    """A ``"distributed"`` server's node-noise key for this session's tree: its own 16-byte
    ``own_key`` (kept by the server, e.g. ``serve --noise-key-file``) or, by default, a fresh
    one drawn here and never written, bound to the tree (:func:`~clipless.federated.noise.
    tree_key`). No other party ever sees it."""
    key = secrets.token_bytes(16) if own_key is None else bytes(own_key)
    return tree_key(key, _context(session))


def run_server(
    session: Session,
    secret: PartySecret,
    index: int,
    listener: socket.socket,
    noise_key: bytes | None = None,
) -> Counter:
    """Server ``index``: collect one message from every owner (and the dealer), answer the
    analyst with its output share, or with the named error it saw.

    ``"distributed"``: the server adds its own node noise, keyed by :func:`server_noise_key`
    of ``noise_key`` (its own key; default a fresh one). The secret file holds link keys only.

    Only authenticated input can end the run early (a well-signed malformed message, or two
    different messages from one party); an unauthenticated connection is dropped without
    effect (:class:`_Inbox`), and a byte-identical replay of an accepted frame is ignored.

    Args:
        session: the public session.
        secret: this server's secret (its link keys and TLS credentials).
        index: this server's index, from 0.
        listener: the bound, listening socket at this server's address.
        noise_key: with ``"distributed"``, this server's own 16-byte key (``None``: fresh).

    Returns:
        The bytes sent on each of its links.
    """
    me: Party = ("server", index)
    keys = dict(secret.links)
    sid = bytes.fromhex(session.session_id)
    counter = Counter()
    m, n = int(session.servers), int(session.owners)
    timeout = float(session.timeout)
    dealer = session.noise_sharing == "dealer"
    own = None if dealer else server_noise_key(session, noise_key)
    expected = {f"owner {i}" for i in range(n)} | ({"dealer 0"} if dealer else set())
    got: dict[str, Frame] = {}
    analysts: list[tuple[ssl.SSLSocket, Frame]] = []
    error: FederatedError | None = None
    deadline = time.monotonic() + timeout
    tls = server_context(_credentials(session, secret, me))
    inbox = Inbox(listener, keys, sid, me, cap=max(64, 4 * (len(keys) + 1)), tls=tls)
    try:
        while error is None and set(got) != expected:
            if time.monotonic() >= deadline:
                error = inbox.missing_error(index, sorted(expected - set(got)), timeout)
                break
            for conn, frame in inbox.poll(deadline):
                who = party_name(frame.sender)
                if frame.sender[0] == "analyst":
                    analysts.append((conn, frame))
                    continue
                if who not in expected:
                    error = error or ProtocolError(
                        f"server {index}: unexpected message from {who}", who
                    )
                elif who in got and (got[who].mtype, got[who].payload) != (
                    frame.mtype,
                    frame.payload,
                ):
                    error = error or ProtocolError(
                        f"server {index}: two different messages from {who}", who
                    )
                elif error is None:
                    # new, or a byte-identical replay of an accepted frame (acknowledged again,
                    # so that a party retrying after a lost ACK succeeds; nothing changes)
                    got[who] = frame
                    # the message is in and verified; a peer gone before the ACK changes nothing
                    conn.settimeout(5.0)
                    with contextlib.suppress(FederatedError):
                        send_frame(conn, keys[who], sid, me, frame.sender, ACK, b"", counter)
                conn.close()
        output: bytes | None = None
        if error is None:
            try:
                output = _server_output(session, index, m, got, own)
            except FederatedError as exc:
                error = exc
            except ValueError as exc:
                error = ProtocolError(f"server {index}: invalid message ({exc})")
        # answer the analyst (wait for it if it has not asked yet; late messages are turned away)
        wait_until = time.monotonic() + timeout
        while not analysts and time.monotonic() < wait_until:
            for conn, frame in inbox.poll(wait_until):
                if frame.sender[0] == "analyst":
                    analysts.append((conn, frame))
                else:
                    conn.close()
    finally:
        inbox.close()
    for conn, frame in analysts:
        # every verified request is answered (a replayed one gets the same share, which the
        # wire shows anyway): a replay cannot take the analyst's place
        if frame.mtype == REQUEST:
            key = keys[party_name(frame.sender)]
            conn.settimeout(timeout)
            with contextlib.suppress(FederatedError):
                if error is None and output is not None:
                    send_frame(conn, key, sid, me, frame.sender, RESULT, output, counter)
                else:
                    assert error is not None
                    body = (
                        bytes([error.code])
                        + json.dumps({"message": str(error), "party": error.party}).encode()
                    )
                    send_frame(conn, key, sid, me, frame.sender, ERROR, body, counter)
        conn.close()
    if error is not None:
        raise error
    return counter


def _server_output(
    session: Session, index: int, m: int, got: dict[str, Frame], noise_key: bytes | None
) -> bytes:
    from clipless.federated.ustat import ShareServer

    pts = _points(session)
    roc = _is_roc(session)
    srv = ShareServer(index, m, pts.size * (2 if roc else 1), noise_key=noise_key)
    owners = sorted((w for w in got if w.startswith("owner")), key=lambda w: int(w.split()[1]))
    if session.protocol == "fss":
        from clipless.federated.dcf import DcfKeys, server_prefix_shares

        for w in owners:
            if got[w].mtype != KEYS:
                raise ProtocolError(f"server {index}: {w} sent no DCF keys", w)
        if roc:
            from clipless.federated.dcf import prefix_dcf_shares

            parts: list[NDArray[np.uint64]] = []
            for c in (0, 1):  # each owner's message: its class-0 keys, then its class-1 keys
                halves = []
                for w in owners:
                    data = got[w].payload
                    if len(data) % 2:
                        raise ProtocolError(f"malformed DCF keys from {w}", w)
                    halves.append(data[c * len(data) // 2 : (c + 1) * len(data) // 2])
                try:
                    keys = DcfKeys.from_bytes(b"".join(halves), index, _n_bits(session) + 1)
                except ValueError as exc:
                    raise ProtocolError(f"server {index}: malformed DCF keys ({exc})") from None
                parts.append(prefix_dcf_shares(keys, pts))
            srv.add_plain(np.concatenate(parts))
        else:
            try:
                keys = DcfKeys.from_bytes(
                    b"".join(got[w].payload for w in owners), index, _n_bits(session)
                )
            except ValueError as exc:
                raise ProtocolError(f"server {index}: malformed DCF keys ({exc})") from None
            if session.n_values is not None and len(keys) != int(session.n_values):
                # one key per value: the true total is known here (public under replace-one)
                raise ProtocolError(
                    f"server {index}: the owners sent {len(keys)} DCF keys (one per value) but "
                    f"the session's public n is {session.n_values}: the ECDF would be divided "
                    "by the wrong n; start a session with the right --n-values"
                )
            srv.add_plain(server_prefix_shares(keys, pts))
    else:
        for w in owners:
            if got[w].mtype != SHARE:
                raise ProtocolError(f"server {index}: {w} sent no share", w)
            try:
                srv.receive_share(got[w].payload)
            except ValueError as exc:
                raise ProtocolError(f"malformed share from {w}: {exc}", w) from None
    param, _, _, lev, idx, matrix = _noise_setup(session)
    if session.noise_sharing == "dealer":
        levels, index_all = _all_nodes(session)
        try:
            srv.receive_noise(got["dealer 0"].payload, levels, index_all)
        except ValueError as exc:
            raise ProtocolError(
                f"malformed noise shares from dealer 0: {exc}", "dealer 0"
            ) from None
    out = srv.output(session.noise, param, lev, idx, matrix)
    return out.astype("<u8").tobytes()


def run_analyst(session: Session, secret: PartySecret) -> tuple[NDArray[np.int64], Counter]:
    """Ask every server for its share; sum them (or raise the error a server reports).

    Args:
        session: the public session.
        secret: the analyst's secret (its link keys and TLS credentials).

    Returns:
        ``(output, traffic)``: the released integer vector and the bytes sent on its links.
    """
    from clipless.federated.ustat import combine

    me: Party = ("analyst", 0)
    keys = dict(secret.links)
    tls = client_context(_credentials(session, secret, me))
    sid = bytes.fromhex(session.session_id)
    counter = Counter()
    deadline = time.monotonic() + 2 * float(session.timeout) + 5.0
    shares = []
    for j in range(int(session.servers)):
        peer: Party = ("server", j)
        host, port = _server_addr(session, j)
        reach_by = min(deadline, time.monotonic() + float(session.timeout))
        with connect(host, port, peer, reach_by, tls) as sock:
            send_frame(sock, keys[party_name(peer)], sid, me, peer, REQUEST, b"", counter)
            frame = recv_frame(sock, keys, sid, me, deadline, party_name(peer))
        if frame.mtype == ERROR:
            info = json.loads(frame.payload[1:].decode())
            cls = ERRORS.get(frame.payload[0], FederatedError)
            raise cls(f"server {j} reports: {info['message']}", info["party"])
        if frame.mtype != RESULT:
            raise ProtocolError(f"server {j} sent no result", f"server {j}")
        shares.append(np.frombuffer(frame.payload, dtype="<u8").astype(np.uint64))
    if len({s.size for s in shares}) != 1:
        raise ProtocolError("the servers' results have different lengths")
    return combine(shares), counter


# --------------------------------------------------------------------------------------------
# simulation on loopback
# --------------------------------------------------------------------------------------------


@dataclass
class SimulationResult:
    """The release and what it cost on the wire (whole frames, all links)."""

    ecdf: Any
    release: Any
    prefix_counts: NDArray[np.int64] | NDArray[np.float64]
    values: NDArray[np.float64]
    points: NDArray[np.int64]
    wall_time: float
    sent: dict[str, int] = field(default_factory=dict)
    roc: Any = None

    @property
    def total(self) -> int:
        """Bytes sent on all links (whole frames)."""
        return sum(self.sent.values())

    def by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for link, nbytes in self.sent.items():
            role = link.split()[0]
            out[role] = out.get(role, 0) + nbytes
        return out


def make_session(
    protocol: Protocol,
    owners: int,
    servers: int,
    size: int,
    epsilon: float | None,
    *,
    noise_sharing: NoiseSharing = "dealer",
    lower: float = 0.0,
    upper: float = 1.0,
    points: Sequence[int] | None = None,
    neighbouring: Neighbouring = "replace_one",
    noise: Noise = "laplace",
    rho: float | None = None,
    timeout: float = 30.0,
    noise_keys: Sequence[bytes] | None = None,
    n_values: int | None = None,
    statistic: Statistic = "ecdf",
    mechanism: str = "auto",
) -> tuple[Session, dict[str, PartySecret]]:
    """A fresh public session and every party's secret: the pairwise link keys, its TLS key
    and certificate (signed by the session's fresh CA, whose private key is then discarded:
    :mod:`clipless.federated.tls`) and, with ``noise_sharing="dealer"``, the dealer's noise key
    (``noise_keys=[K]`` or fresh).

    With ``"distributed"`` no noise key is written anywhere: each server draws its own when it
    serves (:func:`run_server`), so whoever runs this (``clipless federated init``) knows
    nothing of the noise; ``noise_keys`` is then refused (reproducible server keys are given to
    the servers themselves: :func:`simulate`'s ``noise_keys``, ``serve --noise-key-file``).

    Args:
        protocol: ``"shares"`` (``servers >= 2``) or ``"fss"`` (two servers, replace-one).
        owners: the number of data owners, ``>= 1``.
        servers: the number of servers.
        size: the number of grid thresholds, evenly spaced on ``[lower, upper]``.
        epsilon: the budget for Laplace noise (``None`` with ``noise="gaussian"``).
        noise_sharing: ``"dealer"`` or ``"distributed"`` (above).
        lower, upper: the grid's ends (public, chosen without the data).
        points: grid indices of a pointwise query (binary tree); ``None``: the whole grid.
        neighbouring: ``"replace_one"`` or ``"add_remove"``.
        noise: ``"laplace"`` or ``"gaussian"``.
        rho: the zCDP budget for Gaussian noise.
        timeout: seconds each party waits for a message, in ``(0, MAX_TIMEOUT]``.
        noise_keys: the dealer's key ``[K]`` (``None``: fresh); refused with ``"distributed"``.
        n_values: the public total number of values under replace-one (``None``: one value per
            owner); must be ``None`` under add/remove, where it is private.
        statistic: ``"ecdf"`` or ``"roc"`` (owners hold scores and 0/1 labels; whole grid).
        mechanism: ``"auto"`` (default) releases a whole-grid ECDF with the central default's
            ``k``-ary plan (:func:`~clipless.stats.counting.counting_plan`, fixed here and
            written into the public session as ``"kary"``); ``"binary"``, a ROC curve or
            ``points`` use the binary tree.

    Returns:
        ``(session, secrets)``: the public session and each party's secret, by party name.

    Raises:
        ValueError: an option outside the accepted values, or options that do not go together.
    """
    if mechanism not in ("auto", "binary", "k-ary"):
        raise ValueError(f"mechanism must be 'auto', 'binary' or 'k-ary', got {mechanism!r}")
    if statistic not in ("ecdf", "roc"):
        raise ValueError(f"statistic must be 'ecdf' or 'roc', got {statistic!r}")
    if statistic == "roc" and points is not None:
        raise ValueError("statistic='roc' releases the whole grid: points must be None")
    check_protocol(protocol, servers, neighbouring, ("shares", "fss"))
    if servers < 2:
        raise ValueError(f"servers must be >= 2, got {servers}")
    if owners < 1:
        raise ValueError(f"owners must be >= 1, got {owners}")
    if noise_sharing not in ("dealer", "distributed"):
        raise ValueError(f"noise_sharing must be 'dealer' or 'distributed', got {noise_sharing!r}")
    from clipless.stats.grid import Grid

    grid = Grid(lower, upper, size=size)
    _check_release(grid, neighbouring, noise, epsilon, rho, n_values, timeout, points)
    _check_noise_sharing(noise_sharing, noise_keys)
    kary = None
    if mechanism != "binary" and statistic == "ecdf" and points is None:
        from clipless.stats.counting import counting_plan

        budget = _budget_of(noise, epsilon, rho)
        plan = counting_plan(size, neighbouring, noise, budget)
        kary = (plan.branching, tuple(str(w) for w in plan.shares))
    elif mechanism == "k-ary":
        raise ValueError("mechanism='k-ary' is for a whole-grid ECDF (points None, statistic ecdf)")
    parties = (
        [f"owner {i}" for i in range(owners)]
        + [f"server {j}" for j in range(servers)]
        + ["analyst 0"]
        + (["dealer 0"] if noise_sharing == "dealer" else [])
    )
    sid = secrets.token_hex(16)
    ca, certs = make_authority(sid, parties)
    session = Session(
        session_id=sid, statistic=statistic, thresholds=tuple(grid.thresholds.tolist()),
        protocol=protocol, servers=servers, owners=owners, noise_sharing=noise_sharing,
        lower=float(lower), upper=float(upper), size=size,
        points=None if points is None else tuple(int(p) for p in points),
        epsilon=epsilon, rho=rho, noise=noise, neighbouring=neighbouring, timeout=timeout,
        # replace-one: the public n (by default one value per owner, checked by the owners);
        # add/remove: none (the number of values is private, and owners hold any number)
        n_values=None if neighbouring == "add_remove" else n_values if n_values else owners,
        one_value_per_owner=neighbouring == "replace_one" and n_values is None,
        servers_at=(), kary=kary, ca=ca,
    )  # fmt: skip
    links: dict[str, dict[str, bytes]] = {p: {} for p in parties}
    for j in range(servers):
        for p in parties:
            if not p.startswith("server"):
                links[p][f"server {j}"] = links[f"server {j}"][p] = secrets.token_bytes(32)
    noise_key = None
    if noise_sharing == "dealer":
        nk = secrets.token_bytes(16) if noise_keys is None else bytes(next(iter(noise_keys)))
        # the dealer holds the key bound to this tree (grid, statistic, shape): noise.tree_key
        noise_key = tree_key(nk, _context(session))
    secret = {
        p: PartySecret(
            p, links[p], certs[p][1], certs[p][0], noise_key if p == "dealer 0" else None
        )
        for p in parties
    }
    return session, secret


def _check_release(
    grid: Any,
    neighbouring: Neighbouring,
    noise: Noise,
    epsilon: float | None,
    rho: float | None,
    n_values: int | None,
    timeout: float,
    points: Sequence[int] | None,
) -> None:
    """:func:`make_session`'s release arguments, each named in its error (``neighbouring``
    already checked with the protocol)."""
    if noise not in ("laplace", "gaussian"):
        raise ValueError(f"noise must be 'laplace' or 'gaussian', got {noise!r}")
    from clipless.federated.ecdf import _points, noise_parameter
    from clipless.stats.tree import tree_depth

    # the budget is checked now, not by the dealer or the servers mid-run
    noise_parameter(tree_depth(len(grid)), neighbouring, noise, epsilon, rho)
    if n_values is not None and (
        isinstance(n_values, bool) or not isinstance(n_values, int) or n_values < 1
    ):
        raise ValueError(f"n_values must be an integer >= 1 or None; got {n_values!r}")
    if n_values is not None and neighbouring == "add_remove":
        raise ValueError(
            "n_values must be None under neighbouring='add_remove', where the number of values "
            "is private (the release is normalised by its noisy total)"
        )
    if isinstance(timeout, bool) or not (
        isinstance(timeout, int | float) and 0 < timeout <= MAX_TIMEOUT
    ):
        raise ValueError(
            f"timeout must be a number of seconds > 0 and <= {MAX_TIMEOUT} (30 days), got "
            f"{timeout!r}"
        )
    if points is not None:
        try:  # grid indices in [0, size), strictly increasing
            _points(np.asarray(points), len(grid))
        except ValueError as exc:
            raise ValueError(f"points: {exc}") from None


def _check_noise_sharing(noise_sharing: str, noise_keys: Sequence[bytes] | None) -> None:
    if noise_sharing == "distributed" and noise_keys is not None:
        raise ValueError(
            "noise_keys must be None with noise_sharing='distributed', where each server draws "
            "its own key (give reproducible keys to simulate(noise_keys=...) or serve "
            "--noise-key-file)"
        )
    if noise_sharing == "dealer":
        _check_noise_keys(noise_keys, 1)


def _check_noise_keys(noise_keys: Sequence[bytes] | None, need: int) -> None:
    if noise_keys is None:
        return
    if isinstance(noise_keys, str | bytes | bytearray):
        raise TypeError(
            "noise_keys must be a list of 16-byte keys (bytes), one per noise source; got a "
            f"single {type(noise_keys).__name__}"
        )
    nk = list(noise_keys)
    if len(nk) != need:
        raise ValueError(f"noise_keys must hold {need} key(s), got {len(nk)}")
    if len(set(map(bytes, nk))) != len(nk):
        raise ValueError(
            "noise_keys must be distinct: servers holding the same key add the same noise, so any "
            "one of them knows the whole noise"
        )


def _child(target: Callable[..., Counter], args: tuple[Any, ...], conn: Any) -> None:
    try:
        counter = target(*args)
        conn.send({"sent": dict(counter.sent), "error": None})
    except FederatedError as exc:
        conn.send({"sent": {}, "error": (exc.code, str(exc), exc.party)})
    except Exception as exc:  # pragma: no cover - reported, never swallowed
        conn.send({"sent": {}, "error": (0, f"{type(exc).__name__}: {exc}", "")})
    finally:
        conn.close()


def simulate(
    protocol: Protocol,
    owner_values: Sequence[Sequence[float]],
    servers: int,
    size: int,
    epsilon: float | None,
    *,
    spawn: str = "fork",
    faults: dict[str, str] | None = None,
    kill_server: int | None = None,
    smoothing: str | None = "isotonic",
    consistency: bool = True,
    owner_labels: Sequence[Sequence[int]] | None = None,
    **session_kwargs: Any,
) -> SimulationResult:
    """Run one release with every party a separate process on 127.0.0.1.

    Args:
        protocol: ``"shares"`` or ``"fss"`` (:func:`~clipless.federated.federated_ecdf`).
        owner_values: ``owner_values[k]`` is owner ``k``'s values.
        servers: the number of server processes.
        size: the number of grid thresholds on ``[lower, upper]`` (:func:`make_session`).
        epsilon: the budget for Laplace noise (``None`` with ``noise="gaussian"`` and ``rho``).
        spawn: ``"fork"`` or ``"subprocess"`` (each party a ``clipless federated`` command).
        faults: for tests, ``{"owner 2": "die" | "sleep" | "tamper" | "short" | "stranger"}``.
        kill_server: for tests, SIGKILL that server once every process has started.
        smoothing, consistency: the post-processing, as in :func:`clipless.stats.ecdf`.
        owner_labels: with ``statistic="roc"``, owner ``k``'s 0/1 labels, one per value: the
            ROC release of :func:`clipless.federated.federated_roc` over TCP (result in
            :attr:`SimulationResult.roc`).
        session_kwargs: :func:`make_session`'s options. ``noise_keys`` (reproducible runs):
            ``[K]`` for the dealer, or with ``noise_sharing="distributed"`` one distinct key
            per server, handed to that server only (:func:`server_noise_key`), never written
            into a session's secrets.

    Returns:
        The :class:`SimulationResult`: the release, the bytes each role sent and the wall time.

    Raises:
        FederatedError: the subclass naming the failing party (the analyst's carries what the
            servers saw).
        ValueError: an option outside the accepted values.
    """
    if spawn not in ("fork", "subprocess"):
        raise ValueError(f"spawn must be 'fork' or 'subprocess', got {spawn!r}")
    faults = faults or {}
    n = len(owner_values)
    n_values: int | None = sum(len(v) for v in owner_values)
    if session_kwargs.get("neighbouring") == "add_remove":
        n_values = None  # private: the release normalises by its noisy total
    own_keys: list[bytes | None] = [None] * servers  # distributed: each server's own key
    if session_kwargs.get("noise_sharing") == "distributed":
        given = session_kwargs.pop("noise_keys", None)
        _check_noise_keys(given, servers)
        if given is not None:
            own_keys = [bytes(k) for k in given]
    session, secret = make_session(
        protocol, n, servers, size, epsilon, n_values=n_values, **session_kwargs
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="clipless-fed-") as tmp:
        procs: list[tuple[str, Any, Any]] = []
        try:
            if spawn == "fork":
                session = _launch_forks(
                    session, secret, owner_values, procs, kill_server, owner_labels, own_keys,
                    faults,
                )  # fmt: skip
            else:
                session = _launch_subprocesses(
                    session, secret, owner_values, Path(tmp), procs, kill_server, owner_labels,
                    own_keys,
                )  # fmt: skip
            out, sent = _analyst_and_reports(session, secret, procs, spawn)
        finally:
            for _, proc, _ in procs:
                _stop(proc)
    wall = time.perf_counter() - start
    return _finish(session, out, sent, wall, smoothing, consistency)


def _launch_forks(
    session: Session,
    secret: dict[str, PartySecret],
    owner_values: Sequence[Sequence[float]],
    procs: list[tuple[str, Any, Any]],
    kill_server: int | None,
    owner_labels: Sequence[Sequence[int]] | None,
    own_keys: list[bytes | None],
    faults: dict[str, str],
) -> Session:
    """Fork every party but the analyst (appended to ``procs`` with its report pipe); returns
    the session with the servers' listening addresses."""
    ctx = multiprocessing.get_context("fork")

    def launch(name: str, target: Callable[..., Counter], args: tuple[Any, ...]) -> None:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(target, args, child), daemon=True)
        proc.start()
        child.close()
        procs.append((name, proc, parent))

    for j in range(session.servers):
        # one listener at a time, closed here once forked: no other process holds it
        lst = socket.create_server(("127.0.0.1", 0))
        at = (*session.servers_at, ("127.0.0.1", lst.getsockname()[1]))
        session = session.with_servers_at(at)
        launch(f"server {j}", run_server, (session, secret[f"server {j}"], j, lst, own_keys[j]))
        lst.close()
    if kill_server is not None:
        procs[kill_server][1].kill()
        procs[kill_server][1].join()
    if session.noise_sharing == "dealer":
        launch("dealer 0", run_dealer, (session, secret["dealer 0"]))
    for i, vals in enumerate(owner_values):
        labels = None if owner_labels is None else list(owner_labels[i])
        args = (session, secret[f"owner {i}"], i, list(vals), faults.get(f"owner {i}", ""), labels)
        launch(f"owner {i}", run_owner, args)
    return session


def _analyst_and_reports(
    session: Session,
    secret: dict[str, PartySecret],
    procs: list[tuple[str, Any, Any]],
    spawn: str,
) -> tuple[NDArray[np.int64], dict[str, int]]:
    """Run the analyst here, then collect every party's report: ``(the analyst's output, bytes
    sent per party)``, or raise the analyst's error, else the first party's."""
    analyst_error: FederatedError | None = None
    sent: dict[str, int] = {}
    out: NDArray[np.int64] | None = None
    try:
        out, counter = run_analyst(session, secret["analyst 0"])
        sent.update(counter.sent)
    except FederatedError as exc:
        analyst_error = exc
    party_errors: list[FederatedError] = []
    grace = 0.5 if analyst_error is not None else float(session.timeout) + 10.0
    for name, proc, channel in procs:
        report = _collect(name, proc, channel, spawn, grace)
        if report is None:
            continue
        sent.update(report["sent"])
        if report["error"] is not None:
            code, message, party = report["error"]
            party_errors.append(ERRORS.get(code, FederatedError)(message, party))
    if analyst_error is not None:
        raise analyst_error
    if party_errors:
        raise party_errors[0]
    assert out is not None  # run_analyst returned
    return out, sent


def _finish(
    session: Session,
    out: NDArray[np.int64],
    sent: dict[str, int],
    wall: float,
    smoothing: str | None,
    consistency: bool,
) -> SimulationResult:
    from clipless.federated.ecdf import assemble

    param, var, delta, _, _, _ = _noise_setup(session)
    m_noise = int(session.servers) if session.noise_sharing == "distributed" else 1
    pts = _points(session)
    whole = session.points is None
    nb, eps, rho = _budget(session)
    plan = _plan(session)
    if plan is not None:
        from clipless.stats.counting import kary_estimate
        from clipless.stats.ecdf import from_release

        n_pub = int(session.n_values or 0)
        kary = kary_estimate(
            out, len(pts), plan, nb, session.noise, _budget_of(session.noise, eps, rho),  # type: ignore[arg-type]
            n_pub, eps if session.noise == "laplace" else None, rho, m_noise,
        )  # fmt: skip
        Fk = from_release(
            kary, _grid(session), n=n_pub if nb == "replace_one" else None,
            smoothing=smoothing,  # type: ignore[arg-type]
        )  # fmt: skip
        return SimulationResult(
            Fk, kary, kary.prefix_counts, np.asarray(Fk.values), pts, wall, dict(sent)
        )
    if not _is_roc(session):
        counts, values, release, F = assemble(
            out, _grid(session), pts, whole, int(session.n_values or 0), session.noise,
            param, var * m_noise, delta, eps, rho, nb,  # type: ignore[arg-type]
            smoothing, consistency,  # type: ignore[arg-type]
        )  # fmt: skip
        return SimulationResult(F, release, counts, values, pts, wall, dict(sent))
    from clipless.stats.roc import DPROC

    half = out.size // 2
    curves = []
    for part in (out[:half], out[half:]):
        _, _, _, Fc = assemble(
            part, _grid(session), pts, True, 0, session.noise, param, var * m_noise,
            delta, eps, rho, "add_remove", smoothing, consistency,  # type: ignore[arg-type]
        )  # fmt: skip
        curves.append(Fc)
    neg, pos = curves
    assert neg is not None and pos is not None
    fpr, tpr = 1.0 - np.asarray(neg.values), 1.0 - np.asarray(pos.values)
    roc = DPROC(
        thresholds=neg.grid.thresholds, fpr=fpr, tpr=tpr, negatives=neg, positives=pos,
        epsilon=session.epsilon, rho=session.rho, neighbouring=session.neighbouring,
        smoothing=smoothing,  # type: ignore[arg-type]
    )  # fmt: skip
    counts = np.concatenate([neg.release.prefix_counts, pos.release.prefix_counts])
    return SimulationResult(
        None, None, counts, np.concatenate([neg.values, pos.values]), pts, wall, dict(sent), roc
    )


def _collect(name: str, proc: Any, channel: Any, spawn: str, wait: float) -> dict[str, Any] | None:
    if spawn == "fork":
        if channel.poll(wait):
            try:
                return dict(channel.recv())
            except EOFError:
                pass
        proc.join(1.0)
        if proc.exitcode not in (0, None) and proc.exitcode != -signal.SIGKILL:
            return {"sent": {}, "error": (3, f"{name} crashed (exit code {proc.exitcode})", name)}
        return None
    try:
        stdout, _ = proc.communicate(timeout=wait)
    except subprocess.TimeoutExpired:
        return {"sent": {}, "error": (2, f"{name} did not finish in time", name)}
    for line in reversed(stdout.decode(errors="replace").splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    if proc.returncode not in (0, -signal.SIGKILL):
        return {"sent": {}, "error": (3, f"{name} crashed (exit code {proc.returncode})", name)}
    return None


def _stop(proc: Any) -> None:
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    elif proc.is_alive():
        proc.kill()
        proc.join()


def _launch_subprocesses(
    session: Session,
    secret: dict[str, PartySecret],
    owner_values: Sequence[Sequence[float]],
    tmp: Path,
    procs: list[tuple[str, Any, Any]],
    kill_server: int | None,
    owner_labels: Sequence[Sequence[int]] | None = None,
    own_keys: Sequence[bytes | None] | None = None,
) -> Session:
    """Start ``clipless federated serve/dealer/owner`` processes (servers first, on port 0);
    a ``"distributed"`` server given its own key gets it in its own ``--noise-key-file``.
    Returns the session with the servers' addresses."""
    exe = [sys.executable, "-m", "clipless.federated.cli"]  # fast start: no torch, no scipy
    env = dict(os.environ)

    def secret_file(name: str) -> str:
        path = tmp / f"{name.replace(' ', '-')}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(secret[name].to_json(), fh)
        return str(path)

    def key_file(j: int) -> list[str]:
        if own_keys is None or own_keys[j] is None:
            return []
        path = tmp / f"server-{j}.noise-key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(bytes(own_keys[j] or b"").hex() + "\n")
        return ["--noise-key-file", str(path)]

    pub = tmp / "session.json"
    pub.write_text(json.dumps(session.to_json()))
    for j in range(int(session.servers)):
        proc = subprocess.Popen(
            [
                *exe,
                "serve",
                str(pub),
                "--index",
                str(j),
                "--secret",
                secret_file(f"server {j}"),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *key_file(j),
            ],
            stdout=subprocess.PIPE,
            env=env,
        )
        procs.append((f"server {j}", proc, None))
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("listening "):
            raise PartyDroppedError(f"server {j} failed to start", f"server {j}")
        host, port = line.split()[1].rsplit(":", 1)
        session = session.with_servers_at([*session.servers_at, (host, int(port))])
    pub.write_text(json.dumps(session.to_json()))
    if kill_server is not None:
        procs[kill_server][1].kill()
        procs[kill_server][1].wait()
    if session.noise_sharing == "dealer":
        proc = subprocess.Popen(
            [*exe, "dealer", str(pub), "--secret", secret_file("dealer 0")],
            stdout=subprocess.PIPE,
            env=env,
        )
        procs.append(("dealer 0", proc, None))
    for i, vals in enumerate(owner_values):
        proc = subprocess.Popen(
            [
                *exe,
                "owner",
                str(pub),
                "--index",
                str(i),
                "--secret",
                secret_file(f"owner {i}"),
                "--values",
                ",".join(repr(float(v)) for v in vals),
                *(
                    []
                    if owner_labels is None
                    else ["--labels", ",".join(str(int(y)) for y in owner_labels[i])]
                ),
            ],
            stdout=subprocess.PIPE,
            env=env,
        )
        procs.append((f"owner {i}", proc, None))
    return session
