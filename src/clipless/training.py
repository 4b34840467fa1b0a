"""The training loop: :func:`fit` (epochs, evaluation, budget stop, checkpoints, EMA, augmentation
multiplicity, metrics) and :func:`plot_training`.

One front door::

    engine = clipless.PrivacyEngine(accountant="pld")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
                                                   data_loader=loader, loss=loss, ...)
    result = fit(model, optimizer, loader, loss, engine=engine, epochs=30, delta=1e-5,
                 eval_loader=test_loader, epsilon_budget=1.0, checkpoint_dir="runs/x")

What is private and what is not
-------------------------------
* The weights after every step, their projection, their EMA (a fixed function of the private
  iterates: post-processing) and every metric computed on *public* evaluation data are covered by
  the DP guarantee the ledger reports.
* The training loss and accuracy shown in the progress bar and stored in the metrics are computed
  on the private training batches: they are **not** DP releases. They are diagnostics for the
  operator; do not publish them as part of a private release (or evaluate on public data instead).

Budget
------
With ``epsilon_budget``, :meth:`clipless.PrivacyEngine.would_exceed` is asked before *every* step
(including steps on empty Poisson batches, which still add noise and count); training stops before
the first step that would push epsilon above the budget (or past the number of steps the engine's
budget was planned for), then writes the ledger and a checkpoint and
reports ``stop_reason="budget"``. (The ledger caches the number of affordable steps, so asking
before every step is cheap.)

Augmentation multiplicity
-------------------------
With ``augmult=K``, every sample of the Poisson batch is augmented ``K`` times and the
optimizer's scaled kernels divide every copy's parameter-gradient contribution by ``K``
(:meth:`clipless.optim.DPOptimizer.sample_multiplicity`) *after* each copy's cotangent has been
clipped, so sample ``i``'s contribution to a layer's gradient is the mean of ``K`` contributions
of norm at most the layer's sensitivity ``G_k``, hence at most ``G_k`` (triangle inequality):
the noise and the accounting are unchanged (De et al. 2022, section 3.2). This needs the model
to treat rows independently (every clipless layer does) and each augmented row to depend on its
own example only: ``augment`` runs on every row alone (:func:`per_sample`), so batch-mixing
augmentations (mixup, CutMix) cannot run in the private loop.

Checkpoints and resume
----------------------
Each epoch (and at a budget stop) ``checkpoint_dir/checkpoint.pt`` is written atomically with the
model, optimizer, engine (ledger and generator states), EMA, the global RNG states, the data
loader's generators, the epoch and the metrics; it is read with ``torch.load(weights_only=True)``.
The ledger is written *before* every step's noise is drawn (write-ahead accounting), to
``checkpoint_dir/ledger.json`` or to ``make_private``'s ``ledger_path``, so even a hard kill loses
no accounting. ``resume`` keeps the largest of the ledgers that continue the checkpoint's: steps
taken after the last checkpoint were spent, even though their weights are lost. A seeded engine
resumes step for step as the run that was never interrupted; an unseeded one (the default)
reseeds its noise and sampling generators from the OS CSPRNG on every resume (the saved states
would draw a lost step's noise again, and two runs resumed from one checkpoint would draw the
same noise on different gradients). ``epochs`` counts from the start of the run.
"""

from __future__ import annotations

import copy
import csv
import functools
import io
import json
import math
import numbers
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clipless import _shards
from clipless._io import atomic_write, atomic_write_with
from clipless.distributed import shard
from clipless.nn import LossGradientClip
from clipless.optim import DPOptimizer, PrivacyContractError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from clipless.engine import PrivacyEngine

__all__ = [
    "CHECKPOINT_NAME",
    "LEDGER_NAME",
    "FitResult",
    "WeightEMA",
    "evaluate",
    "fit",
    "load_checkpoint",
    "per_sample",
    "plot_training",
    "save_checkpoint",
    "training_figure",
    "training_loss",
    "write_metrics",
]

CHECKPOINT_NAME = "checkpoint.pt"
LEDGER_NAME = "ledger.json"
_CHECKPOINT_FORMAT = 1

PathLike = str | os.PathLike[str]
Augment = Callable[[torch.Tensor], torch.Tensor]
EpochCallback = Callable[[dict[str, Any]], "bool | None"]


# ------------------------------------------------------------------------------------- results
@dataclass
class FitResult:
    """What :func:`fit` returns.

    ``stop_reason`` is ``"completed"``, ``"budget"`` (the next step would have exceeded
    ``epsilon_budget``) or ``"callback"`` (``on_epoch_end`` returned ``True``). ``history`` holds
    one record per (possibly partial) epoch; ``epsilon`` is spent at ``delta`` after the last step.
    ``ema_model`` is the EMA of the weights when ``ema_decay`` was given (the model that was
    evaluated), else ``None``.
    """

    history: list[dict[str, Any]]
    stop_reason: str
    epochs_completed: int
    steps: int
    epsilon: float
    delta: float
    epsilon_budget: float | None = None
    checkpoint_path: Path | None = None
    metrics_path: Path | None = None
    ema_model: torch.nn.Module | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, Any]:
        """The last history record (``{}`` if no epoch ran)."""
        return dict(self.history[-1]) if self.history else {}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (what ``metrics.json`` holds)."""
        return {
            "history": [dict(r) for r in self.history],
            "stop_reason": self.stop_reason,
            "epochs_completed": self.epochs_completed,
            "steps": self.steps,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "epsilon_budget": self.epsilon_budget,
            "config": _jsonable(self.config),
            "final": self.final,
        }


# ------------------------------------------------------------------------------------------ EMA
class WeightEMA:
    """Exponential moving average of a model's parameters (and a copy of its buffers).

    ``ema <- d * ema + (1 - d) * w`` after every optimizer step, with the usual warm-up
    ``d = min(decay, (1 + t) / (10 + t))`` at update ``t``. The EMA is a fixed function of the
    private iterates (post-processing). With the ``clip`` / ``fix`` constraints every iterate
    satisfies ``||W|| <= C`` per layer, and so does any convex combination of them (a norm is
    convex), so the EMA model keeps the Lipschitz constraint.

    Args:
        model: the model whose parameters are averaged (deep-copied; the copy is
            :attr:`model`).
        decay: the decay ``d``, in ``(0, 1)``.

    Raises:
        ValueError: ``decay`` outside ``(0, 1)``.
    """

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not (isinstance(decay, float | int) and 0.0 < float(decay) < 1.0):
            raise ValueError(f"ema_decay must be in (0, 1); got {decay!r}")
        self.decay = float(decay)
        self.updates = 0
        self.model = copy.deepcopy(model)
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Fold the current weights of ``model`` into the average.

        Args:
            model: the trained model (of :attr:`model`'s architecture), after a step.
        """
        self.updates += 1
        d = min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))
        averages: list[torch.Tensor] = list(self.model.parameters())
        params = list(model.parameters())
        if len(averages) != len(params):
            raise ValueError("the model's parameters do not match the average's")
        if averages:  # the per-tensor mul_ and add_, one fused launch each on an accelerator
            torch._foreach_mul_(averages, d)
            torch._foreach_add_(averages, [p.detach() for p in params], alpha=1.0 - d)
        for avg_b, b in zip(self.model.buffers(), model.buffers(), strict=True):
            avg_b.copy_(b)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.updates = int(state["updates"])


