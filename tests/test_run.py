"""``python -m loopq.run`` end to end on the committed tiny teacher with a tiny budget (3 calibration steps, 4
WikiText-2 windows, 2 LAMBADA examples): every stage's files, the printed report path and numbers, re-runs that
skip what is done, a resume after a real kill, and one-line errors. Runs that calibrate are subprocesses (as a user
runs them); runs that only evaluate or fail early run in this process (``main``) to save the start-up time."""

import io
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import warnings
from argparse import ArgumentError
from pathlib import Path

import pytest

from loopq.commands.run import PipelineError, UntitledBarFilter, main
from loopq.paths import REPO_ROOT

TINY = [
    "--config",
    "configs/tiny.yaml",
    "--config",
    "tests/configs/fit-test.yaml",
    "--trainer.max_steps",
    "3",
    "--trainer.enable_progress_bar",
    "true",
    "--limit",
    "2",
    "--tasks",
    "loopq_lambada",
    "--ppl_windows",
    "4",
]
STAGES = 6


def pipeline(root: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "loopq.run", *TINY, "--trainer.default_root_dir", str(root), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"loopq.run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out


def printed(stdout: str) -> tuple[Path, dict[str, float]]:
    """The report path and the FP / RTN / LoopQ perplexities of the closing lines."""
    report = re.search(r"^\[loopq\] done in \S+; report: (.+)$", stdout, re.M)
    numbers = re.search(r"^\[loopq\] WikiText-2 perplexity .*: FP (\S+) \| RTN (\S+) \| LoopQ (\S+)$", stdout, re.M)
    assert report and numbers, stdout[-2000:]
    return Path(report.group(1)), dict(zip(("fp", "rtn-w4a4", "loopq-w4a4"), map(float, numbers.groups()), strict=True))


def outputs(root: Path) -> list[Path]:
    results = [root / "results" / f"{name}.json" for name in ("fp", "rtn-w4a4", "loopq-w4a4")]
    student = [root / "student" / name for name in ("loopq_student.safetensors", "loopq_quant.json")]
    exported = [root / "exported" / name for name in ("model.safetensors", "loopq_export.json")]
    return [*student, *exported, *results, root / "report" / "report.md", root / "pipeline.json"]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline") / "tiny"
    return root, pipeline(root)


def test_every_stage_writes_its_files_and_the_end_names_the_report(first):
    root, out = first
    for path in outputs(root):
        assert path.is_file(), path
    for i in range(1, STAGES + 1):
        assert f"[loopq] [{i}/{STAGES}] " in out.stdout
    assert "calibrate: step 3/3 (100%)" in out.stdout  # the line progress of a non-terminal run
    report, ppl = printed(out.stdout)
    assert report == root / "report" / "report.md"
    for name, value in ppl.items():
        result = json.loads((root / "results" / f"{name}.json").read_text())
        assert value == round(result["wikitext2_ppl"], 2)
        assert result["wikitext2_windows"] == 4 and result["lm_eval"]["limit"] == 2
    table = report.read_text()
    assert "| LoopQ |" in table and "| RTN |" in table and "*FP*" in table


def test_a_second_run_skips_every_stage_and_rewrites_nothing(first, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    root, before = first
    stamps = {path: path.stat().st_mtime_ns for path in outputs(root)}
    assert main([*TINY, "--trainer.default_root_dir", str(root)]) == root / "report" / "report.md"
    out = capsys.readouterr().out
    assert out.count("up to date, skipped") == STAGES
    assert {path: path.stat().st_mtime_ns for path in outputs(root)} == stamps
    assert printed(out) == printed(before.stdout)


def test_a_changed_eval_setting_reruns_the_evaluations_but_not_the_calibration(first, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    root = tmp_path / "tiny"
    shutil.copytree(first[0], root)
    student = root / "student" / "loopq_student.safetensors"
    stamp = student.stat().st_mtime_ns
    main([*TINY, "--trainer.default_root_dir", str(root), "--ppl_windows", "3"])
    assert capsys.readouterr().out.count("up to date, skipped") == 2  # calibrate, export
    assert student.stat().st_mtime_ns == stamp
    assert json.loads((root / "results" / "loopq-w4a4.json").read_text())["wikitext2_windows"] == 3


def test_a_calibration_killed_midway_resumes_from_its_checkpoint(tmp_path):
    marker = tmp_path / "killed-once"
    killer = {"class_path": "tests.helpers.KillOnceAtStep", "init_args": {"step": 4, "marker": str(marker)}}
    args = ["--trainer.max_steps", "5", "--trainer.callbacks+", json.dumps(killer), "--tasks", "--ppl_windows", "1"]
    root = tmp_path / "run"
    crashed = pipeline(root, *args, check=False)
    assert crashed.returncode == -9 and marker.is_file() and not (root / "student").exists()
    out = pipeline(root, *args)
    assert f"resuming the calibration from {root / 'checkpoints' / 'last.ckpt'}" in out.stdout
    manifest = json.loads((root / "pipeline.json").read_text())["stages"]
    assert manifest["calibrate"]["summary"]["steps"] == 5 and (root / "report" / "report.md").is_file()


def test_a_student_of_another_config_is_not_reused(first, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    root = first[0]
    with pytest.raises(PipelineError, match=r"model\.quant\.a_bits differ.*--force"):
        main([*TINY, "--trainer.default_root_dir", str(root), "--model.quant.a_bits", "8"])


def test_bad_input_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(ArgumentError, match=r"config.*configs/missing\.yaml"):  # jsonargparse's one line
        main(["--config", "configs/missing.yaml"])
    with pytest.raises(PipelineError, match=r"--model\.teacher .*: no such model directory"):
        main([*TINY, "--trainer.default_root_dir", str(tmp_path), "--model.teacher", str(tmp_path / "nope")])


def test_errors_end_the_command_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    argv = [*TINY, "--trainer.default_root_dir", str(tmp_path), "--model.teacher", str(tmp_path / "nope")]
    monkeypatch.setattr(sys, "argv", ["python -m loopq.run", *argv])
    with pytest.raises(SystemExit) as exit_info, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is already imported
        runpy.run_module("loopq.run", run_name="__main__")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --model.teacher")


def test_untitled_progress_bars_are_dropped_and_everything_else_kept():
    sink = io.StringIO()
    stream = UntitledBarFilter(sink)
    for text in ["\r  0%|          | 0/2 [00:00<?, ?it/s]", "\r100%|##########| 2/2 [00:00<00:00]", "", "\n"]:
        stream.write(text)
    stream.write("\rTokenizing inputs:  50%|#####     | 1/2")
    stream.write("\n")
    stream.write("a warning\n")
    assert sink.getvalue() == "\rTokenizing inputs:  50%|#####     | 1/2\na warning\n"


def test_help_names_the_pipeline_options_and_points_to_fit(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--limit" in out and "--force" in out and "python -m loopq.fit --help" in out


def killed_at(root: Path, marker: str) -> None:
    """Start the pipeline and SIGKILL it as soon as it prints ``marker`` (a stage's start line): a real crash
    inside that stage, no cleanup."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "loopq.run", *TINY, "--trainer.default_root_dir", str(root)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT, env=env)
    try:
        for line in proc.stdout:
            if marker in line:
                proc.kill()
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -9, f"the pipeline ended before {marker!r}"


@pytest.mark.parametrize("stage", ["[2/6] export", "[4/6] evaluate RTN", "[6/6] report"])
def test_kill_minus_9_in_any_stage_then_rerun_gives_the_uninterrupted_results(first, tmp_path, stage):
    root = tmp_path / "tiny"
    killed_at(root, stage)
    out = pipeline(root)
    assert printed(out.stdout)[1] == printed(first[1].stdout)[1]  # the same three perplexities
    for path in outputs(first[0]):  # student, export, results: byte-identical to the uninterrupted run's
        if path.suffix == ".safetensors":
            assert path.read_bytes() == (root / path.relative_to(first[0])).read_bytes(), path
    for name in ("fp", "rtn-w4a4", "loopq-w4a4"):
        a, b = (json.loads((r / "results" / f"{name}.json").read_text()) for r in (first[0], root))
        assert a["wikitext2_per_loop_ppl"] == b["wikitext2_per_loop_ppl"] and a["lm_eval"] == b["lm_eval"]


def test_a_teacher_rebuilt_in_place_is_noticed(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    monkeypatch.chdir(REPO_ROOT)
    teacher = tmp_path / "teacher"
    shutil.copytree(REPO_ROOT / "loopq" / "assets" / "tiny-ouro", teacher)
    root = tmp_path / "run"
    args = ["--model.teacher", str(teacher), "--trainer.max_steps", "1", "--tasks", "--ppl_windows", "1"]
    pipeline(root, *args)
    state = load_file(str(teacher / "model.safetensors"))  # retrain in place: same path, other weights
    name = sorted(state)[0]
    state[name] = state[name] * 1.01
    save_file(state, str(teacher / "model.safetensors"), metadata={"format": "pt"})
    stamps = {path: path.stat().st_mtime_ns for path in root.rglob("*") if path.is_file()}
    with pytest.raises(PipelineError, match=r"teacher_sha256.*--force"):
        main([*TINY, "--trainer.default_root_dir", str(root), *args])
    assert {path: path.stat().st_mtime_ns for path in root.rglob("*") if path.is_file()} == stamps


# ---------------------------------------------------------------------------------------------------- reuse rules
# What a rerun reuses, checked on copies of the ``first`` run with every stage action stubbed (:func:`stopped`): the
# first action that runs raises :class:`Ran`, so nothing is calibrated or evaluated.
class Ran(Exception):
    """A stage action ran: its name, and for ``calibrate`` the checkpoint it would resume from."""


@pytest.fixture
def stopped(monkeypatch):
    from loopq.commands.run import Pipeline

    monkeypatch.chdir(REPO_ROOT)

    def stop(name):
        def action(self, *args):
            raise Ran(name, self.own_last_checkpoint() if name == "calibrate" else None)

        return action

    for name in ("calibrate", "export", "evaluate", "report"):
        monkeypatch.setattr(Pipeline, name, stop(name))


def copy_run(first, tmp_path: Path) -> Path:
    """A copy of the ``first`` run (modification times kept: its stages are as done as the original's)."""
    root = tmp_path / "tiny"
    shutil.copytree(first[0], root)
    return root


def rerun(root: Path, *extra: str) -> tuple[str, ...]:
    """Run the stubbed pipeline on ``root``: the :class:`Ran` arguments of the first stage action that ran."""
    with pytest.raises(Ran) as ran:
        main([*TINY, "--trainer.default_root_dir", str(root), *extra])
    return ran.value.args


def edit_manifest(root: Path, edit) -> None:
    path = root / "pipeline.json"
    manifest = json.loads(path.read_text())
    edit(manifest["stages"])
    path.write_text(json.dumps(manifest))


def test_a_student_rewritten_by_loopq_fit_with_another_config_is_refused(first, tmp_path, stopped):
    """``python -m loopq.fit --model.lr 0.02 --force`` over the run's student: pipeline.json still records the old
    config, the student's own provenance says 0.02; the run stops naming it (a review found calibrate skipped as up to
    date and the other student evaluated)."""
    from loopq.artifacts import read_student_meta
    from loopq.artifacts.seal import seal

    root = copy_run(first, tmp_path)
    meta = read_student_meta(root / "student")
    meta["provenance"]["config"]["model.lr"] = 0.02
    (root / "student" / "loopq_quant.json").write_text(json.dumps(seal(meta)))
    changed = r"student calibrated with another config \(model\.lr: 0\.02 -> 0\.005\).*--force"
    with pytest.raises(PipelineError, match=changed):
        main([*TINY, "--trainer.default_root_dir", str(root)])


def test_a_student_rewritten_with_the_same_config_is_calibrated_again_not_skipped(first, tmp_path, stopped):
    """A stage's outputs must be the files it wrote (stamps recorded at finish): a student written over since, even
    with the same config, makes the calibration run again, resuming from its own last checkpoint."""
    root = copy_run(first, tmp_path)
    weights = root / "student" / "loopq_student.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert rerun(root) == ("calibrate", root / "checkpoints" / "last.ckpt")


def test_a_finished_calibration_whose_student_was_lost_resumes_from_its_last_checkpoint(first, tmp_path, stopped):
    """The re-run of a finished stage with the same inputs keeps its start, so the checkpoints it wrote are its own
    (a review found the calibration restarted from step 0)."""
    root = copy_run(first, tmp_path)
    shutil.rmtree(root / "student")
    assert rerun(root) == ("calibrate", root / "checkpoints" / "last.ckpt")


def test_a_student_of_loopq_fit_is_adopted_only_with_the_whole_config(first, tmp_path, stopped, capsys):
    """No record of the calibration in pipeline.json: the student is adopted when its provenance is this config (a
    line says so), and refused when any key differs - not only the quant config (a review found a student of
    max_steps 3, lr 0.005, seed 0 adopted by a run asking max_steps 8, lr 0.02, seed 7)."""
    root = copy_run(first, tmp_path)
    edit_manifest(root, lambda stages: stages.pop("calibrate"))
    other = ["--trainer.max_steps", "8", "--model.lr", "0.02", "--seed_everything", "7"]
    with pytest.raises(PipelineError, match=r"another config \(model\.lr: .*seed_everything: 0 -> 7.*--force"):
        main([*TINY, "--trainer.default_root_dir", str(root), *other])
    assert "calibrate" not in json.loads((root / "pipeline.json").read_text())["stages"]
    capsys.readouterr()
    assert rerun(root)[0] == "evaluate"  # the LoopQ evaluation names the copy's student path
    out = capsys.readouterr().out
    assert f"calibrate: adopted the student {root / 'student'}" in out
    assert "[1/6] calibrate: up to date" in out and "[2/6] export: up to date" in out


def test_a_record_from_before_an_option_existed_is_the_same_calibration(first, tmp_path, stopped, capsys):
    """pipeline.json's calibration inputs are read as loopq.fit reads a record (provenance.LATER_OPTIONS,
    RETIRED_OPTIONS): one written before ``model.student_from`` existed, or holding a retired schedule option at its
    default, is this config (a review found it refused as another one)."""
    root = copy_run(first, tmp_path)

    def older(stages):
        del stages["calibrate"]["inputs"]["model.student_from"]
        stages["calibrate"]["inputs"]["model.slt_every_n_steps"] = 50

    edit_manifest(root, older)
    capsys.readouterr()
    assert rerun(root)[0] == "evaluate"
    out = capsys.readouterr().out
    assert "[1/6] calibrate: up to date" in out and "[2/6] export: up to date" in out


def test_the_report_reads_the_student_where_model_output_dir_put_it(first, tmp_path, monkeypatch):
    """``--model.output_dir``: the report's run reads the student there (a review found the calibration called
    unfinished and Fig. 3 dropped)."""
    from loopq.commands.run import Options, Pipeline, parse

    monkeypatch.chdir(REPO_ROOT)
    root, elsewhere = copy_run(first, tmp_path), tmp_path / "students" / "tiny"
    elsewhere.parent.mkdir()
    (root / "student").rename(elsewhere)
    cli = parse([*TINY, "--trainer.default_root_dir", str(root), "--model.output_dir", str(elsewhere)])
    try:
        Pipeline(cli, Options.of(cli.config)).report()
    finally:
        cli.release_lock()
    report = (root / "report" / "report.md").read_text()
    assert "calibration unfinished" not in report and "Fig. 3 - SLT selection order" in report


def test_a_stage_is_done_only_while_its_outputs_are_the_files_it_wrote(tmp_path):
    from loopq.stages import Manifest

    out = tmp_path / "out.json"
    manifest = Manifest(tmp_path / "pipeline.json")
    manifest.start("s", {"a": 1})
    out.write_text("1")
    manifest.finish("s", {}, 0.0, [out])
    assert manifest.is_done("s", {"a": 1}, [out]) and not manifest.is_done("s", {"a": 2}, [out])
    out.write_text("22")  # rewritten by another command
    assert not manifest.is_done("s", {"a": 1}, [out])
    out.unlink()
    assert not manifest.is_done("s", {"a": 1}, [out])


def test_an_entry_without_output_stamps_is_done_until_an_output_changes_after_it_finished(tmp_path):
    """pipeline.json written before the stamps were recorded: an output modified after the stage finished is not
    the stage's."""
    from loopq.stages import Manifest

    out = tmp_path / "out.json"
    out.write_text("1")
    finished = out.stat().st_mtime_ns + 10**9
    (tmp_path / "pipeline.json").write_text(json.dumps({"stages": {"s": {"inputs": {}, "finished": finished}}}))
    manifest = Manifest(tmp_path / "pipeline.json")
    assert manifest.is_done("s", {}, [out])
    os.utime(out, ns=(finished + 1, finished + 1))
    assert not manifest.is_done("s", {}, [out])


def test_a_finished_stage_started_again_with_the_same_inputs_keeps_its_start(tmp_path):
    from loopq.stages import Manifest

    manifest = Manifest(tmp_path / "pipeline.json")
    manifest.start("s", {"a": 1})
    started = manifest.stages["s"]["started"]
    manifest.finish("s", {}, 0.0)
    manifest.start("s", {"a": 1})
    assert manifest.stages["s"]["started"] == started and manifest.stages["s"]["finished"] is None
    manifest.start("s", {"a": 2})
    assert manifest.stages["s"]["started"] > started
