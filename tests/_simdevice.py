"""A simulated accelerator for CPU-only CI: the device ``simgpu``.

CI has no GPU, yet the CUDA bugs worth catching there are mostly *mixed-device* code: a tensor
left on the CPU meets one on the accelerator (issue 34: ``clipless train --device cuda`` premapped
CPU features with the model's CUDA buffers and crashed). This module gives tests a device that
fails the same way while computing exactly what the CPU computes:

* torch's PrivateUse1 backend, renamed ``simgpu``, registered once per process
  (:func:`torch.utils.backend_registration._setup_privateuseone_for_python_backend`);
* :class:`SimTensor`, a wrapper tensor on ``simgpu:0`` holding a plain CPU tensor: every op
  unwraps, runs the CPU kernel and wraps the result (autograd sees ``simgpu`` tensors and keeps
  their gradients there). Factory calls with ``device="simgpu"`` (``torch.zeros``, ``torch.normal``,
  ``.to``, ``module.to``) reach a PrivateUse1 fallback that does the same; ``.cpu()`` /
  ``.to("cpu")`` return plain CPU tensors;
* CUDA's device rules: an op given a ``simgpu`` tensor and a CPU tensor of one or more dimensions
  raises ``RuntimeError: Expected all tensors to be on the same device`` (a 0-dim CPU tensor is
  a scalar, as CUDA allows), except the ops that cross devices on CUDA too (copies, and CPU
  indices); a random op on ``simgpu`` refuses a CPU generator, as CUDA does;
* generators: torch's Python backend hook cannot create them (``getNewGenerator``), so while
  :func:`simulated_device` is active ``torch.Generator(device="simgpu")`` returns a CPU
  generator that reports ``simgpu:0`` as its device (:class:`SimGenerator`). The same seed gives
  the same draws as a CPU generator, which lets tests compare a device run with a CPU run bit for
  bit (and a random op on the CPU refuses a ``simgpu`` generator);
* the CPU's arithmetic where torch would take another path for a tensor subclass: ``torch.linalg``
  calls without autograd run on the unwrapped tensors; ``torch.tensor(data, device="simgpu")``
  and ``new_tensor`` are made on the CPU and moved; ``tolist`` works and ``numpy`` refuses, as on
  CUDA.

Not simulated: CUDA's numerics (TF32, other summation orders), code behind
``device.type == "cuda"`` or ``torch.cuda.*`` (streams, graphs, synchronisation, pinned memory:
``Tensor.pin_memory`` fails once ``simgpu`` is registered, as torch then takes it for the
accelerator), and NCCL. Registration cannot be undone: after the first use ``simgpu`` stays
registered in the process (``torch.accelerator`` reports it); the generator patch and the
mode are active only inside the context.

Use the :func:`simulated_device` context (``tests/test_devices.py`` wraps it in a fixture); it
yields ``torch.device("simgpu", 0)``, or raises :class:`SimDeviceUnavailableError` where the
installed torch cannot register a Python backend.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

NAME = "simgpu"
DEVICE = torch.device("cpu")  # replaced by torch.device(NAME, 0) once registered
_CPU = torch.device("cpu")
_aten = torch.ops.aten


class SimDeviceUnavailableError(RuntimeError):
    """The installed torch cannot register the simulated device (tests skip with the reason)."""


class SimTensor(torch.Tensor):
    """A tensor on ``simgpu:0`` whose data is the plain CPU tensor :attr:`elem`."""

    elem: torch.Tensor
    __slots__ = ("elem",)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> SimTensor:
        if type(elem) is not torch.Tensor or elem.device.type != "cpu":
            raise TypeError(f"SimTensor wraps a plain CPU tensor; got {type(elem).__name__}")
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            dispatch_sizes_strides_policy="sizes",  # an out= argument may be resized
            device=DEVICE,
            requires_grad=False,
        )
        wrapper.elem = elem
        return wrapper

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        return f"SimTensor({self.elem!r}, device='{DEVICE}')"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.save pickles a plain CPU tensor, which is what a CUDA tensor's checkpoint gives
        # back under torch.load(map_location="cpu", weights_only=True) (clipless's loaders)
        plain = self.elem.detach().clone().requires_grad_(self.requires_grad)
        return plain.__reduce_ex__(protocol)  # type: ignore[no-untyped-call]

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # Module._apply (.double(), .to()) sets a parameter's .data: the wrapper takes the new
        # metadata from torch, and its data must follow (else a float64 wrapper holds float32)
        torch.Tensor.data.__set__(self, value)  # type: ignore[attr-defined]
        if isinstance(value, SimTensor):
            self.elem = value.elem

    def tolist(self) -> Any:  # torch refuses it for every subclass; CUDA tensors allow it
        return self.elem.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError(
            f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first. (simulated device)"
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _run(func, args, kwargs or {})


# ops that take tensors of two devices on CUDA too: copies, and (below) indices on the CPU
_COPIES = {
    _aten.copy_.default,
    _aten._to_copy.default,
    _aten._copy_from.default,
    _aten._copy_from_and_resize.default,
}
# ops whose second argument (the list of indices) may hold CPU tensors
_INDEXING = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}


def _is_sim_device(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == NAME
    return isinstance(value, str) and value.split(":")[0] == NAME  # other strings: modes, names


def _check_devices(func: Any, args: Any, kwargs: dict[str, Any], on_device: bool) -> None:
    """CUDA's rule for the tensors of one op."""
    if func in _COPIES or not on_device:
        return
    if func in _INDEXING:
        args = (args[0], *args[2:])
    for leaf in pytree.arg_tree_leaves(*args, **kwargs):
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, SimTensor) and leaf.dim() > 0:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{DEVICE} and {leaf.device}! (simulated device, {func})"
            )


