"""One-run audit of full private training (Steinke, Nasr and Jagielski 2023).

"Privacy auditing with one (1) training run" (NeurIPS 2023, arXiv:2305.08846): ``m`` canaries are
each included in the training data independently with probability 1/2; after one private training
run the auditor scores every canary, guesses "included" for the ``k_plus`` highest scores and
"excluded" for the ``k_minus`` lowest, and abstains on the rest. If training is
``(epsilon, delta)``-DP, the number ``v`` of correct guesses among ``r = k_plus + k_minus`` is
stochastically dominated by ``Binomial(r, e^epsilon / (1 + e^epsilon))`` up to a ``delta`` term
(their Theorem 3 / Proposition 5.x): the p-value of observing ``>= v`` correct guesses is at most

    ``P[Binomial(r, q) >= v] + 2 m delta max_{i=1..v} P[v - i <= Binomial(r, q) < v] / i``,
    ``q = e^epsilon / (1 + e^epsilon)``.

:func:`one_run_epsilon_lower_bound` inverts this by bisection: the largest epsilon whose p-value
is below ``1 - confidence`` is a lower bound on the training's epsilon with that confidence.
``k_plus`` and ``k_minus`` must be fixed before the scores are seen (choosing them afterwards
would be a multiple comparison); :func:`audit_one_run` fixes them as arguments.

:func:`audit_one_run` trains a small Lipschitz MLP on a tabular dataset with the library's own
front door (:class:`clipless.PrivacyEngine`, :func:`clipless.training.fit`, Poisson sampling,
calibrated noise), with input-space canaries: inputs of maximal norm (the ``InputNorm`` radius)
in random directions with random labels, and scores each canary by minus its loss under the
trained model. The bound it gives is far below the claim for realistic budgets: one run with a
few hundred input canaries sees only a fraction of the worst-case leakage (the paper reports the
same for input-space canaries). It catches only gross violations of a full training pipeline:
noise that is essentially not drawn (1000 times too small in the test suite's setting). It does
**not** detect noise 10 times too small, nor a sample rate that is not applied (every batch the
whole dataset: true epsilon about 5 against a claim of 1, lower bound 0, measured by an audit
of this module); :func:`clipless.audit.audit_step` is the sensitive test of the mechanism, and
:func:`clipless.audit.audit_gradient_canaries` the same one-run bound with white-box gradient
canaries (their section 6), informative at realistic epsilon.

The canaries and their inclusion bits, the model's initialisation and the mechanism's noise come
from independent streams derived from ``seed`` (the theorem needs the inclusion bits independent
of the mechanism's randomness), and the caller's global torch RNG is left as it was.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import stats as _stats

from clipless import _validate

__all__ = ["OneRunAudit", "audit_one_run", "one_run_epsilon_lower_bound", "one_run_p_value"]


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on ``P[>= v correct guesses]`` for ``(epsilon, delta)``-DP (module docstring)."""
    for name, value in (("m", m), ("r", r), ("v", v)):
        _validate.integer(name, value)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m; got v={v}, r={r}, m={m}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be a finite number >= 0; got {epsilon!r}")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1]; got {delta!r}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(_stats.binom.sf(v - 1, r, q))  # P[Bin(r, q) >= v]
    worst = 0.0
    if delta > 0 and v > 0:
        pmf = _stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[Bin = v-1], ..., P[Bin = 0]
        ratios = np.cumsum(pmf) / np.arange(1, v + 1)
        worst = float(ratios.max())
    return min(1.0, tail + 2.0 * m * delta * worst)


def one_run_epsilon_lower_bound(
    m: int, r: int, v: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest epsilon whose p-value is below ``1 - confidence`` (0 if none)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1); got {confidence!r}")
    beta = 1.0 - confidence
    if one_run_p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e3:
            return lo
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if one_run_p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class OneRunAudit:
    """Result of :func:`audit_one_run`: the claim, the guesses and the lower bound."""

    claimed_epsilon: float
    delta: float
    canaries: int
    guesses: int
    correct: int
    epsilon_lower_bound: float
    confidence: float
    test_accuracy: float

    def lines(self) -> list[str]:
        """Human-readable report: the claim and the one-run lower bound."""
        return [
            f"claimed epsilon: {self.claimed_epsilon:.4f} (delta {self.delta:g})",
            f"one-run lower bound: {self.epsilon_lower_bound:.4f} ({100 * self.confidence:g}% "
            f"confidence; {self.correct}/{self.guesses} correct guesses on {self.canaries} "
            f"canaries)",
        ]


