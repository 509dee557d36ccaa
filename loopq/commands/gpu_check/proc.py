"""The commands a GPU-check stage runs: from the repository root, this checkout first on ``PYTHONPATH``, under a
time limit, with a callback every few seconds while they run (a stage records its partial rows from it)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import IO

from loopq.paths import REPO_ROOT


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A child process's environment: this one with ``env`` added and this checkout first on ``PYTHONPATH``, so it
    runs the same ``loopq`` as this one."""
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, **(env or {})}


def tail(text: str, lines: int) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.strip().splitlines()[-lines:])


def run_watched(
    cmd: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    poll: Callable[[str, str], None] | None = None,
    every: float = 2.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from the repository root in :func:`child_env` of ``env``, calling ``poll`` with its standard output
    and error so far every ``every`` seconds while it runs and once at its end; its output captured. Beyond
    ``timeout`` seconds it is killed and ``subprocess.TimeoutExpired`` raised."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env(env), stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                proc.wait(timeout=max(0.01, min(every, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if poll is not None:
                    poll(_written(out), _written(err))
                if time.monotonic() >= deadline:
                    proc.kill()
                    proc.wait()
                    raise subprocess.TimeoutExpired(cmd, timeout) from None
        stdout, stderr = _written(out), _written(err)
        if poll is not None:
            poll(stdout, stderr)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _written(file: IO[str]) -> str:
    """What the child wrote to ``file`` so far, read without moving the offset it shares with the child."""
    fd = file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def failure(what: str, returncode: int, stderr: str) -> str:
    """The line of a command that exited non-zero: its last ``error:`` line, else its last line."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    return f"{what} exited with status {returncode}: {(errors or lines or ['no output'])[-1]}"
