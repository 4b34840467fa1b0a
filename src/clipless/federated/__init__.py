"""Federated DP-ECDF (thesis section 6.4): the central tree release computed by many data
owners and a few non-colluding servers, with no trusted curator.

* :class:`UStat` -- the thesis's ``UStat`` operation (section 6.2): backends ``"local"``
  (trusted curator) and ``"shares"`` (additive secret sharing over ``Z_2^64`` among ``m >= 2``
  servers, AES-128-CTR seeds for ``m - 1`` shares), tree-node noise kept inside the protocol
  (``noise_sharing="dealer"`` or ``"distributed"``; :mod:`clipless.federated.ustat` lists the
  coalitions each survives).
* :class:`NodeNoise` -- exact discrete Laplace / Gaussian node noise derived from a PRF of the
  node id (the same noise in every query); also accepted by :func:`clipless.stats.ecdf` as
  ``node_noise`` so the central and federated releases agree bit for bit.
* :func:`federated_ecdf` -- the release, by ``"local"``, ``"shares"`` or ``"fss"`` (two-server
  distributed comparison functions, :mod:`clipless.federated.dcf`); :func:`federated_roc` --
  the two class-conditional trees of a ROC curve, labels hidden.
* :func:`clipless.federated.session.simulate` / ``clipless federated simulate`` -- every party
  a separate process over TCP (HMAC-authenticated frames, timeouts, byte counters).
"""

from typing import TYPE_CHECKING, Any

from clipless.federated.noise import (
    NodeNoise,
    SummedNoise,
    TaggedNoise,
    server_keys,
    tree_context,
    tree_key,
)
from clipless.federated.prg import AesCtrRandom, prf_words, prg_words, random_seed
from clipless.federated.ustat import NoiseDealer, ShareServer, Traffic, UStat, combine

if TYPE_CHECKING:
    from clipless.federated.ecdf import FederatedECDF, federated_ecdf, noise_parameter
    from clipless.federated.roc import FederatedROC, federated_roc


def __getattr__(name: str) -> Any:
    # the release (which loads clipless.stats) is imported on first use, so that owner and
    # server processes start quickly
    if name in ("FederatedECDF", "federated_ecdf", "noise_parameter"):
        from clipless.federated import ecdf

        return getattr(ecdf, name)
    if name in ("FederatedROC", "federated_roc"):
        from clipless.federated import roc

        return getattr(roc, name)
    raise AttributeError(f"module 'clipless.federated' has no attribute {name!r}")


__all__ = [
    "AesCtrRandom",
    "FederatedECDF",
    "FederatedROC",
    "NodeNoise",
    "NoiseDealer",
    "ShareServer",
    "SummedNoise",
    "TaggedNoise",
    "Traffic",
    "UStat",
    "combine",
    "federated_ecdf",
    "federated_roc",
    "noise_parameter",
    "prf_words",
    "prg_words",
    "random_seed",
    "server_keys",
    "tree_context",
    "tree_key",
]
