"""DeepSpeed ZeRO through the real CLI on CPU processes (``LoopQDeepSpeedStrategy``, gloo).

DeepSpeed JIT-compiles a shared-memory CPU all-reduce op on first use (40-66 s); every run here sets
``LOOPQ_DEEPSPEED_SHM=0`` (read by ``loopq.calib.deepspeed``), which skips it: start-up ~2 s, plain gloo
collectives. SLT selection runs up front (``tests/configs/fit-deepspeed.yaml``; a progressive config is switched to
up-front rounds with a warning).

* ZeRO-2 in one process computes exactly what the plain trainer computes (bit-identical student after 8 steps:
  same AdamW, clipping, schedule, upfront selection).
* ZeRO-3 in two processes with per-loop activation checkpointing (``model.checkpoint_loops``): the student is
  gathered from its partitions and written; checkpoints are directories carrying ``loopq.json``; a run killed
  mid-way and resumed with ``--ckpt_path last`` ends bit-identical to the uninterrupted run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loopq.calib.deepspeed import SHM_ENV, SIDECAR
from loopq.calib.student_io import CONFIG, WEIGHTS, load_student
from loopq.paths import REPO_ROOT

pytest.importorskip("deepspeed")

PLAIN = ["--config", "configs/tiny.yaml", "--config", "tests/configs/fit-test.yaml"]
DS = [*PLAIN, "--config", "tests/configs/fit-deepspeed.yaml"]
TWO = ["--trainer.devices", "2", "--data.batch_size", "1"]


def run(root: Path, base: list[str], *extra: str, procs: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), SHM_ENV: "0"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    cmd = [*(launcher if procs > 1 else [sys.executable]), "-m", "loopq.fit", *base]
    cmd += ["--trainer.default_root_dir", str(root), *(TWO if procs > 1 else []), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:8])} ... failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out


def student(root: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(root / "student" / WEIGHTS)), json.loads((root / "student" / CONFIG).read_text())


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=0, rtol=0, msg=key)


def test_zero2_single_process_matches_plain_trainer(tmp_path):
    run(tmp_path / "plain", DS, "--trainer.strategy", "auto")
    out = run(tmp_path / "zero2", DS)
    assert "initializing deepspeed distributed" in out.stderr + out.stdout
    assert "shm_comm" not in out.stdout  # the JIT-compiled op was skipped
    (wa, meta_a), (wb, meta_b) = student(tmp_path / "plain"), student(tmp_path / "zero2")
    assert meta_a["promoted"] == meta_b["promoted"] and len(meta_b["promoted"]) == 2
    assert meta_a["mu"] == meta_b["mu"]
    assert_identical(wa, wb)
    last = tmp_path / "zero2" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / "checkpoint").is_dir()
    assert json.loads((last / SIDECAR).read_text())["promoted"] == meta_b["promoted"]


@pytest.mark.slow
def test_zero3_two_processes_checkpoint_loops_resume(tmp_path):
    zero3 = ["--trainer.strategy.init_args.stage", "3", "--model.checkpoint_loops", "true"]
    run(tmp_path / "full", DS, *zero3, procs=2)
    killer = json.dumps({"class_path": "tests.helpers.KillAtStep", "init_args": {"step": 5}})
    crashed = run(tmp_path / "resumed", DS, *zero3, "--trainer.callbacks+", killer, procs=2, check=False)
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    assert crashed.returncode != 0 and last.is_dir() and not (tmp_path / "resumed" / "student").exists()
    assert len(list((last / "checkpoint").glob("zero_pp_rank_*_model_states.pt"))) == 2  # one shard per rank
    run(tmp_path / "resumed", DS, *zero3, "--ckpt_path", "last", procs=2)
    (wa, meta_a), (wb, meta_b) = student(tmp_path / "full"), student(tmp_path / "resumed")
    assert meta_a["promoted"] == meta_b["promoted"] and meta_a["mu"] == meta_b["mu"]
    assert_identical(wa, wb)
    rebuilt, _ = load_student(tmp_path / "full" / "student")  # gathered, complete parameters
    assert all(p.numel() > 0 for p in rebuilt.parameters())


def test_progressive_selection_switches_to_upfront_under_deepspeed(tmp_path):
    strategy = json.dumps({"class_path": "loopq.calib.deepspeed.LoopQDeepSpeedStrategy", "init_args": {"stage": 2}})
    out = run(tmp_path, PLAIN, "--trainer.strategy", strategy, "--trainer.max_steps", "2")  # progressive config
    assert "all SLT rounds run up front" in out.stderr
    assert out.stdout.count("[loopq] step 0: SLT promoted") == 2  # the whole budget before the first step
    assert len(student(tmp_path)[1]["promoted"]) == 2
