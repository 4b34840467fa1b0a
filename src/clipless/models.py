"""Ready-made Lipschitz models: :func:`linear`, :func:`mlp`, :func:`convnet`, :func:`resnet` and
:func:`gnp_convnet` (what ``clipless train --model`` builds, through :func:`build`).

Every layer comes from :mod:`clipless.nn`, so every layer has a certified Lipschitz bound and the
model passes :func:`clipless.nn.validate`. Every model starts with
:class:`clipless.nn.InputNorm`, which makes ``input_norm`` a certified bound on the inputs' norm
whatever the data. The plain-torch
twin of a model (same function, ordinary ``torch.nn`` layers, for inference or for a non-private
baseline) is :func:`clipless.nn.vanilla_export` ``(model)``.

>>> import torch
>>> model = convnet((1, 8, 8), channels=(4, 8), num_classes=10, input_norm=2.0)
>>> model(torch.zeros(3, 1, 8, 8)).shape
torch.Size([3, 10])
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from clipless import nn
from clipless.nn import _checks

__all__ = [
    "DOWNSAMPLES",
    "MODEL_KINDS",
    "POOLS",
    "Architecture",
    "build",
    "convnet",
    "gnp_convnet",
    "linear",
    "mlp",
    "resnet",
]

MODEL_KINDS = ("linear", "mlp", "cnn", "resnet", "gnp")
POOLS = ("l2", "avg")
DOWNSAMPLES = ("l2", "avg", "conv")


def _widths(name: str, widths: Sequence[int]) -> tuple[int, ...]:
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Iterable):
        raise ValueError(f"{name} must be a sequence of even widths >= 2; got {widths!r}")
    widths = list(widths)
    if any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in widths):
        raise ValueError(f"{name} must be even int widths >= 2 (GroupSort pairs); got {widths!r}")
    out = tuple(int(w) for w in widths)
    if not out or any(w < 2 or w % 2 for w in out):
        raise ValueError(f"{name} must be even widths >= 2 (GroupSort pairs); got {widths!r}")
    return out


def mlp(
    input_shape: Sequence[int],
    hidden: Sequence[int],
    num_classes: int,
    input_norm: float = 1.0,
    bias: bool = False,
    input_mode: str = "ball",
) -> nn.Sequential:
    """``InputNorm(input_norm) [-> Flatten] -> (Linear -> GroupSort(2)) x len(hidden) -> Linear``.

    ``Flatten`` is inserted when a sample has more than one dimension (images).

    Args:
        input_shape: one sample's shape.
        hidden: the hidden layers' widths, each even (GroupSort pairs).
        num_classes: one logit per class.
        input_norm: the radius ``> 0`` of the leading :class:`clipless.nn.InputNorm`, the
            certified bound on every input's L2 norm.
        bias: biases on the linear layers (``False`` by default: each bias is one more noised
            tensor).
        input_mode: ``"ball"`` clips each sample to ``input_norm``, ``"sphere"`` normalises it
            to that norm.

    Raises:
        ValueError: a shape, width or setting out of range, named.
    """
    input_shape = _shape(input_shape)
    hidden = _widths("hidden", hidden)
    layers: list[torch.nn.Module] = [nn.InputNorm(_radius(input_norm), input_mode)]  # all dims
    if len(input_shape) > 1:
        layers.append(nn.Flatten())
    width = math.prod(int(s) for s in input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h, bias=bias), nn.GroupSort(2)]
        width = h
    layers.append(nn.Linear(width, _classes(num_classes), bias=bias))
    return nn.Sequential(*layers)


def linear(
    input_shape: Sequence[int],
    num_classes: int,
    input_norm: float = 1.0,
    bias: bool = True,
    input_mode: str = "ball",
) -> nn.Sequential:
    """``InputNorm(input_norm) [-> Flatten] -> Linear``: a linear model (logistic regression).

    With one layer and per-sample gradient scaling no weight constraint is needed for privacy:
    the layer's sensitivity is the loss constant (or the :class:`clipless.nn.LossGradientClip`
    norm) whatever its weights. On Adult at epsilon 0.414 it matches the MLP
    (``benchmarks/RESULTS.md``, Adult lever table).

    Args:
        input_shape: one sample's shape.
        num_classes: one logit per class.
        input_norm: the radius ``> 0`` of the leading :class:`clipless.nn.InputNorm`, the
            certified bound on every input's L2 norm.
        bias: a bias (``True`` by default: the bias and the weight share one sensitivity, their
            joint per-sample gradient is scaled together).
        input_mode: ``"ball"`` clips each sample to ``input_norm``, ``"sphere"`` normalises it
            to that norm.

    Raises:
        ValueError: a shape, width or setting out of range, named.
    """
    input_shape = _shape(input_shape)
    layers: list[torch.nn.Module] = [nn.InputNorm(_radius(input_norm), input_mode)]
    if len(input_shape) > 1:
        layers.append(nn.Flatten())
    width = math.prod(int(s) for s in input_shape)
    layers.append(nn.Linear(width, _classes(num_classes), bias=bias))
    return nn.Sequential(*layers)


def convnet(
    input_shape: Sequence[int] = (1, 28, 28),
    channels: Sequence[int] = (16, 32),
    num_classes: int = 10,
    input_norm: float = 1.0,
    pool: str = "l2",
    bias: bool = False,
    input_mode: str = "ball",
) -> nn.Sequential:
    """A small Lipschitz ConvNet for ``C x H x W`` images (default: Fashion-MNIST, 1 x 28 x 28).

    ``InputNorm(input_norm) -> (Conv2d 3x3 same-padding, no bias -> GroupSort(2) -> pool 2x2) x
    len(channels) -> Flatten -> Linear``. With the defaults this is the CNN of
    ``benchmarks/fashion_mnist.py``.

    Args:
        input_shape: one image's ``(channels, height, width)``; each side at least
            ``2 ** len(channels)`` pixels (every pooling halves it, floor).
        channels: every stage's output channels, each even (GroupSort pairs).
        num_classes: one logit per class.
        input_norm: the radius ``> 0`` of the leading :class:`clipless.nn.InputNorm`, the
            certified bound on every input's L2 norm.
        pool: ``"l2"`` (:class:`clipless.nn.L2NormPool2d`, Lipschitz 1, the replacement for max
            pooling) or ``"avg"`` (:class:`clipless.nn.AvgPool2d`, Lipschitz 1/2).
        bias: a bias on the final ``Linear`` (the convolutions are bias-free).
        input_mode: ``"ball"`` clips each sample to ``input_norm``, ``"sphere"`` normalises it
            to that norm.

    Raises:
        ValueError: a shape, width or setting out of range, named.
    """
    c, h, w = _image_shape("convnet", input_shape)
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}; got {pool!r}")
    channels = _widths("channels", channels)
    if min(h, w) < 2 ** len(channels):
        raise ValueError(
            f"a {h}x{w} image is too small for {len(channels)} 2x2 poolings; use at most "
            f"{max(0, int(math.log2(max(1, min(h, w)))))} convolution stages"
        )
    layers: list[torch.nn.Module] = [nn.InputNorm(_radius(input_norm), input_mode)]
    for out_channels in channels:
        layers += [
            nn.Conv2d(c, out_channels, 3, padding=1, bias=False),
            nn.GroupSort(2),
            nn.L2NormPool2d(2) if pool == "l2" else nn.AvgPool2d(2),
        ]
        c, h, w = out_channels, h // 2, w // 2
    layers += [nn.Flatten(), nn.Linear(c * h * w, _classes(num_classes), bias=bias)]
    return nn.Sequential(*layers)


def _classes(num_classes: object) -> int:
    """``num_classes`` (the number of logits) as an int >= 1, or an error naming it."""
    return _checks.positive_int("num_classes", num_classes)


def _radius(input_norm: object) -> float:
    """``input_norm`` (the InputNorm radius) as a finite float > 0, or an error naming it."""
    return _checks.positive_float("input_norm", input_norm)


def _shape(input_shape: object) -> tuple[int, ...]:
    """``input_shape`` (one sample's shape) as a tuple of ints >= 1, or a ValueError naming it."""
    if isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, Iterable):
        raise ValueError(f"input_shape must be a sequence of ints >= 1; got {input_shape!r}")
    shape = tuple(input_shape)
    if not shape or any(
        isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in shape
    ):
        raise ValueError(f"input_shape must be one or more ints >= 1; got {shape!r}")
    return tuple(int(d) for d in shape)


