"""Calibrate a LoopQ student:  python -m loopq.fit --config configs/tiny.yaml [--ckpt_path last] [overrides].

A LightningCLI over :class:`~loopq.calib.module.LoopQCalibration` and
:class:`~loopq.data.calibration.CalibrationDataModule`; the resolved config is saved next to the run's logs.
``--ckpt_path last`` resumes mid-calibration (optimizer, schedule, mu_t, SLT selection and data order); under
DeepSpeed checkpoints are directories (``checkpoints/last.ckpt/``) and ``last`` finds them the same way.

Provenance: every checkpoint and the student record the teacher's content hash and the resolved config
(:mod:`loopq.provenance`). Resuming with another teacher (also one rebuilt in place) or another config (any key
but the :data:`COSMETIC` ones) is refused, naming the differing keys; ``--allow_config_change`` resumes anyway and
the student then records the new config.
Multi-GPU: launch the same command under ``torchrun`` (see ``launch/``) with ``trainer.strategy`` set to
``ddp_find_unused_parameters_true`` or a DeepSpeed config.

Memory, before starting: ``--print_plan`` prints the predicted peak memory per GPU of the configured run (teacher,
quantization state, activations, targets; :mod:`loopq.planning.memory`) from the teacher's ``config.json`` alone and
exits without loading anything; ``--plan_config <config.json>`` supplies the shapes of a hub teacher that is not on disk
(the paper's four teachers are embedded).
Precision: ``model.teacher_dtype: auto`` is resolved here from ``trainer.precision`` (bf16 under a bf16 precision,
fp32 otherwise) before the module is built, so the saved config and the provenance record the dtype used.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import capture_parser
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from loopq.artifacts.layout import RUN_LOCK, STUDENT_META, json_object
from loopq.calib.checkpoint_io import CheckpointError, check_ckpt_path, load_weights_only, newest_intact
from loopq.calib.deepspeed import read_sidecar
from loopq.calib.module import LoopQCalibration, resolve_teacher_dtype
from loopq.calib.stop_on_signal import exit_status
from loopq.calib.stop_on_signal import install as install_stop_on_signal
from loopq.commands.cli import SharedParsing, lightning_cli
from loopq.data.calibration import CalibrationDataModule
from loopq.errors import UsageError
from loopq.locks import DirectoryLock
from loopq.models.loading import resolve_model_dir
from loopq.paths import run_root
from loopq.planning.guards import check_calibration, check_local_teacher
from loopq.planning.memory import format_plan, plan_from_config
from loopq.provenance import ProvenanceError, check_same, flat_record, flatten, record, teacher_fingerprint

#: options that do not change the calibrated student: a resume or a loopq.run re-run may differ in them
COSMETIC = frozenset(
    {
        "config",
        "ckpt_path",
        "allow_config_change",
        "trainer.default_root_dir",
        "trainer.enable_progress_bar",
        "trainer.enable_model_summary",
        "trainer.log_every_n_steps",
        "print_plan",
        "plan_config",
        "force",
        # loopq.run's own options: how the student is evaluated, not how it is calibrated
        *("limit", "tasks", "ppl_windows", "ppl_seq_len", "eval_batch_size", "eval_exported", "device"),
    }
)

TRAINER_DEFAULTS: dict[str, Any] = {
    "use_distributed_sampler": False,  # CalibrationSampler shards the global batch itself
    "gradient_clip_val": 1.0,
    "plugins": [{"class_path": "loopq.calib.checkpoint_io.AtomicCheckpointIO"}],
}


#: callbacks that watch a calibration without changing its student (checkpointing, progress, summaries, logging,
#: diagnostics, a clean stop on a signal, memory peaks): left out of the recorded config, so one added for a segment of
#: a run is not another config. Every other callback counts - the method's schedules (mu_t, SLT reselection), and any
#: that stops, averages or otherwise steers training (EarlyStopping, StochasticWeightAveraging, Timer, ...). A callback
#: class of one's own that only watches says so with a class attribute ``changes_student = False``.
OBSERVER_CALLBACKS = (
    "lightning.pytorch.callbacks.ModelCheckpoint",  # under student_from: best its choice counts (student_choice)
    "lightning.pytorch.callbacks.OnExceptionCheckpoint",
    "lightning.pytorch.callbacks.TQDMProgressBar",
    "lightning.pytorch.callbacks.RichProgressBar",
    "lightning.pytorch.callbacks.ModelSummary",
    "lightning.pytorch.callbacks.RichModelSummary",
    "lightning.pytorch.callbacks.LearningRateMonitor",
    "lightning.pytorch.callbacks.DeviceStatsMonitor",
    "lightning.pytorch.callbacks.ThroughputMonitor",
    "loopq.calib.line_progress.LineProgress",
    "loopq.calib.diagnostics.PerLoopDiagnostics",
    "loopq.calib.stop_on_signal.StopOnSignal",
    "loopq.commands.gpu_check.flow.PeakMemory",
)


#: settings of earlier releases that moved (one home per setting): key -> where it is set now
MOVED_KEYS = {
    "model.mu_every_n_steps": "loopq.calib.mu.AdaptiveMu's every_n_steps",
    "model.slt_start_step": "loopq.calib.reselection.SharingGapReselection's start_step",
    "model.slt_every_n_steps": "loopq.calib.reselection.SharingGapReselection's every_n_steps",
    "model.slt_per_round": "loopq.calib.reselection.SharingGapReselection's per_round",
    "model.slt_probe_batches": "loopq.calib.reselection.SharingGapReselection's probe_batches",
}


def check_moved_keys(argv: list[str]) -> None:
    """A moved key (:data:`MOVED_KEYS`), on the command line or in a ``--config`` file, is refused in one line naming
    its new home; anything else is left to the parser."""
    for i, token in enumerate(argv):
        key, _, value = token.removeprefix("--").partition("=")
        if token.startswith("--") and key in MOVED_KEYS:
            raise UsageError(f"--{key}: moved to trainer.callbacks, set {MOVED_KEYS[key]} (docs/usage.md)")
        path = value or (argv[i + 1] if i + 1 < len(argv) else "")
        if token.startswith("--config") and key == "config" and Path(path).is_file():
            try:
                model = (yaml.safe_load(Path(path).read_text()) or {}).get("model") or {}
            except (yaml.YAMLError, AttributeError, UnicodeDecodeError):
                continue  # the parser names what is wrong with the file
            for name in model if isinstance(model, dict) else ():
                if f"model.{name}" in MOVED_KEYS:
                    raise UsageError(
                        f"{path}: model.{name} moved to trainer.callbacks, set {MOVED_KEYS[f'model.{name}']} "
                        "(docs/usage.md)"
                    )


DESCRIPTION = __doc__.split("\n\n")[0]


class LoopQCLI(SharedParsing, LightningCLI):
    """The calibration's command line (module docstring); ``loopq.run`` subclasses it with its own options."""

    #: the first line of ``--help``: the module docstring's first paragraph
    description = DESCRIPTION
    #: what ``--force`` does
    force_help = "replace a student in the output directory that was calibrated with another config or teacher"

    def parse_arguments(self, parser: Any, args: Any) -> None:
        check_moved_keys(list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else [])
        super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="resume: 'last' or a .ckpt path")
        parser.add_argument(
            "--allow_config_change",
            type=bool,
            default=False,
            help="resume even if the checkpoint was made with another config or teacher (the student records the new)",
        )
        parser.add_argument(
            "--print_plan",
            action="store_true",
            help="print the run's predicted memory per GPU (loopq.planning.memory) and exit without loading the "
            "teacher",
        )
        parser.add_argument(
            "--plan_config", type=str | None, default=None, help="--print_plan: the teacher's config.json to plan with"
        )
        parser.add_argument("--force", type=bool, default=False, help=self.force_help)
        parser.link_arguments("model.teacher", "data.tokenizer")

    #: refuse to replace a student calibrated with another config (``loopq.run`` applies its own rule instead)
    check_student = True
    #: refuse to resume a finished calibration (``loopq.run`` resumes it to write a lost student again)
    refuse_finished = True
    command = "loopq.fit"
    lock: DirectoryLock | None = None

    def before_instantiate_classes(self) -> None:
        """Before the teacher loads: ``--print_plan`` (then exit), a ``--ckpt_path`` that is no checkpoint, the
        checks of :func:`~loopq.planning.guards.check_calibration`, a student of another config in the output directory;
        ``model.teacher_dtype: auto`` becomes the dtype ``trainer.precision`` implies. Then the run directory is
        locked (one writer at a time). A relative run directory is first placed under ``$LOOPQ_RUNS_DIR`` when set
        (:func:`loopq.paths.run_root`)."""
        trainer = self.config.trainer
        trainer.default_root_dir = run_root(trainer.default_root_dir)
        if self.config.get("print_plan"):
            print_plan(self.config)
            raise SystemExit(0)
        check_ckpt_path(self.config.get("ckpt_path"))
        self.check_teacher(str(self.config.model.teacher))  # first: a run left in the run directory is read below
        model = self.config.model
        # resolved before the resume check compares this config with the checkpoint's (which records it resolved)
        model.teacher_dtype = resolve_teacher_dtype(model.teacher_dtype, self.config.trainer.precision)
        if self.refuse_finished:
            check_resumable(self.config)
        check_calibration(self.config)
        # a resume is checked against its checkpoint's record instead (check_resume, with its own override)
        overridden = self.config.get("force") or self.config.get("allow_config_change") or self.config.get("ckpt_path")
        if self.check_student and not overridden:
            check_student_replace(self.config)
        if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 holds it for the whole run
            root = self.config.trainer.default_root_dir or os.getcwd()
            self.lock = DirectoryLock(root, RUN_LOCK, self.command, "--trainer.default_root_dir").acquire()

    def check_teacher(self, teacher: str) -> None:
        """``model.teacher`` is a model directory (:func:`~loopq.planning.guards.check_local_teacher`), checked
        before the run directory is: a student an earlier run left there is compared against the teacher."""
        check_local_teacher(teacher)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except BaseException:
            self.release_lock()
            raise

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def after_instantiate(self) -> None:
        """Everything of a run lives under ``trainer.default_root_dir``: checkpoints (so ``--ckpt_path last``
        finds them), TensorBoard and CSV logs."""
        trainer = self.trainer
        root = Path(trainer.default_root_dir)
        for cb in trainer.checkpoint_callbacks:
            if cb.dirpath is None:
                cb.dirpath = str(root / "checkpoints")
        if not any(isinstance(lg, CSVLogger) for lg in trainer.loggers):
            trainer.loggers = [*trainer.loggers, CSVLogger(str(root), name="csv")]
        install_stop_on_signal(trainer)  # SIGTERM / SIGINT: finish the step, save, exit


