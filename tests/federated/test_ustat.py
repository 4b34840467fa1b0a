"""UStat backends, keyed node noise, and the federated release against the central one."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from clipless.federated import (
    AesCtrRandom,
    NodeNoise,
    SummedNoise,
    UStat,
    federated_ecdf,
    prf_words,
    prg_words,
    server_keys,
)
from clipless.federated.noise import tree_context, tree_key
from clipless.federated.ustat import owner_messages
from clipless.stats import Grid, ecdf, release_counts
from clipless.stats.noise import discrete_laplace_pmf, discrete_laplace_variance
from clipless.stats.tree import TreeRelease

KEY = bytes(range(16))


def _owners(seed: int, n_owners: int, per_owner: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0.5, 0.3, size=per_owner) for _ in range(n_owners)]


def test_prg_is_aes_ctr_keystream() -> None:
    # NIST SP 800-38A F.5.1 (AES-128-CTR): keystream = ciphertext XOR plaintext, block 1
    key = bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")
    ctr = int("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff", 16)
    pt = bytes.fromhex("6bc1bee22e409f96e93d7e117393172a")
    ct = bytes.fromhex("874d6191b620e3261bef6864990db6ce")
    ks = bytes(a ^ b for a, b in zip(pt, ct, strict=True))
    words = prg_words(key, 2, nonce=ctr)
    assert words.astype("<u8").tobytes() == ks


def test_prf_is_aes_ecb() -> None:
    # FIPS-197 appendix C.1: AES-128(000102..0f, 00112233..ff) = 69c4e0d86a7b0430d8cdb78070b4c55a
    block = np.frombuffer(bytes.fromhex("00112233445566778899aabbccddeeff"), dtype="<u8")
    out = prf_words(KEY, block.astype(np.uint64)[None, :])
    assert out.astype("<u8").tobytes() == bytes.fromhex("69c4e0d86a7b0430")


def test_aes_random_is_deterministic_and_matches_stream() -> None:
    a, b = AesCtrRandom(KEY), AesCtrRandom(KEY)
    assert [a.randrange(1000) for _ in range(50)] == [b.randrange(1000) for _ in range(50)]
    c = AesCtrRandom(KEY)
    raw = Cipher(algorithms.AES(KEY), modes.CTR(bytes(16))).encryptor().update(bytes(5000))
    assert c.randbytes(10) + c.randbytes(4990) == raw
    assert isinstance(c, random.Random)


def test_node_noise_is_node_indexed_and_exact_laplace() -> None:
    src = NodeNoise(KEY)
    scale = Fraction(3, 2)
    full = src("laplace", scale, 4)
    assert full.shape == (31,)
    # any subset gives the same values: a node's noise does not depend on the query
    lev, idx = np.array([2, 0, 4]), np.array([1, 7, 0])
    offsets = [0, 16, 24, 28, 30]
    expect = [full[offsets[2] + 1], full[offsets[0] + 7], full[offsets[4]]]
    assert src.nodes("laplace", scale, lev, idx).tolist() == expect
    # another key or another parameter: different noise
    assert not np.array_equal(NodeNoise(bytes(16))("laplace", scale, 4), full)
    assert not np.array_equal(src("laplace", Fraction(2), 4), full)
    # distribution: chi-square against the exact pmf over 4000 nodes
    many = src.nodes("laplace", scale, np.zeros(4000, dtype=np.int64), np.arange(4000))
    ks = np.arange(-6, 7)
    obs = np.array([(many == k).sum() for k in ks] + [(np.abs(many) > 6).sum()])
    p = discrete_laplace_pmf(ks, scale)
    exp = np.concatenate([p, [1 - p.sum()]]) * many.size
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < 40.0  # 13 dof: p-value ~ 1e-4 at 40; fixed key, so deterministic


def test_owner_shares_sum_and_single_share_hides() -> None:
    u = np.array([0, 1, 2, 3, 2**40], dtype=np.int64)
    msgs = owner_messages(u, 3)
    assert [len(m) for m in msgs] == [16, 16, 40]
    shares = [prg_words(msgs[0], 5), prg_words(msgs[1], 5)]
    shares.append(np.frombuffer(msgs[2], dtype="<u8").astype(np.uint64))
    total = shares[0] + shares[1] + shares[2]
    assert total.view(np.int64).tolist() == u.tolist()
    # the explicit share alone is uniform: the same u gives fresh unrelated last shares
    again = np.frombuffer(owner_messages(u, 3)[2], dtype="<u8")
    assert not np.any(again == shares[2])


@pytest.mark.parametrize(
    "backend,servers,sharing",
    [
        ("local", 1, "dealer"),
        ("shares", 2, "dealer"),
        ("shares", 4, "dealer"),
        ("shares", 3, "distributed"),
    ],
)
def test_ustat_publishes_sum_plus_noise(backend: str, servers: int, sharing: str) -> None:
    rng = np.random.default_rng(0)
    contrib = [rng.integers(-5, 50, size=6) for _ in range(7)]
    keys = [bytes([j]) * 16 for j in range(servers if sharing == "distributed" else 1)]
    us = UStat(backend, servers, sharing, keys)  # type: ignore[arg-type]
    lev = np.array([[0, 1], [0, 1], [1, 2], [0, 0], [3, 3], [2, 1]])
    idx = np.array([[0, 0], [1, 0], [0, 0], [5, 4], [0, 0], [1, 1]])
    out = us.publish(contrib, "laplace", Fraction(2), lev, idx)
    src = NodeNoise(keys[0]) if sharing == "dealer" else SummedNoise([NodeNoise(k) for k in keys])
    eta = src.nodes("laplace", Fraction(2), lev.ravel(), idx.ravel()).reshape(lev.shape)
    assert out.tolist() == (np.sum(contrib, axis=0) + eta.sum(axis=1)).tolist()
    if backend == "shares":
        # payload: (m-1) seeds + one explicit share per owner; m output vectors
        assert us.traffic.owners == 7 * (16 * (servers - 1) + 8 * 6)
        assert us.traffic.servers == servers * 8 * 6


@pytest.mark.parametrize("protocol,servers", [("local", 1), ("shares", 2), ("shares", 3)])
@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
def test_federated_equals_central_bit_for_bit(
    protocol: str, servers: int, neighbouring: str
) -> None:
    owners = _owners(1, 20)
    grid = Grid(0, 1, size=13)  # not a power of two: exercises the consistency projection
    fed = federated_ecdf(
        owners,
        grid,
        0.7,
        protocol=protocol,
        servers=servers,  # type: ignore[arg-type]
        neighbouring=neighbouring,
        noise_keys=[KEY],  # type: ignore[arg-type]
        mechanism="binary",
    )
    central = ecdf(
        np.concatenate(owners),
        grid,
        0.7,
        neighbouring,  # type: ignore[arg-type]
        node_noise=NodeNoise(tree_key(KEY, tree_context(grid.thresholds, "ecdf"))),
        mechanism="binary",
    )
    assert fed.ecdf is not None and fed.release is not None
    for a, b in zip(fed.release.node_counts, central.release.node_counts, strict=True):
        assert a.tolist() == b.tolist()
    assert fed.ecdf.values.tobytes() == central.values.tobytes()
    assert fed.ecdf.counts.tobytes() == central.counts.tobytes()
    assert fed.ecdf.variance.tobytes() == central.variance.tobytes()


def test_federated_gaussian_and_pointwise_thresholds() -> None:
    owners = _owners(2, 15)
    grid = Grid(0, 1, size=32)
    central = release_counts(
        grid.counts(np.concatenate(owners)),
        None,
        "add_remove",
        "gaussian",
        rho=0.5,
        node_noise=NodeNoise(tree_key(KEY, tree_context(grid.thresholds, "ecdf"))),
    )
    pts = np.array([0, 3, 17, 31])
    fed = federated_ecdf(
        owners,
        grid,
        None,
        protocol="shares",
        servers=3,
        thresholds=pts,
        neighbouring="add_remove",
        noise="gaussian",
        rho=0.5,
        noise_keys=[KEY],
    )
    assert fed.prefix_counts.tolist() == central.prefix_counts[pts].tolist()
    # a second query with other thresholds reuses the same node noise
    pts2 = np.array([3, 4, 5])
    fed2 = federated_ecdf(
        owners,
        grid,
        None,
        protocol="shares",
        servers=2,
        thresholds=pts2,
        neighbouring="add_remove",
        noise="gaussian",
        rho=0.5,
        noise_keys=[KEY],
    )
    assert fed2.prefix_counts.tolist() == central.prefix_counts[pts2].tolist()


def test_distributed_noise_equals_summed_central() -> None:
    owners = _owners(3, 10)
    grid = Grid(0, 1, size=8)
    keys = [bytes([7 + j]) * 16 for j in range(3)]
    fed = federated_ecdf(
        owners,
        grid,
        1.0,
        protocol="shares",
        servers=3,
        noise_sharing="distributed",
        noise_keys=keys,
        mechanism="binary",
    )
    context = tree_context(grid.thresholds, "ecdf")
    central = release_counts(
        grid.counts(np.concatenate(owners)),
        1.0,
        node_noise=SummedNoise([NodeNoise(tree_key(k, context)) for k in keys]),
    )
    assert fed.release is not None
    assert fed.release.prefix_counts.tolist() == central.prefix_counts.tolist()
    assert fed.release.node_variance == central.node_variance  # both 3 x one draw's


def test_federated_no_noise_limit_is_exact_ecdf() -> None:
    owners = _owners(4, 12)
    grid = Grid(0, 1, size=9)
    fed = federated_ecdf(owners, grid, 1e12, protocol="shares", smoothing=None, consistency=False)
    exact = np.cumsum(grid.counts(np.concatenate(owners)))
    assert fed.prefix_counts.tolist() == exact.tolist()


def test_bad_input_names_argument() -> None:
    owners = _owners(5, 3)
    with pytest.raises(ValueError, match="protocol"):
        federated_ecdf(owners, Grid(0, 1, size=4), 1.0, protocol="flower")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="servers"):
        UStat("shares", 1)
    with pytest.raises(ValueError, match="noise_keys"):
        UStat("shares", 3, "distributed", [KEY])
    with pytest.raises(ValueError, match="thresholds"):
        federated_ecdf(owners, Grid(0, 1, size=4), 1.0, thresholds=[3, 1])
    with pytest.raises(ValueError, match="16 bytes"):
        NodeNoise(b"short")


def test_distributed_noise_keys_must_be_distinct() -> None:
    """Audit finding: equal keys gave every server the same noise, so one server alone knew it
    all (and the variance was m times smaller than reported)."""
    owners = _owners(3, 10)
    grid = Grid(0, 1, size=8)
    with pytest.raises(ValueError, match="noise_keys must be distinct"):
        federated_ecdf(
            owners, grid, 1.0, protocol="shares", servers=3, noise_sharing="distributed",
            noise_keys=[KEY] * 3,
        )  # fmt: skip
    keys = server_keys(KEY, 3)
    assert len(set(keys)) == 3 and keys == server_keys(KEY, 3)
    assert all(len(k) == 16 for k in keys)
    fed = federated_ecdf(
        owners, grid, 1.0, protocol="shares", servers=3, noise_sharing="distributed",
        noise_keys=keys,
    )  # fmt: skip
    assert fed.ecdf is not None


def test_fss_key_size_does_not_depend_on_the_values() -> None:
    """Audit finding: the in-process FSS keys were sized from the largest private value."""
    grid = Grid(0, 1, size=64)
    sizes = []
    for top in (0.05, 0.99):
        owners = [np.array([0.01, top]), np.array([0.02])]
        fed = federated_ecdf(owners, grid, 1.0, protocol="fss", servers=2, thresholds=[0, 1])
        sizes.append(fed.traffic.owners)
    assert sizes[0] == sizes[1]
    with pytest.raises(ValueError, match="needs neighbouring='replace_one'"):
        federated_ecdf(
            [np.array([0.1])], grid, 1.0, protocol="fss", servers=2, neighbouring="add_remove"
        )


def test_noise_is_bound_to_the_tree() -> None:
    """Audit finding: node noise depended only on the key, so releases on a shifted grid, or an
    ECDF next to a ROC curve, with one key carried the same noise and their difference was exact
    counts. Now each tree's key is derived from the caller's key and the tree's identity."""
    owners = _owners(5, 12)
    grid = Grid(0, 1, size=16)
    shifted = Grid(0.004, 1.004, size=16)
    a = federated_ecdf(owners, grid, 1.0, protocol="shares", noise_keys=[KEY], smoothing=None)
    b = federated_ecdf(owners, shifted, 1.0, protocol="shares", noise_keys=[KEY], smoothing=None)
    assert a.release is not None and b.release is not None
    exact_a = np.cumsum(grid.counts(np.concatenate(owners)))
    exact_b = np.cumsum(shifted.counts(np.concatenate(owners)))
    noise_a = a.release.prefix_counts - exact_a
    noise_b = b.release.prefix_counts - exact_b
    assert not np.array_equal(noise_a, noise_b)  # was equal: the difference told exact counts
    # the same tree, asked again with the returned key: the same noise (free repeated queries)
    again = federated_ecdf(owners, grid, 1.0, protocol="shares", noise_keys=a.noise_keys)
    assert again.release is not None
    assert again.release.prefix_counts.tolist() == a.release.prefix_counts.tolist()
    assert tree_context(grid.thresholds, "ecdf") != tree_context(grid.thresholds, "roc")


