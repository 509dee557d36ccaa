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

Output in ``--out``: ``report.md`` (Table 1 at W4A4/W4A8, per-loop WikiText-2 perplexity, the evaluation subset
sizes, notes on anything skipped, links to the figures) and PNG figures:

* ``fig2_loop_errors_<run>.png``: relative l2 error per shared layer and loop (last diagnostics entry),
* ``fig3_slt_selection_<run>.png``: SLT selection order per layer and group kind,
* ``fig4_ppl_vs_slt_budget.png`` / ``fig6_ppl_vs_num_samples.png``: perplexity vs SLT budget / calibration set size,
* ``fig5_ppl_vs_loops.png``: perplexity vs loop count (calibrated count dashed),
* ``mu_<run>.png``: the adaptive mu_t over training.

Grouping: a result's *model* is its ``variant`` field if present, else the teacher of the student or export
directory named in ``model`` (read from its ``loopq_quant.json`` / ``loopq_export.json`` when that path exists
here), else the last component of ``model``. A student's bit width is taken from its recorded quant config when
available (``loopq.evaluate`` only records ``--bits`` as given). Table 1 uses, per model, the loop count that most
(method, bits) pairs were evaluated at (``--loops`` overrides it).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from loopq.errors import LoopQError, OneLineParser
from loopq.eval.tasks import PAPER_METRICS
from loopq.files import atomic_write
from loopq.files import read_json as read_json_file
from loopq.quant.config import bits_label

PTQ_COLUMN = "WT2-PTQ"
COLUMNS: list[str] = [*PAPER_METRICS, PTQ_COLUMN]
#: columns where lower is better (perplexities); the rest are accuracies, shown in percent
LOWER_IS_BETTER: frozenset[str] = frozenset(
    [c for c, (_, metric) in PAPER_METRICS.items() if "perplexity" in metric] + [PTQ_COLUMN]
)
DEFAULT_BLOCKS = ("w4a4", "w4a8")
#: SLT candidate groups per shared layer, in model order (Ouro); other architectures use the names found
OURO_KINDS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_gate", "mlp.down_proj")
#: metadata files of a student (loopq.calib.student_io.CONFIG) and an export (loopq.export.META) directory
MODEL_META_FILES = ("loopq_quant.json", "loopq_export.json")
SWEEP_FIELDS = {"slt_budget": ("fig4_ppl_vs_slt_budget.png", 4), "num_samples": ("fig6_ppl_vs_num_samples.png", 6)}
DASH = "–"


class ReportInputError(LoopQError):
    """An input file or directory that cannot be used; the message names it."""


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class Result:
    """One ``loopq.evaluate`` JSON, with the labels the report groups by."""

    path: Path
    data: dict[str, Any]
    model: str
    method: str
    bits: str
    num_loops: int | None
    calibrated_loops: int | None = None

    @property
    def is_fp(self) -> bool:
        return self.method.upper() == "FP" or self.bits == "fp"

    @property
    def series(self) -> tuple[str, str, str]:
        return self.model, self.method, self.bits

    def value(self, column: str) -> float | None:
        """The Table-1 number of ``column`` (accuracies as stored, i.e. fractions), or None if not evaluated."""
        if column == PTQ_COLUMN:
            return self.data.get("wikitext2_ppl")
        return (self.data.get("lm_eval") or {}).get("paper_metrics", {}).get(column)


def read_json(path: Path) -> Any:
    return read_json_file(path, ReportInputError, "pass a result JSON written by python -m loopq.evaluate")


def model_meta(model: str | None) -> dict[str, Any] | None:
    """The ``loopq_quant.json``/``loopq_export.json`` of a student/export directory, if ``model`` is one here."""
    if not model:
        return None
    for name in MODEL_META_FILES:
        path = Path(model) / name
        if path.is_file():
            try:
                meta = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return None
            return meta if isinstance(meta, dict) else None
    return None


def model_label(model: str | None, meta: dict[str, Any] | None) -> str:
    """A short model name: the teacher's directory name for students and exports, else the last path part."""
    if meta and meta.get("teacher"):
        return Path(str(meta["teacher"])).name
    if not model:
        return "?"
    path = Path(model.rstrip("/"))
    if path.name in ("student", "exported") and path.parent.name:
        return path.parent.name  # a student directory that is not here to read: name it after its run
    return path.name


