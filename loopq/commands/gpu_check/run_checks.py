"""One GPU check of LoopQ, sized for one ten-minute command on a bare GPU machine:

    scripts/gpu_check.sh [--carry .gpu-carry] [--out DIR] [--full] [--budget SECONDS] [--only STAGE ...]
                         [--skip STAGE ...]
    python -m loopq.gpu_check [the same options but --carry]   # from a checkout, TRITON_INTERPRET unset or 0

The stages are :mod:`loopq.commands.gpu_check.checks`' (quick by default, ``--full``: more steps, layers and
shapes), run by :mod:`loopq.commands.gpu_check.driver` (a process and a time limit each, inside ``--budget``;
``--out DIR`` gets the results after every stage); the one table it prints and its exit status (1: a stage failed or
was cut; a missed speed goal does not fail) are :mod:`loopq.commands.gpu_check.table`'s. Without a CUDA GPU it prints
one line saying so and exits 0. The whole procedure: docs/benchmarks.md, "GPU check".
"""

from __future__ import annotations

import importlib
import os
import platform
import tempfile
from pathlib import Path

import torch

from loopq.commands.cli import Command
from loopq.commands.gpu_check import driver
from loopq.commands.gpu_check.carry import commit
from loopq.commands.gpu_check.peaks import peaks_for
from loopq.commands.gpu_check.table import exit_status, format_table, markdown
from loopq.errors import UsageError

NO_GPU = "no CUDA GPU: nothing to check (torch.cuda.is_available() is False)"
STAGES_MODULE = "loopq.commands.gpu_check.registry"


def check_options(out: Path | None, budget: float, chosen: dict[str, tuple[str, ...]], stages: list[str]) -> None:
    """``--out`` is no file, ``--budget`` positive, and every stage named by ``--only`` / ``--skip`` (``chosen``)
    is one of ``stages``."""
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file; give a directory, e.g. {out.parent / 'gpu-check'}")
    if not budget > 0:
        raise UsageError(f"--budget {budget:g}: give a positive number of seconds, e.g. 480")
    for option, names in chosen.items():
        unknown = [name for name in names if name not in stages]
        if unknown:
            raise UsageError(f"{option} {' '.join(unknown)}: not a stage; use some of {', '.join(stages)}")


def kernel_section(details: dict[str, object]) -> str:
    """The kernel bench's rows in Markdown (``gpu_check.md``), when it recorded any."""
    from loopq.commands.gpu_check import kernel_bench  # torch and the kernels: only once there are rows

    rows = [row for row in details.get("rows") or [] if isinstance(row, dict)]
    if not rows:
        return ""
    fields = set(kernel_bench.KernelRow.__dataclass_fields__)
    parsed = [kernel_bench.KernelRow(**{k: v for k, v in row.items() if k in fields}) for row in rows]
    peaks = peaks_for(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    table = markdown(kernel_bench.HEADERS, [kernel_bench.row_cells(r, peaks) for r in parsed])
    for headers, cells in (kernel_bench.split_table(parsed), kernel_bench.warm_table(parsed)):
        table += "\n\n" + markdown(headers, cells) if cells else ""
    return table


driver.SECTIONS["kernel-bench"] = kernel_section


def gpu_check(
    full: bool = False,
    out: Path | None = None,
    budget: float = driver.DEFAULT_BUDGET_S,
    only: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    stages_from: str = STAGES_MODULE,
    refresh_s: float = driver.REFRESH_S,
) -> int:
    """Run the check; returns the exit status (0: nothing failed or no GPU, 1: a stage failed or was cut).

    Args:
        full: more steps, layers and shapes (longer limits)
        out: directory for gpu_check.json and gpu_check.md
        budget: total seconds
        only: run only these stages (the table's names; a wrong one is refused with the list)
        skip: skip these stages
        stages_from: the module whose STAGES and LIMITS are run (a test's fake stages)
        refresh_s: seconds between two writes of the results while a stage runs
    """
    module = importlib.import_module(stages_from)
    check_options(out, budget, {"--only": only, "--skip": skip}, list(module.LIMITS))
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
    carried = os.environ.get("LOOPQ_CARRY_COMMIT") or None  # set by scripts/gpu_check.sh --carry from its manifest
    meta = {"device": device, **commits(commit(), carried)}
    with tempfile.TemporaryDirectory(prefix="loopq-gpu-check-") as scratch:
        results = driver.run_check(
            module.LIMITS,
            module.__name__,
            Path(scratch),
            out,
            full=full,
            budget_s=budget,
            only=only,
            skip=skip,
            meta=meta,
            refresh_s=refresh_s,
        )
    print(format_table(results), flush=True)
    return exit_status(results)


COMMAND = Command(gpu_check, "loopq.gpu_check", __doc__)

build_parser, main = COMMAND.parser, COMMAND.run


def commits(here: str | None, carried: str | None) -> dict[str, str | None]:
    """The run's ``commit``: the carry's first, since a device machine's copy of the tree came with a stale git
    history (the first GPU run recorded "d5eb442+dirty" for a tree at 854d779); what git says there is kept beside
    it, as ``git_there``, when it differs."""
    if carried and here and here != carried:
        return {"commit": carried, "git_there": here}
    return {"commit": carried or here}
