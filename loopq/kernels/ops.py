"""Public entry points: argument checks, then dispatch to the torch reference or the Triton kernels.

``backend=None`` picks ``"triton"`` for CUDA tensors and ``"torch"`` otherwise. ``"triton"`` on CPU tensors runs
Triton's interpreter and needs ``TRITON_INTERPRET=1`` in the environment before anything imports triton.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor
from triton.runtime import JITFunction

from loopq.kernels import decode_kernel, gemm_kernel, quantize_kernel, reference
from loopq.kernels.packing import (
    GROUP_SIZE,
    deinterleave_groups,
    launch_device,
    tile_weight,
    tiled_shapes,
    untile_weight,
)
from loopq.qspec import KERNEL_ACT_BITS

BACKENDS = ("torch", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_QUANTIZE = {"torch": reference.quantize_activation, "triton": quantize_kernel.quantize_activation}


def _triton_gemm(
    a: Tensor, a_scales: Tensor, w_packed: Tensor, w_scales: Tensor, out_dtype: torch.dtype, a_int4: bool
) -> Tensor:
    """Decode calls (1..16 tokens) take the decode kernel, larger ones the tile kernel (see ``gemm_w4a4``). The
    decode kernel reads the export layout; from the natural one this compatibility path converts both operands
    first (extra launches and traffic: the packed model calls :func:`quantized_linear` with the stored layout)."""
    if 0 < a.shape[0] <= decode_kernel.MAX_M:
        codes = reference.unpack_int4(a) if a_int4 else a
        w_codes, w_scales_tiled = tile_weight(w_packed, w_scales.half())
        return decode_kernel.gemm_tiled(
            deinterleave_groups(codes), a_scales.float(), w_codes, w_scales_tiled, w_packed.shape[0], out_dtype
        )
    return gemm_kernel.gemm(a, a_scales, w_packed, w_scales, out_dtype, a_int4)


_GEMM_W4A4 = {"torch": reference.gemm_w4a4, "triton": partial(_triton_gemm, a_int4=True)}
_GEMM_W4A8 = {"torch": reference.gemm_w4a8, "triton": partial(_triton_gemm, a_int4=False)}


def quantize_activation(
    x: Tensor,
    left: Tensor | None = None,
    right: Tensor | None = None,
    clip: float = 1.0,
    bits: int = 4,
    group_size: int = GROUP_SIZE,
    backend: str | None = None,
    exact: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Online activation quantizer: ``x [M, K]`` -> (codes, float32 scales ``[M, K / group_size]``).

    Tokens are transformed as ``left^T X right`` (X the token viewed as ``[n1, n2]``, i.e. ``x (left (x) right)``;
    a missing factor is the identity, both missing means no transform), then quantized symmetrically per
    ``group_size`` consecutive channels with clipping ratio ``clip``. Codes are packed int4 (uint8 ``[M, K/2]``)
    for ``bits=4`` and int8 ``[M, K]`` for ``bits=8``. All arithmetic is fp32 whatever the dtype of ``x`` (the
    fast path's transform: tf32x3 tensor-core products, fp32 sums).

    ``exact`` (triton backend, with a transform): ``True`` reproduces the torch backend bit for bit; ``False``
    computes the transform on tensor cores (``tl.dot`` in tf32x3, fast; transformed values within
    ``quantize_kernel.transform_error_bound`` of the float64 transform, so a code can differ from the reference's
    only where the value lies that close to a rounding tie or the clamp, and a scale by the bound's image);
    ``None``: the fast path on CUDA with compiled kernels (so the default Triton quantizer on a GPU is no longer
    bit-exact with the torch backend: pass ``exact=True`` for that), exact in the CPU interpreter (see
    ``quantize_kernel.uses_fast_path``; the fast path compiles without register spills but is not yet timed).
    """
    _check_matrix("x", x, FLOAT_DTYPES)
    if bits not in KERNEL_ACT_BITS:
        raise ValueError(f"bits={bits}: activations are quantized to 4 (W4A4) or 8 (W4A8) bits")
    clip = float(clip)
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip={clip}: the clipping ratio must be a positive finite number, typically in (0, 1]")
    k = x.shape[1]
    group = k if group_size == -1 else group_size
    if group < 1 or k % group or (bits == 4 and k % 2):
        raise ValueError(f"x has K={k} channels, not a multiple of group_size={group_size} (and even for int4)")
    left, right = _transform_factors(left, right, k, x.device)
    backend = _resolve_backend(backend, x, "group_size", group)
    if backend == "torch":
        return _QUANTIZE[backend](x, left, right, clip, bits, group)
    with launch_device(x):
        return _QUANTIZE[backend](x, left, right, clip, bits, group, exact)


