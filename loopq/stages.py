"""A generic stage runner, knowing nothing of what the stages do (``loopq.run`` builds LoopQ's pipeline on it).

Stages run in order. A JSON manifest (:class:`Manifest`, ``pipeline.json`` for ``loopq.run``) records, per stage, the
inputs it ran with (its settings and the modification times of the outputs of the stages it reads), when it started
and finished, the stamps of its own outputs (modification time and size) and its summary; :class:`StageRunner` skips
a stage whose outputs are still the files it wrote and whose inputs are as recorded, and runs it again otherwise.
The manifest is rewritten atomically at every start and finish, so a run killed at any point leaves a readable one
and the interrupted stage runs again.
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

#: maps a stage's inputs to the form they are compared in (:attr:`Stage.canonical`)
Canonical = Callable[[dict[str, Any]], dict[str, Any]]


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
    #: puts recorded and current inputs in one form before they are compared (e.g. options added since a record was
    #: written read as the value they had then); None: compared as they are
    canonical: Canonical | None = None


#: the manifest's file name in a ``loopq.run`` or ``loopq.experiments`` output folder
MANIFEST = "pipeline.json"


class Manifest:
    """``pipeline.json``: per stage, the inputs it ran with, its start and finish stamps (ns, finish None while
    running), the stamps of the outputs it wrote (:func:`output_stamps`), its summary.

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

    def is_done(
        self, name: str, inputs: dict[str, Any], outputs: Sequence[Path] = (), canonical: Canonical | None = None
    ) -> bool:
        """Finished with the same inputs (:meth:`same_inputs`), and ``outputs`` are the files it wrote: they exist
        with the recorded stamps (an entry written before stamps were recorded: none modified after it finished)."""
        entry = self.stages.get(name)
        if entry is None or entry.get("finished") is None or not self.same_inputs(name, inputs, canonical):
            return False
        if not all(p.exists() for p in outputs):
            return False
        if "outputs" not in entry:
            return all(p.stat().st_mtime_ns <= entry["finished"] for p in outputs)
        return entry["outputs"] == output_stamps(outputs)

    def same_inputs(self, name: str, inputs: dict[str, Any], canonical: Canonical | None = None) -> bool:
        """Whether ``name`` is recorded with ``inputs`` (both put through ``canonical`` first when given)."""
        entry = self.stages.get(name)
        if entry is None or "inputs" not in entry:
            return False
        if canonical is None:
            return entry["inputs"] == inputs
        return canonical(entry["inputs"]) == canonical(inputs)

    def start(self, name: str, inputs: dict[str, Any], canonical: Canonical | None = None) -> None:
        """Record a (re)start; an attempt with the same inputs keeps its ``started`` stamp, also once finished (a
        stage re-run because an output was lost or rewritten may resume from what it wrote since then)."""
        entry = self.stages.get(name) or {}
        resumed = "started" in entry and self.same_inputs(name, inputs, canonical)
        started = entry["started"] if resumed else time.time_ns()
        self.stages[name] = {"inputs": inputs, "started": started, "finished": None}
        self.save()

    def finish(self, name: str, summary: dict[str, Any], seconds: float, outputs: Sequence[Path] = ()) -> None:
        """Record the end of ``name``, with the stamps of the ``outputs`` it wrote."""
        stamps = output_stamps(outputs)
        self.stages[name].update(finished=time.time_ns(), seconds=round(seconds, 1), outputs=stamps, summary=summary)
        self.save()

    def restamp(self, name: str, outputs: Sequence[Path]) -> None:
        """Record ``outputs``' present stamps for finished stage ``name``: its owner changed them on purpose after the
        stage finished (a sweep tags its result JSON), so they are still the files it wrote."""
        entry = self.stages.get(name)
        if entry is not None and entry.get("finished") is not None and "outputs" in entry:
            entry["outputs"] = output_stamps(outputs)
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
        if self.manifest.is_done(stage.name, inputs, stage.outputs, stage.canonical):
            say(f"{label}: up to date, skipped ({stage.target})")
            return
        say(f"{label} -> {stage.target}  ({clock(time.monotonic() - self.started)} elapsed)")
        start = time.monotonic()
        self.manifest.start(stage.name, inputs, stage.canonical)
        summary = stage.action()
        self.manifest.finish(stage.name, summary, time.monotonic() - start, stage.outputs)
        note = f" - {summary['note']}" if "note" in summary else ""
        say(f"{label}: done in {clock(time.monotonic() - start)}{note}")


# ---------------------------------------------------------------------------------------------------- helpers
def say(text: str) -> None:
    """One progress line, flushed at once."""
    print(f"[loopq] {text}", flush=True)


def clock(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS``."""
    return str(timedelta(seconds=round(seconds)))


def output_stamps(outputs: Sequence[Path]) -> list[list[int] | None]:
    """``[mtime_ns, size]`` of each of ``outputs`` in order (None for a missing one): what tells a file a stage wrote
    from one written over it since (by hand, or by another command)."""
    stamps: list[list[int] | None] = []
    for path in outputs:
        try:
            stat = path.stat()
        except OSError:
            stamps.append(None)
            continue
        stamps.append([stat.st_mtime_ns, stat.st_size])
    return stamps


def normalised(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples -> lists, paths -> strings), so it compares equal to a stored one."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def differing_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys (with ``prefix``) whose values differ between ``old`` and ``new``, sorted; a missing key is None."""
    return [f"{prefix}{k}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
