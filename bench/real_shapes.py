"""Real-shape rehearsal on CPU: every stage of a LoopQ calibration of an Ouro-1.4B / 2.6B-shaped model.

A randomly initialised Ouro with the published config (hidden 2048, MLP 5632, 16/16 heads of 128, vocab 49152,
rope theta 1e6, untied embeddings, 4 loops; 24 layers for 1.4B, 48 for 2.6B) goes through what a user's run does,
in the paper config's settings (``model.quant`` of ``configs/ouro1.4b.yaml``: W4A4, group 32, LAS, SLT budget
promoted up front, CTA rank 8, top-1000 targets, seq 256):

    build     the bf16 teacher (random weights: values do not change shapes, bytes or cost)
    write     the published layout: sharded ``model-0000i-of-0000n.safetensors`` + index (``--shard_gb``)
    load      ``load_looplm`` of that directory in bf16
    prepare   ``LoopQCalibration`` (teacher load + fake-quant student: transforms, clips, LAS, CTA, SLT promoted)
    targets   the teacher targets of ``--batch`` samples (top-k logits + every loop's state, fp16)
    step      one calibration step: student forward over T loops + Eq. 8 loss + backward + AdamW, with per-loop
              activation checkpointing (``model.checkpoint_loops``)
    export    ``export_student`` (weights folded in float64, int4 packed) and ``load_quantized`` of the export,
              plus one forward of the packed model (torch reference kernels on CPU)

Each stage prints its wall time, the process's resident memory after it and the stage's own peak: before a stage
freed heap is handed back (``malloc_trim``) and the kernel's peak mark is reset (``/proc/self/clear_refs``), as
``tests/peak_memory.py`` does. Run it with ``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed tensors leave the resident
set at once (glibc's default threshold grows after the first large free and keeps later freed tensors on its heap:
the step's peak then reads ~20 % higher). The end prints parameter and byte counts and the training step's
predicted memory (``loopq.planning.memory``) term by term. ``--layers`` reduces the depth where the machine cannot hold
the full model (say so when quoting numbers). Numbers of a run go to ``docs/benchmarks.md``.

    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 python bench/real_shapes.py               # Ouro-1.4B, 24 layers
    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 python bench/real_shapes.py --layers 48   # Ouro-2.6B
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopq.artifacts import export_student, load_quantized, student_meta
from loopq.calib.module import LoopQCalibration
from loopq.calib.targets import compute_targets
from loopq.models.loading import load_looplm
from loopq.models.ouro import OuroLM
from loopq.paths import REPO_ROOT
from loopq.planning.memory import MemoryPlan, plan_shape
from loopq.quant import QuantConfig, init_clipping_from_data, looped_quant_groups
from loopq.quant.accounting import footprint, format_footprint, parameter_report

#: the published Ouro-1.4B config.json (ByteDance/Ouro-1.4B); Ouro-2.6B differs only in num_hidden_layers (48)
OURO_1P4B: dict[str, Any] = {
    "architectures": ["OuroForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    },
    "model_type": "ouro",
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (1.4B: 24, 2.6B: 48)")
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "configs/ouro1.4b.yaml", help="paper config")
    parser.add_argument("--batch", type=int, default=1, help="samples per step (per GPU in the torchrun recipe)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--shard_gb", type=float, default=2.0, help="max shard size of the written checkpoint")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the checkpoints (default: tmp)")
    return parser.parse_args(argv)


def status_gib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process (``/proc/self/status``), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Hand freed heap back to the kernel and reset the peak mark (VmHWM := VmRSS), where Linux allows it."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def stage(name: str, fn: Callable[[], Any], rows: list[tuple[str, float, float, float]]) -> Any:
    """Run ``fn``; print and record its wall time, the resident memory after it and its own peak."""
    reset_peak()
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    now, peak = status_gib("VmRSS"), status_gib("VmHWM")
    rows.append((name, seconds, now, peak))
    print(f"  {name:8s} {seconds:8.1f} s   RSS {now:6.2f} GiB   stage peak {peak:6.2f} GiB", flush=True)
    return out


def paper_model(config: Path) -> tuple[QuantConfig, dict[str, Any]]:
    """``model.quant`` of a paper config and its memory switch ``teacher_dtype``."""
    model = yaml.safe_load(config.read_text())["model"]
    switches = {key: model[key] for key in ("teacher_dtype",) if key in model}
    return QuantConfig(**model["quant"]), switches


def build_teacher(layers: int) -> OuroLM:
    """The bf16 Ouro teacher of the published shape with ``layers`` layers, built directly in bf16."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return OuroLM.from_config({**OURO_1P4B, "num_hidden_layers": layers}, seed=0).eval()
    finally:
        torch.set_default_dtype(default)


