"""Saving and loading a calibrated student: safetensors of the quantization parameters + a JSON quant config.

A student directory holds ``loopq_student.safetensors`` (transforms, clipping logits, adapters - everything the
teacher does not have) and ``loopq_quant.json`` (QuantConfig, teacher directory, promoted groups, calibrated loop
count, final mu_t). :func:`load_student` rebuilds structure first (prepare + re-promotion) and then loads the
tensors strictly - no pickle anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loopq.errors import LoopQError
from loopq.models import LoopLM, load_looplm
from loopq.models.io import atomic_write, read_json, read_safetensors
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
    meta = {
        "format": FORMAT,
        "teacher": str(Path(module.teacher_dir).resolve()),
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


def load_student(directory: str | Path, teacher: LoopLM | None = None) -> tuple[LoopLM, dict[str, Any]]:
    """Rebuild the fake-quant student saved in ``directory`` (teacher reloaded from the recorded path)."""
    directory = Path(directory)
    meta = read_meta(directory)
    teacher = teacher if teacher is not None else load_looplm(meta["teacher"])
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
