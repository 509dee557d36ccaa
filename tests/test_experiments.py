"""Sweep orchestration of ``loopq.experiments`` with calibration and evaluation replaced by recorders."""

import json
from pathlib import Path

import pytest

from loopq import experiments
from loopq.artifacts.layout import STUDENT_FORMAT, STUDENT_META, STUDENT_WEIGHTS


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


def test_loop_sweep_evaluates_fp_rtn_and_student_once_at_2t(recorded, tmp_path, monkeypatch):
    student = tmp_path / "student"
    student.mkdir()
    (student / STUDENT_META).write_text(json.dumps({"format": STUDENT_FORMAT, "calibrated_loops": 3}))
    (student / STUDENT_WEIGHTS).write_bytes(b"not read: evaluate is replaced below")

    def evaluate(out, **kwargs):
        recorded["evaluate"].append(kwargs)
        per_loop = [100.0 * 0.9**i for i in range(kwargs["num_loops"])]
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(
            json.dumps(
                {
                    "wikitext2_ppl": per_loop[-1],
                    "wikitext2_per_loop_ppl": per_loop,
                    "num_loops": kwargs["num_loops"],
                    "method": kwargs["method"],
                }
            )
        )

    monkeypatch.setattr(experiments, "evaluate", evaluate)
    paths = experiments.loops("teacher", str(tmp_path / "loops"), student=str(student))
    assert [(c["method"], c["num_loops"]) for c in recorded["evaluate"]] == [("FP", 6), ("Symmetric", 6), ("LoopQ", 6)]
    assert len(paths) == 12 and not recorded["calibrate"]
    by_name = {p.name: json.loads(p.read_text()) for p in paths}
    for n in range(3, 7):
        row = by_name[f"rtn-w4a4-loops{n}.json"]
        assert row["num_loops"] == n and row["wikitext2_ppl"] == pytest.approx(100.0 * 0.9 ** (n - 1))
        assert len(row["wikitext2_per_loop_ppl"]) == n
    # with lm-eval tasks every loop count is its own evaluation
    recorded["evaluate"].clear()
    experiments.loops("teacher", str(tmp_path / "tasks"), student=str(student), tasks=["lambada_openai"])
    assert [c["num_loops"] for c in recorded["evaluate"]] == [3, 4, 5, 6] * 3


def test_seeds_calibrate_every_trained_row_per_seed_and_training_free_rows_once(recorded, tmp_path):
    out = tmp_path / "t1"
    experiments.table1("teacher", str(out), seeds=[0, 1], bits=["w4a4"], extra=["--trainer.max_steps", "5"])
    runs = {c[0]: c[2] for c in recorded["calibrate"]}
    assert sorted(runs) == [f"{m}-w4a4-s{s}" for m in ("flatquant", "loopq", "spinquant") for s in (0, 1)]
    assert runs["loopq-w4a4-s1"] == [*experiments.seed_args(1), "--trainer.max_steps", "5"]
    assert experiments.seed_args(1) == ["--seed_everything", "1", "--model.quant.seed", "1", "--data.seed", "1"]
    assert json.loads((out / "loopq-w4a4-s1.json").read_text())["seed"] == 1
    assert (out / "rtn-w4a4.json").is_file() and not (out / "rtn-w4a4-s0.json").exists()
    experiments.table1("teacher", str(out), seeds=[0, 1, 2], bits=["w4a4"], methods=["LoopQ"])  # resumes
    assert [c[0] for c in recorded["calibrate"][6:]] == ["loopq-w4a4-s2"]


def test_summary_reports_mean_std_recovery_and_separation(tmp_path):
    rows = [("FP", "fp", 100.0), ("Symmetric", "w4a4", 400.0)]
    rows += [("LoopQ", "w4a4", v) for v in (199.0, 200.0, 201.0)]
    rows += [("QuaRot", "w4a4", v) for v in (240.0, 241.0, 239.0)]  # far away: separated
    rows += [("SpinQuant", "w4a4", v) for v in (201.0, 203.0, 199.0)]  # within the spread
    for i, (method, bits, ppl) in enumerate(rows):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"method": method, "bits": bits, "wikitext2_ppl": ppl}))
    (tmp_path / "sweep.json").write_text(json.dumps({"method": "LoopQ", "bits": "w4a4", "wikitext2_ppl": 1.0,
                                                     "slt_budget": 0}))  # fmt: skip
    text = experiments.summary(str(tmp_path))
    table = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 3 | 200.00 ± 1.00 | 0.50 |" in table["LoopQ"]  # R = ln(400/200) / ln(400/100)
    assert table["QuaRot"].endswith("+40.00 ** |") and table["SpinQuant"].endswith("+1.00 |")
    assert (tmp_path / "summary.md").read_text() == text


def test_ablations_evaluate_on_the_requested_windows(recorded, tmp_path):
    """``--ppl_windows`` used to be accepted and dropped here: a small-ouro ablation row was evaluated on all 1771
    windows and compared with table rows on 256."""
    paths = experiments.ablations("teacher", str(tmp_path), seeds=[0], tasks=[], ppl_windows=256)
    assert [p.name for p in paths] == ["loopq-wo-las-s0.json", "loopq-wo-slt-s0.json", "loopq-wo-cta-s0.json"]
    assert [c["ppl_windows"] for c in recorded["evaluate"]] == [256, 256, 256]
    assert [c["method"] for c in recorded["evaluate"]] == list(experiments.ABLATIONS)
