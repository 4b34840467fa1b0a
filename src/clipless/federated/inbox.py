"""A server's listener: TLS connections multiplexed with :mod:`selectors`.

Every connection is handshaken and read incrementally (non-blocking), so no peer can stall
the others, and a connection that fails the TLS handshake, or whose frame does not verify,
closes only itself.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import time

from clipless.federated.tls import peer_name
from clipless.federated.transport import (
    FederatedError,
    Frame,
    FrameReader,
    Party,
    PartyDroppedError,
    PartyTimeoutError,
    tls_error,
)

__all__ = ["Inbox"]


class Inbox:
    """A server's listener, multiplexed with :mod:`selectors`.

    Anyone who can reach the port can open a connection, so nothing unauthenticated may end
    the run: a connection that fails the TLS handshake (no certificate, or one not from the
    session's CA), sends garbage, a frame in another name than its certificate's, a frame
    failing its HMAC, one that stays idle, or one closed mid-frame is dropped and remembered
    (:attr:`rejected`, by the party its certificate names; :attr:`tls_failures` for handshakes
    that failed) -- if that party's verified message never arrives, the server's timeout error
    names it with what was seen. At most ``cap`` connections are open at once; beyond that,
    the one that has received the fewest bytes (the oldest of those) is dropped, so that idle
    connections opened by a stranger cannot push out a party part-way through its message
    (parties also reconnect and resend until their deadline)."""

    def __init__(
        self,
        listener: socket.socket,
        keys: dict[str, bytes],
        sid: bytes,
        me: Party,
        cap: int,
        tls: ssl.SSLContext,
    ) -> None:
        self.listener, self.keys, self.sid, self.me, self.cap = listener, keys, sid, me, cap
        self.tls = tls
        self.sel = selectors.DefaultSelector()
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, None)
        # None: the TLS handshake is not done yet
        self.open: dict[ssl.SSLSocket, FrameReader | None] = {}
        self.rejected: dict[str, FederatedError] = {}
        self.unidentified = 0
        self.tls_failures: list[str] = []

    def _reject(self, conn: ssl.SSLSocket, exc: FederatedError | None, claimed: str) -> None:
        self.sel.unregister(conn)
        del self.open[conn]
        conn.close()
        if exc is not None and claimed in self.keys:
            self.rejected[claimed] = exc
        else:
            self.unidentified += 1

    def _progress(self, conn: ssl.SSLSocket) -> int:
        reader = self.open[conn]
        return 0 if reader is None else reader.received

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. too many open files: leave it in the backlog for now
                return
            if len(self.open) >= self.cap:  # the least progress (the oldest among equals)
                self._reject(min(self.open, key=self._progress), None, "")
            raw.setblocking(False)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn = self.tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            except OSError:
                raw.close()
                self.unidentified += 1
                continue
            self.open[conn] = None
            self.sel.register(conn, selectors.EVENT_READ, conn)

    def _handshake(self, conn: ssl.SSLSocket) -> FrameReader | None:
        """Advance the TLS handshake; the connection's reader once it is done and the peer's
        certificate names a party of this server's links (else the connection is dropped)."""
        try:
            conn.do_handshake()
        except ssl.SSLWantReadError:
            self.sel.modify(conn, selectors.EVENT_READ, conn)
            return None
        except ssl.SSLWantWriteError:
            self.sel.modify(conn, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return None
        except ssl.SSLError as exc:
            self.tls_failures.append(getattr(exc, "verify_message", None) or exc.reason or "")
            self._reject(conn, None, "")
            return None
        except OSError:
            self._reject(conn, None, "")
            return None
        self.sel.modify(conn, selectors.EVENT_READ, conn)
        name = peer_name(conn)
        if name not in self.keys:  # a certificate of this session, but not a peer of ours
            self.tls_failures.append(f"a certificate of {name or 'no party'}, not a peer")
            self._reject(conn, None, "")
            return None
        reader = self.open[conn] = FrameReader(self.keys, self.sid, self.me, peer=name)
        return reader

    def _read(self, conn: ssl.SSLSocket, reader: FrameReader) -> Frame | None:
        """Read what ``conn`` has (TLS may hold decrypted bytes the selector cannot see);
        the frame once it is whole and verified, else ``None`` (the connection may have been
        dropped)."""
        while True:
            why = "closed the connection mid-message"
            try:
                chunk = conn.recv(min(max(reader.pending, 1), 1 << 20))
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                return None
            except InterruptedError:
                continue
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                chunk = b""
            except ssl.SSLError as exc:  # a record that fails its integrity check
                self._reject(conn, tls_error(exc, reader.peer), reader.peer)
                return None
            except OSError as exc:
                chunk, why = b"", f"dropped the connection ({exc})"
            if not chunk:
                who = reader.claimed or "an unidentified peer"
                self._reject(conn, PartyDroppedError(f"{who} {why}", who), reader.claimed)
                return None
            try:
                frame = reader.feed(chunk)
            except FederatedError as exc:
                self._reject(conn, exc, reader.claimed or exc.party)
                return None
            if frame is not None or not conn.pending():
                return frame

    def poll(self, until: float) -> list[tuple[ssl.SSLSocket, Frame]]:
        """The frames verified before ``until`` (returns as soon as there is one, or at
        ``until``); their connections are handed over in blocking mode."""
        done: list[tuple[ssl.SSLSocket, Frame]] = []
        while not done:
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in self.sel.select(timeout=remaining):
                if key.data is None:
                    self._accept()
                    continue
                conn: ssl.SSLSocket = key.data
                if conn not in self.open:  # dropped earlier in this batch of events (the cap)
                    continue
                reader = self.open[conn] or self._handshake(conn)
                if reader is None:
                    continue
                frame = self._read(conn, reader)
                if frame is not None:
                    self.sel.unregister(conn)
                    del self.open[conn]
                    conn.setblocking(True)
                    done.append((conn, frame))
        return done

    def missing_error(self, index: int, missing: list[str], timeout: float) -> FederatedError:
        """The error for parties whose verified message did not arrive in time: what was
        rejected in their name, if anything, else a timeout."""
        strangers = (
            f"; {self.unidentified} unidentified connection(s) were dropped"
            if self.unidentified
            else ""
        )
        if self.tls_failures:
            strangers += (
                f"; {len(self.tls_failures)} failed the TLS handshake (e.g. "
                f"{self.tls_failures[-1]}: a certificate not from this session's CA?)"
            )
        seen = [p for p in missing if p in self.rejected]
        if seen:
            exc = self.rejected[seen[0]]
            return type(exc)(
                f"server {index}: no verified message from {', '.join(missing)} within "
                f"{timeout} s; a frame claiming to come from {seen[0]} was rejected: {exc}"
                + strangers,
                seen[0],
            )
        return PartyTimeoutError(
            f"server {index}: no message from {', '.join(missing)} within {timeout} s (slow, "
            f"crashed or never started){strangers}",
            missing[0],
        )

    def close(self) -> None:
        for conn in list(self.open):
            self.sel.unregister(conn)
            conn.close()
        self.open.clear()
        self.sel.unregister(self.listener)
        self.sel.close()
