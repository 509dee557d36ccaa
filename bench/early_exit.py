"""Early exit and a quantized KV cache under W4A4, on the embedded tiny Ouro teacher and WikiText-2.

Every number is teacher-forced cached decoding (:func:`loopq.metrics.decoding.decode_perplexity`): the first
``--windows`` non-overlapping ``--seq_len``-token windows of the WikiText-2 PTQ test stream, each decoded one token
per forward against the per-(loop, layer) cache, scored on the next token.

(a) **early exit**: per model (FP teacher, the calibrated LoopQ W4A4 ``--student``, RTN W4A4 built from the teacher,
    and an ``--exported`` packed model when given) and ``--thresholds``: perplexity, average loops used per token,
    and against the FP teacher at the same threshold the fraction of tokens with the same exit loop and the mean
    |exit-loop difference|; wall-clock ms per decode step (all windows' rows together; noisy on a shared CPU).
    "none" is the plain cached decode (every token runs all loops). "upstream": the same threshold as upstream's
    ``OuroForCausalLM`` applies it - one full forward running every loop for every token and reading each token out
    at its exit - its perplexity, and the fraction of tokens whose skipping exit equals it.
(b) **KV cache bits**: per model (FP, LoopQ W4A4) and ``--kv_bits``: perplexity and the bytes the cache stores per
    token (codes + scales, all loops and layers), measured on the cache itself.

    python bench/early_exit.py --student /tmp/ee/tiny/student [--exported DIR] [--windows 8] [--seq_len 256]
    python bench/early_exit.py --teacher loopq/assets/tiny-ouro-outliers --student /tmp/ee/stress/student
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopq.artifacts import load_artifact
from loopq.commands.evaluate import build, parse_model_method
from loopq.data.tokenizer import load_tokenizer
from loopq.metrics.decoding import DecodeResult, decode_perplexity
from loopq.metrics.perplexity import token_windows, wikitext2_stream, window_nll
from loopq.models import LoopLM
from loopq.paths import REPO_ROOT

TEACHER = REPO_ROOT / "loopq" / "assets" / "tiny-ouro"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--teacher", type=Path, default=TEACHER, help="FP teacher (the student's; RTN is built from it)"
    )
    parser.add_argument("--student", type=Path, required=True, help="calibrated LoopQ student (python -m loopq.fit)")
    parser.add_argument("--exported", type=Path, default=None, help="its export (python -m loopq.export), optional")
    parser.add_argument("--windows", type=int, default=8, help="WikiText-2 windows decoded")
    parser.add_argument("--seq_len", type=int, default=256, help="tokens per window")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9, 1.0])
    parser.add_argument("--kv_bits", type=int, nargs="+", default=[16, 8, 4])
    parser.add_argument("--out", type=Path, default=None, help="write the raw numbers as JSON here")
    return parser.parse_args(argv)


def models(teacher: Path, student: Path, exported: Path | None) -> dict[str, LoopLM]:
    """The FP teacher, the LoopQ student, RTN W4A4 (training-free, from the teacher) and the export if given."""
    found = {
        "FP": load_artifact(teacher, kind="teacher").model,
        "LoopQ W4A4": load_artifact(student, kind="student").model,
        "RTN W4A4": build(str(teacher), None, None, parse_model_method("RTN", "w4a4"))[0],
    }
    if exported is not None:
        found["LoopQ W4A4 (exported)"] = load_artifact(exported, kind="export").model
    return {name: model.eval() for name, model in found.items()}


def upstream_threshold(model: LoopLM, windows: Tensor, threshold: float | None) -> tuple[float, Tensor]:
    """Perplexity and exit loops of upstream's threshold mode: one full forward, every loop run for every token,
    logits read out at each token's exit (no skipping, no copied cache slots)."""
    if threshold is None:
        return float("nan"), torch.empty(0)
    with torch.inference_mode():
        out = model(windows, exit_mode="threshold", exit_threshold=threshold)
    return math.exp(window_nll(out.logits, windows) / (windows.shape[0] * (windows.shape[1] - 1))), out.extras[
        "exit_steps"
    ]


