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
* **one launch, K split across programs where the grid is narrow** (:func:`k_split`): ``N / 8`` programs per
  8 tokens is 256 on Ouro-1.4B's ``o_proj`` and ``down_proj``, too few to keep an H100's memory busy (the GPU run
  of 2026-11-27 timed M = 1 by K per program); so each tile's chunk blocks are split over ``S`` = 1, 2, 4 or 8
  neighbouring programs (split ``s`` reads blocks ``s, s + S, ...`` of every chunk), until the grid has
  :data:`PROGRAMS_PER_SM` programs per SM. The reduction stays in the launch and is deterministic: every split
  stores its ``[BLOCK_M, 8]`` partial sums, and the one that arrives last at the block's counter (an ``acq_rel``
  atomic after a barrier) adds the ``S`` partials in split order, adds the bias, writes the output dtype and resets
  the counter (:func:`arrival_counters`: filled once per device and stream, never per call). Unsplit, the program
  writes the output itself;
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
  token and are not stored). Up to 2 tokens a chunk's 8 groups are straight-line code (all 8 weight loads in
  flight); from 4 on they are a loop, so that one group's activations are live at a time (no spills) and each
  variant compiles in seconds instead of the minutes that unrolling 16 tokens x 8 groups took;
* **9..16 tokens run on the int8 tensor cores** (:func:`_decode_mma_kernel`, one variant per K split): with ``dp4a``
  every token costs half an instruction per weight byte, 8 at 16 tokens before any decoding or scaling. A program
  owns 32 output rows (4 tiles) and 16 token slots (rows past M re-read the last token); its 4 warps split K by lane
  (warp ``s`` takes ``j = s, s + 4``), and a step is one lane per warp: the 8 groups ``g = 64 c + 8 i + j`` of the
  export layout's run (one 16-byte code load per group and row, the 8 weight scales of a row one 16-byte load), each
  one ``tl.dot`` of depth 32 (``mma.m16n8k32``: ``[16 tokens, 32] x [32, 32 rows]``) and one rescale. The weight
  operand is decoded in 3 instructions per 4-byte word for both nibbles: ``lop3`` keeps a byte's high nibble and
  flips its top bit, which gives ``16 * code`` as an int8 for the offset-binary nibble, and a ``shl`` by 4 first
  does the same for the low one; so each dot is 16 times the group's (exact: ``|16 dot| <= 2^19``) and the sum is
  multiplied by 1/16 (exact) after the loop, when the 4 warps' sums are added. The loop stages both dot operands
  through shared memory (``bar.sync`` in it) and is not software-pipelined; a step's 8 weight scales per row are
  widened to fp32 where they are loaded and then moved to the accumulator's layout (:func:`_widen`), and each
  group's addresses are the step's plus a constant. The weight operand has two forms with the same integer dots
  (:func:`_weight_operand`, :data:`MMA_HALVES`): Triton 3.9 converts the raw codes to the operand's layout before
  decoding them (16-byte stores, ``ldmatrix``); Triton 3.6 cannot, and stores the decoded operand in an order of its
  own choosing, so before 3.9 two lanes split each row's 16 bytes so that the decoded tile reaches shared memory
  K-major, 8 bytes per store. ``N / 32`` programs are 64 on ``o_proj`` and ``down_proj``, so K is split here too
  (:func:`k_split` with ``mma``: up to :data:`MMA_PROGRAMS_PER_SM` per SM, at most 4 and K's lane runs), the steps
  dealt round-robin to the splits, reduced as above.

Rounding contract (not bit-exact with :mod:`loopq.kernels.reference`, which adds the groups left to right): every
group's integer dot is exact; each term ``t_g = dot_g * (s_a s_w)`` is rounded twice and the G terms are summed in
fp32 in some bracketing (along a lane, then across the 8 lanes or 4 warps, then across the K splits), each term
passing through at most G - 1 additions (the tensor-core kernel contracts a term's second rounding into its
addition: ``fma``, within the same bound).
Hence, with ``u = 2^-24`` and ``gamma_n = n u / (1 - n u)``::

    |out - ref64| <= gamma_{G+1} * sum_k |a_k w_k s_a s_w|                      (fp32 output, no bias)

where ``ref64`` is the same codes and scales evaluated in float64 (:func:`loopq.kernels.reference.gemm_fp64`,
which also returns this bound). The bias is added to the fp32 sum before the cast to the output dtype, as the torch
path does.

``dp4a`` and ``lop3`` are emitted with ``tl.inline_asm_elementwise`` on the GPU; the CPU interpreter cannot run
inline assembly, so there (``ASM=False``) :func:`_dp4a` computes the same four sign-extended byte products with
shifts and :func:`_nibbles16` the same int8 values with integer arithmetic.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopq.kernels.packing import CHUNK_GROUPS, GROUP_SIZE, SCALE_RUN, TILE_LANES, TILE_ROWS, cdiv, next_pow2

#: the decode path serves calls of at most this many tokens (``loopq.kernels.ops`` dispatches on it)
MAX_M = 16
#: the most tokens the ``dp4a`` kernel serves (in each thread's registers); more run the tensor-core kernel
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
    acc, a_ptr, sa_ptr, w_tile, sw_tile, c, G, r, j, jx, rowx, w4, s8, split,
    MASKED: tl.constexpr, UNROLL: tl.constexpr, KSPLIT: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """``acc[m, t] += sum_i dot(a[m, g], w[row, g]) * (s_a[m, g] s_w[row, g])`` over the groups ``g = 64 c + 8 i
    + j`` of chunk ``c`` of thread ``t = 8 j + r`` whose ``i`` is this program's share of the chunk (``i =
    split, split + KSPLIT, ...``: the blocks dealt round-robin, so a split has groups whenever the chunk has
    more blocks than its index), for all BLOCK_M tokens at once (held in each thread's registers); ``MASKED``
    (the last chunk only) skips groups past ``G``. ``UNROLL`` (full chunks only): its 8 / KSPLIT groups as
    straight-line code (all their weight loads in flight, each scale picked by register renaming and, under a
    split, ``KSPLIT - 1`` selects on the program's split), else a loop (one group's registers live at a time,
    the scale picked with 8 selects; in the last chunk only over the 16-byte blocks that exist, so a K of a few
    groups costs a few steps)."""
    sw_off = ((c * _ROWS + r) * _LANES + j) * _RUN + s8  # [T, 8]
    sw = tl.load(sw_tile + sw_off, cache_modifier=".cg").to(tl.float32)  # 16 B, L2 only (read once)
    PER: tl.constexpr = _RUN // KSPLIT
    if UNROLL and not MASKED:
        for ii in tl.static_range(PER):
            sw_i = _pick(sw, ii * KSPLIT)
            for q in tl.static_range(1, KSPLIT):
                sw_i = tl.where(split == q, _pick(sw, ii * KSPLIT + q), sw_i)
            i = ii if KSPLIT == 1 else ii * KSPLIT + split
            acc = _group(acc, a_ptr, sa_ptr, w_tile, sw_i, c, i, G, r, j, jx, rowx, w4, MASKED, ASM)
    else:
        stop = _RUN
        if MASKED:
            stop = tl.cdiv(G - c * _CHUNK, _LANES)  # the last chunk's groups that exist
        for it in range(tl.cdiv(stop - split, KSPLIT)):  # counted from 0 (a strided range can cost registers)
            i = it * KSPLIT + split
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
    a_ptr, sa_ptr, w_ptr, sw_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, G,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, UNROLL: tl.constexpr, KSPLIT: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Program ``p``: output rows ``8 t .. 8 t + 7`` of tile ``t = q // B`` for tokens ``BLOCK_M b ..`` of token
    block ``b = q % B``, ``B = cdiv(M, BLOCK_M)``, ``q = p // KSPLIT``, over K split ``p % KSPLIT`` of ``KSPLIT`` (see
    the module docstring; the splits of one output block are neighbours in the grid)."""
    split = tl.program_id(0) % KSPLIT
    block = tl.program_id(0) // KSPLIT
    token_blocks = tl.cdiv(M, BLOCK_M)
    tile = (block // token_blocks).to(tl.int64)
    first = (block % token_blocks) * BLOCK_M
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
        acc = _chunk(acc, a_ptr, sa_ptr, w_tile, sw_tile, c, G, r, j, jx, rowx, w4, s8, split,
                     False, UNROLL, KSPLIT, ASM)  # fmt: skip
    if full < chunks:
        acc = _chunk(acc, a_ptr, sa_ptr, w_tile, sw_tile, full, G, r, j, jx, rowx, w4, s8, split,
                     True, UNROLL, KSPLIT, ASM)  # fmt: skip
    out = tl.sum(tl.reshape(acc, [BLOCK_M, _LANES, _ROWS]), axis=1)  # [BLOCK_M, R]: the lanes of a row, once
    rn = tile * _ROWS + tl.arange(0, _ROWS)
    om = first + tl.arange(0, BLOCK_M)
    mask = (om < M)[:, None] & (rn < N)[None, :]
    _split_epilogue(out, part_ptr, count_ptr, block, split, bias_ptr, out_ptr, rn, om, M, N, mask, HAS_BIAS, KSPLIT)


@triton.jit
def _split_epilogue(
    out, part_ptr, count_ptr, block, split, bias_ptr, out_ptr, rn, om, M, N, mask,
    HAS_BIAS: tl.constexpr, KSPLIT: tl.constexpr,
):  # fmt: skip
    """Unsplit, :func:`_epilogue`. Split, the program's partial sums go to the workspace, and the program that
    arrives last at the block's counter adds all ``KSPLIT`` of them in split order (the same sum whichever program
    is last), writes the output and resets the counter for the next launch. The barrier orders the block's stores
    before its arrival (release), and the partials are read past L1 (``.cg``) after the arrival that saw all the
    others (acquire)."""
    if KSPLIT == 1:
        _epilogue(out, bias_ptr, out_ptr, rn, om, N, mask, HAS_BIAS)
    else:
        part = part_ptr + (om[:, None] * N + rn[None, :])
        tl.store(part + split * M * N, out, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")
        if arrived == KSPLIT - 1:
            total = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for q in tl.static_range(1, KSPLIT):
                total += tl.load(part + q * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(total, bias_ptr, out_ptr, rn, om, N, mask, HAS_BIAS)
            tl.atomic_xchg(count_ptr + block, 0, sem="relaxed", scope="gpu")


@triton.jit
def _epilogue(out, bias_ptr, out_ptr, rn, om, N, mask, HAS_BIAS: tl.constexpr):
    """The bias (fp32, added before the cast, as the torch path does) and the store in the output dtype."""
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(out_ptr + om[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nibbles16(w, HIGH: tl.constexpr, ASM: tl.constexpr):
    """uint8 code bytes -> int8 ``16 * code`` of each byte's low (or, ``HIGH``, high) offset-binary nibble ``u``:
    the nibble moved to the top of its byte (``<< 4`` for the low one) and masked, its top bit flipped (``u ^ 8`` is
    the code's two's complement nibble), four bytes per 32-bit word: ``lop3`` (and + xor), plus ``shl``."""
    if ASM and HIGH:
        out = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6A;", "=r,r", [w], dtype=tl.int8, is_pure=True, pack=4
        )
    elif ASM:
        out = tl.inline_asm_elementwise(
            "shl.b32 $0, $1, 4;\nlop3.b32 $0, $0, 0xF0F0F0F0, 0x80808080, 0x6A;",
            "=r,r", [w], dtype=tl.int8, is_pure=True, pack=4,
        )  # fmt: skip
    else:
        v = w.to(tl.int32)
        if HIGH:
            v = v >> 4
        out = (((v & 0xF) - 8) * 16).to(tl.int8)
    return out


@triton.jit
def _widen(x, ASM: tl.constexpr):
    """fp16 -> fp32 (``cvt``) in the layout ``x`` was loaded in, so that a layout conversion that follows moves the
    fp32 values: Triton moves a conversion above ``.to(tl.float32)`` (to move half the bytes) and above a pure
    inline-assembly op (rematerialized in the target layout), and then every thread converts each value it receives.
    The weight scales are a ``[S, ROWS, 8]`` tile of which each thread loads 8 and, in the accumulator's layout,
    holds 64 (8 rows x 8 groups, each held by 8 lanes): 8 ``cvt`` instead of 64 plus their unpacking ``mov``. As
    ``is_pure=False`` Triton cannot rematerialize it, and the ``expand_dims`` after it is where Triton 3.6 places the
    one conversion of the tile (it moves a conversion above an ``expand_dims`` it cannot see past; without one it
    converted each group's slice after the picking, 2 ``bar.sync`` each). Triton 3.9 converts the fp32 tile and then
    each group's ``[S, 1, R]`` slice (24 ``bar.sync`` per step instead of 18, 58 fewer instructions)."""
    if ASM:
        out = tl.inline_asm_elementwise("cvt.f32.f16 $0, $1;", "=r,h", [x], dtype=tl.float32, is_pure=False, pack=1)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def _weight_operand(w_step, i, g, G, MASKED: tl.constexpr, HALVES: tl.constexpr, ASM: tl.constexpr):
    """The ``[S, K = 32, ROWS]`` int8 operand (16 x the codes) of group ``g = 64 c + 8 i + j[s]`` for each warp
    ``s``, K in the activation's order: the 16 low nibbles (even k), then the 16 high ones (odd k).

    One lane per row (Triton 3.9): each thread loads a row's 16 code bytes and joins their two nibbles; 3.9 moves
    the layout conversion before the decoding (16-byte stores of the raw codes, ``ldmatrix``). Triton 3.6 converts
    the decoded tile, through shared memory in an order read off its register layout: K first (as each thread
    holds it) unless the dimension its first lane bit runs along holds one element per thread, then that one. Here
    that is S, so K went last and the tile was stored and read one byte at a time (docs/benchmarks.md).

    ``HALVES`` (:data:`MMA_HALVES`, before Triton 3.9): two lanes split a row's 16 bytes (one 8-byte load each; the
    half is the load's dimension 0, so 3.6's coalescing puts it on the first lane bit) and each decodes both nibbles
    of its 8 bytes into K = ``16 h + 8 half + b``, ``h`` a broadcast selected per register (no data moves). The
    first lane bit now runs along K: 3.6 stages the tile K-major, 8 bytes per store, read with ``ldmatrix``.
    """
    if HALVES:
        if MASKED:
            w = tl.load(w_step + i * (_ROWS * _LANES * 16), mask=g[None, :, :, :] < G, other=0x88,
                        eviction_policy="evict_first")  # fmt: skip
        else:
            w = tl.load(w_step + i * (_ROWS * _LANES * 16), eviction_policy="evict_first")
        shape: tl.constexpr = [2, w.shape[1], w.shape[2], 2, 8]  # [half, S, ROWS, h, b]
        lo = tl.broadcast_to(tl.reshape(_nibbles16(w, False, ASM), [2, w.shape[1], w.shape[2], 1, 8]), shape)
        hi = tl.broadcast_to(tl.reshape(_nibbles16(w, True, ASM), [2, w.shape[1], w.shape[2], 1, 8]), shape)
        wk = tl.where(tl.arange(0, 2)[None, None, None, :, None] == 0, lo, hi)
        wk = tl.reshape(tl.permute(wk, [1, 2, 3, 0, 4]), [w.shape[1], w.shape[2], 32])  # [S, ROWS, K]
        wk = tl.trans(wk, [0, 2, 1])
    else:
        if MASKED:
            w = tl.load(w_step + i * (_ROWS * _LANES * 16), mask=g < G, other=0x88, eviction_policy="evict_first")
        else:
            w = tl.load(w_step + i * (_ROWS * _LANES * 16), eviction_policy="evict_first")
        wk = tl.join(_nibbles16(w, False, ASM), _nibbles16(w, True, ASM))  # [S, 16, ROWS, 2]
        wk = tl.reshape(tl.permute(wk, [0, 3, 1, 2]), [w.shape[0], 32, w.shape[2]])
    return wk


@triton.jit
def _weight_step(w_rows, c, js, HALVES: tl.constexpr):
    """The code addresses of chunk ``c``'s first group for lane ``js`` (``[S, 1, 1]``) of each row in ``w_rows``, in
    the shape :func:`_weight_operand` loads: ``[2, S, ROWS, 8]`` (two lanes per row, 8 bytes each) with ``HALVES``,
    else ``[S, 16, ROWS]``; group ``i`` of the step is ``i * ROWS * LANES * 16`` bytes further."""
    if HALVES:
        half = tl.arange(0, 2)[:, None, None, None]
        b8 = tl.arange(0, 8)[None, None, None, :]
        w_off = c * (_RUN * _ROWS * _LANES * 16) + js[None, :, :, :] * 16 + half * 8 + b8  # [2, S, ROWS, 8]
        w_step = w_rows[None, None, :, None] + w_off
    else:
        w_step = w_rows[None, None, :] + (c * (_RUN * _ROWS * _LANES * 16) + js * 16 + tl.arange(0, 16)[None, :, None])
    return w_step


@triton.jit
def _mma_lanes(
    acc, a_rows, sa_rows, w_rows, sw_rows, c, j, G, i8, HALVES: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Groups ``g = 64 c + 8 i + j[s]`` (i = 0..7) of the program's rows for all 16 tokens, one lane ``j[s]`` per
    warp ``s``: per group one int8 tensor-core dot of depth 32 per warp and one rescale of its ``[16, ROWS]``
    tile."""
    js = j[:, None, None]  # [S, 1, 1]
    sw = tl.load(sw_rows[None, :, None] + (c * _ROWS * _CHUNK + js * _RUN) + i8[None, None, :], cache_modifier=".cg")
    sw = _widen(sw, ASM)[:, None, :, :]  # [S, 1, ROWS, 8]: the 8 groups' scales, one 16-byte load per row
    g0 = c * _CHUNK + j  # [S]: the step's group at i = 0
    a_step = a_rows + (g0 * 32)[:, None, None]  # [S, 16, 32]
    sa_step = sa_rows + g0[:, None]  # [S, 16]
    w_step = _weight_step(w_rows, c, js, HALVES)
    for i in tl.static_range(_RUN):
        g2 = g0[:, None] + i * _LANES  # [S, 1]
        g = g2[:, :, None]
        a = tl.load(a_step + i * (_LANES * 32))
        sa = tl.load(sa_step + i * _LANES)
        # the activation holds per group its 16 even-k codes, then its 16 odd-k codes: the low nibbles, then the high
        wk = _weight_operand(w_step, i, g, G, False, HALVES, ASM)  # [S, K, ROWS]
        dot = tl.dot(a, wk, out_dtype=tl.int32)  # [S, 16, ROWS]
        acc += (dot.to(tl.float32) * sa[:, :, None]) * _pick4(sw, i)
    return acc


@triton.jit
def _mma_tail(acc, a_rows, sa_rows, w_rows, sw_rows, c, j, G, HALVES: tl.constexpr, ASM: tl.constexpr):
    """The last, partial chunk ``c``: as :func:`_mma_lanes` with the groups past ``G`` masked, one group per
    iteration (a loop over the groups that exist; each group's scale loaded on its own), so that it holds fewer
    registers than the unrolled steps (unrolled, it made ptxas spill under Triton 3.6)."""
    js = j[:, None, None]  # [S, 1, 1]
    g0 = c * _CHUNK + j
    w_step = _weight_step(w_rows, c, js, HALVES)
    for i in range(tl.cdiv(G - c * _CHUNK, _LANES)):
        g2 = g0[:, None] + i * _LANES  # [S, 1]
        g = g2[:, :, None]
        a = tl.load(a_rows + g * 32, mask=g < G, other=0)
        sa = tl.load(sa_rows + g2, mask=g2 < G, other=0.0)
        sw = tl.load(sw_rows[None, None, :] + (c * (_ROWS * _CHUNK) + js * _RUN + i)).to(tl.float32)  # [S, 1, ROWS]
        wk = _weight_operand(w_step, i, g, G, True, HALVES, ASM)  # [S, K, ROWS]
        dot = tl.dot(a, wk, out_dtype=tl.int32)  # [S, 16, ROWS]
        acc += (dot.to(tl.float32) * sa[:, :, None]) * sw
    return acc


@triton.jit
def _pick4(tile, i: tl.constexpr):
    """Entry ``i`` (0..7) of the last axis of a ``[S, 1, R, 8]`` tile held in one thread (see :func:`_pick`): the
    ``[S, 1, R]`` weight scales of group ``i``, ready to broadcast against a ``[S, 16, R]`` dot."""
    s0: tl.constexpr = tile.shape[0]
    s2: tl.constexpr = tile.shape[2]
    a0, a1 = tl.split(tl.reshape(tile, [s0, 1, s2, 4, 2]))
    b = a0 if i % 2 == 0 else a1
    b0, b1 = tl.split(tl.reshape(b, [s0, 1, s2, 2, 2]))
    c = b0 if (i // 2) % 2 == 0 else b1
    c0, c1 = tl.split(c)
    return c0 if i // 4 == 0 else c1


@triton.jit
def _decode_mma_kernel(
    a_ptr, sa_ptr, w_ptr, sw_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, G,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, HALVES: tl.constexpr, KSPLIT: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """9..16 tokens: program ``p`` computes output rows ``ROWS b ..`` (``b = p // KSPLIT``) for all tokens with int8
    tensor-core dots, its ``SPLIT`` warps taking every ``SPLIT``-th K lane; their sums are added once, after the
    loop. The K steps (one lane run of a chunk each) are dealt to the ``KSPLIT`` programs of a block round-robin
    (split ``p % KSPLIT`` takes steps ``split, split + KSPLIT, ...``, and likewise the last chunk's lane runs), whose
    partial sums :func:`_split_epilogue` adds in the launch."""
    split = tl.program_id(0) % KSPLIT
    block = tl.program_id(0) // KSPLIT
    rn = block * ROWS + tl.arange(0, ROWS)
    rc = tl.minimum(rn, N - 1)  # rows past N read the last one; their outputs are not stored
    tile, r = (rc // _ROWS).to(tl.int64), rc % _ROWS
    blocks, chunks = tl.cdiv(G, _LANES), tl.cdiv(G, _CHUNK)
    w_rows = w_ptr + tile * (blocks * (_ROWS * _LANES * 16)) + r * (_LANES * 16)  # bytes
    sw_rows = sw_ptr + tile * (chunks * (_ROWS * _CHUNK)) + r * _CHUNK
    row = tl.minimum(tl.arange(0, 16), M - 1)
    b32, i8, s = tl.arange(0, 32), tl.arange(0, _RUN), tl.arange(0, SPLIT)
    a_rows = a_ptr + (row[:, None] * (G * 32) + b32[None, :])[None, :, :]  # [1, 16, 32]: group 0 of each token
    sa_rows = sa_ptr + (row * G)[None, :]  # [1, 16]
    acc = tl.zeros([SPLIT, 16, ROWS], dtype=tl.float32)
    full = G // _CHUNK
    runs: tl.constexpr = _LANES // SPLIT
    for it in range(tl.cdiv(full * runs - split, KSPLIT)):  # one loop over (chunk, lane run): no nest to keep
        step = split + it * KSPLIT  # registers for
        c = step // runs
        j = (step - c * runs) * SPLIT + s
        acc = _mma_lanes(acc, a_rows, sa_rows, w_rows, sw_rows, c, j, G, i8, HALVES, ASM)
    if full < chunks:  # the last chunk's lane runs continue the round-robin where the full chunks' steps ended
        first_run = (split + KSPLIT - (full * runs) % KSPLIT) % KSPLIT
        for jj in range(first_run, runs, KSPLIT):
            j = jj * SPLIT + s
            acc = _mma_tail(acc, a_rows, sa_rows, w_rows, sw_rows, full, j, G, HALVES, ASM)
    om = tl.arange(0, 16)
    out = tl.sum(acc, axis=0) * 0.0625  # the dots were of 16 x the codes: exact
    mask = (om < M)[:, None] & (rn < N)[None, :]
    _split_epilogue(out, part_ptr, count_ptr, block, split, bias_ptr, out_ptr, rn, om, M, N, mask, HAS_BIAS, KSPLIT)


#: 9..16 tokens run :func:`_decode_mma_kernel`: output rows per program and warps (each warp every 4th K lane)
MMA_ROWS, MMA_WARPS = 32, 4
#: the tensor-core kernel's weight operand in the form the installed Triton stages through shared memory in wide
#: vectors (:func:`_weight_operand`): two lanes per row before 3.9 (the GPU image's 3.6: 7.62 PTX instructions per
#: weight byte, 0 spills, instead of 14.05 and a 24-byte spill on sm_80 in the one-lane form), one from 3.9 (7.18;
#: the two-lane form would cost 7.30 there); both give the same integer dots, hence bit-identical outputs
#: (``tests/kernels/test_decode_kernel.py`` runs both). Numbers: M = 16 main loop, sm_90 and sm_80 alike
#: (``scripts/ptx_stats.py --kernels decode --m 16``, docs/benchmarks.md)
MMA_HALVES = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9)


def uses_mma(m: int) -> bool:
    """Whether a launch for ``m`` tokens runs the tensor-core kernel (9..16 tokens) rather than the ``dp4a`` one."""
    return m > MAX_BLOCK_M


def specialization(m: int) -> dict[str, int | bool]:
    """The constexprs a launch for ``m`` tokens compiles with. Up to :data:`MAX_BLOCK_M` tokens (the ``dp4a``
    kernel): ``BLOCK_M``, M rounded up to a power of two (so 4 variants serve 1..8 tokens), and ``UNROLL`` up to
    :data:`UNROLL_M`; 9..16 tokens (the tensor-core kernel): ``ROWS`` and ``SPLIT``, one variant."""
    if uses_mma(m):
        return {"ROWS": MMA_ROWS, "SPLIT": MMA_WARPS, "HALVES": MMA_HALVES}
    bm = min(next_pow2(m), MAX_BLOCK_M)
    return {"BLOCK_M": bm, "UNROLL": bm <= UNROLL_M}


def compile_options(m: int) -> dict[str, int | bool]:
    """Warps, pipelining and FMA contraction of the launch for ``m`` tokens. The tensor-core kernel is not
    software-pipelined (its 8 weight loads per step are in flight together; pipelining would route the weight
    through ``cp.async`` and shared memory) and contracts its rescale into FMAs (inside the rounding bound)."""
    if uses_mma(m):
        return {"num_warps": MMA_WARPS, "num_stages": 1, "enable_fp_fusion": True}
    return {"num_warps": NUM_WARPS, "enable_fp_fusion": False}


#: a decode launch splits K across programs until it has this many programs per SM (:func:`k_split`): the GPU run
#: of 2026-11-27 timed M = 1 by K per program, not by bytes (256 programs of 2 warps on 132 SMs read 240-400 GB/s,
#: 1408 read 1.1 TB/s), so a narrow shape needs more, shorter programs to keep enough loads in flight. The
#: ``dp4a`` kernel's programs are 2 warps, the tensor-core kernel's 4 warps (one 16-token x 32-row tile each)
PROGRAMS_PER_SM, MMA_PROGRAMS_PER_SM = 8, 2
#: the most programs one output block's K is split over: the 8 blocks of a chunk (``dp4a``), or 4 (tensor cores:
#: each split keeps at least one lane run of 8 groups per warp at Ouro's K = 5632)
MAX_SPLIT, MMA_MAX_SPLIT = 8, 4
#: the SM count a launch plans for where the device has none to report (the Triton interpreter): an H100 SXM's, so
#: that the CPU runs the splits an H100 would
PLAN_SMS = 132


def k_split(programs: int, groups: int, sms: int, mma: bool = False) -> int:
    """The K split of a launch of ``programs`` output blocks over ``groups`` 32-groups: the least power of two
    ``S`` with ``S * programs >= per_sm * sms`` (:data:`PROGRAMS_PER_SM`, :data:`MMA_PROGRAMS_PER_SM`), at most the
    split's cap and the units K has, so that every split has groups to read (units are dealt round-robin): for
    ``dp4a`` the 16-byte blocks a tile row has per chunk (``cdiv(groups, 8)``, at most 8), for the tensor-core
    kernel its steps, 2 lane runs per full chunk and the last chunk's runs that hold groups (one per 4 groups)."""
    if mma:
        full, tail = divmod(groups, CHUNK_GROUPS)
        runs = TILE_LANES // MMA_WARPS
        units, cap, per_sm = full * runs + min(runs, cdiv(tail, MMA_WARPS)), MMA_MAX_SPLIT, MMA_PROGRAMS_PER_SM
    else:
        units, cap, per_sm = cdiv(groups, TILE_LANES), MAX_SPLIT, PROGRAMS_PER_SM
    split = 1
    while split * 2 <= min(cap, units) and split * programs < per_sm * sms:
        split *= 2
    return split


@functools.cache
def device_sms(device: torch.device) -> int:
    """The SM count of a CUDA ``device``, else :data:`PLAN_SMS`."""
    if device.type != "cuda":
        return PLAN_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


class GemmLaunch(NamedTuple):
    """How :func:`gemm_tiled` launches for a shape: the kernel, its grid, whether the codes are read as int32 words
    (the ``dp4a`` kernel), its constexprs and compile options (also :mod:`loopq.kernels.decode_plan`'s), and its
    K split with the workspace that needs: ``split`` fp32 partial outputs ``[M, N]`` and one arrival counter per
    output block (``blocks``), zero before the launch and left zero by it."""

    kernel: Any
    grid: tuple[int]
    words: bool
    constexprs: dict[str, int | bool]
    split: int
    blocks: int


def gemm_launch(
    m: int, n: int, tiles: int, groups: int, has_bias: bool, device: torch.device, split: int | None = None
) -> GemmLaunch:
    """The launch of ``m`` tokens (1..:data:`MAX_M`) against ``n`` weight rows of ``groups`` 32-groups stored as
    ``tiles`` 8-row tiles: the ``dp4a`` kernel's block is a tile, the tensor-core kernel's :data:`MMA_ROWS` rows,
    each block's K split over :func:`k_split` programs (``split`` overrides it)."""
    mma = uses_mma(m)
    blocks = cdiv(n, MMA_ROWS) if mma else tiles
    if split is None:
        split = k_split(blocks, groups, device_sms(device), mma)
    elif split not in (1, 2, 4, 8)[: 3 if mma else 4]:
        raise ValueError(f"gemm_tiled: split must be 1, 2, 4{'' if mma else ' or 8'} at M={m} (got {split})")
    asm = device.type == "cuda" and isinstance(_decode_kernel, triton.runtime.JITFunction)
    constexprs = dict(HAS_BIAS=has_bias, **specialization(m), KSPLIT=split, ASM=asm, **compile_options(m))
    kernel = _decode_mma_kernel if mma else _decode_kernel
    return GemmLaunch(kernel, (blocks * split,), not mma, constexprs, split, blocks if split > 1 else 0)


_COUNTERS: dict[tuple[str, int], Tensor] = {}
_COUNTERS_LOCK = threading.Lock()


def arrival_counters(device: torch.device, blocks: int) -> Tensor:
    """Zeroed int32 arrival counters for a split launch of ``blocks`` output blocks, kept zero by the kernels (the
    last arrival resets its counter), so that a call fills nothing: one buffer per device and CUDA stream (per
    thread where there is no stream: the interpreter runs a launch in its caller's thread), zeroed when it is
    made and grown when a launch needs more; launches in one stream are ordered, so they take turns with it.

    While the stream is being captured into a CUDA graph, fresh zeros instead: their fill is a node of that graph,
    so every replay starts from zero whatever ran before (another graph captured on the same stream, an eager
    call), where a buffer first zeroed inside a capture would be zero only for the graph that recorded the fill.
    Made outside inference mode, so that an in-place reset works in and out of it."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        with torch.inference_mode(False):
            return torch.zeros(blocks, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else threading.get_ident()
    key = (str(device), stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < blocks:
        with _COUNTERS_LOCK, torch.inference_mode(False):
            counters = _COUNTERS.get(key)
            if counters is None or counters.numel() < blocks:
                counters = _COUNTERS[key] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
    return counters


def gemm_tiled(
    a_codes: Tensor,
    a_scales: Tensor,
    w_codes: Tensor,
    w_scales: Tensor,
    n: int,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
    split: int | None = None,
) -> Tensor:
    """One launch: of :func:`_decode_kernel` for 1..8 tokens (``N / 8`` programs times the K split), of
    :func:`_decode_mma_kernel` for 9..16 (``N / 32`` programs of 4 warps times the K split). ``a_codes``: int8
    ``[M, K]`` in the decode order (:func:`loopq.kernels.packing.deinterleave_groups`), ``a_scales`` fp32
    ``[M, K/32]``; the weight in the kernel layout (:func:`loopq.kernels.packing.tile_weight`) of ``n`` rows;
    ``bias`` fp32 ``[n]`` or None. ``split`` overrides :func:`k_split` (1, 2, 4, or 8 up to 8 tokens; tests and
    benchmarks)."""
    m, k = a_codes.shape
    if not 0 < m <= MAX_M:
        raise ValueError(f"the decode GEMM takes 1..{MAX_M} rows (got M={m}); use loopq.kernels.gemm_kernel")
    out = torch.empty(m, n, dtype=out_dtype, device=a_codes.device)
    if n == 0:
        return out
    launch = gemm_launch(m, n, w_codes.shape[0], k // GROUP_SIZE, bias is not None, a_codes.device, split)
    a_codes = a_codes.contiguous()
    a_codes, w_codes = (a_codes.view(torch.int32), w_codes.view(torch.int32)) if launch.words else (a_codes, w_codes)
    part, counters = (a_scales, w_codes) if launch.split == 1 else split_workspace(launch, m, n, a_codes.device)
    try:
        launch.kernel[launch.grid](
            a_codes, a_scales.contiguous(), w_codes, w_scales, out if bias is None else bias, out, part, counters,
            m, n, k // GROUP_SIZE, **launch.constexprs,
        )  # fmt: skip
    except BaseException:  # an interrupted interpreter launch (Ctrl-C) must not leave counts for the next call
        if launch.split > 1 and not a_codes.is_cuda:
            counters.zero_()
        raise
    return out


def split_workspace(launch: GemmLaunch, m: int, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The partial outputs and zeroed arrival counters (:func:`arrival_counters`) of a split ``launch``. Without a
    split the kernel reads neither: the callers pass stand-ins of the pointer types (an fp32 and an int32 tensor of
    the call), so that no call allocates them."""
    part = torch.empty(launch.split, m, n, dtype=torch.float32, device=device)
    return part, arrival_counters(device, launch.blocks)
