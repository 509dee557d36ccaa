"""The kernels compile for real NVIDIA targets (PTX + ptxas, no GPU needed), with the properties bit-exactness
relies on: no FMA contraction and IEEE division in the quantizer; tensor-core ``mma`` with the tf32x3 split and no
register spills in the quantizer's fast path at Ouro's widths (K = 2048 and 5632, int4 and int8, decode and
prefill splits); the ahead-of-time
proxies of the prefill GEMM's speed (issue 28): int8 ``wgmma`` on sm_90 (``mma.sync`` on sm_80), pipelined
``cp.async`` loads and no register spills for every tile of its config table; and those of the decode GEMM's
speed: 16-byte weight loads and nothing narrower than 8 bytes among them, ``dp4a`` int8 dots, no register spills
(``ptxas -v``), and at least 132 programs (one per H100 SM) at M = 1 on every Ouro-1.4B shape (the main loop's
instruction counts are ``test_ptx_stats.py``'s); the models' one-launch RMSNorm, CTA and RoPE, and calibration's
fused fake quantization: no FMA contraction (torch's separate roundings; IEEE divisions in the latter) and no spills.

The interpreter accepts programs the GPU compiler rejects (and vice versa), so this catches GPU-only breakage.
It runs in a subprocess because this test session has TRITON_INTERPRET=1.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from loopq.kernels.gemm_kernel import CANDIDATES

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the bundled NVIDIA ptxas")
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_nvidia(arch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "0", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.kernels.gpu_compile", str(arch)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    quant, gemm = [s for s in lines if s.startswith("quantize")], [s for s in lines if s.startswith("gemm")]
    assert len(quant) == 3 and len(gemm) == 2 * len(CANDIDATES)  # W4A4 and W4A8 per tile
    assert all(re.search(r"fma 0 div.rn [1-9]\d* div.approx 0$", s) for s in quant), quant
    if arch == 90:  # Hopper: warp-group MMA (wgmma), not the Ampere-style mma.sync
        tensor_core = r"warp_group_dot [1-9]\d* wgmma [1-9]\d* mma.sync 0 int8 [1-9]\d* "
    else:
        tensor_core = r"warp_group_dot 0 wgmma 0 mma.sync [1-9]\d* int8 [1-9]\d* "
    assert all(re.search(tensor_core + r"cp.async [1-9]\d* regs \d+ spills 0$", s) for s in gemm), gemm
    fast = [s for s in lines if s.startswith("fastquant")]
    # the fast quantizer at K = 2048 (32 x 64) and 5632 (64 x 88), int4 and int8, decode (M = 1) and prefill
    # (M = 4096) splits: tf32 dots on tensor cores, split tf32x3 (rna-rounded high halves) and no register spills
    assert len(fast) == 8 and {s.split(" ")[2] for s in fast} == {"32x64", "64x88"}, fast
    assert all(re.search(r" tf32 mma [1-9]\d* tf32 split [1-9]\d* regs \d+ spills 0$", s) for s in fast), fast
    decode = [s for s in lines if s.startswith("decode m")]
    assert len(decode) == 4
    assert all(re.search(r"weight loads 16 B wide [1-9]\d* narrow 0 dp4a [1-9]\d* ", s) for s in decode), decode
    assert all(re.search(r" spills 0$", s) for s in decode), decode
    programs = [int(s.rsplit(" ", 1)[1]) for s in lines if s.startswith("decode-grid")]
    assert len(programs) == 4 and min(programs) >= 132, programs
    rowwise = [s for s in lines if s.startswith("rowwise")]  # RMSNorm, CTA, RoPE: torch's roundings, no spills
    assert len(rowwise) == 3 and all(re.search(r" contracted-fma 0 regs \d+ spills 0$", s) for s in rowwise), rowwise
    # calibration's fake quantization: torch's roundings (no contraction, IEEE divisions), no spills
    fake = [s for s in lines if s.startswith("fakequant")]
    assert len(fake) == 2 and all(
        re.search(r" fma 0 div.rn [1-9]\d* div.approx 0 regs \d+ spills 0$", s) for s in fake
    ), fake
