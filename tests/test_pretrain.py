"""A few pretraining steps of a tiny looped LM lower the loss; the export is a loadable Ouro directory."""

import json
import math
import re

import lightning as L
import pytest
import torch

from loopq.commands.pretrain import (
    PretrainDataModule,
    TeacherPretrainer,
    gate_targets,
    per_loop_token_losses,
    warmup_cosine,
)
from loopq.models import load_looplm


def test_short_pretraining_lowers_loss_and_exports(data, tmp_path):
    dm = PretrainDataModule(
        sources=["calibration/tinyshakespeare_input.txt"], vocab_size=300, seq_len=32, batch_size=16, val_windows=16
    )
    dm.setup()
    module = TeacherPretrainer(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        total_ut_steps=3,
        lr=1e-2,
        warmup_steps=2,
        out_dir=str(tmp_path / "teacher"),
    )

    def val_loss():
        with torch.no_grad():
            return per_loop_token_losses(module.model.eval(), dm.val)[0].mean(dim=(1, 2))

    before = val_loss()
    trainer = L.Trainer(
        max_steps=40,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)
    after = val_loss()
    assert (after < before - 0.5).all(), (before, after)
    exported = load_looplm(tmp_path / "teacher")
    assert exported.arch == "ouro" and exported.default_num_loops == 3
    with torch.no_grad():
        torch.testing.assert_close(exported(dm.val[:2]).logits, module.model(dm.val[:2]).logits)
    record = json.loads((tmp_path / "teacher" / "training_record.json").read_text())
    assert record["steps"] == 40 and (tmp_path / "teacher" / "tokenizer.json").is_file()


def test_gate_targets_by_hand():
    # loop 1 -> 2 gains 1.0 nats (continue: 0), loop 2 -> 3 gains 0.01 (< margin: stop)
    losses = torch.tensor([3.0, 2.0, 1.99]).view(3, 1, 1)
    assert gate_targets(losses, margin=0.02).flatten().tolist() == [0.0, 1.0]


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 10, 100, 0.1) == 0.1
    assert warmup_cosine(9, 10, 100, 0.1) == 1.0
    assert abs(warmup_cosine(100, 10, 100, 0.1) - 0.1) < 1e-9


def test_bos_windows_start_with_bos_and_carry_seq_len_stream_tokens(data):
    dm = PretrainDataModule(
        sources=["calibration/tinyshakespeare_input.txt"], vocab_size=300, seq_len=32, val_windows=4, bos=True
    )
    dm.setup()
    windows = torch.cat([dm.train, dm.val])
    assert windows.shape[1] == 33 and (windows[:, 0] == 0).all()  # <|endoftext|> = id 0 = Ouro's BOS
    plain = PretrainDataModule(sources=["calibration/tinyshakespeare_input.txt"], vocab_size=300, seq_len=32)
    plain.setup()
    assert (plain.train[:, 0] != 0).any()  # without the switch windows are plain stream cuts


