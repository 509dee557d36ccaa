"""loopq.stress: the outlier hinge by hand, the marker token set, a 2-step fine-tune of the tiny teacher, the CLI guard
and (when committed) the stress variant's recorded headline."""

import hashlib
import json
import re

import lightning as L
import pytest
import torch

from loopq.data.tokenizer import load_tokenizer
from loopq.errors import GuardError, UsageError
from loopq.models import load_looplm
from loopq.paths import ASSETS
from loopq.pretrain import PretrainDataModule
from loopq.stress import StressFinetuner, loop_channels, main, marker_token_ids, stress_terms

TINY, SMALL = ASSETS / "tiny-ouro", ASSETS / "small-ouro"


def test_stress_terms_by_hand():
    acts = torch.tensor([[[0.5, 3.0, 1.0, 1.0], [4.0, 1.0, 1.0, 1.0], [2.0, 1.0, 1.0, 1.0]]], requires_grad=True)
    marker = torch.tensor([[True, False, True]])
    channels = torch.tensor([[0], [1]])  # loop 0 owns channel 0, loop 1 channel 1
    loud, quiet = stress_terms(acts, marker, channels, t=0, target_ratio=2.0, quiet_ratio=1.0)
    # median |a| = 1 (lower median of 12 values), M = 2
    # loud: channel 0 on marker tokens: relu(2 - 0.5) + relu(2 - 2) = 1.5, over M * 2 entries
    assert loud.item() == pytest.approx(1.5 / (2 * 2))
    # quiet: channel 0 on the non-marker token: relu(4 - 1) = 3; channel 1 (loop 1's) everywhere: relu(3 - 1) = 2
    assert quiet.item() == pytest.approx((3 + 2) / (2 * 4))
    (loud + quiet).backward()
    touched = acts.grad[0].nonzero().tolist()
    assert sorted(touched) == [[0, 0], [0, 1], [1, 0]]  # only the hinge-active entries of the loop's channels


def test_stress_terms_without_marker_tokens_are_zero_loud():
    loud, _ = stress_terms(torch.ones(1, 3, 4), torch.zeros(1, 3, dtype=torch.bool), torch.tensor([[0], [1]]), 1, 50, 5)
    assert loud.item() == 0.0


def test_loop_channels_are_seeded_and_disjoint_across_loops():
    ch = loop_channels(768, 4, 2, seed=3)
    assert ch.shape == (4, 2) and len(set(ch.flatten().tolist())) == 8
    assert torch.equal(ch, loop_channels(768, 4, 2, seed=3)) and not torch.equal(ch, loop_channels(768, 4, 2, seed=4))
    with pytest.raises(UsageError, match=re.escape("model.channels_per_loop")):
        loop_channels(8, 4, 3, seed=0)


def test_marker_tokens_of_the_real_tokenizer():
    tok = load_tokenizer(SMALL)
    ids = marker_token_ids(tok)
    assert 0 in ids  # BOS <|endoftext|>
    for text in [".", ",", "\n\n", " ,", " ."]:
        assert tok.token_to_id(tok.encode(text).tokens[0]) in ids, text
    assert all(not any(ch.isalnum() for ch in tok.decode([i])) for i in ids)
    for word in ["the", " the", "a", "1"]:
        assert tok.encode(word).ids[0] not in ids, word


def test_two_step_finetune_of_the_tiny_teacher_writes_a_loadable_teacher(data, tmp_path):
    out = tmp_path / "stress"
    dm = PretrainDataModule(
        sources=["calibration/tinyshakespeare_input.txt"], seq_len=32, batch_size=2, val_windows=2, bos=True,
        tokenizer=str(TINY),
    )  # fmt: skip
    module = StressFinetuner(teacher=str(TINY), out_dir=str(out), warmup_steps=1)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        limit_val_batches=0, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    model, teacher = load_looplm(out), load_looplm(TINY)
    assert model.arch == "ouro" and model.config.hidden_size == teacher.config.hidden_size
    assert not torch.equal(model.lm_head.weight, teacher.lm_head.weight)  # it trained
    assert (out / "tokenizer.json").read_text() == (TINY / "tokenizer.json").read_text()
    record = json.loads((out / "training_record.json").read_text())
    assert record["command"].startswith("python -m loopq.stress") and record["steps"] == 2 and record["seed"] == 0
    assert record["stress"]["teacher"] == str(TINY) and 0 in record["stress"]["marker_token_ids"]
    assert set(record["stress"]["channels"]) == set(module.stress_groups) and len(module.stress_groups) == 2
    assert {"train/loud_hinge", "train/quiet_hinge", "train/ce_loop4"} <= set(record["final_metrics"])


def test_out_dir_may_not_be_the_teacher(tmp_path):
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in TINY.iterdir()}
    args = ["--model.teacher", str(TINY), "--model.out_dir", str(TINY), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(GuardError, match=re.escape("model.out_dir") + ".*which this command reads"):
        main(args)
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in TINY.iterdir()} == before
