"""Writing and loading a calibrated student: safetensors of the quantization parameters + a JSON description.

A student directory holds :data:`~loopq.artifacts.layout.STUDENT_WEIGHTS` (transforms, clipping logits, adapters -
everything the teacher does not have) and :data:`~loopq.artifacts.layout.STUDENT_META` (:func:`student_meta`:
QuantConfig, teacher directory, promoted groups, calibrated loop count, final mu_t, and the provenance: the
teacher's content hash and the resolved calibration config), sealed with the size and sha256 of the weights
(:mod:`loopq.artifacts.seal`): an edited description, weights changed or copied in from another student, or a
quant config that disagrees with the recorded calibration config are refused with one line naming the file.
:func:`load_student` rebuilds the structure with ``prepare`` (every promotable group has its per-loop SLT slots from
the start) and loads the tensors strictly, the promotion flags included - no pickle anywhere. A student written
before that fixed layout (per-loop slots only in promoted groups) is refused with one line.
The teacher it loads (the recorded path, the same path relative to the student directory when the
run directory was moved, or one the caller passes) must have the recorded content hash: a student is never put on
top of another teacher (a rebuilt one included) unless the caller says ``check_teacher=False``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from loopq.artifacts.layout import STUDENT_FORMAT, STUDENT_LEGACY_FORMATS, STUDENT_META, STUDENT_WEIGHTS
from loopq.artifacts.ownership import begin, finish
from loopq.artifacts.seal import FILES, SEAL, check_quant_agrees, manifest, seal, unseal, verify_file
from loopq.errors import LoopQError
from loopq.files import read_json, read_safetensors, staged_files
from loopq.models import LoopLM, load_looplm
from loopq.models.base import dtype_problem
from loopq.provenance import ProvenanceError, flat_record, teacher_fingerprint
from loopq.quant import QuantConfig, prepare, quant_groups

RECALIBRATE = "calibrate the student again with python -m loopq.fit"
_WARNED: set[Path] = set()


class StudentFormatError(LoopQError):
    """Not a LoopQ student directory (or a damaged one); the message names the file."""


#: what the names of a student's SLT state buffers contain (anchors and promotion flags, :mod:`loopq.quant.modules`)
SLT_STATE = "slt_"
#: a promotable group's per-loop SLT slots (offsets to its anchors, :mod:`loopq.quant.modules`)
SLT_SLOTS = ("loop_transforms", "loop_weight_clip", "loop_act_clip")


def stored_tensors(student: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a student directory stores: the trainable quantization parameters and the SLT state buffers."""
    tensors = {n: p for n, p in student.named_parameters() if p.requires_grad}
    return tensors | {n: b for n, b in student.named_buffers() if SLT_STATE in n}


