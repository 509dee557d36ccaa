"""DeepSpeed ZeRO through the real CLI on CPU processes (``LoopQDeepSpeedStrategy``, gloo).

DeepSpeed JIT-compiles a shared-memory CPU all-reduce op on first use (40-66 s); every run here sets
``LOOPQ_DEEPSPEED_SHM=0`` (read by ``loopq.calib.deepspeed``), which skips it: start-up ~2 s, plain gloo
collectives. SLT selection runs up front (``tests/configs/fit-deepspeed.yaml``; a progressive config is switched to
up-front rounds with a warning).

* ZeRO-2 in one process computes exactly what the plain trainer computes (bit-identical student after 8 steps:
  same AdamW, clipping, schedule, progressive selection).
* ZeRO-3 in two processes with per-loop activation checkpointing (``model.checkpoint_loops``): the student is
  gathered from its partitions and written; checkpoints are directories carrying ``loopq.json``; a run killed
  mid-way and resumed with ``--ckpt_path last`` ends bit-identical to the uninterrupted run.
"""

import json
from functools import partial

import pytest

from loopq.artifacts import load_student
from loopq.calib.deepspeed import SHM_ENV, SIDECAR
from tests.helpers import FIT_CONFIGS, assert_same_tensors, read_student, run_fit

pytest.importorskip("deepspeed")

DS = [*FIT_CONFIGS, "--config", "tests/configs/fit-deepspeed.yaml"]
TWO = ["--trainer.devices", "2", "--data.batch_size", "1"]
run = partial(run_fit, configs=DS, env={SHM_ENV: "0"})  # every run skips the JIT-compiled shm all-reduce


def test_zero2_single_process_matches_plain_trainer(tmp_path):
    run(tmp_path / "plain", "--trainer.strategy", "auto")
    out = run(tmp_path / "zero2")
    assert "initializing deepspeed distributed" in out.stderr + out.stdout
    assert "shm_comm" not in out.stdout  # the JIT-compiled op was skipped
    (wa, meta_a), (wb, meta_b) = read_student(tmp_path / "plain"), read_student(tmp_path / "zero2")
    assert meta_a["promoted"] == meta_b["promoted"] and len(meta_b["promoted"]) == 2
    assert meta_a["mu"] == meta_b["mu"]
    assert_same_tensors(wa, wb, atol=0)
    last = tmp_path / "zero2" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / "checkpoint").is_dir()
    assert json.loads((last / SIDECAR).read_text())["promoted"] == meta_b["promoted"]


@pytest.mark.slow
def test_zero3_two_processes_checkpoint_loops_resume(tmp_path):
    zero3 = [*TWO, "--trainer.strategy.init_args.stage", "3", "--model.checkpoint_loops", "true"]
    run(tmp_path / "full", *zero3, procs=2)
    killer = json.dumps({"class_path": "tests.helpers.KillAtStep", "init_args": {"step": 5}})
    crashed = run(tmp_path / "resumed", *zero3, "--trainer.callbacks+", killer, procs=2, check=False)
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    assert crashed.returncode != 0 and last.is_dir() and not (tmp_path / "resumed" / "student").exists()
    assert len(list((last / "checkpoint").glob("zero_pp_rank_*_model_states.pt"))) == 2  # one shard per rank
    run(tmp_path / "resumed", *zero3, "--ckpt_path", "last", procs=2)
    (wa, meta_a), (wb, meta_b) = read_student(tmp_path / "full"), read_student(tmp_path / "resumed")
    assert meta_a["promoted"] == meta_b["promoted"] and meta_a["mu"] == meta_b["mu"]
    # A promoted group computes with its per-loop slots; its shared transform and weight clip are dead from then on
    # but still take AdamW's momentum steps (zero gradients), which ZeRO-3 resumes one step differently. They do not
    # enter the student's function or its export: everything it computes with must be bit-identical.
    dead = [f"{g}.{part}" for g in meta_a["promoted"] for part in ("transform.", "weight_clip")]
    live = [k for k in wa if not any(k == d or k.startswith(d) for d in dead)]
    assert len(live) < len(wa)
    assert_same_tensors({k: wa[k] for k in live}, {k: wb[k] for k in live}, atol=0)
    rebuilt, _ = load_student(tmp_path / "full" / "student")  # gathered, complete parameters
    assert all(p.numel() > 0 for p in rebuilt.parameters())


def test_progressive_selection_under_deepspeed(tmp_path):
    """ZeRO-2 runs the progressive schedule (no up-front rounds): one promotion per round, after steps 0 and 1."""
    strategy = json.dumps({"class_path": "loopq.calib.deepspeed.LoopQDeepSpeedStrategy", "init_args": {"stage": 2}})
    out = run(tmp_path, "--trainer.strategy", strategy, "--trainer.max_steps", "3", "--trainer.callbacks",
              "[]", "--model.slt_every_n_steps", "1", configs=FIT_CONFIGS)  # fmt: skip
    assert "step 0: SLT promoted" in out.stdout and "step 1: SLT promoted" in out.stdout
    assert len(read_student(tmp_path)[1]["promoted"]) == 2