def test_pretraining_resumes_from_its_last_checkpoint(data, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(steps, ckpt_path=None):
        dm = PretrainDataModule(
            sources=["calibration/tinyshakespeare_input.txt"], vocab_size=300, seq_len=16, batch_size=4, bos=True
        )
        module = TeacherPretrainer(
            vocab_size=300, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            total_ut_steps=2, warmup_steps=1, out_dir=str(tmp_path / "teacher"),
        )  # fmt: skip
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True, save_top_k=1)
        trainer = L.Trainer(
            max_steps=steps, accelerator="cpu", logger=False, callbacks=[ckpt], enable_progress_bar=False,
            limit_val_batches=0, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return trainer, module

    run(4)
    first = json.loads((tmp_path / "teacher" / "training_record.json").read_text())
    trainer, module = run(6, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    record = json.loads((tmp_path / "teacher" / "training_record.json").read_text())
    assert trainer.global_step == 6 and record["steps"] == 6
    assert record["wall_seconds"] >= first["wall_seconds"]  # wall time sums the resumed segments
    assert module.lr_schedulers().last_epoch == 6  # the LR schedule continued, not restarted


def test_post_norm_init_sets_only_the_sandwich_gains():
    module = TeacherPretrainer(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                               num_key_value_heads=1, total_ut_steps=2, post_norm_init=0.1)  # fmt: skip
    gains = {n: float(p.mean()) for n, p in module.model.named_parameters() if n.endswith("norm.weight") or "_2." in n}
    assert all(
        v == pytest.approx(0.1)
        for n, v in gains.items()
        if n.endswith(("input_layernorm_2.weight", "post_attention_layernorm_2.weight"))
    )
    assert module.model.model.layers[0].input_layernorm.weight.eq(1).all()  # pre-norms untouched


def test_sigterm_during_pretraining_saves_last_ckpt_and_exits_143(data, tmp_path):
    """A multi-hour pretraining stopped by SIGTERM finishes the step in flight, saves ``last.ckpt`` and exits 143."""
    import signal
    import subprocess
    import sys
    import time

    from loopq.paths import REPO_ROOT

    marker, ckpts = tmp_path / "at-step-2", tmp_path / "ckpt"
    waiter = {
        "class_path": "tests.bad_inputs.signals.WaitForSignalAtStep",
        "init_args": {"step": 2, "marker": str(marker)},
    }
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(ckpts), "every_n_train_steps": 100, "save_last": True},
    }
    cmd = [sys.executable, "-m", "loopq.pretrain", "--data.sources", '["calibration/tinyshakespeare_input.txt"]',
           "--data.vocab_size", "300", "--data.seq_len", "16", "--data.batch_size", "4",
           "--model.hidden_size", "16", "--model.intermediate_size", "32", "--model.num_attention_heads", "2",
           "--model.num_key_value_heads", "1", "--model.total_ut_steps", "2", "--model.out_dir", str(tmp_path / "t"),
           "--trainer.max_steps", "50", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
           "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
           "--trainer.default_root_dir", str(tmp_path),
           "--trainer.callbacks", json.dumps([checkpoint, waiter])]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 3  # the step in flight finished
    assert "stopped by SIGTERM after step 3" in stderr and not (tmp_path / "t").exists()  # no half-trained teacher


def test_each_epoch_has_its_own_order_and_a_resume_replays_it():
    """EpochShuffle: a permutation per (seed, epoch), set by Lightning before each epoch, so an epoch's order does not
    depend on the epochs a process ran before it (a resumed run used to replay epoch 0's order: review finding)."""
    from torch.utils.data import DataLoader, TensorDataset

    from loopq.commands.pretrain import EpochShuffle

    orders = []
    for epoch in (0, 1, 1):
        sampler = EpochShuffle(10, seed=3)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert sorted(orders[0]) == list(range(10)) and orders[0] != orders[1] == orders[2]

    seen: list[list[int]] = []

    class Record(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def on_train_epoch_start(self):
            seen.append([])

        def training_step(self, batch, _):
            seen[-1] += batch[0].tolist()
            return (self.w * 0).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.arange(10)), batch_size=5, sampler=EpochShuffle(10, seed=3))

    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Record())
    want = []
    for epoch in range(3):
        sampler = EpochShuffle(10, seed=3)
        sampler.set_epoch(epoch)
        want.append(list(sampler))
    assert seen == want  # Lightning set each epoch on the sampler


