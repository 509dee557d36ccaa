"""What a stage of the GPU check reports, the one table they make, and the exit status it implies (pure functions).

A stage ends ``ok``, ``FAIL`` (a mismatch, an error, a non-finite loss), ``below goal`` (correct, but a speed goal
of the acceptance is missed: reported, not a failure), ``cut`` (stopped at its time limit or by a signal; the rows it
had measured are kept) or ``skipped`` (``--skip`` / ``--only``, or the budget had too little time left for it). A
results file written while a stage runs shows it as ``running`` with what it has measured so far. The check exits 1
when any stage failed, was cut or is still running, else 0.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

OK, FAIL, BELOW_GOAL, SKIPPED, CUT, RUNNING = "ok", "FAIL", "below goal", "skipped", "cut", "running"
STATUSES = (OK, FAIL, BELOW_GOAL, SKIPPED, CUT, RUNNING)
#: statuses that make the check's exit status 1: nothing proven where the stage did not finish
UNFINISHED = (FAIL, CUT, RUNNING)


@dataclass
class StageResult:
    """One row of the table; ``details`` (the measured numbers) go to ``--out`` only."""

    stage: str
    status: str
    summary: str
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: use one of {STATUSES}")


def exit_status(results: Sequence[StageResult]) -> int:
    """1 if any stage failed, was cut or is running, else 0 (a missed speed goal or a skipped stage is not a
    failure)."""
    return 1 if any(r.status in UNFINISHED for r in results) else 0


def verdict(results: Sequence[StageResult]) -> str:
    """The line under the table: which stages failed or were cut, or that none did (and which missed a goal or were
    skipped)."""
    failed = [r.stage for r in results if r.status == FAIL]
    cut = [r.stage for r in results if r.status in (CUT, RUNNING)]
    below = [r.stage for r in results if r.status == BELOW_GOAL]
    skipped = [r.stage for r in results if r.status == SKIPPED]
    notes = [f"below goal: {', '.join(below)}"] * bool(below) + [f"skipped: {', '.join(skipped)}"] * bool(skipped)
    if failed or cut:
        what = [f"FAILED: {', '.join(failed)}"] * bool(failed) + [f"cut: {', '.join(cut)}"] * bool(cut)
        return f"GPU check {'; '.join(what + notes)} (exit status 1)"
    return "; ".join(["GPU check passed", *notes])


def grid(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> str:
    """A plain-text table: columns as wide as their widest cell, separated by two spaces, a dashed rule under the
    headers; the columns in ``right`` are right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


#: the columns of the stage table
COLUMNS = ("stage", "status", "seconds", "key numbers")


def stage_rows(results: Sequence[StageResult]) -> list[list[str]]:
    return [[r.stage, r.status, f"{r.seconds:.1f}", r.summary] for r in results]


def format_table(results: Sequence[StageResult]) -> str:
    """The check's one table (stage, status, seconds, key numbers) and its verdict line."""
    return grid(COLUMNS, stage_rows(results), right={2}) + "\n" + verdict(results)


def markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (``|`` in a cell escaped)."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), "|" + "---|" * len(headers), *(line(r) for r in rows)])


def markdown_table(results: Sequence[StageResult]) -> str:
    """The stage table in Markdown, and the verdict line."""
    return markdown(COLUMNS, stage_rows(results)) + "\n\n" + verdict(results)
