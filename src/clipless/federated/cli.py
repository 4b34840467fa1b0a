"""``clipless federated simulate | serve | owner | dealer`` (see :mod:`clipless.federated.session`).

``simulate`` launches ``--servers`` servers, ``--owners`` owners (one synthetic value each,
Beta(2, 5) on [0, 1] from ``--data-seed``) and, for ``--noise-sharing dealer``, a noise dealer,
each a separate process on 127.0.0.1, then acts as the analyst: it prints the released ECDF,
the wall time, one line ``total: N bytes`` and the bytes sent by each role. ``serve``, ``owner``
and ``dealer`` run one party from a public session file and its own secret file (docs/federated.md
shows how to run them on several machines).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from clipless.federated.noise import server_keys

__all__ = ["add_federated_parser", "main"]


def add_federated_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "federated",
        help="federated DP-ECDF: secret sharing or FSS among processes over TCP",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="federated_command", metavar="ACTION")
    s = sub.add_parser("simulate", help="run owners, servers and the analyst on loopback")
    s.add_argument("--owners", type=int, default=20, help="number of data owners (default 20)")
    s.add_argument("--servers", type=int, default=2, help="number of servers m (default 2)")
    s.add_argument("--protocol", choices=["shares", "fss"], default="shares")
    s.add_argument("--size", type=int, default=16, help="number of grid thresholds |B|")
    s.add_argument("--epsilon", type=float, default=1.0, help="privacy budget (> 0)")
    s.add_argument(
        "--noise-sharing",
        choices=["dealer", "distributed"],
        default="dealer",
        help="who holds the tree-node noise (docs/federated.md: threat model)",
    )
    s.add_argument("--neighbouring", choices=["replace_one", "add_remove"], default="replace_one")
    s.add_argument("--timeout", type=float, default=60.0, help="per-phase timeout in seconds")
    s.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic owner data")
    s.add_argument("--noise-key", default=None, help="hex 16-byte node-noise key (reproducible)")
    s.add_argument("--spawn", choices=["subprocess", "fork"], default="subprocess")
    s.add_argument(
        "--statistic",
        choices=["ecdf", "roc"],
        default="ecdf",
        help="roc: owners hold a synthetic score and a 0/1 label; prints the ROC and its AUC",
    )
    s.set_defaults(func=_simulate)
    i = sub.add_parser("init", help="write a session file and one secret file per party")
    i.add_argument("--out", required=True, help="directory to create (session.json, secrets/)")
    i.add_argument("--owners", type=int, required=True)
    i.add_argument("--servers", type=int, default=2)
    i.add_argument("--protocol", choices=["shares", "fss"], default="shares")
    i.add_argument("--size", type=int, required=True, help="number of grid thresholds")
    i.add_argument("--lower", type=float, default=0.0, help="grid lower bound (default 0)")
    i.add_argument("--upper", type=float, default=1.0, help="grid upper bound (default 1)")
    i.add_argument("--epsilon", type=float, required=True)
    i.add_argument("--noise-sharing", choices=["dealer", "distributed"], default="dealer")
    i.add_argument("--neighbouring", choices=["replace_one", "add_remove"], default="replace_one")
    i.add_argument("--timeout", type=float, default=600.0)
    i.add_argument(
        "--statistic",
        choices=["ecdf", "roc"],
        default="ecdf",
        help="roc: owners pass --labels with their --values",
    )
    i.add_argument(
        "--n-values",
        type=int,
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
    for name, what in (
        ("serve", "a server"),
        ("owner", "a data owner"),
        ("dealer", "the dealer"),
        ("analyst", "the analyst (prints the release)"),
    ):
        q = sub.add_parser(name, help=f"run {what} from a session file")
        q.add_argument("session", help="public session JSON")
        q.add_argument("--secret", required=True, help="this party's secret JSON (link keys)")
        if name in ("serve", "owner"):
            q.add_argument("--index", type=int, required=True, help="party index")
        if name == "serve":
            q.add_argument("--host", default="127.0.0.1")
            q.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
        if name == "owner":
            q.add_argument("--values", required=True, help="comma-separated values")
            q.add_argument("--labels", default=None, help="comma-separated 0/1 labels (roc)")
        q.set_defaults(func=_party)
    p.set_defaults(func=_no_action(p))
    return p


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
            owner_labels=[[int(y)] for y in labels] if args.statistic == "roc" else None,
        )
    except FederatedError as exc:
        print(f"clipless federated simulate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
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
    import os

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
            statistic=args.statistic,
        )  # fmt: skip
    except ValueError as exc:
        print(f"clipless federated init: error: {exc}", file=sys.stderr)
        return 2
    sess["servers_at"] = addrs
    out = Path(args.out)
    (out / "secrets").mkdir(parents=True, exist_ok=False)
    (out / "session.json").write_text(json.dumps(sess, indent=1))
    for name, sec in secrets_.items():
        path = out / "secrets" / f"{name.replace(' ', '-')}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(sec, fh)
    print(f"wrote {out / 'session.json'} and {len(secrets_)} secret files in {out / 'secrets'}")
    print("give each party ONLY its own secret file, over a confidential channel")
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

    sess = json.loads(Path(args.session).read_text())
    secret = json.loads(Path(args.secret).read_text())
    cmd = args.federated_command
    try:
        if cmd == "serve":
            listener = socket.create_server((args.host, args.port))
            host, port = listener.getsockname()[:2]
            print(f"listening {host}:{port}", flush=True)
            # load the release code (clipless.stats, scipy) while the owners start, not after
            import clipless.federated.ecdf  # noqa: F401

            counter = fs.run_server(sess, secret, args.index, listener)
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
        print(json.dumps({"sent": {}, "error": [exc.code, str(exc), exc.party]}), flush=True)
        print(f"clipless federated {cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"sent": dict(counter.sent), "error": None}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m clipless.federated.cli ACTION ...``: the same commands as
    ``clipless federated``, without loading the rest of the ``clipless`` command (faster party
    start-up; :func:`clipless.federated.session.simulate` uses it)."""
    parser = argparse.ArgumentParser(prog="clipless federated")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_federated_parser(sub)
    args = parser.parse_args(["federated", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
