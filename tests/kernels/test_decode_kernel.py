"""The decode GEMM (M <= 16) on the export layout: fp32 output within the rounding bound of the float64 value of its
codes, bias and output dtype in the epilogue, and a quantized linear of two launches.

The bound is ``loopq.kernels.reference.gemm_fp64``'s: ``|out - ref64| <= gamma_{G+1} sum_k |a_k w_k s_a s_w|`` (G
groups, ``gamma_n = n 2^-24 / (1 - n 2^-24)``), derived in :mod:`loopq.kernels.decode_kernel`. Shapes are small for
the interpreter but cover M = 1, 2 (unrolled), 3 (padded to 4) on the ``dp4a`` kernel and 11, 12 and 16 on the
tensor-core one (16 token slots, the last ones past M; both forms of its weight operand), a K of only a masked tail
chunk (2, 3 or 5 groups), one full chunk (64 groups) and a full chunk plus a tail (66), N not a multiple of the
8-row tile (nor of the tensor-core kernel's 32 rows).
"""

import pytest
import torch

from loopq.commands.gpu_check.kernel_bench import SHAPES
from loopq.kernels import decode_kernel, gemm_w4a4, gemm_w4a8, ops, quantize_weight, unpack_int4
from loopq.kernels import quantize_kernel as qk
from loopq.kernels.packing import TILE_ROWS, deinterleave_groups, tile_weight
from loopq.kernels.reference import gemm_fp64, quantize_activation
from tests.kernels.cases import cuda_only

#: (M, N, K)
CASES = {
    "m1-tail": (1, 40, 160),
    "m3-chunk+tail": (3, 13, 2112),
    "m11-tail": (11, 9, 96),
    "m16-tail": (16, 9, 64),
    "m12-chunk+tail": (12, 40, 2112),
    "m2-chunk": (2, 8, 2048),
    "m10-chunks+tail": (10, 8, 4224),  # the tensor-core kernel over chunks 0, 1 and a tail of 4 groups
}


def operands(m, n, k, bits, device, seed=0):
    """Activation int8 codes (natural order) and scales from the reference quantizer, a weight's packed codes and
    scales, and the same weight in the kernel layout."""
    gen = torch.Generator().manual_seed(seed + m * n + k)
    codes, sa = quantize_activation(3 * torch.randn(m, k, generator=gen), None, None, 0.9, 8, 32)
    if bits == 4:
        codes = unpack_int4(quantize_activation(torch.randn(m, k, generator=gen), None, None, 0.9, 4, 32)[0])
    w, sw = quantize_weight(torch.randn(n, k, generator=gen), 0.7 + 0.3 * torch.rand(n, generator=gen))
    wt, swt = tile_weight(w, sw)
    return codes.to(device), sa.to(device), w, sw, wt.to(device), swt.to(device)


