"""Inputs that were refused only after the work, or with a traceback (issue #29, the remaining cases): each now ends
with one ``error:`` line naming the option or file and the fix, exit status 2, before the teacher loads where it
can, and every file that existed before is byte-identical afterwards.

``loopq.fit`` cases run in-process through :class:`~tests.bad_inputs.test_one_writer.ParseOnly` (the real CLI and
its checks, without loading the teacher), so that a test that passes proves the refusal comes before any work.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopq.artifacts import load_artifact
from loopq.artifacts.layout import STUDENT_META, STUDENT_WEIGHTS
from loopq.artifacts.seal import FILES, manifest, seal
from loopq.artifacts.student import StudentFormatError
from loopq.commands import evaluate
from loopq.data.calibration import CalibrationDataModule
from loopq.data.text import DataError
from loopq.errors import UsageError, check_config_files
from loopq.metrics.lm import LoopQLM, model_arg_names
from loopq.models import LoopLMError
from tests.bad_inputs.test_artifact_integrity import write_tiny_student
from tests.bad_inputs.test_cli_errors import TEACHER, assert_one_line_error, cli, hashes
from tests.bad_inputs.test_one_writer import command, parse_main, write_fit_student
from tests.helpers import FIT_CONFIGS

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
TAKES = re.escape("--ckpt_path takes 'last' or a checkpoint under <run>/checkpoints")


def refused_fit(tmp_path: Path, capsys, *args: str) -> str:
    """``loopq.fit`` (parse and checks only) in ``tmp_path/run`` with ``args``: its one line, after checking the
    status, that nothing under ``tmp_path`` changed and that no run directory was made."""
    before = hashes(tmp_path)
    status, line = command(parse_main, [str(tmp_path / "run"), *args], capsys)
    assert status == 2 and hashes(tmp_path) == before and not (tmp_path / "run").exists()
    return line


# ---------------------------------------------------------------------------------------------------- --ckpt_path
def test_fit_ckpt_path_to_a_text_file_is_one_line_in_a_real_run(tmp_path: Path):
    """Case 1 as a user runs it: a traceback from torch.load before; now one line before the teacher loads."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint\n")
    before = hashes(tmp_path)
    proc = cli("fit", *FIT_CONFIGS, "--trainer.default_root_dir", tmp_path / "run", "--ckpt_path", notes)
    assert_one_line_error(proc, rf"--ckpt_path {re.escape(str(notes))}: not a checkpoint: not the zip archive torch")
    assert hashes(tmp_path) == before and not (tmp_path / "run").exists()


def write_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "a zip, not a torch.save file")
    return path


def write_cut_checkpoint(path: Path) -> Path:
    torch.save({"state_dict": {"w": torch.zeros(4096)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda p: save_file({"w": torch.zeros(2)}, str(p)) or p, r"not a checkpoint: not the zip archive torch"),
        (write_zip, r"a zip archive, but not one written by torch\.save"),
        (write_cut_checkpoint, r"a zip archive cut short or damaged"),
        (lambda p: p, r"no such file or directory"),
        (lambda p: p.mkdir() or p, r"a directory without checkpoint files"),
    ],
    ids=["safetensors", "zip", "truncated", "missing", "empty-directory"],
)
def test_fit_ckpt_path_that_is_not_a_checkpoint(tmp_path: Path, capsys, make, pattern):
    path = make(tmp_path / "given")
    line = refused_fit(tmp_path, capsys, "--ckpt_path", str(path))
    assert re.match(rf"error: --ckpt_path {re.escape(str(path))}: {pattern}.*; {TAKES}", line), line


def test_fit_ckpt_path_to_a_student_says_it_is_a_student(tmp_path: Path, capsys):
    """Case 2: the message called a student folder 'a DeepSpeed checkpoint directory'."""
    write_fit_student(tmp_path / "calibrated")
    student = tmp_path / "calibrated" / "student"
    line = refused_fit(tmp_path, capsys, "--ckpt_path", str(student))
    assert line == (
        f"error: --ckpt_path {student}: is a calibrated student, not a calibration checkpoint; --ckpt_path takes "
        "'last' or a checkpoint under <run>/checkpoints (a .ckpt file, or a DeepSpeed checkpoint directory)"
    )
    assert "DeepSpeed checkpoint directory not written" not in line


