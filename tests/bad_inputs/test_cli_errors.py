"""Every command line ends a bad input with one ``error:`` line on stderr and exit status 2, before any real work,
and leaves the files it was given untouched; ``--debug`` / ``LOOPQ_DEBUG=1`` show the traceback instead.

The commands run as a user runs them (``python -m loopq.<command>`` in a subprocess from the repository root); each
fails within seconds, before a model is calibrated or evaluated. A few library-level checks (the message folding,
the file readers, Ouro's position limit) run in-process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loopq.artifacts.layout import STUDENT_FORMAT
from loopq.artifacts.seal import FILES, manifest, seal
from loopq.errors import USER_ERRORS, UsageError, one_line, user_error
from loopq.files import read_json, read_safetensors
from loopq.models import LoopLMError
from loopq.models.ouro import OuroLM
from loopq.paths import ASSETS, REPO_ROOT
from loopq.quant import QuantConfig

TEACHER = ASSETS / "tiny-ouro"
#: stderr lines that are not errors: Lightning's seed notice, lm-eval's timestamped log records
NOISE = re.compile(r"^(Seed set to \d+|\d{4}-\d{2}-\d{2}:\d{2}:\d{2}:\d{2} (INFO|WARNING) .*)$")


# ---------------------------------------------------------------------------------------------------- helpers
def cli(command: str, *args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m loopq.<command> args`` from the repository root, on one thread, offline."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    base.pop("LOOPQ_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", f"loopq.{command}", *map(str, args)],
        cwd=REPO_ROOT,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], pattern: str) -> str:
    """Exit status 2, no traceback, and exactly one non-log line on stderr: ``error: ...`` matching ``pattern``."""
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not NOISE.match(line)]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def hashes(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots`` (what must be byte-identical after a refused command)."""
    files = [p for root in roots for p in ([root] if root.is_file() else sorted(root.rglob("*"))) if p.is_file()]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture
def teacher(tmp_path: Path) -> Path:
    """A private copy of the embedded teacher, to damage."""
    return Path(shutil.copytree(TEACHER, tmp_path / "teacher"))


@pytest.fixture
def student(tmp_path: Path) -> Path:
    """A student directory whose JSON is valid (teacher: the embedded one) and whose weights file is cut short."""
    directory = tmp_path / "student"
    directory.mkdir()
    meta = {
        "format": "loopq-student-v1",
        "teacher": str(TEACHER),
        "arch": "ouro",
        "quant": QuantConfig().to_dict(),
        "promoted": [],
        "calibrated_loops": 4,
        "mu": [1.0] * 4,
    }
    save_file({"x": torch.zeros(256)}, str(directory / "loopq_student.safetensors"))
    meta |= {"format": STUDENT_FORMAT, FILES: manifest(directory, ["loopq_student.safetensors"])}
    (directory / "loopq_quant.json").write_text(json.dumps(seal(meta)))
    truncate(directory / "loopq_student.safetensors")
    return directory


# ---------------------------------------------------------------------------------------------------- loopq.fit
def test_fit_missing_teacher(tmp_path: Path):
    proc = cli("fit", "--config", "configs/tiny.yaml", "--model.teacher", tmp_path / "nowhere")
    assert_one_line_error(proc, r"nowhere: not a directory; pass the folder holding config\.json")


def test_fit_broken_json_config_names_the_file_and_the_line(teacher: Path):
    (teacher / "config.json").write_text('{"model_type": "ouro",\n  "hidden_size": 128,,\n}')
    before = hashes(teacher)
    proc = cli("fit", "--config", "configs/tiny.yaml", "--model.teacher", teacher)
    assert_one_line_error(proc, r"teacher/config\.json: not valid JSON \(.* line 2, column \d+\)")
    assert hashes(teacher) == before


def test_fit_bad_option_value_names_the_nested_key():
    proc = cli("fit", "--config", "configs/tiny.yaml", "--model.quant.w_bits", "four")
    assert_one_line_error(proc, r"^error: --model\.quant\.w_bits: Expected a <class 'int'>\. Got value: four$")


def test_fit_debug_shows_the_traceback(tmp_path: Path):
    proc = cli("fit", "--config", "configs/tiny.yaml", "--model.teacher", tmp_path / "nowhere", "--debug")
    assert proc.returncode not in (0, 2) and "Traceback" in proc.stderr and "LoopLMError" in proc.stderr


