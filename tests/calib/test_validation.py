"""Held-out validation (loopq/calib/validation.py): the windows are held out, the metrics are token-weighted
torchmetrics whose values equal a direct computation over the whole set, and DDP with uneven shards gives the
single-process numbers."""

import csv
import itertools
import json
import math

import lightning as L
import pytest
import torch

from loopq.artifacts.student import StudentFormatError, student_at_checkpoint
from loopq.calib.module import LoopQCalibration
from loopq.calib.validation import LoopPerplexity, ValidationMetrics, measure, token_mean
from loopq.data.calibration import CalibrationDataModule, rank_shard
from loopq.data.stream import disjoint_starts, spread_windows
from loopq.data.text import DataError
from loopq.errors import GuardError
from loopq.metrics.perplexity import perplexity
from loopq.paths import REPO_ROOT
from loopq.quant import QuantConfig
from tests.helpers import assert_same_tensors, read_student, run_fit

TINY = str(REPO_ROOT / "loopq" / "assets" / "tiny-ouro")
VALIDATE = ["--data.val_samples", "5", "--data.val_sources", "[wikitext2/wiki.valid.tokens]"]


# ---------------------------------------------------------------------------------------------------- windows
def test_rank_shards_cover_every_window_once_with_masked_padding():
    windows = torch.arange(5).unsqueeze(1).expand(5, 3)
    (ids0, mask0), (ids1, mask1) = rank_shard(windows, 0, 2), rank_shard(windows, 1, 2)
    assert ids0[:, 0].tolist() == [0, 2, 4] and mask0.tolist() == [True, True, True]
    assert ids1[:, 0].tolist() == [1, 3, 0] and mask1.tolist() == [True, True, False]
    real = sorted(ids0[mask0][:, 0].tolist() + ids1[mask1][:, 0].tolist())
    assert real == [0, 1, 2, 3, 4]


def test_validation_windows_overlap_no_calibration_window_nor_each_other():
    taken = torch.tensor([0, 100, 250, 400])
    starts = disjoint_starts(600, 12, 20, seed=3, taken=taken, key="data.val_samples")
    every = sorted([*taken.tolist(), *starts.tolist()])
    assert len(starts) == 12 and all(b - a >= 20 for a, b in itertools.pairwise(every))


def test_too_many_validation_windows_are_refused_naming_the_key():
    with pytest.raises(DataError, match=r"data\.val_samples=10: only \d windows .* lower it or add text"):
        disjoint_starts(200, 10, 20, seed=0, taken=torch.tensor([0, 50, 100]), key="data.val_samples")


def test_spread_windows_by_hand():
    stream = torch.arange(100)
    assert spread_windows(stream, 3, 10)[:, 0].tolist() == [0, 40, 90]  # windows 0, 4 (4.5 rounds to even), 9
    assert spread_windows(stream, 50, 30).shape == (3, 30)  # fewer windows than asked: all of them


def test_validation_leaves_the_calibration_windows_as_they_were():
    plain = CalibrationDataModule(TINY, num_samples=16, seq_len=32, holdout_samples=2)
    with_val = CalibrationDataModule(TINY, num_samples=16, seq_len=32, holdout_samples=2, val_samples=5)
    plain.setup(), with_val.setup()
    assert torch.equal(plain.samples, with_val.samples) and torch.equal(plain.holdout, with_val.holdout)
    assert plain.val_sets == {} and with_val.val_sets["heldout"].shape == (5, 32)


# ---------------------------------------------------------------------------------------------------- metrics
def test_token_weighted_means_are_global_token_means():
    """Batch means weighted by their token counts = the mean over all tokens (not the mean of batch means)."""
    metric, values = token_mean(), [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]
    for v in values:
        metric.update(v.mean(), v.numel())
    assert float(metric.compute()) == pytest.approx(16 / 4, rel=1e-12)  # not (2 + 10) / 2


def test_loop_perplexity_by_hand():
    metric = LoopPerplexity(2)
    metric.update(torch.tensor([2.0, 1.0]), 2)
    metric.update(torch.tensor([4.0, 3.0]), 4)
    assert metric.compute().tolist() == pytest.approx([math.exp(1.0), math.exp(4 / 6)])


def fresh_module_and_data(batch_size: int = 2) -> tuple[LoopQCalibration, CalibrationDataModule]:
    module = LoopQCalibration(TINY, QuantConfig(w_bits=4, a_bits=4, group_size=32, slt_budget=0))
    data = CalibrationDataModule(
        TINY, num_samples=16, seq_len=32, batch_size=batch_size, holdout_samples=2, val_samples=5,
        val_sources=["wikitext2/wiki.valid.tokens"],
    )  # fmt: skip
    return module, data