def calibration_step(module: LoopQCalibration, ids: torch.Tensor) -> float:
    opt = torch.optim.AdamW(module.param_groups(), weight_decay=0.0)
    loss = module.compute_loss([torch.arange(len(ids)), ids])["loss"]
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="loopq-real-shapes-"))
    teacher_dir, export_dir = work / "teacher", work / "exported"
    quant, switches = paper_model(args.config)
    print(
        f"Ouro-1.4B shape with {args.layers} layers x {OURO_1P4B['total_ut_steps']} loops, batch {args.batch} x "
        f"{args.seq} tokens, {args.config.name}: {quant.bits.label} {switches}, threads {torch.get_num_threads()}"
    )
    rows: list[tuple[str, float, float, float]] = []
    try:
        built = [stage("build", lambda: build_teacher(args.layers), rows)]
        teacher_params = built[0].num_parameters
        shard_bytes = int(args.shard_gb * 2**30)
        stage("write", lambda: built.pop().save_pretrained(teacher_dir, max_shard_size=shard_bytes), rows)
        shards = sorted(teacher_dir.glob("*.safetensors"))
        loaded = stage("load", lambda: load_looplm(teacher_dir, dtype=torch.bfloat16), rows)
        del loaded
        ids = torch.randint(0, OURO_1P4B["vocab_size"], (args.batch, args.seq), generator=torch.Generator())

        def prepare() -> LoopQCalibration:
            module = LoopQCalibration(str(teacher_dir), quant, topk=1000, checkpoint_loops=True, **switches)
            init_clipping_from_data(module.student, ids)
            for group in list(looped_quant_groups(module.student).values())[: quant.slt_budget]:
                group.promote()
            return module

        module = stage("prepare", prepare, rows)
        module.targets = stage("targets", lambda: compute_targets(module.teacher, ids, 1000, module.num_loops), rows)
        module.mu.fill_(0.5)
        loss = stage("step", lambda: calibration_step(module, ids), rows)
        counts = parameter_report(module.student)

        def export() -> dict[str, float]:
            loops = module.num_loops
            meta = student_meta(module.student, teacher_dir, work / "student", module.promoted, [0.5] * loops, None)
            export_student(module.student, meta, export_dir)
            packed = load_quantized(export_dir, dtype=torch.bfloat16)
            with torch.no_grad():
                packed(ids[:, :32])
            return footprint(packed)

        size = stage("export", export, rows)
        print(
            f"\n  loss after one step {loss:.4f}; teacher {teacher_params / 1e9:.3f} B parameters, {len(shards)} shards"
        )
        print(f"  trainable quantization parameters {counts.as_dict()}")
        print(format_footprint(size))
        plan = plan_shape(
            hidden=OURO_1P4B["hidden_size"], layers=args.layers, loops=OURO_1P4B["total_ut_steps"],
            mlp=OURO_1P4B["intermediate_size"], heads=OURO_1P4B["num_attention_heads"], vocab=OURO_1P4B["vocab_size"],
            batch=args.batch, seq_len=args.seq, checkpoint_loops=True, samples=args.batch, quant=quant,
            teacher_dtype=str(switches.get("teacher_dtype", "fp32")),
        )  # fmt: skip
        print(format_step_plan(plan, next(peak for name, _, _, peak in rows if name == "step")))
        prepared = next(peak for name, _, _, peak in rows if name == "prepare")  # the teacher loads inside it
        setup = max(plan.phases["setup"], plan.teacher_load) / 2**30
        print(
            f"  setup predicted {setup:.2f} GiB (max of the teacher load {plan.teacher_load / 2**30:.2f} and the "
            f"setup phase {plan.phases['setup'] / 2**30:.2f}), prepare stage peak {prepared:.2f} GiB "
            f"({prepared / setup:.2f}x)"
        )
        print("\n| stage | seconds | RSS after (GiB) | stage peak (GiB) |\n|---|---|---|---|")
        for name, seconds, now, peak in rows:
            print(f"| {name} | {seconds:.1f} | {now:.2f} | {peak:.2f} |")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def format_step_plan(plan: MemoryPlan, measured: float) -> str:
    """The training step's predicted terms (GiB) next to the measured stage peak."""
    step, gib = plan.step, 2**-30
    transients = {"one layer recomputed + one use's chain": step.recompute + step.use, "the loss": step.logits}
    largest = max(transients, key=transients.__getitem__)
    terms = {
        "frozen teacher (bf16)": plan.frozen,
        "quantization state, all targets": plan.resident - plan.frozen,
        "fake-quant weights (forward, no graph)": step.weights,
        "activations kept": step.kept,
        f"largest transient: {largest}": transients[largest],
        "batch targets": step.targets,
    }
    predicted = plan.phases["training step"] * gib
    lines = [f"  training step predicted by loopq.planning.memory: {predicted:.2f} GiB"]
    lines += [f"    {name:<40} {value * gib:7.2f} GiB" for name, value in terms.items()]
    lines.append(
        f"  measured stage peak {measured:.2f} GiB = {measured / predicted:.2f}x the prediction "
        "(the peak also holds the Python/torch runtime, ~0.5 GiB)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
