"""``clipless train`` as one library call: :func:`train` runs a :class:`clipless.spec.TrainSpec`.

The stages, in order: launch the ranks (``--nproc``), open the run folder (refuse one that would
lose a run; on ``--resume`` read and adopt its configuration), resolve the spec's default rules
(those that need the data once it is loaded), build the model, make it private, write the run
configuration before the first step, train (:func:`clipless.training.fit`) and save the model.
Nothing is written before every check has passed.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from clipless._devices import resolve_device as _resolve_device
from clipless.model_file import MODEL_FORMAT, whiten_placeholder
from clipless.spec import (
    RUN_CONFIG_NAME,
    RUN_OPTIONS,
    OptionError,
    TrainSpec,
    read_run_config,
    show,
)

__all__ = ["MODEL_FORMAT", "RUN_FILES", "train"]

# What makes a folder a run: refused as --out unless --resume or --force.
RUN_FILES = (
    "ledger.json",
    "checkpoint.pt",
    "metrics.json",
    "metrics.csv",
    RUN_CONFIG_NAME,
    "model.pt",
    "training.png",
)


@dataclass
class _Data:
    """The loaded data: ``input_shape`` is the model's input (after the feature front-end)."""

    train: Any
    test: Any
    info: Any
    input_shape: tuple[int, ...]


def train(spec: TrainSpec) -> int:
    """Run ``clipless train`` for ``spec``; returns the exit status (0, or 1 when the dataset is
    not available). Raises :class:`clipless.spec.OptionError` for an option the run cannot take
    (before anything is written)."""
    from clipless import distributed

    spawned = _launch(spec)
    if spawned is not None:
        return spawned
    lead = distributed.current_rank() == 0
    spec = replace(spec, quiet=spec.quiet or not lead, no_progress=spec.no_progress or not lead)
    started = time.perf_counter()
    out = Path(spec.out)
    if lead:  # refuse before anything is read or written
        _check_out_folder(out, spec)
        _check_tensorboard(spec)
    saved: dict[str, Any] | None = None
    if spec.resume:
        saved = read_run_config(out)
        if lead:  # the other ranks load what rank 0 reads (fit: DataParallel.from_rank0)
            _check_resumable(out)
        spec = spec.adopt(saved, out)
    spec = spec.with_static_defaults()
    device = distributed.init_from_env(_resolve_device(spec.device))
    _full_float32_on_cuda(device)
    spec = spec.with_source()
    loaded = _load_data(spec)
    if loaded is None:
        return 1
    spec, data = _resolve_with_data(spec, loaded, device, saved, out)
    _side_effects_start(spec, out, lead)
    return _train_and_save(spec, data, device, saved, out, lead, started)


def _launch(spec: TrainSpec) -> int | None:
    """Under ``--nproc N`` (not under torchrun): spawn the ranks, after the checks that can fail
    (one clear error before any process starts); ``None``: this process is the run."""
    from clipless import distributed

    try:
        torchrun = distributed.launched_by_torchrun()
        if torchrun and spec.nproc > 1:
            raise OptionError("--nproc", "must be 1 under torchrun (torchrun starts the ranks)")
        if torchrun:  # a malformed torchrun environment is named now, not by a hang
            distributed.check_env()
    except OptionError:
        raise
    except ValueError as exc:
        raise OptionError("environment", str(exc)) from None
    if spec.nproc == 1 or torchrun:
        return None
    out = Path(spec.out)
    _check_out_folder(out, spec)
    _check_tensorboard(spec)
    if spec.resume:  # the same for a resumed run whose saved options conflict
        _check_resumable(out)
        spec.adopt(read_run_config(out), out)
    return distributed.spawn(spec.nproc, _train_rank, spec)


