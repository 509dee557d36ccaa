"""The third bad-input battery, output half (issue #38): ownership is proven, not assumed; a command recognises its
own interrupted leftovers; results are never NaN. Each case ends with one ``error:`` line and exit status 2 (or, for
a rerun after a crash, succeeds), and every file that existed before is byte-identical (sha256) afterwards. All on
copies of one tiny student and its export, made once for the module."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopq.artifacts import layout, load_quantized, load_student, read_artifact_meta, write_student
from loopq.artifacts.layout import EXPORT_FORMAT, EXPORT_META, EXPORT_WEIGHTS, RUN_LOCK, STUDENT_META, STUDENT_WEIGHTS
from loopq.artifacts.ownership import JOURNAL, begin
from loopq.artifacts.seal import SEAL
from loopq.commands import evaluate, export, generate
from loopq.commands.report.write_report import main as report
from loopq.errors import GuardError, run_cli
from loopq.paths import ASSETS, REPO_ROOT
from tests.bad_inputs.test_artifact_integrity import write_tiny_student
from tests.helpers import command, snapshot

TEACHER = ASSETS / "tiny-ouro"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A sealed W4A4 student of the tiny teacher (``student``) and its export by the CLI (``exported``)."""
    root = tmp_path_factory.mktemp("battery3")
    write_tiny_student(root / "student", 4, 0)
    export.main(["--ckpt", str(root / "student"), "--out", str(root / "exported")])
    return root


@pytest.fixture
def copies(made, tmp_path) -> Path:
    return Path(shutil.copytree(made, tmp_path / "copies"))


def result_json(path: Path, ppl: float = 15.0) -> Path:
    """A loopq.evaluate result, as the report reads it."""
    data = {"method": "FP", "bits": "fp", "model": str(TEACHER), "num_loops": 4, "wikitext2_ppl": ppl}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "wikitext2_per_loop_ppl": [], "wikitext2_windows": 2}))
    return path


# ---------------------------------------------------------------------------------------------------- case 4
FAKE_DESCRIPTIONS = {
    "v1-label": ({"format": "loopq-export-v1"}, f"its format 'loopq-export-v1' is not {EXPORT_FORMAT!r}"),
    "empty": ({}, f"its format None is not {EXPORT_FORMAT!r}"),
    "unsealed": ({"format": EXPORT_FORMAT, "files": {EXPORT_WEIGHTS: {}}}, "it has no meta_sha256 seal"),
    "bad-seal": (
        {"format": EXPORT_FORMAT, "files": {EXPORT_WEIGHTS: {}}, SEAL: "0" * 64},
        "its content does not match its meta_sha256 seal: it was edited after it was written",
    ),
}


@pytest.mark.parametrize("fake", sorted(FAKE_DESCRIPTIONS))
def test_a_users_folder_with_an_unsealed_export_description_is_not_replaced(copies, capsys, fake):
    """Case 4: a user's model.safetensors, edited tokenizer.json and a loopq_export.json LoopQ did not seal."""
    mine = copies / "mine"
    mine.mkdir()
    (mine / EXPORT_WEIGHTS).write_bytes(b"the user's own weights")
    (mine / "tokenizer.json").write_text('{"edited": true}')
    description, reason = FAKE_DESCRIPTIONS[fake]
    (mine / EXPORT_META).write_text(json.dumps(description))
    before = snapshot(copies)
    status, line = command(export.main, ["--ckpt", str(copies / "student"), "--out", str(mine)], capsys)
    assert status == 2 and line == (
        f"error: --out {mine}: {mine / EXPORT_META} is not a description LoopQ sealed ({reason}), so nothing there "
        "is proven to be this command's to replace; move the folder away or pass another directory"
    )
    assert snapshot(copies) == before


def test_an_unsealed_student_description_does_not_make_a_folder_a_students(copies):
    """The same class for loopq.fit's --model.output_dir: a ``loopq_quant.json`` of ``{}`` proves nothing."""
    mine = copies / "mine"
    mine.mkdir()
    (mine / STUDENT_META).write_text("{}")
    (mine / STUDENT_WEIGHTS).write_bytes(b"the user's")
    with pytest.raises(GuardError, match=r"loopq_quant.json is not a description LoopQ sealed \(its format None"):
        layout.check_output_dir(mine, [TEACHER], "--model.output_dir", replaces=("student",))
    assert layout.check_output_dir(copies / "student", [TEACHER], replaces=("student",)) == copies / "student"


