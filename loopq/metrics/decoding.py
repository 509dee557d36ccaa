"""Perplexity as generation sees it: teacher-forced, token by token through the KV cache.

:func:`loopq.metrics.perplexity.perplexity` scores a window with one full forward. Early exit and a quantized cache only
act when tokens are decoded one at a time against the cache, so :func:`decode_perplexity` feeds each window's tokens
one per forward (the first one included: every position decodes against what is cached before it) and scores the
logits of position i on token i + 1 - the same NLL sum over ``N (seq_len - 1)`` predictions as the full-forward
perplexity, which it equals (within float rounding) without early exit and with ``kv_bits`` None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from loopq.models.base import LoopLM
from loopq.models.early_exit import check_exit_model, check_exit_threshold, early_exit_forward
from loopq.models.kv_cache import LoopKVCache


@dataclass(frozen=True)
class DecodeResult:
    """``ppl`` over ``num_tokens`` predictions; ``exit_loops`` ``[N, seq_len]`` the exit loop of every position
    (the last loop everywhere without early exit); ``cache_bytes`` what the cache held at the end of a batch."""

    ppl: float
    num_tokens: int
    exit_loops: Tensor
    cache_bytes: int

    @property
    def mean_loops(self) -> float:
        """Average loops used per token (exit loop + 1)."""
        return float(self.exit_loops.float().mean()) + 1.0


@torch.inference_mode()
def decode_perplexity(
    model: LoopLM,
    windows: Tensor,
    exit_threshold: float | None = None,
    kv_bits: int | None = None,
    batch_size: int = 8,
    num_loops: int | None = None,
) -> DecodeResult:
    """Teacher-forced cached decoding of every window of ``windows`` ``[N, seq_len]`` (see the module docstring);
    ``batch_size`` windows decode together (each row exits on its own, so batching does not change the numbers)."""
    check_exit_threshold(exit_threshold)
    if exit_threshold is not None:
        check_exit_model(model)
    device = next(model.parameters()).device
    total, exits, cache_bytes = 0.0, [], 0
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        cache = LoopKVCache.for_model(model, batch.shape[0], kv_bits=kv_bits)
        logits, loops = [], []
        for i in range(batch.shape[1]):
            token = batch[:, i : i + 1]
            if exit_threshold is None:
                logits.append(model(token, cache=cache, num_loops=num_loops).logits)
                loops.append(torch.full_like(token[:, 0], model.resolve_num_loops(num_loops) - 1))
            else:
                out, exit_loops, _ = early_exit_forward(model, token, cache, exit_threshold, num_loops=num_loops)
                logits.append(out)
                loops.append(exit_loops)
        scores = torch.cat(logits, dim=1)[:, :-1].flatten(0, 1).float()
        total += float(F.cross_entropy(scores, batch[:, 1:].flatten(), reduction="sum"))
        exits.append(torch.stack(loops, dim=1).cpu())
        cache_bytes = max(cache_bytes, cache.num_bytes())
    count = windows.shape[0] * (windows.shape[1] - 1)
    return DecodeResult(math.exp(total / count), count, torch.cat(exits), cache_bytes)
