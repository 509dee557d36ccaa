"""A generic stage runner, knowing nothing of what the stages do (``loopq.run`` builds LoopQ's pipeline on it).

Stages run in order. A JSON manifest (:class:`Manifest`, ``pipeline.json`` for ``loopq.run``) records, per stage, the
inputs it ran with (its settings and the modification times of the outputs of the stages it reads), when it started
and finished, and its summary; :class:`StageRunner` skips a stage whose outputs exist and whose inputs are as
recorded, and runs it again otherwise. The manifest is rewritten atomically at every start and finish, so a run
killed at any point leaves a readable one and the interrupted stage runs again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from loopq.errors import LoopQError
from loopq.files import atomic_write


class StageError(LoopQError):
    """A manifest that cannot be read (the default error of :class:`Manifest`); the message names it."""


@dataclass
class Stage:
    """One step: runs ``action`` (which returns a summary for ``pipeline.json``, ``note`` is printed) unless its
    ``outputs`` exist and its ``settings`` and the outputs of the stages named in ``after`` are as recorded."""

    name: str
    target: Path  # shown
    outputs: list[Path]
    action: Callable[[], dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)
    after: tuple[str, ...] = ()


class Manifest:
    """``pipeline.json``: per stage, the inputs it ran with, its finish stamp (ns, None while running), its summary.

    ``fresh``: start empty (a forced re-run) instead of reading ``path``; ``error``: what an unreadable file raises.
    """

    def __init__(self, path: Path, fresh: bool = False, error: type[LoopQError] = StageError) -> None:
        self.path, self.error = path, error
        self.stages: dict[str, dict[str, Any]] = {} if fresh or not path.is_file() else self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            return dict(json.loads(self.path.read_text())["stages"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise self.error(f"{self.path}: unreadable ({err}); delete it or pass --force") from None

    def is_done(self, name: str, inputs: dict[str, Any]) -> bool:
        entry = self.stages.get(name)
        return entry is not None and entry.get("finished") is not None and entry.get("inputs") == inputs

    def start(self, name: str, inputs: dict[str, Any]) -> None:
        """Record a (re)start; an unfinished attempt with the same inputs keeps its ``started`` stamp."""
        entry = self.stages.get(name) or {}
        resumed = entry.get("inputs") == inputs and entry.get("finished") is None and "started" in entry
        started = entry["started"] if resumed else time.time_ns()
        self.stages[name] = {"inputs": inputs, "started": started, "finished": None}
        self.save()

    def finish(self, name: str, summary: dict[str, Any], seconds: float) -> None:
        self.stages[name].update(finished=time.time_ns(), seconds=round(seconds, 1), summary=summary)
        self.save()

    def save(self) -> None:
        text = json.dumps({"stages": self.stages}, indent=2) + "\n"
        atomic_write(self.path, lambda tmp: tmp.write_text(text))


class StageRunner:
    """Runs :class:`Stage` s in order against a :class:`Manifest`, a line per stage (``started``: when the whole
    run began, for the elapsed time shown)."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.started = time.monotonic()

    def run_stages(self, stages: Sequence[Stage]) -> None:
        """Every stage, numbered ``[i/n]``, skipped or run (:meth:`execute`)."""
        by_name = {stage.name: stage for stage in stages}
        for i, stage in enumerate(stages, start=1):
            self.execute(stage, f"[{i}/{len(stages)}] {stage.name}", [by_name[name] for name in stage.after])

    def execute(self, stage: Stage, label: str, after: list[Stage]) -> None:
        """Run ``stage`` unless it is done with the same settings and the same files of the stages it reads (their
        modification times: a file rewritten by a re-run, or by hand, makes the stages reading it run again)."""
        stamps = {f"after {dep.name}": [p.stat().st_mtime_ns for p in dep.outputs if p.exists()] for dep in after}
        inputs = normalised({**stage.settings, **stamps})
        if self.manifest.is_done(stage.name, inputs) and all(p.exists() for p in stage.outputs):
            say(f"{label}: up to date, skipped ({stage.target})")
            return
        say(f"{label} -> {stage.target}  ({clock(time.monotonic() - self.started)} elapsed)")
        start = time.monotonic()
        self.manifest.start(stage.name, inputs)
        summary = stage.action()
        self.manifest.finish(stage.name, summary, time.monotonic() - start)
        note = f" - {summary['note']}" if "note" in summary else ""
        say(f"{label}: done in {clock(time.monotonic() - start)}{note}")


# ---------------------------------------------------------------------------------------------------- helpers
def say(text: str) -> None:
    """One progress line, flushed at once."""
    print(f"[loopq] {text}", flush=True)


def clock(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS``."""
    return str(timedelta(seconds=round(seconds)))


def normalised(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples -> lists, paths -> strings), so it compares equal to a stored one."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def differing_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys (with ``prefix``) whose values differ between ``old`` and ``new``, sorted; a missing key is None."""
    return [f"{prefix}{k}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
