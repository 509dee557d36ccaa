"""Triton kernel #1: fused online Kronecker transform + per-token group quantization + int4 packing.

One program quantizes ``BLOCK_M`` tokens end to end, in registers except for the compaction of step 1:

1. transform (optional): ``XR = X R`` by loading columns of X from memory, then ``Z = L^T XR`` by pulling rows of
   XR out of registers with a masked sum (exact: one value plus zeros). Both follow the reference order of
   :mod:`loopq.kernels.reference` with separate fp32 multiplies and adds; the launch disables FMA contraction
   (``enable_fp_fusion=False``) so the GPU rounds like torch. ``n1``/``n2`` are padded to powers of two; when
   ``n2`` is not one (e.g. K = 5632 = 64 x 88) the padded rows are compacted back into K order through an fp32
   scratch row in global memory (store, CTA barrier, reload). ``tl.gather`` would avoid the round trip but
   lowers to ~130k warp shuffles per token at K = 5632.
2. per 32-element group: ``s = max(clip * absmax / q_max, 1e-8)`` with IEEE division (``div_rn``; plain ``/``
   is approximate on NVIDIA GPUs), a NaN in the group giving a NaN scale as in torch (``max.NaN``);
3. codes = round-half-to-even of ``clamp(x / s, q_min, q_max)``, written by hand without libdevice:
   ``(v + 1.5 * 2^23) - 1.5 * 2^23``. Every fp32 in [2^23, 2^24) is an integer, so the addition itself rounds
   ``v`` to the nearest integer with ties to even (1.5 * 2^23 is even), and the subtraction is exact; valid for
   |v| <= 2^22, guaranteed by clamping first (clamp and round commute for integer bounds). The textbook
   ``floor(v + 0.5)`` is wrong for v = 0.49999997, where ``v + 0.5`` already rounds up to 1.
4. int4: ``tl.split`` pairs (even k, odd k) into one byte (low, high nibble); int8: stored as is.

That exact path (``exact=True``) is the oracle-exact mode and the default in the CPU interpreter. ``exact=False``,
and the default on CUDA (``exact=None``, :func:`uses_fast_path`; not yet timed on a GPU), selects
:func:`_quantize_dot_kernel`, whose step 1 runs on tensor cores: ``Z_a = sum_J (L[:, a]^T X[:, J]) R[J, :]`` for a
block of rows ``a`` of Z and 32-column chunks ``J`` of X, both products tf32x3 (:func:`_dot_tf32x3`: each operand
split into a tf32 high half and the fp32 remainder, three tf32 MMAs chained through one fp32 accumulator; what
``input_precision="tf32x3"`` computes, without its per-element adds and NaN masks). Tiles are
zero-padded to powers of two >= 16; a program owns rows of Z whose flattened span is whole 32-groups, so it
quantizes and stores its own codes and scales (compacted through its token block's scratch row when ``n2`` is
not a power of two, as above). The input cast and the diagonal happen on load: a quantized linear stays two
launches. So does the RMSNorm that feeds the group, where the exported model folds it in (``NORM``,
:func:`loopq.quant.packed.fold_feeding_norms`): each program first sums its tokens' squares
(:func:`_rms_inverse`), then normalises every value it loads with the reference's roundings (:func:`_normed`).
Two program splits (:func:`dot_config`):

* decode (M <= 16): 32 / gcd(n2, 32) rows per program, widened while a token keeps 16 programs: Ouro's K = 2048
  (32 x 64) runs 2 rows, K = 5632 (64 x 88) 4 rows (352 values, 11 groups): **16 programs per token** at M = 1
  (the former FMA path: 1), up to 256 at M = 16. Every program reads all of X and R (L2) and pads its rows to
  the dot's 16, so more, smaller programs would not be faster;
* prefill (M > 16): 8 tokens per program, whole tokens at K = 2048 (a 32 x 64 tile) and 16-row quarters at
  K = 5632 (a whole 64 x 128 tile spills, a half is at the register limit); the row blocks of a token block are
  adjacent program ids, so X is read from memory once; the scratch rows are per token block and stacked token
  (M / 8 x 2 of them, 23 MB at M = 4096, K = 5632: L2-sized on an H100's 50 MB). 4 tokens share each dot where
  ``n2`` is a power of two, 2 where it is padded (:func:`prefill_stack`): the first dot takes their columns side
  by side, the second their rows stacked, so the factors' operands are prepared once per 4 (2) tokens and each
  dot is 4x (2x) larger (at K = 2048 the second dot is 128 x 32 x 64: ``wgmma`` on sm_90); per transformed value
  this executes about half (two thirds) of the instructions.

Compiled for sm_80 and sm_90 (``scripts/ptx_stats.py --kernels quantize``), every variant's loops run tensor-core
MMAs, without spills.

**Cost at M = 4096 against the bf16 GEMM it feeds** (H100 SXM peaks, dense: bf16 989, tf32 495 TFLOP/s, HBM
3.35 TB/s). The transform is ``2 K (n1 + n2)`` FLOPs per token against the GEMM's ``2 K N``: (n1 + n2) / N =
1.6 % (QKV, N = 6144), 4.7 % (o_proj, 2048), 0.9 % (gate+up, 11264) at K = 2048 and 7.4 % (down_proj, 2048) at
K = 5632. Executed with padding: 0.39 MFLOP per token at K = 2048 (none), 2.36 MFLOP at K = 5632 (1.38x); tf32x3
is three tf32 MMAs at half the bf16 rate, so each costs 6 bf16 FLOPs of tensor-core time: **9 % / 28 % / 5 % /
61 %** of the bf16 GEMM's time at peak for QKV / o_proj / gate+up / down_proj, more since ``mma.sync`` does not
reach ``wgmma``'s peak on H100. Independently of precision, the quantizer moves 2.6 bytes per element (bf16 in,
int4 + fp32 scale out) while the GEMM spends ``2 N`` FLOPs on it: 387 / N of the GEMM's time, **6 % / 19 % /
3 % / 19 %** (4.1 bytes, 609 / N, with bf16 values out for the 16-bit prefill scheme: 10 % / 30 % / 5 % / 30 %).
So <= 10 % of the bf16 GEMM is within reach only for the wide outputs (QKV, gate+up); at N = 2048
even a copy of the activations exceeds it, and down_proj's tf32x3 transform is compute-bound at about 60 %.
Splitting in bf16 instead (three bf16 MMAs) would halve the tensor-core time at a ~4x looser bound (2^-16
product error); that trade, and the GPU timings, are open (``docs/benchmarks.md``).

A dot changes the summation order and tf32x3 the products, so the contract is a bound, not bit-exactness:
transformed values within :func:`transform_error_bound` of the float64 transform (derived there; it assumes
truncating tensor-core accumulation, which the interpreter cannot show: its ``tl.dot`` is a float32 matmul), hence
codes equal to the reference's except where the pre-rounding value lies within that bound of a .5 tie or of the
clamp, and scales within the bound's image (``tests/kernels/test_quantize_kernel.py`` checks both against float64).
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopq.kernels.packing import GROUP_SIZE, cdiv, next_pow2

ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23


@triton.jit
def _load_tokens(x_ptr, rows, row_mask, K: tl.constexpr, KP: tl.constexpr):
    cols = tl.arange(0, KP)
    mask = row_mask[:, None] & (cols < K)[None, :]
    return tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scaled(x, d_ptr, cols, col_mask, HAS_D: tl.constexpr):
    """``x * inv_d[cols]`` (the diagonal of the transform, one fp32 multiply as the reference does), or ``x``."""
    if HAS_D:
        x = x * tl.load(d_ptr + cols, mask=col_mask, other=0.0)
    return x


@triton.jit
def _rms_inverse(x_blk, ok, K: tl.constexpr, eps, TOKENS: tl.constexpr, KC: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` per token of ``TOKENS`` consecutive ones from ``x_blk`` (&X[t0, 0]; ``ok``:
    which exist), in fp32 as :func:`loopq.models.base.rms_norm`'s ``rsqrt`` (IEEE square root and division), summed
    over K in ``KC``-wide chunks (a power of two; another order than torch's, so the last bits of ``r`` may
    differ: the codes then differ only at rounding ties of the normed values)."""
    c = tl.arange(0, KC)
    t = tl.arange(0, TOKENS)
    acc = tl.zeros([TOKENS, KC], dtype=tl.float32)
    for k0 in range(0, K, KC):
        mask = ok[:, None] & (k0 + c < K)[None, :]
        x = tl.load(x_blk + t[:, None] * K + (k0 + c)[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc + x * x
    mean = tl.math.div_rn(tl.sum(acc, axis=1), tl.full([TOKENS], K, tl.float32))
    return tl.math.div_rn(tl.full([TOKENS], 1.0, tl.float32), tl.sqrt_rn(mean + eps))


@triton.jit
def _normed(x, r, x_ptr, g_ptr, cols, col_mask, NORM: tl.constexpr):
    """The RMSNorm of :func:`loopq.models.base.rms_norm` on fp32 values ``x`` loaded from ``x_ptr`` (``r``
    broadcast to ``x``): ``(x r).to(x's dtype) * gamma`` with the reference's roundings. ``NORM``: 0 no norm;
    1 the product rounded to the input's dtype (weight and input of one dtype: torch rounds ``y * weight`` to it);
    2 the product kept in fp32 (their dtypes differ: torch promotes to fp32)."""
    if NORM != 0:
        x = _normed_by(x, r, x_ptr, tl.load(g_ptr + cols, mask=col_mask, other=0.0).to(tl.float32), NORM)
    return x


@triton.jit
def _stacked(v, N1P: tl.constexpr, STACK: tl.constexpr, CJ: tl.constexpr):
    """``[N1P, CJ]`` per-channel values repeated for the ``STACK`` tokens of a chunk: ``[N1P, STACK * CJ]``."""
    return tl.reshape(tl.broadcast_to(v[:, None, :], [N1P, STACK, CJ]), [N1P, STACK * CJ])


@triton.jit
def _normed_by(x, r, x_ptr, g, NORM: tl.constexpr):
    """:func:`_normed` with the weight ``g`` already loaded (fp32, broadcast to ``x``)."""
    y = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32)
    x = y * g
    if NORM == 1:
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _transform_tokens(
    x_ptr,
    d_ptr,
    left_ptr,
    right_ptr,
    scratch_ptr,
    rows,
    row_mask,
    K: tl.constexpr,
    KP: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N1P: tl.constexpr,
    N2P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_D: tl.constexpr,
    inv_rms,
    g_ptr,
    NORM: tl.constexpr,
):
    a = tl.arange(0, N1P)
    b = tl.arange(0, N2P)
    x_rows = x_ptr + rows[:, None] * K + a[None, :] * N2  # &X[m, i, 0]
    x_mask = row_mask[:, None] & (a < N1)[None, :]
    xr = tl.zeros([BLOCK_M, N1P, N2P], dtype=tl.float32)
    for j in range(N2):
        x_col = tl.load(x_rows + j, mask=x_mask, other=0.0).to(tl.float32)  # X[m, :, j]
        x_col = _normed(x_col, inv_rms[:, None], x_ptr, g_ptr, (a * N2 + j)[None, :], (a < N1)[None, :], NORM)
        x_col = _scaled(x_col, d_ptr, (a * N2 + j)[None, :], (a < N1)[None, :], HAS_D)
        r_row = tl.load(right_ptr + j * N2 + b, mask=b < N2, other=0.0)  # R[j, :]
        xr = xr + x_col[:, :, None] * r_row[None, None, :]
    z = tl.zeros([BLOCK_M, N1P, N2P], dtype=tl.float32)
    for i in range(N1):
        xr_i = tl.sum(tl.where((a == i)[None, :, None], xr, 0.0), axis=1)  # XR[m, i, :]
        l_row = tl.load(left_ptr + i * N1 + a, mask=a < N1, other=0.0)  # L[i, :]
        z = z + l_row[None, :, None] * xr_i[:, None, :]
    if N2P == N2:  # padding only after the last row: already in K order
        return tl.reshape(z, [BLOCK_M, KP])
    a3, b3 = a[None, :, None], b[None, None, :]
    z_mask = row_mask[:, None, None] & (a3 < N1) & (b3 < N2)
    tl.store(scratch_ptr + rows[:, None, None] * K + a3 * N2 + b3, z, mask=z_mask)
    tl.debug_barrier()  # the reload reads other threads' stores
    return _load_tokens(scratch_ptr, rows, row_mask, K, KP)


@triton.jit
def _quantize_kernel(
    x_ptr,
    d_ptr,
    left_ptr,
    right_ptr,
    scratch_ptr,
    codes_ptr,
    scales_ptr,
    g_ptr,
    M,
    clip,
    eps,
    K: tl.constexpr,
    KP: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N1P: tl.constexpr,
    N2P: tl.constexpr,
    HAS_TRANSFORM: tl.constexpr,
    BITS: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_D: tl.constexpr = False,
    DECODE: tl.constexpr = False,
    NORM: tl.constexpr = 0,
    NORM_KC: tl.constexpr = 1024,
    VALUES: tl.constexpr = False,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * K may exceed 2^31
    row_mask = rows < M
    inv_rms = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM != 0:
        x_blk = x_ptr + tl.program_id(0).to(tl.int64) * BLOCK_M * K
        inv_rms = _rms_inverse(x_blk, row_mask, K, eps, BLOCK_M, NORM_KC)
    if HAS_TRANSFORM:
        z = _transform_tokens(
            x_ptr, d_ptr, left_ptr, right_ptr, scratch_ptr, rows, row_mask, K, KP, N1, N2, N1P, N2P, BLOCK_M, HAS_D,
            inv_rms, g_ptr, NORM,
        )  # fmt: skip
    else:
        cols = tl.arange(0, KP)[None, :]
        x = _load_tokens(x_ptr, rows, row_mask, K, KP)
        x = _normed(x, inv_rms[:, None], x_ptr, g_ptr, cols, cols < K, NORM)
        z = _scaled(x, d_ptr, cols, cols < K, HAS_D)

    _quantize_store(z, rows, row_mask, codes_ptr, scales_ptr, clip, K, KP, BITS, QMIN, QMAX, BLOCK_M, DECODE, VALUES)


@triton.jit
def _quantize_store(
    z,
    rows,
    row_mask,
    codes_ptr,
    scales_ptr,
    clip,
    K: tl.constexpr,
    KP: tl.constexpr,
    BITS: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DECODE: tl.constexpr = False,
    VALUES: tl.constexpr = False,
):
    """Steps 2-4 on transformed tokens ``z [BLOCK_M, KP]`` (K order, zero past K): scales, codes, packing.
    ``DECODE``: int8 codes in the decode GEMM's order (per group 16 even k, then 16 odd k), whatever ``BITS``.
    ``VALUES``: instead of codes, the quantized values ``code * scale`` (an fp32 product) in ``codes_ptr``'s 16-bit
    dtype, K order: the operand of the prefill GEMM's 16-bit scheme (:mod:`loopq.kernels.gemm_kernel`)."""
    groups = tl.reshape(z, [BLOCK_M, KP // 32, 32])
    scale = _group_scale(_absmax(groups), clip, QMAX)
    g = tl.arange(0, KP // 32)
    g_mask = row_mask[:, None] & (g < K // 32)[None, :]
    tl.store(scales_ptr + rows[:, None] * (K // 32) + g[None, :], scale, mask=g_mask)

    q = _group_codes(groups, scale[:, :, None], QMIN, QMAX)
    if VALUES:
        c = tl.arange(0, KP)
        c_mask = row_mask[:, None] & (c < K)[None, :]
        v = tl.reshape(q.to(tl.float32) * scale[:, :, None], [BLOCK_M, KP])
        tl.store(codes_ptr + rows[:, None] * K + c[None, :], v.to(codes_ptr.dtype.element_ty), mask=c_mask)
    elif DECODE:
        even, odd = tl.split(tl.reshape(q, [BLOCK_M, KP // 32, 16, 2]))
        p = tl.arange(0, 16)[None, None, :]
        base = codes_ptr + rows[:, None, None] * K + g[None, :, None] * 32 + p
        mask = g_mask[:, :, None] & (p < 16)
        tl.store(base, even.to(tl.int8), mask=mask)
        tl.store(base + 16, odd.to(tl.int8), mask=mask)
    elif BITS == 4:
        even, odd = tl.split(tl.reshape(q, [BLOCK_M, KP // 2, 2]))
        packed = ((even & 0xF) | ((odd & 0xF) << 4)).to(tl.uint8)
        c = tl.arange(0, KP // 2)
        c_mask = row_mask[:, None] & (c < K // 2)[None, :]
        tl.store(codes_ptr + rows[:, None] * (K // 2) + c[None, :], packed, mask=c_mask)
    else:
        c = tl.arange(0, KP)
        c_mask = row_mask[:, None] & (c < K)[None, :]
        tl.store(codes_ptr + rows[:, None] * K + c[None, :], tl.reshape(q, [BLOCK_M, KP]).to(tl.int8), mask=c_mask)


@triton.jit
def _transform_rows(
    x_blk,
    d_ptr,
    right_ptr,
    left_t,
    ok,
    K: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N1P: tl.constexpr,
    N2P: tl.constexpr,
    ROWSP: tl.constexpr,
    CJ: tl.constexpr,
    STACK: tl.constexpr,
    HAS_D: tl.constexpr,
    inv_rms,
    g_ptr,
    NORM: tl.constexpr,
):
    """Rows ``a`` of ``Z = L^T X R`` for ``STACK`` consecutive tokens from ``x_blk`` (&X[t0, 0, 0]; ``ok [STACK]``:
    which exist), given ``left_t [ROWSP, N1P] = L[:, a]^T`` (zero outside the program's rows), as
    ``Z_a = sum_J (L_a^T X[:, J]) R[J, :]`` over ``CJ``-column chunks ``J`` of X. The tokens share both dots: the
    first takes their chunks side by side (``[N1P, STACK * CJ]``: ``L_a^T [X_1[:, J] | X_2[:, J] | ...]``), the
    second their results stacked (``[STACK * ROWSP, CJ] @ R[J, :]``), so ``L`` and ``R``'s operands are prepared
    once for ``STACK`` tokens. Each value is the same two sums as one token alone (tf32x3, fp32 accumulation).
    Returns ``[STACK * ROWSP, N2P]`` (token-major), zero past ``N2``."""
    c = tl.arange(0, N1P)
    q = tl.arange(0, STACK * CJ)  # token q // CJ, column q % CJ of the chunk
    b = tl.arange(0, N2P)
    tok_ok = tl.reshape(tl.broadcast_to(ok[:, None], [STACK, CJ]), [STACK * CJ])
    tok_r = tl.reshape(tl.broadcast_to(inv_rms[:, None], [STACK, CJ]), [STACK * CJ])  # each column's token's 1 / rms
    left_hi, left_lo = _split_tf32(left_t)
    z = tl.zeros([STACK * ROWSP, N2P], dtype=tl.float32)
    for j0 in range(0, N2, CJ):
        j = j0 + q % CJ
        x_mask = (c < N1)[:, None] & (tok_ok & (j < N2))[None, :]
        x_offs = (q // CJ)[None, :] * K + c[:, None] * N2 + j[None, :]
        x = tl.load(x_blk + x_offs, mask=x_mask, other=0.0).to(tl.float32)
        # the norm's weight and the diagonal once per chunk, shared by the STACK tokens
        jc = j0 + tl.arange(0, CJ)
        col_offs = c[:, None] * N2 + jc[None, :]
        col_mask = (c < N1)[:, None] & (jc < N2)[None, :]
        if NORM != 0:
            g = tl.load(g_ptr + col_offs, mask=col_mask, other=0.0).to(tl.float32)
            x = _normed_by(x, tok_r[None, :], x_blk, _stacked(g, N1P, STACK, CJ), NORM)
        if HAS_D:
            x = x * _stacked(tl.load(d_ptr + col_offs, mask=col_mask, other=0.0), N1P, STACK, CJ)
        y = tl.zeros([ROWSP, STACK * CJ], dtype=tl.float32)
        y = _dot_tf32x3(left_hi, left_lo, x, y)  # [a, (t, j)] = sum_c L[c, a] X_t[c, j]
        y = tl.reshape(tl.permute(tl.reshape(y, [ROWSP, STACK, CJ]), (1, 0, 2)), [STACK * ROWSP, CJ])
        jr = j0 + tl.arange(0, CJ)
        r = tl.load(right_ptr + jr[:, None] * N2 + b[None, :], mask=(jr < N2)[:, None] & (b < N2)[None, :], other=0.0)
        y_hi, y_lo = _split_tf32(y)
        z = _dot_tf32x3(y_hi, y_lo, r, z)  # [(t, a), b] += sum_j Y_t[a, j] R[j, b]
    return z


@triton.jit
def _split_tf32(x):
    """``(hi, lo)``: ``hi`` = ``x`` rounded to tf32 (10 fraction bits) to nearest, ties away from zero, as
    ``cvt.rna.tf32.f32`` (add half a tf32 unit to the magnitude bits, clear the 13 below; a carry moves into the
    exponent as it should), ``lo = x - hi`` (exact in fp32). For finite ``|x| < 2^128 (1 - 2^-12)``; above (within
    one tf32 half-unit of fp32's largest value; no bf16 or fp16 input gets there) ``hi`` rounds to inf and the dot
    gives NaN, where Triton's ``tf32x3`` masked it."""
    hi = ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _dot_tf32x3(a_hi, a_lo, b, acc):
    """``acc + a b`` from three tf32 MMAs chained through ``acc``, small products first: ``a_lo b_hi``,
    ``a_hi b_lo``, ``a_hi b_hi`` (``b`` split by :func:`_split_tf32`; the MMA reads each ``lo`` as a tf32, however
    it rounds). What ``input_precision="tf32x3"`` computes (:func:`tf32x3_sum_error` covers either), without its
    per-element adds and NaN masks of the small products' sums (valid for the inputs of :func:`_split_tf32`)."""
    b_hi, b_lo = _split_tf32(b)
    acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
    acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def _span_groups(
    z,
    scratch_blk,
    a0,
    ok,
    K: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N2P: tl.constexpr,
    ROWS: tl.constexpr,
    ROWSP: tl.constexpr,
    GP: tl.constexpr,
    STACK: tl.constexpr,
):
    """Rows ``a0 .. a0 + ROWS`` of Z for ``STACK`` tokens (``z [STACK * ROWSP, N2P]``, token-major) as
    ``[STACK, GP, 32]`` groups of the flattened K order, from index ``a0 * N2`` on, and which of them are real (and
    of a token that exists: ``ok [STACK]``). When ``N2P == N2`` the tile already is that order; otherwise (e.g.
    N2 = 88) the rows go through the token block's fp32 scratch rows, one per stacked token (store, barrier,
    reload, barrier: the block's next tokens overwrite the same span)."""
    g = tl.arange(0, GP)
    valid = ((g < ROWS * N2 // 32) & (a0 * N2 + g * 32 < K))[None, :] & ok[:, None]
    if N2P == N2:
        return tl.reshape(z, [STACK, GP, 32]), valid
    t = tl.arange(0, STACK)[:, None, None]
    r = tl.arange(0, ROWSP)[None, :, None]
    b = tl.arange(0, N2P)[None, None, :]
    mask = (r < ROWS) & (a0 + r < N1) & (b < N2) & (t < STACK)
    tl.store(scratch_blk + t * K + (a0 + r) * N2 + b, tl.reshape(z, [STACK, ROWSP, N2P]), mask=mask)
    tl.debug_barrier()  # the reload reads other threads' stores
    offs = t * K + a0 * N2 + g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    groups = tl.load(scratch_blk + offs, mask=valid[:, :, None], other=0.0)
    tl.debug_barrier()
    return groups, valid


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _absmax(groups):
    """Per group (last axis) ``max |x|``, NaN if any ``x`` is NaN, as torch's ``amax`` (``max.NaN.f32``: no extra
    instruction; a plain ``tl.max`` drops NaNs, so a NaN activation gave a finite scale and finite garbage)."""
    return tl.reduce(tl.abs(groups), len(groups.shape) - 1, _max_nan)


@triton.jit
def _group_scale(absmax, clip, QMAX: tl.constexpr):
    """``max(clip * absmax / q_max, 1e-8)`` with IEEE division (step 2); NaN stays NaN, as torch's ``clamp_min``."""
    return tl.maximum(tl.math.div_rn(absmax * clip, QMAX), 1e-8, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_codes(groups, scale, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """Round-half-to-even of ``clamp(groups / scale, q_min, q_max)`` as int32 (step 3)."""
    return _round_clamped(tl.math.div_rn(groups, scale), QMIN, QMAX)


@triton.jit
def _round_clamped(v, QMIN: tl.constexpr, QMAX: tl.constexpr):
    v = tl.minimum(tl.maximum(v, QMIN), QMAX)
    return ((v + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int32)


@triton.jit
def _store_groups(
    groups,
    valid,
    tok,
    g0,
    codes_ptr,
    scales_ptr,
    clip,
    K: tl.constexpr,
    GP: tl.constexpr,
    BITS: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    DECODE: tl.constexpr,
    VALUES: tl.constexpr = False,
):
    """Steps 2-4 for ``groups [STACK, GP, 32]``, groups ``g0 ..`` of tokens ``tok [STACK]`` (those ``valid``): the
    same scales and formats as :func:`_quantize_store`; the codes of ``groups * (1 / scale)`` (the reciprocal in
    IEEE division, once per group), not ``groups / scale`` (an IEEE division per value, ~11 SASS instructions):
    within 2^-23 of it, relative, which shifts codes only at values that close to a .5 tie, as the transform's
    own bound already does (``test_fast_transform_within_its_bound`` allows for both)."""
    scale = _group_scale(_absmax(groups), clip, QMAX)
    g = g0 + tl.arange(0, GP)[None, :]
    tok = tok[:, None]
    tl.store(scales_ptr + tok * (K // 32) + g, scale, mask=valid)
    q = _round_clamped(groups * tl.math.div_rn(1.0, scale)[:, :, None], QMIN, QMAX)
    p = tl.arange(0, 16)[None, None, :]
    g, tok, mask = g[:, :, None], tok[:, :, None], valid[:, :, None]
    if VALUES:  # as _quantize_store's
        e = tl.arange(0, 32)[None, None, :]
        v = q.to(tl.float32) * scale[:, :, None]
        tl.store(codes_ptr + tok * K + g * 32 + e, v.to(codes_ptr.dtype.element_ty), mask=mask)
    elif DECODE:
        even, odd = tl.split(tl.reshape(q, [q.shape[0], GP, 16, 2]))
        base = codes_ptr + tok * K + g * 32 + p
        tl.store(base, even.to(tl.int8), mask=mask)
        tl.store(base + 16, odd.to(tl.int8), mask=mask)
    elif BITS == 4:
        even, odd = tl.split(tl.reshape(q, [q.shape[0], GP, 16, 2]))
        packed = ((even & 0xF) | ((odd & 0xF) << 4)).to(tl.uint8)
        tl.store(codes_ptr + tok * (K // 2) + g * 16 + p, packed, mask=mask)
    else:
        e = tl.arange(0, 32)[None, None, :]
        tl.store(codes_ptr + tok * K + g * 32 + e, q.to(tl.int8), mask=mask)


@triton.jit
def _quantize_dot_kernel(
    x_ptr,
    d_ptr,
    left_ptr,
    right_ptr,
    scratch_ptr,
    codes_ptr,
    scales_ptr,
    g_ptr,
    M,
    clip,
    eps,
    K: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N1P: tl.constexpr,
    N2P: tl.constexpr,
    ROWS: tl.constexpr,
    ROWSP: tl.constexpr,
    CJ: tl.constexpr,
    GP: tl.constexpr,
    TOKENS: tl.constexpr,
    BITS: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    HAS_D: tl.constexpr = False,
    DECODE: tl.constexpr = False,
    STACK: tl.constexpr = 1,
    NORM: tl.constexpr = 0,
    NORM_KC: tl.constexpr = 1024,
    VALUES: tl.constexpr = False,
):
    """The tensor-core path: program ``i * row_blocks + j`` (the row blocks of a token block run side by side, so X
    is read from memory once) computes rows ``j * ROWS ..`` of Z (whole 32-groups of the K order) for tokens
    ``i * TOKENS ..``, ``STACK`` of them per dot, with :func:`_transform_rows`, then quantizes and stores them
    (:func:`_span_groups`, :func:`_store_groups`). ``L``'s columns are loaded once per program."""
    row_blocks: tl.constexpr = (N1 + ROWS - 1) // ROWS
    pid = tl.program_id(0)
    block = (pid // row_blocks).to(tl.int64)  # M * K may exceed 2^31
    a0 = (pid % row_blocks) * ROWS
    r = tl.arange(0, ROWSP)
    c = tl.arange(0, N1P)
    rows_ok = (r < ROWS) & (a0 + r < N1)
    left_mask = rows_ok[:, None] & (c < N1)[None, :]
    left_t = tl.load(left_ptr + c[None, :] * N1 + (a0 + r)[:, None], mask=left_mask, other=0.0)  # [a, c] = L[c, a]
    scratch_blk = scratch_ptr + block * (STACK * K)
    for t0 in range(0, TOKENS, STACK):
        tok = block * TOKENS + t0 + tl.arange(0, STACK)
        ok = tok < M
        x_blk = x_ptr + (block * TOKENS + t0) * K
        inv_rms = tl.full([STACK], 1.0, tl.float32)
        if NORM != 0:
            inv_rms = _rms_inverse(x_blk, ok, K, eps, STACK, NORM_KC)
        z = _transform_rows(
            x_blk, d_ptr, right_ptr, left_t, ok, K, N1, N2, N1P, N2P, ROWSP, CJ, STACK, HAS_D, inv_rms, g_ptr, NORM
        )
        groups, valid = _span_groups(z, scratch_blk, a0, ok, K, N1, N2, N2P, ROWS, ROWSP, GP, STACK)
        g0 = a0 * N2 // 32
        _store_groups(groups, valid, tok, g0, codes_ptr, scales_ptr, clip, K, GP, BITS, QMIN, QMAX, DECODE, VALUES)


def quantize_activation(
    x: Tensor,
    left: Tensor | None,
    right: Tensor | None,
    clip: float,
    bits: int,
    group_size: int,
    exact: bool | None = None,
    inv_d: Tensor | None = None,
    decode: bool = False,
    norm: tuple[Tensor, float | None] | None = None,
    values: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the quantizer (arguments already validated by :mod:`loopq.kernels.ops`): one launch, which reads
    ``x`` in its own dtype and multiplies it by ``inv_d`` (fp32 ``[K]``, the transform's diagonal) on load.
    ``norm = (weight, eps)``: ``x`` is first normalised as :func:`loopq.models.base.rms_norm` does (the RMSNorm
    that feeds the group, folded in: :func:`norm_code`), each program computing its tokens' ``1 / rms``.

    ``exact=True`` runs :func:`_quantize_kernel` (the reference's operation order, bit-exact), ``False`` the
    tensor-core transform of :func:`_quantize_dot_kernel` (within :func:`transform_error_bound`), ``None`` whichever
    :func:`uses_fast_path` picks: the fast path for compiled kernels on CUDA, the exact one in the CPU interpreter.
    Without a transform both are the same kernel. ``decode``: int8 codes ``[M, K]`` in the decode GEMM's order
    (:func:`loopq.kernels.packing.deinterleave_groups`) for either ``bits``, instead of the packed format.
    ``values`` (a 16-bit dtype): the quantized values ``code * scale`` ``[M, K]`` in that dtype instead of the
    codes (the fp32 product rounded once to it: what the fake-quant student's matmul reads under autocast), for
    :func:`loopq.kernels.gemm_kernel.gemm_values`; the scales are returned as well."""
    if left is None or right is None or not uses_fast_path(exact, x.device):
        return _quantize_exact(x, left, right, clip, bits, inv_d, decode, norm, values)
    return _quantize_fast(x, left, right, clip, bits, inv_d, decode, norm, values)


def _quantize_exact(*args: object) -> tuple[Tensor, Tensor]:
    """Launch :func:`_quantize_kernel` (``x, left, right, clip, bits, inv_d, decode, norm, values``)."""
    return _quantize(*args[:7], fast=False, norm=args[7], values=args[8])  # type: ignore[arg-type]


def _quantize_fast(*args: object) -> tuple[Tensor, Tensor]:
    """Launch :func:`_quantize_dot_kernel` (the fast path; the arguments of :func:`_quantize_exact`)."""
    return _quantize(*args[:7], fast=True, norm=args[7], values=args[8])  # type: ignore[arg-type]


def norm_code(x_dtype: torch.dtype, weight: Tensor | None) -> int:
    """The kernels' ``NORM`` constexpr: 0 no norm, 1 the product with the weight rounded to the input's dtype (one
    dtype: torch's ``y * weight`` rounds to it), 2 kept in fp32 (two dtypes: torch promotes to fp32)."""
    if weight is None:
        return 0
    return 1 if weight.dtype == x_dtype else 2


def norm_eps(eps: float | None) -> float:
    """The fp32 value of the RMSNorm's eps (None: fp32 machine epsilon, :func:`loopq.models.base.rms_norm`'s)."""
    return fp32_value(torch.finfo(torch.float32).eps if eps is None else eps)


def uses_fast_path(exact: bool | None, device: torch.device) -> bool:
    """Whether a transformed call takes the tensor-core path. ``exact=None`` does on CUDA with compiled kernels: it
    compiles without register spills at Ouro's widths (``tests/kernels/test_gpu_compile.py``); it has not been timed
    on a GPU yet. Under the interpreter (CPU CI) ``None`` stays exact, so the tests comparing the
    Triton backend with the torch reference bit for bit keep doing so."""
    if exact is not None:
        return not exact
    return device.type == "cuda" and isinstance(_quantize_dot_kernel, triton.runtime.JITFunction)


def _outputs(x: Tensor, bits: int, decode: bool = False, values: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    m, k = x.shape
    scales = torch.empty(m, k // GROUP_SIZE, dtype=torch.float32, device=x.device)
    if values is not None:
        return torch.empty(m, k, dtype=values, device=x.device), scales
    packed = bits == 4 and not decode
    codes = torch.empty(m, k // 2 if packed else k, dtype=torch.uint8 if packed else torch.int8, device=x.device)
    return codes, scales


def fp32_value(clip: float) -> float:
    """The fp32 value of ``clip``, as a Python float (what the kernel's fp32 ``clip`` argument holds)."""
    return struct.unpack("f", struct.pack("f", clip))[0]


def dot_padding(n: int) -> int:
    """A Kronecker factor's size on the ``tl.dot`` path: the next power of two, at least 16 (the dot's minimum)."""
    return max(16, next_pow2(n))


#: up to this many tokens (the decode calls) a token's rows of Z are split across programs; above, one program
#: transforms whole tokens, :data:`PREFILL_TOKENS` of them
SPLIT_MAX_M = 16
PREFILL_TOKENS = 8
#: tokens sharing each dot of a prefill program where ``n2`` is a power of two (:func:`prefill_stack`)
PREFILL_STACK = 4
#: fp32 values of one token's rows of Z in a prefill program at most (before :func:`prefill_stack`): at K = 5632
#: (64 x 128 padded) a whole token spilled (8 warps, Triton's tf32x3, no alignment specialization: 24 bytes on
#: sm_80 under Triton 3.9, 600-700 under 3.6), half a token needed 218-255 registers; a quarter, stacked 2 tokens
#: per dot, 163-254 (``scripts/ptx_stats.py --kernels quantize``)
PREFILL_TILE = 2048
NUM_WARPS = 8


class DotConfig(NamedTuple):
    """Compile-time shape of the tensor-core path for one (n1, n2) and token count, and its program split."""

    n1p: int
    n2p: int
    rows: int  # rows of Z per program: whole 32-groups of the K order (rows * n2 % 32 == 0)
    rows_p: int  # the dot's M: rows padded to a power of two >= 16
    cj: int  # columns of X (= reduction of the second dot) per chunk
    gp: int  # groups per program, padded to a power of two
    tokens: int  # tokens per program
    num_warps: int
    stack: int = 1  # tokens sharing each dot (``tokens`` is a multiple)

    def grid(self, m: int, n1: int) -> tuple[int]:
        """Token blocks times row blocks, for ``m`` tokens."""
        return (cdiv(m, self.tokens) * cdiv(n1, self.rows),)


def dot_config(n1: int, n2: int, m: int) -> DotConfig:
    """Decode (``m <= SPLIT_MAX_M``): one token per program, on the fewest rows of Z whose flattened span is whole
    32-groups (``32 / gcd(n2, 32)``) times the largest factor that leaves 16 row blocks, so a token takes ~16
    programs (32 x 64 and 64 x 88: 16 each); more would not be faster, every program pads its rows to the dot's 16
    and reads all of X and R. Prefill: whole tokens (``rows = n1``), :data:`PREFILL_TOKENS` per program, so ``L`` is
    loaded once for 8 tokens. Reductions over X's columns in chunks of 32 (16 for a 16-padded factor; a decode
    program takes a power-of-two ``n2`` up to 64 in one chunk); 8 warps."""
    n1p, n2p = dot_padding(n1), dot_padding(n2)
    base = GROUP_SIZE // math.gcd(n2, GROUP_SIZE)
    if m <= SPLIT_MAX_M:
        rows, tokens = base * max(1, n1 // (16 * base)), 1
    else:
        rows, tokens = min(n1, max(base, PREFILL_TILE // n2p // base * base)), PREFILL_TOKENS
    rows_p = dot_padding(rows)
    gp = rows_p * n2p // GROUP_SIZE if n2p == n2 else next_pow2(rows * n2 // GROUP_SIZE)
    stack = 1 if m <= SPLIT_MAX_M else prefill_stack(n2, n2p)
    # a decode program takes a power-of-two n2 <= 64 in one chunk: straight-line code, every load issued at once
    # (K = 2048: ~915 -> ~730 SASS per thread, 60 -> 74-80 registers)
    cj = n2p if m <= SPLIT_MAX_M and n2p == n2 and n2p <= 64 else min(32, n2p)
    return DotConfig(n1p, n2p, rows, rows_p, cj, gp, tokens, NUM_WARPS, stack)


def prefill_stack(n2: int, n2p: int) -> int:
    """Tokens sharing each dot of a prefill program (:func:`_transform_rows`): :data:`PREFILL_STACK` where ``n2`` is
    a power of two, half that where it is padded (its tile is ``n2p`` wide and its rows go through scratch).
    Compiled for sm_90 / sm_80 under Triton 3.9 and 3.6 as a launch specializes it (16-byte aligned pointers;
    ``scripts/ptx_stats.py --kernels quantize``), one token per dot executed 144-146 SASS instructions per
    transformed value and thread at K = 2048 (32 x 64) and 334-338 at K = 5632 (64 x 88); 4 and 2 tokens per dot
    70-99 and 216-257 (44-66 and 164-206 with the hand-made tf32x3 and the reciprocal), without spills (up to 255
    registers under 3.6); 4 tokens at K = 5632 spilled 32 bytes under 3.6 on sm_90."""
    return PREFILL_STACK if n2p == n2 else PREFILL_STACK // 2


class QuantizeLaunch(NamedTuple):
    """Everything of one quantizer launch but its tensors and clip: which kernel, the grid, the constexprs, and
    whether it needs fp32 scratch rows (:meth:`scratch_rows`) for a transform whose ``n2`` is not a power of two. A
    function of the shapes only (:func:`quantize_launch`), so a caller that repeats a call can keep it."""

    fast: bool  # _quantize_dot_kernel, else _quantize_kernel
    grid: tuple[int]
    m: int
    needs_scratch: bool
    constexprs: dict[str, int | float | bool]  # with num_warps and enable_fp_fusion

    def scratch_rows(self) -> int:
        """Rows of K fp32 values the launch's scratch needs (where ``needs_scratch``): one per token for the exact
        kernel, one per token block and stacked token for the tensor-core one (M / 8 x 2 at prefill with a padded
        ``n2``, M at decode)."""
        if self.fast:
            return cdiv(self.m, self.constexprs["TOKENS"]) * self.constexprs["STACK"]
        return self.m

    def run(
        self,
        x: Tensor,
        inv_d: Tensor | None,
        left: Tensor | None,
        right: Tensor | None,
        scratch: Tensor | None,
        codes: Tensor,
        scales: Tensor,
        clip32: float,
        norm_weight: Tensor | None = None,
        eps32: float = 0.0,
    ) -> None:
        """Launch on contiguous ``x`` (``M * K`` elements), fp32 contiguous factors (None without a transform),
        ``clip32`` already an fp32 value (:func:`fp32_value`). An absent operand's pointer is ``scales``' (fp32,
        unread): Triton types code a constexpr rules out, and ``x``'s pointer (bf16 on a GPU) as the scratch made
        ``_span_groups`` return bf16 on one path and fp32 on the other, which Triton 3.6 refuses to compile."""
        kernel = _quantize_dot_kernel if self.fast else _quantize_kernel
        none = scales  # the fp32 stand-in for an absent operand
        kernel[self.grid](
            x, none if inv_d is None else inv_d, none if left is None else left, none if right is None else right,
            none if scratch is None else scratch, codes, scales, x if norm_weight is None else norm_weight, self.m,
            clip32, eps32, **self.constexprs,
        )  # fmt: skip


def quantize_launch(
    m: int,
    k: int,
    factors: tuple[int, int] | None,
    bits: int,
    has_d: bool,
    decode: bool,
    fast: bool,
    cuda: bool,
    norm: int = 0,
    values: bool = False,
) -> QuantizeLaunch:
    """The launch of the exact kernel (``fast=False``, or no transform) or the tensor-core one for ``m >= 1`` tokens
    of ``k`` channels, Kronecker factor sizes ``factors`` (None: no transform), ``norm`` :func:`norm_code`,
    ``values``: the quantized values instead of the codes (:func:`quantize_activation`)."""
    if fast and factors is not None:
        grid, num_warps, scratch, shape = _fast_shape(m, *factors)
    else:
        grid, num_warps, scratch, shape = _exact_shape(m, k, factors, cuda)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    constexprs = dict(K=k, BITS=bits, HAS_D=has_d, QMIN=float(qmin), QMAX=float(qmax), DECODE=decode, **shape)
    constexprs |= dict(NORM=norm, NORM_KC=min(1024, next_pow2(k)), VALUES=values)
    constexprs |= dict(num_warps=num_warps, enable_fp_fusion=False)  # the quantization steps round like the reference
    return QuantizeLaunch(fast and factors is not None, grid, m, scratch, constexprs)


def _exact_shape(m: int, k: int, factors: tuple[int, int] | None, cuda: bool) -> tuple[tuple[int], int, bool, dict]:
    """(grid, warps, scratch needed, constexprs) of :func:`_quantize_kernel`: ``BLOCK_M`` tokens per program, as
    many as :func:`_tile_budget` allows."""
    n1, n2 = factors or (1, 1)
    kp, n1p, n2p = next_pow2(k), next_pow2(n1), next_pow2(n2)
    tile = n1p * n2p if factors else kp
    block_m = max(1, min(next_pow2(m), _tile_budget(cuda) // tile))
    shape = dict(KP=kp, N1=n1, N2=n2, N1P=n1p, N2P=n2p, HAS_TRANSFORM=factors is not None, BLOCK_M=block_m)
    return (cdiv(m, block_m),), 8 if tile * block_m >= 4096 else 4, factors is not None and n2p != n2, shape


def _fast_shape(m: int, n1: int, n2: int) -> tuple[tuple[int], int, bool, dict]:
    """(grid, warps, scratch needed, constexprs) of :func:`_quantize_dot_kernel` (:func:`dot_config`)."""
    cfg = dot_config(n1, n2, m)
    shape = dict(N1=n1, N2=n2, N1P=cfg.n1p, N2P=cfg.n2p, ROWS=cfg.rows, ROWSP=cfg.rows_p, CJ=cfg.cj, GP=cfg.gp)
    return cfg.grid(m, n1), cfg.num_warps, cfg.n2p != n2, shape | dict(TOKENS=cfg.tokens, STACK=cfg.stack)


#: fp32 accumulation inside and between tensor-core MMAs: at most one unit in the last place (2^-23) per addition,
#: relative; this covers round-to-nearest (2^-24) and truncation, which NVIDIA's tensor cores use when they align
#: the products of one MMA step (Fasi, Higham, Mikaitis, Pranesh, PeerJ CS 2021); the interpreter cannot show it
ACC_UNIT = 2.0**-23
TF32_UNIT = 2.0**-11  # round to nearest (``cvt.rna``) to tf32's 10 fraction bits: half a unit, relative


def tf32x3_product_error() -> float:
    """``delta`` with ``|a b - (a_hi b_hi + a_lo' b_hi + a_hi b_lo')| <= delta |a b|`` for fp32 ``a, b``.

    The split (:func:`_split_tf32`, as Triton's ``tf32x3``) is ``a_hi = rna_tf32(a)`` (``|a - a_hi| <= 2^-11 |a|``),
    ``a_lo = a - a_hi`` (exact in fp32), and the MMA reads ``a_lo`` as tf32 ``a_lo'`` however it rounds
    (``|a_lo - a_lo'| <= 2^-10 |a_lo| <= 2^-21 |a|``); the error is
    ``a_lo b_lo + (a_lo - a_lo') b_hi + a_hi (b_lo - b_lo')``: at most ``(2^-22 + 2 * 2^-21 (1 + 2^-11)) |a b|``.
    Each of the three partial products is exact in fp32 (11 x 11 significant bits) and their magnitudes sum to at
    most ``(1 + 2^-8) |a b|``."""
    return 2.0**-22 + 2 * 2.0**-21 * (1 + TF32_UNIT)


def tf32x3_sum_error(n: int) -> float:
    """``eps(n)`` with ``|fl(sum_i a_i b_i) - sum_i a_i b_i| <= eps(n) sum_i |a_i| |b_i|`` for a tf32x3 dot of
    length ``n`` (with padding): the product error :func:`tf32x3_product_error`, plus ``gamma_{3n+1}`` with unit
    :data:`ACC_UNIT` (Higham, eq. 3.5: a sum of ``3n`` exact partial products and the accumulator carried in,
    whether Triton chains it through the three MMAs or adds it after them, in any order, each addition off by
    ``ACC_UNIT``, relative) on their magnitudes (:func:`_dot_tf32x3` chains them; Triton's ``tf32x3`` adds the
    small products' sum after, with NaN masks that do not touch finite values)."""
    return tf32x3_product_error() + (1 + 2.0**-8) * _gamma(3 * n + 1, ACC_UNIT)


def transform_error_bound(x: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """Float64 ``[M, K]`` bound on ``|Z_fast - Z64|``, ``Z64 = L^T X R`` in float64 of the same fp32 inputs, for the
    tensor-core path :func:`_quantize_dot_kernel` (any program split: each value is the same two sums).

    ``Y = fl(L^T X)`` sums ``n1' = N1P`` products per value in one tf32x3 dot: ``|Y - L^T X| <= eps1 |L|^T |X|``,
    ``eps1 = eps(n1')`` (:func:`tf32x3_sum_error`); ``Z = fl(Y R)`` sums ``n2'`` products (``n2`` in chunks of
    ``CJ``, padded) into one accumulator: ``|Z - Y R| <= eps2 |Y| |R|``, ``|Y| <= (1 + eps1) |L|^T |X|``. Hence
    ``|Z_fast - Z64| <= (eps1 + eps2 + eps1 eps2) |L|^T |X| |R|`` (padding adds exact zeros), plus float64's own
    error on ``Z64`` (``gamma_{n1 + n2}``, unit 2^-53) so the bound also covers the oracle. Underflow (products
    below 2^-126) is neglected. At Ouro's widths the factor is 3.7e-5 (K = 2048) and 6.0e-5 (K = 5632), about 6x
    the fp32 FMA path's ``gamma_{n1} + gamma_{n2}``: the price of tensor cores, most of it the assumed
    truncating accumulation."""
    n1, n2 = left.shape[0], right.shape[0]
    cfg = dot_config(n1, n2, 1)
    e1, e2 = tf32x3_sum_error(cfg.n1p), tf32x3_sum_error(cdiv(n2, cfg.cj) * cfg.cj)
    rho = e1 + e2 + e1 * e2 + _gamma(n1 + n2, 2.0**-53)
    xm = x.double().abs().reshape(-1, n1, n2)
    mag = left.double().abs().T @ xm @ right.double().abs()
    return rho * mag.reshape(x.shape)


def _gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``."""
    return n * u / (1 - n * u)


def _quantize(
    x: Tensor,
    left: Tensor | None,
    right: Tensor | None,
    clip: float,
    bits: int,
    inv_d: Tensor | None,
    decode: bool,
    fast: bool,
    norm: tuple[Tensor, float | None] | None = None,
    values: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch :func:`_quantize_dot_kernel` (``fast``, with a transform) or :func:`_quantize_kernel`."""
    codes, scales = _outputs(x, bits, decode, values)
    if x.shape[0] == 0:
        return codes, scales
    factors = (left.shape[0], right.shape[0]) if left is not None and right is not None else None
    weight, eps = norm if norm is not None else (None, None)
    code = norm_code(x.dtype, weight)
    launch = quantize_launch(
        *x.shape, factors, bits, inv_d is not None, decode, fast, x.is_cuda, code, values is not None
    )
    x = x.contiguous()
    rows = launch.scratch_rows()
    scratch = torch.empty(rows, x.shape[1], dtype=torch.float32, device=x.device) if launch.needs_scratch else None
    left, right = (left.float().contiguous(), right.float().contiguous()) if factors else (None, None)
    launch.run(x, inv_d, left, right, scratch, codes, scales, fp32_value(clip), weight, norm_eps(eps))
    return codes, scales


def _tile_budget(cuda: bool) -> int:
    """fp32 elements per program: small on GPU (registers), larger in the CPU interpreter (numpy vectorisation)."""
    return 4096 if cuda else 8192