# ------------------------------------------------------------------------------ checkpointing
def save_checkpoint(path: PathLike, state: Mapping[str, Any]) -> Path:
    """``torch.save`` ``state`` to ``path`` atomically (temporary file, fsync, rename).

    The file is created readable by its owner only (``0o600``): a training checkpoint holds the
    state of the noise generator, and whoever knows it can recompute the noise of later steps.

    Args:
        path: the file to write (replaced atomically).
        state: the tensors and plain values to save.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    return atomic_write_with(path, lambda handle: torch.save(dict(state), handle), mode=0o600)


def load_checkpoint(path: PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`fit` (``weights_only=True``: no arbitrary pickles).

    Args:
        path: the checkpoint file (``checkpoint_dir/checkpoint.pt``).

    Returns:
        The checkpoint's dictionary.

    Raises:
        ValueError: a file that is not a clipless training checkpoint.
    """
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a clipless training checkpoint")
    return state


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state: Any = np.random.get_state()  # noqa: NPY002 - the legacy global state
    return {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": {
            "name": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(  # noqa: NPY002 - the legacy global state
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )


def _find_generators(loader: object) -> dict[str, torch.Generator | np.random.Generator]:
    """The random generators reachable from a data loader (its sampler, batch sampler...)."""
    found: dict[str, torch.Generator | np.random.Generator] = {}
    seen: set[int] = set()

    def visit(obj: object, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Generator | np.random.Generator):
            found[path] = obj
            return
        if isinstance(obj, torch.Tensor | torch.nn.Module | torch.utils.data.Dataset):
            return
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            return
        for name, value in sorted(attrs.items()):
            if isinstance(value, str | int | float | bool | bytes | type(None)):
                continue
            visit(value, f"{path}.{name}" if path else name, depth + 1)

    visit(loader, "", 0)
    return found


def _generator_states(loader: object) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, gen in _find_generators(loader).items():
        if isinstance(gen, torch.Generator):
            out[path] = {"kind": "torch", "state": gen.get_state()}
        else:
            out[path] = {"kind": "numpy", "state": json.dumps(gen.bit_generator.state)}
    return out


def _set_generator_states(loader: object, states: Mapping[str, Any]) -> None:
    generators = _find_generators(loader)
    for path, entry in states.items():
        gen = generators.get(path)
        if gen is None:
            warnings.warn(
                f"checkpoint has a state for loader generator {path!r} that this loader lacks; "
                "the resumed run will sample different batches",
                stacklevel=3,
            )
            continue
        if isinstance(gen, torch.Generator):
            gen.set_state(entry["state"])
        else:
            gen.bit_generator.state = json.loads(entry["state"])


# ---------------------------------------------------------------------------------- metrics
def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def write_metrics(result: FitResult | Mapping[str, Any], path: PathLike) -> tuple[Path, Path]:
    """Write ``metrics.json`` (everything) and ``metrics.csv`` (the history) next to each other.

    Both are written atomically and readable by their owner only (``0o600``): the per-epoch
    training loss and accuracy are statistics of the private data that no noise covers (not DP
    releases).

    Args:
        result: a :class:`FitResult` or its :meth:`FitResult.to_dict`.
        path: the JSON file; the CSV gets the same stem with ``.csv``.

    Returns:
        ``(json_path, csv_path)``.
    """
    data = result.to_dict() if isinstance(result, FitResult) else _jsonable(dict(result))
    json_path, csv_path = _metrics_paths(path)
    atomic_write(json_path, json.dumps(_jsonable(data), indent=2) + "\n", mode=0o600)
    history: Sequence[Mapping[str, Any]] = data.get("history", [])
    columns: list[str] = []
    for record in history:
        columns.extend(k for k in record if k not in columns)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for record in history:
        writer.writerow({k: ("" if record.get(k) is None else record.get(k)) for k in columns})
    atomic_write(csv_path, buffer.getvalue(), mode=0o600)
    return json_path, csv_path


def plot_training(
    metrics: FitResult | Mapping[str, Any] | Sequence[Mapping[str, Any]], path: PathLike
) -> Path:
    """PNG with the loss and accuracy (train, test) and epsilon against epochs (Agg canvas).

    Args:
        metrics: a :class:`FitResult`, a ``metrics.json`` dictionary, or a history list.
        path: the PNG file, written atomically and owner-only (``0o600``) like every file of a
            run (``docs/cli.md``); its folder is created.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    fig = training_figure(metrics)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_with(target, lambda handle: fig.savefig(handle, format="png"), mode=0o600)
    return target


def training_figure(metrics: FitResult | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> Any:
    """The :func:`plot_training` figure (a matplotlib ``Figure``): loss, accuracy, epsilon.

    Args:
        metrics: a :class:`FitResult`, a ``metrics.json`` dictionary, or a history list.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if isinstance(metrics, FitResult):
        history: Sequence[Mapping[str, Any]] = metrics.history
    elif isinstance(metrics, Mapping):
        history = metrics.get("history", [])
    else:
        history = metrics
    epochs = [r.get("epoch_progress", r.get("epoch")) for r in history]
    fig = Figure(figsize=(13.0, 3.6), dpi=110)
    FigureCanvasAgg(fig)
    ax_loss, ax_acc, ax_eps = fig.subplots(1, 3)
    for ax, name in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        _train_test_panel(ax, name, epochs, history)
    points = [
        (e, r["epsilon"])
        for e, r in zip(epochs, history, strict=True)
        if r.get("epsilon") is not None
    ]
    if points:
        xs, ys = zip(*points, strict=True)
        ax_eps.plot(xs, ys, marker="o", markersize=3, color="tab:red", label="spent")
    budget = metrics.epsilon_budget if isinstance(metrics, FitResult) else None
    if isinstance(metrics, Mapping):
        budget = metrics.get("epsilon_budget")
    if budget is not None:
        ax_eps.axhline(float(budget), color="gray", linestyle=":", label="budget")
    delta = history[-1].get("delta") if history else None
    ax_eps.set_xlabel("epoch")
    ax_eps.set_ylabel("epsilon")
    ax_eps.set_title(f"privacy spent (delta = {delta:g})" if delta else "privacy spent")
    ax_eps.grid(alpha=0.3)
    if ax_eps.lines:
        ax_eps.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def _train_test_panel(
    ax: Any, name: str, epochs: Sequence[Any], history: Sequence[Mapping[str, Any]]
) -> None:
    """``train_<name>`` (running, on the private data) and ``test_<name>`` against epochs."""
    for key, label, style in (
        (f"train_{name}", "train (running; not a DP release)", "--"),
        (f"test_{name}", "test", "-"),
    ):
        points = [
            (e, r[key])
            for e, r in zip(epochs, history, strict=True)
            if r.get(key) is not None and math.isfinite(r[key])
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, marker="o", markersize=3, label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(name)
    ax.set_title(name)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="upper right" if name == "loss" else "lower right", fontsize=8)


# ------------------------------------------------------------------------------- evaluation
def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, Mapping):
        return batch["x"] if "x" in batch else batch["input"], batch[
            "y"
        ] if "y" in batch else batch["target"]
    if isinstance(batch, list | tuple) and len(batch) >= 2:
        return batch[0], batch[1]
    raise TypeError(f"data loaders must yield (inputs, targets) pairs; got {type(batch).__name__}")


