"""The federated release with the central default's k-ary plan (issue 37, item 3)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from clipless.federated import NodeNoise, federated_ecdf
from clipless.federated.ecdf import kary_query, kary_shape
from clipless.federated.noise import tree_context, tree_key
from clipless.stats import Grid, ecdf, seeded_rng
from clipless.stats.counting import (
    CountingPlan,
    counting_plan,
    kary_depth,
    kary_node_counts,
    kary_released_nodes,
    release_prefix_counts,
)
from clipless.stats.noise import conservative_scale, discrete_laplace_variance
from clipless.stats.tree import TreeRelease

KEYS = [bytes([11 + j]) * 16 for j in range(3)]


def _owners(seed: int, n: int) -> list[list[float]]:
    gen = np.random.default_rng(seed)
    return [gen.beta(2.0, 5.0, size=int(gen.integers(1, 4))).tolist() for _ in range(n)]


@pytest.mark.parametrize(
    ("protocol", "servers", "sharing"),
    [("local", 2, "dealer"), ("shares", 2, "dealer"), ("shares", 3, "distributed"),
     ("fss", 2, "distributed")],
)  # fmt: skip
@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
@pytest.mark.parametrize("epsilon", [0.1, 1.0, 10.0])
def test_federated_default_equals_central_default_bit_for_bit(
    protocol: str, servers: int, sharing: str, neighbouring: str, epsilon: float
) -> None:
    if protocol == "fss" and neighbouring == "add_remove":
        pytest.skip("fss is replace-one only")
    owners = _owners(int(epsilon * 10) + servers, 12)
    grid = Grid(0, 1, size=50)
    need = servers if sharing == "distributed" else 1
    fed = federated_ecdf(
        owners, grid, epsilon, protocol=protocol, servers=servers,  # type: ignore[arg-type]
        noise_sharing=sharing, neighbouring=neighbouring,  # type: ignore[arg-type]
        noise_keys=KEYS[:need],
    )  # fmt: skip
    values = np.concatenate([np.asarray(o) for o in owners])
    central = ecdf(values, grid, epsilon, neighbouring, node_noise=fed.noise_source)  # type: ignore[arg-type]
    assert fed.ecdf is not None and fed.release is not None
    assert fed.release.mechanism == central.release.mechanism == "k-ary"
    plan = counting_plan(50, neighbouring, "laplace", epsilon)  # type: ignore[arg-type]
    assert (fed.release.branching, fed.release.shares) == (plan.branching, plan.shares)
    for a, b in [
        (fed.release.noisy, central.release.noisy),
        (fed.release.prefix_counts, central.release.prefix_counts),
        (fed.release.variance, central.release.variance),
        (fed.ecdf.values, central.values),
        (fed.ecdf.variance, central.variance),
    ]:
        assert a.tobytes() == b.tobytes()
    # the federated error is the central default's (the same plan and exact variances)
    rel = release_prefix_counts(grid.counts(values), epsilon, neighbouring, rng=seeded_rng(0))  # type: ignore[arg-type]
    np.testing.assert_allclose(fed.release.variance, need * np.asarray(rel.variance), rtol=1e-12)


def test_released_noise_is_exactly_each_levels_calibrated_noise() -> None:
    """noisy - true node counts = the sum of the servers' keyed noise, node (l, j) at level l's
    own parameter, recomputed here from the plan's shares (scale per / (share epsilon))."""
    owners = _owners(3, 30)
    grid = Grid(0, 1, size=300)
    eps = 0.5
    fed = federated_ecdf(owners, grid, eps, protocol="shares", servers=3,
                         noise_sharing="distributed", noise_keys=KEYS)  # fmt: skip
    plan = counting_plan(300, "replace_one", "laplace", eps)
    assert sum(1 for w in plan.shares if w > 0) >= 2  # a real tree, not the flat histogram
    lev, idx = kary_released_nodes(300, plan, "replace_one")
    true = np.concatenate(kary_node_counts(grid.counts(np.concatenate(owners)), plan.branching))
    h = kary_depth(300, plan.branching)
    offsets = np.concatenate([[0], np.cumsum([plan.branching ** (h - x) for x in range(h + 1)])])
    true_released = true[offsets[lev] + idx]
    context = tree_context(grid.thresholds, "ecdf", kary_shape(plan))
    expect = np.zeros(lev.size, dtype=np.int64)
    for level, share in enumerate(plan.shares):
        if share == 0:
            continue
        scale = conservative_scale(Fraction(2) / (Fraction(eps) * share))
        sel = lev == level
        for k in KEYS:
            expect[sel] += NodeNoise(tree_key(k, context)).nodes(
                "laplace", scale, lev[sel], idx[sel]
            )
    assert fed.release is not None
    assert np.array_equal(np.asarray(fed.release.noisy, dtype=np.int64) - true_released, expect)
    leaves = expect[lev == 0]  # 300 draws, each the sum of three at the leaves' scale
    scale0 = conservative_scale(Fraction(2) / (Fraction(eps) * plan.shares[0]))
    assert np.var(leaves) == pytest.approx(3 * discrete_laplace_variance(scale0), rel=0.25)


