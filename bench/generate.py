"""Decode benchmark on the embedded tiny teacher: prefill / decode speed and memory, with and without the KV cache.

(a) **models x cache**: the FP teacher and its W4A4 and W4A8 exports (packed int4 weights; a student straight out of
    ``loopq.quant.prepare``, uncalibrated - speed does not depend on the calibration), one prompt of ``--prompt_len``
    tokens, ``--new_tokens`` greedy tokens. Prefill: tokens/s of the prompt's forward. Decode: generated tokens/s
    after one warm-up step, by decode mode: ``cache`` (one token's looped forward per step on the growing cache,
    :mod:`loopq.models.kv_cache`), ``static`` (the same on the preallocated cache, fixed shapes), ``graphs`` (that
    step replayed from one CUDA graph; on a CPU the eager static step, :mod:`loopq.models.static_decode`) or
    ``rerun`` (the full looped forward over prompt + generated tokens per step, as ``generate(use_cache=False)``).
    Peak memory above the state before the
    phase: ``torch.cuda.max_memory_allocated`` on GPU, on CPU the peak of the running sum of the tensor allocations
    ``torch.profiler`` records (as ``bench/calibration.py``), over the prefill and 8 decode steps.
(b) **prefix curve**: time per decoded token of the FP teacher after a prefix of 64, 256 and 1024 tokens in each
    mode, and the speed-up of the growing cache over the re-run (the issue's bar: >= 5x at 1024).

    python bench/generate.py [--device cuda] [--prompt_len 128] [--new_tokens 32] [--prefixes 64 256 1024]

Ratios come from one run on one machine. On CPU the exported models run the torch *reference* kernels (unpacking,
integer GEMM emulated in fp32), which are correct but not fast: their absolute CPU numbers say nothing about the
Triton kernels on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopq.artifacts import export_student, load_quantized, student_meta
from loopq.models import LoopLM, load_looplm
from loopq.models.kv_cache import LoopKVCache
from loopq.models.static_decode import StaticDecoder
from loopq.paths import REPO_ROOT
from loopq.quant import QuantConfig, prepare

TEACHER = REPO_ROOT / "loopq" / "assets" / "tiny-ouro"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--prompt_len", type=int, default=128, help="prompt tokens of (a)")
    parser.add_argument("--new_tokens", type=int, default=32, help="generated tokens of (a), >= 3")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[64, 256, 1024], help="prefix lengths of (b)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per prefix in (b)")
    return parser.parse_args(argv)


def exported(teacher: LoopLM, a_bits: int, root: Path, device: str) -> LoopLM:
    """The W4A{a_bits} export of an uncalibrated student of ``teacher``, written under ``root`` and loaded back."""
    student = prepare(teacher, QuantConfig(w_bits=4, a_bits=a_bits, group_size=32, transform_init="random", seed=0))
    meta = student_meta(student, TEACHER, root / f"student-a{a_bits}", [], [1.0] * student.calibrated_loops, None)
    return load_quantized(export_student(student, meta, root / f"export-a{a_bits}"), device=device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak memory allocated while ``fn`` runs, above what was allocated when it started."""
    if device.startswith("cuda"):
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated() - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return max(itertools.accumulate((e.self_cpu_memory_usage for e in events), initial=0))


#: how a decode step runs: the full forward re-run, the growing KV cache, the static cache (fixed shapes), the static
#: cache's step replayed from a CUDA graph (on a CPU the eager static step: loopq.models.static_decode)
MODES = ("rerun", "cache", "static", "graphs")


