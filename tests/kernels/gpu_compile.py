"""Compile the Triton kernels ahead of time for an NVIDIA target, without a GPU (``ptxas`` ships with triton).

Run as ``python -m tests.kernels.gpu_compile [arch]`` with TRITON_INTERPRET unset; prints one line per kernel
configuration with PTX facts the bit-exactness relies on; for the quantizer's fast ``tl.dot`` path at Ouro's
widths (its decode and prefill program splits), its tf32 tensor-core ``mma`` instructions and the rounding of
the tf32x3 split (``quantize_kernel._split_tf32``: an ``and`` with ``0xFFFFE000``), registers and spills; for
the prefill GEMM (every tile of its config table, W4A4 and W4A8) the tensor-core instruction its dots lower to
(``warp_group_dot`` in TTGIR and ``wgmma`` in PTX on sm_90, ``mma.sync`` on sm_80), its pipelined ``cp.async``
loads, registers and spills; for the decode GEMM the facts its speed relies on:
the weight's loads by width (``ld.global`` / ``cp.async`` with the evict-first cache hint only the weight carries),
registers and spills as ``ptxas -v`` reports them, and its grid at M = 1 on Ouro-1.4B's shapes.
"""

import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loopq.commands.gpu_check.kernel_bench import SHAPES
from loopq.kernels import decode_kernel, fake_quant_kernel, gemm_kernel, quantize_kernel, rowwise_kernel
from loopq.kernels.packing import TILE_ROWS

