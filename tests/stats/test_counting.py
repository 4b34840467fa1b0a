"""Tests for the counting mechanisms: exhaustive sensitivity, exact least squares, variances."""

import itertools

import numpy as np
import pytest

from clipless.stats import seeded_rng
from clipless.stats.counting import (
    _estimator_coefficients,
    _kary_kappa,
    default_mechanism,
    factorization_coefficients,
    factorization_integer_coefficients,
    factorization_sensitivity,
    kary_consistent_leaves,
    kary_depth,
    kary_node_counts,
    kary_prefix_covariance_with_last,
    kary_prefix_variance,
    kary_sensitivity,
    release_prefix_counts,
)
from clipless.stats.tree import TreeRelease


@pytest.mark.parametrize("k", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("N", [1, 2, 3, 5, 8, 9, 16, 17, 27, 30])
def test_kary_exhaustive_sensitivity(k, N):
    """Every add/remove and replace-one change of the noisy node vector, enumerated."""
    h = kary_depth(N, k)
    base = np.random.default_rng(N * k).integers(0, 3, N)
    before = np.concatenate(kary_node_counts(base, k))
    cols = []
    for a in range(N):
        counts = base.copy()
        counts[a] += 1
        nodes = kary_node_counts(counts, k)
        assert nodes[0][:N].tolist() == counts.tolist()
        cols.append(np.concatenate(nodes) - before)
    cols_arr = np.stack(cols)
    # add/remove: all levels released (root included)
    add = int(np.abs(cols_arr).sum(axis=1).max())
    assert add == kary_sensitivity(h, "add_remove") == h + 1
    assert int((cols_arr**2).sum(axis=1).max()) == h + 1
    # replace-one: the root (last entry) is the public n, not released
    diffs = (cols_arr[None, :, :-1] - cols_arr[:, None, :-1]).reshape(N * N, -1)
    assert np.all(cols_arr[:, -1] == 1)
    rep = int(np.abs(diffs).sum(axis=1).max())
    assert rep <= kary_sensitivity(h, "replace_one") == 2 * h
    assert int((diffs**2).sum(axis=1).max()) == rep
    if k**h == N and N > 1:  # attained on a full tree: first and last leaf
        assert rep == 2 * h


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
@pytest.mark.parametrize("neighbouring", ["add_remove", "replace_one"])
@pytest.mark.parametrize(("k", "N"), [(2, 16), (3, 20), (4, 64), (8, 64), (16, 40)])
def test_kary_privacy_loss_with_level_shares_exhaustive(k, N, neighbouring, noise):
    """The release's own per-level scales: max over all neighbours of the privacy loss
    (sum |change| / b_l for Laplace, sum change^2 / (2 sigma_l^2) for Gaussian), in exact
    rationals, is at most the budget."""
    from fractions import Fraction

    counts = np.random.default_rng(0).integers(0, 3, N)
    eps, rho = (Fraction(7, 10), None) if noise == "laplace" else (None, Fraction(3, 10))
    rel = release_prefix_counts(
        counts, eps, neighbouring, noise, seeded_rng(0), rho, mechanism="k-ary", branching=k
    )
    params = rel.noise_param
    assert sum(rel.shares) == 1 and rel.shares[0] > 0
    h = kary_depth(N, k)
    level_of = np.concatenate([np.full(k ** (h - lev), lev) for lev in range(h + 1)])
    base = np.concatenate(kary_node_counts(counts, k))
    cols = []
    for a in range(N):
        c2 = counts.copy()
        c2[a] += 1
        cols.append(np.concatenate(kary_node_counts(c2, k)) - base)
    diffs = (
        cols
        if neighbouring == "add_remove"
        else [cols[b] - cols[a] for a in range(N) for b in range(N) if a != b]
    )
    worst = Fraction(0)
    for d in diffs:
        loss = Fraction(0)
        for idx in np.flatnonzero(d):
            lev = int(level_of[idx])
            if lev == h and neighbouring == "replace_one":
                raise AssertionError("the root cannot change under replace-one")
            p = params[lev]
            if p is None:  # the level is not released: its change is not observable
                continue
            loss += (
                Fraction(abs(int(d[idx]))) / p
                if noise == "laplace"
                else Fraction(int(d[idx]) ** 2) / (2 * p)
            )
        worst = max(worst, loss)
    budget = eps if noise == "laplace" else rho
    assert worst <= budget
    if neighbouring == "add_remove" or k**h == N:  # attained
        assert worst >= budget * Fraction(99, 100)


def _dense_blue(k, N, level_var, y):
    """Weighted least squares with an exact root (null-space elimination), dense."""
    h = kary_depth(N, k)
    P = k**h
    rows, lv = [], []
    for lev in range(h + 1):
        for j in range(P // k**lev):
            r = np.zeros(P)
            r[j * k**lev : (j + 1) * k**lev] = 1
            rows.append(r)
            lv.append(lev)
    M = np.array(rows)
    w = np.array([level_var[lev] for lev in lv])
    noisy = w > 0
    Mn, yn, W = M[noisy], y[noisy], np.diag(1 / w[noisy])
    if noisy.all():
        G = np.linalg.solve(Mn.T @ W @ Mn, Mn.T @ W)
        return G @ y, G @ np.diag(w) @ G.T
    # exact constraint: sum(x) = y_root; x = x0 + B u with B an orthonormal basis of 1^perp
    one = np.ones(P) / np.sqrt(P)
    B = np.linalg.svd(np.eye(P) - np.outer(one, one))[0][:, : P - 1]
    x0 = one * y[-1] / np.sqrt(P)
    MB = Mn @ B
    H = np.linalg.solve(MB.T @ W @ MB, MB.T @ W)
    est = x0 + B @ (H @ (yn - Mn @ x0))
    cov = B @ H @ np.diag(w[noisy]) @ H.T @ B.T
    return est, cov


@pytest.mark.parametrize(
    ("k", "N", "root_known"),
    [(2, 8, False), (2, 5, True), (3, 7, True), (4, 16, False), (4, 13, True), (5, 20, False)],
)
def test_kary_least_squares_and_variance_match_dense(k, N, root_known):
    h = kary_depth(N, k)
    P = k**h
    level_var = [1.0 + 0.3 * lev for lev in range(h + 1)]
    if root_known:
        level_var[-1] = 0.0
    y = np.random.default_rng(0).normal(size=sum(P // k**lev for lev in range(h + 1))) * 3
    levels, pos = [], 0
    for lev in range(h + 1):
        levels.append(y[pos : pos + P // k**lev])
        pos += P // k**lev
    est, cov = _dense_blue(k, N, level_var, y)
    np.testing.assert_allclose(kary_consistent_leaves(levels, k, level_var), est, atol=1e-9)
    A = np.tril(np.ones((N, P)))
    np.testing.assert_allclose(
        kary_prefix_variance(N, k, level_var), np.diag(A @ cov @ A.T), rtol=1e-9, atol=1e-9
    )
    np.testing.assert_allclose(
        kary_prefix_covariance_with_last(N, k, level_var),
        (A @ cov @ A.T)[:, -1],
        rtol=1e-9,
        atol=1e-9,
    )
    # the O(h) kappa recursion equals the full two passes on v_0 e_0
    unit = [np.zeros(P // k**lev) for lev in range(h + 1)]
    unit[0][0] = level_var[0]
    full = kary_consistent_leaves(unit, k, level_var)
    idx = [0] + [k ** (lev - 1) for lev in range(1, h + 1)]
    np.testing.assert_allclose(_kary_kappa(h, k, tuple(level_var)), full[idx], atol=1e-12)


def _toeplitz(c):
    n = len(c)
    return np.array([[c[i - j] if i >= j else 0 for j in range(n)] for i in range(n)])


@pytest.mark.parametrize("N", [1, 2, 3, 7, 16, 33, 64, 100])
def test_factorization_square_root_and_exhaustive_sensitivity(N):
    c = factorization_coefficients(N)
    np.testing.assert_allclose(_toeplitz(c) @ _toeplitz(c), np.tril(np.ones((N, N))), atol=1e-12)
    ct = factorization_integer_coefficients(N)
    Lt = _toeplitz([int(v) for v in ct]).astype(object)  # exact Python integers
    cols = [Lt[:, a] for a in range(N)]
    add = max(int(np.dot(col, col)) for col in cols)
    rep = max(
        (
            int(np.dot(cols[b] - cols[a], cols[b] - cols[a]))
            for a, b in itertools.permutations(range(N), 2)
        ),
        default=0,
    )
    assert factorization_sensitivity(N, "add_remove") == add
    if N > 1:
        assert factorization_sensitivity(N, "replace_one") == rep
    # the estimator inverts the factor: (A Lt^-1) Lt = A
    g = _estimator_coefficients(N)
    np.testing.assert_allclose(
        _toeplitz(g) @ _toeplitz(ct.astype(float)), np.tril(np.ones((N, N))), atol=1e-9
    )


@pytest.mark.parametrize("n_exp", [5, 12, 14])
def test_exact_convolve_matches_integer_reference(n_exp):
    from clipless.stats.counting import exact_convolve

    rng = np.random.default_rng(n_exp)
    N = 1 << n_exp
    ct = factorization_integer_coefficients(N)
    x = rng.poisson(3.0, N).astype(np.int64)
    x[rng.integers(0, N)] = 10**6  # a heavy leaf
    ref = np.convolve(ct, x)[:N]  # exact int64 (direct)
    np.testing.assert_array_equal(exact_convolve(ct, x, N), ref)


def test_factorization_coefficients_exact():
    from fractions import Fraction
    from math import comb

    c = factorization_coefficients(40)
    exact = [float(Fraction(comb(2 * k, k), 4**k)) for k in range(40)]
    np.testing.assert_allclose(c, exact, rtol=1e-14)


def test_factorization_variance_and_conditioning_match_dense():
    N = 40
    counts = np.random.default_rng(1).integers(0, 5, N)
    rel = release_prefix_counts(
        counts, None, "add_remove", "gaussian", seeded_rng(0), rho=0.5, mechanism="factorization"
    )
    G = _toeplitz(_estimator_coefficients(N))
    v = rel.node_variance
    np.testing.assert_allclose(rel.variance, v * np.diag(G @ G.T), rtol=1e-9)
    assert float(rel.noise_param) >= factorization_sensitivity(N, "add_remove") / (2 * 0.5)
    # the release is exactly A Lt^-1 (Lt x + Z): recover Z as an integer vector
    ct = factorization_integer_coefficients(N)
    z = rel.noisy - _toeplitz(ct) @ counts
    np.testing.assert_array_equal(z, np.round(z))
    rep = release_prefix_counts(
        counts, None, "replace_one", "gaussian", seeded_rng(0), rho=0.5, mechanism="factorization"
    )
    cov = rep.node_variance * G @ G.T
    cond = cov - np.outer(cov[:, -1], cov[:, -1]) / cov[-1, -1]
    np.testing.assert_allclose(rep.variance, np.maximum(np.diag(cond), 0), rtol=1e-6, atol=1e-6)
    assert rep.prefix_counts[-1] == counts.sum()


@pytest.mark.parametrize("mechanism", ["k-ary", "factorization"])
@pytest.mark.parametrize("neighbouring", ["add_remove", "replace_one"])
def test_release_unbiased_with_the_stated_variance(mechanism, neighbouring):
    """Monte Carlo: mean error ~ 0 and per-threshold variance ~ the exact one (within 15%)."""
    N = 50
    counts = np.random.default_rng(2).integers(0, 6, N)
    rng = seeded_rng(3)
    noise = "gaussian" if mechanism == "factorization" else "laplace"
    eps = None if noise == "gaussian" else 1.0
    rho = 0.5 if noise == "gaussian" else None
    errs = []
    for _ in range(400):
        rel = release_prefix_counts(
            counts, eps, neighbouring, noise, rng, rho, mechanism=mechanism, branching=None
        )
        errs.append(rel.prefix_counts - np.cumsum(counts))
    e = np.array(errs)
    var = rel.variance
    # per threshold (the errors of one release are correlated across thresholds)
    se = np.sqrt(var / len(errs))
    assert np.all(np.abs(e.mean(axis=0)) <= 4.5 * se + 1e-9)
    np.testing.assert_allclose(e.var(axis=0).mean(), var.mean(), rtol=0.15)


def test_kary_release_noise_free_is_exact_and_binary_passes_through():
    counts = np.array([3, 0, 2, 5, 1, 1, 0, 4, 2])
    rel = release_prefix_counts(
        counts, 1e9, "add_remove", rng=seeded_rng(0), mechanism="k-ary", branching=3
    )
    np.testing.assert_allclose(rel.prefix_counts, np.cumsum(counts), atol=1e-6)
    assert rel.branching == 3 and rel.sensitivity == 3
    binary = release_prefix_counts(counts, 1.0, rng=seeded_rng(0), mechanism="binary")
    assert isinstance(binary, TreeRelease)


def test_bad_input_messages():
    with pytest.raises(ValueError, match="mechanism must be one of"):
        release_prefix_counts([1, 2], 1.0, mechanism="ternary")
    with pytest.raises(ValueError, match="needs noise='gaussian'"):
        release_prefix_counts([1, 2], 1.0, mechanism="factorization")
    with pytest.raises(ValueError, match="branching must be between 2 and 65536"):
        release_prefix_counts([1, 2], 1.0, mechanism="k-ary", branching=1)
    with pytest.raises(ValueError, match="branching must be between 2 and 65536"):
        release_prefix_counts([1, 2], 1.0, mechanism="k-ary", branching=10**12)
    with pytest.raises(ValueError, match="only for mechanism='k-ary'"):
        release_prefix_counts([1, 2], 1.0, mechanism="binary", branching=4)
    assert default_mechanism("laplace", 64, "add_remove", 1.0) == "k-ary"
    assert default_mechanism("gaussian", 4096, "replace_one", 0.5) == "factorization"
    assert default_mechanism("gaussian", 4096, "replace_one", 50) == "k-ary"  # flat


@pytest.mark.parametrize(
    ("mechanism", "noise"),
    [("k-ary", "laplace"), ("k-ary", "gaussian"), ("factorization", "gaussian")],
)
@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
def test_ecdf_and_roc_accept_every_mechanism(mechanism, noise, neighbouring):
    from clipless.stats import Grid, ecdf, nonprivate_roc, roc

    values = np.random.default_rng(0).normal(size=300)
    grid = Grid(-3, 3, size=40)
    eps, rho = (1e8, None) if noise == "laplace" else (None, 1e14)
    F = ecdf(
        values,
        grid,
        eps,
        neighbouring,
        None,
        noise,
        rng=seeded_rng(1),
        rho=rho,
        mechanism=mechanism,
    )
    exact = np.cumsum(grid.counts(values)) / values.size
    np.testing.assert_allclose(F.values, exact, atol=1e-4)
    assert F.release.mechanism == mechanism
    for sm in ("isotonic", "l2"):
        G = ecdf(
            values,
            grid,
            eps,
            neighbouring,
            sm,
            noise,
            rng=seeded_rng(1),
            rho=rho,
            mechanism=mechanism,
        )
        assert np.all(np.diff(G.values) >= -1e-12)
    labels = (values + np.random.default_rng(1).normal(size=300) > 0).astype(int)
    curve = roc(
        values,
        labels,
        grid,
        eps,
        neighbouring,
        None,
        seeded_rng(2),
        noise=noise,
        rho=rho,
        mechanism=mechanism,
    )
    fpr, tpr = nonprivate_roc(values, labels, grid)
    np.testing.assert_allclose(curve.fpr, fpr[1:-1], atol=1e-4)
    np.testing.assert_allclose(curve.tpr, tpr[1:-1], atol=1e-4)


def test_ecdf_mechanism_errors():
    from clipless.stats import ecdf

    with pytest.raises(ValueError, match="consistency=False"):
        ecdf([1.0, 2.0], [1.0, 2.0], 1.0, consistency=False, mechanism="k-ary")
    with pytest.raises(ValueError, match="mechanism must be one of"):
        ecdf([1.0, 2.0], [1.0, 2.0], 1.0, mechanism="tree")


@pytest.mark.parametrize("mechanism", ["k-ary", "factorization"])
@pytest.mark.parametrize("neighbouring", ["replace_one", "add_remove"])
def test_isotonic_never_increases_the_error(mechanism, neighbouring):
    """Unweighted projection onto monotone CDFs in [0, 1]: for every draw, smoothed error <= raw."""
    from clipless.stats import Grid, ecdf

    values = np.random.default_rng(0).integers(1, 65, 300).astype(float)
    grid = Grid(1, 64, size=64)
    exact = np.cumsum(grid.counts(values)) / values.size
    noise = "gaussian" if mechanism == "factorization" else "laplace"
    eps, rho = (None, 2.0) if noise == "gaussian" else (3.0, None)
    for seed in range(30):
        kw = dict(rng=seeded_rng(seed), rho=rho, mechanism=mechanism)
        raw = ecdf(values, grid, eps, neighbouring, None, noise, **kw)
        kw["rng"] = seeded_rng(seed)
        iso = ecdf(values, grid, eps, neighbouring, "isotonic", noise, **kw)
        np.testing.assert_array_equal(raw.counts, iso.counts)  # same noise draw
        assert np.sum((iso.values - exact) ** 2) <= np.sum((raw.values - exact) ** 2) + 1e-12
