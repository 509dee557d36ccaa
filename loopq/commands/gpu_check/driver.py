"""The GPU check's driver: stages in order, each in its own process under its own time limit, inside one budget,
with the results written after every stage and while one runs.

A GPU machine is lent for one command of at most ten minutes, so the check is built to report what it measured
however it ends:

* **Order**: the stages run in the order of ``STAGES`` (most important first); ``--only`` / ``--skip`` choose.
* **Limits**: a stage has :class:`Limits` - ``cap_s`` (quick mode) or ``full_cap_s``, the most it may take, and
  ``need_s``, the least time worth starting it with. Before each stage the driver takes the budget left
  (``budget - elapsed``): below ``need_s`` the stage is ``skipped`` (it would not finish), else it runs with the time
  limit ``min(cap, left)`` (:func:`stage_limit`).
* **Process per stage**: ``python -m loopq.commands.gpu_check.stage`` in a new process group; at its limit the group
  is killed (the stage and every command it started) and the stage is ``cut``, keeping the rows it recorded in its
  progress file (:mod:`loopq.commands.gpu_check.stage`). A stage that crashes (an exception, a CUDA error, the OOM
  killer) fails alone; the next one starts in a fresh process with a clean GPU.
* **Results**: ``<out>/gpu_check.json`` (everything measured) and ``<out>/gpu_check.md`` (the table) are rewritten
  atomically after every stage and every :data:`REFRESH_S` seconds while one runs (the running stage as ``running``
  with its rows so far), so even a ``kill -9`` of the whole check leaves the rows measured up to seconds before.
  SIGTERM (what ``timeout`` sends) ends the running stage as ``cut``, marks the rest ``skipped`` and writes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loopq.commands.gpu_check.proc import child_env
from loopq.commands.gpu_check.stage import read_progress, write_text
from loopq.commands.gpu_check.table import CUT, FAIL, RUNNING, SKIPPED, StageResult, exit_status, markdown_table
from loopq.paths import REPO_ROOT

#: the check's time budget by default: 8 of a device call's 10 minutes (the rest: the machine's own start-up, the
#: offline install of the carry, and margin)
DEFAULT_BUDGET_S = 480.0
#: seconds between rewrites of the results while a stage runs
REFRESH_S = 5.0
RESULTS_JSON, RESULTS_MD = "gpu_check.json", "gpu_check.md"


@dataclass(frozen=True)
class Limits:
    """A stage's time limits in seconds: at most ``cap_s`` (quick) / ``full_cap_s`` (``--full``); not started with
    less than ``need_s`` of the budget left."""

    cap_s: float
    full_cap_s: float
    need_s: float

    def cap(self, full: bool) -> float:
        return self.full_cap_s if full else self.cap_s


def stage_limit(left_s: float, limits: Limits, full: bool) -> float | None:
    """The time limit of a stage started with ``left_s`` seconds of the budget left: ``min(cap, left)``, or None
    (skip it) when ``left_s < need_s``."""
    if left_s < limits.need_s:
        return None
    return min(limits.cap(full), left_s)


def selection(stages: Sequence[str], only: Sequence[str], skip: Sequence[str]) -> dict[str, str | None]:
    """Per stage, in order: None to run it, else why it is skipped (``--skip``, not in ``--only``)."""
    chosen = {}
    for name in stages:
        chosen[name] = "--skip" if name in skip else "not in --only" if only and name not in only else None
    return chosen


#: seconds between two looks at a running stage (its exit, its limit, SIGTERM)
POLL_S = 0.2
TERMINATED = "the check was terminated (SIGTERM)"


class Stop:
    """Set by SIGTERM while the check runs; the driver looks at it between polls (no exception at a random point,
    e.g. in the middle of writing the results)."""

    requested = False

    @classmethod
    def handler(cls, signum: int, frame: object) -> None:
        cls.requested = True


@dataclass
class Report:
    """The results so far and where they go: ``out`` (None: nowhere) gets :data:`RESULTS_JSON` and
    :data:`RESULTS_MD`."""

    out: Path | None
    meta: dict[str, Any]
    results: list[StageResult] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def write(self, running: StageResult | None = None) -> None:
        """Rewrite both files with the finished stages (and ``running`` after them)."""
        if self.out is None:
            return
        results = [*self.results, *([running] if running else [])]
        payload = {
            **self.meta,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "exit_status": exit_status(results),
            "stages": [asdict(r) for r in results],
        }
        text = json.dumps(payload, indent=2, default=str) + "\n"
        self.out.mkdir(parents=True, exist_ok=True)
        write_text(self.out / RESULTS_JSON, text)
        write_text(self.out / RESULTS_MD, render_markdown(payload, results))


#: extra Markdown sections of a results file, per stage name: (stage details) -> Markdown or "" (the kernel bench
#: adds its rows; filled in by :mod:`loopq.commands.gpu_check.run_checks`)
SECTIONS: dict[str, Callable[[dict[str, Any]], str]] = {}


def render_markdown(payload: dict[str, Any], results: Sequence[StageResult]) -> str:
    """The results file in Markdown: a line of what ran where, the stage table, then per-stage sections."""
    keys = ("device", "commit", "git_there", "mode", "budget_s", "elapsed_s")
    header = ", ".join(f"{k} {payload[k]}" for k in keys if payload.get(k) is not None)
    parts = ["# LoopQ GPU check", "", header, "", markdown_table(results)]
    for result in results:
        section = SECTIONS.get(result.stage)
        try:
            text = section(result.details) if section else ""
        except Exception as err:  # a section never costs the table
            text = f"(not rendered: {type(err).__name__}: {err})"
        if text:
            parts += ["", f"## {result.stage}", "", text]
    return "\n".join(parts) + "\n"


def partial_result(name: str, status: str, why: str, progress: dict[str, Any], seconds: float) -> StageResult:
    """A stage that did not report its own result: ``why``, then its last recorded summary, with its details."""
    summary = "; ".join(p for p in (why, progress.get("summary") or "") if p)
    return StageResult(name, status, summary, seconds, details=dict(progress.get("details") or {}))


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End a stage's process group (the stage and everything it started), then reap the stage."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_stage(
    name: str, module: str, workdir: Path, limit_s: float, full: bool, report: Report, refresh_s: float
) -> StageResult:
    """Run one stage in its own process group under ``limit_s`` (module docstring); its result, or what it had
    recorded when it was cut or died."""
    progress = workdir / f"{name}.progress.json"
    progress.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "loopq.commands.gpu_check.stage", module, name]
    cmd += ["--workdir", str(workdir), "--progress", str(progress), "--seconds", f"{limit_s:.1f}"]
    cmd += ["--full"] * full
    print(f"[gpu_check] {name} (limit {limit_s:.0f} s) ...", flush=True)
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env(), start_new_session=True)
    last_write = began
    try:
        while (returncode := proc.poll()) is None:
            now = time.monotonic()
            if now - began >= limit_s or Stop.requested:
                kill_group(proc)
                why = f"cut: {TERMINATED}" if Stop.requested else f"cut at its {limit_s:.0f} s limit"
                return partial_result(name, CUT, why, read_progress(progress), now - began)
            if now - last_write >= refresh_s:
                report.write(partial_result(name, RUNNING, "", read_progress(progress), now - began))
                last_write = now
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:  # the driver itself failed: no stage outlives it
            kill_group(proc)
    seconds = time.monotonic() - began
    payload = read_progress(progress)
    if "result" in payload:
        result = StageResult(**payload["result"])
        result.seconds = seconds
        return result
    why = f"the stage's process exited with status {returncode} before reporting (see its output above)"
    return partial_result(name, FAIL, why, payload, seconds)


def run_check(
    stages: Mapping[str, Limits],
    module: str,
    workdir: Path,
    out: Path | None,
    *,
    full: bool = False,
    budget_s: float = DEFAULT_BUDGET_S,
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
    meta: dict[str, Any] | None = None,
    refresh_s: float = REFRESH_S,
) -> list[StageResult]:
    """Run the chosen ``stages`` (name -> limits, in order) of ``module`` within ``budget_s`` (module docstring);
    the results, also written under ``out`` after every stage."""
    meta = {"mode": "full" if full else "quick", "budget_s": budget_s, **(meta or {})}
    report = Report(out, meta)
    report.write()
    Stop.requested = False
    previous = signal.signal(signal.SIGTERM, Stop.handler)
    try:
        for name, why in selection(list(stages), only, skip).items():
            left = budget_s - (time.monotonic() - report.started)
            limit = None if why or Stop.requested else stage_limit(left, stages[name], full)
            if Stop.requested:
                result = StageResult(name, SKIPPED, TERMINATED)
            elif why:
                result = StageResult(name, SKIPPED, why)
            elif limit is None:
                need = stages[name].need_s
                result = StageResult(name, SKIPPED, f"budget: {left:.0f} s left, the stage needs {need:.0f} s")
            else:
                result = run_stage(name, module, workdir, limit, full, report, refresh_s)
            print(f"[gpu_check] {name}: {result.status} ({result.seconds:.1f} s)", flush=True)
            report.results.append(result)
            report.write()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return report.results