def load_result(path: Path) -> Result:
    """Read and check one result JSON (:class:`ReportInputError` naming the file if it is not one)."""
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("method"), str):
        raise ReportInputError(f'{path}: not a loopq.evaluate result (no "method" field)')
    for key in ("wikitext2_ppl", "num_loops", "slt_budget", "num_samples"):
        if key in data and data[key] is not None and not isinstance(data[key], int | float):
            raise ReportInputError(f"{path}: {key!r} is {data[key]!r}, not a number")
    lm_eval = data.get("lm_eval")
    metrics = lm_eval.get("paper_metrics", {}) if isinstance(lm_eval, dict) else {} if lm_eval is None else None
    if not isinstance(metrics, dict) or not all(isinstance(v, int | float) for v in metrics.values()):
        raise ReportInputError(f"{path}: 'lm_eval.paper_metrics' is not a mapping of numbers")
    per_loop = data.get("wikitext2_per_loop_ppl", [])
    if not isinstance(per_loop, list) or not all(isinstance(v, int | float) for v in per_loop):
        raise ReportInputError(f"{path}: 'wikitext2_per_loop_ppl' is not a list of numbers")
    meta = model_meta(data.get("model"))
    bits = str(data.get("bits", "")).lower()
    quant = (meta or {}).get("quant") or {}
    if data["method"].upper() != "FP" and "w_bits" in quant and "a_bits" in quant:
        bits = bits_label(quant["w_bits"], quant["a_bits"])
    calibrated = data.get("calibrated_loops", (meta or {}).get("calibrated_loops"))
    return Result(
        path=path,
        data=data,
        model=str(data.get("variant") or model_label(data.get("model"), meta)),
        method=data["method"],
        bits=bits,
        num_loops=int(data["num_loops"]) if data.get("num_loops") is not None else None,
        calibrated_loops=int(calibrated) if isinstance(calibrated, int | float) else None,
    )


def expand(patterns: Iterable[str]) -> list[Path]:
    """Paths as given; a pattern the shell left unexpanded (no such file, has wildcards) is globbed here."""
    paths: list[Path] = []
    for pattern in patterns:
        if not Path(pattern).exists() and any(ch in pattern for ch in "*?["):
            paths += [Path(p) for p in sorted(glob.glob(pattern))]
        else:
            paths.append(Path(pattern))
    return paths


# ---------------------------------------------------------------------------------------------------- runs
@dataclass
class Run:
    """What the report reads from one calibration directory (None/empty where the run did not write it)."""

    path: Path
    name: str
    errors: list[list[float]] | None = None  # [loop][layer] at errors_step
    errors_step: int | None = None
    promoted: list[str] = field(default_factory=list)
    meta: dict[str, Any] | None = None
    mu_steps: list[int] = field(default_factory=list)
    mu: list[list[float]] = field(default_factory=list)  # [row][t]
    notes: list[str] = field(default_factory=list)

    @property
    def teacher(self) -> str | None:
        return Path(str(self.meta["teacher"])).name if self.meta and self.meta.get("teacher") else None

    @property
    def calibrated_loops(self) -> int | None:
        loops = (self.meta or {}).get("calibrated_loops")
        return int(loops) if isinstance(loops, int | float) else None


def version_dirs(root: Path) -> list[Path]:
    """``root/version_*`` in numeric order."""
    found = [p for p in root.glob("version_*") if p.is_dir() and p.name.removeprefix("version_").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("version_")))


