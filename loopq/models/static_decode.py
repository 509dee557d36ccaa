"""Fixed-shape decoding: a preallocated KV cache and a decode step that a CUDA graph can capture and replay.

The growing :class:`~loopq.models.kv_cache.LoopKVCache` changes every attention's key length at every token and reads
the new tokens' positions back to the host; a decode step is then ~1,000 kernel launches driven from Python (issue
28: 48.8 ms per token on an H100 for a step whose weights take ~0.55 ms to read). Here:

* :class:`StaticKVCache` preallocates, per (loop, layer) entry, keys and values ``[B, H_kv, capacity, dh]`` (zeros,
  so that masked slots hold finite values) and writes the new tokens in place at the device-side slot index
  (``index_copy_``). A decode step (one token per row) attends over the **whole** capacity with a mask over the
  filled slots, so every tensor of the step has the same shape at every token and nothing is read back to the host
  (the models' position check uses a bound counted on the host, :attr:`DecodeStep.max_position`). A prefill (several
  tokens) attends over the filled prefix only, as the growing cache does.
* :class:`StaticDecoder` drives prefill and decode steps on it, eagerly or (``graphs=True`` on a CUDA model) by
  capturing one whole looped decode step - T loops x L layers, the head and the cache update - as one CUDA graph on
  static token/logit buffers and replaying it per token. On a CPU model ``graphs=True`` runs the same step eagerly.

Out of scope for this path (refused with one line each, by :func:`check_static_options`): early exit (the loops run
per step depend on the gate, read on the host) and the quantized cache (``kv_bits``: its entries are dequantized
whole per step by the reference code). Parcae decodes with the static cache but not in a graph: its forward builds
its RoPE table and initial state on the host at every step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from loopq.errors import LoopLMError
from loopq.models.kv_cache import DecodeStep, EntryKey

#: given a step function (no arguments, returns the logits) and a reset that undoes one run of it (outside a
#: capture), returns the step's replay, called once per token
Capture = Callable[[Callable[[], Tensor], Callable[[], None]], Callable[[], Tensor]]


@dataclass
class HostState:
    """What the cache counts on the host: filled slots and an upper bound on the next position of every row."""

    length: int = 0
    next_position_bound: int = 0


class StaticKVCache:
    """Per-(loop, layer) keys and values in preallocated ``[B, H_kv, capacity, dh]`` buffers, written in place.

    Device state: ``slot`` ``[1]`` (the next slot index, the same for every row: rows are left padded),
    ``next_position`` ``[B]`` and ``valid`` ``[B, capacity]`` (real tokens). Host state (:class:`HostState`): the
    same count of slots and a bound on the positions, so that a step needs no device-to-host read."""

    def __init__(self, model: nn.Module, batch: int, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise LoopLMError(f"static cache: capacity must be an integer >= 1 (prompt + new tokens), got {capacity!r}")
        device = next(model.parameters()).device
        self.model = weakref.ref(model)
        self.layer_names = {id(m): name for name, layer in model.decoder_layers().items() for m in layer.modules()}
        self.batch, self.capacity = batch, capacity
        self.max_positions: int = model.max_positions
        self.key_buffers: dict[EntryKey, Tensor] = {}
        self.value_buffers: dict[EntryKey, Tensor] = {}
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.key_index = torch.arange(capacity, device=device)
        self.one_token = torch.ones(batch, 1, dtype=torch.bool, device=device)
        self.host = HostState()
        self._slots = self.slot  # the slots of the current forward's tokens
        self._fixed = False  # whether the current forward attends over the whole capacity

    @property
    def length(self) -> int:
        return self.host.length

    def check(self, model: nn.Module, input_ids: Tensor) -> None:
        """Refuse a cache built for another model or another batch size (one line each)."""
        if self.model() is not model:
            raise LoopLMError(
                "cache: this StaticKVCache was built for another model; build one per model with "
                "StaticKVCache(model, batch, capacity)"
            )
        if input_ids.shape[0] != self.batch:
            raise LoopLMError(f"cache: built for a batch of {self.batch}, got input_ids of batch {input_ids.shape[0]}")

    def check_room(self, new_tokens: int) -> None:
        """Refuse ``new_tokens`` more tokens past the capacity or past the model's positions (host counts only)."""
        if self.host.length + new_tokens > self.capacity:
            raise LoopLMError(
                f"static cache: {self.host.length} cached + {new_tokens} new tokens exceed its capacity of "
                f"{self.capacity}; build it with capacity >= prompt length + max_new_tokens"
            )
        if self.host.next_position_bound + new_tokens > self.max_positions:
            raise LoopLMError(
                f"static cache: position {self.host.next_position_bound + new_tokens - 1} is past the model's context "
                f"of {self.max_positions} positions (config.json); shorten the prompt or lower max_new_tokens"
            )

    def step(self, attention_mask: Tensor | None, input_ids: Tensor) -> DecodeStep:
        """Positions and mask of the new tokens; marks their slots valid. One token per row: the mask spans the whole
        capacity (fixed shapes); several: the filled prefix plus the new tokens."""
        b, s = input_ids.shape
        self.check_room(s)
        if attention_mask is None:
            new_valid = self.one_token if s == 1 else self.one_token.expand(b, s)
        elif tuple(attention_mask.shape) != (b, s):
            raise LoopLMError(
                f"attention_mask must have the shape of input_ids {(b, s)} (the new tokens only), "
                f"got {tuple(attention_mask.shape)}"
            )
        else:
            new_valid = attention_mask.to(device=self.valid.device, dtype=torch.bool)
        slots = self.slot if s == 1 else self.slot + self.key_index[:s]
        self.valid.index_copy_(1, slots, new_valid)
        positions = (self.next_position[:, None] + new_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        width = self.capacity if s == 1 else self.host.length + s
        keys = self.key_index[:width]
        causal = keys[None, :] <= slots[:, None]  # [S, W]
        itself = keys[None, :] == slots[:, None]  # a padding query attends to itself only (its output is unread)
        mask = ((causal[None] & self.valid[:, None, :width]) | itself[None])[:, None]  # [B, 1, S, W]
        self._slots, self._fixed = slots, s == 1
        bound = self.host.next_position_bound + s - 1
        return DecodeStep(positions, new_valid, mask, self, max_position=bound)

    def extend(self, layer: nn.Module, t: int | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``, ``v`` ``[B, H_kv, S, dh]`` at the step's slots of entry (``t``, the layer holding ``layer``)
        and return what the step attends over (the whole buffers, or the filled prefix for a prefill)."""
        key = (t, self.layer_names[id(layer)])
        if key not in self.key_buffers:
            if self._fixed and self.host.length > 0:
                raise LoopLMError(
                    f"static cache: entry {key} is first written by a decode step, after the prefill; run every "
                    "decode step with the loops (num_loops / steps) of the prefill"
                )
            shape = (*k.shape[:2], self.capacity, k.shape[3])
            self.key_buffers[key] = k.new_zeros(shape)
            self.value_buffers[key] = v.new_zeros(shape)
        keys, values = self.key_buffers[key], self.value_buffers[key]
        keys.index_copy_(2, self._slots, k)
        values.index_copy_(2, self._slots, v)
        if self._fixed:
            return keys, values
        end = self.host.length + k.shape[2]
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, step: DecodeStep) -> None:
        """Count the new tokens (after the head): device counters in place, then the host counts."""
        s = step.valid.shape[1]
        self.next_position += step.valid.long().sum(dim=1)
        self.slot += s
        self.advance_host(s, exact=s > 1)

    def advance_host(self, new_tokens: int, exact: bool = False) -> None:
        """The host counts after ``new_tokens`` tokens; ``exact`` reads the positions back (one sync, for a prefill)
        instead of bounding them by one per token."""
        self.host.length += new_tokens
        if exact:
            self.host.next_position_bound = int(self.next_position.max())
        else:
            self.host.next_position_bound += new_tokens

    def snapshot(self) -> tuple[HostState, Tensor, Tensor, Tensor]:
        """The counters (host and device) that a warm-up or capture of a step changes; see :meth:`restore`."""
        host = HostState(self.host.length, self.host.next_position_bound)
        return host, self.slot.clone(), self.next_position.clone(), self.valid.clone()

    def restore(self, state: tuple[HostState, Tensor, Tensor, Tensor]) -> None:
        """Undo the steps run since :meth:`snapshot` (the keys/values they wrote lie in slots not yet valid, and are
        overwritten by the next real step before any query reads them)."""
        host, slot, next_position, valid = state
        self.host = HostState(host.length, host.next_position_bound)
        self.slot.copy_(slot)
        self.next_position.copy_(next_position)
        self.valid.copy_(valid)

    def num_bytes(self) -> int:
        """Memory held by the preallocated keys and values."""
        return sum(x.numel() * x.element_size() for x in (*self.key_buffers.values(), *self.value_buffers.values()))


def cuda_graph_capture(fn: Callable[[], Tensor], reset: Callable[[], None], warmup: int = 2) -> Callable[[], Tensor]:
    """Capture ``fn`` in a :class:`torch.cuda.CUDAGraph` after ``warmup`` runs on a side stream (lazy initialisation,
    kernel autotuning), each undone by ``reset``; the replay runs it again on the same buffers and returns its
    (static) output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
            reset()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    reset()  # the capture ran the Python (host counts moved), not the kernels

    def replay() -> Tensor:
        graph.replay()
        return out

    return replay


def capture_for(device: torch.device) -> Capture | None:
    """How to capture a decode step on ``device``: CUDA graphs on CUDA; None elsewhere (the step runs eagerly)."""
    return cuda_graph_capture if device.type == "cuda" else None


def check_graph_model(model: nn.Module) -> None:
    """Refuse a model whose decode step reads host data per token (Parcae's RoPE table and initial state)."""
    if getattr(model, "arch", "") == "parcae":
        raise LoopLMError(
            "--cuda_graphs: Parcae's forward builds its RoPE table and initial state on the host at every step, "
            "which a CUDA graph cannot capture; decode Parcae without --cuda_graphs (the static cache works)"
        )


class StaticDecoder:
    """Prefill, then one token per row per step, on a :class:`StaticKVCache` of ``capacity`` slots.

    ``graphs``: the decode step is captured once (at the first step, after the prefill has created every entry) by
    ``capture`` (default :func:`capture_for` the model's device: a CUDA graph on CUDA, none on CPU, where the step runs
    eagerly) and replayed per token; ``forward_kwargs`` (``num_loops``, LoopFormer's ``steps``...) are fixed at
    capture. :attr:`graphed` says whether steps are replayed."""

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        capacity: int,
        graphs: bool = False,
        capture: Capture | None = None,
        **forward_kwargs: Any,
    ) -> None:
        if graphs:
            check_graph_model(model)
        self.model, self.kwargs = model, forward_kwargs
        self.cache = StaticKVCache(model, batch, capacity)
        device = self.cache.slot.device
        self.capture = (capture or capture_for(device)) if graphs else None
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._replay: Callable[[], Tensor] | None = None

    @property
    def graphed(self) -> bool:
        return self.capture is not None

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits ``[B, S, V]`` of the prompt (left padded where ``attention_mask`` has zeros), filling the cache."""
        if self.cache.length:
            raise LoopLMError("static decoder: prefill runs once, on an empty cache; build a new StaticDecoder")
        return self.model(input_ids, cache=self.cache, attention_mask=attention_mask, **self.kwargs).logits

    def step(self, token: Tensor) -> Tensor:
        """Logits ``[B, 1, V]`` of one new token ``[B]`` per row after everything cached (a static buffer when
        replayed: read it before the next step)."""
        if not self.cache.length:
            raise LoopLMError("static decoder: call prefill(input_ids) before the first decode step")
        self.token.copy_(token.view(-1, 1))
        if self.capture is None:
            return self._forward()
        self.cache.check_room(1)
        if self._replay is None:
            self._replay = self._captured()
        logits = self._replay()
        self.cache.advance_host(1)
        return logits

    def _forward(self) -> Tensor:
        return self.model(self.token, cache=self.cache, **self.kwargs).logits

    def _captured(self) -> Callable[[], Tensor]:
        """Capture :meth:`_forward`; the cache's counters are restored after each warm-up run and after the capture
        (a capture runs the Python, so the host counts move, while a real CUDA capture does not run the kernels)."""
        assert self.capture is not None
        state = self.cache.snapshot()
        try:
            return self.capture(self._forward, lambda: self.cache.restore(state))
        finally:
            self.cache.restore(state)