# ---------------------------------------------------------------------------------------------------- loopq.run
@pytest.mark.parametrize(
    ("option", "pattern"),
    [
        (["--model.quant.w_bits", "3"], r"--model\.quant\.w_bits=3, but the kernels pack int4 weights; use w_bits=4"),
        (["--model.quant.w_bits", "16"], r"--model\.quant\.w_bits=16"),
        (["--model.quant.a_bits", "16"], r"--model\.quant\.a_bits=16; the kernels run W4A4 or W4A8"),
        (["--model.quant.group_size", "64"], r"--model\.quant\.group_size=64 .* use group_size=32"),
        (["--model.quant.w_bits", "5"], r"quant\.w_bits=5 is not supported; use one of"),  # escaped loopq.run before
        (["--tasks", "loopq_hellaswag", "loopq_hellaswagg"], r"--tasks: unknown task\(s\) \['loopq_hellaswagg'\]"),
    ],
)
def test_run_refuses_unexportable_bits_and_unknown_tasks_before_calibrating(tmp_path: Path, option, pattern):
    root = tmp_path / "run"
    proc = cli("run", "--config", "configs/tiny.yaml", "--trainer.default_root_dir", root, *option)
    assert_one_line_error(proc, pattern)
    assert not root.exists()  # nothing was calibrated, not even a pipeline.json written


# ---------------------------------------------------------------------------------------------------- loopq.evaluate
def test_evaluate_refuses_an_unknown_method_for_a_teacher(tmp_path: Path):
    out = tmp_path / "quarot.json"
    proc = cli("evaluate", "--model", TEACHER, "--method", "QuaRott", "--tasks", "[]", "--out", out)
    line = assert_one_line_error(proc, r"--method 'QuaRott' is not a method for --model")
    assert all(name in line for name in ("FP", "Symmetric", "SmoothQuant", "QuaRot"))  # lists the valid ones
    assert not out.exists()


def test_evaluate_refuses_an_unknown_task_before_loading_the_model(tmp_path: Path):
    proc = cli("evaluate", "--model", tmp_path / "not-loaded", "--tasks", "[loopq_hellaswagg]")
    assert_one_line_error(proc, r"--tasks: unknown task\(s\) \['loopq_hellaswagg'\]")


def test_evaluate_truncated_teacher_weights(teacher: Path, tmp_path: Path):
    truncate(teacher / "model.safetensors")
    before = hashes(teacher)
    proc = cli("evaluate", "--model", teacher, "--tasks", "[]", "--out", tmp_path / "fp.json")
    line = assert_one_line_error(proc, r"teacher/model\.safetensors: not a readable safetensors file")
    assert "truncated or corrupt" in line and "re-download" in line and "convert" not in line
    assert hashes(teacher) == before and not (tmp_path / "fp.json").exists()


# ---------------------------------------------------------------------------------------------------- loopq.export
def test_export_truncated_student_weights(student: Path, tmp_path: Path):
    before = hashes(student)
    proc = cli("export", "--ckpt", student, "--out", tmp_path / "exported")
    line = assert_one_line_error(proc, r"student/loopq_student\.safetensors: not the file loopq_quant\.json was")
    assert re.search(r"\(\d+ bytes, recorded \d+ bytes\): it was changed or replaced since; calibrate", line)
    assert hashes(student) == before and not (tmp_path / "exported").exists()


def test_export_missing_student_directory(tmp_path: Path):
    proc = cli("export", "--ckpt", tmp_path / "nowhere", "--out", tmp_path / "exported")
    assert_one_line_error(proc, r"nowhere/loopq_quant\.json: missing")


def test_export_usage_error_is_one_line(tmp_path: Path):
    proc = cli("export", "--ckpt", tmp_path)
    assert_one_line_error(proc, r"required: --out \(see python -m loopq\.export --help\)")


# ---------------------------------------------------------------------------------------------------- the others
def test_eval_missing_pretrained_directory(tmp_path: Path):
    proc = cli("eval", "--model", "loopq", "--model_args", f"pretrained={tmp_path / 'nowhere'}", "--tasks", "x")
    assert_one_line_error(proc, r"nowhere/config\.json")


