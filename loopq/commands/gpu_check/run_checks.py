"""One GPU check of LoopQ, ready to run on a machine with an NVIDIA GPU:

    scripts/gpu_check.sh [--quick] [--out results/gpu_check.json] [--skip STAGE ...]
    python -m loopq.gpu_check [same options]          # from a checkout, TRITON_INTERPRET unset or 0

Stages (:mod:`loopq.commands.gpu_check.checks`): ``environment``, ``kernel-tests`` (compiled Triton kernel tests),
``kernel-bench`` (W4A4 / W4A8 vs BF16 at Ouro-1.4B's shapes, :mod:`loopq.commands.gpu_check.kernel_bench`),
``calibration`` (a bf16 calibration of the tiny teacher on cuda), ``step`` (a real-shape student step). It prints one
table (stage, status, seconds, key numbers) and exits 1 if any stage failed - a kernel mismatch, an error, a non-finite
loss - else 0; a missed speed goal is marked ``below goal`` without failing. Without a CUDA GPU it prints one line
saying so and exits 0. ``--out`` writes everything measured as JSON (atomically, after every stage).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from loopq.commands.gpu_check.checks import STAGES, Context, run_stage
from loopq.commands.gpu_check.table import SKIPPED, StageResult, exit_status, format_table
from loopq.errors import OneLineParser, UsageError
from loopq.files import atomic_write
from loopq.kernels import triton_interpreted

NO_GPU = "no CUDA GPU: nothing to check (torch.cuda.is_available() is False)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m loopq.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="M in {1, 256}, 5 calibration steps, a 2-layer step")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for everything measured")
    parser.add_argument(
        "--skip", nargs="+", action="extend", default=[], choices=list(STAGES), metavar="STAGE", help=", ".join(STAGES)
    )
    args = parser.parse_args(argv)
    if args.out is not None and args.out.is_dir():
        raise UsageError(f"--out {args.out}: is a directory; give a file, e.g. {args.out / 'gpu_check.json'}")
    return args


def write_results(path: Path, results: list[StageResult], quick: bool) -> None:
    """Everything measured so far as JSON: the stages with their details, and the exit status they imply."""
    payload = {"quick": quick, "exit_status": exit_status(results), "stages": [asdict(r) for r in results]}
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(payload, indent=2) + "\n"))


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (0: nothing failed or no GPU, 1: a stage failed)."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU, flush=True)
        return 0
    if triton_interpreted():
        raise UsageError(
            "TRITON_INTERPRET=1 is set, so the Triton kernels would run in the CPU interpreter; run with "
            "TRITON_INTERPRET=0 (scripts/gpu_check.sh sets it)"
        )
    results: list[StageResult] = []
    with tempfile.TemporaryDirectory(prefix="loopq-gpu-check-") as scratch:
        ctx = Context(quick=args.quick, workdir=Path(scratch))
        for name in STAGES:
            skipped = StageResult(name, SKIPPED, "--skip") if name in args.skip else None
            results.append(skipped or run_stage(name, ctx))
            if args.out is not None:
                write_results(args.out, results, args.quick)
    print(format_table(results), flush=True)
    return exit_status(results)
