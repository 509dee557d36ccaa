"""Triton kernel #2: the prefill W4A4 / W4A8 GEMM ``out[M, N] = A[M, K] W[N, K]^T`` with per-group scales.

Calls of more than 16 tokens (:mod:`loopq.kernels.ops`; M <= 16 runs :mod:`loopq.kernels.decode_kernel`). Prefill
is compute-bound, so the kernel is organised around the tensor cores:

* one program owns a ``BLOCK_M x BLOCK_N`` output tile (:func:`prefill_config`: 64 x 128 with 8 warps where
  the grid still fills the GPU, 64 x 64 otherwise), programs are numbered in groups of ``GROUP_M`` tile rows
  (grouped rasterisation: consecutive programs share the same weight columns, which stay in L2);
* each K iteration covers ``BLOCK_G`` 32-groups (``BLOCK_K = 32 BLOCK_G``; :func:`block_g_for` makes it divide
  K, so no load of the loop is masked along K and the row strides ``16 G`` / ``32 G`` bytes let the compiler copy
  16 bytes per thread): the iteration's scales
  are loaded as one short contiguous vector per row (``[BLOCK_M, BLOCK_G]``, ``[BLOCK_N, BLOCK_G]``) and split
  into columns in registers; a statically unrolled loop issues one int8 ``tl.dot`` of depth 32 per group with
  int32 accumulation (exact: |sum| <= 32 * 128 * 8) and rescales it once, vectorised over the tile,
  ``acc += (dot * s_a[m, g]) * s_w[n, g]``; the K loop is software pipelined over ``num_stages`` iterations
  (``cp.async`` loads in flight while the tensor cores work). On sm_90 the dots lower to ``wgmma`` (warp-group
  MMA, the A operand from registers, W from shared memory), on sm_80 to ``mma.sync``;
* the int4 nibbles are unpacked to int8 (sign extension ``(n ^ 8) - 8``) and put back in natural K order with
  ``tl.join`` + ``tl.reshape``, which only pairs the two nibbles of a byte in the same thread before the operand
  is written to shared memory for the tensor cores. The stored weight layout is unchanged (export format v2).

What the compiled loop does not overlap (``docs/benchmarks.md``, kernel section): on sm_90 each group's ``wgmma`` is
followed by ``wgmma.wait_group 0``. Triton keeps a warp-group dot in flight across iterations only when its result is
consumed by nothing but the next dot's accumulator and its shared-memory operand comes straight from the pipelined
copies; a per-group rescale and an operand unpacked in registers break both, so the overlap of the tensor cores
with the CUDA-core rescale comes from the other warp group and the second program on the SM (128 registers:
two programs of 8 warps per SM). The scale vectors (4 to 8 bytes per row) are too narrow for ``cp.async`` and are
plain loads at the top of the iteration.

Rounding contract (the decode kernel's, :mod:`loopq.kernels.decode_kernel`): every group dot is an exact integer
(and exact in fp32, below 2^24); the term ``(dot s_a) s_w`` is rounded at most twice (with FMA contraction, which
the launch enables, once: ``fma(dot s_a, s_w, acc)`` rounds the product and the sum together), and the G terms are
added left to right, each through at most G - 1 additions; so with ``u = 2^-24``, ``gamma_n = n u / (1 - n u)``::

    |out - ref64| <= gamma_{G+1} * sum_k |a_k w_k s_a s_w|                      (fp32 output)

``ref64`` being the float64 value of the same codes and scales (:func:`loopq.kernels.reference.gemm_fp64`, which
returns this bound). The output is no longer bit-identical with the torch backend (which never contracts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

#: programs one wave of an H100 SXM5 runs (132 SMs): a tile size is kept only while the grid fills it
SMS = 132


@dataclass(frozen=True)
class PrefillConfig:
    """One launch of :func:`_gemm_kernel`: tile, warps, pipeline depth, rasterisation group."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_g: int  # 32-groups per K iteration (1, 2 or 4; at most: see block_g_for)
    group_m: int = 8

    def programs(self, m: int, n: int) -> int:
        return triton.cdiv(m, self.block_m) * triton.cdiv(n, self.block_n)


