"""Progressive sharing-gap reselection (paper §4.2, SLT).

Installed by :meth:`loopq.calib.module.LoopQCalibration.configure_callbacks` whenever ``quant.slt_budget > 0``
(schedule: ``model.slt_start_step``, ``slt_every_n_steps``, ``slt_per_round``, ``slt_probe_batches``,
``slt_probe_groups``), or listed
explicitly in a config's ``trainer.callbacks`` to override that schedule.

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
optimizer mid-run: there, all rounds happen back to back before training (``upfront=True``, switched on
automatically under DeepSpeed).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn

from loopq.calib.slt import probe_scores


def round_due(step: int, selected: int, budget: int, start_step: int, every_n_steps: int) -> bool:
    """A scoring round runs at ``start_step``, ``start_step + every_n_steps``, ... while the budget is not spent."""
    if selected >= budget or step < start_step:
        return False
    return (step - start_step) % every_n_steps == 0


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
        probe_groups: int = 0,
    ) -> None:
        if every_n_steps < 1 or per_round < 1 or probe_batches < 1:
            raise ValueError("SharingGapReselection: every_n_steps, per_round and probe_batches must be >= 1")
        if probe_groups < 0:
            raise ValueError("SharingGapReselection: probe_groups must be >= 0 (0: every group in one pass)")
        #: groups probed per forward/backward pass (0: all at once); bounds the probe step's memory
        # (loopq.planning.memory)
        self.probe_groups = probe_groups
        self.budget, self.start_step, self.every_n_steps = budget, start_step, every_n_steps
        self.per_round, self.probe_batches, self.eps_rel, self.upfront = per_round, probe_batches, eps_rel, upfront
        self.selected: list[str] = []
        self.history: list[dict[str, Any]] = []
        self._late_params: list[torch.nn.Parameter] = []

    # ------------------------------------------------------------------ schedule
    def _budget(self, pl_module: Any) -> int:
        return pl_module.quant_config.slt_budget if self.budget is None else self.budget

    def due(self, step: int, pl_module: Any) -> bool:
        return round_due(step, len(self.selected), self._budget(pl_module), self.start_step, self.every_n_steps)

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        """Upfront mode: all rounds before the optimizer exists (DeepSpeed cannot add parameters later)."""
        if stage == "fit" and not self.upfront:
            self.upfront = _must_run_upfront(trainer)
        if not self.upfront or stage != "fit" or self.selected or trainer.ckpt_path:
            return  # resumed runs restore the selection from the checkpoint
        if hasattr(pl_module, "place"):
            pl_module.place()  # the module decides where it computes (LoopQCalibration.compute_device)
        else:
            pl_module.to(trainer.strategy.root_device)
        if hasattr(pl_module, "initialise_from_data"):
            pl_module.initialise_from_data()  # score with the diagonals and clipping training starts from
        loader = trainer.datamodule.train_dataloader()
        batches = [b for _, b in zip(range(self.probe_batches), loader, strict=False)]
        while len(self.selected) < self._budget(pl_module):
            if not self.run_round(trainer, pl_module, batches, step=0, upfront=True):
                break

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        # Groups selected so far (upfront rounds, or re-promoted from a checkpoint) were promoted before the
        # strategy wrapped the model, so DDP already averages their gradients: only later promotions need the
        # manual all-reduce of on_before_optimizer_step.
        self._late_params = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.upfront and self.due(trainer.global_step, pl_module):
            self.run_round(trainer, pl_module, [batch], trainer.global_step)

    # ------------------------------------------------------------------ one round
    def score(self, trainer: L.Trainer, pl_module: Any, batches: list[Any]) -> dict[str, float]:
        """S_l of every shared looped group with a transform (:func:`loopq.calib.slt.sharing_gap_scores`)."""
        reduce = None
        if trainer.world_size > 1:
            reduce = lambda flat: trainer.strategy.reduce(flat, reduce_op="mean")  # noqa: E731
        found = probe_scores(pl_module, batches, self.eps_rel, reduce, chunk=self.probe_groups)
        if found.fitted is not None:
            self.probe_groups = found.fitted  # what fit: later rounds start from it instead of running out again
        return found.scores

    def run_round(
        self, trainer: L.Trainer, pl_module: Any, batches: list[Any], step: int, upfront: bool = False
    ) -> list[str]:
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
        if not upfront:
            pl_module.log("slt/num_selected", float(len(self.selected)))
        else:  # upfront rounds run in setup, where LightningModule.log is not allowed
            for logger in trainer.loggers:
                logger.log_metrics({"slt/num_selected": float(len(self.selected))}, step=step)
        if trainer.is_global_zero:
            print(f"[loopq] step {step}: SLT promoted {chosen} (S = {[round(scores[c], 4) for c in chosen]})")
        return chosen

    # ------------------------------------------------------------------ DDP: promoted params are not in the reducer
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        """Average the gradients of parameters promoted after DDP wrapped the model (it does not know them).

        Runs after backward and before gradient clipping and the optimizer step (Lightning's order), on every
        rank. All late gradients travel in one flattened all-reduce; a parameter without a gradient on this rank
        contributes zeros, and every rank then holds the same averaged gradient (a parameter that has no
        gradient on any rank keeps ``grad = None`` so AdamW skips it, as in a single process).
        """
        if trainer.world_size <= 1 or self.upfront or not self._late_params:
            return
        params = self._late_params
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        has_grad = torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)
        flat = trainer.strategy.reduce(torch.cat([*grads, has_grad.to(grads[0].dtype)]), reduce_op="sum")
        total, seen = flat[: -len(params)], flat[-len(params) :]
        offset = 0
        for p, n in zip(params, seen.tolist(), strict=True):
            chunk = total[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if n > 0:
                p.grad = chunk.div(trainer.world_size).clone()

    def state_dict(self) -> dict[str, Any]:
        return {"selected": list(self.selected), "history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.selected = list(state_dict["selected"])
        self.history = list(state_dict["history"])


def _must_run_upfront(trainer: L.Trainer) -> bool:
    """Progressive promotion needs an optimizer that can grow and, under DDP, ``find_unused_parameters``.

    DeepSpeed cannot add parameters to its optimizer: switch to up-front rounds (with a warning) so that any config
    can be launched under DeepSpeed. Plain DDP would reject the promoted group's unused shared transform at the
    step after a promotion: refuse at setup with the fix instead.
    """
    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        rank_zero_warn(
            "SharingGapReselection: DeepSpeed cannot add parameters to its optimizer mid-run, so all SLT rounds "
            "run up front, before training (as with upfront: true)"
        )
        return True
    kwargs = getattr(strategy, "_ddp_kwargs", None)
    if trainer.world_size > 1 and kwargs is not None and not kwargs.get("find_unused_parameters", False):
        raise ValueError(
            "SharingGapReselection: a promoted group's shared transform stops receiving gradient, which plain "
            "DDP rejects; use --trainer.strategy ddp_find_unused_parameters_true (or upfront: true)"
        )
    return False
