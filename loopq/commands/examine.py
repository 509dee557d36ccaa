"""What a calibrated LoopQ student's loop-aware parts learned, and what each is worth after training.

    python -m loopq.examine results/small-ouro/runs/loopq-w4a4-s0 [--windows 32] [--json out.json]

The argument is a run directory (``RUN/student`` is read, and the SLT score history from ``RUN/checkpoints/
last.ckpt`` when it is there, loaded with ``weights_only=True``) or a student directory. Issue 18 asks, when a
component does not help, to find out why; retrained ablations (``loopq.experiments ablations``) say whether the rest
of the method compensates, this says what the component itself did:

- **mu_t**: the trajectory weights at the end of calibration (Eq. 8; :mod:`loopq.calib.mu`).
- **LAS** (§4.1): per looped group, the learned activation clip ratios c_t; ``spread`` = max_t c_t - min_t c_t.
- **SLT** (§4.2): the promoted groups in promotion order with S_l of their round and the largest S of the groups
  left shared, and how far each promoted group's per-loop transforms moved apart: the relative distance
  ||M_t - mean_t M_t||_F / ||mean_t M_t||_F of the effective input transforms M_t = diag(1/d_t) (P1_t (x) P2_t).
- **CTA** (§4.3): per transition t, rms(a_t - 1), rms(b_t), max|eta_t| and, on the evaluation windows, the relative
  change ||A_t(H) - H|| / ||H|| it makes to the state handed from loop t to loop t+1.
- **Knock-outs**: WikiText-2 perplexity of the student as trained and with one part replaced by its loop-shared
  counterpart *without retraining*: LAS clips by their mean over loops, promoted groups' per-loop parameters by
  their mean over loops, CTA by the identity. A knock-out that costs nothing means the part learned nothing the
  shared parameters did not already have.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from json import dumps
from pathlib import Path
from typing import Any

import torch
from jsonargparse.typing import PositiveInt
from torch import Tensor

from loopq.artifacts.layout import STUDENT_META
from loopq.artifacts.student import load_student
from loopq.calib.checkpoint_io import load_weights_only
from loopq.commands.cli import Command
from loopq.data.tokenizer import load_tokenizer
from loopq.errors import UsageError
from loopq.files import atomic_write
from loopq.metrics.perplexity import perplexity, token_windows, wikitext2_stream
from loopq.models.base import LoopLM
from loopq.planning.guards import check_output_file, is_examined
from loopq.quant.modules import QuantLinearGroup
from loopq.quant.prepare import looped_quant_groups
from loopq.quant.primitives import clip_ratio
from loopq.quant.transforms import KroneckerTransform

SEQ_LEN = 256


def student_dir(path: Path) -> Path:
    """``path`` itself when it is a student directory, else ``path/student`` (a run directory)."""
    for candidate in (path, path / "student"):
        if (candidate / STUDENT_META).is_file():
            return candidate
    raise UsageError(f"{path}: neither a LoopQ student nor a run directory with student/ (run python -m loopq.fit)")


def slt_history(run: Path) -> list[dict[str, Any]]:
    """The SharingGapReselection rounds saved in ``run/checkpoints/last.ckpt`` ([] when there is none)."""
    ckpt = run / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        return []
    state = load_weights_only(ckpt)
    for key, value in state.get("callbacks", {}).items():
        if key.startswith("SharingGapReselection") and isinstance(value, dict):
            return list(value.get("history", []))
    return []


def effective_transform(tr: KroneckerTransform) -> Tensor:
    """M = diag(1/d) (P1 (x) P2): the matrix the group's input is multiplied by (rows: input channels)."""
    p1, p2, _, _ = tr.matrices()
    return tr.activation(torch.eye(tr.n), p1, p2).detach()


def relative_spread(mats: list[Tensor]) -> float:
    """max_t ||M_t - mean M||_F / ||mean M||_F (0 when every loop has the same matrix)."""
    mean = torch.stack(mats).mean(0)
    return max(float((m - mean).norm() / mean.norm()) for m in mats)


def las_clips(groups: dict[str, QuantLinearGroup]) -> dict[str, list[float]]:
    return {name: clip_ratio(g.act_clip.detach()).tolist() for name, g in groups.items()}


