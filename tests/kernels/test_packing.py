"""The packed int4 layout and offline weight quantization."""

import pytest
import torch

from loopq.kernels import pack_int4, quantize_weight, unpack_int4
from loopq.qspec import quantize_codes


def test_pack_layout_by_hand():
    codes = torch.tensor([[0, 1, -1, 7, -8, 3, 2, -2]], dtype=torch.int8)
    # low nibble = even k, high nibble = odd k, two's complement nibbles
    assert pack_int4(codes).tolist() == [[0x10, 0x7F, 0x38, 0xE2]]


def test_pack_unpack_round_trip_covers_full_range():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (3, 5, 64), generator=gen, dtype=torch.int8)
    codes[0, 0, :16] = torch.arange(-8, 8, dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    assert torch.equal(unpack_int4(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)


@pytest.mark.parametrize("clip", [1.0, 0.8, "per_row"])
def test_quantize_weight_codes_match_primitives(clip):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 160, generator=gen)
    ratio = 0.6 + 0.4 * torch.rand(48, generator=gen) if clip == "per_row" else clip
    packed, scales = quantize_weight(w, ratio)
    expected_ratio = ratio.reshape(-1, 1, 1) if clip == "per_row" else ratio
    codes, ref_scales = quantize_codes(w, 4, 32, expected_ratio)
    assert torch.equal(unpack_int4(packed), codes)
    assert scales.dtype == torch.float16 and torch.equal(scales, ref_scales.half())
