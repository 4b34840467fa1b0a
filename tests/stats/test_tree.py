"""Tests for the tree mechanism: exhaustive sensitivity, exact error, least squares."""

from fractions import Fraction

import numpy as np
import pytest

from clipless.stats import (
    consistent_prefix_sums,
    discrete_gaussian_variance,
    discrete_laplace_variance,
    node_counts_from_leaves,
    path_sums,
    prefix_variance,
    release_counts,
    seeded_rng,
    tree_depth,
    tree_path_matrix,
    tree_sensitivity,
)


def _flat(nodes):
    return np.concatenate(nodes)


@pytest.mark.parametrize("N", [*range(1, 65), 100, 128])
def test_exhaustive_sensitivity(N):
    """Every neighbouring change moves at most tree_sensitivity(L) node counts, each by 1.

    Node counts are built from the leaf counts before and after the change. Replace-one: a
    value moves from leaf a to leaf b (prefix counts change by -1 on one interval);
    add/remove: one value added at leaf a (prefix counts change by +1 on a suffix).
    """
    L = tree_depth(N)
    base = np.random.default_rng(N).integers(0, 4, N)
    before = _flat(node_counts_from_leaves(base))
    np.testing.assert_array_equal(path_sums(node_counts_from_leaves(base), N), np.cumsum(base))
    add_max = 0
    after_add = []
    for a in range(N):
        counts = base.copy()
        counts[a] += 1
        nodes = node_counts_from_leaves(counts)
        np.testing.assert_array_equal(path_sums(nodes, N), np.cumsum(counts))
        diff = _flat(nodes) - before
        assert set(np.unique(diff)) <= {-1, 0, 1}
        add_max = max(add_max, int(np.count_nonzero(diff)))
        after_add.append(_flat(nodes))
    assert add_max <= tree_sensitivity(L, "add_remove") == (L + 2) // 2
    # replace-one: the value sits at leaf a in one dataset and at leaf b in the other
    after = np.stack(after_add)
    diffs = after[None, :, :] - after[:, None, :]
    assert set(np.unique(diffs)) <= {-1, 0, 1}
    rep_max = int(np.count_nonzero(diffs, axis=2).max()) if N > 1 else 0
    assert rep_max <= tree_sensitivity(L, "replace_one") == L + 1
    if N == 1 << L:  # the constants are attained: L+1 is tight for this node release
        assert add_max == (L + 2) // 2
        if L >= 1:
            assert rep_max == L + 1


def test_sensitivity_values_and_validation():
    assert [tree_sensitivity(L, "add_remove") for L in range(7)] == [1, 1, 2, 2, 3, 3, 4]
    assert [tree_sensitivity(L, "replace_one") for L in range(4)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="neighbouring"):
        tree_sensitivity(3, "swap")
    with pytest.raises(ValueError, match="depth"):
        tree_sensitivity(-1, "add_remove")


def test_release_structure_and_exactness_at_huge_epsilon():
    counts = np.array([3, 0, 2, 5, 1])
    rel = release_counts(counts, 1e15, "replace_one", rng=seeded_rng(0))
    assert rel.depth == 3 and rel.num_leaves == 5 and rel.padded_leaves == 8
    assert [len(v) for v in rel.node_counts] == [8, 4, 2, 1]
    np.testing.assert_array_equal(rel.prefix_counts, np.cumsum(counts))
    np.testing.assert_array_equal(consistent_prefix_sums(rel), np.cumsum(counts))
    noisy = release_counts(counts, 1.0, "replace_one", rng=seeded_rng(0))
    np.testing.assert_array_equal(noisy.prefix_counts, path_sums(noisy.node_counts, 5))
    assert rel.prefix_counts.dtype == np.int64
    with pytest.raises(ValueError):
        rel.prefix_counts[0] = 1
    with pytest.raises(ValueError):
        rel.node_counts[0][0] = 1
    assert rel.sensitivity == 4 and rel.noise_param == Fraction(4) / Fraction(1e15)


def test_noise_scale_calibration():
    rel = release_counts(np.ones(100, dtype=int), 0.5, "add_remove", rng=seeded_rng(0))
    assert rel.depth == 7 and rel.sensitivity == 4
    assert rel.noise_param == Fraction(8) and rel.noise_scale == 8.0
    assert rel.prefix_variance == pytest.approx(8 * discrete_laplace_variance(8))
    g = release_counts(
        np.ones(16, dtype=int), None, "replace_one", "gaussian", seeded_rng(0), rho=0.5
    )
    # L = 4, Delta_2^2 = 5 changed nodes, sigma^2 = 5 / (2 * 0.5)
    assert g.noise_param == Fraction(5) and g.rho == 0.5 and g.epsilon is None
    assert g.node_variance == pytest.approx(discrete_gaussian_variance(5))


def _mse_check(N, epsilon, neighbouring, noise="laplace", rho=None, repeats=300):
    rng = seeded_rng(11)
    counts = np.random.default_rng(0).integers(0, 20, N)
    truth = np.cumsum(counts)
    plain, cons = [], []
    for _ in range(repeats):
        rel = release_counts(counts, epsilon, neighbouring, noise, rng, rho)
        plain.append(np.mean((rel.prefix_counts - truth) ** 2))
        cons.append(np.mean((consistent_prefix_sums(rel) - truth) ** 2))
    for errs, expected in (
        (np.array(plain), prefix_variance(rel, False).mean()),
        (np.array(cons), prefix_variance(rel, True).mean()),
    ):
        se = errs.std(ddof=1) / np.sqrt(repeats)
        assert abs(errs.mean() - expected) < 5 * se, (errs.mean(), expected, se)
    return rel, np.mean(plain), np.mean(cons)


