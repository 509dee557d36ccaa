"""``report.md``: the tables, the figures and notes on everything skipped, assembled from loaded results and runs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loopq.artifacts.ownership import begin, finish
from loopq.commands.report.figures import (
    SWEEP_FIELDS,
    plot_loop_errors,
    plot_loop_sweep,
    plot_mu,
    plot_slt,
    plot_sweep,
    plot_validation,
    series_points,
    slt_matrix,
)
from loopq.commands.report.inputs import Result, Run, val_sets
from loopq.commands.report.output import (
    KIND,
    REPORT,
    check_report_dir,
    owned_files,
    remove_stale,
    report_files,
    write_manifest,
)
from loopq.commands.report.tables import (
    DASH,
    DEFAULT_BLOCKS,
    per_loop_table,
    reference_loops,
    runs_table,
    subset_table,
    table1,
    table_results,
    validation_table,
)
from loopq.files import StagedFiles, staged_files

#: how to read Table 1
TABLE1_HELP = (
    "HS, WG, LB, AC, MM: accuracy in % (higher is better; acc_norm for HS and AC). WT2: lm-eval word "
    "perplexity; OP: LAMBADA perplexity; WT2-PTQ: WikiText-2 token perplexity under the PTQ protocol "
    "(lower is better). *Italic*: full precision, repeated in each block. **Bold**: best quantized method "
    f"of a model per column (where two or more report it). {DASH}: not evaluated. T: loops at inference."
)
#: how to read the evaluation subsets
SUBSETS_HELP = (
    "lm-eval numbers are on the first `limit` examples of each task (`full`: all); WT2-PTQ uses the windows listed."
)
#: how to read the held-out validation (loopq.calib.validation)
VALIDATION_HELP = (
    "KL: the student's full-vocabulary KL to the teacher per token on windows no calibration step saw (`heldout`: "
    "the calibration sources; `extra`: `data.val_sources`). Falling KL means the calibration generalises; a lowest "
    "KL well before the last step, with the training loss still falling, means it fits its calibration text. ppl: "
    "the student's perplexity after the last loop, FP's in parentheses."
)


def build_report(
    results: Sequence[Result],
    runs: Sequence[Run],
    sweeps: Sequence[Result],
    out: Path,
    blocks: Sequence[str] = DEFAULT_BLOCKS,
    loops_override: int | None = None,
    input_notes: Sequence[str] = (),
) -> Path:
    """Write ``out/report.md`` and the figures, then their sealed manifest; returns the markdown path. ``out`` is
    checked first (:func:`~loopq.commands.report.output.check_report_dir`): only an earlier report's files are
    replaced. The tables are made before anything is written, and the figures, ``report.md`` and the manifest are
    staged and renamed into place together (:func:`~loopq.files.staged_files`): a report that fails leaves the
    earlier one whole."""
    check_report_dir(out, [run.name for run in runs])
    previous = owned_files(out)
    notes = [*input_notes, *(n for run in runs for n in run.notes)]
    loops = reference_loops(results, loops_override)
    table = table_results(results, loops, notes)
    notes += bits_notes(results, sweeps, blocks)
    tables = tables_markdown(table, loops, blocks, [*results, *sweeps], runs)
    begin(out, KIND, report_files([run.name for run in runs]))
    with staged_files(out) as staged:
        figures = make_figures(results, runs, sweeps, staged, notes)
        md = [*tables, *figures_markdown(figures)]
        if notes:
            md += ["", "## Notes", ""] + [f"- {note}" for note in notes]
        staged.write(REPORT, lambda tmp: tmp.write_text("\n".join(md) + "\n"))
        written = write_manifest(staged)  # renamed last: it seals the files renamed before it
    remove_stale(out, previous, written)
    finish(out)
    return out / REPORT


def bits_notes(results: Sequence[Result], sweeps: Sequence[Result], blocks: Sequence[str]) -> list[str]:
    """Notes on bit widths: a student whose recorded ``bits`` is not its own, results outside the Table-1 blocks."""
    notes = []
    for r in [*results, *sweeps]:
        recorded = str(r.data.get("bits", "")).lower()
        if not r.is_fp and recorded != r.bits:
            notes.append(f"`{r.path}`: recorded bits {recorded!r}, but its student is {r.bits} (reported as {r.bits})")
    other_bits = sorted({r.bits for r in results if not r.is_fp and r.bits not in blocks})
    if other_bits:
        notes.append(f"results at {', '.join(other_bits)} are not in Table 1 (blocks: {', '.join(blocks)})")
    return notes


def make_figures(
    results: Sequence[Result], runs: Sequence[Run], sweeps: Sequence[Result], out: StagedFiles, notes: list[str]
) -> list[tuple[str, Path]]:
    """Stage every figure there is data for, as ``(title, path)`` in figure order; what is skipped goes to ``notes``."""
    figures: list[tuple[str, Path]] = []
    for run in runs:
        if run.errors:
            figures.append((f"Fig. 2 - layer x loop relative l2 error, `{run.name}`", plot_loop_errors(run, out)))
    if runs and not any(run.errors for run in runs):
        notes.append("Fig. 2 skipped: no run has loop-error diagnostics")
    loop_series = series_points(results, lambda r: r.num_loops)
    if loop_series:
        calibrated = calibrated_loops(results, runs)
        figures.append(("Fig. 5 - perplexity vs loop count", plot_loop_sweep(loop_series, calibrated, out)))
    else:
        notes.append("Fig. 5 skipped: no model/method/bits was evaluated at two or more loop counts")
    for key, (_, number) in SWEEP_FIELDS.items():
        other = next(k for k in SWEEP_FIELDS if k != key)
        series = series_points(sweeps, lambda r, k=key: r.data.get(k), lambda r, o=other: r.data.get(o))
        if series:
            figures.append((f"Fig. {number} - perplexity vs {key}", plot_sweep(series, key, other, out)))
        else:
            notes.append(f"Fig. {number} skipped: no sweep results with two or more values of `{key}`")
    figures += run_figures(runs, out, notes)
    return sorted(figures, key=lambda fig: int(m.group(1)) if (m := re.match(r"Fig\. (\d+)", fig[0])) else 99)


def calibrated_loops(results: Sequence[Result], runs: Sequence[Run]) -> dict[str, set[int]]:
    """Per model, the loop counts its students were calibrated at (dashed in Fig. 5)."""
    calibrated: dict[str, set[int]] = {}
    for r in results:
        if r.calibrated_loops:
            calibrated.setdefault(r.model, set()).add(r.calibrated_loops)
    for run in runs:
        if run.teacher and run.calibrated_loops:
            calibrated.setdefault(run.teacher, set()).add(run.calibrated_loops)
    return calibrated


def run_figures(runs: Sequence[Run], out: StagedFiles, notes: list[str]) -> list[tuple[str, Path]]:
    """Each run's SLT selection (Fig. 3), mu_t and held-out validation figures."""
    figures: list[tuple[str, Path]] = []
    for run in runs:
        matrix, _, unplaced = slt_matrix(run)
        if unplaced:
            notes.append(f"run `{run.name}`: promoted groups without a layer index: {', '.join(unplaced)}")
        if np.isfinite(matrix).any():
            figures.append((f"Fig. 3 - SLT selection order, `{run.name}`", plot_slt(run, out)))
        elif run.meta is not None:
            notes.append(f"Fig. 3 skipped for `{run.name}`: no group was promoted")
    for run in runs:
        if run.mu:
            figures.append((f"mu_t over calibration, `{run.name}`", plot_mu(run, out)))
    for run in runs:
        if val_sets(run):
            figures.append((f"held-out validation, `{run.name}`", plot_validation(run, out)))
    return figures


