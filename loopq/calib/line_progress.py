"""A progress bar for logs: one plain line every ``every_percent`` of the training steps, no carriage returns.

Lightning's Rich and tqdm bars redraw one line in place; written to a file or a pipe they leave either nothing until
the end (Rich) or one endless line of ``\\r`` updates (tqdm). ``python -m loopq.run`` swaps the default bar for this
one when its output is not a terminal::

    calibrate: step 30/300 (10%)  loss 0.0412  0:00:21 elapsed, ~0:03:09 left
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar


class LineProgress(ProgressBar):
    def __init__(self, every_percent: int = 10, description: str = "calibrate") -> None:
        super().__init__()
        if not 1 <= every_percent <= 100:
            raise ValueError(f"LineProgress.every_percent must be in 1..100, got {every_percent}")
        self.every_percent, self.description = every_percent, description
        self.enabled = True
        self._start = 0.0
        self._first_step = 0

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._start, self._first_step = time.monotonic(), trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, total = trainer.global_step, trainer.max_steps
        if not self.enabled or total <= 0 or not trainer.is_global_zero:
            return
        every = max(1, math.ceil(total * self.every_percent / 100))
        if step % every and step != total:
            return
        print(self.line(step, total, trainer.progress_bar_metrics.get("loss")), flush=True)

    def line(self, step: int, total: int, loss: float | None) -> str:
        elapsed = time.monotonic() - self._start
        done = step - self._first_step
        left = elapsed / done * (total - step) if done > 0 else 0.0
        text = f"{self.description}: step {step}/{total} ({100 * step // total}%)"
        if loss is not None:
            text += f"  loss {float(loss):.4g}"
        return text + f"  {_clock(elapsed)} elapsed, ~{_clock(left)} left"


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))
