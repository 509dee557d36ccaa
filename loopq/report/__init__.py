"""Collect evaluation results and calibration runs into a markdown report with the paper's tables and figures.

``python -m loopq.report`` (:mod:`loopq.report.cli`, which documents the command) reads with
:mod:`~loopq.report.inputs` (result JSONs, calibration directories), formats with :mod:`~loopq.report.tables`
(markdown), plots with :mod:`~loopq.report.figures` (matplotlib, imported only there) and writes ``report.md`` with
:mod:`~loopq.report.build`.

The names below are re-exported here. Those of the inputs and tables are imported with the package; the figures,
:func:`build_report` and :func:`main` only when first used, so reading and tabulating results needs no matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

from loopq.report.inputs import (
    PTQ_COLUMN,
    ReportInputError,
    Result,
    Run,
    expand,
    load_result,
    load_run,
    model_label,
    model_meta,
    read_json,
    read_loop_errors,
    read_mu,
    run_names,
    slug,
    version_dirs,
)
from loopq.report.tables import (
    COLUMNS,
    DASH,
    DEFAULT_BLOCKS,
    LOWER_IS_BETTER,
    best_values,
    fmt,
    method_order,
    per_loop_table,
    reference_loops,
    runs_table,
    subset_table,
    table1,
    table_results,
)

#: re-exported names imported from their module on first use (the figures import matplotlib)
LAZY: dict[str, str] = {
    "build_report": "loopq.report.build",
    "main": "loopq.report.cli",
    "parse_args": "loopq.report.cli",
    **dict.fromkeys(
        [
            "OURO_KINDS",
            "SWEEP_FIELDS",
            "heatmap",
            "plot_loop_errors",
            "plot_loop_sweep",
            "plot_mu",
            "plot_series",
            "plot_slt",
            "plot_sweep",
            "save",
            "series_points",
            "slt_matrix",
        ],
        "loopq.report.figures",
    ),
}

__all__ = [
    "COLUMNS",
    "DASH",
    "DEFAULT_BLOCKS",
    "LOWER_IS_BETTER",
    "OURO_KINDS",
    "PTQ_COLUMN",
    "SWEEP_FIELDS",
    "ReportInputError",
    "Result",
    "Run",
    "best_values",
    "build_report",
    "expand",
    "fmt",
    "heatmap",
    "load_result",
    "load_run",
    "main",
    "method_order",
    "model_label",
    "model_meta",
    "parse_args",
    "per_loop_table",
    "plot_loop_errors",
    "plot_loop_sweep",
    "plot_mu",
    "plot_series",
    "plot_slt",
    "plot_sweep",
    "read_json",
    "read_loop_errors",
    "read_mu",
    "reference_loops",
    "run_names",
    "runs_table",
    "save",
    "series_points",
    "slt_matrix",
    "slug",
    "subset_table",
    "table1",
    "table_results",
    "version_dirs",
]


def __getattr__(name: str) -> Any:
    """The names of :data:`LAZY`, imported from their module when first asked for."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *LAZY})
