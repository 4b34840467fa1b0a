"""Empirical privacy auditing: every guarantee checked by attack (docs/privacy.md, "Audits").

* :func:`audit_step`: the released update of one private training step, attacked with a
  worst-case canary (Jagielski et al. 2020; Nasr et al. 2021) -> an empirical epsilon lower bound
  with Clopper-Pearson confidence, to set against the claimed epsilon.
* :func:`epsilon_lower_bound`, :func:`clopper_pearson`: the statistics behind it.
"""

from __future__ import annotations

from clipless.audit.bounds import ThresholdTest, clopper_pearson, epsilon_lower_bound
from clipless.audit.step import AUDIT_MODES, StepAudit, audit_step

__all__ = [
    "AUDIT_MODES",
    "StepAudit",
    "ThresholdTest",
    "audit_step",
    "clopper_pearson",
    "epsilon_lower_bound",
]
