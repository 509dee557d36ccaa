"""The compiled decode GEMM meets issue 43's proxies, read from PTX compiled ahead of time for sm_90 and sm_80.

``loopq.kernels.ptx`` is checked first on hand-written PTX (loops, counts, load widths, waits); then
``scripts/ptx_stats.py`` compiles the decode kernel for 1, 2, 4, 8 and 16 tokens (a subprocess: this session has
TRITON_INTERPRET=1): every variant's main loop contains no ``shfl`` or ``bar.sync`` and loads the weight codes and
their scales 16 bytes at a time, nothing spills (``ptxas -v``), each compiles in seconds, and at M = 1 the loop
executes at most 8 PTX instructions per weight byte per thread. The prefill GEMM's tiles: no ``cp.async`` wait for
depth 0 inside the K loop, at most 168 registers, no spills. The quantizer's two program splits: tensor-core
instructions in their loops, no spills, at least 16 programs at M = 1, and at prefill at most 90 SASS
instructions per transformed value at K = 2048 (4 tokens per dot, the feeding RMSNorm folded in), 210 at K = 5632
(2). All under the pinned
Triton and, where ``LOOPQ_EXTRA_TRITON`` names a folder holding another (the GPU image's 3.6), under that one too.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from loopq.kernels import ptx

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]
#: seconds one decode variant may take to compile: each takes 1-3 s (docs/benchmarks.md); the bound is there to catch
#: a return of the fully unrolled code that took minutes at 16 tokens, with room for a loaded machine
COMPILE_S = 60

SAMPLE = """
.visible .entry k(
)
{
	mov.u32 	%r1, 0;
$L__BB0_1:                              // %loop
	// begin inline asm
	@%p1 ld.global.L1::evict_first.L2::cache_hint.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd1 + 0 ], %rd9;
	// end inline asm
	ld.global.cg.v4.b32 { %r6, %r7, %r8, %r9 }, [ %rd2 + 0 ];
	ld.global.b32 { %r10 }, [ %rd3 + 0 ];
	dp4a.s32.s32 %r11, %r2, %r10, %r11;
	cp.async.wait_group 2;
	wgmma.wait_group.sync.aligned 1;
	@%p2 bra 	$L__BB0_1;
$L__BB0_2:
	shfl.sync.bfly.b32 	%r12, %r11, 1, 31, -1;
	bar.sync 	0;
	cp.async.wait_group 0;
	ret;
}
"""


def test_loop_body_counts_by_hand():
    (loop,) = ptx.loops(SAMPLE)
    assert loop.label == "$L__BB0_1" and len(loop.body) == 7  # 3 loads, dp4a, 2 waits, branch
    assert loop.count("shfl") == 0 and loop.count("bar.sync") == 0 and loop.count("dp4a") == 1
    assert loop.load_bytes("evict_first") == [16] and loop.load_bytes(".cg.") == [16]
    assert loop.opcodes()["bra"] == 1 and ptx.main_loop(SAMPLE, "evict_first") is not None
    assert ptx.waits_in_loops(SAMPLE) == [2]  # the depth-0 wait after the loop does not count
    assert ptx.waits_in_loops(SAMPLE, "wgmma.wait_group") == [1]


#: a hand-written ``cuobjdump -sass`` listing: a loop from 0x0020 to its backward branch at 0x0040 (three
#: instructions, one predicated), a forward branch and the listing's closing self-branch, neither a loop body
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/              @P2  BRA 0x60 ;                             /* 0x000000400000a947 */
        /*0020*/                   I2F R2, R0 ;                           /* 0x0000000000027306 */
        /*0030*/              @!P0 FFMA R3, R2, R2, R3 ;                  /* 0x0000000202038223 */
        /*0040*/              @P1  BRA 0x20 ;                             /* 0xffffffd000001947 */
        /*0050*/                   EXIT ;                                 /* 0x000000000000794d */
        /*0060*/                   BRA 0x60;                              /* 0xfffffff000007947 */
"""


