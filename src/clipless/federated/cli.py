"""``clipless federated simulate | init | serve | owner | dealer | analyst``.

``simulate`` launches ``--servers`` servers, ``--owners`` owners (one synthetic value each,
Beta(2, 5) on [0, 1] from ``--data-seed``) and, for ``--noise-sharing dealer``, a noise dealer,
each a separate process on 127.0.0.1, then acts as the analyst: it prints the released ECDF,
the wall time, one line ``total: N bytes`` and the bytes sent by each role. ``init`` writes a
public session file (with the session's TLS certificate authority) and one secret file per
party (its TLS key and certificate, its link keys; the dealer's noise key with
``--noise-sharing dealer``, no noise key at all with ``distributed``, where each ``serve``
draws its own); every link is mutually authenticated TLS 1.3. ``serve``, ``owner``, ``dealer`` and
``analyst`` run one party from the session file and its own secret file (docs/federated.md shows
how to run them on several machines; the protocol is :mod:`clipless.federated.session`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import ssl
import sys
from pathlib import Path
from typing import Any, TextIO

from clipless._argtypes import integer, number
from clipless.federated.noise import server_keys
from clipless.federated.sessionfile import (
    MAX_TIMEOUT,
    PartySecret,
    Session,
    load_secret,
    load_session,
)
from clipless.federated.tls import Credentials, certificate_name, server_context

__all__ = ["add_federated_parser", "main"]

_FINITE_POSITIVE = number("a finite number > 0", 0.0, math.inf)
# 30 days; 1e12 s ended in an OverflowError traceback
_MAX_TIMEOUT = MAX_TIMEOUT
_TIMEOUT = number(
    f"a number of seconds > 0 and <= {_MAX_TIMEOUT} (30 days)",
    0.0,
    math.nextafter(_MAX_TIMEOUT, math.inf),  # `number` excludes its upper end
)

# the module docstring without its reST markup, for --help
_DESCRIPTION = (__doc__ or "").replace("``", "").replace(":mod:`", "").replace("`", "")


class _Defaults(argparse.HelpFormatter):
    """Every option's default in its help line, unless the text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _session_options(parser: argparse.ArgumentParser, timeout: float) -> None:
    """The protocol options ``simulate`` and ``init`` share."""
    parser.add_argument(
        "--protocol",
        choices=["shares", "fss"],
        default="shares",
        help="secret sharing or function secret sharing (docs/federated.md)",
    )
    parser.add_argument(
        "--noise-sharing",
        choices=["dealer", "distributed"],
        default="dealer",
        help="who holds the tree-node noise (docs/federated.md: threat model)",
    )
    parser.add_argument(
        "--mechanism",
        choices=["auto", "binary"],
        default="auto",
        help="counting mechanism of an ECDF: auto = the central default's k-ary tree "
        "(branching, levels and budgets of smallest exact error; equal to the central release); "
        "binary = the thesis's tree (a ROC curve always uses it)",
    )
    parser.add_argument(
        "--neighbouring",
        choices=["replace_one", "add_remove"],
        default="replace_one",
        help="the neighbouring relation of the guarantee",
    )
    parser.add_argument(
        "--timeout",
        type=_TIMEOUT,
        default=timeout,
        help=f"per-phase timeout in seconds, > 0 and at most {_MAX_TIMEOUT} (30 days)",
    )


