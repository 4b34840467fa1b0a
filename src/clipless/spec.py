"""The training specification of ``clipless train``: a frozen, versioned value.

:class:`TrainSpec` holds every option of the command (:data:`clipless._train_options.TRAIN_OPTIONS`
defines each one once). It resolves the command's default rules (those that need the data in a
second step, once it is loaded), checks itself (each rule in one method, an :class:`OptionError`
naming the option) and serialises the run configuration (``config.json``, format
:data:`RUN_CONFIG_FORMAT`) that ``--resume`` reads back. :func:`clipless.pipeline.train` runs it.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from clipless._train_options import (
    ADULT_LR,
    ADULT_PREPROCESSING,
    DEFAULT_HIDDEN,
    DEFAULT_LR,
    FEATURES_INPUT_NORM,
    FEATURES_LOSS_CLIP,
    FEATURES_LR,
    IMAGE_MODELS,
    LOSS_CLIP,
    NO_LEGACY,
    PLD_MAX_EPSILON,
    TRAIN_OPTIONS,
    live_choices,
    option,
)

__all__ = [
    "LEGACY_OPTIONS",
    "RUN_CONFIG_FORMAT",
    "RUN_CONFIG_NAME",
    "RUN_OPTIONS",
    "SPEC_VERSION",
    "OptionError",
    "TrainSpec",
    "default_batch_size",
    "default_features",
    "default_input_norm",
    "read_run_config",
    "show",
]

SPEC_VERSION = 1
RUN_CONFIG_NAME = "config.json"
RUN_CONFIG_FORMAT = f"clipless-run-v{SPEC_VERSION}"


class OptionError(ValueError):
    """A ``clipless train`` option with a value the run cannot take (``str``: ``argument
    --flag: what is wrong``)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"argument {argument}: {message}")
        self.argument = argument