def _train_rank(spec: TrainSpec) -> int:
    """One rank of ``clipless train --nproc N`` (in a spawned process): errors as in main."""
    _thread_only_progress_lock()
    try:  # this process is one rank (its environment says which, as under torchrun)
        return train(replace(spec, nproc=1))
    except OptionError as exc:
        print(f"clipless train: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"clipless train: error: {exc}", file=sys.stderr)
        return 1


def _thread_only_progress_lock() -> None:
    """tqdm's default lock holds a multiprocessing semaphore, which a rank (ended with
    ``os._exit``, clipless.distributed.spawn) never releases: the launcher then warned about
    "leaked semaphore objects". A rank's progress output needs a thread lock only."""
    import threading

    from tqdm.auto import tqdm

    tqdm.set_lock(threading.RLock())


def _full_float32_on_cuda(device: Any) -> None:
    if device.type == "cuda":
        from clipless.optim import full_float32_precision

        # float32 in full precision: CUDA's default TF32 convolutions round beyond the noise's
        # float32 margin, and the private optimizer refuses them
        # (clipless.optim.reduced_float32_precision)
        full_float32_precision()


# ------------------------------------------------------------------------------- the data
def _load_data(spec: TrainSpec) -> tuple[TrainSpec, Any, Any, Any] | None:
    """``(spec, train, test, info)``; ``None`` (after one line on stderr) when the dataset is
    not available. With ``--data`` the spec's ``--input-norm`` defaults to ``sqrt(#columns)``
    (each declared column contributes at most 1)."""
    from clipless.data import DatasetNotFoundError, data_root, load_dataset

    try:
        if spec.data is not None:
            return _load_table(spec)
        if spec.dataset == "adult":
            from clipless.data.tabular import load_adult

            loaded = load_adult(data_root(spec.data_root), True, str(spec.preprocessing))
        else:
            loaded = load_dataset(str(spec.dataset), spec.data_root)
    except DatasetNotFoundError as exc:
        print(f"clipless: error: {exc}", file=sys.stderr)
        return None
    return (spec, *loaded)


def _load_table(spec: TrainSpec) -> tuple[TrainSpec, Any, Any, Any]:
    from clipless.data.folder import is_image_folder
    from clipless.data.table import load_table, max_norm, parse_classes, parse_columns

    if is_image_folder(str(spec.data)):
        return _load_folder(spec)

    columns = parse_columns(str(spec.columns))
    try:
        train, test, info = load_table(
            str(spec.data), str(spec.label), parse_classes(str(spec.classes)), columns,
            spec.test_data,
        )  # fmt: skip
    except OSError as exc:
        raise OptionError("--data", f"cannot read {exc.filename}: {exc.strerror}") from None
    except (ValueError, ImportError) as exc:  # ImportError: a Parquet file without pyarrow
        raise OptionError("--data", str(exc)) from None
    if spec.input_norm is None:
        spec = replace(spec, input_norm=max_norm(columns))
    return spec, train, test, info


def _load_folder(spec: TrainSpec) -> tuple[TrainSpec, Any, Any, Any]:
    """``--data DIR``: an image folder (:mod:`clipless.data.folder`); ``--input-norm`` defaults
    to ``sqrt(C H W)``, the public bound of pixels in ``[0, 1]``."""
    from clipless.data.folder import folder_max_norm, load_image_folder
    from clipless.data.table import parse_classes

    classes = None if spec.classes is None else parse_classes(str(spec.classes))
    try:
        train, test, info = load_image_folder(str(spec.data), classes, spec.test_data)
    except OSError as exc:
        raise OptionError("--data", f"cannot read {exc.filename}: {exc.strerror}") from None
    except ValueError as exc:
        raise OptionError("--data", str(exc)) from None
    if spec.input_norm is None:
        spec = replace(spec, input_norm=folder_max_norm(info.input_shape))
    return spec, train, test, info


def _resolve_with_data(
    spec: TrainSpec,
    loaded: tuple[TrainSpec, Any, Any, Any],
    device: Any,
    saved: Mapping[str, Any] | None,
    out: Path,
) -> tuple[TrainSpec, _Data]:
    """The default rules and checks that need the data, and the feature front-end."""
    spec, train, test, info = loaded
    spec = spec.with_data_defaults(info.name, info.input_shape)
    data = _Data(train, test, info, tuple(info.input_shape))
    if spec.features != "none":
        data = _apply_features(spec, data, device)
    spec = spec.with_training_defaults(len(data.train))
    if saved is not None and saved.get("num_samples") not in (None, len(data.train)):
        raise OptionError(
            "--dataset",
            f"{info.name} now has {len(data.train)} training samples but the run in {out} was "
            f"planned for {saved['num_samples']}: it cannot be resumed on other data",
        )
    spec.check_model_and_budget(info.name, info.input_shape)
    spec = spec.with_input_norm(info.name, info.input_shape)
    from clipless import models

    arch = spec.architecture(data.input_shape, info.num_classes)
    try:  # validates the architecture against the data before any write (no release yet)
        models.build(replace(arch, center_noise=None, whiten_noise=None))
    except ValueError as exc:  # e.g. more convolution stages than the image size allows
        raise OptionError("--hidden", f"{exc} (dataset {info.name})") from None
    return spec, data


def _apply_features(spec: TrainSpec, data: _Data, device: Any) -> _Data:
    """The public feature front-end applied to the train and test images (cached under
    ``DATA_ROOT/features`` unless ``--no-feature-cache``)."""
    import torch

    from clipless.data import data_root
    from clipless.features import apply_features, build_features, cached_features

    try:
        front = build_features(str(spec.features), data.info.input_shape)
    except (ImportError, ValueError) as exc:
        raise OptionError("--features", str(exc)) from None
    assert front is not None
    torch.set_num_threads(spec.threads)
    if not spec.feature_cache:
        if not spec.quiet:
            print(f"clipless train: computing {spec.features} features ...", flush=True)
        train = apply_features(front, data.train, device=device)
        test = apply_features(front, data.test, device=device)
    else:
        cache = data_root(spec.data_root) / "features"
        if not spec.quiet:
            print(
                f"clipless train: {spec.features} features (read from the cache in {cache}, "
                "or computed once and cached there) ...",
                flush=True,
            )
        train, _, _ = cached_features(front, data.train, cache, device=device)
        test, _, _ = cached_features(front, data.test, cache, device=device)
    return _Data(train, test, data.info, tuple(front.output_shape))


# --------------------------------------------------------------------------- the run folder
def run_files(out: Path) -> list[str]:
    """The files of :data:`RUN_FILES` present in ``out`` (empty if it is no folder)."""
    if not out.is_dir():
        return []
    return [name for name in RUN_FILES if (out / name).exists()]


def _check_out_folder(out: Path, spec: TrainSpec) -> None:
    """Refuse an --out that would lose a run, or a --resume with nothing to resume (no writes)."""
    if not str(spec.out).strip():
        raise OptionError("--out", "expected a folder, got an empty string")
    if out.exists() and not out.is_dir():
        raise OptionError("--out", f"{out} exists and is not a folder")
    found = run_files(out)
    if spec.resume:
        _check_resume_folder(out, found)
        return
    if found and not spec.force:
        raise OptionError(
            "--out",
            f"{out} already holds a run ({', '.join(found)}); pass --resume to continue it, or "
            f"--force to start a new one (the old run is moved to {out}.old-<timestamp>, "
            "nothing is deleted), or choose another --out",
        )
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise OptionError(
            "--out", f"cannot create or write {out}: {parent} is not a writable folder"
        )


def _check_tensorboard(spec: TrainSpec) -> None:
    """``--tensorboard DIR``: the package is installed and DIR is a folder or can be one."""
    if spec.tensorboard is None:
        return
    from clipless.callbacks import summary_writer_class

    try:
        summary_writer_class()
    except ImportError as exc:
        raise OptionError("--tensorboard", str(exc)) from None
    folder = Path(spec.tensorboard)
    if not str(spec.tensorboard).strip() or (folder.exists() and not folder.is_dir()):
        raise OptionError("--tensorboard", f"expected a folder, got {spec.tensorboard!r}")


def _check_resume_folder(out: Path, found: list[str]) -> None:
    from clipless.training import CHECKPOINT_NAME

    if not found:
        what = "does not exist" if not out.exists() else "holds no run"
        raise OptionError(
            "--resume",
            f"{out} {what}: there is nothing to resume (run without --resume to start a run)",
        )
    if not (out / CHECKPOINT_NAME).is_file():
        raise OptionError(
            "--resume",
            f"{out} holds a run without {CHECKPOINT_NAME} (it stopped before its first "
            "checkpoint), which cannot be continued; its ledger is left as it is. --force "
            "starts over and moves the old run aside",
        )
    if not (out / RUN_CONFIG_NAME).is_file():
        raise OptionError(
            "--resume",
            f"{out} has no {RUN_CONFIG_NAME} (a run from an older clipless), so its "
            "configuration cannot be checked; --force starts over and moves the old run aside",
        )


def _check_resumable(out: Path) -> None:
    """Refuse (one line, no traceback) a run whose checkpoint or ledger cannot be read."""
    from clipless.accounting import PrivacyLedger
    from clipless.training import CHECKPOINT_NAME, LEDGER_NAME, load_checkpoint

    try:
        load_checkpoint(out / CHECKPOINT_NAME)
    except Exception as exc:  # torch.load raises many kinds on a damaged file
        raise OptionError(
            "--resume",
            f"{out / CHECKPOINT_NAME} cannot be read ({type(exc).__name__}): the run cannot be "
            "continued (--force starts over and keeps the old run aside)",
        ) from None
    ledger = out / LEDGER_NAME
    if ledger.exists():
        try:
            PrivacyLedger.from_json(ledger)
        except (OSError, ValueError) as exc:
            raise OptionError(
                "--resume",
                f"{ledger} is damaged ({' '.join(str(exc).split())[:200]}): the privacy spent by "
                "this run is unknown, so it is not continued (--force starts over and keeps the "
                "old run aside)",
            ) from None


def _move_aside(out: Path) -> Path:
    """Rename the run folder ``out`` to ``out.old-<timestamp>`` (a fresh name); returns it.

    Refused (before anything moves) for a symbolic link (its target would move and the link
    be left dangling) and for a folder holding the working directory (the command's relative
    paths would then write into the moved run).
    """
    if out.is_symlink():
        raise OptionError(
            "--out", f"{out} is a symbolic link; pass the folder it points to with --force"
        )
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        raise OptionError(
            "--out",
            f"{out} holds the working directory; --force would move it from under this "
            "command: run it from outside that folder",
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = resolved.with_name(f"{resolved.name}.old-{stamp}")
    suffix = 1
    while target.exists():
        target = resolved.with_name(f"{resolved.name}.old-{stamp}-{suffix}")
        suffix += 1
    try:
        resolved.rename(target)
    except OSError as exc:
        raise OptionError("--out", f"cannot move the earlier run {out} aside: {exc}") from None
    return target


def _make_writable_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise OptionError("--out", f"cannot write to {out}: {exc.strerror or exc}") from None


def _side_effects_start(spec: TrainSpec, out: Path, lead: bool) -> None:
    """``--force`` moves the earlier run aside; the run folder is made; the seeds are set."""
    import numpy as np
    import torch

    if lead and spec.force and run_files(out):
        aside = _move_aside(out)
        print(
            f"clipless train: --force: moved the earlier run in {out} to {aside} (its ledger is "
            "kept: privacy spent by separate runs on the same data adds up); starting a new run",
            file=sys.stderr,
        )
    if lead:
        _make_writable_folder(out)
    torch.set_num_threads(spec.threads)
    random.seed(spec.seed)
    np.random.seed(spec.seed)  # noqa: NPY002 - seed the legacy global state for third parties
    torch.manual_seed(spec.seed)


# ---------------------------------------------------------------------- model and mechanism
def _build_model(spec: TrainSpec, data: _Data, device: Any, resumed: bool) -> Any:
    """The model (its released input centre and whitening, its loss clip) on ``device``: built
    after seeding, so the initial weights depend on ``--seed`` only."""
    from clipless import models, nn

    center = _input_center(spec, data.train, data.input_shape, resumed=resumed)
    whiten = _input_whitening(spec, data.train, data.input_shape, center, resumed=resumed)
    arch = spec.architecture(data.input_shape, data.info.num_classes)
    built = models.build(arch, center=center, whiten=whiten)
    if spec.loss_clip:
        built.append(nn.LossGradientClip(spec.loss_clip))
    return built.to(device)


def _make_private(
    spec: TrainSpec, model: Any, data: _Data, saved: Mapping[str, Any] | None
) -> tuple[Any, Any, Any, Any, Any]:
    """``(engine, model, optimizer, loader, loss)`` from ``PrivacyEngine.make_private``: a
    resumed run keeps the noise multiplier it was calibrated with (saved in config.json); a new
    run calibrates it for --epsilon over --epochs."""
    import torch

    from clipless import nn
    from clipless.accounting import ReleasesExceedTargetError
    from clipless.engine import MechanismSpec, PrivacyEngine, RunOptions
    from clipless.sampling import poisson_loader

    assert spec.lr is not None and spec.batch_size is not None  # resolved by the spec
    loss = nn.CrossEntropyLoss(temperature=spec.temperature)
    optimizer: torch.optim.Optimizer
    if spec.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=spec.lr)
    # Poisson sampling and the DP noise are seeded from the OS CSPRNG unless --unsafe-seed: the
    # amplification-by-sampling argument assumes the batches are secret.
    sampling_generator = torch.Generator()
    if spec.unsafe_seed is not None:
        sampling_generator.manual_seed(spec.unsafe_seed + 1)
    else:
        sampling_generator.manual_seed(secrets.randbits(63))
    rate = min(1.0, spec.batch_size / len(data.train))
    poisson = poisson_loader(data.train, sample_rate=rate, generator=sampling_generator)
    engine = PrivacyEngine(accountant=spec.accountant, seed=spec.unsafe_seed)
    calibration: dict[str, Any] = (
        {"noise_multiplier": float(saved["noise_multiplier"])}
        if saved is not None
        else {"target_epsilon": spec.epsilon, "target_delta": spec.delta, "epochs": spec.epochs}
    )
    try:
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=poisson,
            loss=loss,
            mechanism=MechanismSpec(
                max_norm=spec.max_norm,
                constraint=None if spec.constraint == "none" else spec.constraint,
                scaling=spec.scaling,
                noise=spec.noise,
                neighbouring=spec.neighbouring,
            ),
            options=RunOptions(input_shape=data.input_shape, certify_every=spec.certify_every),
            **calibration,
        )
    except ReleasesExceedTargetError as exc:
        releases = [o for o in ("center_noise", "whiten_noise") if getattr(spec, o)]
        raise OptionError(
            " / ".join(RUN_OPTIONS[o] for o in releases) or "--epsilon",
            f"{exc}: give a larger noise multiplier (or a larger --epsilon)",
        ) from None
    return engine, model, optimizer, loader, loss


