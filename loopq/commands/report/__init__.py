"""Collect evaluation results and calibration runs into a markdown report with the paper's tables and figures.

``python -m loopq.report`` (:mod:`loopq.commands.report.write_report`, which documents the command) reads with
:mod:`~loopq.commands.report.inputs` (result JSONs, calibration directories), formats with
:mod:`~loopq.commands.report.tables` (markdown), plots with :mod:`~loopq.commands.report.figures` (matplotlib, imported
only there) and writes ``report.md`` with :mod:`~loopq.commands.report.build`.

The package exports what other commands use: the inputs (imported with the package) and :func:`build_report` /
:func:`main`, imported on first use, so reading and tabulating results needs no matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

from loopq.commands.report.inputs import ReportInputError, Result, Run, load_result, load_run

#: exported names imported from their module on first use (building a report imports matplotlib)
LAZY: dict[str, str] = {"build_report": "loopq.commands.report.build", "main": "loopq.commands.report.write_report"}

__all__ = ["ReportInputError", "Result", "Run", "build_report", "load_result", "load_run", "main"]


def __getattr__(name: str) -> Any:
    """The names of :data:`LAZY`, imported from their module when first asked for."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *LAZY})