def print_plan(config: Any) -> None:
    """``--print_plan``: the memory plan of the parsed config (rank 0 only under torchrun)."""
    if os.environ.get("RANK", "0") != "0":
        return
    source, plan = plan_from_config(config, config.get("plan_config"))
    title = " ".join(str(c) for c in config.get("config") or []) or str(config.model.teacher)
    print(format_plan(plan, title, source), flush=True)


def main(args: list[str] | None = None) -> LoopQCalibration:
    """Calibrate. The process group is closed after a finished (or signal-stopped) run; after an error it is left to
    :func:`loopq.errors.run_cli`, which exits at once: destroying a group with work in flight can hang (NCCL)."""
    cli = build_cli(args)
    try:
        module = calibrate(cli)
    except SystemExit:
        cli.release_lock()
        close_process_group()
        raise
    except BaseException:
        cli.release_lock()  # the run directory is free again; the process group is left to run_cli's hard exit
        raise
    cli.release_lock()
    close_process_group()
    return module


def student_dir(config: Any) -> Path:
    """Where the calibration writes its student: ``model.output_dir``, else ``<default_root_dir>/student``."""
    root = Path(config.trainer.default_root_dir or os.getcwd())
    return Path(config.model.output_dir) if config.model.output_dir else root / "student"


def check_student_replace(config: Any) -> None:
    """A student already in the output directory is replaced only by a calibration of the same teacher and config
    (the rule of ``loopq.run``); ``--force`` replaces it anyway."""
    meta = json_object(student_dir(config) / STUDENT_META)
    if not meta:
        return
    teacher = resolve_model_dir(str(config.model.teacher))
    current = flat_record(record(teacher_fingerprint(teacher), fit_settings(config)))
    what = f"{student_dir(config)} holds a student calibrated"
    fix = "pass --force true to replace it, or another --trainer.default_root_dir / --model.output_dir"
    if not meta.get("provenance"):
        raise ProvenanceError(f"{what} without a recorded config; {fix}")
    recorded = flat_record(meta["provenance"])
    check_same(recorded, current, what, fix)


