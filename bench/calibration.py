"""Calibration benchmark on the embedded tiny teacher: step time against the FP model, memory against loop count.

Both measurements use one batch of the calibration data (``data.batch_size`` x ``data.seq_len`` of
``configs/tiny.yaml``: 4 x 128 tokens by default) and the LoopQ student of ``configs/tiny.yaml`` (W4A4, group 32,
LAS, CTA rank 8, its SLT budget promoted so the step is the end-of-calibration one):

(a) **step time ratio** = one calibration step (student forward over the true recurrence + LoopQ loss via
    ``LoopQCalibration.compute_loss`` + backward + gradient clipping + AdamW step) / one forward+backward of the
    FP teacher (its parameters temporarily ``requires_grad``; loss: next-token cross-entropy). Target <= 2.0x.
(b) **peak memory growth** = peak memory of one calibration step at 2T loops / at T loops (T = the teacher's
    trained loop count; the teacher targets are computed for 2T loops by loop extrapolation), with per-loop
    activation checkpointing (``model.checkpoint_loops``) on and off. Target <= 1.5x with checkpointing.
    Memory: on GPU ``torch.cuda.max_memory_allocated`` above what was allocated before the step; on CPU the peak
    of the running sum of every tensor allocation and free recorded by ``torch.profiler`` (``profile_memory``)
    during the step - also memory above what existed before it (parameters, teacher, cached targets excluded).

    OMP_NUM_THREADS=1 python bench/calibration.py [--iters 10] [--batch 4] [--seq 128 256 512] [--loops 4]
    OMP_NUM_THREADS=1 python bench/calibration.py --width 2048 [--layers 1]   # Ouro-1.4B's layer shapes

``--width H`` replaces the tiny teacher by a randomly initialised Ouro teacher with a production layer shape
(hidden H, MLP 2.75 H, H / 128 heads; Ouro-1.4B and 2.6B: H = 2048, MLP 5632, 16 heads) and ``--layers`` layers,
the tiny tokenizer's 2048-token vocabulary and the same calibration batch. At the tiny teacher's hidden 128 every
per-loop activation op is dispatch-bound (a few microseconds of work behind ~10 us of overhead); at a real width the
GEMMs dominate, which is what the step-time ratio of a real calibration is made of. Weight values do not change the
cost of a step, so random weights measure it as well as trained ones.

(a) runs for each ``--seq`` (tokens per step = batch x seq: the per-op overhead of the fake-quant chain on
small tensors weighs less as the step grows); (b) uses the first ``--seq``. Student and teacher steps are
timed alternately (one of each per iteration) so a change of machine load hits both; times are medians over
``--iters`` iterations after warm-up. The numbers of a run are kept in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopq.calib.module import LoopQCalibration, load_teacher
from loopq.calib.targets import compute_targets
from loopq.data.calibration import CalibrationDataModule
from loopq.models.loading import read_config
from loopq.models.ouro import OuroLM
from loopq.paths import ASSETS
from loopq.quant import QuantConfig, init_clipping_from_data, looped_quant_groups

TEACHER = str(ASSETS / "tiny-ouro")  # also the tokenizer of every run (--width teachers share its vocabulary)
QUANT = {"w_bits": 4, "a_bits": 4, "group_size": 32, "las": True, "slt_budget": 2, "cta": True, "cta_rank": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10, help="timed steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="samples per step (configs/tiny.yaml: 4)")
    parser.add_argument(
        "--seq", type=int, nargs="+", default=[128, 256, 512], help="tokens per sample (configs/tiny.yaml: 128)"
    )
    parser.add_argument("--loops", type=int, default=None, help="T (default: the teacher's trained loop count)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=None, help="hidden size of a random Ouro teacher (e.g. 2048)")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the --width teacher")
    parser.add_argument("--no-memory", action="store_true", help="skip (b)")
    parser.add_argument("--compile", action="store_true", help="also time model.compile_quantizers: true")
    return parser.parse_args(argv)


def synthetic_teacher(width: int, layers: int, directory: Path) -> str:
    """A random Ouro teacher with the tiny teacher's config but hidden ``width``, MLP 2.75x, heads of 128."""
    config = {
        **read_config(Path(TEACHER)),
        "hidden_size": width,
        "intermediate_size": int(2.75 * width),
        "num_attention_heads": max(1, width // 128),
        "num_key_value_heads": max(1, width // 128),
        "num_hidden_layers": layers,
    }
    model = OuroLM.from_config(config, seed=0)
    model.save_pretrained(directory)
    return str(directory)


def calibration_batch(batch: int, seq: int) -> torch.Tensor:
    dm = CalibrationDataModule(tokenizer=TEACHER, num_samples=batch, seq_len=seq, batch_size=batch, holdout_samples=0)
    dm.setup("fit")
    return dm.samples


def build(
    teacher: str, samples: torch.Tensor, loops: int, checkpoint_loops: bool, device: str, compile_: bool = False
) -> LoopQCalibration:
    """The calibration module at ``loops`` loops: clipping initialised, SLT budget promoted, targets cached."""
    module = LoopQCalibration(
        teacher,
        QuantConfig(**QUANT, num_loops=loops),
        topk=1000,
        checkpoint_loops=checkpoint_loops,
        compile_quantizers=compile_,
    )
    module.to(device)
    init_clipping_from_data(module.student, samples.to(device))
    for group in list(looped_quant_groups(module.student).values())[: module.quant_config.slt_budget]:
        group.promote()  # which groups does not matter for cost: promoted groups differ only in values
    module.targets = compute_targets(module.teacher, samples.to(device), 1000, loops)
    module.mu.fill_(0.5)
    return module


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_pair(first: Any, second: Any, iters: int, warmup: int, device: str) -> tuple[float, float]:
    """Median times of ``first`` and ``second``, run alternately (one of each per iteration)."""
    for _ in range(warmup):
        first()
        second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(iters):
        for fn, out in ((first, times[0]), (second, times[1])):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def student_step(module: LoopQCalibration, batch: list[torch.Tensor], opt: torch.optim.Optimizer) -> Any:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = module.compute_loss(batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        module.last = {}  # the step's states are not kept between steps

    return step


def teacher_step(module: LoopQCalibration, ids: torch.Tensor, loops: int) -> Any:
    def step() -> None:
        logits = module.teacher(ids, num_loops=loops).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        for p in module.teacher.parameters():
            p.grad = None

    return step


def peak_bytes(fn: Any, device: str) -> int:
    """Peak memory allocated while ``fn`` runs, above what was allocated when it started."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return max(itertools.accumulate((e.self_cpu_memory_usage for e in events), initial=0))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    device = args.device
    teacher = TEACHER
    if args.width:
        scratch = Path(tempfile.mkdtemp(prefix="loopq-bench-"))
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        teacher = synthetic_teacher(args.width, args.layers, scratch)
        shape = read_config(Path(teacher))
        print(
            f"random Ouro teacher: hidden {shape['hidden_size']}, MLP {shape['intermediate_size']}, "
            f"{shape['num_attention_heads']} heads, {shape['num_hidden_layers']} layer(s), vocab {shape['vocab_size']}"
        )
    loops = args.loops or load_teacher(teacher).default_num_loops
    print(
        f"teacher {teacher}, batch {args.batch} x {args.seq} tokens, device {device}, "
        f"threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"
    )
    print(f"\n(a) step time at T = {loops} loops (median of {args.iters}; student and FP steps alternate)")
    print("    tokens/step   FP fwd+bwd   LoopQ step   ratio (target <= 2.0x)   with checkpoint_loops")
    for seq in args.seq:
        samples = calibration_batch(args.batch, seq)
        ids = samples.to(device)
        batch = [torch.arange(len(samples), device=device), ids]
        plain, ckpt = build(teacher, samples, loops, False, device), build(teacher, samples, loops, True, device)
        for p in plain.teacher.parameters():
            p.requires_grad_(True)
        opts = [torch.optim.AdamW(m.param_groups(), weight_decay=0.0) for m in (plain, ckpt)]
        t_student, t_teacher = timed_pair(
            student_step(plain, batch, opts[0]), teacher_step(plain, ids, loops), args.iters, args.warmup, device
        )
        t_ckpt, t_teacher2 = timed_pair(
            student_step(ckpt, batch, opts[1]), teacher_step(plain, ids, loops), args.iters, args.warmup, device
        )
        print(
            f"    {args.batch * seq:11d}   {t_teacher * 1e3:7.1f} ms   {t_student * 1e3:7.1f} ms   "
            f"{t_student / t_teacher:5.2f}x                   {t_ckpt * 1e3:7.1f} ms ({t_ckpt / t_teacher2:.2f}x)"
        )
        del ckpt, opts
        if args.compile:
            fused = build(teacher, samples, loops, False, device, compile_=True)
            opt = torch.optim.AdamW(fused.param_groups(), weight_decay=0.0)
            step = student_step(fused, batch, opt)
            start = time.perf_counter()
            step()  # compiles every distinct shape
            compile_s = time.perf_counter() - start
            t_fused, t_teacher3 = timed_pair(step, teacher_step(plain, ids, loops), args.iters, args.warmup, device)
            print(
                f"    compile_quantizers: LoopQ step {t_fused * 1e3:7.1f} ms vs FP {t_teacher3 * 1e3:7.1f} ms = "
                f"{t_fused / t_teacher3:.2f}x (first step incl. compilation {compile_s:.0f} s)"
            )
            del fused, opt
        del plain
    if args.no_memory:
        return 0
    samples = calibration_batch(args.batch, args.seq[0])
    ids = samples.to(device)
    batch = [torch.arange(len(samples), device=device), ids]

    # (b) peak memory at T and 2T loops, checkpointing off / on
    print("\n(b) peak memory of one calibration step (MB above the state before the step)")
    peaks: dict[tuple[bool, int], int] = {}
    for ckpt in (False, True):
        for n in (loops, 2 * loops):
            module = build(teacher, samples, n, ckpt, device)
            opt = torch.optim.AdamW(module.param_groups(), weight_decay=0.0)
            step = student_step(module, batch, opt)
            step()  # AdamW state exists before the measured step
            peaks[ckpt, n] = peak_bytes(step, device)
            print(f"    checkpoint_loops={ckpt!s:5}  {n:2d} loops  {peaks[ckpt, n] / 2**20:8.2f} MB")
            del module, opt
    for ckpt in (False, True):
        growth = peaks[ckpt, 2 * loops] / peaks[ckpt, loops]
        target = "   (target <= 1.5x)" if ckpt else ""
        print(f"    growth T -> 2T, checkpoint_loops={ckpt!s:5}  {growth:6.2f}x{target}")
    print(f"    checkpointing saves at 2T: {peaks[False, 2 * loops] / peaks[True, 2 * loops]:.2f}x less peak memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
