"""Public feature front-ends: fixed, data-independent maps applied to each sample before training.

A map that uses no data (its parameters are fixed in advance, as a wavelet filter bank is) and
transforms each sample on its own is *post-processing of nothing private*: training a DP model on
``phi(x_i)`` instead of ``x_i`` changes no privacy argument, because neighbouring datasets stay
neighbours (one record changes one feature vector) and the DP model's input bound is enforced
after the map by :class:`clipless.nn.InputNorm`. No Lipschitz constant of ``phi`` is needed for
privacy (nothing trainable precedes it). Two conditions are checked by the tests: the map is
deterministic and **per-sample** (a sample's features never depend on the other samples of a
batch, unlike batch normalisation or normalisation by dataset statistics, which would need their
own privacy budget).

:class:`Scattering2d` is the ScatterNet front-end of Tramèr and Boneh, "Differentially Private
Learning Needs Better Features (or Much More Data)", ICLR 2021, section 3: a two-layer wavelet
scattering transform (Mallat, "Group Invariant Scattering", 2012; Bruna and Mallat 2013) with
``J = 2`` scales and ``L = 8`` orientations, computed by ``kymatio`` (Andreux et al., JMLR 2020),
followed by a per-sample group normalisation (their "ScatterNet + GroupNorm" variant; the
variant normalised by private per-channel statistics is not offered).

The data-dependent steps offered are two Gaussian releases, both accounted:
:func:`release_mean`, the mean of the unit-normalised training features, which
:class:`clipless.nn.InputNorm` (``center=``) subtracts from every sample, and
:func:`release_channel_moment`, their channel second moment, from which :func:`whitening` builds
the channel mixing that ``InputNorm`` (``whiten=``) applies next. Tramèr and Boneh normalise with
privately released statistics too ("data normalisation", their section 3; per-channel means and
variances); here the released statistics are the mean direction and the channel covariance, and
their cost enters the same accountant as the training steps
(:meth:`clipless.PrivacyEngine.make_private` reads them from the model).

>>> import torch
>>> phi = Scattering2d((1, 28, 28))  # doctest: +SKIP
>>> phi.output_shape  # doctest: +SKIP
(81, 7, 7)
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from clipless import _validate
from clipless._certified import gamma as _gamma

__all__ = [
    "CENTER_NOISE",
    "FEATURES",
    "WHITEN_NOISE",
    "WHITEN_SHRINK",
    "Scattering2d",
    "apply_features",
    "build_features",
    "cached_features",
    "feature_cache_key",
    "release_channel_moment",
    "release_mean",
    "whitening",
]

FEATURES = ("none", "scatter")
"""Names accepted by :func:`build_features` (and ``clipless train --features``)."""

CENTER_NOISE = 20.0
"""Default noise multiplier of :func:`release_mean` (``clipless train --center``). With 60,000
Fashion-MNIST samples the released mean is within ``~0.02`` (L2) of the exact one, whose norm is
``~0.5``; composed with 20 epochs of training at epsilon 3 it costs what raising the training
noise by ~0.3% costs (``benchmarks/RESULTS.md`` section 17)."""

WHITEN_NOISE = 20.0
"""Default noise multiplier of :func:`release_channel_moment` (``clipless train --whiten-noise``).
On Fashion-MNIST's 81 scattering channels the noise's spectral norm, ``~2 * 20 * sqrt(81) /
60000 = 0.006``, is below the mean channel variance ``~0.009`` that :func:`whitening` adds as its
shrinkage; the release costs what the mean's does (``benchmarks/RESULTS.md`` section 20)."""

WHITEN_SHRINK = 1.0
"""Default ``shrink`` of :func:`whitening`: the eigenvalues are lifted by the mean eigenvalue."""


