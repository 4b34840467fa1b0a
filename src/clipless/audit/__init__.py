"""Empirical privacy auditing: every guarantee checked by attack (docs/privacy.md, "Audits").

* :func:`audit_step`: the released update of one private training step, attacked with a
  worst-case canary (Jagielski et al. 2020; Nasr et al. 2021) -> an empirical epsilon lower bound
  with Clopper-Pearson confidence, to set against the claimed epsilon.
* :func:`epsilon_lower_bound`, :func:`clopper_pearson`: the statistics behind it.
* :func:`audit_ecdf`: exact privacy loss of the ECDF tree release over every neighbouring pair of
  a small domain; :func:`audit_sampler`: sampled audit of the exact discrete samplers.
* :func:`audit_one_run`: one private training run with canaries (Steinke, Nasr and Jagielski
  2023) and :func:`one_run_epsilon_lower_bound`, its statistics.
"""

from __future__ import annotations

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
from clipless.audit.step import AUDIT_MODES, StepAudit, audit_step

__all__ = [
    "AUDIT_MODES",
    "EcdfAudit",
    "OneRunAudit",
    "PrivacyLossDistribution",
    "SamplerAudit",
    "StepAudit",
    "ThresholdTest",
    "audit_ecdf",
    "audit_one_run",
    "audit_sampler",
    "audit_step",
    "clopper_pearson",
    "epsilon_lower_bound",
    "gaussian_renyi_divergence",
    "laplace_privacy_loss",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
]
