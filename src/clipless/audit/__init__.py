"""Empirical privacy auditing: every guarantee checked by attack (docs/privacy.md, "Audits").

* :func:`audit_step`: the released update of one private training step, attacked with a
  worst-case canary (Jagielski et al. 2020; Nasr et al. 2021) -> an empirical epsilon lower bound
  with Clopper-Pearson confidence, to set against the claimed epsilon.
* :func:`epsilon_lower_bound`, :func:`clopper_pearson`: the statistics behind it.
* :func:`audit_ecdf`: exact privacy loss of the ECDF tree release over every neighbouring pair of
  a small domain; :func:`audit_sampler`: sampled audit of the exact discrete samplers.
* :func:`audit_one_run`: one private training run with canaries (Steinke, Nasr and Jagielski
  2023) and :func:`one_run_epsilon_lower_bound`, its statistics; :func:`audit_gradient_canaries`:
  the same bound with white-box gradient canaries through the optimizer's noise (their
  section 6), informative at realistic epsilon.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from clipless.audit._modes import AUDIT_MODES
from clipless.audit.bounds import ThresholdTest, clopper_pearson, epsilon_lower_bound
from clipless.audit.one_run import (
    OneRunAudit,
    audit_one_run,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from clipless.audit.statistics import (
    EcdfAudit,
    PrivacyLossDistribution,
    SamplerAudit,
    audit_ecdf,
    audit_sampler,
    gaussian_renyi_divergence,
    laplace_privacy_loss,
)

if TYPE_CHECKING:
    from clipless.audit.gradient_canaries import (
        GradientCanaryAudit,
        audit_gradient_canaries,
        planned_guesses,
    )
    from clipless.audit.step import StepAudit, audit_step


def __getattr__(name: str) -> Any:
    """:mod:`clipless.audit.step` and :mod:`~clipless.audit.gradient_canaries` need torch: loaded
    on first use, so that ``clipless audit`` can refuse bad arguments (and the statistics can be
    used) without importing torch."""
    if name in ("StepAudit", "audit_step"):
        return getattr(importlib.import_module("clipless.audit.step"), name)
    if name in ("GradientCanaryAudit", "audit_gradient_canaries", "planned_guesses"):
        return getattr(importlib.import_module("clipless.audit.gradient_canaries"), name)
    raise AttributeError(f"module 'clipless.audit' has no attribute {name!r}")


__all__ = [
    "AUDIT_MODES",
    "EcdfAudit",
    "GradientCanaryAudit",
    "OneRunAudit",
    "PrivacyLossDistribution",
    "SamplerAudit",
    "StepAudit",
    "ThresholdTest",
    "audit_ecdf",
    "audit_gradient_canaries",
    "audit_one_run",
    "audit_sampler",
    "audit_step",
    "clopper_pearson",
    "epsilon_lower_bound",
    "gaussian_renyi_divergence",
    "laplace_privacy_loss",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
    "planned_guesses",
]