def tables_markdown(
    table: dict[str, dict[tuple[str, str], Result]],
    loops: dict[str, int | None],
    blocks: Sequence[str],
    results: Sequence[Result],
    runs: Sequence[Run],
) -> list[str]:
    """The markdown of the report up to its figures: Table 1, per-loop perplexity, subsets, runs, validation."""
    md = ["# LoopQ report", "", "## Table 1", ""]
    if table:
        md += [*table1(table, loops, blocks), "", TABLE1_HELP]
    else:
        md += ["_No results._"]
    md += ["", "## WikiText-2 perplexity per loop", "", "Perplexity when exiting after loop t (PTQ protocol).", ""]
    md += per_loop_table(table)
    md += ["", "## Evaluation subsets", "", SUBSETS_HELP, "", *subset_table(results)]
    if runs:
        md += ["", "## Calibration runs", "", *runs_table(runs)]
    if validated := [run for run in runs if val_sets(run)]:
        md += ["", "## Held-out validation", "", VALIDATION_HELP, "", *validation_table(validated)]
    return md


def figures_markdown(figures: Sequence[tuple[str, Path]]) -> list[str]:
    md = ["", "## Figures", ""]
    md += [f"- [{title}]({path.name})" for title, path in figures] or ["_No figures._"]
    for title, path in figures:
        md += ["", f"### {title}", "", f"![{title}]({path.name})"]
    return md
