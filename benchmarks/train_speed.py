"""Training speed and memory: clipless DP training against non-private training and Opacus.

Per-step wall time and per-step peak tensor memory for one model and batch size, in one process,
for these configurations (all plain SGD, same learning rate, same fixed synthetic batch):

* ``nonprivate``: the :func:`clipless.nn.vanilla_export` twin of the model, ordinary training;
* ``clipless-ps``: ``clipless.PrivacyEngine(...).make_private(scaling="per-sample")``;
* ``clipless-bound``: the same with ``scaling="bound"`` (Clipless DP-SGD proper);
* ``clipless-carried`` (opt-in): ``clipless-ps`` with ``make_private(certify_every=k)``
  (``--certify-every``, default 10): carried certified bounds between exact certifications;
* ``opacus``: Opacus DP-SGD (per-sample gradients by hooks, flat clipping at
  ``max_grad_norm = 1``) on the vanilla-exported twin, same noise multiplier;
* ``opacus-ghost``: Opacus with ``grad_sample_mode="ghost"`` (ghost clipping: no per-sample
  gradient is materialised; two backward passes), when Opacus supports it.

Fairness. Every configuration receives the same fixed batch of exactly ``B`` examples (the data
loader is not in the timed region; Poisson sampling is off for Opacus, and the clipless Poisson
loader is bypassed: its optimizer divides by the expected batch size ``B`` either way). The timed
step is the user's step: ``zero_grad(); loss(model(x), y).backward(); optimizer.step()``, which
for clipless includes noise, the weight projection (certifying the Lipschitz bound of every layer),
accounting bookkeeping and the recomputation of the certified bounds for the next step, and for
Opacus the per-sample gradients, clipping, noise and accounting bookkeeping.

Timing. After warm-up, repetitions are interleaved (configuration order rotated every repetition);
one repetition times ``k`` consecutive steps (``k`` chosen so a repetition lasts about
``--target-seconds``). Reported: the median per-step time over repetitions, and the median over
repetitions of the *paired* ratio (configuration / non-private in the same repetition), which is
robust to slow drifts of the machine's load.

Memory. ``step peak`` is the working set of one training step: the peak minus the minimum, during
the step, of the bytes of live torch CPU tensors. The minimum is reached right after
``zero_grad(set_to_none=True)``, when only persistent state is live (parameters, the data batch,
optimizer state, cached bounds); gradients and Opacus's per-sample gradients (which Opacus keeps
alive between steps until the next ``zero_grad``) are freed there and re-created by the step, so
they count, and so do clipless's scratch buffers (``clipless._workspace``), which stay allocated
between steps and are added. It is computed exactly from the allocator events of ``torch.profiler``
(``profile_memory=True``) over two steps, the second one measured. It counts activations saved
for backward, gradients, per-sample gradients, noise and temporaries of the bound computations
(LAPACK/FFT work arrays allocated through torch included); memory that BLAS/LAPACK allocate
internally and Python objects are not counted. ``--rss`` adds a second, coarser measurement: the
peak resident set size (``VmHWM``) of a fresh subprocess per configuration (3 steps), minus
that of a subprocess that only imports the same libraries and builds the data.

Where the time goes (``--profile``, on by default, at batch 256 or the first batch size): for the
non-private and clipless configurations, forward, backward and the optimizer step timed
separately; the clipless step broken down with :mod:`cProfile` (noise, inner SGD step, projection,
bound refresh, accounting, and the exact certifications ``norms.dense_norm`` /
``norms.conv_norm``); per layer, the cost of one exact certification and the growth per step of
the carried bound ``ub + m ||W_new - W_old||_F`` (docs/design.md "Performance practice").

Run ``python benchmarks/train_speed.py --quick`` (batch 64 only, about a minute) or without
``--quick`` for the full grid (batch sizes 64, 256, 1024; about ten minutes on two shared cores).
Results: Markdown tables on stdout and ``benchmarks/out/train_speed[_quick].json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import clipless
from clipless import constraints, models, nn

OUT_DIR = Path(__file__).resolve().parent / "out"
CONFIGS = (
    "nonprivate",
    "clipless-ps",
    "clipless-bound",
    "clipless-carried",
    "opacus",
    "opacus-ghost",
)
DEFAULT_CONFIGS = ("nonprivate", "clipless-ps", "clipless-bound", "opacus", "opacus-ghost")
# The Clipless paper's Figure 4 sizes (CNNs of ~130K, ~500K and ~2M parameters on CIFAR-10-shaped
# 3x32x32 inputs): Lipschitz conv stacks (3x3 convolutions, GroupSort, L2-norm pooling) and a
# dense head, exact parameter counts 131,168 / 495,296 / 1,962,288.
CIFAR_CNNS: dict[str, tuple[int, ...]] = {
    "cnn130k": (32, 64, 152),
    "cnn500k": (64, 128, 320),
    "cnn2m": (144, 288, 576),
}
# The three structures at tiny widths, 8 x 8 inputs: their step's arithmetic is almost
# nothing, so its time is the host's work (Python and operator dispatch), which a GPU step
# waits for when it is bound by its launches (step_profile.py --models mlp-tiny ...).
TINY: dict[str, tuple[tuple[int, int, int], str, tuple[int, ...]]] = {
    "mlp-tiny": ((1, 8, 8), "mlp", (16, 16)),
    "cnn-tiny": ((1, 8, 8), "convnet", (2, 4)),
    "cnn3-tiny": ((3, 8, 8), "convnet", (2, 4, 8)),
}
MODELS = ("mlp", "cnn", *CIFAR_CNNS)
DEFAULT_MODELS = ("mlp", "cnn")
TEMPERATURE = 0.1


# ------------------------------------------------------------------------------------ models
def input_shape(name: str) -> tuple[int, int, int]:
    """``3 x 32 x 32`` for the CIFAR-sized CNNs, ``1 x 28 x 28`` otherwise (tiny: their own)."""
    if name in TINY:
        return TINY[name][0]
    return (3, 32, 32) if name in CIFAR_CNNS else (1, 28, 28)


def build_model(name: str) -> torch.nn.Module:
    """The clipless model (:mod:`clipless.models`; inputs :func:`input_shape`, 10 classes)."""
    if name == "mlp":
        return models.mlp((1, 28, 28), (1024, 1024), 10, input_norm=1.0, bias=False)
    if name == "cnn":
        return models.convnet((1, 28, 28), (32, 64), 10, input_norm=1.0, pool="l2", bias=False)
    if name in CIFAR_CNNS:
        shape = input_shape(name)
        return models.convnet(shape, CIFAR_CNNS[name], 10, input_norm=1.0, pool="l2", bias=False)
    if name in TINY:
        shape, kind, widths = TINY[name]
        if kind == "mlp":
            return models.mlp(shape, widths, 10, input_norm=1.0, bias=False)
        return models.convnet(shape, widths, 10, input_norm=1.0, pool="l2", bias=False)
    raise ValueError(f"unknown model {name!r}")


def plain_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The plain twin of ``clipless.nn.CrossEntropyLoss(temperature)`` (mean reduction)."""
    return F.cross_entropy(out / TEMPERATURE, y)


