"""loopq.stress: the outlier hinge by hand, the marker token set, the quantization-noise forward against the project's
own RTN student, a 2-step fine-tune of the tiny teacher with each objective, the CLI guard."""

import hashlib
import json
import re

import lightning as L
import pytest
import torch
from safetensors import safe_open

from loopq.commands.pretrain import PretrainDataModule
from loopq.commands.stress import (
    StressFinetuner,
    loop_channels,
    main,
    marker_token_ids,
    quant_noise,
    sensitivity_hinge,
    stress_terms,
)
from loopq.data.tokenizer import load_tokenizer
from loopq.errors import GuardError, UsageError
from loopq.models import load_looplm
from loopq.models.base import LinearGroup
from loopq.paths import ASSETS
from loopq.quant.config import QuantConfig
from loopq.quant.hadamard import randomized_hadamard
from loopq.quant.prepare import prepare
from loopq.quant.primitives import fake_quant

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


def test_quant_noise_is_rtn_in_value_and_the_quantized_point_gradient():
    torch.manual_seed(0)
    group = LinearGroup(a=torch.nn.Linear(64, 8), b=torch.nn.Linear(64, 4, bias=False))
    x = (torch.randn(3, 64) * torch.linspace(0.1, 5, 64)).requires_grad_(True)
    plain = group(x)
    with quant_noise(group, [""], bits=4, group_size=32):
        noisy = group(x)
    xq = fake_quant(x.detach(), 4, 32)
    for y, y_plain, lin in zip(noisy, plain, group.children(), strict=True):
        wq = fake_quant(lin.weight.detach(), 4, 32)
        torch.testing.assert_close(y, torch.nn.functional.linear(xq, wq, lin.bias), rtol=1e-5, atol=1e-5)
        assert (y - y_plain).abs().max() > 1e-3  # it did perturb
    g = [torch.randn_like(y) for y in noisy]
    sum((y * gi).sum() for y, gi in zip(noisy, g, strict=True)).backward()
    lins = list(group.children())
    torch.testing.assert_close(lins[0].weight.grad, g[0].T @ xq, rtol=1e-5, atol=1e-5)  # dL/dW at Q(x)
    expected_dx = sum(gi @ fake_quant(lin.weight.detach(), 4, 32) for gi, lin in zip(g, lins, strict=True))
    torch.testing.assert_close(x.grad, expected_dx, rtol=1e-5, atol=1e-5)  # dL/dx through Q(W)
    assert not group._forward_hooks and not group._forward_pre_hooks  # removed on exit


def test_quant_noise_in_a_rotated_basis_is_quarots_product():
    torch.manual_seed(1)
    group = LinearGroup(a=torch.nn.Linear(64, 8, bias=False))
    x = torch.randn(3, 64) * torch.linspace(0.1, 5, 64)
    r = randomized_hadamard(64, torch.Generator().manual_seed(0))
    with quant_noise(group, [""], bits=4, group_size=32, rotations={64: r}):
        (y,) = group(x)
    w = group.a.weight.detach()
    want = fake_quant(x @ r, 4, 32) @ fake_quant(w @ r, 4, 32).T  # QuaRot: quantize x R and W R
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    with quant_noise(group, [""], bits=4, group_size=32, rotations={128: r}):  # no rotation of this width
        (plain,) = group(x)
    torch.testing.assert_close(plain, fake_quant(x, 4, 32) @ fake_quant(w, 4, 32).T, rtol=1e-4, atol=1e-4)
    assert (y - plain).abs().max() > 1e-3


