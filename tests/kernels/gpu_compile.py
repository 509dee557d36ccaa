"""Compile the Triton kernels ahead of time for an NVIDIA target, without a GPU (``ptxas`` ships with triton).

Run as ``python -m tests.kernels.gpu_compile [arch]`` with TRITON_INTERPRET unset; prints one line per kernel
configuration with PTX facts the bit-exactness relies on.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loopq.kernels import gemm_kernel, quantize_kernel

QUANT_CONFIGS = ((5632, 64, 88, True, 4, 1), (2048, 32, 64, True, 8, 2), (2048, 1, 1, False, 4, 2))
GEMM_CONFIGS = ((True, 128, 64, 8), (False, 16, 32, 4))


def compile_quantizer(target: GPUTarget, k: int, n1: int, n2: int, transform: bool, bits: int, block_m: int):
    np2 = triton.next_power_of_2
    sig = {"x_ptr": "*bf16", "left_ptr": "*fp32", "right_ptr": "*fp32", "scratch_ptr": "*fp32"}
    sig |= {"codes_ptr": "*u8" if bits == 4 else "*i8", "scales_ptr": "*fp32", "M": "i32", "clip": "fp32"}
    const = dict(K=k, KP=np2(k), N1=n1, N2=n2, N1P=np2(n1), N2P=np2(n2), HAS_TRANSFORM=transform, BITS=bits)
    const |= dict(QMIN=float(-(2 ** (bits - 1))), QMAX=float(2 ** (bits - 1) - 1), BLOCK_M=block_m)
    src = ASTSource(quantize_kernel._quantize_kernel, sig | dict.fromkeys(const, "constexpr"), constexprs=const)
    return triton.compile(src, target=target, options={"num_warps": 8, "enable_fp_fusion": False})


def compile_gemm(target: GPUTarget, a_int4: bool, block_m: int, block_n: int, num_warps: int):
    sig = {"a_ptr": "*u8" if a_int4 else "*i8", "sa_ptr": "*fp32", "w_ptr": "*u8", "sw_ptr": "*fp16"}
    sig |= {"out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
    const = dict(A_INT4=a_int4, BLOCK_M=block_m, BLOCK_N=block_n)
    src = ASTSource(gemm_kernel._gemm_kernel, sig | dict.fromkeys(const, "constexpr"), constexprs=const)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "enable_fp_fusion": False})


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    for cfg in QUANT_CONFIGS:
        ptx = compile_quantizer(target, *cfg).asm["ptx"]
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
    for cfg in GEMM_CONFIGS:
        ptx = compile_gemm(target, *cfg).asm["ptx"]
        print("gemm", cfg, "int8 mma", ptx.count(".s32.s8.s8"), "fma", ptx.count("fma."))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 80)