def audit_one_run(
    x: Any,
    y: Any,
    *,
    canaries: int = 200,
    guesses: int = 100,
    epsilon: float = 1.0,
    delta: float = 1e-5,
    epochs: int = 10,
    batch_size: int = 64,
    hidden: tuple[int, ...] = (16, 16),
    lr: float = 0.05,
    radius: float | None = None,
    confidence: float = 0.95,
    seed: int = 0,
    x_test: Any = None,
    y_test: Any = None,
) -> OneRunAudit:
    """One private training run with ``canaries`` canaries; ``guesses`` = ``k_plus + k_minus``.

    ``x`` (float, ``[n, d]``) and ``y`` (int labels) are the training data; half the guesses are
    "included" (highest scores), half "excluded" (lowest). ``radius`` is the ``InputNorm`` radius
    (default: the largest norm in ``x``, a value the auditor may use: the audit data is public).
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import clipless
    from clipless import models, nn
    from clipless.audit._seeds import independent_seeds
    from clipless.training import fit

    xa, ya = np.asarray(x), np.asarray(y)
    _check_one_run_arguments(xa, ya, canaries, guesses, confidence, delta, radius, seed)
    xt = torch.as_tensor(xa, dtype=torch.float32)
    yt = torch.as_tensor(ya.astype(np.int64), dtype=torch.long)
    classes = max(int(yt.max()) + 1, 2)
    canary_seed, model_seed, noise_seed = independent_seeds(seed, 3)
    r0 = float(radius) if radius is not None else float(xt.norm(dim=1).max())
    if not r0 > 0:
        raise ValueError("radius: every row of x is zero; pass radius > 0")
    cx, cy, included = _canaries(canaries, int(xt.shape[1]), classes, r0, canary_seed)
    train_x = torch.cat([xt, cx[included]])
    train_y = torch.cat([yt, cy[included]])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_seed)
        model: torch.nn.Module = models.mlp((xt.shape[1],), hidden, classes, r0, False)
    loss = nn.CrossEntropyLoss()
    with warnings.catch_warnings():  # the audit's own seeded engine: an experiment, no release
        warnings.filterwarnings("ignore", message=r"PrivacyEngine\(seed=")
        engine = clipless.PrivacyEngine(seed=noise_seed)
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        data_loader=DataLoader(TensorDataset(train_x, train_y), batch_size=batch_size),
        loss=loss,
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        mechanism=clipless.MechanismSpec(constraint="orthogonal"),
    )
    with torch.random.fork_rng(devices=[]):  # the loader's base seed draws from the global RNG
        result = fit(
            model, optimizer, loader, loss, engine=engine, epochs=epochs, delta=delta,
            progress=False,
        )  # fmt: skip
    model.eval()
    with torch.no_grad():
        scores = -torch.nn.functional.cross_entropy(model(cx), cy, reduction="none")
        accuracy = float("nan")
        if x_test is not None and y_test is not None:
            xs = torch.as_tensor(np.asarray(x_test), dtype=torch.float32)
            ys = torch.as_tensor(np.asarray(y_test), dtype=torch.long)
            accuracy = float((model(xs).argmax(dim=1) == ys).float().mean())
    order = torch.argsort(scores, descending=True)
    k = guesses // 2
    guessed_in, guessed_out = order[:k], order[-k:]
    correct = int(included[guessed_in].sum()) + int((~included[guessed_out]).sum())
    lower = one_run_epsilon_lower_bound(canaries, guesses, correct, delta, confidence)
    return OneRunAudit(
        claimed_epsilon=float(result.epsilon),
        delta=float(delta),
        canaries=canaries,
        guesses=guesses,
        correct=correct,
        epsilon_lower_bound=lower,
        confidence=float(confidence),
        test_accuracy=accuracy,
    )


def _check_one_run_arguments(
    xa: NDArray[Any],
    ya: NDArray[Any],
    canaries: int,
    guesses: int,
    confidence: float,
    delta: float,
    radius: float | None,
    seed: int,
) -> None:
    """:func:`audit_one_run`'s arguments, checked before the run (not after it)."""
    if xa.ndim != 2 or ya.shape != (xa.shape[0],) or xa.shape[0] < 1:
        raise ValueError(
            f"x must be [n, d] with n >= 1 and y [n]; got {tuple(xa.shape)}, {tuple(ya.shape)}"
        )
    if not np.issubdtype(xa.dtype, np.number) or not np.all(np.isfinite(xa)):
        raise ValueError("x must hold finite numbers")
    if not (np.issubdtype(ya.dtype, np.number) and np.all(ya == np.round(ya)) and ya.min() >= 0):
        raise ValueError("y must hold integer class labels >= 0")
    for name, value in (("canaries", canaries), ("guesses", guesses)):
        _validate.positive_int(name, value, minimum=2, wrong_type=ValueError)
    if guesses > canaries or guesses % 2:
        raise ValueError(f"guesses must be even and at most canaries; got {guesses}")
    _validate.probability("confidence", confidence, open_low=True, open_high=True)
    _validate.probability("delta", delta, open_low=True, open_high=True, wrong_type=ValueError)
    if radius is not None and not (
        _validate.is_real(radius) and math.isfinite(radius) and radius > 0
    ):
        raise ValueError(f"radius must be a finite number > 0 or None; got {radius!r}")
    _validate.nonnegative_int("seed", seed, wrong_type=ValueError)


def _canaries(count: int, dim: int, classes: int, radius: float, seed: int) -> tuple[Any, Any, Any]:
    """``(x, y, included)``: ``count`` canaries on the sphere of ``radius`` with random labels,
    each included in the training data with probability 1/2 (one generator, in this order)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(count, dim, generator=gen)
    cx = radius * direction / direction.norm(dim=1, keepdim=True)
    cy = torch.randint(0, classes, (count,), generator=gen)
    included = torch.rand(count, generator=gen) < 0.5
    return cx, cy, included
