"""Data-parallel private training over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Every rank holds the same model and a :class:`clipless.optim.DPOptimizer` built the same way
(same engine arguments); :func:`make_data_parallel` turns it into one replica of a data-parallel
run. One step:

1. Every rank draws the *same* Poisson batch (:func:`make_data_parallel` gives every rank's
   sampler rank 0's generator state) and runs forward and backward on its share of it
   (:func:`shard`: rows ``rank::world``, after checking that the ranks' batches agree).
2. In :meth:`DPOptimizer.step`, the ranks' gradient sums are all-reduced (``SUM``): the result is
   the gradient sum of the whole batch, exactly what one process would compute up to the order of
   floating-point additions.
3. **Noise is added once**, by rank 0, with the plan's standard deviations (the largest over the
   ranks, which plan identical ones unless a replica was edited), and rank 0's noisy
   gradient is broadcast to every rank. The released quantity is therefore the same Gaussian
   mechanism as in one process (one draw of ``N(0, std^2)`` per coordinate on the full sum), so
   the privacy argument and the accounting of :mod:`clipless.mechanism` are unchanged. (Adding
   ``1/sqrt(world)`` of the variance on every rank would also be correct but needs independent
   streams on every rank; one noising rank is simpler to audit.)
4. Every rank takes the same inner step and the same projection (deterministic, same inputs), so
   the replicas stay bitwise identical; the broadcast guarantees identical gradients even if the
   reduction were not bitwise reproducible across ranks.
5. Every rank records the step in its in-memory ledger (so ``epsilon`` reads the same
   everywhere); only rank 0 writes ``ledger_path``.

The noise generator of rank 0 is the optimizer's own (seeded from the OS CSPRNG unless the engine
was given a seed); the other ranks never draw noise.

Launch with ``torchrun --nproc-per-node N script.py`` (one machine) or, on several machines,
``torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT
script.py`` on each; the script calls ``torch.distributed.init_process_group("gloo")`` (or
``"nccl"``) before building the engine. ``tests/test_distributed.py`` runs two processes on
loopback and compares with one process.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from clipless import _shards
from clipless.optim import DPOptimizer, PrivacyContractError

__all__ = ["DataParallel", "current_rank", "init_from_env", "make_data_parallel", "shard", "spawn"]


class DataParallel:
    """The collective operations a :class:`DPOptimizer` uses in data-parallel mode."""

    def __init__(self, group: Any = None, device: torch.device | str = "cpu") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) first (e.g. under torchrun)"
            )
        self.group = group
        self.device = torch.device(device)  # of the small tensors exchanged (NCCL needs CUDA)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @property
    def adds_noise(self) -> bool:
        """Only rank 0 draws the noise (module docstring, step 3)."""
        return self.rank == 0

    @property
    def writes_ledger(self) -> bool:
        return self.rank == 0

    def reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum every tensor over the ranks, in place (same order on every rank).

        The sum is taken in float64 and rounded once to the tensor's dtype: the proof of the
        rounding margin (:func:`clipless.mechanism.rounding_margin`) allows one rounding of the
        whole sum here, whatever the number of ranks (a float32 all-reduce over ``W`` ranks
        rounds ``W - 1`` partial sums)."""
        for t in tensors:
            if t.dtype == torch.float64:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
                continue
            wide = t.double()
            dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=self.group)
            t.copy_(wide)

    def largest(self, values: dict[str, float]) -> dict[str, float]:
        """The largest value of every key over the ranks (same keys, same order everywhere).

        The noise standard deviations: replicas plan identical ones (identical weights), and if a
        replica was changed behind the optimizer's back, the largest planned noise still covers
        every rank's samples (each rank's sensitivity is at most its own plan's).
        """
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return dict(zip(values, (float(v) for v in t.tolist()), strict=True))

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy rank 0's tensors to every rank, in place."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in tensors:
            dist.broadcast(t, src=src, group=self.group)

    def from_rank0(self, read: Callable[[], Any]) -> Any:
        """Call ``read()`` on rank 0 only and return its result on every rank.

        Used for what rank 0 alone may decide, e.g. the checkpoint a run resumes from (only rank
        0's machine need hold the run folder). If ``read`` raises on rank 0, every rank raises
        (rank 0 its own exception, the others a copy of it, pickled; a ``RuntimeError`` naming it
        if it cannot be pickled) instead of the others waiting for a collective that never
        comes. The result travels pickled (``broadcast_object_list``): it must hold CPU tensors
        and plain values.
        """
        payload: list[Any] = [None]
        error: BaseException | None = None
        if self.rank == 0:
            try:
                payload[0] = ("ok", read())
            except Exception as exc:
                error = exc
                try:
                    pickle.loads(pickle.dumps(exc))
                    payload[0] = ("error", exc)
                except Exception:  # an exception that does not survive pickling
                    payload[0] = ("error", RuntimeError(f"{type(exc).__name__} on rank 0: {exc}"))
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(payload, src=src, group=self.group, device=self.device)
        kind, value = payload[0]
        if kind == "ok":
            return value
        raise error if error is not None else value


