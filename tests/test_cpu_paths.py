"""Importing loopq pins the CPU code paths that decide fp32 summation order (loopq/__init__.py): calibrations
reproduce across x86 machines of different instruction sets, not just across thread counts."""

import os
import platform
import subprocess
import sys

import pytest

from loopq import PORTABLE_CPU
from loopq.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
PROBE = "import loopq, os, torch; print(os.environ.get('MKL_CBWR', 'unset'), torch.backends.cpu.get_cpu_capability())"


def probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (*PORTABLE_CPU, "LOOPQ_NATIVE_CPU")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    return out.stdout.strip()


def test_import_pins_aten_and_mkl_to_their_avx2_paths():
    assert probe() == "AVX2 AVX2"


def test_a_users_own_setting_wins_and_native_keeps_the_libraries_choice():
    assert probe(ATEN_CPU_CAPABILITY="default") == "AVX2 DEFAULT"
    native = probe(LOOPQ_NATIVE_CPU="1").split()
    assert native[0] == "unset"  # nothing set: the libraries pick the machine's best path
