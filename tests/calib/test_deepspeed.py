"""DeepSpeed ZeRO through the real CLI on CPU processes (``LoopQDeepSpeedStrategy``, gloo).

DeepSpeed JIT-compiles a shared-memory CPU all-reduce op on first use (40-66 s); every run here sets
``LOOPQ_DEEPSPEED_SHM=0`` (read by ``loopq.calib.deepspeed``), which skips it: start-up ~2 s, plain gloo
collectives. SLT promotes progressively, as under DDP (``tests/configs/fit-deepspeed.yaml``: the parameter layout is
fixed from the start). DeepSpeed's loader reads its files weights-only here (a crafted file runs no code).

* ZeRO-2 in one process computes exactly what the plain trainer computes (bit-identical student after 8 steps:
  same AdamW, clipping, schedule, progressive selection).
* ZeRO-3 in two processes with per-loop activation checkpointing (``model.checkpoint_loops``): the student is
  gathered from its partitions and written; checkpoints are directories carrying ``loopq.json``; a run killed
  mid-way and resumed with ``--ckpt_path last`` ends bit-identical to the uninterrupted run; validation on shards
  of uneven size does not hang the collective forwards.
"""

import json
from functools import partial

import pytest

from loopq.artifacts import load_student
from loopq.calib.checkpoint_io import CheckpointError
from loopq.calib.deepspeed import SHM_ENV, SIDECAR, weights_only_deepspeed_loads
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
    # what DeepSpeed wrote reads weights-only, as a resume reads it (its few classes allowed)
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    files = sorted((last / "checkpoint").glob("*.pt"))
    with weights_only_deepspeed_loads():
        states = [TorchCheckpointEngine().load(str(f)) for f in files]
    assert len(files) == 2 and "module" in states[0] and "optimizer_state_dict" in states[1]


class RunsCode:
    """Unpickling it fully runs code: it writes the file it is given."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_deepspeed_file_is_refused_without_running_code(tmp_path):
    """DeepSpeed's own loader unpickles fully; a checkpoint directory's seal is a checksum anyone can recompute, and
    a bad-input review ran code from a re-sealed file through it. Read weights-only, the file is refused in one line
    and nothing runs; outside the block DeepSpeed's loader is its own again."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker, crafted = tmp_path / "ran", tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "payload": RunsCode(str(marker))}, crafted, _use_new_zipfile_serialization=False)
    original = TorchCheckpointEngine.load
    refused = pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt: not readable weights-only \(.*GLOBAL")
    with refused, weights_only_deepspeed_loads():
        TorchCheckpointEngine().load(str(crafted))
    assert not marker.exists() and TorchCheckpointEngine.load is original


@pytest.mark.slow
def test_zero3_two_processes_checkpoint_loops_resume(tmp_path):
    # validation of 5 windows on 2 ranks: rank 1's last batch is a masked row, whose skipped forwards hung ZeRO-3
    val = ["--data.val_samples", "5", "--trainer.val_check_interval", "4"]
    zero3 = [*TWO, *val, "--trainer.strategy.init_args.stage", "3", "--model.checkpoint_loops", "true"]
    run(tmp_path / "full", *zero3, procs=2)
    killer = json.dumps({"class_path": "tests.helpers.KillAtStep", "init_args": {"step": 5}})
    crashed = run(tmp_path / "resumed", *zero3, "--trainer.callbacks+", killer, procs=2, check=False)
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    assert crashed.returncode != 0 and last.is_dir() and not (tmp_path / "resumed" / "student").exists()
    assert len(list((last / "checkpoint").glob("zero_pp_rank_*_model_states.pt"))) == 2  # one shard per rank
    run(tmp_path / "resumed", *zero3, "--ckpt_path", "last", procs=2)
    (wa, meta_a), (wb, meta_b) = read_student(tmp_path / "full"), read_student(tmp_path / "resumed")
    assert meta_a["promoted"] == meta_b["promoted"] and meta_a["mu"] == meta_b["mu"]
    # every stored tensor, a promoted group's unused shared parameters included (stored at their promotion values)
    assert_same_tensors(wa, wb, atol=0)
    rebuilt, _ = load_student(tmp_path / "full" / "student")  # gathered, complete parameters
    assert all(p.numel() > 0 for p in rebuilt.parameters())


def test_progressive_selection_under_deepspeed(tmp_path):
    """ZeRO-2 runs the progressive schedule (no up-front rounds): one promotion per round, after steps 0 and 1."""
    strategy = json.dumps({"class_path": "loopq.calib.deepspeed.LoopQDeepSpeedStrategy", "init_args": {"stage": 2}})
    every_step = json.dumps(
        [{"class_path": "loopq.calib.reselection.SharingGapReselection", "init_args": {"every_n_steps": 1}}]
    )
    out = run(tmp_path, "--trainer.strategy", strategy, "--trainer.max_steps", "3", "--trainer.callbacks",
              every_step, configs=FIT_CONFIGS)  # fmt: skip
    assert "step 0: SLT promoted" in out.stdout and "step 1: SLT promoted" in out.stdout
    assert len(read_student(tmp_path)[1]["promoted"]) == 2


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({}, 1_056), ({"reduce_bucket_size": 500}, 500), ({"config": {"zero_optimization": {"stage": 2}}}, None)],
    ids=["sized", "user-set", "user-config"],
)
def test_gradient_buckets_are_sized_to_the_trainable_parameters(kwargs, expected, monkeypatch):
    """Lightning's default bucket (2e8 elements: two 800 MB fp32 buffers per ZeRO-2 backward) is capped at the
    trainable count - a 32 x 32 linear's weight and bias, 1,056; its frozen 8 -> 2 neighbour's 16 not counted -
    unless the strategy's ``reduce_bucket_size`` or a DeepSpeed config sets it (then untouched)."""
    import deepspeed
    import torch

    from loopq.calib.deepspeed import DEEPSPEED_BUCKET, LoopQDeepSpeedStrategy, sized_bucket

    seen = {}

    def initialize(**call):
        seen.update(call["config"].get("zero_optimization", {}))
        return "engine", "optimizer", None, None

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(8, 2, bias=False))
    model[1].weight.requires_grad_(False)
    strategy = LoopQDeepSpeedStrategy(stage=2, **kwargs)
    monkeypatch.setattr(strategy, "_device_rank", lambda: 0)  # no devices set up here
    strategy._setup_model_and_optimizer(model, None)
    assert seen.get("reduce_bucket_size") == expected
    assert sized_bucket(3 * DEEPSPEED_BUCKET) == DEEPSPEED_BUCKET and sized_bucket(0) == 1
