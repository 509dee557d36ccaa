"""The report's PNG figures (matplotlib, imported only here): Fig. 2 loop errors, Fig. 3 SLT selection, Fig. 4/6
perplexity vs SLT budget / calibration set size, Fig. 5 perplexity vs loop count, and mu_t over calibration."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from loopq.commands.report.inputs import Result, Run, last_loop_column, slug, val_sets
from loopq.commands.report.seeds import per_seed
from loopq.files import StagedFiles
from loopq.stats import summarize

#: SLT candidate groups per shared layer, in model order (Ouro); other architectures use the names found
OURO_KINDS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_gate", "mlp.down_proj")
#: sweep field of a result -> (figure file, figure number)
SWEEP_FIELDS = {"slt_budget": ("fig4_ppl_vs_slt_budget.png", 4), "num_samples": ("fig6_ppl_vs_num_samples.png", 6)}


#: figures of every report (the sweeps' are in SWEEP_FIELDS); :func:`run_figures` names those of one run
LOOP_SWEEP_FIGURE = "fig5_ppl_vs_loops.png"


def run_figures(name: str) -> dict[str, str]:
    """The file names of one run's figures, by figure: loop errors (Fig. 2), SLT selection (Fig. 3), mu_t and the
    held-out validation curves."""
    return {
        "errors": f"fig2_loop_errors_{slug(name)}.png",
        "slt": f"fig3_slt_selection_{slug(name)}.png",
        "mu": f"mu_{slug(name)}.png",
        "validation": f"validation_{slug(name)}.png",
    }


def figure_files(run_names: Sequence[str]) -> list[str]:
    """Every figure a report of runs named ``run_names`` may write."""
    fixed = [LOOP_SWEEP_FIGURE, *(name for name, _ in SWEEP_FIELDS.values())]
    return fixed + [file for name in run_names for file in run_figures(name).values()]


def save(fig: Figure, out: StagedFiles, name: str) -> Path:
    """Stage ``fig``, laid out tight, as the PNG ``name`` of the report (renamed into place with the report itself);
    returns the path it will have."""
    FigureCanvasAgg(fig)
    fig.tight_layout()
    out.write(name, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    return out.directory / name


def heatmap(
    ax: Any, fig: Figure, values: np.ndarray, fmt_cell: Callable[[float], str], label: str, integer: bool = False
) -> None:
    """``imshow`` of ``values`` with a colorbar; NaN cells light grey, cell values written on small grids."""
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#eeeeee")
    im = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=cmap)
    bar = fig.colorbar(im, ax=ax, label=label)
    if integer:
        bar.locator = MaxNLocator(integer=True)
        bar.update_ticks()
    if values.size <= 120:
        finite = values[np.isfinite(values)]
        mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
        for (i, j), v in np.ndenumerate(values):
            if np.isfinite(v):
                ax.text(j, i, fmt_cell(v), ha="center", va="center", fontsize=7, color="w" if v < mid else "k")


def plot_loop_errors(run: Run, out: StagedFiles) -> Path:
    """Fig. 2: relative l2 error of every shared layer (x) at every loop (y)."""
    errors = np.array(run.errors, dtype=float)
    fig = Figure(figsize=(max(4.0, 0.6 * errors.shape[1] + 2.5), max(2.5, 0.45 * errors.shape[0] + 1.5)))
    ax = fig.add_subplot()
    heatmap(ax, fig, errors, lambda v: f"{v:.3f}", "relative l2 error")
    ax.set_xticks(range(errors.shape[1]))
    ax.set_yticks(range(errors.shape[0]), [str(t) for t in range(1, errors.shape[0] + 1)])
    ax.set_xlabel("shared layer")
    ax.set_ylabel("loop")
    ax.set_title(f"{run.name}: layer x loop error (step {run.errors_step})", fontsize=9)
    return save(fig, out, run_figures(run.name)["errors"])


def slt_matrix(run: Run) -> tuple[np.ndarray, list[str], list[str]]:
    """``(order[layer, kind], kinds, unplaced)``: 1-based selection order of every promoted group (NaN: shared)."""
    placed: list[tuple[int, str, int]] = []
    unplaced = []
    for order, name in enumerate(run.promoted, start=1):
        match = re.search(r"(?:^|\.)(\d+)\.(.+)$", name)
        if match:
            placed.append((int(match.group(1)), match.group(2), order))
        else:
            unplaced.append(name)
    found = list(dict.fromkeys(kind for _, kind, _ in placed))
    is_ouro = (run.meta or {}).get("arch") == "ouro" or any(k in OURO_KINDS for k in found)
    kinds = [*OURO_KINDS, *(k for k in found if k not in OURO_KINDS)] if is_ouro else found
    layers = max([len(run.errors[0]) if run.errors else 0] + [layer + 1 for layer, _, _ in placed])
    matrix = np.full((layers, len(kinds)), np.nan)
    for layer, kind, order in placed:
        matrix[layer, kinds.index(kind)] = order
    return matrix, kinds, unplaced


def plot_slt(run: Run, out: StagedFiles) -> Path:
    """Fig. 3: which groups SLT promoted to loop-dependent transforms, and in which order."""
    matrix, kinds, _ = slt_matrix(run)
    fig = Figure(figsize=(max(4.0, 1.2 * len(kinds) + 2.0), max(2.5, 0.35 * matrix.shape[0] + 1.5)))
    ax = fig.add_subplot()
    heatmap(ax, fig, matrix, lambda v: str(int(v)), "selection order", integer=True)
    ax.set_xticks(range(len(kinds)), kinds, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(matrix.shape[0]))
    ax.set_ylabel("layer")
    ax.set_title(f"{run.name}: SLT selection ({len(run.promoted)} groups)", fontsize=9)
    return save(fig, out, run_figures(run.name)["slt"])


def plot_mu(run: Run, out: StagedFiles) -> Path:
    """mu_t (pull of loop t toward the final teacher state) over calibration steps."""
    mu = np.array(run.mu, dtype=float)
    fig = Figure(figsize=(5.5, 3.2))
    ax = fig.add_subplot()
    for t in range(mu.shape[1]):
        ax.plot(run.mu_steps, mu[:, t], marker="o", markersize=3, label=f"mu_t{t}")
    ax.set_xlabel("step")
    ax.set_ylabel("mu_t")
    ax.set_title(f"{run.name}: adaptive mu_t", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return save(fig, out, run_figures(run.name)["mu"])


def plot_validation(run: Run, out: StagedFiles) -> Path:
    """Held-out curves over calibration: the student's full-vocabulary KL to the teacher (left) and its last-loop
    perplexity against FP's (right), per held-out set. KL rising while the training loss falls is overfitting."""
    fig = Figure(figsize=(9.0, 3.2))
    kl_ax, ppl_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name in val_sets(run):
        kl_ax.plot(run.val_steps, run.val[f"val/{name}/kl_full"], marker="o", markersize=3, label=name)
        line = ppl_ax.plot(run.val_steps, run.val[last_loop_column(run, name)], marker="o", markersize=3, label=name)
        fp = run.val[last_loop_column(run, name, "fp_ppl_loop")]
        ppl_ax.plot(run.val_steps, fp, linestyle="--", color=line[0].get_color(), label=f"{name} FP")
    for ax, label in ((kl_ax, "KL(teacher || student) per token"), (ppl_ax, "last-loop perplexity")):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{run.name}: held-out validation", fontsize=9)
    return save(fig, out, run_figures(run.name)["validation"])


