"""Certified operator norms of 2-D multi-channel convolutions.

:func:`conv_norm` bounds ``x -> conv2d(x, weight, stride, padding)`` by the FFT symbol of the
kernel (Sedghi, Gupta & Long 2019, "The singular values of convolutional layers", with strided
and zero-padded layers embedded exactly into circular ones: :func:`_polyphase_1d`), by the
multiplicity bound ``sqrt(k_eff) ||K reshaped (c_out, c_in kh kw)||_2`` (:func:`conv_multiplicity`)
or by the layer's explicit matrix; :func:`norm_tensor` is the ``"auto"`` bound of a dense or
convolutional weight as a device tensor. :func:`conv_power_iteration` gives a *lower* bound
(steering only).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, NamedTuple

import torch

from clipless import _certified, _validate
from clipless._certified import inflate
from clipless.norms.certificates import (
    _as_tensor,
    _inflated,
    _max_norm_tall,
    all_finite,
    matrix_products_only,
)
from clipless.norms.dense import _GRAM_AUTO_ITERS, dense_norm
from clipless.norms.iterations import (
    GramRequest,
    PowerIterationResult,
    _gram_bounds,
    _gram_bounds_many,
    power_iteration,
)

_GRAM_CONV_ITERS = 10  # per-frequency matrices (rank <= channels): within rank^(2^-11)

_EXPLICIT_MAX_DIM = 1024  # conv "auto": exact SVD of the explicit matrix when c_in H W <= this
_EXPLICIT_MAX_NUMEL = 2**22  # ... and the matrix has at most this many entries


def _as_pair(value: int | tuple[int, ...] | list[int], name: str) -> tuple[int, int]:
    if _validate.is_int(value):
        return (int(value), int(value))
    if isinstance(value, tuple | list) and len(value) == 2 and all(map(_validate.is_int, value)):
        return (int(value[0]), int(value[1]))
    raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")


def _check_conv_args(
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    input_size: tuple[int, int] | None,
) -> None:
    if min(kernel_size) < 1:
        raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
    if min(stride) < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if min(padding) < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    if padding_mode not in ("zeros", "circular"):
        raise ValueError(f"padding_mode must be 'zeros' or 'circular', got {padding_mode!r}")
    if input_size is None:
        return
    for n, k, p in zip(input_size, kernel_size, padding, strict=True):
        if n < 1:
            raise ValueError(f"input_size must be >= 1, got {input_size}")
        if n + 2 * p < k:
            raise ValueError(
                f"input_size {input_size} with padding {padding} is smaller than the kernel "
                f"{kernel_size}: no output"
            )
        if padding_mode == "circular" and p > n:
            raise ValueError(
                f"circular padding {padding} larger than the input size {input_size} (torch "
                "refuses to wrap around more than once)"
            )


def _multiplicity_1d(n: int, k: int, s: int, p: int, circular: bool) -> int:
    """Largest number of (output, tap) pairs reading one input pixel, by direct enumeration."""
    n_out = (n + 2 * p - k) // s + 1
    counts = [0] * n
    for o in range(n_out):
        for j in range(k):
            i = o * s + j - p
            if circular:
                counts[i % n] += 1
            elif 0 <= i < n:
                counts[i] += 1
    return max(counts)


def _size_free_multiplicity_1d(k: int, s: int, p: int, circular: bool) -> int:
    base = -(-k // s)
    if not circular or p == 0 or (s == 1 and 2 * p <= k - 1):
        return base
    return 3 * base


def conv_multiplicity(
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int],
    padding: int | tuple[int, int],
    padding_mode: str,
    input_size: int | tuple[int, int] | None,
) -> int:
    """Exact ``k_eff``: the most (output position, kernel offset) pairs that read one input pixel.

    Output ``o`` reads, through tap ``j``, the padded position ``o s + j``, i.e. input pixel
    ``o s + j - p`` (zeros: counted only inside ``[0, n)``; circular: taken modulo ``n``, so one
    pixel can be read through several wrapped copies). The count is separable, so the 2-D maximum
    is the product of the two 1-D maxima, each found by enumeration.

    Claim: the result ``k_eff`` bounds, for every input pixel, the number of (output position,
    tap) pairs that read it (for every input size when ``input_size=None``); hence the two uses
    below.

    Uses. (1) Per-sample conv weight gradient:
    ``grad_K[co, ci, j] = sum_o dy[co, o] x[ci, i(o, j)]``; by Cauchy-Schwarz
    ``||grad_K||_F^2 <= ||dy||^2 sum_{o, j} ||x[:, i(o, j)]||^2 <= k_eff ||dy||^2 ||x||^2``.
    (2) Operator norm: ``||y||^2 = sum_o ||K_mat patch_o||^2 <= ||K_mat||_2^2 k_eff
    ||x||^2`` (:func:`conv_norm`, method ``"frobenius"``).

    ``input_size=None`` gives a size-free bound, valid for every input size: ``ceil(kh/sh) *
    ceil(kw/sw)`` for zero padding (the taps reading pixel ``i`` satisfy ``j = i + p - o s``: one
    residue class modulo ``s`` in ``[0, k)``), and for circular padding when each dimension has
    stride 1 and ``2 p <= k - 1`` (the outputs read at most ``n`` distinct residues of the ``k``
    taps modulo ``n``) or ``p = 0``. Otherwise, for circular padding, the pixel has at most 3
    padded copies (torch requires ``p <= n``), each read at most ``ceil(k/s)`` times: the
    size-free value is ``3 ceil(k/s)`` in that dimension.
    """
    ks = _as_pair(kernel_size, "kernel_size")
    st = _as_pair(stride, "stride")
    pd = _as_pair(padding, "padding")
    size = None if input_size is None else _as_pair(input_size, "input_size")
    _check_conv_args(ks, st, pd, padding_mode, size)
    return _enumerated_multiplicity(ks, st, pd, padding_mode == "circular", size)


# Layers ask for their k_eff in every forward and every bound report: a pure function of the
# (checked, integer) geometry, enumerated once per geometry.
@functools.lru_cache(maxsize=4096)
def _enumerated_multiplicity(
    ks: tuple[int, int],
    st: tuple[int, int],
    pd: tuple[int, int],
    circular: bool,
    size: tuple[int, int] | None,
) -> int:
    if size is None:
        return math.prod(
            _size_free_multiplicity_1d(k, s, p, circular)
            for k, s, p in zip(ks, st, pd, strict=True)
        )
    return math.prod(
        _multiplicity_1d(n, k, s, p, circular) for n, k, s, p in zip(size, ks, st, pd, strict=True)
    )


class _Polyphase(NamedTuple):
    """Per-dimension description of a strided convolution as a stride-1 circular convolution."""

    phase: list[int]  # input phase b_j of tap j
    shift: list[int]  # position a_j - min(a) of tap j on the coarse grid
    grid: int  # circular grid size on which the taps are folded
    duplication: int  # max number of identical output rows (circular wrap of outputs)
    copies: int  # max number of padded copies of one input pixel (relaxed circular case)
    decimation: int  # the polyphase stride the kernel is built with


def _polyphase_1d(n: int, k: int, s: int, p: int, circular: bool) -> _Polyphase:
    """Exact polyphase embedding of the 1-D strided correlation ``y[o] = sum_j w[j] xpad[o s + j]``.

    Write the pixel read by tap ``j`` at output ``o`` as ``o s + j - p = (o + a_j) s + b_j`` with
    ``b_j = (j - p) mod s`` and ``a_j = floor((j - p) / s)``. With the polyphase components
    ``x_b[m] = x[m s + b]`` (a permutation of the pixels: an isometry) the layer is
    ``y[o] = sum_j w[j] x_{b_j}[o + a_j]``: a stride-1 correlation with ``s`` times more input
    channels and taps ``a_j`` spanning ``span <= ceil(k / s)`` positions.

    Claim: the layer is ``S C P`` with ``C`` the stride-1 circular correlation of the polyphase
    taps on ``Z_grid``, ``||P||^2 <= copies`` and ``||S||^2 <= duplication`` (crops,
    zero-extensions and permutations have norm <= 1), so its norm is at most
    ``sqrt(copies duplication) ||C||``; in 2-D the index maps act on each dimension separately,
    so the factors multiply. Proof, case by case:

    * Zero padding: every ``x_b`` lives on ``m in [0, ceil(n / s))``; the outputs form a crop (and
      zero rows) of the full correlation, which equals the circular correlation on a grid of size
      ``N = ceil(n / s) + span - 1`` applied to the zero-extended components (no index wraps onto
      a non-zero entry). Crop and zero-extension have norm <= 1.
    * Circular padding with ``s | n``: ``x_b[m]`` is ``n / s``-periodic in ``m``, so the layer is
      exactly a circular correlation on the grid ``n / s``, except that the ``n_out`` outputs
      repeat rows with period ``n / s``: each row at most ``ceil(n_out s / n)`` times, a factor
      ``sqrt(duplication)`` on the norm. For ``s = 1`` and ``2 p = k - 1`` this is Sedghi et
      al.'s exact circulant.
    * Circular padding with ``s`` not dividing ``n``: relax. ``xpad = P x`` with ``||P||^2`` the
      largest number of padded copies of a pixel, and the valid strided correlation of ``xpad``
      (a zero-padding-free layer on ``n + 2p`` pixels) is embedded as in the zero-padding case.
      :func:`_polyphase_candidates` offers a second embedding of the circular cases.
    """
    if circular and n % s != 0:
        length = n + 2 * p
        relaxed = _polyphase_1d(length, k, s, 0, circular=False)
        copies = max(sum(1 for q in range(length) if (q - p) % n == i) for i in range(n))
        return relaxed._replace(copies=copies)
    a = [(j - p) // s for j in range(k)]
    b = [(j - p) % s for j in range(k)]
    a_min = min(a)
    span = max(a) - a_min + 1
    if circular:
        grid = n // s
        n_out = (n + 2 * p - k) // s + 1
        duplication = -(-n_out // grid)
    else:
        grid = -(-n // s) + span - 1
        duplication = 1
    return _Polyphase(
        phase=b,
        shift=[x - a_min for x in a],
        grid=grid,
        duplication=duplication,
        copies=1,
        decimation=s,
    )


def _polyphase_candidates(n: int, k: int, s: int, p: int, circular: bool) -> list[_Polyphase]:
    """Embeddings of one dimension of the layer, each valid; the certificate takes the best.

    Every candidate's ``decimation`` is the polyphase stride its kernel is built with. Zero
    padding has one embedding (:func:`_polyphase_1d`). Circular padding has two, each an upper
    bound, the second exact in the common "same" case:

    * the padded copies: ``xpad = P x`` with ``||P||^2`` the largest number of padded copies of a
      pixel (usually 2; 1 for ``p = 0``), then the valid strided correlation of ``xpad``
      embedded as in the zero-padding case (a crop of a circulant: an upper bound);
    * the circulant: output ``o`` reads ``x[(o s + j - p) mod n]``, i.e. it is output
      ``t = (o s) mod n`` of the stride-1 circular correlation on ``Z_n``. With
      ``g = gcd(s, n)`` every such ``t`` is a multiple of ``g``, and ``o -> (o s) mod n`` has
      period ``n / g``, so the layer is ``R A_g`` with ``A_g`` the stride-``g`` circular layer
      (``g | n``: the exact polyphase circulant on the grid ``n / g``) and ``R`` a selection of
      its rows, each taken at most ``ceil(n_out / (n / g))`` times: ``||R||^2`` is that count
      (``R^T R`` is diagonal). Exact when ``s | n`` and ``n_out = n / s`` (each row once: the
      "same" padding of Sedghi et al.).

    Measured against the exact norm on random kernels (``k = 3``, ``p = 1``, ``s = 2``, odd
    ``n``), the padded copies alone were 1.75-2.1x above it and the circulant 1.2-1.3x. The two
    dimensions pick their embeddings independently (the layer's index maps act on each dimension
    separately).
    """
    if not circular:
        return [_polyphase_1d(n, k, s, p, circular=False)]
    length = n + 2 * p
    copies = max(sum(1 for q in range(length) if (q - p) % n == i) for i in range(n))
    copied = _polyphase_1d(length, k, s, 0, circular=False)._replace(copies=copies)
    g = math.gcd(s, n)
    n_out = (n + 2 * p - k) // s + 1
    circulant = _polyphase_1d(n, k, g, p, circular=True)._replace(duplication=-(-n_out // (n // g)))
    if g == s and n_out == n // s:
        return [circulant]
    return [copied, circulant]


def _phases(grid: int, frequencies: int, span: int, device: torch.device) -> torch.Tensor:
    """``exp(-2 pi i f a / grid)`` for ``f < frequencies``, ``a < span`` (``f a`` mod grid)."""
    f = torch.arange(frequencies, device=device)
    a = torch.arange(span, device=device)
    turns = torch.remainder(torch.outer(f, a), grid).to(torch.float64) / grid
    return torch.polar(torch.ones_like(turns), turns * (-2.0 * math.pi))


def _symbol_matrices(
    weight: torch.Tensor, dims: tuple[_Polyphase, _Polyphase], strides: tuple[int, int]
) -> torch.Tensor:
    """The matrices of :func:`_symbol_tensor`, tall: shape ``(F, k, n)``, ``k >= n``: ``K(f)``
    (``c_out >= c_in sh sw``) or ``K(f)^T`` (otherwise; same singular values), contiguous."""
    mats = _symbol_tensor(weight, dims, strides)
    return mats if mats.shape[-2] >= mats.shape[-1] else mats.transpose(-2, -1).contiguous()


def _max_spectral_norm(mats: torch.Tensor) -> float:
    """Certified upper bound on ``max_i ||mats[i]||_2`` over a batch of complex matrices.

    On the CPU: :func:`_max_norm_tall` (on the transposes when the matrices are wide: same
    singular values); within ``~1.5e-6`` of the exact value for
    sides above :data:`_CONV_EIGH_MAX_DIM` (Cholesky certificate), within ``NUMERIC_MARGIN``
    below. Off the CPU (:func:`matrix_products_only`): one batched Gram iteration of every
    frequency's matrix (:func:`_gram_bounds`, :data:`_GRAM_CONV_ITERS` steps).
    """
    rows, cols = int(mats.shape[-2]), int(mats.shape[-1])
    flat = mats.reshape(-1, rows, cols)
    if flat.shape[0] == 0:
        return 0.0  # the maximum over no matrix (the CPU's certificate returns it too)
    if matrix_products_only(flat):  # one batched chain of products, one host read
        return float(_gram_bounds(flat, _GRAM_CONV_ITERS).max().item())
    return _max_norm_tall(flat.mT if rows < cols else flat)


def _grids(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    circular: bool,
    input_size: tuple[int, int],
) -> Iterator[tuple[tuple[_Polyphase, _Polyphase], tuple[int, int], int]]:
    """Every pair of per-dimension embeddings (:func:`_polyphase_candidates`) with its
    decimation and the number of copies (duplication x copies) its symbol's norm is scaled by."""
    kh, kw = weight.shape[-2:]
    for dims in itertools.product(
        _polyphase_candidates(input_size[0], kh, stride[0], padding[0], circular),
        _polyphase_candidates(input_size[1], kw, stride[1], padding[1], circular),
    ):
        copies = dims[0].duplication * dims[1].duplication * dims[0].copies * dims[1].copies
        yield dims, (dims[0].decimation, dims[1].decimation), copies


