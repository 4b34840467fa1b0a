"""Length-prefixed, HMAC-SHA256-authenticated binary messages over mutually authenticated TLS
1.3 (:mod:`clipless.federated.tls`), with byte counters.

Frame layout (all integers big-endian)::

    magic "CLF1" (4) | type (1) | sender role (1) | sender index (4) | receiver role (1)
    | receiver index (4) | payload length (8) | payload | tag (32)

``tag = HMAC-SHA256(k_link, session id || header || payload)`` with the pre-shared key of the
(sender, receiver) link (RFC 2104; :mod:`hmac` with :func:`hmac.compare_digest`). The 16-byte
session id binds a frame to one run; each party accepts at most one message from each peer per
run, so a replayed frame changes nothing (a server acknowledges a byte-identical replay and
ignores it; a different second message is an error).

Every connection is TLS 1.3 with a certificate on both sides from the session's own authority
(:func:`connect` checks the server's name; a server takes the client's name from its
certificate, and :class:`FrameReader` accepts only frames sent in that name), so the frames are
confidential and tampering in transit breaks the TLS record (an :class:`AuthenticationError`).
The HMAC stays, inside TLS: it binds each message to the session id and to its link end to
end (whoever terminates TLS -- a proxy in front of a server -- still cannot forge or redirect a
frame), and it keeps the frame format and the byte counts of the cost model unchanged.

Failures are never silent. Every error names the party at fault:

* :class:`AuthenticationError` -- a frame whose tag does not verify, or from an unknown party;
  a peer certificate that does not verify or names another party; a TLS record that fails its
  integrity check (tampered in transit);
* :class:`PartyTimeoutError` -- a party that sent nothing (or not all of its frame) in time;
* :class:`PartyDroppedError` -- a party whose connection was refused or closed mid-message;
* :class:`ProtocolError` -- a well-authenticated but invalid message (wrong size, duplicate).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import struct
import time
from collections import defaultdict
from dataclasses import dataclass, field

from clipless.federated.tls import peer_name

__all__ = [
    "AuthenticationError",
    "Counter",
    "FederatedError",
    "Frame",
    "FrameReader",
    "PartyDroppedError",
    "PartyTimeoutError",
    "ProtocolError",
    "connect",
    "party_name",
    "recv_frame",
    "send_frame",
    "tls_error",
]

MAGIC = b"CLF1"
_HEADER = struct.Struct(">4sBBIBIQ")
TAG_BYTES = 32
MAX_PAYLOAD = 1 << 31
ROLES = ("owner", "server", "dealer", "analyst")

# message types
SHARE, KEYS, NOISE, ACK, REQUEST, RESULT, ERROR = range(1, 8)

Party = tuple[str, int]


def party_name(party: Party) -> str:
    """``"role index"``, e.g. ``"server 1"``: how messages and errors name a party."""
    return f"{party[0]} {party[1]}"


class FederatedError(RuntimeError):
    """A protocol failure; ``party`` names the party at fault (e.g. ``"owner 3"``)."""

    code = 0

    def __init__(self, message: str, party: str = "") -> None:
        super().__init__(message)
        self.party = party


class AuthenticationError(FederatedError):
    """A message failed HMAC-SHA256 verification (tampered, or from an unknown party), or the
    TLS layer refused a peer (certificate, name, or a record tampered in transit)."""

    code = 1


class PartyTimeoutError(FederatedError):
    """A party sent nothing, or not its whole message, before the deadline."""

    code = 2


class PartyDroppedError(FederatedError):
    """A party refused the connection or closed it mid-message (crashed or killed)."""

    code = 3


class ProtocolError(FederatedError):
    """An authenticated but invalid message (size, type, duplicate)."""

    code = 4


ERRORS: dict[int, type[FederatedError]] = {
    cls.code: cls
    for cls in (
        FederatedError,
        AuthenticationError,
        PartyTimeoutError,
        PartyDroppedError,
        ProtocolError,
    )
}


@dataclass
class Counter:
    """Bytes sent on each link ``"sender -> receiver"`` (whole frames, as on the wire)."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, sender: Party, receiver: Party, nbytes: int) -> None:
        self.sent[f"{party_name(sender)} -> {party_name(receiver)}"] += nbytes

    @property
    def total(self) -> int:
        return sum(self.sent.values())


@dataclass(frozen=True)
class Frame:
    mtype: int
    sender: Party
    payload: bytes
    nbytes: int


def _tag(key: bytes, session: bytes, header: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, session, hashlib.sha256)
    mac.update(header)
    mac.update(payload)
    return mac.digest()


def encode_frame(
    key: bytes, session: bytes, sender: Party, receiver: Party, mtype: int, payload: bytes
) -> bytes:
    header = _HEADER.pack(
        MAGIC,
        mtype,
        ROLES.index(sender[0]),
        sender[1],
        ROLES.index(receiver[0]),
        receiver[1],
        len(payload),
    )
    return header + payload + _tag(key, session, header, payload)