def _input_center(
    spec: TrainSpec, train: Any, input_shape: tuple[int, ...], *, resumed: bool
) -> Any:
    """The released input mean of ``--center-noise`` (``None`` without centring).

    A new run releases it here (noise from the OS CSPRNG, or from ``--unsafe-seed``); the engine
    composes the release with the steps and the ledger records it before the first step. A
    resumed run gets a placeholder: the checkpoint restores the mean released at its start (a new
    release would spend budget again).
    """
    import torch

    from clipless import distributed

    if not spec.center_noise:
        return None
    if resumed or distributed.current_rank() != 0:  # other ranks: rank 0's mean is broadcast
        return torch.zeros(input_shape)
    from clipless.features import release_mean

    generator = None
    if spec.unsafe_seed is not None:
        generator = torch.Generator().manual_seed(spec.unsafe_seed + 2)
    return release_mean(train, spec.center_noise, generator=generator)


def _input_whitening(
    spec: TrainSpec,
    train: Any,
    input_shape: tuple[int, ...],
    center: Any,
    *,
    resumed: bool,
) -> Any:
    """The channel mixing of ``--whiten-noise`` (``None`` without whitening), as
    :func:`_input_center`: released here by a new run's rank 0, a placeholder otherwise."""
    import torch

    from clipless import distributed

    if not spec.whiten_noise:
        return None
    if resumed or distributed.current_rank() != 0:
        return whiten_placeholder(input_shape)
    from clipless.features import release_channel_moment, whitening

    generator = None
    if spec.unsafe_seed is not None:
        generator = torch.Generator().manual_seed(spec.unsafe_seed + 3)
    assert spec.whiten_shrink is not None  # set with --whiten-noise (TrainSpec)
    moment = release_channel_moment(train, spec.whiten_noise, generator=generator)
    return whitening(
        moment,
        center,
        spec.whiten_shrink,
        noise_multiplier=spec.whiten_noise,
        num_samples=len(train),
    )