def gemm_w4a4(
    a_packed: Tensor,
    a_scales: Tensor,
    w_packed: Tensor,
    w_scales: Tensor,
    out_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> Tensor:
    """``out [M, N] = dequant(a) dequant(w)^T`` from packed int4 activations ``[M, K/2]`` and weights ``[N, K/2]``.

    With ``backend="triton"``, M > 16 runs the prefill tile kernel (:mod:`loopq.kernels.gemm_kernel`) and
    1 <= M <= 16 the decode kernel (:mod:`loopq.kernels.decode_kernel`); the fp32 output of both is within
    ``reference.gemm_fp64``'s rounding bound of the float64 value of the same codes, not bit-exact with the torch
    backend. The same holds for :func:`gemm_w4a8`.
    """
    backend = _check_gemm("a_packed", a_packed, 4, a_scales, w_packed, w_scales, out_dtype, backend)
    with launch_device(a_packed):
        return _GEMM_W4A4[backend](a_packed, a_scales, w_packed, w_scales, out_dtype)


def gemm_w4a8(
    a_int8: Tensor,
    a_scales: Tensor,
    w_packed: Tensor,
    w_scales: Tensor,
    out_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> Tensor:
    """``out [M, N] = dequant(a) dequant(w)^T`` from int8 activations ``[M, K]`` and packed int4 weights."""
    backend = _check_gemm("a_int8", a_int8, 8, a_scales, w_packed, w_scales, out_dtype, backend)
    with launch_device(a_int8):
        return _GEMM_W4A8[backend](a_int8, a_scales, w_packed, w_scales, out_dtype)


def quantized_linear(
    x: Tensor,
    w_codes: Tensor,
    w_scales: Tensor,
    n: int,
    left: Tensor | None = None,
    right: Tensor | None = None,
    inv_d: Tensor | None = None,
    clip: float = 1.0,
    a_bits: int = 4,
    bias: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
    norm_weight: Tensor | None = None,
    norm_eps: float | None = None,
    prefill: str | None = None,
) -> Tensor:
    """A whole quantized linear ``y [M, n] = Q_a((x * inv_d) (left (x) right)) W^T + bias`` from the weight in the
    export layout (``w_codes``, ``w_scales`` of :func:`loopq.kernels.packing.tile_weight`), in ``out_dtype``
    (default ``x``'s). With ``norm_weight`` ``[K]``, ``x`` is first normalised by the RMSNorm that feeds the group,
    :func:`loopq.models.base.rms_norm` ``(x, norm_weight, norm_eps)`` (folded into the quantizer's launch on the
    Triton path, where its ``1 / rms`` is summed in another order: the last bits may differ from the torch path's;
    a float64 weight is read there in fp32).

    ``"triton"`` with 1..16 tokens is two launches: the quantizer (input cast and diagonal folded in, int8 codes in
    the decode order) and the decode GEMM (bias and output dtype in its epilogue). More tokens run the quantizer
    and a prefill kernel (bias and output dtype in its epilogue too), which reads the natural layout, converted
    here from the stored one (see docs/benchmarks.md): ``prefill`` picks it (:data:`PREFILL_SCHEMES`; None:
    :func:`prefill_scheme`), ``"int8"`` the integer tile kernel on the codes (``gemm_kernel.gemm``, exact group dots),
    ``"values"`` the 16-bit one on the quantized values in ``x``'s dtype (``gemm_kernel.gemm_values``, operands
    rounded once to it as the student's autocast does; a 16-bit ``x`` only). ``"torch"``
    computes the reference: ``x.float() * inv_d``, :func:`reference.quantize_activation`, the ordered GEMM, ``+ bias``,
    cast - the operations (and bits) of the packed group before the kernel layout."""
    _check_matrix("x", x, (*FLOAT_DTYPES, torch.float64))
    k = x.shape[1]
    if a_bits not in KERNEL_ACT_BITS:
        raise ValueError(f"a_bits={a_bits}: activations are quantized to 4 (W4A4) or 8 (W4A8) bits")
    code_shape, scale_shape = tiled_shapes(n, k)
    if tuple(w_codes.shape) != code_shape or tuple(w_scales.shape) != scale_shape:
        raise ValueError(
            f"w_codes {tuple(w_codes.shape)} / w_scales {tuple(w_scales.shape)} are not the kernel layout of a "
            f"[{n}, {k}] weight ({code_shape} / {scale_shape}); lay it out with loopq.kernels.packing.tile_weight"
        )
    out_dtype = x.dtype if out_dtype is None else out_dtype
    left, right = _transform_factors(left, right, k, x.device)
    _check_norm(norm_weight, k, x.device)
    scheme = prefill_scheme(x.dtype, prefill)  # a bad choice fails on every backend and size
    backend = _resolve_backend(backend, x, "group_size", GROUP_SIZE, out_dtype)
    m = x.shape[0]
    norm = None if norm_weight is None else (norm_weight, norm_eps)
    if backend == "torch" or m == 0:
        if norm is not None:
            from loopq.models.base import rms_norm_ops as rms_norm  # models imports the kernels; the torch ops

            x = rms_norm(x, *norm)
        z = x.float() if inv_d is None else x.float() * inv_d
        codes, scales = reference.quantize_activation(z, left, right, clip, a_bits, GROUP_SIZE)
        w_packed, w_sc = untile_weight(w_codes, w_scales, n, k)
        y = (reference.gemm_w4a4 if a_bits == 4 else reference.gemm_w4a8)(codes, scales, w_packed, w_sc, torch.float32)
        return (y if bias is None else y + bias.float()).to(out_dtype)
    with launch_device(x):  # Triton launches on the current CUDA device
        if m <= decode_kernel.MAX_M:
            codes, scales = quantize_kernel.quantize_activation(
                x, left, right, clip, a_bits, GROUP_SIZE, None, inv_d, True, norm
            )
            return decode_kernel.gemm_tiled(codes, scales, w_codes, w_scales, n, out_dtype, bias)
        values = x.dtype if scheme == "values" else None
        codes, scales = quantize_kernel.quantize_activation(
            x, left, right, clip, a_bits, GROUP_SIZE, None, inv_d, False, norm, values
        )
        w_packed, w_sc = untile_weight(w_codes, w_scales, n, k)
        bias = None if bias is None else bias.float()
        if values is not None:
            return gemm_kernel.gemm_values(codes, w_packed, w_sc, out_dtype, bias=bias)
        return gemm_kernel.gemm(codes, scales, w_packed, w_sc, out_dtype, a_bits == 4, bias=bias)


#: the prefill GEMMs of :func:`quantized_linear` (more than 16 tokens on the Triton backend)
PREFILL_SCHEMES = ("int8", "values")


def check_prefill(prefill: str | None) -> str | None:
    """``prefill`` if it names one of :data:`PREFILL_SCHEMES` or is None (the choice by dtype), else a ValueError."""
    if prefill is not None and prefill not in PREFILL_SCHEMES:
        raise ValueError(f"prefill={prefill!r}: use one of {PREFILL_SCHEMES} (or None: values for bf16, else int8)")
    return prefill


def prefill_scheme(x_dtype: torch.dtype, prefill: str | None = None) -> str:
    """The prefill GEMM for inputs of ``x_dtype``: ``prefill`` if given (checked), else ``"values"`` for bf16 (the
    16-bit scheme: the integer one's per-group rescale bounds it below ~0.67x of a bf16 GEMM, docs/benchmarks.md)
    and ``"int8"`` otherwise (fp32 keeps exact group dots; fp16 keeps them too: a transformed activation's values
    are not bounded by fp16's range)."""
    if check_prefill(prefill) is None:
        return "values" if x_dtype == torch.bfloat16 else "int8"
    if prefill == "values" and x_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"prefill='values' computes in x's 16-bit dtype, x is {x_dtype}; use 'int8' or cast x")
    return prefill


def triton_interpreted() -> bool:
    """Whether the Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` at import time)."""
    return not isinstance(gemm_kernel._gemm_kernel, JITFunction)


def _check_matrix(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, Tensor) or t.dim() != 2:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D tensor [rows, K] (got {shape}); flatten leading dims first")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]} (got {t.dtype}); convert it first")