def test_fit_does_not_replace_an_unsealed_student_in_its_run_directory(copies, capsys):
    """Without --model.output_dir the student goes to <run>/student: the same proof is asked there."""
    from tests.bad_inputs.test_one_writer import parse_main

    run = copies / "run"
    (run / "student").mkdir(parents=True)
    (run / "student" / STUDENT_META).write_text(json.dumps({"format": "loopq-student-v2", "provenance": {}}))
    before = snapshot(copies)
    status, line = command(parse_main, [str(run)], capsys)
    assert status == 2 and line.startswith(
        f"error: --trainer.default_root_dir {run / 'student'}: {run / 'student' / STUDENT_META} is not a "
        "description LoopQ sealed (it has no meta_sha256 seal)"
    )
    assert snapshot(copies) == before


def test_a_sealed_earlier_export_is_replaced_and_the_users_other_files_are_kept(copies):
    """The guard is not over-broad: an export LoopQ sealed is LoopQ's to replace; a file it never listed stays."""
    notes = copies / "exported" / "NOTES.md"
    notes.write_text("my notes")
    export.main(["--ckpt", str(copies / "student"), "--out", str(copies / "exported")])
    assert notes.read_text() == "my notes"
    assert load_quantized(copies / "exported") is not None


# ---------------------------------------------------------------------------------------------------- case 5
@pytest.fixture
def results(tmp_path) -> Path:
    return result_json(tmp_path / "results" / "fp.json")


def test_report_never_replaces_a_users_report(results, tmp_path, capsys):
    """Case 5: ``--out docs`` holding the user's report.md (and other docs) is refused before anything is read."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "report.md").write_text("# My own report\n")
    (docs / "fig5_ppl_vs_loops.png").write_bytes(b"my figure")
    before = snapshot(tmp_path)
    status, line = command(report, ["--results", str(results), "--out", str(docs)], capsys)
    assert status == 2 and line == (
        f"error: --out {docs}: report.md, fig5_ppl_vs_loops.png there was not written by this command and would be "
        "overwritten; move it away or pass another directory"
    )
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("inside", [False, True], ids=["teacher", "inside-teacher"])
def test_report_into_a_teacher_directory_is_refused(results, tmp_path, capsys, inside):
    teacher = Path(shutil.copytree(TEACHER, tmp_path / "teacher"))
    out = teacher / "report" if inside else teacher
    before = snapshot(tmp_path)
    status, line = command(report, ["--results", str(results), "--out", str(out)], capsys)
    where = "lies inside" if inside else "is"
    assert status == 2 and line == (
        f"error: --out {out}: {where} a pretrained teacher directory ({teacher}); write the report elsewhere"
    )
    assert snapshot(tmp_path) == before and not (teacher / "report").exists()


def test_report_replaces_its_own_report_and_keeps_the_users_files(results, tmp_path):
    """A folder of the user's may hold a report: the second report replaces the first (its sealed manifest lists
    it), a file the user added is untouched, and an edited manifest no longer proves anything."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("my index")
    report(["--results", str(results), "--out", str(docs)])
    first = (docs / "report.md").read_text()
    report(["--results", str(result_json(results, ppl=17.0)), "--out", str(docs)])
    assert (docs / "report.md").read_text() != first and "17.00" in (docs / "report.md").read_text()
    assert (docs / "index.md").read_text() == "my index"
    assert sorted(p.name for p in docs.iterdir()) == ["index.md", "loopq_report.json", "report.md"]
    manifest = json.loads((docs / "loopq_report.json").read_text())
    (docs / "loopq_report.json").write_text(json.dumps({**manifest, "format": "loopq-report-v0"}))
    with pytest.raises(GuardError, match=r"report.md, loopq_report.json there was not written by this command"):
        report(["--results", str(results), "--out", str(docs)])


