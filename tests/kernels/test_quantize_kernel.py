"""Triton quantizer (CPU interpreter; CUDA with TRITON_INTERPRET=0) against the torch backend: bit-identical."""

import pytest
import torch

from loopq.kernels import quantize_activation, unpack_int4
from loopq.qspec import quantize_codes
from loopq.quant.transforms import kron_apply, kron_factors
from tests.kernels.cases import cuda_only, random_transform, scaled_permutation, tie_tokens


def _both(x, left, right, clip, bits):
    tri = quantize_activation(x, left, right, clip, bits, backend="triton")
    ref = quantize_activation(x, left, right, clip, bits, backend="torch")
    return tri, ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, pytest.param(torch.bfloat16, marks=cuda_only)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize(("m", "k"), [(1, 64), (5, 160), (33, 160), (33, 96), (33, 128), (33, 352)])
def test_matches_torch_backend(m, k, transform, bits, dtype, device):
    gen = torch.Generator().manual_seed(m * k + bits)
    x = 3 * torch.randn(m, k, generator=gen)
    x[0, :32] = 0  # an all-zero group: scale floor 1e-8, codes 0
    x = x.to(device, dtype)
    left, right = (f.to(device) for f in random_transform(k, gen)) if transform else (None, None)
    (codes, scales), (ref_codes, ref_scales) = _both(x, left, right, 0.8, bits)
    assert codes.dtype == ref_codes.dtype and codes.shape == ref_codes.shape
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales, ref_scales)


@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_ties_and_near_ties(bits, transform, device):
    z = tie_tokens(6, 160, bits, seed=bits)
    x, left, right = z, None, None
    if transform:  # exact transform landing on the ties (see test_reference)
        gen = torch.Generator().manual_seed(6)
        (left, left_inv), (right, right_inv) = (scaled_permutation(n, gen) for n in kron_factors(160))
        x = kron_apply(z, left_inv, right_inv)
        left, right = left.to(device), right.to(device)
    (codes, scales), (ref_codes, ref_scales) = _both(x.to(device), left, right, 1.0, bits)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    prim_codes, _ = quantize_codes(z.to(device), bits, 32, 1.0)
    assert torch.equal(unpack_int4(codes) if bits == 4 else codes, prim_codes)


def test_missing_factor_is_identity(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 96, generator=gen).to(device)
    right = torch.randn(12, 12, generator=gen).to(device)
    (codes, scales), (ref_codes, ref_scales) = _both(x, None, right, 0.9, 4)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    explicit = quantize_activation(x, torch.eye(8, device=device), right, 0.9, 4, backend="triton")
    assert torch.equal(codes, explicit[0]) and torch.equal(scales, explicit[1])


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [2048, 5632])
def test_ouro_widths_bf16(k, bits, device):
    """Ouro-1.4B's input widths with their transforms (K = 5632 = 64 x 88 takes the scratch compaction path), bf16
    tokens as a calibrated model feeds them, enough rows for several programs."""
    gen = torch.Generator().manual_seed(k + bits)
    x = (3 * torch.randn(300, k, generator=gen)).to(device, torch.bfloat16)
    left, right = (f.to(device) for f in random_transform(k, gen))
    (codes, scales), (ref_codes, ref_scales) = _both(x, left, right, 0.9, bits)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