def _correct_tensor(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The number of correct predictions, as a 0-dim tensor on the logits' device."""
    if logits.dim() >= 2 and logits.shape[-1] > 1:
        pred = logits.argmax(dim=-1)
    else:
        pred = (logits.reshape(y.shape) > 0).to(y.dtype)
    return (pred == y.reshape(pred.shape)).sum()


_BAR_EVERY = 16
"""Training steps between the progress bar's readings of the running loss and accuracy (each
reading waits for the device on an accelerator)."""


class _Totals:
    """The running ``(loss sum, correct)`` of an epoch or an evaluation, in float64 on the
    device of the first batch: ``float(batch_loss) / divisor`` and ``correct / augmult`` summed
    in that order, as Python floats would be, without a host read per step."""

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, divisor: int, correct: torch.Tensor, augmult: int) -> None:
        row = torch.stack((loss.detach().double() / divisor, correct.double() / augmult))
        self._sums = row if self._sums is None else self._sums + row

    def read(self) -> list[float]:
        return [0.0, 0.0] if self._sums is None else self._sums.tolist()


def _to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a CPU batch bound for CUDA goes through pinned memory without
    blocking, so the copy does not wait for the steps queued before it."""
    target = torch.device(device)
    if t.device == target:
        return t
    if target.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(target, non_blocking=True)
    return t.to(target)


def _loss_sum(loss: torch.nn.Module, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    value = loss(logits, y)
    reduction = getattr(loss, "reduction", "sum")
    if reduction == "mean":
        return value * logits.shape[0]
    if reduction == "none":
        return value.sum()
    return value


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader: Iterable[Any], loss: torch.nn.Module | None = None
) -> dict[str, float]:
    """Mean loss (if ``loss``) and accuracy of ``model`` over ``loader`` (eval mode, no grad).

    The sums stay on the model's device (:class:`_Totals`) and are read once, at the end.

    Args:
        model: the classifier (one logit per class, or one logit for a binary target).
        loader: batches of ``(inputs, targets)``; empty batches are skipped.
        loss: its ``"sum"``-reduced value is averaged over the samples (``None``: no loss).

    Returns:
        ``{"accuracy": ...}``, with ``"loss"`` when ``loss`` is given (NaN over no sample).
    """
    device = _device_of(model)
    was_training = model.training
    model.eval()
    totals, total = _Totals(), 0
    try:
        for batch in loader:
            x, y = _split_batch(batch)
            if x.shape[0] == 0:
                continue
            x, y = _to_device(x, device), _to_device(y, device)
            logits = model(x)
            summed = logits.new_zeros(()) if loss is None else _loss_sum(loss, logits, y)
            totals.add(summed, 1, _correct_tensor(logits, y), 1)
            total += int(x.shape[0])
    finally:
        model.train(was_training)
    loss_sum, correct = totals.read()  # the one host read of the evaluation
    out = {"accuracy": correct / total if total else float("nan")}
    if loss is not None:
        out["loss"] = loss_sum / total if total else float("nan")
    return out


# ------------------------------------------------------------------------------------- fit
def training_loss(
    model: torch.nn.Module,
    loss: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    augment: Augment | None = None,
    augmult: int = 1,
    optimizer: DPOptimizer | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss of one batch whose backward gives the (scaled) private gradient sum.

    Without ``augment``: ``sum_i loss(model(x_i), y_i)``. With ``augment`` and ``augmult=K``, one
    forward of the ``B*K`` rows ``a = augment(x repeated K times per sample)``:

    * with ``optimizer`` (the :class:`clipless.optim.DPOptimizer`; what :func:`fit` does): the loss
      is ``sum_ij loss(model(a_ij), y_i)`` and the forward runs under
      ``optimizer.sample_multiplicity(K)``, so the scaled kernels divide every row's parameter
      gradient by ``K`` *after* any cotangent clipping: one sample's ``K`` rows together contribute
      at most the layer's sensitivity, even with a ``LossGradientClip`` layer in the model;
    * without it: ``sum_i (1/K) sum_j loss(...)``, valid only when no layer clips cotangents
      (a clip would act on the ``1/K``-weighted cotangent and let ``K`` copies contribute ``K c``):
      a model with a ``LossGradientClip`` is refused.

    ``augment`` runs on every row alone (:func:`per_sample`), so an augmentation that mixes the
    examples of a batch cannot run here.

    Args:
        model: the private model.
        loss: the ``"sum"``-reduced loss.
        x, y: one batch's inputs and targets.
        augment: the per-sample transform (``None``: none, and ``augmult`` is ignored).
        augmult: ``K``, the augmented copies of every sample.
        optimizer: the :class:`clipless.optim.DPOptimizer` the backward feeds (``None``: see
            above).

    Returns:
        ``(loss, logits, targets)`` (``logits``/``targets`` of the ``B*K`` rows).

    Raises:
        ValueError: ``augmult > 1`` without ``optimizer`` in a model with a
            ``LossGradientClip``, or an ``augment`` :func:`per_sample` refuses.
    """
    if augment is not None:
        if optimizer is not None and getattr(optimizer, "data_parallel", None) is not None:
            _shard_before_augmenting(x, x.shape[0] * augmult)
        x_in = per_sample(augment, x.repeat_interleave(augmult, dim=0))
        y_in = y.repeat_interleave(augmult, dim=0)
    else:
        x_in, y_in = x, y
        augmult = 1
    if augmult > 1 and optimizer is not None:
        with optimizer.sample_multiplicity(augmult):
            logits = model(x_in)
        return _loss_sum(loss, logits, y_in), logits, y_in
    if augmult > 1 and any(isinstance(m, LossGradientClip) for m in model.modules()):
        raise ValueError(
            "augmult > 1 with a LossGradientClip layer needs optimizer= (the private optimizer): "
            "dividing the loss by K before the clip would let K copies contribute K times the "
            "clip value"
        )
    logits = model(x_in)
    return _loss_sum(loss, logits, y_in) / augmult, logits, y_in


