"""LoopQ: loop-aware post-training quantization of looped language models.

**Portable CPU numerics.** Calibration is chaotic in the sense that matters here: an fp32 sum taken in another order
moves a value across a 4-bit rounding boundary now and then, and 300 steps later the student is another one (the
README's LoopQ perplexity moved by up to ~2.5 ppl between machines). On x86 CPUs the order is chosen by the CPU's
instruction set - ATen's vectorised kernels (AVX2 or AVX-512) and MKL's GEMM code path - not by the thread count
(measured: 1 and 2 threads give bit-identical students; forcing ATen's ``default`` kernels or MKL's ``COMPATIBLE``
path gives other ones, ``docs/results.md``). So importing ``loopq`` on x86-64 pins both to their AVX2 paths, which
every machine of the project's kind has and the one it calibrated its results on uses anyway (there the pin changes
no bit): ``ATEN_CPU_CAPABILITY=avx2``, ``MKL_CBWR=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``. A value you set yourself wins;
``LOOPQ_NATIVE_CPU=1`` keeps the libraries' own choice (faster on AVX-512 machines, not reproducible across them).
They are read when torch first computes on the CPU, so import ``loopq`` before that (every ``python -m loopq.<cmd>``
does). GPU numerics are not affected.
"""

import os
import platform

__version__ = "0.1.0"

#: the environment that pins the CPU code paths (module docstring)
PORTABLE_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

if platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("LOOPQ_NATIVE_CPU", "0") != "1":
    for _name, _value in PORTABLE_CPU.items():
        os.environ.setdefault(_name, _value)
