"""Reproducible CPU numerics, asked for explicitly: the commands ask, a library import does not.

Calibration is chaotic in the sense that matters here: an fp32 sum taken in another order moves a value across a
4-bit rounding boundary now and then, and 300 steps later the student is another one (the README's LoopQ perplexity
moved by up to ~2.5 ppl between machines). On x86 CPUs the order is chosen by the CPU's instruction set - ATen's
vectorised kernels (AVX2 or AVX-512) and MKL's GEMM code path - not by the thread count (measured: 1 and 2 threads
give bit-identical students; ``docs/results.md``). :func:`reproducible_cpu` pins both to their AVX2 paths, which every
machine of the project's kind has: ``ATEN_CPU_CAPABILITY=avx2``, ``MKL_CBWR=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``.

Who calls it: every ``python -m loopq.<command>`` (:func:`loopq.errors.run_cli`, where LoopQ owns the process) and
the test suite. Importing ``loopq`` changes nothing in the host process; a library user who wants the documented
numbers calls ``loopq.reproducible_cpu()`` before torch first computes on the CPU (the libraries read the settings
then, not at import). A value set in the environment wins; ``LOOPQ_NATIVE_CPU=1`` keeps the libraries' own choice
(faster on AVX-512 machines, not reproducible across them). GPU numerics are not affected. Provenance records the
paths a run took (:func:`loopq.provenance.cpu_paths`).
"""

from __future__ import annotations

import os
import platform

#: the environment that pins the CPU code paths (module docstring)
PORTABLE_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def reproducible_cpu() -> dict[str, str]:
    """Pin ATen, MKL and oneDNN to their AVX2 paths on x86-64 (module docstring); returns what this call set.

    No effect off x86-64, with ``LOOPQ_NATIVE_CPU=1``, or for a variable the environment already sets."""
    if platform.machine().lower() not in ("x86_64", "amd64") or os.environ.get("LOOPQ_NATIVE_CPU", "0") == "1":
        return {}
    missing = {name: value for name, value in PORTABLE_CPU.items() if name not in os.environ}
    os.environ.update(missing)
    return missing
