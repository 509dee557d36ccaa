"""Token perplexity over non-overlapping windows: the standard PTQ WikiText-2 protocol (GPTQ, AWQ, QuaRot, ...).

The evaluation text is encoded once as a single token stream and cut into ``N = floor(len / seq_len)`` windows of
``seq_len`` tokens (the tail is dropped). Every window is scored on its own, with no context carried over:

    NLL_w = -sum_{i=1}^{seq_len-1} log p(x_i | x_<i)          ppl = exp( sum_w NLL_w / (N (seq_len - 1)) )

(GPTQ scales each window's mean loss by ``seq_len`` and divides by ``N seq_len``: the same number.) For WikiText-2
the stream is GPTQ's ``"\\n\\n".join(rows)`` over the rows of the Hugging Face ``wikitext-2-raw-v1`` test split,
which :func:`wikitext2_ptq_text` rebuilds from ``wiki.test.raw`` (one row per line; blank lines are empty rows).

Per-loop perplexity reads every loop state ``H_t`` out with the model's own head, ``Z_t = head(H_t)``, so the last
loop's value equals the plain one. A head may need the context its ``embed`` builds (Parcae's coda blocks read the
RoPE table and the value embeddings of the input ids; Ouro's and LoopFormer's heads ignore it):
:func:`readout_context` rebuilds it from the input (for Parcae this re-runs the prelude once per batch).

A non-finite loss (NaN weights, overflow) is an error naming its cause (:mod:`loopq.models.finite`), never a
``NaN`` perplexity.

This is a calibration-time check and the teacher record; the benchmark numbers come from lm-eval
(``loopq.metrics.lm``, whose ``loopq_wikitext`` task reports lm-eval's document-level word/byte perplexity instead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from loopq.data.text import lambada_test, wikitext2_test
from loopq.models.base import LoopLM, LoopLMError
from loopq.models.finite import nonfinite_error


@dataclass(frozen=True)
class PerplexityResult:
    """``ppl`` of the model's output logits; ``per_loop[t]`` reads out loop t's state (when requested)."""

    ppl: float
    per_loop: tuple[float, ...] | None
    num_windows: int
    num_tokens: int  # predicted tokens: num_windows * (seq_len - 1)


def readout_context(model: LoopLM, input_ids: Tensor, num_loops: int | None = None) -> dict[str, Any]:
    """The context ``model.head`` may read (built by the architecture's ``embed`` for these ids)."""
    return model.embed(input_ids, model.resolve_num_loops(num_loops))[1]


def readout(model: LoopLM, state: Tensor, ctx: dict[str, Any]) -> Tensor:
    """Logits of one loop state through the model's head (Ouro: ``lm_head``; LoopFormer: ``lm_head . norm_f``;
    Parcae: ``C``, coda blocks, ``ln_f``, ``lm_head``, logit scale/softcap)."""
    return model.head(state, ctx)


def token_windows(token_stream: Tensor | Sequence[int], seq_len: int) -> Tensor:
    """``[N, seq_len]`` non-overlapping windows of the stream; the incomplete tail is dropped."""
    tokens = torch.as_tensor(token_stream, dtype=torch.long, device="cpu").flatten()  # windows move per batch
    if seq_len < 2:
        raise LoopLMError(f"seq_len must be >= 2 (a window predicts seq_len - 1 tokens), got {seq_len}")
    n = tokens.numel() // seq_len
    if n == 0:
        raise LoopLMError(f"token stream of {tokens.numel()} tokens is shorter than one window (seq_len={seq_len})")
    return tokens[: n * seq_len].view(n, seq_len)


def window_nll(logits: Tensor, tokens: Tensor) -> float:
    """Summed next-token NLL of ``tokens`` ``[B, S]`` under ``logits`` ``[B, S, V]`` (position s predicts s + 1)."""
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum"))


@torch.inference_mode()
def perplexity(
    model: LoopLM,
    token_stream: Tensor | Sequence[int],
    seq_len: int,
    batch_size: int = 1,
    num_loops: int | None = None,
    per_loop: bool = False,
) -> PerplexityResult:
    """Perplexity over non-overlapping ``seq_len`` windows (see module docstring); ``per_loop`` adds each loop's."""
    if batch_size < 1:
        raise LoopLMError(f"batch_size must be >= 1, got {batch_size}")
    windows = token_windows(token_stream, seq_len)
    device = next(model.parameters()).device
    total = 0.0
    loops: list[float] = []
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        out = model(batch, num_loops=num_loops, return_trajectory=per_loop)
        total += window_nll(out.logits, batch)
        if per_loop:
            ctx = readout_context(model, batch, num_loops)
            nlls = [window_nll(readout(model, state, ctx), batch) for state in out.loop_states or []]
            loops = [a + b for a, b in zip(loops, nlls, strict=True)] if loops else nlls
    count = windows.shape[0] * (seq_len - 1)
    check_finite(model, total, loops)
    return PerplexityResult(
        ppl=math.exp(total / count),
        per_loop=tuple(math.exp(nll / count) for nll in loops) if per_loop else None,
        num_windows=windows.shape[0],
        num_tokens=count,
    )


def check_finite(model: LoopLM, total: float, loops: Sequence[float]) -> None:
    """The summed NLL (and each loop's) must be finite; otherwise the error names the cause."""
    if not math.isfinite(total):
        raise nonfinite_error(model, "the perplexity")
    bad = [t for t, nll in enumerate(loops) if not math.isfinite(nll)]
    if bad:
        raise nonfinite_error(model, f"the perplexity read out after loop {bad[0] + 1}")


def wikitext2_ptq_text(raw: str | None = None) -> str:
    """GPTQ's WikiText-2 test string ``"\\n\\n".join(rows)`` rebuilt from ``wiki.test.raw`` (default: shared data)."""
    raw = wikitext2_test() if raw is None else raw
    rows = [line if line.strip() else "" for line in raw.splitlines(keepends=True)]
    return "\n\n".join(rows)


def lambada_stream(tokenizer: Tokenizer) -> list[int]:
    """The LAMBADA test passages as one running text (``"\\n\\n"``-joined, no special tokens): a second corpus no
    calibration reads (novels, where WikiText-2 is encyclopedic), for perplexity under the same windows."""
    return tokenizer.encode("\n\n".join(lambada_test()), add_special_tokens=False).ids


def wikitext2_stream(tokenizer: Tokenizer) -> list[int]:
    """The WikiText-2 PTQ token stream for ``tokenizer`` (no special tokens added)."""
    return tokenizer.encode(wikitext2_ptq_text(), add_special_tokens=False).ids
