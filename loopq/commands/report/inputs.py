"""The report's inputs: ``loopq.evaluate`` result JSONs (:class:`Result`) and ``loopq.fit`` calibration
directories (:class:`Run`), read and checked; an unusable file is a :class:`ReportInputError` naming it.

A result's *model* is its ``variant`` field if present (unless that is the student or export directory's own
name, as evaluations of an export recorded before), else the teacher of the student or export directory named in
``model`` (read from its ``loopq_quant.json`` / ``loopq_export.json`` when that path exists here), else the last
component of ``model``. A student's bit width is taken from its recorded quant config when available
(``loopq.evaluate`` only records ``--bits`` as given).
"""

from __future__ import annotations

import csv
import glob
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loopq.artifacts import artifact_kind, read_export_meta, read_student_meta
from loopq.artifacts.layout import STUDENT_META
from loopq.errors import LoopQError
from loopq.files import read_json as read_json_file
from loopq.quant.config import Bits
from loopq.stages import MANIFEST
from loopq.stats import Summary

#: fields of the results ``loopq.experiments loops`` writes: they never replace a result evaluated as such
SWEEP_DERIVED = ("per_loop_of", "loop_sweep")
#: the Table-1 column of the WikiText-2 perplexity under the PTQ protocol (``wikitext2_ppl`` of a result)
PTQ_COLUMN = "WT2-PTQ"


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
    #: the calibration seed (``seed``, else the recorded ``seed_everything``); None for an un-seeded row
    seed: int | None = None
    #: a result averaged over seeds (:mod:`~loopq.commands.report.seeds`): per column, the values' mean, std and n
    spread: dict[str, Summary] = field(default_factory=dict)

    @property
    def sweep_derived(self) -> bool:
        """Written by ``loopq.experiments loops`` (a loop sweep; per-loop rows read off a longer evaluation)."""
        return any(key in self.data for key in SWEEP_DERIVED)

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
    """The description of the student or export directory a result names; None for a teacher, a hub id, or a
    directory that is gone or damaged since the evaluation (the result JSON itself is still reported)."""
    if not model:
        return None
    try:
        kind = artifact_kind(model)
        if kind == "student":
            return read_student_meta(model)
        return read_export_meta(model) if kind == "export" else None
    except LoopQError:
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


def result_model(data: dict[str, Any], meta: dict[str, Any] | None) -> str:
    """The model a result is grouped under: its ``variant``, unless that is merely the name of the student or
    export directory itself (what ``loopq.evaluate`` recorded for an export before it named the teacher), where the
    teacher recorded in the directory's description is the model."""
    variant, model = data.get("variant"), data.get("model")
    own_name = Path(model.rstrip("/")).name if model else None
    if variant and not (variant == own_name and meta and meta.get("teacher")):
        return variant
    return model_label(model, meta)


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
    check_field_types(path, data)
    meta = model_meta(data.get("model"))
    bits = str(data.get("bits", "")).lower()
    quant = (meta or {}).get("quant") or {}
    if data["method"].upper() != "FP" and "w_bits" in quant and "a_bits" in quant:
        bits = Bits(quant["w_bits"], quant["a_bits"]).label
    calibrated = data.get("calibrated_loops", (meta or {}).get("calibrated_loops"))
    return Result(
        path=path,
        data=data,
        model=result_model(data, meta),
        method=data["method"],
        bits=bits,
        num_loops=data.get("num_loops"),
        calibrated_loops=int(calibrated) if isinstance(calibrated, int | float) else None,
        seed=result_seed(path, data),
    )


def result_seed(path: Path, data: dict[str, Any]) -> int | None:
    """The seed a result's student was calibrated with: its ``seed`` tag (``loopq.experiments --seeds``), else the
    ``seed_everything`` its provenance records (an un-seeded row and its ``-s<seed>`` twin are one calibration)."""
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ReportInputError(f"{path}: 'seed' is {seed!r}, not a whole number; correct or remove it")
    config = (data.get("provenance") or {}).get("config") if isinstance(data.get("provenance"), dict) else None
    recorded = config.get("seed_everything") if isinstance(config, dict) else None
    if seed is None and isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    return seed