def test_quant_noise_forward_is_the_rtn_student_of_the_tiny_teacher():
    """The fine-tune's quantized pass is exactly loopq's own RTN W4A4 g32 student (an independent code path:
    prepare() builds fake-quant groups), so its dCE is the perplexity gap the testbed measures."""
    teacher = load_looplm(TINY).eval()
    ids = torch.randint(1, teacher.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    student = prepare(teacher, QuantConfig.rtn(4, 4, 32)).eval()
    with torch.no_grad():
        want = student(ids, return_trajectory=True).loop_states
        with quant_noise(teacher, list(teacher.linear_groups()), bits=4, group_size=32):
            got = teacher(ids, return_trajectory=True).loop_states
        clean = teacher(ids, return_trajectory=True).loop_states
    for a, b, c in zip(got, want, clean, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert (a - c).abs().max() > 1e-2


def test_sensitivity_hinge_by_hand():
    noisy, clean = torch.tensor([3.0, 2.5]), torch.tensor([2.9, 2.45], requires_grad=True)
    hinge, gap = sensitivity_hinge(noisy, clean, torch.tensor([0.2, 0.8]), margin=0.2)
    assert gap.item() == pytest.approx(0.2 * 0.1 + 0.8 * 0.05)  # 0.06 nats
    assert hinge.item() == pytest.approx((0.2 - 0.06) / 0.2)
    assert sensitivity_hinge(noisy + 1, clean, torch.tensor([0.5, 0.5]), 0.2)[0].item() == 0.0  # past the margin
    hinge.backward()  # both sides are pushed apart: the clean CE down by 1/margin per weight, never up
    torch.testing.assert_close(clean.grad, torch.tensor([0.2, 0.8]) / 0.2)
    with pytest.raises(UsageError, match=re.escape("model.noise_margin")):
        sensitivity_hinge(noisy, clean, torch.tensor([0.5, 0.5]), 0.0)


def test_bad_stress_options_fail_before_training():
    with pytest.raises(UsageError, match=re.escape("model.save_dtype='fp8'")):
        StressFinetuner(teacher=str(TINY), save_dtype="fp8")
    with pytest.raises(UsageError, match=re.escape("model.noise_rotate=1.5")):
        StressFinetuner(teacher=str(TINY), noise_rotate=1.5)


@pytest.mark.parametrize(
    "option",
    [
        {"noise_bits": 1},
        {"noise_group_size": 0},
        {"target_ratio": 0.0},
        {"target_ratio": float("nan")},
        {"quiet_ratio": -1.0},
        {"channels_per_loop": 0},
    ],
)
def test_stress_options_that_make_the_objective_non_finite_fail_before_training(option):
    ((key, value),) = option.items()
    with pytest.raises(UsageError, match=re.escape(f"model.{key}={value}: must be")):
        StressFinetuner(teacher=str(TINY), **option)


@pytest.mark.parametrize("objective", ["outliers", "sensitivity"])
def test_two_step_finetune_of_the_tiny_teacher_writes_a_loadable_teacher(data, tmp_path, objective):
    out = tmp_path / "stress"
    dm = PretrainDataModule(
        sources=["calibration/tinyshakespeare_input.txt"], seq_len=32, batch_size=2, val_windows=2, bos=True,
        tokenizer=str(TINY),
    )  # fmt: skip
    weights = (
        {"aux_weight": 1.0}
        if objective == "outliers"
        else {"aux_weight": 0.0, "noise_weight": 1.0, "save_dtype": "bfloat16", "noise_rotate": 0.5}
    )
    module = StressFinetuner(teacher=str(TINY), out_dir=str(out), warmup_steps=1, **weights)
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
    logged = {"outliers": {"train/loud_hinge", "train/quiet_hinge"}, "sensitivity": {"train/rtn_gap_nats"}}
    assert logged[objective] | {"train/ce_loop4"} <= set(record["final_metrics"])
    saved = safe_open(str(out / "model.safetensors"), "pt")
    dtypes = {saved.get_tensor(k).dtype for k in saved.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert dtypes == ({torch.float32} if objective == "outliers" else {torch.bfloat16})
    assert record["saved_dtype"] == ("float32" if objective == "outliers" else "bfloat16")
    assert model.lm_head.weight.dtype == torch.float32  # read back as fp32 either way
    other = {"outliers": "sensitivity", "sensitivity": "outliers"}[objective]
    assert not logged[other] & set(record["final_metrics"])  # the switched-off term is not computed


def test_out_dir_may_not_be_the_teacher(tmp_path):
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in TINY.iterdir()}
    args = ["--model.teacher", str(TINY), "--model.out_dir", str(TINY), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(GuardError, match=re.escape("model.out_dir") + ".*which this command reads"):
        main(args)
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in TINY.iterdir()} == before


def test_stress_replaces_only_its_own_output_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "training_record.json").write_text(json.dumps({"command": "python -m loopq.pretrain --config x.yaml"}))
    args = ["--model.teacher", str(TINY), "--model.out_dir", str(out), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(GuardError, match=r"model\.out_dir .*holds a pretrained teacher"):
        main(args)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "training_record.json"]
