"""Adaptive mu_t (paper appendix): how much each loop's state is pulled toward the final teacher state.

Listed in a config's ``trainer.callbacks`` (its ``init_args`` are the schedule), or installed with its defaults by
:meth:`loopq.calib.module.LoopQCalibration.configure_callbacks` when the list has none (unless ``model.adaptive_mu``
is off; listed, it then does nothing).

Every ``every_n_steps`` optimizer steps (default 100, as in the paper) mu_t is recomputed from the current
global batch's teacher and student trajectories (the squared norms are summed over every process's samples
before the ratio, so mu_t does not depend on the number of processes) and written to the module's ``mu`` buffer.
Stateful: resume restores the last mu_t.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from loopq.calib.losses import mu_from_sums, mu_sums


def mu_update_due(step: int, every_n_steps: int) -> bool:
    """mu_t is recomputed after steps 0, every_n, 2 every_n, ... (the first step already gives a trajectory)."""
    return step >= 0 and step % every_n_steps == 0


def adaptive(pl_module: Any) -> bool:
    """Whether the module's settings ask for mu_t updates: ``model.adaptive_mu`` on, the trajectory objective (a
    config that lists this callback and sets ``adaptive_mu: false`` keeps mu = 0, as documented)."""
    hp = pl_module.hparams
    return bool(hp.get("adaptive_mu", True)) and hp.get("objective", "trajectory") == "trajectory"


class AdaptiveMu(L.Callback):
    def __init__(self, every_n_steps: int = 100, eps: float = 1e-6) -> None:
        if every_n_steps < 1:
            raise ValueError(f"AdaptiveMu.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps, self.eps = every_n_steps, eps
        self.mu: list[float] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step - 1  # the step that just finished
        last = pl_module.last_trajectory
        if not mu_update_due(step, self.every_n_steps) or last is None or not adaptive(pl_module):
            return
        sums = mu_sums(last.teacher_states, last.student_states).to(pl_module.compute_device)
        sums = trainer.strategy.reduce(sums, reduce_op="sum")  # sums, then the ratio: world-size invariant
        mu = mu_from_sums(sums, self.eps)
        pl_module.mu.copy_(mu)
        self.mu = pl_module.mu.tolist()  # exactly what the buffer holds (resume restores it bit for bit)
        pl_module.log_dict({f"mu/t{t}": v for t, v in enumerate(self.mu)})

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.mu is not None:
            pl_module.mu.copy_(torch.tensor(self.mu, device=pl_module.mu.device))

    def state_dict(self) -> dict[str, Any]:
        return {"mu": self.mu}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mu = state_dict.get("mu")
