"""The fourth bad-input battery: files of the wrong kind where a command expects a file (a ``config.json`` holding a
list, an empty or cut ``model.safetensors``, a ``--config`` YAML with a syntax error or a NUL byte), each ending
with one ``error:`` line naming the file, exit status 2, and every file that existed before byte-identical.

``loopq.fit`` cases that must be refused before the teacher loads run in-process through
:func:`~tests.bad_inputs.test_refused_early.refused_fit` (the real CLI and its checks, nothing built).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from loopq.models import LoopLMError, load_looplm
from tests.bad_inputs.test_cli_errors import TEACHER, assert_one_line_error, cli, hashes, truncate
from tests.bad_inputs.test_refused_early import refused_fit
from tests.helpers import FIT_CONFIGS

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
