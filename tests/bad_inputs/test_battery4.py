"""The fourth bad-input battery: files of the wrong kind where a command expects a file (a ``config.json`` holding a
list, an empty or cut ``model.safetensors``, a ``--config`` YAML with a syntax error or a NUL byte), files where it
writes a folder and links to nothing, each ending with one ``error:`` line naming the file, exit status 2, and every
file that existed before byte-identical.

``loopq.fit`` cases that must be refused before the teacher loads run in-process through
:func:`~tests.bad_inputs.test_refused_early.refused_fit` (the real CLI and its checks, nothing built).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from loopq.artifacts.layout import RUN_LOCK
from loopq.calib.checkpoint_io import newest_intact
from loopq.commands import examine, export, fit, pretrain
from loopq.errors import GuardError, UsageError
from loopq.locks import DirectoryLock, LockError
from loopq.models import LoopLMError, load_looplm
from loopq.planning.guards import check_output_file
from tests.bad_inputs.test_artifact_integrity import write_tiny_student
from tests.bad_inputs.test_cli_errors import TEACHER, assert_one_line_error, cli, hashes, truncate
from tests.bad_inputs.test_one_writer import parse_main
from tests.bad_inputs.test_refused_early import refused_fit
from tests.helpers import FIT_CONFIGS, command

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


@pytest.fixture
def teacher(tmp_path: Path) -> Path:
    return Path(shutil.copytree(TEACHER, tmp_path / "teacher"))


# ---------------------------------------------------------------------------------------------------- config.json
@pytest.mark.parametrize(("value", "kind"), [([1, 2], "list"), (42, "int"), ("ouro", "str"), (None, "null")])
@pytest.mark.parametrize("plan", [False, True], ids=["fit", "print_plan"])
def test_a_teacher_config_json_that_is_not_an_object_is_one_line(tmp_path, capsys, teacher, value, kind, plan):
    """Was: AttributeError: 'list' object has no attribute 'get' (a traceback, exit status 1)."""
    (teacher / "config.json").write_text(json.dumps(value))
    with pytest.raises(LoopLMError, match=rf"config\.json: holds a JSON {kind}, not a JSON object"):
        load_looplm(teacher)
    line = refused_fit(tmp_path, capsys, "--model.teacher", str(teacher), *(["--print_plan"] if plan else []))
    assert re.search(rf"teacher/config\.json: holds a JSON {kind}, not a JSON object of settings", line), line


# ---------------------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("damage", ["empty", "cut"])
def test_an_empty_or_cut_teacher_weight_file_is_named_before_anything_is_built(tmp_path, capsys, teacher, damage):
    """Was: ``error: Error while deserializing header: header too small`` (the check of the headers named no file)."""
    weights = teacher / "model.safetensors"
    if damage == "empty":
        weights.write_bytes(b"")
    else:
        weights.write_bytes(weights.read_bytes()[:5])  # not even the 8-byte header length
    line = refused_fit(tmp_path, capsys, "--model.teacher", str(teacher))
    assert re.search(r"teacher/model\.safetensors: not a readable safetensors file, truncated or corrupt", line), line


def test_a_teacher_weight_file_cut_in_its_data_is_named_too(tmp_path, capsys, teacher):
    truncate(teacher / "model.safetensors")
    line = refused_fit(tmp_path, capsys, "--model.teacher", str(teacher))
    assert "teacher/model.safetensors" in line, line


# ---------------------------------------------------------------------------------------------------- --config
@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("model:\n  lr: [0.1\n", r"not valid YAML \(.* at line 3, column 1\); fix the file"),
        ("trainer:\n  max_steps: 2\x00\n", r"not valid YAML \(unacceptable character #x0000"),
        ("model:\n\tlr: 0.1\n", r"not valid YAML \(.*at line 2, column 1\)"),
    ],
    ids=["unclosed-list", "nul-byte", "tab-indent"],
)
def test_a_config_file_that_is_not_yaml_is_named(tmp_path: Path, text: str, pattern: str):
    """Was: ``error: Problems parsing config: ... in "<unicode string>", line 2 ...``: no file named."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    before = hashes(tmp_path)
    proc = cli("fit", *FIT_CONFIGS, "--config", config, "--trainer.default_root_dir", tmp_path / "run")
    assert_one_line_error(proc, rf"^error: --config {re.escape(str(config))}: {pattern}")
    assert hashes(tmp_path) == before and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------- output paths
