"""Triton kernel #3: the decode GEMM, ``out[M, N] = A[M, K] W[N, K]^T (+ bias)`` for M <= 16 tokens.

At decode the GEMM is bound by reading the weight: 0.5625 bytes per weight (an int4 code plus its share of one fp16
scale per 32) against BF16's 2, so up to 3.56x a BF16 matmul - but only if the loop that consumes each weight byte
is cheaper than the memory system delivering it (an H100 SM issues ~4 warp-instructions per clock, about
0.3 warp-instructions per weight byte at 3.35 TB/s). The kernel is built so that the compiled loop is that cheap
(``scripts/ptx_stats.py`` counts it, ``tests/kernels/test_ptx_stats.py`` holds it to <= 8 PTX instructions per
weight byte per thread at M = 1):

* **the weight is laid out at export for the threads** (:func:`loopq.kernels.packing.tile_weight`): a program owns
  8 output rows and runs 64 threads ``t = 8 j + r``; thread ``(r, j)`` takes groups ``g = 64 c + 8 i + j``, so at each
  ``i`` of chunk ``c`` the 64 threads read one contiguous 1 KB block, 16 bytes (one group, one ``ld.global.v4``)
  each, and the 8 fp16 scales a thread needs for the chunk are one 16-byte load too;
* **nibbles are decoded with three or four integer ops per 4-byte word**: ``lo = w & 0x0F0F0F0F`` holds the four
  even-k codes of the word as offset-binary nibbles ``u = code + 8`` (the layout stores them so);
  ``(lo + 0x78787878) ^ 0x80808080`` turns each byte into the sign-extended int8 ``u - 8`` without carries between
  bytes (``u + 0x78`` lies in 0x78..0x87, and ``^ 0x80`` maps that to ``u - 8`` modulo 256); ``hi`` the same after
  ``>> 4``;
* **the int8 dot is ``dp4a``** (four int8 products + accumulate per instruction) on the activation's int8 codes,
  written by the quantizer in the matching order (per group its 16 even k, then its 16 odd k:
  :func:`loopq.kernels.packing.deinterleave_groups`), loaded as 16-byte words; each decoded weight word serves all
  the program's tokens;
* **no reduction across threads inside the K loop**: every thread accumulates its own groups in fp32 registers; the
  8 lanes of a row are added once, after the loop;
* **one launch, no split-K**: the K dimension is spread over the 8 lanes of a program instead, and the grid is
  ``N / 8`` programs (256 to 1408 on Ouro-1.4B's shapes, all issued in one wave of loads); the program writes the
  output dtype and adds the bias itself;
* **every load's register layout follows from its shape alone, under any Triton version**: Triton's coalescing
  pass orders a load's dimensions by address contiguity and breaks ties by dimension index - lowest first in 3.6,
  highest first in 3.9. Loads shaped ``[R, J, 4]`` tied R and J, so 3.6 put the rows across a warp's lanes while
  the activation scales (contiguous along j) put the lanes across j, and every group paid layout conversions
  through shared memory (``bar.sync``, and tokens spread over lanes at ``BLOCK_M`` >= 4). So each load is a 2-D
  ``[X, 16 bytes]`` tensor (the activation scales 1-D) over ``x = 64 m + 8 j + r``, where the only order is "vector
  last, x across the threads": thread ``x % 64``, token ``x // 64`` in its registers, for every load in both
  versions; the activations are then viewed as ``[BLOCK_M, 64, 4]`` (a reshape, no data moves) against the
  weight's ``[64, 4]``. r is the fastest of the lanes, so no load's addresses are contiguous along x (which would
  let the pass spread one thread's elements over x);
* **a few compiled variants, each small**: a program holds ``BLOCK_M`` = 1, 2, 4 or 8 tokens in each thread's
  registers as one ``[BLOCK_M, 64, 4]`` block (M rounded up to a power of two; rows past M re-read the last
  token and are not stored); 9..16 tokens run two 8-token programs per tile, adjacent in launch order so the
  second reads the weight from L2. Up to 2 tokens a chunk's 8 groups are straight-line code (all 8 weight loads in
  flight); from 4 on they are a loop, so that one group's activations are live at a time (no spills) and each
  variant compiles in seconds instead of the minutes that unrolling 16 tokens x 8 groups took.

Rounding contract (not bit-exact with :mod:`loopq.kernels.reference`, which adds the groups left to right): every
group's integer dot is exact; each term ``t_g = dot_g * (s_a s_w)`` is rounded twice and the G terms are summed in
fp32 in some bracketing (along a lane, then across the 8 lanes), each term passing through at most G - 1 additions.
Hence, with ``u = 2^-24`` and ``gamma_n = n u / (1 - n u)``::

    |out - ref64| <= gamma_{G+1} * sum_k |a_k w_k s_a s_w|                      (fp32 output, no bias)

where ``ref64`` is the same codes and scales evaluated in float64 (:func:`loopq.kernels.reference.gemm_fp64`,
which also returns this bound). The bias is added to the fp32 sum before the cast to the output dtype, as the torch
path does.

``dp4a`` is emitted with ``tl.inline_asm_elementwise`` on the GPU; the CPU interpreter cannot run inline assembly,
so there (``ASM=False``) :func:`_dp4a` computes the same four sign-extended byte products with shifts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopq.kernels.packing import CHUNK_GROUPS, GROUP_SIZE, SCALE_RUN, TILE_LANES, TILE_ROWS

#: the decode path serves calls of at most this many tokens (``loopq.kernels.ops`` dispatches on it)
MAX_M = 16
#: the most tokens a program holds in registers: a launch of M tokens runs ``cdiv(M, BLOCK_M)`` programs per tile
#: (adjacent in launch order, so the second reads the tile's weight from L2)
MAX_BLOCK_M = 8
#: up to this many tokens a chunk's 8 groups are straight-line code (8 weight loads in flight per thread); larger
#: blocks loop over them, which keeps one group's activation registers live (no spills at 8 tokens) and the
#: compiled code small (each variant compiles in seconds)
UNROLL_M = 2
#: threads of a program: TILE_ROWS x TILE_LANES = 64
NUM_WARPS = TILE_ROWS * TILE_LANES // 32
_ROWS, _LANES, _RUN, _CHUNK = (tl.constexpr(v) for v in (TILE_ROWS, TILE_LANES, SCALE_RUN, CHUNK_GROUPS))
_THREADS = tl.constexpr(TILE_ROWS * TILE_LANES)
_LO = tl.constexpr(0x0F0F0F0F)
_BIAS = tl.constexpr(0x78787878)
_SIGN = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """``c + sum_q a.byte[q] * b.byte[q]`` over the four signed bytes of int32 words (``dp4a.s32.s32``)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        out = c + ((a << 24) >> 24) * ((b << 24) >> 24)
        out += ((a << 16) >> 24) * ((b << 16) >> 24)
        out += ((a << 8) >> 24) * ((b << 8) >> 24)
        out += (a >> 24) * (b >> 24)
    return out