#: tiles from the largest (most reuse per byte loaded) to the smallest, each checked ahead of time for sm_80 and
#: sm_90 under the pinned Triton and the GPU image's 3.6 (``scripts/ptx_stats.py --kernels prefill``, asserted by
#: ``tests/kernels/test_ptx_stats.py``): at most 168 registers per thread (76 to 148 measured), no spills, and no
#: ``cp.async.wait_group 0`` in the K loop (a depth of 4 stages keeps 3 iterations of loads in flight; 2 stages
#: wait for depth 0). 64 x 256 (255 registers with 8 warps, spills on sm_80 with 16) and 128 x 128 (spills) are not
#: offered; 64 x 128 at 128 registers runs two programs per SM, the occupancy of one 64 x 256 program of 16 warps.
CANDIDATES: tuple[PrefillConfig, ...] = (
    PrefillConfig(64, 128, 8, 4, 2),
    PrefillConfig(64, 64, 8, 4, 1),
)


def block_g_for(block_g: int, groups: int) -> int:
    """The groups one K iteration covers: the largest power of two <= ``block_g`` that divides ``groups``, so the
    K loop needs no mask (Ouro's K = 2048 and 5632 have 64 and 176 groups: the configured 2 or 4)."""
    while groups % block_g:
        block_g //= 2
    return block_g


def m_bucket(m: int) -> int:
    """Calls are configured per power-of-two bucket of M (at least 32), so one config serves a range of M."""
    return max(32, triton.next_power_of_2(m))


@lru_cache(maxsize=256)
def _config_for_bucket(bucket: int, n: int) -> PrefillConfig:
    for cfg in CANDIDATES:
        if cfg.programs(bucket, n) >= SMS:
            return cfg
    return CANDIDATES[-1]


def prefill_config(m: int, n: int) -> PrefillConfig:
    """The largest candidate tile whose grid still has at least one program per SM at M's bucket (else the
    smallest): M = 4096 gets 64 x 128, M = 256 on N = 2048 gets 64 x 64 (128 programs)."""
    return _config_for_bucket(m_bucket(m), n)


@triton.jit
def _unpack_int4(packed):
    """uint8 bytes -> (low, high) sign-extended int8 nibbles: codes of k = 2j and k = 2j + 1."""
    v = packed.to(tl.int32)
    return (((v & 0xF) ^ 8) - 8).to(tl.int8), (((v >> 4) ^ 8) - 8).to(tl.int8)