@torch.no_grad()
def release_mean(
    inputs: torch.Tensor | TensorDataset,
    noise_multiplier: float = CENTER_NOISE,
    *,
    generator: torch.Generator | None = None,
    num_samples: int | None = None,
    batch_size: int = 4096,
) -> torch.Tensor:
    """The mean of the unit-normalised samples, released by the Gaussian mechanism.

    Returns ``(sum_i u_i + N(0, noise_multiplier^2 I)) / n`` with ``u_i = x_i / ||x_i||`` (a zero
    sample contributes 0), summed in float64 and returned in the inputs' dtype, of one sample's
    shape. Every ``||u_i|| <= 1`` (certified norms, :func:`clipless.nn._functional.project_norm`),
    so adding or removing one sample moves the sum by at most 1: the Gaussian mechanism (Dwork and
    Roth 2014, Theorem A.1; accounted exactly by ``dp_accounting`` as
    ``GaussianDpEvent(noise_multiplier)``, the same convention as a training step with ``q = 1``)
    under add/remove neighbours; under replace-one the accountant doubles the sensitivity itself.
    ``n`` (``num_samples``, default the number of rows) is public, as it is for the sampling rate
    of the training steps; the float64 rounding of the sum is covered by normalising the samples
    to a radius slightly below 1 that depends on ``n`` alone (so two neighbours, of at most
    ``n + 1`` rows each, normalise alike; more rows than ``n + 1`` are refused). The noise is
    drawn from ``generator`` (default: seeded from the OS CSPRNG; seed one only for reproducible
    experiments).

    The release is *not* recorded anywhere by this function: pass the result with its
    ``noise_multiplier`` to :class:`clipless.nn.InputNorm` (``center=``, ``center_noise=``), and
    :meth:`clipless.PrivacyEngine.make_private` composes the release with the training steps and
    records it in the ledger.
    """
    from clipless.nn._functional import project_norm
    from clipless.norms import all_finite

    x, sigma, n = _release_arguments(inputs, noise_multiplier, num_samples, batch_size)
    # Floating point: any float64 summation order of m vectors of norm <= r errs by at most
    # gamma_m sum_j |u_j| per coordinate (Higham, Accuracy and Stability, eq. (4.4)), i.e. by
    # gamma_m m r in L2 (Cauchy-Schwarz over samples and coordinates). The computed sums of two
    # neighbouring datasets thus differ by at most r + 2 gamma_m m r. The radius depends on the
    # public n only (m = n + 1 bounds the rows of both neighbours), so both releases normalise
    # alike; samples normalised to r = 1 / (1 + 2 gamma_m m) keep the difference at most 1.
    m = _row_cap(len(x), n)
    radius = 1.0 / (1.0 + 2.0 * _gamma(m) * m)
    total = torch.zeros(x.shape[1:], dtype=torch.float64, device=x.device)
    for start in range(0, len(x), batch_size):
        chunk = x[start : start + batch_size].to(torch.float64)
        if not all_finite(chunk):
            raise ValueError("inputs must be finite")
        total += project_norm(chunk, radius, "sphere").sum(dim=0)
    generator = generator if generator is not None else _csprng_generator(x.device)
    noise = torch.randn(total.shape, dtype=torch.float64, device=x.device, generator=generator)
    return ((total + sigma * noise) / n).to(x.dtype)


