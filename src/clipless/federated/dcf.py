"""Two-server distributed comparison functions (DCF) with an AES-128 PRG, vectorised.

Construction: Boyle, Chandran, Gilboa, Gupta, Ishai, Kumar, Rathee, "Function Secret Sharing
for Mixed-Mode and Fixed-Point Secure Computation" (Eurocrypt 2021), Figure 1 (``Gen^<`` /
``Eval^<``), which improves the comparison FSS of Boyle, Gilboa, Ishai (CCS 2016). A DCF key
pair for ``(alpha, beta)`` on the ``n``-bit domain shares the function

    f_{alpha,beta}(x) = beta   if x < alpha,      0 otherwise,

over the group ``G = Z_2^64``: ``Eval(0, k_0, x) + Eval(1, k_1, x) = f(x) mod 2^64``, and each
key alone is computationally indistinguishable from a key for any other ``alpha``.

PRG. ``G(s) = (s^L, v^L, t^L, s^R, v^R, t^R)`` for a 128-bit seed ``s``, built from AES-128 in
the fixed-key Matyas-Meyer-Oseas mode ``H_i(s) = AES_{k_i}(s) XOR s`` with four fixed public
keys ``k_0..k_3`` (``s^L = H_0(s)``, ``s^R = H_1(s)``, ``v^L || v^R = H_2(s)``, ``t^L, t^R`` =
the two low bits of ``H_3(s)``). Fixed-key AES as a PRG in this mode is the standard choice of
FSS implementations (Guo, Katz, Wang, Yu, "Efficient and Secure Multiparty Computation from
Fixed-Key Block Ciphers", S&P 2020, tweakable correlation-robust hashing); it lets one
``cryptography`` ECB call process the seeds of *all* keys at one tree level (numpy buffer in,
numpy buffer out): the only Python loop is over the ``n`` bits of the domain.
``Convert_G`` maps a 128-bit string to its low 64 bits (``G = Z_2^64``).

Key size (bytes), party ``b``: seed 16 + per level (``s_CW`` 16, ``V_CW`` 8, the two bits
``t_CW^L, t_CW^R`` in one byte) + final ``CW^(n+1)`` 8, i.e. ``24 + 25 n`` bytes (``824`` for
``n = 32``). The construction's bit count is ``lambda + n (lambda + 64 + 2) + 64`` =
``192 + 194 n`` bits (``800`` bytes at ``n = 32``, bit-packed); sycret (Ryffel et al., the
AriaNN library's Rust FSS) reports 920 bytes for its 32-bit comparison keys.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from numpy.typing import ArrayLike, NDArray

from clipless.federated.noise import NoiseParam
from clipless.federated.prg import prg_bytes
from clipless.federated.ustat import NoiseDealer, ShareServer, UStat, _unique_nodes, combine

if TYPE_CHECKING:
    import scipy.sparse as sp

    from clipless.stats.tree import NoiseKind

__all__ = [
    "DcfKeys",
    "domain_bits",
    "eval_dcf",
    "eval_dcf_all",
    "fss_publish",
    "gen_dcf",
    "key_bytes",
]

U64 = np.uint64
_MINUS_ONE = np.uint64(0xFFFFFFFFFFFFFFFF)


def key_bytes(n_bits: int) -> int:
    """Serialised size of one party's key on an ``n``-bit domain: ``24 + 25 n`` bytes."""
    return 24 + 25 * n_bits


def domain_bits(num_points: int) -> int:
    """Bits needed for the points ``0..num_points-1`` (at least 1)."""
    return max(1, int(num_points - 1).bit_length())


@lru_cache(maxsize=1)
def _fixed_keys() -> tuple[bytes, ...]:
    return tuple(
        hashlib.sha256(f"clipless.federated.dcf.prg/{i}".encode()).digest()[:16] for i in range(4)
    )


