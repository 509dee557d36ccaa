"""Token streams and fixed-length windows: the one place text becomes training/calibration samples."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer
from torch import Tensor

from loopq.data.text import DataError
from loopq.data.tokenizer import eos_id


def token_stream(docs: Sequence[str], tokenizer: Tokenizer) -> Tensor:
    """Encode documents and join them with end-of-text separators into one int64 stream."""
    eos = eos_id(tokenizer)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(docs), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long, device="cpu")  # host data; batches move with the trainer


def random_starts(tokens: int, num_samples: int, seq_len: int, seed: int) -> Tensor:
    """The offsets :func:`random_windows` cuts at: uniformly random, deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, tokens - seq_len + 1, (num_samples,), generator=gen, device="cpu")


def random_windows(stream: Tensor, num_samples: int, seq_len: int, seed: int, source: str = "data") -> Tensor:
    """``num_samples`` windows of ``seq_len`` tokens at uniformly random offsets (deterministic in ``seed``)."""
    check_one_window(stream.numel(), seq_len, source)
    return windows_at(stream, random_starts(stream.numel(), num_samples, seq_len, seed), seq_len)


def windows_at(stream: Tensor, starts: Tensor, seq_len: int) -> Tensor:
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def disjoint_starts(tokens: int, count: int, seq_len: int, seed: int, taken: Tensor, key: str) -> Tensor:
    """``count`` random offsets whose windows overlap neither each other nor any window starting at ``taken``
    (rejection sampling, deterministic in ``seed``): held-out text that no calibration window saw."""
    gen = torch.Generator().manual_seed(seed)
    kept = sorted(int(t) for t in taken)
    chosen: list[int] = []
    for _ in range(64):
        for s in torch.randint(0, tokens - seq_len + 1, (4 * count,), generator=gen).tolist():
            if len(chosen) < count and _clear(kept, s, seq_len):
                chosen.append(s)
                bisect.insort(kept, s)
        if len(chosen) == count:
            return torch.tensor(chosen, dtype=torch.long)
    raise DataError(
        f"{key}={count}: only {len(chosen)} windows of data.seq_len={seq_len} fit beside the calibration windows "
        "without overlapping them; lower it or add text to data.sources"
    )


def _clear(sorted_starts: list[int], start: int, seq_len: int) -> bool:
    """No window of ``sorted_starts`` overlaps ``[start, start + seq_len)``."""
    i = bisect.bisect_left(sorted_starts, start)
    left_ok = i == 0 or sorted_starts[i - 1] + seq_len <= start
    return left_ok and (i == len(sorted_starts) or start + seq_len <= sorted_starts[i])


def spread_windows(stream: Tensor, count: int, seq_len: int) -> Tensor:
    """Up to ``count`` non-overlapping windows spread evenly over the whole stream (a held-out source)."""
    windows = contiguous_windows(stream, seq_len)
    if windows.shape[0] <= count:
        return windows
    return windows[torch.linspace(0, windows.shape[0] - 1, count).round().long()]


def check_one_window(tokens: int, seq_len: int, source: str = "data") -> None:
    """A stream of ``tokens`` tokens must be longer than one window of ``seq_len``."""
    if tokens < seq_len + 1:
        raise DataError(
            f"{source}: only {tokens} tokens, shorter than one sample of seq_len={seq_len}; add text or lower seq_len"
        )


def contiguous_windows(stream: Tensor, seq_len: int) -> Tensor:
    """Non-overlapping windows covering the stream (the tail shorter than ``seq_len`` is dropped)."""
    n = stream.numel() // seq_len
    if n == 0:
        raise DataError(f"stream of {stream.numel()} tokens is shorter than seq_len={seq_len}")
    return stream[: n * seq_len].view(n, seq_len)


def check_vocab(samples: Tensor, vocab_size: int, key: str = "tokenizer") -> None:
    """Every id must index the model's embedding table."""
    top = int(samples.max()) if samples.numel() else -1
    if top >= vocab_size:
        raise DataError(
            f"{key}: produces token id {top} but the model's vocab_size is {vocab_size}; "
            "use the tokenizer that belongs to the model"
        )
