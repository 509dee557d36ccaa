"""Tokenizers from local files (``tokenizer.json`` or GPT-2 ``encoder.json`` + ``vocab.bpe``), and a small
byte-level BPE trainer for the embedded teacher. Everything goes through the ``tokenizers`` library."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loopq.errors import LoopQError

EOS_TOKEN = "<|endoftext|>"


class TokenizerError(LoopQError):
    """A tokenizer file is missing or unusable; the message names the path."""


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load ``tokenizer.json`` (a file, or a directory holding one) or a GPT-2 BPE directory."""
    p = Path(path)
    if not p.exists():
        from loopq.models.loading import resolve_model_dir

        p = resolve_model_dir(path)
        if not p.exists():
            raise TokenizerError(f"{p}: no such file or directory; pass the model directory (with tokenizer.json)")
    candidates = [p] if p.is_file() else [p / "tokenizer.json", *sorted(p.glob("*okenizer*.json"))]
    for file in candidates:
        if file.is_file() and file.suffix == ".json" and file.name != "encoder.json":
            return _tokenizer_file(file)
    if (p / "encoder.json").is_file() and (p / "vocab.bpe").is_file():
        tok = Tokenizer(models.BPE.from_file(str(p / "encoder.json"), str(p / "vocab.bpe")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    raise TokenizerError(
        f"{p}: no tokenizer.json and no GPT-2 encoder.json + vocab.bpe; copy the model's tokenizer files into it"
    )


def _tokenizer_file(file: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # the tokenizers library raises a bare Exception for any malformed file
        raise TokenizerError(
            f"{file}: not a readable tokenizer file ({err}); copy an intact tokenizer.json of the model"
        ) from None


def eos_id(tokenizer: Tokenizer) -> int:
    """The end-of-text id used to separate documents (``<|endoftext|>``, else id 0)."""
    found = tokenizer.token_to_id(EOS_TOKEN)
    return 0 if found is None else found


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (``<|endoftext|>`` = id 0) on ``texts``: no unknown tokens, any input encodes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_chunks(texts), trainer=trainer)
    return tok


def _chunks(texts: Iterable[str], size: int = 1 << 16) -> Iterator[str]:
    for text in texts:
        for start in range(0, len(text), size):
            yield text[start : start + size]
