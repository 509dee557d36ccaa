"""LoopQ: loop-aware post-training quantization of looped language models.

Importing ``loopq`` changes nothing in the host process. The commands (``python -m loopq.<command>``) pin the CPU
code paths that decide fp32 summation order so calibrations reproduce across x86 machines; a library user asks for
the same with :func:`reproducible_cpu` (:mod:`loopq.numerics`).
"""

from loopq.numerics import PORTABLE_CPU, reproducible_cpu

__version__ = "0.1.0"
__all__ = ["PORTABLE_CPU", "__version__", "reproducible_cpu"]