def close_process_group() -> None:
    """Destroy the torchrun process group before the interpreter exits: Lightning leaves it open, and tearing down a
    live gloo group at exit can abort a rank ("terminate called without an active exception") after a finished run."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def build_cli(args: list[str] | None = None, cli_class: type[LoopQCLI] = LoopQCLI) -> LoopQCLI:
    """Parse ``args`` (a list, or ``sys.argv``) into the calibration CLI (:func:`~loopq.commands.cli.lightning_cli`);
    ``loopq.run`` passes a subclass."""
    model, data = LoopQCalibration, CalibrationDataModule
    return lightning_cli(cli_class, model, data, args, cli_class.command, trainer_defaults=TRAINER_DEFAULTS)


def build_parser() -> Any:
    """The parser of ``python -m loopq.fit``, built as :func:`build_cli` builds it, nothing parsed."""
    return capture_parser(lambda: build_cli([]))


def calibrate(cli: LoopQCLI) -> LoopQCalibration:
    """Run the calibration a built CLI describes (resuming from ``--ckpt_path``); returns the calibrated module."""
    cli.after_instantiate()
    # Resolved before fit and set on the trainer, so that setup hooks already see it: a resumed run skips the
    # data-dependent initialisation in setup (it loads that state; DeepSpeed restores only after building its engine).
    cli.trainer.ckpt_path = resolve_ckpt_path(cli.trainer, cli.config.ckpt_path)
    cli.model.provenance = record(cli.model.teacher_sha256, fit_settings(cli.config))
    if cli.trainer.ckpt_path and not cli.config.get("allow_config_change"):
        check_resume(cli.trainer.ckpt_path, cli.model.provenance)
    if cli.trainer.ckpt_path and cli.refuse_finished:
        check_not_finished(cli.trainer.ckpt_path, cli.trainer.max_steps, student_dir(cli.config))
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    except SIGTERMException:  # stopped on request, checkpoint saved (callbacks.stop_on_signal)
        raise SystemExit(exit_status(cli.trainer)) from None
    return cli.model


def fit_settings(config: Any) -> dict[str, Any]:
    """The resolved calibration config as flat dotted keys, without the :data:`COSMETIC` options; of
    ``trainer.callbacks`` every one but the observers (:func:`is_observer`: checkpointing, progress, diagnostics, ...,
    which do not change the student) counts. With ``model.student_from: best`` the monitoring checkpoint's choice
    does (``student_choice``: what it monitors, in which direction, and which steps it scores), so a changed choice
    reruns the calibration."""
    tree = config.as_dict()
    callbacks = (tree.get("trainer") or {}).get("callbacks")
    if isinstance(callbacks, list):
        tree["trainer"]["callbacks"] = [c for c in callbacks if not is_observer(c)]
        if (tree.get("model") or {}).get("student_from") == "best":
            tree["student_choice"] = [choice for choice in map(_choice, callbacks) if choice]
    return {k: v for k, v in flatten(tree).items() if k not in COSMETIC}


#: the ModelCheckpoint arguments that decide which checkpoint ``student_from: best`` loads
CHOICE_KEYS = ("monitor", "mode", "every_n_train_steps", "every_n_epochs", "train_time_interval")


def _choice(callback: Any) -> dict[str, Any]:
    """A monitoring ModelCheckpoint's :data:`CHOICE_KEYS` (empty for any other callback)."""
    if not isinstance(callback, dict) or not str(callback.get("class_path", "")).endswith("ModelCheckpoint"):
        return {}
    args = callback.get("init_args") or {}
    return {k: args.get(k) for k in CHOICE_KEYS} if args.get("monitor") else {}