def _conv_norm_fft(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    circular: bool,
    input_size: tuple[int, int],
) -> float:
    if matrix_products_only(weight):
        return float(_conv_fft_tensor(weight, stride, padding, circular, input_size).item())
    bounds = [
        inflate(_max_norm_tall(_symbol_matrices(weight, dims, decimation)) * math.sqrt(copies))
        for dims, decimation, copies in _grids(weight, stride, padding, circular, input_size)
    ]
    return min(bounds)


def _conv_norm_frobenius(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    input_size: tuple[int, int] | None,
) -> float:
    kh, kw = weight.shape[-2:]
    k_eff = conv_multiplicity((kh, kw), stride, padding, padding_mode, input_size)
    mat = weight.detach().reshape(weight.shape[0], -1)
    return inflate(math.sqrt(k_eff) * dense_norm(mat))


def _conv_apply(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
) -> torch.Tensor:
    """torch's Conv2d semantics (circular padding through ``F.pad``), without bias."""
    if padding_mode == "circular":
        ph, pw = padding
        x = torch.nn.functional.pad(x, (pw, pw, ph, ph), mode="circular")
        return torch.nn.functional.conv2d(x, weight, stride=stride)
    return torch.nn.functional.conv2d(x, weight, stride=stride, padding=padding)


