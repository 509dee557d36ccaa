"""The paper's benchmarks as offline lm-eval tasks (YAMLs in this folder, loaders in ``utils.py``).

``task_manager()`` indexes only this folder (~0.05 s, instead of ~11 s for lm-eval's whole task tree);
``loopq_paper`` is the group of all six tasks, and :data:`PAPER_METRICS` names the seven numbers of the paper's
Table 1 inside lm-eval's results.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lm_eval.tasks import TaskManager

from loopq.errors import UsageError

TASKS_DIR = Path(__file__).resolve().parent
PAPER_GROUP = "loopq_paper"

#: paper column -> (task or group, lm-eval metric); 0-shot; "acc_norm whenever available" (paper §5.1)
PAPER_METRICS: dict[str, tuple[str, str]] = {
    "HS": ("loopq_hellaswag", "acc_norm"),
    "WG": ("loopq_winogrande", "acc"),
    "LB": ("loopq_lambada", "acc"),
    "AC": ("loopq_arc_challenge", "acc_norm"),
    "MM": ("loopq_mmlu", "acc"),
    "WT2": ("loopq_wikitext", "word_perplexity"),
    "OP": ("loopq_lambada", "perplexity"),
}


def task_manager(**kwargs: Any) -> TaskManager:
    """A ``TaskManager`` over LoopQ's local tasks only (pass ``include_defaults=True`` for lm-eval's as well)."""
    kwargs.setdefault("include_defaults", False)
    return TaskManager(include_path=str(TASKS_DIR), **kwargs)


def check_tasks(tasks: Sequence[str], option: str = "--tasks") -> None:
    """Refuse task names this folder does not define, before any model is loaded (indexing the YAMLs takes
    ~0.05 s; lm-eval itself would only refuse them once the model is built and, in a pipeline, calibrated)."""
    known = task_manager().all_tasks
    unknown = [name for name in tasks if name not in known]
    if unknown:
        listed = [name for name in known if not name.startswith("loopq_mmlu_")]
        raise UsageError(
            f"{option}: unknown task(s) {unknown}; LoopQ's offline tasks are {listed} (plus the loopq_mmlu_* "
            "subjects), or none for perplexity only"
        )


def paper_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The paper's seven numbers from ``simple_evaluate(...)["results"]`` (missing tasks are left out)."""
    found = {}
    for column, (task, metric) in PAPER_METRICS.items():
        value = results.get(task, {}).get(f"{metric},none")
        if value is not None:
            found[column] = float(value)
    return found