def test_report_recognises_its_own_interrupted_leftovers(results, tmp_path):
    """A report killed after its first figure: its journal names the files it was writing, so the rerun replaces
    them (and removes the temporary leftover) instead of refusing them as the user's."""
    out = tmp_path / "report"
    begin(out, "report", ["report.md", "fig5_ppl_vs_loops.png"])
    (out / "fig5_ppl_vs_loops.png").write_bytes(b"half a run's figure")
    (out / ".report.md.abc123.tmp").write_text("# LoopQ rep")
    report(["--results", str(results), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["loopq_report.json", "report.md"]


# ---------------------------------------------------------------------------------------------------- SIGKILL
KILL_AT_WRITE = """
import os, signal, sys
from loopq import files
from loopq.commands import export
real, calls = files.StagedFiles.write, []

def write(self, name, fill):
    calls.append(name)
    if len(calls) == int(sys.argv[1]):  # this file's bytes are in its temporary file; no file renamed yet
        return real(self, name, lambda tmp: (fill(tmp), os.kill(os.getpid(), signal.SIGKILL)))
    return real(self, name, fill)

files.StagedFiles.write = write
export.main(sys.argv[2:])
"""


@pytest.mark.parametrize(
    ("where", "at"),
    [("new", 1), ("new", 2), ("earlier-export", -1)],  # a subprocess each (~10 s): three points, not all six
    ids=["weights-new", "config-new", "description-over-earlier-export"],
)
def test_export_killed_mid_write_is_rerun_over_its_own_leftovers(copies, where, at):
    """SIGKILL of loopq.export while writing its weights, config.json or description (a stale lock, its journal and
    ``.tmp`` leftovers are left; the files are staged, so none is renamed into place and an earlier export is still
    whole): the rerun recognises the leftovers as its own, succeeds, and writes the same bytes as an export that was
    never interrupted."""
    out = copies / "out"
    if where == "earlier-export":
        shutil.copytree(copies / "exported", out)
    writes = 1 + len(json.loads((copies / "exported" / EXPORT_META).read_text())["files"])  # the description last
    argv = ["--ckpt", str(copies / "student"), "--out", str(out)]
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AT_WRITE, str(at if at > 0 else writes), *argv],
        capture_output=True, text=True, env=ENV, cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    left = sorted(p.name for p in out.iterdir())
    assert RUN_LOCK in left and JOURNAL in left and any(name.endswith(".tmp") for name in left), left
    if where == "earlier-export":  # killed before any rename: the earlier export is what it was
        assert (out / EXPORT_META).read_bytes() == (copies / "exported" / EXPORT_META).read_bytes()
        assert load_quantized(out) is not None
    export.main(argv)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (copies / "exported").iterdir())
    for name in (EXPORT_WEIGHTS, EXPORT_META):
        assert (out / name).read_bytes() == (copies / "exported" / name).read_bytes(), name
    assert load_quantized(out) is not None


def test_a_journal_the_user_wrote_proves_nothing(copies, capsys):
    """Only a sealed journal is LoopQ's: a hand-written one beside a user's config.json does not make it ours."""
    mine = copies / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    (mine / JOURNAL).write_text(json.dumps({"format": "loopq-writing-v1", "kind": "export", "files": ["config.json"]}))
    before = snapshot(copies)
    status, line = command(export.main, ["--ckpt", str(copies / "student"), "--out", str(mine)], capsys)
    assert (
        status == 2
        and line == f"error: --out {mine}: holds a teacher that this command would overwrite; pass another directory"
    )
    assert snapshot(copies) == before


# ---------------------------------------------------------------------------------------------------- --out a file
def test_export_out_an_existing_file_is_one_line(copies, capsys):
    notes = copies / "notes.txt"
    notes.write_text("my notes")
    before = snapshot(copies)
    status, line = command(export.main, ["--ckpt", str(copies / "student"), "--out", str(notes)], capsys)
    assert status == 2 and line == f"error: --out {notes}: is a file, not a directory; pass a directory to write into"
    assert snapshot(copies) == before


def test_messages_use_the_right_article(copies):
    """ "holds a export" -> "holds an export"."""
    with pytest.raises(GuardError, match=rf"^--model.output_dir {re.escape(str(copies / 'exported'))}: holds an "):
        layout.check_output_dir(copies / "exported", [TEACHER], "--model.output_dir", replaces=("student",))


# ---------------------------------------------------------------------------------------------------- evaluate lock
HOLD_LOCK = """
import sys, time
from loopq.locks import file_lock
file_lock(sys.argv[1], "loopq.evaluate").acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_two_evaluates_of_one_result_file_the_second_refuses(tmp_path, capsys):
    """While one evaluate holds ``--out res.json`` the second refuses at once, naming it, and the earlier result is
    untouched; once the first is gone (killed: a stale lock) the next one runs and writes its result."""
    out = result_json(tmp_path / "res.json", ppl=99.0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True, env=ENV, cwd=REPO_ROOT
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(tmp_path)
        argv = [
            "--model",
            str(TEACHER),
            "--tasks",
            "[]",
            "--ppl_windows",
            "1",
            "--ppl_seq_len",
            "64",
            "--out",
            str(out),
        ]
        status, line = command(evaluate.main, argv, capsys)
        assert status == 2 and re.fullmatch(
            rf"error: --out {re.escape(str(out))}: loopq.evaluate \(pid {holder.pid} on .*\) is writing it; wait for "
            rf"it to finish or pass another path \(if that process no longer runs, delete .*\.res\.json\.lock\)",
            line,
        ), line
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    evaluate.main(argv)
    assert json.loads(out.read_text())["wikitext2_ppl"] != 99.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json"]


# ---------------------------------------------------------------------------------------------------- relabelled
def relabel(student: Path, keep_seal_keys: bool) -> None:
    """A v2 student's description relabelled ``loopq-student-v1``, a_bits 4 -> 8, provenance removed."""
    path = student / STUDENT_META
    meta = json.loads(path.read_text())
    meta = {k: v for k, v in meta.items() if k != "provenance" and (keep_seal_keys or k not in (SEAL, "files"))}
    meta["format"], meta["quant"]["a_bits"] = "loopq-student-v1", 8
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("keep", [True, False], ids=["seal-keys-kept", "seal-keys-removed"])
def test_a_relabelled_student_is_not_exported_as_a_sealed_export(copies, capsys, keep):
    relabel(copies / "student", keep)
    before = snapshot(copies)
    status, line = command(export.main, ["--ckpt", str(copies / "student"), "--out", str(copies / "w4a8")], capsys)
    found = "carries meta_sha256 and files" if keep else "its weights file says format 'loopq-student-v2'"
    assert status == 2 and line == (
        f"error: {copies / 'student' / STUDENT_META}: labelled 'loopq-student-v1' but {found}, which a "
        "loopq-student-v1 student never has: the description was relabelled after it was written, so nothing in it "
        "can be verified; calibrate the student again with python -m loopq.fit"
    )
    assert snapshot(copies) == before and not (copies / "w4a8").exists()
    with pytest.raises(ValueError, match="labelled 'loopq-student-v1'"):
        read_artifact_meta(copies / "student")  # evaluate and generate read it the same way