def premap_inputs(model: Any, *datasets: Any) -> None:
    """Apply the model's leading ``InputNorm`` map (its released centre and whitening) to the
    feature tensors once, in place (:meth:`clipless.nn.InputNorm.premap_`): the layer then only
    projects, which keeps the certified input bound. Only the tensors this run computed (the
    features) are mapped in place; a new run only (a resumed run's buffers come from its
    checkpoint inside ``fit``, so it maps its batches as it goes)."""
    from clipless import nn
    from clipless.bounds import _leading_module

    first = _leading_module(model)  # the layer the data enters (make_private requires one)
    if not isinstance(first, nn.InputNorm) or (first.center is None and first.whiten is None):
        return
    for data in datasets:
        first.premap_(data.tensors[0])


# ------------------------------------------------------------------------- training and saving
def _train_and_save(
    spec: TrainSpec,
    data: _Data,
    device: Any,
    saved: Mapping[str, Any] | None,
    out: Path,
    lead: bool,
    started: float,
) -> int:
    from clipless import distributed

    model = _build_model(spec, data, device, resumed=saved is not None)
    engine, model, optimizer, loader, loss = _make_private(spec, model, data, saved)
    if distributed.launched_by_torchrun():
        distributed.make_data_parallel(optimizer, loader)
    # the certificate is stated for the features the model maps (clipless.robustness): keep
    # them before the premapping below replaces them in place
    raw_test_x = data.test.tensors[0]
    if spec.features != "none":
        raw_test_x = raw_test_x.clone()
        if saved is None:
            premap_inputs(model, data.train, data.test)
    config = engine.config
    if saved is not None and config["sample_rate"] != saved.get("sample_rate"):
        raise OptionError(
            "--batch-size",
            f"gives sample rate {config['sample_rate']} but the run in {out} was planned with "
            f"{saved.get('sample_rate')}",
        )
    run_config = _run_config(spec, data, config, device, resumed=saved is not None)
    if saved is None and lead:  # before the first step: a later --resume reloads this run
        from clipless._io import atomic_write

        text = json.dumps(spec.saved_config(run_config), indent=2) + "\n"
        atomic_write(out / RUN_CONFIG_NAME, text, mode=0o600)
    if not spec.quiet:
        print(_banner(spec, data, config, device, out, resumed=saved is not None), flush=True)
    fitted = (engine, model, optimizer, loader, loss)
    if not lead:  # another rank: the same steps, nothing evaluated or written
        _fit(spec, fitted, out, resume=out if saved is not None else False)
        return 0
    result = _fit_save_certify(spec, data, fitted, saved is not None, run_config, out, raw_test_x)
    elapsed = time.perf_counter() - started
    print(
        f"final: test_acc {_pct(result.final.get('test_accuracy'))}  epsilon "
        f"{result.epsilon:.4f} (delta {spec.delta:g}, {spec.accountant}, {spec.neighbouring}; "
        f"budget {spec.epsilon:g})  steps {result.steps}  stop: {result.stop_reason}  "
        f"time {elapsed:.1f}s  -> {out}",
        flush=True,
    )
    return 0


