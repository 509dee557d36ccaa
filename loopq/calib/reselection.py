"""Progressive sharing-gap reselection (paper §4.2, SLT), from the training steps' own gradients.

Listed in a config's ``trainer.callbacks`` (its ``init_args`` are the schedule), or installed with its defaults by
:meth:`loopq.calib.module.LoopQCalibration.configure_callbacks` whenever ``quant.slt_budget > 0`` and the list has
none.

Rounds are due at ``start_step``, ``start_step + every_n_steps``, ... until the budget (``quant.slt_budget``) is spent.
For the ``probe_batches`` training steps that end at a round (at most ``every_n_steps``), every still-shared looped
group records its per-loop gradients phi_{t,l} in the step's own backward pass (:mod:`loopq.calib.slt`; nothing
weight-sized, no extra pass); after the backward they are averaged across processes and accumulated. After the
round step's optimizer step the callback computes S_l (:mod:`loopq.quant.sharing_gap`) and *promotes* the top
``per_round`` groups: :meth:`QuantLinearGroup.promote` copies the shared values into the group's per-loop slots,
which exist from the start (:mod:`loopq.quant.modules`). Calibration then adapts them before the next round, so
later selections target the residual mismatch - "alternating adaptation and re-scoring".

Nothing here touches the optimizer, the LR schedule or a strategy's internals: the parameter set never changes, so
the schedule runs the same under one process, DDP and DeepSpeed ZeRO-2/3. Under DDP the per-loop slots of unpromoted
groups (and a promoted group's shared parameters) receive no gradient, so the strategy must allow unused parameters
(``ddp_find_unused_parameters_true``; refused at the start of fit otherwise). The selection, the score history and
the gradients accumulated for an unfinished round are the callback's checkpoint state; the promotion itself is in
the student's state (buffers), so a resume is a plain ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from loopq.calib.deepspeed import gathered
from loopq.calib.slt import gap_scores, loop_gradients, reduce_phis, scored_groups, shared_inverses
from loopq.errors import UsageError
from loopq.quant import quant_groups
from loopq.quant.modules import LoopRecorder, QuantLinearGroup
from loopq.quant.sharing_gap import SharingGapAccumulator


def round_due(step: int, selected: int, budget: int, start_step: int, every_n_steps: int) -> bool:
    """A scoring round runs at ``start_step``, ``start_step + every_n_steps``, ... while the budget is not spent."""
    if selected >= budget or step < start_step:
        return False
    return (step - start_step) % every_n_steps == 0


def recording_due(step: int, selected: int, budget: int, start_step: int, every_n_steps: int, window: int) -> bool:
    """Whether ``step`` is one of the ``window`` steps that end at a due round (its gradients are scored)."""
    nxt = start_step if step < start_step else step + (start_step - step) % every_n_steps
    return nxt - step < min(window, every_n_steps) and round_due(nxt, selected, budget, start_step, every_n_steps)


class SharingGapReselection(L.Callback):
    def __init__(
        self,
        budget: int | None = None,
        start_step: int = 0,
        every_n_steps: int = 50,
        per_round: int = 1,
        probe_batches: int = 2,
        eps_rel: float = 1e-3,
    ) -> None:
        if every_n_steps < 1 or per_round < 1 or probe_batches < 1:
            raise ValueError("SharingGapReselection: every_n_steps, per_round and probe_batches must be >= 1")
        self.budget, self.start_step, self.every_n_steps = budget, start_step, every_n_steps
        self.per_round, self.probe_batches, self.eps_rel = per_round, probe_batches, eps_rel
        self.selected: list[str] = []
        self.history: list[dict[str, Any]] = []
        self.acc: dict[str, SharingGapAccumulator] = {}
        #: the groups recording this step's per-loop gradients, with the shared (P1^-1, P2^-1) of the step
        self._recording: dict[str, tuple[QuantLinearGroup, tuple[Tensor, Tensor]]] = {}

    # ------------------------------------------------------------------ schedule
    def _budget(self, pl_module: Any) -> int:
        return pl_module.quant_config.slt_budget if self.budget is None else self.budget

    def due(self, step: int, pl_module: Any) -> bool:
        return round_due(step, len(self.selected), self._budget(pl_module), self.start_step, self.every_n_steps)

    def records(self, step: int, pl_module: Any) -> bool:
        return recording_due(step, len(self.selected), self._budget(pl_module), self.start_step,
                             self.every_n_steps, self.probe_batches)  # fmt: skip

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        """Plain DDP rejects parameters without gradient, which the fixed SLT layout has: refuse with the fix (not
        without an SLT budget: no per-loop slot exists then)."""
        if pl_module.quant_config.slt_budget == 0:
            return
        wrapped = getattr(trainer.strategy, "model", None)
        if isinstance(wrapped, DistributedDataParallel) and not wrapped.find_unused_parameters:
            raise UsageError(
                "SharingGapReselection: the per-loop SLT slots of unpromoted groups receive no gradient, which plain "
                "DDP rejects; use --trainer.strategy ddp_find_unused_parameters_true (or quant.slt_budget 0)"
            )

    # ------------------------------------------------------------------ the steps
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._recording or not self.records(trainer.global_step, pl_module):
            return  # recording already (the next micro-batch of an accumulated step), or not a scored step
        groups = scored_groups(pl_module.student)
        with gathered(trainer.strategy, [p for g in groups.values() for p in g.transform.parameters()]):
            self._recording = {n: (g, shared_inverses(g)) for n, g in groups.items()}
        for group in groups.values():
            group.recorder = LoopRecorder(group.slots)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        """After the step's backward: its per-loop gradients, averaged across processes, join the round's."""
        if not self._recording:
            return
        phis = {n: loop_gradients(g.recorder, inv) for n, (g, inv) in self._recording.items() if g.recorder is not None}
        reduce = None
        if trainer.world_size > 1:
            reduce = lambda flat: trainer.strategy.reduce(flat, reduce_op="mean")  # noqa: E731
        for name, phi in reduce_phis(phis, reduce).items():
            self.acc.setdefault(name, SharingGapAccumulator()).add(phi)
        self._stop_recording()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._stop_recording()
        step = trainer.global_step - 1  # the step that just ran (global_step counts optimizer steps done)
        if self.due(step, pl_module) and self.acc:
            self.run_round(trainer, pl_module, step)

    def _stop_recording(self) -> None:
        for group, _ in self._recording.values():
            group.recorder = None
        self._recording = {}

    # ------------------------------------------------------------------ one round
    def run_round(self, trainer: L.Trainer, pl_module: Any, step: int) -> list[str]:
        scores = gap_scores(self.acc, self.eps_rel)
        self.acc = {}
        if not scores:
            return []
        ranked = sorted(scores, key=scores.get, reverse=True)
        room = self._budget(pl_module) - len(self.selected)
        chosen = ranked[: min(self.per_round, room)]
        groups = quant_groups(pl_module.student)
        shared = [p for name in chosen for p in groups[name].shared_parameters()]
        with gathered(trainer.strategy, shared):  # ZeRO-3: read the full shared values into the anchors
            for name in chosen:
                groups[name].promote()
        self.selected.extend(chosen)
        self.history.append({"step": step, "selected": chosen, "scores": scores})
        pl_module.log("slt/num_selected", float(len(self.selected)))
        if trainer.is_global_zero:
            print(f"[loopq] step {step}: SLT promoted {chosen} (S = {[round(scores[c], 4) for c in chosen]})")
        return chosen

    def state_dict(self) -> dict[str, Any]:
        pending = {n: {"phi": a.phi, "psi": a.psi, "count": a.count} for n, a in self.acc.items()}
        return {"selected": list(self.selected), "history": self.history, "pending": pending}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.selected = list(state_dict["selected"])
        self.history = list(state_dict["history"])
        self.acc = {}
        for name, saved in state_dict.get("pending", {}).items():
            acc = SharingGapAccumulator()
            acc.phi, acc.psi, acc.count = saved["phi"], saved["psi"], saved["count"]
            self.acc[name] = acc
