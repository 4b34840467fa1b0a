"""Tree-node noise derived from a PRF of the node id (the same noise in every query).

The thesis's federated ECDF (section 6.4, Eq. 6.4.1) publishes
``U_{phi <= tau_i}(X) + sum_{l=0..L} eta_{ceil(i/2^l), l}``: every query for threshold ``i``
reuses the *same* noise variables ``eta_{j,l}`` of the nodes on ``i``'s path, so that any number
of queries is post-processing of one tree release (thesis Theorem 6.3.1) and costs no extra
budget. "UStat has the facilities to draw, store and keep secret the values of eta". Here the
"storage" is a key: node ``(l, j)``'s noise is sampled by :mod:`clipless.stats.noise`'s exact
samplers (Canonne, Kamath, Steinke 2020, Algorithms 2 and 3) from an AES-128-CTR stream
(:class:`~clipless.federated.prg.AesCtrRandom`) keyed by

    k_{l,j} = AES_{K'}(l || j),   K' = HKDF-SHA256(K, info = kind || parameter),

so a node's noise is a deterministic function of (key ``K``, noise kind, exact parameter, node)
and is identical whenever and wherever it is recomputed, without storing it. Different noise
parameters (another epsilon) give independent noise (domain separation by the HKDF ``info``).

:class:`NodeNoise` is also a valid ``node_noise`` argument of
:func:`clipless.stats.tree.release_counts` and :func:`clipless.stats.ecdf`, which is how the
central and the federated releases are compared bit for bit. :class:`SummedNoise` is the noise
of the ``"distributed"`` option (each of the ``m`` servers adds its own full-scale noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray

from clipless.federated.prg import AesCtrRandom, _check_key, aes_ecb

if TYPE_CHECKING:
    from clipless.stats.tree import NoiseKind

__all__ = [
    "NodeNoise",
    "SummedNoise",
    "TaggedNoise",
    "node_ids",
    "num_nodes",
    "server_keys",
    "tree_context",
    "tree_key",
]

TAG_SHIFT = 32

NoiseParam = Fraction | tuple[Fraction | None, ...]
"""One exact noise parameter, or one per tree level (``None``: the level is not released)."""


def num_nodes(depth: int) -> int:
    """``2^(L+1) - 1`` nodes in a tree of depth ``L``."""
    return (1 << (depth + 1)) - 1


def node_ids(depth: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``(level, index)`` of every node in the level-by-level order of
    :func:`clipless.stats.tree.node_counts_from_leaves` (level 0 = leaves first)."""
    levels = np.concatenate(
        [np.full(1 << (depth - lev), lev, dtype=np.int64) for lev in range(depth + 1)]
    )
    index = np.concatenate(
        [np.arange(1 << (depth - lev), dtype=np.int64) for lev in range(depth + 1)]
    )
    return levels, index


def tree_context(thresholds: object, statistic: str, shape: str = "") -> bytes:
    """The identity of one released tree: the statistic, a SHA-256 of the grid's thresholds
    (float64, little-endian) and the tree's ``shape`` (``""``: the binary tree; the ``k``-ary
    tree names its ``k`` and level shares, so that two shapes on one grid never share noise).
    :func:`tree_key` binds a noise key to it.

    Args:
        thresholds: the grid's thresholds.
        statistic: ``"ecdf"`` or ``"roc"``.
        shape: the tree's shape (``""``: the binary tree).

    Raises:
        ValueError: another statistic.
    """
    import hashlib

    if statistic not in ("ecdf", "roc"):
        raise ValueError(f"statistic must be 'ecdf' or 'roc', got {statistic!r}")
    grid = np.ascontiguousarray(np.asarray(thresholds, dtype="<f8"))
    base = f"{statistic}/{hashlib.sha256(grid.tobytes()).hexdigest()}"
    return (base if not shape else f"{base}/{shape}").encode()


