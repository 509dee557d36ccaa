"""Adaptive mu_t (paper appendix): how much each loop's state is pulled toward the final teacher state.

Every ``every_n_steps`` optimizer steps (default 100, as in the paper) mu_t is recomputed from the current
batch's teacher and student trajectories, averaged across processes, and written to the module's ``mu`` buffer.
Stateful: resume restores the last mu_t.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from loopq.calib.losses import adaptive_mu


class AdaptiveMu(L.Callback):
    def __init__(self, every_n_steps: int = 100, eps: float = 1e-6) -> None:
        if every_n_steps < 1:
            raise ValueError(f"AdaptiveMu.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps, self.eps = every_n_steps, eps
        self.mu: list[float] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step - 1  # the step that just finished
        if step % self.every_n_steps or not pl_module.last:
            return
        mu = adaptive_mu(pl_module.last["teacher_states"], pl_module.last["student_states"], self.eps)
        mu = trainer.strategy.reduce(mu.to(pl_module.device), reduce_op="mean")
        pl_module.mu.copy_(mu)
        self.mu = mu.tolist()
        pl_module.log_dict({f"mu/t{t}": v for t, v in enumerate(self.mu)})

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.mu is not None:
            pl_module.mu.copy_(torch.tensor(self.mu))

    def state_dict(self) -> dict[str, Any]:
        return {"mu": self.mu}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mu = state_dict.get("mu")