@torch.no_grad()
def release_channel_moment(
    inputs: torch.Tensor | TensorDataset,
    noise_multiplier: float = WHITEN_NOISE,
    *,
    generator: torch.Generator | None = None,
    num_samples: int | None = None,
    batch_size: int = 4096,
) -> torch.Tensor:
    """The channel second moment of the unit-normalised samples, released by the Gaussian mechanism.

    Each sample ``x_i`` (shape ``[C, ...]``) is normalised to ``u_i = x_i / ||x_i||`` and read as
    ``C`` channels of ``P`` positions (``U_i``, ``C x P``; a flat sample of ``D`` features is ``D``
    channels of one position). Returns the float64 ``C x C`` matrix
    ``(sum_i U_i U_i^T + Z) / n``, with ``Z`` symmetric and its upper triangle (diagonal
    included) i.i.d. ``N(0, noise_multiplier^2)``.

    Privacy (Gaussian mechanism, Dwork and Roth 2014, Theorem A.1; accounted as
    ``GaussianDpEvent(noise_multiplier)``, like :func:`release_mean`): the release is the upper
    triangle of the sum (the rest is its mirror image, post-processing). Adding or removing one
    sample moves the sum by ``U U^T``, whose Frobenius norm is at most
    ``sum_p ||u_p u_p^T||_F = sum_p ||u_p||^2 = ||u||^2 <= 1``, and the upper triangle's L2 norm is
    at most that: sensitivity 1 under add/remove (the accountant doubles it for replace-one).
    Floating point: every entry is a float64 sum of ``m = N P`` products (``N`` rows), so it errs
    by at most ``gamma_{m+1} sum_i (|U_i| |U_i|^T)_{cd}`` in any summation order (Higham, *Accuracy
    and Stability of Numerical Algorithms*, eq. (3.4)), i.e. by ``gamma_{m+1} sum_i ||U_i||_F^2 <=
    gamma_{m+1} N r^2`` in Frobenius norm for samples of norm ``r``. Two neighbouring computed sums
    then differ by at most ``r^2 (1 + 2 gamma_{m+1} N)``; the samples are normalised to ``r^2 =
    1 / (1 + 2 gamma_{m+1} N)`` with ``N = n + 1`` (``m = N P``), which keeps that at most 1.
    ``n`` (``num_samples``, default the number of rows) is public, as for :func:`release_mean`;
    the radius depends on it alone, so two neighbours (at most ``n + 1`` rows each) normalise
    alike. The noise comes from ``generator`` (default: seeded from the OS CSPRNG).

    Nothing is recorded here: pass the result to :func:`whitening` and the matrix it returns, with
    this ``noise_multiplier``, to :class:`clipless.nn.InputNorm` (``whiten=``, ``whiten_noise=``);
    :meth:`clipless.PrivacyEngine.make_private` composes the release with the training steps.
    """
    from clipless.nn._functional import project_norm
    from clipless.norms import all_finite

    x, sigma, n = _release_arguments(inputs, noise_multiplier, num_samples, batch_size)
    rows, channels = len(x), x.shape[1]
    positions = x[0].numel() // channels
    cap = _row_cap(rows, n)
    radius = math.sqrt(1.0 / (1.0 + 2.0 * _gamma(cap * positions + 1) * cap))
    total = torch.zeros(channels, channels, dtype=torch.float64, device=x.device)
    for start in range(0, rows, batch_size):
        chunk = x[start : start + batch_size].to(torch.float64)
        if not all_finite(chunk):
            raise ValueError("inputs must be finite")
        u = project_norm(chunk, radius, "sphere").reshape(len(chunk), channels, positions)
        flat = u.transpose(0, 1).reshape(channels, -1)  # [C, b P]
        total += flat @ flat.T
    # The release is the upper triangle; the lower one must be its exact mirror. ``flat @ flat.T``
    # is not exactly symmetric in floating point, and its asymmetry (a function of the data's
    # rounding, untouched by the symmetric noise) would be released without noise.
    total = total.triu() + total.triu(1).T
    generator = generator if generator is not None else _csprng_generator(x.device)
    noise = torch.randn(
        channels, channels, dtype=torch.float64, device=x.device, generator=generator
    ).triu()
    noise = noise + noise.triu(1).T
    return (total + sigma * noise) / n


def _release_arguments(
    inputs: torch.Tensor | TensorDataset,
    noise_multiplier: float,
    num_samples: int | None,
    batch_size: int,
) -> tuple[torch.Tensor, float, int]:
    """``(x, sigma, n)`` of a release, or a ``ValueError`` naming the bad argument."""
    sigma = _validate.finite_positive("noise_multiplier", noise_multiplier, wrong_type=ValueError)
    for name, value in (("num_samples", num_samples), ("batch_size", batch_size)):
        _validate.optional(_validate.integer, name, value, wrong_type=ValueError)
    x = inputs.tensors[0] if isinstance(inputs, TensorDataset) else inputs
    if not isinstance(x, torch.Tensor) or x.ndim < 2 or len(x) == 0:
        raise ValueError("inputs must be a non-empty tensor (or TensorDataset) of shape [n, ...]")
    if not x.is_floating_point():
        raise ValueError(f"inputs must be floating point; got {x.dtype}")
    n = len(x) if num_samples is None else int(num_samples)
    if n < 1:
        raise ValueError(f"num_samples must be >= 1; got {num_samples!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size!r}")
    return x, sigma, n


