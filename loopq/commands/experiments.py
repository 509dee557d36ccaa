"""Run a whole comparison on one teacher and hand the results to the report:

    python -m loopq.experiments table1 --model loopq/assets/tiny-ouro --out results/tiny-ouro --limit 200

``table1``: the paper's Table 1 rows - FP, then every method of :data:`TABLE1` at W4A4 and W4A8 - each evaluated by
:func:`loopq.evaluate.evaluate`. The trained rows (SpinQuant, FlatQuant, LoopQ) are calibrated by ``loopq.fit``'s CLI
in this process, one after another, each under ``<out>/runs/<row>/``; every row calibrates on ``fit_config``'s data,
as the paper's methods share one calibration set (:class:`CalibrationData`; docs/usage.md, "Export, evaluation,
report"). ``ablations`` (Table 2), ``slt_budget`` (Fig. 4), ``num_samples`` (Fig. 6) and ``loops`` (Fig. 5) are
described by their ``--help``; sweeps record WikiText-2 perplexity only (``tasks`` defaults to none) and add their
swept field to each JSON, which is what ``python -m loopq.report --sweeps`` plots. ``--seeds 0 1 2`` calibrates every
trained row once per seed (``<slug>-s<seed>.json``; the seed sets ``seed_everything``, ``model.quant.seed`` and
``data.seed``, so the calibration windows differ too); training-free rows are deterministic and run once. ``summary``
turns a results folder into the mean ± std table (:mod:`loopq.stats`). Re-runs resume by ``loopq.run``'s rule
(:class:`Sweep`).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from loopq.artifacts import read_artifact_meta
from loopq.artifacts.layout import STUDENT_META, STUDENT_WEIGHTS, json_object
from loopq.calib.checkpoint_io import newest_intact
from loopq.commands import fit
from loopq.commands.cli import Command
from loopq.commands.evaluate import evaluate
from loopq.commands.examine import slt_history
from loopq.commands.run import MANIFEST, parse, quiet_lm_eval
from loopq.devices import AUTO, resolve_device
from loopq.errors import UsageError
from loopq.files import atomic_write, read_json
from loopq.models.loading import resolve_model_dir
from loopq.provenance import flat_record, record, teacher_fingerprint
from loopq.quant.config import BIT_LABELS, METHODS, Bits, QuantConfigError
from loopq.stages import Manifest, Stage, StageRunner, normalised, say
from loopq.stats import log_gap_recovery, separated, summarize

#: activation bits of each reported bit-width label (w4a4 -> 4, w4a8 -> 8)
BITS = {label: Bits.parse(label).a for label in BIT_LABELS}
#: fields that mark a sweep's result (kept out of :func:`summary`'s tables)
SWEEP_TAGS = ("per_loop_of", "loop_sweep", "slt_budget", "num_samples")


@dataclass(frozen=True)
class Row:
    """One quantized method of Table 1: its label (``method`` in the JSON), file stem, and how it is calibrated
    (``calibration``: the ``table1`` argument naming its ``loopq.fit`` config; None: training-free)."""

    label: str
    slug: str
    calibration: str | None = None


TABLE1 = (
    Row(METHODS["rtn"].label, "rtn"),
    Row(METHODS["smoothquant"].label, "smoothquant"),
    Row(METHODS["quarot"].label, "quarot"),
    Row(METHODS["spinquant"].label, "spinquant", calibration="spinquant_config"),
    Row(METHODS["flatquant"].label, "flatquant", calibration="flatquant_config"),
    Row(METHODS["loopq"].label, "loopq", calibration="fit_config"),
)
ABLATIONS = {
    "LoopQ w/o LAS": ["--model.quant.las", "false"],
    "LoopQ w/o SLT": ["--model.quant.slt_budget", "0"],
    "LoopQ w/o CTA": ["--model.quant.cta", "false"],
}


#: one word of ``extra``: the option list is YAML, where ``100`` or ``true`` read as numbers and booleans
FitOption = str | int | float | bool


@dataclass(frozen=True)
class Calibration:
    """One trained row's ``loopq.fit`` run: its ``config`` and ``extra`` options on teacher ``model`` at ``a_bits``
    activation bits, written under the run directory ``run``."""

    model: str
    run: Path
    config: str
    a_bits: int
    extra: tuple[FitOption, ...] = ()

    @property
    def student(self) -> Path:
        return self.run / "student"

    def args(self) -> list[str]:
        """Its ``loopq.fit`` options."""
        teacher = ["--model.teacher", self.model, "--model.quant.a_bits", str(self.a_bits)]
        run = str(self.run.absolute())  # this process's path: not moved by LOOPQ_RUNS_DIR (loopq.paths.run_root)
        where = ["--trainer.default_root_dir", run, "--trainer.enable_progress_bar", "false"]
        return ["--config", self.config, *teacher, *where, *map(str, self.extra)]


class Sweep(StageRunner):
    """The rows of one results folder ``out``, each a stage of :mod:`loopq.stages` recorded in ``<out>/pipeline.json``
    (the runner and rule of ``loopq.run``): a row is skipped when its JSON exists and its inputs are as recorded -
    the evaluation's arguments, and what made the model: the calibration's resolved ``loopq.fit`` config (without
    :data:`loopq.fit.COSMETIC` options) and the teacher's content hash, a given student's file stamp, or the teacher's
    hash. Otherwise it runs again. A JSON without a record (written before the folder had ``pipeline.json``) is adopted
    as it is. ``device`` is resolved here, once for every evaluation of the command."""

    def __init__(self, out: str, device: str = AUTO) -> None:
        self.root, self.device = Path(out), str(resolve_device(device))
        self.root.mkdir(parents=True, exist_ok=True)
        super().__init__(Manifest(self.root / MANIFEST, error=UsageError))

    def row(self, slug: str, calibration: Calibration | None = None, **evaluation: Any) -> Path:
        """``<out>/<slug>.json``: :func:`evaluate` with ``evaluation`` (of the student of ``calibration`` if given)."""
        out = self.root / f"{slug}.json"
        evaluation["device"] = self.device
        if calibration is not None:
            evaluation["student"] = str(calibration.student)
        inputs = {"evaluate": evaluation, **model_inputs(evaluation, calibration)}
        stage = Stage(slug, out, [out], lambda: self.compute(out, evaluation, calibration), inputs)
        if stage.name not in self.manifest.stages and out.is_file() and "per_loop_of" not in read_json(out):
            # a row read off a longer evaluation (per_loop_result) is never adopted: it ran with other inputs
            self.manifest.start(slug, normalised(inputs))
            self.manifest.finish(slug, {"note": f"adopted: written before {MANIFEST}"}, 0.0, stage.outputs)
        self.execute(stage, f"row {slug}", [])
        return out

    def tag(self, path: Path, **fields: object) -> Path:
        """Add the swept ``fields`` (those not None) to a row's JSON (atomically) and record its new stamps as the
        row's own (else the row's outputs would look rewritten, and every tagged row ran again on the next call)."""
        fields = {k: v for k, v in fields.items() if v is not None}
        data = read_json(path)
        if any(data.get(k) != v for k, v in fields.items()):
            data.update(fields)
            atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))
        self.manifest.restamp(path.stem, [path])
        return path

    @staticmethod
    def compute(out: Path, evaluation: dict[str, Any], calibration: Calibration | None) -> dict[str, Any]:
        if calibration is not None:
            calibrate(calibration)
        with quiet_lm_eval():
            evaluate(out=str(out), **evaluation)
        ppl = read_json(out)["wikitext2_ppl"]
        return {"wikitext2_ppl": ppl, "note": f"WikiText-2 ppl {ppl:.2f}"}


def model_inputs(evaluation: dict[str, Any], calibration: Calibration | None) -> dict[str, Any]:
    """What made the evaluated model (see :class:`Sweep`)."""
    if calibration is not None:
        return {"calibrate": calibration_settings(calibration)}
    if evaluation.get("student"):
        weights = Path(evaluation["student"]) / STUDENT_WEIGHTS
        return {"student_mtime_ns": weights.stat().st_mtime_ns if weights.is_file() else None}
    return {"teacher_sha256": teacher_sha256(evaluation["model"])}


def teacher_sha256(model: str) -> str:
    return teacher_fingerprint(resolve_model_dir(model))


def calibration_settings(calibration: Calibration) -> dict[str, Any]:
    """What makes the row's student (``loopq.run``'s calibration inputs): the resolved config and the teacher's hash."""
    cli = parse(calibration.args())
    cli.release_lock()
    return {**fit.fit_settings(cli.config), "teacher_sha256": teacher_sha256(calibration.model)}