def _run(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func`` on the CPU with every ``simgpu`` argument unwrapped, its outputs wrapped."""
    leaves = pytree.arg_tree_leaves(*args, **kwargs)
    on_device = any(isinstance(x, SimTensor) or _is_sim_device(x) for x in leaves)
    _check_devices(func, args, kwargs, on_device)
    owners = {id(x.elem): x for x in leaves if isinstance(x, SimTensor)}

    def unwrap(x: Any) -> Any:
        if isinstance(x, SimTensor):
            return x.elem
        return _CPU if _is_sim_device(x) else x

    def wrap(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        owner = owners.get(id(x))
        if owner is not None:  # an in-place op or out=: the argument itself
            return owner
        return SimTensor(x)

    target = kwargs.get("device")
    to_cpu = func is _aten._to_copy.default and target is not None and not _is_sim_device(target)
    args, kwargs = pytree.tree_map(unwrap, (args, kwargs))
    out = func(*args, **kwargs)
    if not on_device or to_cpu:
        return out
    return pytree.tree_map(wrap, out)


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """PrivateUse1 kernels: factory calls with ``device="simgpu"`` (tensor ops reach
    :meth:`SimTensor.__torch_dispatch__` first)."""
    return _run(op, args, kwargs)


_LIBRARIES: list[Any] = []  # a torch.library.Library unregisters its kernels when collected


@functools.cache
def _register() -> str | None:
    """Register ``simgpu`` once per process; returns why not where torch cannot."""
    global DEVICE
    try:
        from torch.utils.backend_registration import (
            _setup_privateuseone_for_python_backend,
        )
    except ImportError:
        return f"torch {torch.__version__} has no Python PrivateUse1 backend registration"
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", NAME):
        return "the PrivateUse1 backend is already taken by another backend"
    try:
        if torch._C._get_privateuse1_backend_name() != NAME:
            _setup_privateuseone_for_python_backend(NAME)
        library = torch.library.Library("_", "IMPL")  # type: ignore[no-untyped-call]
        library.fallback(_fallback, "PrivateUse1")  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError, TypeError) as exc:
        return f"torch {torch.__version__} cannot register a Python backend: {exc}"
    _LIBRARIES.append(library)
    DEVICE = torch.device(NAME, 0)
    return None


_RealGenerator = torch.Generator


class _GeneratorType(type(_RealGenerator)):  # type: ignore[misc]
    def __instancecheck__(cls, obj: object) -> bool:
        # generators made before the context are generators too
        return isinstance(obj, _RealGenerator)


class SimGenerator(_RealGenerator, metaclass=_GeneratorType):
    """``torch.Generator`` while :func:`simulated_device` is active: a ``simgpu`` generator is a
    CPU generator that reports ``simgpu:0`` as its device."""

    _sim: bool

    def __new__(cls, device: Any = "cpu") -> SimGenerator:
        sim = _is_sim_device(device)
        generator = _RealGenerator.__new__(cls, _CPU if sim else device)  # type: ignore[call-arg]
        generator._sim = sim
        return generator

    def __init__(self, device: Any = "cpu") -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return DEVICE if self._sim else _RealGenerator.device.__get__(self)


_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


def _from_data(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``torch.tensor(data, device="simgpu")`` and kin, or ``None`` for other calls: made on the
    CPU, then moved (torch builds them with the Python dispatch key excluded, which a Python
    backend cannot serve)."""
    if func is torch.Tensor.new_tensor and isinstance(args[0], SimTensor):
        if not _is_sim_device(kwargs.get("device", DEVICE)):
            return None
        rest = {k: v for k, v in kwargs.items() if k not in ("device", "requires_grad")}
        rest.setdefault("dtype", args[0].dtype)
        plain = torch.tensor(args[1], **rest)
    elif func in _DATA_FACTORIES and _is_sim_device(kwargs.get("device")):
        if args and isinstance(args[0], torch.Tensor):
            return None
        rest = {k: v for k, v in kwargs.items() if k not in ("device", "requires_grad")}
        plain = func(*args, **rest)
    else:
        return None
    return plain.to(DEVICE).requires_grad_(bool(kwargs.get("requires_grad", False)))


class _DeviceMode(TorchFunctionMode):
    """What the dispatcher cannot do, at the Python API: check generators (kernels receive a new
    Python object for the generator), make tensors from data (:func:`_from_data`) and keep
    torch.linalg's arithmetic the CPU's (its composite kernels compute singular or eigen vectors
    for every tensor subclass, ``svdvals`` and ``eigvalsh`` included, which changes the last bits
    of the values)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        made = _from_data(func, args, kwargs)
        if made is not None:
            return made
        generator = kwargs.get("generator")
        linalg = getattr(func, "__module__", None) == "torch._C._linalg"
        if generator is None and not linalg:
            return func(*args, **kwargs)
        leaves = pytree.arg_tree_leaves(*args, **kwargs)
        on_device = any(isinstance(x, SimTensor) or _is_sim_device(x) for x in leaves)
        expected = NAME if on_device else "cpu"
        if isinstance(generator, _RealGenerator) and generator.device.type != expected:
            raise RuntimeError(
                f"Expected a '{expected}' device type for generator but found "
                f"'{generator.device.type}' (simulated device, {func.__name__})"
            )
        tracked = any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
        if linalg and on_device and not (tracked and torch.is_grad_enabled()):
            return _run(func, args, kwargs)  # on the CPU tensors: the CPU's kernels
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_device() -> Iterator[torch.device]:
    """Make ``simgpu`` usable (registered once per process) and yield its device."""
    reason = _register()
    if reason is not None:
        raise SimDeviceUnavailableError(reason)
    torch.Generator = SimGenerator  # type: ignore[misc]
    try:
        with _DeviceMode():
            yield DEVICE
    finally:
        torch.Generator = _RealGenerator  # type: ignore[misc]