def _shard_before_augmenting(x: torch.Tensor, rows: int) -> None:
    """Under :mod:`clipless.distributed`: ``x`` must be this rank's shard (:mod:`clipless._shards`);
    the forward of its ``rows`` augmented rows is then allowed."""
    why = _shards.allow_augmented(x, rows)
    if why is not None:
        raise PrivacyContractError(
            f"{why}: under clipless.distributed augment the rows clipless.distributed.shard "
            "handed this rank"
        )


def per_sample(augment: Augment, x: torch.Tensor) -> torch.Tensor:
    """``augment`` applied to every row of ``x`` alone: row ``i`` of the result is
    ``augment(x[i:i+1])[0]``, with independent random draws per row.

    Safe by construction rather than checked: the private step bounds *one example's*
    contribution, which holds only if row ``i`` of the augmented batch depends on example ``i``
    alone. An augmentation given the whole batch can mix examples (mixup ``lam x + (1 - lam)
    x[perm]``, CutMix, ``0.5 x + 0.5 x.flip(0)``): each example then reaches several rows, and
    a review measured 1.94 times the calibrated contribution through :func:`fit` with no error
    (the row count is unchanged, so no check could see it; a probe batch could not rule out a
    transform that mixes only sometimes). So ``augment`` runs under :func:`torch.func.vmap`
    (``randomness="different"``) on batches of one row: it sees a ``[1, *shape]`` tensor, so a
    transform written for batches works unchanged, and nothing it computes can read another
    row. Mixing examples changes the privacy unit (a mixed row is a function of two records)
    and is not supported by the private loop. A transform ``vmap`` cannot run (``.item()``,
    Python branches on tensor values, NumPy or PIL code) is refused with a :class:`ValueError`:
    write it with tensor operations (``torch.where`` on a random draw instead of ``if``).

    Args:
        augment: a transform of a batch ``[1, *shape]`` to a batch ``[1, *shape']``.
        x: the rows to augment, ``[B, *shape]``.

    Returns:
        The ``[B, *shape']`` augmented rows.

    Raises:
        TypeError: ``augment`` not callable.
        ValueError: a transform ``vmap`` cannot run, or one that does not return one row.
    """
    if not callable(augment):
        raise TypeError(f"augment must be callable (a batch of inputs -> a batch); got {augment!r}")

    def one(row: torch.Tensor) -> torch.Tensor:
        return augment(row.unsqueeze(0))

    try:
        out = torch.func.vmap(one, randomness="different")(x)
    except RuntimeError as exc:
        raise ValueError(
            "augment must be a per-sample transform that torch.func.vmap can run (tensor "
            f"operations, e.g. torch.where on a random draw instead of a Python branch): {exc}"
        ) from exc
    if not isinstance(out, torch.Tensor) or out.ndim < 1 or out.shape[1:2] != (1,):
        got = tuple(out.shape[1:]) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"augment must return one row per input row; given a batch of one row it returned {got}"
        )
    return out.squeeze(1)


def _ledger_steps(engine: PrivacyEngine) -> int:
    ledger = getattr(engine, "ledger", None)
    return int(getattr(ledger, "steps", 0)) if ledger is not None else 0


def _epsilon(engine: PrivacyEngine, delta: float) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        return float(engine.get_epsilon(delta))


def _write_ledger(engine: PrivacyEngine, path: Path) -> None:
    """Save the engine's ledger at ``path``, unless the file there records more (never forget)."""
    from clipless.accounting import PrivacyLedger

    ledger = getattr(engine, "ledger", None)
    if ledger is None:
        return
    try:
        on_disk = PrivacyLedger.from_json_if_exists(path)
    except ValueError:
        on_disk = None  # unreadable: this run's own file (checked before its first step)
    if on_disk is not None and on_disk.records_more_than(ledger):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    ledger.to_json(path, mode=0o600)


def _validate(
    epochs: int,
    delta: float,
    epsilon_budget: float | None,
    ema_decay: float | None,
    augment: Augment | None,
    augmult: int,
    on_epoch_end: object = None,
) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer; got {epochs!r}")
    if not (_real(delta) and 0.0 < float(delta) < 1.0):
        raise ValueError(f"delta must be in (0, 1); got {delta!r}")
    if epsilon_budget is not None and not (
        _real(epsilon_budget) and math.isfinite(epsilon_budget) and epsilon_budget > 0
    ):
        raise ValueError(
            f"epsilon_budget must be a finite number > 0 or None; got {epsilon_budget!r}"
        )
    if ema_decay is not None and not (_real(ema_decay) and 0.0 < ema_decay < 1.0):
        raise ValueError(f"ema_decay must be in (0, 1) or None; got {ema_decay!r}")
    if isinstance(augmult, bool) or not isinstance(augmult, numbers.Integral) or augmult < 1:
        raise ValueError(f"augmult must be a positive integer; got {augmult!r}")
    if augmult > 1 and augment is None:
        raise ValueError("augmult > 1 needs augment= (K identical copies would change nothing)")
    if augment is not None and not callable(augment):
        raise TypeError(f"augment must be callable (a batch of inputs -> a batch); got {augment!r}")
    if on_epoch_end is not None and not callable(on_epoch_end):
        raise TypeError(
            f"on_epoch_end must be callable (record -> True to stop) or None; got {on_epoch_end!r}"
        )