@pytest.mark.parametrize(("stop_after_batch", "step"), [(7, 4), (8, 5)])
def test_a_resumed_pretraining_sees_the_uninterrupted_batches_and_ends_on_its_weights(
    data, tmp_path, stop_after_batch, step
):
    """Stopped mid-epoch and resumed from last.ckpt, a run trains on the batches of an uninterrupted run and ends on
    its weights (the resume used to restart its epoch at the first batch: review finding). Epochs of 5 batches in steps
    of 2 (3 steps an epoch, the last of 1 batch). A stop asked for after batch 7 (step 4's last) stops at step 4, 1
    step into epoch 1; one asked for after batch 8, inside step 5's window, waits for that step (it used to stop and
    save after the micro-batch: the resumed run stepped one micro-batch early, every later step shifted by one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen: list[tuple[int, int]] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((trainer.current_epoch, int(batch[0].sum())))

    class StopAt(L.Callback):
        def on_train_batch_end(self, trainer, *_):  # asks once, as a callback on an event does
            trainer.should_stop = trainer.should_stop or len(seen) == stop_after_batch

    def run(name, stop=False, ckpt_path=None):
        dm = PretrainDataModule(sources=["calibration/tinyshakespeare_input.txt"], vocab_size=300, seq_len=16,
                                batch_size=4, bos=True)  # fmt: skip
        module = TeacherPretrainer(
            vocab_size=300, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            total_ut_steps=2, warmup_steps=1, out_dir=str(tmp_path / name / "teacher"),
        )  # fmt: skip
        ckpt = ModelCheckpoint(dirpath=tmp_path / name / "ckpt", every_n_train_steps=2, save_last=True)
        trainer = L.Trainer(
            max_steps=8, accelerator="cpu", logger=False, callbacks=[ckpt, Record()] + [StopAt()] * stop,
            enable_progress_bar=False, limit_train_batches=5, accumulate_grad_batches=2, limit_val_batches=0,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module

    straight = run("straight")
    want, seen[:] = list(seen), []
    from loopq.commands.pretrain import RunIncomplete

    with pytest.raises(RunIncomplete, match=rf"after step {step} of trainer\.max_steps 8"):  # stopped short: said
        run("resumed", stop=True)
    assert len(seen) == 5 + 2 * (step - 3)  # 3 steps of epoch 0 (5 batches), then steps of 2
    resumed = run("resumed", ckpt_path=str(tmp_path / "resumed" / "ckpt" / "last.ckpt"))
    assert seen == want
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_epoch_shuffle_shards_the_epoch_over_processes_and_skips_what_a_resume_consumed():
    """One process takes the epoch's (seed, epoch) permutation as it is (the order the embedded teachers trained
    on); each of N takes every N-th window of it, padded to a multiple of N; a resume skips the windows this
    process consumed in the resumed epoch only."""
    from loopq.commands.pretrain import EpochShuffle, step_generator

    order = torch.randperm(10, generator=step_generator(3, 1)).tolist()
    one = EpochShuffle(10, seed=3)
    one.set_epoch(1)
    assert list(one) == order
    shards = [EpochShuffle(10, seed=3, num_replicas=4, rank=r) for r in range(4)]
    for shard in shards:
        shard.set_epoch(1)
    padded = order + order[:2]
    assert [list(s) for s in shards] == [padded[r::4] for r in range(4)] and all(len(s) == 3 for s in shards)
    shards[1].resume(epoch=1, windows=2)
    assert list(shards[1]) == padded[1::4][2:] and len(shards[1]) == 3  # Lightning counts the skipped as fetched
    shards[1].set_epoch(2)
    assert len(list(shards[1])) == 3


def test_validation_windows_share_no_text_with_training_when_a_source_is_listed_twice(tmp_path):
    """The pretrain configs list WikiText-2 valid twice to weight it; validation windows cut from the shuffled windows
    of that stream had their text in the other copy's training windows (review finding: optimistic val/ce). On text
    of random words (no span of 4 words repeats by chance) no 16-token span of a validation window is in training (a
    copy cut at another offset holds at least one such half of a window)."""
    import random

    gen = random.Random(0)
    words = ["".join(gen.choices("abcdefghij", k=5)) for _ in range(5000)]
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(" ".join(gen.choices(words, k=4000)) + "\n")
    dm = PretrainDataModule(sources=["a.txt", "b.txt", "b.txt"], root=str(tmp_path), vocab_size=300, seq_len=32,
                            val_windows=32, bos=True)  # fmt: skip
    dm.setup()

    def spans(windows):
        return {tuple(w[i : i + 16]) for w in windows.tolist() for i in range(1, len(w) - 15)}

    assert len(dm.val) == 32 and not spans(dm.val) & spans(dm.train)
    once = PretrainDataModule(sources=["a.txt", "b.txt"], root=str(tmp_path), vocab_size=300, seq_len=32,
                                  val_windows=32, bos=True)  # fmt: skip
    once.setup()
    assert len(dm.train) > 1.45 * len(once.train)  # b's copy still weights its text


def test_split_windows_holds_out_text_of_the_distinct_sources_and_keeps_the_old_split_without_repeats():
    """Token values unique per text position, so shared values are shared text."""
    from pathlib import Path

    from loopq.commands.pretrain import split_windows

    a, b = Path("a"), Path("b")
    streams = {a: torch.arange(0, 60), b: torch.arange(100, 190)}
    val, train = split_windows(streams, [a, b, b], seq_len=4, bos=7, val_windows=5, seed=0)
    assert (val[:, 0] == 7).all() and (train[:, 0] == 7).all() and val.shape == (5, 5)
    assert not set(val[:, 1:].flatten().tolist()) & set(train[:, 1:].flatten().tolist())
    assert set(val[:, 1:].flatten().tolist()) <= set(range(60)) | set(range(100, 188))  # cut before b repeats
    windows = torch.cat([streams[a], streams[b]]).view(-1, 5)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))
    val, train = split_windows(streams, [a, b], seq_len=4, bos=None, val_windows=5, seed=0)
    assert torch.equal(val, windows[order[:5]]) and torch.equal(train, windows[order[5:]])  # as before the fix


def test_the_export_writes_tokenizer_and_record_atomically_the_record_last(data, tmp_path, monkeypatch):
    """A run stopped while exporting leaves no half-written tokenizer.json or training_record.json, and the record
    (what marks a teacher this command trained) comes after everything else (review finding: plain writes)."""
    import loopq.commands.pretrain as pretrain

    written: list[str] = []

    def recorded(path, write):
        written.append(path.name)
        atomic(path, write)

    atomic = pretrain.atomic_write
    monkeypatch.setattr(pretrain, "atomic_write", recorded)
    dm = PretrainDataModule(sources=["calibration/tinyshakespeare_input.txt"], vocab_size=300, seq_len=16, batch_size=4)
    module = TeacherPretrainer(vocab_size=300, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                               num_key_value_heads=1, total_ut_steps=2, out_dir=str(tmp_path / "teacher"))  # fmt: skip
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, datamodule=dm)
    assert written == ["tokenizer.json", "training_record.json"]
    record = json.loads((tmp_path / "teacher" / "training_record.json").read_text())
    assert record["steps"] == 1 and load_looplm(tmp_path / "teacher").arch == "ouro"


def tiny_run(tmp_path, steps=4, lr=2e-3, **trainer_args):
    """(trainer, module, datamodule) of a few-step tiny pretraining writing to ``tmp_path / 'teacher'``."""
    dm = PretrainDataModule(
        sources=["calibration/tinyshakespeare_input.txt"], vocab_size=300, seq_len=16, batch_size=4, val_windows=4
    )
    module = TeacherPretrainer(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        total_ut_steps=2, warmup_steps=1, lr=lr, out_dir=str(tmp_path / "teacher"),
    )  # fmt: skip
    args = dict(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False)
    args |= dict(enable_progress_bar=False, limit_val_batches=0, enable_model_summary=False) | trainer_args
    return L.Trainer(**args), module, dm


def test_a_diverged_run_stops_with_one_line_and_keeps_the_teacher_it_would_overwrite(data, tmp_path):
    import re

    from loopq.errors import UsageError

    trainer, module, dm = tiny_run(tmp_path, steps=6, lr=1e6)
    (tmp_path / "teacher").mkdir()
    good = tmp_path / "teacher" / "model.safetensors"
    good.write_bytes(b"a good teacher")
    with pytest.raises(UsageError, match=re.escape("training diverged: the loss is nan") + ".*model.lr"):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step < 6 and good.read_bytes() == b"a good teacher"
    assert sorted(p.name for p in (tmp_path / "teacher").iterdir()) == ["model.safetensors"]  # nothing exported


def test_non_finite_weights_are_never_exported(tmp_path):
    import re

    from loopq.commands.pretrain import check_finite_parameters
    from loopq.errors import UsageError

    module = TeacherPretrainer(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                               num_key_value_heads=1, total_ut_steps=2)  # fmt: skip
    check_finite_parameters(module)  # a fresh model passes
    with torch.no_grad():
        module.model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(UsageError, match=re.escape("1 parameter(s) are not finite (first: model.lm_head.weight)")):
        check_finite_parameters(module)


def tiny_cli_args(tmp_path, steps):
    """``loopq.pretrain`` options of a tiny run under ``tmp_path`` without a ModelCheckpoint (as tiny-ouro.yaml)."""
    return ["--data.sources", '["calibration/tinyshakespeare_input.txt"]', "--data.vocab_size", "300",
            "--data.seq_len", "16", "--data.batch_size", "4", "--data.val_windows", "4",
            "--model.hidden_size", "16", "--model.intermediate_size", "32", "--model.num_attention_heads", "2",
            "--model.num_key_value_heads", "1", "--model.total_ut_steps", "2", "--model.warmup_steps", "1",
            "--model.out_dir", str(tmp_path / "t"), "--trainer.max_steps", str(steps), "--trainer.accelerator", "cpu",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
            "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip


def test_a_stopped_run_without_model_checkpoint_resumes_at_its_step_with_ckpt_path_last(data, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from loopq.commands.pretrain import main
    from loopq.paths import REPO_ROOT

    marker, started = tmp_path / "at-step-2", tmp_path / "started"
    waiter = {"class_path": "tests.bad_inputs.signals.WaitForSignalAtStep",
              "init_args": {"step": 2, "marker": str(marker)}}  # fmt: skip
    cmd = [sys.executable, "-m", "loopq.pretrain", *tiny_cli_args(tmp_path, 50), "--trainer.callbacks",
           json.dumps([waiter])]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "resume with --ckpt_path last" in stderr, stderr[-3000:]
    recorder = {"class_path": "tests.bad_inputs.signals.RecordStartStep", "init_args": {"marker": str(started)}}
    main([*tiny_cli_args(tmp_path, 5), "--ckpt_path", "last", "--trainer.callbacks", json.dumps([recorder])])
    assert started.read_text() == "3"  # resumed where it stopped, not from step 0
    assert json.loads((tmp_path / "t" / "training_record.json").read_text())["steps"] == 5


def test_ckpt_path_last_with_nothing_saved_fails_instead_of_training_from_scratch(tmp_path):
    from loopq.commands.pretrain import main
    from loopq.errors import UsageError

    with pytest.raises(UsageError, match=r"--ckpt_path last: no last\*\.ckpt in .*leave --ckpt_path out"):
        main([*tiny_cli_args(tmp_path, 5), "--ckpt_path", "last"])
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("kind", ["url", "text"])
def test_ckpt_path_is_never_unpickled_from_a_url_or_read_from_a_non_checkpoint(tmp_path, kind):
    from loopq.commands.pretrain import main
    from loopq.errors import LoopQError

    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    path = "http://127.0.0.1:9/evil.ckpt" if kind == "url" else str(text)
    with pytest.raises(LoopQError, match=f"--ckpt_path {path}: " + ("only a local" if kind == "url" else "not a")):
        main([*tiny_cli_args(tmp_path, 5), "--ckpt_path", path])
    assert not (tmp_path / "t").exists()


class _Payload:
    """Unpickling it would create a file (``torch.save`` pickles the call)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_payload_checkpoint_is_refused_as_a_pretraining_one(tmp_path):
    """A ``--ckpt_path`` holding pickled objects is refused in one line that names what pretraining expects and
    which command writes it (the message once said "calibration checkpoint ... loopq.fit"), and never runs."""
    from loopq.commands.pretrain import main
    from loopq.errors import LoopQError

    marker, ckpt = tmp_path / "PAYLOAD-RAN", tmp_path / "planted.ckpt"
    torch.save({"state_dict": {}, "payload": _Payload(marker)}, ckpt)
    with pytest.raises(LoopQError, match=r"planted\.ckpt: not a LoopQ pretraining checkpoint .*loopq\.pretrain"):
        main([*tiny_cli_args(tmp_path, 5), "--ckpt_path", str(ckpt)])
    assert not marker.exists() and not (tmp_path / "t").exists()


