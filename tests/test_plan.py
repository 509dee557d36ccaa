"""The memory plan (loopq.planning.memory, ``loopq.fit --print_plan``): its formulas against hand computations and the
ZeRO paper, its constants against what autograd keeps, and its prediction against the measured memory of real
calibration steps of the tiny teacher."""

import json
import math
import os
import resource
import subprocess
import sys
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


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def parsed(args: list[str]):
    return fit.build_cli(args, ParseOnly).config


# ---------------------------------------------------------------------------------------------------- the command
@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_print_plan_of_a_paper_config_runs_offline_in_seconds_without_the_teacher(name, tmp_path):
    start = children_cpu_seconds()  # CPU time, not wall: a loaded machine (xdist, other jobs) stretches the wall
    cmd = [sys.executable, "-m", "loopq.fit", "--config", f"configs/{name}.yaml", "--print_plan",
           "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert children_cpu_seconds() - start < 60  # imports ~10 s; building a 1.4B teacher alone would take longer
    text = out.stdout
    assert "shapes: embedded" in text and "nothing loaded" in text
    for row in ("frozen teacher weights (bf16", "AdamW", "fake-quant weights", "activations", "PEAK per GPU:",
                "teacher-target cache on disk:", "trainable quantization parameters:"):  # fmt: skip
        assert row in text
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.parametrize(("doc", "heading", "count"), [
    ("docs/benchmarks.md", "### Memory plan of the paper configs", 6),
    ("README.md", "## Quantize your looped model", 2),
])  # fmt: skip
def test_documented_plan_tables_are_what_print_plan_predicts(doc, heading, count):
    """Every row of the memory tables (docs/benchmarks.md: every launch; README: the two one-GPU Ouro rows) -
    training step, setup, target cache, trainable parameters - is the plan of its config and launch overrides, so
    the docs cannot drift from ``--print_plan``."""
    text = (REPO_ROOT / doc).read_text()
    table = text[text.index(heading) :]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    rows = [r for r in rows if r.split("|")[1].strip().strip("`") in PAPER_CONFIGS][:count]
    assert len(rows) == count
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        launch = ["--trainer.devices", "4", "--data.batch_size", "1"] if "... 4" in cells[1] else []
        _, predicted = plan.plan_from_config(parsed(["--config", f"configs/{cells[0].strip('`')}.yaml", *launch]))
        want = [plan.size(predicted.phases["training step"]), plan.size(predicted.phases["setup"]),
                plan.size(predicted.targets), f"{predicted.counts.trainable / 1e6:.2f} M"]  # fmt: skip
        assert cells[3:7] == want, row


def test_print_plan_of_an_unknown_hub_teacher_asks_for_its_config(capsys):
    args = ["--config", "configs/tiny.yaml", "--model.teacher", "someone/unknown-looped-lm", "--print_plan"]
    with pytest.raises(plan.PlanError, match=r"model\.teacher someone/unknown-looped-lm: .* --plan_config"):
        fit.build_cli(args)
    with pytest.raises(SystemExit) as stop:
        fit.build_cli([*args, "--plan_config", str(TINY / "config.json")])
    assert stop.value.code == 0 and "hidden 128, 4 loops" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------- formulas
def test_embedded_shapes_give_the_paper_table_3_totals():
    """Paper Table 5 'Total Params' = model + its shared + loop-dependent quantization parameters (in millions)."""
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
    assert counts.largest_input == 5632 and counts.layers == 24  # down_proj's input
    assert counts.vocab == 49152 and counts.outside.group_inputs == 0


def test_memory_grows_with_the_loops_only_by_the_per_boundary_states():
    """Ouro-2.6B with ``checkpoint_loops``, T = 4 -> 8 loops: only the layer and loop inputs (B S D (n + 1) 4 per
    loop), the promoted groups' per-loop quantized weights, the loss's trajectory terms and the batch's target states
    grow; there is no SLT phase (its scores come from the training step's backward)."""
    plans = {}
    for t in (4, 8):
        counts = plan.model_counts(plan.PUBLISHED["Ouro-2.6B"], QuantConfig(num_loops=t, slt_budget=8))
        settings = plan.RunSettings(batch=4, seq_len=256, samples=1024, loops=t, precision="bf16-mixed",
                                    teacher_dtype="bf16", checkpoint_loops=True)  # fmt: skip
        plans[t] = plan.plan_memory(counts, settings)
    assert set(plans[4].phases) == {"setup", "training step"}
    a, b = plans[4].step, plans[8].step
    states = 4 * 256 * 2048 * 4  # B S D fp32, per loop
    assert b.kept - a.kept == math.ceil(4 * states * 49 * plan.ACTIVATION_FRACTION["autocast", False])
    assert b.weights - a.weights == 4 * plans[4].counts.frozen_promoted * 2  # bf16 per-loop weights of 8 groups
    assert (b.recompute, b.use) == (a.recompute, a.use)
    assert b.logits - a.logits == states * 4 and b.targets - a.targets == 4 * states
    assert a.recompute + a.use > a.logits and b.recompute + b.use > b.logits  # the loss is not the largest transient
    grown = plans[8].phases["training step"] - plans[4].phases["training step"]
    per_loop_params = plans[8].quant_state - plans[4].quant_state  # LAS clips, SLT slots, CTA: per loop by definition
    assert grown == (b.kept - a.kept) + (b.weights - a.weights) + (b.targets - a.targets) + per_loop_params


def test_plan_of_an_explicit_shape_is_the_plan_of_its_config():
    shaped = plan.plan_shape(2048, 24, 4, 5632, 16, 49152, batch=4, seq_len=256, head_dim=128, precision="bf16-mixed")
    assert shaped.settings.teacher_dtype == "bf16" and shaped.counts == plan.model_counts(
        plan.PUBLISHED["Ouro-1.4B"], QuantConfig()
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto means the CPU only without CUDA")
def test_accelerator_auto_on_a_machine_without_cuda_is_planned_as_the_cpu_run_it_is():
    """Lightning's default ``auto`` runs on the CPU here; the plan printed a GPU plan for it (without the targets a
    CPU run holds in memory), half the CPU peak (review finding)."""
    cpu = plan.plan_from_config(parsed([*FIT_CONFIGS, "--trainer.accelerator", "cpu"]))[1]
    auto = plan.plan_from_config(parsed([*FIT_CONFIGS, "--trainer.accelerator", "auto"]))[1]
    assert auto.settings.on_cpu and auto.peak == cpu.peak and auto.peak_phase == cpu.peak_phase


def test_the_plan_follows_init_clipping_and_names_an_objective_it_does_not_model():
    """The setup's clip initialisation is not planned when it does not run; a layer-wise plan says what it assumes
    (it printed the trajectory objective's terms without a word)."""
    on = plan.plan_from_config(parsed(list(FIT_CONFIGS)))[1]
    off = plan.plan_from_config(parsed([*FIT_CONFIGS, "--model.init_clipping", "false"]))[1]
    assert on.clip_init > 0 and off.clip_init == 0
    targets = on.quant_state + on.target_pass + on.targets  # a CPU run: the host targets during the pass
    assert on.target_phase == targets and on.phases["setup"] == on.loaded + max(on.quant_params + on.clip_init, targets)
    assert off.phases["setup"] == on.loaded + targets  # the teacher-target pass still runs
    layerwise = plan.plan_from_config(parsed([*FIT_CONFIGS, "--model.objective", "layerwise"]))[1]
    assert layerwise.target_pass == 0 and on.target_pass > 0  # the layer-wise objective computes no targets
    text = plan.format_plan(layerwise, "t", "s")
    assert "model.objective layerwise: planned as the trajectory objective" in text
    assert "model.objective" not in plan.format_plan(on, "t", "s")


def test_optimizer_state_follows_the_zero_paper():
    """Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, mixed-precision Adam: 120 GB unsharded,
    2 + 2 + 12/64 bytes per parameter sharding the optimizer states, 2 + 14/64 with gradients, 16/64 with
    parameters. Our bf16-mixed DeepSpeed keeps fp32 parameters and still clones an fp32 partition to update
    (``stage_1_and_2.py``, ``stage3.py``): 4 + 16/N and 20/N."""
    q, n = 7_500_000_000, 64
    assert plan.optimizer_bytes(q, "single", 1, 4) == 16 * q
    assert plan.optimizer_bytes(q, "ddp", 4, 4) == 20 * q  # + DDP's fp32 gradient buckets
    assert plan.optimizer_bytes(q, "zero2", n, 2) == 2 * q + math.ceil(14 * q / n)  # 16.6 GB in the paper
    assert plan.optimizer_bytes(q, "zero3", n, 2) == math.ceil(16 * q / n)  # 1.9 GB in the paper
    assert plan.optimizer_bytes(q, "zero2", n, 4) == 4 * q + math.ceil(16 * q / n)
    assert plan.optimizer_bytes(q, "zero3", n, 4) == math.ceil(20 * q / n)


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
    # streamed: one call's input x 3 (or 12 bytes per element of the largest weight) + the forward's fp32 logits
    assert plan.clip_init_bytes(8 * 256, 10, 100, 50) == 8 * 256 * 10 * 4 * 3 + 8 * 256 * 50 * 4
    assert plan.clip_init_bytes(10**6, 10, 10**7, 50) == 12 * 10**7 + 10**6 * 50 * 4
    counts = plan.model_counts(read_config(TINY), QuantConfig())
    factor = activation_factor(counts.shape)  # 132 (loopq.planning.guards)
    settings = plan.RunSettings(batch=4, seq_len=128, samples=16)
    assert plan.activation_parts(counts, 4, settings) == (4 * 128 * 128 * 4 * 4 * factor, 0)
    checkpointed = plan.RunSettings(batch=4, seq_len=128, samples=16, checkpoint_loops=True)
    # one checkpoint per (loop, layer): the 2 layers' inputs and the loop's output kept, one layer recomputed
    assert plan.activation_parts(counts, 4, checkpointed) == (4 * 128 * 128 * 4 * 3 * 4, 4 * 128 * 128 * 4 * factor / 2)


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
    assert step.total == step.weights + step.kept + max(step.recompute + step.use, step.logits) + step.targets
    assert shaped.peak == max(shaped.phases.values()) and set(shaped.phases) == {"setup", "training step"}


# ---------------------------------------------------------------------------------------------------- constants
@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_constants_match_what_autograd_keeps(precision):
    """Per token the saved tensors of a training step grow as the plan's activations + logits; what does not grow
    with the batch is (almost) nothing: the per-use backward saves no weight-sized tensor, only the chains' small
    inputs. Tensors of the model itself are not counted."""
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
    # measured: 0.09 (fp32) and 0.08 (bf16) of one fp32 copy of the weights (8.2 and 7.2 copies before the per-use
    # backward): hidden-sized tensors that do not grow with the batch (transform graphs, RoPE tables), not weights
    assert abs(constant) < 0.12 * 4 * counts.frozen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_one_uses_chain_keeps_what_the_plan_says(precision, compiled):
    """What one use's backward rebuilds: the weight chain with its graph keeps ``WEIGHT_CHAIN_COPIES`` fp32 copies of
    the group's weight (the term of ``use_bytes`` that dominates); measured on the tiny teacher's largest group, eager
    and compiled (``model.compile_quantizers``, what the paper configs run: Inductor saves fewer tensors)."""
    from loopq.quant import quant_groups
    from loopq.quant.modules import GroupOptions

    autocast = precision == "bf16-mixed"
    teacher = load_looplm(TINY, dtype=torch.bfloat16 if autocast else torch.float32).requires_grad_(False)
    student = prepare(teacher, QuantConfig(transform_init="random"), options=GroupOptions(compiled=compiled)).train()
    group = max(quant_groups(student).values(), key=lambda g: sum(w.numel() for w in g.weights()))
    elements = sum(w.numel() for w in group.weights())
    storages: dict[int, int] = {}
    own = {t.untyped_storage().data_ptr() for t in [*student.parameters(), *student.buffers()]}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    settings = plan.RunSettings(
        batch=1, seq_len=1, samples=1, precision=plan.normalise_precision(precision), compiled=compiled
    )
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with cast, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        group._chain(*group._compute_slot(0).chain)
    copies = sum(storages.values()) / (4 * elements)
    assert copies == pytest.approx(plan.WEIGHT_CHAIN_COPIES[settings.numerics()], rel=0.05)  # 7.13; compiled 4.06


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


def test_target_pass_by_hand():
    """The setup's teacher-target pass (``compute_targets``: ``TARGET_BATCH`` = 8 samples per forward) at the paper
    shape of the third GPU run (8 of Ouro-2.6B's layers, bf16 teacher, seq 256): bf16 logits and their fp32 copy,
    8 x 256 x 49152 x 6 B = 604 MB, loop states with their stack and fp16 copies 8 x 4 x 256 x 2048 x 6 B = 101 MB;
    the setup is then the loaded teacher + the quantization state + this pass (larger than the clip
    initialisation's 478 MB): 1.86 GiB, against the 1.88 GiB the H100 measured (1.6 planned before)."""
    from loopq.calib.targets import TARGET_BATCH

    assert TARGET_BATCH == 8
    assert plan.target_pass_bytes(256, 49152, 2048, 4, 2) == 8 * 256 * 49152 * 6 + 8 * 4 * 256 * 2048 * 6
    assert plan.target_pass_bytes(256, 49152, 2048, 4, 4) == 8 * 256 * 49152 * 4 + 8 * 4 * 256 * 2048 * 10  # fp32
    shaped = plan.plan_shape(2048, 8, 4, 5632, 16, 49152, batch=4, seq_len=256, samples=64, checkpoint_loops=True,
                             teacher_dtype="bf16", precision="bf16-mixed", strategy="zero2", on_cpu=False)  # fmt: skip
    assert shaped.target_pass > shaped.clip_init
    # the pass runs after the strategy's setup: the quantization state (ZeRO-2: no bucket yet) is there too
    assert shaped.phases["setup"] == shaped.loaded + shaped.quant_state + shaped.target_pass
    assert f"{shaped.phases['setup'] / 2**30:.2f}" == "1.86"


def test_weight_cache_and_use_by_hand():
    from loopq.planning.memory import WEIGHT_CHAIN_COPIES, use_bytes

    c_w = WEIGHT_CHAIN_COPIES["fp32", False]
    assert use_bytes(1000, ("fp32", False)) == math.ceil(1000 * (4 * c_w + 12 + 8))
    assert use_bytes(1000, ("autocast", False)) == math.ceil(1000 * (4 * WEIGHT_CHAIN_COPIES["autocast", False] + 16))


def test_no_weight_gradients_and_a_bf16_weight_cache_by_hand():
    """Ouro-1.4B's counts: the forward keeps every quantized weight once (bf16 under autocast, the promoted groups' T
    slots), nothing weight-sized is kept for backward, one use's chain is a transient inside one layer's backward;
    ZeRO-3 computes the weights per call and keeps none."""
    quant = QuantConfig(slt_budget=4)
    shaped = plan.plan_shape(2048, 24, 4, 5632, 16, 49152, batch=1, seq_len=256, samples=1, checkpoint_loops=True,
                             quant=quant, teacher_dtype="bf16", precision="bf16-mixed")  # fmt: skip
    step, counts = shaped.step, shaped.counts
    assert step.weights == (counts.frozen + 3 * counts.frozen_promoted) * 2
    assert step.use == plan.use_bytes(counts.largest_group, ("autocast", False))
    assert step.total == step.weights + step.kept + max(step.recompute + step.use, step.logits) + step.targets
    fp32 = plan.plan_shape(2048, 24, 4, 5632, 16, 49152, batch=1, seq_len=256, samples=1, checkpoint_loops=True,
                           quant=quant)  # fmt: skip
    assert fp32.step.weights == (counts.frozen + 3 * counts.frozen_promoted) * 4
    zero3 = plan.plan_shape(2048, 24, 4, 5632, 16, 49152, batch=1, seq_len=256, samples=1, checkpoint_loops=True,
                            quant=quant, strategy="zero3")  # fmt: skip
    assert zero3.step.weights == 0


def test_the_plan_follows_the_runs_gradient_bucket(tmp_path, monkeypatch):
    """The bucket planned is the one the run gets (``LoopQDeepSpeedStrategy``: sized to the parameters unless told):
    a given ``reduce_bucket_size``, a DeepSpeed config's (DeepSpeed's default 5e8 without the key, also from
    ``PL_DEEPSPEED_CONFIG_PATH``), Lightning's own strategies 2e8 (a review found the plan sizing all of them)."""
    loopq_ds = "loopq.calib.deepspeed.LoopQDeepSpeedStrategy"
    assert plan.bucket_of({"class_path": loopq_ds, "init_args": {"stage": 2}}) is None
    assert plan.bucket_of({"class_path": loopq_ds, "init_args": {"reduce_bucket_size": 1000}}) == 1000
    assert plan.bucket_of({"class_path": loopq_ds, "init_args": {"config": {"zero_optimization": {}}}}) == 500_000_000
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 3000}}))
    assert plan.bucket_of({"class_path": loopq_ds, "init_args": {"config": str(config)}}) == 3000
    assert plan.bucket_of("deepspeed_stage_2") == 200_000_000 and plan.bucket_of("ddp") is None
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(config))
    assert plan.bucket_of({"class_path": loopq_ds, "init_args": {}}) == 3000
    q = 21_190_000
    assert plan.bucket_bytes(q, "zero2", 4) == 2 * q * 4 and plan.bucket_bytes(q, "zero3", 4, 1000) == 4000
    assert plan.bucket_bytes(q, "zero2", 4, 200_000_000) == 1_600_000_000 and plan.bucket_bytes(q, "ddp", 4) == 0