def _real(value: object) -> bool:
    """A real number (NumPy scalars included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_metrics_path(metrics_file: Path | None, ckpt_dir: Path | None, writer: bool) -> None:
    """Refuse a metrics path that would overwrite the run's ledger or checkpoint, and make its
    folder (the writing rank): a path that cannot be written fails before the first step, not
    after an epoch of privacy."""
    if metrics_file is None:
        return
    json_path, csv_path = _metrics_paths(metrics_file)
    if ckpt_dir is not None:
        taken = {(ckpt_dir / n).resolve() for n in (LEDGER_NAME, CHECKPOINT_NAME)}
        clash = [p for p in (json_path, csv_path) if p.resolve() in taken]
        if clash:
            raise ValueError(
                f"metrics_path would write {clash[0]}, the run's ledger or checkpoint; "
                "choose another name (e.g. metrics.json)"
            )
    if writer:
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(
                f"metrics_path's folder {json_path.parent} cannot be made: {exc}"
            ) from None


def _metrics_paths(path: PathLike) -> tuple[Path, Path]:
    """The JSON and CSV files :func:`write_metrics` writes for ``path``."""
    json_path = Path(path)
    if json_path.suffix != ".json":
        json_path = json_path.with_suffix(".json")
    return json_path, json_path.with_suffix(".csv")


def _resume_path(resume: bool | PathLike, checkpoint_dir: Path | None) -> Path | None:
    if resume is False or resume is None:
        return None
    if resume is True:
        if checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir (or pass resume=<checkpoint path>)")
        path = checkpoint_dir / CHECKPOINT_NAME
        return path if path.is_file() else None
    path = Path(resume)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"resume: no checkpoint at {path}")
    return path


def fit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: DataLoader[Any] | Iterable[Any],
    loss: torch.nn.Module,
    *,
    engine: PrivacyEngine,
    epochs: int,
    delta: float,
    eval_loader: Iterable[Any] | None = None,
    epsilon_budget: float | None = None,
    checkpoint_dir: PathLike | None = None,
    resume: bool | PathLike = False,
    ema_decay: float | None = None,
    augment: Augment | None = None,
    augmult: int = 1,
    metrics_path: PathLike | None = None,
    progress: bool = True,
    on_epoch_end: EpochCallback | None = None,
) -> FitResult:
    """Train ``model`` privately for ``epochs`` passes over ``train_loader`` (module docstring).

    Every epoch: the Poisson batches are trained on (an empty batch still takes a noisy step),
    ``eval_loader`` is evaluated (with the EMA weights if ``ema_decay`` is given), a history
    record is appended (``epoch``, ``steps``, ``train_loss``, ``train_accuracy``, ``test_loss``,
    ``test_accuracy``, ``epsilon``, ``delta``, ``lr``, ``time_s``, ``complete``), a checkpoint
    is written and ``on_epoch_end(record)`` is called.

    Under :mod:`clipless.distributed` only rank 0 writes the checkpoint, its ledger and the
    metrics; every rank may pass the same ``checkpoint_dir``. On ``resume`` rank 0 alone reads
    the checkpoint (and the largest ledger that continues the checkpoint's) and every rank
    loads what it read, so the folder need only exist on rank 0's machine; an error there (e.g.
    a new run over a spent ledger) is raised on every rank.

    Args:
        model, optimizer, train_loader: what ``engine.make_private`` returned.
        loss: the loss given to ``make_private`` (reduction ``"sum"``: the optimizer divides
            the noisy sum by the expected batch size).
        engine: the :class:`clipless.PrivacyEngine` that made them private (its ledger gives
            epsilon and the budget stop).
        epochs: the run's length in passes over the data, counted from the run's start (a
            resumed run trains the epochs left).
        delta: the delta at which epsilon is reported, in ``(0, 1)``.
        eval_loader: public or held-out data scored after every epoch (``None``: not
            evaluated); never the private training loader, whose Poisson batches no step would
            train on (the optimizer refuses them) and whose score is of private data.
        epsilon_budget: stop before the first step that would push epsilon at ``delta`` above
            it (``stop_reason="budget"``); ``None``: no budget stop besides the engine's plan.
        checkpoint_dir: the folder of ``checkpoint.pt`` (written every epoch) and
            ``ledger.json`` (written before every step's noise); ``None``: neither is written.
        resume: ``True`` continues from ``checkpoint_dir/checkpoint.pt`` if present, a path
            from that checkpoint; ``False`` (default) starts a new run.
        ema_decay: the decay ``d`` in ``(0, 1)`` of a :class:`WeightEMA` of the weights, which
            is then the evaluated model; ``None``: no EMA.
        augment: a per-sample transform of a ``[1, *shape]`` batch, run on every row alone
            (:func:`per_sample`); ``None``: no augmentation.
        augmult: ``K``, the augmented copies of every sample (needs ``augment`` when above 1;
            the sensitivity is unchanged).
        metrics_path: a ``.json`` file rewritten every epoch, with a ``.csv`` of the history
            beside it (:func:`write_metrics`); ``None``: not written.
        progress: show a tqdm progress bar.
        on_epoch_end: called with every epoch's record; returning ``True`` stops the run
            (``stop_reason="callback"``).

    Returns:
        The :class:`FitResult`: history, stop reason, steps and epsilon spent at ``delta``.

    Raises:
        ValueError, TypeError: an argument out of range or of the wrong kind, named.
        FileExistsError: no checkpoint to resume but ``checkpoint_dir/ledger.json`` records
            steps already taken (a new run would forget privacy already spent).
        FileNotFoundError: ``resume`` names a checkpoint that does not exist.
    """
    _validate(epochs, delta, epsilon_budget, ema_decay, augment, augmult, on_epoch_end)
    _check_loaders_and_loss(train_loader, eval_loader, loss)
    epochs, augmult, delta = int(epochs), int(augmult), float(delta)
    keeper = _Checkpointer(checkpoint_dir, model, optimizer, engine, train_loader)
    metrics_file = _metrics_paths(metrics_path)[0] if metrics_path is not None else None
    _check_metrics_path(metrics_file, keeper.directory, keeper.writer)
    resumed = keeper.restore(resume, epochs)
    keeper.ema = ema = _weight_ema(model, ema_decay, resumed)
    loop = _EpochLoop(
        model, optimizer, train_loader, loss, engine, ema, augment, augmult, epsilon_budget, delta
    )
    config: dict[str, Any] = {"epochs": epochs, "delta": delta, "epsilon_budget": epsilon_budget}
    config |= {"ema_decay": ema_decay, "augmult": augmult, "engine": getattr(engine, "config", {})}
    history = resumed.history if resumed is not None else []
    summary = _Summary(
        history=history,
        delta=delta,
        epsilon_budget=epsilon_budget,
        checkpoint_path=keeper.path,
        metrics_path=metrics_file,
        writer=keeper.writer,
        ema=ema,
        config=config,
        epsilon=_epsilon(engine, delta) if _ledger_steps(engine) else 0.0,
        epochs_completed=sum(1 for r in history if r.get("complete")),
    )
    start_epoch = resumed.epoch if resumed is not None else 0
    _run_epochs(
        loop, summary, keeper, range(start_epoch, epochs), eval_loader, on_epoch_end, progress
    )
    keeper.write_ledger()
    if _ledger_steps(engine):
        summary.epsilon = _epsilon(engine, delta)
    summary.publish(engine)
    return summary.result(engine)


def _run_epochs(
    loop: _EpochLoop,
    summary: _Summary,
    keeper: _Checkpointer,
    epochs: range,
    eval_loader: Iterable[Any] | None,
    on_epoch_end: EpochCallback | None,
    progress: bool,
) -> None:
    """The epochs ``epochs`` (of ``epochs.stop`` in all) until one says stop."""
    bar = loop.progress_bar(epochs.stop, epochs.start, progress)
    try:
        for epoch in epochs:
            record, budget_hit = loop.run_epoch(epoch, summary.epsilon, bar, eval_loader)
            if not _end_epoch(epoch, record, budget_hit, summary, keeper, on_epoch_end, loop):
                break
    except BaseException:
        keeper.write_ledger()  # a crash loses no accounting: the steps taken were spent
        if loop.private is not None:
            loop.private.discard_batch()  # training stopped; a later fit starts on a fresh batch
        raise
    finally:
        bar.close()


def _end_epoch(
    epoch: int,
    record: dict[str, Any],
    budget_hit: bool,
    summary: _Summary,
    keeper: _Checkpointer,
    on_epoch_end: EpochCallback | None,
    loop: _EpochLoop,
) -> bool:
    """Record the epoch, checkpoint, publish the metrics and ask the callback; whether to go on
    (not after a budget stop, nor when a rank's callback returned ``True``)."""
    summary.epsilon = record["epsilon"]
    summary.history.append(record)
    if budget_hit:
        summary.stop_reason = "budget"
        keeper.save(epoch, "budget", summary.history)
        summary.publish(keeper.engine)
        if on_epoch_end is not None:
            on_epoch_end(dict(record))
        return False
    summary.epochs_completed += 1
    keeper.save(epoch + 1, None, summary.history)
    summary.publish(keeper.engine)
    stop = on_epoch_end is not None and bool(on_epoch_end(dict(record)))
    if _agreed(stop, loop.parallel):  # every rank asks (a rank may have no callback)
        summary.stop_reason = "callback"
        return False
    return True


def _check_loaders_and_loss(train_loader: object, eval_loader: object, loss: object) -> None:
    if eval_loader is not None and eval_loader is train_loader:
        raise ValueError(
            "eval_loader is the private training loader; pass held-out data, or the original "
            "(non-Poisson) loader for a training-set score"
        )
    reduction = getattr(loss, "reduction", "sum")
    if reduction != "sum":
        raise ValueError(
            f"loss.reduction must be 'sum' (make_private sets it; the optimizer divides by the "
            f"expected batch size); got {reduction!r}"
        )


@dataclass
class _Summary:
    """What :func:`fit` has to say so far (its :class:`FitResult` at any point)."""

    history: list[dict[str, Any]]
    delta: float
    epsilon_budget: float | None
    checkpoint_path: Path | None
    metrics_path: Path | None
    writer: bool
    ema: WeightEMA | None
    config: dict[str, Any]
    epsilon: float
    epochs_completed: int
    stop_reason: str = "completed"

    def publish(self, engine: PrivacyEngine) -> None:
        """Rewrite the metrics file (the writing rank's, when one is given)."""
        if self.metrics_path is not None and self.writer:
            write_metrics(self.result(engine), self.metrics_path)

    def result(self, engine: PrivacyEngine) -> FitResult:
        return FitResult(
            history=self.history,
            stop_reason=self.stop_reason,
            epochs_completed=self.epochs_completed,
            steps=_ledger_steps(engine),
            epsilon=self.epsilon,
            delta=self.delta,
            epsilon_budget=self.epsilon_budget,
            checkpoint_path=self.checkpoint_path,
            metrics_path=self.metrics_path,
            ema_model=None if self.ema is None else self.ema.model,
            config=self.config,
        )


def _weight_ema(
    model: torch.nn.Module, ema_decay: float | None, resumed: _Resumed | None
) -> WeightEMA | None:
    """The EMA, from the weights training continues from (the checkpoint's, on resume)."""
    ema = WeightEMA(model, float(ema_decay)) if ema_decay is not None else None
    saved = None if resumed is None else resumed.ema
    if ema is not None and saved is not None:
        ema.load_state_dict(saved)
    elif resumed is not None and (ema is None) != (saved is None):
        warnings.warn(
            "the checkpoint was written "
            + ("without" if saved is None else "with")
            + " an EMA of the weights and this call has ema_decay="
            + repr(ema_decay)
            + (
                ": the EMA starts from the resumed weights"
                if ema is not None
                else ": it is dropped"
            ),
            stacklevel=3,  # fit's caller
        )
    return ema


class _EpochLoop:
    """One pass over the Poisson batches (a noisy step each, the budget asked before every
    step), then the epoch's record (training statistics, epsilon, held-out scores)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: Iterable[Any],
        loss: torch.nn.Module,
        engine: PrivacyEngine,
        ema: WeightEMA | None,
        augment: Augment | None,
        augmult: int,
        epsilon_budget: float | None,
        delta: float,
    ) -> None:
        self.model, self.optimizer, self.loader, self.loss = model, optimizer, loader, loss
        self.engine, self.ema, self.augment, self.augmult = engine, ema, augment, augmult
        self.epsilon_budget, self.delta = epsilon_budget, delta
        self.device = _device_of(model)
        self.parallel = getattr(optimizer, "data_parallel", None)
        self.private = optimizer if isinstance(optimizer, DPOptimizer) else None
        try:
            self.steps_per_epoch: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            self.steps_per_epoch = None

    def progress_bar(self, epochs: int, start_epoch: int, progress: bool) -> Any:
        from tqdm.auto import tqdm

        per_epoch = self.steps_per_epoch
        return tqdm(
            total=None if per_epoch is None else per_epoch * epochs,
            initial=0 if per_epoch is None else per_epoch * start_epoch,
            disable=not progress,
            unit="step",
            dynamic_ncols=True,
            leave=False,
        )

    def run_epoch(
        self, epoch: int, epsilon: float, bar: Any, eval_loader: Iterable[Any] | None
    ) -> tuple[dict[str, Any], bool]:
        """Train one epoch; returns its history record and whether the budget stopped it."""
        started = time.perf_counter()
        self.model.train()
        totals, steps, budget_hit = self._train_batches(epsilon, bar)
        if self.parallel is not None:  # the whole batch's training statistics, on every rank
            summed = torch.tensor(totals, dtype=torch.float64, device=self.parallel.device)
            self.parallel.reduce([summed])
            totals = [float(summed[0]), float(summed[1]), float(int(summed[2]))]
        loss_total, correct, seen = totals[0], totals[1], int(totals[2])
        epsilon = _epsilon(self.engine, self.delta)
        per_epoch = self.steps_per_epoch
        record: dict[str, Any] = {
            "epoch": epoch + 1,
            "epoch_progress": epoch + (steps / per_epoch if per_epoch else 1.0),
            "steps": _ledger_steps(self.engine),
            "train_loss": loss_total / seen if seen else None,
            "train_accuracy": correct / seen if seen else None,
            "test_loss": None,
            "test_accuracy": None,
            "epsilon": epsilon,
            "delta": self.delta,
            "lr": float(self.optimizer.param_groups[0].get("lr", float("nan"))),
            "time_s": time.perf_counter() - started,
            "complete": not budget_hit,
        }
        if eval_loader is not None:
            evaluated = self.ema.model if self.ema is not None else self.model
            scores = evaluate(evaluated, eval_loader, self.loss)
            record["test_loss"] = scores.get("loss")
            record["test_accuracy"] = scores["accuracy"]
        record = {k: _jsonable(v) for k, v in record.items()}
        bar.set_postfix(
            loss=_fmt(record["train_loss"]),
            acc=_fmt(record["train_accuracy"], 3),
            test=_fmt(record["test_accuracy"], 3),
            eps=f"{epsilon:.3f}",
        )
        return record, budget_hit

    def _over_budget(self) -> bool:
        engine, budget = self.engine, self.epsilon_budget
        return engine.steps_remaining == 0 or (
            budget is not None and engine.would_exceed(budget, self.delta)
        )

    def _train_batches(self, epsilon: float, bar: Any) -> tuple[list[float], int, bool]:
        """``([loss sum, correct, seen], steps, budget_hit)`` of one pass over the batches.

        The running loss and accuracy stay on the model's device (:class:`_Totals`): the step
        itself reads the host once on an accelerator, and the progress bar reads them only
        every :data:`_BAR_EVERY` steps."""
        seen, steps = 0, 0
        totals = _Totals()
        for batch in self.loader:
            if self._over_budget():  # stop before the step that would overspend
                if self.private is not None:
                    self.private.discard_batch()  # drawn, not trained on, and training stops
                return [*totals.read(), float(seen)], steps, True
            x, y = _split_batch(batch)
            if self.parallel is not None:  # clipless.distributed: this rank's rows of the batch
                x, y = shard(x, y, group=self.parallel.group, loader=self.loader)
            self.optimizer.zero_grad()
            if x.shape[0] > 0:
                x, y = _to_device(x, self.device), _to_device(y, self.device)
                batch_loss, logits, y_in = training_loss(
                    self.model, self.loss, x, y, augment=self.augment, augmult=self.augmult,
                    optimizer=self.private,
                )  # fmt: skip
                batch_loss.backward()
                with torch.no_grad():
                    divisor = 1 if self.private is None else self.augmult
                    totals.add(batch_loss, divisor, _correct_tensor(logits, y_in), self.augmult)
                    seen += int(x.shape[0])
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update(self.model)
            steps += 1
            bar.update(1)
            if seen and steps % _BAR_EVERY == 0:
                loss_total, correct = totals.read()
                bar.set_postfix(
                    loss=f"{loss_total / seen:.4f}",
                    acc=f"{correct / seen:.3f}",
                    eps=f"{epsilon:.3f}",
                    refresh=False,
                )
        return [*totals.read(), float(seen)], steps, False


@dataclass
class _Resumed:
    """What a checkpoint restored: the history, the epoch to continue from and the EMA state."""

    history: list[dict[str, Any]]
    epoch: int
    ema: Mapping[str, Any] | None


class _Checkpointer:
    """The run folder of :func:`fit`: the write-ahead ledger's path, resuming (the checkpoint,
    reconciled with every ledger file the run may have written since), the checkpoints and the
    ledger writes. Under :mod:`clipless.distributed` only rank 0 writes (a checkpoint written by
    every rank to one shared folder would be whichever rank renamed last)."""

    def __init__(
        self,
        directory: PathLike | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        engine: PrivacyEngine,
        loader: object,
    ) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.model, self.optimizer, self.engine, self.loader = model, optimizer, engine, loader
        self.ema: WeightEMA | None = None
        if self.directory is not None and getattr(optimizer, "ledger_path", "") is None:
            # Write-ahead accounting (clipless.optim): every step is on disk before its noise.
            self.directory.mkdir(parents=True, exist_ok=True)
            optimizer.ledger_path = self.directory / LEDGER_NAME  # type: ignore[attr-defined]
        self.own_ledger = getattr(optimizer, "ledger_path", None)
        self.parallel = getattr(optimizer, "data_parallel", None)
        self.writer = self.parallel is None or self.parallel.writes_ledger

    @property
    def path(self) -> Path | None:
        return None if self.directory is None else self.directory / CHECKPOINT_NAME

    def restore(self, resume: bool | PathLike, epochs: int) -> _Resumed | None:
        """Load the checkpoint to resume from into the model, optimizer, generators and engine
        (``None``: a new run, after refusing one over a spent ledger). Under
        :mod:`clipless.distributed` rank 0 alone reads the run folder and every rank loads what
        it read, so a rank on another machine needs no copy (and a stale copy cannot make the
        replicas disagree)."""
        read = functools.partial(_read_resume, resume, self.directory, self.own_ledger)
        state = read() if self.parallel is None else self.parallel.from_rank0(read)
        if state is None:
            return None
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
        _set_generator_states(self.loader, state.get("loader_generators", {}))
        # After the loader's generators: an unseeded engine reseeds the noise and the sampler
        # here, so the saved states are never drawn from again (two runs resumed from one
        # checkpoint would draw the same noise on different gradients, and lost steps' noise
        # would be drawn again); a seeded one restores them (bit-identical resume).
        self.engine.load_state_dict(state["engine"])
        if isinstance(self.optimizer, DPOptimizer):
            self.optimizer.discard_batch()  # e.g. drawn before an interruption: never trained on
        history = [dict(r) for r in state.get("history", [])]
        start_epoch = int(state["epoch"])
        if start_epoch > epochs:
            raise ValueError(
                f"the checkpoint has completed {start_epoch} epochs but epochs={epochs}: pass "
                f"epochs >= {start_epoch} to continue (epochs counts from the start of the run)"
            )
        if history and not history[-1].get("complete", True):
            history.pop()  # stopped inside an epoch (budget): run again as a fresh pass
        refresh = getattr(self.optimizer, "refresh", None)
        if callable(refresh):
            refresh()
        return _Resumed(history, start_epoch, state.get("ema"))

    def write_ledger(self) -> None:
        """The engine's ledger to the run folder (unless the file there records more)."""
        if self.directory is not None and self.writer:
            _write_ledger(self.engine, self.directory / LEDGER_NAME)

    def save(self, epoch: int, reason: str | None, history: Sequence[Mapping[str, Any]]) -> None:
        """The ledger, then the checkpoint of ``epoch`` completed epochs."""
        if self.directory is None or not self.writer:
            return
        self.write_ledger()
        own = self.own_ledger
        save_checkpoint(
            self.directory / CHECKPOINT_NAME,
            {
                "format": _CHECKPOINT_FORMAT,
                "epoch": epoch,
                "stop_reason": reason,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "engine": self.engine.state_dict(),
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "rng": _rng_state(),
                "loader_generators": _generator_states(self.loader),
                "history": [_jsonable(r) for r in history],
                # read on resume with the other ledger files: steps written there after this
                # checkpoint (a hard kill) are never forgotten
                "ledger_path": None if own is None else os.fspath(Path(own).resolve()),
            },
        )


def _agreed(stop: bool, parallel: Any) -> bool:
    """Under :mod:`clipless.distributed`, stop when any rank's callback says so (a stop decided
    on rank 0 alone, e.g. on its held-out accuracy, would leave the others in a collective)."""
    if parallel is None:
        return stop
    flag = torch.tensor([1.0 if stop else 0.0], dtype=torch.float64, device=parallel.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=parallel.group)
    return bool(flag.item() > 0)


def _fmt(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def _read_resume(
    resume: bool | PathLike, ckpt_dir: Path | None, own_ledger: object
) -> dict[str, Any] | None:
    """The checkpoint to resume from, its ledger replaced by the largest one on disk (``None``:
    a new run, after refusing one over a spent ledger)."""
    resume_from = _resume_path(resume, ckpt_dir)
    if resume_from is None:
        if ckpt_dir is not None:
            _refuse_orphan_ledger(ckpt_dir / LEDGER_NAME, resume)
        return None

    state = load_checkpoint(resume_from)
    engine_state = dict(state["engine"])
    # Every ledger file this run may have written since the checkpoint: next to the checkpoint,
    # in checkpoint_dir (a checkpoint copied from elsewhere), and the optimizer's own
    # ledger_path. The largest wins: spent steps are never forgotten.
    candidates = [resume_from.parent / LEDGER_NAME]
    if ckpt_dir is not None:
        candidates.append(ckpt_dir / LEDGER_NAME)
    if own_ledger is not None:
        candidates.append(Path(own_ledger))  # type: ignore[arg-type]
    if isinstance(state.get("ledger_path"), str):  # the run's own ledger_path, when it had one
        candidates.append(Path(state["ledger_path"]))
    for ledger_file in dict.fromkeys(p.resolve() for p in candidates):
        engine_state = _prefer_larger_ledger(engine_state, ledger_file)
    return {**state, "engine": engine_state}


def _refuse_orphan_ledger(ledger_file: Path, resume: bool | PathLike) -> None:
    """Refuse to start a fresh run over a ledger that records spent privacy.

    A fresh run would overwrite ``ledger.json`` and forget the earlier run's steps (the privacy
    they spent on the same data is not undone by losing their weights).
    """
    if not ledger_file.is_file():
        return
    from clipless.accounting import PrivacyLedger

    try:
        ledger = PrivacyLedger.from_json(ledger_file)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"checkpoint_dir holds {ledger_file}, which cannot be read ({exc}); it may record "
            "privacy already spent: move it aside before starting a new run there"
        ) from None
    steps = ledger.steps
    if steps == 0 and not ledger.releases:
        return
    why = (
        "resume=True but there is no checkpoint to resume from (the earlier run stopped before "
        "its first checkpoint: its privacy is spent and its weights are lost)"
        if resume
        else "a new run (resume=False) would overwrite it"
    )
    spent = f"{steps} private steps already taken" + (
        f" and {len(ledger.releases)} release(s)" if ledger.releases else ""
    )
    raise FileExistsError(
        f"{ledger_file} records {spent}; {why}. Move the folder "
        "aside (its ledger is the record of that spending) or pass another checkpoint_dir"
    )


def _prefer_larger_ledger(engine_state: dict[str, Any], ledger_file: Path) -> dict[str, Any]:
    """Use ``ledger.json`` instead of the checkpoint's ledger if it records more steps.

    Steps taken after the last checkpoint (before a crash) were spent; resuming must not forget
    them, even though their weights are lost.
    """
    from clipless.accounting import PrivacyLedger

    on_disk = PrivacyLedger.from_json_if_exists(ledger_file)
    in_ckpt = PrivacyLedger.from_dict(engine_state["ledger"])
    if on_disk is not None and on_disk.records_more_than(in_ckpt):
        if not on_disk.extends(in_ckpt):
            # e.g. the checkpoint's recorded path after its folder was moved aside (--force)
            # and a new run wrote there: adopting it would replace this run's record
            warnings.warn(
                f"{ledger_file} records {on_disk.steps} steps but does not continue the "
                f"checkpoint's ledger ({in_ckpt.steps} steps): it is another run's ledger and "
                "is ignored",
                stacklevel=5,
            )
            return engine_state
        warnings.warn(
            f"{ledger_file} records {on_disk.steps} steps but the checkpoint only "
            f"{in_ckpt.steps}: the steps after the checkpoint were spent and stay in the ledger",
            stacklevel=5,  # fit's caller (_read_resume, _Checkpointer.restore and fit between)
        )
        engine_state = dict(engine_state)
        engine_state["ledger"] = on_disk.to_dict()
    return engine_state
