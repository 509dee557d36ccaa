"""The artifact layer (loopq.artifacts): one loader for teachers, students and exports, and file names in one place."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopq.artifacts import (
    StudentFormatError,
    artifact_kind,
    layout,
    load_artifact,
    load_quantized,
    load_student,
    read_artifact_meta,
    student_meta,
    tokenizer_dir,
    write_student,
)
from loopq.artifacts.seal import FILES, manifest, seal
from loopq.commands.harness import check_loopq_args
from loopq.metrics.lm import LoopQLM
from loopq.models import LoopLMError, load_looplm
from loopq.paths import ASSETS, REPO_ROOT

from .conftest import make_student


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_load_artifact_gives_each_kind_the_model_of_its_own_loader(exported):
    ids = exported.ids()
    student = load_artifact(exported.student_dir)
    export = load_artifact(exported.out)
    teacher = load_artifact(exported.teacher_dir)
    assert (student.kind, export.kind, teacher.kind) == ("student", "export", "teacher")
    assert torch.equal(logits(student.model, ids), logits(exported.student, ids))
    assert torch.equal(logits(export.model, ids), logits(exported.model, ids))
    assert torch.equal(logits(teacher.model, ids), logits(load_looplm(exported.teacher_dir), ids))
    assert student.bits == export.bits == f"w4a{exported.a_bits}" and teacher.bits == "fp"
    assert student.meta["promoted"] == exported.meta["promoted"] == export.meta["promoted"]
    assert teacher.meta == {"arch": exported.arch, "teacher": str(exported.teacher_dir.resolve())}


def test_tokenizer_of_a_student_is_its_teachers_and_an_export_carries_its_own(exported):
    student = load_artifact(exported.student_dir)
    assert tokenizer_dir(exported.student_dir, student) == exported.teacher_dir.resolve()
    assert tokenizer_dir(exported.out, load_artifact(exported.out)) == exported.out


def test_lm_eval_model_loads_a_student_directory(tmp_path):
    """``model_args pretrained=<student dir>`` evaluates the fake-quant student with its teacher's tokenizer."""
    teacher_dir = ASSETS / "tiny-ouro"
    student, promoted = make_student(load_looplm(teacher_dir), a_bits=4)
    loops = student.calibrated_loops
    write_student(student, student_meta(student, teacher_dir, tmp_path, [promoted], [0.0] * loops, None), tmp_path)
    lm = LoopQLM(pretrained=str(tmp_path))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(lm.model, ids), logits(student.eval(), ids))
    assert lm.tokenizer.get_vocab() == LoopQLM(pretrained=str(teacher_dir)).tokenizer.get_vocab()