def _small(
    weight: torch.Tensor, stride: tuple[int, int], padding: tuple[int, int], size: tuple[int, int]
) -> bool:
    c_out, c_in, kh, kw = (int(d) for d in weight.shape)
    d_in = c_in * size[0] * size[1]
    d_out = c_out
    for n, k, s, p in zip(size, (kh, kw), stride, padding, strict=True):
        d_out *= (n + 2 * p - k) // s + 1
    return d_in <= _EXPLICIT_MAX_DIM and d_in * d_out <= _EXPLICIT_MAX_NUMEL


def _explicit_matrix(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    input_size: tuple[int, int],
) -> torch.Tensor:
    """The transpose of the layer's matrix (same norm), in float64: the convolution applied to
    every basis image."""
    c_in = int(weight.shape[1])
    d_in = c_in * input_size[0] * input_size[1]
    basis = torch.eye(d_in, dtype=torch.float64, device=weight.device)
    out = _conv_apply(
        basis.reshape(d_in, c_in, *input_size),
        weight.detach().to(torch.float64),
        stride,
        padding,
        padding_mode,
    )
    return out.reshape(d_in, -1)


def _conv_norm_explicit(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    input_size: tuple[int, int],
) -> float:
    matrix = _explicit_matrix(weight, stride, padding, padding_mode, input_size)
    # On the CPU the SVD for small matrices, else the Gram matrix's top eigenvalue with its
    # rounding term (within ~1e-9 of the exact norm and ~5x cheaper than the SVD at 784 x 3136);
    # Gram iteration on an accelerator. The few roundings of circular wrap-around sums (relative
    # ~t u) are inside the NUMERIC_MARGIN dense_norm applies.
    method: Literal["svd", "eigh", "gram"] = "svd" if min(matrix.shape) <= 64 else "eigh"
    if matrix_products_only(matrix):
        method = "gram"
    return dense_norm(matrix, method=method, gram_iters=_GRAM_AUTO_ITERS)


