"""Early exit while decoding with the KV cache: a token stops looping at Ouro's threshold exit and skips the rest.

Ouro's gate gives each loop state ``H_t`` an exit logit g_t; with lambda_t = sigmoid(g_t) the probability of exiting
at loop t is p_t = lambda_t prod_{j<t} (1 - lambda_j) (the last loop takes the rest), and the threshold exit of
upstream's ``OuroForCausalLM`` (:func:`loopq.models.ouro.threshold_exit_steps`) is the first loop whose cumulative
probability sum_{j<=t} p_j reaches the threshold. That cumulative probability needs only the gates up to t, so a
decoded token can stop after its exit loop e and read its logits from ``lm_head(H_e)``: loops e+1 .. T-1 are never
computed for it.

The cache rule for the skipped loops: the token's slot in the (t, layer) entries for t > e holds a copy of its loop-e
keys/values (:meth:`loopq.models.kv_cache.LoopKVCache.fill_skipped`). A later token in loop t then attends to the
exited token's last computed representation of that layer - the state the exited token "stays at", as a loop that
would not change it (the fixed point the exit gate bets on) would give the same keys; this is free (a copy, no
projection of the exit state through the deeper loops' layers, which would cost the K/V matmuls of every skipped
loop and needs the deeper layers' inputs that were never computed).

Batches: every row selects its own exit loop, logits and cache copies, so a row decodes as it would alone; the
batch stops looping once *every* row has exited (rows that exited earlier keep running but their results are
discarded and their deeper slots overwritten with the copy). The prompt is prefilled by the ordinary full forward
(all loops for every prompt token, logits read out at the threshold exit), as upstream's threshold mode does; skipping
applies to the tokens decoded one at a time after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from loopq.errors import LoopLMError
from loopq.models.base import LoopLM
from loopq.models.kv_cache import LoopKVCache


@dataclass
class ExitStats:
    """Exit loops of the tokens decoded with early exit: ``exit_loops`` one ``[B]`` tensor per decoded step,
    ``loops_run`` the loops the batch actually ran at that step (the deepest row's exit + 1)."""

    exit_loops: list[Tensor] = field(default_factory=list)
    loops_run: list[int] = field(default_factory=list)

    def mean_loops(self) -> float:
        """Average loops used per decoded token (exit loop + 1), over rows and steps."""
        return float(torch.stack(self.exit_loops).float().mean()) + 1.0 if self.exit_loops else float("nan")


def check_exit_threshold(threshold: float | None) -> None:
    """One line for an ``--exit_threshold`` outside (0, 1]."""
    if threshold is not None and not 0 < threshold <= 1:
        raise LoopLMError(
            f"--exit_threshold must be in (0, 1] (1 = exit only where the gate saturates), got {threshold!r}"
        )


def check_exit_model(model: LoopLM) -> None:
    """Early exit needs an exit gate (Ouro's); one line otherwise."""
    if not hasattr(model, "exit_gate_logits"):
        raise LoopLMError(f"--exit_threshold: early exit needs an exit gate (Ouro); the {model.arch} model has none")


def exit_cdf(gate_logits: Tensor) -> Tensor:
    """Cumulative exit probability sum_{j<=t} p_j after the last of the gate logits ``[..., t+1]`` so far, computed as
    :func:`loopq.models.ouro.exit_distribution`'s pdf (the last loop's remainder rule does not apply before T-1)."""
    lam = torch.sigmoid(gate_logits)
    survive = torch.cumprod(1.0 - lam, dim=-1)
    before = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
    return torch.cumsum(lam * before, dim=-1)[..., -1]


def early_exit_forward(
    model: LoopLM, token: Tensor, cache: LoopKVCache, threshold: float, num_loops: int | None = None, **kwargs: Any
) -> tuple[Tensor, Tensor, int]:
    """One new token ``[B, 1]`` against ``cache``, looping until each row's threshold exit: its logits
    ``[B, 1, V]`` (from its exit loop's state), the exit loops ``[B]`` and the number of loops run."""
    num_loops = model.resolve_num_loops(num_loops, **kwargs)
    if token.dim() != 2 or token.shape[1] != 1:
        raise LoopLMError(f"early exit decodes one token per row, got input_ids of shape {tuple(token.shape)}")
    step = model.prepare_decode(token, cache, None)
    h, ctx = model.embed(token, num_loops, **kwargs, step=step)
    ctx["num_loops"] = num_loops
    batch = token.shape[0]
    exit_loops = torch.full((batch,), num_loops - 1, dtype=torch.long, device=token.device)
    exited = torch.zeros(batch, dtype=torch.bool, device=token.device)
    states: list[Tensor] = []
    gates: list[Tensor] = []
    for t in range(num_loops):
        h, _ = model.loop_body(h, t, ctx, False)
        states.append(h)
        gates.append(model.exit_gate_logits(h)[:, 0, 0])
        if t == num_loops - 1:
            break
        newly = (exit_cdf(torch.stack(gates, dim=-1)) >= threshold) & ~exited
        exit_loops, exited = torch.where(newly, t, exit_loops), exited | newly
        if bool(exited.all()):
            break
        if model.transition is not None:
            h = model.transition(h, t)
    chosen = torch.stack(states)[exit_loops, torch.arange(batch, device=token.device)]
    cache.fill_skipped(exit_loops, len(states), num_loops)
    cache.advance(step)
    return model.head(chosen, ctx), exit_loops, len(states)