@triton.jit
def _interleave(even, odd, ROWS: tl.constexpr):
    """``[ROWS, 16]`` even-k and odd-k codes -> ``[ROWS, 32]`` in natural K order."""
    return tl.reshape(tl.join(even, odd), [ROWS, 32])


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped rasterisation: program ids walk ``GROUP_M`` tile rows down one tile column, then the next column."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _gemm_kernel(
    a_ptr,
    sa_ptr,
    w_ptr,
    sw_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    G,
    A_INT4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # the row strides derive from G (K = 32 G): divisible by 16 when G is (Ouro: 64, 176 groups), so the
    # compiler sees 16-byte aligned rows and copies each thread's codes 16 bytes at a time
    groups = G
    row_w = G * 16  # bytes per weight row
    row_a = G * 16 if A_INT4 else G * 32  # bytes per activation row
    # 64-bit scalar bases (M * K may exceed 2^31), 32-bit offsets inside the tile: half the registers
    m0, n0 = pid_m.to(tl.int64) * BLOCK_M, pid_n.to(tl.int64) * BLOCK_N
    a_base, sa_base = a_ptr + m0 * row_a, sa_ptr + m0 * groups
    w_base, sw_base = w_ptr + n0 * row_w, sw_ptr + n0 * groups
    rm, rn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M - pid_m * BLOCK_M, rn < N - pid_n * BLOCK_N  # 32-bit compares
    gs = tl.arange(0, BLOCK_G)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, groups, BLOCK_G):  # BLOCK_G divides groups (the launcher's choice): no mask along K
        # the iteration's scales, one short contiguous vector per row, split into groups in registers
        sa_tile = tl.load(sa_base + rm[:, None] * groups + (g0 + gs)[None, :], mask=m_mask[:, None], other=0.0)
        sw_tile = tl.load(sw_base + rn[:, None] * groups + (g0 + gs)[None, :], mask=n_mask[:, None], other=0.0)
        for i in tl.static_range(BLOCK_G):
            g = g0 + i
            w_off = rn[:, None] * row_w + (g * 16 + tl.arange(0, 16))[None, :]
            w_even, w_odd = _unpack_int4(tl.load(w_base + w_off, mask=n_mask[:, None]))
            if A_INT4:
                a_off = rm[:, None] * row_a + (g * 16 + tl.arange(0, 16))[None, :]
                a_even, a_odd = _unpack_int4(tl.load(a_base + a_off, mask=m_mask[:, None]))
                a = _interleave(a_even, a_odd, BLOCK_M)
            else:
                a = tl.load(a_base + rm[:, None] * row_a + (g * 32 + tl.arange(0, 32))[None, :], mask=m_mask[:, None])
            dot = tl.dot(a, tl.trans(_interleave(w_even, w_odd, BLOCK_N)), out_dtype=tl.int32)
            sa = _column(sa_tile, i, BLOCK_G).to(tl.float32)
            sw = _column(sw_tile, i, BLOCK_G).to(tl.float32)
            acc += (dot.to(tl.float32) * sa[:, None]) * sw[None, :]  # no [BLOCK_M, BLOCK_N] scale temporary
    if HAS_BIAS:  # fp32, as the torch path adds it before the cast
        acc += tl.load(bias_ptr + n0 + rn, mask=n_mask, other=0.0)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    out_off = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out_ptr + m0 * N + n0 + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _column(tile, i: tl.constexpr, COLS: tl.constexpr):
    """Column ``i`` of a ``[rows, COLS]`` tile (``COLS`` = 1, 2 or 4) by ``tl.reshape`` / ``tl.split``: no
    arithmetic, no shuffles across threads once the few columns sit in one thread. Column ``2 a + b`` of
    ``[rows, 2, 2]`` is (a, b)."""
    if COLS == 1:
        col = tl.reshape(tile, [tile.shape[0]])
    elif COLS == 2:
        c0, c1 = tl.split(tile)
        col = c0 if i == 0 else c1
    else:
        b0, b1 = tl.split(tl.reshape(tile, [tile.shape[0], 2, 2]))  # b = i % 2
        c0, c1 = tl.split(b0 if i % 2 == 0 else b1)  # a = i // 2
        col = c0 if i // 2 == 0 else c1
    return col