def _csprng_generator(device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from the operating system's CSPRNG."""
    import secrets

    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def _row_cap(rows: int, n: int) -> int:
    """``n + 1``: the most rows either of two neighbouring datasets of public size ``n`` has."""
    if rows > n + 1:
        raise ValueError(
            f"num_samples must be at least the number of rows - 1 (the public dataset size, from "
            f"which the rounding bound is computed); got {n} for {rows} rows"
        )
    return n + 1


def whitening(
    moment: torch.Tensor,
    center: torch.Tensor | None = None,
    shrink: float = WHITEN_SHRINK,
    *,
    noise_multiplier: float | None = None,
    num_samples: int | None = None,
) -> torch.Tensor:
    """A shrunk inverse square root of the channel covariance: the ``whiten`` of ``InputNorm``.

    ``moment`` is :func:`release_channel_moment`'s ``C x C`` output and ``center`` the mean
    (:func:`release_mean`, one sample's shape ``[C, ...]``) that ``InputNorm`` subtracts first, if
    any. With ``M_c = center`` read as ``C x P``, the covariance is ``A = moment - M_c M_c^T``;
    with its eigen-decomposition ``A = V diag(lambda) V^T`` (negative eigenvalues, which only
    noise creates, set to 0) and ``m`` the mean eigenvalue, the result is
    ``V diag(d) V^T`` with ``d_j = (lambda_j + l)^(-1/2)``, scaled so that ``max d = 1``, where
    the lift is ``l = shrink m``, or, given the release's ``noise_multiplier`` ``z`` and
    ``num_samples`` ``n``, ``l = max(shrink m, 2 z sqrt(C) / n)``: ``2 z sqrt(C) / n`` is about
    the spectral norm of the release's noise ``Z / n`` (a symmetric Gaussian matrix's, the
    semicircle edge), below which a direction's variance cannot be told from noise. With few
    samples the lift grows and the result tends to the identity instead of amplifying noise.
    It is non-expansive (``||whiten||_2 = 1``) and shrinks the directions in which the samples vary
    most; ``shrink -> inf`` tends to the identity, ``shrink -> 0`` to full whitening. It is a
    function of released values only (post-processing: no privacy cost of its own). A float64
    tensor.

    Why: the unit-normalised scattering features are strongly correlated across channels (the top
    channel direction carries ~35% of the variance), which conditions a linear model's problem
    badly; DP noise makes Adam's per-coordinate scaling uninformative, so the optimiser cannot
    correct it. Partial whitening (``shrink`` 0.3-3) gained ~0.4 points on Fashion-MNIST at
    epsilon 3 (``benchmarks/RESULTS.md`` section 20).
    """
    square = isinstance(moment, torch.Tensor) and moment.ndim == 2
    if not square or moment.shape[0] != moment.shape[1]:
        raise ValueError("moment must be a square C x C tensor (release_channel_moment)")
    if not bool(torch.isfinite(moment).all()):
        raise ValueError("moment must be finite")
    s = float(shrink)
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"shrink must be a finite number > 0; got {shrink!r}")
    a = moment.to(torch.float64)
    channels = a.shape[0]
    if center is not None:
        if center.ndim < 1 or center.shape[0] != channels:
            raise ValueError(
                f"center must have one sample's shape [C, ...] with C = {channels}; got "
                f"{tuple(center.shape)}"
            )
        c = center.to(torch.float64).reshape(channels, -1)
        a = a - c @ c.T
    a = (a + a.T) / 2
    lam, vecs = torch.linalg.eigh(a)
    lam = lam.clamp_min(0.0)
    lift = s * float(lam.mean())
    if (noise_multiplier is None) != (num_samples is None):
        raise ValueError("noise_multiplier and num_samples go together (the release's noise floor)")
    if noise_multiplier is not None and num_samples is not None:
        z, n = float(noise_multiplier), int(num_samples)
        if not (math.isfinite(z) and z > 0.0) or n < 1:
            raise ValueError(
                f"noise_multiplier must be > 0 and num_samples >= 1; got {noise_multiplier!r}, "
                f"{num_samples!r}"
            )
        lift = max(lift, 2.0 * z * math.sqrt(channels) / n)
    if lift == 0.0:
        return torch.eye(channels, dtype=torch.float64, device=a.device)
    d = (lam + lift).rsqrt()
    d = d / d.max()
    return (vecs * d) @ vecs.T


