"""Token streams and fixed-length windows: the one place text becomes training/calibration samples."""

from __future__ import annotations

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


def random_windows(stream: Tensor, num_samples: int, seq_len: int, seed: int, source: str = "data") -> Tensor:
    """``num_samples`` windows of ``seq_len`` tokens at uniformly random offsets (deterministic in ``seed``)."""
    check_one_window(stream.numel(), seq_len, source)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len + 1, (num_samples,), generator=gen, device="cpu")
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


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
