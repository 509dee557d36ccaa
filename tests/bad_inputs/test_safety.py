"""Never overwrite inputs, resume past a damaged checkpoint, refuse loop counts that cannot fit, stop cleanly on
SIGTERM (issue #14). Every refusal is checked for its one-line message (naming the option and the directory) and
for leaving every file that existed before byte-identical. Commands that fail before any work run in this process;
the ones a user runs from a shell (export, run, the SIGTERM'd calibration) run as subprocesses."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from safetensors.torch import load_file

from loopq.artifacts import layout
from loopq.artifacts.layout import STUDENT_FORMAT, STUDENT_META, STUDENT_WEIGHTS
from loopq.artifacts.seal import seal
from loopq.calib.checkpoint_io import CheckpointError, checkpoint_problem, newest_intact, write_sidecar
from loopq.calib.stop_on_signal import StopOnSignal, exit_status
from loopq.commands import evaluate, export, fit, pretrain, run, testbed
from loopq.errors import GuardError, LoopQError, UsageError
from loopq.paths import REPO_ROOT
from loopq.planning import guards
from tests.helpers import FIT_CONFIGS, assert_same_tensors, read_student, run_fit

TINY = REPO_ROOT / "loopq" / "assets" / "tiny-ouro"
STRESS = REPO_ROOT / "loopq" / "assets" / "tiny-ouro-outliers"
#: the in-process CLIs get their arguments as a list while pytest's own are in sys.argv: expected here
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots`` (what must not change)."""
    files = [p for root in roots for p in sorted(root.rglob("*")) if p.is_file()]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def one_line(err: BaseException | str) -> str:
    text = str(err).strip()
    assert "\n" not in text, text
    return text


@pytest.fixture
def teacher(tmp_path: Path) -> Path:
    """A private copy of the embedded teacher (config.json, weights, tokenizer, records)."""
    return Path(shutil.copytree(TINY, tmp_path / "teacher"))


@pytest.fixture
def student(tmp_path: Path, teacher: Path) -> Path:
    """A student directory as loopq.fit writes it, as far as the guards read it (they act before loading it)."""
    directory = tmp_path / "student"
    directory.mkdir()
    (directory / STUDENT_META).write_text(json.dumps(seal({"format": STUDENT_FORMAT, "teacher": str(teacher)})))
    (directory / STUDENT_WEIGHTS).write_bytes(b"not read before the guard")
    return directory


# ---------------------------------------------------------------------------------------------------- export
def test_export_into_the_teacher_directory_is_refused_and_the_teacher_is_unchanged(teacher, student):
    before = snapshot(teacher, student)
    cmd = [sys.executable, "-m", "loopq.export", "--ckpt", str(student), "--out", str(teacher)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=ENV, timeout=300)
    assert out.returncode != 0
    line = one_line(out.stderr)
    assert re.fullmatch(rf"error: --out {re.escape(str(teacher))}: is {re.escape(str(teacher))}, which this .*", line)
    assert snapshot(teacher, student) == before


@pytest.mark.parametrize("where", ["inside the teacher", "the student", "a symlink to the teacher"])
def test_export_into_a_directory_it_reads_is_refused(teacher, student, tmp_path, where):
    out = {"inside the teacher": teacher / "exported", "the student": student, "a symlink to the teacher": None}[where]
    if out is None:
        out = tmp_path / "link"
        out.symlink_to(teacher, target_is_directory=True)
    before = snapshot(teacher, student)
    with pytest.raises(GuardError) as err:
        export.main(["--ckpt", str(student), "--out", str(out)])
    assert re.match(rf"--out {re.escape(str(out))}: (is|is inside) .*which this command reads", one_line(err.value))
    assert snapshot(teacher, student) == before and not (teacher / "exported").exists()


def test_export_may_replace_an_earlier_export_but_no_other_model(tmp_path):
    earlier = tmp_path / "exported"
    earlier.mkdir()
    (earlier / layout.EXPORT_META).write_text(json.dumps(seal({"format": layout.EXPORT_FORMAT, "files": {}})))
    (earlier / "model.safetensors").write_bytes(b"packed")
    assert layout.check_output_dir(earlier, [TINY], replaces=("export",)) == earlier
    with pytest.raises(GuardError, match=r"--out .*stress: holds a stress variant that this command would overwrite"):
        layout.check_output_dir(shutil.copytree(STRESS, tmp_path / "stress"), [TINY], replaces=("export",))