def test_val_windows_must_leave_training_windows(data):
    import re

    from loopq.errors import UsageError

    with pytest.raises(UsageError, match=re.escape("data.val_windows=-1: must be >= 0")):
        PretrainDataModule(sources=["calibration/tinyshakespeare_input.txt"], val_windows=-1)
    dm = PretrainDataModule(
        sources=["calibration/tinyshakespeare_input.txt"], vocab_size=300, seq_len=16, val_windows=10**9
    )
    with pytest.raises(UsageError, match=re.escape("data.val_windows=1000000000: must be >= 0 and below the")):
        dm.setup()


def test_a_run_that_took_no_step_exports_nothing(data, tmp_path):
    from loopq.errors import UsageError

    trainer, module, dm = tiny_run(tmp_path, steps=4, limit_train_batches=0)
    with pytest.raises(UsageError, match="no training step ran"):
        trainer.fit(module, datamodule=dm)
    assert not (tmp_path / "teacher").exists()


def test_the_lr_schedule_spans_the_epochs_when_max_steps_is_not_set(data, tmp_path):
    class RecordLR(L.Callback):
        def __init__(self):
            self.lrs = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    record = RecordLR()
    trainer, module, dm = tiny_run(tmp_path, steps=-1, max_epochs=1, limit_train_batches=6, callbacks=[record])
    trainer.fit(module, datamodule=dm)
    # warm-up of 1 step, then cosine from 2e-3 to 2e-4 over the 6 steps of the epoch: 1 + cos(pi * s / 5) halves
    expected = [2e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 1) / 5))) for s in range(1, 6)]
    assert record.lrs == pytest.approx([2e-3, *expected])
    assert record.lrs[2] > 1e-3  # before: the floor (2e-4) from step 2 on


