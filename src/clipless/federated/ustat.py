"""``UStat``: publish ``M sum_i phi(x_i) + sum_{k in I} eta_k`` with the noise kept secret.

Thesis section 6.2: "we assume the existence of an operation ``UStat(phi, X, eta : I)`` that
computes and publishes ``U_phi(X) + sum_{i in I} eta_i`` in a way compliant with the considered
attack model ... [with] the facilities to draw, store and keep secret the values in ``eta``".
Everything after it is done in the open, so the federated ECDF inherits its attack model from
the backend. Here all values live in the ring ``Z_2^64`` (numpy ``uint64`` arithmetic wraps
modulo ``2^64``); a published value is read back as a signed int64, exact as long as the true
value is below ``2^63`` in magnitude.

Backends
--------
``"local"``
    A trusted curator in one process sums the contributions and adds the noise. Attack model:
    the curator sees every input; DP holds only against the readers of the output.
``"shares"``
    Additive secret sharing over ``Z_2^64`` among ``m >= 2`` servers. Owner ``i`` splits its
    vector ``u_i`` into ``r_{i,1} + ... + r_{i,m} = u_i``: ``r_{i,j} = PRG(sigma_{i,j})`` for
    ``j < m`` (AES-128-CTR, :func:`~clipless.federated.prg.prg_words`; the owner sends the
    16-byte seed ``sigma_{i,j}``) and the explicit last share ``r_{i,m} = u_i - sum_j r_{i,j}``
    (``8 d`` bytes). Any ``m - 1`` shares are (pseudo)uniform and independent of ``u_i``. Each
    server sums its shares, applies the public integer map ``M`` and adds its share of the
    noise; the shares of the result are published and summed. Semi-honest (honest-but-curious)
    servers; no robustness to a server that lies about its sum (it can shift the output).

Noise sharing (``noise_sharing``, for ``"shares"``)
---------------------------------------------------
``"dealer"``
    A noise dealer holding the node-noise key ``K`` (:class:`~clipless.federated.NodeNoise`)
    gives each server ``j < m`` a 16-byte seed ``s_j`` and the last server the explicit shares
    ``eta_k - sum_j F_{s_j}(k)`` of every node ``k`` (``F`` = AES PRF,
    :func:`~clipless.federated.prg.prf_words`): server ``j``'s share of node ``k`` is
    ``F_{s_j}(k)``, identical in every query. The released noise is exactly the central one
    (variance ``Var(eta)``). **Survives**: any coalition of at most ``m - 1`` servers together
    with any owners and the analyst, provided the dealer is not in it. **Fails**: the dealer
    with the analyst (or anyone who reads the output) learns the exact counts; all ``m``
    servers together learn every input.
``"distributed"``
    No dealer: server ``j`` holds its own key ``K_j`` (over TCP drawn by the server itself,
    :func:`clipless.federated.session.run_server`; nobody else ever has it, ``init`` included;
    in process the one :class:`UStat` plays every server) and adds its own full-scale node noise
    ``eta^(j)_k`` (same PRF derivation) to its share; the released noise is
    ``sum_j eta^(j)_k`` (variance ``m Var(eta)``). **Survives**: any coalition of at most
    ``m - 1`` servers with any owners and the analyst: one honest server's noise is unknown to
    the coalition, and the output minus the noise the coalition knows is the counts plus at
    least one full-scale noise (post-processing of an ``epsilon``-DP release). **Fails**: all
    ``m`` servers (they know all inputs anyway). The price is ``m`` times the variance.

The central equivalent of either option is :func:`clipless.stats.tree.release_counts` with
``node_noise=NodeNoise(K)`` (dealer) or ``node_noise=SummedNoise([NodeNoise(K_j)])``
(distributed): equal bit for bit (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from clipless.federated.noise import NodeNoise, NoiseParam, SummedNoise, tree_key
from clipless.federated.prg import SEED_BYTES, _check_key, prf_words, prg_words, random_seed

if TYPE_CHECKING:
    import scipy.sparse as sp

    from clipless.stats.tree import NoiseKind

__all__ = [
    "Backend",
    "NoiseDealer",
    "NoiseSharing",
    "ShareServer",
    "Traffic",
    "UStat",
    "combine",
    "linear_mod",
    "owner_messages",
]

Backend = Literal["local", "shares"]
NoiseSharing = Literal["dealer", "distributed"]

U64 = np.uint64


def _as_ring(values: ArrayLike, name: str) -> NDArray[np.uint64]:
    arr = np.asarray(values)
    if not (arr.dtype == bool or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64).view(np.uint64) if arr.dtype != np.uint64 else arr.copy()


def combine(shares: Sequence[NDArray[np.uint64]]) -> NDArray[np.int64]:
    """Sum of shares modulo ``2^64``, read as signed int64.

    Args:
        shares: every server's output share (equal lengths, at least one).
    """
    total = np.zeros_like(np.asarray(shares[0], dtype=np.uint64))
    for s in shares:
        total = total + np.asarray(s, dtype=np.uint64)
    return total.view(np.int64)


def linear_mod(matrix: sp.spmatrix | None, x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """``matrix @ x`` in ``Z_2^64`` for a public integer sparse ``matrix`` (exact, wrapping)."""
    if matrix is None:
        return x
    import scipy.sparse as sp

    coo = sp.coo_matrix(matrix)
    prod = coo.data.astype(np.int64).view(np.uint64) * x[coo.col]
    out = np.zeros(coo.shape[0], dtype=np.uint64)
    np.add.at(out, coo.row, prod)
    return out


def owner_messages(
    contribution: ArrayLike, servers: int, seeds: Sequence[bytes] | None = None
) -> list[bytes]:
    """The ``m`` messages of one owner: ``m - 1`` seeds (16 bytes each) and the explicit last
    share (``8 d`` bytes, little-endian ``uint64``).

    Args:
        contribution: the owner's integer vector ``u`` (length ``d``), read in ``Z_2^64``.
        servers: ``m >= 2``.
        seeds: the ``m - 1`` 16-byte seeds (``None``: fresh).

    Raises:
        ValueError: fewer than 2 servers or a wrong number of seeds.
    """
    u = _as_ring(np.ravel(contribution), "contribution")
    if servers < 2:
        raise ValueError(f"servers must be >= 2 for secret sharing, got {servers}")
    seeds = [random_seed() for _ in range(servers - 1)] if seeds is None else list(seeds)
    if len(seeds) != servers - 1:
        raise ValueError(f"need {servers - 1} seeds, got {len(seeds)}")
    last = u.copy()
    for s in seeds:
        last = last - prg_words(_check_key(s), u.size)
    return [bytes(s) for s in seeds] + [last.astype("<u8").tobytes()]


def _node_blocks(levels: NDArray[np.int64], index: NDArray[np.int64]) -> NDArray[np.uint64]:
    return np.stack([levels.astype(np.uint64), index.astype(np.uint64)], axis=1)


class NoiseDealer:
    """The ``"dealer"`` option: holds the node-noise key, hands out noise shares once.

    Args:
        key: the 16-byte node-noise key (:class:`~clipless.federated.NodeNoise`).
        servers: ``m``, the number of servers.
        seeds: the ``m - 1`` 16-byte seeds of servers ``0..m-2`` (``None``: fresh).
    """

    def __init__(self, key: bytes, servers: int, seeds: Sequence[bytes] | None = None) -> None:
        self.noise = NodeNoise(key)
        self.servers = servers
        self.seeds = [random_seed() for _ in range(servers - 1)] if seeds is None else list(seeds)

    def messages(
        self,
        kind: NoiseKind,
        param: NoiseParam,
        levels: NDArray[np.int64],
        index: NDArray[np.int64],
    ) -> list[bytes]:
        """Seeds for servers ``0..m-2``; explicit shares of the given nodes for the last one."""
        eta = self.noise.nodes(kind, param, levels, index).view(np.uint64)
        last = eta.copy()
        blocks = _node_blocks(levels, index)
        for s in self.seeds:
            last = last - prf_words(s, blocks)
        return [bytes(s) for s in self.seeds] + [last.astype("<u8").tobytes()]


@dataclass
class ShareServer:
    """Server ``index`` of ``servers``: sums owner shares, holds its share of the node noise.

    Args:
        index: this server's index, in ``[0, servers)``.
        servers: ``m``, the number of servers.
        dim: the length ``d`` of the owners' vectors.
        noise_key: with ``"distributed"``, this server's own node-noise key; otherwise
            ``None``, and :meth:`receive_noise` is given the dealer's message for the nodes it
            will need.

    Raises:
        ValueError: an index outside ``[0, servers)``.
    """

    index: int
    servers: int
    dim: int
    noise_key: bytes | None = None
    _sum: NDArray[np.uint64] = field(init=False, repr=False)
    _noise_seed: bytes | None = field(default=None, init=False, repr=False)
    _noise_table: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)
    owners: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.servers:
            raise ValueError(f"index must be in [0, {self.servers}), got {self.index}")
        self._sum = np.zeros(self.dim, dtype=np.uint64)

    @property
    def is_last(self) -> bool:
        """Whether this is the last server (it receives explicit shares, not seeds)."""
        return self.index == self.servers - 1

    def receive_share(self, payload: bytes) -> None:
        """Add one owner's share (a seed, or the explicit last share)."""
        if self.is_last:
            if len(payload) != 8 * self.dim:
                raise ValueError(
                    f"server {self.index}: explicit share must be {8 * self.dim} bytes, "
                    f"got {len(payload)}"
                )
            self._sum = self._sum + np.frombuffer(payload, dtype="<u8").astype(np.uint64)
        else:
            if len(payload) != SEED_BYTES:
                raise ValueError(
                    f"server {self.index}: share seed must be {SEED_BYTES} bytes, "
                    f"got {len(payload)}"
                )
            self._sum = self._sum + prg_words(payload, self.dim)
        self.owners += 1

    def add_plain(self, values: NDArray[np.uint64]) -> None:
        """Add an already-computed share vector (used by the FSS servers)."""
        self._sum = self._sum + values
        self.owners += 1

    def receive_noise(
        self, payload: bytes, levels: NDArray[np.int64], index: NDArray[np.int64]
    ) -> None:
        """The dealer's message: a seed (servers ``< m-1``) or explicit node shares (last)."""
        if self.is_last:
            words = np.frombuffer(payload, dtype="<u8").astype(np.uint64)
            if words.size != np.asarray(levels).size:
                raise ValueError(
                    f"server {self.index}: noise shares for {np.asarray(levels).size} nodes "
                    f"expected, got {words.size}"
                )
            for lv, ix, w in zip(levels.tolist(), index.tolist(), words.tolist(), strict=True):
                self._noise_table[(lv, ix)] = w
        else:
            self._noise_seed = _check_key(payload, "noise seed")

    def noise_shares(
        self,
        kind: NoiseKind,
        param: NoiseParam,
        levels: NDArray[np.int64],
        index: NDArray[np.int64],
    ) -> NDArray[np.uint64]:
        """This server's share of the noise of nodes ``(levels, index)``."""
        if self.noise_key is not None:
            return NodeNoise(self.noise_key).nodes(kind, param, levels, index).view(np.uint64)
        if self._noise_seed is not None:
            return prf_words(self._noise_seed, _node_blocks(levels, index))
        try:
            pairs = zip(levels.tolist(), index.tolist(), strict=True)
            vals = [self._noise_table[(lv, ix)] for lv, ix in pairs]
        except KeyError as exc:
            raise RuntimeError(f"server {self.index}: no noise share for node {exc}") from None
        return np.array(vals, dtype=np.uint64)

    def output(
        self,
        kind: NoiseKind,
        param: NoiseParam,
        noise_levels: NDArray[np.int64],
        noise_index: NDArray[np.int64],
        matrix: sp.spmatrix | None = None,
    ) -> NDArray[np.uint64]:
        """``M (sum of shares) + sum_k (noise share of node [row, k])``; rows of the noise
        arrays (shape ``(d_out, k)``) name the nodes added to each output."""
        agg = linear_mod(matrix, self._sum)
        lev = np.asarray(noise_levels, dtype=np.int64)
        idx = np.asarray(noise_index, dtype=np.int64)
        if lev.shape[0] != agg.size:
            raise ValueError(f"noise rows {lev.shape[0]} != output size {agg.size}")
        shares = self.noise_shares(kind, param, lev.ravel(), idx.ravel()).reshape(lev.shape)
        return agg + shares.sum(axis=1, dtype=np.uint64)


