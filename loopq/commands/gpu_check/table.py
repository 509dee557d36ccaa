"""What a stage of the GPU check reports, the one table they make, and the exit status it implies (pure functions).

A stage ends ``ok``, ``FAIL`` (a mismatch, an error, a non-finite loss), ``below goal`` (correct, but a speed goal
of the acceptance is missed: reported, not a failure) or ``skipped`` (``--skip``). The check exits 1 when any stage
failed, else 0.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

OK, FAIL, BELOW_GOAL, SKIPPED = "ok", "FAIL", "below goal", "skipped"
STATUSES = (OK, FAIL, BELOW_GOAL, SKIPPED)


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
    """1 if any stage failed, else 0 (a missed speed goal or a skipped stage is not a failure)."""
    return 1 if any(r.status == FAIL for r in results) else 0


def verdict(results: Sequence[StageResult]) -> str:
    """The line under the table: which stages failed, or that none did (and which missed a goal)."""
    failed = [r.stage for r in results if r.status == FAIL]
    below = [r.stage for r in results if r.status == BELOW_GOAL]
    if failed:
        return f"GPU check FAILED: {', '.join(failed)} (exit status 1)"
    return "GPU check passed" + (f"; below goal: {', '.join(below)}" if below else "")


def grid(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> str:
    """A plain-text table: columns as wide as their widest cell, separated by two spaces, a dashed rule under the
    headers; the columns in ``right`` are right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_table(results: Sequence[StageResult]) -> str:
    """The check's one table (stage, status, seconds, key numbers) and its verdict line."""
    rows = [[r.stage, r.status, f"{r.seconds:.1f}", r.summary] for r in results]
    return grid(("stage", "status", "seconds", "key numbers"), rows, right={2}) + "\n" + verdict(results)
