"""The third bad-input battery (issue 38), the calibration half: nothing executes, nothing trains backwards, configs
and teachers are checked before anything is built. Each case ends with one ``error:`` line naming the option, key or
file, exit status 2, and every file that existed before byte-identical; everything runs on copies under ``tmp_path``.

``loopq.fit`` cases that must be refused before the teacher loads run in-process through
:func:`~tests.bad_inputs.test_refused_early.refused_fit` (the real CLI and its checks, nothing built), so that a test
that passes proves the refusal comes first.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopq.calib.checkpoint_io import SIDECAR, CheckpointError, check_sealed, load_weights_only, write_sidecar
from loopq.calib.stop_on_signal import LIGHTNING_SIGNAL_LOGGER, install
from loopq.config_yaml import MAX_NODES, expanded_size
from loopq.data.tokenizer import TokenizerError, load_tokenizer
from loopq.models import LoopLMError, load_looplm
from loopq.paths import REPO_ROOT
from tests.bad_inputs.test_artifact_integrity import write_tiny_student
from tests.bad_inputs.test_cli_errors import TEACHER, assert_one_line_error, cli, hashes
from tests.bad_inputs.test_refused_early import refused_fit
from tests.helpers import FIT_CONFIGS

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
#: three steps of 8 x 32 tokens
SMALL = ("--trainer.max_steps", "2", "--data.num_samples", "8", "--data.batch_size", "2")
ENV = {"LOOPQ_DEEPSPEED_SHM": "0"}


class Payload:
    """What a hostile checkpoint holds: unpickling it creates ``marker`` (the side effect checked not to happen)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def plant(path: Path, marker: Path) -> None:
    torch.save({"state_dict": {}, "loopq": {}, "payload": Payload(marker)}, path)