def _kymatio_scattering(shape: tuple[int, int], J: int, L: int, max_order: int) -> torch.nn.Module:
    try:
        # The 2-D frontend directly: ``kymatio.torch`` also imports the 3-D frontend, which fails
        # with SciPy >= 1.15 (``scipy.special.sph_harm`` was removed) in kymatio 0.3.0.
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D as Scattering
    except ImportError:  # pragma: no cover - a later kymatio layout
        try:
            from kymatio.torch import Scattering2D as Scattering
        except ImportError as exc:
            raise ImportError(
                "the scattering front-end needs kymatio (a dependency of clipless): "
                "pip install kymatio"
            ) from exc
    module: torch.nn.Module = Scattering(J=J, shape=shape, L=L, max_order=max_order)
    return module


class Scattering2d(torch.nn.Module):
    """Wavelet scattering of ``C x H x W`` images, then a per-sample group normalisation.

    Output ``[batch, C * K, H / 2^J, W / 2^J]`` with ``K = 1 + J L + L^2 J (J - 1) / 2``
    scattering paths per input channel (81 for ``J = 2, L = 8``; ``max_order = 1`` keeps
    ``1 + J L``). ``groups`` > 0 normalises each sample's channels in ``groups`` contiguous groups
    to zero mean and unit variance (``torch.nn.functional.group_norm`` without affine parameters,
    ``eps = 1e-5``: a function of that sample alone); ``groups = 0`` keeps the raw coefficients.
    The default ``groups = 27`` is Tramèr and Boneh's choice for ``81`` channels.

    The map has no trainable parameters and uses no data: it is a public pre-processing (module
    docstring). After the normalisation every sample's feature vector has squared norm close to
    its number of entries (exactly ``numel`` when no group is constant), so the model's
    :class:`clipless.nn.InputNorm` radius ``sqrt(numel)`` (:attr:`natural_norm`) leaves the
    features unchanged.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        J: int = 2,
        L: int = 8,
        max_order: int = 2,
        groups: int = 27,
    ) -> None:
        super().__init__()
        shape = tuple(int(s) for s in input_shape)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(
                f"input_shape must be (channels, height, width) of positive sizes; got {shape}"
            )
        if not isinstance(J, int) or J < 1 or min(shape[1:]) < 2**J:
            raise ValueError(
                f"J must be an int >= 1 with 2**J <= min(height, width) = {min(shape[1:])}; got {J}"
            )
        if not isinstance(L, int) or L < 1:
            raise ValueError(f"L must be an int >= 1 (orientations); got {L!r}")
        if max_order not in (1, 2):
            raise ValueError(f"max_order must be 1 or 2; got {max_order!r}")
        paths = 1 + J * L + (L * L * J * (J - 1) // 2 if max_order == 2 else 0)
        channels = shape[0] * paths
        if not isinstance(groups, int) or groups < 0 or (groups and channels % groups):
            raise ValueError(
                f"groups must be 0 (no normalisation) or a divisor of the {channels} scattering "
                f"channels; got {groups!r}"
            )
        self.input_shape = shape
        self.J, self.L, self.max_order, self.groups = J, L, max_order, groups
        self.scattering = _kymatio_scattering(shape[1:], J, L, max_order)
        self.output_shape = (channels, shape[1] // 2**J, shape[2] // 2**J)

    @property
    def natural_norm(self) -> float:
        """``sqrt(numel)`` of one output: the feature norm after group normalisation is at most
        this in exact arithmetic (float32 evaluation may exceed it by rounding, ~1e-7 relative).
        Not a privacy bound: the model's :class:`clipless.nn.InputNorm` enforces its own."""
        return math.sqrt(math.prod(self.output_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(
                f"expected images of shape [batch, {', '.join(map(str, self.input_shape))}]; "
                f"got {list(x.shape)}"
            )
        z = self.scattering(x.contiguous())  # [B, C, K, h, w]
        z = z.reshape(x.shape[0], *self.output_shape)
        if self.groups:
            z = torch.nn.functional.group_norm(z, self.groups, eps=1e-5)
        return z

    def extra_repr(self) -> str:
        return (
            f"input_shape={self.input_shape}, J={self.J}, L={self.L}, "
            f"max_order={self.max_order}, groups={self.groups}"
        )


def build_features(name: str, input_shape: Sequence[int]) -> Scattering2d | None:
    """The front-end called ``name`` (:data:`FEATURES`) for samples of ``input_shape``."""
    if name == "none":
        return None
    if name == "scatter":
        return Scattering2d(input_shape)
    raise ValueError(f"features must be one of {FEATURES}; got {name!r}")


@torch.no_grad()
def apply_features(
    features: torch.nn.Module,
    data: TensorDataset,
    batch_size: int = 1024,
    device: torch.device | str | None = None,
) -> TensorDataset:
    """``TensorDataset(features(x), y)``, computed once in batches (the map is per-sample, so the
    batching does not change the result). With ``device`` (e.g. ``"cuda"``) each batch is mapped
    there and the features come back to ``x``'s device: the dataset stays where it was."""
    if not _validate.is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1; got {batch_size!r}")
    x, *rest = data.tensors
    if len(x) == 0:
        raise ValueError("data must hold at least one sample")
    if device is not None:
        features = features.to(device)

    def mapped(chunk: torch.Tensor) -> torch.Tensor:
        if device is None:
            return features(chunk)
        return features(chunk.to(device)).to(x.device)

    out = torch.cat([mapped(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])
    return TensorDataset(out, *rest)


FEATURE_CACHE_FORMAT = "clipless-features-v1"


def _library_versions() -> str:
    try:
        from importlib.metadata import version

        kymatio = version("kymatio")
    except Exception:  # pragma: no cover - kymatio not installed through pip
        kymatio = "unknown"
    return f"torch {torch.__version__}, kymatio {kymatio}"


def _clipless_sources(features: torch.nn.Module) -> bytes:
    """The source files of the clipless modules that define the map's classes (its ``forward``
    and the helpers beside it: a change there changes the features without changing ``repr``)."""
    import inspect
    import sys

    files: dict[str, bytes] = {}
    for module in features.modules():
        name = type(module).__module__
        if name.split(".")[0] != "clipless":
            continue  # torch and kymatio are covered by their versions
        try:
            path = inspect.getsourcefile(sys.modules[name])
        except (KeyError, TypeError):
            path = None
        if path and path not in files:
            files[path] = Path(path).read_bytes()
    return b"".join(hashlib.sha256(files[p]).digest() for p in sorted(files))


def _hash_tensor(h: hashlib._Hash, name: str, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().data)


def feature_cache_key(
    features: torch.nn.Module,
    x: torch.Tensor,
    batch_size: int = 1024,
    device: torch.device | str | None = None,
) -> str:
    """SHA-256 (hex) naming the output of ``apply_features(features, x, batch_size)``.

    It covers everything the output depends on: the map's class and configuration, with every
    submodule's (``repr``, which nests the children's ``extra_repr``), its training mode, every
    tensor of its state (a scattering's filter bank), the source files of the clipless modules
    that define its classes (so an edited ``forward`` or constant does not reuse old features),
    the torch and kymatio versions, the batch size, the device type that computes them (another
    device's kernels round differently), and the input's dtype, shape and bytes. Two
    calls with the same key compute the same features, so a cached tensor can stand in for the
    computation. A map whose output depends on plain attributes that its ``repr`` does not show
    is not covered: give it an ``extra_repr``.
    """
    h = hashlib.sha256()
    modes = "".join("t" if m.training else "e" for m in features.modules())
    h.update(
        f"{FEATURE_CACHE_FORMAT}\n{type(features).__module__}.{type(features).__qualname__}\n"
        f"{features!r}\nmodes {modes}\n{_library_versions()}\nbatch_size {batch_size}\n".encode()
    )
    kind = torch.device(device).type if device is not None else x.device.type
    if kind != "cpu":  # CPU keys are those of the files cached before devices were recorded
        h.update(f"device {kind}\n".encode())
    h.update(_clipless_sources(features))
    for name, t in sorted(features.state_dict().items()):
        _hash_tensor(h, f"state {name}", t)
    _hash_tensor(h, "input", x)
    return h.hexdigest()


def _read_cached(path: Path, key: str, rows: int) -> torch.Tensor | None:
    """The tensor cached at ``path`` under ``key``, or ``None`` when absent or not usable."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn or foreign file: recompute and overwrite it
        warnings.warn(f"feature cache {path} is unreadable ({exc}); recomputing", stacklevel=3)
        return None
    tensor = saved.get("features") if isinstance(saved, dict) else None
    if (
        not isinstance(saved, dict)
        or saved.get("format") != FEATURE_CACHE_FORMAT
        or saved.get("key") != key
        or not isinstance(tensor, torch.Tensor)
        or tensor.dim() < 1
        or tensor.shape[0] != rows
    ):
        warnings.warn(
            f"feature cache {path} does not hold these features; recomputing", stacklevel=3
        )
        return None
    return tensor


@torch.no_grad()
def cached_features(
    features: torch.nn.Module,
    data: TensorDataset,
    cache_dir: str | os.PathLike[str],
    batch_size: int = 1024,
    device: torch.device | str | None = None,
) -> tuple[TensorDataset, Path, bool]:
    """:func:`apply_features` through a cache on disk: ``(dataset, cache file, found)``.

    The features of ``data`` are stored under ``cache_dir`` in a file named by
    :func:`feature_cache_key` (the map, its state, the library versions and the input's bytes), so
    a later call with the same map and data loads them instead of computing them; any change of
    these gives another file. ``device`` computes them there (:func:`apply_features`). A file
    that cannot be read or does not match its key is recomputed
    and replaced, with a warning; a cache that cannot be written (read-only, full) only warns.
    Files are written atomically, so concurrent processes (the ranks of ``clipless train
    --nproc``) at worst compute the same tensor twice.

    Privacy: the cache holds a per-sample transform of the training data and is as sensitive as
    the data itself; its files are readable by their owner only (mode ``0o600``). Nothing
    released depends on whether the features were loaded or computed.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size!r}")
    from clipless._io import atomic_write_with

    x, *rest = data.tensors
    key = feature_cache_key(features, x, batch_size, device)
    path = Path(cache_dir) / f"{key[:40]}.pt"
    cached = _read_cached(path, key, len(x))
    if cached is not None:
        return TensorDataset(cached, *rest), path, True
    out = apply_features(features, data, batch_size, device)
    payload = {"format": FEATURE_CACHE_FORMAT, "key": key, "features": out.tensors[0]}
    # owner-only, like any copy of training data (the folder is the user's dataset cache)
    try:
        atomic_write_with(path, lambda handle: torch.save(payload, handle), mode=0o600)
    except OSError as exc:  # a read-only or full cache: the features are still here
        warnings.warn(
            f"could not write the feature cache {path} ({exc}); continuing without it",
            stacklevel=3,
        )
    return out, path, False
