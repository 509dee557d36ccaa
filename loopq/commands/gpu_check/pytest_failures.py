"""A pytest plugin the ``kernel-tests`` stage loads (``-p loopq.commands.gpu_check.pytest_failures``): each failed
or erroring test, and each expected failure with its reason, is appended as it happens to the JSON-lines file
``LOOPQ_PYTEST_FAILURES`` names (its id, the phase, the first line of its error), so that a stage cut at its time
limit still says what failed: pytest's own summary and ``--junitxml`` report come only at the end of the session
(the first GPU run of this check was cut with "5 failed" and no names). Under pytest-xdist only the controller
writes (it receives every worker's reports; a worker writing too would list each failure twice)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

#: the environment variable naming the file (unset: the plugin does nothing)
ENV = "LOOPQ_PYTEST_FAILURES"


def failure_line(report: pytest.TestReport, limit: int = 300) -> str:
    """The first line of the failure's message (pytest's ``reprcrash``), else the last line of its report."""
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
    lines = str(crash if crash else report.longrepr).strip().splitlines()
    return (lines[0] if crash else lines[-1] if lines else "")[:limit]


_IN_WORKER = False


def pytest_configure(config: pytest.Config) -> None:
    global _IN_WORKER
    _IN_WORKER = hasattr(config, "workerinput")  # an xdist worker: the controller writes its reports


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = None if _IN_WORKER else os.environ.get(ENV)
    xfail = hasattr(report, "wasxfail")  # an expected failure: kept as ``when: "xfail"`` with its reason
    if path and (report.failed or (xfail and report.skipped)):
        when, error = ("xfail", report.wasxfail) if xfail else (report.when, failure_line(report))
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": report.nodeid, "when": when, "error": error}) + "\n")


def read_failures(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The failures written so far (a line still being written is skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