def _fit_save_certify(
    spec: TrainSpec,
    data: _Data,
    fitted: tuple[Any, Any, Any, Any, Any],
    resumed: bool,
    run_config: Mapping[str, Any],
    out: Path,
    raw_test_x: Any,
) -> Any:
    """Rank 0's training, ``model.pt`` and the certified robust accuracy, each epoch's record
    and the certificate also to the ``--tensorboard`` logger; the fit's result."""
    from clipless._robustness_cli import train_robustness

    board = None
    if spec.tensorboard is not None:
        from clipless.callbacks import TensorBoardLogger

        board = TensorBoardLogger(spec.tensorboard)
    try:
        result = _fit(
            spec, fitted, out, resume=resumed, data=data, run_config=run_config, board=board
        )
        _save_run(spec, data, fitted, result, run_config, out)
        robust = train_robustness(
            out, raw_test_x, data.test.tensors[1], str(spec.features), spec.quiet
        )
        if board is not None and result.history:
            board.robustness(robust, int(result.history[-1]["epoch"]))
    finally:
        if board is not None:
            board.close()
    return result


def _run_config(
    spec: TrainSpec, data: _Data, config: Mapping[str, Any], device: Any, *, resumed: bool
) -> dict[str, Any]:
    import clipless

    return {
        **spec.run_config(
            data.info.name, data.input_shape, data.info.num_classes, config, str(device)
        ),
        "clipless_version": clipless.__version__,
        "git_commit": git_commit(),
        "resumed": resumed,
    }


