"""Length-prefixed, HMAC-SHA256-authenticated binary messages over TCP, with byte counters.

Frame layout (all integers big-endian)::

    magic "CLF1" (4) | type (1) | sender role (1) | sender index (4) | receiver role (1)
    | receiver index (4) | payload length (8) | payload | tag (32)

``tag = HMAC-SHA256(k_link, session id || header || payload)`` with the pre-shared key of the
(sender, receiver) link (RFC 2104; :mod:`hmac` with :func:`hmac.compare_digest`). The 16-byte
session id binds a frame to one run; each party accepts at most one message from each peer per
run, so a replayed frame changes nothing (a server acknowledges a byte-identical replay and
ignores it; a different second message is an error). Messages are authenticated,
**not encrypted**: on a network that others can read, run the links inside TLS or an SSH tunnel
(secret shares and DCF keys must stay confidential; the docs say how).

Failures are never silent. Every error names the party at fault:

* :class:`AuthenticationError` -- a frame whose tag does not verify, or from an unknown party;
* :class:`PartyTimeoutError` -- a party that sent nothing (or not all of its frame) in time;
* :class:`PartyDroppedError` -- a party whose connection was refused or closed mid-message;
* :class:`ProtocolError` -- a well-authenticated but invalid message (wrong size, duplicate).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from collections import defaultdict
from dataclasses import dataclass, field

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
    """A message failed HMAC-SHA256 verification (tampered, or from an unknown party)."""

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
    except OSError as exc:
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
        except OSError as exc:
            raise PartyDroppedError(f"{who} dropped the connection ({exc})", who) from None
        if not chunk:
            raise PartyDroppedError(
                f"{who} closed the connection mid-message ({len(buf)} of {n} bytes)", who
            )
        buf += chunk
    return bytes(buf)


def _check_header(
    raw: bytes, keys: dict[str, bytes], me: Party, expect_from: str
) -> tuple[int, Party, int]:
    """The type, claimed sender and payload length of a frame header (nothing verified yet)."""
    magic, mtype, srole, sidx, rrole, ridx, length = _HEADER.unpack(raw)
    if magic != MAGIC or srole >= len(ROLES) or rrole >= len(ROLES):
        raise ProtocolError(f"{expect_from} sent a frame with a bad header", expect_from)
    sender = (ROLES[srole], sidx)
    who = party_name(sender)
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
    """Read and verify one frame; ``keys`` maps peer names (``"owner 3"``) to link keys."""
    raw = _recv_exact(sock, _HEADER.size, deadline, expect_from)
    _, sender, length = _check_header(raw, keys, me, expect_from)
    body = _recv_exact(sock, length + TAG_BYTES, deadline, party_name(sender))
    return _check_tag(keys, session, me, raw, body)


class FrameReader:
    """One frame read incrementally from a non-blocking socket (a server's multiplexed loop).

    :meth:`feed` takes the bytes received so far and returns the verified :class:`Frame` once
    it is whole, ``None`` while it is not; an invalid header or tag raises the same named
    :class:`FederatedError` as :func:`recv_frame`. :attr:`claimed` is the sender the header
    names (unauthenticated until the tag verifies)."""

    def __init__(self, keys: dict[str, bytes], session: bytes, me: Party) -> None:
        self.keys, self.session, self.me = keys, session, me
        self.buf = bytearray()
        self.raw: bytes | None = None
        self.need = _HEADER.size
        self.claimed = ""

    def feed(self, data: bytes) -> Frame | None:
        self.buf += data
        if self.raw is None and len(self.buf) >= _HEADER.size:
            self.raw = bytes(self.buf[: _HEADER.size])
            del self.buf[: _HEADER.size]
            _, sender, length = _check_header(self.raw, self.keys, self.me, "an unidentified peer")
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


def connect(host: str, port: int, peer: Party, deadline: float) -> socket.socket:
    """Connect to a listening party, retrying a refused connection until the deadline."""
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
