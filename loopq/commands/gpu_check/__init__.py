"""One GPU check of LoopQ (``python -m loopq.gpu_check``, ``scripts/gpu_check.sh``;
:mod:`loopq.commands.gpu_check.run_checks` documents the command).

:mod:`~loopq.commands.gpu_check.peaks` (dense peaks of known GPUs, fractions of them),
:mod:`~loopq.commands.gpu_check.table` (stage results, the table, the exit status),
:mod:`~loopq.commands.gpu_check.kernel_bench` (the kernel benchmark, also ``bench/kernels.py``),
:mod:`~loopq.commands.gpu_check.checks` (the five stages) and :mod:`~loopq.commands.gpu_check.run_checks`.
"""
