"""Test-only callbacks used through the CLI (``class_path: tests.helpers...``)."""

import os
import signal

import lightning as L


class KillAtStep(L.Callback):
    """SIGKILL the process right before optimizer step ``step`` starts: a real crash, no cleanup, no save."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
