"""Loss constants against an adversarial search for the largest per-sample gradient norm.

All constants are tight (module docstring of clipless.nn.losses): the search must come within 3%
of each one, and must never exceed it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from clipless.nn import (
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    HKRLoss,
    HuberLoss,
    KRLoss,
    L1Loss,
    LipschitzLoss,
    MulticlassHingeLoss,
)

RESTARTS = 64
SCALES = (0.1, 1.0, 5.0, 30.0)
# Smooth losses are climbed by gradient ascent on the gradient norm; the piecewise-linear ones
# have a piecewise-constant gradient (nothing to climb), so random restarts at several scales are
# the search there.
SMOOTH = (CrossEntropyLoss, BCEWithLogitsLoss)
ASCENT_STEPS = 15


def _grad_norms(loss: LipschitzLoss, z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample ||d l_i / d z_i|| (summing the per-sample losses keeps the samples separate)."""
    per_sample = loss.per_sample(z, target)
    (g,) = torch.autograd.grad(per_sample.sum(), z, create_graph=True)
    return torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1)


def adversarial_max(
    loss: LipschitzLoss, logits_shape: tuple[int, ...], target: torch.Tensor, seed: int
) -> torch.Tensor:
    """Largest gradient norm found for each row of ``target`` (shape ``[len(target)]``)."""
    gen = torch.Generator().manual_seed(seed)
    steps = ASCENT_STEPS if isinstance(loss, SMOOTH) else 1
    best = torch.zeros(target.shape[0], dtype=torch.float64)
    for scale in SCALES:
        z = scale * torch.randn(target.shape[0], *logits_shape, generator=gen, dtype=torch.float64)
        z.requires_grad_(True)
        opt = torch.optim.Adam([z], lr=0.3 * scale)
        for step in range(steps):
            norms = _grad_norms(loss, z, target)
            best = torch.maximum(best, norms.detach())
            if step + 1 < steps:
                opt.zero_grad()
                (-norms.sum()).backward()
                opt.step()
    return best


def _check(loss: LipschitzLoss, num_logits: int, found: torch.Tensor) -> None:
    """No violation anywhere, and within 3% of the (tight) constant."""
    constant = loss.lipschitz(num_logits)
    assert float(found.max()) <= constant * (1 + 1e-9), (float(found.max()), constant)
    assert float(found.max()) >= 0.97 * constant, (float(found.max()), constant)


MULTICLASS = [
    CrossEntropyLoss(),
    CrossEntropyLoss(temperature=0.25),
    CrossEntropyLoss(temperature=3.0),
    MulticlassHingeLoss(margin=1.0),
    MulticlassHingeLoss(margin=0.1),
    KRLoss(),
    HKRLoss(alpha=0.5, margin=1.0),
    HKRLoss(alpha=4.0, margin=0.2),
]


@pytest.mark.parametrize("loss", MULTICLASS, ids=repr)
@pytest.mark.parametrize("num_classes", [2, 3, 5])
def test_multiclass_constants_every_label(loss: LipschitzLoss, num_classes: int) -> None:
    labels = torch.arange(num_classes).repeat_interleave(RESTARTS)
    found = adversarial_max(loss, (num_classes,), labels, seed=num_classes)
    for label in range(num_classes):
        _check(loss, num_classes, found[labels == label])


BINARY = [
    (MulticlassHingeLoss(margin=1.0), (0, 1)),
    (MulticlassHingeLoss(margin=0.3), (-1, 1)),
    (KRLoss(), (0, 1)),
    (KRLoss(), (-1, 1)),
    (HKRLoss(alpha=2.0, margin=0.5), (0, 1)),
    (HKRLoss(alpha=0.3, margin=1.0), (-1, 1)),
    (BCEWithLogitsLoss(), (0, 1)),
]


@pytest.mark.parametrize(("loss", "labels"), BINARY, ids=repr)
@pytest.mark.parametrize("shape", [(), (1,)])
def test_binary_constants_every_label(
    loss: LipschitzLoss, labels: tuple[int, int], shape: tuple[int, ...]
) -> None:
    target = torch.tensor(labels, dtype=torch.float64).repeat_interleave(RESTARTS)
    found = adversarial_max(loss, shape, target.reshape(-1, *shape), seed=len(shape))
    for label in labels:
        _check(loss, 1, found[target == label])


