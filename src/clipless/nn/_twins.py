"""The torch -> clipless registry: one entry per torch module type, with its converter and advice.

:func:`clipless.nn.validate` reports an uncertified module with the ``advice`` of the first entry
it is an instance of; :func:`clipless.nn.convert` converts a leaf module with the ``convert`` of
the entry matching its exact type (or, for ``subclasses=True``, any subclass: the batch-statistics
norms and dropout, whose subclasses share the base's forward). A subclass of an exact-type entry
that defines its own ``forward`` is traced instead, since its function is no longer the base's.

A converter receives the torch module and an :class:`Outcome` through which it records what it
did: a *twin* (same function, weights copied), a *substitute* (a different, certified function),
a *removal* (identity in eval mode) or *unconvertible* (with the reason).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from clipless.nn import _checks
from clipless.nn.activations import (
    ELU,
    Flatten,
    Hardtanh,
    LeakyReLU,
    ReLU,
    Sigmoid,
    Tanh,
    Unflatten,
)
from clipless.nn.conv import PADDING_MODES, Conv2d
from clipless.nn.linear import Linear
from clipless.nn.norm import GroupNorm
from clipless.nn.pooling import AvgPool2d, L2NormPool2d, MaxPool2d

_MAX_GROUPS = 32  # BatchNorm2d/3d -> GroupNorm with the largest divisor of C up to this


class Outcome(Protocol):
    """What a converter records for the module it was given (see the module docstring)."""

    def twin(self, new: torch.nn.Module, reason: str = "certified twin") -> torch.nn.Module: ...

    def substitute(self, new: torch.nn.Module, reason: str) -> torch.nn.Module: ...

    def removed(self, reason: str) -> None: ...

    def unconvertible(self, reason: str) -> torch.nn.Module: ...

    def sequential(self, items: list[tuple[str, torch.nn.Module | None]]) -> torch.nn.Module: ...


Converter = Callable[[Any, Outcome], torch.nn.Module | None]


@dataclass(frozen=True)
class Twin:
    """One registry entry: the torch types it covers, ``validate``'s advice, ``convert``'s rule."""

    types: tuple[type[torch.nn.Module], ...]
    advice: str
    convert: Converter | None = None
    subclasses: bool = False  # convert subclasses of ``types`` too (else the exact types only)


class _ViewFlatten(torch.nn.Flatten):
    """``x.view(-1, features)`` (internal: converted to ``Flatten(features=features)``)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features


def _copy_parameters(source: torch.nn.Module, target: torch.nn.Module, names: list[str]) -> None:
    with torch.no_grad():
        for name in names:
            src = getattr(source, name)
            dst = getattr(target, name)
            if src is None:
                continue
            dst.copy_(src)
            dst.requires_grad_(src.requires_grad)


