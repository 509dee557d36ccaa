"""Autoregressive decoding of any :class:`~loopq.models.base.LoopLM`: prefill once, then one token per step.

With ``use_cache`` (default) the prompt runs once through the full looped forward, filling a
:class:`~loopq.models.kv_cache.LoopKVCache` (one K/V entry per (loop, layer)), and every new token runs all T loops
on that token alone: a step costs T x L single-token layer calls plus attention over the cache, instead of the whole
looped forward over prompt + generated tokens (``use_cache=False``, kept for comparison: the same logits up to float
rounding, and so the same greedy tokens except where a quantized model's activation sits at a rounding tie, which a
1e-5 input difference can move to the next 4-bit code; docs/generation.md, Exactness).

The next token is the argmax of the last position's logits (``temperature=0``, default) or a draw from
``softmax(logits / temperature)`` restricted to the top-p nucleus. Prompts of different lengths are left padded and
marked by ``attention_mask`` (see :mod:`loopq.models.kv_cache`). Quantization is inside the model's linear groups,
so the FP teacher, a fake-quant student and an exported packed model decode through this same function.
Non-finite logits (NaN weights) are an error naming the cause (:mod:`loopq.models.finite`), not an argmax that
happens to be the end-of-text token; they are checked where the loop reads the device anyway (an ``on_token``
callback or an EOS to wait for), else once at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from loopq.errors import LoopLMError
from loopq.models.base import LoopLM
from loopq.models.early_exit import ExitStats, check_exit_model, check_exit_threshold, early_exit_forward
from loopq.models.finite import nonfinite_error
from loopq.models.kv_cache import LoopKVCache
from loopq.models.kv_quant import check_kv_bits
from loopq.models.static_decode import StaticDecoder, check_graph_model

#: called after every step with the new tokens ``[B]``; returning True stops the generation
OnToken = Callable[[Tensor], bool | None]


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """One line per bad decoding option, naming it (the CLI flag has the same name)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise LoopLMError(f"--max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise LoopLMError(f"--temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise LoopLMError(f"--top_p must be in (0, 1] (1 = no nucleus cut), got {top_p!r}")


def check_prompt(
    model: LoopLM, input_ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int, what: str = "--prompt"
) -> None:
    """Refuse an empty prompt, or one that with ``max_new_tokens`` more tokens exceeds the model's positions;
    ``what``: where the prompt came from, as the message names it (``--prompts_file FILE line N``)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise LoopLMError(f"--prompt is empty (input_ids of shape {tuple(input_ids.shape)}); give at least one token")
    lengths = (
        attention_mask.long().sum(dim=1)
        if attention_mask is not None
        else torch.full((1,), input_ids.shape[1], device=input_ids.device)
    )
    if int(lengths.min()) == 0:
        raise LoopLMError("--prompt is empty for a row of the batch (all padding); give at least one token per prompt")
    longest, limit = int(lengths.max()), model.max_positions
    if longest + max_new_tokens > limit:
        raise LoopLMError(
            f"{what} of {longest} tokens + --max_new_tokens {max_new_tokens} exceeds the model's context of {limit} "
            "positions (config.json); shorten the prompt or lower --max_new_tokens"
        )


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """``logits`` ``[B, V]`` with every token outside the smallest set of cumulative probability >= ``top_p`` at -inf
    (the most likely token always stays)."""
    if top_p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p  # the mass before this token already reaches top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def next_token(
    logits: Tensor, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """The next token ``[B]`` from last-position ``logits`` ``[B, V]``: argmax at temperature 0, else a draw."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = top_p_filter(logits.float() / temperature, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(
    model: LoopLM,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    num_loops: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    on_token: OnToken | None = None,
    exit_threshold: float | None = None,
    kv_bits: int | None = None,
    exit_stats: ExitStats | None = None,
    static_cache: bool = False,
    cuda_graphs: bool = False,
    **forward_kwargs: Any,
) -> Tensor:
    """The generated tokens ``[B, n]`` (n <= ``max_new_tokens``) after ``input_ids`` ``[B, S]`` (left padded where
    ``attention_mask`` has zeros). Stops early when every row has produced ``eos_token_id`` (rows that finished
    repeat it) or ``on_token`` returns True. ``forward_kwargs`` go to every forward (LoopFormer's ``steps``...).

    ``exit_threshold`` in (0, 1] (Ouro): each decoded token stops looping at its threshold exit
    (:mod:`loopq.models.early_exit`); its exit loops are appended to ``exit_stats`` when given. ``kv_bits`` 8 or 4
    stores the cache as codes and scales (:mod:`loopq.models.kv_quant`); both need the cache.

    ``static_cache``: decode on a preallocated cache with fixed-shape steps (:mod:`loopq.models.static_decode`);
    ``cuda_graphs`` (implies it): replay each decode step from one CUDA graph on a CUDA model (on a CPU model the
    same static step runs eagerly). Neither combines with early exit or ``kv_bits``."""
    check_sampling(max_new_tokens, temperature, top_p)
    check_decoding(model, use_cache, exit_threshold, kv_bits)
    check_static_options(model, use_cache, exit_threshold, kv_bits, static_cache, cuda_graphs)
    check_prompt(model, input_ids, attention_mask, max_new_tokens)
    kwargs = {"num_loops": num_loops, **forward_kwargs}
    if static_cache or cuda_graphs:
        step = _static_steps(model, input_ids, attention_mask, kwargs, max_new_tokens, cuda_graphs)
    elif use_cache:
        cache = LoopKVCache.for_model(model, input_ids.shape[0], kv_bits=kv_bits)
        step = _cached_steps(model, input_ids, attention_mask, kwargs, cache, exit_threshold, exit_stats)
    else:
        step = _rerun_steps(model, input_ids, attention_mask, kwargs)
    new: list[Tensor] = []
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    finite = torch.ones((), dtype=torch.bool, device=input_ids.device)
    reads_each_step = on_token is not None or eos_token_id is not None  # the device is read every step anyway
    logits = step(None)
    for _ in range(max_new_tokens):
        finite &= logits[:, -1].isfinite().all()
        if reads_each_step and not bool(finite):  # before the token is shown
            raise nonfinite_error(model, f"the logits of new token {len(new) + 1}")
        token = next_token(logits[:, -1], temperature, top_p, generator)
        if eos_token_id is not None:
            token = torch.where(done, torch.full_like(token, eos_token_id), token)
            done |= token == eos_token_id
        new.append(token)
        if (on_token is not None and on_token(token)) or len(new) == max_new_tokens:
            break
        if eos_token_id is not None and bool(done.all()):  # a device read: only when there is an EOS to wait for
            break
        logits = step(token)
    if not bool(finite):
        raise nonfinite_error(model, "the logits of a new token")
    return torch.stack(new, dim=1)


