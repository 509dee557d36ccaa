"""Offline loaders for the paper's benchmarks (lm-eval ``custom_dataset`` hooks) and the one preprocessing step that
has to differ from lm-eval's stock tasks.

Each loader reads the local release file under :func:`loopq.paths.data_dir` at load time and returns a
``datasets.DatasetDict`` whose rows have the schema of the Hugging Face dataset the stock task reads, so the task
YAMLs keep the stock ``doc_to_text``/``doc_to_choice``/``doc_to_target`` (often the stock functions themselves).
lm-eval calls a loader with the task's metadata as keyword arguments; loaders ignore what they do not use.
See ``loopq/metrics/README.md`` for every difference from the stock tasks.
"""

from __future__ import annotations

import bz2
import csv
import json
import re
from pathlib import Path
from typing import Any

import datasets
from lm_eval.tasks.hellaswag.utils import preprocess as hellaswag_preprocess

from loopq.data.text import DataError
from loopq.paths import data_dir

HELLASWAG_FILE = "hellaswag/hellaswag_val_full.txt.bz2"
MMLU_LETTERS = "ABCD"
#: the boundary after which HellaSwag's ``ctx_b`` fragment starts (ActivityNet contexts end in that fragment)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def data_file(relative: str) -> Path:
    """A file of the shared data folder; the error names the env variable that relocates it."""
    path = data_dir() / relative
    if not path.is_file():
        raise DataError(f"{path}: benchmark file not found; set LOOPQ_DATA (or LOOPQ_SHARED) to the shared data folder")
    return path


def _dataset(**splits: list[dict[str, Any]]) -> datasets.DatasetDict:
    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{n}: not valid JSON ({err.msg}); restore the benchmark file") from None
    return rows


# --------------------------------------------------------------------------------------------------- HellaSwag
def read_hellaswag(path: Path) -> list[dict[str, Any]]:
    """llama.cpp's 6-line records: ``activity_label: ctx``, gold index, 4 endings (already tag-cleaned)."""
    with bz2.open(path, "rt", encoding="utf-8") as handle:
        lines = handle.read().rstrip("\n").split("\n")
    if len(lines) % 6:
        raise DataError(f"{path}: {len(lines)} lines is not a multiple of 6 (context, label, 4 endings per item)")
    return [
        {"text": lines[i], "label": int(lines[i + 1]), "endings": lines[i + 2 : i + 6]} for i in range(0, len(lines), 6)
    ]


def load_hellaswag(**_: Any) -> datasets.DatasetDict:
    """HellaSwag validation with the stock ``process_docs`` fields (``query``, ``choices``, ``gold``)."""
    return _dataset(validation=[process_hellaswag(doc) for doc in read_hellaswag(data_file(HELLASWAG_FILE))])


def process_hellaswag(doc: dict[str, Any]) -> dict[str, Any]:
    """The stock fields through the stock ``preprocess``, after restoring ``ctx_b``'s capital letter."""
    return {
        "query": hellaswag_preprocess(capitalize_ctx_b(doc["text"])),
        "choices": [hellaswag_preprocess(ending) for ending in doc["endings"]],
        "gold": doc["label"],
    }


def capitalize_ctx_b(text: str) -> str:
    """Redo the stock ``ctx_b.capitalize()``: the file keeps ``ctx`` (= ``ctx_a + " " + ctx_b``) as is.

    ``ctx_b`` is the unfinished sentence that ends an ActivityNet context ("... on a roof. he"); WikiHow contexts
    end in a full sentence and have an empty ``ctx_b``. So a context that does not end in sentence punctuation
    gets its last fragment capitalized exactly as ``str.capitalize`` does (first letter up, the rest lowered).
    """
    if re.search(r"[.!?\"')\]]\s*$", text):
        return text
    fragment = _SENTENCE_END.split(text)[-1]
    return text[: len(text) - len(fragment)] + fragment.capitalize()