# ---------------------------------------------------------------------------------------------------- case 1
@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory) -> Path:
    """A finished 2-step ZeRO-2 calibration (its checkpoints are sealed directories)."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("ds") / "run"
    configs = [*FIT_CONFIGS, "--config", "tests/configs/fit-deepspeed.yaml"]
    proc = cli("fit", *configs, "--trainer.default_root_dir", root, *SMALL, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_a_deepspeed_checkpoint_is_sealed_with_every_file(deepspeed_run: Path):
    last = deepspeed_run / "checkpoints" / "last.ckpt"
    sidecar = json.loads((last / SIDECAR).read_text())
    on_disk = {p.relative_to(last).as_posix() for p in last.rglob("*") if p.is_file() and p.name != SIDECAR}
    assert set(sidecar["files"]) == on_disk and "checkpoint/mp_rank_00_model_states.pt" in on_disk
    assert sidecar["global_step"] == 2
    check_sealed(last)  # what was written verifies


@pytest.mark.parametrize("how", ["replaced", "added"])
def test_a_planted_payload_in_a_deepspeed_checkpoint_never_runs(deepspeed_run: Path, tmp_path: Path, how: str):
    """Case 1: DeepSpeed unpickles its files (weights_only=False): the payload ran, exit 0. Now the seal fails first."""
    root = Path(shutil.copytree(deepspeed_run, tmp_path / "run"))
    marker = tmp_path / "PAYLOAD-RAN"
    target = root / "checkpoints" / "last.ckpt" / "checkpoint"
    plant(target / ("mp_rank_00_model_states.pt" if how == "replaced" else "extra.pt"), marker)
    before = hashes(tmp_path)
    configs = [*FIT_CONFIGS, "--config", "tests/configs/fit-deepspeed.yaml"]
    for ckpt in ("last", root / "checkpoints" / "last.ckpt"):
        proc = cli("fit", *configs, "--trainer.default_root_dir", root, *SMALL, "--ckpt_path", ckpt, env=ENV)
        assert_one_line_error(proc, r"(changed|added) since")
    assert not marker.exists() and hashes(tmp_path) == before


def test_an_unsealed_or_edited_sidecar_is_refused(deepspeed_run: Path, tmp_path: Path):
    last = Path(shutil.copytree(deepspeed_run / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt"))
    meta = json.loads((last / SIDECAR).read_text())
    (last / SIDECAR).write_text(json.dumps({**meta, "global_step": 0}))
    with pytest.raises(CheckpointError, match="edited after it was written"):
        check_sealed(last)
    (last / SIDECAR).write_text(json.dumps({k: v for k, v in meta.items() if k != "meta_sha256"}))
    with pytest.raises(CheckpointError, match="has no meta_sha256 seal"):
        check_sealed(last)
    write_sidecar(last, {"promoted": []})  # resealed over the same files: whole again
    check_sealed(last)


def test_resuming_a_finished_deepspeed_run_says_it_is_finished(deepspeed_run: Path, tmp_path: Path):
    """Was: "No training batches" then "calibrated student written", exit 0."""
    root = Path(shutil.copytree(deepspeed_run, tmp_path / "run"))
    before = hashes(tmp_path)
    configs = [*FIT_CONFIGS, "--config", "tests/configs/fit-deepspeed.yaml"]
    proc = cli("fit", *configs, "--trainer.default_root_dir", root, *SMALL, "--ckpt_path", "last", env=ENV)
    assert_one_line_error(proc, r"the calibration is finished \(step 2 of --trainer.max_steps 2\)")
    assert hashes(tmp_path) == before


# ---------------------------------------------------------------------------------------------------- pickle .ckpt
def test_a_pickle_payload_ckpt_is_one_line_and_never_runs(tmp_path: Path, capsys):
    marker = tmp_path / "PAYLOAD-RAN"
    ckpt = tmp_path / "planted.ckpt"
    plant(ckpt, marker)
    line = refused_fit(tmp_path, capsys, "--ckpt_path", str(ckpt))
    assert re.search(r"planted\.ckpt: not a LoopQ calibration checkpoint .*never unpickles", line), line
    run_ckpts = tmp_path / "run2" / "checkpoints"
    run_ckpts.mkdir(parents=True)
    plant(run_ckpts / "last.ckpt", marker)
    write_tiny_student(tmp_path / "run2" / "student", a_bits=4, seed=0)
    before = hashes(tmp_path)
    proc = cli("fit", *FIT_CONFIGS, "--trainer.default_root_dir", tmp_path / "run2", "--ckpt_path", "last")
    assert_one_line_error(proc, r"last\.ckpt: not a LoopQ calibration checkpoint")
    proc = cli("examine", tmp_path / "run2", "--windows", "1")
    assert_one_line_error(proc, r"last\.ckpt: not a LoopQ calibration checkpoint")
    assert not marker.exists() and hashes(tmp_path) == before
    with pytest.raises(CheckpointError):
        load_weights_only(ckpt)


# ---------------------------------------------------------------------------------------------------- cases 2, 3
@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--model.lr=-0.005"], r"--model\.lr -0\.005: out of range; it must be a finite number > 0"),
        (["--model.lr", "0"], r"--model\.lr 0\.?0?: out of range"),
        (["--model.lr", "nan"], r"--model\.lr: nan is not a finite number"),
        (["--model.lr", "inf"], r"--model\.lr: inf is not a finite number"),
        (["--model.lr", ".nan"], r"--model\.lr nan: not finite"),
        (["--model.clip_lr_mult=-1"], r"--model\.clip_lr_mult -1\.?0?: out of range"),
        (["--trainer.max_epochs", "0"], r"--trainer\.max_epochs 0: no optimizer step would run"),
        (["--trainer.limit_train_batches", "0"], r"--trainer\.limit_train_batches 0: no training batch would run"),
        (["--trainer.limit_train_batches", "0.01"], r"--trainer\.limit_train_batches 0\.01: no training batch"),
        (["--trainer.max_steps", "0"], r"--trainer\.max_steps 0: .* must be 1 or more"),
        (["--trainer.max_time", "00:00:00:00"], r"--trainer\.max_time 00:00:00:00: no time to train"),
        (["--trainer.strategy", "dpp"], r"--trainer\.strategy dpp: not a strategy Lightning knows; did you mean ddp"),
        (["--trainer.accumulate_grad_batches", "2"], r"--trainer\.accumulate_grad_batches 2: calibration takes one"),
        (["--trainer.devices", "0"], r"--trainer\.devices 0: no device to run on"),
        (["--model.topk", "0"], r"--model\.topk 0: out of range; it must be a whole number >= 1"),
        (["--model.topk=-5"], r"--model\.topk -5: out of range"),
        (["--model.objective", "layerwize"], r"model\.objective='layerwize': use one of"),
        (["--data.holdout_samples=-1"], r"data\.holdout_samples=-1: a count of held-out windows"),
    ],
)
def test_zero_or_negative_work_is_refused_before_any_work(tmp_path: Path, capsys, args, pattern):
    line = refused_fit(tmp_path, capsys, *args)
    assert re.search(pattern, line), line


# ---------------------------------------------------------------------------------------------------- case 6
def alias_bomb(levels: int) -> str:
    """``levels`` nested alias levels under data.sources, each ten times the one before (about 550 bytes for 9)."""
    lines = ["data:", "  sources:", "    - &a0 [" + ", ".join(["x"] * 10) + "]"]
    lines += [f"    - &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_alias_expansion_is_counted_not_performed():
    import yaml

    node = yaml.compose(alias_bomb(3))
    # root map, "data", its map, "sources", the list, then a0 (1 + 10), a1 (1 + 10 x 11), a2 (1 + 10 x 111)
    assert expanded_size(node, {}, 10**9) == 5 + 11 + 111 + 1111
    assert expanded_size(yaml.compose(alias_bomb(9)), {}, MAX_NODES) == MAX_NODES + 1


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (alias_bomb(9), r"its aliases \(\*name\) expand to more than 100,000 settings"),
        ("model:\n  lr: 0.005\n  lam: 0.1\n  lr: -1\n", r"key 'lr' appears twice in one mapping \(line 4\)"),
        ("trainer:\n  max_steps: 3\ntrainer:\n  max_steps: 4\n", r"key 'trainer' appears twice .*\(line 3\)"),
    ],
)
def test_yaml_bombs_and_duplicate_keys_are_one_line_naming_the_file(tmp_path: Path, text, pattern):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    before = hashes(tmp_path)
    proc = cli("fit", *FIT_CONFIGS, "--config", config, "--trainer.default_root_dir", tmp_path / "run")
    assert_one_line_error(proc, rf"--config {re.escape(str(config))}: {pattern}")
    assert hashes(tmp_path) == before and not (tmp_path / "run").exists()


def test_yaml_option_values_go_through_the_same_check(tmp_path: Path, capsys):
    bomb = alias_bomb(9).split("sources:\n", 1)[1]
    line = refused_fit(tmp_path, capsys, "--data.sources", bomb)
    assert line.startswith("error: --data.sources value: its aliases (*name) expand to more than"), line
    line = refused_fit(tmp_path, capsys, "--model={lr: 0.1, lr: -1}")
    assert line.startswith("error: --model value: key 'lr' appears twice"), line


# ---------------------------------------------------------------------------------------------------- case 7
@pytest.fixture
def teacher(tmp_path: Path) -> Path:
    return Path(shutil.copytree(TEACHER, tmp_path / "teacher"))


def edit_config(teacher: Path, **values) -> None:
    path = teacher / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


@pytest.mark.parametrize(
    ("values", "pattern"),
    [
        ({"hidden_size": "128"}, r"config\.json: hidden_size is a str \('128'\); it must be int"),
        ({"total_ut_steps": 0}, r"config\.json: total_ut_steps is 0, but it is a size or count and must be >= 1"),
        ({"num_hidden_layers": True}, r"num_hidden_layers is a boolean; it must be int"),
        ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps is a str"),
        ({"num_hidden_layers": 1000000}, r"num_hidden_layers=1000000 describes 1000000 layers, but the weight files"),
        ({"hidden_size": 256}, r"has shape .* but config\.json implies"),
        ({"num_hidden_layers": 3}, r"checkpoint keys do not match"),
    ],
)
def test_teacher_config_json_is_checked_before_anything_is_built(tmp_path, capsys, teacher, values, pattern):
    edit_config(teacher, **values)
    line = refused_fit(tmp_path, capsys, "--model.teacher", str(teacher))
    assert re.search(pattern, line), line


def test_a_million_layer_config_is_refused_by_load_and_by_the_memory_plan(tmp_path, capsys, teacher: Path):
    """Case 7: the memory guard built the million layers (112 s, 5.2 GB, MemoryError); now nothing is built."""
    edit_config(teacher, num_hidden_layers=1000000)
    with pytest.raises(LoopLMError, match="describes 1000000 layers"):
        load_looplm(teacher)
    line = refused_fit(tmp_path, capsys, "--model.teacher", str(teacher), "--print_plan")
    assert "num_hidden_layers=1000000 describes 1000000 layers" in line, line


# ---------------------------------------------------------------------------------------------------- teachers on load
def test_a_non_finite_teacher_weight_is_refused_naming_the_tensor(teacher: Path, tmp_path: Path):
    weights = load_file(str(teacher / "model.safetensors"))
    name = sorted(weights)[3]
    weights[name].view(-1)[7] = float("nan")
    save_file(weights, str(teacher / "model.safetensors"))
    with pytest.raises(LoopLMError, match=rf"tensor {re.escape(repr(name))} holds NaN or infinite values"):
        load_looplm(teacher)
    before = hashes(tmp_path)
    proc = cli("evaluate", "--model", teacher, "--method", "fp", "--out", tmp_path / "fp.json", "--limit", "1")
    assert_one_line_error(proc, rf"tensor {re.escape(repr(name))} holds NaN")
    assert hashes(tmp_path) == before


def test_a_teacher_without_tokenizer_json_is_not_looked_up_on_the_hub(tmp_path, capsys, monkeypatch, teacher):
    (teacher / "tokenizer.json").unlink()
    line = refused_fit(tmp_path, capsys, "--model.teacher", str(teacher))
    assert re.search(r"teacher: no tokenizer\.json", line) and "hub" not in line, line
    monkeypatch.chdir(tmp_path)  # "teacher/tokenizer.json" looks like a hub id (org/name) but is a local path
    with pytest.raises(TokenizerError, match=r"^teacher/tokenizer\.json: no such file or directory") as err:
        load_tokenizer("teacher/tokenizer.json")
    assert "hub" not in str(err.value)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused_up_front(tmp_path, capsys, teacher):
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    extra = {f"zz{i}": len(vocab) + i for i in range(3000)}  # ids beyond the model's 2048 rows
    tok["model"]["vocab"] = {**vocab, **extra}
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    line = refused_fit(tmp_path, capsys, "--model.teacher", str(teacher))
    assert re.search(r"tokenizer\.json: .* ids up to \d+ but the model's vocabulary has 2048", line), line


# ---------------------------------------------------------------------------------------------------- normal use
def test_lightnings_sigterm_notice_is_not_printed_for_a_ctrl_c(tmp_path: Path):
    import lightning as L

    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    install(trainer)
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger(LIGHTNING_SIGNAL_LOGGER)
    handler = Collect()
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        logger.info("[rank: 0] Received SIGTERM: 15")  # what Lightning's handler logs for a Ctrl-C routed to it
        logger.info("Bypassing SIGTERM: 15")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert seen == ["Bypassing SIGTERM: 15"]


OFFLINE = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_generate_refuses_a_loop_count_beyond_memory_up_front(tmp_path: Path):
    before = hashes(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "loopq.generate", "--model", str(TEACHER), "--prompt", "a", "--max_new_tokens", "2",
         "--num_loops", "100000"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "LOOPQ_ALLOW_LOW_MEMORY"}, **OFFLINE},
    )  # fmt: skip
    assert_one_line_error(proc, r"--num_loops 100000: ")
    assert hashes(tmp_path) == before
