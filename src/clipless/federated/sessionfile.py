"""The federated session and each party's secret as frozen, typed values, and their JSON files.

:class:`Session` is the public description every party reads (protocol, parties, grid, budget,
timeout, the servers' addresses, the session's TLS certificate authority); :class:`PartySecret`
is one party's own link keys, TLS key and certificate (and the dealer's noise key). Both are
checked once, in their constructors, whether made by
:func:`~clipless.federated.session.make_session` or read from a file, so the protocol code
never meets a malformed one.

The files are versioned JSON (``"format"``: :data:`SESSION_FORMAT`, :data:`SECRET_FORMAT`).
Files of an earlier version (written before the transport used TLS, without ``"format"``) are
refused with a message saying to run ``clipless federated init`` again: they lack the
certificates, and nothing runs without them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

Protocol = Literal["shares", "fss"]
Statistic = Literal["ecdf", "roc"]
NoiseSharing = Literal["dealer", "distributed"]
Noise = Literal["laplace", "gaussian"]
Neighbouring = Literal["replace_one", "add_remove"]

__all__ = [
    "MAX_TIMEOUT",
    "SECRET_FORMAT",
    "SESSION_FORMAT",
    "PartySecret",
    "Session",
    "load_secret",
    "load_session",
]

SESSION_FORMAT = "clipless-federated-session/2"
SECRET_FORMAT = "clipless-federated-secret/2"

#: The largest per-phase timeout (30 days): every deadline (at most now + 2 timeout + 5 s) stays
#: far inside what socket timeouts and ``select`` can represent (1e12 s overflowed).
MAX_TIMEOUT = 30 * 86400
_T = TypeVar("_T")

_CHOICES = {
    "protocol": ("shares", "fss"),
    "statistic": ("ecdf", "roc"),
    "noise_sharing": ("dealer", "distributed"),
    "noise": ("laplace", "gaussian"),
    "neighbouring": ("replace_one", "add_remove"),
}
_PEM_CERT = "-----BEGIN CERTIFICATE-----"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(frozen=True)
class Session:
    """A federated release's public description (one JSON file, the same for every party).

    ``thresholds`` is the public grid (``size`` of them from ``lower`` to ``upper``); ``points``
    the queried grid indices (``None``: the whole grid); ``kary`` the ``k``-ary plan fixed at
    ``init`` as ``(branching, level shares as fraction strings)`` (``None``: the binary tree);
    ``servers_at`` the ``(host, port)`` of the servers known so far (in order); ``ca`` the
    session's certificate authority (PEM), against which every party verifies its peers."""

    session_id: str
    protocol: Protocol
    statistic: Statistic
    servers: int
    owners: int
    noise_sharing: NoiseSharing
    lower: float
    upper: float
    size: int
    thresholds: tuple[float, ...]
    points: tuple[int, ...] | None
    epsilon: float | None
    rho: float | None
    noise: Noise
    neighbouring: Neighbouring
    timeout: float
    n_values: int | None
    one_value_per_owner: bool
    servers_at: tuple[tuple[str, int], ...]
    kary: tuple[int, tuple[str, ...]] | None
    ca: str

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ValueError(f"session: {problem}")

    def _problem(self) -> str:
        if not re.fullmatch(r"[0-9a-f]{32}", str(self.session_id)):
            return f"session id must be 32 hex digits, got {self.session_id!r}"
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                return f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
        if not (_is_int(self.servers) and self.servers >= 2):
            return f"servers must be an integer >= 2, got {self.servers!r}"
        if not (_is_int(self.owners) and self.owners >= 1):
            return f"owners must be an integer >= 1, got {self.owners!r}"
        if self.protocol == "fss" and self.servers != 2:
            return f"protocol fss uses exactly 2 servers, got {self.servers}"
        if not (_is_int(self.size) and self.size >= 2 and len(self.thresholds) == self.size):
            return f"size must be an integer >= 2 matching thresholds, got {self.size!r}"
        if self.points is not None and not all(0 <= p < self.size for p in self.points):
            return f"points must be grid indices in [0, {self.size})"
        if not (_is_real(self.timeout) and 0 < self.timeout <= MAX_TIMEOUT):
            return (
                f"timeout {self.timeout!r} is not a number of seconds > 0 and <= {MAX_TIMEOUT} "
                "(30 days)"
            )
        if self.n_values is not None and not (_is_int(self.n_values) and self.n_values >= 1):
            return f"n_values must be an integer >= 1 or null, got {self.n_values!r}"
        if len(self.servers_at) > self.servers or not all(
            isinstance(h, str) and _is_int(p) and 0 <= p <= 65535 for h, p in self.servers_at
        ):
            return f"servers_at must hold at most {self.servers} [HOST, PORT] pairs"
        if not str(self.ca).startswith(_PEM_CERT):
            return "ca must be a PEM certificate (the session's TLS certificate authority)"
        return ""

    def with_servers_at(self, servers_at: Sequence[tuple[str, int]]) -> Session:
        """The same session with the servers' addresses ``servers_at`` (known later)."""
        return dataclasses.replace(self, servers_at=tuple((str(h), int(p)) for h, p in servers_at))

    def to_json(self) -> dict[str, Any]:
        """The JSON document of :func:`load_session` (version :data:`SESSION_FORMAT`)."""
        return {
            "format": SESSION_FORMAT,
            "session": self.session_id,
            "statistic": self.statistic,
            "thresholds": list(self.thresholds),
            "protocol": self.protocol,
            "servers": self.servers,
            "owners": self.owners,
            "noise_sharing": self.noise_sharing,
            "grid": {"lower": self.lower, "upper": self.upper, "size": self.size},
            "points": None if self.points is None else list(self.points),
            "epsilon": self.epsilon,
            "rho": self.rho,
            "noise": self.noise,
            "neighbouring": self.neighbouring,
            "timeout": self.timeout,
            "n_values": self.n_values,
            "one_value_per_owner": self.one_value_per_owner,
            "servers_at": [[h, p] for h, p in self.servers_at],
            "kary": None
            if self.kary is None
            else {"branching": self.kary[0], "shares": list(self.kary[1])},
            "ca": self.ca,
        }

    @classmethod
    def from_json(cls, doc: object) -> Session:
        """The session a :meth:`to_json` document describes; ``ValueError`` names what is
        wrong (an earlier version included)."""
        d = _versioned(doc, SESSION_FORMAT, "session")
        try:
            grid, kary = d["grid"], d["kary"]
            return cls(
                session_id=d["session"], protocol=d["protocol"], statistic=d["statistic"],
                servers=d["servers"], owners=d["owners"], noise_sharing=d["noise_sharing"],
                lower=float(grid["lower"]), upper=float(grid["upper"]), size=grid["size"],
                thresholds=tuple(float(t) for t in d["thresholds"]),
                points=None if d["points"] is None else tuple(int(p) for p in d["points"]),
                epsilon=d["epsilon"], rho=d["rho"], noise=d["noise"],
                neighbouring=d["neighbouring"], timeout=d["timeout"], n_values=d["n_values"],
                one_value_per_owner=bool(d["one_value_per_owner"]),
                servers_at=tuple((h, p) for h, p in d["servers_at"]),
                kary=None if kary is None
                else (int(kary["branching"]), tuple(str(w) for w in kary["shares"])),
                ca=d["ca"],
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ValueError) and str(exc).startswith("session: "):
                raise
            raise ValueError(f"session: malformed field ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True, repr=False)
class PartySecret:
    """One party's secret: its name, its link keys (peer name -> 32-byte HMAC key), its TLS
    private key and certificate (PEM, signed by the session's CA) and, for the dealer, its
    node-noise key. Never printed (``repr`` shows the party only)."""

    party: str
    links: Mapping[str, bytes]
    tls_key: str
    tls_cert: str
    noise_key: bytes | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"(owner|server|dealer|analyst) \d+", str(self.party)):
            raise ValueError(f"secret: party must be like 'owner 3', got {self.party!r}")
        if not self.links or not all(
            isinstance(k, bytes) and len(k) == 32 for k in self.links.values()
        ):
            raise ValueError(f"secret of {self.party}: no link keys, or one not of 32 bytes")
        if not str(self.tls_cert).startswith(_PEM_CERT) or "PRIVATE KEY" not in self.tls_key:
            raise ValueError(f"secret of {self.party}: no TLS certificate and private key")
        if self.noise_key is not None and len(self.noise_key) != 16:
            raise ValueError(f"secret of {self.party}: the noise key must be 16 bytes")
        object.__setattr__(self, "links", dict(self.links))

    def __repr__(self) -> str:
        return f"PartySecret(party={self.party!r})"

    def to_json(self) -> dict[str, Any]:
        """The JSON document of :func:`load_secret` (version :data:`SECRET_FORMAT`)."""
        doc: dict[str, Any] = {
            "format": SECRET_FORMAT,
            "party": self.party,
            "links": {name: key.hex() for name, key in self.links.items()},
            "tls": {"key": self.tls_key, "cert": self.tls_cert},
        }
        if self.noise_key is not None:
            doc["noise_key"] = self.noise_key.hex()
        return doc

    @classmethod
    def from_json(cls, doc: object) -> PartySecret:
        d = _versioned(doc, SECRET_FORMAT, "secret")
        try:
            noise = d.get("noise_key")
            return cls(
                party=d["party"],
                links={str(k): bytes.fromhex(v) for k, v in d["links"].items()},
                tls_key=d["tls"]["key"],
                tls_cert=d["tls"]["cert"],
                noise_key=None if noise is None else bytes.fromhex(noise),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"secret: malformed field ({type(exc).__name__}: {exc})") from None