#: (tokens, K, Kronecker factors or None, bits) of the exact quantizer: its prefill split at 5632 = 64 x 88 (through
#: the scratch rows), its decode split at 2048 = 32 x 64, and no transform (all 2048 channels of a row per program)
QUANT_CONFIGS = ((4096, 5632, (64, 88), 4), (16, 2048, (32, 64), 8), (4096, 2048, None, 4))
#: the fast quantizer at Ouro-1.4B's input widths (``kron_factors``: 2048 = 32 x 64, 5632 = 64 x 88), int4 and int8
FAST_QUANT_CONFIGS = tuple((k, n1, n2, bits) for k, n1, n2 in ((2048, 32, 64), (5632, 64, 88)) for bits in (4, 8))
#: tokens per launch whose dp4a decode kernels are checked here: one of each compiled variant (BLOCK_M 1, 2, 4, 8;
#: 9..16 tokens run the tensor-core kernel, checked by ``scripts/ptx_stats.py``)
DECODE_M = (1, 2, 4, 8)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
#: Triton's pointer type of each torch dtype a launch passes
POINTER = {
    torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
    torch.uint8: "*u8", torch.int8: "*i8", torch.int32: "*i32",
}  # fmt: skip
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call, launches nothing."""

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel, self.call = kernel, None

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: setattr(self, "call", (args, kwargs))


def as_launched(module: ModuleType, names: tuple[str, ...], launch: Callable[[], None]) -> tuple:
    """(kernel, signature, constexprs, options) of the call ``launch()`` makes to one of ``module``'s kernels
    ``names``, with each pointer typed by the tensor the host code really passes: a signature written here by hand
    once typed an unread stand-in pointer fp32 where the launcher passed the bf16 input, and the GPU compiler
    rejected what this file compiled."""
    saved = {name: getattr(module, name) for name in names}
    recorders = {name: _Recorder(kernel) for name, kernel in saved.items()}
    try:
        for name, recorder in recorders.items():
            setattr(module, name, recorder)
        launch()
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)
    (recorder,) = [r for r in recorders.values() if r.call is not None]
    args, kwargs = recorder.call
    options = {key: kwargs.pop(key) for key in OPTIONS if key in kwargs}
    sig = {}
    for name, arg in zip(recorder.kernel.arg_names, args, strict=False):
        sig[name] = POINTER[arg.dtype] if isinstance(arg, torch.Tensor) else "i32" if isinstance(arg, int) else "fp32"
    return recorder.kernel, sig | dict.fromkeys(kwargs, "constexpr"), kwargs, options, divisibility(args)


def divisibility(args: tuple) -> dict:
    """The ``tt.divisibility`` attributes Triton's JIT gives a launch with these arguments (its specialization):
    16 for a tensor whose address is a multiple of 16 bytes (torch's allocations are) and for an integer that is a
    multiple of 16. Without them the compiler must assume unaligned pointers and emits scalar loads and stores,
    which is not the code a GPU runs (the quantizer's ahead-of-time compile lacked them until session 23). Not
    copied: the JIT also makes an integer equal to 1 a constant (M = 1 at decode), and re-specializes every call
    (a misaligned view gets unaligned code there)."""
    attrs = {}
    for i, arg in enumerate(args):
        aligned_tensor = isinstance(arg, torch.Tensor) and arg.data_ptr() % 16 == 0
        if aligned_tensor or (isinstance(arg, int) and not isinstance(arg, bool) and arg % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_quantizer(
    target: GPUTarget,
    m: int,
    k: int,
    factors: tuple[int, int] | None,
    bits: int,
    fast: bool,
    norm: bool = False,
    values: bool = False,
):
    """The quantizer as :meth:`quantize_kernel.QuantizeLaunch.run` launches it on a GPU for ``m`` bf16 tokens: the
    diagonal folded in (the exported model multiplies by 1/d in the quantizer), packed int4 or int8 codes; ``fast``:
    the tensor-core path (:func:`~quantize_kernel.dot_config`: the decode split up to 16 tokens, whole tokens above);
    ``norm``: with the feeding RMSNorm folded in (a bf16 weight, as the exported Ouro's QKV and gate/up groups);
    ``values``: writing the quantized values in bf16 (the 16-bit prefill scheme's operand) instead of the codes."""
    code = quantize_kernel.norm_code(torch.bfloat16, torch.empty(0, dtype=torch.bfloat16)) if norm else 0
    launch = quantize_kernel.quantize_launch(m, k, factors, bits, True, False, fast, True, code, values)
    x, inv_d = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(k)
    weight = torch.empty(k, dtype=torch.bfloat16) if norm else None
    left, right = (torch.empty(f, f) for f in factors) if factors else (None, None)
    scratch = torch.empty(launch.scratch_rows(), k) if launch.needs_scratch else None
    codes, scales = quantize_kernel._outputs(x, bits, values=torch.bfloat16 if values else None)

    def run() -> None:
        launch.run(x, inv_d, left, right, scratch, codes, scales, 1.0, weight, 1e-6)

    kernel, sig, const, options, attrs = as_launched(quantize_kernel, ("_quantize_kernel", "_quantize_dot_kernel"), run)
    return triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=target, options=options)


def compile_gemm(target: GPUTarget, a_int4: bool, cfg: gemm_kernel.PrefillConfig):
    """The prefill tile kernel as ``ops.quantized_linear`` launches it for more than 16 tokens: a bias and a bf16
    output."""
    sig = {"a_ptr": "*u8" if a_int4 else "*i8", "sa_ptr": "*fp32", "w_ptr": "*u8", "sw_ptr": "*fp16"}
    sig |= {"bias_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "G": "i32"}
    const = dict(A_INT4=a_int4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_G=cfg.block_g, GROUP_M=cfg.group_m)
    const |= dict(HAS_BIAS=True)
    # what the launcher specializes on Ouro's shapes: 16-byte aligned pointers, N and the group count multiples of
    # 16
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8)}
    src = ASTSource(gemm_kernel._gemm_kernel, sig | dict.fromkeys(const, "constexpr"), constexprs=const, attrs=aligned)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": True}
    return triton.compile(src, target=target, options=options)


def compile_values_gemm(target: GPUTarget, cfg: gemm_kernel.PrefillConfig):
    """The 16-bit prefill GEMM (:func:`gemm_kernel._gemm_values_kernel`) as ``ops.quantized_linear`` launches it
    for more than 16 bf16 tokens: bf16 activation values, a bias, a bf16 output, 16-byte aligned pointers, N and
    the group count multiples of 16."""
    sig = {"a_ptr": "*bf16", "w_ptr": "*u8", "sw_ptr": "*fp16", "bias_ptr": "*fp32", "out_ptr": "*bf16"}
    sig |= {"M": "i32", "N": "i32", "G": "i32"}
    const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_G=cfg.block_g, GROUP_M=cfg.group_m, HAS_BIAS=True)
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7)}
    src = ASTSource(
        gemm_kernel._gemm_values_kernel, sig | dict.fromkeys(const, "constexpr"), constexprs=const, attrs=aligned
    )
    return triton.compile(src, target=target, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def compile_decode(target: GPUTarget, m: int, split: int = 1):
    """The decode GEMM as ``gemm_tiled`` launches it for ``m`` tokens (:func:`decode_kernel._decode_kernel` up to 8,
    :func:`decode_kernel._decode_mma_kernel` from 9), K split ``split`` ways; its
    :func:`~decode_kernel.specialization` and :func:`~decode_kernel.compile_options`, bf16 output, a bias, 16-byte
    aligned pointers as torch allocates them; the workspace pointers as ``gemm_tiled`` passes them: fp32 partials
    and int32 counters, or the fp32 activation scales and int32 weight words standing in for them)."""
    mma = decode_kernel.uses_mma(m)
    sig = {"a_ptr": "*i8" if mma else "*i32", "sa_ptr": "*fp32", "w_ptr": "*u8" if mma else "*i32"}
    sig |= {"sw_ptr": "*fp16", "bias_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32"}
    sig |= {"count_ptr": "*u8" if mma and split == 1 else "*i32", "M": "i32", "N": "i32", "G": "i32"}
    const = {"HAS_BIAS": True, **decode_kernel.specialization(m), "KSPLIT": split, "ASM": True}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(8)}
    kernel = decode_kernel._decode_mma_kernel if mma else decode_kernel._decode_kernel
    src = ASTSource(kernel, sig | dict.fromkeys(const, "constexpr"), constexprs=const, attrs=aligned)
    return triton.compile(src, target=target, options=decode_kernel.compile_options(m))