@pytest.mark.parametrize("teacher_there", [False, True])
def test_a_run_stopped_by_max_time_says_so_keeps_a_teacher_and_saves_a_checkpoint(data, tmp_path, teacher_there):
    import re
    import time

    from loopq.commands.pretrain import RunIncomplete

    class SlowStep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                time.sleep(1.2)

    out = tmp_path / "teacher"
    if teacher_there:
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"a good teacher")
    trainer, module, dm = tiny_run(
        tmp_path, steps=50, max_time={"seconds": 1}, callbacks=[SlowStep()], default_root_dir=str(tmp_path)
    )
    message = r"stopped by trainer\.max_time after step (\d+) of trainer\.max_steps 50: "
    message += "left the model in" if teacher_there else "wrote the partly trained model to"
    with pytest.raises(RunIncomplete, match=message + ".*resume with --ckpt_path last") as stop:
        trainer.fit(module, datamodule=dm)
    step = int(re.search(message, str(stop.value)).group(1))  # 2 unless the first steps took over a second
    assert 1 <= step <= 2 and trainer.global_step == step
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step
    if teacher_there:
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
        assert (out / "model.safetensors").read_bytes() == b"a good teacher"
    else:
        record = json.loads((out / "training_record.json").read_text())
        assert record["steps"] == step and record["max_steps"] == 50 and record["stop_reason"] == "trainer.max_time"


