"""One writer per directory: a lock file that names its holder, so a second command refuses instead of interleaving.

Two ``loopq.fit`` runs in one run directory used to both exit 0 with checkpoints of both mixed in ``checkpoints/``
and one run's student under the other's "written" line. :class:`DirectoryLock` creates its file with ``O_EXCL``
(atomic on local filesystems) holding the holder's pid, host, command and start time; a second command refuses
with one line naming them. A lock whose holder is gone is *stale*: on the same host a dead pid is detected and the
lock taken over (a process killed with SIGKILL leaves one behind); a lock from another host cannot be checked and
the message says which file to delete if that process no longer runs.

A single output file (``loopq.evaluate --out res.json``) is locked the same way by :func:`file_lock`.

The lock is re-entrant within a process (``loopq.run`` holds its run directory and calibrates through
``loopq.fit``'s CLI, which takes the same lock) and released at :meth:`DirectoryLock.release` or at exit. A
directory the lock itself created is removed again if it is still empty when the lock is released (a refused
command leaves no trace).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from loopq.errors import LoopQError
from loopq.files import in_the_way

#: lock path -> (how many holders in this process, whether the lock created the directory)
_HELD: dict[Path, list[Any]] = {}


class LockError(LoopQError):
    """Another command is writing the same directory; the message names it and the lock file."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def read_holder(path: Path) -> dict[str, Any] | None:
    """The holder a lock file names, or None when it is unreadable (being written, or damaged)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def is_stale(holder: dict[str, Any] | None) -> bool:
    """A lock is stale when its holder is unreadable or a process of this host that no longer runs."""
    return holder is None or (holder.get("host") == socket.gethostname() and not pid_alive(holder["pid"]))


def is_mine(holder: dict[str, Any] | None) -> bool:
    return holder is not None and holder.get("host") == socket.gethostname() and holder["pid"] == os.getpid()


class DirectoryLock:
    """The lock ``directory/name`` for ``command`` (``key``: the option that named the directory, or ``target``,
    the one file in it that the lock guards - see :func:`file_lock`)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        name: str,
        command: str,
        key: str,
        target: str | os.PathLike[str] | None = None,
    ) -> None:
        self.directory, self.command, self.key = Path(directory), command, key
        self.target = None if target is None else Path(target)
        self.path = (self.directory / name).absolute()

    def acquire(self) -> DirectoryLock:
        """Take the lock (re-entrant within this process) or raise :class:`LockError` naming its holder."""
        if self.path in _HELD:
            _HELD[self.path][0] += 1
            return self
        problem = in_the_way(self.directory)
        if problem is not None:  # mkdir would raise FileExistsError / NotADirectoryError, a traceback
            raise LockError(f"{self.key} {self.named}: {problem}")
        created = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._create():
                _HELD[self.path] = [1, created]
                return self
            holder = read_holder(self.path)
            if holder is None:
                time.sleep(0.2)  # maybe being written right now: read it again before calling it stale
                holder = read_holder(self.path)
            if is_mine(holder) or is_stale(holder):
                self.path.unlink(missing_ok=True)
                continue
            raise LockError(self._held_message(holder))
        raise LockError(f"{self.key} {self.named}: cannot take the lock {self.path}; delete it and retry")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command, "since": time.time()}
        with os.fdopen(fd, "w") as f:
            json.dump(holder, f)
        return True

    @property
    def named(self) -> Path:
        """What the option named: the guarded file, else the directory."""
        return self.directory if self.target is None else self.target

    def _held_message(self, holder: dict[str, Any]) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
        where, other = ("there", "directory") if self.target is None else ("it", "path")
        return (
            f"{self.key} {self.named}: {holder.get('command', 'another command')} (pid {holder['pid']} on "
            f"{holder.get('host')}, since {since}) is writing {where}; wait for it to finish or pass another "
            f"{other} (if that process no longer runs, delete {self.path})"
        )

    def release(self) -> None:
        """Give the lock back (the last holder in this process deletes the file, and an empty directory it made)."""
        held = _HELD.get(self.path)
        if held is None:
            return
        held[0] -= 1
        if held[0] > 0:
            return
        del _HELD[self.path]
        if is_mine(read_holder(self.path)):
            self.path.unlink(missing_ok=True)
        if held[1] and self.directory.is_dir() and not any(self.directory.iterdir()):
            self.directory.rmdir()

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def file_lock(path: str | os.PathLike[str], command: str, key: str = "--out") -> DirectoryLock:
    """The lock of one output file ``path`` (``.<name>.lock`` beside it): two commands writing the same result file
    at once would both compute it and one result would silently replace the other."""
    path = Path(path)
    return DirectoryLock(path.parent, f".{path.name}.lock", command, key, target=path)


def release_all() -> None:
    """Release every lock this process still holds (at exit)."""
    for path in list(_HELD):
        if is_mine(read_holder(path)):
            path.unlink(missing_ok=True)
        _HELD.pop(path, None)


atexit.register(release_all)