@pytest.mark.parametrize("name", ["checkpoints", "lightning_logs", "csv", "student"])
def test_a_file_where_the_run_writes_a_folder_is_refused_before_any_work(tmp_path: Path, capsys, name: str):
    """Was: the calibration ran to its end, then FileExistsError (a traceback) when it saved ``checkpoints/``."""
    root = tmp_path / "run"
    root.mkdir()
    (root / name).write_text("my notes\n")
    before = hashes(tmp_path)
    status, line = command(parse_main, [str(root), "--ckpt_path", "last"], capsys)
    assert status == 2 and hashes(tmp_path) == before
    assert line == (
        f"error: --trainer.default_root_dir {root}: the run writes its {name}/ folder there, but {root / name} is a "
        "file, not a directory; pass another path"
    )


def test_an_output_directory_that_is_a_link_to_nothing_is_one_line(tmp_path: Path, capsys):
    """Was: FileExistsError from mkdir (a traceback): a link to nothing does not exist(), so the checks walked past
    it to its existing parent."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    student = write_tiny_student(tmp_path / "student", a_bits=4, seed=0)
    said = f"{link} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist; create it or pass another path"
    before = hashes(tmp_path)
    status, line = command(export.main, ["--ckpt", str(student), "--out", str(link)], capsys)
    assert status == 2 and line == f"error: --out {link}: {said}"
    status, line = command(parse_main, [str(link)], capsys)
    assert status == 2 and line == f"error: --trainer.default_root_dir {link}: {said}"
    with pytest.raises(GuardError, match=re.escape(f"--out {link / 'fp.json'}: {said}")):
        check_output_file(link / "fp.json")  # evaluate --out: refused before the evaluation, not at its write
    with pytest.raises(LockError, match=re.escape(f"--out {link}: {said}")):
        DirectoryLock(link, RUN_LOCK, "loopq.report", "--out").acquire()
    assert hashes(tmp_path) == before and link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_ckpt_path_last_skips_a_last_ckpt_that_links_to_nothing(tmp_path: Path, capsys):
    """Was: ``error: .../last.ckpt: no such file or directory`` (no fix said), where a cut last.ckpt is skipped."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"global_step": 3, "state_dict": {"w": torch.zeros(4)}}, folder / "epoch=0-step=3.ckpt")
    os.utime(folder / "epoch=0-step=3.ckpt", ns=(10**18, 10**18))  # older than the link, as last.ckpt is
    (folder / "last.ckpt").symlink_to(tmp_path / "gone.ckpt")
    trainer = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=str(folder))])
    assert fit.resolve_ckpt_path(trainer, "last") == str(folder / "epoch=0-step=3.ckpt")
    err = capsys.readouterr().err
    assert re.search(r"skipped .*last\.ckpt: a symbolic link to .*gone\.ckpt, which does not exist", err), err
    assert newest_intact(fit.checkpoints_in([folder]), quiet=True) == folder / "epoch=0-step=3.ckpt"