def _banner(
    spec: TrainSpec,
    data: _Data,
    config: Mapping[str, Any],
    device: Any,
    out: Path,
    *,
    resumed: bool,
) -> str:
    return (
        f"clipless train: {data.info.name} (n={len(data.train)} train, {len(data.test)} test), "
        f"{'resuming' if resumed else 'new run'} in {out}, model {spec.model}"
        f"{' ' + show(spec.hidden) if spec.hidden else ''} on {device}, "
        f"target epsilon={spec.epsilon:g} "
        f"delta={spec.delta:g}, sigma={config.get('effective_noise_multiplier', math.nan):.3f}"
        f", q={config.get('sample_rate', math.nan):.4f}, epochs={spec.epochs}"
    )


def _fit(
    spec: TrainSpec,
    fitted: tuple[Any, Any, Any, Any, Any],
    out: Path,
    *,
    resume: bool | Path,
    data: _Data | None = None,
    run_config: Mapping[str, Any] | None = None,
    board: Any = None,
) -> Any:
    """:func:`clipless.training.fit` of the run; without ``data`` (a rank other than 0) no
    evaluation, checkpoint, metrics or progress; ``board``: the ``--tensorboard`` logger."""
    from torch.utils.data import DataLoader

    from clipless.training import fit

    engine, model, optimizer, loader, loss = fitted
    common = {"engine": engine, "epochs": spec.epochs, "delta": spec.delta}
    common["epsilon_budget"] = spec.epsilon
    if data is None or run_config is None:
        return fit(model, optimizer, loader, loss, **common, resume=resume, progress=False)

    def on_epoch_end(record: dict[str, Any]) -> None:
        _merge_config(out / "metrics.json", run_config)  # fit has just written it
        if board is not None:
            board(record)
        if not spec.quiet:
            _print_epoch(record, spec.epochs)

    return fit(
        model,
        optimizer,
        loader,
        loss,
        **common,
        eval_loader=DataLoader(data.test, batch_size=1024),
        checkpoint_dir=out,
        resume=resume,
        ema_decay=spec.ema or None,
        metrics_path=out / "metrics.json",
        progress=not spec.no_progress and sys.stderr.isatty(),
        on_epoch_end=on_epoch_end,
    )


