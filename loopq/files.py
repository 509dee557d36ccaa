"""Crash-safe writes and readers that name the file: the bottom of the package (imports nothing from loopq but
:mod:`loopq.errors`). Every artifact LoopQ writes goes through :func:`atomic_write`; every JSON / safetensors file it
reads goes through :func:`read_json` / :func:`read_safetensors`, whose errors name the file and say what to do."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from loopq.errors import LoopQError


def dangling_link(path: str | os.PathLike[str]) -> Path | None:
    """The first of ``path`` and its parents that is a symbolic link to nothing (None: there is none). Such a link
    does not ``exist()``, yet ``mkdir`` fails on it with ``FileExistsError``: a check that looks for the nearest
    existing parent walks past it."""
    for part in (Path(path), *Path(path).parents):
        if part.is_symlink() and not part.exists():
            return part
    return None


def in_the_way(path: str | os.PathLike[str]) -> str | None:
    """Why the directory ``path`` cannot be created or used (a link to nothing, a file where it or a parent should
    be), for a message that names the option; None when nothing is in the way."""
    link = dangling_link(path)
    if link is not None:
        target = os.readlink(link)
        return f"{link} is a symbolic link to {target}, which does not exist; create it or pass another path"
    for part in (Path(path), *Path(path).parents):
        if part.exists():
            return None if part.is_dir() else f"{part} is a file, not a directory; pass another path"
    return None


def read_json(path: Path, error: type[Exception] = LoopQError, fix: str = "fix or rewrite it") -> Any:
    """The JSON document in ``path``; a missing, unreadable or malformed file raises ``error`` naming the file
    and, for a syntax error, where it is (``fix`` says what to do)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); {fix}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"{path}: cannot be read as JSON text ({err}); {fix}") from None


def read_json_object(path: Path, error: type[Exception] = LoopQError, fix: str = "fix or rewrite it") -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object (a ``config.json``): a list, a number or a string
    raises ``error`` naming the file and what it holds, where the callers' ``config.get`` crashed with a traceback."""
    data = read_json(path, error, fix)
    if not isinstance(data, dict):
        kind = "null" if data is None else type(data).__name__
        raise error(f"{path}: holds a JSON {kind}, not a JSON object of settings; {fix}")
    return data


def read_safetensors(
    path: Path, error: type[Exception] = LoopQError, fix: str = "re-download or re-export it"
) -> dict[str, Tensor]:
    """The tensors of a safetensors file; a missing, truncated or foreign file raises ``error`` naming it (``fix``
    says how to get an intact copy; a torch zip/pickle checkpoint is told apart and pointed to a conversion)."""
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError) as err:
        if zipfile.is_zipfile(path):
            raise error(
                f"{path}: a torch zip/pickle checkpoint, not safetensors; convert it (load it with torch.load "
                "and write it with safetensors.torch.save_file)"
            ) from None
        raise error(f"{path}: not a readable safetensors file, truncated or corrupt ({err}); {fix}") from None


class StagedFiles:
    """Several files of one directory written as one change (:func:`staged_files`): :meth:`write` writes a file
    under ``atomic_write``'s temporary name (``.<name>.<random>.tmp``, which the output journals recognise as a
    leftover) and returns that path; the block's end renames them all into place, in the order written."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.pending = Path(directory), []

    def write(self, name: str, write: Any) -> Path:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        self.pending.append((Path(tmp), self.directory / name))
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        return Path(tmp)


@contextlib.contextmanager
def staged_files(directory: Path) -> Iterator[StagedFiles]:
    """Write every file first, then rename them into place: a failure while writing (a full disk, an error in the
    middle) leaves every earlier file as it was, where file-by-file ``atomic_write`` had replaced the first files of
    an earlier output before the error, leaving it neither old nor new (a re-export that failed on its tokenizer
    copy destroyed the previous export). Only the renames, microseconds, stay between two consistent states."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    files = StagedFiles(directory)
    try:
        yield files
    except BaseException:
        for tmp, _ in files.pending:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in files.pending:
        os.replace(tmp, final)


def atomic_write(path: Path, write: Any) -> None:
    """Call ``write(tmp_path)`` then rename onto ``path``: a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
