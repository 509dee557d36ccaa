"""The prefill tile GEMM (CPU interpreter; CUDA with TRITON_INTERPRET=0): fp32 output within the rounding bound of
the float64 value of the same codes and scales.

The bound is :func:`loopq.kernels.reference.gemm_fp64`'s, ``|out - ref64| <= gamma_{G+1} sum_k |a_k w_k s_a s_w|``
(G groups, ``gamma_n = n 2^-24 / (1 - n 2^-24)``), derived in :mod:`loopq.kernels.gemm_kernel`: exact int32 group
dots, at most two roundings per term and G - 1 additions. ``ops`` sends M <= 16 to the split-K decode kernel
(``test_decode_kernel.py``); these tests call the tile kernel directly, so they cover every M and every tile of
:data:`loopq.kernels.gemm_kernel.CANDIDATES`, with M, N not multiples of the tile and K not a multiple of the
configured ``32 * BLOCK_G`` (5 groups: the launcher takes one group per iteration, :func:`block_g_for`).
"""

from functools import partial

import pytest
import torch

from loopq.kernels import gemm_kernel, gemm_w4a4, gemm_w4a8, quantize_activation, quantize_weight
from loopq.kernels.gemm_kernel import CANDIDATES, PrefillConfig, prefill_config
from tests.kernels.cases import assert_within_bound, cuda_only

#: (M, N, K, config): ragged M / N tails, K = 5 groups (one group per iteration: neither 2 nor 4 divides 5) and 6
#: (configured 4, run as 2 per iteration),
#: Ouro's K = 2048 and 5632 at small M, N, and a grid of several tile rows for the grouped rasterisation
CASES = {
    "m33-n96-k160-small": (33, 96, 160, PrefillConfig(32, 32, 4, 2, 2, group_m=2)),
    "m70-n40-k192-g4": (70, 40, 192, PrefillConfig(32, 32, 4, 2, 4, group_m=2)),
    "m17-n48-k2048": (17, 48, 2048, PrefillConfig(32, 32, 4, 2, 4)),
    "m20-n40-k5632": (20, 40, 5632, PrefillConfig(32, 32, 4, 2, 4)),
    "m130-n72-k128-default": (130, 72, 128, None),
}


def operands(m, n, k, bits, device, seed=0):
    gen = torch.Generator().manual_seed(seed + m * n + k)
    a, sa = quantize_activation(3 * torch.randn(m, k, generator=gen).to(device), clip=0.9, bits=bits)
    w, sw = quantize_weight(torch.randn(n, k, generator=gen).to(device), 0.7 + 0.3 * torch.rand(n, generator=gen))
    return a, sa, w, sw


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", CASES)
def test_within_the_fp32_bound(case, bits, device):
    m, n, k, config = CASES[case]
    a, sa, w, sw = operands(m, n, k, bits, device)
    out = gemm_kernel.gemm(a, sa, w, sw, torch.float32, bits == 4, config)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_within_bound(out, a, sa, w, sw, bits)
    half = gemm_kernel.gemm(a, sa, w, sw, torch.float16, bits == 4, config)
    assert torch.equal(half, out.half())  # one fixed summation order, rounded once to the output dtype


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", ["m33-n96-k160-small", "m130-n72-k128-default"])
def test_bias_and_output_dtype_in_the_epilogue(case, bits, device):
    """With a bias and a 16-bit output the kernel writes, bit for bit, its fp32 output plus the bias, cast: what the
    torch epilogue it replaces (``(y + bias.float()).to(out_dtype)``, two more passes over the output) computed."""
    m, n, k, config = CASES[case]
    a, sa, w, sw = operands(m, n, k, bits, device)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)
    plain = gemm_kernel.gemm(a, sa, w, sw, torch.float32, bits == 4, config)
    for dtype in (torch.float32, torch.float16):
        fused = gemm_kernel.gemm(a, sa, w, sw, dtype, bits == 4, config, bias=bias)
        assert fused.dtype == dtype and torch.equal(fused, (plain + bias).to(dtype))


