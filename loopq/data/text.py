"""Text sources for calibration/pretraining, and the evaluation readers.

Benchmark evaluation splits are for evaluation only. :func:`read_training_text`, the one gate every calibration and
pretraining file passes, refuses them unless the caller explicitly passes ``allow_eval_splits=True`` (nothing in
LoopQ does). Its guards, in order, each a one-line :class:`DataError` naming the file (and the file a link points to):

1. the path is resolved first (symlinks, ``..``, relative to the working directory), so the guards see the real file;
2. by name: the given or the real path matches ``EVAL_ONLY_PATTERNS``;
3. by encoding: compressed files are decompressed, binary or non-UTF-8 content is refused (:mod:`loopq.data.decode`);
4. by content: the text holds fingerprints of a benchmark's evaluation files (:mod:`loopq.data.fingerprints`), which
   catches a renamed, linked, decompressed or concatenated copy.

``hf:`` sources cannot be read before they are downloaded; :func:`check_hf_split` refuses them by dataset id and
split name first, and their text passes guard 4 after the download (:mod:`loopq.data.calibration`).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loopq.data.decode import read_text_file, text_suffix
from loopq.data.fingerprints import benchmark_hits, holds_any, sampled_hashes
from loopq.errors import DataError
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
#: Hugging Face dataset ids (last path component, lowercase) of evaluation benchmarks: only their train splits may be
#: calibrated on. C4's validation split is the perplexity set of GPTQ-style papers; Pile-val stays allowed (the
#: paper calibrates on ``hf:mit-han-lab/pile-val-backup:validation``).
HF_EVAL_DATASETS = re.compile(
    r"wikitext\S*|lambada\S*|hellaswag|winogrande|(ai2_)?arc(_challenge|_easy)?|mmlu\S*|hendrycks_test|piqa|boolq"
    r"|openbookqa|sciq|truthful_?qa|gsm8k|ptb_text_only|penn_?treebank|c4"
)


def is_eval_only(path: Path) -> bool:
    text = str(path)
    return any(fnmatch.fnmatch(text, pattern) for pattern in EVAL_ONLY_PATTERNS)


def check_hf_split(name: str, split: str, key: str) -> None:
    """Refuse an ``hf:`` source that names evaluation data, before anything is downloaded.

    Refused: any ``test`` split (held-out evaluation data by definition), and every split but a training one
    (a split name containing ``train``) of a dataset in ``HF_EVAL_DATASETS``. Split expressions such as
    ``train[:10%]+test`` are checked part by part.
    """
    dataset = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for part in split.split("+"):
        base = part.split("[", 1)[0].strip().lower()
        if base.startswith("test"):
            what = "a test split, held-out evaluation data"
        elif HF_EVAL_DATASETS.fullmatch(dataset) and "train" not in base:
            what = "a benchmark evaluation split"
        else:
            continue
        raise DataError(
            f"{key}: split {base!r} of {name!r} is {what}; it must never be used for calibration; "
            "use a training split or another corpus (the paper: hf:mit-han-lab/pile-val-backup:validation)"
        )


def check_eval_content(found: dict[str, np.ndarray]) -> None:
    """Refuse sources (label -> :func:`~loopq.data.fingerprints.sampled_hashes` of their text) that hold, alone or
    together, fingerprints of a benchmark's evaluation files; the error names the sources that hold them."""
    hits = benchmark_hits(np.concatenate([np.zeros(0, np.uint64), *found.values()]))
    if hits:
        name, count = next(iter(hits.items()))
        holders = [label for label, hashes in found.items() if holds_any(hashes, name)]
        named = ", ".join(holders[:5]) + (f" and {len(holders) - 5} more" if len(holders) > 5 else "")
        verb = "contains" if len(holders) == 1 else "together contain"
        raise DataError(
            f"{named}: {verb} {name} text ({count} fingerprinted passages), a benchmark evaluation "
            "split; it must never be used for calibration or pretraining; remove that text from the data sources"
        )


def source_label(path: Path, real: Path) -> str:
    """How errors name a source: as given, plus the real file when a link or ``..`` leads elsewhere."""
    return str(path) if os.path.abspath(path) == str(real) else f"{path} (-> {real})"


def check_sources_listed(sources: Sequence[str] | None, default: Sequence[str], key: str = "data.sources") -> None:
    """``sources`` left out (None) reads ``default``; an empty list is refused: it fell back to ``default`` silently,
    so ``[]`` trained or calibrated on text nobody listed."""
    if sources is not None and len(sources) == 0:
        raise DataError(
            f"{key}=[]: lists no text; list the files (or globs) to read, or leave {key} out for the default "
            f"({', '.join(default)})"
        )


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


def read_document(path: Path, text_key: str = "text", label: str | None = None) -> list[str]:
    """A text file is one document; a ``.jsonl`` file is one document per ``\\n``-ended line (field ``text_key``).

    Compressed files are read decompressed and binary files refused (:func:`loopq.data.decode.decode_text`);
    ``docs.jsonl.gz`` is a ``.jsonl`` file. Errors name ``label`` (default: the path).
    """
    label = str(path) if label is None else label
    text = read_text_file(path, label)
    if text_suffix(path) != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold raw U+2028, U+0085
        if line.strip():
            try:
                doc = json.loads(line)[text_key]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataError(f"{label}:{n}: expected a JSON object with a {text_key!r} field") from err
            if not isinstance(doc, str):  # {"text": 12345} or null: a traceback in the tokenizer before
                kind = type(doc).__name__
                raise DataError(f"{label}:{n}: the {text_key!r} field is {kind}, not text; make it a string")
            docs.append(doc)
    return docs


def read_source(path: Path, allow_eval_splits: bool = False) -> tuple[str, list[str]]:
    """The label and non-empty documents of one source after guards 1-3 of the module docstring."""
    real = Path(path).resolve()
    label = source_label(Path(path), real)
    if not allow_eval_splits and (is_eval_only(Path(path)) or is_eval_only(real)):
        raise DataError(
            f"{label}: is a benchmark evaluation split; it must never be used for calibration; "
            "remove it from the data sources"
        )
    texts = [d for d in read_document(real, label=label) if d.strip()]
    if not texts:
        raise DataError(f"{label}: empty; remove it from the data sources")
    return label, texts


def read_training_text(files: Sequence[Path], allow_eval_splits: bool = False) -> list[str]:
    """Documents of ``files`` after the guards of the module docstring: each file alone, then all together."""
    docs: list[str] = []
    found: dict[str, np.ndarray] = {}
    for path in files:
        label, texts = read_source(path, allow_eval_splits)
        if not allow_eval_splits:
            found[label] = sampled_hashes("\n".join(texts))
            check_eval_content({label: found[label]})
        docs.extend(texts)
    if len(found) > 1:
        check_eval_content(found)
    return docs


def wikitext2_test(root: Path | None = None) -> str:
    """WikiText-2 raw test split as one string (the standard PTQ perplexity text)."""
    path = (data_dir() if root is None else root) / "wikitext2" / "wiki.test.raw"
    if not path.is_file():
        raise DataError(f"{path}: WikiText-2 raw test not found; set LOOPQ_DATA to the shared data folder")
    return read_text_file(path)


def lambada_test(root: Path | None = None) -> list[str]:
    """LAMBADA (OpenAI variant) test passages; the last word of each is the prediction target."""
    path = (data_dir() if root is None else root) / "lambada" / "lambada_test.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: LAMBADA test not found; set LOOPQ_DATA to the shared data folder")
    return read_document(path)
