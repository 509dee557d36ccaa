"""``loopq.experiments`` resumes by ``loopq.run``'s rule (the stage runner of :mod:`loopq.stages`): a row is skipped
only if its JSON exists and its recorded inputs match; a row whose config changed runs again. The rule is checked
with the calibration and evaluation replaced by recorders, and once end to end on the committed tiny teacher."""

import json
import os
from pathlib import Path

import pytest
import torch

from loopq.artifacts.layout import STUDENT_FORMAT, STUDENT_META
from loopq.artifacts.seal import FILES, seal
from loopq.commands import experiments, fit
from loopq.provenance import record
from loopq.stages import Manifest

#: what configs/tiny.yaml's data section resolves to (test_experiments_table1 checks it on the real file)
TINY_DATA = experiments.CalibrationData(None, 256, 128)


@pytest.fixture
def recorded(monkeypatch):
    calls: dict[str, list] = {"evaluate": [], "calibrate": []}

    def fake_evaluate(out, **kwargs):
        calls["evaluate"].append(Path(out).stem)
        Path(out).write_text(json.dumps({"method": kwargs["method"], "bits": "x", "wikitext2_ppl": 1.0}))

    def fake_calibrate(calibration):
        calls["calibrate"].append(calibration.run.name)
        return calibration.student

    monkeypatch.setattr(experiments, "evaluate", fake_evaluate)
    monkeypatch.setattr(experiments, "calibrate", fake_calibrate)
    monkeypatch.setattr(experiments, "calibration_settings", lambda calibration: {"args": calibration.args()})
    monkeypatch.setattr(experiments, "calibration_data", lambda model, config, extra: TINY_DATA)
    monkeypatch.setattr(experiments, "teacher_sha256", lambda model: f"sha256 of {model}")
    return calls


def table1(out, **options):
    return experiments.table1("teacher", str(out), bits=["w4a4"], tasks=[], device="cpu", **options)


def test_a_rerun_with_nothing_changed_runs_nothing(recorded, tmp_path):
    table1(tmp_path)
    assert len(recorded["evaluate"]) == 7 and recorded["calibrate"] == [
        "spinquant-w4a4",
        "flatquant-w4a4",
        "loopq-w4a4",
    ]
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.json") if p.name != "pipeline.json"}
    recorded["evaluate"].clear()
    recorded["calibrate"].clear()
    table1(tmp_path)
    assert recorded == {"evaluate": [], "calibrate": []}
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.json") if p.name != "pipeline.json"} == before
    stages = Manifest(tmp_path / "pipeline.json").stages
    assert sorted(stages) == sorted(name.removesuffix(".json") for name in before)
    assert stages["loopq-w4a4"]["inputs"]["evaluate"]["device"] == "cpu"


def test_a_row_whose_config_changed_is_rerun(recorded, tmp_path):
    table1(tmp_path)
    recorded["evaluate"].clear()
    recorded["calibrate"].clear()
    table1(tmp_path, fit_config="configs/small.yaml")  # LoopQ's calibration config: only its row
    assert recorded == {"evaluate": ["loopq-w4a4"], "calibrate": ["loopq-w4a4"]}
    recorded["evaluate"].clear()
    recorded["calibrate"].clear()
    table1(tmp_path, fit_config="configs/small.yaml", ppl_windows=4)  # an evaluation setting: every row, no calibration
    assert len(recorded["evaluate"]) == 7 and recorded["calibrate"] == [
        "spinquant-w4a4",
        "flatquant-w4a4",
        "loopq-w4a4",
    ]


def test_results_written_before_the_manifest_are_adopted_then_held_to_the_rule(recorded, tmp_path):
    """A folder of the old rule (a JSON that exists is done) is not recomputed; once recorded, a change reruns it."""
    (tmp_path / "fp.json").write_text(json.dumps({"method": "FP", "bits": "fp", "wikitext2_ppl": 5.0}))
    table1(tmp_path, methods=["QuaRot"])
    assert recorded["evaluate"] == ["quarot-w4a4"]
    assert Manifest(tmp_path / "pipeline.json").stages["fp"]["summary"]["note"].startswith("adopted")
    table1(tmp_path, methods=["QuaRot"], limit=5)
    assert recorded["evaluate"] == ["quarot-w4a4", "fp", "quarot-w4a4"]