def conv_norm(
    weight: torch.Tensor,
    *,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    padding_mode: str = "zeros",
    input_size: int | tuple[int, int] | None,
    method: Literal["auto", "fft", "frobenius", "explicit"] = "auto",
) -> float:
    """Certified upper bound on the operator norm of ``x -> conv2d(x, weight, stride, padding)``.

    The operator acts on inputs of spatial size ``input_size`` (``None``: any size), with torch's
    ``Conv2d`` semantics (cross-correlation, ``padding_mode`` ``"zeros"`` or ``"circular"``).

    ``"fft"`` (Sedghi, Gupta & Long 2019, Theorem 6): a multi-channel circular convolution on an
    ``Nh x Nw`` grid is block-diagonalised by the 2-D DFT, so its operator norm is exactly
    ``max_f ||K(f)||_2`` over the ``c_out x c_in`` matrices of DFT coefficients of the kernel
    (the DFT of the few taps evaluated directly in complex128 -- what ``rfft2`` of the zero-padded
    kernel gives, about twice as fast; ``K(-f) = conj(K(f))`` for a real kernel, so half the
    frequencies suffice; each frequency's norm is certified from the largest eigenvalue of its
    float64 Gram matrix with the product's rounding covered, as ``dense_norm(method="eigh")``). A
    stride-``s`` layer is written exactly as a stride-1 layer on the polyphase components of the
    input (``c_in s_h s_w`` channels, kernel ``ceil(k/s)``), and zero padding embeds into the
    circular convolution on a grid of ``ceil(n/s) + ceil(k/s) - 1`` (``n + k - 1`` for stride 1):
    see :func:`_polyphase_1d` for the argument (crop, zero-extension and subsampling have norm
    <= 1). Circular padding is certified by the smaller of two embeddings per dimension
    (:func:`_polyphase_candidates`), exact when ``s | n`` and each output row is distinct
    (Sedghi et al.'s "same" case); otherwise an upper bound (when the stride does not divide the
    input size, measured up to 1.9x above the exact norm on small random kernels).
    Needs ``input_size``.

    ``"frobenius"``: ``sqrt(k_eff) ||K reshaped (c_out, c_in kh kw)||_2`` with ``k_eff`` from
    :func:`conv_multiplicity` (proof there). It is never looser than the
    ``sqrt(kh kw) ||K||_F`` of the thesis and Barczewski & Ramon 2024 (``k_eff <= kh kw`` for zero
    padding and ``||.||_2 <= ||.||_F``), which is also valid. With ``input_size=None`` it uses the
    size-free ``k_eff``.

    ``"explicit"``: the layer's matrix (the convolution applied in float64 to every basis image:
    each entry is one kernel weight, or with circular wrap-around a sum of the few weights that
    read the same pixel, so it is exact up to one rounding per addition) certified by
    :func:`dense_norm` (``"eigh"`` on the CPU, within ~1e-10 of the exact norm; Gram iteration on
    an accelerator). Needs
    ``input_size``; cost grows like ``(c_in H W)^2 (c_out H_out W_out)``.

    ``"auto"``: ``"explicit"`` for small layers (``c_in H W <= 1024``), else the smaller of
    ``"fft"`` and ``"frobenius"`` (both certified) when ``input_size`` is known, else
    ``"frobenius"``.

    Precondition: ``weight`` finite and 4-D; a valid geometry (``ValueError`` otherwise).

    Claim: the result is ``>= ||x -> conv2d(x, weight)||_2`` on inputs of size ``input_size``
    (every size for ``None``), for every method. Proofs: :func:`_polyphase_1d` and
    :func:`_polyphase_candidates` (the embeddings),
    :func:`clipless.norms.certificates._max_norm_tall` (the per-frequency norms),
    :func:`conv_multiplicity` (``"frobenius"``), :func:`dense_norm` (``"explicit"``).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4:
        raise ValueError("weight must be a 4-D tensor (c_out, c_in, kh, kw)")
    if method not in ("auto", "fft", "frobenius", "explicit"):
        raise ValueError(f"method must be 'auto', 'fft', 'frobenius' or 'explicit', got {method!r}")
    st = _as_pair(stride, "stride")
    pd = _as_pair(padding, "padding")
    size = None if input_size is None else _as_pair(input_size, "input_size")
    ks = (int(weight.shape[-2]), int(weight.shape[-1]))
    _check_conv_args(ks, st, pd, padding_mode, size)
    with torch.no_grad():
        if not all_finite(weight):
            raise ValueError("weight must be finite")
        if weight.numel() == 0:
            return 0.0
        if size is None and method in ("fft", "explicit"):
            raise ValueError(f"method={method!r} needs input_size")
        if method == "explicit" or (
            method == "auto" and size is not None and _small(weight, st, pd, size)
        ):
            assert size is not None
            return _conv_norm_explicit(weight, st, pd, padding_mode, size)
        if method == "frobenius" or size is None:
            return _conv_norm_frobenius(weight, st, pd, padding_mode, size)
        fft = _conv_norm_fft(weight, st, pd, padding_mode == "circular", size)
        if method == "fft":
            return fft
        return min(fft, _conv_norm_frobenius(weight, st, pd, padding_mode, size))


_TAP_PHASES: dict[tuple[object, ...], torch.Tensor] = {}


def _tap_phases(
    kernel: tuple[int, int],
    dims: tuple[_Polyphase, _Polyphase],
    strides: tuple[int, int],
    device: torch.device,
) -> torch.Tensor:
    """``B[j, c, f, :]``: (real, imaginary) of ``phi_f(j)`` where tap ``j`` falls in polyphase
    class ``c`` (its input phases), 0 elsewhere; shape ``(kh kw, sh sw, F, 2)``, float64.

    ``phi_f(j) = e_h(f_h, a_h(j)) e_w(f_w, a_w(j))``, one complex product of two phases of
    :func:`_phases` (error ``<= 12u``). Public geometry only:
    built once per layer geometry and device (a blocking host-to-device copy), then cached."""
    key = (kernel, tuple((tuple(d.phase), tuple(d.shift), d.grid) for d in dims), strides, device)
    cached = _TAP_PHASES.get(key)
    if cached is not None:
        return cached
    (kh, kw), (ph, pw), (sh, sw) = kernel, dims, strides
    e_h = _phases(ph.grid, ph.grid, max(ph.shift) + 1, torch.device("cpu"))
    e_w = _phases(pw.grid, pw.grid // 2 + 1, max(pw.shift) + 1, torch.device("cpu"))
    table = torch.zeros((kh, kw, sh * sw, ph.grid, pw.grid // 2 + 1), dtype=torch.complex128)
    for jh in range(kh):
        for jw in range(kw):
            phi = e_h[:, ph.shift[jh], None] * e_w[None, :, pw.shift[jw]]
            table[jh, jw, ph.phase[jh] * sw + pw.phase[jw]] = phi
    flat = torch.view_as_real(table.reshape(kh * kw, sh * sw, -1)).contiguous()
    if len(_TAP_PHASES) > 256:
        _TAP_PHASES.clear()
    _TAP_PHASES[key] = cached = flat.to(device)
    return cached


def _symbol_tensor(
    weight: torch.Tensor, dims: tuple[_Polyphase, _Polyphase], strides: tuple[int, int]
) -> torch.Tensor:
    """The per-frequency matrices ``K(f)``, ``(F, c_out, c_in sh sw)`` for the ``F = Nh (Nw // 2 +
    1)`` frequencies, complex128: ``K(f) = sum_a P[:, :, a] exp(-2 pi i (f_h a_h / Nh + f_w a_w /
    Nw))`` with ``P`` the polyphase kernel, the 2-D DFT of ``P`` folded onto the ``Nh x Nw`` grid
    (what ``rfft2`` of the folded kernel computes), evaluated directly because a kernel has few
    taps; ``f_w <= Nw // 2`` suffices (``K(-f) = conj(K(f))`` for a real kernel). One real matrix
    product of the taps with :func:`_tap_phases`: each real or imaginary component is a sum over
    the ``kh kw`` taps of a tap times a phase component (zero outside the tap's class, exactly),
    so the error analysis of :data:`NUMERIC_MARGIN` ("Symbol (DFT)") applies."""
    c_out, c_in, kh, kw = (int(d) for d in weight.shape)
    table = _tap_phases((kh, kw), dims, strides, weight.device)
    taps = weight.detach().to(torch.float64).reshape(c_out * c_in, kh * kw)
    classes, freqs = int(table.shape[1]), int(table.shape[2])
    out = torch.mm(taps, table.reshape(kh * kw, -1)).reshape(c_out, c_in, classes, freqs, 2)
    out = torch.view_as_complex(out.permute(3, 0, 1, 2, 4).contiguous())
    return out.reshape(freqs, c_out, c_in * classes)


class NormPlan(NamedTuple):
    """A certified bound as Gram requests and how their results combine (:func:`evaluate_plans`)."""

    requests: tuple[GramRequest, ...]
    finish: Callable[[list[torch.Tensor]], torch.Tensor]


def evaluate_plans(plans: Sequence[NormPlan]) -> list[torch.Tensor]:
    """Every plan's bound, the Gram requests of all plans batched together
    (:func:`_gram_bounds_many`: one chain of products per bucket, not one per layer)."""
    flat = _gram_bounds_many([req for plan in plans for req in plan.requests])
    out, start = [], 0
    for plan in plans:
        out.append(plan.finish(flat[start : start + len(plan.requests)]))
        start += len(plan.requests)
    return out


def _conv_fft_plan(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    circular: bool,
    input_size: tuple[int, int],
) -> NormPlan:
    """:func:`_conv_norm_fft` on the accelerator path, as a plan (no host read).

    The symbol of a kernel of float32 or a narrower dtype goes into the Gram iteration unscaled:
    each entry sums ``t`` taps times phases of modulus ``<= 1``, so ``|entry| <= t 2^128 (1 +
    1e-15)`` and no square overflows float64; a square that underflows (``|entry| < 2^-511``)
    moves the Frobenius norm by at most ``sqrt(F k n) 2^-511``, while that norm is at least
    ``sqrt(N / 2) ||P||_F (1 - 1e-11) >= 2^-150`` for a non-zero kernel (Parseval over the half
    spectrum; a non-zero float32 tap is ``>= 2^-149``): a relative change below ``2^-300``."""
    narrow = weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
    grids = list(_grids(weight, stride, padding, circular, input_size))
    requests = tuple(
        GramRequest(_symbol_tensor(weight, dims, decimation), _GRAM_CONV_ITERS, narrow)
        for dims, decimation, _ in grids
    )

    def finish(results: list[torch.Tensor]) -> torch.Tensor:
        bounds = [
            _inflated(r.max() * _certified.sqrt(copies))
            for r, (_, _, copies) in zip(results, grids, strict=True)
        ]
        return torch.stack(bounds).min()

    return NormPlan(requests, finish)


def _conv_fft_tensor(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    circular: bool,
    input_size: tuple[int, int],
) -> torch.Tensor:
    """:func:`_conv_fft_plan` evaluated alone."""
    return evaluate_plans([_conv_fft_plan(weight, stride, padding, circular, input_size)])[0]


def _conv_plan(
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    padding_mode: str,
    size: tuple[int, int] | None,
) -> NormPlan:
    """``conv_norm(..., method="auto")`` on the accelerator path, as a plan."""
    kh, kw = (int(weight.shape[-2]), int(weight.shape[-1]))
    k_eff = conv_multiplicity((kh, kw), stride, padding, padding_mode, size)
    mat = weight.detach().reshape(weight.shape[0], -1)
    # With zero padding the FFT bound (below) is the exact norm of a circulant containing the
    # layer, at most the size-free sqrt(k_eff) ||K_mat||_2 in every case measured (equal for
    # all-ones kernels): the size-free bound is then only a guard, in its no-iteration form.
    iters = 0 if size is not None and padding_mode == "zeros" else _GRAM_AUTO_ITERS
    guard = GramRequest(mat, iters)
    root_k = _certified.sqrt(k_eff)
    if size is None:
        return NormPlan((guard,), lambda r: _inflated(r[0] * root_k))
    if _small(weight, stride, padding, size):
        matrix = _explicit_matrix(weight, stride, padding, padding_mode, size)
        return NormPlan((GramRequest(matrix, _GRAM_AUTO_ITERS),), lambda r: r[0])
    fft = _conv_fft_plan(weight, stride, padding, padding_mode == "circular", size)

    def finish(results: list[torch.Tensor]) -> torch.Tensor:
        return torch.minimum(fft.finish(results[1:]), _inflated(results[0] * root_k))

    return NormPlan((guard, *fft.requests), finish)


def _finite_or_inf(bound: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(bound), bound, torch.full_like(bound, math.inf))


def norm_plan(
    weight: torch.Tensor,
    *,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    padding_mode: str = "zeros",
    input_size: int | tuple[int, int] | None = None,
) -> NormPlan:
    """:func:`norm_tensor` as a plan, so that many layers' bounds are computed together
    (:func:`evaluate_plans`). Off the accelerator path the bound is computed now (the CPU's
    certificates) and the plan holds it."""
    with torch.no_grad():
        w = weight.detach()
        if w.dim() == 2:
            if not matrix_products_only(w):
                return _computed(_as_tensor(dense_norm(w), w))
            return NormPlan((GramRequest(w, _GRAM_AUTO_ITERS),), lambda r: r[0])
        st, pd = _as_pair(stride, "stride"), _as_pair(padding, "padding")
        size = None if input_size is None else _as_pair(input_size, "input_size")
        _check_conv_args((int(w.shape[-2]), int(w.shape[-1])), st, pd, padding_mode, size)
        if not matrix_products_only(w) or w.numel() == 0:
            value = conv_norm(w, stride=st, padding=pd, padding_mode=padding_mode, input_size=size)
            return _computed(_as_tensor(value, w))
        plan = _conv_plan(w, st, pd, padding_mode, size)
        return NormPlan(plan.requests, lambda r: _finite_or_inf(plan.finish(r)))


def _computed(value: torch.Tensor) -> NormPlan:
    return NormPlan((), lambda _: value)


def norm_tensor(
    weight: torch.Tensor,
    *,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    padding_mode: str = "zeros",
    input_size: int | tuple[int, int] | None = None,
) -> torch.Tensor:
    """The certified bound of ``"auto"`` as a 0-dim float64 tensor on ``weight``'s device.

    A 2-D ``weight``: :func:`dense_norm`; a 4-D one: :func:`conv_norm` with the geometry given.
    On an accelerator (:func:`matrix_products_only`) it is computed there without a host read
    (``inf`` for a non-finite weight), so that many layers' bounds leave the device in one
    transfer; on the CPU it is the float the functions above return. :func:`norm_plan` and
    :func:`evaluate_plans` compute several layers' bounds together.
    """
    plan = norm_plan(
        weight, stride=stride, padding=padding, padding_mode=padding_mode, input_size=input_size
    )
    with torch.no_grad():
        return evaluate_plans([plan])[0]


def conv_power_iteration(
    weight: torch.Tensor,
    *,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    padding_mode: str = "zeros",
    input_size: int | tuple[int, int],
    iters: int = 20,
    init: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> PowerIterationResult:
    """LOWER bound on :func:`conv_norm`'s operator (power iteration; steering/diagnostics only)."""
    st = _as_pair(stride, "stride")
    pd = _as_pair(padding, "padding")
    size = _as_pair(input_size, "input_size")
    w = weight.detach()

    def op(x: torch.Tensor) -> torch.Tensor:
        return _conv_apply(x[None], w, st, pd, padding_mode)[0]

    if init is None:
        init = torch.randn((w.shape[1], *size), generator=generator, dtype=w.dtype).to(w.device)
    return power_iteration(op, input_shape=(int(w.shape[1]), *size), iters=iters, init=init)
