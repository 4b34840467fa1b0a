"""The counting-mechanism choice at the exact variance of the noise drawn (issue 37, item 1).

Exhaustive privacy loss of every new shape (flat histogram, levels dropped), the choice's score
against independent closed forms and dense covariances, and the default never worse than the
flat histogram or any uniform b-ary tree (OpenDP's shape).
"""

from fractions import Fraction

import numpy as np
import pytest

from clipless.stats import seeded_rng
from clipless.stats.counting import (
    CountingPlan,
    _release_kary,
    _tree_score,
    counting_plan,
    exact_level_variances,
    kary_depth,
    kary_node_counts,
    release_prefix_counts,
)
from clipless.stats.noise import discrete_gaussian_variance, discrete_laplace_variance

SHAPES = [  # (k, N, shares of the noisy levels under add/remove; replace-one drops the root's)
    (8, 8, (Fraction(1), Fraction(0))),  # flat histogram, k = N
    (2, 8, (Fraction(1, 2), Fraction(0), Fraction(1, 2), Fraction(0))),  # levels 1, 3 dropped
    (2, 13, (Fraction(1, 4), Fraction(1, 4), Fraction(0), Fraction(1, 2), Fraction(0))),
    (3, 20, (Fraction(1, 3), Fraction(0), Fraction(1, 3), Fraction(1, 3))),  # root kept
    (4, 16, (Fraction(1), Fraction(0), Fraction(0))),  # flat on a tree
]


def _replace_shares(shares: tuple[Fraction, ...]) -> tuple[Fraction, ...]:
    """Replace-one has no noisy root: move the root's share to the leaves."""
    out = list(shares[:-1])
    out[0] += shares[-1]
    return tuple(out)


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
@pytest.mark.parametrize("neighbouring", ["add_remove", "replace_one"])
@pytest.mark.parametrize(("k", "N", "shares"), SHAPES)
def test_privacy_loss_of_every_shape_exhaustive(k, N, shares, neighbouring, noise):
    """Every neighbour enumerated; privacy loss in exact rationals from the release's own
    per-level parameters is at most the budget, and a level with share 0 publishes nothing."""
    if neighbouring == "replace_one":
        shares = _replace_shares(shares)
    budget = Fraction(7, 10)
    counts = np.random.default_rng(N).integers(0, 3, N)
    rel = _release_kary(
        counts,
        CountingPlan(k, shares, 0.0),
        neighbouring,
        noise,
        budget,
        seeded_rng(0),
        float(budget) if noise == "laplace" else None,
        float(budget) if noise == "gaussian" else None,
    )
    released = [lev for lev, w in enumerate(shares) if w > 0]
    per = 1 if neighbouring == "add_remove" else 2
    assert rel.sensitivity == per * len(released)  # issue 37 item 6: not h + 1
    h = kary_depth(N, k)
    sizes = [k ** (h - lev) for lev in range(h + 1)]
    assert rel.noisy.size == sum(sizes[lev] for lev in released)
    level_of = np.concatenate([np.full(sizes[lev], lev) for lev in range(h + 1)])
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
            assert not (lev == h and neighbouring == "replace_one")
            p = rel.noise_param[lev]
            if p is None:
                assert shares[lev] == 0
                continue
            c = int(d[idx])
            loss += Fraction(abs(c)) / p if noise == "laplace" else Fraction(c * c) / (2 * p)
        worst = max(worst, loss)
    assert worst <= budget
    if neighbouring == "add_remove" or k**h == N:  # attained
        assert worst >= budget * Fraction(99, 100)