# ----------------------------------------------------------------------------------- runners
@dataclass
class Runner:
    """One configuration: a closure running one training step on the fixed batch."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]
    extra: dict[str, Any] = field(default_factory=dict)


def _loader(x: torch.Tensor, y: torch.Tensor, batch: int) -> torch.utils.data.DataLoader[Any]:
    # The loader only tells the engines N and B (sample rate B / N); batches are fed directly.
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def make_runner(
    config: str,
    model_name: str,
    xb: torch.Tensor,
    yb: torch.Tensor,
    *,
    sigma: float,
    lr: float,
    seed: int,
    dataset_batches: int = 16,
    max_grad_sample_gib: float = math.inf,
    certify_every: int = 10,
    device: str | torch.device = "cpu",
) -> Runner:
    """Build ``config`` for ``model_name``; every configuration starts from the same weights.

    ``opacus`` (hooks) is refused with :class:`MemoryError` when its per-sample gradients alone
    (``B x #params`` floats) would exceed ``max_grad_sample_gib``.
    """
    torch.manual_seed(seed)
    cmodel = build_model(model_name)
    batch = xb.shape[0]
    # A dataset of `dataset_batches` copies of the batch: only its size matters (q = B / N).
    x_all = xb.repeat(dataset_batches, 1, 1, 1)
    y_all = yb.repeat(dataset_batches)
    cmodel.to(device)  # the loaders' copies stay on the CPU: they only tell N and B
    xb, yb = xb.to(device), yb.to(device)
    if config.startswith("clipless"):
        scaling = "bound" if config == "clipless-bound" else "per-sample"
        every = certify_every if config == "clipless-carried" else 1
        loss = nn.CrossEntropyLoss(temperature=TEMPERATURE)
        opt = torch.optim.SGD(cmodel.parameters(), lr=lr)
        engine = clipless.PrivacyEngine(accountant="pld", seed=seed)
        model, dp_opt, _ = engine.make_private(
            module=cmodel,
            optimizer=opt,
            data_loader=_loader(x_all, y_all, batch),
            loss=loss,
            noise_multiplier=sigma,
            mechanism=clipless.MechanismSpec(
                max_norm=1.0, constraint="clip", scaling=scaling, noise="global"
            ),
            options=clipless.RunOptions(certify_every=every),
        )
        dp_opt.data_loader = None  # every step trains on the same batch (timing only)

        def step() -> None:
            dp_opt.zero_grad()
            loss(model(xb), yb).backward()
            dp_opt.step()

        return Runner(config, model, dp_opt, step, {"engine": engine, "loss": loss})

    # Non-clipless configurations train the plain torch twin (same initial weights, projected
    # exactly as clipless's make_private projects them).
    constraints.project(cmodel, mode="clip", max_norm=1.0)
    plain = nn.vanilla_export(cmodel)
    opt = torch.optim.SGD(plain.parameters(), lr=lr)
    if config == "nonprivate":

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            plain_loss(plain(xb), yb).backward()
            opt.step()

        return Runner(config, plain, opt, step)

    from opacus import PrivacyEngine as OpacusEngine

    engine = OpacusEngine(accountant="prv")
    kwargs: dict[str, Any] = {
        "module": plain,
        "optimizer": opt,
        "data_loader": _loader(x_all, y_all, batch),
        "noise_multiplier": sigma,
        "max_grad_norm": 1.0,
        "poisson_sampling": False,
    }
    if config == "opacus":
        need = batch * sum(q.numel() for q in plain.parameters()) * 4 / 2**30
        if need > max_grad_sample_gib:
            raise MemoryError(
                f"per-sample gradients alone need {need:.1f} GiB > --max-grad-sample-gib "
                f"{max_grad_sample_gib:g}"
            )
        model, dp_opt, _ = engine.make_private(**kwargs)

        def step() -> None:
            dp_opt.zero_grad(set_to_none=True)
            plain_loss(model(xb), yb).backward()
            dp_opt.step()

        return Runner(config, model, dp_opt, step, {"engine": engine})
    if config == "opacus-ghost":
        criterion = torch.nn.CrossEntropyLoss()
        model, dp_opt, crit, _ = engine.make_private(
            **kwargs, criterion=criterion, grad_sample_mode="ghost"
        )

        def step() -> None:
            dp_opt.zero_grad(set_to_none=True)
            crit(model(xb) / TEMPERATURE, yb).backward()
            dp_opt.step()

        return Runner(config, model, dp_opt, step, {"engine": engine})
    raise ValueError(f"unknown configuration {config!r}")


def synthetic_batch(
    batch: int, seed: int, shape: tuple[int, ...] = (1, 28, 28)
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return x, y


# ------------------------------------------------------------------------------------ timing
def time_steps(runners: list[Runner], reps: int, warmup: int, target: float) -> dict[str, Any]:
    """Interleaved timing; returns per-configuration per-step times (seconds) per repetition."""
    ks: dict[str, int] = {}
    for r in runners:
        t0 = time.perf_counter()
        for _ in range(warmup):
            r.step()
        per = (time.perf_counter() - t0) / max(warmup, 1)
        ks[r.name] = max(1, min(50, math.ceil(target / max(per, 1e-6))))
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for rep in range(reps):
        shift = rep % len(runners)
        for r in runners[shift:] + runners[:shift]:
            k = ks[r.name]
            t0 = time.perf_counter()
            for _ in range(k):
                r.step()
            times[r.name].append((time.perf_counter() - t0) / k)
    return {"times": times, "steps_per_rep": ks}


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float | None:
    if num not in times or den not in times or not times[num]:
        return None
    return statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))


# ------------------------------------------------------------------------------------ memory
def step_peak_bytes(runner: Runner) -> int:
    """Peak minus minimum of the live-tensor bytes during one step (module docstring), plus the
    scratch buffers that clipless keeps between steps (``clipless._workspace``: live at the
    minimum, so the difference alone would not count them)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from clipless import _workspace

    _workspace.release()  # only this runner's buffers are counted

    with (
        warnings.catch_warnings(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        warnings.simplefilter("ignore")
        for i in range(2):
            with record_function(f"train_speed_step{i}"):
                runner.step()
    events = list(prof.profiler.kineto_results.events())  # type: ignore[union-attr]
    marks = [e for e in events if e.name() == "train_speed_step1"]
    if not marks:
        raise RuntimeError("profiler did not record the step marker")
    start = marks[0].start_ns()
    end = start + marks[0].duration_ns()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    level = 0
    inside: list[int] = []
    for t, nbytes in mem:
        if t > end:
            break
        if t >= start and not inside:
            inside.append(level)
        level += nbytes
        if t >= start:
            inside.append(level)
    return (max(inside) - min(inside) if inside else 0) + _workspace.pooled_bytes()


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rss_child(config: str, model_name: str, batch: int, args: argparse.Namespace) -> float:
    """Peak RSS (MiB) of a fresh process running ``config`` (``"none"``: imports and data only)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"{config},{model_name},{batch}",
        "--threads",
        str(args.threads),
        "--sigma",
        str(args.sigma),
        "--lr",
        str(args.lr),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def child_main(spec: str, args: argparse.Namespace) -> None:
    config, model_name, batch = spec.split(",")
    import opacus  # noqa: F401 - every child imports the same libraries

    xb, yb = synthetic_batch(int(batch), args.seed, input_shape(model_name))
    data_copy = xb.repeat(16, 1, 1, 1)  # as make_runner's dataset, so the baseline has it too
    del data_copy
    if config != "none":
        runner = make_runner(config, model_name, xb, yb, sigma=args.sigma, lr=args.lr, seed=0)
        for _ in range(3):
            runner.step()
    print(peak_rss_mib())


def peak_rss_mib() -> float:
    """This process's peak resident set size (MiB): ``VmHWM`` (Linux), reset by ``exec``.

    ``getrusage``'s ``ru_maxrss`` is not used: Linux carries it across ``fork`` + ``exec``, so
    a child would report its parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ----------------------------------------------------------------------------------- profile
_STEP_PARTS = {
    "noise (add_noise)": ("optim/optimizer.py", "add_noise"),
    "inner SGD step": ("sgd.py", "step"),
    "projection (constraints.project)": ("constraints.py", "project"),
    "bound refresh (DPOptimizer.refresh)": ("optim/optimizer.py", "refresh"),
    "accounting (ledger.record)": ("ledger.py", "record"),
}
_CERTIFY = {
    "dense_norm": ("norms/dense.py", "dense_norm"),
    "conv_norm": ("norms/convolution.py", "conv_norm"),
}


def _cum(stats: pstats.Stats, file_end: str, func: str) -> tuple[float, int]:
    total, calls = 0.0, 0
    for (filename, _line, name), row in stats.stats.items():  # type: ignore[attr-defined]
        if name == func and filename.endswith(file_end):
            total += row[3]
            calls += row[1]
    return total, calls


def split_times(
    runner: Runner,
    loss: Callable[..., torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
    n: int,
    prof: cProfile.Profile | None = None,
) -> dict[str, float]:
    """Median forward+loss, backward and optimizer-step times of ``n`` steps."""
    model, opt = runner.model, runner.optimizer
    fwd, bwd, stp = [], [], []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        value = loss(model(xb), yb)
        t1 = time.perf_counter()
        value.backward()
        t2 = time.perf_counter()
        if prof is not None:
            prof.enable()
        opt.step()
        if prof is not None:
            prof.disable()
        t3 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        stp.append(t3 - t2)
    return {
        "forward+loss": statistics.median(fwd),
        "backward": statistics.median(bwd),
        "optimizer.step": statistics.median(stp),
    }


def certification_costs(runner: Runner) -> dict[str, Any]:
    """Per parametric layer: the time of one exact certification (``layer.lipschitz()`` with its
    cache cleared), its value, and the growth ``m ||W_new - W_old||_F`` that a carried bound
    (docs/design.md "Performance practice") would add over one training step."""
    layers = {
        path: mod
        for path, mod in runner.model.named_modules()
        if isinstance(mod, nn.Linear | nn.Conv2d)
    }
    before = {path: mod.weight.detach().clone() for path, mod in layers.items()}
    runner.step()
    out: dict[str, Any] = {}
    for path, mod in layers.items():
        mod.__dict__.pop("_bound_cache", None)
        t0 = time.perf_counter()
        value = float(mod.lipschitz())
        seconds = time.perf_counter() - t0
        delta = (mod.weight.detach() - before[path]).double()
        m = math.sqrt(mod.multiplicity()) if isinstance(mod, nn.Conv2d) else 1.0
        out[path] = {
            "shape": list(mod.weight.shape),
            "certify_seconds": seconds,
            "lipschitz": value,
            "carried_growth_per_step": m * float(delta.norm()),
        }
    return out


def profile_clipless(runner: Runner, xb: torch.Tensor, yb: torch.Tensor, n: int) -> dict[str, Any]:
    """Forward / backward / step times and a cProfile breakdown of the clipless step."""
    prof = cProfile.Profile()
    out: dict[str, Any] = split_times(runner, runner.extra["loss"], xb, yb, n, prof)
    stats = pstats.Stats(prof)
    out["step_parts"] = {k: _cum(stats, *v)[0] / n for k, v in _STEP_PARTS.items()}
    certify = {}
    for k, v in _CERTIFY.items():
        total, calls = _cum(stats, *v)
        certify[k] = {"seconds_per_step": total / n, "calls_per_step": calls / n}
    out["certification"] = certify
    out["layers"] = certification_costs(runner)
    return out


# -------------------------------------------------------------------------------------- main
def environment(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import opacus

        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "git_commit": commit or None,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "opacus": opacus_version,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


def fmt_ms(s: float | None) -> str:
    return "—" if s is None else f"{1000 * s:.1f}"


def fmt_x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def fmt_mib(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**20:.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 256 only, fewer repetitions")
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=MODELS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=None)
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=CONFIGS)
    p.add_argument("--certify-every", type=int, default=10, help="for clipless-carried")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--target-seconds", type=float, default=None, help="length of one repetition")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier (both engines)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-timing", action="store_true", help="skip timing (memory/RSS only)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument(
        "--max-grad-sample-gib",
        type=float,
        default=4.0,
        help="skip Opacus (hooks) when its per-sample gradients alone would exceed this",
    )
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--profile-batch", type=int, default=None, help="default: 256 if timed")
    p.add_argument("--rss", action="store_true", help="also peak RSS per config (subprocesses)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Opacus's secure-RNG and hook warnings
    if args.child is not None:
        child_main(args.child, args)
        return
    batches = args.batch_sizes or ([64] if args.quick else [64, 256, 1024])
    profile_batch = args.profile_batch or (256 if 256 in batches else batches[0])
    reps = args.reps or (4 if args.quick else 9)
    target = args.target_seconds or (0.15 if args.quick else 0.4)
    name = "train_speed_quick.json" if args.quick else "train_speed.json"
    out_path = args.out or OUT_DIR / name

    env = environment(args.threads)
    print(f"# train_speed: {env}", flush=True)
    results: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for model_name in args.models:
        for batch in batches:
            xb, yb = synthetic_batch(batch, args.seed, input_shape(model_name))
            runners = []
            for config in args.configs:
                try:
                    runners.append(
                        make_runner(
                            config,
                            model_name,
                            xb,
                            yb,
                            sigma=args.sigma,
                            lr=args.lr,
                            seed=0,
                            max_grad_sample_gib=args.max_grad_sample_gib,
                            certify_every=args.certify_every,
                        )
                    )
                except Exception as exc:  # e.g. Opacus missing or a mode it does not support
                    print(f"  skip {config} ({type(exc).__name__}: {exc})", flush=True)
                    skipped[f"{model_name}/B={batch}/{config}"] = f"{type(exc).__name__}: {exc}"
            t_start = time.perf_counter()
            timing = time_steps(runners, 0 if args.no_timing else reps, args.warmup, target)
            times = timing["times"]
            row: dict[str, Any] = {
                "model": model_name,
                "batch": batch,
                "reps": reps,
                "steps_per_rep": timing["steps_per_rep"],
                "loadavg": os.getloadavg(),
                "timing_seconds": time.perf_counter() - t_start,
                "configs": {},
            }
            for r in runners:
                c: dict[str, Any] = {
                    "median_step_s": statistics.median(times[r.name]) if times[r.name] else None,
                    "min_step_s": min(times[r.name], default=None),
                    "times_s": times[r.name],
                    "ratio_vs_nonprivate": paired_ratio(times, r.name, "nonprivate"),
                    "ratio_vs_opacus": paired_ratio(times, r.name, "opacus"),
                    "ratio_vs_opacus_ghost": paired_ratio(times, r.name, "opacus-ghost"),
                    "param_bytes": param_bytes(r.model),
                }
                if not args.no_memory:
                    c["step_peak_bytes"] = step_peak_bytes(r)
                if args.rss:
                    c["rss_peak_mib"] = rss_child(r.name, model_name, batch, args)
                row["configs"][r.name] = c
            if args.rss:
                row["rss_baseline_mib"] = rss_child("none", model_name, batch, args)
            results.append(row)
            print_row(row)
            if not args.no_profile and batch == profile_batch:
                for r in runners:
                    key = f"{model_name}/B={batch}/{r.name}"
                    if r.name.startswith("clipless"):
                        profiles[key] = profile_clipless(r, xb, yb, n=3)
                    elif r.name == "nonprivate":
                        profiles[key] = split_times(r, plain_loss, xb, yb, n=3)
                    else:
                        continue
                    print_profile(key, profiles[key])
            del runners

    env["loadavg_end"] = os.getloadavg()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "args": vars(args) | {"out": str(out_path)}}
    payload |= {"results": results, "profiles": profiles, "skipped": skipped}
    out_path.write_text(json.dumps(payload, indent=1, default=str))
    print()
    print_tables(results)
    print(f"\nload average start {env['loadavg_start']}, end {env['loadavg_end']}")
    print(f"wrote {out_path}")


def print_row(row: dict[str, Any]) -> None:
    parts = []
    for name, c in row["configs"].items():
        mem = c.get("step_peak_bytes")
        parts.append(
            f"{name} {fmt_ms(c['median_step_s'])} ms ({fmt_x(c['ratio_vs_nonprivate'])}"
            + (f", {fmt_mib(mem)} MiB" if mem is not None else "")
            + ")"
        )
    print(f"{row['model']} B={row['batch']}: " + "; ".join(parts), flush=True)


def print_profile(key: str, prof: dict[str, Any]) -> None:
    print(f"  profile {key}:")
    for k in ("forward+loss", "backward", "optimizer.step"):
        print(f"    {k:40s} {fmt_ms(prof[k])} ms")
    for k, v in prof.get("step_parts", {}).items():
        print(f"      {k:38s} {fmt_ms(v)} ms")
    for k, v in prof.get("certification", {}).items():
        print(
            f"      certification {k:24s} {fmt_ms(v['seconds_per_step'])} ms "
            f"({v['calls_per_step']:.0f} calls/step)"
        )
    for path, v in prof.get("layers", {}).items():
        print(
            f"    layer {path} {v['shape']}: one exact certification "
            f"{fmt_ms(v['certify_seconds'])} ms, Lipschitz bound {v['lipschitz']:.3f}, "
            f"carried-bound growth per step {v['carried_growth_per_step']:.3f}"
        )


def print_tables(results: list[dict[str, Any]]) -> None:
    """Markdown tables: time, ratios, memory."""
    configs = [c for c in CONFIGS if any(c in r["configs"] for r in results)]
    head = "| model | B | " + " | ".join(configs) + " |"
    sep = "|---|---|" + "---|" * len(configs)

    def table(title: str, cell: Callable[[dict[str, Any], str], str]) -> None:
        print(f"\n{title}\n\n{head}\n{sep}")
        for r in results:
            cells = [cell(r, c) if c in r["configs"] else "—" for c in configs]
            print(f"| {r['model']} | {r['batch']} | " + " | ".join(cells) + " |")

    table("Median step time (ms)", lambda r, c: fmt_ms(r["configs"][c]["median_step_s"]))
    table(
        "Step time / non-private (median of paired ratios)",
        lambda r, c: fmt_x(r["configs"][c]["ratio_vs_nonprivate"]),
    )
    table(
        "Step time / Opacus (hooks) (median of paired ratios)",
        lambda r, c: fmt_x(r["configs"][c]["ratio_vs_opacus"]),
    )
    table(
        "Step time / Opacus (ghost) (median of paired ratios)",
        lambda r, c: fmt_x(r["configs"][c].get("ratio_vs_opacus_ghost")),
    )
    if any("step_peak_bytes" in c for r in results for c in r["configs"].values()):
        table(
            "Step peak tensor memory (MiB, above the persistent state)",
            lambda r, c: fmt_mib(r["configs"][c].get("step_peak_bytes")),
        )

        def mem_ratio(r: dict[str, Any], c: str) -> str:
            base = r["configs"].get("nonprivate", {}).get("step_peak_bytes")
            mine = r["configs"][c].get("step_peak_bytes")
            return "—" if not base or mine is None else fmt_x(mine / base)

        table("Step peak tensor memory / non-private", mem_ratio)
    if any("rss_peak_mib" in c for r in results for c in r["configs"].values()):

        def rss(r: dict[str, Any], c: str) -> str:
            v = r["configs"][c].get("rss_peak_mib")
            return "—" if v is None else f"{v - r['rss_baseline_mib']:.0f}"

        table("Peak RSS above an import-only process (MiB)", rss)


if __name__ == "__main__":
    main()
