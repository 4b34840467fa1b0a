"""Tests for clipless.stats.continual (thesis Theorem 6.3.2)."""

import numpy as np
import pytest

from clipless.stats import (
    ContinualCounter,
    HorizonExceededError,
    discrete_laplace,
    discrete_laplace_variance,
    path_sums,
    seeded_rng,
)


def test_exact_at_huge_epsilon_and_horizon():
    stream = [1, 0, 1, 1, 0, 1, 1]
    c = ContinualCounter(1e12, horizon=7, rng=seeded_rng(0))
    out = [c.update(x) for x in stream]
    assert out == np.cumsum(stream).tolist()
    np.testing.assert_array_equal(c.released, out)
    assert c.time == 7 and c.depth == 3
    with pytest.raises(HorizonExceededError, match="horizon"):
        c.update(1)


def test_released_is_thesis_path_sum():
    """s_hat_t = s_t + sum_l eta_{ceil(t/2^l), l}: replay the counter's i.i.d. noise draws."""
    c = ContinualCounter(1.0, horizon=16, rng=seeded_rng(1))
    stream = np.random.default_rng(0).integers(0, 2, 11)
    for x in stream:
        c.update(int(x))
    draws = iter(discrete_laplace(c.noise_param, 31, seeded_rng(1)).tolist())
    nodes = [np.zeros(16 >> lev, dtype=np.int64) for lev in range(5)]
    for leaf in range(11):  # nodes are drawn when first needed, lowest level first
        for lev in range(5):
            if leaf % (1 << lev) == 0:
                nodes[lev][leaf >> lev] = next(draws)
    np.testing.assert_array_equal(c.released - np.cumsum(stream), path_sums(nodes, 11))


@pytest.mark.parametrize(("bound", "noise"), [(1, "laplace"), (3, "laplace"), (1, "gaussian")])
def test_calibration_and_error(bound, noise):
    eps, rho = (0.5, None) if noise == "laplace" else (None, 0.3)
    rng = seeded_rng(5)
    sq = []
    for _ in range(150):
        c = ContinualCounter(eps, 16, noise, rng=rng, rho=rho, bound=bound)
        stream = [bound] * 16
        out = [c.update(x) for x in stream]
        sq.append(np.mean((np.array(out) - np.cumsum(stream)) ** 2))
    L = 4
    nodes = 3  # ceil((L+1)/2)
    assert c.sensitivity == bound * nodes
    if noise == "laplace":
        assert float(c.noise_param) == bound * nodes / eps
        assert c.variance == pytest.approx((L + 1) * discrete_laplace_variance(bound * nodes / eps))
    else:
        assert float(c.noise_param) == pytest.approx(nodes / (2 * rho))
    sq = np.array(sq)
    assert abs(sq.mean() - c.variance) < 5 * sq.std(ddof=1) / np.sqrt(sq.size)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"horizon": 0}, ValueError, "horizon"),
        ({"horizon": 2.0}, TypeError, "horizon"),
        ({"epsilon": 0.0}, ValueError, "epsilon"),
        ({"epsilon": None}, ValueError, "epsilon"),
        ({"noise": "gaussian"}, ValueError, "rho"),
        ({"neighbouring": "x"}, ValueError, "neighbouring"),
        ({"bound": 0}, ValueError, "bound"),
        ({"noise": "x"}, ValueError, "noise"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    args = {"epsilon": 1.0, "horizon": 8, "rng": seeded_rng(0)} | kwargs
    with pytest.raises(exc, match=match):
        ContinualCounter(**args)


def test_bad_elements():
    c = ContinualCounter(1.0, 8, rng=seeded_rng(0), bound=2)
    with pytest.raises(ValueError, match="x"):
        c.update(3)
    with pytest.raises(ValueError, match="x"):
        c.update(-1)
    with pytest.raises(TypeError, match="x"):
        c.update(0.5)
    assert c.time == 0
    c.update(True)
    assert c.time == 1


def test_factorization_counter_matches_offline_and_variance():
    from clipless.stats.counting import (
        _estimator_coefficients,
        factorization_integer_coefficients,
        factorization_sensitivity,
    )

    T = 20
    c = ContinualCounter(None, T, "gaussian", rng=seeded_rng(4), rho=0.5, mechanism="factorization")
    stream = np.random.default_rng(1).integers(0, 2, T)
    out = np.array([c.update(int(x)) for x in stream])

    def toeplitz(v):
        return np.array([[v[i - j] if i >= j else 0 for j in range(T)] for i in range(T)])

    Lt = toeplitz(factorization_integer_coefficients(T))
    G = toeplitz(_estimator_coefficients(T))
    noisy = np.array(c._noisy)
    z = noisy - Lt @ stream  # integer discrete Gaussian draws
    np.testing.assert_array_equal(z, np.round(z))
    np.testing.assert_allclose(out, G @ noisy, rtol=1e-12, atol=1e-6)
    np.testing.assert_allclose(G @ Lt, np.tril(np.ones((T, T))), atol=1e-9)
    assert float(c.noise_param) >= factorization_sensitivity(T, "add_remove")
    last = []
    for seed in range(300):
        cc = ContinualCounter(
            None, T, "gaussian", rng=seeded_rng(seed), rho=0.5, mechanism="factorization"
        )
        last.append([cc.update(0) for _ in range(T)][-1])
    assert np.var(last) == pytest.approx(cc.variance, rel=0.2)
    with pytest.raises(ValueError, match="needs noise='gaussian'"):
        ContinualCounter(1.0, 8, mechanism="factorization")
    with pytest.raises(ValueError, match="'binary' or 'factorization'"):
        ContinualCounter(1.0, 8, mechanism="k-ary")