def validate(module, data) -> dict[str, float]:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    return trainer.validate(module, datamodule=data, verbose=False)[0]


def test_validation_metrics_equal_a_direct_computation_over_the_whole_set():
    """Batches of 2 over 5 windows, reduced by torchmetrics = one pass over all 5 windows; the perplexities are
    loopq.metrics.perplexity's (the evaluation's own implementation)."""
    module, data = fresh_module_and_data()
    got = validate(module, data)
    for name, windows in data.val_sets.items():
        terms, kl_sum, _, _ = measure(module.teacher, module.student, windows, module.mu, module.hparams, 4)
        for key, value in terms.items():
            assert got[f"val/{name}/{key}"] == pytest.approx(float(value), rel=1e-5), key
        assert got[f"val/{name}/kl_full"] == pytest.approx(float(kl_sum) / windows.numel(), rel=1e-5)
        fp = perplexity(module.teacher, windows.flatten(), 32, batch_size=5, per_loop=True)
        student = perplexity(module.student, windows.flatten(), 32, batch_size=5, per_loop=True)
        for t in range(4):
            assert got[f"val/{name}/fp_ppl_loop{t + 1}"] == pytest.approx(fp.per_loop[t], rel=1e-5)
            assert got[f"val/{name}/ppl_loop{t + 1}"] == pytest.approx(student.per_loop[t], rel=1e-5)
    assert got["val/heldout/kl_full"] > 0 and got["val/extra/ppl_loop4"] != got["val/heldout/ppl_loop4"]


def test_metric_states_are_not_checkpointed():
    module, _ = fresh_module_and_data()
    assert not any(key.startswith("val_metrics") for key in module.state_dict())
    assert isinstance(module.val_metrics["heldout"], ValidationMetrics)


# ---------------------------------------------------------------------------------------------------- end to end
def val_rows(root) -> dict[int, dict[str, float]]:
    """step -> the val/ metrics logged at that step (CSV logger)."""
    rows: dict[int, dict[str, float]] = {}
    with open(next((root / "csv").glob("version_*/metrics.csv"))) as f:
        for row in csv.DictReader(f):
            vals = {k: float(v) for k, v in row.items() if k.startswith("val/") and v}
            if vals:
                rows.setdefault(int(row["step"]), {}).update(vals)
    return rows


def test_ddp_validation_with_uneven_shards_equals_one_process(tmp_path):
    """5 windows per set on 2 processes (3 + 2, the short shard padded with a masked row) vs 1 process; float64 so
    that the two calibrations themselves agree (test_distributed.py) and only validation is compared."""
    run = ["--trainer.precision", "64-true", "--trainer.max_steps", "2", "--trainer.val_check_interval", "1", *VALIDATE]
    run_fit(tmp_path / "one", *run)
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp_find_unused_parameters_true", "--data.batch_size", "1"]
    run_fit(tmp_path / "two", *run, *ddp, procs=2)
    one, two = val_rows(tmp_path / "one"), val_rows(tmp_path / "two")
    assert sorted(one) == sorted(two) and len(one) == 2
    assert len(one[min(one)]) == 2 * (6 + 2 * 4)  # 2 sets x (5 loss terms, kl_full, 2 x 4 perplexities)
    for step, values in one.items():
        for key, value in values.items():
            assert two[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)