@pytest.mark.parametrize(
    "loss", [BCEWithLogitsLoss(), L1Loss(), HuberLoss(0.3), HuberLoss(2.0)], ids=repr
)
@pytest.mark.parametrize("num_logits", [1, 3, 5])
def test_elementwise_constants(loss: LipschitzLoss, num_logits: int) -> None:
    gen = torch.Generator().manual_seed(num_logits)
    targets = torch.cat(
        [
            torch.zeros(RESTARTS, num_logits, dtype=torch.float64),
            torch.ones(RESTARTS, num_logits, dtype=torch.float64),
            torch.rand(RESTARTS, num_logits, generator=gen, dtype=torch.float64),
            torch.randint(0, 2, (RESTARTS, num_logits), generator=gen).double(),
        ]
    )
    found = adversarial_max(loss, (num_logits,), targets, seed=num_logits)
    _check(loss, num_logits, found)


def test_constants_values() -> None:
    assert CrossEntropyLoss(temperature=0.5).lipschitz(10) == pytest.approx(2 * math.sqrt(2))
    assert BCEWithLogitsLoss().lipschitz(4) == 2.0
    assert MulticlassHingeLoss().lipschitz(1) == 1.0
    assert MulticlassHingeLoss().lipschitz(7) == pytest.approx(math.sqrt(2))
    assert KRLoss().lipschitz(1) == 1.0
    assert KRLoss().lipschitz(5) == pytest.approx(math.sqrt(5 / 4))
    assert HKRLoss(alpha=2.0).lipschitz(1) == 3.0
    assert HKRLoss(alpha=2.0).lipschitz(2) == pytest.approx(3 * math.sqrt(2))
    k, a = 10, 1.0
    exact = math.sqrt(k / (k - 1) * (1 + 2 * a) + 2 * a * a)
    assert HKRLoss(alpha=a).lipschitz(k) == pytest.approx(exact)
    assert exact < math.sqrt(k / (k - 1)) + a * math.sqrt(2)  # tighter than the triangle bound
    assert L1Loss().lipschitz(9) == 3.0
    assert HuberLoss(0.5).lipschitz(4) == 1.0


def test_values_match_references() -> None:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(6, 4, generator=gen, dtype=torch.float64) * 3
    y = torch.tensor([0, 3, 1, 2, 2, 0])
    torch.testing.assert_close(
        CrossEntropyLoss(temperature=2.0, reduction="none")(z, y),
        F.cross_entropy(z / 2.0, y, reduction="none"),
    )
    hinge = MulticlassHingeLoss(margin=0.5, reduction="none")(z, y)
    kr = KRLoss(reduction="none")(z, y)
    for i in range(6):
        others = [float(z[i, j]) for j in range(4) if j != int(y[i])]
        zy = float(z[i, y[i]])
        assert float(hinge[i]) == pytest.approx(max(0.0, 0.5 - zy + max(others)))
        assert float(kr[i]) == pytest.approx(-zy + sum(others) / 3)
    hkr = HKRLoss(alpha=3.0, margin=0.5, reduction="none")(z, y)
    torch.testing.assert_close(hkr, kr + 3.0 * hinge)
    # binary
    zb = torch.randn(6, generator=gen, dtype=torch.float64)
    yb = torch.tensor([0, 1, 1, 0, 1, 0])
    signed = 2.0 * yb - 1.0
    torch.testing.assert_close(
        MulticlassHingeLoss(reduction="none")(zb, yb), torch.relu(1 - signed * zb)
    )
    torch.testing.assert_close(KRLoss(reduction="none")(zb, signed), -signed * zb)
    targets = torch.rand(6, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        BCEWithLogitsLoss(reduction="none")(z, targets),
        F.binary_cross_entropy_with_logits(z, targets, reduction="none").sum(1),
    )
    torch.testing.assert_close(L1Loss(reduction="sum")(z, targets), (z - targets).abs().sum())
    torch.testing.assert_close(
        HuberLoss(0.7, reduction="mean")(z, targets),
        F.huber_loss(z, targets, delta=0.7, reduction="none").sum(1).mean(),
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions(reduction: str) -> None:
    z = torch.randn(5, 3)
    y = torch.tensor([0, 1, 2, 1, 0])
    per_sample = CrossEntropyLoss(reduction="none")(z, y)
    assert per_sample.shape == (5,)
    out = CrossEntropyLoss(reduction=reduction)(z, y)
    expected = {"mean": per_sample.mean(), "sum": per_sample.sum(), "none": per_sample}
    torch.testing.assert_close(out, expected[reduction])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="reduction"):
        CrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="temperature"):
        CrossEntropyLoss(temperature=0.0)
    with pytest.raises(ValueError, match="margin"):
        MulticlassHingeLoss(margin=-1.0)
    with pytest.raises(ValueError, match="alpha"):
        HKRLoss(alpha=-0.5)
    with pytest.raises(ValueError, match="margin"):
        HKRLoss(margin=math.nan)
    with pytest.raises(ValueError, match="delta"):
        HuberLoss(delta=0.0)
    with pytest.raises(ValueError, match="num_logits"):
        L1Loss().lipschitz(0)
    with pytest.raises(TypeError, match="num_logits"):
        KRLoss().lipschitz(2.0)  # type: ignore[arg-type]