def test_lm_eval_command_accepts_a_student_directory(tmp_path):
    """``python -m loopq.eval --model_args pretrained=<student dir>`` was refused by a config.json pre-check only a
    teacher passes; a directory that is neither a model nor an artifact is still refused in one line."""
    teacher_dir = ASSETS / "tiny-ouro"
    student, promoted = make_student(load_looplm(teacher_dir), a_bits=4)
    meta = student_meta(student, teacher_dir, tmp_path / "student", [promoted], [0.0] * student.calibrated_loops, None)
    write_student(student, meta, tmp_path / "student")
    for model in (tmp_path / "student", teacher_dir):
        check_loopq_args(["--model", "loopq", "--model_args", f"pretrained={model},num_loops=2", "--tasks", "x"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoopLMError, match=rf"^{re.escape(str(tmp_path / 'empty' / 'config.json'))}: no config\.json"):
        check_loopq_args(["--model", "loopq", "--model_args", f"pretrained={tmp_path / 'empty'}", "--tasks", "x"])


def old_layout(name: str, promoted: str | None) -> bool:
    """Whether a student written before the fixed SLT layout lacked tensor ``name``: the SLT state (anchors,
    promotion flags) everywhere, and the per-loop slots of every group it had not promoted."""
    per_loop = ".loop_transforms." in name or name.endswith((".loop_weight_clip", ".loop_act_clip"))
    return ".slt_" in name or (per_loop and (promoted is None or not name.startswith(f"{promoted}.")))


@pytest.mark.parametrize("keep_promoted", [False, True], ids=["no-slots", "promoted-slots-kept"])
def test_a_student_of_the_old_slt_layout_is_told_to_recalibrate(tmp_path, keep_promoted):
    """The format string was not bumped with the fixed SLT layout, so such a student is known by its missing
    per-loop slots; it got "parameters do not match (missing ...)" because only SLT-state names were expected."""
    teacher_dir = ASSETS / "tiny-ouro"
    student, promoted = make_student(load_looplm(teacher_dir), a_bits=4)
    directory = tmp_path / "student"
    loops = student.calibrated_loops
    write_student(student, student_meta(student, teacher_dir, directory, [promoted], [0.0] * loops, None), directory)
    weights = directory / layout.STUDENT_WEIGHTS
    state = load_file(str(weights))
    dropped = [n for n in state if old_layout(n, promoted if keep_promoted else None)]
    assert any(".loop_transforms." in n for n in dropped) and any(".slt_" in n for n in dropped)
    kept = {n: t for n, t in state.items() if n not in dropped}
    save_file(kept, str(weights), metadata={"format": layout.STUDENT_FORMAT})  # the format was not bumped
    meta = json.loads((directory / layout.STUDENT_META).read_text())
    meta[FILES] = manifest(directory, [layout.STUDENT_WEIGHTS])
    (directory / layout.STUDENT_META).write_text(json.dumps(seal(meta)))  # as that writer sealed it
    expected = rf"^{re.escape(str(weights))}: written before the fixed SLT layout \(no per-loop slots .*\); calibrate"
    with pytest.raises(StudentFormatError, match=expected):
        load_student(directory)


@pytest.mark.parametrize("exported", [("parcae", 8)], indirect=True, ids=["parcae-w4a8"])
def test_an_expected_kind_names_the_missing_file(exported, tmp_path):
    with pytest.raises(StudentFormatError, match=rf"^{re.escape(str(exported.out / layout.STUDENT_META))}: missing"):
        load_artifact(exported.out, kind="student")
    moved = shutil.copytree(exported.student_dir, tmp_path / "student")
    (moved / layout.STUDENT_WEIGHTS).unlink()
    assert artifact_kind(moved) == "student"  # still recognised by its description ...
    with pytest.raises(StudentFormatError, match=rf"{layout.STUDENT_WEIGHTS}: missing"):
        read_artifact_meta(moved)  # ... and refused as incomplete before any model is built


def test_file_names_are_spelled_only_in_the_layout_module():
    """Every module that reads or writes a student or export directory takes its names from loopq.artifacts.layout."""
    names = [layout.STUDENT_META, layout.STUDENT_WEIGHTS, layout.EXPORT_META]
    names += [layout.STUDENT_FORMAT, layout.EXPORT_FORMAT]
    spelled = {
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for path in (REPO_ROOT / "loopq").rglob("*.py")
        if path.name != "layout.py"
        for name in names
        if re.search(rf"[\"']{re.escape(name)}[\"']", path.read_text())
    }
    assert not spelled


def _digests(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_a_failed_rewrite_leaves_the_earlier_export_and_student_whole(exported, tmp_path, monkeypatch):
    """A re-export that fails in the middle (here: the disk fills while the tokenizer is copied) left the earlier
    export neither old nor new - new weights next to the old description, refused on load. Every file is now written
    before any is renamed into place: the earlier export is byte for byte what it was and loads; the same for a
    student directory whose description fails to write."""
    from loopq.artifacts import export_student
    from loopq.artifacts import quantized as quantized_module
    from loopq.artifacts import student as student_module

    out, student_dir = tmp_path / "export", tmp_path / "student"
    shutil.copytree(exported.out, out)
    shutil.copytree(exported.student_dir, student_dir)
    before, student_before = _digests(out), _digests(student_dir)
    other, _ = make_student(load_looplm(exported.teacher_dir), exported.a_bits, seed=7)  # other parameters

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quantized_module.shutil, "copyfile", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_student(other, exported.meta, out)
    after = {k: v for k, v in _digests(out).items() if not k.startswith(".")}  # the journal says one was begun
    assert after == before and not list(out.glob(".*.tmp"))
    load_quantized(out)  # still the earlier, consistent export

    monkeypatch.setattr(student_module, "seal", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_student(other, exported.meta, student_dir)
    assert {k: v for k, v in _digests(student_dir).items() if not k.startswith(".")} == student_before
    load_student(student_dir)


def test_an_edited_and_resealed_export_is_one_line(exported, tmp_path):
    """The seal is a checksum: an export edited and re-sealed by hand reached a kernel or the adapters' constructor
    and failed with a traceback. Packed tensors of another dtype and an impossible transition are named instead."""
    from loopq.artifacts import ExportError, layout

    def resealed(edit_state=None, edit_meta=None):
        out = tmp_path / f"export-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(exported.out, out)
        if edit_state is not None:
            state = load_file(out / layout.EXPORT_WEIGHTS)
            edit_state(state)
            save_file(state, out / layout.EXPORT_WEIGHTS, metadata={"format": layout.EXPORT_FORMAT})
        meta = json.loads((out / layout.EXPORT_META).read_text())
        if edit_meta is not None:
            edit_meta(meta)
        meta[FILES] = manifest(out, list(meta[FILES]))
        (out / layout.EXPORT_META).write_text(json.dumps(seal(meta)))
        return out

    group = next(iter(json.loads((exported.out / layout.EXPORT_META).read_text())["groups"]))
    key = f"{group}.weight"
    int32 = resealed(edit_state=lambda s: s.__setitem__(key, s[key].to(torch.int32)))
    with pytest.raises(ExportError, match=rf"{re.escape(key)} is torch.int32, not torch.uint8; "):
        load_quantized(int32)
    loops = resealed(edit_meta=lambda m: m["transition"].__setitem__("num_loops", -1))
    with pytest.raises(ExportError, match=r"transition .*num_loops >= 2"):
        load_quantized(loops)
