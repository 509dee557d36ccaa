"""Kernel launches of one static decode step, W4A4 export against its FP teacher (``bench/decode_launches.py``).

Issue 43 asks for "W4A4 decode step launches <= bf16's"; by hand: a quantized group is two launches (quantizer +
GEMM) where the teacher has one ``linear`` per projection, so per layer application Ouro's 7 projections (q, k, v, o,
gate, up, down) become 4 groups x 2 = 8 launches (+1); the two RMSNorms that feed a group and nothing else
(``input_layernorm``, ``post_attention_layernorm``) are folded into the group's quantizer, 8 launches each at 16 bits
(the cast to fp32, pow, mean, + eps, rsqrt, * rsqrt, the cast back, * weight): -16; and each of the T - 1 cross-loop
transition adapters (CTA, paper 4.3) adds 15: the cast in, its weightless RMSNorm (pow, mean, + eps, rsqrt, mul),
(a - 1) * n, + h, + b, n V, * eta, (.) U^T, + and the cast out. At Ouro-1.4B's 24 layers x 4 loops that is
4535 launches against BF16's 5930 (``bench/decode_launches.py``, docs/benchmarks.md). Counted as a GPU launches
them: Triton kernels stubbed (each launch recorded), torch operators through a dispatch mode (views, allocations and
same-dtype casts launch nothing). float16 stands in for bfloat16 (the same casts; the interpreter refuses bfloat16
on a CPU).
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import torch

from loopq.artifacts import load_quantized
from loopq.models import load_looplm
from loopq.paths import REPO_ROOT
from tests.export.conftest import export_student

CTA_LAUNCHES = 15
NORM_LAUNCHES = 8  # one rms_norm at 16 bits


def bench_module():
    spec = importlib.util.spec_from_file_location("decode_launches", REPO_ROOT / "bench" / "decode_launches.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_w4a4_step_launches_fewer_kernels_than_the_teacher(fixtures, tmp_path):
    bench = bench_module()
    export_student(fixtures / "ouro-tiny", 4, tmp_path)
    packed = load_quantized(tmp_path / "export", dtype=torch.float16).eval()
    teacher = load_looplm(fixtures / "ouro-tiny", dtype=torch.float16).eval()
    fp_torch, fp_triton = bench.step_launches(teacher)
    q_torch, q_triton = bench.step_launches(packed)
    layers, loops = len(teacher.model.layers), teacher.default_num_loops
    applications = layers * loops
    assert fp_triton == [] and Counter(q_triton) == {
        "_quantize_kernel": 4 * applications,
        "_decode_kernel": 4 * applications,
    }
    assert Counter(fp_torch)["linear.default"] - Counter(q_torch)["linear.default"] == 7 * applications
    extra = len(q_torch) + len(q_triton) - len(fp_torch)
    assert extra == applications * (1 - 2 * NORM_LAUNCHES) + CTA_LAUNCHES * (loops - 1), Counter(q_torch)
    assert len(q_torch) + len(q_triton) < len(fp_torch)  # issue 43: W4A4 decode step launches <= bf16's
