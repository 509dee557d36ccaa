"""The packed int4 format: two codes per byte along K, plus offline weight quantization.

Byte ``j`` of a row holds the code of ``k = 2j`` in its low nibble and of ``k = 2j + 1`` in its high nibble, both
in two's complement (-8..7), so ``byte = (c[2j] & 0xF) | (c[2j+1] & 0xF) << 4`` and K keeps its natural order.
Unpacking sign-extends a nibble ``n`` with ``(n ^ 8) - 8``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopq.qspec import quantize_codes

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
    if bits != 4:
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
