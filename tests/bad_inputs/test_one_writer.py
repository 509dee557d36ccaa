"""One writer per run directory, no silent replacement, no silent no-op runs (issue #29, cases 4-7 and the
refusals that came only after the work): each case ends with one ``error:`` line and its exit status, and leaves
every file that existed before byte-identical."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from loopq.artifacts.layout import EXPORT_FORMAT, EXPORT_META, RUN_LOCK, STUDENT_FORMAT, STUDENT_META, STUDENT_WEIGHTS
from loopq.artifacts.quantized import check_export_dir
from loopq.artifacts.seal import seal
from loopq.commands import export, fit
from loopq.errors import INTERRUPT_STATUS, GuardError, run_cli
from loopq.locks import DirectoryLock, LockError
from loopq.paths import ASSETS
from loopq.planning.guards import check_output_file
from loopq.provenance import record, teacher_fingerprint
from tests.bad_inputs.test_artifact_integrity import write_tiny_student
from tests.helpers import FIT_CONFIGS, command, run_fit, snapshot

TEACHER = ASSETS / "tiny-ouro"
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


class ParseOnly(fit.LoopQCLI):
    """loopq.fit's CLI up to (and with) its checks and lock, without loading the teacher."""

    def instantiate_classes(self) -> None:
        """Nothing to build: the checks ran in ``before_instantiate_classes``."""


def parse(root: Path, *args: str) -> ParseOnly:
    cli = fit.build_cli([*FIT_CONFIGS, "--trainer.default_root_dir", str(root), *args], ParseOnly)
    cli.release_lock()
    return cli  # type: ignore[return-value]


def parse_main(argv: list[str]) -> None:
    parse(Path(argv[0]), *argv[1:])


