"""Triton kernel #3: the decode GEMM, ``out[M, N] = A[M, K] W[N, K]^T`` for M <= 16 tokens, split over K.

At decode the GEMM is bound by reading the weight: 0.5625 bytes per weight (an int4 code plus its share of one fp16
scale per 32) against BF16's 2, so up to 3.56x a BF16 matmul if every SM streams weight bytes. The tile kernel
(:mod:`loopq.kernels.gemm_kernel`) gives a 2048-row linear only ``2048 / BLOCK_N`` programs, and pads M = 1 to a
16-row tensor-core dot. This kernel instead

* splits K: program ``(i, s)`` owns output columns ``[i BLOCK_N, (i + 1) BLOCK_N)`` and the groups
  ``[s G_s, (s + 1) G_s)``; :func:`decode_config` picks ``BLOCK_N`` and ``G_s`` per shape so that M = 1 launches
  about :data:`TARGET_PROGRAMS` programs, at most one split per iteration (Ouro-1.4B: 512 to 768, against 64 to 352
  for the tile kernel);
* reads ``BLOCK_G`` groups per iteration, ``BLOCK_G * 16`` contiguous bytes of each weight row (16-byte aligned:
  rows are ``K / 2`` bytes, a multiple of 16, so the loads compile to ``ld.global.v4``, or 16-byte ``cp.async``
  where the tensor-core loop is pipelined), with ``evict_first`` since each weight byte is read once;
* for M <= 4 multiplies on CUDA cores: activations and weights are packed alike (the low nibble holds the even k),
  so ``dot = sum_j lo(a_j) lo(w_j) + hi(a_j) hi(w_j)`` needs no re-interleaving, and no row is padded; for
  4 < M <= 16 it unpacks the groups to natural K order for a batched 16-row int8 tensor-core dot, one per group;
* writes fp32 partial sums ``[S, M, N]`` that :func:`_reduce_kernel` adds in split order (deterministic, no
  atomics) while casting to the output dtype; with one split the kernel writes the output itself.

Rounding contract (not bit-exact with :mod:`loopq.kernels.reference`, which adds the groups left to right): every
group's integer dot is exact; each term ``t_g = dot_g * (s_a s_w)`` is rounded twice and the G terms are summed in
fp32 in some bracketing (within an iteration, along a split, across splits), each term passing through at most
G - 1 additions. Hence, with ``u = 2^-24`` (half of fp32's epsilon) and ``gamma_n = n u / (1 - n u)``::

    |out - ref64| <= gamma_{G+1} * sum_k |a_k w_k s_a s_w|                      (fp32 output)

where ``ref64`` is the same codes and scales evaluated in float64 (:func:`loopq.kernels.reference.gemm_fp64`,
which also returns this bound). The tile kernel and the torch reference satisfy it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopq.kernels.gemm_kernel import _unpack_int4

#: the decode path serves calls of at most this many tokens (``loopq.kernels.ops`` dispatches on it)
MAX_M = 16
#: programs asked of a launch at M = 1: four per SM of an H100 SXM5 (132 SMs), to keep enough loads in flight
TARGET_PROGRAMS = 4 * 132
#: the largest ``BLOCK_M * BLOCK_N * BLOCK_G`` of the CUDA-core path: 32 int32 products per thread at 4 warps
_CUDA_CORE_PRODUCTS = 64 * 4


@dataclass(frozen=True)
class DecodeConfig:
    """One launch: tiles, groups per iteration (``block_g``) and per split, and how many splits."""

    block_m: int
    block_n: int
    block_g: int
    groups_per_split: int
    splits: int
    use_dot: bool
    num_warps: int = 4

    def grid(self, n: int) -> tuple[int, int]:
        return triton.cdiv(n, self.block_n), self.splits


def decode_config(m: int, n: int, k: int, target_programs: int = TARGET_PROGRAMS) -> DecodeConfig:
    """Tiles and split-K of an ``[m, k] x [n, k]^T`` decode GEMM (``1 <= m <= MAX_M``, ``k`` a multiple of 32).

    M <= 4 runs on CUDA cores with ``BLOCK_M * BLOCK_N * BLOCK_G = 256`` (registers); larger M on a 16-row tensor
    core dot, four groups per iteration, 32 columns per program. K is split into as many splits as bring the grid to
    ``target_programs`` (a power of two, each split a whole number of iterations), but the fp32 partial sums may
    not exceed a quarter of the weight's bytes (they are written and read back).
    """
    block_m = triton.next_power_of_2(m)
    use_dot = block_m > 4
    if use_dot:
        block_m, block_n, block_g = 16, 32, 4
    else:
        block_n = 64 if block_m == 1 else 32
        block_g = _CUDA_CORE_PRODUCTS // (block_m * block_n)
    groups = k // 32
    iterations = triton.cdiv(groups, block_g)
    n_blocks = triton.cdiv(n, block_n)
    max_by_traffic = max(1, (n * k * 9 // 16) // (32 * m * n))  # partials: 4 B written + read, <= 1/4
    splits = min(triton.next_power_of_2(triton.cdiv(target_programs, n_blocks)), iterations, max_by_traffic)
    groups_per_split = block_g * triton.cdiv(iterations, splits)
    splits = triton.cdiv(groups, groups_per_split)
    num_warps = 2 if block_m == 4 else 4  # 16 weight bytes per thread and iteration
    return DecodeConfig(block_m, block_n, block_g, groups_per_split, splits, use_dot, num_warps)


@triton.jit
def _decode_kernel(
    a_ptr,
    sa_ptr,
    w_ptr,
    sw_ptr,
    part_ptr,
    M,
    N,
    row_bytes,
    groups,
    groups_per_split,
    A_INT4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_mask, n_mask = rm < M, rn < N
    g_begin = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_begin + groups_per_split, groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g_begin, g_end, BLOCK_G):
        if USE_DOT:
            acc = _tensor_core_groups(
                acc, a_ptr, sa_ptr, w_ptr, sw_ptr, rm, rn, m_mask, n_mask, g, g_end, row_bytes, groups,
                A_INT4, BLOCK_M, BLOCK_N, BLOCK_G,
            )  # fmt: skip
        else:
            acc = _cuda_core_groups(
                acc, a_ptr, sa_ptr, w_ptr, sw_ptr, rm, rn, m_mask, n_mask, g, g_end, row_bytes, groups,
                A_INT4, BLOCK_M, BLOCK_N, BLOCK_G,
            )  # fmt: skip
    out = part_ptr + tl.program_id(1) * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(part_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _cuda_core_groups(
    acc, a_ptr, sa_ptr, w_ptr, sw_ptr, rm, rn, m_mask, n_mask, g, g_end, row_bytes, groups,
    A_INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """``acc += sum_g dot_g * (s_a s_w)`` over groups ``g .. g + BLOCK_G`` (those below ``g_end``): each row's
    ``BLOCK_G * 16`` weight bytes in one load, exact int32 group dots of the unpacked nibbles on CUDA cores."""
    rg = g + tl.arange(0, BLOCK_G)
    g_mask = rg < g_end
    kb = g * 16 + tl.arange(0, BLOCK_G * 16)  # byte j of a packed row holds k = 2j (low nibble), 2j + 1 (high)
    k_mask = (kb < g_end * 16)[None, :]
    w = tl.load(
        w_ptr + rn[:, None] * row_bytes + kb[None, :],
        mask=n_mask[:, None] & k_mask,
        other=0,
        eviction_policy="evict_first",
    )
    a_mask = m_mask[:, None] & k_mask
    if A_INT4:
        a_lo, a_hi = _unpack_int4(tl.load(a_ptr + rm[:, None] * row_bytes + kb[None, :], mask=a_mask, other=0))
    else:
        even = a_ptr + rm[:, None] * (2 * row_bytes) + 2 * kb[None, :]
        a_lo, a_hi = tl.load(even, mask=a_mask, other=0), tl.load(even + 1, mask=a_mask, other=0)
    w_lo, w_hi = _unpack_int4(w)
    a_lo, a_hi = a_lo.to(tl.int32)[:, None, :], a_hi.to(tl.int32)[:, None, :]
    prod = a_lo * w_lo.to(tl.int32)[None, :, :] + a_hi * w_hi.to(tl.int32)[None, :, :]
    dots = tl.sum(tl.reshape(prod, [BLOCK_M, BLOCK_N, BLOCK_G, 16]), axis=3)
    sa = tl.load(sa_ptr + rm[:, None] * groups + rg[None, :], mask=m_mask[:, None] & g_mask[None, :], other=0.0)
    sw = tl.load(sw_ptr + rn[:, None] * groups + rg[None, :], mask=n_mask[:, None] & g_mask[None, :], other=0.0)
    scale = sa.to(tl.float32)[:, None, :] * sw.to(tl.float32)[None, :, :]
    return acc + tl.sum(dots.to(tl.float32) * scale, axis=2)


@triton.jit
def _tensor_core_groups(
    acc, a_ptr, sa_ptr, w_ptr, sw_ptr, rm, rn, m_mask, n_mask, g, g_end, row_bytes, groups,
    A_INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """The same on the tensor cores: ``[BLOCK_G, BLOCK_N, 16]`` weight bytes in one load, unpacked to natural K
    order, one batched int8 dot ``[BLOCK_G, BLOCK_M, 32] x [BLOCK_G, 32, BLOCK_N]`` (a depth-32 dot per group)."""
    rg = (g + tl.arange(0, BLOCK_G))[:, None, None]
    g_mask = rg < g_end
    kb = rg * 16 + tl.arange(0, 16)[None, None, :]
    w = tl.load(
        w_ptr + rn[None, :, None] * row_bytes + kb,
        mask=n_mask[None, :, None] & g_mask,
        other=0,
        eviction_policy="evict_first",
    )
    a_mask = m_mask[None, :, None] & g_mask
    if A_INT4:
        a = _natural_order(tl.load(a_ptr + rm[None, :, None] * row_bytes + kb, mask=a_mask, other=0), BLOCK_G, BLOCK_M)
    else:
        a_ptrs = a_ptr + rm[None, :, None] * (2 * row_bytes) + rg * 32 + tl.arange(0, 32)[None, None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0)
    w = tl.permute(_natural_order(w, BLOCK_G, BLOCK_N), (0, 2, 1))
    dots = tl.dot(a, w, out_dtype=tl.int32)
    sa = tl.load(sa_ptr + rm[None, :, None] * groups + rg, mask=a_mask, other=0.0).to(tl.float32)
    sw = tl.load(sw_ptr + rn[None, None, :] * groups + rg, mask=n_mask[None, None, :] & g_mask, other=0.0)
    return acc + tl.sum(dots.to(tl.float32) * (sa * sw.to(tl.float32)), axis=0)


@triton.jit
def _natural_order(packed, BLOCK_G: tl.constexpr, ROWS: tl.constexpr):
    """``[BLOCK_G, ROWS, 16]`` packed bytes -> ``[BLOCK_G, ROWS, 32]`` int8 codes in natural K order."""
    even, odd = _unpack_int4(packed)
    return tl.reshape(tl.join(even, odd), [BLOCK_G, ROWS, 32])


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``out = sum_s part[s]`` in split order (fixed, so repeated calls agree bit for bit), cast to ``out``'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc = acc + tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm(
    a: Tensor,
    a_scales: Tensor,
    w_packed: Tensor,
    w_scales: Tensor,
    out_dtype: torch.dtype,
    a_int4: bool,
    config: DecodeConfig | None = None,
) -> Tensor:
    """Launch :func:`_decode_kernel` (+ :func:`_reduce_kernel` when K is split); arguments validated by ``ops``.
    ``config`` (default :func:`decode_config`) lets tests force splits the small shapes would not get."""
    m, n, row_bytes = a.shape[0], w_packed.shape[0], w_packed.shape[1]
    if not 0 < m <= MAX_M:
        raise ValueError(f"the decode GEMM takes 1..{MAX_M} rows (got M={m}); use loopq.kernels.gemm_kernel")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if n == 0:
        return out
    cfg = config or decode_config(m, n, 2 * row_bytes)
    part = out if cfg.splits == 1 else torch.empty(cfg.splits, m, n, dtype=torch.float32, device=a.device)
    _decode_kernel[cfg.grid(n)](
        a.contiguous(),
        a_scales.contiguous(),
        w_packed.contiguous(),
        w_scales.contiguous(),
        part,
        m,
        n,
        row_bytes,
        w_scales.shape[1],
        cfg.groups_per_split,
        A_INT4=a_int4,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_G=cfg.block_g,
        USE_DOT=cfg.use_dot,
        num_warps=cfg.num_warps,
        enable_fp_fusion=False,
    )
    if cfg.splits > 1:
        block = 1024
        _reduce_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLITS=cfg.splits, BLOCK=block, num_warps=4)
    return out