def read_loop_errors(path: Path) -> tuple[int | None, list[list[float]]] | None:
    """The last complete ``{"step", "errors"}`` entry of a ``loop_errors.jsonl`` (a torn last line is skipped)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        errors = entry.get("errors") if isinstance(entry, dict) else None
        try:
            if not errors or len({len(row) for row in errors}) != 1:
                raise ValueError("ragged")
            return entry.get("step"), [[float(v) for v in row] for row in errors]
        except (TypeError, ValueError):
            raise ReportInputError(f"{path}: 'errors' is not a [loop][layer] matrix of numbers") from None
    return None


def read_mu(paths: Sequence[Path]) -> tuple[list[int], list[list[float]]]:
    """``(steps, mu)`` from the ``mu/t*`` columns of ``metrics.csv`` files in version order; a resumed version
    replaces the rows it logged again."""
    steps: list[int] = []
    rows: list[list[float]] = []
    for path in paths:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            cols = sorted((c for c in reader.fieldnames or [] if re.fullmatch(r"mu/t\d+", c)), key=lambda c: int(c[4:]))
            new_steps, new_rows = [], []
            for line_no, row in enumerate(reader, start=2):
                if not cols or any(row.get(c) in (None, "") for c in cols):
                    continue
                try:
                    new_rows.append([float(row[c]) for c in cols])
                    new_steps.append(int(float(row["step"])))
                except (KeyError, TypeError, ValueError):
                    raise ReportInputError(f"{path}: line {line_no}: bad 'step' or 'mu/t*' value") from None
        if new_steps:
            keep = [i for i, s in enumerate(steps) if s < new_steps[0]]
            steps, rows = [steps[i] for i in keep] + new_steps, [rows[i] for i in keep] + new_rows
    last = dict(zip(steps, rows, strict=True))  # several logging rows of one step: the last values
    return list(last), list(last.values())


def load_run(path: Path, name: str) -> Run:
    """Read a ``loopq.fit`` directory; missing pieces become notes, unreadable files errors naming them."""
    if not path.is_dir():
        raise ReportInputError(f"{path}: run directory not found")
    run = Run(path=path, name=name)
    meta_path = path / "student" / MODEL_META_FILES[0]
    if meta_path.is_file():
        meta = read_json(meta_path)
        if not isinstance(meta, dict) or not isinstance(meta.get("promoted", []), list):
            raise ReportInputError(f"{meta_path}: not a LoopQ student config (no 'promoted' list)")
        run.meta, run.promoted = meta, [str(n) for n in meta.get("promoted", [])]
    else:
        run.notes.append(f"run `{name}`: no `student/{MODEL_META_FILES[0]}` (calibration unfinished?)")
    for version in reversed(version_dirs(path / "lightning_logs")):
        errors_path = version / "loop_errors.jsonl"
        if errors_path.is_file() and (entry := read_loop_errors(errors_path)):
            run.errors_step, run.errors = entry
            break
    else:
        run.notes.append(f"run `{name}`: no `lightning_logs/version_*/loop_errors.jsonl` entry")
    metrics = [v / "metrics.csv" for v in version_dirs(path / "csv") if (v / "metrics.csv").is_file()]
    run.mu_steps, run.mu = read_mu(metrics)
    if not run.mu:
        run.notes.append(f"run `{name}`: no `mu/t*` values in `csv/version_*/metrics.csv`")
    return run


def run_names(paths: Sequence[Path]) -> list[str]:
    """Directory names, or the whole path (slugged) where two runs share a name."""
    counts = Counter(p.name for p in paths)
    return [p.name if counts[p.name] == 1 else slug(str(p)) for p in paths]


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"


# ---------------------------------------------------------------------------------------------------- tables
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
    """``{model: {(method, bits): result}}`` at each model's reference loop count (later files win)."""
    table: dict[str, dict[tuple[str, str], Result]] = {}
    for r in results:
        if r.num_loops != loops[r.model]:
            continue
        key = (r.method, "fp" if r.is_fp else r.bits)
        cell = table.setdefault(r.model, {})
        if key in cell:
            notes.append(f"`{r.path}` replaces `{cell[key].path}` (same model, method, bits and loops)")
        cell[key] = r
    for model in dict.fromkeys(r.model for r in results):
        cell = table.get(model, {})
        shown = {(r.method, "fp" if r.is_fp else r.bits) for r in results if r.model == model}
        for method, bits in sorted(shown - set(cell)):
            notes.append(f"{model}: {method} {bits} is not in Table 1 (no result at T={loops[model]} loops)")
        if cell:
            table[model] = dict(sorted(cell.items(), key=lambda kv: method_order(kv[0][0])))
    return table