def test_a_genuine_legacy_student_is_not_sealed_into_an_export(copies, capsys):
    """A real v1 student (its weights' header says v1 too) still loads, but an export would vouch for it."""
    relabel(copies / "student", keep_seal_keys=False)
    weights = copies / "student" / STUDENT_WEIGHTS
    save_file(load_file(weights), weights, metadata={"format": "loopq-student-v1"})
    before = snapshot(copies)
    status, line = command(export.main, ["--ckpt", str(copies / "student"), "--out", str(copies / "new")], capsys)
    assert status == 2 and line.startswith(
        f"error: {copies / 'student' / STUDENT_META}: format 'loopq-student-v1' is not content-verified, and an "
        "export would seal"
    )
    assert snapshot(copies) == before and not (copies / "new").exists()


# ---------------------------------------------------------------------------------------------------- NaN
@pytest.fixture
def nan_student(copies) -> tuple[Path, str]:
    """The student with one activation clip set to NaN (as a diverged calibration leaves it), written sealed."""
    student, meta = load_student(copies / "student")
    name = next(n for n, p in student.named_parameters() if p.requires_grad and n.endswith("act_clip"))
    with torch.no_grad():
        student.get_parameter(name).fill_(float("nan"))
    write_student(student, meta, copies / "nan-student")
    return copies / "nan-student", name


def test_evaluate_of_a_nan_model_is_an_error_naming_the_tensor(copies, nan_student, capsys):
    path, name = nan_student
    out = copies / "res.json"
    before = snapshot(copies)
    argv = ["--student", str(path), "--tasks", "[]", "--ppl_windows", "1", "--ppl_seq_len", "64", "--out", str(out)]
    status, line = command(evaluate.main, argv, capsys)
    assert status == 2 and line == (
        f"error: the perplexity is not finite (NaN or inf): the model's tensor {name!r} holds NaN/inf values (a "
        "diverged calibration or a damaged file); recalibrate, re-export or re-download the model; no result was "
        "reported"
    )
    assert snapshot(copies) == before and not out.exists()


def test_generate_with_a_nan_model_is_an_error_not_end_of_text(nan_student, capsys):
    """The error comes before any token is shown: stdout holds the echoed prompt and nothing else."""
    path, name = nan_student
    argv = ["--student", str(path), "--prompt", "The loop", "--max_new_tokens", "4", "--device", "cpu"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: generate.main(argv))
    captured = capsys.readouterr()
    assert ended.value.code == 2 and captured.out == "The loop"
    assert captured.err.splitlines() == [
        f"error: the logits of new token 1 is not finite (NaN or inf): the model's tensor {name!r} holds NaN/inf "
        "values (a diverged calibration or a damaged file); recalibrate, re-export or re-download the model; no "
        "result was reported"
    ]


# ---------------------------------------------------------------------------------------------------- prompts file
def test_a_latin1_prompts_file_is_one_line_naming_file_and_option(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("Un café\n".encode("latin-1"))
    status, line = command(generate.main, ["--model", str(TEACHER), "--prompts_file", str(prompts)], capsys)
    assert status == 2 and line == (
        f"error: --prompts_file {prompts}: not UTF-8 text (byte 0xe9 at offset 6); save it as UTF-8 (e.g. iconv -f "
        "latin1 -t utf-8)"
    )
