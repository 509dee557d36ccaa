"""The trajectory-aware calibration objective (paper Eq. 8, in the appendix form with adaptive mu_t).

    L = KL(Z || Z~) + lambda * ( sum_{t=0}^{T-1} [ (1 - mu_t) d(H~_{t,L}, H_{t,L}) + mu_t d(H~_{t,L}, H_T) ]
                                 + sum_{t=0}^{T-2} d(A_t(H~_{t,L}), H_{t+1,0}) )

with lambda = 0.1, KL at temperature 1 over the teacher's top-k (k = 1000) logits, and

    mu_t = ||H_T - H_{t,L}||^2 / ( ||H_T - H_{t,L}||^2 + sum_{t' >= t} ||H_{t',L} - H~_{t',L}||^2 + eps ).

Conventions (the paper leaves them open; stated here):
* H_{t,L} is the state handed from loop t to loop t+1 (``loop_states[t]``), so in the teacher H_{t+1,0} =
  H_{t,L} and the transition term compares the *adapted* student state with the same teacher state;
* d(a, b) is the squared error of the states, averaged over tokens (as the KL is). ``state_reduction`` says how the
  hidden dimension D is reduced (``model.state_reduction``):
  - ``mean`` (the default): averaged over the D features too (a per-element MSE), so the state terms do not scale
    with the hidden width;
  - ``sum``: summed over the D features - the squared L2 norm ||H~ - H||_2^2 per token as Eq. 8 writes it, which
    weighs the trajectory terms D times more than ``mean`` at the same lambda (128x on tiny-ouro, 2048x at
    Ouro's width). ``sum`` at lambda equals ``mean`` at lambda * D;
* the top-k KL renormalises the teacher over its top-k tokens and scores the student's full-vocabulary
  log-probabilities on them: sum_k p_k (log p_k - log q_k) >= 0.

FlatQuant's layer-wise objective (:func:`layerwise_loss`, Sun et al., 2025) is the baselines' alternative: every
decoder layer's quantized output against the FP layer output, both given the FP layer input,

    L = sum_calls d(f~_l(H_{t,l-1}; t), H_{t,l}),

where a shared layer is one call per loop (t = 0..T-1) and layers outside the loop are one call each. Because the
inputs are the teacher's, the sum decouples over layers: optimising it jointly is FlatQuant's layer-by-layer
recipe (up to the shared learning-rate schedule and gradient-norm clipping), and a shared layer sees all its loops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from loopq.qspec import at_least_fp32


def teacher_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k teacher logits (values, int64 indices) per token; k is capped at the vocabulary size."""
    values, indices = at_least_fp32(logits).topk(min(k, logits.shape[-1]), dim=-1)
    return values, indices


def topk_kl(
    teacher_values: Tensor, teacher_indices: Tensor, student_logits: Tensor, temperature: float = 1.0
) -> Tensor:
    """KL(teacher || student) over the teacher's top-k tokens, averaged over tokens (scaled by T^2)."""
    p_log = F.log_softmax(at_least_fp32(teacher_values) / temperature, dim=-1)
    q_log = F.log_softmax(at_least_fp32(student_logits) / temperature, dim=-1).gather(-1, teacher_indices.long())
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return kl.mean() * temperature**2


#: how d(a, b) reduces the hidden dimension (module docstring); tokens are always averaged
STATE_REDUCTIONS = ("mean", "sum")


def state_distance(a: Tensor, b: Tensor, reduction: str = "mean") -> Tensor:
    """d(a, b) of Eq. 8: the squared error, averaged over tokens; over the last (hidden) dimension averaged
    (``mean``) or summed (``sum``: the squared L2 norm per token)."""
    err = (at_least_fp32(a) - at_least_fp32(b)).pow(2)
    if reduction == "sum":
        return err.sum(-1).mean()
    if reduction == "mean":
        return err.mean()
    raise ValueError(f"state reduction {reduction!r}: use one of {STATE_REDUCTIONS}")