def compile_rowwise(target: GPUTarget) -> dict[str, object]:
    """The models' one-launch RMSNorm, CTA and RoPE (:mod:`loopq.kernels.rowwise_kernel`) as launched at decode on
    Ouro-1.4B's widths in bf16: the norm with its bf16 weight over 2048 features, the transition adapter (rank 8),
    RoPE on a transposed query view of 16 heads x 128."""
    x, g = torch.empty(1, 2048, dtype=torch.bfloat16), torch.empty(2048, dtype=torch.bfloat16)
    a, b, eta, u, v = torch.empty(2048), torch.empty(2048), torch.empty(8), torch.empty(2048, 8), torch.empty(2048, 8)
    q = torch.empty(1, 1, 16, 128, dtype=torch.bfloat16).transpose(1, 2)
    cos = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    launches = {
        "_rms_norm_kernel": lambda: rowwise_kernel.rms_norm(x, g, 1e-6),
        "_transition_kernel": lambda: rowwise_kernel.transition(x, a, b, eta, u, v, 1e-6),
        "_rope_kernel": lambda: rowwise_kernel.rope(q, cos, cos),
    }
    compiled = {}
    for name, launch in launches.items():
        kernel, sig, const, options, attrs = as_launched(rowwise_kernel, (name,), launch)
        src = ASTSource(kernel, sig, constexprs=const, attrs=attrs)
        compiled[name] = triton.compile(src, target=target, options=options)
    return compiled


def compile_fake_quant(target: GPUTarget) -> dict[str, object]:
    """Calibration's fused fake quantization (:mod:`loopq.kernels.fake_quant_kernel`), forward and backward, as
    launched for a weight of Ouro-1.4B's o_proj (2048 x 2048, a clip per row), 4 bits."""
    x, clip, gy = torch.empty(2048, 2048), torch.empty(2048, 1, 1), torch.empty(2048, 2048)
    launches = {
        "_forward_kernel": lambda: fake_quant_kernel.forward(x, clip, 4),
        "_backward_kernel": lambda: fake_quant_kernel.backward(x, clip, gy, 4),
    }
    compiled = {}
    for name, launch in launches.items():
        kernel, sig, const, options, attrs = as_launched(fake_quant_kernel, (name,), launch)
        compiled[name] = triton.compile(
            ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=target, options=options
        )
    return compiled


#: -0, 1 and -1 in bf16 and fp16, alone and as pairs: an ``fma`` with one of them as its addend or multiplier is a
#: plain product or sum, rounded once (sm_80 has no bf16 ``mul`` / ``add`` and writes them so)
_EXACT = {0x8000, 0x3F80, 0xBF80, 0x3C00, 0xBC00}
_EXACT |= {v << 16 | v for v in _EXACT}


def contracted_16bit(ptx: str) -> int:
    """``fma.rn`` on bf16 / f16 values or pairs whose multiplier and addend are both not one of :data:`_EXACT` (a
    real contraction of a product into a sum: another rounding than torch's)."""
    movs = re.findall(r"mov\.b(?:16|32)\s+(%rs?\d+), (-?(?:0x[0-9a-fA-F]+|\d+));", ptx)
    consts = {reg: int(value, 0) & 0xFFFFFFFF for reg, value in movs}
    fmas = re.findall(r"fma\.rn\.(?:bf16|f16)(?:x2)?\s+%rs?\d+, %rs?\d+, (%rs?\d+), (%rs?\d+);", ptx)
    return sum(consts.get(b) not in _EXACT and consts.get(c) not in _EXACT for b, c in fmas)


