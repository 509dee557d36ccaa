"""The GPU check's flow stages (loopq.commands.gpu_check.flow) on the CPU: the pipeline stage end to end with the CPU
as both devices (every command it runs, the agreement it computes), its verdicts on fabricated numbers, the plan parsing
on the paper config's real ``--print_plan`` output, the plan verdict, and the random teacher in the published
layout. What only a GPU can say (cuda numbers, allocator peaks) is measured by ``scripts/gpu_check.sh``."""

import json

import pytest
import torch

from loopq.commands.gpu_check import flow
from loopq.commands.gpu_check.table import FAIL, OK
from loopq.models import load_looplm
from loopq.paths import ASSETS
from tests.helpers import run_fit


def test_pipeline_runs_every_command_and_agrees_with_itself(tmp_path):
    run_fit(tmp_path / "fit")
    result = flow.pipeline(tmp_path / "flow", tmp_path / "fit" / "student", str(ASSETS / "tiny-ouro"), ("cpu", "cpu"))
    assert result.status == OK, result.summary
    assert set(result.details["ppl"]) == {"FP", "student", "export"}
    for by_device in result.details["ppl"].values():
        assert 1 < by_device["cpu"] < 1e4
    assert result.details["generated"]["cpu"].startswith(flow.PROMPT)
    assert "(0.000 %)" in result.summary and "the same text on both" in result.summary
    fp = json.loads((tmp_path / "flow" / "FP-cpu.json").read_text())
    assert fp["device"] == "cpu" and fp["wikitext2_windows"] == flow.PIPELINE_WINDOWS


def test_agreement_verdicts():
    ppl = {"FP": {"cpu": 200.0, "cuda": 200.1}, "export": {"cpu": 210.0, "cuda": 210.0}}
    ok = flow.agreement(ppl, {"cpu": "a b", "cuda": "a c"}, ("cpu", "cuda"))
    assert ok.status == OK and "FP 200.000 / 200.100 (0.050 %)" in ok.summary and "other text" in ok.summary
    ppl["export"]["cuda"] = 213.0  # 1.4 %
    assert flow.agreement(ppl, {"cpu": "a", "cuda": "a"}, ("cpu", "cuda")).status == FAIL


def test_plan_of_the_paper_config_is_parsed():
    from tests.helpers import REPO_ROOT

    proc = flow.run_command(["loopq.fit", "--config", flow.PAPER_CONFIG, "--print_plan"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = flow.plan_peaks(proc.stdout)
    lines = proc.stdout.splitlines()
    total = next(line for line in lines if line.strip().startswith("total")).split()
    assert f"{found['step']:.1f}" == total[1] and "probe" not in found  # SLT has no phase of its own
    peak = next(line for line in lines if "PEAK" in line)
    assert f"{found['peak']:.1f} GiB" in peak
    assert found["setup"] > 0 and REPO_ROOT.is_dir()


def test_plan_verdict_by_hand():
    planned = {"setup": 40.0, "step": 30.0}
    gib = 2**30
    near = {
        "setup": {"allocated": 44 * gib, "reserved": 50 * gib},
        "step": {"allocated": 27 * gib, "reserved": 30 * gib},
    }
    result = flow.plan_verdict(planned, near, 3)
    assert result.status == OK and "+10 %" in result.summary and "-10 %" in result.summary
    far = {**near, "setup": {"allocated": 79 * gib, "reserved": 79 * gib}}
    assert flow.plan_verdict(planned, far, 3).status == FAIL
    assert flow.plan_verdict(planned, {"setup": near["setup"]}, 3).status == FAIL  # no step measured


def test_random_teacher_in_the_published_layout(tmp_path):
    directory = flow.write_random_teacher(tmp_path / "t", layers=1, shard_gb=0.2)
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
    assert (directory / "model.safetensors.index.json").is_file() and (directory / "tokenizer.json").is_file()
    model = load_looplm(directory, dtype=torch.bfloat16)
    config = json.loads((directory / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (2048, 5632, 49152)
    assert config["num_hidden_layers"] == 1 and model.default_num_loops == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_peak_memory_callback_is_silent_without_cuda(tmp_path):
    callback = flow.PeakMemory(str(tmp_path / "p.json"))
    callback.on_train_batch_end(None, None)
    assert not (tmp_path / "p.json").exists() and callback.peaks == {}


def test_peak_memory_splits_the_step_into_its_parts(tmp_path, monkeypatch):
    """Each record is the allocator's peak since the one before (the peak is reset after it); ``step`` is the largest
    part over all steps, ``setup`` apart; the verdict names the parts."""
    gib = 2**30
    peaks = iter([2 * gib, 3 * gib, 5 * gib, 4 * gib, 3 * gib, 6 * gib, 1 * gib])  # setup, then 2 steps x 3 parts
    current = {"v": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: current.update(v=next(peaks)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: current["v"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: current["v"] + gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    callback = flow.PeakMemory(str(tmp_path / "p.json"))
    trainer = type("T", (), {"global_step": 0})()
    callback.on_train_batch_start(trainer, None, None, 0)
    for _ in range(2):
        callback.on_before_backward(trainer, None, None)
        callback.on_after_backward(trainer, None)
        callback.on_train_batch_end(trainer, None)
    written = json.loads((tmp_path / "p.json").read_text())
    allocated = {k: v["allocated"] // gib for k, v in written.items()}
    assert allocated == {"setup": 2, "forward": 3, "backward": 6, "optimizer": 4, "step": 6}
    assert written["step"]["reserved"] == 7 * gib
    result = flow.plan_verdict({"setup": 2.0, "step": 6.0}, written, 2)
    assert (
        result.status == OK
        and "step's parts (GiB allocated): forward 3.0, backward 6.0, optimizer 4.0" in result.summary
    )
