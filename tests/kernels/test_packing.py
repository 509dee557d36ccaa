"""The packed int4 layout and offline weight quantization."""

import pytest
import torch

from loopq.kernels import pack_int4, quantize_weight, unpack_int4
from loopq.kernels.packing import deinterleave_groups, interleave_groups, tile_weight, tiled_shapes, untile_weight
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


def test_kernel_layout_by_hand():
    """Row r, group g of a [12, 96] weight (3 groups, 2 tiles of 8 rows): its 16 bytes at block [r // 8, g // 8,
    r % 8, g % 8] xor 0x88 (offset binary nibbles), its scale at [r // 8, g // 64, r % 8, g % 8, g % 64 // 8];
    padding is code 0 (byte 0x88) and scale 0; untile_weight inverts it exactly."""
    gen = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (12, 48), generator=gen, dtype=torch.uint8)
    scales = torch.rand(12, 3, generator=gen).half()
    codes, s = tile_weight(packed, scales)
    assert codes.shape == (2, 1, 8, 8, 16) and s.shape == (2, 1, 8, 8, 8)
    for r in range(12):
        for g in range(3):
            assert torch.equal(codes[r // 8, 0, r % 8, g], packed[r, 16 * g : 16 * g + 16] ^ 0x88)
            assert s[r // 8, 0, r % 8, g, 0] == scales[r, g]
    assert bool((codes[1, 0, 4:] == 0x88).all() and (codes[0, 0, :, 3:] == 0x88).all())
    assert int(s.count_nonzero()) == 12 * 3
    assert all(torch.equal(a, b) for a, b in zip(untile_weight(codes, s, 12, 96), (packed, scales), strict=True))
    assert tiled_shapes(2048, 5632) == ((256, 22, 8, 8, 16), (256, 3, 8, 8, 8))


def test_decode_activation_order_by_hand():
    codes = torch.arange(64, dtype=torch.int8).reshape(1, 64) - 32
    order = deinterleave_groups(codes)[0] + 32
    assert order[:16].tolist() == list(range(0, 32, 2)) and order[16:32].tolist() == list(range(1, 32, 2))
    assert order[32:48].tolist() == list(range(32, 64, 2))
    assert torch.equal(interleave_groups(deinterleave_groups(codes)), codes)