def best_values(rows: Sequence[dict[str, list[str]]], blocks: Sequence[str]) -> dict[tuple[str, str], str]:
    """Per (block, column), the best formatted value among the quantized rows (only where two or more have one).
    Values are compared as shown, so equal-looking cells are bolded alike."""
    best = {}
    for block in blocks:
        for i, column in enumerate(COLUMNS):
            values = [row[block][i] for row in rows if row[block][i] != DASH and math.isfinite(float(row[block][i]))]
            if len(values) >= 2:
                pick = min if column in LOWER_IS_BETTER else max
                best[block, column] = pick(values, key=float)
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
            formatted = {block: [fmt(r.value(c), c) if r else DASH for c in COLUMNS] for block, r in picked.items()}
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
        values = [fmt(v, PTQ_COLUMN) for v in r.data["wikitext2_per_loop_ppl"]]
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
    lines = ["| Run | Teacher | T | SLT promoted (in order) | final mu_t |", "|---|---|---:|---|---|"]
    for run in runs:
        promoted = ", ".join(f"{i}. `{n}`" for i, n in enumerate(run.promoted, start=1)) or DASH
        mu = ", ".join(f"{v:.3f}" for v in run.mu[-1]) if run.mu else DASH
        loops = DASH if run.calibrated_loops is None else run.calibrated_loops
        lines.append(f"| `{run.name}` | {run.teacher or DASH} | {loops} | {promoted} | {mu} |")
    return lines


# ---------------------------------------------------------------------------------------------------- figures
def save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    return path


def heatmap(
    ax: Any, fig: Figure, values: np.ndarray, fmt_cell: Callable[[float], str], label: str, integer: bool = False
) -> None:
    """``imshow`` of ``values`` with a colorbar; NaN cells light grey, cell values written on small grids."""
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#eeeeee")
    im = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=cmap)
    bar = fig.colorbar(im, ax=ax, label=label)
    if integer:
        bar.locator = MaxNLocator(integer=True)
        bar.update_ticks()
    if values.size <= 120:
        finite = values[np.isfinite(values)]
        mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
        for (i, j), v in np.ndenumerate(values):
            if np.isfinite(v):
                ax.text(j, i, fmt_cell(v), ha="center", va="center", fontsize=7, color="w" if v < mid else "k")


def plot_loop_errors(run: Run, out: Path) -> Path:
    """Fig. 2: relative l2 error of every shared layer (x) at every loop (y)."""
    errors = np.array(run.errors, dtype=float)
    fig = Figure(figsize=(max(4.0, 0.6 * errors.shape[1] + 2.5), max(2.5, 0.45 * errors.shape[0] + 1.5)))
    ax = fig.add_subplot()
    heatmap(ax, fig, errors, lambda v: f"{v:.3f}", "relative l2 error")
    ax.set_xticks(range(errors.shape[1]))
    ax.set_yticks(range(errors.shape[0]), [str(t) for t in range(1, errors.shape[0] + 1)])
    ax.set_xlabel("shared layer")
    ax.set_ylabel("loop")
    ax.set_title(f"{run.name}: layer x loop error (step {run.errors_step})", fontsize=9)
    fig.tight_layout()
    return save(fig, out / f"fig2_loop_errors_{slug(run.name)}.png")


def slt_matrix(run: Run) -> tuple[np.ndarray, list[str], list[str]]:
    """``(order[layer, kind], kinds, unplaced)``: 1-based selection order of every promoted group (NaN: shared)."""
    placed: list[tuple[int, str, int]] = []
    unplaced = []
    for order, name in enumerate(run.promoted, start=1):
        match = re.search(r"(?:^|\.)(\d+)\.(.+)$", name)
        if match:
            placed.append((int(match.group(1)), match.group(2), order))
        else:
            unplaced.append(name)
    found = list(dict.fromkeys(kind for _, kind, _ in placed))
    is_ouro = (run.meta or {}).get("arch") == "ouro" or any(k in OURO_KINDS for k in found)
    kinds = [*OURO_KINDS, *(k for k in found if k not in OURO_KINDS)] if is_ouro else found
    layers = max([len(run.errors[0]) if run.errors else 0] + [layer + 1 for layer, _, _ in placed])
    matrix = np.full((layers, len(kinds)), np.nan)
    for layer, kind, order in placed:
        matrix[layer, kinds.index(kind)] = order
    return matrix, kinds, unplaced


def plot_slt(run: Run, out: Path) -> Path:
    """Fig. 3: which groups SLT promoted to loop-dependent transforms, and in which order."""
    matrix, kinds, _ = slt_matrix(run)
    fig = Figure(figsize=(max(4.0, 1.2 * len(kinds) + 2.0), max(2.5, 0.35 * matrix.shape[0] + 1.5)))
    ax = fig.add_subplot()
    heatmap(ax, fig, matrix, lambda v: str(int(v)), "selection order", integer=True)
    ax.set_xticks(range(len(kinds)), kinds, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(matrix.shape[0]))
    ax.set_ylabel("layer")
    ax.set_title(f"{run.name}: SLT selection ({len(run.promoted)} groups)", fontsize=9)
    fig.tight_layout()
    return save(fig, out / f"fig3_slt_selection_{slug(run.name)}.png")


