"""Collect evaluation results and calibration runs into a markdown report with the paper's tables and figures.

    python -m loopq.report --results results/*.json [--runs runs/tiny runs/tiny-stress] \\
        [--sweeps results/sweeps/*.json] --out docs/report

Inputs:

* ``--results``: JSONs written by ``python -m loopq.evaluate --out`` (``method``, ``bits``, ``model``,
  ``num_loops``, ``wikitext2_ppl``, ``wikitext2_per_loop_ppl``, ``lm_eval.paper_metrics`` ...). Results that share
  model, method and bits but differ in ``num_loops`` form a loop sweep (Fig. 5).
* ``--runs``: calibration directories of ``python -m loopq.fit`` (``csv/version_*/metrics.csv``,
  ``lightning_logs/version_*/loop_errors.jsonl``, ``student/loopq_quant.json``); resumed runs (several versions)
  are read in version order.
* ``--sweeps``: result JSONs with an extra ``slt_budget`` (Fig. 4) and/or ``num_samples`` (Fig. 6) field.

Output in ``--out`` (:mod:`~loopq.commands.report.output`: a folder that may hold other files, of which only an
earlier report's are replaced; a model directory is refused): ``report.md`` (Table 1 at W4A4/W4A8, per-loop
WikiText-2 perplexity, the evaluation subset sizes, notes on anything skipped, links to the figures) and PNG figures:

* ``fig2_loop_errors_<run>.png``: relative l2 error per shared layer and loop (last diagnostics entry),
* ``fig3_slt_selection_<run>.png``: SLT selection order per layer and group kind,
* ``fig4_ppl_vs_slt_budget.png`` / ``fig6_ppl_vs_num_samples.png``: perplexity vs SLT budget / calibration set size,
* ``fig5_ppl_vs_loops.png``: perplexity vs loop count (calibrated count dashed),
* ``mu_<run>.png``: the adaptive mu_t over training;
* ``loopq_report.json``: the sealed manifest of the files above, which lets the next report replace them.

Grouping (which model a result belongs to, its bit width): :mod:`~loopq.commands.report.inputs`; Table 1's loop
count: :mod:`~loopq.commands.report.tables` (``--loops`` overrides it).
"""

from __future__ import annotations

from pathlib import Path

from loopq.artifacts.layout import RUN_LOCK
from loopq.commands.cli import Command
from loopq.commands.report.build import build_report
from loopq.commands.report.inputs import ReportInputError, expand, load_results, load_run, run_names
from loopq.commands.report.output import check_report_dir
from loopq.commands.report.tables import DEFAULT_BLOCKS
from loopq.locks import DirectoryLock


def write_report(
    results: tuple[str, ...],
    out: Path,
    runs: tuple[str, ...] = (),
    sweeps: tuple[str, ...] = (),
    bits: tuple[str, ...] = DEFAULT_BLOCKS,
    loops: int | None = None,
) -> Path:
    """Write the report (module docstring); returns the path of ``report.md``.

    Args:
        results: loopq.evaluate result JSONs (globs are expanded)
        out: report directory to write
        runs: loopq.fit run directories
        sweeps: result JSONs with slt_budget / num_samples
        bits: Table-1 blocks
        loops: loop count of Table 1 (default: the most common)
    """
    run_paths = [Path(p) for p in runs]
    names = run_names(run_paths)
    check_report_dir(out, names)  # before anything is read: a user's report.md is never replaced
    result_paths = expand(results)
    if not result_paths:
        raise ReportInputError(f"--results {' '.join(results)}: no files")
    notes: list[str] = []
    result_data = load_results(result_paths, notes)
    sweep_data = load_results(expand(sweeps), notes)
    run_data = [load_run(p, name) for p, name in zip(run_paths, names, strict=True)]
    with DirectoryLock(out, RUN_LOCK, "loopq.report", "--out"):  # one writer at a time
        report = build_report(result_data, run_data, sweep_data, out, [b.lower() for b in bits], loops, notes)
    print(f"report written to {report}")
    return report


COMMAND = Command(write_report, "loopq.report", __doc__)

build_parser, main = COMMAND.parser, COMMAND.run
