"""The paper's benchmarks as offline lm-eval tasks (YAMLs in this folder, loaders in ``utils.py``).

``task_manager()`` indexes only this folder (~0.05 s, instead of ~11 s for lm-eval's whole task tree);
``loopq_paper`` is the group of all six tasks, and :data:`PAPER_METRICS` names the seven numbers of the paper's
Table 1 inside lm-eval's results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval.tasks import TaskManager

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


def paper_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The paper's seven numbers from ``simple_evaluate(...)["results"]`` (missing tasks are left out)."""
    found = {}
    for column, (task, metric) in PAPER_METRICS.items():
        value = results.get(task, {}).get(f"{metric},none")
        if value is not None:
            found[column] = float(value)
    return found