def test_fit_ckpt_path_to_a_run_or_teacher_directory(tmp_path: Path, capsys):
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    line = refused_fit(tmp_path, capsys, "--ckpt_path", str(tmp_path / "old"))
    old = tmp_path / "old"
    assert line.endswith(
        f"is a run directory; pass --ckpt_path last with --trainer.default_root_dir {old}, or a checkpoint under "
        f"{old / 'checkpoints'}"
    )
    line = refused_fit(tmp_path, capsys, "--ckpt_path", str(TEACHER))
    assert re.match(rf"error: --ckpt_path {re.escape(str(TEACHER))}: is a (pretrained )?teacher directory", line)


# ---------------------------------------------------------------------------------------------------- int32 weights
def test_teacher_weight_stored_as_int32_names_file_tensor_and_dtype(tmp_path: Path):
    """Case 3, teacher: a RuntimeError traceback from load_state_dict before."""
    teacher = Path(shutil.copytree(TEACHER, tmp_path / "teacher"))
    weights = load_file(str(teacher / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].to(torch.int32)
    save_file(weights, str(teacher / "model.safetensors"))
    before = hashes(tmp_path)
    proc = cli("evaluate", "--model", teacher, "--tasks", "[]", "--out", tmp_path / "fp.json")
    assert_one_line_error(
        proc,
        r"teacher/model\.safetensors: tensor 'model\.embed_tokens\.weight' is stored as torch\.int32 but the model "
        r"expects a floating-point dtype \(float32, bfloat16 or float16\); .* re-download or re-convert it",
    )
    assert hashes(tmp_path) == before


def test_student_weight_stored_as_int32_is_refused_not_cast(tmp_path: Path):
    """Case 3, student: load_state_dict cast an int32 tensor silently into the float parameter (a sealed file of a
    writer gone wrong: the seal matches, the dtype does not)."""
    student = write_tiny_student(tmp_path / "student", 4, 0)
    state = load_file(str(student / STUDENT_WEIGHTS))
    name = sorted(state)[0]
    state[name] = state[name].round().to(torch.int32)
    save_file(state, str(student / STUDENT_WEIGHTS))
    meta = json.loads((student / STUDENT_META).read_text())
    meta[FILES] = manifest(student, [STUDENT_WEIGHTS])
    (student / STUDENT_META).write_text(json.dumps(seal(meta)))
    before = hashes(tmp_path)
    expected = f"{student / STUDENT_WEIGHTS}: tensor {name!r} is stored as torch.int32 but the model expects a float"
    with pytest.raises(StudentFormatError, match=re.escape(expected)):
        load_artifact(student)
    assert hashes(tmp_path) == before


# ---------------------------------------------------------------------------------------------------- seq_len
def test_fit_seq_len_beyond_the_teachers_positions_names_the_option(tmp_path: Path, capsys):
    """Case 4, loopq.fit: the forward's message named config.json only, after the teacher loaded."""
    line = refused_fit(tmp_path, capsys, "--data.seq_len", "4096")
    assert line == (
        "error: --data.seq_len 4096: longer than the 2048 positions the teacher loopq/assets/tiny-ouro has (its "
        "config.json); pass --data.seq_len 2048 or less"
    )


def test_evaluate_ppl_seq_len_beyond_the_models_positions_names_the_option(tmp_path: Path, capsys):
    """Case 4, loopq.evaluate: refused once the model is loaded, before any window is evaluated."""
    out = tmp_path / "fp.json"
    status, line = command(
        evaluate.main, ["--model", str(TEACHER), "--tasks", "[]", "--ppl_seq_len", "4096", "--out", str(out)], capsys
    )
    assert status == 2 and line == (
        "error: --ppl_seq_len 4096: longer than the 2048 positions the model has (its config.json); pass "
        "--ppl_seq_len 2048 or less"
    )
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------- --config
def test_an_empty_config_file_is_named(tmp_path: Path):
    """Case 5: jsonargparse said only 'Unexpected config:'."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    proc = cli("fit", "--config", empty)
    assert_one_line_error(
        proc, rf"^error: --config {re.escape(str(empty))}: the file is empty \(no settings\); write settings into it"
    )
    assert empty.read_text() == ""


def test_config_files_that_hold_no_settings(tmp_path: Path):
    comments = tmp_path / "comments.yaml"
    comments.write_text("# nothing but a comment\n")
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(UsageError, match=r"comments\.yaml: the file is empty"):
        check_config_files(["--config", str(comments)])
    with pytest.raises(UsageError, match=r"list\.yaml: holds a list, not settings"):
        check_config_files([f"--config={listed}"])
    check_config_files(["--config", "configs/tiny.yaml", "--config", str(tmp_path / "missing.yaml")])
    binary = tmp_path / "bin.yaml"  # jsonargparse said only "'utf-8' codec can't decode byte 0xff ..."
    binary.write_bytes(b"\xff\xfe\x00trainer: {}")
    with pytest.raises(UsageError, match=r"bin\.yaml: not UTF-8 text; save it as UTF-8"):
        check_config_files(["--config", str(binary)])


# ---------------------------------------------------------------------------------------------------- model_args
def test_eval_misspelled_model_arg_lists_the_accepted_ones():
    """Case 6: a TypeError traceback from LoopQLM.__init__ before."""
    proc = cli("eval", "--model", "loopq", "--model_args", f"pretrained={TEACHER},num_loop=2", "--tasks", "x")
    line = assert_one_line_error(
        proc, r"--model_args: unknown key\(s\) \['num_loop'\] for the loopq model \(did you mean num_loops\?\)"
    )
    assert line.endswith(f"it accepts {', '.join(model_arg_names())}") and "max_length" in line


def test_lm_eval_model_args_are_checked_in_process_too():
    with pytest.raises(LoopLMError, match=r"unknown key\(s\) \['loops'\]"):
        LoopQLM.create_from_arg_string(f"pretrained={TEACHER},loops=2")


# ---------------------------------------------------------------------------------------------------- data
def test_fit_calibration_text_shorter_than_the_windows_is_refused(tmp_path: Path, capsys):
    """Case 7: 16 + 2 windows of 32 tokens were drawn from ~200 tokens, overlapping, without a word."""
    text = tmp_path / "short.txt"
    text.write_text("A short calibration text that cannot hold eighteen windows of thirty-two tokens. " * 4)
    line = refused_fit(tmp_path, capsys, "--data.sources", f"[{text}]")
    found = re.fullmatch(
        r"error: data\.sources: (\d+) tokens, but data\.num_samples=16 \+ data\.holdout_samples=2 windows of "
        r"data\.seq_len=32 need 576 \(fewer would overlap, and the held-out windows would repeat training text\); "
        r"add text to data\.sources, or lower data\.num_samples to (\d+) or data\.seq_len to (\d+)",
        line,
    )
    assert found, line
    tokens, samples, seq_len = map(int, found.groups())
    assert 32 < tokens < 576 and (samples + 2) * 32 <= tokens and 18 * seq_len <= tokens


def test_fit_refuses_an_empty_sources_list_instead_of_calibrating_on_the_default_text(tmp_path: Path, capsys):
    """``--data.sources '[]'`` calibrated on the default prose (calibration/*.txt) without a word."""
    line = refused_fit(tmp_path, capsys, "--data.sources", "[]")
    assert line.startswith("error: data.sources=[]: lists no text; list the files (or globs) to read, or leave "), line
    assert line.endswith("data.sources out for the default (calibration/*.txt)"), line


def test_calibration_data_module_refuses_overlapping_windows(data, tmp_path: Path):
    """The same rule in the data module itself (a hub source is checked there, after its download)."""
    text = tmp_path / "short.txt"
    text.write_text("word " * 300)
    module = CalibrationDataModule(str(TEACHER), [str(text)], num_samples=64, seq_len=32, holdout_samples=4)
    with pytest.raises(DataError, match=r"data\.sources: \d+ tokens, but .* need 2176"):
        module.setup()
    CalibrationDataModule(str(TEACHER), [str(text)], num_samples=4, seq_len=32, holdout_samples=1).setup()
