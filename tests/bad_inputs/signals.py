"""Test-only callbacks for the signal tests (used through the CLI: ``class_path: tests.bad_inputs.signals...``)."""

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
