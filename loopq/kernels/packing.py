"""The packed int4 format: two codes per byte along K, plus offline weight quantization.

Byte ``j`` of a row holds the code of ``k = 2j`` in its low nibble and of ``k = 2j + 1`` in its high nibble, both
in two's complement (-8..7), so ``byte = (c[2j] & 0xF) | (c[2j+1] & 0xF) << 4`` and K keeps its natural order.
Unpacking sign-extends a nibble ``n`` with ``(n ^ 8) - 8``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

from loopq.qspec import KERNEL_WEIGHT_BITS, quantize_codes

#: the 32-element K groups that share one scale (one int8 tensor-core dot of depth 32 on GPU)
GROUP_SIZE = 32
INT4_MIN, INT4_MAX = -8, 7


def pack_int4(codes: Tensor) -> Tensor:
    """int4 codes stored as int8 ``[..., K]`` (values in -8..7, K even) -> uint8 ``[..., K/2]``."""
    if codes.dtype != torch.int8:
        raise ValueError(f"pack_int4: codes must be int8 (got {codes.dtype}); convert with codes.to(torch.int8)")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4: the last dimension of codes ({codes.shape[-1]}) must be even")
    if codes.numel() and (int(codes.min()) < INT4_MIN or int(codes.max()) > INT4_MAX):
        raise ValueError(f"pack_int4: codes must lie in [{INT4_MIN}, {INT4_MAX}]; quantize with bits=4 first")
    return pack_int4_unchecked(codes)


def pack_int4_unchecked(codes: Tensor) -> Tensor:
    """:func:`pack_int4` without the range check (for codes that are in range by construction)."""
    low = (codes[..., 0::2] & 0xF).to(torch.uint8)
    high = (codes[..., 1::2] & 0xF).to(torch.uint8)
    return low | (high << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 ``[..., K/2]`` -> sign-extended int8 codes ``[..., K]`` (inverse of :func:`pack_int4`)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4: packed must be uint8 (got {packed.dtype})")
    low = ((packed & 0xF).to(torch.int8) ^ 8) - 8
    high = ((packed >> 4).to(torch.int8) ^ 8) - 8
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize_weight(
    w: Tensor, clip_ratio: Tensor | float = 1.0, bits: int = 4, group_size: int = GROUP_SIZE
) -> tuple[Tensor, Tensor]:
    """Offline int4 weight quantization ``w [N, K] -> (packed uint8 [N, K/2], scales float16 [N, K/group_size])``.

    Codes are exactly :func:`loopq.qspec.quantize_codes` of ``w`` in fp32 with the per-row
    ``clip_ratio`` (``[N]`` or a scalar), so they match the fake-quant student bit for bit. Only the stored
    scale is rounded to float16 (relative error <= 2^-11; groups with absmax below ~4e-4 get subnormal scales).
    """
    if bits != KERNEL_WEIGHT_BITS:
        raise ValueError(f"quantize_weight: bits={bits} is not supported; weights are packed as int4 (bits=4)")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight: w must be a floating [N, K] matrix (got {w.dtype} {tuple(w.shape)})")
    n, k = w.shape
    if group_size < 2 or k % group_size or group_size % 2:
        raise ValueError(f"quantize_weight: group_size={group_size} must be even and divide K={k}")
    clip = torch.as_tensor(clip_ratio, dtype=torch.float32, device=w.device)
    if clip.numel() not in (1, n):
        raise ValueError(f"quantize_weight: clip_ratio must be a scalar or have N={n} entries (got {clip.numel()})")
    codes, scales = quantize_codes(w.float(), bits, group_size, clip.reshape(-1, 1, 1) if clip.numel() > 1 else clip)
    return pack_int4_unchecked(codes), scales.to(torch.float16)


# ------------------------------------------------------------------------------------------- the kernel layout
#: rows of a weight tile: the decode GEMM's program owns TILE_ROWS output rows (:mod:`loopq.kernels.decode_kernel`)
TILE_ROWS = 8
#: K lanes of a tile: a program's threads are TILE_ROWS x TILE_LANES, lane j takes every TILE_LANES-th group
TILE_LANES = 8
#: groups one thread reads per chunk (one 16-byte load of fp16 scales): a chunk is TILE_LANES * SCALE_RUN groups
SCALE_RUN = 8
CHUNK_GROUPS = TILE_LANES * SCALE_RUN
#: xor of a :func:`pack_int4` byte into the kernel layout's offset binary nibbles (and back)
OFFSET_BYTE = 0x88


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``) in plain integer arithmetic: ``triton.next_power_of_2`` is a
    ``ConstexprFunction`` in Triton 3.9, whose host-side call costs microseconds, at every launch."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, the host-side ``triton.cdiv`` (see :func:`next_pow2`)."""
    return -(-a // b)


def tiled_shapes(n: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of :func:`tile_weight`'s codes ``[N/8, G/8, 8, 8, 16]`` (uint8) and scales ``[N/8, G/64, 8, 8, 8]``
    (fp16), N rounded up to 8 rows, the groups G = K/32 to 8 (codes) and 64 (scales) with zero padding."""
    tiles, groups = -(-n // TILE_ROWS), k // GROUP_SIZE
    code_blocks, chunks = -(-groups // TILE_LANES), -(-groups // CHUNK_GROUPS)
    return (tiles, code_blocks, TILE_ROWS, TILE_LANES, GROUP_SIZE // 2), (
        tiles,
        chunks,
        TILE_ROWS,
        TILE_LANES,
        SCALE_RUN,
    )


def tile_weight(packed: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """Packed weights ``[N, K/2]`` and scales ``[N, K/32]`` -> the kernel layout (export format v3).

    Codes: byte block ``[t, b, r, j]`` (16 bytes: one group, nibbles ordered as in :func:`pack_int4`) is row
    ``8 t + r``, group ``8 b + j``, each nibble in offset binary (``code + 8``, 0..15: the byte of
    :func:`pack_int4` xor 0x88, which the decode GEMM sign-extends with one add and one xor per 4-byte word). The
    8 x 8 groups of a block row lie in 1 KB, read by the decode GEMM's 64 threads ``(r, j)`` with one 16-byte load
    each. Scales: ``[t, c, r, j, i]`` is row ``8 t + r``, group ``64 c + 8 i + j``: the 8 scales thread ``(r, j)``
    needs in chunk ``c`` are one 16-byte load.
    A pure permutation plus zero padding: :func:`untile_weight` inverts it exactly."""
    n, half_k = packed.shape
    groups = scales.shape[1]
    code_shape, scale_shape = tiled_shapes(n, 2 * half_k)
    tiles, blocks, chunks = code_shape[0], code_shape[1], scale_shape[1]
    codes = packed.new_full((tiles * TILE_ROWS, blocks * TILE_LANES * GROUP_SIZE // 2), OFFSET_BYTE)  # code 0
    codes[:n, :half_k] = packed ^ OFFSET_BYTE
    codes = codes.reshape(tiles, TILE_ROWS, blocks, TILE_LANES, GROUP_SIZE // 2).permute(0, 2, 1, 3, 4)
    s = scales.new_zeros(tiles * TILE_ROWS, chunks * CHUNK_GROUPS)
    s[:n, :groups] = scales
    s = s.reshape(tiles, TILE_ROWS, chunks, SCALE_RUN, TILE_LANES).permute(0, 2, 1, 4, 3)
    return codes.contiguous(), s.contiguous()


def untile_weight(codes: Tensor, scales: Tensor, n: int, k: int) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`tile_weight`: ``(packed [N, K/2], scales [N, K/32])``."""
    tiles, blocks = codes.shape[:2]
    chunks = scales.shape[1]
    packed = codes.permute(0, 2, 1, 3, 4).reshape(tiles * TILE_ROWS, blocks * TILE_LANES * GROUP_SIZE // 2)
    s = scales.permute(0, 2, 1, 4, 3).reshape(tiles * TILE_ROWS, chunks * CHUNK_GROUPS)
    return packed[:n, : k // 2] ^ OFFSET_BYTE, s[:n, : k // GROUP_SIZE]


def deinterleave_groups(codes: Tensor) -> Tensor:
    """int8 codes ``[M, K]`` -> the decode GEMM's activation order: per 32-group its 16 even k, then its 16 odd k
    (the order of the low and high nibbles of four weight bytes, so that one 4-byte word of each side meets)."""
    m, k = codes.shape
    return codes.reshape(m, k // GROUP_SIZE, GROUP_SIZE // 2, 2).transpose(2, 3).reshape(m, k)


def interleave_groups(codes: Tensor) -> Tensor:
    """The inverse of :func:`deinterleave_groups`."""
    m, k = codes.shape
    return codes.reshape(m, k // GROUP_SIZE, 2, GROUP_SIZE // 2).transpose(2, 3).reshape(m, k)


def launch_device(x: Tensor) -> AbstractContextManager[object]:
    """A Triton kernel launches on the current CUDA device, whatever its tensors' device: for a tensor on another
    (``cuda:1`` while the current one is 0) the context that makes its device current; else one that does nothing
    (the common case costs one ``current_device`` call)."""
    if x.is_cuda and x.device.index is not None and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return nullcontext()
