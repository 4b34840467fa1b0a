"""Lipschitz layers and losses with certified constants, mirroring :mod:`torch.nn`.

Every layer is a :class:`LipschitzModule` that certifies, from its current weights, an upper bound
on its input-Lipschitz constant (``lipschitz()``) and on one sample's output norm
(``output_bound(X)``); parametric layers (:class:`ParametricLipschitzModule`) also bound one
sample's parameter gradient (``gradient_bounds(X, G)``). :mod:`clipless.bounds` chains them
("backpropagation for bounds", Béthune et al. 2024, Algorithm 1). Constants follow thesis
Table 5.1 and docs/design.md "Layers and losses"; each class's docstring gives its derivation.
"""

from clipless.nn._base import LipschitzModule, ParametricLipschitzModule
from clipless.nn.activations import (
    ELU,
    Abs,
    Flatten,
    GroupSort,
    Hardtanh,
    LeakyReLU,
    ReLU,
    Sigmoid,
    Tanh,
    Unflatten,
)
from clipless.nn.clip import LossGradientClip
from clipless.nn.containers import Residual, Sequential
from clipless.nn.conv import Conv2d
from clipless.nn.convert import ConversionEntry, ConversionReport, convert
from clipless.nn.export import vanilla_export
from clipless.nn.input import InputNorm
from clipless.nn.linear import Linear
from clipless.nn.losses import (
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    HKRLoss,
    HuberLoss,
    KRLoss,
    L1Loss,
    LipschitzLoss,
    MulticlassHingeLoss,
)
from clipless.nn.norm import GroupNorm
from clipless.nn.pooling import AvgPool2d, L2NormPool2d, MaxPool2d
from clipless.nn.validate import validate

__all__ = [
    "ELU",
    "Abs",
    "AvgPool2d",
    "BCEWithLogitsLoss",
    "Conv2d",
    "ConversionEntry",
    "ConversionReport",
    "CrossEntropyLoss",
    "Flatten",
    "GroupNorm",
    "GroupSort",
    "HKRLoss",
    "Hardtanh",
    "HuberLoss",
    "InputNorm",
    "KRLoss",
    "L1Loss",
    "L2NormPool2d",
    "LeakyReLU",
    "Linear",
    "LipschitzLoss",
    "LipschitzModule",
    "LossGradientClip",
    "MaxPool2d",
    "MulticlassHingeLoss",
    "ParametricLipschitzModule",
    "ReLU",
    "Residual",
    "Sequential",
    "Sigmoid",
    "Tanh",
    "Unflatten",
    "convert",
    "validate",
    "vanilla_export",
]