@dataclass(frozen=True)
class TrainSpec:
    """Every option of ``clipless train`` (``None``: the default rule decides, see
    :meth:`with_static_defaults`, :meth:`with_data_defaults` and :meth:`with_training_defaults`).

    The first fields define the run (:data:`RUN_OPTIONS`: a resumed run keeps them); the others
    say where and how it runs. ``given`` names the options written on the command line.
    """

    version: ClassVar[int] = SPEC_VERSION

    dataset: str | None = "breast-cancer"
    data: str | None = None
    test_data: str | None = None
    label: str | None = None
    classes: str | None = None
    columns: str | None = None
    preprocessing: str | None = None
    features: str | None = None
    model: str | None = None
    hidden: tuple[int, ...] | None = None
    pool: str = "l2"
    bias: bool | None = None
    input_norm: float | None = None
    input_mode: str | None = None
    center_noise: float | None = None
    whiten_noise: float | None = None
    whiten_shrink: float | None = None
    temperature: float = 0.1
    loss_clip: float | None = None
    epsilon: float = 1.0
    delta: float = 1e-5
    accountant: str = "pld"
    neighbouring: str = "add_remove"
    noise: str = "global"
    scaling: str = "per-sample"
    constraint: str | None = None
    max_norm: float = 1.0
    epochs: int = 30
    batch_size: int | None = None
    lr: float | None = None
    optimizer: str = "adam"
    momentum: float = 0.9
    ema: float = 0.9
    seed: int = 0
    unsafe_seed: int | None = None
    # where and how the run runs
    data_root: str | None = None
    out: str = "runs/demo"
    tensorboard: str | None = None
    resume: bool = False
    force: bool = False
    device: str = "cpu"
    feature_cache: bool = True
    threads: int = 1
    certify_every: int = 1
    nproc: int = 1
    no_progress: bool = False
    quiet: bool = False
    given: frozenset[str] | None = None

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> TrainSpec:
        """The spec of parsed ``clipless train`` arguments (``args.given``: the options written
        on the command line; without it every run option counts as given)."""
        names = {f.name for f in fields(cls)} - {"given"}
        values = {k: v for k, v in vars(args).items() if k in names}
        given = getattr(args, "given", None)
        return cls(**values, given=None if given is None else frozenset(given))

    @property
    def given_options(self) -> frozenset[str]:
        return frozenset(RUN_OPTIONS) if self.given is None else self.given

    def run_options(self) -> dict[str, Any]:
        """The options that define the run, as JSON values (``config.json``'s ``options``)."""
        return {dest: _comparable(getattr(self, dest)) for dest in RUN_OPTIONS}

    # ---------------------------------------------------------------------------- resuming
    def adopt(self, saved: Mapping[str, Any], out: Path) -> TrainSpec:
        """The saved run's options (``read_run_config``); refuses a given one that differs."""
        options = {**LEGACY_OPTIONS, **saved["options"]}
        if "preprocessing" not in saved["options"]:
            options["preprocessing"] = _legacy_preprocessing(str(options["dataset"]))
        given = self.given_options
        differ = [
            f"{flag} (run: {show(options[dest])}, given: {show(getattr(self, dest))})"
            for dest, flag in RUN_OPTIONS.items()
            if dest in given and _comparable(getattr(self, dest)) != _comparable(options[dest])
        ]
        if differ:
            raise OptionError(
                differ[0].split(" ", 1)[0],
                f"the run in {out} was planned with other values: {'; '.join(differ)}. A resumed "
                "run keeps its configuration (its noise was calibrated for it): leave these "
                "options out, or start a new run (--force or another --out)",
            )
        values: dict[str, Any] = {
            d: tuple(options[d]) if d == "hidden" else options[d] for d in RUN_OPTIONS
        }
        if "device" not in given and isinstance(saved.get("device"), str):
            values["device"] = saved["device"]
        return replace(self, **values)

    # ----------------------------------------------------------------------- default rules
    def with_static_defaults(self) -> TrainSpec:
        """The rules that need no data: ``--model`` linear, ``--hidden`` per model,
        ``--constraint`` none for the linear model (one layer needs none), else orthogonal."""
        model = self.model or "linear"
        hidden = DEFAULT_HIDDEN[model] if self.hidden is None else self.hidden
        constraint = self.constraint
        if constraint is None:
            constraint = "none" if model == "linear" else "orthogonal"
        return replace(self, model=model, hidden=hidden, constraint=constraint)

    def with_source(self) -> TrainSpec:
        """Checks where the data comes from (``--data`` or ``--dataset``, ``--data-root``,
        ``--preprocessing``) and sets adult's preprocessing."""
        spec = self._with_table_source()
        spec.check_data_root()
        if spec.dataset != "adult" and spec.preprocessing is not None:
            raise OptionError("--preprocessing", f"is for --dataset adult only, not {spec.dataset}")
        if spec.dataset == "adult" and spec.preprocessing is None:
            return replace(spec, preprocessing=ADULT_PREPROCESSING)
        return spec

    def _with_table_source(self) -> TrainSpec:
        """With ``--data``: no ``--dataset``; a table (CSV or Parquet) needs ``--label``,
        ``--classes`` and ``--columns``, an image folder none of them (``--classes`` selects its
        subfolders)."""
        if self.data is None:
            for dest in ("test_data", "label", "classes", "columns"):
                if getattr(self, dest) is not None:
                    raise OptionError(
                        RUN_OPTIONS[dest], "is for --data (your own table or images) only"
                    )
            return self
        if "dataset" in self.given_options and self.dataset is not None:
            raise OptionError("--data", "give --dataset or --data, not both")
        from clipless.data.folder import is_image_folder

        if is_image_folder(self.data):  # one subfolder per class: no columns, classes optional
            for dest in ("label", "columns"):
                if getattr(self, dest) is not None:
                    raise OptionError(
                        RUN_OPTIONS[dest], "is for a table --data, not an image folder"
                    )
            return replace(self, dataset=None)
        for dest in ("label", "classes", "columns"):
            if getattr(self, dest) is None:
                raise OptionError(RUN_OPTIONS[dest], "is required with --data")
        return replace(self, dataset=None)

    def check_data_root(self) -> None:
        """A ``--data-root`` that does not exist is refused (a typo would otherwise create a
        new cache there and download into it)."""
        if self.data_root is not None and not Path(self.data_root).expanduser().is_dir():
            raise OptionError(
                "--data-root",
                f"{self.data_root} is not a directory (a typo?): create it first to use it as "
                "the dataset cache, or leave --data-root out ($CLIPLESS_DATA or "
                "~/.cache/clipless)",
            )

    def with_data_defaults(self, name: str, image_shape: Sequence[int]) -> TrainSpec:
        """The rules that follow the data's shape: ``--features`` (then ``--bias``,
        ``--input-mode``, ``--loss-clip``, ``--center-noise``, ``--whiten-noise`` and
        ``--whiten-shrink``, which follow the features)."""
        from clipless.features import CENTER_NOISE, WHITEN_NOISE, WHITEN_SHRINK

        features = self.features or default_features(str(self.model), image_shape)
        plain = features == "none"
        spec = replace(
            self,
            features=features,
            bias=self.model == "linear" and plain if self.bias is None else self.bias,
            input_mode=self.input_mode or ("ball" if plain else "sphere"),
            loss_clip=_default(self.loss_clip, LOSS_CLIP if plain else FEATURES_LOSS_CLIP),
            center_noise=_default(self.center_noise, 0.0 if plain else CENTER_NOISE),
            whiten_noise=_default(self.whiten_noise, 0.0 if plain else WHITEN_NOISE),
        )
        if spec.whiten_shrink is None and spec.whiten_noise:
            spec = replace(spec, whiten_shrink=WHITEN_SHRINK)
        elif spec.whiten_shrink is not None and not spec.whiten_noise:
            raise OptionError("--whiten-shrink", "needs --whiten-noise > 0 (whitening is off)")
        if not plain and len(image_shape) != 3:
            raise OptionError(
                "--features",
                f"{features} needs an image dataset (digits, fashion-mnist, mnist-10k); "
                f"{name} has input shape {tuple(image_shape)}",
            )
        return spec

    def with_training_defaults(self, num_samples: int) -> TrainSpec:
        """``--lr`` (adult's, the features', else the general default) and ``--batch-size``
        (:func:`default_batch_size`, checked against the training set's size)."""
        lr = self.lr
        if lr is None:
            plain = DEFAULT_LR if self.features == "none" else FEATURES_LR
            lr = ADULT_LR if self.dataset == "adult" else plain
        batch = default_batch_size(num_samples) if self.batch_size is None else self.batch_size
        if batch > num_samples:
            raise OptionError(
                "--batch-size",
                f"must be at most the training set size {num_samples}; got {batch}",
            )
        return replace(self, lr=lr, batch_size=batch)

    def with_input_norm(self, name: str, image_shape: Sequence[int]) -> TrainSpec:
        """``--input-norm``: a public bound of the dataset's transform, or with features the
        sphere radius (after :meth:`check_model_and_budget`)."""
        if self.input_norm is not None:
            return self
        if self.features != "none":
            return replace(self, input_norm=FEATURES_INPUT_NORM)
        return replace(self, input_norm=default_input_norm(name, image_shape, self.preprocessing))

    # ------------------------------------------------------------------------------ checks
    def check_model_and_budget(self, name: str, image_shape: Sequence[int]) -> None:
        """An image model needs images; the PLD accountant calibrates at most
        :data:`PLD_MAX_EPSILON`."""
        if self.model in IMAGE_MODELS and len(image_shape) != 3:
            raise OptionError(
                "--model",
                f"{self.model} needs an image dataset (digits, fashion-mnist, mnist-10k); "
                f"{name} has input shape {tuple(image_shape)} (use --model mlp)",
            )
        if self.accountant == "pld" and self.epsilon > PLD_MAX_EPSILON:
            raise OptionError(
                "--epsilon",
                f"at most {PLD_MAX_EPSILON:g} with the PLD accountant (its calibration at the "
                f"tiny noise of a larger budget does not finish); got {self.epsilon:g}: use "
                "--accountant rdp for such budgets",
            )

    # ------------------------------------------------------------------------ serialising
    def architecture(self, input_shape: Sequence[int], num_classes: int) -> Any:
        """The :class:`clipless.models.Architecture` of this (resolved) spec."""
        from clipless.models import Architecture

        return Architecture(
            kind=str(self.model),
            input_shape=tuple(input_shape),
            hidden=tuple(self.hidden or ()),
            num_classes=num_classes,
            input_norm=float(self.input_norm or 0.0),
            bias=bool(self.bias),
            pool=self.pool,
            input_mode=str(self.input_mode),
            center_noise=self.center_noise or None,
            whiten_noise=self.whiten_noise or None,
        )

    def run_config(
        self,
        name: str,
        input_shape: Sequence[int],
        num_classes: int,
        engine_config: Mapping[str, Any],
        device: str,
    ) -> dict[str, Any]:
        """The resolved run as JSON (``metrics.json``'s ``config``; ``config.json`` adds
        :meth:`run_options` and the format)."""
        sgd = self.optimizer == "sgd"
        return {
            "dataset": name,
            "preprocessing": self.preprocessing,
            "model": self.model,
            "hidden": list(self.hidden or ()),
            "pool": self.pool if self.model in ("cnn", "resnet") else None,
            "bias": bool(self.bias),
            "features": self.features,
            "input_shape": list(input_shape),
            "num_classes": num_classes,
            "input_norm": float(self.input_norm or 0.0),
            "input_mode": self.input_mode,
            "center_noise": self.center_noise or None,
            "whiten_noise": self.whiten_noise or None,
            "whiten_shrink": self.whiten_shrink,
            "temperature": self.temperature,
            "loss_clip": self.loss_clip or None,
            "lr": self.lr,
            "optimizer": self.optimizer,
            "momentum": self.momentum if sgd else None,
            "batch_size": self.batch_size,
            "sample_rate": engine_config["sample_rate"],
            "num_samples": engine_config["num_samples"],
            "epochs": self.epochs,
            "seed": self.seed,
            "unsafe_seed": self.unsafe_seed,
            "target_epsilon": self.epsilon,
            "delta": self.delta,
            "noise_multiplier": engine_config["noise_multiplier"],
            "effective_noise_multiplier": engine_config["effective_noise_multiplier"],
            "accountant": self.accountant,
            "neighbouring": self.neighbouring,
            "constraint": self.constraint,
            "max_norm": self.max_norm,
            "scaling": self.scaling,
            "noise": self.noise,
            "ema": self.ema,
            "device": device,
        }

    def saved_config(self, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """``config.json``: what :func:`read_run_config` reads back on ``--resume``."""
        extra = {k: v for k, v in run_config.items() if k != "resumed"}
        return {"format": RUN_CONFIG_FORMAT, "options": self.run_options(), **extra}


RUN_OPTIONS: dict[str, str] = {
    f.name: option(f.name).flag
    for f in fields(TrainSpec)
    if f.name != "given" and option(f.name).run
}
"""The options that define a run (its data, model, mechanism, noise calibration and
optimisation), by field name: a resumed run keeps them; a different value with ``--resume`` is
refused."""
LEGACY_OPTIONS: dict[str, Any] = {
    o.dest: o.legacy for o in TRAIN_OPTIONS if o.run and o.legacy is not NO_LEGACY
}
"""Run options added after the run folder format was in use: a saved run without them was
trained with these values (so resuming it reproduces it)."""


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _comparable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def _legacy_preprocessing(dataset: str) -> str | None:
    """The transform of a run saved before ``--preprocessing`` existed (the loader's default)."""
    return "public-ranges" if dataset == "adult" else None


def show(value: Any) -> str:
    """An option's value as the command line writes it."""
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return "None" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def default_features(model: str, input_shape: Sequence[int]) -> str:
    """``"scatter"`` for a linear model on images of at least 16 x 16 pixels, else ``"none"``.

    On Fashion-MNIST at epsilon 3 a linear model on scattering features reaches ~89.5% against
    ~83.4% on pixels (``benchmarks/RESULTS.md`` section 14); the deeper models keep their pixels.
    """
    shape = tuple(int(v) for v in input_shape)
    if model == "linear" and len(shape) == 3 and min(shape[1:]) >= 16:
        return "scatter"
    return "none"


def default_batch_size(num_samples: int) -> int:
    """``n / 16`` clamped to ``[128, 2048]`` and at most ``n``: the expected batch of a new run.

    Larger batches divide the same noise among more samples; on Adult (n = 32,561) 2,048-4,096
    beat 128 by 3 points at epsilon 0.414 (``benchmarks/RESULTS.md``).
    """
    return min(int(num_samples), max(128, min(2048, int(num_samples) // 16)))


def default_input_norm(
    dataset: str, input_shape: Sequence[int], preprocessing: str | None = None
) -> float:
    """A public bound on the inputs' norm under the dataset's fixed transform."""
    features = math.prod(int(s) for s in input_shape)
    if dataset == "adult":
        # features in [0, 1], at most one 1 per one-hot group: sqrt(13) for public-ranges (5
        # numeric + 8 categorical columns), sqrt(17) with public-bins(-fine) (+ 4 binned columns)
        from clipless.data.tabular import adult_max_norm

        return adult_max_norm(preprocessing or "public-ranges")
    if dataset == "german-credit":
        # 7 numeric features in [0, 1] and 13 one-hot groups with at most one 1 each
        return math.sqrt(20.0)
    if dataset in ("digits", "fashion-mnist", "mnist-10k"):
        # pixels in [0, 1]: a quarter of the worst case sqrt(d); brighter images are projected
        # onto the ball (a per-sample rescale, applied identically in training and inference)
        return max(1.0, math.sqrt(features) / 4.0)
    return max(1.0, math.sqrt(features))


# ------------------------------------------------------------------------ reading a saved run
def read_run_config(out: Path) -> dict[str, Any]:
    """``out/config.json`` checked: its format, every run option present (or legacy) and of a
    value the command line accepts, and a positive noise multiplier."""
    path = out / RUN_CONFIG_NAME
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OptionError("--resume", f"cannot read {path}: {exc}") from None
    if (
        not isinstance(saved, dict)
        or saved.get("format") != RUN_CONFIG_FORMAT
        or not isinstance(saved.get("options"), dict)
    ):
        raise OptionError(
            "--resume", f"{path} is not a run configuration written by clipless train"
        )
    missing = [
        flag
        for dest, flag in RUN_OPTIONS.items()
        if dest not in saved["options"] and dest not in LEGACY_OPTIONS
    ]
    if missing:
        raise OptionError("--resume", f"{path} lacks {', '.join(missing)}")
    sigma = saved.get("noise_multiplier")
    if (
        isinstance(sigma, bool)
        or not isinstance(sigma, int | float)
        or not (math.isfinite(sigma) and sigma > 0)
    ):
        raise OptionError(
            "--resume", f"{path}: noise_multiplier must be a number > 0, got {sigma!r}"
        )
    for dest, flag in RUN_OPTIONS.items():
        value = saved["options"].get(dest)
        if value is not None and not _valid_saved(dest, value):
            raise OptionError(
                "--resume", f"{path}: the saved {flag} ({value!r}) is not a valid value"
            )
    return saved


def _valid_saved(dest: str, value: Any) -> bool:
    """Whether a saved run option passes the command line's own check (a config.json edited
    into the wrong types is named, not a traceback later)."""
    if dest == "hidden":
        return isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
        )
    if dest == "bias":
        return isinstance(value, bool)
    if isinstance(value, bool | list | dict):
        return False
    kwargs = option(dest).kwargs
    choices = live_choices(kwargs.get("choices"))
    if choices is not None and value not in choices:
        return False
    parse = kwargs.get("type")
    if callable(parse):
        try:
            parse(str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            return False
    return True