def _versioned(doc: object, fmt: str, what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ValueError(f"{what}: not a clipless federated {what} file (not a JSON object)")
    found = doc.get("format")
    if found == fmt:
        return doc
    if found is None and ("links" in doc or "protocol" in doc):
        raise ValueError(
            f"{what}: written by an earlier clipless, before the transport used TLS (it has no "
            "certificates); run clipless federated init again and hand out the new files"
        )
    raise ValueError(f"{what}: format {found!r} is not {fmt!r} (not a {what} file, or newer?)")


def _load(path: str | Path, flag: str, parse: Callable[[object], _T]) -> _T:
    """``parse`` of the JSON file at ``path``; a ``ValueError`` names the file (``flag``)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {str(path)!r} is not a JSON file ({exc})") from None
    try:
        return parse(data)
    except ValueError as exc:
        if str(exc).startswith(flag):
            raise
        raise ValueError(f"{flag} {str(path)!r}: {exc}") from None


def load_session(path: str | Path, flag: str = "session") -> Session:
    """The session in a file ``init`` wrote; ``ValueError`` names the file and the problem."""
    return _load(path, flag, Session.from_json)


def load_secret(path: str | Path, flag: str = "--secret") -> PartySecret:
    """A party's secret from a file ``init`` wrote; ``ValueError`` names the file."""
    return _load(path, flag, PartySecret.from_json)
