"""The GPU check's driver (loopq.commands.gpu_check.driver) end to end on the CPU, with every stage's GPU part faked
(tests/gpu_fakes.py) but everything else real: one process per stage, time limits, the budget, the results written
after every stage and while one runs, SIGTERM and SIGKILL of the whole check."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopq.commands.gpu_check import checks, driver, registry
from loopq.commands.gpu_check.driver import Limits, selection, stage_limit
from loopq.commands.gpu_check.table import CUT, FAIL, OK, RUNNING, SKIPPED
from loopq.paths import REPO_ROOT
from tests import gpu_fakes

FAKES = "tests.gpu_fakes"


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """``set(plan)``: the fake stages' behaviours; the log the stages append to is returned."""
    log = tmp_path / "stages.log"
    monkeypatch.setenv("LOOPQ_FAKE_LOG", str(log))

    def setup(plan: dict[str, str]) -> Path:
        monkeypatch.setenv("LOOPQ_FAKE_STAGES", json.dumps(plan))
        return log

    return setup


def logged(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.is_file() else []


def saved(out: Path) -> dict:
    return json.loads((out / driver.RESULTS_JSON).read_text())


# ------------------------------------------------------------------------------------------------ pure arithmetic
def test_stage_limit_is_the_cap_or_what_is_left_and_none_below_the_need():
    limits = Limits(cap_s=60, full_cap_s=200, need_s=20)
    assert stage_limit(480, limits, full=False) == 60 and stage_limit(480, limits, full=True) == 200
    assert stage_limit(45, limits, full=False) == 45 and stage_limit(150, limits, full=True) == 150
    assert stage_limit(20, limits, full=False) == 20 and stage_limit(19.9, limits, full=False) is None


def test_selection_by_only_and_skip():
    names = ["a", "b", "c", "d"]
    assert selection(names, [], []) == dict.fromkeys(names)
    assert selection(names, ["c", "a"], ["a"]) == {"a": "--skip", "b": "not in --only", "c": None, "d": "not in --only"}


def test_the_real_stages_are_in_the_issues_order_with_limits_that_fit_a_call():
    """The fakes mirror the real stages; the quick caps of the stages that must run fit the default budget."""
    assert tuple(checks.STAGES) == gpu_fakes.NAMES == tuple(registry.LIMITS) == tuple(registry.STAGES)
    first = ("environment", "calibration", "kernel-tests", "kernel-bench")
    assert sum(registry.LIMITS[n].cap_s for n in first) <= driver.DEFAULT_BUDGET_S
    assert all(lim.need_s <= lim.cap_s <= lim.full_cap_s for lim in registry.LIMITS.values())


# ------------------------------------------------------------------------------------------- the driver, faked
def test_order_caps_partial_rows_and_failures(tmp_path, fake_env):
    """Every stage runs once, in order, in its own process with its cap as deadline; the slow one is cut at its cap
    with the rows it recorded; a crash and a dying process fail their stage alone, keeping their row; the files are
    there after the run."""
    log = fake_env({"kernel-bench": "slow", "pipeline": "crash", "paper-shape": "die", "e2e": "fail"})
    limits = {name: Limits(5.0 if name != "kernel-bench" else 1.5, 10.0, 0.5) for name in gpu_fakes.NAMES}
    out = tmp_path / "out"
    began = time.monotonic()
    results = driver.run_check(limits, FAKES, tmp_path, out, budget_s=120, refresh_s=0.2, meta={"device": "fake"})
    assert [r.stage for r in results] == list(gpu_fakes.NAMES)
    assert [line[0] for line in logged(log)] == list(gpu_fakes.NAMES)
    pids = {line[1] for line in logged(log)}
    assert len(pids) == len(gpu_fakes.NAMES) and str(os.getpid()) not in pids  # one process per stage
    for name, _pid, left, quick in logged(log):  # each stage's deadline is its cap (minus its start-up)
        assert 0 < float(left) <= limits[name].cap_s and quick == "True"
    status = {r.stage: r for r in results}
    bench = status["kernel-bench"]
    assert bench.status == CUT and bench.summary.startswith("cut at its 2 s limit")
    assert 1.5 <= bench.seconds < 1.5 + 2 and bench.details["rows"][:3] == [1, 2, 3]
    crashed = status["pipeline"]
    assert crashed.status == FAIL and "RuntimeError: pipeline crashed on purpose" in crashed.summary
    died = status["paper-shape"]
    assert died.status == FAIL and "exited with status 3" in died.summary and died.details["rows"] == [1]
    assert status["e2e"].status == FAIL and status["profile"].status == OK and status["environment"].status == OK
    assert time.monotonic() - began < 60
    payload = saved(out)
    assert payload["exit_status"] == 1 and payload["mode"] == "quick" and payload["device"] == "fake"
    assert [(s["stage"], s["status"]) for s in payload["stages"]] == [(r.stage, r.status) for r in results]
    table = (out / driver.RESULTS_MD).read_text()
    assert "| kernel-bench | cut |" in table and "| profile | ok |" in table
    assert "GPU check FAILED: e2e, pipeline, paper-shape; cut: kernel-bench (exit status 1)" in table


def test_budget_skips_what_would_not_finish(tmp_path, fake_env):
    """With a 2.5 s budget the slow first stage gets min(cap 30 s, 2.5 s left) and is cut there; then less than
    any stage's need is left, so the others are skipped, saying so, and never started."""
    log = fake_env({"environment": "slow"})
    limits = {name: Limits(30.0, 30.0, 1.0) for name in gpu_fakes.NAMES}
    results = driver.run_check(limits, FAKES, tmp_path, tmp_path / "out", budget_s=2.5, refresh_s=0.2)
    first, *rest = results
    assert first.status == CUT and first.summary.startswith("cut at its 2 s limit") and 2.0 <= first.seconds < 4
    assert all(r.status == SKIPPED and r.summary.startswith("budget: ") for r in rest)
    assert all(r.summary.endswith("the stage needs 1 s") for r in rest)
    assert [line[0] for line in logged(log)] == ["environment"]


def test_only_and_skip_leave_rows_that_say_why(tmp_path, fake_env):
    log = fake_env({})
    results = driver.run_check(
        gpu_fakes.LIMITS, FAKES, tmp_path, None, only=["e2e", "profile", "calibration"], skip=["profile"]
    )
    assert [(r.stage, r.status) for r in results if r.status != SKIPPED] == [("calibration", OK), ("e2e", OK)]
    assert {r.summary for r in results if r.status == SKIPPED} == {"--skip", "not in --only"}
    assert [line[0] for line in logged(log)] == ["calibration", "e2e"]


# --------------------------------------------------------------------------------------- killing the whole check
def start_check(tmp_path: Path, plan: dict[str, str], *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "LOOPQ_FAKE_STAGES": json.dumps(plan),
        "LOOPQ_FAKE_LOG": str(tmp_path / "stages.log"),
        "LOOPQ_FAKE_CAP": "60",
        "PYTHONPATH": str(REPO_ROOT),
    }
    cmd = [sys.executable, "-m", "loopq.gpu_check", "--stages_from", FAKES, "--out", str(tmp_path / "out"), *args]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_rows(out: Path, stage: str, rows: int, timeout: float = 60) -> dict:
    """The results file once it shows ``stage`` running with at least ``rows`` rows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            payload = saved(out)
        except (OSError, ValueError):
            payload = {"stages": []}
        found = [s for s in payload["stages"] if s["stage"] == stage and s["status"] == RUNNING]
        if found and len(found[0]["details"].get("rows", [])) >= rows:
            return payload
        time.sleep(0.1)
    raise AssertionError(f"{stage} never showed {rows} rows in {out}")


def test_sigterm_cuts_the_running_stage_and_keeps_its_rows(tmp_path):
    proc = start_check(tmp_path, {"kernel-bench": "slow"}, "--only", "environment", "kernel-bench", "e2e",
                       "--refresh_s", "0.2")  # fmt: skip
    try:
        wait_for_rows(tmp_path / "out", "kernel-bench", 3)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1
    stages = {s["stage"]: s for s in saved(tmp_path / "out")["stages"]}
    assert stages["environment"]["status"] == OK
    bench = stages["kernel-bench"]
    assert bench["status"] == CUT and "terminated (SIGTERM)" in bench["summary"] and len(bench["details"]["rows"]) >= 3
    assert stages["e2e"] == {**stages["e2e"], "status": SKIPPED, "summary": driver.TERMINATED}
    assert "kernel-bench  cut" in stdout
    stage_pid = int(logged(tmp_path / "stages.log")[-1][1])
    with pytest.raises(ProcessLookupError):  # the stage's process group was ended with it
        os.kill(stage_pid, 0)


def test_sigkill_of_the_check_leaves_the_rows_measured_seconds_before(tmp_path):
    proc = start_check(tmp_path, {"calibration": "slow"}, "--only", "environment", "calibration", "--refresh_s", "0.2")
    try:
        payload = wait_for_rows(tmp_path / "out", "calibration", 3)
        proc.kill()  # SIGKILL: no handler runs
        proc.wait(timeout=30)
    finally:
        proc.kill()
        slow = logged(tmp_path / "stages.log")[-1]  # the orphaned slow stage, in its own process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(slow[1]), signal.SIGKILL)
    after = saved(tmp_path / "out")
    assert after["stages"][0]["status"] == OK and after["stages"][1]["status"] == RUNNING
    assert len(after["stages"][1]["details"]["rows"]) >= len(payload["stages"][1]["details"]["rows"]) >= 3
    assert after["exit_status"] == 1
    assert "| calibration | running |" in (tmp_path / "out" / driver.RESULTS_MD).read_text()