def test_sass_loop_by_hand():
    assert ptx.sass_loop(SASS) == {"I2F": 1, "FFMA": 1, "BRA": 1}
    assert ptx.sass_loop("        /*0000*/                   EXIT ;") == {}


#: a loop (0x0010-0x0060) holding another (0x0020-0x0040): 6 instructions listed in the outer one, 3 of them the
#: inner loop's body
NESTED = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG R2, [R4] ;
        /*0020*/                   HMMA R8, R2, R2, R8 ;
        /*0030*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0040*/              @P1  BRA 0x20 ;
        /*0050*/                   STG [R6], R8 ;
        /*0060*/              @P2  BRA 0x10 ;
        /*0070*/                   EXIT ;
"""


def test_sass_executed_counts_the_inner_loop_as_often_as_it_runs():
    assert sum(ptx.sass_loop(NESTED).values()) == 6
    assert ptx.sass_executed(NESTED, 1) == 6 and ptx.sass_executed(NESTED, 3) == 6 + 2 * 3
    assert ptx.sass_executed(SASS, 5) == 3 and ptx.sass_executed("", 2) == 0  # no inner loop; no loop


def test_load_width_and_opcode():
    assert ptx.load_width("ld.global.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];") == 8
    assert ptx.load_width("ld.global.b16 { %rs1 }, [ %rd1 + 0 ];") == 2
    assert ptx.opcode("@%p3 ld.global.b32 { %r1 }, [ %rd2 + 0 ];") == "ld.global.b32"
    with pytest.raises(ValueError, match="no loop"):
        ptx.main_loop(SAMPLE, "evict_last")


#: a second Triton to check the proxies under (compiled code differs between versions; the GPU image runs 3.6):
#: a folder holding its package, e.g. ``pip install --no-deps --target DIR triton==3.6.0`` (docs/benchmarks.md)
EXTRA_TRITON = os.environ.get("LOOPQ_EXTRA_TRITON", "")


def ptx_stats(triton_dir: str, tmp_path: Path, kernels: str, timeout: int) -> list[dict]:
    """``scripts/ptx_stats.py --json`` rows for sm_90 and sm_80 under the pinned Triton or (``"extra"``) the one in
    ``LOOPQ_EXTRA_TRITON`` (skips where unset), with TRITON_INTERPRET unset and a fresh compile cache."""
    if triton_dir == "extra" and not EXTRA_TRITON:
        pytest.skip("LOOPQ_EXTRA_TRITON unset: no second Triton to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = [EXTRA_TRITON] if triton_dir == "extra" else []
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    cmd = [sys.executable, "scripts/ptx_stats.py", "--arch", "90", "80", "--kernels", kernels, "--json"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if triton_dir == "extra":
        assert {r["triton"] for r in rows} != {triton.__version__}, "LOOPQ_EXTRA_TRITON did not change the version"
    return rows


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the bundled NVIDIA ptxas")
@pytest.mark.parametrize("triton_dir", ["pinned", "extra"])
def test_decode_main_loop_proxies(triton_dir, tmp_path):
    """Every decode launch shape (M = 1, 2, 4, 8: the ``dp4a`` kernel, unsplit and with K split across programs
    (all four splits at M = 1); 16: the tensor-core kernel serving 9..16, split 1, 2 and 4) for sm_90 and sm_80: no
    ``shfl`` in the main loop, 16-byte code and scale loads, no spills, each variant
    compiled in seconds; the ``dp4a`` loops without ``bar.sync``, at M = 1 at most 8 PTX instructions per weight
    byte per thread. M = 16: at most 8 per weight byte under the pinned Triton and 7.75 under 3.6 (7.62 measured),
    whose form of the weight operand (two lanes per row, ``decode_kernel.MMA_HALVES``) loads the codes 8 bytes at a
    time (15 per byte before it: the operand was staged through shared memory byte by byte; 8.59 before the scales
    were widened ahead of their layout conversion, docs/benchmarks.md).
    The tensor-core loop stages its operands through shared memory, so it has ``bar.sync`` (one warp-group each)."""
    rows = ptx_stats(triton_dir, tmp_path, "decode", 420)
    variants = [(m, s) for m in (1, 2, 4, 8) for s in ((1, 2, 4, 8) if m == 1 else (1, 8))]
    variants += [(16, 1), (16, 2), (16, 4)]
    assert sorted((r["arch"], r["M"], r["split"]) for r in rows) == [(a, *v) for a in (80, 90) for v in variants]
    for r in rows:
        assert r["shfl"] == 0 and r["spills"] == 0, r
        halves = "2 lanes per row" in r["variant"]
        assert r["code_load_bytes"] == [8 if halves else 16] and r["scale_load_bytes"] == [16], r
        assert r["compile_s"] <= COMPILE_S, r
        assert r["bar_sync"] == 0 or r["variant"].startswith("mma"), r
    for r in (r for r in rows if r["M"] == 1):
        assert r["per_byte"] <= 8, r
        assert r["dp4a"] == 2 * r["code_bytes"] // 4, r  # two dp4a per 4-byte weight word at M = 1
    for r in (r for r in rows if r["M"] == 16):
        halves = "2 lanes per row" in r["variant"]  # before Triton 3.9 (the GPU image's 3.6)
        assert halves == (tuple(int(v) for v in r["triton"].split(".")[:2]) < (3, 9)), r
        assert r["variant"].startswith("mma") and r["per_byte"] <= (7.75 if halves else 8), r


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the bundled NVIDIA ptxas")
@pytest.mark.parametrize("triton_dir", ["pinned", "extra"])
def test_prefill_loop_proxies(triton_dir, tmp_path):
    """Every tile of the prefill config table, W4A4 and W4A8, for sm_90 and sm_80: the K loop never waits for its
    copies to drain (no ``cp.async.wait_group 0`` inside a loop, and at least one deeper wait: the loop is
    pipelined), at most 168 registers, no spills; in the loop's SASS: tensor-core MMAs and exactly the rescale the
    kernel's docstring describes (one FMUL and one FFMA per accumulator element per group, and one int-to-float
    conversion: ``I2F`` on sm_80, ``I2FP`` on sm_90), the issue-rate cost of docs/benchmarks.md. Eight compiles,
    about a second each."""
    rows = ptx_stats(triton_dir, tmp_path, "prefill", 300)
    assert len(rows) == 2 * 2 * 2, rows  # two archs, two tiles, two activation widths
    for r in rows:
        assert r["cp_async_waits_in_loop"] and min(r["cp_async_waits_in_loop"]) > 0, r
        assert r["registers"] <= 168 and r["spills"] == 0, r
        # the SASS of the K loop: tensor-core MMAs, and a rescale (FMUL + FFMA) per accumulator element per group
        # (64 x 128 / 64 x 64 tiles, 256 threads, 2 / 1 groups per iteration: 32 or 16 elements per thread per group)
        assert r["sass_mma"] > 0, r
        per_group = r["sass_rescale"] / (2 if "64x128" in r["kernel"] else 1)
        assert per_group == 2 * (32 if "64x128" in r["kernel"] else 16), r
        # one int-to-float conversion per accumulator element per group: I2F on sm_80, I2FP (another unit) on sm_90
        assert r["sass_i2f"] == (0 if r["arch"] == 90 else r["sass_rescale"] // 2), r


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the bundled NVIDIA ptxas")
@pytest.mark.parametrize("triton_dir", ["pinned", "extra"])
def test_quantizer_proxies(triton_dir, tmp_path):
    """The tensor-core quantizer at Ouro's input widths (K = 2048 and 5632), its decode split (compiled and launched
    for M = 1) and its prefill one (M = 4096), for sm_90 and sm_80: tensor-core instructions (``mma.sync`` or
    ``wgmma``) inside its loops, no spills, each compiled in seconds, and at M = 1 at least 16 programs per token
    (the former fast path ran one)."""
    rows = ptx_stats(triton_dir, tmp_path, "quantize", 300)
    keys = sorted((r["arch"], r["kernel"]) for r in rows)
    assert keys == sorted((a, f"quantize K={k} M={m}") for a in (80, 90) for k in (2048, 5632) for m in (1, 4096))
    for r in rows:
        assert r["spills"] == 0 and r["loop_mma"] + r["loop_wgmma"] > 0, r
        assert r["compile_s"] <= COMPILE_S, r
        assert r["grid"] >= (16 if r["kernel"].endswith("M=1") else 512), r
    # prefill: 59.1-79.1 SASS instructions per transformed value and thread at K = 2048 (4 tokens per dot, the
    # feeding RMSNorm folded in as the exported Ouro launches it: 43.8-66.1 without) and 169.5-186.4 at K = 5632 (2
    # per dot) under both Tritons; one token per dot with Triton's tf32x3 and a division per value executed 144-146
    # and 334-338 (docs/benchmarks.md)
    for k, limit in ((2048, 90), (5632, 210)):
        stacked = [r for r in rows if r["kernel"] == f"quantize K={k} M=4096"]
        assert len(stacked) == 2 and all(r["sass_per_value"] <= limit for r in stacked), stacked


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the bundled NVIDIA ptxas")
@pytest.mark.parametrize("triton_dir", ["pinned", "extra"])
def test_values_prefill_proxies(triton_dir, tmp_path):
    """The 16-bit prefill scheme (``gemm_kernel.VALUES_CANDIDATES``, sm_90 and sm_80) and its quantizer writing bf16
    values at Ouro's widths: pipelined K loops (no ``cp.async`` wait for depth 0 inside), MMAs in the loop, no
    spills; the per-group scales cost one conversion and one multiply per *weight* element per thread (at most twice
    that on sm_80, whose warps share B columns), nothing per accumulator element; and sm_90's large tile, the one
    M = 4096 takes, issues its K loop within the bf16 MMA time of its products (warp-instructions / 4 per clock
    against 2048 products per clock: 0.91-0.94 measured under 3.6 / 3.9, against 4.0 for the integer kernel's 64 x
    128 tile) at <= 128 registers, two programs of 8 warps per SM. sm_80's 64 x 128: 1.15-1.27 (asserted <= 1.35).
    Every tile leaves room for two programs per SM (65,536 registers): what the integer tiles' 168-register limit
    is for (their 8 warps; these tiles' 4-warp programs may use more: sm_80's 64 x 128 takes 240 under 3.6)."""
    rows = ptx_stats(triton_dir, tmp_path, "values", 300)
    gemms = [r for r in rows if r["kernel"].startswith("prefill values")]
    assert len(gemms) == 4 and len(rows) == 8, rows  # two archs: two tiles, two quantizer widths
    for r in rows:
        assert r["spills"] == 0, r
    for r in gemms:
        bm, bn, bg, warps = r["block"]
        assert r["cp_async_waits_in_loop"] and min(r["cp_async_waits_in_loop"]) > 0, r
        assert r["sass_mma"] > 0, r
        assert 2 * r["registers"] * 32 * warps <= 65536, r  # two programs fit an SM's registers (the 168 rule's aim)
        per_thread = bn * 32 * bg // (32 * warps)  # weight elements each thread dequantizes per K step
        assert r["sass_i2f"] in (per_thread, 2 * per_thread) and r["sass_rescale"] == r["sass_i2f"], r
        if r["arch"] == 90 and bm == 128:
            assert r["issue_per_mma"] <= 1.0 and r["registers"] <= 128, r
        if r["arch"] == 80 and bn == 128:
            assert r["issue_per_mma"] <= 1.35, r