def test_extreme_codes(device):
    """All-(-8) / all-(-128) operands with unit scales: exact integers, the int32 group dot's largest values, over
    three groups (one per iteration, whatever the configured BLOCK_G)."""
    for cfg in (PrefillConfig(32, 32, 4, 2, 2), PrefillConfig(32, 32, 4, 2, 4)):
        a4 = torch.full((40, 48), 0x88, dtype=torch.uint8, device=device)
        a8 = torch.full((40, 96), -128, dtype=torch.int8, device=device)
        w = torch.full((40, 48), 0x88, dtype=torch.uint8, device=device)
        sa, sw = torch.ones(40, 3, device=device), torch.ones(40, 3, dtype=torch.float16, device=device)
        assert bool((gemm_kernel.gemm(a4, sa, w, sw, torch.float32, True, cfg) == 3 * 32 * 64).all())
        assert bool((gemm_kernel.gemm(a8, sa, w, sw, torch.float32, False, cfg) == 3 * 32 * 8 * 128).all())


def test_group_scales_land_on_their_group(device):
    """One nonzero group per call, distinct power-of-two scales per (row, group): the output is exactly
    dot_g * s_a[m, g] * s_w[n, g] for that g, so a scale column mixed up with another one cannot pass."""
    cfg = PrefillConfig(32, 32, 4, 2, 4)
    m, n, groups = 33, 40, 6
    rows = torch.arange(m, dtype=torch.float32)[:, None]
    sa = (2.0 ** (rows % 5 - torch.arange(groups)[None, :])).to(device)
    sw = (2.0 ** (torch.arange(n)[:, None] % 3 + 2 * torch.arange(groups)[None, :])).half().to(device)
    for g in range(groups):
        codes = torch.zeros(m, 32 * groups, dtype=torch.int8)
        codes[:, 32 * g : 32 * g + 32] = 1
        out = gemm_kernel.gemm(
            codes.to(device),
            sa,
            torch.full((n, 16 * groups), 0x11, dtype=torch.uint8, device=device),
            sw,
            torch.float32,
            False,
            cfg,
        )
        expected = 32 * sa[:, g, None].double().cpu() * sw[None, :, g].double().cpu()
        assert torch.equal(out.double().cpu(), expected), g


def test_config_table():
    """Per M bucket: the largest candidate whose grid has >= 132 programs (one H100 wave), else the smallest;
    cached per bucket, so every M of a bucket gets the same launch."""
    assert [(c.block_m, c.block_n) for c in CANDIDATES] == [(64, 128), (64, 64)]
    assert prefill_config(4096, 2048) == CANDIDATES[0]  # 64 x 16 = 1024 programs of 64 x 128
    assert prefill_config(256, 11264) == CANDIDATES[0]  # 4 x 88 = 352
    assert prefill_config(256, 2048) == CANDIDATES[1]  # 4 x 16 = 64 < 132, then 64 x 64: 128, the smallest
    assert prefill_config(1024, 2048) == CANDIDATES[0]  # 16 x 16 = 256
    assert prefill_config(300, 6144) is prefill_config(512, 6144)
    for cfg in CANDIDATES:
        assert cfg.block_g in (1, 2, 4) and cfg.num_stages >= 3  # 2 stages wait for depth 0 in the K loop


def test_groups_per_iteration_divide_k():
    """The K loop has no mask: an iteration's groups divide K's (Ouro's 64 and 176 keep the configured 2)."""
    assert [gemm_kernel.block_g_for(2, g) for g in (64, 176, 5, 6)] == [2, 2, 1, 2]
    assert [gemm_kernel.block_g_for(4, g) for g in (64, 176, 5, 6, 10)] == [4, 4, 1, 2, 2]


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k"), [(300, 11264, 2048), (4096, 2048, 5632), (257, 6144, 2048)])
def test_ouro_shapes_bf16(m, n, k, bits, device):
    """Ouro-1.4B's linears at prefill M through ``ops`` and the default tile, fp32 within the bound, bf16 output
    the fp32 output rounded once."""
    gen = torch.Generator().manual_seed(m + n + k + bits)
    a, sa = quantize_activation(torch.randn(m, k, generator=gen).to(device, torch.bfloat16), clip=0.9, bits=bits)
    w, sw = quantize_weight(torch.randn(n, k, generator=gen).to(device), 0.8)
    gemm = partial(gemm_w4a4 if bits == 4 else gemm_w4a8, a, sa, w, sw, backend="triton")
    out = gemm(torch.float32)
    assert_within_bound(out, a, sa, w, sw, bits)
    assert torch.equal(gemm(torch.bfloat16), out.to(torch.bfloat16))
