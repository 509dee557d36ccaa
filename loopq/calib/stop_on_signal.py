"""Stop a training run (calibration, pretraining) cleanly on SIGTERM or SIGINT: finish the current step, save
``last.ckpt``, exit with one line.

What Lightning 2.6 already does, and this callback uses: in every run (not only under SLURM) its signal connector
installs a SIGTERM handler right before training that sets ``trainer.received_sigterm``; the training loop then
finishes the step in progress (its ``on_train_batch_end`` hooks included), broadcasts the stop to every rank and
raises ``SIGTERMException`` - but saves nothing (only SLURM's requeue signal does) and exits with status 0. SIGINT
raises ``KeyboardInterrupt`` wherever the step happens to be, and nothing is saved either.

What it adds: SIGINT takes the same route as SIGTERM (Lightning's handler), the signal is acknowledged at once on
stderr, naming the signal that came (Lightning's own "Received SIGTERM: 15", logged for Ctrl-C too, is dropped:
:class:`QuietSigtermNotice`),
``SIGTERMException`` saves ``last.ckpt`` in the run's checkpoint folder (atomically, through the trainer's
checkpoint IO; a collective save under DeepSpeed, so every rank takes part), and :func:`exit_status` gives
``loopq.fit`` / ``loopq.pretrain`` the shell's 128 + signal number to exit with (:func:`install` adds the callback
to a trainer that has none). A second signal stops at once without saving (the
previous checkpoint stays). Before training starts (teacher targets, setup) SIGTERM keeps its default - the process
ends at once - since there is nothing to save yet.

With ``trainer.accumulate_grad_batches > 1`` (pretraining) the step that finishes is the whole accumulation window:
the signal is handed to Lightning only after a micro-batch that took an optimizer step, so ``last.ckpt`` is saved at
a step boundary. Lightning alone stopped after the micro-batch in flight: the gradients accumulated so far were in
no checkpoint, and the resumed run, counting that micro-batch as done, stepped one micro-batch early - every later
step's batches shifted by one against an uninterrupted run.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: the logger of Lightning's signal connector, which logs "Received SIGTERM: <n>" for any signal routed to it
LIGHTNING_SIGNAL_LOGGER = "lightning.pytorch.trainer.connectors.signal_connector"


class QuietSigtermNotice(logging.Filter):
    """Drops Lightning's "Received SIGTERM" record: :class:`StopOnSignal` has said which signal came and what
    happens next (a Ctrl-C would otherwise also be reported as "SIGTERM: 15")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Received SIGTERM" not in record.getMessage()  # also as "[rank: 0] Received SIGTERM: 15"


class StopOnSignal(L.Callback):
    """See the module docstring; ``loopq.fit`` adds one to every calibration."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the signal that asked to stop, on the rank that received it
        self.saved: Path | None = None
        self.batch_step = 0  # the optimizer step the training batch in flight started at
        #: Lightning's handler, held back until the accumulation window's optimizer step is taken (module doc)
        self.held: Callable[[int, FrameType | None], Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.held = None
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        lightning_sigterm = signal.getsignal(signal.SIGTERM)  # installed by Lightning just before training

        def handle(signum: int, frame: FrameType | None) -> None:
            if self.signum is not None:
                raise KeyboardInterrupt  # a second signal: Lightning's interrupt path, nothing saved
            self.signum = signum
            if trainer.is_global_zero:  # os.write: print() may be interrupted mid-write to the same stream
                os.write(
                    sys.stderr.fileno(),
                    f"[loopq] {signal.Signals(signum).name} received: finishing step {trainer.global_step + 1}, then "
                    "saving a checkpoint and stopping (send it again to stop at once, without saving)\n".encode(),
                )
            if not callable(lightning_sigterm):
                return
            if trainer.accumulate_grad_batches > 1:  # on_train_batch_end hands it on once a window's step is taken
                self.held = lightning_sigterm
            else:
                lightning_sigterm(signal.SIGTERM, frame)

        for signum in SIGNALS:
            signal.signal(signum, handle)  # Lightning's teardown restores the handlers it found before training

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batch_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Hand a held-back signal to Lightning once this batch took an optimizer step (the window's last
        micro-batch, or an epoch's last batch however few it accumulated): it stops after this batch. Any time
        else with ``accumulate_grad_batches > 1`` - between windows too, since Lightning checks for a signal only
        after the next micro-batch has run - the signal waits for the end of the window in flight or the next."""
        if self.held is None or trainer.global_step == self.batch_step:
            return
        held, self.held = self.held, None
        held(signal.SIGTERM, None)

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return  # a failure (e.g. a non-finite loss) must not overwrite the last good checkpoint
        path = self.saved = save_last(trainer)
        name = signal.Signals(self.signum or signal.SIGTERM).name
        say(trainer, f"stopped by {name} after step {trainer.global_step}: saved {path}; resume with --ckpt_path last")


def save_last(trainer: L.Trainer) -> Path:
    """Save ``last.ckpt`` in :func:`checkpoint_dir` (what ``--ckpt_path last`` resumes from); returns its path."""
    path = checkpoint_dir(trainer) / "last.ckpt"
    for callback in trainer.checkpoint_callbacks:  # the file is that callback's "last" (in the saved state too):
        # a resumed run overwrites it; before, a stop ahead of the first periodic save left the callback's
        # last_model_path empty, and the resumed run wrote last-v1.ckpt beside a stale last.ckpt
        ours = isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath
        if ours and Path(callback.dirpath).resolve() == path.parent.resolve():
            callback.last_model_path = str(path)
    trainer.save_checkpoint(path, weights_only=False)
    return path


def checkpoint_dir(trainer: L.Trainer) -> Path:
    """The first ModelCheckpoint's folder (where ``--ckpt_path last`` looks), else ``<root>/checkpoints``."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return Path(callback.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def install(trainer: L.Trainer) -> None:
    """Add a :class:`StopOnSignal` to ``trainer`` unless its callbacks already hold one."""
    if not any(isinstance(cb, StopOnSignal) for cb in trainer.callbacks):
        trainer.callbacks.append(StopOnSignal())
    logger = logging.getLogger(LIGHTNING_SIGNAL_LOGGER)
    if not any(isinstance(f, QuietSigtermNotice) for f in logger.filters):
        logger.addFilter(QuietSigtermNotice())


def exit_status(trainer: L.Trainer) -> int:
    """The shell's status for a run stopped by a signal: 128 + its number (143 for SIGTERM, 130 for SIGINT)."""
    received = [cb.signum for cb in trainer.callbacks if isinstance(cb, StopOnSignal) and cb.signum]
    return 128 + (received[0] if received else signal.SIGTERM)


def say(trainer: L.Trainer, text: str) -> None:
    if trainer.is_global_zero:
        print(f"[loopq] {text}", file=sys.stderr, flush=True)