# ---------------------------------------------------------------------------------------------------- case 4: lock
@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def write_lock(root: Path, pid: int, host: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    holder = {"pid": pid, "host": host or socket.gethostname(), "command": "loopq.fit", "since": 0}
    (root / RUN_LOCK).write_text(json.dumps(holder))
    return root / RUN_LOCK


def test_a_second_fit_in_a_locked_run_directory_is_refused(tmp_path, live_pid):
    """Case 4, as a shell runs it: the second calibration names the first one's pid and host and exits 2."""
    lock = write_lock(tmp_path / "run", live_pid)
    before = snapshot(tmp_path)
    out = run_fit(tmp_path / "run", check=False)
    lines = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    host = re.escape(socket.gethostname())
    assert re.fullmatch(
        rf"error: --trainer.default_root_dir {re.escape(str(tmp_path / 'run'))}: loopq.fit \(pid {live_pid} on "
        rf"{host}, since .*\) is writing there; wait for it to finish or pass another directory \(if that process "
        rf"no longer runs, delete {re.escape(str(lock))}\)",
        lines[0],
    )
    assert snapshot(tmp_path) == before


def test_a_stale_lock_is_taken_over_and_a_foreign_hosts_is_not(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lock(tmp_path / "stale", int(dead.stdout))
    with DirectoryLock(tmp_path / "stale", RUN_LOCK, "loopq.export", "--out"):
        assert json.loads((tmp_path / "stale" / RUN_LOCK).read_text())["pid"] == os.getpid()
    assert not (tmp_path / "stale" / RUN_LOCK).exists()  # released
    write_lock(tmp_path / "far", 1, host="another-host")
    with pytest.raises(LockError, match=r"loopq.fit \(pid 1 on another-host"):
        DirectoryLock(tmp_path / "far", RUN_LOCK, "loopq.export", "--out").acquire()


def test_a_refused_lock_leaves_no_directory_behind(tmp_path, live_pid):
    write_lock(tmp_path / "held", live_pid)
    with DirectoryLock(tmp_path / "new" / "out", RUN_LOCK, "loopq.export", "--out"):
        assert (tmp_path / "new" / "out" / RUN_LOCK).is_file()
    assert not (tmp_path / "new" / "out").exists()


# ---------------------------------------------------------------------------------------------------- case 5
def write_fit_student(root: Path, *args: str) -> None:
    """A student in ``root/student`` whose provenance is what loopq.fit records for ``args``."""
    cli = parse(root, *args)
    provenance = record(teacher_fingerprint(TEACHER), fit.fit_settings(cli.config))
    meta = seal({"format": STUDENT_FORMAT, "teacher": str(TEACHER), "provenance": provenance})
    (root / "student").mkdir(parents=True)
    (root / "student" / STUDENT_META).write_text(json.dumps(meta))
    (root / "student" / STUDENT_WEIGHTS).write_bytes(b"the first run's student")


def test_fit_over_a_student_of_another_config_is_refused_unless_forced(tmp_path, capsys):
    """Case 5: --model.quant.a_bits 8 over a W4A4 run directory; the same config, or --force true, may replace it."""
    root = tmp_path / "run"
    write_fit_student(root)
    before = snapshot(tmp_path)
    status, line = command(parse_main, [str(root), "--model.quant.a_bits", "8"], capsys)
    assert status == 2 and line == (
        f"error: {root / 'student'} holds a student calibrated with another config (config.model.quant.a_bits: 4 -> "
        "8); pass --force true to replace it, or another --trainer.default_root_dir / --model.output_dir"
    )
    assert snapshot(tmp_path) == before
    parse(root)  # the same config: a re-run may replace its own student
    parse(root, "--model.quant.a_bits", "8", "--force", "true")
    assert snapshot(tmp_path) == before  # parsing wrote nothing (and left no lock)


# ---------------------------------------------------------------------------------------------------- case 6
def test_export_does_not_overwrite_a_users_file(tmp_path, capsys):
    """Case 6: --out DIR holding the user's tokenizer.json is refused; an earlier export whose manifest lacks a
    file the new export writes keeps that file too."""
    student = write_tiny_student(tmp_path / "student", 4, 0)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"mine": true}')
    before = snapshot(tmp_path)
    status, line = command(export.main, ["--ckpt", str(student), "--out", str(out)], capsys)
    assert status == 2 and line == (
        f"error: --out {out}: holds files this command did not write (tokenizer.json); pass a new or empty directory"
    )
    assert snapshot(tmp_path) == before
    (out / EXPORT_META).write_text(json.dumps(seal({"format": EXPORT_FORMAT, "files": {"model.safetensors": {}}})))
    with pytest.raises(GuardError, match=r"tokenizer.json there was not written by this command and would be over"):
        check_export_dir(out, str(TEACHER))


# ---------------------------------------------------------------------------------------------------- case 7
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.max_steps", "-1"], "--trainer.max_steps -1: the calibration's learning-rate schedule runs over"),
        (["--trainer.max_steps", "0"], "--trainer.max_steps 0: the calibration's learning-rate schedule runs over"),
        (["--model.warmup_steps", "8"], "--model.warmup_steps 8: must be >= 0 and below --trainer.max_steps 8"),
    ],
    ids=["no-limit", "zero", "all-warmup"],
)
def test_a_degenerate_schedule_is_refused_before_any_work(tmp_path, capsys, args, message):
    status, line = command(parse_main, [str(tmp_path / "run"), *args], capsys)
    assert status == 2 and line.startswith(f"error: {message}")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------- before work
def read_only(directory: str) -> bool:
    try:
        tempfile.TemporaryFile(dir=directory).close()
    except OSError:
        return True
    return False


@pytest.mark.skipif(not read_only("/sys"), reason="needs a folder no one can write to, even root: a read-only /sys")
def test_an_unwritable_output_is_refused_before_any_work(tmp_path, capsys):
    status, line = command(parse_main, [str(tmp_path / "run"), "--model.output_dir", "/sys/loopq/student"], capsys)
    assert status == 2 and line.startswith("error: --model.output_dir /sys/loopq/student: /sys is not writable")
    with pytest.raises(GuardError, match=r"^--out /sys/loopq/r.json: /sys is not writable"):
        check_output_file("/sys/loopq/r.json")


def test_ctrl_c_ends_with_one_line_and_status_130(capsys):
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as ended:
        run_cli(interrupted)
    assert ended.value.code == INTERRUPT_STATUS == 130
    assert capsys.readouterr().err == (
        "error: interrupted (Ctrl-C); every file written so far is complete (atomic writes): run the command again\n"
    )