def send_frame(
    sock: socket.socket,
    key: bytes,
    session: bytes,
    sender: Party,
    receiver: Party,
    mtype: int,
    payload: bytes,
    counter: Counter,
) -> int:
    """Send one authenticated frame (:func:`encode_frame`) on ``sock``; count its bytes in
    ``counter`` and return them. Raises :class:`PartyTimeoutError` when the receiver does not
    accept it in time, :class:`PartyDroppedError` when the connection is closed."""
    data = encode_frame(key, session, sender, receiver, mtype, payload)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise PartyTimeoutError(
            f"{party_name(receiver)} did not accept data within the timeout",
            party_name(receiver),
        ) from None
    except ssl.SSLError as exc:
        if not isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError):
            raise tls_error(exc, party_name(receiver)) from None
        alert = _pending_alert(sock, party_name(receiver))
        if alert is not None:
            raise alert from None
        raise PartyDroppedError(
            f"{party_name(receiver)} closed the TLS connection ({exc}; if it persists, this "
            "party's certificate may not be of that session)",
            party_name(receiver),
        ) from None
    except OSError as exc:
        alert = _pending_alert(sock, party_name(receiver))
        if alert is not None:
            raise alert from None
        raise PartyDroppedError(
            f"{party_name(receiver)} closed the connection ({exc})", party_name(receiver)
        ) from None
    counter.add(sender, receiver, len(data))
    return len(data)


def _recv_exact(sock: socket.socket, n: int, deadline: float, who: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PartyTimeoutError(f"{who} did not send its whole message in time", who)
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise PartyTimeoutError(f"{who} did not send its whole message in time", who) from None
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            raise PartyDroppedError(f"{who} dropped the connection ({exc})", who) from None
        except ssl.SSLError as exc:
            raise tls_error(exc, who) from None
        except OSError as exc:
            raise PartyDroppedError(f"{who} dropped the connection ({exc})", who) from None
        if not chunk:
            raise PartyDroppedError(
                f"{who} closed the connection mid-message ({len(buf)} of {n} bytes)", who
            )
        buf += chunk
    return bytes(buf)


def _check_header(
    raw: bytes, keys: dict[str, bytes], me: Party, expect_from: str, peer: str = ""
) -> tuple[int, Party, int]:
    """The type, claimed sender and payload length of a frame header (nothing verified yet but
    the sender's name against ``peer``, the name in the connection's TLS certificate)."""
    magic, mtype, srole, sidx, rrole, ridx, length = _HEADER.unpack(raw)
    if magic != MAGIC or srole >= len(ROLES) or rrole >= len(ROLES):
        raise ProtocolError(f"{expect_from} sent a frame with a bad header", expect_from)
    sender = (ROLES[srole], sidx)
    who = party_name(sender)
    if peer and who != peer:
        raise AuthenticationError(
            f"a frame in the name of {who} came over {peer}'s TLS connection", peer
        )
    if who not in keys:
        raise AuthenticationError(f"a frame claims to come from {who}, an unknown party", who)
    if (ROLES[rrole], ridx) != me:
        raise AuthenticationError(f"{who} sent a frame addressed to someone else", who)
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"{who} announced a {length}-byte message (too large)", who)
    return mtype, sender, length


def _check_tag(keys: dict[str, bytes], session: bytes, me: Party, raw: bytes, body: bytes) -> Frame:
    """The frame whose header is ``raw`` and whose payload and tag are ``body``, verified."""
    _, mtype, srole, sidx, _, _, _ = _HEADER.unpack(raw)
    sender = (ROLES[srole], sidx)
    who = party_name(sender)
    length = len(body) - TAG_BYTES
    payload, tag = body[:length], body[length:]
    if not hmac.compare_digest(tag, _tag(keys[who], session, raw, payload)):
        raise AuthenticationError(
            f"message from {who} to {party_name(me)} failed HMAC-SHA256 verification "
            "(tampered or wrong key)",
            who,
        )
    return Frame(mtype, sender, payload, len(raw) + len(body))


def recv_frame(
    sock: socket.socket,
    keys: dict[str, bytes],
    session: bytes,
    me: Party,
    deadline: float,
    expect_from: str = "a peer",
) -> Frame:
    """Read and verify one frame; ``keys`` maps peer names (``"owner 3"``) to link keys. On a
    TLS connection the frame must come from the party its certificate names."""
    raw = _recv_exact(sock, _HEADER.size, deadline, expect_from)
    peer = peer_name(sock) if isinstance(sock, ssl.SSLSocket) else ""
    _, sender, length = _check_header(raw, keys, me, expect_from, peer)
    body = _recv_exact(sock, length + TAG_BYTES, deadline, party_name(sender))
    return _check_tag(keys, session, me, raw, body)