class Decoder:
    """Greedy decoding of one prompt, split into its prefill and its decode steps (``mode`` in :data:`MODES`;
    ``room``: decode steps the static cache has slots for)."""

    def __init__(self, model: LoopLM, ids: torch.Tensor, mode: str, room: int = 64) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.ids, self.mode = model, ids, mode
        self.cache = LoopKVCache.for_model(model, ids.shape[0]) if mode == "cache" else None
        self.static = (
            StaticDecoder(model, ids.shape[0], ids.shape[1] + room, graphs=mode == "graphs")
            if mode in ("static", "graphs")
            else None
        )
        self.token: torch.Tensor | None = None

    @torch.inference_mode()
    def prefill(self) -> None:
        if self.static is not None:
            logits = self.static.prefill(self.ids)
        else:
            logits = self.model(self.ids, cache=self.cache).logits
        self.token = logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            assert self.token is not None
            if self.static is not None:
                logits = self.static.step(self.token[:, 0])
            elif self.cache is not None:
                logits = self.model(self.token, cache=self.cache).logits
            else:
                self.ids = torch.cat([self.ids, self.token], dim=1)
                logits = self.model(self.ids).logits
            self.token = logits[:, -1].argmax(-1, keepdim=True)


def models_by_cache(models: dict[str, LoopLM], args: argparse.Namespace) -> None:
    print(f"(a) prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, batch 1, device {args.device}")
    print(
        f"    {'model':6} {'decode':7} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill MB':>11} {'decode MB':>10}"
    )
    ids = torch.randint(0, 2048, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).to(args.device)
    room = max(args.new_tokens, 9)  # the memory run decodes 8 tokens (+ the graph's capture)
    for (name, model), mode in itertools.product(models.items(), ("cache", "static", "graphs", "rerun")):
        Decoder(model, ids, mode, room).prefill()  # warm-up
        prefill = min(timed(Decoder(model, ids, mode, room).prefill, args.device) for _ in range(3))
        run = Decoder(model, ids, mode, room)
        run.prefill()
        run.decode(1)  # warm-up (the graph's capture)
        decode = timed(lambda run=run: run.decode(args.new_tokens - 2), args.device)
        mem = Decoder(model, ids, mode, room)
        prefill_mb = peak_bytes(mem.prefill, args.device) / 2**20
        decode_mb = peak_bytes(lambda mem=mem: mem.decode(8), args.device) / 2**20
        print(
            f"    {name:6} {mode:7} {args.prompt_len / prefill:14.1f} "
            f"{(args.new_tokens - 2) / decode:13.1f} {prefill_mb:11.2f} {decode_mb:10.2f}"
        )


def prefix_curve(model: LoopLM, args: argparse.Namespace) -> None:
    print(f"\n(b) FP teacher, ms per decoded token after a prefix (mean of {args.steps} steps)")
    print(f"    {'prefix':>6} {'cached':>9} {'static':>9} {'graphs':>9} {'re-run':>9} {'speed-up':>9}")
    for prefix in args.prefixes:
        ids = torch.randint(0, 2048, (1, prefix), generator=torch.Generator().manual_seed(prefix)).to(args.device)
        per_token = {}
        for mode in ("cache", "static", "graphs", "rerun"):
            run = Decoder(model, ids, mode, args.steps + 1)
            run.prefill()
            run.decode(1)  # warm-up
            per_token[mode] = timed(lambda run=run: run.decode(args.steps), args.device) / args.steps * 1e3
        cells = " ".join(f"{per_token[m]:9.2f}" for m in ("cache", "static", "graphs", "rerun"))
        print(f"    {prefix:6d} {cells} {per_token['rerun'] / per_token['cache']:8.1f}x")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.new_tokens < 3:
        raise SystemExit("--new_tokens must be >= 3 (one warm-up step, then the timed ones)")
    teacher = load_looplm(TEACHER).to(args.device).eval()
    longest = max([*args.prefixes, args.prompt_len]) + max(args.new_tokens, args.steps + 1)
    if longest > teacher.max_positions:
        raise SystemExit(f"--prefixes/--prompt_len + decoded tokens exceed the teacher's {teacher.max_positions}")
    with tempfile.TemporaryDirectory() as tmp:
        cpu_teacher = load_looplm(TEACHER).eval()
        models = {"FP": teacher, **{f"W4A{a}": exported(cpu_teacher, a, Path(tmp), args.device) for a in (4, 8)}}
    models_by_cache(models, args)
    prefix_curve(teacher, args)


if __name__ == "__main__":
    main()
