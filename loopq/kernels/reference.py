"""Pure-torch backend of the kernels: the CPU path and the oracle the Triton kernels are tested against.

Both backends share one *defined* fp32 evaluation order, so their outputs are bit-identical rather than close:

* transform ``Z = L^T X R`` (X the token viewed as ``[n1, n2]``): first ``XR = sum_j X[:, j] R[j, :]``, then
  ``Z = sum_i L[i, :]^T XR[i, :]``, each a left-to-right chain of separate fp32 multiplies and adds starting
  from zero (no FMA). ``kron_apply`` (a BLAS matmul) computes the same value in an unspecified order;
* quantization is :func:`loopq.qspec.quantize_codes` of the fp32 transformed token;
* GEMM: per 32-element K group an exact integer dot (the int8 products summed in fp32 are integers below
  2^24, hence exact), then ``acc = acc + dot * (s_a * s_w)`` in fp32, groups in order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopq.kernels.packing import pack_int4_unchecked, unpack_int4
from loopq.qspec import quantize_codes


def kron_apply_ordered(x: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """``kron_apply(x, left, right)`` for fp32 rows ``x [M, n1 * n2]`` in the kernels' accumulation order."""
    n1, n2 = left.shape[0], right.shape[0]
    xm = x.reshape(-1, n1, n2)
    xr = torch.zeros_like(xm)
    for j in range(n2):
        xr = xr + xm[:, :, j, None] * right[j]
    z = torch.zeros_like(xm)
    for i in range(n1):
        z = z + left[i, :, None] * xr[:, i, None, :]
    return z.reshape(x.shape)


def quantize_activation(
    x: Tensor, left: Tensor | None, right: Tensor | None, clip: float, bits: int, group_size: int
) -> tuple[Tensor, Tensor]:
    """Transform (if ``left``/``right`` are given) and quantize per token group; int4 codes come packed."""
    z = x.float()
    if left is not None and right is not None:
        z = kron_apply_ordered(z, left.float(), right.float())
    codes, scales = quantize_codes(z, bits, group_size, clip)
    return (pack_int4_unchecked(codes) if bits == 4 else codes), scales


def gemm(a_codes: Tensor, a_scales: Tensor, w_codes: Tensor, w_scales: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``[M, K] x [N, K]^T`` from int8-stored codes and per-group scales ``[M, G]``, ``[N, G]``."""
    groups = a_scales.shape[1]
    size = a_codes.shape[1] // groups  # explicit: zero rows (an empty batch) cannot infer a -1
    a = a_codes.float().reshape(a_codes.shape[0], groups, size)
    w = w_codes.float().reshape(w_codes.shape[0], groups, size)
    sa, sw = a_scales.float(), w_scales.float()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    for g in range(groups):
        acc = acc + (a[:, g] @ w[:, g].T) * (sa[:, g, None] * sw[None, :, g])
    return acc.to(out_dtype)


def gemm_w4a4(a_packed: Tensor, a_scales: Tensor, w_packed: Tensor, w_scales: Tensor, out_dtype: torch.dtype) -> Tensor:
    return gemm(unpack_int4(a_packed), a_scales, unpack_int4(w_packed), w_scales, out_dtype)


def gemm_w4a8(a_int8: Tensor, a_scales: Tensor, w_packed: Tensor, w_scales: Tensor, out_dtype: torch.dtype) -> Tensor:
    return gemm(a_int8, a_scales, unpack_int4(w_packed), w_scales, out_dtype)


def gemm_fp64(a_codes: Tensor, a_scales: Tensor, w_codes: Tensor, w_scales: Tensor) -> tuple[Tensor, Tensor]:
    """The GEMM of int8-stored codes in float64, and the fp32 rounding bound any summation order must meet.

    Returns ``(ref64, bound)``, ``[M, N]`` each: ``ref64 = sum_g dot_g s_a s_w`` (exact up to float64 rounding, as
    ``dot_g s_a s_w`` needs at most 16 + 24 + 11 bits) and ``bound = gamma_{G+1} sum_k |a_k w_k s_a s_w|`` with
    ``gamma_n = n u / (1 - n u)``, ``u = 2^-24``: G per-group terms each rounded twice (the scale product, then
    times the exact dot) and summed by at most G - 1 fp32 additions in any bracketing. A kernel's fp32 output
    ``out`` is correct when ``|out - ref64| <= bound`` (``loopq.kernels.decode_kernel``'s contract).
    """
    groups = a_scales.shape[1]
    a = a_codes.double().reshape(a_codes.shape[0], groups, -1)
    w = w_codes.double().reshape(w_codes.shape[0], groups, -1)
    s = a_scales.double().T[:, :, None] * w_scales.double().T[:, None, :]  # [G, M, N]
    dots = torch.einsum("mgk,ngk->gmn", a, w)
    magnitudes = torch.einsum("mgk,ngk->gmn", a.abs(), w.abs())
    nu = (groups + 1) * 2.0**-24
    return (dots * s).sum(0), nu / (1 - nu) * (magnitudes * s.abs()).sum(0)
