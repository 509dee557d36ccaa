"""One GPU check of LoopQ (``python -m loopq.gpu_check``, ``scripts/gpu_check.sh``; :mod:`loopq.gpu_check.cli`
documents the command).

:mod:`~loopq.gpu_check.peaks` (dense peaks of known GPUs, fractions of them), :mod:`~loopq.gpu_check.table`
(stage results, the table, the exit status), :mod:`~loopq.gpu_check.kernel_bench` (the kernel benchmark, also
``bench/kernels.py``), :mod:`~loopq.gpu_check.stages` (the five stages) and :mod:`~loopq.gpu_check.cli`.
"""
