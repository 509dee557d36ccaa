"""The Triton tile GEMM (CPU interpreter; CUDA with TRITON_INTERPRET=0) against the torch backend: bit-exact.

``ops`` sends M <= 16 to the split-K decode kernel (``test_decode_kernel.py``); these tests call the tile kernel
directly, so they cover it at every M."""

from functools import partial

import pytest
import torch

from loopq.kernels import gemm_kernel, gemm_w4a4, gemm_w4a8, quantize_activation, quantize_weight
from tests.kernels.cases import cuda_only


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=cuda_only)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 32, 64), (5, 48, 160), (33, 96, 128), (130, 40, 64)])
def test_matches_torch_backend(m, n, k, bits, out_dtype, device):
    gen = torch.Generator().manual_seed(m * n + k)
    a, sa = quantize_activation(torch.randn(m, k, generator=gen).to(device), clip=0.9, bits=bits)
    w, sw = quantize_weight(torch.randn(n, k, generator=gen).to(device), 0.8)
    gemm = gemm_w4a4 if bits == 4 else gemm_w4a8
    out = gemm_kernel.gemm(a, sa, w, sw, out_dtype, a_int4=bits == 4)
    ref = gemm(a, sa, w, sw, out_dtype, backend="torch")
    assert out.dtype == out_dtype and out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_extreme_codes(device):
    """All-(-8) and all-(-128) operands: the largest magnitudes the int32 group dot must hold (M = 3 through ``ops``:
    the decode kernel)."""
    a4 = torch.full((3, 32), 0x88, dtype=torch.uint8, device=device)
    a8 = torch.full((3, 64), -128, dtype=torch.int8, device=device)
    w = torch.full((40, 32), 0x88, dtype=torch.uint8, device=device)
    s3, s40 = torch.ones(3, 2, device=device), torch.ones(40, 2, dtype=torch.float16, device=device)
    assert bool((gemm_w4a4(a4, s3, w, s40, backend="triton") == 2 * 32 * 64).all())
    assert bool((gemm_w4a8(a8, s3, w, s40, backend="triton") == 2 * 32 * 8 * 128).all())


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 2048), (16, 2048, 5632), (300, 11264, 2048)])
def test_ouro_shapes_bf16(m, n, k, bits, device):
    """Ouro-1.4B's linears (fused QKV, down_proj, fused gate+up) at decode, small-batch and calibration M, with the
    bf16 output the exported model asks for; the tile kernel itself at M = 1 and 16 (``ops`` sends those to the
    decode kernel, tested in ``test_decode_kernel.py``), M = 300 through ``ops``."""
    gen = torch.Generator().manual_seed(m + n + k + bits)
    a, sa = quantize_activation(torch.randn(m, k, generator=gen).to(device, torch.bfloat16), clip=0.9, bits=bits)
    w, sw = quantize_weight(torch.randn(n, k, generator=gen).to(device), 0.8)
    ref = (gemm_w4a4 if bits == 4 else gemm_w4a8)(a, sa, w, sw, torch.float32, backend="torch")
    tile = partial(gemm_kernel.gemm, a, sa, w, sw, a_int4=bits == 4)
    torch.testing.assert_close(tile(torch.float32), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tile(torch.bfloat16), ref.to(torch.bfloat16))
