"""GPU benchmark: fused activation quantizer + W4A4 / W4A8 GEMM against a BF16 ``torch.matmul``.

Shapes are Ouro-1.4B's linears as the exported model runs them, (N, K) = (6144, 2048) fused QKV, (2048, 2048)
o_proj, (11264, 2048) fused gate+up, (2048, 5632) down_proj, at M = 1, 16, 256, 4096 tokens. Every shape is first
checked against the torch backend on the same GPU (quantizer bit-exact, GEMM within fp32 rounding), then timed
with ``triton.testing.do_bench``: microseconds, TFLOP/s / TOPS, the fraction of the GPU's dense BF16 and int8
tensor-core peaks, and the speed-up over BF16 of the GEMM alone (``x mm``) and of quantizer + GEMM (``x q+mm``,
what a quantized linear pays per call). The code is :mod:`loopq.commands.gpu_check.kernel_bench`, the ``kernel-bench``
stage of ``python -m loopq.gpu_check``; this is it alone.

    python bench/kernels.py [--no-transform] [--tokens 1 16 256 4096]

Exit status 1 on a mismatch. Without CUDA it prints "no GPU: ..." and exits 0 (the Triton interpreter is far too
slow to time; the kernels are tested on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopq.commands.gpu_check import kernel_bench
from loopq.commands.gpu_check.peaks import peaks_for
from loopq.commands.gpu_check.table import FAIL
from loopq.kernels import triton_interpreted


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-transform", action="store_true", help="time the quantizer without the transform")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(kernel_bench.TOKENS), help="values of M")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: the Triton kernels are benchmarked on CUDA only; nothing to do")
        return 0
    if triton_interpreted():
        print("no GPU kernels: TRITON_INTERPRET is set; unset it to benchmark the compiled kernels")
        return 0
    transform = not args.no_transform
    name = torch.cuda.get_device_name()
    peaks = peaks_for(name)
    print(f"{name} ({peaks.model if peaks else 'peaks n/a'}) | transform={'on' if transform else 'off'}")
    rows = kernel_bench.measure(kernel_bench.SHAPES, args.tokens, transform)
    print(kernel_bench.format_rows(rows, peaks))
    status, summary = kernel_bench.summarize(rows, peaks)
    print(f"{status}: {summary}")
    return 1 if status == FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
