"""Text sources for calibration/pretraining, and the evaluation readers.

Benchmark test splits are for evaluation only: :func:`read_training_text` refuses them unless the caller
explicitly passes ``allow_eval_splits=True`` (nothing in LoopQ does).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from pathlib import Path

from loopq.errors import LoopQError
from loopq.paths import data_dir

#: files that hold evaluation data; calibrating or training on them would leak the benchmarks
EVAL_ONLY_PATTERNS = (
    "*wiki.test.*",
    "*lambada_test*",
    "*hellaswag*",
    "*winogrande*",
    "*ARC-*",
    "*/mmlu/*",
)

DEFAULT_TRAINING_SOURCES = (
    "calibration/*.txt",
    "lambada/lambada_development_plain_text.txt",
    "wikitext2/wiki.valid.tokens",
)
DEFAULT_CALIBRATION_SOURCES = ("calibration/*.txt",)


class DataError(LoopQError):
    """Bad data input; the message names the file or key and what to do."""


def is_eval_only(path: Path) -> bool:
    text = str(path)
    return any(fnmatch.fnmatch(text, pattern) for pattern in EVAL_ONLY_PATTERNS)


def resolve_sources(sources: Sequence[str], root: Path | None = None) -> list[Path]:
    """Expand globs relative to ``root`` (default: the data root); every pattern must match a file."""
    root = data_dir() if root is None else root
    files: list[Path] = []
    for pattern in sources:
        base = Path(pattern).expanduser()
        base = base if base.is_absolute() else root / base
        matched = sorted(base.parent.glob(base.name)) if any(c in base.name for c in "*?[") else [base]
        matched = [m for m in matched if m.is_file()]
        if not matched:
            raise DataError(f"data source {pattern!r}: no file at {base}; set data.root or LOOPQ_DATA")
        files.extend(matched)
    return files


def read_document(path: Path, text_key: str = "text") -> list[str]:
    """A text file is one document; a ``.jsonl`` file is one document per line (field ``text_key``)."""
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    docs.append(json.loads(line)[text_key])
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise DataError(f"{path}:{n}: expected a JSON object with a {text_key!r} field") from err
        return docs
    return [path.read_text(encoding="utf-8", errors="replace")]


def read_training_text(files: Sequence[Path], allow_eval_splits: bool = False) -> list[str]:
    """Documents of ``files``; benchmark test files are refused (they are for evaluation only)."""
    docs: list[str] = []
    for path in files:
        if is_eval_only(path) and not allow_eval_splits:
            raise DataError(f"{path}: is a benchmark evaluation split; it must never be used for calibration")
        found = [d for d in read_document(path) if d.strip()]
        if not found:
            raise DataError(f"{path}: empty; remove it from the data sources")
        docs.extend(found)
    return docs


def wikitext2_test(root: Path | None = None) -> str:
    """WikiText-2 raw test split as one string (the standard PTQ perplexity text)."""
    path = (data_dir() if root is None else root) / "wikitext2" / "wiki.test.raw"
    if not path.is_file():
        raise DataError(f"{path}: WikiText-2 raw test not found; set LOOPQ_DATA to the shared data folder")
    return path.read_text(encoding="utf-8")


def lambada_test(root: Path | None = None) -> list[str]:
    """LAMBADA (OpenAI variant) test passages; the last word of each is the prediction target."""
    path = (data_dir() if root is None else root) / "lambada" / "lambada_test.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: LAMBADA test not found; set LOOPQ_DATA to the shared data folder")
    return read_document(path)