def check_field_types(path: Path, data: dict[str, Any]) -> None:
    """The labels the report groups by have the types ``loopq.evaluate`` writes (a wrong one would be grouped
    under a made-up name or a truncated loop count, or fail later with a traceback)."""
    fix = "re-run python -m loopq.evaluate or correct it"
    for key in ("model", "variant", "bits"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ReportInputError(f"{path}: {key!r} is {data[key]!r}, not a string; {fix}")
    loops = data.get("num_loops")
    if loops is not None and (isinstance(loops, bool) or not isinstance(loops, int)):
        raise ReportInputError(f"{path}: 'num_loops' is {loops!r}, not a whole number of loops; {fix}")
    lm_eval = data.get("lm_eval")
    sizes = lm_eval.get("n_samples") if isinstance(lm_eval, dict) else None
    if sizes is not None and not isinstance(sizes, dict):
        raise ReportInputError(f"{path}: 'lm_eval.n_samples' is {sizes!r}, not a mapping of task to examples; {fix}")


def is_stage_manifest(path: Path) -> bool:
    """Whether ``path`` is the ``pipeline.json`` of a ``loopq.run`` / ``loopq.experiments`` folder (which
    ``--results <folder>/*.json`` takes in beside the results), not a result."""
    if path.name != MANIFEST or not path.is_file():
        return False
    data = read_json(path)
    return isinstance(data, dict) and isinstance(data.get("stages"), dict) and "method" not in data


def load_results(paths: Iterable[Path], notes: list[str]) -> list[Result]:
    """:func:`load_result` of each path but a stage manifest, which is skipped with a note."""
    manifests = [p for p in paths if is_stage_manifest(p)]
    notes += [f"`{p}`: skipped, the loopq.experiments / loopq.run manifest (not a result)" for p in manifests]
    return [load_result(p) for p in paths if p not in manifests]


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
    #: held-out validation (loopq.calib.validation): ``val/<set>/<metric>`` column -> values at ``val_steps``
    val_steps: list[int] = field(default_factory=list)
    val: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def teacher(self) -> str | None:
        return Path(str(self.meta["teacher"])).name if self.meta and self.meta.get("teacher") else None

    @property
    def calibrated_loops(self) -> int | None:
        loops = (self.meta or {}).get("calibrated_loops")
        return int(loops) if isinstance(loops, int | float) else None


#: what to do about a run file that cannot be read
RUN_FIX = "restore it from the run's logs or leave the run out of --runs"


def version_dirs(root: Path) -> list[Path]:
    """``root/version_*`` in numeric order."""
    found = [p for p in root.glob("version_*") if p.is_dir() and p.name.removeprefix("version_").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("version_")))