def trajectory_terms(
    student: Sequence[Tensor], teacher: Sequence[Tensor], mu: Tensor, reduction: str = "mean"
) -> tuple[Tensor, Tensor]:
    """(loop-wise term sum_t (1-mu_t) d(H~_t, H_t), final-target term sum_t mu_t d(H~_t, H_T))."""
    final = teacher[-1]
    pairs = enumerate(zip(student, teacher, strict=True))
    loopwise = sum((1 - mu[t]) * state_distance(s, h, reduction) for t, (s, h) in pairs)
    to_final = sum(mu[t] * state_distance(s, final, reduction) for t, s in enumerate(student))
    return torch.as_tensor(loopwise), torch.as_tensor(to_final)


def transition_term(adapted: Sequence[Tensor], teacher: Sequence[Tensor], reduction: str = "mean") -> Tensor:
    """sum_{t <= T-2} d(A_t(H~_{t,L}), H_{t+1,0}) with H_{t+1,0} = teacher ``loop_states[t]``."""
    if not adapted:
        return torch.zeros(())
    return torch.as_tensor(sum(state_distance(a, teacher[t], reduction) for t, a in enumerate(adapted)))


def adaptive_mu(teacher: Sequence[Tensor], student: Sequence[Tensor], eps: float = 1e-6) -> Tensor:
    """mu_t of the appendix (per-sample squared norms summed over the batch), shape ``[T]``."""
    return mu_from_sums(mu_sums(teacher, student), eps)


def mu_sums(teacher: Sequence[Tensor], student: Sequence[Tensor]) -> Tensor:
    """``[2, T]``: sum over the batch of ||H_T - H_t||^2 (row 0) and ||H_t - H~_t||^2 (row 1).

    Sums, not ratios: under data parallelism each process's sums are added (all-reduce *sum*) before
    :func:`mu_from_sums`, so mu_t of a global batch does not depend on how it is split across processes.
    Accumulated in float64 so that the split (a different summation order) changes mu_t by ~1e-16, not ~1e-7.
    """
    final = teacher[-1].double()
    to_final = torch.stack([(final - h.double()).pow(2).sum() for h in teacher])
    mismatch = torch.stack([(h.double() - s.double()).pow(2).sum() for h, s in zip(teacher, student, strict=True)])
    return torch.stack([to_final, mismatch])


def mu_from_sums(sums: Tensor, eps: float = 1e-6) -> Tensor:
    """mu_t = to_final_t / (to_final_t + sum_{t' >= t} mismatch_t' + eps) from :func:`mu_sums`."""
    to_final, mismatch = sums[0], sums[1]
    tail = mismatch.flip(0).cumsum(0).flip(0)  # sum_{t' >= t}
    return to_final / (to_final + tail + eps)


def loopq_loss(
    student_logits: Tensor,
    student_states: Sequence[Tensor],
    adapted_states: Sequence[Tensor] | None,
    teacher_values: Tensor,
    teacher_indices: Tensor,
    teacher_states: Sequence[Tensor],
    mu: Tensor,
    lam: float = 0.1,
    temperature: float = 1.0,
    state_reduction: str = "mean",
) -> dict[str, Tensor]:
    """Every term of Eq. 8 and the total (``loss``); the terms are returned for logging."""
    kl = topk_kl(teacher_values, teacher_indices, student_logits, temperature)
    loopwise, to_final = trajectory_terms(student_states, teacher_states, mu.to(kl.device), state_reduction)
    transition = transition_term(adapted_states or [], teacher_states, state_reduction).to(kl.device)
    loss = kl + lam * (loopwise + to_final + transition)
    return {"loss": loss, "kl": kl, "loopwise": loopwise, "to_final": to_final, "transition": transition}


def layerwise_loss(
    student_outputs: Sequence[Tensor], teacher_outputs: Sequence[Tensor], loops: Sequence[int | None]
) -> dict[str, Tensor]:
    """FlatQuant's layer-wise MSE summed over layer calls (``loss``), and its part per loop for logging
    (``loop{t}``; ``outside`` for layers outside the loop)."""
    per_call = [state_distance(s, t) for s, t in zip(student_outputs, teacher_outputs, strict=True)]
    terms: dict[str, Tensor] = {"loss": torch.stack(per_call).sum()}
    for distance, t in zip(per_call, loops, strict=True):
        key = "outside" if t is None else f"loop{t}"
        terms[key] = terms[key] + distance.detach() if key in terms else distance.detach()
    return terms