def _print_epoch(record: Mapping[str, Any], epochs: int) -> None:
    from tqdm.auto import tqdm

    tqdm.write(
        f"epoch {record['epoch']:3d}/{epochs}"
        f"  train_acc {_pct(record.get('train_accuracy'))}"
        f"  test_acc {_pct(record.get('test_accuracy'))}"
        f"  epsilon {record['epsilon']:.4f}"
        + ("" if record.get("complete", True) else "  (stopped: budget)")
    )
    sys.stdout.flush()


def _save_run(
    spec: TrainSpec,
    data: _Data,
    fitted: tuple[Any, Any, Any, Any, Any],
    result: Any,
    run_config: Mapping[str, Any],
    out: Path,
) -> None:
    """The ledger, the metrics (with the run configuration), ``model.pt`` and the figure."""
    import torch

    from clipless._io import atomic_write_with
    from clipless.training import plot_training, write_metrics

    engine, model = fitted[0], fitted[1]
    assert engine.ledger is not None
    engine.ledger.to_json(out / "ledger.json", mode=0o600)
    metrics = result.to_dict()
    metrics["config"] = {**metrics["config"], **run_config}
    write_metrics(metrics, out / "metrics.json")
    evaluated = result.ema_model if result.ema_model is not None else model
    model_file = {
        "format": MODEL_FORMAT,
        "architecture": _model_architecture(spec, data),
        "state_dict": {k: v.detach().cpu() for k, v in evaluated.state_dict().items()},
        "dataset": data.info.name,
        "epsilon": result.epsilon,
        "delta": result.delta,
    }
    # atomically: a run killed while saving keeps its previous model.pt (or none), never a torn
    # one; owner-only like every file of the run (docs/cli.md): publishing is the user's decision
    atomic_write_with(out / "model.pt", lambda handle: torch.save(model_file, handle), mode=0o600)
    plot_training(result, out / "training.png")