def tree_key(key: bytes, context: bytes) -> bytes:
    """The node-noise key of one tree: ``HKDF-SHA256(key, info = "tree/" || context)``.

    Node ``(l, j)``'s noise depends only on the key, the noise parameter and the node, so two
    trees released with one key and one parameter (two grids, or an ECDF and a ROC curve of the
    same scores) would carry the same noise, and their difference would be exact counts. The
    federated releases therefore derive the key of each tree from the caller's key and the
    tree's :func:`tree_context`: the same key gives the same noise for more thresholds of the
    same tree (free repeated queries) and independent noise for any other tree.

    Args:
        key: the caller's 16-byte noise key.
        context: the tree's :func:`tree_context`.

    Returns:
        The tree's 16-byte node-noise key.
    """
    key = _check_key(key, "key")
    info = b"clipless.federated.tree/" + bytes(context)
    return HKDF(algorithm=hashes.SHA256(), length=16, salt=None, info=info).derive(key)


def server_keys(key: bytes, servers: int) -> list[bytes]:
    """``servers`` distinct 16-byte keys derived from ``key`` (HKDF-SHA256, one ``info`` per
    server): the keys of the ``"distributed"`` option from one secret, for reproducible runs.

    Args:
        key: the 16-byte secret.
        servers: how many keys, an int ``>= 1``.

    Raises:
        ValueError: a key that is not 16 bytes, or ``servers`` below 1.
    """
    key = _check_key(key, "key")
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be an integer >= 1, got {servers!r}")
    out = []
    for j in range(servers):
        info = f"clipless.federated.server-noise-key/{j}".encode()
        out.append(HKDF(algorithm=hashes.SHA256(), length=16, salt=None, info=info).derive(key))
    return out


class _TreeNoise:
    """A node-noise source: :meth:`nodes` gives chosen nodes' noise, a call the whole tree's
    (``source(kind, param, depth)``: all ``2^(L+1) - 1`` nodes in level order, the form
    :func:`clipless.stats.tree.release_counts` takes)."""

    copies = 1
    """Independent draws summed into each node's noise (its variance is ``copies`` times one
    draw's): 1 for a :class:`NodeNoise`, ``m`` for :class:`SummedNoise` of ``m`` keys."""

    def nodes(
        self,
        kind: NoiseKind,
        param: Fraction | tuple[Fraction | None, ...],
        levels: NDArray[np.int64],
        index: NDArray[np.int64],
    ) -> NDArray[np.int64]:
        raise NotImplementedError

    def __call__(self, kind: NoiseKind, param: Fraction, depth: int) -> NDArray[np.int64]:
        levels, index = node_ids(depth)
        return self.nodes(kind, param, levels, index)


class NodeNoise(_TreeNoise):
    """Exact discrete Laplace / Gaussian noise for each tree node, derived from a 16-byte key.

    ``noise(kind, param, depth)`` returns the int64 noise of all ``2^(L+1) - 1`` nodes in level
    order; :meth:`nodes` the noise of chosen nodes only (the same values). ``param`` is the
    discrete Laplace scale or the discrete Gaussian ``sigma^2`` (exact rationals, as computed by
    :func:`clipless.stats.tree.release_counts`). Node ids do not depend on the depth, so the
    noise of node ``(l, j)`` is the same for every tree that contains it.

    The key is secret: whoever knows it knows the noise. Never reuse a key across datasets,
    and never across grids or statistics: the noise of node ``(l, j)`` depends on the key, the
    noise kind and parameter and the node only, so a release on another grid (or a ROC curve
    next to an ECDF) with the same key and parameter carries the same noise, and the difference
    of the two releases is exact counts. Reuse a key only for more thresholds of the same tree.

    Args:
        key: the secret 16-byte key.
    """

    def __init__(self, key: bytes) -> None:
        self._key = _check_key(key, "key")

    def _subkey(self, kind: NoiseKind, param: Fraction) -> bytes:
        if kind not in ("laplace", "gaussian"):
            raise ValueError(f"kind must be 'laplace' or 'gaussian', got {kind!r}")
        info = f"clipless.federated.node-noise/{kind}/{param.numerator}/{param.denominator}"
        hkdf = HKDF(algorithm=hashes.SHA256(), length=16, salt=None, info=info.encode())
        return hkdf.derive(self._key)

    def nodes(
        self,
        kind: NoiseKind,
        param: Fraction | tuple[Fraction | None, ...],
        levels: NDArray[np.int64],
        index: NDArray[np.int64],
    ) -> NDArray[np.int64]:
        """The noise of nodes ``(levels[k], index[k])``, int64.

        ``param`` is one exact parameter, or one per tree level (the ``k``-ary release's level
        budgets): node ``(l, j)`` then gets ``param[l mod 2^32]`` (the tag bits of
        :class:`TaggedNoise` stripped), exactly as if asked for with that one parameter.

        Args:
            kind: ``"laplace"`` or ``"gaussian"``.
            param: the exact discrete Laplace scale or Gaussian ``sigma^2``, or one per level.
            levels, index: the nodes' levels (0 = leaves) and indices within their level.
        """
        lev = np.asarray(levels, dtype=np.int64).ravel()
        idx = np.asarray(index, dtype=np.int64).ravel()
        if lev.shape != idx.shape:
            raise ValueError("levels and index must have the same length")
        if lev.size and (lev.min() < 0 or idx.min() < 0):
            raise ValueError("node levels and indices must be non-negative")
        if isinstance(param, tuple):
            out = np.empty(lev.size, dtype=np.int64)
            depth = lev & ((1 << TAG_SHIFT) - 1)
            for level in np.unique(depth).tolist():
                p = param[level] if level < len(param) else None
                if p is None:
                    raise ValueError(f"no noise parameter for level {level} (not released)")
                sel = depth == level
                out[sel] = self.nodes(kind, p, lev[sel], idx[sel])
            return out
        # imported here: parties that never sample (owners, servers holding dealt shares) start
        # without loading clipless.stats
        from clipless.stats.noise import discrete_gaussian, discrete_laplace

        param = Fraction(param)
        sub = self._subkey(kind, param)
        blocks = np.stack([lev.astype("<u8"), idx.astype("<u8")], axis=1)
        node_keys = aes_ecb(sub, np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, 16))
        out = np.empty(lev.size, dtype=np.int64)
        for k in range(lev.size):  # one exact scalar sample per node, from its own stream
            rng = AesCtrRandom(node_keys[k].tobytes())
            if kind == "laplace":
                out[k] = discrete_laplace(param, 1, rng)[0]
            else:
                out[k] = discrete_gaussian(None, 1, rng, sigma2=param)[0]
        return out


