"""Float32 computed in float32: the settings under which it is not (TF32, bfloat16 products),
and the switch that turns them off (the noise's rounding margin covers float32 only)."""

from __future__ import annotations

from typing import Any

import torch

from clipless import nn as _cnn

__all__ = ["full_float32_precision", "reduced_float32_precision", "switch_to_full_float32"]


def reduced_float32_precision(devices: set[str], convolutions: bool = True) -> str | None:
    """The torch setting (a description) under which float32 convolutions or matrix products on
    one of the device types ``devices`` round below float32, or ``None``.

    CUDA runs float32 convolutions in TF32 by default (``torch.backends.cudnn.allow_tf32`` is
    True): a 10-bit mantissa, like half precision, whose rounding exceeds the float32 margin of
    the noise plan (:data:`clipless.mechanism.ROUNDING_MARGIN`; an audit emulating TF32 measured
    one record's contribution at 1.00025 times its planned sensitivity). ``torch.
    set_float32_matmul_precision("high"/"medium")`` allows TF32 or bfloat16 products on CUDA and
    on CPUs with bfloat16 units. torch >= 2.9 keeps these settings per backend
    (``fp32_precision``, ``"none"`` inheriting from the backend, then from
    ``torch.backends.fp32_precision``; the legacy setters write them): those are read. Older
    torch: the legacy flags. :func:`full_float32_precision` turns everything off.
    ``convolutions=False`` (a model of dense layers only) skips the convolution settings.
    """
    backends = torch.backends
    ops = ("conv", "matmul") if convolutions else ("matmul",)
    wanted = []
    if "cuda" in devices:
        wanted += [("cudnn" if op == "conv" else "cuda", op) for op in ops]
    if "cpu" in devices:
        wanted += [("mkldnn", op) for op in ops]
    root = getattr(backends, "fp32_precision", None)
    if isinstance(root, str):  # torch >= 2.9
        for backend, op in wanted:
            parent = getattr(backends, backend, None)
            leaf = getattr(parent, op, None)
            chain = [
                (f"torch.backends.{backend}.{op}.fp32_precision", leaf),
                (f"torch.backends.{backend}.fp32_precision", parent),
                ("torch.backends.fp32_precision", backends),
            ]
            for name, owner in chain:
                try:
                    value = (
                        getattr(owner, "fp32_precision", "none") if owner is not None else "none"
                    )
                except (AttributeError, RuntimeError):
                    value = "none"
                if value != "none":  # the first explicit setting up the chain decides
                    if value != "ieee":
                        return f"{name} is {value!r}"
                    break
        return None
    precision = torch.get_float32_matmul_precision()  # torch < 2.9: the legacy settings
    if precision != "highest":
        return f"torch.get_float32_matmul_precision() is {precision!r}"
    if "cuda" in devices:
        legacy: list[tuple[str, Any]] = [
            ("torch.backends.cuda.matmul.allow_tf32", backends.cuda.matmul)
        ]
        if convolutions:
            legacy.append(("torch.backends.cudnn.allow_tf32", backends.cudnn))
        for name, owner in legacy:
            if getattr(owner, "allow_tf32", False) is True:
                return f"{name} is True"
    return None


# clipless layers that run no convolution (the precision check's cuDNN exemption)
_DENSE_LAYERS: tuple[type, ...] = (
    _cnn.Sequential,
    _cnn.Residual,
    _cnn.Linear,
    _cnn.InputNorm,
    _cnn.GroupSort,
    _cnn.ReLU,
    _cnn.Tanh,
    _cnn.Sigmoid,
    _cnn.Abs,
    _cnn.Flatten,
    _cnn.LossGradientClip,
)


_FP32_LEAVES = (
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("cuda", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "matmul"),
    ("mkldnn", "rnn"),
)


def full_float32_precision() -> None:
    """Turn TF32 and bfloat16 products off, so that float32 is computed in float32 everywhere
    (what :func:`reduced_float32_precision` checks; ``clipless train`` calls this on CUDA).

    torch >= 2.9: every backend's ``fp32_precision`` is set to ``"ieee"`` (writing the legacy
    flags there leaves a setting such as ``torch.backends.fp32_precision = "tf32"`` inherited);
    older torch: ``allow_tf32 = False`` for cuDNN and cuBLAS and the ``"highest"`` matmul
    precision. A global setting of the process, like the flags it writes.
    """
    backends = torch.backends
    leaves = [getattr(getattr(backends, a, None), b, None) for a, b in _FP32_LEAVES]
    new_api = [leaf for leaf in leaves if leaf is not None and hasattr(leaf, "fp32_precision")]
    if new_api:
        for leaf in new_api:
            leaf.fp32_precision = "ieee"
        return
    backends.cudnn.allow_tf32 = False
    backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def switch_to_full_float32(module: torch.nn.Module) -> str | None:
    """Call :func:`full_float32_precision` if a float32 ``module`` would otherwise round below
    float32 on its devices (TF32 / bfloat16 products, :func:`reduced_float32_precision`): returns
    the setting that was switched off, or ``None`` when nothing needed to change."""
    params = list(module.parameters())
    if not params or any(p.dtype != torch.float32 for p in params):
        return None
    devices = {p.device.type for p in params}
    convolutions = any(not isinstance(m, _DENSE_LAYERS) for m in module.modules())
    setting = reduced_float32_precision(devices, convolutions)
    if setting is not None:
        full_float32_precision()
    return setting
