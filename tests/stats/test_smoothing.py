"""Smoothing (thesis eq. 6.3.6) against brute-force references on small trees, and PAV against
scikit-learn / scipy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import isotonic_regression, linprog, minimize
from sklearn.isotonic import IsotonicRegression

from clipless.stats import Grid, ecdf, release_counts, seeded_rng
from clipless.stats import smoothing as sm
from clipless.stats.smoothing import isotonic, smooth_counts, smooth_tree

# ------------------------------------------------------------------------------------------
# references, written from the thesis's formulation (path sums), not the flow reformulation
# ------------------------------------------------------------------------------------------


def path_matrix(N: int) -> np.ndarray:
    """Dense path-sum matrix: row i has a 1 for each node (j, l) with j = i >> l."""
    L = int(N - 1).bit_length()
    cols = []
    for lev in range(L + 1):
        m = -(-N // (1 << lev))
        block = np.zeros((N, m))
        block[np.arange(N), np.arange(N) >> lev] = 1.0
        cols.append(block)
    return np.hstack(cols)


def constraint_rows(P: np.ndarray, n: float) -> tuple[np.ndarray, np.ndarray]:
    """6.3.6 as G nu <= h: y_1 >= 0, y_i <= y_{i+1}, y_N <= n with y = P + A nu."""
    A = path_matrix(P.size)
    N = P.size
    D = np.zeros((N + 1, N))
    D[0, 0] = -1.0
    for i in range(1, N):
        D[i, i - 1], D[i, i] = 1.0, -1.0
    D[N, N - 1] = 1.0
    h = -D @ P
    h[N] += n
    return D @ A, h


def objective_reference_l1(P: np.ndarray, n: float) -> float:
    """Dense LP with epigraph variables t >= |nu| (interior point), independent formulation."""
    G, h = constraint_rows(P, n)
    M = G.shape[1]
    eye = np.eye(M)
    A_ub = np.block([[G, np.zeros((G.shape[0], M))], [eye, -eye], [-eye, -eye]])
    b_ub = np.concatenate([h, np.zeros(2 * M)])
    c = np.concatenate([np.zeros(M), np.ones(M)])
    res = linprog(c, A_ub=A_ub, b_ub=b_ub, bounds=(None, None), method="highs-ipm")
    assert res.status == 0
    return float(res.fun)


def objective_exhaustive_l1(P: np.ndarray, n: float, k: int) -> float:
    """Exhaustive search over integer corrections in [-k, k]^M (an integral optimum exists: the
    constraint matrix is totally unimodular)."""
    G, h = constraint_rows(P, n)
    M = G.shape[1]
    grid = np.array(list(itertools.product(range(-k, k + 1), repeat=M)), dtype=np.float64)
    feasible = np.all(grid @ G.T <= h + 1e-9, axis=1)
    return float(np.abs(grid[feasible]).sum(axis=1).min())


def objective_active_sets_l2(P: np.ndarray, n: float) -> float:
    """Exact QP optimum by enumerating every active set: min ||nu||^2 s.t. G nu <= h equals the
    smallest objective among feasible least-norm solutions of G_S nu = h_S."""
    G, h = constraint_rows(P, n)
    best = np.inf
    rows = range(G.shape[0])
    for size in range(G.shape[0] + 1):
        for S in itertools.combinations(rows, size):
            if S:
                nu = np.linalg.lstsq(G[list(S)], h[list(S)], rcond=None)[0]
                if not np.allclose(G[list(S)] @ nu, h[list(S)], atol=1e-9):
                    continue
            else:
                nu = np.zeros(G.shape[1])
            if np.all(G @ nu <= h + 1e-9):
                best = min(best, float(nu @ nu))
    return best


def objective_slsqp_l2(P: np.ndarray, n: float) -> float:
    G, h = constraint_rows(P, n)
    M = G.shape[1]
    res = minimize(
        lambda x: x @ x,
        np.zeros(M),
        jac=lambda x: 2 * x,
        constraints=[{"type": "ineq", "fun": lambda x: h - G @ x, "jac": lambda x: -G}],
        method="SLSQP",
        options={"ftol": 1e-12, "maxiter": 1000},
    )
    assert res.success, res.message
    return float(res.fun)


def noisy_prefix(N: int, rng: np.random.Generator, lam: float = 2.0, noise: int = 6):
    """Integer noisy prefix counts with a tree path noise pattern, and n."""
    L = int(N - 1).bit_length()
    counts = rng.poisson(lam, N)
    n = int(counts.sum()) + 1
    P = np.cumsum(counts).astype(np.int64)
    for lev in range(L + 1):
        m = -(-N // (1 << lev))
        P = P + rng.integers(-noise, noise + 1, m)[np.arange(N) >> lev]
    return P, n


def check_valid(res: sm.SmoothedCounts, n: float) -> None:
    v = res.values
    assert np.all(np.diff(v) >= 0)
    assert v.min() >= 0.0 and v.max() <= 1.0
    np.testing.assert_allclose(res.prefix / n, v)


# ------------------------------------------------------------------------------------------
# the thesis's problem 6.3.6
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_l1_matches_exhaustive_integer_search(N: int) -> None:
    rng = np.random.default_rng(100 + N)
    for _ in range(3):
        P, n = noisy_prefix(N, rng, lam=1.0, noise=2)
        k = 3 if N <= 3 else 2
        ref = objective_exhaustive_l1(P.astype(float), n, k)
        for method in ("auto", "generic"):
            res = smooth_counts(P, n, "l1", method=method)
            assert res.objective == pytest.approx(ref, abs=1e-7)
            check_valid(res, n)


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5])
def test_l2_matches_active_set_enumeration(N: int) -> None:
    rng = np.random.default_rng(200 + N)
    for _ in range(4):
        P, n = noisy_prefix(N, rng, lam=1.0, noise=4)
        ref = objective_active_sets_l2(P.astype(float), n)
        for method in ("auto", "generic"):
            res = smooth_counts(P, n, "l2", method=method)
            assert res.objective == pytest.approx(ref, rel=1e-6, abs=1e-6)
            check_valid(res, n)


@pytest.mark.parametrize("N", [6, 11, 16, 23])
def test_matches_dense_reference_solvers(N: int) -> None:
    rng = np.random.default_rng(300 + N)
    for _ in range(2):
        P, n = noisy_prefix(N, rng)
        ref1 = objective_reference_l1(P.astype(float), n)
        ref2 = objective_slsqp_l2(P.astype(float), n)
        for method in ("auto", "generic"):
            r1 = smooth_counts(P, n, "l1", method=method)
            r2 = smooth_counts(P, n, "l2", method=method)
            assert r1.objective == pytest.approx(ref1, rel=1e-6, abs=1e-6)
            assert r2.objective == pytest.approx(ref2, rel=1e-5, abs=1e-5)
            check_valid(r1, n)
            check_valid(r2, n)


def test_exact_solvers_agree_with_highs_and_osqp() -> None:
    rng = np.random.default_rng(7)
    for N in (37, 128, 300, 1000):
        P, n = noisy_prefix(N, rng, lam=1.5, noise=15)
        for norm in ("l1", "l2"):
            fast = smooth_counts(P, n, norm)
            generic = smooth_counts(P, n, norm, method="generic")
            assert fast.method == ("dual-dp+maxflow" if norm == "l1" else "pdas")
            assert generic.method == ("highs" if norm == "l1" else "osqp")
            assert fast.objective == pytest.approx(generic.objective, rel=1e-6)
            check_valid(fast, n)
            if norm == "l2":  # strictly convex: the optimum is unique
                np.testing.assert_allclose(fast.prefix, generic.prefix, atol=1e-3 * n)


def test_l1_dual_box_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact l1 solver restricts the dual to a box and grows it while the bound binds."""
    rng = np.random.default_rng(11)
    P, n = noisy_prefix(256, rng, lam=1.0, noise=40)
    calls: list[int] = []
    original = sm._l1_dual_dp

    def spy(d, graph, box):  # type: ignore[no-untyped-def]
        calls.append(box)
        return original(d, graph, box)

    monkeypatch.setattr(sm, "_L1_BOX_START", 1)
    monkeypatch.setattr(sm, "_l1_dual_dp", spy)
    res = smooth_counts(P, n, "l1")
    assert calls[0] == 1 and len(calls) >= 2
    ref = smooth_counts(P, n, "l1", method="generic")
    assert res.objective == pytest.approx(ref.objective, rel=1e-9)