def test_a_row_read_off_a_longer_evaluation_is_not_adopted(recorded, tmp_path):
    """``loops`` without tasks writes the lower loop counts from the top one's per-loop perplexities, outside the
    manifest; a later ``loops --tasks`` must evaluate them (with the tasks), not adopt them as done (a review found
    them adopted, recorded with the tasks, and never evaluated)."""
    derived = {"method": "FP", "bits": "fp", "wikitext2_ppl": 5.0, "per_loop_of": str(tmp_path / "fp-loops6.json")}
    (tmp_path / "fp-loops4.json").write_text(json.dumps(derived))
    sweep = experiments.Sweep(str(tmp_path), "cpu")
    sweep.row("fp-loops4", model="teacher", method="FP", tasks=["lambada_openai"], num_loops=4)
    assert recorded["evaluate"] == ["fp-loops4"]
    assert "per_loop_of" not in json.loads((tmp_path / "fp-loops4.json").read_text())


TINY = ("--config", "tests/configs/fit-test.yaml", "--trainer.max_steps", "2")


def test_a_real_tiny_row_is_calibrated_in_process_and_rerun_only_when_its_config_changes(monkeypatch, tmp_path):
    """FP and LoopQ W4A4 of the committed tiny teacher, 2 calibration steps, 2 WikiText-2 windows."""
    calls: list[str] = []
    for name in ("calibrate", "evaluate"):
        real = getattr(experiments, name)
        monkeypatch.setattr(
            experiments, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )

    def run(*extra):
        return experiments.table1(
            "loopq/assets/tiny-ouro", str(tmp_path), bits=["w4a4"], methods=["LoopQ"], tasks=[], ppl_windows=2,
            extra=[*TINY, *extra], device="cpu",
        )  # fmt: skip

    fp, loopq = run()
    assert calls == ["evaluate", "calibrate", "evaluate"]
    student = tmp_path / "runs" / "loopq-w4a4" / "student"
    provenance = json.loads((student / STUDENT_META).read_text())["provenance"]
    assert provenance["config"]["trainer.max_steps"] == 2
    stamps = [p.stat().st_mtime_ns for p in (fp, loopq, student / STUDENT_META)]
    run()
    assert calls == ["evaluate", "calibrate", "evaluate"]  # nothing changed: nothing ran
    assert [p.stat().st_mtime_ns for p in (fp, loopq, student / STUDENT_META)] == stamps
    run("--trainer.max_steps", "3")
    assert calls[3:] == ["calibrate", "evaluate"]  # the LoopQ row, not FP
    assert json.loads((student / STUDENT_META).read_text())["provenance"]["config"]["trainer.max_steps"] == 3
    assert fp.stat().st_mtime_ns == stamps[0] and loopq.stat().st_mtime_ns > stamps[1]


def test_a_calibration_resumes_only_a_checkpoint_of_its_own_config(monkeypatch, tmp_path):
    """A run stopped midway continues from its newest checkpoint if that records the same teacher and config; one
    of another config (the row's config changed since) is not resumed, the calibration starts over."""
    started: list[str | None] = []
    monkeypatch.setattr(fit, "calibrate", lambda cli: started.append(cli.config.ckpt_path))
    calibration = experiments.Calibration("loopq/assets/tiny-ouro", tmp_path / "run", "configs/tiny.yaml", 4, TINY)
    settings = experiments.calibration_settings(calibration)
    own = record(settings.pop("teacher_sha256"), settings)
    other = record(own["teacher_sha256"], {**settings, "trainer.max_steps": 9})
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for age, (name, provenance) in enumerate((("epoch=0-step=3.ckpt", own), ("last.ckpt", other))):
        torch.save({"loopq": {"provenance": provenance}}, tmp_path / "run" / "checkpoints" / name)
        os.utime(tmp_path / "run" / "checkpoints" / name, ns=(10**18 + age, 10**18 + age))  # the coarse clock
    experiments.calibrate(calibration)  # the newest checkpoint is of another config: a fresh start
    torch.save({"loopq": {"provenance": own}}, tmp_path / "run" / "checkpoints" / "last.ckpt")
    experiments.calibrate(calibration)
    assert started == [None, str(tmp_path / "run" / "checkpoints" / "last.ckpt")]
    # a student of this teacher and config is reused as it is
    calibration.student.mkdir()
    sealed = seal({"format": STUDENT_FORMAT, "provenance": own, FILES: {}})  # as write_student seals its description
    (calibration.student / STUDENT_META).write_text(json.dumps(sealed))
    assert experiments.calibrate(calibration) == calibration.student and len(started) == 2
