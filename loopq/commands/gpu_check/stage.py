"""One stage of the GPU check in its own process, and what the stage writes while it runs.

The driver (:mod:`loopq.commands.gpu_check.driver`) starts every stage as

    python -m loopq.commands.gpu_check.stage STAGES_MODULE NAME --workdir DIR --progress FILE --seconds S [--full]

in a new process group, so that it can end the stage and everything the stage started when its time is up. The
stage gets a :class:`Context`: the mode, a scratch folder shared by all stages of one check (the ``pipeline`` stage
reuses the ``calibration`` stage's student), its deadline, and :meth:`Context.record`, which writes what the stage
measured so far to FILE (atomically). A stage records each row as it measures it; when it is cut short the driver
reads FILE and keeps those rows. At the end FILE also holds the stage's result. STAGES_MODULE is the module whose
``STAGES`` mapping holds the stage functions (:mod:`loopq.commands.gpu_check.checks`; a test passes fakes).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loopq.commands.cli import Command
from loopq.commands.gpu_check.table import FAIL, StageResult
from loopq.errors import one_line, run_cli


@dataclass
class Context:
    """What a stage may use: ``quick`` (the default mode: fewer shapes and steps), the check's scratch folder, the
    progress file (None: nothing recorded) and the stage's deadline on ``time.monotonic``."""

    quick: bool
    workdir: Path
    progress: Path | None = None
    deadline: float = float("inf")
    details: dict[str, Any] = field(default_factory=dict)
    summary: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def remaining(self, floor: float = 1.0) -> float:
        """Seconds left before the deadline (at least ``floor``: a subprocess timeout must be positive)."""
        return max(floor, self.deadline - time.monotonic())

    def record(self, summary: str | None = None, **details: Any) -> None:
        """Merge ``details`` into what the stage measured (and replace the one-line partial ``summary``), then write
        them to the progress file; safe from several threads."""
        with self._lock:
            self.details.update(details)
            if summary is not None:
                self.summary = summary
            self._write(None)

    def finish(self, result: StageResult) -> None:
        """Write the stage's result (its details merged over what was recorded) to the progress file."""
        with self._lock:
            result.details = {**self.details, **result.details}
            self._write(result)

    def _write(self, result: StageResult | None) -> None:
        if self.progress is None:
            return
        payload: dict[str, Any] = {"summary": self.summary, "details": self.details}
        if result is not None:
            payload["result"] = asdict(result)
        write_text(self.progress, json.dumps(payload, indent=1, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: to a temporary file beside it, renamed over it (as
    :func:`loopq.files.atomic_write`, here without importing torch: a stage's runner and the driver start fast)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_progress(path: Path) -> dict[str, Any]:
    """A progress file's contents (empty when the stage wrote none or it cannot be read)."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return payload if isinstance(payload, dict) else {}


def stage(module: str, name: str, *, workdir: Path, progress: Path, seconds: float, full: bool = False) -> int:
    """Run stage ``name`` of ``module`` under a deadline; returns 0: its result, an exception as its failure
    (traceback on stderr), is in the progress file. The two positional arguments come first, the rest are options
    (keyword-only).

    Args:
        module: the module whose STAGES mapping holds the stage functions
        name: the stage
        workdir: the scratch folder shared by the stages of one check
        progress: the file the stage records what it measured to
        seconds: the stage's time limit
        full: the long mode (more steps, layers and shapes)
    """
    ctx = Context(not full, workdir, progress, time.monotonic() + seconds)
    stages = importlib.import_module(module).STAGES
    try:
        result = stages[name](ctx)
    except Exception as err:
        traceback.print_exc()
        result = StageResult(name, FAIL, f"{type(err).__name__}: {one_line(err)}")
    ctx.finish(result)
    return 0


COMMAND = Command(stage, "loopq.commands.gpu_check.stage", __doc__, positional=True)

build_parser, main = COMMAND.parser, COMMAND.run


if __name__ == "__main__":
    run_cli(lambda: sys.exit(main()))