@pytest.mark.parametrize(
    ("N", "k", "shares"),
    [(13, 13, (Fraction(1), Fraction(0))), (13, 2, (Fraction(1, 2), Fraction(0),
     Fraction(1, 4), Fraction(1, 4), Fraction(0))), (50, 7, (Fraction(1, 3), Fraction(1, 3),
     Fraction(1, 3)))],
)  # fmt: skip
def test_kary_query_maps_prefix_counts_to_the_released_nodes(N, k, shares) -> None:
    plan = CountingPlan(k, shares, 0.0)
    counts = np.random.default_rng(N).integers(0, 5, N)
    lev, idx = kary_released_nodes(N, plan, "add_remove")
    h = kary_depth(N, k)
    nodes = kary_node_counts(counts, k)
    expect = np.array([nodes[a][b] for a, b in zip(lev.tolist(), idx.tolist(), strict=True)])
    assert np.array_equal(kary_query(N, plan) @ np.cumsum(counts), expect)
    assert lev.size == sum(k ** (h - x) for x, w in enumerate(shares) if w > 0)


def test_kary_and_binary_trees_never_share_noise() -> None:
    """Two shapes on one grid with one key: independent noise (the shape is in the key)."""
    grid = Grid(0, 1, size=16)
    plan = counting_plan(16, "replace_one", "laplace", 1.0)
    binary = NodeNoise(tree_key(KEYS[0], tree_context(grid.thresholds, "ecdf")))
    kary = NodeNoise(tree_key(KEYS[0], tree_context(grid.thresholds, "ecdf", kary_shape(plan))))
    lev, idx = np.zeros(16, dtype=np.int64), np.arange(16)
    assert not np.array_equal(
        binary.nodes("laplace", Fraction(3), lev, idx), kary.nodes("laplace", Fraction(3), lev, idx)
    )


def test_federated_mechanism_choices() -> None:
    owners = _owners(1, 5)
    grid = Grid(0, 1, size=8)
    pointwise = federated_ecdf(owners, grid, 1.0, thresholds=[1, 5])  # binary: Eq. 6.4.1
    assert pointwise.release is None and pointwise.prefix_counts.dtype == np.int64
    plain = federated_ecdf(owners, grid, 1.0, consistency=False, smoothing=None)
    assert isinstance(plain.release, TreeRelease)  # the thesis's plain estimator: binary
    with pytest.raises(ValueError, match="thresholds must be None"):
        federated_ecdf(owners, grid, 1.0, thresholds=[1], mechanism="k-ary")
    with pytest.raises(ValueError, match="mechanism must be"):
        federated_ecdf(owners, grid, 1.0, mechanism="factorization")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="branching is only"):
        federated_ecdf(owners, grid, 1.0, mechanism="binary", branching=4)
    fixed = federated_ecdf(owners, grid, 1.0, mechanism="k-ary", branching=2)
    assert fixed.release is not None and fixed.release.branching == 2  # type: ignore[union-attr]