def test_report_broken_result_json_and_its_debug_traceback(tmp_path: Path):
    broken = tmp_path / "fp.json"
    broken.write_text('{"method": "FP", ')
    before = hashes(tmp_path)
    args = ("--results", broken, "--out", tmp_path / "report")
    assert_one_line_error(cli("report", *args), r"fp\.json: not valid JSON")
    debug = cli("report", *args, env={"LOOPQ_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ReportInputError" in debug.stderr
    assert hashes(tmp_path) == before


def test_testbed_truncated_teacher_is_left_as_it_was(teacher: Path):
    truncate(teacher / "model.safetensors")
    before = hashes(teacher)
    proc = cli("testbed", "--model", teacher)
    assert_one_line_error(proc, r"teacher/model\.safetensors: not a readable safetensors file")
    assert hashes(teacher) == before  # no testbed.json / TESTBED.md written next to it


def test_pretrain_missing_config(tmp_path: Path):
    proc = cli("pretrain", "--config", tmp_path / "pretrain.yaml")
    assert_one_line_error(proc, r"--config: File does not exist: .*pretrain\.yaml")


def test_experiments_missing_student(tmp_path: Path):
    out = tmp_path / "out"
    proc = cli("experiments", "loops", "--model", TEACHER, "--student", tmp_path / "student", "--out", out)
    assert_one_line_error(proc, r"student/loopq_quant\.json: missing - .* is not a LoopQ student directory")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------- in-process
def test_ouro_refuses_a_sequence_beyond_max_position_embeddings():
    config = {"model_type": "ouro", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64}
    config |= {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    model = OuroLM.from_config({**config, "max_position_embeddings": 16}, seed=0)
    assert model(torch.zeros(1, 16, dtype=torch.long), num_loops=1).logits.shape == (1, 16, 32)
    with pytest.raises(LoopLMError, match=r"input has 17 tokens but config\.json max_position_embeddings=16"):
        model(torch.zeros(1, 17, dtype=torch.long), num_loops=1)


def test_nested_jsonargparse_messages_fold_to_the_key_and_the_reason():
    nested = (
        'Parser key "model.quant":\n  Does not validate against any of the Union subtypes\n  Errors:\n'
        "    - Problem with given class_path 'loopq.quant.QuantConfig':\n        Parser key \"w_bits\":\n"
        "          Expected a <class 'int'>. Got value: abc\n    - Expected a <class 'NoneType'>\n"
    )
    folded = one_line(argparse.ArgumentError(None, nested))
    assert folded == "--model.quant.w_bits: Expected a <class 'int'>. Got value: abc"
    wrapped = ValueError("Does not validate against any of the Union subtypes\nErrors:\n  - ...")
    wrapped.__cause__ = UsageError("quant.w_bits=5 is not supported")
    assert str(user_error(wrapped)) == "quant.w_bits=5 is not supported"
    assert user_error(RuntimeError("a bug")) is None
    restricted = 'Parser key "windows":\n  Not of type PositiveInt: 0 does not conform to restriction v>0'
    assert one_line(argparse.ArgumentError(None, restricted)) == "--windows 0: must be >0"


def test_file_readers_name_the_file(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(LoopLMError, match=r"bad\.json: not valid JSON \(.* line 1, column 6\); fix it"):
        read_json(bad, LoopLMError, "fix it")
    with pytest.raises(USER_ERRORS, match=r"missing\.json: no such file"):
        read_json(tmp_path / "missing.json")
    pickled = tmp_path / "weights.safetensors"
    torch.save({"w": torch.zeros(2)}, pickled)  # a torch zip archive under a safetensors name
    assert zipfile.is_zipfile(pickled)
    with pytest.raises(USER_ERRORS, match=r"weights\.safetensors: a torch zip/pickle checkpoint, not safetensors"):
        read_safetensors(pickled)


HOLDS_THE_PROCESS = """
import threading, torch.distributed as dist
from loopq.errors import UsageError, run_cli
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
threading.Thread(target=threading.Event().wait, daemon=False).start()  # as NCCL's watchdog: never ends
def main():
    raise {error}
run_cli(main)
"""


@pytest.mark.parametrize(("error", "status"), [("UsageError('--x: bad')", 2), ("RuntimeError('a bug')", 1)])
def test_failure_with_a_process_group_exits_instead_of_hanging(error, status):
    """The first GPU run's DeepSpeed crash in setup left the process hanging until killed: a live process group's
    threads kept the interpreter alive. Here a non-daemon thread plays that part; the command must still exit."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = HOLDS_THE_PROCESS.format(port=port, error=error)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == status, out.stderr[-2000:]
    if status == 2:
        assert out.stderr.strip().splitlines()[-1] == "error: --x: bad"
    else:
        assert "RuntimeError: a bug" in out.stderr  # a bug keeps its traceback


def test_a_full_disk_or_a_forbidden_path_is_one_line():
    """A bad-input review filled the disk during an export: a traceback. The machine's errors (no space, quota, a
    read-only file system) are one line naming the file; other OS errors stay tracebacks (they may be bugs)."""
    import errno

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/export/model.safetensors")
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = full
    line = one_line(user_error(wrapped))
    assert line.startswith("/runs/export/model.safetensors: No space left on device; free space (or make it")
    assert "Read-only file system" in one_line(user_error(OSError(errno.EROFS, "Read-only file system", "/mnt/x")))
    assert user_error(OSError(errno.EIO, "Input/output error", "/x")) is None
