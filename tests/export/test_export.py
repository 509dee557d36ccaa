"""Prepare vs convert at model level, the export directory, the round trip, the footprint and bad input.

Tolerances. The exported model is compared *bit for bit* with the student evaluated with the kernels' numerics
(:func:`kernel_numerics`: transform in the kernels' order, float64 fold, fp16 weight scales, per-group GEMM). Against
the plain fake-quant forward there is no tight model-level tolerance: the remaining differences are numerical
(fp16 weight scales: ~2e-4 relative per group output; rare +-1 codes at ties), and the quantizers amplify them -
every activation code that a perturbation pushes across a rounding boundary is a full quantization step, and the
loop feeds it back. Measured relative L2 gaps of the logits over 3 inputs (these heavily clipped random students
are themselves 0.47-0.74 away from their FP teachers): W4A4 ouro 0.35-0.52, loopformer 0.18-0.23, parcae
0.21-0.32; W4A8 ouro 0.032-0.040, loopformer 0.013-0.019, parcae 0.018-0.029. Here: W4A8 gap < 0.1, and any gap
smaller than the student's own error against its teacher. The exact per-group comparison is in ``test_packed.py``.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopq.artifacts import (
    ExportError,
    StudentFormatError,
    convert,
    export_student,
    load_quantized,
    student_meta,
    write_student,
)
from loopq.artifacts.layout import EXPORT_META as META
from loopq.artifacts.layout import STUDENT_META as STUDENT_CONFIG
from loopq.artifacts.layout import STUDENT_WEIGHTS as STUDENT_WEIGHTS
from loopq.artifacts.quantized import tied_aliases
from loopq.commands.export import main
from loopq.kernels.packing import tiled_shapes
from loopq.models import load_looplm
from loopq.models.ouro import OuroLM
from loopq.paths import ASSETS
from loopq.quant import QuantConfig, looped_quant_groups, prepare, quant_groups
from loopq.quant.accounting import footprint
from loopq.quant.packed import PackedLinearGroup

from .conftest import make_student, use_kernel_numerics

W4A8_GAP = 0.1


def run(model, ids, loops=None):
    with torch.no_grad():
        return model(ids, num_loops=loops, return_trajectory=True)


def relative(a, b):
    return float((a - b).norm() / b.norm())


def test_bit_exact_with_the_student_under_kernel_numerics(exported):
    """Logits, every loop state and every CTA state, at the calibrated loop count and two loops beyond it."""
    ids = exported.ids()
    loops = exported.meta["calibrated_loops"]
    hooks = use_kernel_numerics(exported.student)
    try:
        for n in (loops, loops + 2):
            ref, out = run(exported.student, ids, n), run(exported.model, ids, n)
            assert torch.equal(out.logits, ref.logits)
            assert len(out.loop_states) == n
            for a, b in zip(out.loop_states, ref.loop_states, strict=True):
                assert torch.equal(a, b)
            for a, b in zip(out.transition_states, ref.transition_states, strict=True):
                assert torch.equal(a, b)
    finally:
        for h in hooks:
            h.remove()


def test_close_to_the_plain_student(exported):
    ids = exported.ids(seed=1)
    ref, out = run(exported.student, ids), run(exported.model, ids)
    teacher = run(load_looplm(exported.teacher_dir), ids)
    assert torch.isfinite(out.logits).all()
    for mine, theirs, fp in (
        (out.logits, ref.logits, teacher.logits),
        (out.loop_states[-1], ref.loop_states[-1], teacher.loop_states[-1]),
    ):
        gap = relative(mine, theirs)
        assert gap < relative(theirs, fp)
        assert exported.a_bits == 4 or gap < W4A8_GAP


def test_directory_is_self_contained(exported):
    files = sorted(p.name for p in exported.out.iterdir())
    assert files == ["config.json", META, "model.safetensors"]
    assert (exported.out / "config.json").read_text() == (exported.teacher_dir / "config.json").read_text()
    meta = json.loads((exported.out / META).read_text())
    assert meta["arch"] == exported.arch and meta["calibrated_loops"] == exported.meta["calibrated_loops"]
    assert meta["promoted"] == exported.meta["promoted"]
    assert meta["quant"] == exported.meta["quant"]
    teacher = load_looplm(exported.teacher_dir)
    stored = load_file(str(exported.out / "model.safetensors"))
    groups = tuple(name + "." for name in meta["groups"])
    fp = {k: v for k, v in teacher.state_dict().items() if not k.startswith(groups)}
    assert set(fp) - set(stored) == set(tied_aliases(teacher))  # tied tensors are stored once
    assert {k for k in stored if not k.startswith((*groups, "transition."))} <= set(fp)
    for key in set(fp) & set(stored):  # every FP tensor of the teacher, unchanged
        assert torch.equal(stored[key], fp[key]), key


def test_slots_per_group(exported):
    """Promoted group: per-loop weights and transforms; LAS: per-loop clips; outside the loop: one slot."""
    meta = json.loads((exported.out / META).read_text())
    loops = meta["calibrated_loops"]
    for name, spec in meta["groups"].items():
        packed = exported.model.get_submodule(name)
        per_loop = loops if name in meta["promoted"] else 1
        assert (spec["weight_slots"], spec["transform_slots"]) == (per_loop, per_loop)
        assert spec["act_slots"] == (loops if spec["looped"] else 1)
        assert packed.weight.shape[0] == per_loop and packed.left.shape[0] == per_loop
        if not spec["looped"]:
            assert spec["slots"] == 1 and packed.slot(None) == 0
        else:
            assert packed.slot(loops + 5) == loops - 1
    (promoted,) = meta["promoted"]
    weights = exported.model.get_submodule(promoted).weight
    assert not torch.equal(weights[0], weights[1])
    if exported.arch == "parcae":
        assert any(not spec["looped"] for spec in meta["groups"].values())


def test_round_trip_and_extrapolation(exported):
    again = load_quantized(exported.out)
    assert isinstance(again.get_submodule(exported.meta["promoted"][0]), PackedLinearGroup)
    converted = convert(exported.student)
    mine, theirs = again.state_dict(), converted.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    if exported.arch != "ouro":  # LoopFormer and the Parcae fixture tie the head to the embedding
        assert again.lm_head.weight is again.transformer.wte.weight
    loops = exported.meta["calibrated_loops"]
    out = run(again, exported.ids(), loops + 3)
    assert len(out.loop_states) == loops + 3 and torch.isfinite(out.logits).all()
    promoted = again.get_submodule(exported.meta["promoted"][0])  # loops past calibration reuse the last slot
    x = torch.randn(1, 4, promoted.spec.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(promoted(x, loops + 3), promoted(x, loops - 1), strict=True))
        assert not torch.equal(promoted(x, 0)[0], promoted(x, loops - 1)[0])


def test_load_casts_only_fp_modules(exported):
    model = load_quantized(exported.out, dtype=torch.bfloat16)
    group = next(m for m in model.modules() if isinstance(m, PackedLinearGroup))
    assert group.weight.dtype == torch.uint8 and group.weight_scale.dtype == torch.float16
    assert group.left.dtype == torch.float32 and model.lm_head.weight.dtype == torch.bfloat16
    assert model.transition.a.dtype == torch.float32
    assert torch.isfinite(run(model, exported.ids()).logits.float()).all()
    cast = load_quantized(exported.out).to(torch.bfloat16)  # a whole-model cast leaves the packed tensors alone
    mine, theirs = (
        cast.get_submodule(exported.meta["promoted"][0]),
        exported.model.get_submodule(exported.meta["promoted"][0]),
    )
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.buffers(), theirs.buffers(), strict=True))
    assert cast.lm_head.weight.dtype == torch.bfloat16


def test_footprint_of_realistic_layers_is_under_0p3_of_bf16():
    """hidden 1024 / MLP 2816 (Ouro-like proportions): int4 (0.25x) + fp16 scale per 32 (0.031x; stored padded to
    64-group chunks: 2x at K = 1024, 1.45x at K = 2816, 1 / 1.09x at Ouro-1.4B's 2048 / 5632) + transforms."""
    config = {"model_type": "ouro", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 1}
    config |= {"num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 256, "total_ut_steps": 4}
    teacher = OuroLM.from_config(config, seed=0)
    student = prepare(teacher, QuantConfig(transform_init="rotation", slt_budget=0))
    report = footprint(convert(student))
    assert 0.28 < report["quantized_layers_ratio"] <= 0.33
    assert report["relative"] < -0.6
    assert report["params_loop_dependent"] == 4 * 4 + 3 * (2 * 1024 + 8)  # LAS clips + CTA a, b, eta
    assert report["total"] == sum(report[k] for k in ("packed_weights", "weight_scales", "fp_modules")) + sum(
        report[k] for k in ("quant_shared", "quant_loop_dependent")
    )


def test_promoted_group_stores_one_weight_per_loop(exported):
    report = footprint(exported.model)
    groups = [m for m in exported.model.modules() if isinstance(m, PackedLinearGroup)]
    assert report["packed_weights"] == sum(g.weight.numel() for g in groups)
    promoted = exported.model.get_submodule(exported.meta["promoted"][0])
    loops = exported.meta["calibrated_loops"]
    n, k = sum(promoted.spec.splits), promoted.spec.in_features
    code_shape, scale_shape = tiled_shapes(n, k)  # the kernel layout: rows padded to 8, groups to 8 / 64
    assert promoted.weight.shape == (loops, *code_shape) and promoted.weight_scale.shape == (loops, *scale_shape)
    # the T - 1 extra slots of promoted groups, by hand: int4 codes (1/2 byte), padded to 8 rows and 8 groups of 32
    # inputs, and fp16 scales padded to 8 rows and 64 groups
    extra = sum(
        (loops - 1) * 8 * -(-sum(g.spec.splits) // 8) * (16 * 8 * -(-k // 256) + 2 * 64 * -(-k // 2048))
        for g in groups
        if g.weight.shape[0] > 1
        for k in [g.spec.in_features]
    )
    assert extra > 0 and report["slt_weight_copies"] == extra
    assert report["quantized_layers_shared"] + extra == report["quantized_layers"]
    assert report["quantized_layers_shared_ratio"] < report["quantized_layers_ratio"]


def test_embedded_teacher_footprint_breakdown():
    """The tiny teacher (hidden 128, MLP 384) with two promoted groups: the packed weights of its quantized layers
    take their kernel layout's bytes (int4 + an fp16 scale per 32, padded as below); its fp32 transforms and the
    SLT copies (3 extra loop slots of 2 of its 8 groups) are reported on top, not hidden in that ratio."""
    teacher = load_looplm(ASSETS / "tiny-ouro")
    student = prepare(teacher, QuantConfig(transform_init="rotation", slt_budget=2))
    for group in list(looped_quant_groups(student).values())[:2]:
        group.promote()
    report = footprint(convert(student))
    # by hand: codes padded to 8 rows x 8 groups of 32 (16 bytes each), fp16 scales to 8 rows x 64 groups; the
    # tiny widths (K = 128: 4 groups) pay 2x on the codes and 16x on the scales, Ouro-1.4B's widths nothing / 9 %
    packed = bf16 = 0
    for g in quant_groups(student).values():
        rows, k = 8 * -(-sum(g.splits) // 8), g.in_features
        packed += rows * (16 * 8 * -(-k // 256) + 2 * 64 * -(-k // 2048))
        bf16 += 2 * sum(g.splits) * k
    assert report["packed_shared_ratio"] == pytest.approx(packed / bf16, abs=1e-12)
    transforms = sum(
        t.numel() * t.element_size()
        for g in convert(student).modules()
        if isinstance(g, PackedLinearGroup)
        for t in (g.left, g.right, g.inv_d, g.act_clip)
    )
    stored = report["packed_weights"] + report["weight_scales"] + transforms
    assert report["quantized_layers"] == stored
    assert report["packed_shared_ratio"] < report["quantized_layers_shared_ratio"] < report["quantized_layers_ratio"]


# ------------------------------------------------------------------------------------------------ bad input
def test_cli_rejects_a_teacher_directory(fixtures, tmp_path):
    with pytest.raises(StudentFormatError, match=re.escape(STUDENT_CONFIG)):
        main(["--ckpt", str(fixtures / "ouro-tiny"), "--out", str(tmp_path / "out")])


def test_cli_names_a_missing_student_weights_file(exported, tmp_path):
    (tmp_path / STUDENT_CONFIG).write_text((exported.student_dir / STUDENT_CONFIG).read_text())
    with pytest.raises(StudentFormatError, match=re.escape(STUDENT_WEIGHTS)):
        main(["--ckpt", str(tmp_path), "--out", str(tmp_path / "out")])


def test_load_rejects_a_directory_that_is_not_an_export(fixtures):
    with pytest.raises(ExportError, match=re.escape(META)):
        load_quantized(fixtures / "ouro-tiny")


def test_load_refuses_an_export_of_the_previous_format(exported, tmp_path):
    """v2 stored the weights in natural order; v3 in the kernel layout: a v2 directory is refused in one line that
    says to export it again, before any tensor is read."""
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(exported.out / name, tmp_path / name)
    meta = json.loads((exported.out / META).read_text()) | {"format": "loopq-export-v2"}
    (tmp_path / META).write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=r"format 'loopq-export-v2' is not 'loopq-export-v3'; export it again") as err:
        load_quantized(tmp_path)
    assert "\n" not in str(err.value)


def test_load_names_damaged_weights(exported, tmp_path):
    for name in ("config.json", META):
        (tmp_path / name).write_text((exported.out / name).read_text())
    state = load_file(str(exported.out / "model.safetensors"))
    state.pop(next(k for k in state if k.endswith(".weight_scale")))
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match=re.escape("model.safetensors")):
        load_quantized(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"group_size": 16}, "quant.group_size=16"), ({"a_bits": 16}, "quant.a_bits=16"), ({"w_bits": 8}, "w_bits=8")],
)
def test_export_rejects_what_the_kernels_cannot_run(fixtures, tmp_path, change, message):
    teacher = load_looplm(fixtures / "ouro-tiny")
    student = prepare(teacher, QuantConfig(**{"cta": False, **change}))
    with pytest.raises(ExportError, match=message):
        export_student(student, {"teacher": str(fixtures / "ouro-tiny")}, tmp_path)


def test_convert_rejects_a_model_without_quant_groups(fixtures):
    with pytest.raises(ExportError, match="prepare"):
        convert(load_looplm(fixtures / "ouro-tiny"))


def test_cli_takes_the_teacher_of_a_student_whose_teacher_moved(tmp_path):
    """The student loader's error says to pass ``--teacher`` when the recorded teacher is gone, which loopq.export
    did not take; now it does, and the export is made on (and copies its tokenizer from) that teacher."""
    teacher = shutil.copytree(ASSETS / "tiny-ouro", tmp_path / "teacher")
    student, promoted = make_student(load_looplm(teacher), a_bits=4)
    directory = tmp_path / "run" / "student"
    meta = student_meta(student, teacher, directory, [promoted], [1.0] * student.calibrated_loops, None)
    write_student(student, meta, directory)
    moved = teacher.rename(tmp_path / "moved")
    with pytest.raises(StudentFormatError, match=r"is not there .*; pass the teacher directory \(--teacher\)$"):
        main(["--ckpt", str(directory), "--out", str(tmp_path / "out")])
    main(["--ckpt", str(directory), "--out", str(tmp_path / "out"), "--teacher", str(moved)])
    assert json.loads((tmp_path / "out" / META).read_text())["teacher"] == str(moved.resolve())
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (moved / "tokenizer.json").read_bytes()
    load_quantized(tmp_path / "out")


def test_export_without_a_teacher_directory_writes_the_model_config(fixtures, tmp_path):
    student, _ = make_student(load_looplm(fixtures / "parcae-tiny"), a_bits=8)
    export_student(student, {}, tmp_path)
    model = load_quantized(tmp_path)
    assert len(quant_groups(student)) == sum(isinstance(m, PackedLinearGroup) for m in model.modules())
    assert model.calibrated_loops == student.calibrated_loops


def test_plain_rtn_student_exports_bit_exact(fixtures, tmp_path):
    """No transforms, no learnable clips (ratio exactly 1), no LAS, no CTA: the packed group quantizes x as is."""
    rtn = {"transforms": False, "learn_weight_clip": False, "learn_act_clip": False, "las": False, "cta": False}
    student = prepare(load_looplm(fixtures / "ouro-tiny"), QuantConfig(slt_budget=0, **rtn))
    export_student(student, {"teacher": str(fixtures / "ouro-tiny")}, tmp_path)
    model = load_quantized(tmp_path)
    assert model.transition is None
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    hooks = use_kernel_numerics(student)
    try:
        assert torch.equal(run(model, ids).logits, run(student, ids).logits)
    finally:
        for h in hooks:
            h.remove()
