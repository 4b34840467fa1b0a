"""``clipless audit``'s argument checks run before torch is loaded (issue 37, item 6)."""

import subprocess
import sys

import pytest


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


def test_one_run_usage_errors_name_the_argument(capsys: pytest.CaptureFixture[str]) -> None:
    from clipless.cli import main

    for argv, flag in (
        (["audit", "--one-run", "--sigma", "3"], "--sigma"),
        (["audit", "--one-run", "--trials", "100"], "--trials"),
        (["audit", "--one-run", "--mode", "batch-max"], "--mode"),
        (["audit", "--epsilon", "2"], "--epsilon"),
        (["audit", "--canaries", "100"], "--canaries"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"argument {flag}:" in err[0], (argv, err)


def test_one_run_prints_the_bound_below_the_claim(capsys: pytest.CaptureFixture[str]) -> None:
    from clipless.audit import audit_gradient_canaries
    from clipless.cli import main

    argv = ["audit", "--one-run", "--epsilon", "4", "--canaries", "256", "--seed", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    expected = audit_gradient_canaries(4.0, canaries=256, seed=1)
    assert out == expected.lines() and len(out) == 3
    assert 0 < expected.epsilon_lower_bound <= expected.claimed_epsilon


def test_device_usage_errors_name_the_argument(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device`` takes what ``clipless train --device`` takes; a device this machine lacks is
    a usage error (exit 2) naming it, before the audit runs."""
    import torch

    from clipless.cli import main

    assert main(["audit", "--device", "gpu"]) == 2
    assert "argument --device: expected one of cpu, cuda, cuda:N, mps, auto" in (
        capsys.readouterr().err
    )
    if not torch.cuda.is_available():
        for flag in (["audit"], ["audit", "--one-run"]):
            assert main([*flag, "--device", "cuda:3"]) == 2
            err = capsys.readouterr().err
            assert "argument --device: cuda:3 is not available" in err