def test_pretrain_refuses_a_stress_output_and_with_overwrite_still_the_data_it_reads(data, tmp_path):
    from loopq.commands.pretrain import main
    from loopq.errors import GuardError

    stress = tmp_path / "t"
    stress.mkdir()
    (stress / "config.json").write_text("{}")
    record = {"command": "python -m loopq.stress --config configs/stress/small-ouro.yaml"}
    (stress / "training_record.json").write_text(json.dumps(record))
    with pytest.raises(GuardError, match=r"model\.out_dir .*holds a stress-trained teacher"):
        main(tiny_cli_args(tmp_path, 2))
    assert sorted(p.name for p in stress.iterdir()) == ["config.json", "training_record.json"]
    args = [*tiny_cli_args(tmp_path, 2), "--overwrite", "true", "--model.out_dir", str(data)]
    with pytest.raises(GuardError, match="which this command reads"):
        main(args)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--data.vocab_size", "100", "data.vocab_size=100: the BPE trained on the text"),
        ("--model.num_attention_heads", "3", "model.hidden_size=16 is not a multiple of model.num_attention_heads=3"),
        ("--model.hidden_size", "0", "model: hidden_size is 0, but it is a size or count and must be >= 1"),
        ("--data.seq_len", "0", "data.seq_len=0: must be >= 1"),
        ("--data.batch_size", "0", "data.batch_size=0: must be >= 1"),
    ],
)
def test_model_and_data_shapes_are_checked_before_training(data, tmp_path, option, value, message):
    """Each gave a traceback mid-training (an index error, a shape mismatch) or, for a zero width, trained and wrote
    a teacher the loader refuses; now one line before any step, and nothing is written."""
    from loopq.commands.pretrain import main
    from loopq.errors import LoopQError

    args = tiny_cli_args(tmp_path, 2)
    if option == "--model.num_attention_heads":
        args += ["--model.num_key_value_heads", "1"]
    with pytest.raises(LoopQError, match=re.escape(message)):
        main([*args, option, value])
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("batch", [7, 8])
def test_a_sigterm_inside_an_accumulation_window_waits_for_its_step_and_the_resume_sees_the_same_batches(
    data, tmp_path, capfd, batch
):
    """With ``accumulate_grad_batches`` 2 a SIGTERM that lands on either micro-batch of step 5 (batches 7 and 8,
    0-based) finishes that step's window before saving: the checkpoint is at a step boundary, so the resumed run
    accumulates the batches an uninterrupted run does, step for step, and ends on its weights. On the first
    micro-batch it used to save right after it (its gradient lost), and the resumed run, counting that batch as done,
    stepped after one micro-batch: every later step's batches shifted by one. Epochs of 5 batches (steps of 2, 2, 1);
    the signal lands in epoch 1."""
    from safetensors.torch import load_file

    from loopq.commands.pretrain import main

    def args(name, steps, *callbacks):
        record = {"class_path": "tests.bad_inputs.signals.RecordBatches",
                  "init_args": {"path": str(tmp_path / f"{name}.jsonl")}}  # fmt: skip
        trainer = ["--trainer.accumulate_grad_batches", "2", "--trainer.limit_train_batches", "5"]
        trainer += ["--trainer.callbacks", json.dumps([record, *callbacks])]
        return [*tiny_cli_args(tmp_path / name, steps), *trainer]

    def batches(name):
        return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]

    main(args("straight", 7))
    signal_at = {"class_path": "tests.bad_inputs.signals.SignalAtBatch", "init_args": {"batch": batch}}
    with pytest.raises(SystemExit) as stop:
        main(args("resumed", 7, signal_at))
    assert stop.value.code == 143 and "stopped by SIGTERM after step 5" in capfd.readouterr().err
    assert torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5
    main([*args("resumed", 7), "--ckpt_path", "last"])
    assert batches("resumed") == batches("straight")  # [step, batch] of every micro-batch: none lost or replayed
    straight, resumed = (load_file(tmp_path / name / "t" / "model.safetensors") for name in ("straight", "resumed"))
    for name, weight in straight.items():
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=0, msg=name)