def test_non_integer_data_falls_back_to_highs() -> None:
    rng = np.random.default_rng(5)
    P, n = noisy_prefix(50, rng)
    res = smooth_counts(P + 0.25, n + 0.5, "l1")
    assert res.method == "highs"
    check_valid(res, n + 0.5)


def test_feasible_release_is_unchanged() -> None:
    P = np.array([0, 1, 1, 3, 6, 6, 9])
    for norm in ("l1", "l2"):
        res = smooth_counts(P, 10, norm)
        assert res.method == "none" and res.objective == 0.0
        np.testing.assert_array_equal(res.values, P / 10)


def test_smooth_tree_on_a_real_release() -> None:
    values = np.random.default_rng(0).poisson(2, 400).repeat(3).astype(float)
    grid = Grid(0, 20, size=100)
    rel = release_counts(grid.counts(values), 0.5, "replace_one", rng=seeded_rng(3))
    n = values.size
    for norm in ("l1", "l2"):
        F = smooth_tree(rel, n, norm)
        assert F.shape == (100,)
        assert np.all(np.diff(F) >= 0) and F.min() >= 0 and F.max() <= 1
        np.testing.assert_array_equal(F, smooth_counts(rel.prefix_counts, n, norm).values)
    released = ecdf(values, grid, 0.5, smoothing="l2", consistency=False, rng=seeded_rng(3))
    np.testing.assert_allclose(released.values, smooth_tree(rel, n, "l2"))
    # the default smooths the least-squares counts instead
    default = ecdf(values, grid, 0.5, smoothing="l2", rng=seeded_rng(3))
    assert default.consistency
    expected = smooth_counts(default.counts, n, "l2", depth=rel.depth).values
    np.testing.assert_allclose(default.values, expected)
    assert np.all(np.diff(default.values) >= 0)


