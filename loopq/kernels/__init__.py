"""Low-bit kernels of exported LoopQ models: a fused activation quantizer and W4A4 / W4A8 GEMMs.

Packed format (K = input dimension of a linear, a multiple of 32; a *group* is 32 consecutive k, g = k // 32)
-------------------------------------------------------------------------------------------------------------
* int4 codes (weights ``[N, K/2]``, W4A4 activations ``[M, K/2]``): ``torch.uint8``, two codes per byte along
  K in natural order, two's complement nibbles -8..7::

      byte[r, j] = (code[r, 2j] & 0xF) | (code[r, 2j + 1] & 0xF) << 4      # low nibble = even k

* int8 codes (W4A8 activations ``[M, K]``): ``torch.int8``, natural K order, -128..127.
* weight scales: ``torch.float16 [N, K/32]``, one per output row and group (rounded from fp32 at export).
* activation scales: ``torch.float32 [M, K/32]``, one per token and group (computed online).
* value = code * scale: symmetric, no zero point; s = max(clip * absmax / q_max, 1e-8), q_max = 2^(b-1) - 1.

Codes are exactly those of :func:`loopq.qspec.quantize_codes` (round-half-to-even), so the fake-quant
student and the exported model agree in the integer domain. The GEMM computes, per 32-element group, an exact
integer dot and accumulates ``dot * s_a[m, g] * s_w[n, g]`` in fp32.

Every entry point takes ``backend="torch" | "triton"`` (``None``: triton on CUDA, torch on CPU). The torch
backend (:mod:`loopq.kernels.reference`) is the CPU path and the test oracle; the Triton quantizer
(:mod:`loopq.kernels.quantize_kernel`) follows its fp32 operation order with FMA contraction disabled, so it
reproduces it bit for bit. The GEMMs add the groups in other orders (the prefill one with FMA): the prefill tile GEMM
(:mod:`loopq.kernels.gemm_kernel`, calls of more than 16 tokens) and the decode GEMM
(:mod:`loopq.kernels.decode_kernel`, 1 to 16 tokens) give fp32 outputs within the rounding bound of
:func:`loopq.kernels.reference.gemm_fp64` of the float64 value of the same codes, not bit-exact. Prefill in bf16
takes the 16-bit scheme instead (``ops.prefill_scheme``: the quantized values rounded to bf16, the weight
dequantized to bf16 in the kernel, bf16 MMAs; within :func:`loopq.kernels.gemm_kernel.values_bound` of those
operands' float64 product).
"""

from loopq.kernels.ops import gemm_w4a4, gemm_w4a8, quantize_activation, triton_interpreted
from loopq.kernels.packing import GROUP_SIZE, pack_int4, quantize_weight, unpack_int4

__all__ = [
    "GROUP_SIZE",
    "gemm_w4a4",
    "gemm_w4a8",
    "pack_int4",
    "quantize_activation",
    "quantize_weight",
    "triton_interpreted",
    "unpack_int4",
]
