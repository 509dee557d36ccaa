"""Crash-safe checkpoint files: write to a temporary file in the same folder, fsync, then atomically rename.

A process killed while saving leaves the previous checkpoint intact (the rename is the commit point). Loading
uses ``torch.load(weights_only=True)``: LoopQ checkpoints hold only tensors and plain Python values, so nothing
is ever unpickled.

A checkpoint can still be damaged later (a full disk, a copy cut short). :func:`newest_intact` is what
``--ckpt_path last`` resumes from: the newest checkpoint whose zip archive is whole - every member's CRC is checked,
which reads the file once and unpickles nothing - skipping (with one line each) newer ones that are not. A DeepSpeed
checkpoint is a directory: it counts as whole when LoopQ's sidecar (written last) is readable and every ``.pt`` in
it is. :func:`check_ckpt_path` applies the same test to a ``--ckpt_path`` the user names, before the teacher loads.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from loopq.artifacts.layout import model_kind
from loopq.errors import LoopQError, article


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        target = Path(path)
        if not target.is_file():
            raise FileNotFoundError(f"checkpoint {target} does not exist; pass --ckpt_path last or a .ckpt file")
        try:
            return torch.load(target, map_location=map_location or "cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"{target}: not a loadable LoopQ checkpoint (weights-only load failed: {err})") from err


class CheckpointError(LoopQError):
    """No checkpoint to resume from is readable; the message names the folder and what to do."""


def _zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"not a whole checkpoint archive ({err})"
    return None if bad is None else f"member {bad} fails its CRC check"


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` (a checkpoint file, or a DeepSpeed checkpoint directory) cannot be resumed from; None if whole."""
    if path.is_dir():
        sidecar = path / "loopq.json"  # loopq.calib.deepspeed.SIDECAR, written after the checkpoint itself
        try:
            json.loads(sidecar.read_text())
        except (OSError, ValueError) as err:
            return f"{sidecar.name} unreadable ({type(err).__name__}): the save did not finish"
        problems = [(pt, _zip_problem(pt)) for pt in sorted(path.rglob("*.pt"))]
        return next((f"{pt.relative_to(path)}: {why}" for pt, why in problems if why), None)
    if not path.is_file():
        return "missing"
    if path.stat().st_size == 0:
        return "empty file"
    return _zip_problem(path)


#: what ``--ckpt_path`` takes, for the messages that refuse something else
CKPT_PATH_TAKES = (
    "--ckpt_path takes 'last' or a checkpoint under <run>/checkpoints (a .ckpt file, or a DeepSpeed checkpoint "
    "directory)"
)


def _file_problem(path: Path) -> str | None:
    """Why the file ``path`` is not a whole ``torch.save`` archive (which holds ``<name>/data.pkl``); None if it is."""
    if not zipfile.is_zipfile(path):
        with path.open("rb") as f:
            zip_start = f.read(4) == b"PK\x03\x04"
        if zip_start:
            return "a zip archive cut short or damaged (its central directory is missing)"
        return "not a checkpoint: not the zip archive torch.save writes"
    problem = checkpoint_problem(path)
    if problem is not None:
        return problem
    with zipfile.ZipFile(path) as archive:
        if any(name.endswith("data.pkl") for name in archive.namelist()):
            return None
    return "a zip archive, but not one written by torch.save"


def _directory_problem(path: Path) -> str | None:
    """Why the directory ``path`` is not a whole DeepSpeed checkpoint; None if it is."""
    if next(path.rglob("*.pt"), None) is None:
        return "a directory without checkpoint files (a DeepSpeed checkpoint holds .pt files and loopq.json)"
    return checkpoint_problem(path)


def check_ckpt_path(ckpt_path: str | None) -> None:
    """A ``--ckpt_path`` other than ``last`` must be a whole checkpoint: refused before any work, with one line
    saying what it is instead (missing, a run, student or other model directory, a file that is no checkpoint)."""
    if ckpt_path in (None, "last"):
        return
    path = Path(ckpt_path)
    if not path.exists():
        raise CheckpointError(f"--ckpt_path {path}: no such file or directory; {CKPT_PATH_TAKES}")
    if (path / "checkpoints").is_dir():
        raise CheckpointError(
            f"--ckpt_path {path}: is a run directory; pass --ckpt_path last with --trainer.default_root_dir {path}, or "
            f"a checkpoint under {path / 'checkpoints'}"
        )
    kind = model_kind(path)
    if kind is not None:
        what = "a calibrated student" if kind == "student" else f"{article(kind)} directory"
        raise CheckpointError(f"--ckpt_path {path}: is {what}, not a calibration checkpoint; {CKPT_PATH_TAKES}")
    problem = _directory_problem(path) if path.is_dir() else _file_problem(path)
    if problem is not None:
        raise CheckpointError(f"--ckpt_path {path}: {problem}; {CKPT_PATH_TAKES}")


def newest_intact(candidates: Iterable[Path], option: str = "--ckpt_path last") -> Path | None:
    """The newest (modification time) whole checkpoint among ``candidates``; prints one line per newer one it skips.
    None when there are no candidates; :class:`CheckpointError` when none of them is whole."""
    ordered = sorted(candidates, key=lambda p: p.stat().st_mtime_ns, reverse=True)
    skipped: list[str] = []
    for path in ordered:
        problem = checkpoint_problem(path)
        if problem is None:
            if skipped:
                print(f"[loopq] {option}: resuming from {path}", file=sys.stderr, flush=True)
            return path
        skipped.append(f"{path.name} ({problem})")
        print(f"[loopq] {option}: skipped {path}: {problem}", file=sys.stderr, flush=True)
    if ordered:
        raise CheckpointError(
            f"{option}: no readable checkpoint in {ordered[0].parent} ({'; '.join(skipped)}); move them away to start "
            "fresh, or pass --ckpt_path <file>"
        )
    return None