def cta_parameters(student: LoopLM) -> list[dict[str, float]]:
    tr = student.transition
    if tr is None:
        return []
    with torch.no_grad():
        return [
            {
                "rms_a_minus_1": float((tr.a[t] - 1).pow(2).mean().sqrt()),
                "rms_b": float(tr.b[t].pow(2).mean().sqrt()),
                "max_abs_eta": float(tr.eta[t].abs().max()),
            }
            for t in range(tr.num_transitions)
        ]


@torch.no_grad()
def cta_effect(student: LoopLM, windows: Tensor) -> list[float]:
    """Per transition t, ||A_t(H) - H|| / ||H|| summed over ``windows``."""
    if student.transition is None:
        return []
    out = student(windows, return_trajectory=True)
    pairs = zip(out.loop_states, out.transition_states or [], strict=False)
    return [float((a - h).norm() / h.norm()) for h, a in pairs]


def mean_over_loops_(param: torch.nn.Parameter) -> None:
    """Replace every loop slot (dim 0) of ``param`` by the mean over slots."""
    with torch.no_grad():
        param.copy_(param.mean(0, keepdim=True).expand_as(param))


def knock_out_las(student: LoopLM) -> None:
    for g in looped_quant_groups(student).values():
        if g.act_clip.numel() > 1:
            mean_over_loops_(g.act_clip)


def knock_out_slt(student: LoopLM) -> None:
    for g in looped_quant_groups(student).values():
        if g.loop_transforms is not None:
            for params in zip(*(tr.parameters() for tr in g.loop_transforms), strict=True):
                mean = torch.stack([p.detach() for p in params]).mean(0)
                for p in params:
                    p.data.copy_(mean)
        if g.loop_weight_clip is not None:
            mean_over_loops_(g.loop_weight_clip)


def knock_out_cta(student: LoopLM) -> None:
    student.transition = None


KNOCK_OUTS: dict[str, Callable[[LoopLM], None]] = {
    "LAS -> mean clip": knock_out_las,
    "SLT -> mean transform": knock_out_slt,
    "CTA -> identity": knock_out_cta,
}


def knock_outs(student: LoopLM, stream: Tensor) -> dict[str, float]:
    """WikiText-2 perplexity as trained and with each part replaced (module doc), each on a fresh copy (a deep copy
    holds no cached quantized weights: ``QuantLinearGroup.__getstate__``)."""
    result = {"as trained": perplexity(student, stream, SEQ_LEN, batch_size=8).ppl}
    for label, knock in KNOCK_OUTS.items():
        variant = copy.deepcopy(student)
        knock(variant)
        result[label] = perplexity(variant, stream, SEQ_LEN, batch_size=8).ppl
    return result