def _largest_divisor(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _pool_problem(
    kernel_size: Any, stride: Any, padding: Any, ceil_mode: bool, dilation: Any
) -> str:
    kernel = _checks.int_pair("kernel_size", kernel_size, 1)
    strides = kernel if stride is None or stride == [] else _checks.int_pair("stride", stride, 1)
    problems = []
    if strides != kernel:
        problems.append(f"stride {strides} != kernel_size {kernel} (overlapping or gapped windows)")
    if _checks.int_pair("padding", padding, 0) != (0, 0):
        problems.append(f"padding={padding}")
    if _checks.int_pair("dilation", dilation, 1) != (1, 1):
        problems.append(f"dilation={dilation}")
    if ceil_mode:
        problems.append("ceil_mode=True")
    return ", ".join(problems)


# ------------------------------------------------------------------------------- converters
def _linear(m: torch.nn.Linear, out: Outcome) -> torch.nn.Module:
    w = m.weight
    new = Linear(
        m.in_features, m.out_features, bias=m.bias is not None, device=w.device, dtype=w.dtype
    )
    _copy_parameters(m, new, ["weight", "bias"])
    return out.twin(new, "certified twin, weights copied")


def _conv_problems(m: torch.nn.Conv1d | torch.nn.Conv2d, kernel: tuple[int, ...]) -> list[str]:
    """What ``clipless.nn.Conv2d`` does not support in ``m`` (padding checked by the caller)."""
    problems = []
    if m.groups != 1:
        problems.append(f"groups={m.groups} (only groups=1 is certified)")
    if tuple(m.dilation) != (1,) * len(kernel):
        problems.append(f"dilation={m.dilation} (only dilation 1 is certified)")
    if m.padding_mode not in PADDING_MODES:
        problems.append(f"padding_mode={m.padding_mode!r} (clipless has {PADDING_MODES})")
    return problems


def _conv_padding(
    m: torch.nn.Conv1d | torch.nn.Conv2d, kernel: tuple[int, ...], problems: list[str]
) -> Any:
    """``m.padding`` as numbers (``"valid"`` and odd-kernel ``"same"`` resolved)."""
    padding: Any = m.padding
    if padding == "valid":
        padding = (0,) * len(kernel)
    elif padding == "same":
        if any(k % 2 == 0 for k in kernel):
            problems.append("padding='same' with an even kernel (asymmetric padding)")
        padding = tuple(k // 2 for k in kernel)
    return padding


def _conv2d(m: torch.nn.Conv2d, out: Outcome) -> torch.nn.Module:
    kernel = _checks.int_pair("kernel_size", m.kernel_size, 1)
    problems = _conv_problems(m, kernel)
    padding = _conv_padding(m, kernel, problems)
    if problems:
        return out.unconvertible("clipless.nn.Conv2d does not support " + ", ".join(problems))
    w = m.weight
    new = Conv2d(
        m.in_channels,
        m.out_channels,
        kernel,
        stride=_checks.int_pair("stride", tuple(m.stride), 1),
        padding=_checks.int_pair("padding", tuple(padding), 0),
        padding_mode=m.padding_mode,
        bias=m.bias is not None,
        device=w.device,
        dtype=w.dtype,
    )
    _copy_parameters(m, new, ["weight", "bias"])
    reason = "certified twin, weights copied"
    if m.bias is not None:
        reason += (
            " (bias kept: its per-sample gradient bound grows as sqrt(output positions); "
            "bias=False is usually better under DP)"
        )
    return out.twin(new, reason)


def _conv1d(m: torch.nn.Conv1d, out: Outcome) -> torch.nn.Module:
    """``Conv1d`` as a ``Conv2d`` with a ``1 x k`` kernel on ``[batch, C, 1, L]``: same
    function, and every certified bound of ``Conv2d`` applies unchanged."""
    (k,) = m.kernel_size
    problems = _conv_problems(m, (k,))
    padding = _conv_padding(m, (k,), problems)
    if problems:
        return out.unconvertible("clipless.nn.Conv2d does not support " + ", ".join(problems))
    w = m.weight
    conv = Conv2d(
        m.in_channels,
        m.out_channels,
        (1, k),
        stride=(1, int(m.stride[0])),
        padding=(0, int(padding[0])),
        padding_mode=m.padding_mode,
        bias=m.bias is not None,
        device=w.device,
        dtype=w.dtype,
    )
    with torch.no_grad():
        conv.weight.copy_(w.unsqueeze(2))
        conv.weight.requires_grad_(w.requires_grad)
        if m.bias is not None and conv.bias is not None:
            conv.bias.copy_(m.bias)
            conv.bias.requires_grad_(m.bias.requires_grad)
    new = out.sequential(
        [("unsqueeze", Unflatten(2, (1, -1))), ("conv", conv), ("squeeze", Flatten(2, 3))]
    )
    return out.twin(
        new,
        f"certified twin, weights copied: a Conv2d with a 1 x {k} kernel on [batch, C, 1, L] "
        "(parameters renamed conv.weight / conv.bias)",
    )


def _relu(m: torch.nn.ReLU, out: Outcome) -> torch.nn.Module:
    return out.twin(ReLU())


def _tanh(m: torch.nn.Tanh, out: Outcome) -> torch.nn.Module:
    return out.twin(Tanh())


def _sigmoid(m: torch.nn.Sigmoid, out: Outcome) -> torch.nn.Module:
    return out.twin(Sigmoid())


def _leaky_relu(m: torch.nn.LeakyReLU, out: Outcome) -> torch.nn.Module:
    leaky = LeakyReLU(m.negative_slope)
    return out.twin(leaky, f"certified twin, Lipschitz {leaky.lipschitz()}")


def _hardtanh(m: torch.nn.Hardtanh, out: Outcome) -> torch.nn.Module:
    lo, hi = float(getattr(m, "min_val")), float(getattr(m, "max_val"))  # noqa: B009
    if not lo <= 0.0 <= hi:
        return out.unconvertible(
            f"Hardtanh({lo}, {hi}) does not map 0 to 0; clipless.nn.Hardtanh needs "
            "min_val <= 0 <= max_val"
        )
    return out.twin(Hardtanh(lo, hi), "certified twin, Lipschitz 1")


def _elu(m: torch.nn.ELU, out: Outcome) -> torch.nn.Module:
    alpha = float(m.alpha)
    if alpha < 0:
        return out.unconvertible(f"ELU(alpha={alpha}): clipless.nn.ELU needs alpha >= 0")
    elu = ELU(alpha)
    return out.twin(elu, f"certified twin, Lipschitz {elu.lipschitz()}")


def _flatten(m: torch.nn.Flatten, out: Outcome) -> torch.nn.Module:
    if m.start_dim < 1:
        return out.unconvertible(
            f"Flatten(start_dim={m.start_dim}) flattens the batch dimension or depends on "
            "the input's rank; clipless.nn.Flatten needs start_dim >= 1"
        )
    if m.end_dim == 0:
        return out.unconvertible("Flatten(end_dim=0) flattens the batch dimension")
    return out.twin(Flatten(m.start_dim, m.end_dim))


def _view_flatten(m: _ViewFlatten, out: Outcome) -> torch.nn.Module:
    return out.twin(
        Flatten(1, -1, features=m.features),
        f"x.view(-1, {m.features}) is a flatten when every sample has {m.features} "
        "entries; the converted Flatten checks that at every forward",
    )


def _max_pool2d(m: torch.nn.MaxPool2d, out: Outcome) -> torch.nn.Module:
    kernel = _checks.int_pair("kernel_size", m.kernel_size, 1)
    if _pool_problem(m.kernel_size, m.stride, m.padding, m.ceil_mode, m.dilation):
        return _overlapping_max_pool2d(m, out)
    return out.substitute(
        L2NormPool2d(kernel),
        "no certified max pooling in clipless; the L2 norm of each same window is "
        "1-Lipschitz (values differ: the window's L2 norm instead of its maximum)",
    )


def _overlapping_max_pool2d(m: torch.nn.MaxPool2d, out: Outcome) -> torch.nn.Module:
    """Overlapping (or padded) windows: the certified twin, Lipschitz ``sqrt(m)``."""
    if _checks.int_pair("dilation", m.dilation, 1) != (1, 1):
        return out.unconvertible(
            f"dilation={m.dilation}; clipless.nn.MaxPool2d has no dilation (use dilation=1)"
        )
    new = MaxPool2d(m.kernel_size, m.stride or None, m.padding, bool(m.ceil_mode))
    return out.twin(
        new,
        f"certified twin: {new.multiplicity()} windows can contain one pixel, so the "
        f"Lipschitz constant is sqrt({new.multiplicity()}) (1 for non-overlapping windows, "
        "which are converted to L2-norm pooling only when stride = kernel and no padding)",
    )


def _avg_pool2d(m: torch.nn.AvgPool2d, out: Outcome) -> torch.nn.Module:
    kernel = _checks.int_pair("kernel_size", m.kernel_size, 1)
    refused = [
        text
        for text, bad in (
            ("ceil_mode=True", m.ceil_mode),
            ("count_include_pad=False", not m.count_include_pad),
            ("divisor_override is set", m.divisor_override is not None),
        )
        if bad
    ]
    if refused:
        return out.unconvertible(
            f"{', '.join(refused)}; clipless.nn.AvgPool2d divides every window by its "
            "full size (count_include_pad=True, floor mode)"
        )
    pool = AvgPool2d(kernel, m.stride or None, m.padding)
    return out.twin(pool, f"certified twin, Lipschitz {pool.lipschitz():.6g}")


_BATCH_STATISTICS = (
    "batch statistics mix the samples of a batch (one sample changes every other sample's "
    "output, so per-sample sensitivity is unbounded)"
)
_NORM_REASON = (
    f"{_BATCH_STATISTICS}; substituted by the per-sample thesis normalisation "
    "(x - mean) / max(alpha, std), Lipschitz 1/alpha, without affine parameters"
)


def _batch_norm(m: torch.nn.modules.batchnorm._BatchNorm, out: Outcome) -> torch.nn.Module:
    channels = int(m.num_features)
    groups = 1 if isinstance(m, torch.nn.BatchNorm1d) else _largest_divisor(channels, _MAX_GROUPS)
    return out.substitute(GroupNorm(groups, channels), _NORM_REASON)


def _layer_norm(m: torch.nn.LayerNorm, out: Outcome) -> torch.nn.Module:
    shape = tuple(m.normalized_shape)
    return out.substitute(
        GroupNorm(1, int(shape[0])),
        _NORM_REASON.replace(
            _BATCH_STATISTICS,
            "LayerNorm's 1/sqrt(var + eps) has Lipschitz constant about 1/sqrt(eps)",
        )
        + f"; assumes normalized_shape {shape} covers every non-batch dimension",
    )


def _group_norm(m: torch.nn.GroupNorm, out: Outcome) -> torch.nn.Module:
    return out.substitute(
        GroupNorm(m.num_groups, m.num_channels),
        "GroupNorm's 1/sqrt(var + eps) has Lipschitz constant about 1/sqrt(eps); "
        "substituted by (x - mean) / max(alpha, std), Lipschitz 1/alpha, without affine "
        "parameters",
    )


def _instance_norm(m: torch.nn.modules.instancenorm._InstanceNorm, out: Outcome) -> torch.nn.Module:
    channels = int(m.num_features)
    return out.substitute(
        GroupNorm(channels, channels),
        "InstanceNorm's 1/sqrt(var + eps) has Lipschitz constant about 1/sqrt(eps); "
        "substituted by (x - mean) / max(alpha, std) per channel, Lipschitz 1/alpha, "
        "without affine parameters",
    )


def _dropout(m: torch.nn.modules.dropout._DropoutNd, out: Outcome) -> None:
    out.removed(
        "dropout has no useful Lipschitz certificate and is the identity in eval mode; "
        "the DP noise already regularises"
    )


def _identity(m: torch.nn.Identity, out: Outcome) -> None:
    out.removed("identity")


# --------------------------------------------------------------------------------- registry
_NORM = "clipless.nn.GroupNorm (the thesis's (x - mean)/max(alpha, std), Lipschitz 1/alpha)"
_IN_THE_LOSS = "remove it and put it in the loss (clipless.nn.CrossEntropyLoss takes logits)"
_ATTENTION = "no certified attention (dot-product attention is not Lipschitz)"

# validate's advice is the first entry the module is an instance of: keep a base class after
# the subclasses that have advice of their own.
TWINS: tuple[Twin, ...] = (
    Twin((torch.nn.Linear,), "use clipless.nn.Linear", _linear),
    Twin(
        (torch.nn.Bilinear,),
        "no clipless replacement; use clipless.nn.Linear on concatenated inputs",
    ),
    Twin((torch.nn.Conv2d,), "use clipless.nn.Conv2d", _conv2d),
    Twin(
        (torch.nn.Conv1d,),
        "clipless.nn.convert certifies it (a clipless.nn.Conv2d with a 1 x k kernel between "
        "clipless.nn.Unflatten(2, (1, -1)) and clipless.nn.Flatten(2, 3))",
        _conv1d,
    ),
    Twin((torch.nn.Sequential,), "use clipless.nn.Sequential"),
    Twin((torch.nn.modules.batchnorm._BatchNorm,), f"use {_NORM}", _batch_norm, subclasses=True),
    Twin((torch.nn.LayerNorm,), f"use {_NORM}", _layer_norm),
    Twin((torch.nn.GroupNorm,), f"use {_NORM}", _group_norm),
    Twin(
        (torch.nn.modules.instancenorm._InstanceNorm,),
        f"use {_NORM}",
        _instance_norm,
        subclasses=True,
    ),
    Twin(
        (torch.nn.MaxPool2d,),
        "use clipless.nn.MaxPool2d (overlapping windows: Lipschitz sqrt(windows per pixel)) or "
        "clipless.nn.L2NormPool2d",
        _max_pool2d,
    ),
    Twin((torch.nn.AdaptiveMaxPool2d,), "use clipless.nn.L2NormPool2d with a fixed kernel_size"),
    Twin((torch.nn.AvgPool2d,), "use clipless.nn.AvgPool2d", _avg_pool2d),
    Twin((torch.nn.AdaptiveAvgPool2d,), "use clipless.nn.AvgPool2d with a fixed kernel_size"),
    Twin((torch.nn.LPPool2d,), "use clipless.nn.L2NormPool2d"),
    Twin(
        (torch.nn.ReLU,),
        "use clipless.nn.ReLU (or clipless.nn.GroupSort, gradient norm preserving)",
        _relu,
    ),
    Twin((torch.nn.Tanh,), "use clipless.nn.Tanh", _tanh),
    Twin((torch.nn.LeakyReLU,), "use clipless.nn.LeakyReLU", _leaky_relu),
    Twin(
        (torch.nn.Hardtanh, torch.nn.ReLU6),
        "use clipless.nn.Hardtanh (ReLU6 is Hardtanh(0, 6))",
        _hardtanh,
    ),
    Twin((torch.nn.ELU,), "use clipless.nn.ELU", _elu),
    Twin((torch.nn.Sigmoid,), "use clipless.nn.Sigmoid", _sigmoid),
    Twin((torch.nn.Flatten,), "use clipless.nn.Flatten", _flatten),
    Twin((_ViewFlatten,), "use clipless.nn.Flatten", _view_flatten),
    Twin((torch.nn.Softmax,), _IN_THE_LOSS),
    Twin((torch.nn.LogSoftmax,), _IN_THE_LOSS),
    Twin(
        (torch.nn.modules.dropout._DropoutNd,),
        "remove it (dropout has no useful Lipschitz certificate; DP noise already regularises)",
        _dropout,
        subclasses=True,
    ),
    Twin((torch.nn.Identity,), "remove it (or use an empty clipless.nn.Sequential())", _identity),
    Twin(
        (torch.nn.Embedding,),
        "no certified embedding: its input is an index, not a vector of bounded norm, so no "
        "input bound X0 reaches it; feed a public one-hot (or bag-of-words) encoding to "
        "clipless.nn.Linear(vocab, dim, bias=False), which computes the same lookup with a "
        "certified bound (docs/opacus-migration.md, 'Layers without a certified twin')",
    ),
    Twin(
        (torch.nn.EmbeddingBag,),
        "no certified embedding: feed a public bag-of-words encoding to clipless.nn.Linear",
    ),
    Twin(
        (torch.nn.modules.rnn.RNNBase,),
        "no certified recurrent layer: a recurrence's Lipschitz bound grows as L^T with the "
        "sequence length T (and an LSTM's gates multiply activations); use a torch.nn.Conv1d "
        "over the sequence (clipless.nn.convert certifies it), or per-sample clipping "
        "(Opacus's DPLSTM) for recurrent models",
    ),
    Twin(
        (torch.nn.modules.rnn.RNNCellBase,),
        "no certified recurrent cell (the recurrence's bound grows as L^T); use "
        "a torch.nn.Conv1d over the sequence (clipless.nn.convert certifies it)",
    ),
    Twin(
        (torch.nn.MultiheadAttention,),
        "no certified attention: dot-product attention multiplies activations and is not "
        "Lipschitz on unbounded inputs (Kim et al. 2021); use a torch.nn.Conv1d or an MLP on "
        "pooled features",
    ),
    Twin(
        (torch.nn.Transformer,),
        "no certified attention (dot-product attention is not Lipschitz); see "
        "docs/opacus-migration.md, 'Layers without a certified twin'",
    ),
    Twin((torch.nn.TransformerEncoderLayer,), _ATTENTION),
    Twin((torch.nn.TransformerDecoderLayer,), _ATTENTION),
    Twin(
        (torch.nn.modules.loss._Loss,),
        "losses do not belong in the model; pass a clipless.nn loss to the engine",
    ),
    Twin(
        (
            torch.nn.LeakyReLU,
            torch.nn.ELU,
            torch.nn.GELU,
            torch.nn.SiLU,
            torch.nn.Softplus,
            torch.nn.PReLU,
            torch.nn.ReLU6,
            torch.nn.Hardtanh,
            torch.nn.Mish,
        ),
        "use clipless.nn.GroupSort, clipless.nn.ReLU or clipless.nn.Tanh",
    ),
)

_NO_TWIN = (
    "no clipless replacement; build it from clipless.nn layers and containers, or subclass "
    "clipless.nn.LipschitzModule and certify it"
)


def advice(module: torch.nn.Module) -> str:
    """What to use instead of ``module`` (``validate``'s message for an uncertified module)."""
    for twin in TWINS:
        if isinstance(module, twin.types):
            return twin.advice
    return _NO_TWIN


def converter(module: torch.nn.Module) -> Converter | None:
    """``convert``'s rule for the leaf ``module`` (``None``: no entry converts it)."""
    for twin in TWINS:
        if twin.convert is None:
            continue
        if isinstance(module, twin.types) if twin.subclasses else type(module) in twin.types:
            return twin.convert
    return None
