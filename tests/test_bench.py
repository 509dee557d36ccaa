"""Every ``bench/*.py`` still imports and parses its options: the benchmarks run on demand only (on a GPU, or for
minutes on CPU), so nothing else exercises them, and a renamed library function broke ``bench/calibration.py`` at
import without any test noticing. Each script is run as ``python bench/<name>.py --help`` would run it - its
top-level imports, then its ``main`` up to argparse's ``--help`` exit - in one child process (one torch import
for all of them), with this checkout first on ``sys.path``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from loopq.paths import REPO_ROOT

BENCH = sorted(p.name for p in (REPO_ROOT / "bench").glob("*.py") if p.name != "__init__.py")

#: run in the child: ``runpy.run_path`` as ``__main__`` with ``argv = [script, "--help"]``; prints one JSON line of
#: {script: "ok" | the error}. A script that does not exit through argparse's --help is reported, not waited on.
DRIVER = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for name in sys.argv[1:]:
    path = "bench/" + name
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        results[name] = "returned without exiting: --help was not parsed"
    except SystemExit as exit_:
        ok = exit_.code in (0, None) and "usage:" in out.getvalue()
        results[name] = "ok" if ok else f"exit {exit_.code!r}, output {out.getvalue()[:200]!r}"
    except BaseException:
        results[name] = traceback.format_exc(limit=-3)
print(json.dumps(results))
"""


def test_the_benchmark_list_is_not_empty():
    assert "calibration.py" in BENCH and len(BENCH) >= 5


def test_every_benchmark_imports_and_prints_its_help():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *BENCH], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == set(BENCH)
    failed = {name: result for name, result in results.items() if result != "ok"}
    assert not failed, "\n".join(f"bench/{name}: {result}" for name, result in failed.items())


def test_the_calibration_benchmark_runs_one_step_of_a_random_teacher(capsys):
    """``bench/calibration.py`` end to end at its smallest (a 128-wide random teacher written with
    ``save_pretrained``, one timed step of 1 x 16 tokens, no memory pass): the library calls it makes still exist."""
    spec = importlib.util.spec_from_file_location("calibration_bench", REPO_ROOT / "bench" / "calibration.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--width", "128", "--iters", "1", "--warmup", "0", "--batch", "1", "--seq", "16", "--no-memory"]
    assert bench.main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "random Ouro teacher: hidden 128" in out and "tokens/step" in out
