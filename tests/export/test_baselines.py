"""The baselines through the unchanged exporter: SmoothQuant's online diagonal, QuaRot's fixed Hadamard factors and
SpinQuant's learned Cayley rotations are written as the packed format's 1/d, P1 and P2, and the loaded int model is
bit-exact with the fake-quant student evaluated with the kernels' numerics (as for LoopQ in test_export.py)."""

import json

import pytest
import torch

from loopq.artifacts import export_student, load_quantized
from loopq.artifacts.layout import EXPORT_META as META
from loopq.models import load_looplm
from loopq.quant import QuantConfig, prepare, quant_groups
from loopq.quant.prepare import prepare_static

from .conftest import use_kernel_numerics

ARCHS = {"ouro": "ouro-tiny", "loopformer": "loopformer-tiny", "parcae": "parcae-tiny"}
CASES = [(arch, method, a_bits) for arch in sorted(ARCHS) for method in ("smoothquant", "quarot") for a_bits in (4, 8)]
CASES += [(arch, "spinquant", 4) for arch in sorted(ARCHS)]


def ids_for(model, seed=0, length=16):
    return torch.randint(0, model.lm_head.weight.shape[0], (2, length), generator=torch.Generator().manual_seed(seed))


def baseline_student(teacher, method, a_bits):
    config = QuantConfig.of_method(method, 4, a_bits, group_size=32)
    if method == "spinquant":  # a "calibrated" SpinQuant: rotations moved away from the Hadamard start
        student = prepare(teacher, config)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for g in quant_groups(student).values():
                for factor in (g.transform.left, g.transform.right):
                    factor.skew.copy_(torch.randn(factor.skew.shape, generator=gen) * 0.2)
        return student.eval()
    return prepare_static(teacher, config, ids_for(teacher, seed=7, length=32))


@pytest.mark.parametrize(("arch", "method", "a_bits"), CASES, ids=[f"{a}-{m}-w4a{b}" for a, m, b in CASES])
def test_baseline_exports_bit_exact(fixtures, tmp_path, arch, method, a_bits):
    teacher_dir = fixtures / ARCHS[arch]
    teacher = load_looplm(teacher_dir)
    student = baseline_student(teacher, method, a_bits)
    export_student(student, {"teacher": str(teacher_dir)}, tmp_path)
    model = load_quantized(tmp_path)
    meta = json.loads((tmp_path / META).read_text())
    assert meta["quant"]["method"] == method and meta["promoted"] == [] and meta["transition"] is None
    for name, spec in meta["groups"].items():
        assert (spec["transform_slots"], spec["weight_slots"], spec["act_slots"]) == (1, 1, 1)  # static
        packed, group = model.get_submodule(name), quant_groups(student)[name]
        assert torch.equal(packed.left[0], group.transform.left.matrix().float())
        assert torch.equal(packed.inv_d[0], (-group.transform.log_d).exp())
    ids = ids_for(teacher, seed=1)
    hooks = use_kernel_numerics(student)
    try:
        with torch.no_grad():
            for loops in (student.calibrated_loops, student.calibrated_loops + 2):
                ref = student(ids, num_loops=loops, return_trajectory=True)
                out = model(ids, num_loops=loops, return_trajectory=True)
                assert torch.equal(out.logits, ref.logits)
                assert all(torch.equal(a, b) for a, b in zip(out.loop_states, ref.loop_states, strict=True))
    finally:
        for h in hooks:
            h.remove()
