"""The torch backend against the quantization primitives (bit-exact) and a dequantize-then-matmul GEMM."""

import pytest
import torch

from loopq.kernels import gemm_w4a4, gemm_w4a8, quantize_activation, quantize_weight, unpack_int4
from loopq.kernels.reference import kron_apply_ordered
from loopq.qspec import dequantize_codes, quantize_codes
from loopq.quant.primitives import fake_quant
from loopq.quant.transforms import kron_apply, kron_factors
from tests.kernels.cases import random_transform, scaled_permutation, tie_tokens


def _codes(codes, bits):
    return unpack_int4(codes) if bits == 4 else codes


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("transform", [False, True])
def test_ties_match_primitives(bits, transform):
    z = tie_tokens(7, 128, bits)
    x, left, right = z, None, None
    if transform:  # x is chosen so that the transform lands exactly on the ties
        gen = torch.Generator().manual_seed(2)
        (left, left_inv), (right, right_inv) = (scaled_permutation(n, gen) for n in kron_factors(128))
        x = kron_apply(z, left_inv, right_inv)
        assert torch.equal(kron_apply(x, left, right), z)
    codes, scales = quantize_activation(x, left, right, clip=1.0, bits=bits, backend="torch")
    ref_codes, ref_scales = quantize_codes(z, bits, 32, 1.0)
    assert torch.equal(scales, ref_scales) and bool((scales == 1).all())
    assert torch.equal(_codes(codes, bits), ref_codes)
    half = (z - z.floor() == 0.5) & (z.abs() < 2 ** (bits - 1) - 1)
    assert torch.equal(ref_codes[half].float(), torch.round(z[half]))  # ties present and rounded to even
    assert bool((ref_codes[half] % 2 == 0).all()) and half.sum() > 100


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 96, 160])
def test_transform_matches_kron_apply_on_exact_integers(bits, k):
    """With small integers every summation order is exact, so kron_apply is a bit-exact oracle."""
    gen = torch.Generator().manual_seed(k)
    n1, n2 = kron_factors(k)
    x = torch.randint(-8, 9, (9, k), generator=gen).float()
    left = torch.randint(-2, 3, (n1, n1), generator=gen).float()
    right = torch.randint(-2, 3, (n2, n2), generator=gen).float()
    codes, scales = quantize_activation(x, left, right, clip=0.85, bits=bits, backend="torch")
    ref_codes, ref_scales = quantize_codes(kron_apply(x, left, right), bits, 32, 0.85)
    assert torch.equal(_codes(codes, bits), ref_codes) and torch.equal(scales, ref_scales)


def test_ordered_transform_equals_kron_apply_up_to_rounding():
    gen = torch.Generator().manual_seed(3)
    left, right = random_transform(160, gen)
    x = torch.randn(5, 160, generator=gen)
    torch.testing.assert_close(kron_apply_ordered(x, left, right), kron_apply(x, left, right), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dequantized_activation_equals_fake_quant(dtype):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).to(dtype)
    codes, scales = quantize_activation(x, clip=0.9, bits=4, backend="torch")
    assert torch.equal(dequantize_codes(unpack_int4(codes), scales, 32), fake_quant(x.float(), 4, 32, 0.9))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 32, 64), (5, 48, 160), (33, 96, 128)])
def test_gemm_equals_dequantize_then_matmul(bits, m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    a, sa = quantize_activation(torch.randn(m, k, generator=gen), clip=0.9, bits=bits, backend="torch")
    w, sw = quantize_weight(torch.randn(n, k, generator=gen), 0.7 + 0.3 * torch.rand(n, generator=gen))
    gemm = gemm_w4a4 if bits == 4 else gemm_w4a8
    out = gemm(a, sa, w, sw, torch.float32, backend="torch")
    a_deq = dequantize_codes(_codes(a, bits), sa, 32).double()
    w_deq = dequantize_codes(unpack_int4(w), sw.float(), 32).double()
    bound = a_deq.abs() @ w_deq.abs().T  # fp32 error bound scale: |a| |w|^T
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert bool(((out.double() - a_deq @ w_deq.T).abs() <= 1e-5 * bound + 1e-30).all())