@dataclass
class Traffic:
    """Payload bytes sent, per role (``owners``, ``dealer``, ``servers``)."""

    owners: int = 0
    dealer: int = 0
    servers: int = 0

    @property
    def total(self) -> int:
        """Bytes sent on all links."""
        return self.owners + self.dealer + self.servers


class UStat:
    """The thesis's ``UStat`` operation with a ``"local"`` or ``"shares"`` backend.

    The backend and the noise option decide which coalitions the DP guarantee survives (module
    docstring).

    Args:
        backend: ``"local"`` (trusted curator) or ``"shares"`` (additive secret sharing).
        servers: the number of servers, ``>= 2`` for ``"shares"`` (1 for ``"local"``).
        noise_sharing: ``"dealer"`` (one noise key) or ``"distributed"`` (one per server, the
            noise summed); ``"local"`` always uses a dealer.
        noise_keys: one 16-byte key (``"local"``, or ``"shares"`` with ``"dealer"``) or
            ``servers`` distinct keys (``"distributed"``); fresh random keys when ``None``.
        tree: the released tree's :func:`~clipless.federated.noise.tree_context`, which the
            keys are bound to (``None``: the keys are used as given).

    Raises:
        ValueError, TypeError: an unknown backend or noise option, too few servers, or keys of
            the wrong number, length or type, or repeated.
    """

    def __init__(
        self,
        backend: Backend = "shares",
        servers: int = 2,
        noise_sharing: NoiseSharing = "dealer",
        noise_keys: Sequence[bytes] | None = None,
        tree: bytes | None = None,
    ) -> None:
        if backend not in ("local", "shares"):
            raise ValueError(f"backend must be 'local' or 'shares', got {backend!r}")
        if noise_sharing not in ("dealer", "distributed"):
            raise ValueError(
                f"noise_sharing must be 'dealer' or 'distributed', got {noise_sharing!r}"
            )
        if isinstance(servers, bool) or not isinstance(servers, int):
            raise TypeError(f"servers must be an int, got {type(servers).__name__}")
        if backend == "shares" and servers < 2:
            raise ValueError(f"servers must be >= 2 for backend='shares', got {servers}")
        self.backend = backend
        self.servers = servers if backend == "shares" else 1
        self.noise_sharing: NoiseSharing = noise_sharing if backend == "shares" else "dealer"
        need = self.servers if self.noise_sharing == "distributed" else 1
        if isinstance(noise_keys, str | bytes | bytearray):
            raise TypeError(
                "noise_keys must be a list of 16-byte keys (bytes), one per noise source; got a "
                f"single {type(noise_keys).__name__}"
            )
        keys = [random_seed() for _ in range(need)] if noise_keys is None else list(noise_keys)
        if len(keys) != need:
            raise ValueError(
                f"noise_keys must hold {need} key(s) for backend={backend!r}, "
                f"noise_sharing={self.noise_sharing!r}; got {len(keys)}"
            )
        self.noise_keys = [_check_key(k, "noise key") for k in keys]
        #: the keys the noise is drawn with: ``noise_keys`` bound to the released tree
        #: (:func:`~clipless.federated.noise.tree_key`), or themselves without a ``tree``
        self.working_keys = (
            list(self.noise_keys) if tree is None else [tree_key(k, tree) for k in self.noise_keys]
        )
        if len(set(self.noise_keys)) != len(self.noise_keys):
            raise ValueError(
                "noise_keys must be distinct: servers holding the same key add the same noise, "
                "so any one of them knows the whole noise (and the variance is m times smaller "
                "than reported)"
            )
        self.traffic = Traffic()

    @property
    def noise_source(self) -> NodeNoise | SummedNoise:
        """The central equivalent of the released noise."""
        if self.noise_sharing == "distributed":
            return SummedNoise([NodeNoise(k) for k in self.working_keys])
        return NodeNoise(self.working_keys[0])

    def publish(
        self,
        contributions: Sequence[ArrayLike],
        kind: NoiseKind,
        param: NoiseParam,
        noise_levels: NDArray[np.int64],
        noise_index: NDArray[np.int64],
        matrix: sp.spmatrix | None = None,
    ) -> NDArray[np.int64]:
        """``M sum_i u_i + (sum of the noise of the nodes named in each row)``, int64.

        Args:
            contributions: one integer vector ``u_i`` per owner (same length ``d``).
            kind: ``"laplace"`` or ``"gaussian"``.
            param: the exact noise parameter, or one per tree level.
            noise_levels, noise_index: the nodes whose noise each output row sums, shape
                ``(d_out, k)``.
            matrix: the public integer ``d_out x d`` map ``M`` (``None``: the identity).
        """
        if len(contributions) == 0:
            raise ValueError("contributions must hold at least one owner's vector")
        vecs = [_as_ring(np.ravel(c), "contributions") for c in contributions]
        d = vecs[0].size
        if any(v.size != d for v in vecs):
            raise ValueError("every owner's contribution must have the same length")
        lev = np.asarray(noise_levels, dtype=np.int64)
        idx = np.asarray(noise_index, dtype=np.int64)
        if self.backend == "local":
            agg = linear_mod(matrix, combine(vecs).view(np.uint64))
            eta = self.noise_source.nodes(kind, param, lev.ravel(), idx.ravel())
            noise = eta.view(np.uint64).reshape(lev.shape).sum(axis=1, dtype=np.uint64)
            return (agg + noise).view(np.int64)
        m = self.servers
        servers = [
            ShareServer(
                j,
                m,
                d,
                noise_key=self.working_keys[j] if self.noise_sharing == "distributed" else None,
            )
            for j in range(m)
        ]
        if self.noise_sharing == "dealer":
            flat_l, flat_i = _unique_nodes(lev, idx)
            dealer = NoiseDealer(self.working_keys[0], m)
            for srv, msg in zip(servers, dealer.messages(kind, param, flat_l, flat_i), strict=True):
                self.traffic.dealer += len(msg)
                srv.receive_noise(msg, flat_l, flat_i)
        for u in vecs:
            for srv, msg in zip(servers, owner_messages(u, m), strict=True):
                self.traffic.owners += len(msg)
                srv.receive_share(msg)
        outs = [srv.output(kind, param, lev, idx, matrix) for srv in servers]
        self.traffic.servers += sum(8 * o.size for o in outs)
        return combine(outs)


def _unique_nodes(
    levels: NDArray[np.int64], index: NDArray[np.int64]
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    pairs = np.unique(np.stack([levels.ravel(), index.ravel()], axis=1), axis=0)
    return pairs[:, 0].copy(), pairs[:, 1].copy()
