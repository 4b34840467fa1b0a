"""The bound report reuses a model's zero-input trace while its structure is unchanged
(:func:`clipless.bounds.report`), and traces again on every change that could alter it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from clipless import bounds
from clipless import nn as cnn

LOSS = cnn.CrossEntropyLoss(reduction="sum")
SHAPE = (2, 8, 8)


def _model() -> cnn.Sequential:
    return cnn.Sequential(
        cnn.InputNorm(1.0),
        cnn.Conv2d(2, 4, 3, padding=1),
        cnn.GroupSort(2),
        cnn.Residual(cnn.Sequential(cnn.Conv2d(4, 4, 3, padding=1), cnn.GroupSort(2))),
        cnn.Flatten(),
        cnn.Linear(4 * 8 * 8, 10),
    )


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the models traced, one entry per zero-input forward."""
    seen: list[int] = []
    original = bounds._trace_forward

    def counted(model: torch.nn.Module, shape: tuple[int, ...], first: torch.nn.Module) -> object:
        seen.append(id(model))
        return original(model, shape, first)

    monkeypatch.setattr(bounds, "_trace_forward", counted)
    return seen


def _reports(model: torch.nn.Module, n: int = 1) -> bounds.BoundReport:
    report = bounds.report(model, LOSS, SHAPE)
    for _ in range(n - 1):
        report = bounds.report(model, LOSS, SHAPE)
    return report


def test_an_unchanged_model_is_traced_once_with_the_same_report(traces: list[int]) -> None:
    model = _model()
    first = _reports(model, 2)
    before = len(traces)
    again = _reports(model, 3)
    assert len(traces) == before == 1
    assert again == first
    with torch.no_grad():  # new weights change the bounds, not the structure
        model[5].weight.mul_(0.5)
    assert _reports(model) != first and len(traces) == before


def _set(index: int, name: str, value: object) -> Callable[[cnn.Sequential], None]:
    return lambda m: setattr(m[index], name, value)


def _add_hook(m: cnn.Sequential) -> None:
    m[2].register_forward_hook(lambda mod, args, out: out)


def _own_forward(m: cnn.Sequential) -> None:
    m[2].forward = lambda x: x  # type: ignore[method-assign]


def _replace_child(m: cnn.Sequential) -> None:
    m[2] = cnn.GroupSort(2)


def _wider_weight(m: cnn.Sequential) -> None:
    m[5].weight = torch.nn.Parameter(torch.zeros(12, 4 * 8 * 8))


CHANGES: dict[str, Callable[[cnn.Sequential], None]] = {
    "group size": _set(2, "group_size", 4),
    "stride": _set(1, "stride", (2, 2)),
    "residual mode": _set(3, "mode", "average"),
    "input bound": _set(0, "max_norm", 2.0),
    "eval mode": lambda m: m.eval(),
    "forward hook": _add_hook,
    "instance forward": _own_forward,
    "replaced child": _replace_child,
    "weight of another shape": _wider_weight,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_structural_change_traces_again(change: str, traces: list[int]) -> None:
    """Each change gives another key (or none), and the next report either traces again or is
    refused before tracing (a hook: ``validate``); it never reuses the old trace."""
    model = _model()
    _reports(model, 2)
    before, key = len(traces), bounds._structure_key(model, SHAPE)
    CHANGES[change](model)
    assert bounds._structure_key(model, SHAPE) != key
    try:
        bounds.report(model, LOSS, SHAPE)
    except (ValueError, RuntimeError, TypeError):
        return  # refused: by validate, by the new trace's checks, or by its forward
    assert len(traces) == before + 1, change


class _Doubling(cnn.LipschitzModule):
    """A custom leaf: its forward is not clipless's, so its trace is never reused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x

    def lipschitz(self) -> float:
        return 0.5

    def output_bound(self, input_bound: float) -> float:
        return 0.5 * input_bound


def test_a_model_with_a_custom_module_is_traced_every_time(traces: list[int]) -> None:
    model = cnn.Sequential(cnn.InputNorm(1.0), cnn.Flatten(), _Doubling(), cnn.Linear(128, 3))
    for _ in range(3):
        bounds.report(model, LOSS, SHAPE)
    assert len(traces) == 3


def test_a_shared_module_added_after_a_report_is_refused(traces: list[int]) -> None:
    """A structural change the cached trace would miss is seen: a Conv2d applied at a second
    size after the model's first reports."""
    model = _model()
    _reports(model, 2)
    model.insert(2, model[1])  # the 2 -> 4 conv again, now on a 4-channel input
    with pytest.raises((ValueError, RuntimeError)):
        bounds.report(model, LOSS, SHAPE)


def test_a_forward_at_another_size_is_never_certified_from_the_cache(traces: list[int]) -> None:
    """A forward at another input size (an evaluation) re-records the Conv2d's size; the next
    report traces again and certifies the model's input size, every time (the key kept is the
    state a trace leaves, not the one it found)."""
    model = _model()
    first = _reports(model, 2)
    for _ in range(3):
        with torch.no_grad():
            model[1](torch.zeros(1, 2, 4, 4))  # the first conv alone, at 4 x 4
        assert model[1].input_size == (4, 4)
        before = len(traces)
        assert bounds.report(model, LOSS, SHAPE) == first
        assert len(traces) == before + 1 and model[1].input_size == (8, 8)


def _backward_hook(m: cnn.Sequential) -> None:
    m[2].register_full_backward_hook(lambda mod, gin, gout: None)


def _with_frozen_parameter(model: cnn.Sequential) -> torch.nn.Parameter:
    """A parameter on a parameter-free layer: allowed frozen, refused trained (validate)."""
    extra = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    model[2].register_parameter("extra", extra)
    return extra


@pytest.mark.parametrize("change", ["backward hook", "parameter trained"])
def test_a_cached_structure_is_validated_again_after_a_change(change: str) -> None:
    """A report of a known structure skips ``validate`` and the structural checks: the key
    covers what they read, so each change that would make them refuse is a new key (dropping
    backward hooks or ``requires_grad`` from it lets these reports through)."""
    model = _model()
    extra = _with_frozen_parameter(model)
    _reports(model, 2)
    if change == "backward hook":
        _backward_hook(model)
    else:
        extra.requires_grad_(True)
    with pytest.raises(TypeError, match=r"hook|trainable parameters"):
        bounds.report(model, LOSS, SHAPE)


def test_a_replaced_parameter_is_reported_under_its_name(traces: list[int]) -> None:
    """The same shape, a new tensor: reported (and keyed) as the layer's parameter."""
    model = _model()
    _reports(model, 2)
    model[5].weight = torch.nn.Parameter(torch.zeros(10, 4 * 8 * 8))
    report = bounds.report(model, LOSS, SHAPE)
    assert "5.weight" in report.layers[-1].gradient_bounds
    assert len(traces) == 2


def test_a_structure_refused_once_is_refused_every_time() -> None:
    """A trace is kept for reuse only after the structural checks passed on it: a model whose
    last Flatten folds the batch (its start_dim set to 0 after construction; the forward runs)
    is refused at every report, not only the first."""
    model = _model()
    model.append(cnn.Flatten())
    model[6].start_dim = 0  # the logits of the batch in one row
    for _ in range(2):
        with pytest.raises(ValueError, match="row"):
            bounds.report(model, LOSS, SHAPE)