def make_data_parallel(optimizer: DPOptimizer, data_loader: Any, group: Any = None) -> DPOptimizer:
    """Make ``optimizer`` one replica of a data-parallel private run (module docstring).

    ``data_loader`` is the Poisson loader ``make_private`` returned on this rank. Its sampler's
    generator state is replaced by rank 0's (broadcast), so that every rank draws the *same*
    Poisson batches: with independent draws, one example could land in several ranks' shards and
    contribute more than once (the sensitivity would not hold). Rank 0's state comes from the OS
    CSPRNG unless the engine was seeded. Rank 0's parameters and buffers are broadcast too, so
    every replica starts from the same weights (and the same released input mean). Returns the
    optimizer (the same object).
    """
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            f"optimizer must be a clipless DPOptimizer (from PrivacyEngine.make_private); got "
            f"{type(optimizer).__name__}"
        )
    own = optimizer.data_loader
    if own is not None and data_loader is not own:
        raise TypeError(
            "data_loader must be the Poisson loader make_private returned with this optimizer "
            "(optimizer.data_loader): its sampler is the one synchronised across ranks"
        )
    sampler = getattr(data_loader, "batch_sampler", None)
    generator = getattr(sampler, "generator", None)
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            "data_loader must be the Poisson loader returned by make_private (its batch sampler's "
            "generator is synchronised across ranks)"
        )
    params = list(optimizer.module.parameters())
    parallel = DataParallel(group, params[0].device if params else "cpu")
    with torch.no_grad():
        state = generator.get_state()
        buffer = state.to(parallel.device)
        parallel.broadcast([buffer])
        generator.set_state(buffer.cpu())
        parallel.broadcast([p.data for p in params])
        # buffers too, e.g. the released input mean of a centred InputNorm (released once, by
        # rank 0: clipless train computes it there only)
        parallel.broadcast([b.data for b in optimizer.module.buffers()])
    optimizer.data_parallel = parallel
    optimizer.refresh()  # the bounds of the broadcast weights
    return optimizer


def shard(
    *tensors: torch.Tensor, group: Any = None, loader: Any = None
) -> tuple[torch.Tensor, ...]:
    """This rank's share (rows ``rank::world``) of a batch drawn identically on every rank.

    Checks (one small all-reduce) that every rank holds the same batch, and raises
    :class:`clipless.optim.PrivacyContractError` otherwise (the batches were not drawn
    identically, e.g. the loader was not given to :func:`make_data_parallel`). With ``loader``
    (the Poisson loader the batch came from, as :func:`clipless.training.fit` passes) the check
    compares the batch's *indices* (:attr:`clipless.sampling.PoissonDataLoader.
    last_batch_fingerprint`), so random per-example transforms in the dataset may differ between
    ranks; without it, the batch size and a float64 checksum of the contents (non-finite values
    counted apart). The check runs on the group's device (CUDA for NCCL).

    The rows returned (their first tensor: the inputs) are recorded, and the private model's
    next training forward must receive exactly them (:mod:`clipless._shards`): training on other
    rows of the batch (``x[: len(x) // world]`` on every rank counts the first examples once per
    rank) is refused. Augment them with :func:`clipless.training.training_loss` (``augment=``),
    which checks the shard before augmenting it.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard needs an initialised torch.distributed process group: call "
            "clipless.distributed.init_from_env() (under torchrun) or "
            "torch.distributed.init_process_group(...) first"
        )
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if not tensors:
        return ()
    stats = [float(tensors[0].shape[0])]
    fingerprint = getattr(loader, "last_batch_fingerprint", None)
    if fingerprint is not None:
        stats += [float(fingerprint), float(loader.batches_yielded)]
    else:
        for t in tensors:
            n = t.shape[0]
            flat = t.detach().reshape(n, math.prod(t.shape[1:])).to(torch.float64)
            bad = ~torch.isfinite(flat)
            flat = torch.where(bad, 0.0, flat)
            weights = torch.arange(1, n + 1, dtype=torch.float64, device=flat.device)
            stats.append(float((flat.sum(dim=1) * weights).sum()) if flat.numel() else 0.0)
            stats.append(float((bad.sum(dim=1) * weights).sum()) if flat.numel() else 0.0)
    backend = dist.get_backend(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor(stats, dtype=torch.float64, device=device)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise PrivacyContractError(
            "the ranks hold different batches: every rank must draw the same Poisson batch "
            "(pass make_private's loader to make_data_parallel) before taking its shard"
        )
    out = tuple(t[rank::world] for t in tensors)
    _shards.record(out[0])  # the training forward checks it receives exactly these rows
    return out


# ------------------------------------------------------------------------------- launching
def _env_int(name: str, default: str | None = None) -> int:
    text = os.environ.get(name, default)
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"environment variable {name}={text!r} must be an integer (set by torchrun)"
        ) from None


def check_env() -> None:
    """Refuse a malformed ``torchrun``-style environment with a named error (before joining a
    group that would hang): integer ``RANK`` in ``[0, WORLD_SIZE)``, ``LOCAL_RANK`` >= 0,
    ``MASTER_ADDR`` set and ``MASTER_PORT`` in 1..65535."""
    world, rank = _env_int("WORLD_SIZE", "1"), _env_int("RANK")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"environment variables RANK={rank} and WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE"
        )
    if _env_int("LOCAL_RANK", "0") < 0:
        raise ValueError("environment variable LOCAL_RANK must be >= 0")
    if not os.environ.get("MASTER_ADDR"):
        raise ValueError("environment variable MASTER_ADDR is not set (torchrun sets it)")
    port = _env_int("MASTER_PORT", "")
    if not 1 <= port <= 65535:
        raise ValueError(f"environment variable MASTER_PORT={port} must be in 1..65535")


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` launch (``WORLD_SIZE`` > 1 is set)."""
    return _env_int("WORLD_SIZE", "1") > 1 and "RANK" in os.environ


