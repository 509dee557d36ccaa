"""End-to-end calibration through the real CLI: runs, logs every term, resumes after a real kill, bad input."""

import json

import pytest
import torch

from loopq.artifacts import load_student
from tests.helpers import assert_same_tensors, read_student, run_fit


@pytest.fixture(scope="module")
def uninterrupted(tiny_calibration):
    """The suite's shared tiny calibration (tests/conftest.py): the plain run_fit of FIT_CONFIGS, read-only."""
    return tiny_calibration


def test_fit_writes_student_logs_and_selections(uninterrupted):
    student_dir = uninterrupted / "student"
    _, meta = load_student(student_dir)
    assert meta["promoted"] and len(meta["promoted"]) == 2  # budget of configs/tiny.yaml
    assert len(meta["mu"]) == 4 and 0 < meta["mu"][0] < 1
    header = (next((uninterrupted / "csv").glob("version_*")) / "metrics.csv").read_text().splitlines()[0]
    for term in ("train/kl", "train/loopwise", "train/to_final", "train/transition", "mu/t0", "slt/num_selected"):
        assert term in header
    errors = next(uninterrupted.glob("lightning_logs/version_*/loop_errors.jsonl")).read_text().splitlines()
    assert len(json.loads(errors[-1])["errors"]) == 4  # one row of per-layer errors per loop
    assert (next(uninterrupted.glob("lightning_logs/version_*")) / "config.yaml").is_file()


def test_resume_after_kill_matches_uninterrupted_run(uninterrupted, tmp_path):
    killer = json.dumps({"class_path": "tests.helpers.KillAtStep", "init_args": {"step": 5}})
    crashed = run_fit(tmp_path, "--trainer.callbacks+", killer, check=False)
    assert crashed.returncode == -9, crashed.stderr[-2000:]  # SIGKILL: nothing ran after step 4
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file() and not (tmp_path / "student").exists()
    run_fit(tmp_path, "--ckpt_path", "last")
    (a, meta_a), (b, meta_b) = read_student(uninterrupted), read_student(tmp_path)
    assert_same_tensors(a, b, atol=1e-6)
    assert meta_a["promoted"] == meta_b["promoted"] and meta_a["mu"] == pytest.approx(meta_b["mu"])


def test_resume_without_las_after_a_promotion_matches_uninterrupted_run(tmp_path):
    """w/o LAS a promotion replaces the group's shared activation clip by per-loop ones (c_{t,l} only where SLT
    promoted); the checkpoint after it (step 3, promotions at steps 1 and 4) must resume into the same optimizer
    layout. It failed with a parameter-group size mismatch before (the Table 2 ablation could not resume)."""
    killer = json.dumps({"class_path": "tests.helpers.KillAtStep", "init_args": {"step": 5}})
    run_fit(tmp_path / "full", "--model.quant.las", "false")
    crashed = run_fit(tmp_path / "resumed", "--model.quant.las", "false", "--trainer.callbacks+", killer, check=False)
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    last = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3 and len(last["loopq"]["promoted"]) == 1
    run_fit(tmp_path / "resumed", "--model.quant.las", "false", "--ckpt_path", "last")
    (a, meta_a), (b, meta_b) = read_student(tmp_path / "full"), read_student(tmp_path / "resumed")
    assert len(meta_a["promoted"]) == 2 and meta_a["promoted"] == meta_b["promoted"]
    assert any(v.shape == (4,) for k, v in a.items() if k.endswith("act_clip"))  # per-loop clips were trained
    assert_same_tensors(a, b, atol=1e-6)


def test_unknown_config_key_is_one_line(tmp_path):
    out = run_fit(tmp_path, "--model.lamda", "0.1", check=False)
    assert out.returncode != 0 and "lamda" in out.stderr


def test_teacher_of_another_kind_is_named(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = run_fit(tmp_path, "--model.teacher", str(bad), check=False)
    assert out.returncode != 0 and "unknown architecture" in out.stderr


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(tmp_path):
    poison = json.dumps({"class_path": "tests.helpers.PoisonAtStep", "init_args": {"step": 4}})
    out = run_fit(tmp_path, "--trainer.callbacks+", poison, check=False)
    assert out.returncode != 0 and "loss is not finite at step 4" in out.stderr
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3  # written before the failure, intact, and free of NaN
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    assert not (tmp_path / "student").exists()


def test_calibration_text_shorter_than_a_sample_is_named(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short to make even one calibration sample.")
    out = run_fit(tmp_path, "--data.sources", f"[{short}]", check=False)
    assert out.returncode != 0 and "shorter than one sample of seq_len=32" in out.stderr


def test_promotions_never_edit_the_optimizer_or_the_scheduler(tmp_path):
    """The SLT layout is fixed: across two promotions (after steps 1 and 4) the optimizer's groups and parameters and
    the LambdaLR's base LRs and lambdas stay the objects ``configure_optimizers`` made."""
    guard = json.dumps({"class_path": "tests.calib.optimizer_guard.OptimizerGuard"})
    run_fit(tmp_path, "--trainer.callbacks+", guard)
    record = json.loads((tmp_path / "optimizer_guard.json").read_text())
    assert record["checks"] == 8 and record["promoted"] == [0, 1, 1, 1, 2, 2, 2, 2]