# ---------------------------------------------------------------------------------------------------- testbed
def test_testbed_outliers_out_onto_the_teacher_is_refused(teacher):
    before = snapshot(teacher)
    with pytest.raises(GuardError) as err:
        testbed.main(["--model", str(teacher), "--outliers_out", str(teacher)])
    assert re.match(rf"--outliers_out {re.escape(str(teacher))}: is ", one_line(err.value))
    assert snapshot(teacher) == before


def test_testbed_outliers_out_replaces_only_an_earlier_stress_variant(teacher, tmp_path):
    other = shutil.copytree(TINY, tmp_path / "other-teacher")
    before = snapshot(other)
    with pytest.raises(GuardError, match=r"--outliers_out .*other-teacher: holds a pretrained teacher"):
        testbed.main(["--model", str(teacher), "--outliers-out", str(other)])  # the old spelling, still read
    assert snapshot(other) == before
    stress = shutil.copytree(STRESS, tmp_path / "stress")  # the README's rebuild writes over its own output
    assert layout.check_output_dir(stress, [teacher], "--outliers_out", replaces=("stress variant",)) == stress


def test_testbed_outliers_out_on_loopformer_is_refused_in_one_line_before_anything_is_written(tmp_path):
    """LoopFormer has no RMSNorm weight to scale (``norm_feeds`` is empty): refused with the CLI's usage error before
    the model is measured, its testbed.json / TESTBED.md rewritten or ``--outliers_out`` made (review finding: a
    ValueError traceback after both records were overwritten)."""
    model = Path(shutil.copytree(REPO_ROOT / "loopq" / "assets" / "tiny-loopformer", tmp_path / "loopformer"))
    before = snapshot(model)
    with pytest.raises(UsageError) as err:
        testbed.main(["--model", str(model), "--outliers_out", str(tmp_path / "stress"), "--windows", "1"])
    assert re.match(r"--outliers_out: .*loopformer \(loopformer\) has no RMSNorm", one_line(err.value))
    assert snapshot(model) == before and not (tmp_path / "stress").exists()


# ---------------------------------------------------------------------------------------------------- fit / run
def parse_fit(*args: str) -> None:
    """Parse a calibration config as loopq.run does (the guards run before anything is built)."""
    fit.build_cli([*FIT_CONFIGS, *args], run.DeferredCLI)


def test_run_directory_equal_to_the_teacher_is_refused(teacher):
    before = snapshot(teacher)
    with pytest.raises(GuardError) as err:
        parse_fit("--model.teacher", str(teacher), "--trainer.default_root_dir", str(teacher))
    assert re.match(rf"--trainer.default_root_dir {re.escape(str(teacher))}: is the teacher", one_line(err.value))
    assert snapshot(teacher) == before


def test_student_output_dir_onto_the_teacher_is_refused(teacher, tmp_path):
    with pytest.raises(GuardError, match=r"^--model.output_dir .*teacher: is .*teacher, which this command reads"):
        parse_fit("--model.teacher", str(teacher), "--trainer.default_root_dir", str(tmp_path / "run"),
                  "--model.output_dir", str(teacher))  # fmt: skip


def test_target_cache_inside_the_teacher_is_refused(teacher, tmp_path):
    before = snapshot(teacher)
    with pytest.raises(
        GuardError, match=r"^--model.target_cache_dir .*cache: is inside the teacher .*another directory"
    ):
        parse_fit("--model.teacher", str(teacher), "--trainer.default_root_dir", str(tmp_path / "run"),
                  "--model.target_cache_dir", str(teacher / "cache"))  # fmt: skip
    assert snapshot(teacher) == before and not (teacher / "cache").exists()


