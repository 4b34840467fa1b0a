"""``clipless audit``'s argument checks run before torch is loaded (issue 37, item 6)."""

import subprocess
import sys


def test_batch_max_usage_error_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from clipless.cli import main\n"
        "rc = main(['audit', '--mode', 'batch-max'])\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["2", "False"], out
    assert "--allow-unproven" in out.stderr


def test_the_lazy_package_still_exports_the_step_audit() -> None:
    import clipless.audit as audit
    from clipless.audit.step import StepAudit, audit_step

    assert audit.audit_step is audit_step and audit.StepAudit is StepAudit
    assert audit.AUDIT_MODES == ("per-sample", "bound", "threshold", "batch-max")