def weight_load_bytes(ptx: str) -> list[int]:
    """Bytes per thread of each load instruction that can carry the weight: ``ld.global`` with the evict-first
    hint (only the weight's ``eviction_policy="evict_first"`` gives it) and, where the loop is pipelined through
    shared memory, every ``cp.async`` (sm_80 drops the hint there; the activation copies are among them)."""
    sizes = []
    for line in ptx.splitlines():
        if "cp.async" in line and "shared.global" in line:
            sizes.append(int(re.search(r"\], (0x[0-9a-f]+)", line).group(1), 16))
        elif "ld.global" in line and "evict_first" in line:
            vec = re.search(r"\.v(\d)\.b(\d+)", line)
            scalar = re.search(r"\.b(\d+) ", line)
            sizes.append(int(vec.group(1)) * int(vec.group(2)) // 8 if vec else int(scalar.group(1)) // 8)
    return sizes


def sass_of(ptx: str, arch: int) -> str:
    """The SASS listing of ``ptx`` for ``arch``: the bundled ``ptxas`` (as :func:`ptxas_usage`) and ``cuobjdump``."""
    ptxas = BIN / ("ptxas-blackwell" if arch >= 90 and (BIN / "ptxas-blackwell").exists() else "ptxas")
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        subprocess.run([str(ptxas), f"--gpu-name={gpu}", str(src), "-o", str(cubin)], capture_output=True, check=True)
        return subprocess.run(
            [str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes stored + loaded) from the bundled ``ptxas -v`` (the one triton uses for ``arch``)."""
    ptxas = BIN / ("ptxas-blackwell" if arch >= 90 and (BIN / "ptxas-blackwell").exists() else "ptxas")
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [str(ptxas), "-v", f"--gpu-name={gpu}", str(src), "-o", str(Path(tmp) / "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return int(re.search(r"Used (\d+) registers", log).group(1)), spills


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    for cfg in QUANT_CONFIGS:
        ptx = compile_quantizer(target, *cfg, fast=False).asm["ptx"]
        print(
            "quantize",
            cfg,
            "fma",
            ptx.count("fma."),
            "div.rn",
            ptx.count("div.rn.f32"),
            "div.approx",
            ptx.count("div.approx") + ptx.count("div.full"),
        )
    for k, n1, n2, bits in FAST_QUANT_CONFIGS:
        for m in (1, 4096):  # the decode split and the prefill one
            ptx = compile_quantizer(target, m, k, (n1, n2), bits, fast=True).asm["ptx"]
            regs, spills = ptxas_usage(ptx, arch)
            mma = len(re.findall(r"\b(?:mma\.sync\.aligned|wgmma\.mma_async)\S*\.tf32\b", ptx))
            split = len(re.findall(r"and\.b32\s+%r\d+, %r\d+, -8192;", ptx))  # quantize_kernel._split_tf32
            print(f"fastquant K={k} {n1}x{n2} a{bits} M={m} tf32 mma", mma, "tf32 split", split, end=" ")
            print("regs", regs, "spills", spills)
    for cfg in gemm_kernel.CANDIDATES:
        for a_int4 in (True, False):
            compiled = compile_gemm(target, a_int4, cfg)
            ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
            regs, spills = ptxas_usage(ptx, arch)
            name = f"gemm m{cfg.block_m} n{cfg.block_n} g{cfg.block_g} w{cfg.num_warps} s{cfg.num_stages}"
            print(name, f"a{4 if a_int4 else 8}", "warp_group_dot", ttgir.count("ttng.warp_group_dot "), end=" ")
            print("wgmma", ptx.count("wgmma.mma_async"), "mma.sync", ptx.count("mma.sync.aligned"), end=" ")
            print("int8", ptx.count(".s32.s8.s8"), "cp.async", ptx.count("cp.async.c"), "regs", regs, "spills", spills)
    for m in DECODE_M:
        ptx = compile_decode(target, m).asm["ptx"]
        sizes = weight_load_bytes(ptx)
        regs, spills = ptxas_usage(ptx, arch)
        wide, narrow = sum(b >= 8 for b in sizes), sum(b < 8 for b in sizes)
        print(f"decode m{m} weight loads", max(sizes, default=0), "B wide", wide, "narrow", narrow, end=" ")
        print("dp4a", ptx.count("dp4a.s32.s32"), "regs", regs, "spills", spills)
    for n, k in SHAPES:
        print(f"decode-grid N={n} K={k} M=1 programs {triton.cdiv(n, TILE_ROWS)}")
    for name, compiled in compile_rowwise(target).items():
        ptx = compiled.asm["ptx"]
        regs, spills = ptxas_usage(ptx, arch)
        # sm_80 has no bf16 mul / add and writes them as fma.rn.bf16x2 with -0 / 1 (exact): only others count
        fmas = ptx.count("fma.rn.f32") + contracted_16bit(ptx)
        print(f"rowwise {name} contracted-fma", fmas, "regs", regs, "spills", spills)
    for name, compiled in compile_fake_quant(target).items():
        ptx = compiled.asm["ptx"]
        regs, spills = ptxas_usage(ptx, arch)
        approx = ptx.count("div.approx") + ptx.count("div.full")
        print(f"fakequant {name} fma", ptx.count("fma.rn.f32"), "div.rn", ptx.count("div.rn.f32"), "div.approx", approx,
              "regs", regs, "spills", spills)  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 80)