def gemm(
    a: Tensor,
    a_scales: Tensor,
    w_packed: Tensor,
    w_scales: Tensor,
    out_dtype: torch.dtype,
    a_int4: bool,
    config: PrefillConfig | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """Launch :func:`_gemm_kernel` (arguments already validated by :mod:`loopq.kernels.ops`); ``config`` overrides
    :func:`prefill_config` (the tests force small tiles). ``bias`` (fp32 ``[N]``) is added to the fp32 sums before
    the cast to ``out_dtype``, as the torch path adds it."""
    m, n = a.shape[0], w_packed.shape[0]
    k = 2 * w_packed.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    cfg = config or prefill_config(m, n)
    _gemm_kernel[(cfg.programs(m, n),)](
        a.contiguous(),
        a_scales.contiguous(),
        w_packed.contiguous(),
        w_scales.contiguous(),
        a_scales if bias is None else bias,  # fp32, unread without a bias
        out,
        m,
        n,
        k // 32,
        A_INT4=a_int4,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_G=block_g_for(cfg.block_g, k // 32),
        GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=True,  # acc + (dot s_a) s_w as one FMA: fewer roundings, inside the bound
    )
    return out


# --- the 16-bit scheme: per-group scales folded into the operands ---------------------------------------------------
#
# Why a second prefill scheme. The integer kernel above rescales its accumulator after every 32-deep group: with
# scales on both operands that is 3 CUDA-core instructions per accumulator element per group (conversion, two
# products), against which no schedule gets past ~0.67x of a bf16 GEMM on an H100 (docs/benchmarks.md, "what bounds
# the prefill"); the third GPU run measured 0.20x at M = 4096, the kernel issue-bound at ~8x its int8 MMA time. Folding
# the scales into the operands instead costs per *operand* element, once per tile, not per accumulator element per
# group: ``a_k s_a`` arrives from the quantizer as a 16-bit value (``quantize_kernel`` with ``values``), and the
# weight tile is dequantized in registers, ``bf16(code * s_w)``, before one ``tl.dot`` per K step on the 16-bit
# tensor cores with an fp32 accumulator that the MMAs chain. On an H100 bf16 runs at half the int8 rate, but the
# per-group work shrinks from ``BLOCK_M x BLOCK_N`` to ``BLOCK_N`` elements per group: compiled for sm_90 (Triton
# 3.9) the 128 x 128 tile issues 241 SASS instructions per 64-deep iteration and thread, 8 warps x 241 / 4
# schedulers = 482 clocks against 512 of bf16 MMA time for its 128 x 128 x 64 products, at 128 registers (two
# programs per SM): the loop should keep the tensor cores' pace, where the integer tile issues 4x its bf16 MMA time
# (a prediction from the compiled code, ``scripts/ptx_stats.py``, ``tests/kernels/test_ptx_stats.py``, until a GPU
# times it). Hopper has no int4 tensor cores, so 4-bit operands cannot be faster than
# this; the 4-bit activation codes still serve decode, where the GEMM reads them (:mod:`decode_kernel`).
#
# Rounding: each operand is the fp32 product ``code * scale`` rounded once to the 16-bit dtype (an activation's
# product was rounded to fp32 first, as the student's fake quantization computes it before autocast casts it to
# bf16: the operands are the student's own bf16 operands), products exact in fp32, sums in the tensor cores' fp32
# (:data:`loopq.kernels.quantize_kernel.ACC_UNIT` per addition). Both operands are thus fixed numbers before any sum
# (``a~`` the given activation values, ``w~ = dtype(fp32(c s_w))``, finite: a value past the 16-bit dtype's range is
# inf - bf16 has fp32's range; an explicit fp16 choice can overflow), and with the bias added to the fp32 sum::
#
#     |out - (sum_k a~_k w~_k + b)| <= gamma'_{K+1} * (sum_k |a~_k w~_k| + |b|)        (fp32 output)
#
# with ``gamma'_n = n 2^-23 / (1 - n 2^-23)`` (:func:`values_bound`).


#: tiles of :func:`_gemm_values_kernel`, largest first, per architecture (``PrefillConfig.block_g`` = 32-groups per
#: K step): compiled ahead of time by ``scripts/ptx_stats.py --kernels values`` and held by
#: ``tests/kernels/test_ptx_stats.py`` to no spills and no ``cp.async.wait_group 0`` in the K loop. sm_90: 128 x 128
#: with 8 warps at 128 registers (two programs per SM); sm_80 (``mma.sync``, more registers per tile): 64 x 128 with
#: 4 warps (168 under Triton 3.9, 240 under the GPU image's 3.6: two programs of 128 threads per SM either way). The
#: last of each is the small grid's.
VALUES_CANDIDATES: dict[int, tuple[PrefillConfig, ...]] = {
    90: (PrefillConfig(128, 128, 8, 3, 2), PrefillConfig(64, 64, 4, 4, 2)),
    80: (PrefillConfig(64, 128, 4, 4, 2), PrefillConfig(64, 64, 4, 4, 2)),
}


def values_config(m: int, n: int, arch: int) -> PrefillConfig:
    """The largest tile of ``arch``'s table whose grid has a program per SM at M's bucket, else the smallest: Hopper
    (9.x) takes sm_90's (``wgmma``), every other architecture sm_80's smaller tiles (``mma.sync`` and the like)."""
    table = VALUES_CANDIDATES[90 if arch // 10 == 9 else 80]
    bucket = m_bucket(m)
    return next((cfg for cfg in table if cfg.programs(bucket, n) >= SMS), table[-1])


def values_bound(
    a_values: Tensor, w_codes: Tensor, w_scales: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(ref64, bound)`` of :func:`gemm_values` (on the CPU): the float64 value of the given 16-bit activation values
    times the kernel's weight operand ``dtype(fp32(code * s_w))`` (int8-stored codes, ``a_values``' dtype), plus the
    bias, and the bound above on the fp32 output's distance from it."""
    groups = w_scales.shape[1]
    w = (w_codes.float().reshape(w_codes.shape[0], groups, -1) * w_scales.float()[:, :, None]).flatten(1)
    w = w.to(a_values.dtype).double()
    a = a_values.double()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    nu = (a.shape[1] + 1) * 2.0**-23
    return a @ w.T + b, nu / (1 - nu) * (a.abs() @ w.abs().T + b.abs())


@triton.jit
def _gemm_values_kernel(
    a_ptr,
    w_ptr,
    sw_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    G,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):
    """``out = A W^T`` for 16-bit activation values ``A [M, K]`` and int4 weight codes (natural layout) with fp16
    group scales: per K step of ``32 BLOCK_G`` the weight tile is dequantized in registers to A's dtype and one
    ``tl.dot`` adds the step to the fp32 accumulator."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    BLOCK_K: tl.constexpr = 32 * BLOCK_G
    row_w = G * 16  # bytes per weight row (16-byte aligned when G is even: Ouro's 64 and 176 groups)
    row_a = G * 32  # elements per activation row
    m0, n0 = pid_m.to(tl.int64) * BLOCK_M, pid_n.to(tl.int64) * BLOCK_N
    a_base, w_base, sw_base = a_ptr + m0 * row_a, w_ptr + n0 * row_w, sw_ptr + n0 * G
    rm, rn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M - pid_m * BLOCK_M, rn < N - pid_n * BLOCK_N
    gs, ks, bs = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):  # BLOCK_G divides G (the launcher's choice): no mask along K
        a = tl.load(a_base + rm[:, None] * row_a + (g0 * 32 + ks)[None, :], mask=m_mask[:, None], other=0.0)
        sw = tl.load(sw_base + rn[:, None] * G + (g0 + gs)[None, :], mask=n_mask[:, None], other=0.0)
        even, odd = _unpack_int4(tl.load(w_base + rn[:, None] * row_w + (g0 * 16 + bs)[None, :], mask=n_mask[:, None]))
        codes = tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_G, 32]).to(tl.float32)  # natural K order
        w = tl.reshape(codes * sw.to(tl.float32)[:, :, None], [BLOCK_N, BLOCK_K]).to(a.dtype)  # exact, rounded once
        acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:  # fp32, as the torch path adds it before the cast
        acc += tl.load(bias_ptr + n0 + rn, mask=n_mask, other=0.0)[None, :]
    out_off = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out_ptr + m0 * N + n0 + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemm_values(
    a_values: Tensor,
    w_packed: Tensor,
    w_scales: Tensor,
    out_dtype: torch.dtype,
    config: PrefillConfig | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """Launch :func:`_gemm_values_kernel` on 16-bit activation values ``[M, K]`` (``quantize_kernel`` with
    ``values``), packed int4 weight codes ``[N, K / 2]`` and fp16 scales ``[N, K / 32]`` (arguments validated by
    :mod:`loopq.kernels.ops`); ``config`` overrides :func:`values_config` (the tests force small tiles), ``bias``
    (fp32 ``[N]``) is added to the fp32 sums before the cast."""
    m, n = a_values.shape[0], w_packed.shape[0]
    groups = a_values.shape[1] // 32
    out = torch.empty(m, n, dtype=out_dtype, device=a_values.device)
    if m == 0 or n == 0:
        return out
    arch = torch.cuda.get_device_capability(a_values.device)[0] * 10 if a_values.is_cuda else 90
    cfg = config or values_config(m, n, arch)
    _gemm_values_kernel[(cfg.programs(m, n),)](
        a_values.contiguous(),
        w_packed.contiguous(),
        w_scales.contiguous(),
        w_scales if bias is None else bias,  # unread without a bias
        out,
        m,
        n,
        groups,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_G=block_g_for(cfg.block_g, groups),
        GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