def _mmo(i: int, seeds: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """``AES_{k_i}(s) XOR s`` for every row ``s`` of ``seeds`` (shape ``(k, 2)``), one call."""
    buf = np.ascontiguousarray(seeds, dtype="<u8")
    enc = Cipher(algorithms.AES(_fixed_keys()[i]), modes.ECB()).encryptor()
    out = np.frombuffer(enc.update(buf.tobytes()), dtype="<u8").reshape(buf.shape)
    return out.astype(np.uint64) ^ seeds


def _prg(
    seeds: NDArray[np.uint64],
) -> tuple[
    NDArray[np.uint64],
    NDArray[np.uint64],
    NDArray[np.uint8],
    NDArray[np.uint64],
    NDArray[np.uint64],
    NDArray[np.uint8],
]:
    """``(s^L, v^L, t^L, s^R, v^R, t^R)`` for a batch of seeds (shape ``(k, 2)``)."""
    s_left = _mmo(0, seeds)
    s_right = _mmo(1, seeds)
    v = _mmo(2, seeds)
    t = _mmo(3, seeds)[:, 0]
    return (
        s_left,
        v[:, 0],
        (t & U64(1)).astype(np.uint8),
        s_right,
        v[:, 1],
        ((t >> U64(1)) & U64(1)).astype(np.uint8),
    )


def _sign(t: NDArray[np.uint8]) -> NDArray[np.uint64]:
    """``(-1)^t`` in ``Z_2^64``."""
    return np.where(t.astype(bool), _MINUS_ONE, U64(1))


@dataclass(frozen=True, eq=False)
class DcfKeys:
    """A batch of ``k`` DCF keys of one party on an ``n``-bit domain (see module docstring)."""

    party: int
    n_bits: int
    seed: NDArray[np.uint64]  # (k, 2)
    s_cw: NDArray[np.uint64]  # (k, n, 2)
    v_cw: NDArray[np.uint64]  # (k, n)
    t_cw: NDArray[np.uint8]  # (k, n) bit 0 = t^L_CW, bit 1 = t^R_CW
    cw_last: NDArray[np.uint64]  # (k,)

    def __len__(self) -> int:
        return int(self.seed.shape[0])

    def to_bytes(self) -> bytes:
        """``k`` keys of :func:`key_bytes` bytes each, concatenated."""
        k, n = len(self), self.n_bits
        level = np.zeros((k, n, 25), dtype=np.uint8)
        level[:, :, :16] = (
            np.ascontiguousarray(self.s_cw.astype("<u8")).view(np.uint8).reshape(k, n, 16)
        )
        level[:, :, 16:24] = (
            np.ascontiguousarray(self.v_cw.astype("<u8")).view(np.uint8).reshape(k, n, 8)
        )
        level[:, :, 24] = self.t_cw
        out = np.concatenate(
            [
                np.ascontiguousarray(self.seed.astype("<u8")).view(np.uint8).reshape(k, 16),
                level.reshape(k, 25 * n),
                np.ascontiguousarray(self.cw_last.astype("<u8")).view(np.uint8).reshape(k, 8),
            ],
            axis=1,
        )
        return out.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, party: int, n_bits: int) -> DcfKeys:
        """Parse :meth:`to_bytes` output (``ValueError`` if the length is not a multiple)."""
        size = key_bytes(n_bits)
        if len(data) % size:
            raise ValueError(
                f"DCF key data of {len(data)} bytes is not a whole number of {size}-byte keys "
                f"({n_bits}-bit domain)"
            )
        arr = np.frombuffer(data, dtype=np.uint8).reshape(-1, size)
        k, n = arr.shape[0], n_bits
        level = arr[:, 16 : 16 + 25 * n].reshape(k, n, 25)
        t_cw = level[:, :, 24].copy()
        if np.any(t_cw > 3):
            raise ValueError("malformed DCF key: control-bit byte above 3")
        return cls(
            party=party,
            n_bits=n,
            seed=np.ascontiguousarray(arr[:, :16]).view("<u8").astype(np.uint64),
            s_cw=np.ascontiguousarray(level[:, :, :16]).view("<u8").reshape(k, n, 2).astype(U64),
            v_cw=np.ascontiguousarray(level[:, :, 16:24]).view("<u8").reshape(k, n).astype(U64),
            t_cw=t_cw,
            cw_last=np.ascontiguousarray(arr[:, size - 8 :]).view("<u8").ravel().astype(U64),
        )


