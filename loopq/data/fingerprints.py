"""Benchmark evaluation text recognised by content: fingerprints of the evaluation files, matched in any source.

A name check misses a renamed copy, a link, a concatenation or a decompressed copy of ``wiki.test.raw``; the text
itself does not change, so LoopQ compares text.

**Unit: word shingles.** Text is normalised to lowercase runs of letters/digits, after dropping JSON escapes
(``\\u2019``, ``\\n``, ``\\"``), so a ``.jsonl`` passage and its raw line, a CSV row, WikiText's raw and tokenised
files and a re-wrapped copy give the same words. Line-based hashes would not survive these formats. Every window of
``SHINGLE_WORDS`` consecutive words is hashed to 64 bits (each word by blake2b-64, combined as a polynomial mod
2^64, then a splitmix64 finaliser), vectorised in numpy: 0.1-0.15 s per MB of text on one core (the SmolLM2
tokenizer takes ~1.2 s per MB), so the 3 MB of calibration prose are checked in ~0.4 s.

**Sampling.** A shingle is *sampled* when its hash is 0 mod ``RATE``. The rule depends only on the shingle, so an
excerpt, a copy or a concatenation samples the same shingles as the original wherever they sit. A benchmark's
fingerprints are its sampled shingles, minus boilerplate (shingles repeated within one of its files, shingles with
fewer than 5 distinct words of 3+ characters) and minus any shingle of the text LoopQ trains and calibrates on
(``DEFAULT_TRAINING_SOURCES``). Only these hashes are stored (``eval_fingerprints.json``, regenerated from the shared
data by ``python -m loopq.commands.make_fingerprints``), never the third-party text.

**Matching.** A text *contains* a benchmark when it holds at least ``MIN_HITS`` distinct fingerprints of it (the
sources of one run are also checked together: a split cut into many small files is caught as a whole). An
excerpt of n words carries about n / ``RATE`` of them: a whole evaluation file gives tens to thousands of hits, an
excerpt of 5,000 words (~30 KB) is caught with probability > 99.9 %, one of 1,000 words about half the time; a quote
of a sentence or two is not (a shared phrase is not a leak, and a single hit is never enough to refuse a corpus).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
from pathlib import Path

import numpy as np

#: words per shingle
SHINGLE_WORDS = 10
#: one shingle in RATE is sampled (those whose hash is 0 mod RATE)
RATE = 512
#: distinct fingerprints of one benchmark that make a text "contain" it
MIN_HITS = 2
#: where the fingerprints live (regenerate with ``python -m loopq.commands.make_fingerprints``)
FINGERPRINTS = Path(__file__).with_name("eval_fingerprints.json")
#: characters normalised per step (bounds the memory of the word list on a large corpus)
CHUNK_CHARS = 1 << 22

_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{4}|[nrtbf\"\\/])")
_WORD = re.compile(r"[^\W_]+")
_MULT = np.uint64(0x9E3779B97F4A7C15)


def normalised_words(text: str) -> list[str]:
    """Lowercase runs of letters/digits of ``text`` with JSON escapes dropped (the matching unit's alphabet)."""
    return _WORD.findall(_ESCAPE.sub(" ", text.lower()))


def word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")


def shingle_hashes(words: list[str]) -> np.ndarray:
    """64-bit hash of every window of ``SHINGLE_WORDS`` consecutive words (``uint64``, one per window start)."""
    n = len(words) - SHINGLE_WORDS + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    table = {w: word_hash(w) for w in set(words)}
    ids = np.fromiter(map(table.__getitem__, words), dtype=np.uint64, count=len(words))
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(SHINGLE_WORDS):
            h = h * _MULT + ids[j : j + n]
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(29)
    return h


def sampled_hashes(text: str) -> np.ndarray:
    """The sampled shingle hashes of ``text`` (sorted, unique), normalised in chunks of ``CHUNK_CHARS``."""
    parts = []
    for start in range(0, len(text), CHUNK_CHARS):
        h = shingle_hashes(normalised_words(text[start : start + CHUNK_CHARS]))
        parts.append(h[h % np.uint64(RATE) == 0])
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)


def encode_hashes(hashes: np.ndarray) -> str:
    return base64.b64encode(np.sort(hashes).astype("<u8").tobytes()).decode("ascii")


def decode_hashes(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<u8").astype(np.uint64)


@functools.lru_cache(maxsize=2)
def load_fingerprints(path: Path = FINGERPRINTS) -> dict[str, np.ndarray]:
    """Benchmark name -> sorted fingerprint hashes, checked against this module's hashing parameters."""
    record = json.loads(path.read_text(encoding="utf-8"))
    if (record.get("shingle_words"), record.get("rate")) != (SHINGLE_WORDS, RATE):
        raise RuntimeError(
            f"{path}: made with other hashing parameters; run python -m loopq.commands.make_fingerprints"
        )
    return {name: decode_hashes(entry["fingerprints"]) for name, entry in record["benchmarks"].items()}


def benchmark_hits(found: np.ndarray | str, fingerprints: dict[str, np.ndarray] | None = None) -> dict[str, int]:
    """Benchmarks of which ``found`` (a text, or its :func:`sampled_hashes`) holds at least ``MIN_HITS`` distinct
    fingerprints, most hits first."""
    found = sampled_hashes(found) if isinstance(found, str) else np.unique(found)
    table = load_fingerprints() if fingerprints is None else fingerprints
    hits = {name: int(np.isin(found, prints, assume_unique=True).sum()) for name, prints in table.items()}
    return dict(sorted(((k, v) for k, v in hits.items() if v >= MIN_HITS), key=lambda kv: -kv[1]))


def holds_any(found: np.ndarray, benchmark: str) -> bool:
    """Whether ``found`` (sampled hashes) holds at least one fingerprint of ``benchmark``."""
    return bool(np.isin(found, load_fingerprints()[benchmark]).any())
