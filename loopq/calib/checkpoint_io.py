"""Crash-safe checkpoint files: write to a temporary file in the same folder, fsync, then atomically rename.

A process killed while saving leaves the previous checkpoint intact (the rename is the commit point). Loading
uses ``torch.load(weights_only=True)``: LoopQ checkpoints hold only tensors and plain Python values, so nothing
is ever unpickled.

A checkpoint can still be damaged later (a full disk, a copy cut short). :func:`newest_intact` is what
``--ckpt_path last`` resumes from: the newest checkpoint whose zip archive is whole - every member's CRC is checked,
which reads the file once and unpickles nothing - skipping newer ones that are not (named when it resumes from an
older one; when none is whole, one error line names them all). :func:`check_ckpt_path` applies the same test to a
``--ckpt_path`` the user names, before the teacher loads. A file that is whole but holds objects a weights-only load
refuses (a pickle payload) is refused with one line by :func:`load_weights_only`, never unpickled.

**DeepSpeed checkpoints are sealed.** A DeepSpeed checkpoint is a directory, and DeepSpeed's own checkpoint engine
opens its ``.pt`` files with a full unpickle: a planted file would run code. LoopQ's strategy makes that engine read
weights-only (``loopq.calib.deepspeed.weights_only_deepspeed_loads``), since the seal below is a checksum anyone can
recompute, not a signature. And LoopQ seals the directory when it writes it, as students and exports are sealed
(:mod:`loopq.artifacts.seal`):
the sidecar ``loopq.json`` is removed before DeepSpeed writes, and written last with the size and sha256 of every
other file of the directory and a seal over itself (:func:`write_sidecar`). :func:`sealed_problem` accepts the
directory only when the sidecar is there and sealed, no file is missing or added, and every file has its recorded
hash; it runs when ``--ckpt_path`` is checked or ``last`` resolved (before the teacher loads) and again right before
DeepSpeed opens the files (``LoopQDeepSpeedStrategy.load_checkpoint``). A save cut short leaves no sidecar ("the
save did not finish"); a file changed or added afterwards fails its hash. The cost is one sequential read of the
checkpoint per check. As with students, the seal is a consistency check, not a signature: whoever rewrites the files
and the sidecar on purpose is not stopped - nor is whoever can write into the run directory's code.
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
from loopq.artifacts.seal import FILES, SEAL, manifest, seal, sha256_file
from loopq.errors import LoopQError, article

#: the LoopQ state (and seal) a DeepSpeed checkpoint directory carries next to DeepSpeed's own files
SIDECAR = "loopq.json"


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
        return load_weights_only(target, map_location)


class CheckpointError(LoopQError):
    """No checkpoint to resume from is readable; the message names the folder and what to do."""


def load_weights_only(
    path: str | os.PathLike,
    map_location: Any = None,
    mmap: bool = False,
    kind: str = "calibration",
    writer: str = "loopq.fit",
) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``; a file holding anything else (a pickle payload, another program's
    objects) is a :class:`CheckpointError` of one line naming the file and the first refused object, not
    ``UnpicklingError``'s page of advice to load it unsafely (``kind`` / ``writer``: what the caller expects and
    which command writes it, for that line)."""
    try:
        state = torch.load(path, map_location=map_location or "cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # UnpicklingError, RuntimeError (not a zip, bad storage), EOFError, ...
        first = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        why = first or f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        raise CheckpointError(
            f"{path}: not a LoopQ {kind} checkpoint - it holds objects other than tensors and plain values "
            f"({why.rstrip('.')}), and LoopQ never unpickles those; pass a checkpoint {writer} wrote"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a {kind} checkpoint")
    return state


# ---------------------------------------------------------------------------------------------------- DeepSpeed seal
def sealed_names(directory: Path) -> list[str]:
    """Every file under ``directory`` but the sidecar (and its temporary), as POSIX paths relative to it."""
    skip = {SIDECAR, f".{SIDECAR}.tmp"}
    files = (p for p in sorted(Path(directory).rglob("*")) if p.is_file() or p.is_symlink())
    return [p.relative_to(directory).as_posix() for p in files if p.relative_to(directory).as_posix() not in skip]


def write_sidecar(directory: Path, state: dict[str, Any]) -> Path:
    """Write ``directory/loopq.json``: ``state`` plus the size and sha256 of every other file of the directory,
    sealed (module docstring); atomically, as the last file of the checkpoint."""
    names = sealed_names(directory)
    target = Path(directory) / SIDECAR
    tmp = target.with_name(f".{SIDECAR}.tmp")
    tmp.write_text(json.dumps(seal({**state, FILES: manifest(directory, names)}), indent=2) + "\n")
    os.replace(tmp, target)
    return target


def read_sidecar_state(directory: Path) -> dict[str, Any]:
    """The sealed sidecar of a DeepSpeed checkpoint directory, its seal checked (the files are not:
    :func:`sealed_problem`), without the seal; :class:`CheckpointError` naming the file otherwise."""
    path = Path(directory) / SIDECAR
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing - the save did not finish, or loopq.fit did not write it") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}) - the save did not finish") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: holds a {type(meta).__name__}, not LoopQ's checkpoint record")
    if SEAL not in meta:
        raise CheckpointError(f"{path}: has no {SEAL} seal (written by an older LoopQ, or not by LoopQ)")
    if meta[SEAL] != seal(meta)[SEAL]:
        raise CheckpointError(f"{path}: edited after it was written (its content no longer matches {SEAL})")
    return {k: v for k, v in meta.items() if k != SEAL}


def sealed_problem(directory: Path) -> str | None:
    """Why the DeepSpeed checkpoint ``directory`` is not exactly what LoopQ sealed (module docstring); None if it is.
    Reads every file once; unpickles nothing."""
    try:
        meta = read_sidecar_state(directory)
    except CheckpointError as err:
        return f"{SIDECAR}: {str(err).removeprefix(f'{Path(directory) / SIDECAR}: ')}"
    recorded = meta.get(FILES)
    if not isinstance(recorded, dict) or not recorded:
        return f"{SIDECAR} records no files"
    present = sealed_names(directory)
    added = sorted(set(present) - set(recorded))
    if added:
        return f"{added[0]} was not in the checkpoint when it was written (added since)"
    for name, entry in recorded.items():
        path = Path(directory) / name
        if not path.is_file() or path.is_symlink():
            return f"{name}: missing (or replaced by a link) since the checkpoint was written"
        if path.stat().st_size != entry.get("size") or sha256_file(path) != entry.get("sha256"):
            return f"{name}: changed since the checkpoint was written (its size or sha256 is not the recorded one)"
    return None


def check_sealed(directory: str | os.PathLike) -> None:
    """:class:`CheckpointError` when ``directory`` fails :func:`sealed_problem` - called right before DeepSpeed
    unpickles its files."""
    problem = sealed_problem(Path(directory))
    if problem is not None:
        raise CheckpointError(
            f"{directory}: {problem}; refused: DeepSpeed would unpickle it. Resume from another "
            "checkpoint, or start fresh without --ckpt_path"
        )


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
        return sealed_problem(path)
    if path.is_symlink() and not path.exists():
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
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


def modified(path: Path) -> int:
    """When ``path`` was last modified (ns); a symbolic link to nothing: the link's own time (``stat`` raised)."""
    return (path.stat() if path.exists() else path.lstat()).st_mtime_ns


def newest_intact(candidates: Iterable[Path], option: str = "--ckpt_path last", quiet: bool = False) -> Path | None:
    """The newest (modification time) whole checkpoint among ``candidates``; prints one line per newer one it skips
    (unless ``quiet``). None when there are no candidates; :class:`CheckpointError` when none of them is whole."""
    ordered = sorted(candidates, key=modified, reverse=True)
    skipped: list[tuple[Path, str]] = []
    for path in ordered:
        problem = checkpoint_problem(path)
        if problem is None:
            for bad, why in [] if quiet else skipped:
                print(f"[loopq] {option}: skipped {bad}: {why}", file=sys.stderr, flush=True)
            if skipped and not quiet:
                print(f"[loopq] {option}: resuming from {path}", file=sys.stderr, flush=True)
            return path
        skipped.append((path, problem))
    if ordered:
        raise CheckpointError(
            f"{option}: no readable checkpoint in {ordered[0].parent} "
            f"({'; '.join(f'{bad.name} ({why})' for bad, why in skipped)}); move them away to start "
            "fresh, or pass --ckpt_path <file>"
        )
    return None
