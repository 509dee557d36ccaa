"""Saving and loading a calibrated student: safetensors of the quantization parameters + a JSON quant config.

A student directory holds ``loopq_student.safetensors`` (transforms, clipping logits, adapters - everything the
teacher does not have) and ``loopq_quant.json`` (QuantConfig, teacher directory, promoted groups, calibrated loop
count, final mu_t, and the provenance: the teacher's content hash and the resolved calibration config).
:func:`load_student` rebuilds structure first (prepare + re-promotion) and then loads the tensors strictly - no
pickle anywhere. The teacher it loads (the recorded path, the same path relative to the student directory when the
run directory was moved, or one the caller passes) must have the recorded content hash: a student is never put on
top of another teacher (a rebuilt one included) unless the caller says ``check_teacher=False``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loopq.errors import LoopQError
from loopq.files import atomic_write, read_json, read_safetensors
from loopq.models import LoopLM, load_looplm
from loopq.provenance import ProvenanceError, teacher_fingerprint
from loopq.quant import QuantConfig, prepare, quant_groups

WEIGHTS = "loopq_student.safetensors"
CONFIG = "loopq_quant.json"
FORMAT = "loopq-student-v1"
RECALIBRATE = "calibrate the student again with python -m loopq.fit"


class StudentFormatError(LoopQError):
    """Not a LoopQ student directory (or a damaged one); the message names the file."""


def quant_state(student: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in student.named_parameters() if p.requires_grad}


def save_student(module: Any, directory: Path) -> Path:
    """Write the student of a :class:`~loopq.calib.module.LoopQCalibration` (atomically, file by file)."""
    teacher = Path(module.teacher_dir).resolve()
    meta = {
        "format": FORMAT,
        "teacher": str(teacher),
        "teacher_relative": os.path.relpath(teacher, Path(directory).resolve()),
        "provenance": module.provenance,
        "arch": module.teacher.arch,
        "quant": module.quant_config.to_dict(),
        "promoted": list(module.promoted),
        "calibrated_loops": module.num_loops,
        "mu": module.mu.tolist(),
    }
    return write_student(module.student, meta, directory)


def write_student(student: torch.nn.Module, meta: dict[str, Any], directory: Path) -> Path:
    state = quant_state(student)
    atomic_write(directory / WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": FORMAT}))
    atomic_write(directory / CONFIG, lambda p: p.write_text(json.dumps(meta, indent=2) + "\n"))
    return directory


def read_meta(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise StudentFormatError(f"{path}: missing - {directory} is not a LoopQ student (run python -m loopq.fit)")
    meta = read_json(path, StudentFormatError, RECALIBRATE)
    if meta.get("format") != FORMAT:
        raise StudentFormatError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def teacher_dir_of(directory: Path, meta: dict[str, Any]) -> Path:
    """Where the student's teacher is: the recorded absolute path, else the recorded path relative to the student
    directory (a moved run directory with its teacher beside it)."""
    recorded = Path(meta["teacher"])
    if recorded.is_dir():
        return recorded
    relative = meta.get("teacher_relative")
    if relative is not None and (directory / relative).is_dir():
        return (directory / relative).resolve()
    raise StudentFormatError(
        f"{directory / CONFIG}: its teacher {recorded} is not there (nor at {relative!r} relative to the student); "
        "pass the teacher directory (--teacher)"
    )


def check_student_teacher(directory: Path, meta: dict[str, Any], teacher_dir: str | Path) -> None:
    """The teacher must be the one the student was calibrated on (same content hash)."""
    recorded = (meta.get("provenance") or {}).get("teacher_sha256")
    if recorded is None:
        return  # written before provenance was recorded: nothing to compare
    actual = teacher_fingerprint(teacher_dir)
    if actual != recorded:
        raise ProvenanceError(
            f"{directory / CONFIG}: calibrated on teacher {recorded[:12]} but {teacher_dir} is {actual[:12]} (rebuilt "
            "or another model); recalibrate on this teacher, or pass the original teacher directory"
        )


def load_student(
    directory: str | Path,
    teacher: LoopLM | None = None,
    teacher_dir: str | Path | None = None,
    check_teacher: bool = True,
) -> tuple[LoopLM, dict[str, Any]]:
    """Rebuild the fake-quant student saved in ``directory``.

    The teacher is ``teacher`` (an already loaded model: the caller vouches for it), else loaded from
    ``teacher_dir``, else from where the student recorded it (:func:`teacher_dir_of`); a loaded teacher is checked
    against the recorded content hash unless ``check_teacher`` is off. ``meta["teacher"]`` is the directory used."""
    directory = Path(directory)
    meta = read_meta(directory)
    if teacher is None:
        source = Path(teacher_dir) if teacher_dir is not None else teacher_dir_of(directory, meta)
        if check_teacher:
            check_student_teacher(directory, meta, source)
        teacher = load_looplm(source)
        meta = {**meta, "teacher": str(source.resolve())}
    config = QuantConfig.from_dict(meta["quant"])
    student = prepare(teacher, config)
    groups = quant_groups(student)
    for name in meta["promoted"]:
        if name not in groups:
            raise StudentFormatError(f"{directory / CONFIG}: promoted group {name!r} does not exist in the teacher")
        groups[name].promote()
    state = read_safetensors(directory / WEIGHTS, StudentFormatError, RECALIBRATE)
    expected = {n for n, p in student.named_parameters() if p.requires_grad}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise StudentFormatError(
            f"{directory / WEIGHTS}: parameters do not match (missing {missing[:5]}, extra {extra[:5]})"
        )
    student.load_state_dict(state, strict=False)
    return student.eval(), meta
