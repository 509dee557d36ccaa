"""Eq. 4 on hand-computed cases: scales, clipping, rounding rule, group edges, STE."""

import pytest
import torch

from loopq.qspec import dequantize_codes, qrange, quantize_codes, scale_floor, to_groups
from loopq.quant.primitives import best_clip_ratio, clip_logit, clip_ratio, fake_quant, row_clip_errors


def test_qrange():
    assert qrange(4) == (-8, 7) and qrange(8) == (-128, 127)


def test_int4_group_by_hand():
    # one group of 4: absmax 7 -> scale 1; values round half to even: 2.5 -> 2, -3.5 -> -4, 7 -> 7
    x = torch.tensor([[2.5, -3.5, 7.0, 0.4]])
    codes, scales = quantize_codes(x, bits=4, group_size=4)
    assert scales.tolist() == [[1.0]]
    assert codes.tolist() == [[2, -4, 7, 0]]
    assert fake_quant(x, 4, 4).tolist() == [[2.0, -4.0, 7.0, 0.0]]


def test_clipping_saturates_at_qmax():
    # clip 0.5: scale = 0.5 * 14 / 7 = 1 -> 14 saturates to 7, -14 to -8 (q_min), 3.2 -> 3
    x = torch.tensor([[14.0, -14.0, 3.2, 0.0]])
    assert fake_quant(x, 4, 4, clip=0.5).tolist() == [[7.0, -8.0, 3.0, 0.0]]


def test_groups_are_independent_at_the_edge():
    # group 1 = [7, 1], group 2 = [0.7, 0.1]: each gets its own scale (1 and 0.1)
    x = torch.tensor([[7.0, 1.0, 0.7, 0.1]])
    codes, scales = quantize_codes(x, 4, 2)
    torch.testing.assert_close(scales, torch.tensor([[1.0, 0.1]]))
    assert codes.tolist() == [[7, 1, 7, 1]]
    torch.testing.assert_close(dequantize_codes(codes, scales, 2), x)


def test_per_channel_and_per_token_is_group_minus_one():
    x = torch.randn(3, 64)
    torch.testing.assert_close(fake_quant(x, 8, -1), fake_quant(x, 8, 64))


def test_sixteen_bits_is_identity_and_zero_group_is_zero():
    x = torch.randn(2, 32)
    assert fake_quant(x, 16, 32) is x
    assert fake_quant(torch.zeros(1, 32), 4, 32).abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_an_all_zero_group_quantizes_to_zeros_in_every_dtype(dtype):
    """fp16 has no 1e-8 (it rounds to 0 there), so a zero group's scale needs fp16's own floor, not 0/0 = NaN;
    the group beside it is quantized as by hand: integers with absmax 7 -> scale 7 / 7 = 1, codes = the values."""
    ints = torch.arange(32) % 15 - 7.0  # -7..7
    x = torch.cat([torch.zeros(32), ints]).to(dtype).reshape(1, 64)
    codes, scales = quantize_codes(x, 4, 32)
    assert torch.equal(codes[0, :32], torch.zeros(32, dtype=torch.int8))
    assert scales[0, 0] > 0 and scales[0, 1] == 1
    assert torch.equal(codes[0, 32:], ints.to(torch.int8))
    out = fake_quant(x, 4, 32)
    assert torch.equal(out[0], torch.cat([torch.zeros(32), ints]).to(dtype))


def test_the_scale_floor_is_unchanged_where_1e8_is_representable():
    assert scale_floor(torch.float32) == scale_floor(torch.bfloat16) == scale_floor(torch.float64) == 1e-8
    assert scale_floor(torch.float16) == 2.0**-14  # fp16's smallest normal number
    zero = torch.zeros(1, 32)
    assert quantize_codes(zero, 4, 32)[1].item() == torch.tensor(1e-8).item()


def test_group_must_divide_dimension():
    with pytest.raises(ValueError, match="group_size=32 does not divide the dimension 48"):
        to_groups(torch.zeros(2, 48), 32)


def test_straight_through_gradient():
    x = torch.tensor([[0.3, 1.7, -2.2, 7.0]], requires_grad=True)
    fake_quant(x, 4, 4).sum().backward()
    # round is identity in the backward pass: a non-max element gets d(s * x/s)/dx = 1
    assert torch.isfinite(x.grad).all() and x.grad[0, 0] == pytest.approx(1.0)


def test_clip_gradient_reaches_logit():
    logit = clip_logit(0.9).requires_grad_(True)
    x = torch.linspace(-3, 3, 32)[None]
    (fake_quant(x, 4, 32, clip_ratio(logit)) - x).pow(2).sum().backward()
    assert logit.grad is not None and logit.grad != 0


def test_clip_parameterisation_stays_in_unit_interval():
    for v in (-50.0, 0.0, 50.0):
        r = float(clip_ratio(torch.tensor(v)))
        assert 0.0 <= r <= 1.0
    assert float(clip_ratio(clip_logit(0.7))) == pytest.approx(0.7, abs=1e-6)


def test_best_clip_ratio_minimises_the_error_on_its_grid():
    torch.manual_seed(0)
    heavy = torch.distributions.StudentT(2.0).sample((512, 32))
    grid = torch.linspace(0.5, 1.0, 6)
    best = best_clip_ratio(heavy, 4, 32, grid)
    errors = [float((fake_quant(heavy, 4, 32, float(c)) - heavy).pow(2).mean()) for c in grid]
    assert float((fake_quant(heavy, 4, 32, best) - heavy).pow(2).mean()) == pytest.approx(min(errors))


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_row_clip_errors_are_the_fake_quant_errors_bit_for_bit(bits):
    """The weight-clip search's fast path gives exactly the per-row errors of its definition, an all-zero group
    (the scale floor) included, so ``prepare`` chooses the same clips as before it was sped up."""
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(48, 128, generator=gen) * torch.rand(1, 128, generator=gen) * 3
    w[5, :32] = 0
    grid = torch.linspace(0.55, 1.0, 10)
    want = torch.stack([to_groups((fake_quant(w, bits, 32, float(c)) - w).pow(2), 32).sum(dim=(-1, -2)) for c in grid])
    assert torch.equal(row_clip_errors(w, bits, 32, grid), want)