def agreement(exits: Tensor, reference: Tensor) -> tuple[float, float]:
    """Fraction of tokens with the same exit loop as ``reference``, and the mean |loop difference|."""
    return float((exits == reference).float().mean()), float((exits - reference).abs().float().mean())


def exit_table(named: dict[str, LoopLM], windows: Tensor, thresholds: list[float | None]) -> list[dict]:
    rows = []
    for threshold in thresholds:
        fp: DecodeResult | None = None
        for name, model in named.items():
            start = time.perf_counter()
            result = decode_perplexity(model, windows, exit_threshold=threshold)
            ms = (time.perf_counter() - start) * 1000 / windows.shape[1]
            fp = result if name == "FP" else fp
            same, diff = agreement(result.exit_loops, fp.exit_loops) if fp is not None else (1.0, 0.0)
            up_ppl, up_exits = upstream_threshold(model, windows, threshold)
            up_same = agreement(result.exit_loops, up_exits)[0] if up_exits.numel() else float("nan")
            rows.append(
                {"threshold": threshold, "model": name, "ppl": result.ppl, "loops": result.mean_loops}
                | {"same_exit": same, "exit_diff": diff, "ms_per_step": ms, "upstream_ppl": up_ppl}
                | {"same_exit_as_upstream": up_same}
            )
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def kv_table(named: dict[str, LoopLM], windows: Tensor, kv_bits: list[int]) -> list[dict]:
    rows = []
    for name in ("FP", "LoopQ W4A4"):
        for bits in kv_bits:
            result = decode_perplexity(named[name], windows, kv_bits=bits)
            per_token = result.cache_bytes / (min(8, windows.shape[0]) * windows.shape[1])
            rows.append({"model": name, "kv_bits": bits, "ppl": result.ppl, "bytes_per_token": per_token})
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def markdown(exits: list[dict], kv: list[dict], windows: Tensor) -> str:
    n, s = windows.shape
    lines = [
        f"{n} windows x {s} tokens ({n * (s - 1)} predictions), teacher-forced cached decoding",
        "",
        "| threshold | model | ppl | loops/token | same exit as FP | mean abs loop diff | ms/step "
        "| upstream ppl | same exit as upstream |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in exits:
        t = "none" if r["threshold"] is None else f"{r['threshold']:g}"
        lines.append(
            f"| {t} | {r['model']} | {r['ppl']:.2f} | {r['loops']:.2f} | {r['same_exit']:.3f} | {r['exit_diff']:.3f} "
            f"| {r['ms_per_step']:.1f} | {r['upstream_ppl']:.2f} | {r['same_exit_as_upstream']:.3f} |"
        )
    base = {r["model"]: r["bytes_per_token"] for r in kv if r["kv_bits"] == 16}
    lines += ["", "| model | kv bits | ppl | cache bytes/token | vs fp32 cache |", "|---|---|---|---|---|"]
    for r in kv:
        ratio = base[r["model"]] / r["bytes_per_token"] if r["model"] in base else float("nan")
        bits = "16 (unquantized: fp32)" if r["kv_bits"] == 16 else r["kv_bits"]
        lines.append(f"| {r['model']} | {bits} | {r['ppl']:.2f} | {r['bytes_per_token']:.0f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.teacher / "tokenizer.json")
    windows = token_windows(wikitext2_stream(tokenizer), args.seq_len)[: args.windows]
    named = models(args.teacher, args.student, args.exported)
    for model in named.values():  # warm-up, so that the first timed decode does not pay one-time set-up
        decode_perplexity(model, windows[:1, :4], exit_threshold=0.5)
    exits = exit_table(named, windows, [None, *args.thresholds])
    kv = kv_table(named, windows, args.kv_bits)
    if args.out is not None:
        args.out.write_text(json.dumps({"early_exit": exits, "kv_cache": kv}, indent=1))
    table = markdown(exits, kv, windows)
    print(table)
    return table


if __name__ == "__main__":
    main()