# ---------------------------------------------------------------------------------------------------- examine --json
def test_examine_json_never_replaces_a_models_file_or_yours(tmp_path: Path, capsys, teacher: Path):
    """Was: ``examine --json teacher/config.json`` replaced the teacher's config with the numbers (exit 0), and a
    directory was refused only after the knock-outs, naming a temporary file."""
    student = write_tiny_student(tmp_path / "student", a_bits=4, seed=0)
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    (tmp_path / "folder").mkdir()
    cases = {
        teacher / "config.json": f"{teacher} is a pretrained teacher directory; write results elsewhere",
        student / "numbers.json": f"{student} is a student directory; write results elsewhere",
        notes: "exists and is not a loopq.examine --json file; pass a new path",
        tmp_path / "folder": "is a directory; pass a file path",
    }
    before = hashes(tmp_path)
    for out, said in cases.items():
        status, line = command(examine.main, [str(student), "--windows", "1", "--json", str(out)], capsys)
        assert status == 2 and line.startswith(f"error: --json {out}: {said}"), line
    assert hashes(tmp_path) == before
    out = tmp_path / "examined.json"
    for _ in range(2):  # an earlier one of its own is replaced
        examine.main([str(student), "--windows", "1", "--json", str(out)])
        assert json.loads(out.read_text())["student"] == str(student)


# ---------------------------------------------------------------------------------------------------- pretrain
@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--model.min_lr_ratio", "2"], r"--model\.min_lr_ratio 2\.0: out of range; it must be a number from 0 to 1"),
        (["--model.gate_weight=-1"], r"--model\.gate_weight -1\.0: out of range; it must be a finite number >= 0"),
        (["--model.lr=-0.003"], r"--model\.lr -0\.003: out of range; it must be a finite number > 0"),
        (["--model.weight_decay=-1"], r"--model\.weight_decay -1\.0: out of range"),
        (["--model.post_norm_init", "0"], r"--model\.post_norm_init 0\.0: out of range"),
        (["--model.num_key_value_heads", "3"], r"model\.num_key_value_heads=3: must be >= 1 and divide model\.num_at"),
        (["--model.num_key_value_heads", "0"], r"model\.num_key_value_heads=0: must be >= 1"),
    ],
)
def test_pretrain_training_numbers_are_checked_before_anything_is_built(tmp_path: Path, args, pattern):
    """Was: a min_lr_ratio of 2 or a negative gate weight trained (exit 0) with the schedule past its peak or the gate
    pushed away from its targets; 3 KV heads named config.json, 0 divided by zero."""
    config = ["--config", "configs/pretrain/tiny-ouro.yaml", "--model.out_dir", str(tmp_path / "out")]
    with pytest.raises(UsageError, match=pattern):
        pretrain.PretrainCLI(
            pretrain.TeacherPretrainer, pretrain.PretrainDataModule, run=False, args=[*config, *args],
            seed_everything_default=0,
        )  # fmt: skip
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------- session 27
def test_an_unknown_key_in_a_config_file_names_the_file(tmp_path: Path, capsys):
    """Was: ``error: Group 'model' does not accept option 'bogus_key'``, no file named (with several ``--config``
    files the user had to search them all). The file holding the key is named; a key typed on the command line has
    jsonargparse's own message (it names the option)."""
    extra = tmp_path / "extra.yaml"
    extra.write_text("model:\n  bogus_key: 3\n")
    line = refused_fit(tmp_path, capsys, "--config", str(extra))
    assert re.search(rf"does not accept option 'bogus_key' \(in --config {re.escape(str(extra))}: remove or", line)
    line = refused_fit(tmp_path, capsys, "--model.bogus_key", "3")
    assert "bogus_key" in line and "--config" not in line, line
    proc = cli("export", f"--config={extra}")  # the jsonargparse stack of the other commands
    assert_one_line_error(proc, rf"'model\.bogus_key' is not accepted \(in --config {re.escape(str(extra))}: remove")


def test_a_weights_file_that_is_a_directory_is_named(tmp_path: Path, teacher: Path):
    """Was: ``teacher: no model.safetensors (or ...) found`` while a ``model.safetensors`` folder was there."""
    (teacher / "model.safetensors").unlink()
    (teacher / "model.safetensors").mkdir()
    with pytest.raises(LoopLMError, match=r"teacher/model\.safetensors: a directory, not the weights file; replace"):
        load_looplm(teacher)