def gen_dcf(
    alpha: ArrayLike, n_bits: int, beta: ArrayLike = 1, seed: bytes | None = None
) -> tuple[DcfKeys, DcfKeys]:
    """Key pairs for ``f(x) = beta [x < alpha]`` for every ``alpha`` (vectorised ``Gen^<``).

    ``alpha``: integers in ``[0, 2^n)``; ``beta``: integer(s) in ``Z_2^64``; ``seed``: a 16-byte
    key making the generation reproducible (AES-CTR randomness, for tests), else the OS CSPRNG.
    """
    if isinstance(n_bits, bool) or not isinstance(n_bits, int) or not 1 <= n_bits <= 63:
        raise ValueError(f"n_bits must be an int in [1, 63], got {n_bits!r}")
    a = np.asarray(alpha)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError("alpha must be a 1-D integer array")
    if a.size and (a.min() < 0 or a.max() >= (1 << n_bits)):
        raise ValueError(f"alpha must lie in [0, 2^{n_bits}), got [{a.min()}, {a.max()}]")
    a = a.astype(np.uint64)
    k = a.size
    b = np.broadcast_to(np.asarray(beta).astype(np.int64).view(np.uint64), (k,)).copy()
    rand = secrets.token_bytes(32 * k) if seed is None else prg_bytes(seed, 32 * k)
    init = np.frombuffer(rand, dtype="<u8").astype(np.uint64).reshape(k, 2, 2)
    s0: NDArray[Any] = init[:, 0].copy()
    s1: NDArray[Any] = init[:, 1].copy()
    seed0, seed1 = s0.copy(), s1.copy()
    t0: NDArray[Any] = np.zeros(k, dtype=np.uint8)
    t1: NDArray[Any] = np.ones(k, dtype=np.uint8)
    v_alpha: NDArray[Any] = np.zeros(k, dtype=np.uint64)
    s_cw = np.empty((k, n_bits, 2), dtype=np.uint64)
    v_cw = np.empty((k, n_bits), dtype=np.uint64)
    t_cw = np.empty((k, n_bits), dtype=np.uint8)
    for i in range(n_bits):
        bit = ((a >> U64(n_bits - 1 - i)) & U64(1)).astype(bool)  # alpha_i, MSB first
        s0l, v0l, t0l, s0r, v0r, t0r = _prg(s0)
        s1l, v1l, t1l, s1r, v1r, t1r = _prg(s1)
        keep_r = bit[:, None]
        s0_lose, s1_lose = np.where(keep_r, s0l, s0r), np.where(keep_r, s1l, s1r)
        s0_keep, s1_keep = np.where(keep_r, s0r, s0l), np.where(keep_r, s1r, s1l)
        v0_lose, v1_lose = np.where(bit, v0l, v0r), np.where(bit, v1l, v1r)
        v0_keep, v1_keep = np.where(bit, v0r, v0l), np.where(bit, v1r, v1l)
        sign = _sign(t1)
        scw = s0_lose ^ s1_lose
        vcw = sign * (v1_lose - v0_lose - v_alpha)
        vcw = vcw + np.where(bit, sign * b, U64(0))  # Lose = L exactly when alpha_i = 1
        v_alpha = v_alpha - v1_keep + v0_keep + sign * vcw
        bit8 = bit.astype(np.uint8)
        tl_cw = t0l ^ t1l ^ bit8 ^ np.uint8(1)
        tr_cw = t0r ^ t1r ^ bit8
        t_keep_cw = np.where(bit, tr_cw, tl_cw)
        s0 = s0_keep ^ (scw * t0[:, None].astype(np.uint64))
        s1 = s1_keep ^ (scw * t1[:, None].astype(np.uint64))
        t0 = np.where(bit, t0r, t0l) ^ (t0 & t_keep_cw)
        t1 = np.where(bit, t1r, t1l) ^ (t1 & t_keep_cw)
        s_cw[:, i] = scw
        v_cw[:, i] = vcw
        t_cw[:, i] = tl_cw | (tr_cw << np.uint8(1))
    cw_last = _sign(t1) * (s1[:, 0] - s0[:, 0] - v_alpha)
    keys = tuple(
        DcfKeys(party, n_bits, sd, s_cw, v_cw, t_cw, cw_last)
        for party, sd in ((0, seed0), (1, seed1))
    )
    return keys[0], keys[1]