def test_validation_changes_no_bit_and_a_checkpoint_reproduces_the_logged_values(tmp_path):
    """Validating every 3 steps leaves the student bit-identical to a run without validation (the README's number
    stays); ``trainer.validate(ckpt_path=...)`` restores a checkpoint (promoted SLT groups, mu_t included) and
    measures what the calibration logged at that step."""
    run_fit(tmp_path / "plain", "--trainer.max_steps", "6")
    best = {"monitor": "val/heldout/kl_full", "mode": "min", "save_top_k": 1, "filename": "best"}
    chooser = json.dumps({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": best})
    run_fit(tmp_path, "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", *VALIDATE,
            "--trainer.callbacks+", chooser)  # fmt: skip
    (plain, meta_plain), (validated, meta) = read_student(tmp_path / "plain"), read_student(tmp_path)
    assert_same_tensors(plain, validated, atol=0)
    assert meta_plain["promoted"] == meta["promoted"] and meta_plain["mu"] == meta["mu"]
    # the last checkpoint made into a student (student_at_checkpoint) is the student the run wrote, bit for bit
    student_at_checkpoint(tmp_path / "student", tmp_path / "checkpoints" / "last.ckpt", tmp_path / "at" / "student")
    rebuilt, meta_rebuilt = read_student(tmp_path / "at")
    assert_same_tensors(rebuilt, validated, atol=0)
    assert (meta_rebuilt["promoted"], meta_rebuilt["mu"]) == (meta["promoted"], meta["mu"])
    assert meta_rebuilt["provenance"]["selected"]["step"] == 6
    with pytest.raises(StudentFormatError, match="not a checkpoint of the calibration that wrote"):  # other config
        student_at_checkpoint(tmp_path / "student", tmp_path / "plain" / "checkpoints" / "last.ckpt", tmp_path / "x")
    with pytest.raises(StudentFormatError, match=r"missing\.ckpt: not found; pass a \.ckpt file"):
        student_at_checkpoint(tmp_path / "student", tmp_path / "missing.ckpt", tmp_path / "x")
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(StudentFormatError, match=r"dir\.ckpt: a directory \(DeepSpeed"):
        student_at_checkpoint(tmp_path / "student", tmp_path / "dir.ckpt", tmp_path / "x")
    before = (tmp_path / "student" / "loopq_student.safetensors").read_bytes()
    for taken in (tmp_path / "student", tmp_path / "plain" / "student"):  # the run's own student, another model
        with pytest.raises(GuardError, match="out "):
            student_at_checkpoint(tmp_path / "student", tmp_path / "checkpoints" / "last.ckpt", taken)
    assert (tmp_path / "student" / "loopq_student.safetensors").read_bytes() == before
    logged = val_rows(tmp_path)
    step = max(logged)  # Lightning logs validation at global_step - 1: the checkpoint of step 6
    ckpt = next((tmp_path / "checkpoints").glob(f"*step={step + 1}.ckpt"))
    hparams = {k: v for k, v in torch.load(ckpt, weights_only=True)["hyper_parameters"].items() if k[0] != "_"}
    module = LoopQCalibration(**{**hparams, "quant": QuantConfig(**hparams["quant"])})
    data = CalibrationDataModule(
        TINY, num_samples=16, seq_len=32, batch_size=2, holdout_samples=2, val_samples=5,
        val_sources=["wikitext2/wiki.valid.tokens"],
    )  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    got = trainer.validate(module, datamodule=data, ckpt_path=str(ckpt), verbose=False)[0]
    assert module.promoted  # the checkpoint's SLT selection was replayed
    for key, value in logged[step].items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    # ModelCheckpoint(monitor=...) chooses by the held-out KL: its checkpoint is the step of the lowest logged KL
    states = torch.load(tmp_path / "checkpoints" / "best.ckpt", weights_only=True)["callbacks"]
    chosen = next(v for k, v in states.items() if "val/heldout/kl_full" in k)
    assert float(chosen["best_model_score"]) == pytest.approx(min(r["val/heldout/kl_full"] for r in logged.values()))


def test_student_from_best_is_the_monitored_checkpoint_and_is_recorded(tmp_path):
    """``model.student_from: best`` writes the checkpoint the monitoring ModelCheckpoint chose (mode ``max`` here, so
    that it is an early one, not the last step) as the student, and records which in the provenance."""
    worst = {"monitor": "val/heldout/kl_full", "mode": "max", "save_top_k": 1, "filename": "chosen"}
    chooser = json.dumps({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": worst})
    run_fit(tmp_path, "--trainer.max_steps", "6", "--trainer.val_check_interval", "2", *VALIDATE,
            "--trainer.callbacks+", chooser, "--model.student_from", "best")  # fmt: skip
    weights, meta = read_student(tmp_path)
    chosen = torch.load(tmp_path / "checkpoints" / "chosen.ckpt", weights_only=True)
    selected = meta["provenance"]["selected"]
    assert selected["checkpoint"] == "best" and selected["monitor"] == "val/heldout/kl_full"
    assert selected["step"] == chosen["global_step"] < selected["last_step"] == 6
    logged = val_rows(tmp_path)
    assert selected["score"] == pytest.approx(max(r["val/heldout/kl_full"] for r in logged.values()))
    assert_same_tensors(weights, {k: chosen["state_dict"]["student." + k] for k in weights}, atol=0)
    assert meta["mu"] == chosen["loopq"]["mu"]
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert any(not torch.equal(weights[k], last["student." + k]) for k in weights)  # not the last step's
    # the chosen checkpoint made into a student again (student_at_checkpoint) is the student written
    student_at_checkpoint(
        tmp_path / "student", tmp_path / "checkpoints" / "chosen.ckpt", tmp_path / "again" / "student"
    )
    assert_same_tensors(read_student(tmp_path / "again")[0], weights, atol=0)


def test_student_from_best_is_refused_without_something_to_choose_by():
    from types import SimpleNamespace as NS

    from loopq.errors import UsageError
    from loopq.planning.guards import check_student_choice

    monitor = NS(class_path="lightning.pytorch.callbacks.ModelCheckpoint", init_args={"monitor": "val/heldout/kl_full"})
    plain = NS(class_path="lightning.pytorch.callbacks.ModelCheckpoint", init_args={"save_last": True})

    def config(val_samples=5, callbacks=(monitor,), strategy="auto"):
        trainer = NS(callbacks=list(callbacks), strategy=strategy)
        return NS(model=NS(student_from="best"), data=NS(val_samples=val_samples, val_sources=None), trainer=trainer)

    check_student_choice(config())
    with pytest.raises(UsageError, match=r"student_from best: nothing is validated; set --data\.val_samples"):
        check_student_choice(config(val_samples=0))
    with pytest.raises(UsageError, match=r"no ModelCheckpoint in trainer\.callbacks monitors"):
        check_student_choice(config(callbacks=(plain,)))
    with pytest.raises(UsageError, match="not under DeepSpeed"):
        check_student_choice(config(strategy=NS(class_path="loopq.calib.deepspeed.LoopQDeepSpeedStrategy")))
    # the student is the checkpoint of one monitor, and that monitor is a validation metric
    top1 = NS(class_path=monitor.class_path, init_args={"monitor": "val/heldout/top1", "mode": "max"})
    with pytest.raises(
        UsageError, match=r"several ModelCheckpoints monitor a metric \(val/heldout/kl_full, val/heldout/top1"
    ):
        check_student_choice(config(callbacks=(monitor, top1)))
    train = NS(class_path=monitor.class_path, init_args={"monitor": "train/loss"})
    with pytest.raises(UsageError, match=r"monitors train/loss, not a validation metric"):
        check_student_choice(config(callbacks=(train,)))
    last = config()
    last.model.student_from = "last"
    check_student_choice(last)  # the paper's default needs nothing


SHIPPED = ["configs/tiny.yaml", "configs/small.yaml", "configs/baselines/flatquant-tiny.yaml"]
SHIPPED += ["configs/baselines/spinquant-tiny.yaml"]


@pytest.mark.parametrize("config", SHIPPED)
def test_the_student_best_overlay_adds_a_monitoring_checkpoint_to_any_shipped_config(config):
    """``--config <c> --config configs/overlays/student-best.yaml`` keeps the config's own callbacks, appends one
    ModelCheckpoint monitoring the held-out KL (mode min) and passes the ``student_from best`` guard."""
    from loopq.commands import fit
    from loopq.errors import UsageError
    from loopq.planning.guards import check_student_choice

    parser = fit.build_parser()
    plain = parser.parse_args(["--config", str(REPO_ROOT / config)])
    both = parser.parse_args(
        ["--config", str(REPO_ROOT / config), "--config", str(REPO_ROOT / "configs/overlays/student-best.yaml")]
    )
    names = [cb.class_path for cb in both.trainer.callbacks]
    assert names[:-1] == [cb.class_path for cb in plain.trainer.callbacks]
    added = both.trainer.callbacks[-1]
    assert added.class_path.endswith("ModelCheckpoint")
    assert (added.init_args["monitor"], added.init_args["mode"]) == ("val/heldout/kl_full", "min")
    assert both.model.student_from == "best" and plain.model.student_from == "last"
    if both.data.val_samples or both.data.val_sources:
        check_student_choice(both)
    else:  # configs/small.yaml validates nothing: best has nothing to choose by, said at the start
        with pytest.raises(UsageError, match="nothing is validated"):
            check_student_choice(both)


def test_what_chooses_the_best_student_is_part_of_the_calibration_settings():
    """With ``student_from: best`` the monitoring checkpoint's monitor, mode and schedule decide the student, so they
    are in the settings a rerun and a resume compare (a review found two different choices compared equal); with
    ``last`` the checkpoint callbacks stay out of them, as every other checkpointing callback does."""
    from loopq.commands import fit

    parser = fit.build_parser()
    base = [
        "--config",
        str(REPO_ROOT / "configs/tiny.yaml"),
        "--config",
        str(REPO_ROOT / "configs/overlays/student-best.yaml"),
    ]

    def settings(*extra):
        return fit.fit_settings(parser.parse_args([*base, *extra]))

    best = settings()
    assert best["student_choice"][0]["monitor"] == "val/heldout/kl_full" and best["student_choice"][0]["mode"] == "min"
    other = json.dumps({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                        "init_args": {"monitor": "val/heldout/top1", "mode": "max"}})  # fmt: skip
    swapped = settings("--trainer.callbacks", json.dumps([]), "--trainer.callbacks+", other)
    assert swapped != best and swapped["student_choice"] == [
        {"monitor": "val/heldout/top1", "mode": "max", **dict.fromkeys(fit.CHOICE_KEYS[2:])}
    ]
    last = settings("--model.student_from", "last")
    assert (
        "student_choice" not in last and settings("--model.student_from", "last", "--trainer.callbacks+", other) == last
    )
