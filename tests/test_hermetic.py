"""The suite depends on nothing it did not make (issue 42): run directories go to ``$LOOPQ_RUNS_DIR``, a run left
by the README's first command does not change what a command says, the tree guard catches a test that writes into
the repository, and the shuffled order is a pure function of its printed seed.

The guard and the shuffle are exercised on small throw-away suites run by a child pytest (``-p no:cacheprovider``,
their own rootdir in ``tmp_path``), the only way to watch a session fail.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loopq.paths import REPO_ROOT, RUNS_DIR_ENV, run_root

NOISE = re.compile(r"^(Seed set to \d+|\d{4}-\d{2}-\d{2}:\d{2}:\d{2}:\d{2} (INFO|WARNING) .*)$")


def loopq(command: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m loopq.<command>`` from the repository root as a user runs it (the environment, with this test's
    ``LOOPQ_RUNS_DIR``, inherited)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("LOOPQ_DEBUG", None)
    cmd = [sys.executable, "-m", f"loopq.{command}", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not NOISE.match(line)]


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


# ---------------------------------------------------------------------------------------------------- run roots
def test_run_root_places_relative_run_directories_under_the_env_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(RUNS_DIR_ENV, raising=False)
    assert run_root("runs/tiny") == "runs/tiny" and run_root(None) is None  # unset: the working directory decides
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path))
    assert run_root("runs/tiny") == str(tmp_path / "runs" / "tiny")
    assert run_root("/abs/run") == "/abs/run"  # an explicit absolute directory is the user's choice
    assert run_root(None) == str(tmp_path)  # Lightning's default (the working directory) moves too


def test_every_test_gets_its_own_empty_runs_dir(runs_dir):
    assert os.environ[RUNS_DIR_ENV] == str(runs_dir) and list(runs_dir.iterdir()) == []
    assert REPO_ROOT not in runs_dir.parents


def test_the_shared_calibration_went_to_runs_dir_not_the_clone(tiny_calibration):
    """The shared fixture ran loopq.fit with the config's relative runs/tiny and no --trainer.default_root_dir."""
    assert tiny_calibration.parts[-2:] == ("runs", "tiny") and REPO_ROOT not in tiny_calibration.parents
    assert (tiny_calibration / "student" / "loopq_quant.json").is_file()
    assert (tiny_calibration / "checkpoints" / "last.ckpt").is_file()


# ---------------------------------------------------------------------------------------------------- leftover run
@pytest.fixture
def leftover(tiny_calibration, runs_dir) -> Path:
    """The state the README's first command leaves: ``runs/tiny`` with a calibrated student, where configs/tiny.yaml
    points (under this test's ``LOOPQ_RUNS_DIR``)."""
    run = runs_dir / "runs" / "tiny"
    shutil.copytree(tiny_calibration, run)
    for path in run.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
    return run


def test_fit_names_a_missing_teacher_even_with_a_run_left_in_runs_tiny(leftover, tmp_path):
    """Issue 42: with runs/tiny/student present, the missing teacher used to be reported as the run directory's
    'no config.json or weights to fingerprint'. The teacher is checked first; the leftover run is not touched."""
    before = digest(leftover)
    proc = loopq("fit", "--config", "configs/tiny.yaml", "--model.teacher", tmp_path / "nowhere")
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert re.fullmatch(
        rf"error: {re.escape(str(tmp_path / 'nowhere'))}: not a directory; pass the folder .*", lines[0]
    )
    debug = loopq("fit", "--config", "configs/tiny.yaml", "--model.teacher", tmp_path / "nowhere", "--debug")
    assert debug.returncode not in (0, 2) and "LoopLMError" in debug.stderr and "fingerprint" not in debug.stderr
    assert digest(leftover) == before


