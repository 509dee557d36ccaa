"""Test-only callbacks for the signal tests (used through the CLI: ``class_path: tests.bad_inputs.signals...``)."""

import json
import os
import signal
import time
from pathlib import Path

import lightning as L


class WaitForSignalAtStep(L.Callback):
    """Right before optimizer step ``step`` starts: create ``marker`` (the test then sends a signal) and wait, at most
    ``timeout`` seconds, until Lightning has registered it - so the signal always lands in the middle of that step."""

    changes_student = False  # not in the recorded config: the resumed segment runs without it

    def __init__(self, step: int, marker: str, timeout: float = 60.0) -> None:
        self.step, self.marker, self.timeout = step, marker, timeout

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        Path(self.marker).touch()
        deadline = time.monotonic() + self.timeout
        while not trainer.received_sigterm and time.monotonic() < deadline:
            time.sleep(0.02)


class RecordStartStep(L.Callback):
    """Write the step training starts at (a resumed run's restored step) to ``marker``."""

    changes_student = False

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def on_train_start(self, trainer, pl_module) -> None:
        Path(self.marker).write_text(str(trainer.global_step))


class SignalAtBatch(L.Callback):
    """Send SIGTERM to this process at the start of its ``batch``-th training batch of this segment (0-based, counting
    micro-batches): with ``accumulate_grad_batches > 1`` the signal can land inside an accumulation window. In-process
    tests only: the run's stop-on-signal handler is installed by then (never the default, which would end pytest)."""

    changes_student = False

    def __init__(self, batch: int) -> None:
        self.batch, self.seen = batch, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen += 1
        if self.seen - 1 == self.batch and signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN):
            os.kill(os.getpid(), signal.SIGTERM)


class RecordBatches(L.Callback):
    """Append ``[optimizer step, token sum of the batch]`` of every training micro-batch to the JSON-lines file
    ``path``: which batches each optimizer step accumulated, over every segment of a resumed run."""

    changes_student = False

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps([trainer.global_step, int(batch[0].sum())]) + "\n")
