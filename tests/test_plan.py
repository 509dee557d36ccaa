"""The memory plan (loopq.planning.memory, ``loopq.fit --print_plan``): its formulas against hand computations and the
ZeRO paper, its constants against what autograd keeps, and its prediction against the measured memory of real
calibration steps of the tiny teacher."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loopq.calib.losses import loopq_loss
from loopq.commands import fit
from loopq.models import load_looplm
from loopq.models.loading import read_config
from loopq.paths import REPO_ROOT
from loopq.planning import memory as plan
from loopq.planning.guards import activation_factor
from loopq.quant import QuantConfig, prepare
from tests.helpers import FIT_CONFIGS

TINY = REPO_ROOT / "loopq" / "assets" / "tiny-ouro"
PAPER_CONFIGS = ["ouro1.4b", "ouro2.6b", "parcae370m", "loopformer3x8"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
GIB = 2**30


class ParseOnly(fit.LoopQCLI):
    """The calibration CLI's parsing alone (nothing checked, nothing built)."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


def parsed(args: list[str]):
    return fit.build_cli(args, ParseOnly).config


# ---------------------------------------------------------------------------------------------------- the command
@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_print_plan_of_a_paper_config_runs_offline_in_seconds_without_the_teacher(name, tmp_path):
    start = time.monotonic()
    cmd = [sys.executable, "-m", "loopq.fit", "--config", f"configs/{name}.yaml", "--print_plan",
           "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - start < 60
    text = out.stdout
    assert "shapes: embedded" in text and "nothing loaded" in text
    for row in ("frozen teacher weights (bf16", "AdamW", "fake-quant weights", "activations", "PEAK per GPU:",
                "teacher-target cache on disk:", "trainable quantization parameters:"):  # fmt: skip
        assert row in text
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.parametrize(("doc", "count"), [("README.md", 2), ("docs/usage.md", 6)])
def test_documented_plan_tables_are_what_print_plan_predicts(doc, count):
    """Every row of the memory tables (README: the two one-GPU rows; docs/usage.md: every launch) - training step, SLT
    probe step, target cache - is the plan of its config and launch overrides, so the docs cannot drift from
    ``--print_plan``."""
    rows = [line for line in (REPO_ROOT / doc).read_text().splitlines() if line.startswith("| `")]
    rows = [r for r in rows if r.split("|")[1].strip().strip("`") in PAPER_CONFIGS]
    assert len(rows) == count
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        launch = ["--trainer.devices", "4", "--data.batch_size", "1"] if "... 4" in cells[1] else []
        _, predicted = plan.plan_from_config(parsed(["--config", f"configs/{cells[0].strip('`')}.yaml", *launch]))
        want = [plan.size(predicted.phases["training step"]), plan.size(predicted.phases["SLT probe step"]),
                plan.size(predicted.targets)]  # fmt: skip
        assert cells[3:6] == want, row


def test_print_plan_of_an_unknown_hub_teacher_asks_for_its_config(capsys):
    args = ["--config", "configs/tiny.yaml", "--model.teacher", "someone/unknown-looped-lm", "--print_plan"]
    with pytest.raises(plan.PlanError, match=r"model\.teacher someone/unknown-looped-lm: .* --plan_config"):
        fit.build_cli(args)
    with pytest.raises(SystemExit) as stop:
        fit.build_cli([*args, "--plan_config", str(TINY / "config.json")])
    assert stop.value.code == 0 and "hidden 128, 4 loops" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------- formulas
def test_embedded_shapes_give_the_paper_table_3_totals():
    """Paper Table 3 'Total Params' = model + its shared + loop-dependent quantization parameters (in millions)."""
    paper = {"Ouro-1.4B": (1476, 40.65, 0.6495), "Ouro-2.6B": (2750, 82.16, 0.2936),
             "loopformer-3x8": (282.19, 3.69, 0.328), "parcae-370m": (390.27, 1.70, 0.3048)}  # fmt: skip
    for name, (total, shared, loop) in paper.items():
        counts = plan.model_counts(plan.PUBLISHED[name], QuantConfig(slt_budget=0))
        assert counts.shape.parameters / 1e6 + shared + loop == pytest.approx(total, rel=1e-3), name


def test_ouro_counts_by_hand():
    counts = plan.model_counts(plan.PUBLISHED["Ouro-1.4B"], QuantConfig(slt_budget=4))
    attention, mlp, norms = 4 * 2048 * 2048, 3 * 2048 * 5632, 4 * 2048  # 16 heads x 128 = 2048
    embeddings, final_norm, exit_gate = 2 * 49152 * 2048, 2048, 2048 + 1  # untied embedding and head
    assert counts.shape.parameters == 24 * (attention + mlp + norms) + embeddings + final_norm + exit_gate
    assert counts.frozen == counts.frozen_looped == 24 * (attention + mlp)
    assert counts.frozen_promoted == 4 * 5632 * 2048 and counts.promoted_groups == 4  # the largest: down_proj
    assert counts.clip_inputs == 24 * 4 * (3 * 2048 + 5632)  # qkv, o, up_gate, down inputs, per loop slot
    assert counts.vocab == 49152 and counts.outside.group_inputs == 0


def test_probing_in_chunks_bounds_the_probe_step_by_hand():
    """Ouro-1.4B, 96 looped groups (4 per layer): a chunk of 24 consecutive groups is 6 layers' weights, on top of the
    SLT-promoted groups' own per-loop weights; the probe's gradients reach the probed groups' T per-loop weights."""
    counts = plan.model_counts(plan.PUBLISHED["Ouro-1.4B"], QuantConfig(slt_budget=4))
    per_layer = 4 * 2048 * 2048 + 3 * 2048 * 5632
    assert len(counts.probe_sizes) == 96 and sum(counts.probe_sizes) == 24 * per_layer
    assert plan.probe_elements(counts, 0) == plan.probe_elements(counts, 96) == counts.frozen_looped
    assert plan.probe_elements(counts, 24) == counts.frozen_promoted + 6 * per_layer
    settings = plan.RunSettings(batch=1, seq_len=256, samples=1, checkpoint_weights=True, probe_groups=24)
    probe = plan.training_pass(counts, 4, settings, probe=True)
    assert probe.grads == 4 * 4 * (counts.frozen_promoted + 6 * per_layer)
    assert probe.weights == 4 * (counts.frozen + 3 * (counts.frozen_promoted + 6 * per_layer))
    # the paper configs probe 24 groups per pass: the plan reads it from the configured callback
    assert plan.settings_from_config(parsed(["--config", "configs/ouro1.4b.yaml"])).probe_groups == 24


def test_plan_of_an_explicit_shape_is_the_plan_of_its_config():
    shaped = plan.plan_shape(2048, 24, 4, 5632, 16, 49152, batch=4, seq_len=256, head_dim=128, precision="bf16-mixed")
    assert shaped.settings.teacher_dtype == "bf16" and shaped.counts == plan.model_counts(
        plan.PUBLISHED["Ouro-1.4B"], QuantConfig()
    )


def test_optimizer_state_follows_the_zero_paper():
    """Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, mixed-precision Adam: 120 GB unsharded,
    2 + 2 + 12/64 bytes per parameter sharding the optimizer states, 2 + 14/64 with gradients, 16/64 with
    parameters. Our bf16-mixed DeepSpeed keeps fp32 parameters (no master copy): 4 + 12/N and 16/N."""
    q, n = 7_500_000_000, 64
    assert plan.optimizer_bytes(q, "single", 1, 4) == 16 * q
    assert plan.optimizer_bytes(q, "ddp", 4, 4) == 20 * q  # + DDP's fp32 gradient buckets
    assert plan.optimizer_bytes(q, "zero2", n, 2) == 2 * q + math.ceil(14 * q / n)  # 16.6 GB in the paper
    assert plan.optimizer_bytes(q, "zero3", n, 2) == math.ceil(16 * q / n)  # 1.9 GB in the paper
    assert plan.optimizer_bytes(q, "zero2", n, 4) == 4 * q + math.ceil(12 * q / n)
    assert plan.optimizer_bytes(q, "zero3", n, 4) == math.ceil(16 * q / n)


def test_frozen_weights_by_strategy():
    p, lin = 1000, 800  # parameters, of which frozen group weights (the student's buffers)
    assert plan.frozen_bytes(p, lin, 2, None, "ddp", 4) == 2 * p  # shared, not copied
    assert plan.frozen_bytes(p, lin, 2, None, "zero2", 4) == 2 * p  # bf16-mixed: DeepSpeed casts nothing
    assert plan.frozen_bytes(p, lin, 4, 2, "zero2", 4) == 2 * p + 4 * lin  # fp16 cast; buffers keep fp32
    assert plan.frozen_bytes(p, lin, 2, None, "zero3", 4) == 2 * p // 4 + 2 * lin  # buffers are never partitioned
    assert plan.frozen_bytes(p, lin, 4, 2, "single", 1) == 2 * p + 2 * lin  # bf16-true casts buffers separately


def test_targets_activations_and_loss_by_hand():
    # Ouro-1.4B's cache: 1024 samples x 256 tokens, top-1000 fp16 values + int32 ids (vocab > 32767), fp16 states
    assert plan.target_bytes(1024, 256, 1000, 49152, 2048, 4) == 1024 * 256 * (1000 * 6 + 4 * 2048 * 2)
    assert plan.target_bytes(4, 8, 1000, 2048, 128, 4) == 4 * 8 * (1000 * 4 + 4 * 128 * 2)  # int16 ids, k <= V
    assert plan.logit_bytes(4, 256, 49152, 2048, 4) == 4 * 256 * (5 * 49152 + 4 * 2048) * 4
    assert plan.batch_target_bytes(4, 256, 1000, 49152, 2048, 4) == 4 * 256 * (12 * 1000 + 16 * 2048)
    assert plan.clip_init_bytes(8 * 256, 10) == 8 * 256 * 10 * 4 and plan.clip_init_bytes(10**6, 10) == 4096 * 40
    counts = plan.model_counts(read_config(TINY), QuantConfig())
    factor = activation_factor(counts.shape)  # 132 (loopq.planning.guards)
    settings = plan.RunSettings(batch=4, seq_len=128, samples=16)
    assert plan.activation_parts(counts, 4, settings) == (4 * 128 * 128 * 4 * 4 * factor, 0)
    checkpointed = plan.RunSettings(batch=4, seq_len=128, samples=16, checkpoint_loops=True)
    assert plan.activation_parts(counts, 4, checkpointed) == (4 * 128 * 128 * 4 * 4, 4 * 128 * 128 * 4 * factor)


def test_settings_read_the_strategy_devices_and_precision_of_a_config():
    four = parsed(["--config", "configs/ouro2.6b.yaml", "--trainer.devices", "4", "--data.batch_size", "1"])
    settings = plan.settings_from_config(four)
    assert (settings.strategy, settings.processes, settings.batch) == ("zero2", 4, 1)
    assert (settings.precision, settings.teacher_dtype, settings.checkpoint_loops) == ("bf16-mixed", "bf16", True)
    assert plan.strategy_of("deepspeed_stage_3", 8) == "zero3" and plan.strategy_of("auto", 2) == "ddp"
    assert plan.strategy_of("ddp_find_unused_parameters_true", 1) == "ddp" and plan.strategy_of(None, 1) == "single"
    assert [plan.device_count(d) for d in (2, "4", "auto", -1, [0, 1, 2])] == [2, 4, 1, 1, 3]


def test_the_peak_is_the_largest_phase_and_checkpointing_overlaps_loss_and_recomputation():
    shaped = plan.plan_shape(128, 2, 4, 384, 4, 2048, batch=8, seq_len=128, samples=32, checkpoint_loops=True)
    step = shaped.step
    assert step.total == step.weights + step.grads + step.kept + max(step.recompute, step.logits) + step.targets
    assert shaped.peak == max(shaped.phases.values()) and shaped.probe.weights > step.weights  # per-loop weights


# ---------------------------------------------------------------------------------------------------- constants
@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_constants_match_what_autograd_keeps(precision):
    """Per token the saved tensors of a training step grow as the plan's activations + logits; what does not grow
    with the batch is the fake-quant weights (``WEIGHT_CHAIN_COPIES``). Tensors of the model itself are not counted."""
    autocast = precision == "bf16-mixed"
    teacher = load_looplm(TINY, dtype=torch.bfloat16 if autocast else torch.float32).requires_grad_(False)
    student = prepare(teacher, QuantConfig()).train()
    own = {t.untyped_storage().data_ptr() for t in [*student.parameters(), *student.buffers()]}
    seq, k = 64, 1000

    def saved(batch: int) -> int:
        storages: dict[int, int] = {}

        def keep(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in own:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, 2048, (batch, seq))
        values, ids_k = torch.randn(batch, seq, k), torch.randint(0, 2048, (batch, seq, k))
        states = [torch.randn(batch, seq, 128) for _ in range(4)]
        cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
        with cast, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = student(ids, return_trajectory=True)
            loopq_loss(out.logits, out.loop_states, out.transition_states, values, ids_k, states, torch.zeros(4))
        return sum(storages.values())

    one, three = saved(1), saved(3)
    per_token, constant = (three - one) / (2 * seq), one - (three - one) / 2
    settings = plan.RunSettings(batch=1, seq_len=1, samples=1, precision=plan.normalise_precision(precision))
    counts = plan.model_counts(read_config(TINY), QuantConfig(slt_budget=0))
    kept, _ = plan.activation_parts(counts, 4, settings)
    logits_saved = 2 * 2048 * 4 + 8 * k  # the fp32 log-softmax and its input, and the int64 top-k ids gathered
    assert per_token == pytest.approx(kept + logits_saved, rel=0.1)  # measured: 0.2 % (fp32), 0.1 % (bf16)
    assert constant == pytest.approx(plan.weight_chain_bytes(counts.frozen, settings.numerics()), rel=0.1)  # 1 %


# ---------------------------------------------------------------------------------------------------- measured
#: measured / predicted peak of real runs of the tiny teacher (tests/peak_memory.py), by precision. Measured across
#: batch 4-8 x seq 128-256, SLT on and off, checkpoint_loops on and off: 1.007-1.017 in fp32, 1.06-1.15 in
#: bf16-mixed (the bf16 runs keep ~20 MB more than the plan whatever the batch: CPU kernel caches of the bf16 path);
#: five repeats of one run agree to 0.1 %. On another machine of the same kind (session 12, the same code as the
#: run that landed) the same command measured 0.988 in fp32 and 0.956 in bf16-mixed: machines differ by ~0.1 in
#: the bf16 ratio (its kernel caches). Tolerance: the observed range 0.956-1.15 widened by ~8 % on each side.
TOLERANCE = {"32": (0.92, 1.10), "bf16-mixed": (0.88, 1.25)}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
@pytest.mark.parametrize("precision", sorted(TOLERANCE))
def test_plan_predicts_the_measured_peak_memory_of_real_calibration_steps(tmp_path, precision):
    args = [*FIT_CONFIGS, "--data.num_samples", "32", "--data.seq_len", "128", "--data.batch_size", "8",
            "--trainer.max_steps", "3", "--trainer.precision", precision]  # fmt: skip
    env = {**ENV, "MALLOC_MMAP_THRESHOLD_": "131072"}
    cmd = [sys.executable, "-m", "tests.peak_memory", *args, "--trainer.default_root_dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    _, predicted = plan.plan_from_config(parsed(args))  # what --print_plan prints for this command line
    ratio = (measured["peak"] - measured["baseline"]) / predicted.peak
    low, high = TOLERANCE[precision]
    assert low <= ratio <= high, f"measured / predicted = {ratio:.3f}"


def test_recomputed_weight_chains_keep_the_quantized_weights_and_one_chain_by_hand():
    from loopq.planning.memory import WEIGHT_CHAIN_COPIES, chain_recompute_bytes, weight_chain_bytes

    c_w = WEIGHT_CHAIN_COPIES["fp32", False]
    assert weight_chain_bytes(1000, ("fp32", False)) == math.ceil(1000 * 4 * c_w)
    assert weight_chain_bytes(1000, ("fp32", False), recomputed=True) == 1000 * 4
    assert chain_recompute_bytes(100, ("fp32", False)) == math.ceil(100 * 4 * c_w)


def test_weight_gradients_and_bf16_casts_of_a_checkpointed_bf16_step_by_hand():
    """Ouro-1.4B's counts: every quantized weight's fp32 gradient (summed over the loops) is alive at once, and a
    bf16 step saves one loop's bf16 weight casts while that loop is recomputed; the chain rebuild, the recomputed
    loop and the loss are transients that do not overlap."""
    quant = QuantConfig(slt_budget=4)
    shaped = plan.plan_shape(2048, 24, 4, 5632, 16, 49152, batch=1, seq_len=256, samples=1, checkpoint_loops=True,
                             quant=quant, checkpoint_weights=True, teacher_dtype="bf16")  # fmt: skip
    step, counts = shaped.step, shaped.counts
    elements = counts.frozen + 3 * counts.frozen_promoted
    assert step.grads == elements * 4 and step.weights == elements * 4  # the outside groups: none in Ouro
    _, recompute = plan.activation_parts(counts, 4, shaped.settings)
    assert step.recompute == recompute + 2 * counts.frozen_looped
    assert step.total == step.weights + step.grads + step.kept + max(step.recompute, step.logits, step.chain) + (
        step.targets
    )
    fp32 = plan.plan_shape(2048, 24, 4, 5632, 16, 49152, batch=1, seq_len=256, samples=1, checkpoint_loops=True,
                           quant=quant, checkpoint_weights=True)  # fmt: skip
    assert fp32.step.recompute == plan.activation_parts(counts, 4, fp32.settings)[1]  # fp32: no casts
