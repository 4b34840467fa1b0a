"""Parameter-free activations with certified constants (thesis Table 5.1; Béthune et al. 2024, 3.1).

For an elementwise ``phi`` with ``|phi'| <= c`` everywhere, the Jacobian is ``diag(phi'(x))`` and
its spectral norm is ``max_i |phi'(x_i)| <= c``; the map is therefore ``c``-Lipschitz in L2.
"""

from __future__ import annotations

import math

import torch

from clipless import _certified, _validate
from clipless.nn import _checks
from clipless.nn._base import LipschitzModule
from clipless.nn._functional import group_sort
from clipless.nn.export import PlainAbs, PlainGroupSort

__all__ = [
    "ELU",
    "Abs",
    "Flatten",
    "GroupSort",
    "Hardtanh",
    "LeakyReLU",
    "ReLU",
    "Sigmoid",
    "Tanh",
    "Unflatten",
]


class NonExpansive(LipschitzModule):
    """A layer that is 1-Lipschitz and maps ``0`` to ``0``, so that ``||f(x)|| <= ||x||``: its
    :meth:`lipschitz` is 1 and its :meth:`output_bound` the input bound (each subclass's
    docstring gives the reason; also pooling's and the loss-gradient clip's)."""

    def lipschitz(self) -> float:
        return 1.0

    def output_bound(self, input_bound: float) -> float:
        return _checks.as_bound("input_bound", input_bound)


class GroupSort(NonExpansive):
    """Sorts (ascending) contiguous groups of ``group_size`` entries of dimension 1.

    ``group_size=2`` is MaxMin (``(min(a, b), max(a, b))`` for each consecutive pair of
    features / channels); ``group_size`` equal to the number of channels is FullSort. The size of
    dimension 1 must be divisible by ``group_size``.

    Lipschitz constant 1 and gradient norm preserving (Anil, Lucas & Grosse 2019; the Clipless
    DP-SGD paper, section 3.1 and Remark 2, uses it for GNP networks): on each region where the
    ordering is fixed, GroupSort is a permutation matrix (orthogonal Jacobian); the map is
    continuous and piecewise linear, hence 1-Lipschitz. It permutes entries, so
    ``||GroupSort(x)|| = ||x||`` and the output bound is ``X``.
    """

    def __init__(self, group_size: int = 2) -> None:
        super().__init__()
        self.group_size = _checks.positive_int("group_size", group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group_sort(x, self.group_size)

    def vanilla_export(self) -> torch.nn.Module:
        return PlainGroupSort(self.group_size)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}"