def init_from_env(device: torch.device | str = "cpu") -> torch.device:
    """Join the process group described by the environment, if any; returns this rank's device.

    Under ``torchrun`` (or after :func:`spawn`) the environment names the rank, the world size and
    the rendezvous (``MASTER_ADDR``/``MASTER_PORT``): the group is initialised with NCCL when
    ``device`` is CUDA, gloo otherwise, unless one is initialised already. A CUDA device becomes
    ``cuda:LOCAL_RANK`` (one GPU per local rank). Without such an environment nothing happens and
    ``device`` is returned: one process.
    """
    device = torch.device(device)
    if not (dist.is_available() and (dist.is_initialized() or launched_by_torchrun())):
        return device
    if device.type == "cuda" and device.index is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
    if not dist.is_initialized():
        check_env()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def current_rank() -> int:
    """This process's rank: the group's, else ``RANK`` under torchrun, else 0 (one process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int("RANK") if launched_by_torchrun() else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(local_rank: int, world: int, port: int, fn: Callable[..., int], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    code = int(fn(*args))
    if code != 0:
        # a failed rank leaves at once: the others may be waiting in a collective it will never
        # join (a barrier here would wait for them, and they for it); spawn then stops them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        if dist.is_initialized():
            # every rank done before any tears down: rank 0 still writes the run folder when the
            # others return, and a peer's closed gloo connection can abort a rank's background
            # thread ("terminate called without an active exception", seen once in CI)
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # End the rank here, without the interpreter's finalisation: gloo's worker threads may still
    # hold objects whose destruction during finalisation aborts the process ("terminate called
    # without an active exception": seen twice in CI after a rank had returned 0; PyTorch's
    # pull request 179291 describes the mechanism). Everything the rank wrote is closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(nproc: int, fn: Callable[..., int], *args: Any) -> int:
    """Run ``fn(*args)`` in ``nproc`` local processes, ranks of one group on loopback.

    Each process gets the environment ``torchrun --standalone --nproc-per-node nproc`` would set
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``),
    so ``fn`` calls :func:`init_from_env` exactly as under ``torchrun``. ``fn`` returns an exit
    status. Returns 0 when every rank returned 0, else the first failing rank's status (the
    other ranks are then stopped: they would wait for it in a collective). ``fn`` and ``args``
    must be picklable (processes are started with the ``spawn`` method). After ``fn`` returns 0,
    the ranks meet at a barrier, leave the group and end with ``os._exit`` (stdout and stderr
    flushed): interpreter finalisation, where gloo's threads can abort a rank, is skipped, so
    ``fn`` must close or flush what it opened (``atexit`` handlers do not run in the ranks). A
    rank whose ``fn`` returns another status ends at once, without the barrier (the others may
    be waiting for it in a collective), and the others are stopped.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer; got {nproc!r}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    try:
        torch.multiprocessing.spawn(
            _spawned, args=(nproc, _free_port(), fn, args), nprocs=nproc, join=True
        )
    except torch.multiprocessing.ProcessExitedException as exc:
        return int(exc.exit_code) if exc.exit_code and exc.exit_code > 0 else 1
    except torch.multiprocessing.ProcessRaisedException as exc:
        # one line, not the rank's traceback wrapped in the launcher's
        last = [line for line in str(exc).strip().splitlines() if line.strip()][-1:]
        print(f"rank {exc.error_index}: {last[0] if last else exc}", file=sys.stderr)
        return 1
    return 0
