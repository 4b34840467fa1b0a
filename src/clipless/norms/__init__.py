"""Certified operator norms of dense matrices and 2-D convolutions.

Certified *upper* bounds on the L2 operator norm of dense matrices (:func:`dense_norm`: exact SVD,
a Cholesky certificate, or Gram iteration -- Delattre et al. 2023, "Efficient bound of Lipschitz
constant for convolutional layers by Gram iteration") and of 2-D multi-channel convolutions
(:func:`conv_norm`: the FFT symbol of the kernel -- Sedghi, Gupta & Long 2019, "The singular
values of convolutional layers" -- or the multiplicity bound
``sqrt(k_eff) ||K reshaped (c_out, c_in kh kw)||_2``). :func:`power_iteration` gives a *lower*
bound, for steering projections and diagnostics only.

Every number returned here is a Python float computed in float64 arithmetic and, where it comes
from floating-point linear algebra, multiplied by ``1 + NUMERIC_MARGIN`` (see that constant).

One module per subject, each certificate's precondition, claim and proof in its constructor's
docstring:

* :mod:`clipless.norms.certificates`: certified rounding (:data:`NUMERIC_MARGIN`), finiteness,
  the device choice (:func:`matrix_products_only`) and the batched complex Cholesky / ``eigh``
  certificate of ``max_i ||A_i||_2``;
* :mod:`clipless.norms.iterations`: Gram iteration (upper bounds) and power iteration (lower);
* :mod:`clipless.norms.dense`: :func:`dense_norm`;
* :mod:`clipless.norms.convolution`: :func:`conv_multiplicity`, :func:`conv_norm`,
  :func:`norm_tensor` (and :func:`norm_plan` / :func:`evaluate_plans`, which batch many
  layers' Gram iterations together), :func:`conv_power_iteration`.

Every name of the submodules is also an attribute of this package, and setting one here (e.g.
``clipless.norms.ACCELERATOR_PATH_ON_CPU = True``, or a test's ``monkeypatch.setattr``) sets it in
every submodule that holds it, so that it takes effect where it is read.

Layering: this package depends on torch, :mod:`clipless._certified` and :mod:`clipless._workspace`
only; the layers of :mod:`clipless.nn` build on it, and :mod:`clipless.bounds` (backpropagation for
bounds) on both.
"""

from __future__ import annotations

import sys
import types

from clipless._certified import UNIT_ROUNDOFF as UNIT_ROUNDOFF
from clipless._certified import inflate as inflate
from clipless.norms import certificates, convolution, dense, iterations
from clipless.norms.certificates import ACCELERATOR_PATH_ON_CPU as ACCELERATOR_PATH_ON_CPU
from clipless.norms.certificates import NUMERIC_MARGIN, matrix_products_only
from clipless.norms.certificates import _aminmax as _aminmax
from clipless.norms.certificates import all_finite as all_finite
from clipless.norms.convolution import (
    NormPlan,
    conv_multiplicity,
    conv_norm,
    conv_power_iteration,
    evaluate_plans,
    norm_plan,
    norm_tensor,
)
from clipless.norms.dense import dense_norm
from clipless.norms.iterations import PowerIterationResult, gram_iteration, power_iteration

__all__ = [
    "NUMERIC_MARGIN",
    "NormPlan",
    "PowerIterationResult",
    "conv_multiplicity",
    "conv_norm",
    "conv_power_iteration",
    "dense_norm",
    "evaluate_plans",
    "gram_iteration",
    "matrix_products_only",
    "norm_plan",
    "norm_tensor",
    "power_iteration",
]

_SUBMODULES = (certificates, iterations, dense, convolution)

# The submodules' private helpers and thresholds are attributes here too, so that tests and
# benchmarks read and patch them through ``clipless.norms`` wherever a subject's code lives.
for _module in _SUBMODULES:
    globals().update(
        (name, value)
        for name, value in vars(_module).items()
        if name.startswith("_") and not name.startswith("__") and name not in globals()
    )
del _module


class _Package(types.ModuleType):
    """The package's module type: a name set here is set in every submodule holding it too.

    The submodules read their flags, thresholds and helpers from their own globals; without the
    forwarding, ``clipless.norms.ACCELERATOR_PATH_ON_CPU = True`` would change only this
    package's copy and no certificate would see it.
    """

    def __setattr__(self, name: str, value: object) -> None:
        for module in _SUBMODULES:
            if name in vars(module):
                setattr(module, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
