"""Federated ROC against the central class-conditional releases, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from clipless.federated import NodeNoise
from clipless.federated.noise import TaggedNoise, tree_context, tree_key
from clipless.federated.roc import federated_roc, prefix_dcf_keys, prefix_dcf_shares
from clipless.stats import Grid, nonprivate_roc, release_counts, roc
from clipless.stats.ecdf import from_release

KEY = bytes([3]) * 16


def _data(seed: int, owners: int = 12) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    labels = [rng.integers(0, 2, size=2) for _ in range(owners)]
    scores = [rng.normal(0.4 + 0.3 * y, 0.2) for y in labels]
    return scores, labels


def test_prefix_dcf_counts_with_hidden_beta() -> None:
    leaves = np.array([0, 2, 2, 5, 7])
    beta = np.array([1, 0, 1, 1, 0])
    k0, k1 = prefix_dcf_keys(leaves, beta, 3, seed=bytes(16))
    pts = np.arange(8)
    total = (prefix_dcf_shares(k0, pts) + prefix_dcf_shares(k1, pts)).view(np.int64)
    assert total.tolist() == [int(((leaves <= t) * beta).sum()) for t in pts]


def _roc_noise(grid: Grid) -> NodeNoise:
    """The central equivalent: KEY bound to this grid's ROC tree (noise.tree_key)."""
    return NodeNoise(tree_key(KEY, tree_context(grid.thresholds, "roc")))


@pytest.mark.parametrize("protocol,servers", [("local", 1), ("shares", 3), ("fss", 2)])
@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
def test_federated_roc_equals_central(protocol: str, servers: int, neighbouring: str) -> None:
    scores, labels = _data(0)
    grid = Grid(0, 1, size=11)
    if protocol == "fss" and neighbouring == "add_remove":
        # one key per value: the servers learn every owner's count, private under add/remove
        with pytest.raises(ValueError, match="needs neighbouring='replace_one'"):
            federated_roc(scores, labels, grid, 1.0, protocol="fss", neighbouring="add_remove")
        return
    fed, ustat = federated_roc(
        scores,
        labels,
        grid,
        1.0,
        protocol=protocol,
        servers=servers,  # type: ignore[arg-type]
        neighbouring=neighbouring,
        noise_keys=[KEY],  # type: ignore[arg-type]
    )
    s, y = np.concatenate(scores), np.concatenate(labels).astype(bool)
    eps_class = 0.5 if neighbouring == "replace_one" else 1.0
    for c, curve in ((0, fed.negatives), (1, fed.positives)):
        rel = release_counts(
            grid.counts(s[y == bool(c)]),
            eps_class,
            "add_remove",
            node_noise=TaggedNoise(_roc_noise(grid), c),
        )
        ref = from_release(rel, grid, n=None, smoothing="isotonic")
        assert curve.values.tobytes() == ref.values.tobytes()
    if protocol == "fss":  # 2 classes x 2 servers x one (n+1)-bit key per value
        assert ustat.traffic.owners == 2 * 2 * s.size * (24 + 25 * 5)


def test_federated_roc_gaussian_equals_central() -> None:
    scores, labels = _data(2)
    grid = Grid(0, 1, size=9)
    fed, _ = federated_roc(
        scores, labels, grid, None, protocol="fss", noise="gaussian", rho=0.3, noise_keys=[KEY]
    )
    s, y = np.concatenate(scores), np.concatenate(labels).astype(bool)
    for c, curve in ((0, fed.negatives), (1, fed.positives)):
        rel = release_counts(
            grid.counts(s[y == bool(c)]), None, "add_remove", "gaussian", rho=0.15,
            node_noise=TaggedNoise(_roc_noise(grid), c),
        )  # fmt: skip
        ref = from_release(rel, grid, n=None, smoothing="isotonic")
        assert curve.values.tobytes() == ref.values.tobytes()
    assert fed.rho == 0.3 and fed.epsilon is None


def test_federated_roc_noiseless_auc_matches_central() -> None:
    scores, labels = _data(1, owners=30)
    grid = Grid(-0.5, 1.5, size=64)
    fed, _ = federated_roc(scores, labels, grid, 1e12, protocol="fss", smoothing=None)
    s, y = np.concatenate(scores), np.concatenate(labels)
    central = roc(s, y, grid, 1e12, smoothing=None)
    assert fed.auc() == pytest.approx(central.auc(), abs=1e-9)
    fpr, tpr = nonprivate_roc(s, y, grid)
    assert np.allclose(fed.curve()[0], fpr, atol=1e-9)
    assert np.allclose(fed.curve()[1], tpr, atol=1e-9)


def test_federated_roc_returns_a_named_result_that_still_unpacks() -> None:
    from clipless.federated import FederatedROC

    scores, labels = _data(2, owners=5)
    grid = Grid(0, 1, size=16)
    out = federated_roc(scores, labels, grid, 1.0, protocol="shares", servers=3)
    assert isinstance(out, FederatedROC)
    curve, ustat = out
    assert curve is out.roc and ustat is out.ustat
    assert out.traffic is ustat.traffic and out.traffic.owners > 0
    assert out.noise_keys == ustat.noise_keys and out.servers == 3
    assert out.noise_sharing == "dealer"
    assert out.auc() == curve.auc()


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="labels"):
        federated_roc([[0.5]], [[2]], Grid(0, 1, size=4), 1.0)
    with pytest.raises(ValueError, match="same"):
        federated_roc([[0.5]], [], Grid(0, 1, size=4), 1.0)
