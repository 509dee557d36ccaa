"""A callback for end-to-end tests: fails the run if the optimizer or the LR scheduler is edited after
``configure_optimizers`` (parameter groups, their parameters, the scheduler's base LRs and lambdas), and writes what it
checked to ``<default_root_dir>/optimizer_guard.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L


def layout(trainer: L.Trainer) -> dict[str, Any]:
    """Everything about the optimizer and scheduler objects that only an edit (not a step) changes."""
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {
        "optimizer": id(opt),
        "groups": [(g.get("name"), [id(p) for p in g["params"]]) for g in opt.param_groups],
        "scheduler": id(sched),
        "base_lrs": list(sched.base_lrs),
        "lambdas": [id(f) for f in sched.lr_lambdas],
    }


class OptimizerGuard(L.Callback):
    def __init__(self) -> None:
        self.start: dict[str, Any] | None = None
        self.checks = 0
        self.promoted_during: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.start = layout(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = layout(trainer)
        if now != self.start:
            raise AssertionError(f"optimizer or scheduler edited at step {trainer.global_step}: {now} != {self.start}")
        self.checks += 1
        self.promoted_during.append(len(pl_module.promoted))

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        record = {"checks": self.checks, "promoted": self.promoted_during}
        (Path(trainer.default_root_dir) / "optimizer_guard.json").write_text(json.dumps(record))