def test_run_directory_may_contain_the_teacher_but_not_write_over_it(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(TINY, root / "teachers" / "tiny")
    assert guards.check_run_root(root, root / "teachers" / "tiny") == root  # beside the run's folders: fine
    shutil.copytree(TINY, root / "student")
    with pytest.raises(GuardError, match=r"the run writes .*student, which holds the teacher"):
        guards.check_run_root(root, root / "student")
    with pytest.raises(GuardError, match=r"is inside the teacher directory"):
        guards.check_run_root(root / "student" / "run", root / "student")


# ---------------------------------------------------------------------------------------------------- evaluate
def test_evaluate_out_onto_the_teachers_weights_is_refused(teacher):
    before = snapshot(teacher)
    target = teacher / "model.safetensors"
    with pytest.raises(GuardError) as err:
        evaluate.evaluate(model=str(teacher), method="FP", out=str(target), tasks=[])
    assert re.match(rf"--out {re.escape(str(target))}: lies inside .*teacher, which this command reads", str(err.value))
    assert snapshot(teacher) == before


def test_evaluate_out_replaces_only_an_earlier_result(tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    with pytest.raises(GuardError, match=r"--out .*notes.json: exists and is not a loopq.evaluate result"):
        guards.check_output_file(notes, [TINY])
    earlier = tmp_path / "fp.json"
    earlier.write_text(json.dumps({"method": "FP", "wikitext2_ppl": 222.1}))
    assert guards.check_output_file(earlier, [TINY]) == earlier
    with pytest.raises(GuardError, match=r"is a stress variant directory"):
        guards.check_output_file(STRESS / "result.json")


# ---------------------------------------------------------------------------------------------------- pretrain
def build_pretrain(*args: str) -> None:
    pretrain.PretrainCLI(
        pretrain.TeacherPretrainer, pretrain.PretrainDataModule, run=False, args=list(args), seed_everything_default=0
    )


def test_pretrain_rebuilds_its_own_teacher_in_place_but_no_other_model(tmp_path):
    config = ["--config", "configs/pretrain/tiny-ouro.yaml"]
    own = shutil.copytree(TINY, tmp_path / "own")  # has training_record.json: the README's rebuild in place
    build_pretrain(*config, "--model.out_dir", str(own))
    stress = shutil.copytree(STRESS, tmp_path / "stress")
    before = snapshot(stress)
    with pytest.raises(GuardError, match=r"^model.out_dir .*stress: holds a stress variant .*pass another directory"):
        build_pretrain(*config, "--model.out_dir", str(stress))
    build_pretrain(*config, "--model.out_dir", str(stress), "--overwrite", "true")  # asked for explicitly
    assert snapshot(stress) == before  # building the CLI writes nothing


# ---------------------------------------------------------------------------------------------------- checkpoints
def write_ckpt(path: Path, step: int, mtime: int) -> Path:
    torch.save({"global_step": step, "state_dict": {"w": torch.full((64,), float(step))}}, path)
    os.utime(path, ns=(mtime, mtime))
    return path


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """checkpoints/ with step 3, step 6 and last (step 6) - written in that order, as ModelCheckpoint does."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for i, name in enumerate(["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]):
        write_ckpt(folder / name, 3 if i == 0 else 6, 10**18 + i * 10**9)
    return folder


def trainer_with(folder: Path) -> SimpleNamespace:
    return SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=str(folder))])


def test_truncated_last_checkpoint_falls_back_to_the_newest_intact_one(ckpt_dir, capsys):
    last = ckpt_dir / "last.ckpt"
    stamp = last.stat().st_mtime_ns
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    os.utime(last, ns=(stamp, stamp))
    before = snapshot(ckpt_dir)
    found = fit.resolve_ckpt_path(trainer_with(ckpt_dir), "last")
    assert found == str(ckpt_dir / "epoch=0-step=6.ckpt")
    assert torch.load(found, weights_only=True)["global_step"] == 6
    err = capsys.readouterr().err
    assert re.search(r"--ckpt_path last: skipped .*last\.ckpt: not a whole checkpoint archive", err)
    assert re.search(r"--ckpt_path last: resuming from .*epoch=0-step=6\.ckpt", err)
    assert snapshot(ckpt_dir) == before  # the damaged file is left where it is


def test_a_flipped_byte_is_caught_by_the_crc_even_where_torch_load_succeeds(ckpt_dir):
    last = ckpt_dir / "last.ckpt"
    data = bytearray(last.read_bytes())
    offset = data.index(torch.full((64,), 6.0).numpy().tobytes())  # inside the tensor's bytes
    data[offset + 1] ^= 0xFF
    last.write_bytes(bytes(data))
    torch.load(last, weights_only=True)  # loads silently with a wrong weight
    assert re.match(r"member .* fails its CRC check", checkpoint_problem(last))


def test_every_checkpoint_corrupt_is_one_line_naming_them(ckpt_dir):
    for path in ckpt_dir.iterdir():
        path.write_bytes(path.read_bytes()[:100])
    before = snapshot(ckpt_dir)
    with pytest.raises(CheckpointError) as err:
        fit.resolve_ckpt_path(trainer_with(ckpt_dir), "last")
    line = one_line(err.value)
    assert line.startswith(f"--ckpt_path last: no readable checkpoint in {ckpt_dir} (last.ckpt (not a whole")
    assert "epoch=0-step=3.ckpt" in line and "pass --ckpt_path <file>" in line
    assert snapshot(ckpt_dir) == before
    assert isinstance(CheckpointError("x"), LoopQError) and issubclass(GuardError, LoopQError)  # run_cli: one line


def test_deepspeed_directory_checkpoints_are_checked_by_their_sidecar(tmp_path):
    folder = tmp_path / "checkpoints"
    whole, unfinished = folder / "epoch=0-step=3.ckpt", folder / "last.ckpt"
    for i, directory in enumerate([whole, unfinished]):
        (directory / "checkpoint").mkdir(parents=True)
        write_ckpt(directory / "checkpoint" / "mp_rank_00_model_states.pt", 3, 10**18)
        os.utime(directory, ns=(10**18 + i, 10**18 + i))
    write_sidecar(whole, {"promoted": []})  # the sealed sidecar is written after DeepSpeed's files
    assert newest_intact(fit.checkpoints_in([folder])) == whole
    assert "loopq.json: missing - the save did not finish" in checkpoint_problem(unfinished)


def test_loopq_run_resumes_from_the_newest_intact_checkpoint_of_its_own_attempt(ckpt_dir):
    (ckpt_dir / "last.ckpt").write_bytes(b"")
    pipeline = SimpleNamespace(root=ckpt_dir.parent, manifest=SimpleNamespace(stages={"calibrate": {"started": 0}}))
    assert run.Pipeline.own_last_checkpoint(pipeline) == ckpt_dir / "epoch=0-step=6.ckpt"
    pipeline.manifest.stages["calibrate"]["started"] = 2 * 10**18  # started after every file: none is its own
    assert run.Pipeline.own_last_checkpoint(pipeline) is None


# ---------------------------------------------------------------------------------------------------- loop count
def test_activation_factor_of_the_tiny_teacher_by_hand_and_by_autograd():
    shape = guards.teacher_shape(TINY)
    # per shared layer: groups qkv (128 in, 128 + 2 x 64 out), o (128, 128), gate/up (128, 2 x 384), down (384, 128)
    inputs, outputs, norms, layers = 128 + 128 + 128 + 384, 256 + 128 + 768 + 128, 4, 2
    assert (shape.group_inputs, shape.group_outputs, shape.norms) == (2 * inputs, 2 * outputs, 2 * norms)
    assert guards.activation_factor(shape) == (8 * inputs + outputs + 2 * norms * 128) * layers / 128 == 132.0
    assert guards.activation_bytes(4, 128, 128, 1000, 4, 132.0) == 4 * 128 * 128 * 1000 * 4 * 132


@pytest.mark.parametrize("name", ["tiny-ouro", "ouro-tiny", "loopformer-tiny", "parcae-tiny"])
def test_activation_factor_matches_what_autograd_keeps_per_loop(name, fixtures):
    """The bytes autograd saves for 4 more loops of the student's forward, per loop, against the estimate."""
    from loopq.models import load_looplm
    from loopq.quant import QuantConfig, prepare

    directory = TINY if name == "tiny-ouro" else fixtures / name
    model, shape, ids = load_looplm(directory), guards.teacher_shape(directory), torch.randint(0, 100, (2, 32))

    def saved_bytes(loops: int) -> int:
        storages: dict[int, int] = {}

        def keep(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        student = prepare(model, QuantConfig(w_bits=4, a_bits=4, num_loops=loops, slt_budget=0))
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            student(ids, num_loops=loops)
        return sum(storages.values())

    per_loop = (saved_bytes(8) - saved_bytes(4)) / 4
    estimate = guards.activation_bytes(2, 32, shape.hidden, 1, 4, guards.activation_factor(shape))
    assert per_loop == pytest.approx(estimate, rel=0.1)  # measured: within 4 % on all four


def test_num_loops_far_above_the_trained_count_is_refused_naming_the_key_and_the_free_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(guards, "available_memory", lambda: 16 * 2**30)
    monkeypatch.delenv(guards.ALLOW_LOW_MEMORY, raising=False)
    args = ("--config", "configs/tiny.yaml", "--model.teacher", str(TINY), "--trainer.default_root_dir", str(tmp_path),
            "--model.quant.num_loops")  # fmt: skip
    with pytest.raises(GuardError) as err:
        fit.build_cli([*args, "1000"], run.DeferredCLI)
    # by hand: batch 4 x seq 128 x hidden 128 x 1000 loops x 4 bytes x 132, the trajectories of 256 samples in fp16
    acts, trajectories = 4 * 128 * 128 * 1000 * 4 * 132, 256 * 128 * 128 * 1000 * 2
    weights = 2 * 4 * sum(t.numel() for t in load_file(TINY / "model.safetensors").values())  # fp32, twice
    assert re.fullmatch(
        rf"model.quant.num_loops=1000: the calibration needs about {(acts + trajectories + weights) / 2**30:.1f} GiB "
        rf"\(activations {acts / 2**30:.1f} GiB, teacher trajectories {trajectories / 2**30:.1f} GiB, .*\) but only "
        r"16.0 GiB of memory is free; lower model.quant.num_loops \(trained: 4\).*LOOPQ_ALLOW_LOW_MEMORY=1 .*",
        one_line(err.value),
    )
    assert not list(tmp_path.iterdir())  # nothing was started


@pytest.mark.parametrize(("precision", "size"), [("32-true", 4), ("64-true", 8), ("bf16-true", 2), ("bf16-mixed", 4)])
def test_the_loop_memory_guard_counts_the_bytes_of_the_precision(monkeypatch, tmp_path, precision, size):
    """Lightning's own spelling of fp32, ``32-true``, was read as 2 bytes (every ``*-true`` was): the estimate halved
    and a calibration that does not fit was accepted (review finding)."""
    monkeypatch.setattr(guards, "available_memory", lambda: 16 * 2**30)
    monkeypatch.delenv(guards.ALLOW_LOW_MEMORY, raising=False)
    args = ("--config", "configs/tiny.yaml", "--model.teacher", str(TINY), "--trainer.default_root_dir", str(tmp_path),
            "--trainer.precision", precision, "--model.quant.num_loops", "1000")  # fmt: skip
    with pytest.raises(GuardError) as err:
        fit.build_cli(list(args), run.DeferredCLI)
    acts = 4 * 128 * 128 * 1000 * size * 132  # as in the test above, at this precision's bytes
    assert f"(activations {acts / 2**30:.1f} GiB," in one_line(err.value)


def test_num_loops_above_twice_the_trained_count_warns_with_the_memory_it_needs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(guards, "available_memory", lambda: 16 * 2**30)
    args = ("--config", "configs/tiny.yaml", "--model.teacher", str(TINY), "--trainer.default_root_dir", str(tmp_path),
            "--model.quant.num_loops")  # fmt: skip
    fit.build_cli([*args, "8"], run.DeferredCLI)  # twice the trained count: quiet
    assert "[loopq] warning" not in capsys.readouterr().err
    monkeypatch.setenv(guards.ALLOW_LOW_MEMORY, "1")  # the override: warned, not refused
    fit.build_cli([*args, "1000"], run.DeferredCLI)
    warning = capsys.readouterr().err
    assert re.search(
        r"warning: model.quant.num_loops=1000 is 250x the teacher's trained 4 loops; .*about 40\.0 GiB", warning
    )


def test_loopq_run_refuses_an_impossible_loop_count_in_one_line_before_any_work(tmp_path):
    cmd = [sys.executable, "-m", "loopq.run", "--config", "configs/tiny.yaml", "--trainer.default_root_dir",
           str(tmp_path / "run"), "--model.quant.num_loops", "1000000"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=ENV, timeout=300)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(r"error: model.quant.num_loops=1000000: .* GiB of memory is free", errors[0])
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------- SIGTERM
@pytest.fixture(scope="module")
def sigtermed(tmp_path_factory) -> SimpleNamespace:
    """A calibration sent SIGTERM in the middle of step 5 (global_step 4), then resumed with ``--ckpt_path last``."""
    tmp = tmp_path_factory.mktemp("sigterm")
    root, marker = tmp / "run", tmp / "at-step-4"
    init = {"step": 4, "marker": str(marker)}
    waiter = {"class_path": "tests.bad_inputs.signals.WaitForSignalAtStep", "init_args": init}
    cmd = [sys.executable, "-m", "loopq.fit", *FIT_CONFIGS, "--trainer.default_root_dir", str(root),
           "--trainer.callbacks+", json.dumps(waiter)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=ENV)
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    last = root / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)["global_step"] if last.is_file() else None
    stopped = SimpleNamespace(returncode=proc.returncode, stderr=stderr, saved_step=saved, student=(root / "student"))
    stopped.had_student = stopped.student.exists()
    resumed = run_fit(root, "--ckpt_path", "last")
    return SimpleNamespace(root=root, last=last, stopped=stopped, resumed=resumed)


def test_sigterm_finishes_the_step_saves_last_ckpt_and_exits_then_resume_continues_from_it(sigtermed):
    stopped, last = sigtermed.stopped, sigtermed.last
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert re.search(r"SIGTERM received: finishing step 5, then saving a checkpoint", stopped.stderr)
    assert f"stopped by SIGTERM after step 5: saved {last}; resume with --ckpt_path last" in stopped.stderr
    assert stopped.saved_step == 5 and not stopped.had_student  # the step in flight finished; no half student
    resumed = sigtermed.resumed.stdout + sigtermed.resumed.stderr
    assert f"Restoring states from the checkpoint path at {last}" in resumed
    assert (sigtermed.root / "student" / STUDENT_WEIGHTS).is_file()


@pytest.mark.slow
def test_resume_after_sigterm_matches_an_uninterrupted_run_bit_for_bit(sigtermed, tmp_path):
    run_fit(tmp_path)
    (a, meta_a), (b, meta_b) = read_student(tmp_path), read_student(sigtermed.root)
    assert_same_tensors(a, b, atol=0)  # nothing of the interrupted step was repeated or lost
    assert meta_a["promoted"] == meta_b["promoted"] and meta_a["mu"] == meta_b["mu"]


class TinyRegression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SignalAtStep(L.Callback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def test_sigint_takes_the_same_clean_route_and_restores_the_handlers(tmp_path):
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=100), StopOnSignal()]
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=10, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, SignalAtStep(2, signal.SIGINT)],
    )  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)))
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SIGTERMException):
        trainer.fit(TinyRegression(), data)
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 3  # step 3 finished
    assert exit_status(trainer) == 130 and signal.getsignal(signal.SIGINT) is before


def test_a_resume_after_a_signal_before_any_periodic_save_keeps_writing_last_ckpt(tmp_path):
    """A stop before the first periodic save left ModelCheckpoint's ``last_model_path`` empty in the saved state, so
    the resumed run wrote ``last-v1.ckpt`` beside the stale ``last.ckpt`` (found resuming a calibration stopped at
    step 9: ``student_at_checkpoint(..., last.ckpt)`` gave the step-9 student). Now the resumed run overwrites it."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)))

    def trainer(max_steps: int, *extra: L.Callback) -> L.Trainer:
        save = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_last=True)
        return L.Trainer(
            default_root_dir=tmp_path, max_steps=max_steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[save, StopOnSignal(), *extra],
        )  # fmt: skip

    with pytest.raises(SIGTERMException):
        trainer(10, SignalAtStep(1, signal.SIGINT)).fit(TinyRegression(), data)  # stopped after step 2, unsaved before
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2
    trainer(10).fit(TinyRegression(), data, ckpt_path=str(last))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("last*")) == ["last.ckpt"]
    assert torch.load(last, weights_only=True)["global_step"] == 8  # its last periodic save
