"""Progressive sharing-gap reselection (paper §4.2, SLT).

At scheduled steps the callback *scores* every still-shared looped group: it attaches zero per-loop
perturbations Delta_t to each group's transform (:meth:`QuantLinearGroup.start_probe`), takes gradients of the
calibration loss w.r.t. them on ``probe_batches`` batches (``torch.autograd.grad``: parameter gradients and the
optimizer are untouched), averages them across processes, computes S_l (:mod:`loopq.quant.sharing_gap`) and
*promotes* the top ``per_round`` groups to loop-dependent transforms. Calibration then adapts them before the
next scoring round, so later selections target the residual mismatch - "alternating adaptation and re-scoring".
Rounds repeat every ``every_n_steps`` from ``start_step`` until the budget (``quant.slt_budget``) is spent.

Stateful: selections and score history are saved; the module re-promotes the groups on resume before loading
parameters. Under DDP the new parameters are not known to the DDP reducer, so their gradients are averaged here
(``on_before_optimizer_step``) and the strategy must allow unused parameters (the promoted group's shared
transform stops receiving gradient): use ``ddp_find_unused_parameters_true``. DeepSpeed cannot grow its
optimizer mid-run: there, all rounds happen back to back before training (``upfront=True``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor

from loopq.quant import looped_quant_groups
from loopq.quant.sharing_gap import SharingGapAccumulator


class SharingGapReselection(L.Callback):
    def __init__(
        self,
        budget: int | None = None,
        start_step: int = 0,
        every_n_steps: int = 50,
        per_round: int = 1,
        probe_batches: int = 2,
        eps_rel: float = 1e-3,
        upfront: bool = False,
    ) -> None:
        if every_n_steps < 1 or per_round < 1 or probe_batches < 1:
            raise ValueError("SharingGapReselection: every_n_steps, per_round and probe_batches must be >= 1")
        self.budget, self.start_step, self.every_n_steps = budget, start_step, every_n_steps
        self.per_round, self.probe_batches, self.eps_rel, self.upfront = per_round, probe_batches, eps_rel, upfront
        self.selected: list[str] = []
        self.history: list[dict[str, Any]] = []
        self._late_params: list[torch.nn.Parameter] = []

    # ------------------------------------------------------------------ schedule
    def _budget(self, pl_module: Any) -> int:
        return pl_module.quant_config.slt_budget if self.budget is None else self.budget

    def due(self, step: int, pl_module: Any) -> bool:
        if len(self.selected) >= self._budget(pl_module) or step < self.start_step:
            return False
        return (step - self.start_step) % self.every_n_steps == 0

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        """Upfront mode: all rounds before the optimizer exists (DeepSpeed cannot add parameters later)."""
        if not self.upfront or stage != "fit" or self.selected or trainer.ckpt_path:
            return  # resumed runs restore the selection from the checkpoint
        pl_module.to(trainer.strategy.root_device)
        loader = trainer.datamodule.train_dataloader()
        batches = [b for _, b in zip(range(self.probe_batches), loader, strict=False)]
        while len(self.selected) < self._budget(pl_module):
            if not self.run_round(trainer, pl_module, batches, step=0):
                break

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._late_params = [p for n in self.selected for p in pl_module.student_group(n).promotion_parameters()]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.upfront and self.due(trainer.global_step, pl_module):
            self.run_round(trainer, pl_module, [batch], trainer.global_step)

    # ------------------------------------------------------------------ one round
    def score(self, trainer: L.Trainer, pl_module: Any, batches: list[Any]) -> dict[str, float]:
        """S_l of every shared looped group with a transform, from per-loop gradients on ``batches``."""
        groups = {n: g for n, g in looped_quant_groups(pl_module.student).items() if not g.promoted}
        for g in groups.values():
            g.start_probe()
        probed = {n: g for n, g in groups.items() if g.probe is not None}
        acc = {n: SharingGapAccumulator() for n in probed}
        try:
            for batch in batches:
                batch = [t.to(pl_module.device) for t in batch]
                with torch.enable_grad():
                    loss = pl_module.compute_loss(batch)["loss"]
                    deltas = [d for g in probed.values() for d in g.probe]
                    grads = torch.autograd.grad(loss, deltas, allow_unused=True)
                for i, (name, g) in enumerate(probed.items()):
                    phi = _per_loop(grads[2 * i], grads[2 * i + 1], g.slots)
                    acc[name].add(trainer.strategy.reduce(phi, reduce_op="mean"))
        finally:
            for g in groups.values():
                g.stop_probe()
        psi_scale = {n: float(a.psi.mean()) / a.count for n, a in acc.items()}
        return {n: a.score(eps=self.eps_rel * psi_scale[n] + 1e-30) for n, a in acc.items()}

    def run_round(self, trainer: L.Trainer, pl_module: Any, batches: list[Any], step: int) -> list[str]:
        scores = self.score(trainer, pl_module, batches)
        if not scores:
            return []
        ranked = sorted(scores, key=scores.get, reverse=True)
        room = self._budget(pl_module) - len(self.selected)
        chosen = ranked[: min(self.per_round, room)]
        for name in chosen:
            self._late_params.extend(pl_module.promote(name))
            self.selected.append(name)
        self.history.append({"step": step, "selected": chosen, "scores": scores})
        pl_module.log("slt/num_selected", float(len(self.selected)))
        if trainer.is_global_zero:
            print(f"[loopq] step {step}: SLT promoted {chosen} (S = {[round(scores[c], 4) for c in chosen]})")
        return chosen

    # ------------------------------------------------------------------ DDP: promoted params are not in the reducer
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.world_size > 1 and not self.upfront:
            for p in self._late_params:
                if p.grad is not None:
                    p.grad.copy_(trainer.strategy.reduce(p.grad, reduce_op="mean"))

    def state_dict(self) -> dict[str, Any]:
        return {"selected": list(self.selected), "history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.selected = list(state_dict["selected"])
        self.history = list(state_dict["history"])


def _per_loop(g1: Tensor | None, g2: Tensor | None, slots: int) -> Tensor:
    parts = [g.reshape(slots, -1) for g in (g1, g2) if g is not None]
    return torch.cat(parts, dim=1).detach() if parts else torch.zeros(slots, 1)