def _dense_prefix_cov(k, N, level_var):
    """Dense weighted least squares over the released levels only (no exact root)."""
    h = kary_depth(N, k)
    P = k**h
    rows, var = [], []
    for lev in range(h + 1):
        if not np.isfinite(level_var[lev]):
            continue
        for j in range(P // k**lev):
            r = np.zeros(P)
            r[j * k**lev : (j + 1) * k**lev] = 1
            rows.append(r)
            var.append(level_var[lev])
    M, w = np.array(rows), np.array(var)
    G = np.linalg.solve(M.T @ (M / w[:, None]), M.T / w[None, :])
    cum = np.tril(np.ones((N, P)))
    return cum @ G @ np.diag(w) @ G.T @ cum.T


@pytest.mark.parametrize(("k", "N", "shares"), SHAPES)
def test_tree_score_matches_dense_covariance(k, N, shares):
    """add/remove: the score is the mean variance of Chat_i - (i/N) Chat_N, from the dense
    covariance of the least-squares estimate with the dropped levels removed."""
    lv = exact_level_variances(shares, "add_remove", "laplace", Fraction(2))
    cov = _dense_prefix_cov(k, N, lv)
    f = np.arange(1, N + 1) / N
    proxy = np.diag(cov) - 2 * f * cov[:, -1] + f * f * cov[-1, -1]
    assert _tree_score(N, k, "add_remove", lv) == pytest.approx(proxy.mean(), rel=1e-9)


def _flat_score(N, neighbouring, noise, budget):
    """Independent closed form: leaves with i.i.d. noise of variance v, prefix = cumsum; the
    score of both relations is v mean_i (i - i^2 / N) (normalised, or conditioned on C_N)."""
    per = 1 if neighbouring == "add_remove" else 2
    if noise == "laplace":
        v = discrete_laplace_variance(Fraction(per) / budget)
    else:
        v = discrete_gaussian_variance(Fraction(per) / (2 * budget))
    i = np.arange(1, N + 1)
    return v * float(np.mean(i - i * i / N))


def _uniform_score(N, k, neighbouring, noise, budget):
    """OpenDP's shape: every noisy level with the same share."""
    m = kary_depth(N, k) + (1 if neighbouring == "add_remove" else 0)
    lv = exact_level_variances(tuple([Fraction(1, m)] * m), neighbouring, noise, budget)
    return _tree_score(N, k, neighbouring, lv)


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
@pytest.mark.parametrize("neighbouring", ["add_remove", "replace_one"])
@pytest.mark.parametrize("N", [1, 2, 37, 256, 1000])
@pytest.mark.parametrize("budget", [Fraction(1, 10), Fraction(1), Fraction(3), Fraction(10)])
def test_default_never_worse_than_flat_or_uniform_tree(budget, N, neighbouring, noise):
    plan = counting_plan(N, neighbouring, noise, budget)
    flat = _flat_score(N, neighbouring, noise, budget)
    assert plan.score <= flat * (1 + 1e-9) + 1e-12
    for b in (2, 4, 8, 16):
        assert plan.score <= _uniform_score(N, b, neighbouring, noise, budget) * (1 + 1e-9)
    if N >= 2 and all(w == 0 for w in plan.shares[1:]):
        assert plan.branching == N  # the flat histogram is released without padding


@pytest.mark.parametrize("neighbouring", ["add_remove", "replace_one"])
def test_high_epsilon_releases_the_flat_histogram(neighbouring):
    """Issue 37: at epsilon 10, N = 2^12, add/remove, a flat discrete-Laplace histogram has
    mean per-threshold variance 0.186 (the old default: 0.880); the default is now that."""
    N = 1 << 12
    rel = release_prefix_counts(np.ones(N, dtype=np.int64), 10.0, neighbouring, rng=seeded_rng(0))
    v = discrete_laplace_variance(Fraction(1 if neighbouring == "add_remove" else 2) / 10)
    i = np.arange(1, N + 1)
    if neighbouring == "add_remove":
        assert (rel.branching, rel.shares) == (N, (Fraction(1), Fraction(0)))
        np.testing.assert_allclose(rel.variance, v * i, rtol=1e-12)
        assert float(np.mean(rel.variance)) == pytest.approx(0.186, abs=5e-4)
    else:  # a k-ary shape can beat flat here (the root is public): never worse than it
        assert float(np.mean(rel.variance)) <= v * float(np.mean(i - i * i / N)) * (1 + 1e-9)


@pytest.mark.parametrize("noise", ["laplace", "gaussian"])
def test_release_variance_is_the_plan_score_under_replace_one(noise):
    """The released variance (exact, conditioned) averages to the score the choice minimised."""
    N, budget = 300, Fraction(1)
    eps, rho = (1.0, None) if noise == "laplace" else (None, 1.0)
    rel = release_prefix_counts(
        np.ones(N, dtype=np.int64), eps, "replace_one", noise, seeded_rng(0), rho,
        mechanism="k-ary",
    )  # fmt: skip
    plan = counting_plan(N, "replace_one", noise, budget)
    assert (rel.branching, rel.shares) == (plan.branching, plan.shares)
    assert float(np.mean(rel.variance)) == pytest.approx(plan.score, rel=1e-9)


def test_counting_plan_bad_input():
    with pytest.raises(ValueError, match="noise must be"):
        counting_plan(10, "add_remove", "uniform", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_leaves must be >= 1"):
        counting_plan(0, "add_remove", "laplace", 1.0)
    with pytest.raises(ValueError, match="budget must be > 0"):
        counting_plan(10, "add_remove", "laplace", 0.0)
    with pytest.raises(ValueError, match="shares must"):
        _release_kary(
            np.ones(4, dtype=np.int64), CountingPlan(2, (Fraction(1),), 0.0), "add_remove",
            "laplace", Fraction(1), seeded_rng(0), 1.0, None,
        )  # fmt: skip


@pytest.mark.parametrize("neighbouring", ["add_remove", "replace_one"])
@pytest.mark.parametrize("rho", [Fraction(1, 100), Fraction(1, 2), Fraction(50)])
def test_zcdp_default_is_the_lower_exact_score(neighbouring, rho):
    """Under zCDP "auto" is the factorisation or the k-ary plan, whichever has the lower exact
    score; the release's own variance of the chosen one agrees with that score."""
    from clipless.stats.counting import default_mechanism, factorization_score

    N = 300
    tree = counting_plan(N, neighbouring, "gaussian", rho).score
    fact = factorization_score(N, neighbouring, rho)
    chosen = default_mechanism("gaussian", N, neighbouring, rho)
    assert chosen == ("factorization" if fact < tree else "k-ary")
    rel = release_prefix_counts(
        np.ones(N, dtype=np.int64), None, neighbouring, "gaussian", seeded_rng(0), float(rho)
    )
    assert rel.mechanism == chosen
    if neighbouring == "replace_one":  # the score is the mean released variance
        assert float(np.mean(rel.variance)) == pytest.approx(min(fact, tree), rel=1e-6)