def check_decoding(model: LoopLM, use_cache: bool, exit_threshold: float | None, kv_bits: int | None) -> None:
    """One line per bad early-exit / quantized-cache option, naming its flag."""
    check_exit_threshold(exit_threshold)
    check_kv_bits(kv_bits)
    if exit_threshold is not None:
        check_exit_model(model)
    if not use_cache and (exit_threshold is not None or check_kv_bits(kv_bits) is not None):
        flag = "--exit_threshold" if exit_threshold is not None else "--kv_bits"
        raise LoopLMError(f"{flag} needs the KV cache; drop --no_cache (use_cache=False)")


def check_static_options(
    model: LoopLM,
    use_cache: bool,
    exit_threshold: float | None,
    kv_bits: int | None,
    static_cache: bool,
    cuda_graphs: bool,
) -> None:
    """One line for an option the static cache / CUDA-graph decode step does not support."""
    if not (static_cache or cuda_graphs):
        return
    flag = "--cuda_graphs" if cuda_graphs else "--static_cache"
    if not use_cache:
        raise LoopLMError(f"{flag} is a KV cache; drop --no_cache (use_cache=False)")
    if exit_threshold is not None:
        raise LoopLMError(f"{flag} runs every loop at every step; drop --exit_threshold (early exit) or {flag}")
    if check_kv_bits(kv_bits) is not None:
        raise LoopLMError(f"{flag} stores the cache in the model's dtype; drop --kv_bits or {flag}")
    if cuda_graphs:
        check_graph_model(model)


def _static_steps(
    model: LoopLM,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    kwargs: dict[str, Any],
    max_new_tokens: int,
    graphs: bool,
) -> Callable[[Tensor | None], Tensor]:
    """Logits of the prompt (``None``), then of each new token, on a static cache with room for the prompt and the
    ``max_new_tokens - 1`` tokens fed back (the last new token is never fed)."""
    capacity = input_ids.shape[1] + max_new_tokens - 1
    decoder = StaticDecoder(model, input_ids.shape[0], capacity, graphs=graphs, **kwargs)

    def step(token: Tensor | None) -> Tensor:
        return decoder.prefill(input_ids, attention_mask) if token is None else decoder.step(token)

    return step


def _cached_steps(
    model: LoopLM,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    kwargs: dict[str, Any],
    cache: LoopKVCache,
    exit_threshold: float | None = None,
    exit_stats: ExitStats | None = None,
) -> Callable[[Tensor | None], Tensor]:
    """Logits of the prompt (``None``), then of each new token alone against the cache (with early exit: the
    prompt read out at its threshold exit, each new token looping only until its own)."""
    exits = {} if exit_threshold is None else {"exit_mode": "threshold", "exit_threshold": exit_threshold}

    def step(token: Tensor | None) -> Tensor:
        if token is None:
            return model(input_ids, cache=cache, attention_mask=attention_mask, **kwargs, **exits).logits
        if exit_threshold is None:
            return model(token[:, None], cache=cache, **kwargs).logits
        logits, exit_loops, ran = early_exit_forward(model, token[:, None], cache, exit_threshold, **kwargs)
        if exit_stats is not None:
            exit_stats.exit_loops.append(exit_loops)
            exit_stats.loops_run.append(ran)
        return logits

    return step


def _rerun_steps(
    model: LoopLM, input_ids: Tensor, attention_mask: Tensor | None, kwargs: dict[str, Any]
) -> Callable[[Tensor | None], Tensor]:
    """Logits of the whole sequence so far, recomputed from scratch at every step (no cache)."""
    ids, mask = input_ids, attention_mask

    def step(token: Tensor | None) -> Tensor:
        nonlocal ids, mask
        if token is not None:
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = None if mask is None else torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return model(ids, attention_mask=mask, **kwargs).logits

    return step
