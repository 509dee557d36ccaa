"""Artifacts that cannot lie (issue #29, cases 1-3): a student or export whose weights or description were changed
after they were written is refused with one line naming the file and the fix, exit status 2, and every file that
existed before is byte-identical afterwards."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from loopq.artifacts import load_artifact, read_artifact_meta, student_meta, write_student
from loopq.artifacts.layout import EXPORT_META, EXPORT_WEIGHTS, STUDENT_META, STUDENT_WEIGHTS, TOKENIZER_FILES
from loopq.artifacts.seal import SEAL, seal
from loopq.commands import evaluate, export
from loopq.models import load_looplm
from loopq.paths import ASSETS
from loopq.provenance import teacher_fingerprint
from tests.bad_inputs.test_cli_errors import assert_one_line_error, cli
from tests.export.conftest import make_student
from tests.helpers import command, snapshot

TEACHER = ASSETS / "tiny-ouro"


def write_tiny_student(directory: Path, a_bits: int, seed: int) -> Path:
    student, promoted = make_student(load_looplm(TEACHER), a_bits, seed=seed)
    config = {"model.quant.a_bits": a_bits, "model.quant.w_bits": 4}
    provenance = {"teacher_sha256": teacher_fingerprint(TEACHER), "config": config}
    meta = student_meta(student, TEACHER, directory, [promoted], [1.0] * student.calibrated_loops, provenance)
    return write_student(student, meta, directory)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Two W4A4 students of the tiny teacher (seeds 0 and 1) and their exports."""
    root = tmp_path_factory.mktemp("made")
    for seed in (0, 1):
        write_tiny_student(root / f"student{seed}", 4, seed)
        export.main(["--ckpt", str(root / f"student{seed}"), "--out", str(root / f"export{seed}")])
    return root


@pytest.fixture
def copies(made, tmp_path) -> Path:
    return Path(shutil.copytree(made, tmp_path / "copies"))


def test_a_fresh_student_and_export_load_and_record_their_files(copies):
    meta = json.loads((copies / "export0" / EXPORT_META).read_text())
    expected = {EXPORT_WEIGHTS, "config.json", *(n for n in TOKENIZER_FILES if (TEACHER / n).is_file())}
    assert set(meta["files"]) == expected
    data = (copies / "export0" / EXPORT_WEIGHTS).read_bytes()
    assert meta["files"][EXPORT_WEIGHTS] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert load_artifact(copies / "export0").bits == load_artifact(copies / "student0").bits == "w4a4"


def test_flipped_bytes_of_an_exported_tensor_are_refused_by_generate(copies):
    """Case 1: one tensor's bytes flipped (same size): loopq.generate refuses instead of printing garbage."""
    weights = copies / "export0" / EXPORT_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])
    weights.write_bytes(bytes(data))
    before = snapshot(copies)
    proc = cli("generate", "--exported", copies / "export0", "--prompt", "hi")
    line = assert_one_line_error(proc, rf"{re.escape(str(weights))}: not the file {EXPORT_META} was written with")
    assert "changed or replaced since; export it again with python -m loopq.export" in line
    assert snapshot(copies) == before


def test_another_exports_weights_copied_in_are_refused_by_evaluate(copies, capsys):
    """Case 1: the same-shaped weights of another export: not evaluated under this export's provenance."""
    shutil.copyfile(copies / "export1" / EXPORT_WEIGHTS, copies / "export0" / EXPORT_WEIGHTS)
    before = snapshot(copies)
    out = copies / "result.json"
    argv = ["--exported", str(copies / "export0"), "--tasks", "[]", "--ppl_windows", "1", "--out", str(out)]
    status, line = command(evaluate.main, argv, capsys)
    assert status == 2 and f"{copies / 'export0' / EXPORT_WEIGHTS}: not the file {EXPORT_META}" in line
    assert "sha256" in line and not out.exists() and snapshot(copies) == before


def test_an_export_description_without_its_seal_is_refused(copies, capsys):
    """Case 2: meta_sha256 deleted and every a_bits set to 8: no "w4a8" for a W4A4 model."""
    path = copies / "export0" / EXPORT_META
    meta = json.loads(path.read_text())
    del meta[SEAL]
    meta["quant"]["a_bits"] = 8
    for group in meta["groups"].values():
        group["a_bits"] = 8
    path.write_text(json.dumps(meta))
    before = snapshot(copies)
    status, line = command(evaluate.main, ["--exported", str(copies / "export0"), "--tasks", "[]"], capsys)
    assert status == 2 and line == (
        f"error: {path}: has no {SEAL} seal, so its bits and layout cannot be trusted; export it again with "
        "python -m loopq.export"
    )
    assert snapshot(copies) == before


def test_an_edited_student_description_is_neither_evaluated_nor_exported(copies, capsys):
    """Case 3: a_bits 4 -> 8 in a student's description; loopq.export must not seal a W4A8 export of it."""
    path = copies / "student0" / STUDENT_META
    meta = json.loads(path.read_text())
    meta["quant"]["a_bits"] = 8
    path.write_text(json.dumps(meta, indent=2))
    before = snapshot(copies)
    status, line = command(evaluate.main, ["--student", str(copies / "student0"), "--tasks", "[]"], capsys)
    assert status == 2 and line.startswith(f"error: {path}: edited after it was written")
    status, line = command(export.main, ["--ckpt", str(copies / "student0"), "--out", str(copies / "new")], capsys)
    assert status == 2 and line.endswith("calibrate the student again with python -m loopq.fit")
    assert snapshot(copies) == before and not (copies / "new").exists()


def test_a_resealed_description_must_still_agree_with_its_provenance(copies):
    """Case 3 by someone who also recomputes the seal: the provenance still says what it was calibrated as."""
    path = copies / "student0" / STUDENT_META
    meta = json.loads(path.read_text())
    meta["quant"]["a_bits"] = 8
    path.write_text(json.dumps(seal(meta)))
    with pytest.raises(ValueError, match=r"quant.a_bits=8 but its own provenance says model.quant.a_bits=4"):
        read_artifact_meta(copies / "student0")


def test_another_students_weights_copied_in_are_refused(copies):
    shutil.copyfile(copies / "student1" / STUDENT_WEIGHTS, copies / "student0" / STUDENT_WEIGHTS)
    with pytest.raises(ValueError, match=rf"{STUDENT_WEIGHTS}: not the file {STUDENT_META} was written with \(sha256"):
        load_artifact(copies / "student0")


def test_a_legacy_student_is_read_with_a_warning(copies, capsys):
    """A student written before the seal (format v1) still loads - calibrations are not lost - and says so."""
    path = copies / "student0" / STUDENT_META
    meta = json.loads(path.read_text())
    legacy = {k: v for k, v in meta.items() if k not in (SEAL, "files")} | {"format": "loopq-student-v1"}
    path.write_text(json.dumps(legacy))
    weights = copies / "student0" / STUDENT_WEIGHTS  # a v1 student's weights header said v1, as its description
    save_file(load_file(weights), weights, metadata={"format": "loopq-student-v1"})
    assert load_artifact(copies / "student0").bits == "w4a4"
    assert "format loopq-student-v1 is not content-verified" in capsys.readouterr().err