def test_an_empty_sources_list_is_refused_before_anything_is_trained_or_written(data, tmp_path):
    """``--data.sources '[]'`` trained on the default sources (calibration prose, LAMBADA dev, WikiText-2 valid)
    without a word; now one line naming the key, nothing written."""
    from loopq.commands.pretrain import main
    from loopq.data.text import DataError

    with pytest.raises(DataError, match=re.escape("data.sources=[]: lists no text; list the files (or globs)")):
        main([*tiny_cli_args(tmp_path, 2), "--data.sources", "[]"])
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no teacher, no checkpoint, no logs
    with pytest.raises(DataError, match=re.escape("data.sources=[]")):
        PretrainDataModule(sources=[])


@pytest.mark.parametrize(
    ("option", "value", "differs"),
    [
        ("--model.hidden_size", "32", "model.hidden_size: 16 -> 32"),  # was a page of state-dict shape mismatches
        ("--model.total_ut_steps", "3", "model.total_ut_steps: 2 -> 3"),  # trained on silently (loop count)
        ("--data.sources", '["calibration/*.txt"]', "data.sources: "),  # silently: another text, another BPE
        ("--trainer.accumulate_grad_batches", "2", "trainer.accumulate_grad_batches: 1 -> 2"),  # another position
    ],
)
def test_a_resume_with_other_settings_is_refused_before_training_and_the_run_settings_may_change(
    data, tmp_path, option, value, differs
):
    """``--ckpt_path`` (a file, or ``last``) with another model shape, loop count, text or data position: one line
    naming the key, the checkpoint's value first, before any training; checkpoint and teacher untouched. The run
    length, logging and ``model.out_dir`` may change: that resume trains on."""
    from loopq.commands.pretrain import main
    from loopq.errors import UsageError

    ckpt = tmp_path / "ckpt" / "last.ckpt"
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(ckpt.parent), "save_last": True}}  # fmt: skip
    args = [*tiny_cli_args(tmp_path, 2), "--trainer.enable_checkpointing", "true"]
    args += ["--trainer.callbacks", json.dumps([checkpoint])]
    main(args)
    before = {path: path.read_bytes() for path in [ckpt, *(tmp_path / "t").iterdir()]}
    for resume in (str(ckpt), "last"):
        with pytest.raises(UsageError, match=rf"--ckpt_path .*: trained with other settings \(.*{re.escape(differs)}"):
            main([*args, "--trainer.max_steps", "4", "--ckpt_path", resume, option, value])
        assert {path: path.read_bytes() for path in before} == before
    main([*args, "--trainer.max_steps", "3", "--trainer.max_time", "00:00:10:00", "--trainer.log_every_n_steps", "1",
          "--model.out_dir", str(tmp_path / "t2"), "--ckpt_path", "last"])  # fmt: skip
    assert json.loads((tmp_path / "t2" / "training_record.json").read_text())["steps"] == 3
