"""Provenance: artifacts record the teacher's content hash and the resolved config; mismatches are refused."""

import hashlib
import json
import os
import shutil
import sys

import lightning
import pytest
import torch
from safetensors.torch import load_file, save_file

from loopq.artifacts import export_student, load_quantized, load_student
from loopq.artifacts import read_student_meta as read_meta
from loopq.artifacts.seal import seal
from loopq.commands.fit import COSMETIC
from loopq.paths import REPO_ROOT
from loopq.provenance import (
    ProvenanceError,
    check_same,
    differing_keys,
    flat_record,
    flatten,
    json_digest,
    record,
    teacher_fingerprint,
    widest_isa,
)
from loopq.quant.packed import ExportError
from tests.helpers import run_fit

TEACHER = REPO_ROOT / "loopq" / "assets" / "tiny-ouro"


def digest_tree(root):
    """sha256 of every file under ``root`` (what a refused command must leave untouched)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def rebuilt_teacher(src, dst):
    """A copy of the teacher with one weight changed, as a retrained teacher in the same place would be."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    state = load_file(str(dst / "model.safetensors"))
    name = sorted(state)[0]
    state[name] = state[name] + 1e-3
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------ pure functions
def test_fingerprint_follows_content_not_place_or_time(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(TEACHER, copy)
    os.utime(copy / "model.safetensors", ns=(1, 1))  # another mtime, same bytes
    assert teacher_fingerprint(copy) == teacher_fingerprint(TEACHER)
    rebuilt_teacher(TEACHER, copy)
    assert teacher_fingerprint(copy) != teacher_fingerprint(TEACHER)


def test_fingerprint_by_hand(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("ignored")  # not a weight/config/tokenizer file
    file_hash = hashlib.sha256(b"{}").hexdigest()
    assert teacher_fingerprint(tmp_path) == hashlib.sha256(f"config.json\0{file_hash}\n".encode()).hexdigest()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "encoder.json", "vocab.bpe"])
def test_every_weight_and_tokenizer_file_the_loaders_read_enters_the_fingerprint(tmp_path, name):
    """Parcae publishes pytorch_model.bin (which the loader reads) and LoopFormer a GPT-2 tokenizer: a teacher
    rebuilt in such files kept its fingerprint, so its target cache, resume checks and loopq.run's skips held."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / name).write_bytes(b"one")
    before = teacher_fingerprint(tmp_path)
    (tmp_path / name).write_bytes(b"two")
    assert teacher_fingerprint(tmp_path) != before


def test_fingerprint_of_an_empty_directory_is_refused(tmp_path):
    with pytest.raises(ProvenanceError, match=r"no config\.json or weights"):
        teacher_fingerprint(tmp_path)


def test_flatten_and_differing_keys_by_hand():
    flat = flatten({"model": {"lr": 1, "quant": {"bits": (4, 4)}}, "seed": 0, "empty": {}})
    assert flat == {"model.lr": 1, "model.quant.bits": [4, 4], "seed": 0, "empty": {}}
    assert differing_keys({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": None}) == ["b", "c"]
    assert json_digest({"b": 1, "a": 2}) == json_digest({"a": 2, "b": 1})


def test_check_same_names_the_keys_and_the_fix():
    old = flat_record(record("a" * 64, {"model.quant.a_bits": 4}))
    new = flat_record(record("b" * 64, {"model.quant.a_bits": 8}))
    with pytest.raises(ProvenanceError) as err:
        check_same(old, new, "ckpt was calibrated", "do X")
    text = str(err.value)
    assert "config.model.quant.a_bits: 4 -> 8" in text and "teacher_sha256: " in text
    assert text.endswith("do X") and "\n" not in text
    check_same(old, dict(old), "same", "never")  # equal records pass


def test_cosmetic_keys_are_those_that_cannot_change_the_student():
    assert {"ckpt_path", "trainer.default_root_dir", "allow_config_change"} <= COSMETIC
    assert not {k for k in COSMETIC if k.startswith(("model.", "data."))}


# ------------------------------------------------------------------------------------------------ through the CLI
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A few-step calibration on a private copy of the teacher (so the tests can rebuild it in place)."""
    root = tmp_path_factory.mktemp("prov")
    teacher = root / "teacher"
    shutil.copytree(TEACHER, teacher)
    run_fit(root / "run", "--model.teacher", str(teacher), "--trainer.max_steps", "3")
    return root


