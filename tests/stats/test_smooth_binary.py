"""Tests for the smooth binary mechanism (Andersson & Pagh 2023): exhaustive sensitivity,
exact reads, equal per-prefix variance, exact conditioning, Monte Carlo variance."""

import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest

from clipless.stats import seeded_rng
from clipless.stats.counting import (
    release_prefix_counts,
    smooth_binary_labels,
    smooth_binary_node_counts,
    smooth_binary_nodes,
    smooth_binary_sensitivity,
    smooth_binary_shape,
)

SIZES = [1, 2, 3, 4, 5, 7, 9, 16, 20, 33, 50, 64, 100]


def _dense_nodes(N):
    """Node-by-leaf matrix of the released vector, built from unit vectors."""
    return np.stack([smooth_binary_node_counts(np.eye(N, dtype=np.int64)[a]) for a in range(N)], 1)


def _dense_reads(N):
    """Read-by-node 0/1 matrix (read m sums its k nodes), from the node keys, independently
    of the release code: the dyadic nodes of [0, L_m) by brute force over the tree."""
    h, _ = smooth_binary_shape(N)
    keys, _ = smooth_binary_nodes(N)
    pos = {int(key): i for i, key in enumerate(keys)}
    labels = smooth_binary_labels(N)
    R = np.zeros((N, keys.size), dtype=np.int64)
    for m in range(1, N + 1):
        t = int(labels[m])
        for j in range(h):
            if (t >> j) & 1:
                R[m - 1, pos[j * (1 << h) + (t >> j) - 1]] = 1
    return R


@pytest.mark.parametrize("N", SIZES)
def test_shape_and_labels(N):
    h, k = smooth_binary_shape(N)
    assert comb(h, k) >= N + 1
    labels = [int(v) for v in smooth_binary_labels(N)]
    every = [v for v in range(1 << h) if bin(v).count("1") == k]
    assert labels == every[: N + 1]  # the smallest N + 1 labels of weight k, in order


@pytest.mark.parametrize("N", SIZES)
def test_exhaustive_sensitivity(N):
    """Every add/remove (one leaf +1) and replace-one (leaf a -> leaf b) change of the released
    node vector, enumerated; L1 and squared L2 both equal the claimed constant."""
    M = _dense_nodes(N)
    assert set(np.unique(M)) <= {0, 1}
    add_l1 = int(np.abs(M).sum(axis=0).max())
    assert int((M**2).sum(axis=0).max()) == add_l1
    assert smooth_binary_sensitivity(N, "add_remove") == max(1, add_l1)
    h, k = smooth_binary_shape(N)
    assert add_l1 <= h - k  # the bound the shape is optimised for
    rep = max(
        (int(np.abs(M[:, b] - M[:, a]).sum()) for a, b in itertools.permutations(range(N), 2)),
        default=0,
    )
    rep2 = max(
        (int(((M[:, b] - M[:, a]) ** 2).sum()) for a, b in itertools.permutations(range(N), 2)),
        default=0,
    )
    assert rep == rep2
    assert smooth_binary_sensitivity(N, "replace_one") == max(1, rep)