def plot_mu(run: Run, out: Path) -> Path:
    """mu_t (pull of loop t toward the final teacher state) over calibration steps."""
    mu = np.array(run.mu, dtype=float)
    fig = Figure(figsize=(5.5, 3.2))
    ax = fig.add_subplot()
    for t in range(mu.shape[1]):
        ax.plot(run.mu_steps, mu[:, t], marker="o", markersize=3, label=f"mu_t{t}")
    ax.set_xlabel("step")
    ax.set_ylabel("mu_t")
    ax.set_title(f"{run.name}: adaptive mu_t", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, out / f"mu_{slug(run.name)}.png")


def series_points(
    results: Sequence[Result], x: Callable[[Result], float | None], split: Callable[[Result], Any] = lambda r: None
) -> dict[tuple[Any, ...], list[tuple[float, float]]]:
    """``{(model, method, bits, split): sorted [(x, ppl)]}`` for series with two or more distinct x."""
    series: dict[tuple[Any, ...], dict[float, float]] = {}
    for r in results:
        xv, ppl = x(r), r.data.get("wikitext2_ppl")
        if xv is not None and ppl is not None:
            series.setdefault((*r.series, split(r)), {})[xv] = ppl
    return {k: sorted(v.items()) for k, v in series.items() if len(v) >= 2}


def plot_series(
    ax: Any, series: dict[tuple[Any, ...], list[tuple[float, float]]], split_name: str | None = None
) -> None:
    """One line per (model, method, bits, split) series; log y when the values span more than 10x."""
    top = 1.0
    several_models = len({k[0] for k in series}) > 1
    for (model, method, bits, split), points in series.items():
        label = f"{model}: " if several_models else ""
        label += f"{method} {bits}" + (f" ({split_name}={split})" if split is not None else "")
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", markersize=4, label=label)
        finite = [y for y in ys if math.isfinite(y) and y > 0]
        top = max(top, max(finite) / min(finite)) if finite else top
    if top > 10:
        ax.set_yscale("log")
    ax.set_ylabel("WikiText-2 perplexity (PTQ)")
    ax.grid(alpha=0.3)


def plot_loop_sweep(
    series: dict[tuple[Any, ...], list[tuple[float, float]]], calibrated: dict[str, set[int]], out: Path
) -> Path:
    """Fig. 5: perplexity vs loop count, one panel per model; the calibrated loop count dashed."""
    models = list(dict.fromkeys(k[0] for k in series))
    fig = Figure(figsize=(5.5 * len(models), 3.6))
    for i, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), i + 1)
        plot_series(ax, {k: v for k, v in series.items() if k[0] == model})
        for t in sorted(calibrated.get(model, ())):
            ax.axvline(t, color="grey", linestyle="--", linewidth=1, label=f"calibrated T={t}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
        ax.set_xlabel("loops at inference")
        ax.set_title(model, fontsize=9)
    fig.tight_layout()
    return save(fig, out / "fig5_ppl_vs_loops.png")


def plot_sweep(series: dict[tuple[Any, ...], list[tuple[float, float]]], key: str, other: str, out: Path) -> Path:
    """Fig. 4 / Fig. 6: perplexity vs ``slt_budget`` / ``num_samples``."""
    fig = Figure(figsize=(5.5, 3.6))
    ax = fig.add_subplot()
    plot_series(ax, series, split_name=other)
    ax.legend(fontsize=7)
    ax.set_xlabel({"slt_budget": "SLT-selected groups", "num_samples": "calibration samples"}.get(key, key))
    if key == "num_samples":
        ax.set_xscale("log", base=2)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"perplexity vs {key}", fontsize=9)
    fig.tight_layout()
    return save(fig, out / SWEEP_FIELDS[key][0])


