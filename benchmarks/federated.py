"""Federated DP-ECDF communication and time (thesis section 6.6, Figure 6.6.6), measured.

* **bytes vs |B|** and **bytes vs m** -- every party a separate process over TCP loopback
  (:func:`clipless.federated.session.simulate`, fork start), bytes counted on the wire (whole
  HMAC-authenticated frames), next to the exact formula and the thesis's leading terms
  ``O(n |B|)`` (secret sharing, owners re-send per query) and ``O(n + m |B|)`` (FSS: one DCF key
  per owner and server, then ``m |B|`` words). Each owner holds one value; the grid has
  ``N = 1024`` thresholds, the query ``B`` is ``|B|`` evenly spaced of them.
* **wall time** -- the whole protocol in one process (:func:`clipless.federated.federated_ecdf`:
  the same messages, no sockets) for ``n`` up to 1,000 owners and ``|B|`` up to 1,024, and the
  TCP run's wall time for the byte measurements.

Exact wire bytes (frame = 23-byte header + payload + 32-byte HMAC tag, ``F = 55``; ``d = |B|``;
``k(n_bits) = 24 + 25 n_bits`` bytes per DCF key; the dealer deals all ``2N - 1`` node noises)::

    owners  shares: n ((m-1)(F+16) + F + 8d)         fss: n m (F + k)
    dealer  (m-1)(F+16) + F + 8(2N-1)
    servers m ((n+1) F + F + 8d)                     (acknowledgements + one result each)
    analyst m F

Run (from the repository root)::

    .venv/bin/python benchmarks/federated.py --quick     # about a minute
    .venv/bin/python benchmarks/federated.py             # n = 100 over TCP, n up to 1000 in process

Writes ``benchmarks/out/federated.json`` and ``benchmarks/out/federated_bytes.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from clipless.federated import federated_ecdf
from clipless.federated.dcf import domain_bits, key_bytes
from clipless.federated.session import simulate
from clipless.stats import Grid

FRAME = 55
GRID = 1024


def wire_formula(protocol: str, n: int, m: int, d: int, size: int) -> dict[str, int]:
    """Exact bytes on the wire per role (module docstring)."""
    if protocol == "shares":
        owner = n * ((m - 1) * (FRAME + 16) + FRAME + 8 * d)
    else:
        owner = n * m * (FRAME + key_bytes(domain_bits(size)))
    dealer = (m - 1) * (FRAME + 16) + FRAME + 8 * (2 * (1 << (size - 1).bit_length()) - 1)
    server = m * ((n + 1) * FRAME + FRAME + 8 * d)
    return {"owner": owner, "dealer": dealer, "server": server, "analyst": m * FRAME}


def leading_terms(protocol: str, n: int, m: int, d: int, size: int) -> int:
    """The thesis's asymptotic terms with this implementation's constants (payload only)."""
    if protocol == "shares":
        return 8 * n * d + 16 * n * (m - 1)  # O(n |B|)
    return m * n * key_bytes(domain_bits(size)) + 8 * m * d  # O(n + m |B|)


def points(d: int, size: int = GRID) -> list[int]:
    return np.unique(np.linspace(0, size - 1, d).round().astype(int)).tolist()


def tcp_run(protocol: str, n: int, m: int, d: int, seed: int = 0) -> dict[str, Any]:
    vals = [[float(v)] for v in np.random.default_rng(seed).beta(2, 5, n)]
    pts = points(d)
    res = simulate(protocol, vals, m, GRID, 1.0, points=pts, timeout=300.0)
    roles = res.by_role()
    formula = wire_formula(protocol, n, m, len(pts), GRID)
    return {
        "protocol": protocol,
        "n": n,
        "m": m,
        "B": len(pts),
        "measured": res.total,
        "by_role": roles,
        "formula": sum(formula.values()),
        "formula_matches": roles == formula,
        "leading": leading_terms(protocol, n, m, len(pts), GRID),
        "wall_s": res.wall_time,
    }


def in_process_time(protocol: str, n: int, d: int, seed: int = 0) -> dict[str, Any]:
    vals = [[float(v)] for v in np.random.default_rng(seed).beta(2, 5, n)]
    grid = Grid(0, 1, size=GRID)
    pts = points(d)
    t0 = time.perf_counter()
    federated_ecdf(vals, grid, 1.0, protocol=protocol, servers=2, thresholds=pts)  # type: ignore[arg-type]
    return {"protocol": protocol, "n": n, "B": len(pts), "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n = 20 over TCP, n <= 100 in process")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_tcp = 20 if args.quick else 100
    sizes = [1, 4, 16, 64, 256, 1024]
    results: dict[str, Any] = {"vs_B": [], "vs_m": [], "time": []}
    for proto in ("shares", "fss"):
        for d in sizes:
            r = tcp_run(proto, n_tcp, 2, d)
            results["vs_B"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "by_role"}), flush=True)
    for m in (2, 3, 4, 6, 8):
        r = tcp_run("shares", n_tcp, m, 64)
        results["vs_m"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "by_role"}), flush=True)
    for n in (10, 100) if args.quick else (10, 100, 1000):
        for d in (16, 128, 1024):
            for proto in ("shares", "fss"):
                r = in_process_time(proto, n, d)
                results["time"].append(r)
                print(json.dumps(r), flush=True)
    (out / "federated.json").write_text(json.dumps(results, indent=1))
    _plot(results, out / "federated_bytes.png", n_tcp)


def _plot(results: dict[str, Any], path: Path, n: int) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    for proto, colour in (("shares", "tab:blue"), ("fss", "tab:red")):
        rows = [r for r in results["vs_B"] if r["protocol"] == proto]
        b = [r["B"] for r in rows]
        ax1.loglog(b, [8 * r["measured"] for r in rows], "o-", color=colour, label=f"{proto}")
        ax1.loglog(b, [8 * r["leading"] for r in rows], "--", color=colour, alpha=0.6,
                   label=f"{proto} leading term")  # fmt: skip
    ax1.set_xlabel("|B| (thresholds evaluated)")
    ax1.set_ylabel("total bits sent")
    ax1.set_title(f"(a) n = {n} owners, m = 2")
    ax1.legend()
    rows = results["vs_m"]
    ms = [r["m"] for r in rows]
    ax2.plot(ms, [8 * r["measured"] for r in rows], "o-", color="tab:blue", label="shares")
    fss = [r for r in results["vs_B"] if r["protocol"] == "fss" and r["B"] == 64]
    if fss:
        ax2.plot([2], [8 * fss[0]["measured"]], "s", color="tab:red", label="fss (m = 2 only)")
    ax2.set_xlabel("m (servers)")
    ax2.set_ylabel("total bits sent")
    ax2.set_title(f"(b) n = {n}, |B| = 64")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