class FrameReader:
    """One frame read incrementally from a non-blocking socket (a server's multiplexed loop).

    :meth:`feed` takes the bytes received so far and returns the verified :class:`Frame` once
    it is whole, ``None`` while it is not; an invalid header or tag raises the same named
    :class:`FederatedError` as :func:`recv_frame`. ``peer`` is the party the connection's TLS
    certificate names (set once the handshake is done): a frame in any other name is refused.
    :attr:`claimed` is the sender the header names (unauthenticated until the tag verifies)."""

    def __init__(self, keys: dict[str, bytes], session: bytes, me: Party, peer: str = "") -> None:
        self.keys, self.session, self.me, self.peer = keys, session, me, peer
        self.buf = bytearray()
        self.raw: bytes | None = None
        self.need = _HEADER.size
        self.claimed = peer

    def feed(self, data: bytes) -> Frame | None:
        self.buf += data
        if self.raw is None and len(self.buf) >= _HEADER.size:
            self.raw = bytes(self.buf[: _HEADER.size])
            del self.buf[: _HEADER.size]
            who = self.peer or "an unidentified peer"
            _, sender, length = _check_header(self.raw, self.keys, self.me, who, self.peer)
            self.claimed = party_name(sender)
            self.need = length + TAG_BYTES
        if self.raw is None or len(self.buf) < self.need:
            return None
        if len(self.buf) > self.need:
            raise ProtocolError(f"{self.claimed} sent more than one frame", self.claimed)
        return _check_tag(self.keys, self.session, self.me, self.raw, bytes(self.buf))

    @property
    def received(self) -> int:
        """Bytes received so far (header included): how far this connection has got."""
        return len(self.buf) + (len(self.raw) if self.raw is not None else 0)

    @property
    def pending(self) -> int:
        """Bytes still expected (of the header while it is incomplete)."""
        return self.need - len(self.buf) if self.raw is not None else _HEADER.size - len(self.buf)


def connect(
    host: str, port: int, peer: Party, deadline: float, tls: ssl.SSLContext
) -> ssl.SSLSocket:
    """Connect to a listening party over TLS (:func:`~clipless.federated.tls.client_context`),
    retrying a refused connection until the deadline, and check that its certificate names
    ``peer``. Raises :class:`AuthenticationError` when it does not, or when its certificate
    does not verify against the session's CA: nothing has been sent then."""
    sock = _connect_tcp(host, port, peer, deadline)
    who = party_name(peer)
    try:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        tsock = tls.wrap_socket(sock)
    except ssl.SSLCertVerificationError as exc:
        sock.close()
        raise AuthenticationError(
            f"{who} at {host}:{port}: its TLS certificate does not verify against this "
            f"session's CA ({exc.verify_message}): not {who} of this session",
            who,
        ) from None
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError) as exc:
        sock.close()
        raise PartyDroppedError(
            f"{who} at {host}:{port} closed the connection ({exc})", who
        ) from None
    except TimeoutError:
        sock.close()
        raise PartyTimeoutError(f"{who} at {host}:{port}: TLS handshake timed out", who) from None
    except ssl.SSLError as exc:
        sock.close()
        raise tls_error(exc, who) from None
    name = peer_name(tsock)
    if name != who:
        tsock.close()
        raise AuthenticationError(
            f"the TLS certificate at {host}:{port} is {name or 'nameless'}'s, not {who}'s "
            "(a wrong servers_at address, or swapped secret files?)",
            who,
        )
    return tsock


def tls_error(exc: ssl.SSLError, who: str) -> AuthenticationError:
    """The named error for a TLS failure on a link with ``who``: its alert (it refused this
    party's certificate) or a record that failed its integrity check (tampered in transit)."""
    reason = exc.reason or str(exc)
    if "ALERT" in reason.upper():
        return AuthenticationError(
            f"{who} refused the TLS connection ({reason}): this party's certificate is not "
            "of that session, or not the party it claims to be",
            who,
        )
    return AuthenticationError(
        f"the TLS connection with {who} failed ({reason}): a record tampered in transit, or "
        "not a TLS peer",
        who,
    )


def _pending_alert(sock: socket.socket, who: str) -> AuthenticationError | None:
    """After a failed send: the TLS alert the peer sent before closing, if any (a refused
    certificate surfaces as a reset connection otherwise)."""
    if not isinstance(sock, ssl.SSLSocket):
        return None
    try:
        sock.settimeout(0.5)
        sock.recv(1)
    except ssl.SSLError as exc:
        if "ALERT" in (exc.reason or "").upper():
            return tls_error(exc, who)
    except OSError:
        pass
    return None


def _connect_tcp(host: str, port: int, peer: Party, deadline: float) -> socket.socket:
    """A TCP connection to a listening party, retrying a refused one until the deadline."""
    who = party_name(peer)
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(0.05, deadline - time.monotonic())
            )
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except ConnectionRefusedError as exc:
            last = exc
            time.sleep(0.05)
        except TimeoutError:
            break
        except OSError as exc:
            raise PartyDroppedError(f"cannot reach {who} at {host}:{port} ({exc})", who) from None
    raise PartyDroppedError(
        f"{who} at {host}:{port} refused the connection until the deadline (down?) ({last})", who
    )
