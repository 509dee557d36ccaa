"""Quantized KV-cache entries: keys and values stored as 8- or 4-bit codes in per-token groups of 32 channels.

Each cached key/value vector ``x`` of one token and one K/V head (``[..., head_dim]``) is cut into groups of 32
channels (the whole head where ``head_dim`` is not a multiple of 32), each stored as signed symmetric codes and one
scale - the paper's activation quantizer (:mod:`loopq.qspec`: ``s = max|x_g| / q_max``, ``code = round(x / s)``),
so ``|dequant(quant(x)) - x| <= s / 2`` element-wise. 4-bit codes are packed two per byte
(:func:`loopq.kernels.packing.pack_int4`); 8-bit codes take one byte. Scales keep the cache's dtype.

Per token, entry and head: ``head_dim * bits / 8`` bytes of codes + ``head_dim / 32`` scales, against
``head_dim * 2`` (bf16) or ``* 4`` (fp32) bytes; at ``head_dim = 32`` in fp32 that is 36 (8-bit) and 20 (4-bit)
against 128 bytes.

Why per-token groups and not KIVI's per-channel keys: a token's groups are final when it is written, so an entry
only ever grows by appending (and an early-exited token's deeper-loop slots are a copy of its exit loop's codes), with
no full-precision residual window to flush and re-quantize; and it is the granularity LoopQ already quantizes
activations with. KIVI's per-channel keys handle keys' outlier channels better at 2 bits; at 4 and 8 bits per-token
groups of 32 are the usual choice (e.g. QuaRot's KV cache, which groups per head the same way).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loopq.errors import LoopLMError
from loopq.kernels.packing import pack_int4_unchecked, unpack_int4
from loopq.qspec import dequantize_codes, quantize_codes

#: cache precisions: None / 16 keep the model's dtype; 8 and 4 store codes and per-group scales
KV_BITS = (None, 16, 8, 4)
#: channels per scale (the paper's activation group size)
KV_GROUP = 32


class QuantizedKV(NamedTuple):
    """One cache entry's codes ``[B, H, S, dh]`` (int8) or ``[B, H, S, dh / 2]`` (uint8, two 4-bit codes per byte)
    and scales ``[B, H, S, groups]``; every field is indexed by (batch, head, slot) first."""

    codes: Tensor
    scales: Tensor


def check_kv_bits(kv_bits: int | None) -> int | None:
    """The stored bit width (None = unquantized) of ``--kv_bits``; a bad value gives one line naming the flag."""
    if kv_bits not in KV_BITS or isinstance(kv_bits, bool):
        raise LoopLMError(f"--kv_bits must be 16 (no quantization), 8 or 4, got {kv_bits!r}")
    return None if kv_bits in (None, 16) else kv_bits


def kv_group_size(head_dim: int) -> int:
    """32 channels per scale, or one scale per head where ``head_dim`` is not a multiple of 32."""
    return KV_GROUP if head_dim % KV_GROUP == 0 else -1


def quantize_kv(x: Tensor, bits: int) -> QuantizedKV:
    """Codes and scales of keys or values ``x`` ``[B, H, S, dh]`` in per-token groups (see the module docstring)."""
    codes, scales = quantize_codes(x, bits, kv_group_size(x.shape[-1]))
    return QuantizedKV(pack_int4_unchecked(codes) if bits == 4 else codes, scales)


def dequantize_kv(q: QuantizedKV) -> Tensor:
    """``[B, H, S, dh]`` in the scales' dtype from :func:`quantize_kv`'s codes (uint8 codes are packed 4-bit)."""
    codes = unpack_int4(q.codes) if q.codes.dtype == torch.uint8 else q.codes
    group = codes.shape[-1] // q.scales.shape[-1]
    return dequantize_codes(codes, q.scales, group)


def kv_num_bytes(entry: Tensor | QuantizedKV) -> int:
    """Bytes an entry holds (codes + scales for a quantized one)."""
    parts = (entry,) if isinstance(entry, Tensor) else tuple(entry)
    return sum(x.numel() * x.element_size() for x in parts)
