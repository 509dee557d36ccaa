"""Ownership is proven, not assumed: which files of an output directory a LoopQ command may replace.

A command replaces an existing file only when a description *LoopQ sealed* lists it (:mod:`loopq.artifacts.seal`):

* the earlier output's own description - a student's ``loopq_quant.json``, an export's ``loopq_export.json``, a
  report's ``loopq_report.json`` - of the current format with an intact seal (:func:`sealed`). A file merely
  *named* like one (``{"format": "loopq-export-v1"}``, ``{}``) proves nothing: the folder is the user's;
* the *write journal* :data:`JOURNAL`, sealed into the directory before a command's first write and removed after
  its last (:func:`begin`, :func:`finish`). A command killed in between (SIGKILL, a power cut) leaves it behind; its
  rerun finds the journal and recognises the files it lists, and ``atomic_write``'s temporary leftovers of them, as
  its own (:func:`journal_files`) instead of refusing them as "files this command did not write".

The seal is a consistency check, not a signature: it tells LoopQ's writing from a user's, not from a forger's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loopq.artifacts.seal import FILES, SEAL, seal
from loopq.files import atomic_write

#: the write journal of a command writing a directory (removed when it finishes)
JOURNAL = ".loopq_writing.json"
JOURNAL_FORMAT = "loopq-writing-v1"


def seal_problem(path: Path, fmt: str) -> str | None:
    """Why ``path`` is not a description of format ``fmt`` that LoopQ sealed (None: it is one)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "it is missing"
    except (OSError, ValueError):
        return "it is not readable JSON"
    if not isinstance(data, dict):
        return "it is not a JSON object"
    if data.get("format") != fmt:
        return f"its format {data.get('format')!r} is not {fmt!r}"
    if SEAL not in data:
        return f"it has no {SEAL} seal"
    if data[SEAL] != seal(data)[SEAL]:
        return f"its content does not match its {SEAL} seal: it was edited after it was written"
    return None


def sealed(path: Path, fmt: str) -> dict[str, Any] | None:
    """The unsealed content of ``path`` when it is a description of format ``fmt`` LoopQ sealed, else None."""
    if seal_problem(path, fmt) is not None:
        return None
    return {k: v for k, v in json.loads(Path(path).read_text(encoding="utf-8")).items() if k != SEAL}


def listed_files(path: Path, fmt: str) -> list[str]:
    """The file names a sealed description lists under :data:`~loopq.artifacts.seal.FILES` (and the description
    itself), or ``[]`` when it is not one LoopQ sealed."""
    meta = sealed(path, fmt)
    if meta is None:
        return []
    files = meta.get(FILES)
    return [Path(path).name, *(files if isinstance(files, dict | list) else [])]


def begin(directory: Path, kind: str, names: Iterable[str]) -> None:
    """Seal the journal of a command about to write ``names`` (a ``kind`` output) into ``directory``."""
    record = seal({"format": JOURNAL_FORMAT, "kind": kind, FILES: sorted(set(names))})
    atomic_write(Path(directory) / JOURNAL, lambda p: p.write_text(json.dumps(record, indent=2) + "\n"))


def journal_kind(directory: Path) -> str | None:
    """The kind of output an interrupted command was writing into ``directory`` (its sealed journal), else None."""
    meta = sealed(Path(directory) / JOURNAL, JOURNAL_FORMAT)
    return None if meta is None else meta.get("kind")


def journal_files(directory: Path, kind: str) -> list[str]:
    """The files the sealed journal of an interrupted ``kind`` command lists, with their temporary leftovers and the
    journal itself; ``[]`` when there is none (or it is another kind's)."""
    meta = sealed(Path(directory) / JOURNAL, JOURNAL_FORMAT)
    if meta is None or meta.get("kind") != kind:
        return []
    names = [str(name) for name in meta.get(FILES) or []]
    return [JOURNAL, *names, *(p.name for p in leftovers(directory, names))]


def leftovers(directory: Path, names: Iterable[str]) -> list[Path]:
    """``atomic_write``'s temporary files of ``names`` (``.<name>.<random>.tmp``) in ``directory``."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    prefixes = tuple(f".{name}." for name in names)
    return [p for p in directory.iterdir() if p.name.startswith(prefixes) and p.name.endswith(".tmp")]


def is_bookkeeping(name: str) -> bool:
    """The journal and its temporary files: LoopQ's, never a user's, and never replaced by an output."""
    return name == JOURNAL or (name.startswith(f".{JOURNAL}.") and name.endswith(".tmp"))


def finish(directory: Path) -> None:
    """The command's last write is done: remove its journal and the temporary leftovers of an earlier, killed run."""
    directory = Path(directory)
    meta = sealed(directory / JOURNAL, JOURNAL_FORMAT)
    names = [str(name) for name in (meta or {}).get(FILES) or []]
    for path in leftovers(directory, [*names, JOURNAL]):
        path.unlink(missing_ok=True)
    (directory / JOURNAL).unlink(missing_ok=True)