def test_student_and_checkpoint_record_teacher_hash_and_config(calibrated):
    meta = read_meta(calibrated / "run" / "student")
    prov = meta["provenance"]
    assert prov["teacher_sha256"] == teacher_fingerprint(calibrated / "teacher")
    assert prov["config"]["model.quant.a_bits"] == 4 and prov["config"]["trainer.max_steps"] == 3
    assert "trainer.default_root_dir" not in prov["config"]
    ckpt = torch.load(calibrated / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert prov.pop("selected") == {"checkpoint": "last", "step": 3}  # the student's own: which state it is
    assert ckpt["loopq"]["provenance"] == prov
    env = prov["environment"]
    assert env["torch"] == torch.__version__ and env["python"] == sys.version.split()[0]
    assert env["lightning"] == lightning.__version__ and env["cpu"]


def test_the_widest_isa_is_read_from_the_cpu_flags():
    """Hand cases: an AVX-512 CPU (also AVX2) reports AVX512, an AVX2-only one AVX2, an SSE-only one default."""
    assert widest_isa({"sse4_2", "avx", "avx2", "avx512f", "avx512bw"}) == "AVX512"
    assert widest_isa({"sse4_2", "avx", "avx2", "fma"}) == "AVX2"
    assert widest_isa({"sse4_2", "avx"}) == "default"
    assert widest_isa(set()) == "unknown"
    assert record("a" * 64)["environment"]["cpu_isa"] in ("AVX512", "AVX2", "default", "unknown")


def test_the_environment_is_recorded_but_never_compared():
    """Results of two machines are two samples (docs/results.md), so a resume or an evaluation on another machine
    with other package versions is not refused for it; only the teacher and the config are compared."""
    here = record("a" * 64, {"model.lr": 0.005})
    there = {**here, "environment": {**here["environment"], "torch": "0.0", "cpu": "another"}}
    assert flat_record(here) == flat_record(there)
    check_same(flat_record(here), flat_record(there), "the checkpoint was calibrated", "resume as is")


def test_resume_with_another_config_is_refused_and_loses_nothing(calibrated, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(calibrated / "run", run)
    before = digest_tree(run / "checkpoints")
    out = run_fit(
        run, "--model.teacher", str(calibrated / "teacher"), "--trainer.max_steps", "3",
        "--model.quant.a_bits", "8", "--ckpt_path", "last", check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "model.quant.a_bits: 4 -> 8" in out.stderr and "--allow_config_change" in out.stderr
    assert digest_tree(run / "checkpoints") == before


def test_resume_with_a_rebuilt_teacher_is_refused(calibrated, tmp_path):
    run, teacher = tmp_path / "run", tmp_path / "teacher"
    shutil.copytree(calibrated / "run", run)
    rebuilt_teacher(calibrated / "teacher", teacher)
    out = run_fit(run, "--model.teacher", str(teacher), "--trainer.max_steps", "3", "--ckpt_path", "last", check=False)
    assert out.returncode != 0 and "teacher_sha256" in out.stderr


def test_allow_config_change_resumes_and_records_the_new_config(calibrated, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(calibrated / "run", run)
    shutil.rmtree(run / "student")
    args = ["--model.teacher", str(calibrated / "teacher"), "--trainer.max_steps", "4", "--ckpt_path", "last"]
    run_fit(run, *args, "--allow_config_change", "true")
    assert read_meta(run / "student")["provenance"]["config"]["trainer.max_steps"] == 4


def test_student_on_a_rebuilt_teacher_is_refused(calibrated, tmp_path):
    teacher = tmp_path / "teacher"
    rebuilt_teacher(calibrated / "teacher", teacher)
    with pytest.raises(ProvenanceError, match="calibrated on teacher"):
        load_student(calibrated / "run" / "student", teacher_dir=teacher)
    load_student(calibrated / "run" / "student", teacher_dir=teacher, check_teacher=False)  # the explicit override


def test_moved_run_directory_finds_its_teacher_beside_it(calibrated, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(calibrated, moved)  # teacher/ and run/ together, the recorded absolute path is elsewhere
    meta = json.loads((moved / "run" / "student" / "loopq_quant.json").read_text())
    meta["teacher"] = str(tmp_path / "gone")
    (moved / "run" / "student" / "loopq_quant.json").write_text(json.dumps(seal(meta)))  # as if written there
    _, loaded = load_student(moved / "run" / "student")
    assert loaded["teacher"] == str((moved / "teacher").resolve())


def test_edited_export_description_is_refused(calibrated, tmp_path):
    student, meta = load_student(calibrated / "run" / "student")
    out = export_student(student, meta, tmp_path / "exported")
    assert json.loads((out / "loopq_export.json").read_text())["provenance"] == meta["provenance"]
    load_quantized(out)
    path = out / "loopq_export.json"
    edited = json.loads(path.read_text())
    group = next(iter(edited["groups"]))
    edited["groups"][group]["a_bits"] = 8
    path.write_text(json.dumps(edited, indent=2))
    with pytest.raises(ExportError, match="edited after it was written"):
        load_quantized(out)


def test_observer_callbacks_stay_out_of_the_recorded_config_and_every_other_counts():
    """Checkpointing, progress, diagnostics, a test's kill switch (``changes_student = False``) do not change the
    student; the method's schedules do, and so does any other callback - EarlyStopping on a validation metric or
    StochasticWeightAveraging (a review found them dropped: a rerun or resume with them passed as the same config)."""
    from jsonargparse import Namespace

    from loopq.commands.fit import fit_settings

    def config(*paths):
        return Namespace(trainer=Namespace(callbacks=[{"class_path": p, "init_args": {}} for p in paths]))

    method = "loopq.calib.reselection.SharingGapReselection"
    observers = (
        "tests.helpers.KillAtStep",
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "lightning.pytorch.callbacks.LearningRateMonitor",
        "callbacks.line_progress.LineProgress",  # a re-export: the class decides, not the path
        "loopq.calib.diagnostics.PerLoopDiagnostics",
    )
    assert fit_settings(config(method, *observers)) == fit_settings(config(method))
    assert fit_settings(config(method)) != fit_settings(config())  # dropping SLT reselection changes the student
    for steering in ("EarlyStopping", "StochasticWeightAveraging", "Timer"):
        assert fit_settings(config(method, f"lightning.pytorch.callbacks.{steering}")) != fit_settings(config(method))
    assert fit_settings(config(method, "no.such.Callback")) != fit_settings(config(method))


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO_ROOT / "configs").glob("*.yaml")))
def test_the_shipped_configs_record_the_method_callbacks_as_before(name):
    """Inverting the callback rule keeps the records of the shipped configs: their recorded callbacks are the
    method's two schedules, as under the earlier rule (students and checkpoints written before still compare equal)."""
    from loopq.commands.fit import build_parser, fit_settings

    settings = fit_settings(build_parser().parse_args(["--config", str(REPO_ROOT / "configs" / name)]))
    recorded = [c["class_path"] for c in settings["trainer.callbacks"]]
    assert recorded == ["loopq.calib.mu.AdaptiveMu", "loopq.calib.reselection.SharingGapReselection"]


def test_a_record_from_before_an_option_existed_reads_as_its_default():
    """Students and checkpoints written before ``model.state_reduction`` existed were calibrated with ``mean``: they
    match a current config of ``mean`` and differ from one of ``sum``."""
    old = {"teacher_sha256": "t", "config": {"model.lam": 0.1}}
    now = {"teacher_sha256": "t", "config": {"model.lam": 0.1, "model.state_reduction": "mean"}}
    check_same(flat_record(old), flat_record(now), "x", "fix")
    summed = {"teacher_sha256": "t", "config": {"model.lam": 0.1, "model.state_reduction": "sum"}}
    with pytest.raises(ProvenanceError, match="state_reduction"):
        check_same(flat_record(old), flat_record(summed), "x", "fix")


def test_a_record_of_a_retired_schedule_option_matches_when_it_meant_the_callbacks_default():
    """``model.slt_every_n_steps`` etc. moved to the callbacks (issue 40). A record holding the value that equals the
    callback's default (what a config without callbacks runs now) is the same config; another value is not."""
    from loopq.calib.mu import AdaptiveMu
    from loopq.calib.reselection import SharingGapReselection

    slt, mu = SharingGapReselection(), AdaptiveMu()
    defaults = {
        "model.mu_every_n_steps": mu.every_n_steps, "model.slt_start_step": slt.start_step,
        "model.slt_every_n_steps": slt.every_n_steps, "model.slt_per_round": slt.per_round,
        "model.slt_probe_batches": slt.probe_batches,
    }  # fmt: skip
    now = {"teacher_sha256": "t", "config": {"model.lam": 0.1}}
    old = {"teacher_sha256": "t", "config": {"model.lam": 0.1, **defaults}}
    check_same(flat_record(old), flat_record(now), "x", "fix")
    other = {"teacher_sha256": "t", "config": {"model.lam": 0.1, **defaults, "model.slt_every_n_steps": 25}}
    with pytest.raises(ProvenanceError, match="slt_every_n_steps"):
        check_same(flat_record(other), flat_record(now), "x", "fix")
