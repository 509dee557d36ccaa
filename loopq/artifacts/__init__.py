"""LoopQ's model directories - teachers, calibrated students and packed exports - in one layer, outside the
Lightning code: their file names and formats (:mod:`~loopq.artifacts.layout`), writing and reading a student
(:mod:`~loopq.artifacts.student`) and converting, writing and loading an export (:mod:`~loopq.artifacts.quantized`).

:func:`load_artifact` is the one entry point for commands that take "a model": it tells the kind from the files
(:func:`artifact_kind`) and returns ``(model, meta, kind)``::

    model, meta, kind = load_artifact("runs/tiny/student")      # fake-quant student on its recorded teacher
    model, meta, kind = load_artifact("runs/tiny/exported")     # packed W4A4 model (Triton kernels)
    model, meta, kind = load_artifact("loopq/assets/tiny-ouro") # the FP teacher (or a hub id)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from loopq.artifacts.layout import ArtifactKind, check_output_dir, model_kind
from loopq.artifacts.quantized import ExportError, convert, export_student, load_quantized, read_export_meta
from loopq.artifacts.student import (
    StudentFormatError,
    check_student_dir,
    check_student_teacher,
    load_student,
    read_student_meta,
    student_meta,
    write_student,
)
from loopq.models import LoopLM, load_looplm
from loopq.models.loading import architecture_for, read_config, resolve_model_dir
from loopq.quant.config import FP_LABEL, Bits
from loopq.quant.prepare import cast_student

__all__ = [
    "Artifact",
    "ArtifactKind",
    "ExportError",
    "StudentFormatError",
    "artifact_kind",
    "check_output_dir",
    "check_student_dir",
    "check_student_teacher",
    "convert",
    "export_student",
    "load_artifact",
    "load_quantized",
    "load_student",
    "model_kind",
    "read_artifact_meta",
    "read_export_meta",
    "read_student_meta",
    "student_meta",
    "tokenizer_dir",
    "write_student",
]


class Artifact(NamedTuple):
    """A loaded model directory: the model, its description and its kind."""

    model: LoopLM
    meta: dict[str, Any]
    kind: ArtifactKind

    @property
    def bits(self) -> str:
        """``w4a4``, ``w4a8``, ... for a student or export; ``fp`` for a teacher."""
        quant = self.meta.get("quant")
        return Bits(quant["w_bits"], quant["a_bits"]).label if quant else FP_LABEL.lower()


def artifact_kind(path: str | Path) -> ArtifactKind:
    """``export`` or ``student`` when ``path`` is a directory with that kind's description or weights, else
    ``teacher`` (a model directory or hub id; :func:`~loopq.models.load_looplm` says when it is neither)."""
    kind = model_kind(Path(path))
    return kind if kind in ("export", "student") else "teacher"


def read_artifact_meta(path: str | Path, kind: ArtifactKind | None = None) -> tuple[dict[str, Any], ArtifactKind]:
    """The checked description of a student or export directory without loading its model (a teacher's is
    ``{"arch", "teacher"}`` read from its config). ``kind``: the kind the caller expects (its reader's error names
    the missing file), else :func:`artifact_kind`."""
    kind = kind or artifact_kind(path)
    if kind == "export":
        return read_export_meta(path), kind
    if kind == "student":
        check_student_dir(path)
        return read_student_meta(path), kind
    return teacher_meta(path), kind


def teacher_meta(path: str | Path) -> dict[str, Any]:
    """A teacher's description: its architecture and resolved directory."""
    directory = resolve_model_dir(path)
    return {
        "arch": architecture_for(read_config(directory), str(directory / "config.json")).arch,
        "teacher": str(directory),
    }


def load_artifact(
    path: str | Path,
    *,
    kind: ArtifactKind | None = None,
    teacher: str | Path | None = None,
    check_teacher: bool = True,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Artifact:
    """Load the model in ``path``: of ``kind`` when the caller expects one (a directory of another kind fails with
    that kind's one-line error naming the missing file), else whatever :func:`artifact_kind` finds.

    ``teacher``: a student's teacher directory when its recorded one is gone (it must have the recorded content
    hash unless ``check_teacher`` is off). ``dtype`` casts a teacher or student (a student's quantization parameters
    stay fp32: :func:`loopq.quant.prepare.cast_student`); an export casts its FP modules only (packed tensors keep
    their formats). ``meta["teacher"]`` of a student is the teacher directory used."""
    kind = kind or artifact_kind(path)
    if kind == "export":
        model, meta = load_quantized(path, device=device, dtype=dtype), read_export_meta(path)
    elif kind == "student":
        check_student_dir(path)
        model, meta = load_student(path, teacher_dir=teacher, check_teacher=check_teacher)
        model = cast_student(model, dtype, device)  # quantization parameters stay fp32 under a bf16/fp16 dtype
    else:
        model, meta = load_looplm(path, dtype=dtype).to(device), teacher_meta(path)
    return Artifact(model, meta, kind)


def tokenizer_dir(path: str | Path, artifact: Artifact) -> Path:
    """Where the tokenizer of a loaded artifact is: an export carries its own, a student uses its teacher's."""
    if artifact.kind == "export":
        return Path(path)
    return Path(artifact.meta["teacher"])
