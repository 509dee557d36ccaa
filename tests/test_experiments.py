"""Sweep orchestration of ``loopq.experiments`` with calibration and evaluation replaced by recorders."""

import json
from pathlib import Path

import pytest

from loopq import experiments


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    calls = {"calibrate": [], "evaluate": []}

    def calibrate(model, run_dir, config, a_bits, extra):
        calls["calibrate"].append((run_dir.name, a_bits, extra))
        student = run_dir / "student"
        student.mkdir(parents=True)
        (student / "loopq_quant.json").write_text(json.dumps({"calibrated_loops": 4}))
        return student

    def evaluate(out, **kwargs):
        calls["evaluate"].append(kwargs)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"wikitext2_ppl": 100.0, "method": kwargs.get("method")}))

    monkeypatch.setattr(experiments, "calibrate", calibrate)
    monkeypatch.setattr(experiments, "evaluate", evaluate)
    return calls


def test_slt_sweep_calibrates_each_budget_and_tags_its_json(recorded, tmp_path):
    paths = experiments.slt_budget("teacher", str(tmp_path / "slt"), budgets=[0, 2, 4])
    assert [c[2] for c in recorded["calibrate"]] == [["--model.quant.slt_budget", str(b)] for b in (0, 2, 4)]
    assert [json.loads(p.read_text())["slt_budget"] for p in paths] == [0, 2, 4]
    assert all(call["tasks"] == [] and call["bits"] == "w4a4" for call in recorded["evaluate"])
    # a re-run resumes: finished rows are neither recalibrated nor re-evaluated
    experiments.slt_budget("teacher", str(tmp_path / "slt"), budgets=[0, 2, 4, 8])
    assert [c[0] for c in recorded["calibrate"]] == ["slt-0", "slt-2", "slt-4", "slt-8"]
    assert len(recorded["evaluate"]) == 4


def test_num_samples_sweep_sets_the_data_size(recorded, tmp_path):
    paths = experiments.num_samples("teacher", str(tmp_path / "n"), sizes=[32, 1024], bits="w4a8")
    assert [c[1:] for c in recorded["calibrate"]] == [
        (8, ["--data.num_samples", "32"]),
        (8, ["--data.num_samples", "1024"]),
    ]
    assert [json.loads(p.read_text())["num_samples"] for p in paths] == [32, 1024]


def test_loop_sweep_evaluates_fp_rtn_and_student_from_t_to_2t(recorded, tmp_path):
    student = tmp_path / "student"
    student.mkdir()
    (student / "loopq_quant.json").write_text(json.dumps({"calibrated_loops": 3}))
    paths = experiments.loops("teacher", str(tmp_path / "loops"), student=str(student))
    assert [c["num_loops"] for c in recorded["evaluate"]] == [3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6, 6]
    assert [c["method"] for c in recorded["evaluate"][:3]] == ["FP", "RTN", "LoopQ"]
    assert len(paths) == 12 and not recorded["calibrate"]
