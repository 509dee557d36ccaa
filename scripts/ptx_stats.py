"""Compile the packed-model kernels for NVIDIA GPUs on a CPU and print what their compiled code does.

    env -u TRITON_INTERPRET python scripts/ptx_stats.py [--arch 90 80] [--kernels decode prefill quantize] [--json]

Triton compiles each kernel ahead of time (``triton.compile`` for ``sm_<arch>``, its bundled ``ptxas -v`` for
registers and spills; no GPU needed) and :mod:`loopq.kernels.ptx` reads the PTX. Per decode GEMM launch shape
(M = 1, 2, 4, 8 tokens: the ``dp4a`` kernel's variants, each unsplit and with K split across programs; 16: the
tensor-core kernel that serves 9..16): the seconds
``triton.compile`` took, the main K loop's PTX instructions per thread, the weight
code bytes that thread loads per iteration and their ratio (instructions per weight byte), ``shfl`` / ``bar.sync``
inside the loop, the widths of the weight-code and weight-scale loads, registers and spill bytes. Per prefill tile
of the config table (W4A4 and W4A8): the ``cp.async.wait_group`` and ``wgmma.wait_group`` depths inside its loops
(a 0 is a full drain), and from the SASS (bundled ``cuobjdump``) of its K loop: the instructions per iteration,
of them the ``I2F`` conversions (a quarter-rate unit before sm_90), the tensor-core MMAs and the rescale's
``FMUL`` + ``FFMA``; registers, spills. Per tensor-core quantizer variant at Ouro's two input widths (decode:
compiled and launched for M = 1; prefill: for M = 4096): rows of Z, tokens per program and per dot, programs at
that M, ``mma.sync`` / ``wgmma`` instructions inside its loops (in the kernel, if it has none), for prefill the
SASS instructions one iteration of its token loop executes (its chunk loop counted as often as it runs) per
transformed value per thread, registers, spills.
``docs/benchmarks.md`` quotes its table;
``tests/kernels/test_ptx_stats.py`` asserts the acceptance limits on the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("error: TRITON_INTERPRET is set; run with it unset (env -u TRITON_INTERPRET ...) to compile for a GPU")

import triton
from triton.backends.compiler import GPUTarget

from loopq.kernels import decode_kernel, gemm_kernel, ptx, quantize_kernel
from loopq.kernels.packing import cdiv
from tests.kernels.gpu_compile import (
    compile_decode,
    compile_gemm,
    compile_quantizer,
    compile_values_gemm,
    ptxas_usage,
    sass_of,
)

DECODE_M = (1, 2, 4, 8, 16)
#: the K splits compiled per token count (``decode_kernel.k_split``: at M <= 8 Ouro's shapes take 1, 2 and 8 on an
#: H100, 4 on an A100; at 9..16 tokens 1, 2 and 4): all of them where a per-byte limit applies (M = 1 and 16), the
#: extremes between
DECODE_SPLITS = {1: (1, 2, 4, 8), 2: (1, 8), 4: (1, 8), 8: (1, 8), 16: (1, 2, 4)}
#: the weight codes are loaded with the evict-first hint, their scales with ``ld.global.cg`` (``decode_kernel``)
CODE_MARK, SCALE_MARK = "evict_first", ".cg."


def decode_row(arch: int, m: int, split: int = 1) -> dict:
    start = time.perf_counter()
    code = compile_decode(GPUTarget("cuda", arch, 32), m, split).asm["ptx"]
    seconds = time.perf_counter() - start
    loop = ptx.main_loop(code, CODE_MARK)
    code_bytes = loop.load_bytes(CODE_MARK)
    regs, spills = ptxas_usage(code, arch)
    return {
        "kernel": "decode",
        "arch": arch,
        "M": m,
        "split": split,
        "variant": _variant(decode_kernel.specialization(m)) + (f", K split {split}" if split > 1 else ""),
        "compile_s": round(seconds, 1),
        "loop_instructions": len(loop.body),
        "code_bytes": sum(code_bytes),
        "per_byte": round(len(loop.body) / sum(code_bytes), 2),
        "shfl": loop.count("shfl"),
        "bar_sync": loop.count("bar.sync"),
        "code_load_bytes": sorted(set(code_bytes)),
        "scale_load_bytes": sorted(set(loop.load_bytes(SCALE_MARK))),
        "dp4a": loop.count("dp4a"),
        "registers": regs,
        "spills": spills,
    }


def _variant(spec: dict) -> str:
    if "ROWS" in spec:
        return f"mma {spec['ROWS']} rows x {spec['SPLIT']} warps" + (", 2 lanes per row" if spec["HALVES"] else "")
    return f"dp4a BLOCK_M={spec['BLOCK_M']}" + (" unrolled" if spec["UNROLL"] else " loop")


def prefill_row(arch: int, cfg: gemm_kernel.PrefillConfig, a_bits: int) -> dict:
    start = time.perf_counter()
    code = compile_gemm(GPUTarget("cuda", arch, 32), a_bits == 4, cfg).asm["ptx"]
    seconds = time.perf_counter() - start
    kernel = f"prefill W4A{a_bits} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} g{cfg.block_g}"
    return {"kernel": kernel, **loop_facts(code, arch, seconds)}


def loop_facts(code: str, arch: int, seconds: float) -> dict:
    """A prefill kernel's compiled K loop: its SASS per iteration (of them ``I2F`` conversions - sm_90's ``I2FP``
    apart -, tensor-core MMAs, ``FMUL`` + ``FFMA``), the waits inside loops, registers and spills."""
    regs, spills = ptxas_usage(code, arch)
    sass = ptx.sass_loop(sass_of(code, arch))
    return {
        "sass_loop": sum(sass.values()),
        "sass_i2f": sass["I2F"],
        "sass_i2fp": sass["I2FP"],
        "sass_mma": sum(v for k, v in sass.items() if "MMA" in k),
        "sass_rescale": sass["FMUL"] + sass["FFMA"],
        "arch": arch,
        "compile_s": round(seconds, 1),
        "cp_async_waits_in_loop": ptx.waits_in_loops(code),
        "wgmma_waits_in_loop": ptx.waits_in_loops(code, "wgmma.wait_group"),
        "registers": regs,
        "spills": spills,
    }


#: bf16 MMA products per clock and SM (dense): an H100 SXM (989 TFLOPS at 132 SMs, 1.83 GHz) and an A100 (312 at 108,
#: 1.41 GHz); 4 schedulers per SM each issue one warp-instruction per clock
BF16_MACS_PER_CLOCK = {90: 2048, 80: 1024}


def values_row(arch: int, cfg: gemm_kernel.PrefillConfig) -> dict:
    """The 16-bit prefill GEMM's tile ``cfg`` for ``arch``: the prefill columns, and the issue-rate ratio of its K
    loop, warp-instructions per iteration / 4 schedulers over the bf16 MMA clocks of the iteration's products (<= 1:
    the loop keeps pace with the tensor cores)."""
    start = time.perf_counter()
    code = compile_values_gemm(GPUTarget("cuda", arch, 32), cfg).asm["ptx"]
    seconds = time.perf_counter() - start
    facts = loop_facts(code, arch, seconds)
    issue = facts["sass_loop"] * cfg.num_warps / 4
    mma_clocks = cfg.block_m * cfg.block_n * 32 * cfg.block_g / BF16_MACS_PER_CLOCK[arch]
    return {
        "kernel": f"prefill values {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} g{cfg.block_g}",
        "block": [cfg.block_m, cfg.block_n, cfg.block_g, cfg.num_warps],
        "issue_per_mma": round(issue / mma_clocks, 3),
        **facts,
        "sass_i2f": facts["sass_i2f"] + facts["sass_i2fp"],  # every int-to-float conversion of the weight
    }


def values_quantizer_row(arch: int, k: int, n1: int, n2: int) -> dict:
    """The prefill quantizer writing bf16 values (the 16-bit scheme's operand) at 4096 tokens: registers, spills."""
    code = compile_quantizer(GPUTarget("cuda", arch, 32), 4096, k, (n1, n2), 4, True, True, True).asm["ptx"]
    regs, spills = ptxas_usage(code, arch)
    return {"kernel": f"quantize values K={k} M=4096", "arch": arch, "registers": regs, "spills": spills}


#: the quantizer's two variants, by the token count they are compiled and launched for: 1 (decode split, up to
#: ``SPLIT_MAX_M`` tokens) and 4096 (whole tokens, prefill)
QUANT_M = (1, 4096)
OURO_FACTORS = ((2048, 32, 64), (5632, 64, 88))


def quantizer_row(arch: int, k: int, n1: int, n2: int, m: int) -> dict:
    """K = 2048 is compiled as the exported Ouro launches it for its QKV and gate/up groups, with the feeding RMSNorm
    folded in (:func:`loopq.quant.packed.fold_feeding_norms`); K = 5632 (down_proj) has no norm before it."""
    norm = k == 2048
    start = time.perf_counter()
    code = compile_quantizer(GPUTarget("cuda", arch, 32), m, k, (n1, n2), 4, fast=True, norm=norm).asm["ptx"]
    seconds = time.perf_counter() - start
    regs, spills = ptxas_usage(code, arch)
    launch = quantize_kernel.quantize_launch(m, k, (n1, n2), 4, True, False, True, True, int(norm))
    # the loops' instructions, or the whole kernel's where it is straight-line (a decode program at K = 2048)
    body = [line for loop in ptx.loops(code) for line in loop.body] or ptx.instructions(code.splitlines())
    cfg = quantize_kernel.dot_config(n1, n2, m)
    per_value = None
    if cfg.tokens > 1:  # prefill: one iteration of the token loop transforms and quantizes `stack` tokens' rows
        executed = ptx.sass_executed(sass_of(code, arch), cdiv(n2, cfg.cj))
        per_value = round(executed / (cfg.stack * cfg.rows * n2 / (32 * cfg.num_warps)), 1)
    return {
        "kernel": f"quantize K={k} M={m}",
        "arch": arch,
        "variant": f"{cfg.rows} rows x {cfg.tokens} tokens, {cfg.stack} per dot" + (", RMSNorm folded" if norm else ""),
        "sass_per_value": per_value,
        "compile_s": round(seconds, 1),
        "grid": launch.grid[0],
        "loop_mma": sum(ptx.opcode(line).startswith("mma.sync") for line in body),
        "loop_wgmma": sum(ptx.opcode(line).startswith("wgmma.mma_async") for line in body),
        "registers": regs,
        "spills": spills,
    }


KERNELS = ("decode", "prefill", "quantize", "values")


def collect(archs: list[int], kernels: tuple[str, ...] = KERNELS, decode_m: tuple[int, ...] = DECODE_M) -> list[dict]:
    rows = []
    for arch in archs:
        if "decode" in kernels:
            rows += [decode_row(arch, m, s) for m in decode_m for s in DECODE_SPLITS[m]]
        if "prefill" in kernels:
            rows += [prefill_row(arch, cfg, bits) for cfg in gemm_kernel.CANDIDATES for bits in (4, 8)]
        if "quantize" in kernels:
            rows += [quantizer_row(arch, k, n1, n2, m) for k, n1, n2 in OURO_FACTORS for m in QUANT_M]
        if "values" in kernels:
            rows += [values_row(arch, cfg) for cfg in gemm_kernel.VALUES_CANDIDATES[arch]]
            rows += [values_quantizer_row(arch, k, n1, n2) for k, n1, n2 in OURO_FACTORS]
    return rows


def markdown(rows: list[dict]) -> str:
    quant = [r for r in rows if r["kernel"].startswith("quantize K=")]
    decode = [r for r in rows if r["kernel"] == "decode"]
    others = [r for r in rows if r["kernel"] != "decode" and r not in quant]
    out = []
    if decode:
        out += [
            "| arch | M | variant | compile s | loop instr. | code B / iter. | instr. / B | shfl | bar.sync | "
            "code load B | scale load B | dp4a | regs | spills |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in decode:
        out.append(
            f"| sm_{r['arch']} | {r['M']} | {r['variant']} | {r['compile_s']} | "
            f"{r['loop_instructions']} | {r['code_bytes']} | {r['per_byte']} | "
            f"{r['shfl']} | {r['bar_sync']} | {r['code_load_bytes']} | {r['scale_load_bytes']} | {r['dp4a']} | "
            f"{r['registers']} | {r['spills']} |"
        )
    if decode and others:
        out.append("")
    if others:
        out += [
            "| arch | kernel | cp.async waits in loop | wgmma waits in loop | SASS loop (I2F / MMA / FMUL+FFMA) "
            "| issue / MMA | regs | spills |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for r in others:
        waits = r.get("cp_async_waits_in_loop", "-"), r.get("wgmma_waits_in_loop", "-")
        sass = (
            f"{r['sass_loop']} ({r['sass_i2f']} / {r['sass_mma']} / {r['sass_rescale']})" if "sass_loop" in r else "-"
        )
        out.append(
            f"| sm_{r['arch']} | {r['kernel']} | {waits[0]} | {waits[1]} | {sass} | {r.get('issue_per_mma', '-')} | "
            f"{r['registers']} | {r['spills']} |"
        )
    if quant and (decode or others):
        out.append("")
    if quant:
        out += [
            "| arch | quantizer | variant | compile s | programs | loop mma.sync | loop wgmma | SASS / value | regs "
            "| spills |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in quant:
        out.append(
            f"| sm_{r['arch']} | {r['kernel']} | {r['variant']} | {r['compile_s']} | {r['grid']} | {r['loop_mma']} | "
            f"{r['loop_wgmma']} | {r['sass_per_value'] or '-'} | {r['registers']} | {r['spills']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90, 80)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS), help="which kernels")
    parser.add_argument("--m", type=int, nargs="+", default=list(DECODE_M), help="decode tokens (1 2 4 8 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per line instead of tables")
    args = parser.parse_args(argv)
    rows = collect(args.arch, tuple(args.kernels), tuple(args.m))
    print(f"triton {triton.__version__}")
    rows = [r | {"triton": triton.__version__} for r in rows]
    print("\n".join(json.dumps(r) for r in rows) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
