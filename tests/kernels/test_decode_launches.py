"""Kernel launches of one static decode step, W4A4 export against its FP teacher (``bench/decode_launches.py``).

Issue 43 asks for "W4A4 decode step launches <= bf16's". Counted as a GPU launches them: Triton kernels stubbed
(each launch recorded), the models' norms, RoPE and CTA on their GPU path (``loopq.kernels.rowwise_kernel``: one
launch each), torch operators through a dispatch mode (views, allocations and same-dtype casts launch nothing).
By hand: a quantized group is two launches (quantizer + GEMM) where the teacher has one ``linear`` per projection,
so per layer application Ouro's 7 projections (q, k, v, o, gate, up, down) become 4 groups x 2 = 8 launches (+1);
the two RMSNorms that feed a group and nothing else (``input_layernorm``, ``post_attention_layernorm``) are folded
into the group's quantizer, one launch each (-2); and each of the T - 1 cross-loop transition adapters (CTA, paper
4.3) adds its one launch. So the W4A4 step launches ``L T - (T - 1)`` fewer kernels than BF16's for L layers: at
Ouro-1.4B's 24 layers x 4 loops 2,161 against BF16's 2,254 (``bench/decode_launches.py``, docs/benchmarks.md;
before the one-launch norms, RoPE and CTA 4,535 against 5,930). float16 stands in for bfloat16 (the same casts; the
interpreter refuses bfloat16 on a CPU).
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import torch

from loopq.artifacts import load_quantized
from loopq.models import load_looplm
from loopq.paths import REPO_ROOT
from tests.export.conftest import export_student

CTA_LAUNCHES = 1  # one transition adapter (its RMSNorm, affine and low-rank terms)
NORM_LAUNCHES = 1  # one rms_norm


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
    assert Counter(q_triton) == {
        "_quantize_kernel": 4 * applications,
        "_decode_kernel": 4 * applications,
        "_rms_norm_kernel": 2 * applications + loops,  # the two that feed no group; model.norm after each loop
        "_rope_kernel": 2 * applications,
        "_transition_kernel": loops - 1,
    }
    assert Counter(fp_torch)["linear.default"] - Counter(q_torch)["linear.default"] == 7 * applications
    extra = len(q_torch) + len(q_triton) - len(fp_torch) - len(fp_triton)
    assert extra == applications * (1 - 2 * NORM_LAUNCHES) + CTA_LAUNCHES * (loops - 1), Counter(q_torch)
    assert len(q_torch) + len(q_triton) < len(fp_torch) + len(fp_triton)  # issue 43: W4A4 launches <= bf16's
    norms = 4 * applications + loops  # four per Ouro layer, model.norm after each loop
    assert Counter(fp_triton) == {"_rms_norm_kernel": norms, "_rope_kernel": 2 * applications}
    assert not {"pow.Tensor_Scalar", "rsqrt.default", "neg.default"} & set(fp_torch + q_torch)  # no torch norm, RoPE
