"""``loopq.pretrain`` for LoopFormer and Parcae: the multi-exit objective reads each loop out through the model's own
head, the sampled depths follow their distribution, a few steps lower the loss of every exit, and the export is the
architecture's native directory computing the trained function."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from loopq.commands.pretrain import PretrainDataModule, pretrainer_class, requested_architecture
from loopq.commands.pretrain_looped import (
    LoopFormerPretrainer,
    ParcaePretrainer,
    exit_loss,
    exit_token_losses,
    exit_weights,
    truncated_poisson,
)
from loopq.errors import UsageError
from loopq.models import load_looplm

LOOPFORMER = {
    "block_size": 64,
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "intermediate_dim": 64,
    "loopq_default_loops": 3,
}
PARCAE = {
    "block_size": 64, "n_embd": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
    "padding_multiple": 64, "norm_class_name": "RMSNorm", "nonlin_name": "ReLU2", "init_strategy": "scaled-zero",
    "qk_norm": True, "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 1, "n_layers_in_coda": 1,
    "recurrent_embedding_dimension": 32, "recurrent_intermediation_embedding_dimension": 64, "prelude_norm": True,
    "mean_recurrence": 3, "mean_backprop_depth": 1, "tie_embeddings": True,
}  # fmt: skip


def build(kind: str, out_dir: str, **extra):
    if kind == "loopformer":
        return LoopFormerPretrainer(
            config=LOOPFORMER, vocab_size=320, lr=1e-2, warmup_steps=2, out_dir=out_dir, **extra
        )
    return ParcaePretrainer(config=PARCAE, vocab_size=320, lr=1e-2, warmup_steps=2, out_dir=out_dir, **extra)


@pytest.mark.parametrize("kind", ["loopformer", "parcae"])
def test_the_last_exit_is_the_models_own_forward(kind, tmp_path):
    model = build(kind, str(tmp_path)).model.eval()
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        losses = exit_token_losses(model, ids, 3)
        for loops in (1, 3):  # the exit after loop t is what a t-loop forward returns
            logits = model(ids[:, :-1], num_loops=loops).logits
            want = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(2, 16)
            torch.testing.assert_close(losses[loops - 1], want)


def test_truncated_poisson_draws_follow_the_renormalised_pmf():
    gen = torch.Generator().manual_seed(1)
    draws = torch.tensor([truncated_poisson(4.0, 1, 8, gen) for _ in range(4000)])
    assert draws.min() >= 1 and draws.max() <= 8
    pmf = [math.exp(-4) * 4**k / math.factorial(k) for k in range(1, 9)]
    for k, p in zip(range(1, 9), pmf, strict=True):
        assert abs((draws == k).float().mean().item() - p / sum(pmf)) < 0.025, k


def test_exit_weights_renormalise_the_loops_a_step_ran():
    torch.testing.assert_close(exit_weights(torch.tensor([1.0, 4.0, 9.0, 16.0]), 2), torch.tensor([0.2, 0.8]))
    with pytest.raises(ValueError, match="5 loops but only 4 loop weights"):
        exit_weights(torch.ones(4), 5)


def test_loop_weights_that_leave_a_drawable_depth_without_loss_are_refused(tmp_path):
    """A step normalises its exits' weights over the loops it ran; weights that are 0 over the fewest loops a step
    can run (LoopFormer: the smallest budget; Parcae: depth 1) gave 0 / 0, a NaN loss and NaN gradients (a review
    reproduced it for Parcae with [0, 0, 1, 1, 1, 1])."""
    with pytest.raises(UsageError, match=r"all 0 over the first 1 loop\(s\), the fewest a training step can run"):
        build("parcae", str(tmp_path), max_depth=6, loop_weights=[0, 0, 1, 1, 1, 1])
    with pytest.raises(UsageError, match=r"all 0 over the first 2 loop\(s\)"):
        build("loopformer", str(tmp_path), budgets=[2, 3], loop_weights=[0, 0, 1])
    ok = build("loopformer", str(tmp_path), budgets=[3], loop_weights=[0, 0, 1])  # last exit only, one budget
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = (exit_weights(ok.loop_weights, 3) * exit_token_losses(ok.model, ids, 3).mean(dim=(1, 2))).sum()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("kind", ["loopformer", "parcae"])
def test_exits_last_trains_only_the_steps_final_read_out(kind, tmp_path):
    """``model.exits: last`` (upstream's objective): the loss and its gradient are those of the full-depth forward's
    own CE; the earlier exits contribute nothing (``all`` weighs them in: hand-computed)."""
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    per_loop = torch.tensor([3.0, 2.0, 1.5])
    assert exit_loss(per_loop, torch.tensor([1.0, 4.0, 9.0]), "last").item() == 1.5
    assert exit_loss(per_loop, torch.tensor([1.0, 4.0, 9.0]), "all").item() == pytest.approx((3 + 8 + 13.5) / 14)
    last, ref = build(kind, str(tmp_path), exits="last"), build(kind, str(tmp_path))
    ref.model.load_state_dict(last.model.state_dict())
    loss, per_loop = last._objective([ids], "val")  # validation runs the default depth, 3 loops
    logits = ref.model(ids[:, :-1], num_loops=3).logits
    want = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, want)
    loss.backward(), want.backward()
    for (name, p), q in zip(last.model.named_parameters(), ref.model.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    with pytest.raises(UsageError, match=r"model.exits='first': use one of \('all', 'last'\)"):
        build(kind, str(tmp_path), exits="first")
    with pytest.raises(UsageError, match=r"model\.loop_weights weighs the exits of model\.exits=all"):
        build(kind, str(tmp_path), exits="last", loop_weights=[1.0, 1.0, 1.0])


def test_the_architecture_comes_from_the_config_or_the_command_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("architecture: parcae\n")
    assert requested_architecture([]) == "ouro"
    assert requested_architecture(["--config", str(config)]) == "parcae"
    assert requested_architecture(["--config", str(config), "--architecture=loopformer"]) == "loopformer"
    assert pretrainer_class(["--architecture", "parcae"]) is ParcaePretrainer
    with pytest.raises(UsageError, match=r"architecture='gpt': use one of \['loopformer', 'ouro', 'parcae'\]"):
        requested_architecture(["--architecture", "gpt"])


@pytest.mark.parametrize(("kind", "extra"), [("loopformer", {"budgets": [2, 3]}), ("parcae", {"max_depth": 5})])
def test_short_pretraining_lowers_every_exit_and_exports_natively(kind, extra, data, tmp_path):
    dm = PretrainDataModule(
        sources=["calibration/tinyshakespeare_input.txt"], vocab_size=320, seq_len=32, batch_size=16, val_windows=16
    )
    dm.setup()
    module = build(kind, str(tmp_path / "teacher"), **extra)

    def val_losses():
        with torch.no_grad():
            return exit_token_losses(module.model.eval(), dm.val, 3).mean(dim=(1, 2))

    before = val_losses()
    trainer = L.Trainer(
        max_steps=30, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        limit_val_batches=0, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    after = val_losses()
    assert (after < before - 0.5).all(), (before, after)
    exported = load_looplm(tmp_path / "teacher")
    assert exported.arch == kind and exported.default_num_loops == 3
    with torch.no_grad():
        torch.testing.assert_close(exported(dm.val[:2, :-1]).logits, module.model(dm.val[:2, :-1]).logits)
