"""The shell scripts that do long or networked work print their usage on ``-h`` / ``--help`` and exit 0 without
starting it, and refuse an unknown option (exit 2) instead of running with it ignored."""

import subprocess

import pytest

from loopq.paths import REPO_ROOT

#: script -> a phrase of its header comment, which is its usage text
SCRIPTS = {
    "scripts/weighting_sweep.sh": "weighting_sweep.sh [teacher ...]",
    "scripts/gpu_carry.sh": "Builds .gpu-carry/",
}


def bash(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_starts_nothing(script, flag):
    proc = bash(script, flag)
    assert proc.returncode == 0, proc.stderr
    assert SCRIPTS[script] in proc.stdout and "set -euo" not in proc.stdout
    assert not (REPO_ROOT / ".gpu-carry.partial").exists()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_an_unknown_option_is_refused(script):
    proc = bash(script, "--no-such-option")
    assert proc.returncode == 2 and "error:" in proc.stderr
