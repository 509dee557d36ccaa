"""Regenerate ``loopq/data/eval_fingerprints.json`` from the shared data folder (see :mod:`loopq.data.fingerprints`).

    python -m loopq.commands.make_fingerprints            # rewrite the stored file from $LOOPQ_DATA or ../shared/data
    python -m loopq.commands.make_fingerprints --check    # exit 1 when the stored file differs from a regeneration

Each benchmark's evaluation files are read as LoopQ reads any source (compressed files decompressed) in two views,
the raw text (what a renamed copy holds) and, for ``.jsonl``, the string values of every record (what a converted
copy holds). The sha256 of every file read is recorded, so the fingerprints name the release they come from.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loopq.commands.cli import Command
from loopq.data import fingerprints as fp
from loopq.data.decode import read_text_file, text_suffix
from loopq.data.text import DEFAULT_TRAINING_SOURCES, resolve_sources
from loopq.paths import data_dir

#: benchmark name (as refusals print it) -> its evaluation files, globs relative to the data root
BENCHMARKS: dict[str, tuple[str, ...]] = {
    "WikiText-2 test": ("wikitext2/wiki.test.raw", "wikitext2/wiki.test.tokens"),
    "LAMBADA test": ("lambada/lambada_test.jsonl",),
    "HellaSwag validation": ("hellaswag/hellaswag_val_full.txt.bz2",),
    "WinoGrande dev": ("winogrande/dev.jsonl",),
    "ARC-Challenge test": ("arc/ARC-Challenge-Test.jsonl",),
    "ARC-Challenge dev": ("arc/ARC-Challenge-Dev.jsonl",),
    "MMLU test": ("mmlu/test/*.csv",),
    "MMLU dev": ("mmlu/dev/*.csv",),
}
#: a fingerprint's shingle must hold this many distinct words of 3+ characters with a letter (no number runs)
MIN_DISTINCT_WORDS = 5


def views(path: Path) -> Iterator[str]:
    """The raw text of ``path`` and, for ``.jsonl``, the string values of its records (one record a line)."""
    raw = read_text_file(path)
    yield raw
    if text_suffix(path) == ".jsonl":
        yield "\n".join(" ".join(strings(json.loads(line))) for line in raw.split("\n") if line.strip())


def strings(value: Any) -> Iterator[str]:
    """Every string inside a JSON value, depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from strings(item)


def informative(words: list[str]) -> bool:
    return len({w for w in words if len(w) >= 3 and not w.isdigit()}) >= MIN_DISTINCT_WORDS


def file_fingerprints(text: str) -> np.ndarray:
    """Sampled shingles of ``text`` that occur once in it and are informative (sorted, unique)."""
    words = fp.normalised_words(text)
    hashes = fp.shingle_hashes(words)
    starts = np.nonzero(hashes % np.uint64(fp.RATE) == 0)[0]
    keep = [i for i in starts.tolist() if informative(words[i : i + fp.SHINGLE_WORDS])]
    unique, counts = np.unique(hashes[keep], return_counts=True)
    return unique[counts == 1]


def build(root: Path) -> dict[str, Any]:
    """The fingerprint record of the benchmarks under ``root`` (training text's shingles removed)."""
    allowed = np.unique(
        np.concatenate([fp.sampled_hashes(read_text_file(p)) for p in resolve_sources(DEFAULT_TRAINING_SOURCES, root)])
    )
    benchmarks: dict[str, Any] = {}
    for name, patterns in BENCHMARKS.items():
        files = resolve_sources(patterns, root)
        found = np.unique(np.concatenate([file_fingerprints(text) for f in files for text in views(f)]))
        found = np.setdiff1d(found, allowed, assume_unique=True)
        benchmarks[name] = {
            "files": {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
            "count": int(found.size),
            "fingerprints": fp.encode_hashes(found),
        }
    return {
        "about": "sampled 64-bit word-shingle hashes of benchmark evaluation files; see loopq/data/fingerprints.py",
        "shingle_words": fp.SHINGLE_WORDS,
        "rate": fp.RATE,
        "benchmarks": benchmarks,
    }


def make_fingerprints(data: Path | None = None, out: Path = fp.FINGERPRINTS, check: bool = False) -> int:
    """Write (or with ``check`` compare) the fingerprint file; returns the exit status.

    Args:
        data: the shared data folder (default: LOOPQ_DATA or ../shared/data)
        out: the fingerprint file
        check: compare with --out instead of writing it (exit status 1 when it differs)
    """
    text = json.dumps(build(data or data_dir()), indent=1) + "\n"
    if check:
        same = out.is_file() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'up to date' if same else 'differs from a regeneration; rerun without --check'}")
        return 0 if same else 1
    from loopq.files import atomic_write

    atomic_write(out, lambda p: p.write_text(text, encoding="utf-8"))
    print(f"wrote {out}")
    return 0


COMMAND = Command(make_fingerprints, "loopq.commands.make_fingerprints", __doc__)

build_parser, main = COMMAND.parser, COMMAND.run


if __name__ == "__main__":
    sys.exit(main())
