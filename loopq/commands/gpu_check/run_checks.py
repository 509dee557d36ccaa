"""One GPU check of LoopQ, sized for one ten-minute command on a bare GPU machine:

    scripts/gpu_check.sh [--carry .gpu-carry] [--out DIR] [--full] [--budget SECONDS] [--only STAGE ...]
                         [--skip STAGE ...]
    python -m loopq.gpu_check [the same options but --carry]   # from a checkout, TRITON_INTERPRET unset or 0

Stages, most important first (:mod:`loopq.commands.gpu_check.checks`): ``environment``, ``calibration`` (the tiny
config on cuda, its first loss against the CPU's), ``kernel-tests`` (the Triton kernel tests, compiled, on CUDA),
``kernel-bench`` (W4A4 / W4A8 against BF16 at Ouro-1.4B's shapes), ``e2e`` (prefill and decode), ``pipeline``
(export, evaluation and generation on cuda against the CPU), ``paper-shape`` (allocator peaks of the paper config
against its plan) and ``profile`` (a real-shape student step, timed and profiled). Quick by default; ``--full``
runs more steps, layers and shapes. Each stage runs in its own process under its own time limit, inside a total
``--budget`` (default 480 s): a stage that would not finish in what is left is skipped, one that reaches its limit is
cut and keeps what it had measured (:mod:`loopq.commands.gpu_check.driver`). ``--out DIR`` gets ``gpu_check.json``
and ``gpu_check.md`` after every stage. It prints one table (stage, status, seconds, key numbers) and exits 1 if a
stage failed or was cut - a kernel mismatch, an error, a non-finite loss, a time limit - else 0; a missed speed
goal is ``below goal`` without failing. Without a CUDA GPU it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import tempfile
from pathlib import Path

import torch

from loopq.commands.gpu_check import driver
from loopq.commands.gpu_check.carry import commit
from loopq.commands.gpu_check.peaks import peaks_for
from loopq.commands.gpu_check.table import exit_status, format_table, markdown
from loopq.errors import OneLineParser, UsageError

NO_GPU = "no CUDA GPU: nothing to check (torch.cuda.is_available() is False)"
STAGES_MODULE = "loopq.commands.gpu_check.registry"


def parse_args(argv: list[str] | None, stages: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m loopq.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="more steps, layers and shapes (longer limits)")
    parser.add_argument("--out", type=Path, default=None, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--budget", type=float, default=driver.DEFAULT_BUDGET_S, help="total seconds (default 480)")
    choice = {"choices": stages, "metavar": "STAGE", "nargs": "+", "action": "extend", "default": []}
    parser.add_argument("--only", help="run only these: " + ", ".join(stages), **choice)  # type: ignore[arg-type]
    parser.add_argument("--skip", help="skip these", **choice)  # type: ignore[arg-type]
    parser.add_argument("--stages_from", default=STAGES_MODULE, help=argparse.SUPPRESS)  # a test's fake stages
    parser.add_argument("--refresh_s", type=float, default=driver.REFRESH_S, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: is a file; give a directory, e.g. {args.out.parent / 'gpu-check'}")
    if not args.budget > 0:
        raise UsageError(f"--budget {args.budget:g}: give a positive number of seconds, e.g. 480")
    return args


def kernel_section(details: dict[str, object]) -> str:
    """The kernel bench's rows in Markdown (``gpu_check.md``), when it recorded any."""
    from loopq.commands.gpu_check import kernel_bench  # torch and the kernels: only once there are rows

    rows = [row for row in details.get("rows") or [] if isinstance(row, dict)]
    if not rows:
        return ""
    fields = set(kernel_bench.KernelRow.__dataclass_fields__)
    parsed = [kernel_bench.KernelRow(**{k: v for k, v in row.items() if k in fields}) for row in rows]
    peaks = peaks_for(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    return markdown(kernel_bench.HEADERS, [kernel_bench.row_cells(r, peaks) for r in parsed])


driver.SECTIONS["kernel-bench"] = kernel_section


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status (0: nothing failed or no GPU, 1: a stage failed or was cut)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--stages_from", default=STAGES_MODULE)
    module = importlib.import_module(pre.parse_known_args(argv)[0].stages_from)
    args = parse_args(argv, list(module.LIMITS))
    if getattr(module, "NEEDS_CUDA", True):
        if not torch.cuda.is_available():
            print(NO_GPU, flush=True)
            return 0
        from loopq.kernels import triton_interpreted

        if triton_interpreted():
            raise UsageError(
                "TRITON_INTERPRET=1 is set, so the Triton kernels would run in the CPU interpreter; run with "
                "TRITON_INTERPRET=0 (scripts/gpu_check.sh sets it)"
            )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    meta = {"device": device, "commit": commit() or _carried_commit()}
    with tempfile.TemporaryDirectory(prefix="loopq-gpu-check-") as scratch:
        results = driver.run_check(
            module.LIMITS,
            module.__name__,
            Path(scratch),
            args.out,
            full=args.full,
            budget_s=args.budget,
            only=args.only,
            skip=args.skip,
            meta=meta,
            refresh_s=args.refresh_s,
        )
    print(format_table(results), flush=True)
    return exit_status(results)


def _carried_commit() -> str | None:
    """The commit the carry was built from (``LOOPQ_CARRY_COMMIT``, set by ``scripts/gpu_check.sh --carry``) when
    the tree has no git history (a device machine's copy)."""
    return os.environ.get("LOOPQ_CARRY_COMMIT") or None
