"""Federated DP ROC curve and AUC: the two class-conditional trees of
:func:`clipless.stats.roc`, computed by the owners and servers without revealing labels.

Each owner holds ``(score, label)`` pairs. Both classes' prefix counts are computed in one run,
and every owner contributes to both (zeros for the class it does not hold), so the shares or
keys it sends reveal neither its scores nor its labels:

* ``"shares"`` / ``"local"``: owner vector ``(u^0, u^1)``, ``u^c_t = #{own scores of class c
  with leaf <= t}``, shared as in :class:`~clipless.federated.UStat`; the public map is the
  block-diagonal tree map.
* ``"fss"``: per value and per class one DCF pair with a hidden payload ``beta_c = [label = c]``
  for the comparison ``[a <= t]``, written as ``[x' < alpha']`` with ``x' = 2^n - 1 - t`` and
  ``alpha' = 2^n - a`` on ``n + 1`` bits (so no public key count is needed); the servers sum
  the evaluations per class.

Privacy is exactly that of :func:`clipless.stats.roc` (its module docstring): each class's tree
is calibrated with the add/remove sensitivity, at ``epsilon/2`` per class under replace-one
and ``epsilon`` per class under add/remove; each class normalises by its own released total.
The two trees use independent node noise from one key (:class:`~clipless.federated.TaggedNoise`,
tags 0 and 1). With the same keyed noise, the result equals the central composition
``release_counts(..., node_noise=TaggedNoise(NodeNoise(K_roc), c))`` + ``from_release`` bit for
bit, where ``K_roc = tree_key(K, tree_context(thresholds, "roc"))`` binds the caller's key to this
tree (:func:`~clipless.federated.noise.tree_key`).
Whole-grid release only (the curve needs every threshold). Over TCP:
:func:`clipless.federated.session.simulate` with ``statistic="roc"`` (same result, tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
from numpy.typing import ArrayLike, NDArray

from clipless.federated._checks import check_protocol
from clipless.federated.dcf import DcfKeys, prefix_dcf_keys, prefix_dcf_shares
from clipless.federated.ecdf import (
    Protocol,
    assemble,
    noise_parameter,
    prefix_indicators,
    tree_query,
)
from clipless.federated.noise import TAG_SHIFT, node_ids, tree_context
from clipless.federated.ustat import NoiseSharing, Traffic, UStat
from clipless.stats.ecdf import Smoothing, _as_grid
from clipless.stats.grid import Grid, tree_depth
from clipless.stats.roc import DPROC, class_budget, roc_from_classes
from clipless.stats.tree import Neighbouring, NoiseKind

__all__ = ["FederatedROC", "federated_roc", "prefix_dcf_keys", "prefix_dcf_shares"]


class FederatedROC(NamedTuple):
    """The output of :func:`federated_roc`: the released curve and the run that made it.

    A named pair, so ``curve, ustat = federated_roc(...)`` keeps working; the attributes
    mirror :class:`~clipless.federated.FederatedECDF` (``traffic``, ``noise_keys``, ...).
    """

    roc: DPROC
    ustat: UStat

    @property
    def traffic(self) -> Traffic:
        """Payload bytes per role of the in-process run."""
        return self.ustat.traffic

    @property
    def noise_keys(self) -> list[bytes]:
        """The caller's noise keys (before they are bound to this tree)."""
        return list(self.ustat.noise_keys)

    @property
    def servers(self) -> int:
        """The number of servers."""
        return int(self.ustat.servers)

    @property
    def noise_sharing(self) -> NoiseSharing:
        """``"dealer"`` or ``"distributed"``."""
        return self.ustat.noise_sharing

    def auc(self) -> float:
        """The released curve's AUC (:meth:`~clipless.stats.DPROC.auc`)."""
        return self.roc.auc()