class ReLU(NonExpansive):
    """``max(x, 0)``: Lipschitz 1 (``0 <= relu' <= 1``; thesis Table 5.1); ``|relu(x)| <= |x|``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.ReLU()


class Tanh(NonExpansive):
    """``tanh(x)``: Lipschitz 1 (``0 < tanh' <= 1``; thesis Table 5.1); ``|tanh(x)| <= |x|``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.Tanh()


class LeakyReLU(LipschitzModule):
    """``x`` for ``x >= 0``, ``negative_slope * x`` otherwise: Lipschitz ``max(1, |slope|)``.

    The derivative is ``1`` or ``negative_slope``, so the Jacobian ``diag(phi'(x))`` has norm at
    most ``max(1, |slope|)`` (attained: 1 at a positive entry, ``|slope|`` at a negative one);
    ``|phi(x_i)| <= max(1, |slope|) |x_i|`` gives the output bound. 1-Lipschitz for
    ``|negative_slope| <= 1`` (torch's default 0.01).
    """

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        self.negative_slope = _checks.finite_float("negative_slope", negative_slope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.leaky_relu(x, self.negative_slope)

    def lipschitz(self) -> float:
        return max(1.0, abs(self.negative_slope))

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.LeakyReLU(self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"


class Hardtanh(NonExpansive):
    """``clamp(x, min_val, max_val)`` with ``min_val <= 0 <= max_val``: Lipschitz 1.

    A projection onto an interval is 1-Lipschitz (derivative 0 or 1); because the interval
    contains 0, ``|clamp(x_i)| <= |x_i|`` and the output bound is ``X``. ``ReLU6`` is
    ``Hardtanh(0, 6)``.
    """

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0) -> None:
        super().__init__()
        lo = _checks.finite_float("min_val", min_val)
        hi = _checks.finite_float("max_val", max_val)
        if not lo <= 0.0 <= hi:
            raise ValueError(
                f"Hardtanh needs min_val <= 0 <= max_val (so that 0 maps to 0), got "
                f"min_val={lo}, max_val={hi}"
            )
        self.min_val = lo
        self.max_val = hi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.hardtanh(x, self.min_val, self.max_val)

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.Hardtanh(self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"


class ELU(LipschitzModule):
    """``x`` for ``x > 0``, ``alpha (exp(x) - 1)`` otherwise (``alpha >= 0``): Lipschitz
    ``max(1, alpha)``.

    The derivative is 1 for ``x > 0`` and ``alpha exp(x) < alpha`` below (its supremum ``alpha``
    is approached as ``x -> 0-``); ``|alpha (exp(x) - 1)| <= alpha |x|`` gives the output bound
    ``max(1, alpha) X``. 1-Lipschitz for ``alpha <= 1`` (torch's default 1).
    """

    def __init__(self, alpha: float = 1.0) -> None:
        super().__init__()
        self.alpha = _checks.nonnegative_float("alpha", alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.elu(x, self.alpha)

    def lipschitz(self) -> float:
        return max(1.0, self.alpha)

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.ELU(self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


class Abs(NonExpansive):
    """``|x|``: Lipschitz 1 (``| |a| - |b| | <= |a - b|``; docs/design.md "Layers and losses").

    Norm preserving, ``||abs(x)|| = ||x||`` (a GNP activation, Béthune et al. 2024, Remark 2).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.abs(x)

    def vanilla_export(self) -> torch.nn.Module:
        return PlainAbs()


class Sigmoid(LipschitzModule):
    """``1 / (1 + exp(-x))``: Lipschitz 1/4.

    ``sigma' = sigma (1 - sigma) <= 1/4`` (maximum at 0). Thesis Table 5.1 lists 1, which is valid
    but four times looser; we certify the exact constant 1/4.

    ``sigma(0) = 1/2 != 0``, so the output bound is not ``Lip X``: writing
    ``sigma(x) = 1/2 + (sigma(x) - 1/2)`` with ``|sigma(x_i) - 1/2| <= |x_i| / 4`` gives
    ``||sigma(x)|| <= sqrt(n)/2 + X/4``, and ``0 < sigma < 1`` gives ``||sigma(x)|| <= sqrt(n)``,
    with ``n`` the number of entries per sample. ``n`` is recorded by each forward in
    :attr:`sample_numel` (or passed to the constructor as ``num_features``); :meth:`output_bound`
    raises until it is known.
    """

    sample_numel: int | None

    def __init__(self, num_features: int | None = None) -> None:
        super().__init__()
        self.sample_numel = None
        if num_features is not None:
            self.sample_numel = _checks.positive_int("num_features", num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim >= 1:
            self.sample_numel = math.prod(int(d) for d in x.shape[1:])
        return torch.sigmoid(x)

    def lipschitz(self) -> float:
        return 0.25

    def output_bound(self, input_bound: float) -> float:
        """``min(sqrt(n)/2 + X/4, sqrt(n))``."""
        x_bound = _checks.as_bound("input_bound", input_bound)
        if self.sample_numel is None:
            raise RuntimeError(
                "Sigmoid.output_bound needs the number of entries per sample (sigmoid(0) = 1/2 "
                "contributes sqrt(n)/2): run one forward pass or pass num_features= to Sigmoid"
            )
        root_n = _certified.sqrt(self.sample_numel)
        offset = _certified.add(_certified.mul(0.5, root_n), _certified.mul(0.25, x_bound))
        return min(offset, root_n)

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.Sigmoid()


class Flatten(NonExpansive):
    """Flattens dimensions ``start_dim..end_dim`` (as :class:`torch.nn.Flatten`): an isometry.

    ``start_dim`` must be >= 1 (dimension 0 is the batch). With ``features=N`` every forward
    checks that each sample flattens to exactly ``N`` entries: the certified form of
    ``x.view(-1, N)``, which is a flatten only when ``N`` is the sample's size (otherwise it
    moves entries between samples; this layer refuses such an input instead).
    """

    def __init__(
        self, start_dim: int = 1, end_dim: int = -1, *, features: int | None = None
    ) -> None:
        super().__init__()
        if not _validate.is_int(start_dim) or start_dim < 1:
            raise ValueError(f"start_dim must be an int >= 1 (0 is the batch), got {start_dim!r}")
        if not _validate.is_int(end_dim):
            raise ValueError(f"end_dim must be an int, got {end_dim!r}")
        if end_dim == 0:
            raise ValueError("end_dim must not be 0 (the batch dimension)")
        self.start_dim = int(start_dim)
        self.end_dim = int(end_dim)
        self.features = None if features is None else _checks.positive_int("features", features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.flatten(x, self.start_dim, self.end_dim)
        if self.features is not None and (out.ndim != 2 or out.shape[1] != self.features):
            raise ValueError(
                f"Flatten(features={self.features}) received samples of shape "
                f"{tuple(x.shape[1:])}: x.view(-1, {self.features}) on them would move entries "
                "between samples, which no per-sample bound covers"
            )
        return out

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.Flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        text = f"start_dim={self.start_dim}, end_dim={self.end_dim}"
        return text if self.features is None else f"{text}, features={self.features}"


class Unflatten(NonExpansive):
    """Splits dimension ``dim`` into ``sizes`` (as :class:`torch.nn.Unflatten`): an isometry.

    ``dim`` must be >= 1 (dimension 0 is the batch); ``sizes`` may contain one ``-1``.
    """

    def __init__(self, dim: int, sizes: tuple[int, ...]) -> None:
        super().__init__()
        if not _validate.is_int(dim) or dim < 1:
            raise ValueError(f"dim must be an int >= 1 (0 is the batch), got {dim!r}")
        if not sizes or not all(_validate.is_int(d) for d in sizes):
            raise ValueError(f"sizes must be a non-empty tuple of ints, got {sizes!r}")
        self.dim = int(dim)
        self.sizes = tuple(int(d) for d in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(self.dim, self.sizes)

    def vanilla_export(self) -> torch.nn.Module:
        return torch.nn.Unflatten(self.dim, self.sizes)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, sizes={self.sizes}"