class SummedNoise(_TreeNoise):
    """The sum of several independent node-noise sources (the ``"distributed"`` option).

    Each source draws the full-scale noise, so a node's noise variance is :attr:`copies` (the
    number of sources) times one draw's; :func:`clipless.stats.tree.release_counts` reads it.

    Args:
        sources: the node-noise sources (one key each), at least one.
    """

    def __init__(self, sources: Sequence[NodeNoise]) -> None:
        if len(sources) == 0:
            raise ValueError("sources must be non-empty")
        self.sources = list(sources)
        self.copies = sum(int(getattr(src, "copies", 1)) for src in self.sources)

    def nodes(
        self,
        kind: NoiseKind,
        param: Fraction | tuple[Fraction | None, ...],
        levels: NDArray[np.int64],
        index: NDArray[np.int64],
    ) -> NDArray[np.int64]:
        """The summed noise of nodes ``(levels[k], index[k])`` over every source, int64."""
        total = np.zeros(np.asarray(levels).size, dtype=np.int64)
        for src in self.sources:
            total = total + src.nodes(kind, param, levels, index)
        return total


class TaggedNoise(_TreeNoise):
    """The noise of tree number ``tag`` of a source: node ``(l, j)`` is the source's node
    ``(l + tag * 2^32, j)``. Several trees released together (the two classes of a ROC curve)
    thus get independent noise from one key (domain separation in the PRF input).

    Args:
        source: the noise source of every tree.
        tag: this tree's number, in ``[0, 2^31)``.
    """

    def __init__(self, source: NodeNoise | SummedNoise, tag: int) -> None:
        if not 0 <= tag < (1 << 31):
            raise ValueError(f"tag must be in [0, 2^31), got {tag}")
        self.source = source
        self.tag = tag
        self.copies = int(getattr(source, "copies", 1))

    def nodes(
        self,
        kind: NoiseKind,
        param: Fraction | tuple[Fraction | None, ...],
        levels: NDArray[np.int64],
        index: NDArray[np.int64],
    ) -> NDArray[np.int64]:
        """The noise of this tree's nodes ``(levels[k], index[k])``, int64."""
        lev = np.asarray(levels, dtype=np.int64) + (self.tag << TAG_SHIFT)
        return self.source.nodes(kind, param, lev, index)