def test_smooth_tree_reduces_error_at_moderate_epsilon() -> None:
    """Thesis section 6.6.3: projecting onto CDFs lowers the squared error when it binds."""
    counts = np.random.default_rng(1).poisson(3, 1024)
    n = int(counts.sum())
    exact = np.cumsum(counts) / n
    raw_err, l2_err = 0.0, 0.0
    for seed in range(5):
        rel = release_counts(counts, 0.2, "replace_one", rng=seeded_rng(seed))
        raw_err += float(np.sum((rel.prefix_counts / n - exact) ** 2))
        l2_err += float(np.sum((smooth_tree(rel, n, "l2") - exact) ** 2))
    assert l2_err < raw_err


def test_smoothing_validation() -> None:
    with pytest.raises(ValueError, match="norm"):
        smooth_counts([1, 2], 3, "l3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="method"):
        smooth_counts([1, 2], 3, method="cvxopt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be finite and > 0"):
        smooth_counts([1, 2], 0)
    with pytest.raises(TypeError, match="n must be a real number"):
        smooth_counts([1, 2], "3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_counts must be finite"):
        smooth_counts([1, np.nan], 3)
    with pytest.raises(ValueError, match="prefix_counts must be non-empty"):
        smooth_counts([], 3)
    with pytest.raises(ValueError, match="depth must be >="):
        smooth_counts([1, 2, 3], 3, depth=1)
    with pytest.raises(TypeError, match="release must be a TreeRelease"):
        smooth_tree([1, 2, 3], 3)  # type: ignore[arg-type]


def test_depth_larger_than_needed_gives_same_problem() -> None:
    """Extra levels above the root only duplicate the root: the optimum is unchanged for l1
    and smaller or equal for l2 (more variables share the same correction)."""
    rng = np.random.default_rng(9)
    P, n = noisy_prefix(16, rng)
    a = smooth_counts(P, n, "l1")
    b = smooth_counts(P, n, "l1", depth=6)
    assert b.objective == pytest.approx(a.objective)
    assert smooth_counts(P, n, "l2", depth=6).objective <= smooth_counts(P, n, "l2").objective


# ------------------------------------------------------------------------------------------
# isotonic regression
# ------------------------------------------------------------------------------------------


def test_isotonic_matches_sklearn_and_scipy() -> None:
    rng = np.random.default_rng(4)
    for size in (1, 2, 5, 50, 1000):
        y = np.cumsum(rng.normal(0.001, 0.05, size)) + 0.5
        w = rng.uniform(0.1, 3.0, size)
        x = np.arange(size)
        ref = IsotonicRegression(y_min=0.0, y_max=1.0).fit_transform(x, y, sample_weight=w)
        np.testing.assert_allclose(isotonic(y, w), ref, atol=1e-12)
        ref2 = np.clip(isotonic_regression(y, weights=w).x, 0, 1)
        np.testing.assert_allclose(isotonic(y, w), ref2, atol=1e-12)
        ref3 = np.clip(isotonic_regression(y).x, 0, 1)
        np.testing.assert_allclose(isotonic(y), ref3, atol=1e-12)


def test_isotonic_properties_and_validation() -> None:
    out = isotonic([0.3, 0.2, -0.5, 0.9, 1.4, 1.1])
    assert np.all(np.diff(out) >= 0) and out.min() >= 0 and out.max() <= 1
    np.testing.assert_allclose(isotonic([0.1, 0.2, 0.2, 0.7]), [0.1, 0.2, 0.2, 0.7])
    with pytest.raises(ValueError, match="weights must be > 0"):
        isotonic([0.1, 0.2], [1.0, 0.0])
    with pytest.raises(ValueError, match="same length"):
        isotonic([0.1, 0.2], [1.0])
    with pytest.raises(ValueError, match="values must be finite"):
        isotonic([0.1, np.inf])
    with pytest.raises(ValueError, match="one-dimensional"):
        isotonic([[0.1, 0.2]])
    with pytest.raises(TypeError, match="values must be an array of real numbers"):
        isotonic(["a", "b"])
