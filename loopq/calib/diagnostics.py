"""Per-loop diagnostics: relative l2 error of every shared layer's output at every loop (paper Figure 2).

On the datamodule's fixed held-out batch, every ``every_n_steps`` steps (and at the end):

    err[t][l] = ||H~_{t,l} - H_{t,l}||_F / ||H_{t,l}||_F

where H_{t,l} is the teacher's output of shared layer l in loop t and H~ the student's (running its own
recurrence). Logged as ``diag/err_t{t}_l{l}`` and appended to ``<log_dir>/loop_errors.jsonl`` for the report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch


@torch.no_grad()
def layer_loop_errors(teacher: Any, student: Any, ids: torch.Tensor, num_loops: int) -> list[list[float]]:
    """``err[t][l]`` as in the module docstring."""
    ref = teacher(ids, num_loops=num_loops, return_layer_states=True).layer_states
    got = student(ids, num_loops=num_loops, return_layer_states=True).layer_states
    return [
        [float((g - r).float().norm() / r.float().norm().clamp_min(1e-12)) for g, r in zip(gl, rl, strict=True)]
        for gl, rl in zip(got, ref, strict=True)
    ]


class PerLoopDiagnostics(L.Callback):
    def __init__(self, every_n_steps: int = 100, filename: str = "loop_errors.jsonl") -> None:
        if every_n_steps < 1:
            raise ValueError(f"PerLoopDiagnostics.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps, self.filename = every_n_steps, filename
        #: the step last measured: the end of training measures once more only if the last step was not measured
        #: (a run ending on a scheduled step wrote it twice, duplicating the report's last point)
        self._measured_step: int | None = None

    def _run(self, trainer: L.Trainer, pl_module: Any) -> None:
        holdout = getattr(trainer.datamodule, "holdout", None)
        if holdout is None or len(holdout) == 0 or trainer.global_step == self._measured_step:
            return
        self._measured_step = trainer.global_step
        # Every rank runs this: trainer.log_dir broadcasts from rank 0 under DDP, and under DeepSpeed ZeRO-3 the
        # forward passes gather partitioned parameters - collectives that rank 0 alone would wait on forever.
        log_dir = trainer.log_dir or trainer.default_root_dir
        was_training = pl_module.student.training
        pl_module.student.eval()
        errors = layer_loop_errors(
            pl_module.teacher, pl_module.student, holdout.to(pl_module.compute_device), pl_module.num_loops
        )
        pl_module.student.train(was_training)
        if not trainer.is_global_zero:
            return  # the held-out batch is the same on every rank: rank 0 writes
        metrics = {f"diag/err_t{t}_l{layer}": v for t, row in enumerate(errors) for layer, v in enumerate(row)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        path = Path(log_dir) / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "errors": errors}) + "\n")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.global_step - 1) % self.every_n_steps == 0:
            self._run(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._run(trainer, pl_module)