def quant_state(student: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`stored_tensors` on the CPU, a promoted group's unused shared parameters at the values it was promoted
    with (:meth:`~loopq.quant.modules.QuantLinearGroup.stored_shared`)."""
    tensors = stored_tensors(student)
    for name, group in quant_groups(student).items():
        stored = {f"{name}.{key}": value.clone() for key, value in group.stored_shared().items()}  # not the anchor
        tensors |= {key: value for key, value in stored.items() if key in tensors}  # the trainable ones
    return {n: t.detach().cpu().contiguous() for n, t in tensors.items()}


def student_meta(
    student: LoopLM,
    teacher_dir: str | Path,
    directory: str | Path,
    promoted: list[str],
    mu: list[float],
    provenance: dict[str, Any] | None,
) -> dict[str, Any]:
    """The :data:`STUDENT_META` of ``student`` calibrated on ``teacher_dir``, to be written to ``directory``: the
    teacher as an absolute path and relative to ``directory`` (a moved run directory with its teacher beside it)."""
    teacher = Path(teacher_dir).resolve()
    return {
        "format": STUDENT_FORMAT,
        "teacher": str(teacher),
        "teacher_relative": os.path.relpath(teacher, Path(directory).resolve()),
        "provenance": provenance,
        "arch": student.arch,
        "quant": student.quant_config.to_dict(),
        "promoted": list(promoted),
        "calibrated_loops": student.calibrated_loops,
        "mu": list(mu),
    }


def write_student(student: torch.nn.Module, meta: dict[str, Any], directory: str | Path) -> Path:
    """Write ``student``'s quantization parameters and ``meta`` (:func:`student_meta`), both files renamed into place
    only once both are written (an earlier student stays whole if writing fails); the description, in the current
    format, holds the weights' size and sha256, sealed."""
    directory = Path(directory)
    state = quant_state(student)
    begin(directory, "student", [STUDENT_WEIGHTS, STUDENT_META])
    with staged_files(directory) as files:
        weights = files.write(STUDENT_WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": STUDENT_FORMAT}))
        sealed = seal({**meta, "format": STUDENT_FORMAT, FILES: manifest(directory, {STUDENT_WEIGHTS: weights})})
        files.write(STUDENT_META, lambda p: p.write_text(json.dumps(sealed, indent=2) + "\n"))
    finish(directory)
    return directory


def check_student_dir(directory: str | Path) -> None:
    """Both files of a student directory are there (before anything is loaded or written)."""
    for name in (STUDENT_META, STUDENT_WEIGHTS):
        if not (Path(directory) / name).is_file():
            raise StudentFormatError(
                f"{Path(directory) / name}: missing - {directory} is not a LoopQ student directory "
                "(write one with python -m loopq.fit)"
            )


def read_student_meta(directory: str | Path) -> dict[str, Any]:
    """The checked, unsealed :data:`STUDENT_META` of a student directory (a legacy format is read with a warning
    that it is not verified)."""
    path = Path(directory) / STUDENT_META
    if not path.is_file():
        raise StudentFormatError(f"{path}: missing - {directory} is not a LoopQ student (run python -m loopq.fit)")
    meta = read_json(path, StudentFormatError, RECALIBRATE)
    if not isinstance(meta, dict):
        raise StudentFormatError(f"{path}: not a JSON object; {RECALIBRATE}")
    if meta.get("format") in STUDENT_LEGACY_FORMATS:
        check_legacy_labels(Path(directory), meta)
        warn_legacy(path, meta["format"])
    elif meta.get("format") != STUDENT_FORMAT:
        raise StudentFormatError(f"{path}: format {meta.get('format')!r} is not {STUDENT_FORMAT!r}; {RECALIBRATE}")
    else:
        meta = unseal(meta, path, StudentFormatError, RECALIBRATE)
    check_quant_agrees(meta, path, StudentFormatError, RECALIBRATE)
    return meta


def check_legacy_labels(directory: Path, meta: dict[str, Any]) -> None:
    """A description labelled with a legacy format must be one: no seal or manifest (which legacy formats never
    wrote), and a weights file whose own header names the same format. A current student relabelled legacy - to
    dodge the seal after an edit - is refused, since nothing of it could then be verified."""
    path, fmt = directory / STUDENT_META, meta["format"]
    extra = [key for key in (SEAL, FILES) if key in meta]
    weights = directory / STUDENT_WEIGHTS
    header = weights_format(weights) if weights.is_file() else fmt
    if extra or header != fmt:
        found = f"carries {' and '.join(extra)}" if extra else f"its weights file says format {header!r}"
        raise StudentFormatError(
            f"{path}: labelled {fmt!r} but {found}, which a {fmt} student never has: the description was relabelled "
            f"after it was written, so nothing in it can be verified; {RECALIBRATE}"
        )


def weights_format(path: Path) -> str | None:
    """The ``format`` a safetensors file's header records (None when it records none or is not readable)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format")
    except (SafetensorError, OSError):
        return None


def check_exportable(meta: dict[str, Any], directory: Path | None = None) -> None:
    """An export seals what it is made from, so it is made only from a verified student: a description of a legacy
    format is refused (``directory``: where it was read, checked for relabelling first - :func:`check_legacy_labels`;
    a ``meta`` without a format is a caller's own, not read from a directory)."""
    if meta.get("format") not in STUDENT_LEGACY_FORMATS:
        return
    if directory is not None:
        check_legacy_labels(directory, meta)
    where = "the student" if directory is None else directory / STUDENT_META
    raise StudentFormatError(
        f"{where}: format {meta['format']!r} is not content-verified, and an export would seal its unverified bits "
        f"and provenance as {STUDENT_FORMAT}'s; {RECALIBRATE}, then export"
    )


def warn_legacy(path: Path, fmt: str) -> None:
    """One warning line per legacy student description and process: it is read, but nothing in it is verified."""
    if path.resolve() not in _WARNED:
        _WARNED.add(path.resolve())
        print(f"[loopq] warning: {path}: format {fmt} is not content-verified; {RECALIBRATE} to seal it",
              file=sys.stderr, flush=True)  # fmt: skip


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
        f"{directory / STUDENT_META}: its teacher {recorded} is not there (nor at {relative!r} relative to the "
        "student); pass the teacher directory (--teacher)"
    )


def check_student_teacher(directory: Path, meta: dict[str, Any], teacher_dir: str | Path) -> None:
    """The teacher must be the one the student was calibrated on (same content hash)."""
    recorded = (meta.get("provenance") or {}).get("teacher_sha256")
    if recorded is None:
        return  # written before provenance was recorded: nothing to compare
    actual = teacher_fingerprint(teacher_dir)
    if actual != recorded:
        raise ProvenanceError(
            f"{directory / STUDENT_META}: calibrated on teacher {recorded[:12]} but {teacher_dir} is {actual[:12]} "
            "(rebuilt or another model); recalibrate on this teacher, or pass the original teacher directory"
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
    meta = read_student_meta(directory)
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
            raise StudentFormatError(
                f"{directory / STUDENT_META}: promoted group {name!r} does not exist in the teacher"
            )
    if meta["format"] == STUDENT_FORMAT:
        verify_file(directory, STUDENT_WEIGHTS, meta, STUDENT_META, StudentFormatError, RECALIBRATE)
    state = read_safetensors(directory / STUDENT_WEIGHTS, StudentFormatError, RECALIBRATE)
    check_student_state(directory / STUDENT_WEIGHTS, state, student)
    student.load_state_dict(state, strict=False)
    flagged = sorted(n for n, g in groups.items() if g.promoted)
    if flagged != sorted(meta["promoted"]):
        raise StudentFormatError(
            f"{directory / STUDENT_META}: promoted {sorted(meta['promoted'])} but its weights flag {flagged}; "
            f"{RECALIBRATE}"
        )
    return student.eval(), meta


def fixed_layout_only(name: str) -> bool:
    """Whether stored tensor ``name`` is one a student written before the fixed SLT layout lacks: a per-loop slot
    (that layout had them in promoted groups only) or SLT state (it had none). The student format was not bumped with
    the layout, so such a student is known by these missing tensors."""
    return any(part in SLT_SLOTS or part.startswith(SLT_STATE) for part in name.split("."))


def check_student_state(path: Path, state: dict[str, torch.Tensor], student: torch.nn.Module) -> None:
    """The weights file holds exactly the student's trainable parameters, each of its shape and of a float dtype
    (``load_state_dict`` would cast an int32 tensor silently, or fail with a traceback on a wrong shape)."""
    params = stored_tensors(student)
    missing = sorted(set(params) - set(state))
    if missing and all(fixed_layout_only(n) for n in missing):
        raise StudentFormatError(
            f"{path}: written before the fixed SLT layout (no per-loop slots {missing[:2]}); {RECALIBRATE}"
        )
    if set(state) != set(params):
        extra = sorted(set(state) - set(params))
        raise StudentFormatError(f"{path}: parameters do not match (missing {missing[:5]}, extra {extra[:5]})")
    for name, tensor in state.items():
        problem = dtype_problem(tensor, params[name])
        if problem is None and tensor.shape != params[name].shape:
            problem = f"has shape {tuple(tensor.shape)}, the student built from its teacher {tuple(params[name].shape)}"
        if problem is not None:
            raise StudentFormatError(f"{path}: tensor {name!r} {problem}; {RECALIBRATE}")


def student_at_checkpoint(directory: str | Path, ckpt_path: str | Path, out: str | Path) -> Path:
    """Write to ``out`` the student of the calibration that wrote ``directory`` as it was at ``ckpt_path``, one of
    that run's checkpoints (same teacher and config, else refused in one line): the last step's when
    ``model.student_from: best`` chose another, or any step's, to compare them (issue 41). The checkpoint is read
    weights-only; ``provenance.selected`` records it and its step."""
    from loopq.artifacts.layout import check_output_dir
    from loopq.calib.checkpoint_io import load_weights_only

    if not Path(ckpt_path).is_file():
        what = "a directory (DeepSpeed's checkpoints are not read here)" if Path(ckpt_path).is_dir() else "not found"
        raise StudentFormatError(f"{ckpt_path}: {what}; pass a .ckpt file from the run's checkpoints/ folder")
    check_output_dir(out, [directory], "out")  # never the run's own student, nor any other model directory
    state = load_weights_only(ckpt_path)
    recorded = (state.get("loopq") or {}).get("provenance")
    if recorded is None or flat_record(recorded) != flat_record(read_student_meta(directory).get("provenance")):
        raise StudentFormatError(
            f"{ckpt_path}: not a checkpoint of the calibration that wrote {directory} (another teacher or config); "
            "pass one from that run's checkpoints/ folder"
        )
    student, meta = load_student(directory)
    prefix = "student."
    weights = {k[len(prefix) :]: v for k, v in state["state_dict"].items() if k.startswith(prefix)}
    missing = sorted(stored_tensors(student).keys() - weights.keys())
    if missing:  # the frozen weights are the teacher's and not in a checkpoint; everything calibrated must be
        raise StudentFormatError(f"{ckpt_path}: holds no {missing[0]} (and {len(missing) - 1} more); {RECALIBRATE}")
    unexpected = student.load_state_dict(weights, strict=False).unexpected_keys
    if unexpected:
        raise StudentFormatError(f"{ckpt_path}: {unexpected[0]} is not a tensor of this student; {RECALIBRATE}")
    promoted = [name for name, group in quant_groups(student).items() if group.promoted]
    selected = {"checkpoint": str(Path(ckpt_path).resolve()), "step": int(state["global_step"])}
    provenance = {**meta["provenance"], "selected": selected}
    return write_student(
        student, student_meta(student, meta["teacher"], out, promoted, state["loopq"]["mu"], provenance), out
    )