def add_federated_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``federated`` command (``simulate``, ``init``, ``serve``, ``owner``, ``dealer``,
    ``analyst``) to an :mod:`argparse` sub-parser set; return its parser."""
    p = subparsers.add_parser(
        "federated",
        help="federated DP-ECDF: secret sharing or FSS among processes over TCP",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="federated_command", metavar="ACTION")
    _add_simulate(sub)
    _add_init(sub)
    for name, what in (
        ("serve", "a server"),
        ("owner", "a data owner"),
        ("dealer", "the dealer"),
        ("analyst", "the analyst (prints the release)"),
    ):
        _add_party(sub, name, what)
    p.set_defaults(func=_no_action(p))
    return p


def _add_simulate(sub: Any) -> None:
    """``federated simulate``: every party on loopback."""
    s = sub.add_parser(
        "simulate",
        help="run owners, servers and the analyst on loopback",
        formatter_class=_Defaults,
    )
    s.add_argument(
        "--owners",
        type=integer(1, 1000),
        default=20,
        help="number of data owners, one process each (default 20, at most 1000; "
        "clipless.federated.federated_ecdf takes any number in one process)",
    )
    s.add_argument("--servers", type=integer(2), default=2, help="number of servers m (default 2)")
    s.add_argument("--size", type=integer(2), default=16, help="number of grid thresholds |B|")
    s.add_argument("--epsilon", type=_FINITE_POSITIVE, default=1.0, help="privacy budget (> 0)")
    _session_options(s, timeout=60.0)
    s.add_argument(
        "--data-seed", type=integer(0), default=0, help="seed of the synthetic owner data"
    )
    s.add_argument("--noise-key", default=None, help="hex 16-byte node-noise key (reproducible)")
    s.add_argument(
        "--spawn",
        choices=["subprocess", "fork"],
        default="subprocess",
        help="how the parties are started: one Python process each, or forks of this one",
    )
    s.add_argument(
        "--statistic",
        choices=["ecdf", "roc"],
        default="ecdf",
        help="roc: owners hold a synthetic score and a 0/1 label; prints the ROC and its AUC",
    )
    s.set_defaults(func=_simulate)


def _add_init(sub: Any) -> None:
    """``federated init``: the session file and one secret file per party."""
    i = sub.add_parser(
        "init", help="write a session file and one secret file per party", formatter_class=_Defaults
    )
    i.add_argument("--out", required=True, help="directory to create (session.json, secrets/)")
    i.add_argument("--owners", type=integer(1), required=True, help="number of data owners")
    i.add_argument("--servers", type=integer(2), default=2, help="number of servers m")
    i.add_argument("--size", type=integer(2), required=True, help="number of grid thresholds")
    i.add_argument("--lower", type=float, default=0.0, help="grid lower bound (default 0)")
    i.add_argument("--upper", type=float, default=1.0, help="grid upper bound (default 1)")
    i.add_argument("--epsilon", type=_FINITE_POSITIVE, required=True, help="privacy budget (> 0)")
    _session_options(i, timeout=600.0)
    i.add_argument(
        "--statistic",
        choices=["ecdf", "roc"],
        default="ecdf",
        help="roc: owners pass --labels with their --values",
    )
    i.add_argument(
        "--n-values",
        type=integer(1),
        default=None,
        help="public total number of values (replace_one; default: one per owner)",
    )
    i.add_argument(
        "--server-at",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="address of server j (repeat, in order)",
    )
    i.set_defaults(func=_init)


def _add_party(sub: Any, name: str, what: str) -> None:
    """``federated serve|owner|dealer|analyst``: one party from the session's files."""
    q = sub.add_parser(name, help=f"run {what} from a session file", formatter_class=_Defaults)
    q.add_argument("session", help="public session JSON")
    q.add_argument("--secret", required=True, help="this party's secret JSON (TLS key, link keys)")
    if name in ("serve", "owner"):
        q.add_argument("--index", type=integer(0), required=True, help="party index")
    if name == "serve":
        q.add_argument(
            "--host",
            default=None,
            help="address to listen on (default: the host of the session's servers_at for "
            "--index, where the other parties connect; 127.0.0.1 if the session records "
            "none; 0.0.0.0: every interface)",
        )
        q.add_argument(
            "--port",
            type=integer(0, 65535),
            default=None,
            help="port to listen on (default: the port of the session's servers_at for "
            "--index; 0: any free port, printed). Another port than the recorded one is for "
            "a port forward that reaches it from there (a note says so)",
        )
    if name == "serve":
        q.add_argument(
            "--noise-key-file",
            default=None,
            help="noise_sharing distributed: this server's own noise key (32 hex digits), "
            "created (mode 0600) with a fresh key if absent, reused if present: the same "
            "noise for later queries of the same data and grid. Default: a fresh key per "
            "run, never written. No other party ever has it (init writes no noise key)",
        )
    if name == "owner":
        q.add_argument("--values", required=True, help="comma-separated values")
        q.add_argument("--labels", default=None, help="comma-separated 0/1 labels (roc)")
    q.set_defaults(func=_party)


