"""The whole flow in one command: calibrate -> export -> evaluate -> report.

    python -m loopq.run --config configs/tiny.yaml [--limit 10] [--tasks ...] [--ppl_windows N] [--force]
                        [any python -m loopq.fit option: --trainer.max_steps 100, --model.quant.a_bits 8, ...]

Everything is written under the run directory ``trainer.default_root_dir``: ``student/`` (``loopq.fit`` with the same
config, in this process), ``exported/`` (checked against the student on the first WikiText-2 windows), ``results/``
(the FP teacher, plain RTN at the student's bits and LoopQ, each :func:`loopq.evaluate.evaluate`) and ``report/``
(``loopq.report``); the table of stages and the re-run rules are in docs/usage.md, "The main command". Every
WikiText-2 window is sized from the teacher's own context (:func:`window_length`), so a LoopFormer with ``block_size``
64 is evaluated on 64-token windows.

Re-running is safe and cheap: ``pipeline.json`` records every stage's inputs, and a stage whose inputs did not change
and whose outputs are still the files it wrote is skipped, so an interrupted run continues where it stopped (a
calibration from the newest intact checkpoint written since it first started: :meth:`Pipeline.own_last_checkpoint`).
A student is never recalibrated silently: another config or teacher content stops the run naming the keys
(:meth:`Pipeline.check_calibration`); ``--force`` reruns every stage from scratch. The stage bookkeeping is the generic
runner of :mod:`loopq.stages`; this module defines LoopQ's stages on it.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import capture_parser
from jsonargparse.typing import PositiveInt
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from loopq.artifacts import check_student_teacher, export_student, load_quantized, load_student, read_student_meta
from loopq.artifacts.layout import EXPORT_META, STUDENT_META, STUDENT_WEIGHTS
from loopq.calib.checkpoint_io import newest_intact
from loopq.calib.line_progress import LineProgress
from loopq.commands import fit
from loopq.commands.evaluate import evaluate
from loopq.commands.report.build import build_report
from loopq.commands.report.inputs import load_result, load_run
from loopq.data.tokenizer import load_tokenizer
from loopq.devices import resolve_device
from loopq.errors import LoopQError
from loopq.files import read_json
from loopq.metrics.perplexity import perplexity, wikitext2_stream
from loopq.metrics.tasks import check_tasks
from loopq.models.base import LoopLM
from loopq.models.loading import resolve_model_dir
from loopq.planning.guards import meta_teacher
from loopq.provenance import describe, flat_record, teacher_fingerprint
from loopq.quant import QuantConfig
from loopq.quant.accounting import footprint
from loopq.quant.config import Bits
from loopq.quant.packed import check_kernel_support
from loopq.stages import MANIFEST, Manifest, Stage, StageRunner, clock, differing_keys, normalised, say

#: lm-eval examples per task: keeps the embedded default under ten minutes on two CPU cores (``--limit full``: all)
DEFAULT_LIMIT = 10
EXPORT_CHECK_WINDOWS = 8
#: the PTQ protocol's window here (the paper's 2048, scaled to the tiny teachers), cut to a shorter model's context
DEFAULT_PPL_SEQ_LEN = 256
#: a static baseline's calibration samples (loopq.evaluate's default), cut to a shorter model's context
DEFAULT_CALIB_SEQ_LEN = 128


class PipelineError(LoopQError):
    """Bad input, or a run directory that cannot be reused as asked; the message says what to do."""


@dataclass(frozen=True)
class Options:
    """The pipeline's own options; ``--force`` (an option of ``loopq.fit``) reruns every stage.

    Args:
        limit: lm-eval examples per task, or full (all of them)
        tasks: lm-eval tasks (none given, or []: perplexity only)
        ppl_windows: the first N WikiText-2 windows (default: all)
        ppl_seq_len: WikiText-2 window (default: min(256, the teacher's context))
        eval_batch_size: evaluation batch size
        eval_exported: evaluate the int model as LoopQ (slow on a CPU)
        device: where to export-check and evaluate: auto (cuda when available), cpu, cuda, cuda:N
    """

    limit: PositiveInt | Literal["full", "none"] | None = DEFAULT_LIMIT
    tasks: tuple[str, ...] = ("loopq_paper",)
    ppl_windows: PositiveInt | None = None
    ppl_seq_len: PositiveInt | None = None
    eval_batch_size: PositiveInt = 8
    eval_exported: bool = False
    device: str = "auto"
    force: bool = False

    @classmethod
    def of(cls, config: Any) -> Options:
        """The options as parsed: a ``full`` limit is None, the device is decided once for the command (a bad one
        refused before calibrating); the calibration's device is its ``trainer``'s."""
        values = {name: config[name] for name in cls.__dataclass_fields__}
        limit = None if values["limit"] in ("full", "none") else values["limit"]
        return cls(**{**values, "limit": limit, "device": str(resolve_device(values["device"]))})


class DeferredCLI(fit.LoopQCLI):
    """The calibration CLI, parsed and checked up front but built (teacher loaded, trainer created) only when a
    student has to be calibrated. Parsing locks the run directory for this process (one writer at a time); the
    pipeline's own rule decides whether a student may be replaced (:meth:`Pipeline.check_calibration`)."""

    check_student = False
    refuse_finished = False  # a finished calibration whose student was lost writes it again
    command = "loopq.run"
    description = (
        "python -m loopq.fit --help lists the calibration's options, all read here too; the pipeline's own follow. "
        "Calibrate, export, evaluate and report in one command, in the run directory --trainer.default_root_dir."
    )
    force_help = "rerun every stage, recalibrating from scratch (files are replaced, nothing is deleted)"

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_function_arguments(Options, skip={"force"})

    def check_teacher(self, teacher: str) -> None:
        """loopq.run's own teacher check (its message names ``--model.teacher``)."""
        check_teacher(teacher)

    def instantiate_classes(self) -> None:
        """Deferred to :meth:`build`."""

    def build(self) -> None:
        super().instantiate_classes()

    def release(self) -> None:
        """Drop the calibration's teacher, student and trainer before the evaluations load their own models."""
        self.model = self.datamodule = self.trainer = self.config_init = None  # type: ignore[assignment]


class Pipeline(StageRunner):
    """The stages of one run directory (see module docstring)."""

    def __init__(self, cli: DeferredCLI, options: Options) -> None:
        self.cli, self.options = cli, options
        config = cli.config
        self.root = Path(config.trainer.default_root_dir)
        self.teacher = str(config.model.teacher)
        self.student_dir = fit.student_dir(config)
        self.exported_dir = self.root / "exported"
        self.results_dir = self.root / "results"
        self.report_dir = self.root / "report"
        self.report_path = self.report_dir / "report.md"
        self.quant = asked_quant(config)
        teacher_model = check_teacher(self.teacher)
        #: the teacher's architecture (the report and the summary name it) and every WikiText-2 window's length
        self.arch, self.context = teacher_model.arch, teacher_model.max_positions
        self.window = window_length(self.context, options.ppl_seq_len)
        #: content hash of the teacher: every stage's inputs include it, so a rebuilt teacher is never mixed in
        self.teacher_sha256 = teacher_fingerprint(resolve_model_dir(self.teacher))
        #: the bit widths as the label its stages and result files record (the JSON boundary)
        self.bits = Bits(self.quant["w_bits"], self.quant["a_bits"]).label
        super().__init__(Manifest(self.root / MANIFEST, fresh=options.force, error=PipelineError))

    # ------------------------------------------------------------------ plan and run
    def stages(self) -> list[Stage]:
        if self.options.eval_exported:
            loopq, made_by = {"exported": str(self.exported_dir)}, ("calibrate", "export")
        else:
            loopq, made_by = {"student": str(self.student_dir)}, ("calibrate",)
        rtn = {"calib_seq_len": min(DEFAULT_CALIB_SEQ_LEN, self.context)}  # a static baseline's samples fit too
        evals = [
            self.eval_stage("evaluate FP", {"model": self.teacher, "method": "FP", "bits": "fp"}),
            self.eval_stage("evaluate RTN", {"model": self.teacher, "method": "RTN", "bits": self.bits, **rtn}),
            self.eval_stage("evaluate LoopQ", {**loopq, "method": "LoopQ", "bits": self.bits}, made_by),
        ]
        student_files = [self.student_dir / STUDENT_WEIGHTS, self.student_dir / STUDENT_META]
        everything = ("calibrate", *(stage.name for stage in evals))
        return [
            Stage(
                "calibrate",
                self.student_dir,
                student_files,
                self.calibrate,
                self.calibration_settings(),
                canonical=calibration_inputs,
            ),
            Stage("export", self.exported_dir, [self.exported_dir / EXPORT_META], self.export, after=("calibrate",)),
            *evals,
            Stage("report", self.report_path, [self.report_path], self.report, after=everything),
        ]

    def eval_stage(self, name: str, model: dict[str, Any], after: tuple[str, ...] = ()) -> Stage:
        """``model``: which model, method and bits (:func:`loopq.evaluate.evaluate`'s arguments)."""
        settings = {
            **model,
            "tasks": list(self.options.tasks),
            "limit": self.options.limit,
            "ppl_windows": self.options.ppl_windows,
            "ppl_seq_len": self.window,
            "batch_size": self.options.eval_batch_size,
            "device": self.options.device,  # resolved: a result says where it was computed
        }
        out = self.result_paths()[model["method"]]
        inputs = {**settings, "teacher_sha256": self.teacher_sha256}  # a rebuilt teacher re-runs the evaluation
        return Stage(name, out, [out], lambda: self.evaluate(settings, out), inputs, after)

    def calibration_settings(self) -> dict[str, Any]:
        return {**fit.fit_settings(self.cli.config), "teacher_sha256": self.teacher_sha256}

    def run(self) -> Path:
        stages = self.stages()
        self.check_calibration(stages[0])
        self.run_stages(stages)
        self.print_summary()
        return self.report_path

    def check_calibration(self, stage: Stage) -> None:
        """Refuse to reuse a student or checkpoint made with another config (``pipeline.json``'s record, and the
        student's own); adopt a student ``loopq.fit`` wrote with this config."""
        if self.options.force:
            return
        current = calibration_inputs(normalised(stage.settings))
        entry = self.manifest.stages.get("calibrate")
        if entry is not None:
            changed = differing_keys(calibration_inputs(entry["inputs"]), current)
            if changed:
                raise PipelineError(
                    f"{self.root} was calibrated with another config ({', '.join(changed)} differ); pass --force to "
                    "start over, or set another --trainer.default_root_dir"
                )
        if (self.student_dir / STUDENT_WEIGHTS).is_file():
            self.check_student(current)
            if entry is None:
                self.adopt_student(stage)

    def check_student(self, current: dict[str, Any]) -> None:
        """The student in the output directory was calibrated on this teacher (same content hash) with this config
        (its recorded provenance, as :func:`loopq.fit.check_student_replace` compares it): ``python -m loopq.fit``
        may have written it, or written over the one this pipeline made."""
        meta = read_student_meta(self.student_dir)
        check_student_teacher(self.student_dir, meta, resolve_model_dir(self.teacher))
        fix = "pass --force to recalibrate, or set another --trainer.default_root_dir / --model.output_dir"
        if not meta.get("provenance"):
            raise PipelineError(f"{self.student_dir} holds a student calibrated without a recorded config; {fix}")
        recorded = unprefixed(flat_record(meta["provenance"]))
        changed = differing_keys(recorded, current)
        if changed:
            raise PipelineError(
                f"{self.student_dir} holds a student calibrated with another config "
                f"({describe(changed, recorded, current)}); {fix}"
            )

    def adopt_student(self, stage: Stage) -> None:
        """Record a student ``python -m loopq.fit`` wrote (no record here; checked by :meth:`check_student`) as this
        run's calibration."""
        self.manifest.start(stage.name, normalised(stage.settings))
        self.manifest.finish(stage.name, {"note": "adopted an existing student"}, 0.0, stage.outputs)
        say(f"calibrate: adopted the student {self.student_dir} (written by python -m loopq.fit with this config)")

    # ------------------------------------------------------------------ stage actions
    def calibrate(self) -> dict[str, Any]:
        cli = self.cli
        cli.build()
        if not sys.stdout.isatty():
            use_line_progress(cli.trainer)
        resume = self.own_last_checkpoint()
        if cli.config.ckpt_path is None and resume is not None:
            cli.config.ckpt_path = str(resume)
            say(f"resuming the calibration from {resume}")
        module = fit.calibrate(cli)
        summary = {"steps": cli.trainer.global_step, "promoted": list(module.promoted)}
        cli.release()
        return {**summary, "note": f"{summary['steps']} steps, SLT promoted {len(module.promoted)} group(s)"}

    def own_last_checkpoint(self) -> Path | None:
        """The newest intact ``checkpoints/*.ckpt`` written since this calibration first started (checkpoints of an
        earlier run, e.g. before ``--force`` or of another config, are never resumed; damaged ones are skipped with
        a line saying so, see :func:`~loopq.calib.checkpoint_io.newest_intact`)."""
        started = self.manifest.stages["calibrate"]["started"]
        found = [p for p in fit.checkpoints_in([self.root / "checkpoints"]) if p.stat().st_mtime_ns >= started]
        return newest_intact(found, "resume")

    def export(self) -> dict[str, Any]:
        student, meta = load_student(self.student_dir)
        export_student(student, meta, self.exported_dir)
        device = torch.device(self.options.device)
        exported = load_quantized(self.exported_dir, device=device)
        check = export_check(student.to(device), exported, meta["teacher"], self.window)
        size = footprint(load_quantized(self.exported_dir, dtype=torch.bfloat16))
        mb = {"size_mb": size["total"] / 2**20, "bf16_mb": size["bf16_model"] / 2**20}
        note = (
            f"{mb['size_mb']:.2f} MB (BF16 teacher {mb['bf16_mb']:.2f} MB); WikiText-2 ppl on the first "
            f"{check['windows']} windows x {check['seq_len']} tokens: int model {check['int_ppl']:.2f}, "
            f"fake-quant student {check['fake_quant_ppl']:.2f}"
        )
        return {**check, **mb, "note": note}

    def evaluate(self, settings: dict[str, Any], out: Path) -> dict[str, Any]:
        with quiet_lm_eval():
            result = evaluate(out=str(out), **settings)
        ppl, windows = result["wikitext2_ppl"], result["wikitext2_windows"]
        return {"wikitext2_ppl": ppl, "note": f"WikiText-2 ppl {ppl:.2f} ({windows} windows)"}

    def report(self) -> dict[str, Any]:
        results = [load_result(path) for path in self.result_paths().values()]
        run = load_run(self.root, self.root.name, self.student_dir)
        report = build_report(results, [run], [], self.report_dir, blocks=[self.bits])
        return {"report": str(report), "note": str(report)}

    # ------------------------------------------------------------------ summary
    def result_paths(self) -> dict[str, Path]:
        return {
            "FP": self.results_dir / "fp.json",
            "RTN": self.results_dir / f"rtn-{self.bits}.json",
            "LoopQ": self.results_dir / f"loopq-{self.bits}.json",
        }

    def print_summary(self) -> None:
        results = {method: read_json(path, PipelineError) for method, path in self.result_paths().items()}
        windows = results["FP"]["wikitext2_windows"]
        ppl = " | ".join(f"{method} {r['wikitext2_ppl']:.2f}" for method, r in results.items())
        say(f"done in {clock(time.monotonic() - self.started)}; report: {self.report_path}")
        say(f"teacher {self.teacher} ({self.arch}), WikiText-2 windows of {self.window} tokens")
        say(f"WikiText-2 perplexity ({self.bits}, PTQ protocol, {windows} windows): {ppl}")


# ---------------------------------------------------------------------------------------------------- helpers
def calibration_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The calibrate stage's inputs (the flat config and ``teacher_sha256``) as ``loopq.fit`` compares a record
    (:func:`loopq.provenance.flat_record`: an option added since a record was written reads as the value it had then,
    a retired one at its default drops out), keys as the stage records them (``model.lr``, ``teacher_sha256``)."""
    config = {k: v for k, v in inputs.items() if k != "teacher_sha256"}
    return unprefixed(flat_record({"teacher_sha256": inputs.get("teacher_sha256"), "config": config}))


def unprefixed(flat: dict[str, Any]) -> dict[str, Any]:
    """A :func:`loopq.provenance.flat_record` with its ``config.`` keys as the config names them."""
    return {k.removeprefix("config."): v for k, v in flat.items()}


def asked_quant(config: Any) -> dict[str, Any]:
    """The QuantConfig the calibration config asks for, as a plain dict."""
    quant = config.model.quant
    return (QuantConfig.from_dict(quant.as_dict()) if quant is not None else QuantConfig()).to_dict()


def use_line_progress(trainer: Any) -> None:
    """Swap Lightning's default bar, redrawn in place, for one that prints plain lines (output is not a terminal)."""
    for i, callback in enumerate(trainer.callbacks):
        if type(callback) in (RichProgressBar, TQDMProgressBar):
            trainer.callbacks[i] = LineProgress()


def window_length(context: int, asked: int | None = None) -> int:
    """The WikiText-2 window of a model with ``context`` positions: ``asked`` if given (it must fit the context),
    else :data:`DEFAULT_PPL_SEQ_LEN` cut to the context."""
    if asked is None:
        return min(DEFAULT_PPL_SEQ_LEN, context)
    if asked < 2:
        raise PipelineError(f"--ppl_seq_len {asked}: a window needs at least 2 tokens; pass --ppl_seq_len 2..{context}")
    if asked > context:
        raise PipelineError(
            f"--ppl_seq_len {asked}: longer than the teacher's {context} positions (its config.json); pass "
            f"--ppl_seq_len {context} or less"
        )
    return asked


def export_check(student: Any, exported: Any, tokenizer_dir: str, seq_len: int) -> dict[str, Any]:
    """WikiText-2 perplexity of the fake-quant student and the exported int model on the first windows of
    ``seq_len`` tokens (the teacher's window, :func:`window_length`)."""
    stream = torch.tensor(wikitext2_stream(load_tokenizer(tokenizer_dir)), device="cpu")[
        : EXPORT_CHECK_WINDOWS * seq_len
    ]
    return {
        "windows": EXPORT_CHECK_WINDOWS,
        "seq_len": seq_len,
        "fake_quant_ppl": perplexity(student, stream, seq_len, batch_size=8).ppl,
        "int_ppl": perplexity(exported, stream, seq_len, batch_size=8).ppl,
    }


class UntitledBarFilter:
    """A text stream that drops progress bars without a title and passes everything else on.

    lm-eval draws one such bar per task while it builds the requests (62 finished bars per model for the paper's
    suite) and has no switch for it; the bars that tell something are titled ("loopq scoring", "Tokenizing inputs").
    """

    BAR = re.compile(r"\r?\s*\d+%\|")

    def __init__(self, stream: Any) -> None:
        self.stream, self.in_bar = stream, False

    def write(self, text: str) -> int:
        if not text:  # tqdm writes "" between a bar's last redraw and its newline
            return 0
        if self.BAR.match(text) or (self.in_bar and text == "\n"):  # a bar's redraw, or the newline that ends it
            self.in_bar = text != "\n"
            return len(text)
        self.in_bar = False
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, encoding, ... of the real stream
        return getattr(self.stream, name)


@contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Silence lm-eval's per-task notices (warnings about our offline task definitions) and untitled bars."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with redirect_stderr(UntitledBarFilter(sys.stderr)):
            yield
    finally:
        logger.setLevel(level)


def check_teacher(teacher: str) -> LoopLM:
    """The teacher's model on the meta device (:func:`~loopq.planning.guards.meta_teacher`), or a refusal."""
    model = meta_teacher(resolve_model_dir(teacher))
    if model is None:
        raise PipelineError(f"--model.teacher {teacher}: no such model directory (a folder with config.json)")
    return model


def check_before_calibration(config: Any, options: Options) -> None:
    """What the later stages would refuse, refused in the first seconds instead of after the calibration: bits
    and group size the export kernels do not run, lm-eval task names the evaluations do not know."""
    quant = asked_quant(config)
    check_kernel_support(quant["w_bits"], quant["a_bits"], quant["group_size"], key="--model.quant")
    if options.tasks:
        check_tasks(options.tasks)


# ---------------------------------------------------------------------------------------------------- CLI
def parse(argv: list[str] | None = None) -> DeferredCLI:
    """The command line (default ``sys.argv[1:]``) parsed, the run directory locked, nothing built."""
    return fit.build_cli(argv, DeferredCLI)  # type: ignore[return-value]


def build_parser() -> Any:
    """The parser of ``python -m loopq.run``: ``loopq.fit``'s with the pipeline's :class:`Options`."""
    return capture_parser(lambda: fit.build_cli([], DeferredCLI))


def main(argv: list[str] | None = None) -> Path:
    cli = parse(argv)
    try:  # the teacher was checked while parsing (DeferredCLI.check_teacher)
        options = Options.of(cli.config)
        check_before_calibration(cli.config, options)
        return Pipeline(cli, options).run()
    finally:
        cli.release_lock()
