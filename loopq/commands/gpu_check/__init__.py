"""One GPU check of LoopQ (``python -m loopq.gpu_check``, ``scripts/gpu_check.sh``;
:mod:`loopq.commands.gpu_check.run_checks` documents the command).

:mod:`~loopq.commands.gpu_check.peaks` (dense peaks of known GPUs, fractions of them),
:mod:`~loopq.commands.gpu_check.table` (stage results, the table, the exit status),
:mod:`~loopq.commands.gpu_check.kernel_bench` (the kernel benchmark, also ``bench/kernels.py``),
:mod:`~loopq.commands.gpu_check.checks` and :mod:`~loopq.commands.gpu_check.flow` (the eight stages),
:mod:`~loopq.commands.gpu_check.registry` (their order and time limits), :mod:`~loopq.commands.gpu_check.driver` and
:mod:`~loopq.commands.gpu_check.stage` (a process per stage, caps, the budget, results written as they come),
:mod:`~loopq.commands.gpu_check.carry` (what travels to a bare GPU machine: ``scripts/gpu_carry.sh``) and
:mod:`~loopq.commands.gpu_check.run_checks` (the command).
"""