def _no_action(p: argparse.ArgumentParser) -> Any:
    def run(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    return run


def _check(args: argparse.Namespace) -> str | None:
    if args.owners < 1:
        return f"--owners must be >= 1, got {args.owners}"
    if args.servers < 2:
        return f"--servers must be >= 2, got {args.servers}"
    if args.protocol == "fss" and args.servers != 2:
        return f"--protocol fss uses exactly 2 servers, got --servers {args.servers}"
    if args.size < 2:
        return f"--size must be >= 2, got {args.size}"
    if not args.epsilon > 0:
        return f"--epsilon must be > 0, got {args.epsilon}"
    if args.timeout <= 0:
        return f"--timeout must be > 0, got {args.timeout}"
    if args.noise_key is not None:
        try:
            if len(bytes.fromhex(args.noise_key)) != 16:
                raise ValueError
        except ValueError:
            return "--noise-key must be 32 hex digits (16 bytes)"
    return None


def _simulate(args: argparse.Namespace) -> int:
    import numpy as np

    from clipless.federated.session import simulate
    from clipless.federated.transport import FederatedError

    problem = _check(args)
    if problem:
        print(f"clipless federated simulate: error: {problem}", file=sys.stderr)
        return 2
    gen = np.random.default_rng(args.data_seed)
    labels = gen.integers(0, 2, size=args.owners)
    if args.statistic == "roc":  # positives score higher: Beta(5, 2) against Beta(2, 5)
        values = np.where(
            labels == 1, gen.beta(5.0, 2.0, args.owners), gen.beta(2.0, 5.0, args.owners)
        )
    else:
        values = gen.beta(2.0, 5.0, size=args.owners)
    keys = None
    if args.noise_key is not None:
        key = bytes.fromhex(args.noise_key)
        # one key per server, derived from the given one (equal keys would let any one server
        # know the whole noise)
        keys = [key] if args.noise_sharing == "dealer" else server_keys(key, args.servers)
    try:
        res = simulate(
            args.protocol,
            [[float(v)] for v in values],
            args.servers,
            args.size,
            args.epsilon,
            spawn=args.spawn,
            noise_sharing=args.noise_sharing,
            neighbouring=args.neighbouring,
            timeout=args.timeout,
            noise_keys=keys,
            statistic=args.statistic,
            mechanism=args.mechanism,
            owner_labels=[[int(y)] for y in labels] if args.statistic == "roc" else None,
        )
    except FederatedError as exc:
        print(f"clipless federated simulate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # the session's arguments (checked before anything starts)
        print(f"clipless federated simulate: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"released {args.statistic.upper()} ({args.protocol}, {args.owners} owners, "
        f"{args.servers} servers, noise {args.noise_sharing}, epsilon={args.epsilon:g}, "
        f"{args.neighbouring}):"
    )
    _print_release(res)
    print(f"wall time: {res.wall_time:.3f} s")
    print(f"total: {res.total} bytes")
    for role, nbytes in sorted(res.by_role().items()):
        print(f"  {role}: {nbytes} bytes")
    return 0


def _init(args: argparse.Namespace) -> int:
    from clipless.federated.session import make_session

    addrs = []
    for a in args.server_at:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            print(
                f"clipless federated init: error: --server-at {a!r} is not HOST:PORT "
                "(port 1-65535)",
                file=sys.stderr,
            )
            return 2
        addrs.append([host, int(port)])
    if len(addrs) != args.servers:
        print(
            f"clipless federated init: error: {args.servers} servers need {args.servers} "
            f"--server-at, got {len(addrs)}",
            file=sys.stderr,
        )
        return 2
    try:
        sess, secrets_ = make_session(
            args.protocol, args.owners, args.servers, args.size, args.epsilon,
            noise_sharing=args.noise_sharing, lower=args.lower, upper=args.upper,
            neighbouring=args.neighbouring, timeout=args.timeout, n_values=args.n_values,
            statistic=args.statistic, mechanism=args.mechanism,
        )  # fmt: skip
    except ValueError as exc:
        print(f"clipless federated init: error: {exc}", file=sys.stderr)
        return 2
    if len({(h, p) for h, p in addrs}) != len(addrs):
        print("clipless federated init: error: --server-at: two servers at one address",
              file=sys.stderr)  # fmt: skip
        return 2
    sess = sess.with_servers_at([(h, p) for h, p in addrs])
    out = Path(args.out)
    if os.path.lexists(out / "session.json"):  # an earlier session: never overwritten
        print(f"clipless federated init: error: --out {str(out)!r} already holds a session.json "
              "(choose a new directory)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        (out / "secrets").mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        print(f"clipless federated init: error: --out {str(out)!r}: {exc.strerror or exc} "
              "(choose a new directory)", file=sys.stderr)  # fmt: skip
        return 2
    with open(out / "session.json", "x") as fh:  # "x": fails rather than overwrite
        fh.write(json.dumps(sess.to_json(), indent=1))
    for name, sec in secrets_.items():
        path = out / "secrets" / f"{name.replace(' ', '-')}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(sec.to_json(), fh)
    print(f"wrote {out / 'session.json'} and {len(secrets_)} secret files in {out / 'secrets'}")
    print("give each party ONLY its own secret file, over a confidential channel (it holds the "
          "party's TLS private key and link keys); the session's CA key was not kept")  # fmt: skip
    return 0


def _print_release(res: Any) -> None:
    if res.roc is not None:
        print("threshold  FPR     TPR")
        for t, a, b in zip(
            res.roc.thresholds.tolist(), res.roc.fpr.tolist(), res.roc.tpr.tolist(), strict=True
        ):
            print(f"{t:9.4f}  {a:.4f}  {b:.4f}")
        print(f"AUC: {res.roc.auc():.4f}")
        return
    print("threshold  F")
    for t, f in zip(res.ecdf.grid.thresholds.tolist(), res.values.tolist(), strict=True):
        print(f"{t:9.4f}  {f:.4f}")


def _party(args: argparse.Namespace) -> int:
    from clipless.federated import session as fs
    from clipless.federated.transport import FederatedError

    cmd = args.federated_command
    try:
        sess, secret = _load_party(args)
        if cmd == "serve":
            at, recorded = _listen_address(args, sess)
            own_key = _own_noise_key(args.noise_key_file, sess.noise_sharing)
    except ValueError as exc:
        print(f"clipless federated {cmd}: error: {exc}", file=sys.stderr)
        return 2
    try:
        if cmd == "serve":
            try:
                listener = socket.create_server(at)
            except OSError as exc:
                where = f" (the session's servers_at[{args.index}])" if recorded else ""
                why = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
                print(f"clipless federated serve: error: --host/--port: cannot listen on "
                      f"{at[0]}:{at[1]}{where}: {why} (--host 0.0.0.0 listens on every "
                      "interface)", file=sys.stderr)  # fmt: skip
                return 2
            host, port = listener.getsockname()[:2]
            print(f"listening {host}:{port}", flush=True)
            # load the release code (clipless.stats, scipy) while the owners start, not after
            import clipless.federated.ecdf  # noqa: F401

            counter = fs.run_server(sess, secret, args.index, listener, own_key)
        elif cmd == "owner":
            try:
                vals = [float(v) for v in args.values.split(",") if v.strip()]
            except ValueError:
                print("clipless federated owner: error: --values must be numbers", file=sys.stderr)
                return 2
            labels = None
            if args.labels is not None:
                try:
                    labels = [int(v) for v in args.labels.split(",") if v.strip()]
                except ValueError:
                    print("clipless federated owner: error: --labels must be 0/1", file=sys.stderr)
                    return 2
            counter = fs.run_owner(sess, secret, args.index, vals, labels=labels)
        elif cmd == "dealer":
            counter = fs.run_dealer(sess, secret)
        else:
            out, counter = fs.run_analyst(sess, secret)
            res = fs._finish(sess, out, dict(counter.sent), 0.0, "isotonic", True)
            _print_release(res)
    except FederatedError as exc:
        status = {"sent": {}, "error": [exc.code, str(exc), exc.party]}
        print(json.dumps(status), file=_status_stream(cmd), flush=True)
        print(f"clipless federated {cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. the port is taken, or the host is not this machine's
        print(f"clipless federated {cmd}: error: --host/--port: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # this party's input (values, labels) against the session
        print(f"clipless federated {cmd}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"sent": dict(counter.sent), "error": None}), file=_status_stream(cmd),
          flush=True)  # fmt: skip
    return 0


def _own_noise_key(path: str | None, noise_sharing: str) -> bytes | None:
    """``serve --noise-key-file``: read this server's own noise key, or create the file (mode
    0600, never overwritten) with a fresh one."""
    if path is None:
        return None
    if noise_sharing != "distributed":
        raise ValueError(
            "--noise-key-file: only for noise_sharing distributed (with a dealer the servers "
            "hold shares of the dealer's noise, not a key)"
        )
    import secrets

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        text = Path(path).read_text().strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != 16:
            raise ValueError(
                f"--noise-key-file: {path} must hold 32 hex digits (a 16-byte key)"
            ) from None
        return key
    except OSError as exc:
        raise ValueError(f"--noise-key-file: {path}: {exc.strerror or exc}") from None
    key = secrets.token_bytes(16)
    with os.fdopen(fd, "w") as fh:
        fh.write(key.hex() + "\n")
    return key


def _status_stream(cmd: str) -> TextIO:
    """Where a party prints its JSON status line (bytes sent, error): stdout, which the
    simulation reads; the analyst's stdout is the released table, so its status goes to
    stderr."""
    return sys.stderr if cmd == "analyst" else sys.stdout


def _listen_address(args: argparse.Namespace, sess: Session) -> tuple[tuple[str, int], bool]:
    """Where ``serve`` listens, and whether the session records an address for ``--index``:
    ``--host`` and ``--port``, each by default the session's ``servers_at[--index]`` (where the
    owners, the dealer and the analyst connect), else 127.0.0.1 and any free port (a session
    whose addresses are not known yet: ``simulate``'s). A ``--port`` other than the recorded one
    gets a note on stderr: the other parties reach it only through a port forward."""
    recorded = args.index < len(sess.servers_at)
    host, port = sess.servers_at[args.index] if recorded else ("127.0.0.1", 0)
    if recorded and args.port is not None and args.port != port:
        print(f"clipless federated serve: note: --port {args.port} is not the session's "
              f"servers_at[{args.index}] {host}:{port}, where the other parties connect "
              "(a port forward must reach this port from there)", file=sys.stderr)  # fmt: skip
    return (args.host if args.host is not None else host,
            args.port if args.port is not None else port), recorded  # fmt: skip


def _load_party(args: argparse.Namespace) -> tuple[Session, PartySecret]:
    """The session and this party's secret, checked against each other and ``--index``
    (a wrong file or index is named now, not at the run's timeout)."""
    sess = load_session(args.session)
    secret = load_secret(args.secret)
    cmd = args.federated_command
    m, n = sess.servers, sess.owners
    role = {"serve": "server", "owner": "owner", "dealer": "dealer", "analyst": "analyst"}[cmd]
    if cmd in ("serve", "owner") and args.index >= (m if cmd == "serve" else n):
        plural = "servers" if cmd == "serve" else "owners"
        top = m if cmd == "serve" else n
        raise ValueError(f"--index {args.index}: this session has {plural} 0..{top - 1}")
    me = f"{role} {args.index if cmd in ('serve', 'owner') else 0}"
    if secret.party != me:
        what = "a server's" if cmd == "serve" else f"{me}'s"
        raise ValueError(f"--secret {args.secret!r} is not {what} secret (it is "
                         f"{secret.party}'s: a server's secret? the wrong --index?)")  # fmt: skip
    if certificate_name(secret.tls_cert) != me or not _signed_by(secret.tls_cert, sess.ca):
        raise ValueError(f"--secret {args.secret!r}: its TLS certificate is not {me}'s in this "
                         "session (a secret from another init?)")  # fmt: skip
    try:  # the key must match the certificate: load them now, not at the first connection
        server_context(Credentials(secret.party, secret.tls_cert, secret.tls_key, sess.ca))
    except ssl.SSLError as exc:
        raise ValueError(f"--secret {args.secret!r}: its TLS key and certificate do not load "
                         f"({exc.reason or exc})") from None  # fmt: skip
    if cmd == "owner" and args.labels is not None and sess.statistic != "roc":
        raise ValueError("--labels: this session releases an ECDF (labels are for roc)")
    return sess, secret


def _signed_by(cert_pem: str, ca_pem: str) -> bool:
    """Whether the session's CA signed this certificate (a secret from another session fails
    here, before any connection)."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m clipless.federated.cli ACTION ...``: the same commands as
    ``clipless federated``, without loading the rest of the ``clipless`` command (faster party
    start-up; :func:`clipless.federated.session.simulate` uses it)."""
    parser = argparse.ArgumentParser(prog="clipless")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_federated_parser(sub)
    args = parser.parse_args(["federated", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
