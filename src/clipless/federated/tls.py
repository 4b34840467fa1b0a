"""Mutually authenticated TLS 1.3 for the federated transport (stdlib :mod:`ssl`).

``clipless federated init`` (:func:`~clipless.federated.session.make_session`) makes a private
certificate authority for the session, signs one certificate per party with it, and **discards
the authority's private key**: nobody, whoever ran ``init`` included, can issue another
certificate for that session afterwards. The authority's certificate is public (in the session
file); each party's private key and certificate are in its own secret file (mode 0600).

Every connection is TLS 1.3 with certificates required on both sides, verified against the
session's authority only (never the system's trust store), and the peer's name is checked:

* a client (owner, dealer, analyst) checks that the server it reached presents the certificate
  of the server it meant to reach (``commonName`` ``"server j"``), and refuses it otherwise
  (:class:`~clipless.federated.transport.AuthenticationError`, before anything is sent);
* a server takes the client's identity from its verified certificate and accepts only frames
  whose sender is that identity (:class:`~clipless.federated.transport.FrameReader`).

Keys are ECDSA P-256, certificates valid from one hour before ``init`` (clock skew) for
:data:`VALID_DAYS` days.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography import x509

__all__ = [
    "VALID_DAYS",
    "Credentials",
    "certificate_name",
    "client_context",
    "make_authority",
    "peer_name",
    "server_context",
]

#: How long the certificates ``init`` makes stay valid.
VALID_DAYS = 366


@dataclass(frozen=True, repr=False)
class Credentials:
    """One party's TLS identity: its certificate and private key (PEM), the session's CA."""

    party: str
    cert: str
    key: str
    ca: str

    def __repr__(self) -> str:  # never print a private key
        return f"Credentials(party={self.party!r})"


def make_authority(
    session_id: str, parties: Sequence[str]
) -> tuple[str, dict[str, tuple[str, str]]]:
    """A fresh CA for one session and a certificate for each party: ``(CA certificate PEM,
    {party: (certificate PEM, private key PEM)})``. The CA's private key is not returned."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, f"clipless federated session {session_id}")
    ])  # fmt: skip
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    out: dict[str, tuple[str, str]] = {}
    for party in parties:
        key = ec.generate_private_key(ec.SECP256R1())
        purpose = (
            ExtendedKeyUsageOID.SERVER_AUTH
            if party.startswith("server")
            else ExtendedKeyUsageOID.CLIENT_AUTH
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, party)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(aki, critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        pem_key = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        out[party] = (cert.public_bytes(serialization.Encoding.PEM).decode(), pem_key.decode())
    return ca_cert.public_bytes(serialization.Encoding.PEM).decode(), out


def _usage(cert_sign: bool) -> x509.KeyUsage:
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False,
    )  # fmt: skip


def certificate_name(cert_pem: str) -> str:
    """The party a certificate names (its ``commonName``); ``""`` if it has none."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attrs = x509.load_pem_x509_certificate(cert_pem.encode()).subject.get_attributes_for_oid(
        NameOID.COMMON_NAME
    )
    return str(attrs[0].value) if attrs else ""


def _context(purpose: int, creds: Credentials) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    if purpose == ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = False  # the peer's party name is checked instead: peer_name
    ctx.load_verify_locations(cadata=creds.ca)  # this session's CA only
    # ssl loads a certificate chain from files only: a private folder, removed at once
    with tempfile.TemporaryDirectory(prefix="clipless-tls-") as tmp:
        path = os.path.join(tmp, "party.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(creds.key + creds.cert)
        ctx.load_cert_chain(path)
    return ctx


def server_context(creds: Credentials) -> ssl.SSLContext:
    """A server's context: TLS 1.3, a client certificate from the session's CA required."""
    return _context(ssl.PROTOCOL_TLS_SERVER, creds)


def client_context(creds: Credentials) -> ssl.SSLContext:
    """A client's context: TLS 1.3, the server's certificate from the session's CA required
    (its name is checked by the caller with :func:`peer_name`)."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, creds)


def peer_name(sock: ssl.SSLSocket) -> str:
    """The party named by the peer's verified certificate (``""`` if none)."""
    # getpeercert() parses the subject as ((("commonName", "owner 3"),),); typeshed's type
    # for it is looser
    subject: Any = (sock.getpeercert() or {}).get("subject", ())
    names = [value for rdn in subject for key, value in rdn if key == "commonName"]
    return str(names[0]) if names else ""