@pytest.mark.parametrize("split", [None, 2, 4, "max"], ids=["auto", "split2", "split4", "split-max"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", CASES)
def test_within_the_fp32_bound(case, bits, split, device):
    """Also with K split across 2 programs and across the most a kernel takes (8 for ``dp4a``, 4 for the tensor
    cores; the automatic split of these small grids is the largest their K allows), including splits left without
    groups (a K of one 16-byte block, or fewer lane runs than splits)."""
    m, n, k = CASES[case]
    if split == "max":
        split = decode_kernel.MMA_MAX_SPLIT if decode_kernel.uses_mma(m) else decode_kernel.MAX_SPLIT
    codes, sa, w, sw, wt, swt = operands(m, n, k, bits, device)
    out = decode_kernel.gemm_tiled(deinterleave_groups(codes), sa, wt, swt, n, torch.float32, split=split)
    assert out.shape == (m, n) and out.dtype == torch.float32
    ref, bound = gemm_fp64(codes.cpu(), sa.cpu(), unpack_int4(w), sw)
    err = (out.cpu().double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("case", [c for c in CASES if decode_kernel.uses_mma(CASES[c][0])])
def test_tensor_core_operand_forms_agree(case, device, monkeypatch):
    """The tensor-core kernel's two forms of the weight operand (one lane per row, as Triton 3.9 compiles best;
    two lanes per row, as 3.6 does: ``decode_kernel.MMA_HALVES``) give the same integer dots, hence bit-identical
    outputs, each within the bound; whichever the installed Triton picks, both run here."""
    m, n, k = CASES[case]
    codes, sa, w, sw, wt, swt = operands(m, n, k, 4, device)
    ref, bound = gemm_fp64(codes.cpu(), sa.cpu(), unpack_int4(w), sw)
    outs = []
    for halves in (False, True):
        monkeypatch.setattr(decode_kernel, "MMA_HALVES", halves)
        assert decode_kernel.specialization(m)["HALVES"] is halves
        outs.append(decode_kernel.gemm_tiled(deinterleave_groups(codes), sa, wt, swt, n, torch.float32))
        assert bool(((outs[-1].cpu().double() - ref).abs() <= bound).all())
    assert torch.equal(outs[0], outs[1])


def test_bias_and_output_dtype_in_the_epilogue(device):
    """One fixed summation order: the fp16 output with a bias is the fp32 output plus the bias, rounded once."""
    m, n, k = CASES["m1-tail"]
    codes, sa, _, _, wt, swt = operands(m, n, k, 4, device)
    a = deinterleave_groups(codes)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(device)
    out = decode_kernel.gemm_tiled(a, sa, wt, swt, n, torch.float32)
    half = decode_kernel.gemm_tiled(a, sa, wt, swt, n, torch.float16, bias)
    assert torch.equal(half, (out + bias).half())


def test_extreme_codes(device):
    """All -8 weights against all -128 / all 7 activations: the largest exact group dots, both signs of the
    sign extension (offset-binary nibble 0 -> -8) and a padded K tail."""
    k, n = 96, 12
    wt, swt = tile_weight(torch.full((n, k // 2), 0x88, dtype=torch.uint8), torch.ones(n, k // 32).half())
    sa = torch.ones(2, k // 32, device=device)
    a = torch.tensor([-128, 7], dtype=torch.int8)[:, None].expand(2, k).contiguous()
    out = decode_kernel.gemm_tiled(a.to(device), sa, wt.to(device), swt.to(device), n, torch.float32)
    assert out[0].eq(k * 8 * 128).all() and out[1].eq(-k * 8 * 7).all()


def test_quantizer_writes_the_decode_order_with_the_diagonal(device):
    """The Triton quantizer's decode output (int8, per group even k then odd k, ``x * inv_d`` on load) is the
    reference's codes of ``x.float() * inv_d`` bit for bit, deinterleaved; scales equal."""
    gen = torch.Generator().manual_seed(5)
    x, inv_d = torch.randn(3, 128, generator=gen).half(), torch.rand(128, generator=gen) + 0.5
    left, right = torch.eye(8) + 0.1 * torch.randn(8, 8, generator=gen), torch.eye(16)
    for bits in (4, 8):
        for transform in ((None, None), (left, right)):
            want, want_s = quantize_activation(x.float() * inv_d, *transform, 0.9, bits, 32)
            want = unpack_int4(want) if bits == 4 else want
            tr = [t if t is None else t.to(device) for t in transform]
            got, got_s = qk.quantize_activation(x.to(device), *tr, 0.9, bits, 32, True, inv_d.to(device), True)
            assert torch.equal(got.cpu(), deinterleave_groups(want)) and torch.equal(got_s.cpu(), want_s)


class _Launches:
    """Stands in for every Triton kernel (``kernel[grid](...)``) and counts the launches."""

    def __init__(self):
        self.names = []

    def kernel(self, name):
        counter = self

        class Stub:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: counter.names.append(name)

        return Stub()


class _TorchKernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch operators that would launch a GPU kernel (not allocations, views or metadata)."""

    FREE = (
        "empty",
        "view",
        "reshape",
        "as_strided",
        "_unsafe_view",
        "t.",
        "expand",
        "select",
        "slice",
        "split",
        "permute",
    )

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if not name.startswith(self.FREE) and "detach" not in name and "alias" not in name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("k", [128, 2048], ids=["no-split", "k-split"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "tensor-core"])
@pytest.mark.parametrize("m", [1, 16, 17])
def test_a_quantized_linear_is_two_launches(m, fast, k, monkeypatch):
    """``ops.quantized_linear`` with a transform, the diagonal, a bias and a bf16 output: the quantizer and the GEMM
    (the decode kernel at M <= 16, the tile kernel above, both with the bias and the output dtype in their
    epilogues); at decode no torch kernel, at prefill only the weight's conversion from the stored layout (the
    torch epilogue, two more passes over the output, went into the tile kernel in session 23). Either quantizer:
    the exact one or the tensor-core one (CUDA's default), whose cast, diagonal and split across programs stay
    inside its one launch. A K split (K = 2048: 8 programs per
    tile) reduces inside the GEMM's launch; its arrival counters are filled once per device and stream, by the
    first call (made here before the count)."""
    monkeypatch.setattr(qk, "uses_fast_path", lambda exact, device: exact is not True and fast)
    quantizer = "_quantize_dot_kernel" if fast else "_quantize_kernel"
    launches = _Launches()
    kernels = ((qk, "_quantize_kernel"), (qk, "_quantize_dot_kernel"), (decode_kernel, "_decode_kernel"))
    for mod, name in (*kernels, (decode_kernel, "_decode_mma_kernel")):
        monkeypatch.setattr(mod, name, launches.kernel(name))
    monkeypatch.setattr(ops.gemm_kernel, "_gemm_kernel", launches.kernel("_gemm_kernel"))
    monkeypatch.setattr(ops, "triton_interpreted", lambda: True)
    n = 24
    wt, swt = tile_weight(torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // 32).half())
    x, bias, left, right, inv_d = torch.randn(m, k), torch.randn(n), torch.eye(8), torch.eye(k // 8), torch.ones(k)
    args = (x, wt, swt, n, left, right, inv_d, 0.9, 4, bias, torch.float16)
    ops.quantized_linear(*args, backend="triton")
    launches.names.clear()
    with _TorchKernels() as torch_ops:
        y = ops.quantized_linear(*args, backend="triton")
    assert y.shape == (m, n) and y.dtype == torch.float16
    if m <= decode_kernel.MAX_M:
        gemm = "_decode_mma_kernel" if decode_kernel.uses_mma(m) else "_decode_kernel"
        assert launches.names == [quantizer, gemm] and torch_ops.ops == []
    else:
        # the weight's conversion from the stored layout (codes copied and xor-ed, scales copied); the bias add and
        # the cast are the tile kernel's since session 23
        assert launches.names == [quantizer, "_gemm_kernel"]
        assert "bitwise_xor.Scalar" in torch_ops.ops and set(torch_ops.ops) <= {"clone.default", "bitwise_xor.Scalar"}


@pytest.mark.parametrize(
    ("sms", "want", "want_mma"),
    [(132, {"6144x2048": 2, "2048x2048": 8, "11264x2048": 1, "2048x5632": 8},  # H100 SXM: 1056 programs wanted,
      {"6144x2048": 2, "2048x2048": 2, "11264x2048": 1, "2048x5632": 4}),  # 264 of the tensor-core kernel
     (108, {"6144x2048": 2, "2048x2048": 4, "11264x2048": 1, "2048x5632": 4},  # A100: 864,
      {"6144x2048": 2, "2048x2048": 2, "11264x2048": 1, "2048x5632": 4})],  # 216
)  # fmt: skip
def test_k_split_at_the_ouro_shapes(sms, want, want_mma):
    """By hand. ``dp4a`` (M <= 8): N / 8 tiles (768, 256, 1408, 256) times the least power of two reaching 8
    programs per SM, at most 8 (the 16-byte blocks of a chunk). Tensor cores (9..16 tokens): N / 32 blocks (192,
    64, 352, 64) reaching 2 per SM, at most 4 and at most K's lane runs (2 per chunk: 2 at K = 2048, 6 at 5632).
    A K of few groups splits no further than its blocks or lane runs."""
    got = {f"{n}x{k}": decode_kernel.k_split(n // TILE_ROWS, k // 32, sms) for n, k in SHAPES}
    got_mma = {f"{n}x{k}": decode_kernel.k_split(n // 32, k // 32, sms, mma=True) for n, k in SHAPES}
    assert got == want and got_mma == want_mma
    assert [decode_kernel.k_split(1, g, 132) for g in (1, 8, 9, 16, 17, 24, 64, 176)] == [1, 1, 2, 2, 2, 2, 8, 8]
    # tensor cores: 2 runs per full chunk, and one per 4 groups of the last chunk (at most 2)
    assert [decode_kernel.k_split(1, g, 132, mma=True) for g in (1, 4, 5, 64, 65, 68, 69, 128, 129)] == [
        1,
        1,
        2,
        2,
        2,
        2,
        4,
        4,
        4,
    ]


def test_a_split_launch_leaves_its_counters_zero_and_repeats_its_bits(device, monkeypatch):
    """The last of a block's programs resets its arrival counter, so the next call (which fills nothing) finds
    zeros; a launch interrupted in the interpreter (Ctrl-C) zeroes what it counted."""
    m, n, k = 2, 24, 2048
    codes, sa, _, _, wt, swt = operands(m, n, k, 4, device)
    a = deinterleave_groups(codes)
    first = decode_kernel.gemm_tiled(a, sa, wt, swt, n, torch.float32, split=8)
    again = decode_kernel.gemm_tiled(a, sa, wt, swt, n, torch.float32, split=8)
    assert torch.equal(first, again)
    counters = decode_kernel.arrival_counters(torch.device(device), 3)
    assert int(counters.abs().sum()) == 0
    if device.type == "cuda":
        return

    class Interrupted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                args[7][:3] += 1  # three programs arrived, then Ctrl-C
                raise KeyboardInterrupt

            return launch

    monkeypatch.setattr(decode_kernel, "_decode_kernel", Interrupted())
    with pytest.raises(KeyboardInterrupt):
        decode_kernel.gemm_tiled(a, sa, wt, swt, n, torch.float32, split=8)
    assert int(counters.abs().sum()) == 0
    # counters first made under inference mode (a generation loop) are reset outside it too
    monkeypatch.setattr(decode_kernel, "_COUNTERS", {})
    with torch.inference_mode():
        fresh = decode_kernel.arrival_counters(torch.device(device), 3)
    with pytest.raises(KeyboardInterrupt):
        decode_kernel.gemm_tiled(a, sa, wt, swt, n, torch.float32, split=8)
    assert decode_kernel.arrival_counters(torch.device(device), 3) is fresh and int(fresh.abs().sum()) == 0


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_grid_fills_the_gpu(n, k):
    """One program per 8 output rows: at least 132 programs (one per H100 SM) on every Ouro-1.4B shape, and the
    kernel layout of those shapes carries no padding (N a multiple of 8, K/32 of 8)."""
    wt, _ = tile_weight(torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // 32).half())
    assert wt.shape[0] == n // TILE_ROWS >= 132 and wt.numel() == n * k // 2


def test_ops_dispatch_decode_up_to_16_rows(monkeypatch, device):
    seen = []
    monkeypatch.setattr(decode_kernel, "gemm_tiled", lambda a, *args: seen.append(("decode", a.shape[0])))
    monkeypatch.setattr(ops.gemm_kernel, "gemm", lambda a, *args: seen.append(("tile", a.shape[0])))
    w = torch.zeros(8, 16, dtype=torch.uint8, device=device)  # on the device: the triton backend refuses CPU tensors
    sw = torch.ones(8, 1, dtype=torch.float16, device=device)  # on a GPU (the first GPU run of this test failed so)
    for m in (1, 16, 17):
        a = torch.zeros(m, 16, dtype=torch.uint8, device=device)
        gemm_w4a4(a, torch.ones(m, 1, device=device), w, sw, backend="triton")
    assert seen == [("decode", 1), ("decode", 16), ("tile", 17)]


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_ouro_shapes(n, k, m, bits, device):
    """Ouro-1.4B's linears at decode (compiled kernels only, ``dp4a``): within the bound, and the bf16 output is
    the fp32 one rounded once; also through the natural-layout entry points."""
    codes, sa, w, sw, wt, swt = operands(m, n, k, bits, device)
    out = decode_kernel.gemm_tiled(deinterleave_groups(codes), sa, wt, swt, n, torch.float32)
    ref, bound = gemm_fp64(codes.cpu(), sa.cpu(), unpack_int4(w), sw)
    assert bool(((out.cpu().double() - ref).abs() <= bound).all())
    bf16 = decode_kernel.gemm_tiled(deinterleave_groups(codes), sa, wt, swt, n, torch.bfloat16)
    assert torch.equal(bf16, out.to(torch.bfloat16))
    a = ops.reference.pack_int4_unchecked(codes) if bits == 4 else codes
    gemm = gemm_w4a4 if bits == 4 else gemm_w4a8
    assert torch.equal(gemm(a, sa, w.to(device), sw.to(device), torch.float32, backend="triton"), out)
