"""The split-K decode GEMM (M <= 16): fp32 output within the rounding bound of the float64 value of its codes.

The bound is ``loopq.kernels.reference.gemm_fp64``'s: ``|out - ref64| <= gamma_{G+1} sum_k |a_k w_k s_a s_w|``
(G groups, ``gamma_n = n 2^-24 / (1 - n 2^-24)``), derived in :mod:`loopq.kernels.decode_kernel`. Shapes are small
for the interpreter but cover M = 1 (CUDA cores), M = 2 / 3 (padded CUDA-core rows), M = 9 / 16 (tensor-core dot),
splits that end inside an iteration (K not a multiple of the split) and masked N tails.
"""

import pytest
import torch

from loopq.commands.gpu_check.kernel_bench import SHAPES
from loopq.kernels import (
    decode_kernel,
    gemm_kernel,
    gemm_w4a4,
    gemm_w4a8,
    ops,
    quantize_activation,
    quantize_weight,
)
from loopq.kernels.decode_kernel import MAX_M, DecodeConfig, decode_config
from tests.kernels.cases import assert_within_bound, cuda_only

#: (M, N, K, forced config or None): N tails at 40 / 70 / 33 columns; the splits end mid-iteration
CASES = {
    "m1-default": (1, 40, 160, None),  # 5 groups: splits of 4 + 1
    "m2-default": (2, 70, 352, None),  # 11 groups: splits of 4 + 4 + 3
    "m3-split": (3, 33, 224, DecodeConfig(4, 32, 2, 4, 2, False)),  # 7 groups: 4 + 3, last iteration half masked
    "m9-dot": (9, 40, 96, None),  # 3 groups: one iteration, 1 of 4 masked
    "m16-dot-split": (16, 40, 160, DecodeConfig(16, 32, 4, 4, 2, True)),  # 5 groups: 4 + 1, 3 of 4 masked
}


def operands(m, n, k, bits, device, seed=0):
    gen = torch.Generator().manual_seed(seed + m * n + k)
    a, sa = quantize_activation(torch.randn(m, k, generator=gen).to(device), clip=0.9, bits=bits)
    w, sw = quantize_weight(torch.randn(n, k, generator=gen).to(device), 0.7 + 0.3 * torch.rand(n, generator=gen))
    return a, sa, w, sw


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", CASES)
def test_within_the_fp32_bound(case, bits, device):
    m, n, k, config = CASES[case]
    a, sa, w, sw = operands(m, n, k, bits, device)
    out = decode_kernel.gemm(a, sa, w, sw, torch.float32, bits == 4, config)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_within_bound(out, a, sa, w, sw, bits)
    half = decode_kernel.gemm(a, sa, w, sw, torch.float16, bits == 4, config)
    assert torch.equal(half, out.half())  # one fixed summation order, rounded once to the output dtype


def test_extreme_codes(device):
    """All-(-8) / all-(-128) operands on both paths and split: exact integers, the int32 group dot's largest."""
    for m, config in ((1, None), (16, DecodeConfig(16, 32, 1, 1, 2, True)), (2, DecodeConfig(2, 32, 1, 1, 2, False))):
        a4 = torch.full((m, 32), 0x88, dtype=torch.uint8, device=device)
        a8 = torch.full((m, 64), -128, dtype=torch.int8, device=device)
        w = torch.full((40, 32), 0x88, dtype=torch.uint8, device=device)
        sa, sw = torch.ones(m, 2, device=device), torch.ones(40, 2, dtype=torch.float16, device=device)
        assert bool((decode_kernel.gemm(a4, sa, w, sw, torch.float32, True, config) == 2 * 32 * 64).all())
        assert bool((decode_kernel.gemm(a8, sa, w, sw, torch.float32, False, config) == 2 * 32 * 8 * 128).all())


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_config_covers_k_and_fills_the_gpu(n, k):
    """Every M: the splits tile the groups exactly, in whole iterations; partial sums stay under a quarter of the
    weight's bytes; at M = 1 every Ouro-1.4B shape launches >= 132 programs (one per H100 SM)."""
    groups = k // 32
    for m in range(1, MAX_M + 1):
        cfg = decode_config(m, n, k)
        assert cfg.block_m >= m and cfg.groups_per_split % cfg.block_g == 0
        assert (cfg.splits - 1) * cfg.groups_per_split < groups <= cfg.splits * cfg.groups_per_split
        assert cfg.splits == 1 or 8 * cfg.splits * m * n <= n * k * 9 // 16 // 4
        assert cfg.use_dot == (m > 4)
    grid = decode_config(1, n, k).grid(n)
    assert grid[0] * grid[1] >= 132


def test_ops_dispatch_decode_up_to_16_rows(monkeypatch):
    seen = []
    monkeypatch.setattr(decode_kernel, "gemm", lambda a, *args: seen.append(("decode", a.shape[0])))
    monkeypatch.setattr(gemm_kernel, "gemm", lambda a, *args: seen.append(("tile", a.shape[0])))
    w, sw = torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1)
    for m in (1, 16, 17):
        gemm_w4a4(torch.zeros(m, 16, dtype=torch.uint8), torch.ones(m, 1), w, sw, backend="triton")
    assert seen == [("decode", 1), ("decode", 16), ("tile", 17)]
    assert ops._GEMM_W4A4["triton"].keywords == {"a_int4": True}


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_ouro_shapes(n, k, m, bits, device):
    """Ouro-1.4B's linears at decode through ``ops`` with the configs :func:`decode_config` picks, fp32 and the bf16
    output the exported model asks for (compiled kernels only)."""
    a, sa, w, sw = operands(m, n, k, bits, device)
    gemm = gemm_w4a4 if bits == 4 else gemm_w4a8
    out = gemm(a, sa, w, sw, torch.float32, backend="triton")
    assert_within_bound(out, a, sa, w, sw, bits)
    assert torch.equal(gemm(a, sa, w, sw, torch.bfloat16, backend="triton"), out.to(torch.bfloat16))