# --------------------------------------------------------------------------------------------------- WinoGrande
def load_winogrande(**_: Any) -> datasets.DatasetDict:
    """WinoGrande 1.1 dev (= ``winogrande_xl`` validation) with the answers of ``dev-labels.lst``."""
    rows = _jsonl(data_file("winogrande/dev.jsonl"))
    labels = data_file("winogrande/dev-labels.lst").read_text(encoding="utf-8").split()
    if len(labels) != len(rows):
        raise DataError(f"winogrande: {len(rows)} items in dev.jsonl but {len(labels)} labels in dev-labels.lst")
    for row, label in zip(rows, labels, strict=True):
        if row.setdefault("answer", label) != label:
            raise DataError(f"winogrande: item {row.get('qID')} answers {row['answer']} in dev.jsonl, {label} in .lst")
    fields = ("sentence", "option1", "option2", "answer")
    return _dataset(validation=[{k: row[k] for k in fields} for row in rows])


# --------------------------------------------------------------------------------------------------- LAMBADA
def load_lambada(**_: Any) -> datasets.DatasetDict:
    """LAMBADA, OpenAI variant (= ``EleutherAI/lambada_openai`` default test)."""
    return _dataset(test=[{"text": row["text"]} for row in _jsonl(data_file("lambada/lambada_test.jsonl"))])


# --------------------------------------------------------------------------------------------------- ARC
def _arc_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for row in _jsonl(path):
        choices = row["question"]["choices"]
        rows.append(
            {
                "id": row["id"],
                "question": row["question"]["stem"],
                "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]},
                "answerKey": row["answerKey"],
            }
        )
    return rows


def load_arc_challenge(**_: Any) -> datasets.DatasetDict:
    """AI2 ARC-Challenge test/dev in the ``allenai/ai2_arc`` schema (digit answer keys come with digit labels)."""
    return _dataset(
        test=_arc_rows(data_file("arc/ARC-Challenge-Test.jsonl")),
        validation=_arc_rows(data_file("arc/ARC-Challenge-Dev.jsonl")),
    )


# --------------------------------------------------------------------------------------------------- MMLU
def _mmlu_rows(path: Path, subject: str) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8", newline="") as handle:
        for n, record in enumerate(csv.reader(handle), 1):
            if len(record) != 6 or record[5] not in MMLU_LETTERS:
                raise DataError(f"{path}:{n}: expected question, 4 choices and an answer letter A-D")
            rows.append(
                {
                    "question": record[0],
                    "subject": subject,
                    "choices": record[1:5],
                    "answer": MMLU_LETTERS.index(record[5]),
                }
            )
    return rows


def load_mmlu(subject: str, **_: Any) -> datasets.DatasetDict:
    """One MMLU subject in the ``cais/mmlu`` schema: ``test`` (scored) and ``dev`` (the 5 few-shot examples)."""
    return _dataset(
        test=_mmlu_rows(data_file(f"mmlu/test/{subject}_test.csv"), subject),
        dev=_mmlu_rows(data_file(f"mmlu/dev/{subject}_dev.csv"), subject),
    )


# --------------------------------------------------------------------------------------------------- WikiText
def split_wikitext_articles(raw: str) -> list[str]:
    """Cut WikiText raw text into articles, as ``EleutherAI/wikitext_document_level`` does.

    A new article starts at every top-level title line (`` = Title = `` once ``= =``/``= = =`` runs are joined);
    an article is its lines joined by ``\\n`` up to the next title; text before the first title is dropped when
    blank. ``wiki.test.raw`` gives 62 articles.
    """
    articles: list[str] = []
    current: list[str] = []
    for line in raw.split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            page = "\n".join(current)
            if page.strip():
                articles.append(page)
            current = []
        current.append(line)
    articles.append("\n".join(current))
    return articles


def load_wikitext(**_: Any) -> datasets.DatasetDict:
    """WikiText-2 raw test as article documents (field ``page``, like ``wikitext_document_level``)."""
    raw = data_file("wikitext2/wiki.test.raw").read_text(encoding="utf-8")
    return _dataset(test=[{"page": page} for page in split_wikitext_articles(raw)])
