"""Multi-process calibration through the real CLI under ``torchrun`` (2 CPU processes, gloo).

What is compared, and why these tolerances:

* **World-size invariance** (1 process x batch 2 == 2 processes x batch 1): run in float64
  (``--trainer.precision 64-true``) and compared with atol 1e-9. W4A4 fake quantization makes the calibration
  loss *piecewise constant* in the parameters: in float32 the ~1e-7 relative difference between summing a
  gradient inside one batch and averaging two per-process gradients (all-reduce order) flips 4-bit rounding
  decisions, changes per-sample losses by ~0.5 % after a single step and can change the next SLT selection
  (measured: a 1e-7 relative perturbation of the student moves the loss by 5e-3 relative; with w16/a16 by
  2e-7). So no float32 tolerance separates "correct" from "buggy" after 8 steps. In float64 the same
  reduction-order noise is ~1e-16 and lands on no rounding boundary: the measured difference of the final
  students is ~4e-11, while every real bug found here (per-rank mu_t ratios, clipping initialised from the
  per-process batch, a missing all-reduce of late-promoted parameters, transforms computed in fp32 inside a
  float64 run) moves them by > 1e-3.
* **Rank consistency**: both ranks end with bit-identical students (the late-promoted parameters are averaged
  by hand, everything else by DDP).
* **Exact DDP resume** (float32, the production precision): a 2-process run SIGKILLed mid-run and resumed with
  ``--ckpt_path last`` ends bit-identical to the uninterrupted 2-process run (same reduction order both times;
  the resumed run re-promotes the first SLT group *before* DDP wraps the model, promotes the second one after).
  Float64 resume is not usable for this: Lightning restores the checkpoint into the float32 module before
  ``64-true`` converts it, rounding the restored parameters to float32.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import assert_same_tensors, read_student, run_fit

DDP = ["--trainer.devices", "2", "--trainer.strategy", "ddp_find_unused_parameters_true", "--data.batch_size", "1"]
RANK_DUMP = json.dumps({"class_path": "tests.helpers.SaveRankStudent"})


def test_two_processes_match_one_process(tmp_path):
    fp64 = ["--trainer.precision", "64-true"]
    run_fit(tmp_path / "one", *fp64)
    run_fit(tmp_path / "two", *DDP, *fp64, "--trainer.callbacks+", RANK_DUMP, procs=2)
    (w1, meta1), (w2, meta2) = read_student(tmp_path / "one"), read_student(tmp_path / "two")
    assert meta1["promoted"] == meta2["promoted"] and len(meta1["promoted"]) == 2  # the same SLT selections
    assert meta2["mu"] == pytest.approx(meta1["mu"], abs=1e-9)
    assert next(iter(w1.values())).dtype == torch.float64
    assert_same_tensors(w1, w2, atol=1e-9)
    rank0, rank1 = (load_file(str(tmp_path / "two" / f"rank{r}.safetensors")) for r in (0, 1))
    assert_same_tensors(rank0, rank1, atol=0)  # DDP kept the replicas bit-identical
    assert_same_tensors(rank0, w2, atol=0)  # what rank 0 wrote is its replica


@pytest.mark.slow
def test_ddp_resume_after_kill_is_exact(tmp_path):
    run_fit(tmp_path / "full", *DDP, procs=2)
    killer = json.dumps({"class_path": "tests.helpers.KillAtStep", "init_args": {"step": 4}})
    crashed = run_fit(tmp_path / "resumed", *DDP, "--trainer.callbacks+", killer, procs=2, check=False)
    assert crashed.returncode != 0 and (tmp_path / "resumed" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "resumed" / "student").exists()
    run_fit(tmp_path / "resumed", *DDP, "--ckpt_path", "last", procs=2)
    (wa, meta_a), (wb, meta_b) = read_student(tmp_path / "full"), read_student(tmp_path / "resumed")
    assert meta_a["promoted"] == meta_b["promoted"] and meta_a["mu"] == meta_b["mu"]
    assert_same_tensors(wa, wb, atol=0)
