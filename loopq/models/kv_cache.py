"""KV cache for looped LMs: one K/V entry per (loop, layer), so decoding costs one token's forward per new token.

A looped model applies the same layer f_l in every loop t, but on a different input H_{t,l-1}, so each loop's
attention has its own keys and values: the cache holds one entry per (t, layer) of the shared stack, plus one per
non-looped layer (Parcae's prelude and coda, key ``(None, name)``). Per sequence that is

    T x L x 2 x S x d_kv   values        (T loops, L shared layers, S cached tokens, d_kv = kv_heads x head_dim)

- T times a plain transformer's cache of the same depth. Keys are stored after RoPE (and after Parcae's qk-norm),
values after Parcae's value-embedding mix, with the model's K/V heads (grouped-query heads are not repeated).

A forward with a cache (:meth:`loopq.models.base.LoopLM.forward` with ``cache=``) runs only the new tokens: every
attention layer appends their K/V to its entry and attends over the whole entry. Quantization lives inside the
layers' ``LinearGroup`` modules and acts on each token independently, so the FP teacher, a fake-quant student and an
exported packed model all decode through the same code.

Batches of prompts of different lengths are *left* padded: ``attention_mask`` (1 = token, 0 = padding) marks the
padding, padded keys are never attended to, and positions are counted per row over real tokens only, so a padded
row sees the same RoPE / learned positions as the same prompt alone. The cache keeps, per row, which cached slots are
real (``valid``) and the next position (``next_position``).

Early exit (Ouro's per-token gate, :mod:`loopq.models.early_exit`): a decoded token that exits after loop e skips
the deeper loops, and :meth:`LoopKVCache.fill_skipped` writes its loop-e keys/values into its slot of every deeper
loop's entry, so later tokens attend to it in every loop. ``kv_bits`` 8 or 4 stores every entry as codes and
per-token group scales (:mod:`loopq.models.kv_quant`); the new tokens of a forward attend to their own K/V unrounded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from loopq.errors import LoopLMError
from loopq.models.kv_quant import QuantizedKV, check_kv_bits, dequantize_kv, kv_num_bytes, quantize_kv

#: a cache entry's key: (loop index or None outside the loop, decoder-layer module name)
EntryKey = tuple[int | None, str]
#: a stored entry: the keys or values ``[B, H_kv, S, dh]`` themselves, or their codes and scales
Entry = Tensor | QuantizedKV


class SlotBuffer:
    """Slots ``[B, H, capacity, d]`` of which the first ``length`` are filled. An append copies the new slots into the
    spare capacity, growing it by doubling, so decoding n tokens copies O(n) slots in all instead of the O(n^2) of
    concatenating the whole entry at every step. :meth:`view` is the filled part (it shares the storage)."""

    def __init__(self, first: Tensor) -> None:
        self.data = first.new_empty(*first.shape[:2], max(2 * first.shape[2], 16), *first.shape[3:])
        self.length = 0
        self.append(first)

    def view(self) -> Tensor:
        return self.data[:, :, : self.length]

    def append(self, x: Tensor) -> None:
        need = self.length + x.shape[2]
        if need > self.data.shape[2]:
            grown = self.data.new_empty(*self.data.shape[:2], max(need, 2 * self.data.shape[2]), *self.data.shape[3:])
            grown[:, :, : self.length] = self.view()
            self.data = grown
        self.data[:, :, self.length : need] = x
        self.length = need


def map_entry(fn: Callable[..., Tensor], *entries: Entry) -> Entry:
    """``fn`` applied field by field to entries of one kind (a tensor, or the codes and the scales)."""
    if isinstance(entries[0], Tensor):
        return fn(*entries)
    return QuantizedKV(*(fn(*fields) for fields in zip(*entries, strict=True)))


@dataclass
class DecodeStep:
    """What a cached or padded forward adds to the context ``ctx["step"]`` that every layer reads.

    ``positions`` ``[B, S]``: each new token's position; ``valid`` ``[B, S]``: which new tokens are real (not
    padding); ``mask`` ``[B, 1, S, P + S]`` (bool, True = attend): causal over the ``P`` cached plus ``S`` new tokens,
    padding excluded; ``cache``: where the layers append their K/V (None for a padded forward without a cache)."""

    positions: Tensor
    valid: Tensor
    mask: Tensor
    cache: DecodeCache | None = None
    #: an upper bound on ``positions`` known on the host (a static cache's count), so that the models' position check
    #: needs no device-to-host read; None: read ``positions`` (one sync)
    max_position: int | None = None

    def position_bound(self) -> int:
        """The largest position of the new tokens, or an upper bound the cache knows without a device sync."""
        return int(self.positions.max()) if self.max_position is None else self.max_position


class DecodeCache(Protocol):
    """What a forward with ``cache=`` calls (:class:`LoopKVCache`, :class:`loopq.models.static_decode.StaticKVCache`):
    ``check`` the model and batch, ``step`` the new tokens' positions and mask, ``extend`` an entry in every attention
    (returning the keys/values to attend over) and ``advance`` after the head."""

    def check(self, model: nn.Module, input_ids: Tensor) -> None: ...

    def step(self, attention_mask: Tensor | None, input_ids: Tensor) -> DecodeStep: ...

    def extend(self, layer: nn.Module, t: int | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def advance(self, step: DecodeStep) -> None: ...


@dataclass
class LoopKVCache:
    """Per-(loop, layer) keys and values of the tokens seen so far, for one model and one batch.

    Build it with :meth:`for_model`; a forward with ``cache=`` fills and extends it. ``length`` is the number of
    cached token slots (padding included), ``valid`` ``[B, length]`` marks the real ones. ``kv_bits`` (8 or 4)
    stores entries as :class:`~loopq.models.kv_quant.QuantizedKV`; None keeps the model's dtype."""

    model: weakref.ReferenceType[nn.Module]
    layer_names: dict[int, str]
    batch: int
    #: per entry the buffers of its fields: (keys,) or (codes, scales); read them through ``keys`` / ``values``
    key_buffers: dict[EntryKey, tuple[SlotBuffer, ...]] = field(default_factory=dict)
    value_buffers: dict[EntryKey, tuple[SlotBuffer, ...]] = field(default_factory=dict)
    length: int = 0
    valid: Tensor | None = None
    next_position: Tensor | None = None
    kv_bits: int | None = None

    @classmethod
    def for_model(cls, model: Any, batch: int, kv_bits: int | None = None) -> LoopKVCache:
        """An empty cache for ``batch`` sequences of ``model`` (a :class:`~loopq.models.base.LoopLM`), storing
        ``kv_bits`` (None or 16: unquantized; 8 or 4: codes and scales) per key/value."""
        # every module inside a decoder layer maps to that layer's name: its attention module appends the K/V
        names = {id(m): name for name, layer in model.decoder_layers().items() for m in layer.modules()}
        return cls(model=weakref.ref(model), layer_names=names, batch=batch, kv_bits=check_kv_bits(kv_bits))

    def check(self, model: nn.Module, input_ids: Tensor) -> None:
        """Refuse a cache built for another model or another batch size (one line each)."""
        if self.model() is not model:
            raise LoopLMError(
                "cache: this LoopKVCache was built for another model; build a new one with "
                "LoopKVCache.for_model(model, batch) for each model"
            )
        if input_ids.shape[0] != self.batch:
            raise LoopLMError(f"cache: built for a batch of {self.batch}, got input_ids of batch {input_ids.shape[0]}")

    @property
    def keys(self) -> dict[EntryKey, Entry]:
        """Every entry's cached keys (views of the buffers: writing into them writes the cache)."""
        return {key: _entry(bufs) for key, bufs in self.key_buffers.items()}

    @property
    def values(self) -> dict[EntryKey, Entry]:
        """Every entry's cached values (views, as :attr:`keys`)."""
        return {key: _entry(bufs) for key, bufs in self.value_buffers.items()}

    def step(self, attention_mask: Tensor | None, input_ids: Tensor) -> DecodeStep:
        """The positions and attention mask of the new tokens ``input_ids`` given what is cached."""
        past = self.valid if self.valid is not None else input_ids.new_ones(self.batch, 0, dtype=torch.bool)
        start = self.next_position if self.next_position is not None else input_ids.new_zeros(self.batch)
        return decode_step(input_ids, attention_mask, past, start, self)

    def extend(self, layer: nn.Module, t: int | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new ``k``, ``v`` ``[B, H_kv, S, dh]`` to the entry of (``t``, the decoder layer holding ``layer``);
        return the whole entry (quantized: the stored slots dequantized, then the new ones unrounded)."""
        key = (t, self.layer_names[id(layer)])
        if self.kv_bits is None:
            _append(self.key_buffers, key, k)
            _append(self.value_buffers, key, v)
            return _entry(self.key_buffers[key]), _entry(self.value_buffers[key])  # type: ignore[return-value]
        if key in self.key_buffers:
            k_full = torch.cat([dequantize_kv(_entry(self.key_buffers[key])).to(k.dtype), k], dim=2)  # type: ignore[arg-type]
            v_full = torch.cat([dequantize_kv(_entry(self.value_buffers[key])).to(v.dtype), v], dim=2)  # type: ignore[arg-type]
        else:
            k_full, v_full = k, v
        _append(self.key_buffers, key, quantize_kv(k, self.kv_bits))
        _append(self.value_buffers, key, quantize_kv(v, self.kv_bits))
        return k_full, v_full

    def fill_skipped(self, exit_loops: Tensor, ran: int, num_loops: int) -> None:
        """After a one-token forward that ran loops ``0 .. ran-1``: the token of row b exited at ``exit_loops[b]``, so
        its slot in every deeper loop's entry becomes a copy of its exit loop's keys/values (appended for the loops
        that did not run, overwritten in place for rows that exited before the batch stopped)."""
        looped = [name for t, name in self.key_buffers if t == 0]
        rows = torch.arange(self.batch, device=exit_loops.device)
        for buffers in (self.key_buffers, self.value_buffers):
            for name in looped:
                ran_slots = [map_entry(lambda x: x[:, :, -1:], _entry(buffers[(t, name)])) for t in range(ran)]
                exit_slot = map_entry(lambda *xs: torch.stack(xs)[exit_loops, rows], *ran_slots)
                for t in range(1, num_loops):
                    key, skipped = (t, name), exit_loops < t
                    if t < ran and bool(skipped.any()):
                        _replace_last(buffers[key], exit_slot, skipped)
                    elif t >= ran:  # no row ran loop t: append the copy
                        _append(buffers, key, exit_slot)

    def advance(self, step: DecodeStep) -> None:
        """Record the new tokens once every layer has appended them (called at the end of a forward)."""
        self.valid = step.valid if self.valid is None else torch.cat([self.valid, step.valid], dim=1)
        start = self.next_position if self.next_position is not None else 0
        self.next_position = start + step.valid.long().sum(dim=1)
        self.length = self.valid.shape[1]

    def num_bytes(self) -> int:
        """Memory held by the cached keys and values."""
        return sum(kv_num_bytes(x) for x in (*self.keys.values(), *self.values.values()))  # the filled slots


def _entry(buffers: tuple[SlotBuffer, ...]) -> Entry:
    """The filled slots of an entry's buffers: a tensor, or codes and scales."""
    views = [b.view() for b in buffers]
    return views[0] if len(views) == 1 else QuantizedKV(*views)


def _append(buffers: dict[EntryKey, tuple[SlotBuffer, ...]], key: EntryKey, new: Entry) -> None:
    """Append ``new`` slots to entry ``key`` of ``buffers`` (creating it)."""
    fields = (new,) if isinstance(new, Tensor) else tuple(new)
    if key not in buffers:
        buffers[key] = tuple(SlotBuffer(f) for f in fields)
        return
    for buffer, f in zip(buffers[key], fields, strict=True):
        buffer.append(f)


def _replace_last(buffers: tuple[SlotBuffer, ...], slot: Entry, rows: Tensor) -> None:
    """Overwrite the last filled slot of an entry with ``slot`` in the ``rows`` ``[B]`` (bool) of the batch."""
    mask = rows[:, None, None, None]
    fields = (slot,) if isinstance(slot, Tensor) else tuple(slot)
    for buffer, s in zip(buffers, fields, strict=True):
        last = buffer.view()[:, :, -1:]
        last.copy_(torch.where(mask, s, last))


def decode_step(
    input_ids: Tensor, attention_mask: Tensor | None, past_valid: Tensor, start: Tensor, cache: DecodeCache | None
) -> DecodeStep:
    """Positions and mask for new tokens after ``past_valid`` ``[B, P]`` cached slots whose next position is
    ``start`` ``[B]``. ``attention_mask`` ``[B, S]`` (1 = token, 0 = padding) defaults to all ones."""
    b, s = input_ids.shape
    if attention_mask is None:
        new_valid = torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
    elif tuple(attention_mask.shape) != (b, s):
        raise LoopLMError(
            f"attention_mask must have the shape of input_ids {(b, s)} (the new tokens only), "
            f"got {tuple(attention_mask.shape)}"
        )
    else:
        new_valid = attention_mask.to(device=input_ids.device, dtype=torch.bool)
    positions = (start[:, None] + new_valid.long().cumsum(dim=1) - 1).clamp(min=0)
    return DecodeStep(positions, new_valid, attention_mask_4d(past_valid.to(input_ids.device), new_valid), cache)


def attention_mask_4d(past_valid: Tensor, new_valid: Tensor) -> Tensor:
    """``[B, 1, S, P + S]`` bool: new token i attends to real cached slots and to real new tokens j <= i, and always
    to itself (a padding query would otherwise see nothing and give NaN; its output is never read)."""
    p, s = past_valid.shape[1], new_valid.shape[1]
    keys_valid = torch.cat([past_valid, new_valid], dim=1)[:, None, :]  # [B, 1, P+S]
    idx = torch.arange(s, device=new_valid.device)
    causal = torch.arange(p + s, device=new_valid.device)[None, :] <= (p + idx)[:, None]  # [S, P+S]
    itself = torch.arange(p + s, device=new_valid.device)[None, :] == (p + idx)[:, None]
    return ((causal[None] & keys_valid) | itself[None])[:, None]