def read_loop_errors(path: Path) -> tuple[int | None, list[list[float]]] | None:
    """The last complete ``{"step", "errors"}`` entry of a ``loop_errors.jsonl`` (a torn last line is skipped)."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as err:
        raise ReportInputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); {RUN_FIX}") from None
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
    steps, _, rows = read_series(paths, r"mu/t\d+", lambda c: int(c[4:]), "mu/t*")
    return steps, rows


def read_val(paths: Sequence[Path]) -> tuple[list[int], dict[str, list[float]]]:
    """``(steps, {column: values})`` of the ``val/<set>/<metric>`` columns (validation passes), as :func:`read_mu`;
    the steps are global steps, those of the checkpoints and of ``provenance.selected`` (Lightning's CSV ``step`` of
    a validation pass during training is one less)."""
    steps, columns, rows = read_series(paths, r"val/\w+/\w+", lambda c: c, "val/*")
    return [s + 1 for s in steps], {c: [row[i] for row in rows] for i, c in enumerate(columns)}


def read_series(
    paths: Sequence[Path], pattern: str, order: Callable[[str], Any], what: str
) -> tuple[list[int], list[str], list[list[float]]]:
    """Steps, column names and rows of the columns matching ``pattern`` in ``metrics.csv`` files (version order; a
    resumed version replaces the rows it logged again; several rows of one step: the last values). Each file's rows
    keep their own columns: a version that logged none of them (a resumed segment with no validation pass) changes
    nothing, and the columns returned are those every kept row has."""
    series: dict[int, dict[str, float]] = {}
    for path in paths:
        new = read_rows(path, pattern, what)
        if new:
            first = min(new)
            series = {step: row for step, row in series.items() if step < first} | new
    if not series:
        return [], [], []
    cols = sorted(set.intersection(*(set(row) for row in series.values())), key=order)
    return list(series), cols, [[row[c] for c in cols] for row in series.values()]


def read_rows(path: Path, pattern: str, what: str) -> dict[int, dict[str, float]]:
    """``{step: {column: value}}`` of one ``metrics.csv``: the rows where every column matching ``pattern`` is set
    (a file that is not UTF-8 CSV text is a :class:`ReportInputError` naming it)."""
    rows: dict[int, dict[str, float]] = {}
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            cols = [c for c in reader.fieldnames or [] if re.fullmatch(pattern, c)]
            for line_no, row in enumerate(reader, start=2):
                if not cols or any(row.get(c) in (None, "") for c in cols):
                    continue
                try:
                    rows[int(float(row["step"]))] = {c: float(row[c]) for c in cols}
                except (KeyError, TypeError, ValueError):
                    raise ReportInputError(f"{path}: line {line_no}: bad 'step' or '{what}' value") from None
    except UnicodeDecodeError as err:
        raise ReportInputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); {RUN_FIX}") from None
    except csv.Error as err:
        raise ReportInputError(f"{path}: not readable CSV ({err}); {RUN_FIX}") from None
    return rows


def load_run(path: Path, name: str, student: Path | None = None) -> Run:
    """Read a ``loopq.fit`` directory, its student from ``student`` (default ``<path>/student``; a run calibrated
    with ``--model.output_dir`` keeps it there); missing pieces become notes, unreadable files errors naming them."""
    if not path.is_dir():
        raise ReportInputError(f"{path}: run directory not found")
    run = Run(path=path, name=name)
    meta_path = (path / "student" if student is None else student) / STUDENT_META
    if meta_path.is_file():
        meta = read_student_meta(meta_path.parent)
        if not isinstance(meta.get("promoted", []), list):
            raise ReportInputError(f"{meta_path}: not a LoopQ student config (no 'promoted' list)")
        run.meta, run.promoted = meta, [str(n) for n in meta.get("promoted", [])]
    else:
        shown = meta_path.relative_to(path) if meta_path.is_relative_to(path) else meta_path
        run.notes.append(f"run `{name}`: no `{shown}` (calibration unfinished?)")
    for version in reversed(version_dirs(path / "lightning_logs")):
        errors_path = version / "loop_errors.jsonl"
        if errors_path.is_file() and (entry := read_loop_errors(errors_path)):
            run.errors_step, run.errors = entry
            break
    else:
        run.notes.append(f"run `{name}`: no `lightning_logs/version_*/loop_errors.jsonl` entry")
    metrics = [v / "metrics.csv" for v in version_dirs(path / "csv") if (v / "metrics.csv").is_file()]
    run.mu_steps, run.mu = read_mu(metrics)
    run.val_steps, run.val = read_val(metrics)
    for held_out in dict.fromkeys(column.split("/")[1] for column in run.val):
        if lacking := missing_val(run, held_out):
            run.notes.append(f"run `{name}`: held-out set `{held_out}` not reported: no {', '.join(lacking)} column")
    if not run.mu:
        run.notes.append(f"run `{name}`: no `mu/t*` values in `csv/version_*/metrics.csv`")
    return run


def val_sets(run: Run) -> list[str]:
    """The held-out sets a run validated on (``val/<set>/...`` columns) with the columns the report reads (KL and
    the per-loop perplexities): ``heldout`` first, then the others."""
    names = [name for name in dict.fromkeys(column.split("/")[1] for column in run.val) if not missing_val(run, name)]
    return sorted(names, key=lambda name: name != "heldout")  # the calibration text's own held-out set first


def missing_val(run: Run, name: str) -> list[str]:
    """What held-out set ``name`` of ``run`` lacks of the columns the report reads."""
    missing = [] if f"val/{name}/kl_full" in run.val else [f"val/{name}/kl_full"]
    for prefix in ("ppl_loop", "fp_ppl_loop"):
        if not any(c.startswith(f"val/{name}/{prefix}") for c in run.val):
            missing.append(f"val/{name}/{prefix}<t>")
    return missing


def last_loop_column(run: Run, name: str, prefix: str = "ppl_loop") -> str:
    """The ``val/<name>/<prefix><T>`` column of the last loop."""
    loops = [int(c.rsplit(prefix, 1)[1]) for c in run.val if c.startswith(f"val/{name}/{prefix}")]
    return f"val/{name}/{prefix}{max(loops)}"


def run_names(paths: Sequence[Path]) -> list[str]:
    """Directory names, or the whole path (slugged) where two runs share a name."""
    counts = Counter(p.name for p in paths)
    return [p.name if counts[p.name] == 1 else slug(str(p)) for p in paths]


def slug(text: str) -> str:
    """``text`` reduced to characters safe in a file name (``run`` if nothing is left)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"