@pytest.mark.parametrize(("N", "neighbouring"), [(100, "replace_one"), (64, "add_remove")])
def test_mse_matches_exact_variance_laplace(N, neighbouring):
    epsilon = 1.0
    rel, plain, cons = _mse_check(N, epsilon, neighbouring)
    L = rel.depth
    b = tree_sensitivity(L, neighbouring) / epsilon
    assert rel.prefix_variance == pytest.approx((L + 1) * discrete_laplace_variance(b))
    if neighbouring == "replace_one":
        # thesis Theorem 6.3.1 (continuous Laplace): 2 (L+1)^3 / eps^2; the discrete Laplace
        # variance is 2 b^2 - 1/6 + O(b^-2), so the exact error is just below it
        thesis = 2 * (L + 1) ** 3 / epsilon**2
        assert rel.prefix_variance < thesis
        assert rel.prefix_variance == pytest.approx(thesis - (L + 1) / 6, rel=1e-3)
    assert cons < 0.7 * plain  # least squares roughly halves the error


def test_mse_matches_exact_variance_gaussian():
    _mse_check(37, None, "add_remove", "gaussian", rho=0.1, repeats=200)


@pytest.mark.parametrize("N", [1, 2, 3, 5, 8, 12, 16, 20, 23, 33, 44, 64])
def test_consistency_is_exact_least_squares(N):
    """consistent_prefix_sums equals a dense least-squares fit of the node values."""
    L = tree_depth(N)
    A = np.stack([_flat(node_counts_from_leaves(np.eye(N, dtype=int)[a], L)) for a in range(N)], 1)
    rel = release_counts(np.arange(N) % 3, 1.0, "replace_one", rng=seeded_rng(N))
    V = _flat(rel.node_counts).astype(float)
    c_hat = np.linalg.lstsq(A.astype(float), V, rcond=None)[0]
    np.testing.assert_allclose(consistent_prefix_sums(rel), np.cumsum(c_hat), atol=1e-8)
    S = np.tril(np.ones((N, N)))
    cov = S @ np.linalg.inv(A.T @ A) @ S.T
    np.testing.assert_allclose(
        prefix_variance(rel, True), np.diag(cov) * rel.node_variance, rtol=1e-9
    )
    if N == 1 << L:
        # power of two: average variance (L+2)/2 node variances vs (L+1) for the plain release
        assert prefix_variance(rel, True).mean() == pytest.approx((L + 2) / 2 * rel.node_variance)


def test_path_matrix_matches_path_sums():
    N, L = 11, 4
    nu = [np.random.default_rng(lev).standard_normal(1 << (L - lev)) for lev in range(L + 1)]
    Z = tree_path_matrix(L, N)
    assert Z.shape == (N, 2 ** (L + 1) - 1)
    np.testing.assert_allclose(Z @ _flat(nu), path_sums(nu, N))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"leaf_counts": [1, -1]}, ValueError, "leaf_counts"),
        ({"leaf_counts": [[1, 2]]}, ValueError, "leaf_counts"),
        ({"leaf_counts": []}, ValueError, "leaf_counts"),
        ({"leaf_counts": [1.5, 2]}, ValueError, "leaf_counts"),
        ({"leaf_counts": ["a"]}, TypeError, "leaf_counts"),
        ({"epsilon": 0.0}, ValueError, "epsilon"),
        ({"epsilon": -1.0}, ValueError, "epsilon"),
        ({"epsilon": float("nan")}, ValueError, "epsilon"),
        ({"epsilon": None}, ValueError, "epsilon"),
        ({"neighbouring": "swap"}, ValueError, "neighbouring"),
        ({"noise": "uniform"}, ValueError, "noise"),
        ({"rho": 1.0}, ValueError, "rho"),
        ({"noise": "gaussian"}, ValueError, "rho"),
        ({"noise": "gaussian", "epsilon": None}, ValueError, "rho"),
        ({"noise": "gaussian", "epsilon": None, "rho": -1.0}, ValueError, "rho"),
    ],
)
def test_bad_inputs(kwargs, exc, match):
    args = {"leaf_counts": [1, 2, 3], "epsilon": 1.0, "rng": seeded_rng(0)} | kwargs
    with pytest.raises(exc, match=match):
        release_counts(**args)


def test_small_epsilon_scale_rounded_up_and_fast():
    rel = release_counts(np.ones(2**12, dtype=int), 0.01, "replace_one", rng=seeded_rng(0))
    assert rel.noise_param >= Fraction(13) / Fraction(0.01)
    assert rel.noise_param.numerator < 2**62


@pytest.mark.parametrize("L", range(2, 9))
def test_data_carrying_nodes_characterisation(L):
    """Power of two: the nodes theta uses are the root, its right child, and every lower node
    that is the same-side child as its parent (index = 0 or 3 mod 4): N nodes in all."""
    from clipless.stats.tree import _consistency_plan, _level_offsets

    used, q = _consistency_plan(L, 1 << L)
    assert q.shape[1] == 0 and used.sum() == 1 << L
    offsets = _level_offsets(L)
    for lev in range(L + 1):
        idx = np.flatnonzero(used[offsets[lev] : offsets[lev + 1]])
        if lev == L:
            assert idx.tolist() == [0]
        elif lev == L - 1:
            assert idx.tolist() == [1]
        else:
            np.testing.assert_array_equal(
                idx, [j for j in range(1 << (L - lev)) if j % 4 in (0, 3)]
            )