# ---------------------------------------------------------------------------------------------------- report
def build_report(
    results: Sequence[Result],
    runs: Sequence[Run],
    sweeps: Sequence[Result],
    out: Path,
    blocks: Sequence[str] = DEFAULT_BLOCKS,
    loops_override: int | None = None,
) -> Path:
    """Write ``out/report.md`` and the figures; returns the markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    notes = [n for run in runs for n in run.notes]
    figures: list[tuple[str, Path]] = []

    loops = reference_loops(results, loops_override)
    table = table_results(results, loops, notes)
    for r in [*results, *sweeps]:
        recorded = str(r.data.get("bits", "")).lower()
        if not r.is_fp and recorded != r.bits:
            notes.append(f"`{r.path}`: recorded bits {recorded!r}, but its student is {r.bits} (reported as {r.bits})")
    other_bits = sorted({r.bits for r in results if not r.is_fp and r.bits not in blocks})
    if other_bits:
        notes.append(f"results at {', '.join(other_bits)} are not in Table 1 (blocks: {', '.join(blocks)})")

    for run in runs:
        if run.errors:
            figures.append((f"Fig. 2 - layer x loop relative l2 error, `{run.name}`", plot_loop_errors(run, out)))
    if runs and not any(run.errors for run in runs):
        notes.append("Fig. 2 skipped: no run has loop-error diagnostics")

    calibrated: dict[str, set[int]] = {}
    for r in results:
        if r.calibrated_loops:
            calibrated.setdefault(r.model, set()).add(r.calibrated_loops)
    for run in runs:
        if run.teacher and run.calibrated_loops:
            calibrated.setdefault(run.teacher, set()).add(run.calibrated_loops)
    loop_series = series_points(results, lambda r: r.num_loops)
    if loop_series:
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

    figures.sort(key=lambda fig: int(m.group(1)) if (m := re.match(r"Fig\. (\d+)", fig[0])) else 99)
    md = ["# LoopQ report", ""]
    md += ["## Table 1", ""]
    if table:
        md += table1(table, loops, blocks)
        md += [
            "",
            "HS, WG, LB, AC, MM: accuracy in % (higher is better; acc_norm for HS and AC). WT2: lm-eval word "
            "perplexity; OP: LAMBADA perplexity; WT2-PTQ: WikiText-2 token perplexity under the PTQ protocol "
            "(lower is better). *Italic*: full precision, repeated in each block. **Bold**: best quantized method "
            f"of a model per column (where two or more report it). {DASH}: not evaluated. T: loops at inference.",
        ]
    else:
        md += ["_No results._"]
    md += ["", "## WikiText-2 perplexity per loop", "", "Perplexity when exiting after loop t (PTQ protocol).", ""]
    md += per_loop_table(table)
    md += ["", "## Evaluation subsets", ""]
    md += [
        "lm-eval numbers are on the first `limit` examples of each task (`full`: all); WT2-PTQ uses the windows "
        "listed.",
        "",
    ]
    md += subset_table([*results, *sweeps])
    if runs:
        md += ["", "## Calibration runs", "", *runs_table(runs)]
    md += ["", "## Figures", ""]
    md += [f"- [{title}]({path.name})" for title, path in figures] or ["_No figures._"]
    for title, path in figures:
        md += ["", f"### {title}", "", f"![{title}]({path.name})"]
    if notes:
        md += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    report = out / "report.md"
    atomic_write(report, lambda tmp: tmp.write_text("\n".join(md) + "\n"))  # last: figures exist when it does
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m loopq.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="+", required=True, help="loopq.evaluate result JSONs")
    parser.add_argument("--runs", nargs="*", default=[], help="loopq.fit run directories")
    parser.add_argument("--sweeps", nargs="*", default=[], help="result JSONs with slt_budget / num_samples")
    parser.add_argument("--out", type=Path, required=True, help="report directory to write")
    parser.add_argument("--bits", nargs="+", default=list(DEFAULT_BLOCKS), help="Table-1 blocks (default: %(default)s)")
    parser.add_argument("--loops", type=int, default=None, help="loop count of Table 1 (default: the most common)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    result_paths = expand(args.results)
    if not result_paths:
        raise ReportInputError(f"--results {' '.join(args.results)}: no files")
    results = [load_result(p) for p in result_paths]
    sweeps = [load_result(p) for p in expand(args.sweeps)]
    run_paths = [Path(p) for p in args.runs]
    runs = [load_run(p, name) for p, name in zip(run_paths, run_names(run_paths), strict=True)]
    report = build_report(results, runs, sweeps, args.out, [b.lower() for b in args.bits], args.loops)
    print(f"report written to {report}")
    return report