def inspect(path: Path, windows: int, teacher: Path | None = None) -> dict[str, Any]:
    directory = student_dir(path)
    student, meta = load_student(directory, teacher_dir=teacher)
    student.eval()
    groups = looped_quant_groups(student)
    promoted = [n for n in meta["promoted"] if n in groups]
    tokenizer = load_tokenizer(teacher if teacher is not None else Path(meta["teacher"]))
    stream = torch.tensor(wikitext2_stream(tokenizer))[: windows * SEQ_LEN]
    if stream.numel() < SEQ_LEN:
        raise UsageError(f"--windows {windows}: needs at least one window of {SEQ_LEN} tokens")
    history = slt_history(path) if directory != path else []
    return {
        "student": str(directory),
        "mu": meta.get("mu"),
        "las_clips": las_clips(groups),
        "slt": {
            "promoted": promoted,
            "rounds": [
                {
                    "step": r["step"],
                    "selected": r["selected"],
                    "score": [r["scores"][s] for s in r["selected"]],
                    "largest_left": max((v for k, v in r["scores"].items() if k not in r["selected"]), default=None),
                    "median": float(torch.tensor(list(r["scores"].values())).median()),
                }
                for r in history
            ],
            "transform_spread": {
                n: relative_spread([effective_transform(tr) for tr in groups[n].loop_transforms])
                for n in promoted
                if groups[n].loop_transforms is not None
            },
        },
        "cta": {
            "parameters": cta_parameters(student),
            "relative_change": cta_effect(student, token_windows(stream, SEQ_LEN)[:4]),
        },
        "knock_outs": {"windows": int(stream.numel() // SEQ_LEN), "ppl": knock_outs(student, stream)},
    }


def las_table(clips: dict[str, list[float]]) -> list[str]:
    """Mean c_t per loop and the spread per group kind. A group with one clip (LAS off, not promoted) counts as
    that clip at every loop."""
    loops = max(len(c) for c in clips.values())
    full = {n: c * loops if len(c) == 1 else c for n, c in clips.items()}
    lines = ["| group kind | mean c_t per loop | median spread | max spread |", "|---|---|---:|---:|"]
    for kind in sorted({n.rsplit(".", 1)[-1] for n in full}):
        rows = torch.tensor([c for n, c in full.items() if n.endswith("." + kind)])
        spread = rows.max(1).values - rows.min(1).values
        per_loop = " / ".join(f"{c:.3f}" for c in rows.mean(0).tolist())
        lines.append(f"| {kind} | {per_loop} | {spread.median():.3f} | {spread.max():.3f} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Inside {result['student']}", ""]
    if result["mu"]:
        lines += ["mu_t (end of calibration): " + ", ".join(f"{m:.3f}" for m in result["mu"]), ""]
    lines += ["## LAS: activation clip ratio per loop", "", *las_table(result["las_clips"])]
    slt = result["slt"]
    lines += ["", "## SLT: promoted groups", "", "| round step | promoted | S_l | largest S left | median S |"]
    lines += ["|---:|---|---:|---:|---:|"]
    for r in slt["rounds"]:
        left = "-" if r["largest_left"] is None else f"{r['largest_left']:.4g}"
        score = ", ".join(f"{s:.4g}" for s in r["score"])
        lines.append(f"| {r['step']} | {', '.join(r['selected'])} | {score} | {left} | {r['median']:.4g} |")
    if not slt["rounds"]:
        lines.append(f"| - | {', '.join(slt['promoted']) or 'none'} | (no checkpoint history) | | |")
    lines += ["", "Per-loop transforms of the promoted groups, max_t ||M_t - mean M|| / ||mean M||:", ""]
    lines += [f"- {n}: {v:.4f}" for n, v in slt["transform_spread"].items()] or ["- (none promoted)"]
    cta = result["cta"]
    lines += ["", "## CTA: transitions", "", "| t -> t+1 | rms(a-1) | rms(b) | max abs eta | relative change of H |"]
    lines += ["|---|---:|---:|---:|---:|"]
    for t, (p, r) in enumerate(zip(cta["parameters"], cta["relative_change"], strict=False)):
        lines.append(
            f"| {t + 1} -> {t + 2} | {p['rms_a_minus_1']:.4f} | {p['rms_b']:.4f} | {p['max_abs_eta']:.4f} | {r:.4f} |"
        )
    ko = result["knock_outs"]
    base = ko["ppl"]["as trained"]
    lines += ["", f"## Knock-outs without retraining (WikiText-2, {ko['windows']} windows x {SEQ_LEN})", ""]
    lines += ["| student | ppl | vs as trained |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.2f} | {100 * (v / base - 1):+.2f} % |" for k, v in ko["ppl"].items()]
    return "\n".join(lines) + "\n"


def examine(
    path: Path, windows: PositiveInt = 32, json: Path | None = None, teacher: Path | None = None
) -> dict[str, Any]:
    """Print what a student's loop-aware parts learned as Markdown (module docstring); returns the numbers.

    Args:
        path: a run directory (RUN/student, RUN/checkpoints) or a student directory
        windows: WikiText-2 test windows for the knock-outs
        json: also write the numbers to this JSON file
        teacher: teacher directory of a student whose recorded teacher path is gone (same content hash)
    """
    if json is not None:  # before the work: a directory, a model's file or one of yours is refused, not replaced
        check_output_file(json, [teacher], key="--json", ours=is_examined, what="loopq.examine --json file")
    result = inspect(path, windows, teacher)
    print(markdown(result), end="")
    if json is not None:
        atomic_write(json, lambda p: p.write_text(dumps(result, indent=2) + "\n"))  # never a torn file
    return result


COMMAND = Command(examine, "loopq.examine", __doc__, positional=True)

build_parser, main = COMMAND.parser, COMMAND.run