def eval_dcf(keys: DcfKeys, points: ArrayLike, chunk: int = 1 << 18) -> NDArray[np.uint64]:
    """``Eval^<(b, k, x)`` for every key and point: array ``(len(keys), len(points))``.

    Vectorised over all (key, point) pairs, ``chunk`` pairs at a time; per level, four AES-ECB
    calls over the whole batch. Shares of the two parties sum to ``beta [x < alpha]``.
    """
    x = np.asarray(points)
    if x.ndim != 1 or not np.issubdtype(x.dtype, np.integer):
        raise ValueError("points must be a 1-D integer array")
    n = keys.n_bits
    if x.size and (x.min() < 0 or x.max() >= (1 << n)):
        raise ValueError(f"points must lie in [0, 2^{n}), got [{x.min()}, {x.max()}]")
    x = x.astype(np.uint64)
    k, t = len(keys), x.size
    out = np.empty((k, t), dtype=np.uint64)
    if k == 0 or t == 0:
        return out
    rows = max(1, chunk // t)
    neg = keys.party == 1
    for start in range(0, k, rows):
        sl = slice(start, min(k, start + rows))
        kk = sl.stop - sl.start
        key_idx = np.repeat(np.arange(sl.start, sl.stop), t)
        xs = np.tile(x, kk)
        s = keys.seed[key_idx]
        tb = np.full(key_idx.size, keys.party, dtype=np.uint8)
        v = np.zeros(key_idx.size, dtype=np.uint64)
        for i in range(n):
            sl_, vl, tl, sr, vr, tr = _prg(s)
            scw = keys.s_cw[key_idx, i]
            tcw = keys.t_cw[key_idx, i]
            tmask = tb.astype(np.uint64)[:, None]
            sl_ = sl_ ^ (scw * tmask)
            sr = sr ^ (scw * tmask)
            tl = tl ^ (tb & (tcw & np.uint8(1)))
            tr = tr ^ (tb & (tcw >> np.uint8(1)))
            go_r = ((xs >> U64(n - 1 - i)) & U64(1)).astype(bool)
            term = np.where(go_r, vr, vl) + tb.astype(np.uint64) * keys.v_cw[key_idx, i]
            v = v + term
            s = np.where(go_r[:, None], sr, sl_)
            tb = np.where(go_r, tr, tl)
        v = v + s[:, 0] + tb.astype(np.uint64) * keys.cw_last[key_idx]
        if neg:
            v = U64(0) - v
        out[sl] = v.reshape(kk, t)
    return out


def eval_dcf_all(keys: DcfKeys, chunk: int = 1 << 18) -> NDArray[np.uint64]:
    """Full-domain evaluation: ``Eval^<(b, k, x)`` for every key and every ``x < 2^n``.

    Expands each key's tree breadth first (both children of every node), ``2^(n+1)`` PRG
    calls per key instead of ``n 2^n`` for pointwise evaluation of the whole domain; the values
    equal :func:`eval_dcf` at every point (tested). Returns ``(len(keys), 2^n)``.
    """
    n = keys.n_bits
    k, width = len(keys), 1 << n
    out = np.empty((k, width), dtype=np.uint64)
    rows = max(1, chunk // width)
    for start in range(0, k, rows):
        idx = np.arange(start, min(k, start + rows))
        kk = idx.size
        s = keys.seed[idx]  # (kk * width_i, 2), node order: key-major, then x prefix
        tb = np.full(kk, keys.party, dtype=np.uint8)
        v = np.zeros(kk, dtype=np.uint64)
        key_idx = idx
        for i in range(n):
            sl_, vl, tl, sr, vr, tr = _prg(s)
            scw = keys.s_cw[key_idx, i]
            tcw = keys.t_cw[key_idx, i]
            tmask = tb.astype(np.uint64)[:, None]
            corr = tb.astype(np.uint64) * keys.v_cw[key_idx, i]
            s = np.stack([sl_ ^ (scw * tmask), sr ^ (scw * tmask)], axis=1).reshape(-1, 2)
            tb = np.stack(
                [tl ^ (tb & (tcw & np.uint8(1))), tr ^ (tb & (tcw >> np.uint8(1)))], axis=1
            ).ravel()
            v = np.stack([v + vl + corr, v + vr + corr], axis=1).ravel()
            key_idx = np.repeat(key_idx, 2)
        v = v + s[:, 0] + tb.astype(np.uint64) * keys.cw_last[key_idx]
        if keys.party == 1:
            v = U64(0) - v
        out[idx] = v.reshape(kk, width)
    return out


def prefix_dcf_keys(
    leaves: NDArray[np.int64], beta: ArrayLike, n_bits: int, seed: bytes | None = None
) -> tuple[DcfKeys, DcfKeys]:
    """DCF pairs sharing ``t -> beta [leaf <= t]`` on ``t < 2^n`` (``n + 1``-bit keys)."""
    alpha = (1 << n_bits) - np.asarray(leaves, dtype=np.int64)
    return gen_dcf(alpha, n_bits + 1, beta=beta, seed=seed)


def prefix_dcf_shares(keys: DcfKeys, points: NDArray[np.int64]) -> NDArray[np.uint64]:
    """One server's share of ``sum_keys beta [leaf <= t]`` at every point ``t``."""
    n_bits = keys.n_bits - 1
    x = (1 << n_bits) - 1 - np.asarray(points, dtype=np.int64)
    return eval_dcf(keys, x).sum(axis=0, dtype=np.uint64)


def fss_publish(
    leaves: Sequence[NDArray[np.int64]],
    points: NDArray[np.int64],
    ustat: UStat,
    kind: NoiseKind,
    param: NoiseParam,
    noise_levels: NDArray[np.int64],
    noise_index: NDArray[np.int64],
    matrix: sp.spmatrix | None,
    domain: int | None = None,
) -> NDArray[np.int64]:
    """The FSS protocol in process (thesis section 6.4.2), two servers.

    ``domain``: the public grid size ``N``, which sizes the keys (default: the largest queried
    point, never the private values: a key size read from the largest value would tell it).

    Each value ``a`` (a leaf index) gives one DCF pair for ``[x < a]`` (``beta = 1``); server
    ``b`` computes its share of the prefix count ``C_t = #{a <= t} = K - #{t < a}`` as
    ``[b = 0] K - sum_keys Eval(b, k, t)`` (``K`` = number of keys, public to the servers),
    applies the public map, adds its node-noise share (``ustat``'s option) and publishes.
    """
    size = int(points.max()) + 1 if domain is None else int(domain)
    if any(lv.size and (int(lv.min()) < 0 or int(lv.max()) >= size) for lv in leaves):
        raise ValueError(f"leaf indices must lie in [0, {size}) (the public domain)")
    n_bits = domain_bits(size)
    servers = fss_servers(ustat, points.size, kind, param, noise_levels, noise_index)
    # every owner generates its own keys; in one process the generation is batched (one
    # vectorised call: the keys are independent, so this is the same distribution) and the
    # bytes are still counted per owner and server
    counts = [int(lv.size) for lv in leaves]
    pair = gen_dcf(np.concatenate(leaves), n_bits)
    size = key_bytes(n_bits)
    received: list[list[bytes]] = [[], []]
    for j, key in enumerate(pair):
        data = key.to_bytes()
        start = 0
        for c in counts:  # owner i's message to server j: its c keys
            received[j].append(data[start : start + c * size])
            ustat.traffic.owners += c * size
            start += c * size
    for j, srv in enumerate(servers):
        keys = DcfKeys.from_bytes(b"".join(received[j]), j, n_bits)
        srv.add_plain(server_prefix_shares(keys, points))
    return fss_combine(servers, ustat, kind, param, noise_levels, noise_index, matrix)


def fss_servers(
    ustat: UStat,
    dim: int,
    kind: NoiseKind,
    param: NoiseParam,
    noise_levels: NDArray[np.int64],
    noise_index: NDArray[np.int64],
) -> list[ShareServer]:
    """The two servers of an in-process FSS release, for ``dim`` shares each, holding their
    node-noise shares (``ustat``'s noise option; the dealer's bytes counted in its traffic)."""
    servers = [
        ShareServer(
            j,
            2,
            dim,
            noise_key=ustat.working_keys[j] if ustat.noise_sharing == "distributed" else None,
        )
        for j in range(2)
    ]
    if ustat.noise_sharing == "dealer":
        flat_l, flat_i = _unique_nodes(noise_levels, noise_index)
        dealer = NoiseDealer(ustat.working_keys[0], 2)
        for srv, msg in zip(servers, dealer.messages(kind, param, flat_l, flat_i), strict=True):
            ustat.traffic.dealer += len(msg)
            srv.receive_noise(msg, flat_l, flat_i)
    return servers


def fss_combine(
    servers: list[ShareServer],
    ustat: UStat,
    kind: NoiseKind,
    param: NoiseParam,
    noise_levels: NDArray[np.int64],
    noise_index: NDArray[np.int64],
    matrix: sp.spmatrix | None,
) -> NDArray[np.int64]:
    """The servers' published outputs (counted in ``ustat``'s traffic), combined."""
    outs = [srv.output(kind, param, noise_levels, noise_index, matrix) for srv in servers]
    ustat.traffic.servers += sum(8 * o.size for o in outs)
    return combine(outs)


def server_prefix_shares(keys: DcfKeys, points: NDArray[np.int64]) -> NDArray[np.uint64]:
    """Server ``keys.party``'s shares of ``C_t = #{alpha <= t}`` at every point."""
    if 2 * points.size * keys.n_bits >= (2 << keys.n_bits):  # full domain is cheaper
        total = eval_dcf_all(keys).sum(axis=0, dtype=np.uint64)[points]
    else:
        total = eval_dcf(keys, points).sum(axis=0, dtype=np.uint64)
    base = np.uint64(len(keys)) if keys.party == 0 else np.uint64(0)
    return base - total
