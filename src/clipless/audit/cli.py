"""``clipless audit``: attack one private training step and compare with the claimed epsilon.

Wired into the main ``clipless`` command by :func:`add_audit_parser`. Prints four lines: the
mechanism, the claimed epsilon, the Gaussian-DP fit of all the scores (estimate and rigorous
lower bound under the step's Gaussian output model) and the distribution-free empirical lower
bound with its confidence (:mod:`clipless.audit.step`). ``--one-run`` runs the one-run audit with
white-box gradient canaries instead (:mod:`clipless.audit.gradient_canaries`) and prints three
lines: the mechanism, the claimed epsilon and the one-run lower bound. Exit status 0 when the
claim stands, 1 when the audit shows it false (exactly, by the canary's contribution, or
statistically by a lower bound above it), 2 on bad arguments (one line on stderr naming the
argument).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from clipless._argtypes import DEVICES, device, integer, number
from clipless.allocation import allocation_names
from clipless.audit._modes import AUDIT_MODES

__all__ = ["add_audit_parser", "audit_command"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help text already states one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "default:" in text.lower() else super()._get_help_string(action)


def add_audit_parser(sub: Any) -> None:
    """Add the ``audit`` sub-command to the ``clipless`` parser's sub-parsers."""
    p = sub.add_parser(
        "audit",
        help="attack one private training step: empirical epsilon lower bound vs the claim",
        description=(
            "Run one DP training step of a small Lipschitz MLP many times on two neighbouring "
            "datasets (with and without a worst-case canary), project the released noisy "
            "updates on the most distinguishing direction, and turn a threshold test into an "
            "empirical lower bound on epsilon with Clopper-Pearson confidence (Jagielski et al. "
            "2020; Nasr et al. 2021). A sound mechanism gives a lower bound below the claimed "
            "epsilon; batch-max scaling (no DP proof) gives one above it. The canary's exact "
            "contribution relative to the calibrated sensitivity is printed too: above 1 proves "
            "the claim false. Exit status: 0 when the claim stands, 1 when it is shown false, 2 "
            "on bad arguments."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--one-run",
        action="store_true",
        help="instead: one run calibrated to --epsilon with white-box gradient canaries and the "
        "one-run lower bound (Steinke, Nasr and Jagielski 2023, section 6)",
    )
    p.add_argument(
        "--epsilon",
        type=number("a number in (0, 100)", 0.0, 100.0),
        default=None,
        help="with --one-run: the target epsilon the noise is calibrated to (default: 1)",
    )
    p.add_argument(
        "--canaries",
        type=integer(2, 1 << 22),
        default=None,
        help="with --one-run: the number of gradient canaries (default: 4096)",
    )
    p.add_argument("--mode", choices=AUDIT_MODES, default="per-sample", help="gradient scaling")
    p.add_argument(
        "--allow-unproven",
        action="store_true",
        help="required with --mode batch-max (a mode without a DP proof)",
    )
    p.add_argument("--noise", choices=allocation_names(), default="global", help="noise")
    p.add_argument(
        "--sigma",
        type=number("a number in [0.001, 1e6)", 1e-3, 1e6, open_low=False),
        default=None,
        help="noise multiplier (default: 2; not with --one-run)",
    )
    p.add_argument(
        "--trials",
        type=integer(20, 10_000_000),
        default=None,
        help="releases simulated on each neighbouring dataset (default: 20000; not with --one-run)",
    )
    p.add_argument(
        "--steps", type=integer(1, 10_000), default=1, help="steps composed (fixed weights)"
    )
    p.add_argument(
        "--delta", type=number("a number in [1e-100, 1)", 1e-100, 1.0, open_low=False),
        default=1e-5, help="delta of the claimed epsilon and of the lower bound",
    )  # fmt: skip
    p.add_argument(
        "--confidence",
        type=number("a number in (0, 1)", 0.0, 1.0),
        default=0.95,
        help="confidence of the lower bound",
    )
    p.add_argument(
        "--seed",
        type=integer(0, 2**62),
        default=None,
        help="reproducible model, canary and noise (default: fresh randomness)",
    )
    p.add_argument(
        "--plot",
        default=None,
        help="write the two score histograms to this image (.png, .pdf, .svg)",
    )
    p.add_argument(
        "--device",
        type=device,
        default="cpu",
        help=f"where the audited model trains and the noise is drawn: {DEVICES}",
    )
    p.set_defaults(func=audit_command)


def _usage_error(argument: str, message: str) -> int:
    print(f"clipless audit: error: argument {argument}: {message}", file=sys.stderr)
    return 2


def _one_run(args: argparse.Namespace) -> int:
    """``--one-run``: the white-box gradient-canary audit (:mod:`.gradient_canaries`)."""
    for flag, value in (("--sigma", args.sigma), ("--trials", args.trials), ("--plot", args.plot)):
        if value is not None:
            return _usage_error(flag, "not used by --one-run (its noise is set by --epsilon)")
    if args.mode == "batch-max":
        return _usage_error(
            "--mode", "--one-run audits per-sample, bound or threshold (gradient canaries bypass "
            "batch-max's flaw); audit batch-max without --one-run",
        )  # fmt: skip
    where = _device(args.device)
    if where is None:
        return 2
    from clipless.audit.gradient_canaries import audit_gradient_canaries

    result = audit_gradient_canaries(
        1.0 if args.epsilon is None else args.epsilon,
        delta=args.delta,
        canaries=4096 if args.canaries is None else args.canaries,
        steps=args.steps,
        mode=args.mode,
        noise=args.noise,
        confidence=args.confidence,
        seed=args.seed,
        device=where,
    )
    for line in result.lines():
        print(line)
    return 1 if result.violated else 0


def _device(name: str) -> Any:
    """``--device`` resolved (``None`` after printing the usage error: not available here)."""
    from clipless import _devices
    from clipless.spec import OptionError

    try:
        return _devices.resolve_device(name)
    except OptionError as exc:
        print(f"clipless audit: error: {exc}", file=sys.stderr)
        return None


def audit_command(args: argparse.Namespace) -> int:
    """Run the audit described by ``args`` and print its report; returns the exit status."""
    if args.one_run:
        return _one_run(args)
    for flag, value in (("--epsilon", args.epsilon), ("--canaries", args.canaries)):
        if value is not None:
            return _usage_error(flag, "only with --one-run")
    if args.mode == "batch-max" and not args.allow_unproven:
        return _usage_error("--mode", "batch-max has no DP proof; add --allow-unproven to audit it")
    if args.plot:  # checked before the audit runs, not after
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        if Path(args.plot).is_dir():
            return _usage_error(
                "--plot", f"{args.plot} is a folder; give an image file name (.png, .pdf or .svg)"
            )
        suffix = Path(args.plot).suffix[1:].lower() or "png"
        if suffix not in FigureCanvasAgg.get_supported_filetypes():
            return _usage_error(
                "--plot", f".{suffix} is not an image format (use .png, .pdf or .svg)"
            )
    where = _device(args.device)
    if where is None:
        return 2
    from clipless.audit.step import audit_step  # torch: loaded only once the arguments pass

    result = audit_step(
        args.mode,
        noise=args.noise,
        noise_multiplier=2.0 if args.sigma is None else args.sigma,
        trials=20000 if args.trials is None else args.trials,
        steps=args.steps,
        delta=args.delta,
        confidence=args.confidence,
        allow_unproven=args.allow_unproven,
        seed=args.seed,
        device=where,
    )
    for line in result.lines():
        print(line)
    if args.plot:
        try:
            path = result.plot(args.plot)
        except (OSError, ValueError) as exc:
            return _usage_error("--plot", str(exc))
        print(f"plot: {path}")
    return 1 if result.violated else 0
