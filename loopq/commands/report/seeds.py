"""Several results of one Table-1 cell or figure point (same model, method, bits and loops): which are kept, and how
they are combined, independent of the order the files were given in.

* A result read off a loop sweep (:attr:`~loopq.commands.report.inputs.Result.sweep_derived`: ``experiments loops``,
  no lm-eval columns) never replaces one evaluated as such; it is used only where there is no other.
* Of the results of one seed, the later file wins (a re-evaluation).
* Results of different seeds (``loopq.experiments --seeds``: ``loopq-w4a4-s0.json``, ``-s1`` ...) are averaged:
  every number is the mean over the seeds that have it, with its sample std and count in
  :attr:`~loopq.commands.report.inputs.Result.spread` (Table 1 shows ``mean ± std (n=k)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from loopq.commands.report.inputs import PTQ_COLUMN, Result
from loopq.stats import Summary, summarize

#: the :attr:`Result.spread` key of the perplexity after loop ``t`` (1-based)
LOOP_KEY = "t={}"


def per_seed(found: Sequence[Result], notes: list[str] | None = None) -> list[Result]:
    """One result per seed of ``found`` (results of one cell), in seed order: the evaluated ones over the loop-sweep
    ones, then the later file of each seed; what is left out is noted in ``notes``."""
    kept = [r for r in found if not r.sweep_derived] or list(found)
    chosen: dict[int | None, Result] = {}
    for r in kept:
        if r.seed in chosen and notes is not None:
            notes.append(f"`{r.path}` replaces `{chosen[r.seed].path}` (same model, method, bits and loops)")
        chosen[r.seed] = r
    if notes is not None:
        for r in found:
            if r not in kept:
                notes.append(f"`{r.path}` (from a loop sweep) is not in Table 1: `{kept[0].path}` is evaluated as such")
    return [chosen[seed] for seed in sorted(chosen, key=lambda seed: (seed is not None, seed or 0))]


def combine(found: Sequence[Result], notes: list[str] | None = None) -> Result:
    """The result of one cell: its single result, or the mean over its seeds (:func:`mean_result`)."""
    picked = per_seed(found, notes)
    if len(picked) == 1:
        return picked[0]
    if notes is not None:
        seeds = ", ".join("none" if r.seed is None else str(r.seed) for r in picked)
        first = picked[0]
        notes.append(
            f"{first.model}: {first.method} {'fp' if first.is_fp else first.bits} at T={first.num_loops} is the mean "
            f"over seeds {seeds} ({', '.join(f'`{r.path.name}`' for r in picked)})"
        )
    return mean_result(picked)


def mean_result(results: Sequence[Result]) -> Result:
    """``results`` (one per seed) as one: every Table-1 number and per-loop perplexity the mean over those that have
    it, its :class:`~loopq.stats.Summary` in ``spread``."""
    spread: dict[str, Summary] = {}
    columns = dict.fromkeys([PTQ_COLUMN, *(c for r in results for c in metrics_of(r))])
    for column in columns:
        values = [v for r in results if (v := r.value(column)) is not None]
        if values:
            spread[column] = summarize(values)
    per_loop: list[float] = []
    for t in range(max(len(loops_of(r)) for r in results)):
        values = [loops_of(r)[t] for r in results if len(loops_of(r)) > t]
        spread[LOOP_KEY.format(t + 1)] = summarize(values)
        per_loop.append(spread[LOOP_KEY.format(t + 1)].mean)
    data = {**results[0].data, "wikitext2_ppl": spread[PTQ_COLUMN].mean if PTQ_COLUMN in spread else None}
    data["wikitext2_per_loop_ppl"] = per_loop
    means = {c: s.mean for c, s in spread.items() if c in columns and c != PTQ_COLUMN}
    lm_eval = next((r.data["lm_eval"] for r in results if isinstance(r.data.get("lm_eval"), dict)), None)
    data["lm_eval"] = None if lm_eval is None else {**lm_eval, "paper_metrics": means}
    return dataclasses.replace(results[0], data=data, seed=None, spread=spread)


def loops_of(r: Result) -> list[float]:
    return r.data.get("wikitext2_per_loop_ppl") or []


def metrics_of(r: Result) -> dict[str, Any]:
    lm_eval = r.data.get("lm_eval")
    return (lm_eval.get("paper_metrics") or {}) if isinstance(lm_eval, dict) else {}
