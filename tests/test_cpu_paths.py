"""The CPU code paths that decide fp32 summation order (loopq/numerics.py): the commands pin them, importing
``loopq`` does not, and the README's number is checked where it was documented (AMD EPYC, pinned paths)."""

import os
import platform
import subprocess
import sys

import pytest

from loopq import PORTABLE_CPU
from loopq.paths import REPO_ROOT
from loopq.provenance import environment

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
REPORT = "import os, torch; print(os.environ.get('MKL_CBWR', 'unset'), torch.backends.cpu.get_cpu_capability())"
#: a command: run_cli owns the process, as every ``python -m loopq.<command>`` does
AS_COMMAND = f"from loopq.errors import run_cli; run_cli(lambda: exec({REPORT!r}))"


def probe(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (*PORTABLE_CPU, "LOOPQ_NATIVE_CPU")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    return out.stdout.strip()


def test_importing_loopq_changes_nothing_in_the_host_process():
    before = probe(REPORT)  # the libraries' own choice on this machine
    assert probe(f"import loopq; {REPORT}") == before
    assert before.split()[0] == "unset"


def test_a_command_pins_aten_and_mkl_to_their_avx2_paths():
    assert probe(AS_COMMAND) == "AVX2 AVX2"
    assert probe(f"import loopq; loopq.reproducible_cpu(); {REPORT}") == "AVX2 AVX2"  # the library user's way


def test_a_users_own_setting_wins_and_native_keeps_the_libraries_choice():
    assert probe(AS_COMMAND, ATEN_CPU_CAPABILITY="default") == "AVX2 DEFAULT"
    assert probe(AS_COMMAND, LOOPQ_NATIVE_CPU="1") == probe(REPORT)


#: the CPU paths the README's number was measured with (the pin of loopq/numerics.py)
DOCUMENTED_PATHS = "aten AVX2, MKL_CBWR AVX2, ONEDNN_MAX_CPU_ISA AVX2"
#: CPU model (``/proc/cpuinfo``) -> the step-0 sharing gap S_l the README's main command prints there
#: (configs/tiny.yaml, seed 0). Session 15 (per-use weight backward, issue 37) measured it on this Intel Xeon with
#: AVX-512, where the README's run printed LoopQ 223.56; the AMD EPYCs of sessions 13-14 printed 2420.7086 before
#: that change and are not measured since, so they are not listed.
DOCUMENTED_STEP0 = {"Intel(R) Xeon(R) Processor": "2299.4664"}


def documented_score() -> str | None:
    env = environment()
    return DOCUMENTED_STEP0.get(env["cpu"]) if env["cpu_paths"] == DOCUMENTED_PATHS else None


@pytest.mark.skipif(
    documented_score() is None, reason="README number documented for another CPU (docs/reproducibility.md)"
)
def test_calibration_takes_the_paths_the_readme_number_came_from(tmp_path):
    """The README's LoopQ number reproduces on a machine only where calibration sums in the same fp32 order. Step 0's
    sharing gap is the cheapest sensitive witness (a 1e-7 relative change of the weights moves it by up to 17 %,
    docs/results.md). A failure here means this machine, of a documented model with the pinned paths, calibrates
    another sample of the seed distribution than the documented one. Elsewhere (another CPU model,
    ``LOOPQ_NATIVE_CPU=1``) it is skipped: a correct install whose number differs is not a failure; the run records
    its CPU and paths in provenance (``environment.cpu``, ``environment.cpu_paths``)."""
    out = subprocess.run(
        [sys.executable, "-m", "loopq.fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "1",
         "--trainer.default_root_dir", str(tmp_path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    step0 = [line for line in out.stdout.splitlines() if line.startswith("[loopq] step 0:")]
    want = f"[loopq] step 0: SLT promoted ['model.layers.0.mlp.down_proj'] (S = [{documented_score()}])"
    assert step0 == [want], f"{step0}: this documented CPU with the pinned paths calibrates otherwise"