def _check_norm(weight: Tensor | None, k: int, device: torch.device) -> None:
    """The folded RMSNorm's weight: a floating ``[K]`` vector on ``x``'s device."""
    if weight is None:
        return
    if not isinstance(weight, Tensor) or weight.shape != (k,) or weight.dtype not in (*FLOAT_DTYPES, torch.float64):
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"norm_weight must be a floating [K={k}] vector (got {shape}); pass the RMSNorm's weight")
    if weight.device != device:
        raise ValueError(f"norm_weight is on {weight.device} but x is on {device}; move it to x's device")


def _transform_factors(
    left: Tensor | None, right: Tensor | None, k: int, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Check the Kronecker factors (``n1 * n2 = K``) and fill a missing one with the identity."""
    if left is None and right is None:
        return None, None
    for name, f in (("left", left), ("right", right)):
        if f is not None:
            _check_matrix(name, f, FLOAT_DTYPES)
            if f.shape[0] != f.shape[1] or k % f.shape[0]:
                raise ValueError(f"{name} must be square with a size dividing K={k} (got {tuple(f.shape)})")
            if f.device != device:
                raise ValueError(f"{name} is on {f.device} but x is on {device}; move it to x's device")
    left = torch.eye(k // right.shape[0], device=device) if left is None else left
    right = torch.eye(k // left.shape[0], device=device) if right is None else right
    if left.shape[0] * right.shape[0] != k:
        raise ValueError(f"left {tuple(left.shape)} (x) right {tuple(right.shape)} does not match K={k}")
    return left, right


def _check_gemm(
    a_name: str,
    a: Tensor,
    a_bits: int,
    a_scales: Tensor,
    w_packed: Tensor,
    w_scales: Tensor,
    out_dtype: torch.dtype,
    backend: str | None,
) -> str:
    """Shapes/dtypes/devices of the GEMM operands (activations: packed int4 uint8 ``[M, K/2]`` for ``a_bits=4``,
    int8 ``[M, K]`` for ``a_bits=8``); returns the resolved backend."""
    _check_matrix(a_name, a, (torch.uint8,) if a_bits == 4 else (torch.int8,))
    k = a.shape[1] * 8 // a_bits
    _check_matrix("w_packed", w_packed, (torch.uint8,))
    _check_matrix("a_scales", a_scales, FLOAT_DTYPES)
    _check_matrix("w_scales", w_scales, FLOAT_DTYPES)
    if 2 * w_packed.shape[1] != k:
        raise ValueError(f"{a_name} has K={k} but w_packed has K={2 * w_packed.shape[1]}; quantize the same input dim")
    m, n, groups = a.shape[0], w_packed.shape[0], w_scales.shape[1]
    if groups == 0 or k % groups or a_scales.shape[1] != groups:
        raise ValueError(
            f"a_scales {tuple(a_scales.shape)} and w_scales {tuple(w_scales.shape)} must both have "
            f"K/group_size columns with K={k}; quantize both with the same group_size"
        )
    if a_scales.shape[0] != m or w_scales.shape[0] != n:
        raise ValueError(
            f"a_scales needs one row per token and w_scales one per output row (got "
            f"{tuple(a_scales.shape)}, {tuple(w_scales.shape)} for M={m}, N={n})"
        )
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype}: use one of {[str(d) for d in FLOAT_DTYPES]}")
    devices = {t.device for t in (a, a_scales, w_packed, w_scales)}
    if len(devices) > 1:
        raise ValueError(f"GEMM operands are on several devices {sorted(map(str, devices))}; move them to one")
    # before the device check, so that a call with both wrong names its operand first (as the other checks do)
    if (backend == "triton" or (backend is None and w_packed.is_cuda)) and w_scales.dtype != torch.float16:
        raise ValueError(
            f"w_scales is {w_scales.dtype}, but the Triton kernels read float16 weight scales (quantize_weight's and "
            "the export's format); pass w_scales.half() or backend='torch'"
        )
    return _resolve_backend(backend, w_packed, "group_size (K / scale columns)", k // groups, out_dtype)


def _resolve_backend(
    backend: str | None, ref: Tensor, group_name: str, group: int, dtype: torch.dtype | None = None
) -> str:
    if backend is None:
        backend = "triton" if ref.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS} (or None: triton on CUDA, torch on CPU)")
    if backend == "torch":
        return backend
    if group != GROUP_SIZE:
        raise ValueError(f"{group_name}={group} is not supported by backend='triton'; use {GROUP_SIZE} or 'torch'")
    if not ref.is_cuda and not triton_interpreted():
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before importing triton")
    if not ref.is_cuda and torch.bfloat16 in (ref.dtype, dtype):
        raise ValueError("bfloat16 is not supported by Triton's CPU interpreter; use float16/float32 or 'torch'")
    return backend
