"""Held-out validation of a calibration: does the student generalise beyond its calibration text?

A calibration trains many more parameters than a training-free method on a few hundred windows of text, so it can
fit that text rather than the model. Every validation pass measures, on each held-out set (``heldout``: windows of
the calibration sources that overlap no training or diagnostic window; ``extra``: windows of ``data.val_sources``,
e.g. WikiText-2 *valid*):

* the calibration loss and its terms (Eq. 8: ``loss``, ``kl``, ``loopwise``, ``to_final``, ``transition``) against
  the teacher's live top-k logits and loop states with the current mu_t - the training objective on unseen text;
* ``kl_full``: the student's KL to the teacher over the full vocabulary at the last loop (temperature 1), per token;
* ``ppl_loop{t}``: the student's perplexity when exiting after loop t (t = 1..T), next to the teacher's
  (``fp_ppl_loop{t}``): a gap to FP that grows with t is the compounding error the method targets.

Every value is a torchmetrics metric weighted by tokens (the loss terms are token means of each batch, weighted by
its token count; the perplexities sum next-token NLLs and count them), so accumulation and the cross-process
reduction are torchmetrics' (sums of float64 states), not an average of per-rank averages: DDP with uneven shards
gives the single-process numbers (``tests/calib/test_validation.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric

from loopq.calib.losses import loopq_loss, teacher_topk
from loopq.models import LoopLM
from loopq.qspec import at_least_fp32

#: the names of the held-out sets, in the order of ``val_dataloader``'s loaders
VAL_SETS = ("heldout", "extra")
LOSS_TERMS = ("loss", "kl", "loopwise", "to_final", "transition")


def full_kl_sum(teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
    """sum over positions of KL(p_teacher || q_student) over the whole vocabulary, temperature 1 (fp32 or wider)."""
    p_log = F.log_softmax(at_least_fp32(teacher_logits), dim=-1)
    q_log = F.log_softmax(at_least_fp32(student_logits), dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum()


def next_token_nll_sum(logits: Tensor, ids: Tensor) -> Tensor:
    """Summed next-token NLL of ``ids`` ``[B, S]`` under ``logits`` ``[B, S, V]`` (position s predicts s + 1)."""
    return F.cross_entropy(at_least_fp32(logits[:, :-1]).flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


class LoopPerplexity(Metric):
    """exp(summed NLL / predicted tokens) per loop exit; states are float64 sums, reduced by summing across ranks."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, num_loops: int) -> None:
        super().__init__()
        self.add_state("nll", torch.zeros(num_loops, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, nll_per_loop: Tensor, tokens: int) -> None:
        self.nll += nll_per_loop.to(self.nll)
        self.tokens += tokens

    def compute(self) -> Tensor:
        return torch.exp(self.nll / self.tokens)


def token_mean() -> MeanMetric:
    metric = MeanMetric()
    metric.set_dtype(torch.float64)
    return metric


class ValidationMetrics(nn.Module):
    """The metrics of one held-out set (module docstring); ``values()`` computes (synced) and names them."""

    def __init__(self, num_loops: int) -> None:
        super().__init__()
        self.terms = nn.ModuleDict({name: token_mean() for name in LOSS_TERMS})
        self.kl_full = token_mean()
        self.student_ppl = LoopPerplexity(num_loops)
        self.teacher_ppl = LoopPerplexity(num_loops)

    def update(
        self, terms: dict[str, Tensor], kl_sum: Tensor, student_nll: Tensor, teacher_nll: Tensor, ids: Tensor
    ) -> None:
        positions = ids.numel()  # the loss terms and the KL are means over every position
        for name, metric in self.terms.items():
            metric.update(terms[name].detach().double(), positions)
        self.kl_full.update(kl_sum.detach().double() / positions, positions)
        predicted = ids.shape[0] * (ids.shape[1] - 1)
        self.student_ppl.update(student_nll, predicted)
        self.teacher_ppl.update(teacher_nll, predicted)

    def values(self) -> dict[str, float]:
        out = {name: float(metric.compute()) for name, metric in self.terms.items()}
        out["kl_full"] = float(self.kl_full.compute())
        for t, (s, f) in enumerate(zip(self.student_ppl.compute(), self.teacher_ppl.compute(), strict=True), 1):
            out[f"ppl_loop{t}"], out[f"fp_ppl_loop{t}"] = float(s), float(f)
        return out

    def reset(self) -> None:
        for metric in (*self.terms.values(), self.kl_full, self.student_ppl, self.teacher_ppl):
            metric.reset()


def per_loop_nll(model: LoopLM, states: list[Tensor], ids: Tensor, num_loops: int) -> Tensor:
    """``[T]`` summed next-token NLL when exiting after each loop (the model's own head on each loop state)."""
    ctx = model.embed(ids, num_loops)[1]  # what the head reads (as loopq.metrics.perplexity.readout_context)
    return torch.stack([next_token_nll_sum(model.head(state, ctx), ids) for state in states])


@torch.no_grad()
def measure(
    teacher: LoopLM, student: LoopLM, ids: Tensor, mu: Tensor, hparams: dict, num_loops: int
) -> tuple[dict[str, Tensor], Tensor, Tensor, Tensor]:
    """One held-out batch: Eq. 8's terms against the live teacher, the full-vocabulary KL sum, and the student's and
    teacher's per-loop NLL sums (the arguments of :meth:`ValidationMetrics.update`, less ``ids``)."""
    fp = teacher(ids, num_loops=num_loops, return_trajectory=True)
    out = student(ids, num_loops=num_loops, return_trajectory=True)
    values, indices = teacher_topk(fp.logits, hparams["topk"])
    terms = loopq_loss(
        out.logits, out.loop_states, out.transition_states, values, indices, fp.loop_states, mu,
        hparams["lam"], hparams["temperature"], hparams["state_reduction"],
    )  # fmt: skip
    kl_sum = full_kl_sum(fp.logits, out.logits)
    return (
        terms,
        kl_sum,
        per_loop_nll(student, out.loop_states, ids, num_loops),
        per_loop_nll(teacher, fp.loop_states, ids, num_loops),
    )