def test_bad_targets() -> None:
    z = torch.randn(3, 4)
    with pytest.raises(ValueError, match="class indices"):
        MulticlassHingeLoss()(z, torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="class indices"):
        KRLoss()(z, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\{0, 1\}"):
        KRLoss()(torch.randn(3), torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match=r"\{0, 1\}"):
        MulticlassHingeLoss()(torch.randn(3), torch.tensor([0, -1, 1]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        BCEWithLogitsLoss()(z, torch.full((3, 4), 1.5))
    with pytest.raises(ValueError, match="shape"):
        L1Loss()(z, torch.zeros(3, 3))


# (loss, logits shape, target) for an empty batch of every kind each loss accepts
EMPTY_CASES = [
    (CrossEntropyLoss(), (0, 4), torch.zeros(0, dtype=torch.long)),
    (CrossEntropyLoss(temperature=2.0), (0, 4), torch.zeros(0, 4)),
    (BCEWithLogitsLoss(), (0, 3), torch.zeros(0, 3)),
    (BCEWithLogitsLoss(), (0,), torch.zeros(0)),
    (BCEWithLogitsLoss(), (0, 1), torch.zeros(0, 1)),
    (MulticlassHingeLoss(), (0, 4), torch.zeros(0, dtype=torch.long)),
    (MulticlassHingeLoss(), (0,), torch.zeros(0)),
    (MulticlassHingeLoss(), (0, 1), torch.zeros(0, 1)),
    (KRLoss(), (0, 4), torch.zeros(0, dtype=torch.long)),
    (KRLoss(), (0,), torch.zeros(0)),
    (HKRLoss(), (0, 4), torch.zeros(0, dtype=torch.long)),
    (HKRLoss(), (0, 1), torch.zeros(0, 1)),
    (L1Loss(), (0, 3), torch.zeros(0, 3)),
    (L1Loss(), (0,), torch.zeros(0)),
    (L1Loss(), (0, 1), torch.zeros(0, 1)),
    (L1Loss(), (0, 2, 5), torch.zeros(0, 2, 5)),
    (HuberLoss(0.5), (0, 3), torch.zeros(0, 3)),
    (HuberLoss(), (0,), torch.zeros(0)),
    (HuberLoss(), (0, 1), torch.zeros(0, 1)),
]


@pytest.mark.parametrize(("loss", "shape", "target"), EMPTY_CASES, ids=repr)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(
    loss: LipschitzLoss, shape: tuple[int, ...], target: torch.Tensor, reduction: str
) -> None:
    loss = copy.copy(loss)
    loss.reduction = reduction
    z = torch.zeros(shape, requires_grad=True)
    out = loss(z, target)
    if reduction == "none":
        assert out.shape == (0,)
    else:
        assert out.shape == ()
        assert float(out.detach()) == 0.0  # the mean of an empty batch is 0, not nan
    out.sum().backward()
    assert z.grad is not None
    assert z.grad.shape == z.shape


def test_mean_unchanged_on_nonempty_batch() -> None:
    z = torch.randn(5, 3)
    targets = torch.rand(5, 3)
    for loss_cls in (BCEWithLogitsLoss, L1Loss, HuberLoss):
        per_sample = loss_cls(reduction="none")(z, targets)
        assert torch.equal(loss_cls(reduction="mean")(z, targets), per_sample.mean())


def test_probability_targets_accepted() -> None:
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    probs = torch.softmax(torch.randn(6, 5, generator=gen, dtype=torch.float64), dim=1)
    torch.testing.assert_close(
        CrossEntropyLoss(reduction="none")(z, probs),
        F.cross_entropy(z, probs, reduction="none"),
    )
    one_hot = F.one_hot(torch.tensor([0, 4, 2, 1, 3, 3]), 5).double()
    torch.testing.assert_close(
        CrossEntropyLoss(reduction="none")(z, one_hot),
        CrossEntropyLoss(reduction="none")(z, torch.tensor([0, 4, 2, 1, 3, 3])),
    )
    # rows off by rounding only, in low precision dtypes, are accepted (and renormalised)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        low = probs.to(dtype)
        out = CrossEntropyLoss(reduction="none")(z.to(dtype), low)
        assert out.shape == (6,)
        assert bool(out.isfinite().all())
    # a row summing to 1 + 1e-6 in float32 passes (tolerance 1e-5)
    CrossEntropyLoss()(z.float(), torch.tensor([[0.5, 0.500001, 0, 0, 0]] * 6))


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ((100.0, 0.0), "sum"),
        ((math.nan, 0.0), "NaN"),
        ((math.inf, 0.0), "NaN or infinity"),
        ((-0.5, 1.5), "negative"),
        ((0.5, 0.4), "sum"),
        ((0.5, 0.5001), "sum"),
    ],
)
def test_probability_targets_rejected(row: tuple[float, float], match: str) -> None:
    z = torch.randn(2, 2)
    target = torch.tensor([[0.5, 0.5], list(row)])
    with pytest.raises(ValueError, match="target") as info:
        CrossEntropyLoss()(z, target)
    assert match in str(info.value)
    assert "each row summing to 1" in str(info.value)  # says what is accepted


@pytest.mark.parametrize("bad", [-1, 3, 100])
def test_class_index_targets_out_of_range(bad: int) -> None:
    z = torch.randn(2, 3)
    for loss in (CrossEntropyLoss(), MulticlassHingeLoss(), KRLoss(), HKRLoss()):
        with pytest.raises(ValueError, match=r"target class indices must lie in \[0, 3\)"):
            loss(z, torch.tensor([0, bad]))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_elementwise_targets_must_be_finite(value: float) -> None:
    z = torch.randn(2, 2)
    target = torch.tensor([[0.0, 1.0], [value, 0.0]])
    for loss in (BCEWithLogitsLoss(), L1Loss(), HuberLoss()):
        with pytest.raises(ValueError, match="target") as info:
            loss(z, target)
        assert "finite" in str(info.value)


def test_bce_targets_out_of_range() -> None:
    z = torch.randn(2, 2)
    for row in ((100.0, 0.0), (-0.1, 0.0)):
        with pytest.raises(ValueError, match=r"target must hold probabilities in \[0, 1\]"):
            BCEWithLogitsLoss()(z, torch.tensor([[0.0, 1.0], list(row)]))
    # L1 and Huber accept any finite regression target
    L1Loss()(z, torch.tensor([[100.0, 0.0], [-3.0, 2.0]]))
    HuberLoss()(z, torch.tensor([[100.0, 0.0], [-3.0, 2.0]]))


def test_losses_run_under_vmap() -> None:
    """Exact per-sample gradients (torch.func.vmap(grad)) run through the target checks."""
    from torch.func import grad, vmap

    z = torch.randn(4, 3)
    cases = [
        (CrossEntropyLoss(), torch.tensor([0, 2, 1, 1])),
        (CrossEntropyLoss(), torch.softmax(torch.randn(4, 3), dim=1)),
        (BCEWithLogitsLoss(), torch.rand(4, 3)),
        (L1Loss(), torch.randn(4, 3)),
        (HuberLoss(), torch.randn(4, 3)),
        (MulticlassHingeLoss(), torch.tensor([0, 2, 1, 1])),
        (HKRLoss(), torch.tensor([0, 2, 1, 1])),
    ]
    for loss, target in cases:

        def one(zi: torch.Tensor, yi: torch.Tensor, loss: LipschitzLoss = loss) -> torch.Tensor:
            return loss(zi.unsqueeze(0), yi.unsqueeze(0))

        per_sample = vmap(grad(one))(z, target)
        z_ = z.clone().requires_grad_(True)
        loss.per_sample(z_, target).sum().backward()
        torch.testing.assert_close(per_sample, z_.grad)
    zb = torch.randn(4)
    yb = torch.tensor([1.0, -1.0, -1.0, 1.0])
    vmap(grad(lambda zi, yi: KRLoss()(zi.unsqueeze(0), yi.unsqueeze(0))))(zb, yb)
