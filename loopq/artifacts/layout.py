"""What LoopQ's model directories are called and hold, and where a model may be written.

Every file name and format version of a student or export directory is a constant here and nowhere else:

* a **student** (``python -m loopq.fit``): :data:`STUDENT_WEIGHTS` (the quantization parameters: transforms, clipping
  logits, adapters) and :data:`STUDENT_META` (QuantConfig, the teacher, promoted groups, calibrated loops, mu_t and
  the provenance, sealed with the size and sha256 of the weights, :mod:`loopq.artifacts.seal`), format
  :data:`STUDENT_FORMAT` (:data:`STUDENT_LEGACY_FORMATS` are still read, unverified, with a warning);
* an **export** (``python -m loopq.export``): :data:`EXPORT_WEIGHTS` (every tensor of the packed model) and
  :data:`EXPORT_META` (the layout and the size and sha256 of every file, sealed by ``meta_sha256``), format
  :data:`EXPORT_FORMAT`, plus the teacher's ``config.json`` and :data:`TOKENIZER_FILES`;
* a **teacher**: any of :data:`TEACHER_FILES`; ``loopq.pretrain`` adds :data:`TRAINING_RECORD`, a stress variant
  written by ``loopq.testbed --outliers_out`` has ``outliers`` in its :data:`TESTBED_RECORD`.

:func:`model_kind` tells them apart; :func:`check_output_dir` refuses an output directory that is a file, is, contains
or lies inside a directory the command reads, or holds a model of a kind the command does not write (each command may
replace only its own earlier output: ``loopq.export`` an export, ``loopq.fit`` a student, ``loopq.testbed
--outliers_out`` a stress variant, ``loopq.pretrain`` a teacher it trained, ``loopq.stress`` a teacher it
fine-tuned). Symlinks are resolved first. A student or
export is replaced only when its description is one LoopQ sealed, or a sealed write journal says this command was
interrupted writing it (:mod:`loopq.artifacts.ownership`): ownership is proven, not assumed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from loopq.artifacts import ownership
from loopq.errors import GuardError, article

STUDENT_WEIGHTS = "loopq_student.safetensors"
STUDENT_META = "loopq_quant.json"
STUDENT_FORMAT = "loopq-student-v2"
#: older student formats still read: unsealed, weights not content-verified (a warning says so)
STUDENT_LEGACY_FORMATS = ("loopq-student-v1",)
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_META = "loopq_export.json"
EXPORT_FORMAT = "loopq-export-v3"  # v3: weights in the kernel layout (loopq.kernels.packing.tile_weight)
MODEL_CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "encoder.json", "vocab.bpe")
TEACHER_FILES = (MODEL_CONFIG, "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TRAINING_RECORD = "training_record.json"
TESTBED_RECORD = "testbed.json"
#: the lock file of a directory a command is writing (:class:`loopq.locks.DirectoryLock`)
RUN_LOCK = ".loopq.lock"

#: kinds whose description is sealed: ``kind -> (description file, format)``; only an intact one proves ownership
SEALED_KINDS = {"export": (EXPORT_META, EXPORT_FORMAT), "student": (STUDENT_META, STUDENT_FORMAT)}

#: what :func:`loopq.artifacts.load_artifact` loads
ArtifactKind = Literal["teacher", "student", "export"]


#: the kind of a teacher ``loopq.stress`` fine-tuned (its training record names that command)
STRESS_TRAINED = "stress-trained teacher"
#: every kind :func:`model_kind` names (what ``--overwrite true`` lets a teacher command's out_dir hold)
MODEL_KINDS = ("export", "student", "stress variant", STRESS_TRAINED, "pretrained teacher", "teacher")


def model_kind(directory: Path) -> str | None:
    """What model ``directory`` holds: ``export``, ``student``, ``stress variant`` (written by ``loopq.testbed
    --outliers_out``), ``pretrained teacher`` (written by ``loopq.pretrain``), ``stress-trained teacher`` (by
    ``loopq.stress``: the ``command`` of its training record says which), ``teacher`` (any other config.json or
    weights), or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    if (directory / EXPORT_META).exists():
        return "export"
    if (directory / STUDENT_META).exists() or (directory / STUDENT_WEIGHTS).exists():
        return "student"
    if not any((directory / name).exists() for name in TEACHER_FILES):
        return None
    if "outliers" in json_object(directory / TESTBED_RECORD):
        return "stress variant"
    if not (directory / TRAINING_RECORD).is_file():
        return "teacher"
    command = str(json_object(directory / TRAINING_RECORD).get("command", ""))
    return STRESS_TRAINED if command.startswith("python -m loopq.stress") else "pretrained teacher"


