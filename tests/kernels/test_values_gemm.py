"""The 16-bit prefill scheme (``gemm_kernel.gemm_values`` on the quantizer's ``values``; CPU interpreter in fp16,
which it runs, CUDA in bf16 too).

Oracles: the quantizer's values are the fp32 products ``code * scale`` of its own codes rounded once to the 16-bit
dtype (bit for bit); the GEMM is within :func:`gemm_kernel.values_bound` of the float64 GEMM of its given activation
values and its weight operand ``dtype(code * s_w)`` (``gamma'_{K+1} (sum_k |a~_k w~_k| + |b|)``, the fp32 sums'
rounding alone, derived in ``gemm_kernel``: a kernel that rounded its accumulator to 16 bits per K step fails it at
K = 160 and 192, which a bound with the weight rounding in it let pass); a whole ``quantized_linear`` with
``prefill="values"`` is the same GEMM on the values of the torch reference's codes. Forced tiles cover ragged M / N,
K steps of one and two groups, and the tile M = 4096 takes on sm_90.
"""

import pytest
import torch

from loopq.kernels import gemm_kernel, ops, quantize_kernel, quantize_weight, reference, unpack_int4
from loopq.kernels.gemm_kernel import VALUES_CANDIDATES, PrefillConfig, gemm_values, values_bound, values_config
from loopq.kernels.packing import tile_weight
from loopq.qspec import dequantize_codes
from tests.kernels.cases import cuda_only, random_transform

CASES = {
    "m33-n96-k160": (33, 96, 160, PrefillConfig(16, 32, 4, 2, 2, group_m=2)),
    "m70-n40-k192": (70, 40, 192, PrefillConfig(32, 16, 4, 2, 2, group_m=2)),
    "m17-n48-k2048": (17, 48, 2048, PrefillConfig(32, 32, 4, 2, 2)),
    "m130-n136-k96-sm90-tile": (130, 136, 96, VALUES_CANDIDATES[90][0]),  # G = 3: one group per K step
}


def weight(n, k, device, seed=0):
    gen = torch.Generator().manual_seed(seed + n + k)
    return quantize_weight(torch.randn(n, k, generator=gen).to(device), 0.7 + 0.3 * torch.rand(n, generator=gen))


def values_of(codes, scales, dtype):
    """The oracle: ``code * scale`` in fp32 (the fake-quant student's product), rounded once to ``dtype``."""
    return dequantize_codes(codes, scales.float(), 32).to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("transform", [False, True])
def test_quantizer_values_are_its_codes_times_scales(bits, transform, device):
    """The exact quantizer's ``values`` are the torch reference's codes times scales, rounded once to fp16 (with and
    without a transform and the diagonal), and its scales are the reference's."""
    gen = torch.Generator().manual_seed(bits)
    m, k = 19, 256
    x = (3 * torch.randn(m, k, generator=gen)).to(device, torch.float16)
    left, right = (f.to(device) for f in random_transform(k, gen)) if transform else (None, None)
    inv_d = (0.5 + torch.rand(k, generator=gen)).to(device)
    vals, scales = quantize_kernel.quantize_activation(
        x, left, right, 0.8, bits, 32, True, inv_d, False, None, torch.float16
    )
    codes, ref_scales = reference.quantize_activation(x.float() * inv_d, left, right, 0.8, bits, 32)
    codes = unpack_int4(codes) if bits == 4 else codes
    assert vals.dtype == torch.float16 and vals.shape == (m, k)
    assert torch.equal(scales, ref_scales) and torch.equal(vals, values_of(codes, ref_scales, torch.float16))


def test_fast_quantizer_values_are_its_own_codes_times_scales(device):
    """The tensor-core quantizer (``exact=False``) writes the values of the codes and scales it writes without
    ``values``: the two outputs share everything up to the store."""
    gen = torch.Generator().manual_seed(3)
    m, k = 20, 2048
    x = (3 * torch.randn(m, k, generator=gen)).to(device, torch.float16)
    left, right = (f.to(device) for f in random_transform(k, gen))
    codes, scales = quantize_kernel.quantize_activation(x, left, right, 0.8, 4, 32, False)
    vals, vscales = quantize_kernel.quantize_activation(
        x, left, right, 0.8, 4, 32, False, None, False, None, torch.float16
    )
    assert torch.equal(vscales, scales) and torch.equal(vals, values_of(unpack_int4(codes), scales, torch.float16))


@pytest.mark.parametrize("case", CASES)
def test_gemm_within_its_bound(case, device):
    m, n, k, config = CASES[case]
    gen = torch.Generator().manual_seed(m)
    a = (2 * torch.randn(m, k, generator=gen)).to(device, torch.float16)
    w, sw = weight(n, k, device)
    out = gemm_values(a, w, sw.half(), torch.float32, config)
    assert out.shape == (m, n) and out.dtype == torch.float32
    ref, bound = values_bound(a.cpu(), unpack_int4(w).cpu(), sw.half().cpu())
    assert bool(((out.cpu().double() - ref).abs() <= bound).all())
    bias = torch.randn(n, generator=gen).to(device)
    with_bias = gemm_values(a, w, sw.half(), torch.float32, config, bias)
    ref, bound = values_bound(a.cpu(), unpack_int4(w).cpu(), sw.half().cpu(), bias.cpu())
    assert bool(((with_bias.cpu().double() - ref).abs() <= bound).all())
    half = gemm_values(a, w, sw.half(), torch.float16, config, bias)
    assert torch.equal(half, with_bias.half())  # bias added to the fp32 sums, then one cast