def _model_architecture(spec: TrainSpec, data: _Data) -> dict[str, Any]:
    """``model.pt``'s ``architecture``: the model's, and the data transform that feeds it."""
    arch = spec.architecture(data.input_shape, data.info.num_classes).to_dict()
    return {
        "kind": arch["kind"],
        "features": spec.features,
        "preprocessing": spec.preprocessing,  # adult: load_adult(preprocessing=...) feeds it
        "image_shape": list(data.info.input_shape),
        **{k: v for k, v in arch.items() if k != "kind"},
    }


def _merge_config(metrics_path: Path, run_config: Mapping[str, Any]) -> None:
    """Add the run configuration to the ``config`` of a ``metrics.json`` written by ``fit``."""
    from clipless.training import write_metrics

    data = json.loads(metrics_path.read_text(encoding="utf-8"))
    data["config"] = {**(data.get("config") or {}), **run_config}
    write_metrics(data, metrics_path)


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the checkout clipless is imported from, else ``None``."""
    import clipless

    source = Path(clipless.__file__).resolve().parent
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", "cli.py"],
            cwd=source,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if tracked.returncode != 0:  # not a checkout of clipless (e.g. installed in a repo)
            return None
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=source,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def _pct(value: Any) -> str:
    return "   -  " if value is None else f"{100.0 * float(value):5.1f}%"
