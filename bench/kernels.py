"""GPU benchmark: fused activation quantizer + W4A4 / W4A8 GEMM against a BF16 ``torch.matmul``.

Shapes are Ouro-1.4B's linears (K x N = 2048 x 2048 attention, 2048 x 5632 gate/up, 5632 x 2048 down) at
M = 1 .. 4096 tokens. Each low-bit time is quantizer (with the online Kronecker transform unless
``--no-transform``) + GEMM, the cost a quantized linear pays per call; ``x`` is the speed-up over BF16
(> 1 = faster). Before timing, the Triton results are checked against the torch backend on the same GPU.

    python bench/kernels.py [--no-transform] [--tokens 1 16 128]

Without CUDA it prints "no GPU: ..." and exits 0 (the Triton interpreter is far too slow to time).
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = ((2048, 2048), (2048, 5632), (5632, 2048))  # (K, N)
TOKENS = (1, 16, 128, 1024, 4096)
CLIP = 0.9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-transform", action="store_true", help="time the quantizer without the transform")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="values of M")
    return parser.parse_args(argv)


def factors(k: int, transform: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    from loopq.quant.transforms import kron_factors

    if not transform:
        return None, None
    n1, n2 = kron_factors(k)
    return tuple(torch.eye(n, device="cuda") + 0.1 * torch.randn(n, n, device="cuda") for n in (n1, n2))


def check(k: int, n: int, transform: bool) -> str:
    """Triton vs torch backend on the GPU: quantizer bit-exact, GEMMs within fp32 rounding."""
    from loopq.kernels import gemm_w4a4, gemm_w4a8, quantize_activation, quantize_weight

    x = torch.randn(77, k, device="cuda", dtype=torch.bfloat16)
    left, right = factors(k, transform)
    w, sw = quantize_weight(torch.randn(n, k, device="cuda"))
    report = []
    for bits, gemm in ((4, gemm_w4a4), (8, gemm_w4a8)):
        tri = quantize_activation(x, left, right, CLIP, bits, backend="triton")
        ref = quantize_activation(x, left, right, CLIP, bits, backend="torch")
        exact = all(torch.equal(t, r) for t, r in zip(tri, ref, strict=True))
        out_t = gemm(*tri, w, sw, torch.float32, backend="triton")
        out_r = gemm(*tri, w, sw, torch.float32, backend="torch")
        err = float(((out_t - out_r).abs() / out_r.abs().clamp_min(1e-3)).max())
        report.append(f"W4A{bits}: quantizer {'bit-exact' if exact else 'MISMATCH'}, GEMM max rel err {err:.1e}")
    return "; ".join(report)


def bench_row(k: int, n: int, m: int, transform: bool) -> str:
    from triton.testing import do_bench

    from loopq.kernels import gemm_w4a4, gemm_w4a8, quantize_activation, quantize_weight

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    w, sw = quantize_weight(weight)
    left, right = factors(k, transform)
    t_bf16 = do_bench(lambda: torch.matmul(x, weight.T))
    cells = [f"{k:>5} {n:>5} {m:>5} | {t_bf16 * 1e3:9.1f}"]
    for bits, gemm in ((4, gemm_w4a4), (8, gemm_w4a8)):
        a, sa = quantize_activation(x, left, right, CLIP, bits)
        t_quant = do_bench(lambda bits=bits: quantize_activation(x, left, right, CLIP, bits))
        t_gemm = do_bench(lambda a=a, sa=sa, gemm=gemm: gemm(a, sa, w, sw, torch.bfloat16))
        total = t_quant + t_gemm
        cells.append(f"      {t_quant * 1e3:8.1f} {t_gemm * 1e3:8.1f} {t_bf16 / total:6.2f}x {t_bf16 / t_gemm:6.2f}x")
    return " | ".join(cells)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: the Triton kernels are benchmarked on CUDA only; nothing to do")
        return 0
    from loopq.kernels import triton_interpreted

    if triton_interpreted():
        print("no GPU kernels: TRITON_INTERPRET is set; unset it to benchmark the compiled kernels")
        return 0
    transform = not args.no_transform
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | transform={'on' if transform else 'off'} | times in microseconds")
    for k, n in SHAPES:
        print(f"check K={k} N={n}: {check(k, n, transform)}")
    head = f"{'quant':>8} {'gemm':>8} {'x q+gemm':>7} {'x gemm':>7}"
    print(f"{'K':>5} {'N':>5} {'M':>5} | {'bf16 mm':>9} | W4A4: {head} | W4A8: {head}")
    for k, n in SHAPES:
        for m in args.tokens:
            print(bench_row(k, n, m, transform), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
