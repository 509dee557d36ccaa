"""Calibrating the trained baselines: FlatQuant's layer-wise objective, the baseline configs end to end through the
CLI, and the methods the calibration module refuses."""

import os
import subprocess
import sys

import pytest
import torch

from loopq.artifacts import load_student
from loopq.calib.losses import layerwise_loss
from loopq.calib.module import LoopQCalibration
from loopq.paths import ASSETS, REPO_ROOT
from loopq.quant import QuantConfig, QuantConfigError, quant_groups

TEACHER = str(ASSETS / "tiny-ouro")
ARCHS = {"ouro": "ouro-tiny", "loopformer": "loopformer-tiny", "parcae": "parcae-tiny"}


def batch(vocab, seed=0, size=2, length=32):
    ids = torch.randint(0, vocab, (size, length), generator=torch.Generator().manual_seed(seed))
    return [torch.arange(size), ids]


def test_layerwise_loss_by_hand():
    a, b = torch.zeros(1, 2, 2), torch.ones(1, 2, 2)
    terms = layerwise_loss([a, a, 2 * b, a], [b, a, b, 3 * b], [0, 0, 1, None])
    # per call (MSE): 1, 0, 1, 9
    assert float(terms["loss"]) == 11.0
    assert (float(terms["loop0"]), float(terms["loop1"]), float(terms["outside"])) == (1.0, 1.0, 9.0)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_layerwise_loss_is_zero_with_quantization_off(fixtures, arch):
    quant = QuantConfig.of_method("flatquant", 16, 16, transform_init="random")
    module = LoopQCalibration(str(fixtures / ARCHS[arch]), quant=quant, objective="layerwise")
    vocab = module.teacher.lm_head.weight.shape[0]
    terms = module.compute_loss(batch(vocab))
    calls = module.teacher.default_num_loops * len(module.teacher.loop_layers)
    assert len([k for k in terms if k.startswith("loop")]) == module.teacher.default_num_loops
    assert float(terms["loss"].detach()) < 1e-9 * calls
    if arch == "parcae":
        assert "outside" in terms  # prelude and coda are calibrated too


def test_layerwise_calibration_decreases_the_loss_on_the_tiny_teacher():
    module = LoopQCalibration(TEACHER, quant=QuantConfig.flatquant(4, 4), objective="layerwise")
    data = batch(module.teacher.lm_head.weight.shape[0], seed=3, size=2, length=64)
    params = [p for p in module.student.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=5e-3)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = module.compute_loss(data)["loss"]
        loss.backward()
        opt.step()
        losses.append(float(loss))
    # W4A4 rounding makes single steps noisy and thread-count dependent (step 8: 0.870 with 1 thread, 0.875 with 2,
    # 0.903 on a fresh CI clone). Measured best of steps 9-12: 0.813 (1 thread) / 0.832 (2 threads); margin > 0.09.
    assert min(losses[-4:]) < 0.93 * losses[0], losses
    assert all(torch.isfinite(p).all() for p in params)


def test_layerwise_gradients_reach_only_the_student(fixtures):
    module = LoopQCalibration(str(fixtures / "parcae-tiny"), quant=QuantConfig.flatquant(4, 4), objective="layerwise")
    module.compute_loss(batch(module.teacher.lm_head.weight.shape[0]))["loss"].backward()
    groups = quant_groups(module.student)
    assert all(g.transform.left.u.grad is not None for g in groups.values())  # every group, prelude/coda included
    assert all(p.grad is None for p in module.teacher.parameters())


@pytest.mark.parametrize("method", ["rtn", "smoothquant", "quarot"])
def test_training_free_methods_are_refused(method):
    with pytest.raises(QuantConfigError, match=rf"quant.method='{method}' is training-free"):
        LoopQCalibration(TEACHER, quant=QuantConfig.of_method(method))


def test_unknown_objective_is_named():
    with pytest.raises(ValueError, match=r"model.objective='blockwise'"):
        LoopQCalibration(TEACHER, quant=QuantConfig.flatquant(), objective="blockwise")


@pytest.mark.parametrize("name", ["spinquant", "flatquant"])
def test_baseline_config_calibrates_a_few_steps(tmp_path, name):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "loopq.fit", "--config", f"configs/baselines/{name}-tiny.yaml"]
    cmd += ["--trainer.max_steps", "3", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false"]
    cmd += ["--data.num_samples", "8", "--data.seq_len", "32", "--data.batch_size", "2"]
    cmd += ["--trainer.default_root_dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    student, meta = load_student(tmp_path / "student")
    assert meta["quant"]["method"] == name and meta["promoted"] == []
    assert student.transition is None
    header = next((tmp_path / "csv").glob("version_*/metrics.csv")).read_text().splitlines()[0]
    assert ("train/loop0" in header) == (name == "flatquant") and ("train/kl" in header) == (name == "spinquant")