def series_points(
    results: Sequence[Result], x: Callable[[Result], float | None], split: Callable[[Result], Any] = lambda r: None
) -> dict[tuple[Any, ...], list[tuple[float, float]]]:
    """``{(model, method, bits, split): sorted [(x, ppl)]}`` for series with two or more distinct x; several results
    at one x are combined as in Table 1 (:func:`~loopq.commands.report.seeds.per_seed`: the mean over seeds)."""
    series: dict[tuple[Any, ...], dict[float, list[Result]]] = {}
    for r in results:
        xv = x(r)
        if xv is not None and r.data.get("wikitext2_ppl") is not None:
            series.setdefault((*r.series, split(r)), {}).setdefault(xv, []).append(r)
    return {k: sorted((xv, mean_ppl(found)) for xv, found in v.items()) for k, v in series.items() if len(v) >= 2}


def mean_ppl(found: Sequence[Result]) -> float:
    """The WikiText-2 perplexity of one figure point: the mean over the seeds of ``found``."""
    return summarize([r.data["wikitext2_ppl"] for r in per_seed(found)]).mean


def plot_series(
    ax: Any, series: dict[tuple[Any, ...], list[tuple[float, float]]], split_name: str | None = None
) -> None:
    """One line per (model, method, bits, split) series; log y when the values span more than 10x."""
    top = 1.0
    several_models = len({k[0] for k in series}) > 1
    for (model, method, bits, split), points in series.items():
        label = f"{model}: " if several_models else ""
        label += f"{method} {bits}" + (f" ({split_name}={split})" if split is not None else "")
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", markersize=4, label=label)
        finite = [y for y in ys if math.isfinite(y) and y > 0]
        top = max(top, max(finite) / min(finite)) if finite else top
    if top > 10:
        ax.set_yscale("log")
    ax.set_ylabel("WikiText-2 perplexity (PTQ)")
    ax.grid(alpha=0.3)


def plot_loop_sweep(
    series: dict[tuple[Any, ...], list[tuple[float, float]]], calibrated: dict[str, set[int]], out: StagedFiles
) -> Path:
    """Fig. 5: perplexity vs loop count, one panel per model; the calibrated loop count dashed."""
    models = list(dict.fromkeys(k[0] for k in series))
    fig = Figure(figsize=(5.5 * len(models), 3.6))
    for i, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), i + 1)
        plot_series(ax, {k: v for k, v in series.items() if k[0] == model})
        for t in sorted(calibrated.get(model, ())):
            ax.axvline(t, color="grey", linestyle="--", linewidth=1, label=f"calibrated T={t}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
        ax.set_xlabel("loops at inference")
        ax.set_title(model, fontsize=9)
    return save(fig, out, LOOP_SWEEP_FIGURE)


def plot_sweep(
    series: dict[tuple[Any, ...], list[tuple[float, float]]], key: str, other: str, out: StagedFiles
) -> Path:
    """Fig. 4 / Fig. 6: perplexity vs ``slt_budget`` / ``num_samples``."""
    fig = Figure(figsize=(5.5, 3.6))
    ax = fig.add_subplot()
    plot_series(ax, series, split_name=other)
    ax.legend(fontsize=7)
    ax.set_xlabel({"slt_budget": "SLT-selected groups", "num_samples": "calibration samples"}.get(key, key))
    if key == "num_samples":
        ax.set_xscale("log", base=2)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"perplexity vs {key}", fontsize=9)
    return save(fig, out, SWEEP_FIELDS[key][0])