def is_observer(callback: Any) -> bool:
    """Whether a ``trainer.callbacks`` entry (a ``class_path`` dict, or an instance) only watches the calibration: its
    class is one of :data:`OBSERVER_CALLBACKS` or says ``changes_student = False``; a class that does not import
    counts as changing the student."""
    cls = import_class(str(callback.get("class_path", ""))) if isinstance(callback, dict) else type(callback)
    return cls is not None and (cls in observer_classes() or getattr(cls, "changes_student", True) is False)


@functools.cache
def observer_classes() -> frozenset[type]:
    """The classes :data:`OBSERVER_CALLBACKS` names (those that import)."""
    return frozenset(cls for cls in map(import_class, OBSERVER_CALLBACKS) if cls is not None)


def import_class(path: str) -> type | None:
    """The class a dotted ``class_path`` names, None when it does not import."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


def checkpoint_record(ckpt_path: str) -> tuple[dict[str, Any], int | None]:
    """The LoopQ block a calibration checkpoint recorded (a file, or a DeepSpeed directory's sealed sidecar) and its
    global step (None when not recorded); a file is read weights-only (a pickle payload: one line)."""
    if Path(ckpt_path).is_dir():
        state = read_sidecar(ckpt_path) or {}
        return state, state.get("global_step")
    checkpoint = load_weights_only(ckpt_path, mmap=True)
    return checkpoint.get("loopq") or {}, checkpoint.get("global_step")


def checkpoint_provenance(ckpt_path: str) -> dict[str, Any] | None:
    """The provenance block a calibration checkpoint recorded (:func:`checkpoint_record`)."""
    return checkpoint_record(ckpt_path)[0].get("provenance")


def check_resumable(config: Any) -> None:
    """Before the teacher loads: the checkpoint ``--ckpt_path`` names (``last``: the newest whole one in the run's
    default ``checkpoints/`` folder) loads weights-only and is not the end of a finished calibration."""
    ckpt_path = config.get("ckpt_path")
    root = Path(config.trainer.default_root_dir or os.getcwd())
    if ckpt_path == "last":
        found = newest_intact(checkpoints_in([root / "checkpoints"]), quiet=True)
        ckpt_path = None if found is None else str(found)
    if ckpt_path is None:
        return
    step = checkpoint_record(ckpt_path)[1]
    if isinstance(step, int) and step >= config.trainer.max_steps and not config.get("allow_config_change"):
        # another teacher or config is the more basic problem: say that first, as a resume that is not finished does
        teacher = teacher_fingerprint(resolve_model_dir(config.model.teacher))
        check_resume(ckpt_path, record(teacher, fit_settings(config)))
    check_not_finished(ckpt_path, config.trainer.max_steps, student_dir(config))


def check_not_finished(ckpt_path: str, max_steps: int, student: Path) -> None:
    """Resuming a checkpoint that already reached ``trainer.max_steps`` would train nothing and write its student
    again: say that the calibration is finished instead."""
    step = checkpoint_record(ckpt_path)[1]
    if isinstance(step, int) and step >= max_steps:
        where = f"its student is {student}" if (student / STUDENT_META).is_file() else "its student was not kept"
        raise CheckpointError(
            f"--ckpt_path {ckpt_path}: the calibration is finished (step {step} of --trainer.max_steps {max_steps}) "
            f"and {where}; nothing is left to resume - to calibrate again, start a fresh run (another "
            "--trainer.default_root_dir, or this one without --ckpt_path and with --force true)"
        )


def check_resume(ckpt_path: str, current: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint made from another teacher or config (see module docstring)."""
    recorded = checkpoint_provenance(ckpt_path)
    if recorded is None:
        raise ProvenanceError(
            f"{ckpt_path}: records no teacher/config (written by an older loopq.fit); resume it with "
            "--allow_config_change if you know it matches, or start fresh without --ckpt_path"
        )
    check_same(
        flat_record(recorded),
        flat_record(current),
        f"{ckpt_path} was calibrated",
        "resume with the same teacher and config, pass --allow_config_change to continue anyway, or start a "
        "fresh run (another --trainer.default_root_dir)",
    )


def resolve_ckpt_path(trainer: Any, ckpt_path: str | None) -> str | None:
    """``last`` -> the newest intact checkpoint (a file, or a DeepSpeed checkpoint directory) of the run's
    ModelCheckpoint folders, saying which newer ones it skipped and why (:func:`~loopq.calib.checkpoint_io.
    newest_intact`); None (a fresh start, with a warning) if there is none yet; other values as given."""
    if ckpt_path != "last":
        return ckpt_path
    folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    found = newest_intact(checkpoints_in(set(folders)))
    if found is None:
        rank_zero_warn("--ckpt_path last: no checkpoint yet under the run's checkpoint folder; starting fresh")
        return None
    return str(found)


def checkpoints_in(folders: Iterable[str | Path]) -> list[Path]:
    """Every ``*.ckpt`` file or DeepSpeed directory in ``folders`` (not the hidden temporaries of atomic saves)."""
    return [
        path
        for folder in folders
        if Path(folder).is_dir()
        for path in Path(folder).iterdir()
        if path.name.endswith(".ckpt") and not path.name.startswith(".")
    ]