def test_fit_names_a_teacher_folder_without_config_json(leftover, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = loopq("fit", "--config", "configs/tiny.yaml", "--model.teacher", tmp_path / "empty")
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {tmp_path / 'empty' / 'config.json'}: no config.json"), lines[0]


def test_fit_still_guards_a_leftover_student_of_another_config(leftover):
    """The teacher check comes first, the run directory's own check still follows: a valid teacher and another
    config against the leftover student is refused by the provenance rule, naming the run's student."""
    proc = loopq("fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "2")  # fit-test.yaml made it
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"{leftover / 'student'} holds a student calibrated" in lines[0] and "--force true" in lines[0]


# ---------------------------------------------------------------------------------------------------- child suites
def child_pytest(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pytest`` on the throw-away suite in ``root`` (its own rootdir: a pytest.ini there)."""
    (root / "pytest.ini").write_text("[pytest]\n")
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "1000", **(env or {})}
    full.pop("PYTEST_XDIST_WORKER", None)
    full.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q", *args]
    return subprocess.run(cmd, cwd=root, env=full, capture_output=True, text=True, timeout=120)


GUARDED = """
from pathlib import Path

ROOT = Path(__file__).parent

def test_clean(tmp_path):
    (tmp_path / "fine.txt").write_text("tmp_path is the place")
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "cache.bin").write_text("an ignored build folder")

def test_pollutes_runs():
    (ROOT / "runs" / "tiny").mkdir(parents=True, exist_ok=True)
    (ROOT / "runs" / "tiny" / "pipeline.json").write_text("{}")

def test_changes_a_doc():
    (ROOT / "docs" / "a.md").write_text("rewritten, longer than before")

def test_removes_a_result():
    (ROOT / "results" / "r.json").unlink()
"""


@pytest.fixture
def guarded_suite(tmp_path) -> Path:
    root = tmp_path / "clone"
    for name, text in (("docs/a.md", "a doc"), ("results/r.json", "{}")):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "conftest.py").write_text('pytest_plugins = ("tests.tree_guard",)\n')
    (root / "test_polluter.py").write_text(GUARDED)
    return root


def test_tree_guard_fails_the_tests_that_touch_the_tree_and_the_session(guarded_suite):
    proc = child_pytest(guarded_suite, "-rE")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "4 passed, 3 errors" in out, out  # the three polluters fail at teardown; the clean test does not
    assert re.search(
        r"ERROR test_polluter.py::test_pollutes_runs - .*added runs; added runs/tiny; added runs/tiny/pip", out
    )
    assert re.search(r"ERROR test_polluter.py::test_changes_a_doc - .*changed docs/a\.md", out), out
    assert re.search(r"ERROR test_polluter.py::test_removes_a_result - .*removed results/r\.json", out), out
    assert "test_clean" not in re.findall(r"ERROR (\S+)", out)
    session = re.search(r"the tests changed the repository .*", out)
    assert session and all(p in session.group() for p in ("runs/tiny/pipeline.json", "docs/a.md", "results/r.json"))
    assert "build" not in session.group()


def test_tree_guard_passes_a_clean_suite_and_can_be_turned_off(guarded_suite):
    clean = child_pytest(guarded_suite, "-k", "clean")
    assert clean.returncode == 0 and "1 passed" in clean.stdout, clean.stdout + clean.stderr
    off = child_pytest(guarded_suite, env={"LOOPQ_TREE_GUARD": "0"})
    assert off.returncode == 0 and "4 passed" in off.stdout, off.stdout + off.stderr


LATE = """
import pytest
from pathlib import Path

@pytest.fixture(scope="session")
def late():
    yield
    (Path(__file__).parent / "results" / "late.json").write_text("{}")

def test_uses_late(late):
    pass
"""


def test_tree_guard_session_check_catches_a_write_after_the_last_test(guarded_suite):
    """A session fixture's teardown runs after every per-test check: only the session comparison sees it."""
    (guarded_suite / "test_polluter.py").write_text(LATE)
    proc = child_pytest(guarded_suite)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 passed" in out and "error" not in out.lower(), out
    assert re.search(r"=+ tree guard =+\nthe tests changed the repository .*: added results/late\.json\n", out), out


ORDERED = """
import pytest

SETUPS = []

@pytest.fixture(scope="module", params=[1, 2])
def expensive(request):
    SETUPS.append(request.param)
    return request.param

@pytest.mark.parametrize("i", range(4))
def test_uses(expensive, i):
    print("ORDER", __name__, expensive, i)

def test_setups_once_per_value():
    pass

def teardown_module():
    print("SETUPS", __name__, SETUPS)
"""


def order(out: str) -> list[str]:
    return re.findall(r"ORDER (\S+ \S+ \S+)", out)  # -s: printed right after the previous test's progress dot


def test_shuffle_is_a_function_of_the_printed_seed_and_keeps_module_fixtures_shared(tmp_path):
    root = tmp_path / "suite"
    root.mkdir()
    (root / "conftest.py").write_text('pytest_plugins = ("tests.shuffle",)\n')
    for name in ("test_a", "test_b", "test_c"):
        (root / f"{name}.py").write_text(ORDERED)
    runs = {name: child_pytest(root, "-s", "--shuffle-seed", name[0]) for name in ("1", "1 again", "2")}
    plain = child_pytest(root, "-s", "--shuffle-seed", "none")
    drawn = child_pytest(root, "-s")
    for proc in (*runs.values(), plain, drawn):
        assert proc.returncode == 0 and "27 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "test order: shuffled, --shuffle-seed 1 " in runs["1"].stdout  # printed even under -q
    assert order(runs["1"].stdout) == order(runs["1 again"].stdout)
    assert order(runs["1"].stdout) != order(runs["2"].stdout) != order(plain.stdout)
    assert sorted(order(runs["1"].stdout)) == sorted(order(plain.stdout))  # the same tests, another order
    seed = re.search(r"--shuffle-seed (\d+)", drawn.stdout).group(1)  # a drawn seed is printed and reproduces
    assert order(child_pytest(root, "-s", "--shuffle-seed", seed).stdout) == order(drawn.stdout)
    for proc in (runs["1"], runs["2"], drawn):  # each module built each value of its module fixture once
        setups = re.findall(r"SETUPS (\S+) \[(.*?)\]", proc.stdout)
        assert len(setups) == 3 and all(sorted(s.split(", ")) == ["1", "2"] for _, s in setups), proc.stdout
    assert "test order: as collected" in plain.stdout