def _image_shape(model: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    input_shape = _shape(input_shape)
    if len(input_shape) != 3:
        raise ValueError(
            f"{model} needs images of shape (channels, height, width); got input shape "
            f"{tuple(input_shape)}"
        )
    c, h, w = (int(s) for s in input_shape)
    return c, h, w


def resnet(
    input_shape: Sequence[int] = (1, 28, 28),
    width: int | Sequence[int] = 16,
    depth: int = 1,
    num_classes: int = 10,
    *,
    stages: int = 2,
    input_norm: float = 1.0,
    groups: int | None = None,
    alpha: float = 1.0,
    downsample: str = "l2",
    residual: str = "average",
    bias: bool = False,
) -> nn.Sequential:
    """A Lipschitz wide residual network (WRN-style) for ``C x H x W`` images.

    Layout (pre-normalisation residual blocks, He et al. 2016 / Zagoruyko & Komodakis 2016, with
    every piece replaced by its certified Lipschitz counterpart)::

        InputNorm(input_norm)
        Conv2d(C, w_1, 3, padding=1) -> GroupSort(2)                        # stem
        stage 1: depth x Residual(GroupNorm -> Conv 3x3 -> GroupSort(2) -> Conv 3x3, residual)
        stage s > 1: downsample(w_{s-1} -> w_s), then depth x Residual(...) at width w_s
        Flatten -> Linear(w_last * h * w, num_classes)

    Each of the ``stages - 1`` transitions halves the image (floor) and changes the width, with
    ``downsample``:

    * ``"l2"`` (default): :class:`clipless.nn.L2NormPool2d` (2x2, Lipschitz 1) then a bias-free
      1x1 :class:`clipless.nn.Conv2d` when the width changes;
    * ``"avg"``: :class:`clipless.nn.AvgPool2d` (2x2, Lipschitz 1/2) then the 1x1 convolution;
    * ``"conv"``: a bias-free 2x2 convolution with stride 2 followed by ``GroupSort(2)``.

    **Certified constants.** The block's normalisation is the thesis's
    :class:`clipless.nn.GroupNorm` ``(x - mean) / max(alpha, std)`` per group (Lipschitz
    ``1/alpha``; ``groups`` groups, default ``gcd(width, 4)``). A block is
    :class:`clipless.nn.Residual`: ``mode="average"`` (default) computes ``(x + g(x)) / 2``, whose
    certified constant is ``(1 + Lip(g)) / 2`` with ``Lip(g) <= Lip(conv_1) Lip(conv_2) / alpha``,
    so with ``alpha = 1`` and convolutions constrained to ``<= 1`` every block is 1-Lipschitz;
    ``"add"`` computes ``x + g(x)`` (constant ``1 + Lip(g)``: up to ``2^blocks`` for the whole
    network, with as much more noise). :mod:`clipless.bounds` propagates input and cotangent
    bounds through the blocks (``Residual`` rules in ``clipless.bounds._Walker``), so every
    convolution inside a branch gets its own certified per-sample gradient bound.

    **Not GNP.** GroupNorm's centring and the average of the two paths are contractions, so
    the network is 1-Lipschitz but not gradient-norm preserving even with orthogonal weights
    (:func:`gnp_convnet` is). **No weight standardisation**: standardising a kernel
    ``W -> (W - mean) / std`` per output channel makes the layer invariant to the scale of ``W``,
    so the weight projections (``clip`` / ``fix`` / ``orthogonal`` rescale ``W``) could no longer
    bound its Lipschitz constant (a standardised ``c_in k k`` row has norm ``sqrt(c_in k k)``
    whatever ``W``), and the per-sample gradient with respect to the raw ``W`` is the standardised
    one times up to ``1 / min std``, unbounded as a row's spread shrinks. A certified version
    needs its own layer, bound and projection; it is left out.

    Args:
        input_shape: one image's ``(channels, height, width)``; each side at least
            ``2 ** (stages - 1)`` pixels.
        width: the first stage's channel count, doubled at every later stage (WRN's ``16k, 32k,
            64k``), or an explicit sequence of per-stage widths (then ``stages`` is ignored);
            every width even.
        depth: residual blocks per stage, ``>= 0``.
        num_classes: one logit per class.
        stages: the number of stages, ``>= 1``.
        input_norm: the radius ``> 0`` of the leading :class:`clipless.nn.InputNorm`, the
            certified bound on every input's L2 norm.
        groups: GroupNorm's groups, dividing every width (``None``: ``gcd(width, 4)``).
        alpha: GroupNorm's floor on the standard deviation (Lipschitz ``1 / alpha``).
        downsample: ``"l2"``, ``"avg"`` or ``"conv"`` (above).
        residual: ``"average"`` (1-Lipschitz blocks) or ``"add"``.
        bias: a bias on the final ``Linear``.

    Raises:
        ValueError: a shape, width or setting out of range, named.
    """
    c, h, w = _image_shape("resnet", input_shape)
    stages_i = _checks_positive("stages", stages)
    depth = _checks_positive("depth", depth, low=0)
    if isinstance(width, int) and not isinstance(width, bool):
        widths = _widths("width", [int(width) * 2**s for s in range(stages_i)])
    else:
        widths = _widths("width", width)  # type: ignore[arg-type]
    if downsample not in DOWNSAMPLES:
        raise ValueError(f"downsample must be one of {DOWNSAMPLES}; got {downsample!r}")
    if residual not in ("add", "average"):
        raise ValueError(f"residual must be 'add' or 'average'; got {residual!r}")
    _check_stages(widths, (h, w), groups)

    def block(ch: int) -> nn.Residual:
        g = math.gcd(ch, 4) if groups is None else int(groups)
        branch = nn.Sequential(
            nn.GroupNorm(g, ch, alpha=alpha),
            nn.Conv2d(ch, ch, 3, padding=1, bias=False),
            nn.GroupSort(2),
            nn.Conv2d(ch, ch, 3, padding=1, bias=False),
        )
        return nn.Residual(branch, mode=residual)

    layers: list[torch.nn.Module] = [
        nn.InputNorm(_radius(input_norm)),
        nn.Conv2d(c, widths[0], 3, padding=1, bias=False),
        nn.GroupSort(2),
    ]
    ch = widths[0]
    for stage, out in enumerate(widths):
        if stage > 0:
            if downsample == "conv":
                layers += [nn.Conv2d(ch, out, 2, stride=2, bias=False), nn.GroupSort(2)]
            else:
                layers.append(nn.L2NormPool2d(2) if downsample == "l2" else nn.AvgPool2d(2))
                if out != ch:
                    layers.append(nn.Conv2d(ch, out, 1, bias=False))
            ch, h, w = out, h // 2, w // 2
        layers += [block(ch) for _ in range(depth)]
    layers += [nn.Flatten(), nn.Linear(ch * h * w, _classes(num_classes), bias=bias)]
    return nn.Sequential(*layers)


def _check_stages(widths: tuple[int, ...], size: tuple[int, int], groups: int | None) -> None:
    """:func:`resnet`'s stages fit the image (one 2x2 downsampling each after the first) and
    ``groups`` divides every width."""
    h, w = size
    if min(h, w) < 2 ** (len(widths) - 1):
        raise ValueError(
            f"a {h}x{w} image is too small for {len(widths) - 1} 2x2 downsamplings; use at most "
            f"{1 + max(0, int(math.log2(max(1, min(h, w)))))} stages"
        )
    for v in widths:
        g = math.gcd(v, 4) if groups is None else int(groups)
        if g < 1 or v % g:
            raise ValueError(f"groups must divide every stage width {widths}; got groups={groups}")


def gnp_convnet(
    input_shape: Sequence[int] = (1, 28, 28),
    channels: Sequence[int] = (4, 16),
    num_classes: int = 10,
    input_norm: float = 1.0,
    bias: bool = False,
) -> nn.Sequential:
    """A gradient-norm-preserving (GNP) ConvNet: ``InputNorm -> (Conv2d 2x2 stride 2 ->
    GroupSort(2)) x len(channels) -> Flatten -> Linear``.

    Every convolution has kernel = stride (``k_eff = 1``: each input pixel is read by exactly one
    output position), so it applies the reshaped kernel ``K_mat`` (``c_out x 4 c_in``) to disjoint
    2x2 patches and its operator norm *is* ``||K_mat||_2`` (exact; the FFT certificate of
    :func:`clipless.norms.conv_norm` attains it up to its rounding margin). Trained with
    ``constraint="orthogonal"`` (:func:`clipless.constraints.project`: Björck steps on
    ``K_mat``, then a certified rescale to ``<= C``), ``K_mat`` converges to a matrix with
    orthonormal rows when ``c_out <= 4 c_in``, so the convolution's Jacobian ``J`` has
    ``J J^T = I`` (also on odd sizes: the dropped last row or column only adds zero columns to
    ``J``): ``||J^T g|| = ||g||`` for every cotangent ``g``, the GNP property of Anil, Lucas &
    Grosse 2019 ("Sorting out Lipschitz function approximation", ICML) and of the Clipless DP-SGD
    paper (section 3.1, "Gradient Norm Preserving networks"). GroupSort is a permutation of each
    sample's entries (GNP) and the final :class:`clipless.nn.Linear` has orthonormal rows after
    Björck when ``num_classes <=`` its input size. Exactly GNP, therefore, up to (a) the Björck
    iterations' convergence (a few per step, applied to the stored weights) and (b) the
    certified rescale, which places the top singular value a relative ``~1e-7`` below ``C``.
    With ``channels[i] > 4 channels[i-1]`` ``K_mat`` has orthonormal columns instead: an
    isometry, 1-Lipschitz but not GNP. GNP makes the cotangent bounds ``G_k`` tight (for the
    worst sample), not the per-sample *weight*-gradient bound of a convolution, a sum over
    output positions (measured in ``benchmarks/RESULTS.md`` section 11).

    Default ``(4, 16)`` on 28x28x1 images: ``1 -> 4 -> 16`` channels are square ``K_mat``
    (orthogonal transforms of the image, ``14x14x4``, ``7x7x16 = 784`` features). By contrast the
    3x3 convolutions of :func:`convnet` and :func:`resnet` are only approximately orthogonal
    after Björck on ``K_mat`` (their operator norm lies between ``||K_mat||_2`` and
    ``3 ||K_mat||_2``), hence 1-Lipschitz but not GNP.

    Args:
        input_shape: one image's ``(channels, height, width)``; each side at least
            ``2 ** len(channels)`` pixels.
        channels: every stride-2 convolution's output channels, each even.
        num_classes: one logit per class.
        input_norm: the radius ``> 0`` of the leading :class:`clipless.nn.InputNorm`, the
            certified bound on every input's L2 norm.
        bias: a bias on the final ``Linear``.

    Raises:
        ValueError: a shape, width or setting out of range, named.
    """
    c, h, w = _image_shape("gnp_convnet", input_shape)
    channels = _widths("channels", channels)
    if min(h, w) < 2 ** len(channels):
        raise ValueError(
            f"a {h}x{w} image is too small for {len(channels)} stride-2 convolutions; use at "
            f"most {max(0, int(math.log2(max(1, min(h, w)))))} stages"
        )
    layers: list[torch.nn.Module] = [nn.InputNorm(_radius(input_norm))]
    for out in channels:
        layers += [nn.Conv2d(c, out, 2, stride=2, bias=False), nn.GroupSort(2)]
        c, h, w = out, h // 2, w // 2
    layers += [nn.Flatten(), nn.Linear(c * h * w, _classes(num_classes), bias=bias)]
    return nn.Sequential(*layers)


def _checks_positive(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
    return value


def _with_input_mode(
    model: nn.Sequential,
    input_mode: str,
    center: torch.Tensor | None = None,
    center_noise: float | None = None,
    whiten: torch.Tensor | None = None,
    whiten_noise: float | None = None,
) -> nn.Sequential:
    first = model[0]
    assert isinstance(first, nn.InputNorm)
    released = (center, center_noise, whiten, whiten_noise)
    if input_mode != first.mode or any(v is not None for v in released):
        model[0] = nn.InputNorm(first.max_norm, input_mode, *released)
    return model


@dataclass(frozen=True)
class Architecture:
    """What :func:`build` builds: the model's kind, shapes and first-layer input map.

    Args:
        kind: one of :data:`MODEL_KINDS`: ``linear`` (``hidden`` must be empty), ``mlp``,
            ``cnn`` (:func:`convnet`, ``hidden`` = channels per convolution stage), ``resnet``
            (:func:`resnet`, ``hidden`` = width per stage, one residual block per stage, ``pool``
            its downsampling) or ``gnp`` (:func:`gnp_convnet`, ``hidden`` = channels per stride-2
            convolution).
        input_shape: one sample's shape (the model's input).
        hidden: the widths described under ``kind``.
        num_classes: one logit per class.
        input_norm: the certified input norm bound of the leading
            :class:`clipless.nn.InputNorm`.
        bias: biases on the linear layers.
        pool: ``cnn`` pooling / ``resnet`` downsampling, one of :data:`POOLS`.
        input_mode: ``"ball"`` clips each sample to ``input_norm``, ``"sphere"`` normalises it
            to that norm.
        center_noise: the noise multiplier of a released input mean the first layer subtracts
            (:func:`clipless.features.release_mean`; the tensor is given to :func:`build`).
        whiten_noise: the noise multiplier of the released channel mixing it applies next
            (:func:`clipless.features.whitening`).

    The values are checked by :func:`build` (each builder names the argument it refuses).
    """

    kind: str
    input_shape: Sequence[int]
    hidden: Sequence[int]
    num_classes: int
    input_norm: float = 1.0
    bias: bool = False
    pool: str = "l2"
    input_mode: str = "ball"
    center_noise: float | None = None
    whiten_noise: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the ``architecture`` of a saved model; lists for the shapes)."""
        return {
            "kind": self.kind,
            "input_shape": [int(s) for s in self.input_shape],
            "hidden": [int(h) for h in self.hidden],
            "num_classes": self.num_classes,
            "input_norm": float(self.input_norm),
            "bias": bool(self.bias),
            "pool": self.pool,
            "input_mode": self.input_mode,
            "center_noise": self.center_noise,
            "whiten_noise": self.whiten_noise,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Architecture:
        """Read :meth:`to_dict`'s form; a missing ``kind`` is an MLP (the first saved format)."""
        return cls(
            kind=str(data.get("kind", "mlp")),
            input_shape=tuple(data["input_shape"]),
            hidden=tuple(data["hidden"]),
            num_classes=data["num_classes"],
            input_norm=data["input_norm"],
            bias=data["bias"],
            pool=str(data.get("pool", "l2")),
            input_mode=str(data.get("input_mode", "ball")),
            center_noise=data.get("center_noise") or None,
            whiten_noise=data.get("whiten_noise") or None,
        )


_OLD_BUILD_ARGS = (
    "input_shape", "hidden", "num_classes", "input_norm", "bias", "pool", "input_mode",
    "center", "center_noise", "whiten", "whiten_noise",
)  # fmt: skip


@overload
def build(
    architecture: Architecture,
    *,
    center: torch.Tensor | None = None,
    whiten: torch.Tensor | None = None,
) -> nn.Sequential: ...


@overload
def build(architecture: str, *args: Any, **kwargs: Any) -> nn.Sequential: ...


def build(architecture: Architecture | str, *args: Any, **kwargs: Any) -> nn.Sequential:
    """The model an :class:`Architecture` describes.

    Args:
        architecture: what to build.
        center: the released input mean the first layer subtracts (with
            ``architecture.center_noise``; a zero placeholder of the input's shape when a state
            dict will fill it in).
        whiten: the released ``C x C`` channel mixing it applies next (with
            ``architecture.whiten_noise``).

    Returns:
        An :class:`clipless.nn.Sequential` starting with :class:`clipless.nn.InputNorm`.

    Raises:
        ValueError / TypeError: a value the builders refuse, naming it.

    The older form ``build(kind, input_shape, hidden, num_classes, input_norm=1.0, bias=False,
    pool="l2", input_mode="ball", center=None, center_noise=None, whiten=None,
    whiten_noise=None)`` still works and warns (:class:`DeprecationWarning`).
    """
    if not isinstance(architecture, Architecture):
        architecture, kwargs = _old_build_form(architecture, args, kwargs)
    elif args or set(kwargs) - {"center", "whiten"}:
        raise TypeError("build(Architecture) takes only the keywords center= and whiten=")
    return _build(architecture, kwargs.get("center"), kwargs.get("whiten"))


def _old_build_form(
    kind: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Architecture, dict[str, Any]]:
    """``build(kind, input_shape, ...)`` as an :class:`Architecture` (with a warning)."""
    warnings.warn(
        "models.build(kind, input_shape, hidden, num_classes, ...) is deprecated: pass "
        "models.Architecture(kind, input_shape, hidden, num_classes, ...) (and the released "
        "tensors as center= and whiten=)",
        DeprecationWarning,
        stacklevel=3,
    )
    if len(args) > len(_OLD_BUILD_ARGS):
        raise TypeError(f"build() takes at most {len(_OLD_BUILD_ARGS) + 1} positional arguments")
    named = dict(zip(_OLD_BUILD_ARGS, args, strict=False))
    clash = set(named) & set(kwargs)
    unknown = set(kwargs) - set(_OLD_BUILD_ARGS)
    if clash or unknown:
        raise TypeError(f"build() got unexpected or repeated arguments {sorted(clash | unknown)}")
    named.update(kwargs)
    missing = [k for k in _OLD_BUILD_ARGS[:3] if k not in named]
    if missing:
        raise TypeError(f"build() is missing {', '.join(missing)}")
    tensors = {"center": named.pop("center", None), "whiten": named.pop("whiten", None)}
    return Architecture(str(kind), **named), tensors


def _build(
    arch: Architecture, center: torch.Tensor | None, whiten: torch.Tensor | None
) -> nn.Sequential:
    kind, shape, hidden, classes = arch.kind, arch.input_shape, arch.hidden, arch.num_classes
    norm, bias, pool = arch.input_norm, arch.bias, arch.pool
    model: nn.Sequential
    if isinstance(hidden, (str, bytes)) or not isinstance(hidden, Iterable):
        raise ValueError(f"hidden must be a sequence of widths (may be empty); got {hidden!r}")
    if kind == "linear":
        if tuple(hidden):
            raise ValueError(f"a linear model has no hidden layers; got hidden={tuple(hidden)!r}")
        model = linear(shape, classes, norm, bias)
    elif kind == "mlp":
        model = mlp(shape, hidden, classes, norm, bias)
    elif kind == "cnn":
        model = convnet(shape, hidden, classes, norm, pool, bias)
    elif kind == "resnet":
        model = resnet(shape, hidden, 1, classes, input_norm=norm, downsample=pool, bias=bias)
    elif kind == "gnp":
        model = gnp_convnet(shape, hidden, classes, norm, bias)
    else:
        raise ValueError(f"model must be one of {MODEL_KINDS}; got {kind!r}")
    released = (center, arch.center_noise, whiten, arch.whiten_noise)
    return _with_input_mode(model, arch.input_mode, *released)