def test_quantized_linear_values_path_against_float64(device):
    """``prefill="values"`` on fp16 tokens: the torch reference's codes (the exact quantizer's) times their scales in
    fp16, times the weight's dequantized codes, within the bound; the bias in the epilogue."""
    gen = torch.Generator().manual_seed(5)
    m, n, k = 40, 48, 256
    x = (3 * torch.randn(m, k, generator=gen)).to(device, torch.float16)
    w, sw = weight(n, k, device, seed=1)
    bias = torch.randn(n, generator=gen).to(device)
    w_codes, w_scales = tile_weight(w, sw.half())
    y = ops.quantized_linear(
        x, w_codes, w_scales, n, clip=0.9, bias=bias, out_dtype=torch.float32, backend="triton", prefill="values"
    )
    codes, scales = reference.quantize_activation(x.float(), None, None, 0.9, 4, 32)
    a = values_of(unpack_int4(codes), scales, torch.float16).cpu()
    ref, bound = values_bound(a, unpack_int4(w).cpu(), sw.half().cpu(), bias.cpu())
    assert bool(((y.cpu().double() - ref).abs() <= bound).all())


def test_prefill_scheme_choice():
    """bf16 takes the 16-bit scheme by default, fp16 and fp32 the integer one; an explicit choice is checked."""
    assert ops.prefill_scheme(torch.bfloat16) == "values"
    assert ops.prefill_scheme(torch.float16) == ops.prefill_scheme(torch.float32) == "int8"
    assert (
        ops.prefill_scheme(torch.float16, "values") == "values" and ops.prefill_scheme(torch.bfloat16, "int8") == "int8"
    )
    with pytest.raises(ValueError, match="16-bit dtype"):
        ops.prefill_scheme(torch.float32, "values")
    with pytest.raises(ValueError, match="prefill='fp8'"):
        ops.prefill_scheme(torch.bfloat16, "fp8")
    w, sw = weight(8, 64, "cpu")
    w_codes, w_scales = tile_weight(w, sw.half())
    with pytest.raises(ValueError, match="prefill"):  # checked on the torch backend too
        ops.quantized_linear(torch.randn(2, 64), w_codes, w_scales, 8, prefill="values", backend="torch")


def test_tile_choice_per_architecture():
    """By hand: at M = 4096, N = 2048 sm_90's 128 x 128 tile gives 32 x 16 = 512 programs (>= 132, one per SM), at
    M = 256 only 2 x 16 = 32, so the small tile; every architecture but Hopper takes the sm_80 table."""
    big90, small90 = VALUES_CANDIDATES[90]
    assert values_config(4096, 2048, 90) == big90 == PrefillConfig(128, 128, 8, 3, 2)
    assert values_config(256, 2048, 90) == small90 and values_config(4096, 2048, 90) == big90
    big80 = VALUES_CANDIDATES[80][0]
    assert values_config(4096, 2048, 86) == values_config(4096, 2048, 80) == big80  # Ampere, Ada (8.9) too
    assert values_config(4096, 2048, 100) == values_config(4096, 2048, 120) == big80  # no wgmma on Blackwell


@cuda_only
def test_bf16_values_path_on_cuda():
    """On a GPU, the default for bf16 prefill through ``quantized_linear`` at Ouro-1.4B's fused QKV width and 2048
    tokens (sm_90's 128 x 128 tile), with a bias: the values are the exact quantizer's codes times scales rounded
    to bf16 (bit for bit), the output within the bound of the float64 GEMM on them."""
    gen = torch.Generator().manual_seed(9)
    m, n, k = 2048, 6144, 2048
    x = (3 * torch.randn(m, k, generator=gen)).to("cuda", torch.bfloat16)
    w, sw = weight(n, k, "cuda", seed=2)
    bias = torch.randn(n, generator=gen).to("cuda")
    assert ops.prefill_scheme(x.dtype) == "values"
    w_codes, w_scales = tile_weight(w, sw.half())
    y = ops.quantized_linear(x, w_codes, w_scales, n, clip=0.9, bias=bias, out_dtype=torch.float32)
    vals, _ = quantize_kernel.quantize_activation(x, None, None, 0.9, 4, 32, True, None, False, None, torch.bfloat16)
    codes, ref_scales = reference.quantize_activation(x.float().cpu(), None, None, 0.9, 4, 32)
    assert torch.equal(vals.cpu(), values_of(unpack_int4(codes), ref_scales, torch.bfloat16))
    ref, bound = values_bound(vals.cpu(), unpack_int4(w).cpu(), sw.half().cpu(), bias.cpu())
    assert bool(((y.cpu().double() - ref).abs() <= bound).all())


def test_set_prefill_picks_the_packed_groups_scheme(device, monkeypatch):
    """``set_prefill`` reaches every packed group: an fp16 prefill (17 tokens) runs the integer kernel by default and
    the 16-bit one after ``set_prefill(model, "values")`` (the GEMM each launches, recorded), with outputs that
    differ only by the two schemes' roundings; decode calls and a bad name are unaffected / refused."""
    from loopq.quant.packed import set_prefill
    from tests.kernels.test_decode_plan import make_group, tokens

    model = torch.nn.Sequential(make_group(device), make_group(device, seed=1))
    launched = []
    for name in ("gemm", "gemm_values"):
        real = getattr(gemm_kernel, name)
        monkeypatch.setattr(
            gemm_kernel, name, lambda *a, real=real, name=name, **k: launched.append(name) or real(*a, **k)
        )
    x = tokens(17, device)
    default = model[0](x)
    assert set_prefill(model, "values") == 2 and all(g.prefill == "values" for g in model)
    values = model[0](x)
    assert launched == ["gemm", "gemm_values"]
    for d, v in zip(default, values, strict=True):
        assert torch.allclose(d.float(), v.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="prefill='fp8'"):
        set_prefill(model, "fp8")