def test_an_empty_federation_is_released_under_add_remove() -> None:
    """As the central ecdf: n is private under add/remove, so no data-dependent refusal."""
    grid = Grid(0, 1, size=8)
    fed = federated_ecdf([np.array([])], grid, 1.0, protocol="shares", neighbouring="add_remove")
    assert fed.ecdf is not None and bool(np.all(np.isfinite(fed.ecdf.values)))
    with pytest.raises(ValueError, match="n = 0 is public under replace_one"):
        federated_ecdf([np.array([])], grid, 1.0, protocol="shares")


@pytest.mark.parametrize("smoothing", [None, "isotonic"])
def test_summed_noise_has_the_true_variance_and_equals_federated_bit_for_bit(smoothing) -> None:
    """Issue 37: ``ecdf(node_noise=SummedNoise(m keys))`` reported 1/m of the variance (391 vs
    1,174 at m = 3), which changed the least-squares and isotonic weights, so the federated
    values differed from the central ones in the last bits."""
    owners = _owners(3, 10)
    grid = Grid(0, 1, size=8)
    keys = [bytes([7 + j]) * 16 for j in range(3)]
    fed = federated_ecdf(
        owners, grid, 1.0, protocol="shares", servers=3, noise_sharing="distributed",
        noise_keys=keys, smoothing=smoothing, mechanism="binary",
    )  # fmt: skip
    context = tree_context(grid.thresholds, "ecdf")
    source = SummedNoise([NodeNoise(tree_key(k, context)) for k in keys])
    assert source.copies == 3
    central = ecdf(
        np.concatenate(owners), grid, 1.0, smoothing=smoothing, mechanism="binary",
        node_noise=source,
    )  # fmt: skip
    release = central.release
    assert isinstance(release, TreeRelease)
    one = discrete_laplace_variance(release.noise_param)
    assert release.node_variance == 3 * one  # three independent full-scale draws
    assert fed.ecdf is not None
    assert np.array_equal(fed.ecdf.values, central.values)
    assert np.array_equal(fed.ecdf.variance, central.variance)
