"""The report's markdown tables: Table 1 (the paper's columns per W4A4/W4A8 block, best quantized value in bold),
per-loop WikiText-2 perplexity, evaluation subset sizes and calibration runs. Table 1 uses, per model, the loop count
that most (method, bits) pairs were evaluated at (``--loops`` overrides it); results that differ only by seed are
shown as ``mean ± std (n=k)`` (:mod:`~loopq.commands.report.seeds`). No plotting library is needed here.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from loopq.commands.report.inputs import PTQ_COLUMN, Result, Run, last_loop_column, val_sets
from loopq.commands.report.seeds import LOOP_KEY, combine
from loopq.metrics.tasks import PAPER_METRICS

COLUMNS: list[str] = [*PAPER_METRICS, PTQ_COLUMN]
#: columns where lower is better (perplexities); the rest are accuracies, shown in percent
LOWER_IS_BETTER: frozenset[str] = frozenset(
    [c for c, (_, metric) in PAPER_METRICS.items() if "perplexity" in metric] + [PTQ_COLUMN]
)
#: Table-1 blocks (bit widths) when ``--bits`` is not given
DEFAULT_BLOCKS = ("w4a4", "w4a8")
#: a cell that was not evaluated
DASH = "–"


def fmt(value: float | None, column: str) -> str:
    """Accuracies in percent with one decimal, perplexities with two; ``–`` when not evaluated."""
    if value is None:
        return DASH
    if not math.isfinite(value):
        return str(value)
    return f"{value:.2f}" if column in LOWER_IS_BETTER else f"{100 * value:.1f}"


def reference_loops(results: Sequence[Result], override: int | None) -> dict[str, int | None]:
    """Per model, the loop count Table 1 reports: the one most (method, bits) pairs were evaluated at; ties go to
    the calibrated count, then to the largest."""
    out: dict[str, int | None] = {}
    for model in dict.fromkeys(r.model for r in results):
        mine = [r for r in results if r.model == model]
        if override is not None:
            out[model] = override
            continue
        votes = Counter(loops for _, loops in {(r.series, r.num_loops) for r in mine})
        top = max(votes.values())
        tied = [n for n, c in votes.items() if c == top]
        calibrated = {r.calibrated_loops for r in mine} & set(tied)
        candidates = sorted((n for n in (calibrated or tied) if n is not None), reverse=True)
        out[model] = candidates[0] if candidates else None
    return out


def method_order(method: str) -> int:
    """FP first, LoopQ variants last, baselines between (in order of appearance)."""
    return 0 if method.upper() == "FP" else 2 if method.lower().startswith("loopq") else 1


def table_results(
    results: Sequence[Result], loops: dict[str, int | None], notes: list[str]
) -> dict[str, dict[tuple[str, str], Result]]:
    """``{model: {(method, bits): result}}`` at each model's reference loop count; several results of one cell are
    combined by :func:`~loopq.commands.report.seeds.combine` (mean over seeds; a loop-sweep result never replaces an
    evaluated one), whatever the order of the files."""
    found: dict[str, dict[tuple[str, str], list[Result]]] = {}
    for r in sorted(results, key=lambda r: r.sweep_derived):  # rows in order of appearance of the evaluated results
        if r.num_loops == loops[r.model]:
            found.setdefault(r.model, {}).setdefault((r.method, "fp" if r.is_fp else r.bits), []).append(r)
    table = {model: {key: combine(rs, notes) for key, rs in cells.items()} for model, cells in found.items()}
    for model in dict.fromkeys(r.model for r in results):
        cell = table.get(model, {})
        shown = {(r.method, "fp" if r.is_fp else r.bits) for r in results if r.model == model}
        for method, bits in sorted(shown - set(cell)):
            notes.append(f"{model}: {method} {bits} is not in Table 1 (no result at T={loops[model]} loops)")
        if cell:
            table[model] = dict(sorted(cell.items(), key=lambda kv: method_order(kv[0][0])))
    return table


def cell(r: Result | None, column: str, key: str | None = None, value: float | None = None) -> str:
    """:func:`fmt` of ``r``'s ``column`` (or ``value``), with ``± std (n=k)`` where ``r`` is a mean over seeds
    (``key``: its :attr:`~loopq.commands.report.inputs.Result.spread` key, default ``column``)."""
    if r is None:
        return DASH
    text = fmt(r.value(column) if value is None else value, column)
    stat = r.spread.get(key or column)
    if stat is None or text == DASH or not math.isfinite(stat.mean):
        return text
    if stat.n == 1:
        return f"{text} (n=1)"
    std = f"{stat.std:.2f}" if column in LOWER_IS_BETTER else f"{100 * stat.std:.1f}"
    return f"{text} ± {std} (n={stat.n})"


def number(shown: str) -> float:
    """The value of a formatted cell (the mean of ``mean ± std (n=k)``)."""
    return float(shown.split()[0])


def best_values(rows: Sequence[dict[str, list[str]]], blocks: Sequence[str]) -> dict[tuple[str, str], str]:
    """Per (block, column), the best formatted value among the quantized rows (only where two or more have one).
    Values are compared as shown, so equal-looking cells are bolded alike."""
    best = {}
    for block in blocks:
        for i, column in enumerate(COLUMNS):
            values = [row[block][i] for row in rows if row[block][i] != DASH and math.isfinite(number(row[block][i]))]
            if len(values) >= 2:
                pick = min if column in LOWER_IS_BETTER else max
                best[block, column] = pick(values, key=number)
    return best


def table1(
    table: dict[str, dict[tuple[str, str], Result]], loops: dict[str, int | None], blocks: Sequence[str]
) -> list[str]:
    """Markdown lines of Table 1: one row per method and model, a W4A4/W4A8 block of the paper's columns each."""
    header = ["Model", "Method"] + [f"{block.upper()} {column}" for block in blocks for column in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for model, cells in table.items():
        rows: list[tuple[str, bool, dict[str, list[str]]]] = []  # (method, is FP, {block: cells})
        for method in dict.fromkeys(method for method, _ in cells):
            fp = cells.get((method, "fp"))  # full precision: the same numbers in every block
            picked = {block: fp or cells.get((method, block)) for block in blocks}
            formatted = {block: [cell(r, c) for c in COLUMNS] for block, r in picked.items()}
            if any(v != DASH for values in formatted.values() for v in values):
                rows.append((method, fp is not None, formatted))
        best = best_values([values for _, is_fp, values in rows if not is_fp], blocks)
        for i, (method, is_fp, values) in enumerate(rows):
            label = (model if loops[model] is None else f"{model} (T={loops[model]})") if i == 0 else ""
            out = [label, f"*{method}*" if is_fp else method]
            for block in blocks:
                for column, v in zip(COLUMNS, values[block], strict=True):
                    if is_fp and v != DASH:
                        v = f"*{v}*"
                    elif best.get((block, column)) == v:
                        v = f"**{v}**"
                    out.append(v)
            lines.append("| " + " | ".join(out) + " |")
    return lines


def per_loop_table(table: dict[str, dict[tuple[str, str], Result]]) -> list[str]:
    """Markdown lines: WikiText-2 (PTQ protocol) perplexity when exiting after loop t, for every Table-1 result."""
    entries = [r for cells in table.values() for r in cells.values() if r.data.get("wikitext2_per_loop_ppl")]
    if not entries:
        return ["_No result records per-loop perplexities._"]
    width = max(len(r.data["wikitext2_per_loop_ppl"]) for r in entries)
    lines = [
        "| Model | Method | Bits | " + " | ".join(f"t={t}" for t in range(1, width + 1)) + " |",
        "|---|---|---|" + "---:|" * width,
    ]
    for r in entries:
        per_loop = enumerate(r.data["wikitext2_per_loop_ppl"], start=1)
        values = [cell(r, PTQ_COLUMN, LOOP_KEY.format(t), v) for t, v in per_loop]
        values += [DASH] * (width - len(values))
        bits = "fp" if r.is_fp else r.bits
        lines.append(f"| {r.model} | {r.method} | {bits} | " + " | ".join(values) + " |")
    return lines


def subset_table(results: Sequence[Result]) -> list[str]:
    """Markdown lines: the lm-eval ``limit`` and examples per task, and the WikiText-2 windows, of every file."""
    lines = [
        "| File | Model | Method | Bits | T | lm-eval limit | examples per task | WT2-PTQ windows |",
        "|---|---|---|---|---:|---:|---|---:|",
    ]
    for r in results:
        lm_eval = r.data.get("lm_eval")
        if isinstance(lm_eval, dict):
            limit = "full" if lm_eval.get("limit") is None else str(lm_eval["limit"])
            sizes = lm_eval.get("n_samples") or {}
            per_task = ", ".join(f"{k.removeprefix('loopq_')} {v}" for k, v in sizes.items()) or DASH
        else:
            limit, per_task = "not run", DASH
        windows = r.data.get("wikitext2_windows", DASH)
        bits = "fp" if r.is_fp else r.bits
        loops = DASH if r.num_loops is None else r.num_loops
        lines.append(
            f"| `{r.path.name}` | {r.model} | {r.method} | {bits} | {loops} | {limit} | {per_task} | {windows} |"
        )
    return lines


def runs_table(runs: Sequence[Run]) -> list[str]:
    header = "| Run | Teacher | Architecture | T | SLT promoted (in order) | final mu_t |"
    lines = [header, "|---|---|---|---:|---|---|"]
    for run in runs:
        promoted = ", ".join(f"{i}. `{n}`" for i, n in enumerate(run.promoted, start=1)) or DASH
        mu = ", ".join(f"{v:.3f}" for v in run.mu[-1]) if run.mu else DASH
        loops = DASH if run.calibrated_loops is None else run.calibrated_loops
        arch = (run.meta or {}).get("arch") or DASH
        lines.append(f"| `{run.name}` | {run.teacher or DASH} | {arch} | {loops} | {promoted} | {mu} |")
    return lines


def validation_table(runs: Sequence[Run]) -> list[str]:
    """Per run and held-out set: KL to the teacher and last-loop perplexity (FP) at the first and last validation
    pass, and the step of the lowest KL (a best step well before the end means the student overfits)."""
    lines = [
        "| Run | Held-out set | steps | KL first -> last | lowest KL at step | ppl first -> last (FP) |",
        "|---|---|---|---|---:|---|",
    ]
    for run in runs:
        for name in val_sets(run):
            kl = run.val[f"val/{name}/kl_full"]
            ppl, fp = run.val[last_loop_column(run, name)], run.val[last_loop_column(run, name, "fp_ppl_loop")]
            best = run.val_steps[min(range(len(kl)), key=kl.__getitem__)]
            lines.append(
                f"| `{run.name}` | {name} | {run.val_steps[0]}-{run.val_steps[-1]} | {kl[0]:.4f} -> {kl[-1]:.4f} | "
                f"{best} | {ppl[0]:.2f} -> {ppl[-1]:.2f} ({fp[-1]:.2f}) |"
            )
    return lines