def json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when it is missing, unreadable or not an object (a probe, not a read)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def relation(out: Path, other: Path) -> str | None:
    """How ``out`` relates to ``other`` after resolving symlinks: ``is``, ``is inside``, ``contains`` or None."""
    a, b = out.resolve(), other.resolve()
    if a == b:
        return "is"
    if a.is_relative_to(b):
        return "is inside"
    return "contains" if b.is_relative_to(a) else None


def local_dirs(paths: Iterable[str | os.PathLike[str] | None]) -> list[Path]:
    """The given paths that exist on this machine (a hub id or a missing path cannot be overwritten here)."""
    return [Path(p) for p in paths if p is not None and str(p) and Path(p).exists()]


def proof_problem(out: Path, kind: str) -> str | None:
    """Why the ``kind`` output in ``out`` is not proven LoopQ's (:mod:`loopq.artifacts.ownership`): its description
    is not one LoopQ sealed. None when it is, or when ``kind`` has no sealed description (:data:`SEALED_KINDS`)."""
    if kind not in SEALED_KINDS:
        return None
    name, fmt = SEALED_KINDS[kind]
    problem = ownership.seal_problem(out / name, fmt)
    return None if problem is None else f"{out / name} is not a description LoopQ sealed ({problem})"


def check_output_dir(
    out: str | os.PathLike[str],
    reads: Iterable[str | os.PathLike[str] | None] = (),
    key: str = "--out",
    replaces: Sequence[str] = (),
) -> Path:
    """Refuse ``out`` if it is a file, is, is inside or contains a directory in ``reads``, holds a model whose kind
    (:func:`model_kind`) is not in ``replaces`` (the kinds this command writes itself), or one of such a kind whose
    description LoopQ did not seal (:func:`proof_problem`), unless a sealed write journal of one of those kinds
    says this command was interrupted writing it there (:mod:`loopq.artifacts.ownership`); returns ``out``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GuardError(f"{key} {out}: is a file, not a directory; pass a directory to write into")
    for read in local_dirs(reads):
        how = relation(out, read)
        if how is not None:
            raise GuardError(f"{key} {out}: {how} {read}, which this command reads; pass another directory")
    if ownership.journal_kind(out) in replaces:
        return out  # its own interrupted output: the caller replaces only the files the journal lists
    kind = model_kind(out)
    if kind is not None and kind not in replaces:
        raise GuardError(
            f"{key} {out}: holds {article(kind)} that this command would overwrite; pass another directory"
        )
    problem = proof_problem(out, kind) if kind is not None else None
    if problem is not None:
        raise GuardError(
            f"{key} {out}: {problem}, so nothing there is proven to be this command's to replace; move the folder "
            "away or pass another directory"
        )
    foreign = [p.name for p in out.iterdir() if not is_ours(p.name)] if kind is None and out.is_dir() else []
    if foreign:
        foreign.sort()
        raise GuardError(
            f"{key} {out}: holds files this command did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); pass a new or empty directory"
        )
    return out


def is_ours(name: str) -> bool:
    """The lock file and the write journal's files: never a user's file, never replaced by an output."""
    return name == RUN_LOCK or ownership.is_bookkeeping(name)


def check_owned(out: Path, writes: Iterable[str], owned: Iterable[str], key: str = "--out") -> None:
    """Refuse to write ``writes`` into ``out`` if one of them exists there but is not ``owned`` (listed in the
    manifest of the earlier output being replaced): a file the user put there is never overwritten."""
    owned = set(owned)
    clash = [name for name in writes if (Path(out) / name).exists() and name not in owned]
    if clash:
        raise GuardError(
            f"{key} {out}: {', '.join(clash)} there was not written by this command and would be overwritten; "
            "move it away or pass another directory"
        )