@triton.jit
def _pick(tile, i: tl.constexpr):
    """Entry ``i`` (0..7) of the last axis of a ``[T, 8]`` tile held in one thread, by ``tl.split`` (register
    renaming, no arithmetic): entry ``i`` of ``[T, 2, 2, 2]`` is at ``(i % 2, i // 2 % 2, i // 4)`` reversed."""
    a0, a1 = tl.split(tl.reshape(tile, [tile.shape[0], 4, 2]))
    b = a0 if i % 2 == 0 else a1
    b0, b1 = tl.split(tl.reshape(b, [tile.shape[0], 2, 2]))
    c = b0 if (i // 2) % 2 == 0 else b1
    c0, c1 = tl.split(c)
    return c0 if i // 4 == 0 else c1


@triton.jit
def _chunk(
    acc, a_ptr, sa_ptr, w_tile, sw_tile, c, G, r, j, jx, rowx, w4, s8,
    MASKED: tl.constexpr, UNROLL: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """``acc[m, t] += sum_i dot(a[m, g], w[row, g]) * (s_a[m, g] s_w[row, g])`` over the 8 groups
    ``g = 64 c + 8 i + j`` of chunk ``c`` of thread ``t = 8 j + r``, for all BLOCK_M tokens at once (held in each
    thread's registers); ``MASKED`` (the last chunk only) skips groups past ``G``. ``UNROLL`` (full chunks
    only): the 8 groups as straight-line code (all 8 weight loads in flight, each scale picked by register
    renaming), else a loop (one group's registers live at a time, the scale picked with 8 selects; in the last
    chunk only over the 16-byte blocks that exist, so a K of a few groups costs a few steps)."""
    sw_off = ((c * _ROWS + r) * _LANES + j) * _RUN + s8  # [T, 8]
    sw = tl.load(sw_tile + sw_off, cache_modifier=".cg").to(tl.float32)  # 16 B, L2 only (read once)
    if UNROLL and not MASKED:
        for i in tl.static_range(_RUN):
            acc = _group(acc, a_ptr, sa_ptr, w_tile, _pick(sw, i), c, i, G, r, j, jx, rowx, w4, MASKED, ASM)
    else:
        steps = _RUN
        if MASKED:
            steps = tl.cdiv(G - c * _CHUNK, _LANES)  # the last chunk's groups that exist
        for i in range(steps):
            sw_i = tl.sum(tl.where(s8 == i, sw, 0.0), axis=1)
            acc = _group(acc, a_ptr, sa_ptr, w_tile, sw_i, c, i, G, r, j, jx, rowx, w4, MASKED, ASM)
    return acc


@triton.jit
def _group(
    acc, a_ptr, sa_ptr, w_tile, sw_i, c, i, G, r, j, jx, rowx, w4, MASKED: tl.constexpr, ASM: tl.constexpr
):  # fmt: skip
    """The ``i``-th group of chunk ``c`` (``g = 64 c + 8 i + j``) for thread ``t = 8 j + r``, all tokens: one
    16-byte weight load, two 16-byte activation loads and one scale load per token, 8 ``dp4a`` per token. Every
    load is a 2-D ``[T or BLOCK_M T, 4]`` (or 1-D) tensor whose element ``x`` belongs to thread ``x % T`` (see the
    module docstring); the activations are then viewed as ``[BLOCK_M, T, 4]`` (a reshape: no data moves)."""
    w_off = ((c * _RUN + i) * (_ROWS * _LANES) + r * _LANES + j) * 4 + w4  # [T, 4]
    gx = c * _CHUNK + i * _LANES + jx  # [BLOCK_M T]: the group of each (token, thread)
    a_row = a_ptr + rowx[:, None] * (G * 8) + gx[:, None] * 8 + w4  # [BLOCK_M T, 4]
    sa_row = sa_ptr + rowx * G + gx
    if MASKED:
        live = (c * _CHUNK + i * _LANES + j) < G
        wv = tl.load(w_tile + w_off, mask=live, other=0, eviction_policy="evict_first")
        a_even = tl.load(a_row, mask=(gx < G)[:, None], other=0)
        a_odd = tl.load(a_row + 4, mask=(gx < G)[:, None], other=0)
        sa = tl.load(sa_row, mask=gx < G, other=0.0)
    else:
        wv = tl.load(w_tile + w_off, eviction_policy="evict_first")
        a_even = tl.load(a_row)
        a_odd = tl.load(a_row + 4)
        sa = tl.load(sa_row)
    lo = ((wv & _LO) + _BIAS) ^ _SIGN  # [T, 4] words of sign-extended int8 codes: even k
    hi = (((wv >> 4) & _LO) + _BIAS) ^ _SIGN  # odd k
    shape: tl.constexpr = [acc.shape[0], acc.shape[1], 4]
    a_even, a_odd = tl.reshape(a_even, shape), tl.reshape(a_odd, shape)
    dot = _dp4a(lo[None, :, :], a_even, _dp4a(hi[None, :, :], a_odd, tl.zeros_like(a_even), ASM), ASM)
    return acc + tl.sum(dot, axis=2).to(tl.float32) * (tl.reshape(sa, [acc.shape[0], acc.shape[1]]) * sw_i[None, :])


@triton.jit
def _decode_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, bias_ptr, out_ptr, M, N, G,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, UNROLL: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Program ``p``: output rows ``8 t .. 8 t + 7`` of tile ``t = p // B`` for tokens ``BLOCK_M b ..`` of token
    block ``b = p % B``, ``B = cdiv(M, BLOCK_M)`` (see the module docstring)."""
    token_blocks = tl.cdiv(M, BLOCK_M)
    tile = (tl.program_id(0) // token_blocks).to(tl.int64)
    first = (tl.program_id(0) % token_blocks) * BLOCK_M
    t = tl.arange(0, _THREADS)
    r = (t % _ROWS)[:, None]  # [T, 1]: thread t = 8 j + r owns tile row r and K lane j
    j = (t // _ROWS)[:, None]
    x = tl.arange(0, BLOCK_M * _THREADS)  # (token, thread) pairs, x = T m + t
    jx = (x // _ROWS) % _LANES
    rowx = tl.minimum(first + x // _THREADS, M - 1)  # rows past M read the last one; their outputs are not stored
    w4 = tl.arange(0, 4)[None, :]
    s8 = tl.arange(0, _RUN)[None, :]
    blocks = tl.cdiv(G, _LANES)  # 16-byte code blocks of 8 groups per tile row
    chunks = tl.cdiv(G, _CHUNK)
    w_tile = w_ptr + tile * (blocks * (_ROWS * _LANES * 4))  # int32 words
    sw_tile = sw_ptr + tile * (chunks * (_ROWS * _CHUNK))
    acc = tl.zeros([BLOCK_M, _THREADS], dtype=tl.float32)
    full = G // _CHUNK
    for c in range(full):
        acc = _chunk(acc, a_ptr, sa_ptr, w_tile, sw_tile, c, G, r, j, jx, rowx, w4, s8, False, UNROLL, ASM)
    if full < chunks:
        acc = _chunk(acc, a_ptr, sa_ptr, w_tile, sw_tile, full, G, r, j, jx, rowx, w4, s8, True, UNROLL, ASM)
    out = tl.sum(tl.reshape(acc, [BLOCK_M, _LANES, _ROWS]), axis=1)  # [BLOCK_M, R]: the lanes of a row, once
    rn = tile * _ROWS + tl.arange(0, _ROWS)
    om = first + tl.arange(0, BLOCK_M)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    mask = (om < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + om[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def specialization(m: int) -> dict[str, int | bool]:
    """The constexprs a launch for ``m`` tokens compiles with: ``BLOCK_M``, M rounded up to a power of two and
    capped at :data:`MAX_BLOCK_M` (so 4 variants serve 1..16 tokens), and ``UNROLL`` up to :data:`UNROLL_M`."""
    bm = min(triton.next_power_of_2(m), MAX_BLOCK_M)
    return {"BLOCK_M": bm, "UNROLL": bm <= UNROLL_M}


def gemm_tiled(
    a_codes: Tensor,
    a_scales: Tensor,
    w_codes: Tensor,
    w_scales: Tensor,
    n: int,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:
    """One launch of :func:`_decode_kernel` (``N / 8 * cdiv(M, BLOCK_M)`` programs). ``a_codes``: int8 ``[M, K]``
    in the decode order (:func:`loopq.kernels.packing.deinterleave_groups`), ``a_scales`` fp32 ``[M, K/32]``; the
    weight in the kernel layout (:func:`loopq.kernels.packing.tile_weight`) of ``n`` rows; ``bias`` fp32 ``[n]`` or
    None."""
    m, k = a_codes.shape
    if not 0 < m <= MAX_M:
        raise ValueError(f"the decode GEMM takes 1..{MAX_M} rows (got M={m}); use loopq.kernels.gemm_kernel")
    out = torch.empty(m, n, dtype=out_dtype, device=a_codes.device)
    if n == 0:
        return out
    groups = k // GROUP_SIZE
    spec = specialization(m)
    _decode_kernel[(w_codes.shape[0] * triton.cdiv(m, spec["BLOCK_M"]),)](
        a_codes.contiguous().view(torch.int32),
        a_scales.contiguous(),
        w_codes.view(torch.int32),
        w_scales,
        out if bias is None else bias,
        out,
        m,
        n,
        groups,
        HAS_BIAS=bias is not None,
        **spec,
        ASM=a_codes.is_cuda and isinstance(_decode_kernel, triton.runtime.JITFunction),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return out