def federated_roc(
    owner_scores: Sequence[ArrayLike],
    owner_labels: Sequence[ArrayLike],
    grid: Grid | ArrayLike,
    epsilon: float | None,
    *,
    protocol: Protocol = "shares",
    servers: int = 2,
    noise_sharing: NoiseSharing = "dealer",
    neighbouring: Neighbouring = "replace_one",
    smoothing: Smoothing | None = "isotonic",
    consistency: bool = True,
    noise_keys: Sequence[bytes] | None = None,
    noise: NoiseKind = "laplace",
    rho: float | None = None,
) -> FederatedROC:
    """The ROC release of :func:`clipless.stats.roc`, federated: ``epsilon``-DP with discrete
    Laplace noise, or ``rho``-zCDP with ``noise="gaussian"`` (``epsilon=None``), split between
    the classes as :func:`clipless.stats.roc` does.

    Args:
        owner_scores, owner_labels: owner ``k``'s scores (finite) and 0/1 labels, one label per
            score; the same number of owners (at least one) in both.
        grid, epsilon, neighbouring, smoothing, consistency, noise, rho: as in
            :func:`clipless.stats.roc`.
        protocol, servers, noise_sharing, noise_keys: as in
            :func:`~clipless.federated.federated_ecdf`.

    Returns:
        A :class:`FederatedROC`: the :class:`~clipless.stats.DPROC` (``.roc``) and the
        :class:`UStat` (``.ustat``, its ``traffic`` and ``noise_keys``); it still unpacks as
        the pair ``(roc, ustat)``.

    Raises:
        ValueError: an option outside the accepted values, owners that do not match, or
            non-finite scores.
    """
    check_protocol(protocol, servers, neighbouring)
    if len(owner_scores) != len(owner_labels) or len(owner_scores) == 0:
        raise ValueError("owner_scores and owner_labels must list the same (>= 1) owners")
    g = _as_grid(grid)
    N, L = len(g), tree_depth(len(g))
    eps_class = class_budget(epsilon, "epsilon", neighbouring)
    rho_class = class_budget(rho, "rho", neighbouring)
    param, variance, delta = noise_parameter(L, "add_remove", noise, eps_class, rho_class)
    leaves, labels = [], []
    for k, (sc, lb) in enumerate(zip(owner_scores, owner_labels, strict=True)):
        s = np.asarray(sc, dtype=np.float64).ravel()
        y = np.asarray(lb).ravel()
        if s.shape != y.shape or not np.all(np.isfinite(s)):
            raise ValueError(f"owner {k}: scores must be finite, one label per score")
        if not np.all((y == 0) | (y == 1)):
            raise ValueError(f"owner {k}: labels must be 0 or 1")
        leaves.append(g.leaf_index(s))
        labels.append(y.astype(bool))
    points = np.arange(N, dtype=np.int64)
    tree = tree_query(N)
    matrix = sp.block_diag([tree, tree], format="csr")
    lv, ix = node_ids(L)
    noise_levels = np.concatenate([lv, lv + (1 << TAG_SHIFT)])[:, None]
    noise_index = np.concatenate([ix, ix])[:, None]
    backend = "local" if protocol == "local" else "shares"
    ustat = UStat(  # the noise is bound to this tree (grid and statistic): noise.tree_key
        backend,  # type: ignore[arg-type]
        servers,
        noise_sharing,
        noise_keys,
        tree=tree_context(g.thresholds, "roc"),
    )
    if protocol == "fss":
        out = _fss_roc(
            leaves, labels, points, ustat, noise, param, noise_levels, noise_index, matrix
        )
    else:
        contributions = [
            np.concatenate([prefix_indicators(lf[~y], points), prefix_indicators(lf[y], points)])
            for lf, y in zip(leaves, labels, strict=True)
        ]
        out = ustat.publish(contributions, noise, param, noise_levels, noise_index, matrix)
    m_noise = ustat.servers if ustat.noise_sharing == "distributed" else 1
    half = out.size // 2
    curves = []
    for part in (out[:half], out[half:]):
        _, _, _, F = assemble(
            part, g, points, True, 0, noise, param, variance * m_noise, delta,
            eps_class, rho_class, "add_remove", smoothing, consistency,
        )  # fmt: skip
        assert F is not None
        curves.append(F)
    result = roc_from_classes(g, curves[0], curves[1], epsilon, rho, neighbouring, smoothing)
    return FederatedROC(result, ustat)


def _fss_roc(
    leaves: list[NDArray[np.int64]],
    labels: list[NDArray[np.bool_]],
    points: NDArray[np.int64],
    ustat: UStat,
    noise: NoiseKind,
    param: object,
    noise_levels: NDArray[np.int64],
    noise_index: NDArray[np.int64],
    matrix: sp.csr_matrix,
) -> NDArray[np.int64]:
    from fractions import Fraction

    from clipless.federated.dcf import domain_bits, fss_combine, fss_servers

    assert isinstance(param, Fraction)
    n_bits = domain_bits(points.size)
    servers = fss_servers(ustat, 2 * points.size, noise, param, noise_levels, noise_index)
    received: list[list[list[bytes]]] = [[[], []], [[], []]]  # [server][class]
    for lf, y in zip(leaves, labels, strict=True):
        for c in (0, 1):  # one key per value and class; beta hides the label
            beta = (y == bool(c)).astype(np.int64)
            pair = prefix_dcf_keys(lf, beta, n_bits)
            for j in (0, 1):
                data = pair[j].to_bytes()
                ustat.traffic.owners += len(data)
                received[j][c].append(data)
    for j, srv in enumerate(servers):
        shares = [
            prefix_dcf_shares(DcfKeys.from_bytes(b"".join(received[j][c]), j, n_bits + 1), points)
            for c in (0, 1)
        ]
        srv.add_plain(np.concatenate(shares))
    return fss_combine(servers, ustat, noise, param, noise_levels, noise_index, matrix)