@pytest.mark.parametrize("N", SIZES)
def test_reads_are_exact_prefix_counts_with_k_nodes_each(N):
    counts = np.random.default_rng(N).integers(-3, 7, N)  # linear: negatives allowed
    _, k = smooth_binary_shape(N)
    R = _dense_reads(N)
    assert np.all(R.sum(axis=1) == k)  # every prefix uses exactly k nodes: equal variance
    np.testing.assert_array_equal(R @ smooth_binary_node_counts(counts), np.cumsum(counts))


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
@pytest.mark.parametrize("neighbouring", ["add_remove", "replace_one"])
def test_release_scale_and_exact_variance(noise, neighbouring):
    N = 45
    counts = np.random.default_rng(1).integers(0, 5, N)
    eps, rho = (Fraction(7, 10), None) if noise == "laplace" else (None, Fraction(3, 10))
    rel = release_prefix_counts(
        counts, eps, neighbouring, noise, seeded_rng(0), rho, mechanism="smooth-binary"
    )
    delta = smooth_binary_sensitivity(N, neighbouring)
    assert rel.sensitivity == delta
    if noise == "laplace":  # privacy loss delta / b <= epsilon, exactly
        assert Fraction(delta) / rel.noise_param <= eps
    else:  # delta / (2 sigma^2) <= rho, exactly
        assert Fraction(delta) / (2 * rel.noise_param) <= rho
    # the release is R (U x + Z) (then conditioned): Z is an integer vector
    z = rel.noisy - smooth_binary_node_counts(counts)
    np.testing.assert_array_equal(z, np.round(z))
    R = _dense_reads(N)
    cov = rel.node_variance * R @ R.T
    if neighbouring == "add_remove":
        np.testing.assert_array_equal(rel.prefix_counts, R @ rel.noisy)
        _, k = smooth_binary_shape(N)
        np.testing.assert_allclose(rel.variance, k * rel.node_variance, rtol=1e-12)
        assert np.ptp(rel.variance) == 0  # the same variance at every prefix
        np.testing.assert_allclose(rel.variance, np.diag(cov), rtol=1e-12)
    else:
        cond = cov - np.outer(cov[:, -1], cov[:, -1]) / cov[-1, -1]
        np.testing.assert_allclose(rel.variance, np.maximum(np.diag(cond), 0), atol=1e-9)
        raw = R @ rel.noisy
        expect = raw - cov[:, -1] / cov[-1, -1] * (raw[-1] - counts.sum())
        np.testing.assert_allclose(rel.prefix_counts, expect, atol=1e-9)
        assert rel.prefix_counts[-1] == counts.sum()


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_monte_carlo_variance_matches_and_is_flat(noise):
    """400 releases: mean error ~ 0, and per-prefix empirical variances ~ the constant stated
    one (mean within 10%; no prefix outside a 5-sigma band of the chi-square spread)."""
    N = 60
    counts = np.random.default_rng(2).integers(0, 6, N)
    rng = seeded_rng(5)
    eps, rho = (1.0, None) if noise == "laplace" else (None, 0.5)
    errs = []
    for _ in range(400):
        rel = release_prefix_counts(
            counts, eps, "add_remove", noise, rng, rho, mechanism="smooth-binary"
        )
        errs.append(rel.prefix_counts - np.cumsum(counts))
    e = np.array(errs)
    v = float(rel.variance[0])
    assert abs(e.mean()) < 4 * np.sqrt(v / e.size) * 3  # correlated columns: loose
    emp = e.var(axis=0)
    np.testing.assert_allclose(emp.mean(), v, rtol=0.10)
    rel_sd = np.sqrt(2 / 400) * (3 if noise == "laplace" else 1)  # heavier tails for Laplace
    assert np.all(np.abs(emp / v - 1) < 5 * rel_sd)


def test_variance_beats_binary_tree_and_trails_factorisation():
    """At N = 4096 under rho-zCDP: the smooth binary variance k * Delta / (2 rho) lies between the
    factorisation's mean variance and the binary tree's (the paper's ordering)."""
    N, rho = 4096, 0.5
    counts = np.zeros(N, dtype=np.int64)
    kw = dict(rng=seeded_rng(0), rho=rho)
    sm = release_prefix_counts(
        counts, None, "add_remove", "gaussian", **kw, mechanism="smooth-binary"
    )
    fa = release_prefix_counts(
        counts, None, "add_remove", "gaussian", **kw, mechanism="factorization"
    )
    from clipless.stats.tree import prefix_variance

    bi = release_prefix_counts(counts, None, "add_remove", "gaussian", **kw, mechanism="binary")
    binary_mean = float(np.mean(prefix_variance(bi, consistent=False)))
    assert fa.variance.mean() < sm.variance.mean() < binary_mean


def test_bad_input():
    with pytest.raises(ValueError, match="only for mechanism='k-ary'"):
        release_prefix_counts([1, 2], 1.0, mechanism="smooth-binary", branching=4)
    with pytest.raises(ValueError, match="num_leaves must be in"):
        smooth_binary_shape(0)
    with pytest.raises(TypeError, match="num_leaves must be an int"):
        smooth_binary_shape(2.5)


@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
def test_ecdf_and_roc_accept_smooth_binary(neighbouring):
    from clipless.stats import Grid, ecdf, nonprivate_roc, roc

    values = np.random.default_rng(0).normal(size=300)
    grid = Grid(-3, 3, size=40)
    F = ecdf(values, grid, 1e8, neighbouring, None, rng=seeded_rng(1), mechanism="smooth-binary")
    exact = np.cumsum(grid.counts(values)) / values.size
    np.testing.assert_allclose(F.values, exact, atol=1e-4)
    assert F.release.mechanism == "smooth-binary"
    iso = ecdf(
        values, grid, 1.0, neighbouring, "isotonic", rng=seeded_rng(1), mechanism="smooth-binary"
    )
    assert np.all(np.diff(iso.values) >= -1e-12)
    labels = (values + np.random.default_rng(1).normal(size=300) > 0).astype(int)
    curve = roc(
        values, labels, grid, 1e8, neighbouring, None, seeded_rng(2), mechanism="smooth-binary"
    )
    fpr, tpr = nonprivate_roc(values, labels, grid)
    np.testing.assert_allclose(curve.fpr, fpr[1:-1], atol=1e-4)
    np.testing.assert_allclose(curve.tpr, tpr[1:-1], atol=1e-4)