def calibrate(calibration: Calibration) -> Path:
    """The row's student, calibrated in this process by ``loopq.fit``'s CLI, unless the run directory holds one of
    the same teacher and config (the row re-runs for its evaluation only). A calibration stopped midway resumes from
    the run's newest intact checkpoint if that records the same teacher and config."""
    cli = parse(calibration.args())  # loopq.fit's CLI (run.parse), its run directory locked, not built
    try:
        current = flat_record(record(teacher_sha256(calibration.model), fit.fit_settings(cli.config)))
        if recorded(json_object(calibration.student / STUDENT_META)) == current:
            return calibration.student
        last = newest_intact(fit.checkpoints_in([calibration.run / "checkpoints"]), "resume")
        if last is not None and recorded({"provenance": fit.checkpoint_provenance(str(last))}) == current:
            cli.config.ckpt_path = str(last)
            say(f"resuming the calibration from {last}")
        cli.build()
        fit.calibrate(cli)
        cli.release()
    finally:
        cli.release_lock()
    return calibration.student


def recorded(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The flat provenance (teacher hash and config) an artifact's metadata records; None if it records none."""
    return flat_record(meta["provenance"]) if meta.get("provenance") else None


def seed_args(seed: int | None) -> list[str]:
    """``loopq.fit`` options of one seed repeat (none for the un-seeded default run)."""
    if seed is None:
        return []
    return ["--seed_everything", str(seed), "--model.quant.seed", str(seed), "--data.seed", str(seed)]


def seeded(slug: str, seed: int | None) -> str:
    return slug if seed is None else f"{slug}-s{seed}"


def with_bits(slug: str, bits: str) -> str:
    """A sweep row's name: ``slug`` at the sweeps' default W4A4, ``slug-<bits>`` otherwise, so that one folder can
    hold a sweep at each width (``summary`` groups them by bits)."""
    return slug if bits == "w4a4" else f"{slug}-{bits}"


T = TypeVar("T")


def given(values: list[T] | None, default: list[T], key: str) -> list[T]:
    """A list option: ``default`` when it is not given; an explicit empty list is refused (it used to read as
    "all", running every row the user meant to leave out)."""
    if values is None:
        return default
    if not values:
        raise UsageError(f"{key} is empty; name at least one, or leave {key} out for the default {default}")
    return values


def bit_label(bits: str, key: str = "--bits") -> str:
    """The label of a bit width the experiments run (``W4A4`` -> ``w4a4``); any other is refused naming ``key``."""
    try:
        label = Bits.parse(bits, key).label
    except QuantConfigError:
        label = ""  # not w<W>a<A>: refused below with the valid widths
    if label not in BITS:
        raise UsageError(f"{key} {bits}: not a bit width the experiments run; use one of {', '.join(BITS)}")
    return label


def bit_labels(bits: list[str] | None) -> list[str]:
    """``table1``'s bit widths as labels, each once (default: all of :data:`BITS`)."""
    return list(dict.fromkeys(bit_label(b) for b in given(bits, list(BITS), "--bits")))


def table1_rows(methods: list[str] | None) -> list[Row]:
    """The :data:`TABLE1` rows ``methods`` names by label or slug in any case (``loopq``, ``RTN``, ``Symmetric``),
    in table order (default: all); an unknown name is refused listing the valid ones."""
    chosen = given(methods, [row.label for row in TABLE1], "--methods")
    by_name = {name.lower(): row for row in TABLE1 for name in (row.label, row.slug)}
    unknown = [name for name in chosen if name.lower() not in by_name]
    if unknown:
        valid = ", ".join(f"{row.label} ({row.slug})" for row in TABLE1)
        raise UsageError(f"--methods {', '.join(unknown)}: not a Table 1 method; use any of {valid}")
    wanted = {by_name[name.lower()] for name in chosen}
    return [row for row in TABLE1 if row in wanted]


@dataclass(frozen=True)
class CalibrationData:
    """The calibration set of a ``loopq.fit`` config (its resolved ``data`` section): every Table 1 row calibrates on
    it (the paper: all methods share the calibration set)."""

    sources: list[str] | None
    num_samples: int
    seq_len: int

    def evaluate_options(self) -> dict[str, Any]:
        """:func:`evaluate`'s options of a training-free baseline calibrated on these windows."""
        return {"calib_sources": self.sources, "calib_samples": self.num_samples, "calib_seq_len": self.seq_len}

    def fit_options(self) -> list[str]:
        """``loopq.fit`` overrides that calibrate a trained baseline on these windows (its own config's otherwise)."""
        sources = [] if self.sources is None else ["--data.sources", json.dumps(self.sources)]
        return [*sources, "--data.num_samples", str(self.num_samples), "--data.seq_len", str(self.seq_len)]


def calibration_data(model: str, fit_config: str, extra: tuple[FitOption, ...]) -> CalibrationData:
    """The ``data`` section of ``fit_config`` with ``extra`` as ``loopq.fit`` resolves it for the LoopQ rows (parsed
    with a throwaway run directory: the parse takes the run directory's lock, which made ``runs/`` in the caller's
    working directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        cli = parse(Calibration(model, Path(tmp) / "unused", fit_config, 4, extra).args())
        cli.release_lock()
    data = cli.config.data
    sources = None if data.sources is None else [str(s) for s in data.sources]
    return CalibrationData(sources, int(data.num_samples), int(data.seq_len))


def table1(
    model: str,
    out: str,
    fit_config: str = "configs/tiny.yaml",
    limit: int | None = 200,
    tasks: list[str] | None = None,
    spinquant_config: str = "configs/baselines/spinquant-tiny.yaml",
    flatquant_config: str = "configs/baselines/flatquant-tiny.yaml",
    seeds: list[int] | None = None,
    bits: list[str] | None = None,
    methods: list[str] | None = None,
    extra: list[FitOption] | None = None,
    ppl_windows: int | None = None,
    device: str = AUTO,
) -> list[Path]:
    """FP and every :data:`TABLE1` method (or those named in ``methods``) at W4A4 and W4A8 (or ``bits``) on
    ``model``; one result JSON each in ``out`` (per seed for trained rows with ``seeds``).

    Args:
        spinquant_config: loopq.fit config of SpinQuant
        flatquant_config: loopq.fit config of FlatQuant
        bits: bit widths (default: w4a4, w4a8)
        methods: only these methods, by label or slug in any case (default: all of Table 1)
    """
    widths, chosen = bit_labels(bits), table1_rows(methods)  # before any row runs
    shared = calibration_data(model, fit_config, tuple(extra or []))  # LoopQ's windows, for every row
    sweep = Sweep(out, device)
    configs = {"fit_config": fit_config, "spinquant_config": spinquant_config, "flatquant_config": flatquant_config}
    common = {"limit": limit, "tasks": tasks, "ppl_windows": ppl_windows}
    written = [sweep.row("fp", model=model, method="FP", **common)]
    for width in widths:
        for row in chosen:
            evaluation = {"method": row.label, "bits": width, **common}
            if row.calibration is None:
                data = shared.evaluate_options() if row.slug != "rtn" else {}  # RTN reads no data
                written.append(sweep.row(f"{row.slug}-{width}", model=model, **evaluation, **data))
                continue
            same_data = shared.fit_options() if row.calibration != "fit_config" else []
            config = configs[row.calibration]
            for seed in seeds or [None]:
                slug = seeded(f"{row.slug}-{width}", seed)
                args = (*same_data, *seed_args(seed), *(extra or []))
                calibration = Calibration(model, sweep.root / "runs" / slug, config, BITS[width], args)
                written.append(sweep.tag(sweep.row(slug, calibration, **evaluation), seed=seed))
    return written


def ablations(
    model: str,
    out: str,
    fit_config: str = "configs/tiny.yaml",
    limit: int | None = 200,
    tasks: list[str] | None = None,
    seeds: list[int] | None = None,
    extra: list[FitOption] | None = None,
    ppl_windows: int | None = None,
    device: str = AUTO,
) -> list[Path]:
    """LoopQ W4A4 with one component switched off at a time (paper Table 2), per seed with ``seeds``."""
    sweep, written = Sweep(out, device), []
    common = {"bits": "w4a4", "limit": limit, "tasks": tasks, "ppl_windows": ppl_windows}
    for name, switch in ABLATIONS.items():
        for seed in seeds or [None]:
            slug = seeded(name.lower().replace(" ", "-").replace("/", ""), seed)
            args = (*switch, *seed_args(seed), *(extra or []))
            calibration = Calibration(model, sweep.root / "runs" / slug, fit_config, 4, args)
            written.append(sweep.tag(sweep.row(slug, calibration, method=name, **common), seed=seed))
    return written


def slt_budget(
    model: str,
    out: str,
    budgets: list[int] | None = None,
    fit_config: str = "configs/tiny.yaml",
    bits: str = "w4a4",
    limit: int | None = 200,
    tasks: list[str] | None = None,
    seeds: list[int] | None = None,
    extra: list[FitOption] | None = None,
    ppl_windows: int | None = None,
    device: str = AUTO,
) -> list[Path]:
    """Fig. 4: LoopQ calibrated with each SLT budget.

    Args:
        budgets: SLT budgets (default: 0, 2, 4, 8 promoted groups)
        bits: bit widths of the calibrations
        tasks: lm-eval tasks (default: none, perplexity only)
    """
    bits, budgets = bit_label(bits), given(budgets, [0, 2, 4, 8], "--budgets")
    sweep, written = Sweep(out, device), []
    common = {"method": "LoopQ", "bits": bits, "limit": limit, "tasks": tasks or [], "ppl_windows": ppl_windows}
    for budget in budgets:
        for seed in seeds or [None]:
            slug = seeded(with_bits(f"slt-{budget}", bits), seed)
            args = ("--model.quant.slt_budget", str(budget), *seed_args(seed), *(extra or []))
            calibration = Calibration(model, sweep.root / "runs" / slug, fit_config, BITS[bits], args)
            path = sweep.row(slug, calibration, **common)
            written.append(sweep.tag(path, slt_budget=budget, seed=seed, **promotion_record(calibration.run)))
    return written


def promotion_record(run: Path) -> dict[str, Any]:
    """Which groups calibration ``run`` promoted (``promoted``, from its student) and each round of the sharing-gap
    re-selection (``slt_rounds``: step, the selected groups with their S_l, and the median S_l of all groups, from
    its last checkpoint; §4.2, Eq. 6). Empty when the run directory is gone (a row resumed from its JSON)."""
    student = run / "student"
    if not (student / STUDENT_META).is_file():
        return {}
    rounds = [
        {
            "step": r["step"],
            "selected": {name: r["scores"][name] for name in r["selected"]},
            "median_S": statistics.median(r["scores"].values()),
        }
        for r in slt_history(run)
    ]
    return {"promoted": read_artifact_meta(student, kind="student")[0].get("promoted", []), "slt_rounds": rounds}


def num_samples(
    model: str,
    out: str,
    sizes: list[int] | None = None,
    fit_config: str = "configs/tiny.yaml",
    bits: str = "w4a4",
    limit: int | None = 200,
    tasks: list[str] | None = None,
    device: str = AUTO,
) -> list[Path]:
    """Fig. 6: LoopQ calibrated on 32 ... 1024 samples (same steps and batch: smaller sets are revisited more).

    Args:
        sizes: calibration set sizes (default: 32 ... 1024)
        bits: bit widths of the calibrations
        tasks: lm-eval tasks (default: none, perplexity only)
    """
    bits, sizes = bit_label(bits), given(sizes, [32, 64, 128, 256, 512, 1024], "--sizes")
    sweep, written = Sweep(out, device), []
    for size in sizes:
        slug = with_bits(f"samples-{size}", bits)
        args = ("--data.num_samples", str(size))
        calibration = Calibration(model, sweep.root / "runs" / slug, fit_config, BITS[bits], args)
        path = sweep.row(slug, calibration, method="LoopQ", bits=bits, limit=limit, tasks=tasks or [])
        written.append(sweep.tag(path, num_samples=size))
    return written


def loops(
    model: str,
    out: str,
    student: str,
    max_loops: int | None = None,
    bits: str = "w4a4",
    limit: int | None = 200,
    tasks: list[str] | None = None,
    seed: int | None = None,
    ppl_windows: int | None = None,
    method: str = "LoopQ",
    device: str = AUTO,
) -> list[Path]:
    """Fig. 5: FP, Symmetric RTN and the calibrated ``student`` at T ... ``max_loops`` (default 2T) loops.

    T is the student's calibrated loop count; loops beyond it reuse the last loop's parameters (LAS clips,
    promoted transforms, CTA).
    WikiText-2 only (the default): one evaluation per method at ``max_loops`` gives the perplexity after every
    loop (the output after n loops does not depend on later loops), written as one JSON per n with
    ``per_loop_of`` naming its source. With ``tasks``, every loop count is evaluated separately.
    Every JSON is tagged ``loop_sweep`` (the top loop count), which keeps it out of :func:`summary`'s Table 1 rows.

    Args:
        student: the calibrated student directory
        max_loops: the top loop count (default: twice the calibrated)
        bits: the student's bit widths
        tasks: lm-eval tasks (default: none, perplexity only; given: every loop count evaluated separately)
        seed: the student's calibration seed (rows loopq-<bits>-s<seed>-loops<n>; FP and RTN are shared)
        method: the trained method that calibrated the student (LoopQ, FlatQuant, SpinQuant)
    """
    trained = {row.label: row.slug for row in TABLE1 if row.calibration}
    if method not in trained:
        raise UsageError(f"--method {method}: not a calibrated method; use one of {', '.join(trained)}")
    bits = bit_label(bits)
    calibrated = read_artifact_meta(student, kind="student")[0]["calibrated_loops"]
    top = loop_sweep_top(max_loops, calibrated)
    sweep, written = Sweep(out, device), []
    rows = {
        "fp": {"model": model, "method": "FP"},
        f"rtn-{bits}": {"model": model, "method": "Symmetric", "bits": bits},
        seeded(f"{trained[method]}-{bits}", seed): {"student": student, "method": method, "bits": bits},
    }
    common = {"limit": limit, "ppl_windows": ppl_windows}
    for slug, row in rows.items():
        tag = {"loop_sweep": top, "seed": seed if row["method"] == method else None}
        if tasks:
            for n in range(calibrated, top + 1):
                path = sweep.row(f"{slug}-loops{n}", tasks=tasks, num_loops=n, **common, **row)
                written.append(sweep.tag(path, **tag))
            continue
        source = sweep.tag(sweep.row(f"{slug}-loops{top}", tasks=[], num_loops=top, **common, **row), **tag)
        written += [per_loop_result(source, n) for n in range(calibrated, top)] + [source]
    return written


def loop_sweep_top(max_loops: int | None, calibrated: int) -> int:
    """The loop sweep's top loop count: ``max_loops``, default twice the ``calibrated`` T; below T (the sweep's first
    row) it is refused, where ``0`` used to become 2T and ``2`` a lone 2-loop row."""
    if max_loops is None:
        return 2 * calibrated
    if max_loops < calibrated:
        raise UsageError(
            f"--max_loops {max_loops}: below the student's calibrated {calibrated} loops, where the sweep starts; "
            f"pass {calibrated} or more (default {2 * calibrated})"
        )
    return max_loops


def per_loop_result(source: Path, n: int) -> Path:
    """The result at ``n`` loops read off the per-loop perplexities of a longer WikiText-2 evaluation."""
    data = read_json(source)
    per_loop = data["wikitext2_per_loop_ppl"]
    derived = {**data, "num_loops": n, "wikitext2_ppl": per_loop[n - 1], "wikitext2_per_loop_ppl": per_loop[:n]}
    derived["per_loop_of"] = str(source)
    path = source.with_name(source.name.replace(f"loops{data['num_loops']}", f"loops{n}"))
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(derived, indent=2)))
    return path


def summary(out: str, reference: str = "LoopQ") -> str:
    """The mean ± std table of every result JSON in ``out`` (grouped by method and bits), with R against the
    Symmetric RTN row and FP, and a mark on rows separated from ``reference`` at the same bits by > 2 std
    (:func:`loopq.stats.separated`); then, where ``out`` holds them, the SLT budget sweep (with the promoted groups
    and their S_l) and the loop sweep. Printed and written to ``<out>/summary.md``.

    Args:
        out: the results folder
        reference: the method other rows are compared with
    """
    root = Path(out)
    results = [data for path in sorted(root.glob("*.json")) if "wikitext2_ppl" in (data := read_json(path))]
    rows: dict[tuple[str, str], list[float]] = {}
    for data in once_per_calibration([d for d in results if not any(k in d for k in SWEEP_TAGS)]):
        rows.setdefault((data["method"], data["bits"]), []).append(data["wikitext2_ppl"])
    lines = [
        f"Results in `{root}`: WikiText-2 PTQ perplexity, mean ± std over seeds (n); R = (ln RTN - ln M) / "
        f"(ln RTN - ln FP); ** = separated from {reference} at the same bits by more than 2 std "
        "(|diff| > 2 sqrt(s1^2 + s2^2)).",
        "",
        "| method | bits | n | WT2 ppl | R | vs " + reference + " |",
        "|---|---|---:|---:|---:|---|",
    ]
    for (method, bits), values in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        stat = summarize(values)
        ref = rows.get((reference, bits))
        mark = ""
        if ref and method != reference:
            diff = stat.mean - summarize(ref).mean
            mark = f"{diff:+.2f}" + (" **" if separated(stat, summarize(ref)) else "")
        lines.append(f"| {method} | {bits} | {stat.n} | {stat} | {recovery(rows, bits, stat.mean)} | {mark} |")
    text = "\n".join(lines + slt_sweep_lines(results, rows) + loop_sweep_lines(results)) + "\n"
    atomic_write(root / "summary.md", lambda tmp: tmp.write_text(text))
    print(text)
    return text


def calibration_seed(data: dict[str, Any]) -> object:
    """The seed a calibrated row's student was trained with (its recorded ``seed_everything``); None for a row
    without a calibration (FP, training-free baselines)."""
    config = (data.get("provenance") or {}).get("config")
    return config.get("seed_everything") if isinstance(config, dict) else None


def once_per_calibration(results: list[dict[str, Any]], *swept: str) -> list[dict[str, Any]]:
    """``results`` with each calibration once: an un-seeded row (the config's seed) and its ``-s<seed>`` twin record
    the same method, bits, calibration seed and ``swept`` fields - one run, which counted twice biased the mean and
    shrank the std. Rows without a calibration seed (FP, training-free) are all kept."""
    seen: set[tuple[object, ...]] = set()
    kept = []
    for data in results:
        seed = calibration_seed(data)
        run = (data["method"], data["bits"], seed, *(data.get(field) for field in swept))
        if seed is None or run not in seen:
            seen.add(run)
            kept.append(data)
    return kept


def recovery(rows: dict[tuple[str, str], list[float]], bits: str, ppl: float) -> str:
    """R of a perplexity against the FP and Symmetric RTN rows at ``bits`` ('' without them)."""
    fp, rtn = rows.get(("FP", "fp")), rows.get(("Symmetric", bits)) or rows.get(("RTN", bits))
    r = log_gap_recovery(summarize(fp).mean, summarize(rtn).mean, ppl) if fp and rtn else math.nan
    return "" if math.isnan(r) else f"{r:.2f}"


def slt_sweep_lines(results: list[dict[str, Any]], rows: dict[tuple[str, str], list[float]]) -> list[str]:
    """Fig. 4 as a table: per SLT budget the perplexity over seeds, R, and the groups promoted at the end of
    calibration - in how many seeds, with S_l of the round that last selected them against that round's median."""
    sweep: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for data in once_per_calibration([d for d in results if "slt_budget" in d], "slt_budget"):
        sweep.setdefault((data["bits"], data["slt_budget"]), []).append(data)
    if not sweep:
        return []
    lines = [
        "",
        "SLT budget sweep (Fig. 4): promoted = groups promoted at the end (seeds promoting it / seeds; mean S_l of "
        "the round that last selected it vs that round's median S).",
        "",
        "| SLT budget | bits | n | WT2 ppl | R | promoted |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for (bits, budget), runs in sorted(sweep.items()):
        stat = summarize([d["wikitext2_ppl"] for d in runs])
        cell = promoted_cell(runs)
        lines.append(f"| {budget} | {bits} | {stat.n} | {stat} | {recovery(rows, bits, stat.mean)} | {cell} |")
    return lines


def promoted_cell(runs: list[dict[str, Any]]) -> str:
    scores: dict[str, list[tuple[float, float]]] = {}
    for data in runs:
        last = {}
        for r in data.get("slt_rounds", []):
            last.update({name: (score, r["median_S"]) for name, score in r["selected"].items()})
        for name in data.get("promoted", []):
            scores.setdefault(name, [])
            if name in last:
                scores[name].append(last[name])
    parts = []
    for name, found in sorted(scores.items(), key=lambda kv: -len(kv[1])):
        count = sum(name in d.get("promoted", []) for d in runs)
        s_text = ""
        if found:
            s_text = f", S {statistics.mean(s for s, _ in found):.0f} vs {statistics.mean(m for _, m in found):.0f}"
        parts.append(f"{name.removeprefix('model.layers.')} ({count}/{len(runs)}{s_text})")
    return "; ".join(parts) or "none"


def loop_sweep_lines(results: list[dict[str, Any]]) -> list[str]:
    """Fig. 5 as a table: perplexity (mean ± std over seeds) of each method after n loops."""
    cells: dict[tuple[str, int], list[float]] = {}
    for data in once_per_calibration([d for d in results if "loop_sweep" in d], "num_loops"):
        cells.setdefault((f"{data['method']} {data['bits']}", data["num_loops"]), []).append(data["wikitext2_ppl"])
    if not cells:
        return []
    methods = sorted({m for m, _ in cells}, key=lambda m: (m != "FP fp", m))
    lines = ["", "Loop sweep (Fig. 5): WikiText-2 perplexity after n loops.", ""]
    lines += ["| loops | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
    for n in sorted({n for _, n in cells}):
        row = [str(summarize(cells[(m, n)])) if (m, n) in cells else "" for m in methods]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    return lines


def check_not_a_fit_config(argv: list[str]) -> None:
    """``--config FILE`` is this command's own options file (jsonargparse); a ``loopq.fit`` config there used to be
    taken for it and ignored, so every row silently calibrated with ``configs/tiny.yaml``."""
    for flag, value in itertools.pairwise(argv):
        if flag != "--config" or not Path(value).is_file():
            continue
        text = Path(value).read_text()
        if any(line.startswith(("trainer:", "data:", "seed_everything:")) for line in text.splitlines()):
            raise UsageError(
                f"--config {value}: a loopq.fit config; pass it as --fit_config {value} "
                "(--config reads this command's own options)"
            )


#: the help of the options several subcommands share (:class:`~loopq.commands.cli.Command`'s ``shared_help``)
SHARED_HELP = {
    "model": "teacher model directory",
    "out": "results folder (one JSON per row, pipeline.json)",
    "fit_config": "loopq.fit config of the LoopQ calibrations",
    "limit": "lm-eval examples per task (null: all)",
    "tasks": "lm-eval tasks (default: loopq_paper; [] or none given: perplexity only)",
    "seeds": "calibrate every trained row once per seed",
    "extra": "more loopq.fit options for every calibration (e.g. [--trainer.max_steps, 100])",
    "ppl_windows": "the first N WikiText-2 windows only (default: all)",
    "device": "where the evaluations run: auto, cpu, cuda, cuda:N (a calibration: its config's trainer)",
}
SUBCOMMANDS = [table1, ablations, slt_budget, num_samples, loops, summary]
COMMAND = Command(SUBCOMMANDS, "loopq.experiments", __doc__, shared_help=SHARED_HELP)

build_parser = COMMAND.parser


def main(argv: list[str] | None = None) -> None:
    check_not_a_fit_config(sys.argv[1:] if argv is None else argv)
    COMMAND.run(argv)
