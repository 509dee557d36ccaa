"""A calibration's memory, planned before it starts: ``python -m loopq.fit --config X --print_plan``.

Nothing is loaded. The teacher and its fake-quant student are built on the ``meta`` device from the teacher's
``config.json`` alone (a local teacher's, ``--plan_config``'s, or the embedded :data:`PUBLISHED` shapes of the
paper's four teachers), so every count is exact and costs no memory. All sizes are bytes per process (one process
per GPU) for the trajectory objective. Symbols: P teacher parameters; L elements of the frozen weights (and biases)
of the quantized groups, L_loop of those inside the loop, L_slt of the SLT-promoted ones; Q trainable quantization
parameters (transforms, clips, adapters); N processes; T loops; B batch per process; S seq_len; D hidden; V
vocabulary; k top-k; M samples; b_t the teacher's bytes per element, b_p the strategy's parameter bytes.

* **frozen weights** (:func:`frozen_bytes`): P b_t - ``prepare`` shares the teacher's tensors with the student.
  ZeRO-3 partitions *parameters*, but the student holds its groups' frozen weights as *buffers*, which DeepSpeed
  never partitions: P b_t / N + L b_t. A cast of the parameters (DeepSpeed's fp16 mode, ``*-true`` precisions) gives
  them new storage while the buffers keep the loaded one (``bf16-mixed`` casts nothing: ``loopq.calib.deepspeed``).
* **quantization state** (:func:`optimizer_bytes`, ZeRO paper, Rajbhandari et al. 2020, with K = 12 for mixed
  precision): single process / DDP 16 Q (fp32 parameter, gradient, AdamW m and v) + 4 Q for DDP's gradient buckets;
  DeepSpeed b_p Q parameters (/ N under ZeRO-3), b_p Q / N gradients, (8 + 4) Q / N optimizer states and fp32
  master partition (cloned even from fp32 parameters: ``stage_1_and_2.py``, ``stage3.py``). Plus DeepSpeed's
  gradient buckets (:func:`bucket_bytes`): ZeRO-2 allocates two (contiguous gradients with overlapped communication)
  of ``reduce_bucket_size`` elements for each backward, ZeRO-3 one for the whole run, in b_p;
  ``loopq.calib.deepspeed`` caps the bucket at Q unless told otherwise (:func:`bucket_of`; Lightning's 2e8 elements
  were two 800 MB fp32 buffers per backward, unplanned: the GPU check's paper-shape step measured 19 % over plan).
* **fake-quant weights** (:func:`weight_cache_bytes`): every forward transforms and fake-quantizes each group's
  weight once per distinct slot without a graph (``QuantLinearGroup.begin_forward``) and keeps it for the forward in
  the matmul's dtype b_m (2 under bf16 autocast, else 4): (L + (T - 1) L_slt) b_m. ZeRO-3 computes them per call
  instead (nothing kept). Autograd keeps nothing weight-sized: the per-use backward (``loopq.quant.modules``).
* **one use's backward** (:func:`use_bytes`): each use (one group in one loop) rebuilds its chain with a graph in the
  backward pass, forms its weight gradient, sends it through the chain and frees everything: the largest group's
  weight x (4 c_w + 12 + 2 b_m) - the chain's graph (c_w fp32 copies, :data:`WEIGHT_CHAIN_COPIES`), the rebuilt
  weight, its cast and its gradient, and two fp32 gradients inside the chain's backward. It happens while the
  backward of one layer runs, so it adds to that layer's recomputed tensors (``checkpoint_loops``).
* **activations** (:func:`activation_parts`): B S D T 4 factor, the factor of
:func:`loopq.planning.guards.activation_factor`
  (tested there against autograd); with ``checkpoint_loops`` (one checkpoint per (loop, layer) call) every layer's
  input and every loop's, B S D T (n_layers + 1) 4, plus one layer's B S D 4 factor / n_layers while it is
  recomputed - after the loss's backward, so the two are not added (:class:`Pass`); the quantized groups outside the
  loop (Parcae's prelude and coda) once; x :data:`ACTIVATION_FRACTION` for bf16 numerics (bf16 and fp32 tensors) or
  compiled chains.
* **logits and loss** (:func:`logit_bytes`): B S (5 V + T D) 4 - the fp32 log-softmax of the logits and its input,
  three logit-sized gradients as the backward pass starts, the trajectory differences - and the batch's targets on
  the device (:func:`batch_target_bytes`), B S (12 k + 4 T D) (fp32 values, int64 ids, fp32 states).
* **setup** (:func:`clip_init_bytes`): LAS's clip initialisation scores each group call's input against the clip
  grid and drops it (streamed, ``init_clipping_from_data``), its forward computing the quantized weights per call:
  one call's input and three working copies, min(B N S, 4096) 4 max_g in_g 3, or one group's chain without a
  graph, 4 x 3 of the largest group's weight, whichever is larger; and the forward's logits, B N S V 4. Or, if
  larger, the teacher-target pass (:func:`target_pass_bytes`, trajectory objective): the teacher's forward over
  ``TARGET_BATCH`` samples, its logits in b_t and their fp32 copy for the top-k, b S V (b_t + 4), and its loop states
  with their stacked and fp16 copies, b T S D (2 b_t + 2) (the third GPU run measured an 8-layer Ouro-2.6B's setup
  17 % over the plan without this term: 1.88 against 1.6 GiB; with it 1.86).
* **teacher targets** (:func:`target_bytes`): M S k (2 + b_id) + M T S D 2 - fp16 top-k logits, int16/int32 ids,
  fp16 loop states - held once in host memory (written into tensors allocated for all samples; a cache file is read
  back whole after the computed copy is dropped), and the cache file on disk.

The peak is the larger phase: setup or the training step. SLT costs no phase of its own: its per-loop gradients are
recorded in the training step's backward (transform-sized; ``loopq.calib.slt``). On a CPU run the
host rows (the targets) share the same memory and are added. The constants below were measured with autograd's
saved-tensor hooks on the embedded tiny teacher and the shared fixtures (``tests/test_plan.py`` re-measures them).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loopq.calib.deepspeed import DEEPSPEED_BUCKET, sized_bucket
from loopq.calib.module import TEACHER_DTYPES, resolve_teacher_dtype
from loopq.calib.targets import TARGET_BATCH
from loopq.errors import LoopQError
from loopq.files import read_json, read_json_object
from loopq.models.base import LoopLM, RMSNorm
from loopq.models.config_checks import check_against_header
from loopq.models.loading import architecture_for
from loopq.planning.guards import LoopShape, activation_bytes, activation_factor, loop_shape, trajectory_bytes
from loopq.quant import QuantConfig, prepare
from loopq.quant.accounting import ParameterReport, parameter_report
from loopq.quant.modules import QuantLinearGroup
from loopq.quant.prepare import is_fp_module, looped_quant_groups, quant_groups

#: how a forward's numbers are held, the key of the two tables below: ``fp32``; ``autocast`` (``*-mixed`` precision
#: under Lightning's autocast; a bf16 teacher); ``bf16`` (a bf16 model without autocast: DeepSpeed's bf16 engine,
#: ``bf16-true``)
NUMERICS = ("fp32", "autocast", "bf16")
#: fp32 copies of a weight that the transform + fake-quant chain leaves to autograd (what one use's backward rebuilds,
#: :func:`use_bytes`), by (numerics, compiled chains). Measured on the largest group (autograd's saved tensors of
#: ``QuantLinearGroup._chain``, ``tests/test_plan.py``), tiny teacher and the three fixtures: 7.13-7.20 fp32,
#: 7.13 autocast (the chain runs in fp32 under autocast since session 25, ``loopq.quant.transforms``; 5.11-5.18
#: before), 7.13-7.20 bf16 (the chain runs in fp32 there); compiled, on the tiny teacher: 4.06 fp32 and autocast
#: (session 25, the per-use chain; 5.13 fp32 / 4.61 autocast for the forward's chain before the per-use backward), 6.13
#: bf16 (before it)
WEIGHT_CHAIN_COPIES = {
    ("fp32", False): 7.25,
    ("autocast", False): 7.25,
    ("bf16", False): 7.25,
    ("fp32", True): 4.2,
    ("autocast", True): 4.2,
    ("bf16", True): 6.25,
}
#: activation bytes relative to :func:`loopq.planning.guards.activation_factor`'s fp32 estimate, by (numerics, compiled
#: chains): bf16 numerics keep a mix of bf16 and fp32 (the transforms) tensors, Inductor recomputes part of a fused
#: chain in the backward instead of saving it. Measured 0.98-1.04 fp32, 0.68-0.72 bf16, autocast 0.87 on the tiny
#: teacher (0.59-0.61 before session 25, when autocast rounded the transformed activations to bf16: saved tensors of
#: a student forward, 57.6 against 39.3 MiB, fp32 66.0); compiled on the tiny teacher 0.72 fp32, 0.49 bf16, autocast
#: 0.40 (26.7 MiB, session 25: Inductor saves no fp32 transform output, it recomputes it)
ACTIVATION_FRACTION = {
    ("fp32", False): 1.0,
    ("autocast", False): 0.88,
    ("bf16", False): 0.7,
    ("fp32", True): 0.72,
    ("autocast", True): 0.42,
    ("bf16", True): 0.5,
}
#: tokens per group and slot that LAS's clip initialisation records (``init_clipping_from_data``'s ``max_tokens``)
CLIP_INIT_TOKENS = 4096
STRATEGIES = ("single", "ddp", "zero2", "zero3")


class PlanError(LoopQError):
    """The plan cannot be made (no shapes for the teacher, an unknown strategy); the message names the option."""


# ---------------------------------------------------------------------------------------------------- shapes
def ouro_config(
    hidden: int,
    layers: int,
    loops: int,
    mlp: int,
    heads: int,
    vocab: int,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    tied: bool = False,
) -> dict[str, Any]:
    """A native Ouro ``config.json`` of this shape (what :func:`model_counts` builds on the meta device)."""
    return {
        "model_type": "ouro",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "total_ut_steps": loops,
        "intermediate_size": mlp,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }


#: the native configs of the paper's teachers (their shapes; what a plan needs when the teacher is not on disk)
PUBLISHED: dict[str, dict[str, Any]] = {
    # huggingface.co/ByteDance/Ouro-1.4B and -2.6B config.json (Ouro-2.6B: the same layer, 48 layers)
    "Ouro-1.4B": ouro_config(2048, 24, 4, 5632, 16, 49152, head_dim=128),
    "Ouro-2.6B": ouro_config(2048, 48, 4, 5632, 16, 49152, head_dim=128),
    # github.com/armenjeddi/loopformer config/train_loopformer_3blk.py (3 blocks x 8 loops, 32 heads, 2048 wide) on
    # the GPTConfig defaults of models/loopformer.py (vocab 50304, block 1024, MLP 5120, no bias)
    "loopformer-3x8": {
        "model_type": "loopformer",
        "n_layer": 3,
        "n_head": 32,
        "n_embd": 2048,
        "intermediate_dim": 5120,
        "vocab_size": 50304,
        "block_size": 1024,
        "bias": False,
        "loopq_default_loops": 8,
    },
    # github.com/sandyresearch/parcae parcae_lm/configs/parcae/parcae-medium-370m.py (4 prelude + 4 core x 8 loops +
    # 4 coda blocks, 1024 wide, MLP 4096, 8 heads, vocab 32768, tied embeddings)
    "parcae-370m": {
        "_class_name": "ParcaeConfig",
        "name": "parcae-medium-370m",
        "block_size": 2048,
        "vocab_size": 32768,
        "padding_multiple": 64,
        "n_embd": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 4096,
        "bias": False,
        "tie_embeddings": True,
        "prelude_norm": True,
        "norm_class_name": "RMSNorm",
        "norm_eps": 1e-5,
        "mlp_class_name": "BaseMLP",
        "nonlin_name": "ReLU2",
        "qk_norm": True,
        "init_strategy": "scaled-zero",
        "injection_type": "diagonal",
        "state_init": "like-init",
        "recurrent_embedding_dimension": 1024,
        "recurrent_intermediation_embedding_dimension": 4096,
        "n_layers_in_recurrent_block": 4,
        "n_layers_in_prelude": 4,
        "n_layers_in_coda": 4,
        "mean_recurrence": 8,
        "mean_backprop_depth": 4,
    },
}
#: other names the paper configs use for them (hub ids, the local folders of configs/*.yaml)
ALIASES = {
    "parcae-medium-370m": "parcae-370m",
    "sandyresearch/parcae-370m": "parcae-370m",
    "loopformer3x8": "loopformer-3x8",
}


def published_config(teacher: str) -> tuple[str, dict[str, Any]] | None:
    """(name, native config) of :data:`PUBLISHED` for a teacher named by hub id, alias or folder name, else None."""
    names = {name.lower(): name for name in PUBLISHED}
    for key in (teacher.lower(), Path(teacher).name.lower()):
        key = ALIASES.get(key, key)
        if key in names:
            return names[key], PUBLISHED[names[key]]
    return None


def teacher_config(teacher: str, plan_config: str | None = None) -> tuple[str, dict[str, Any]]:
    """(where it came from, native config) of the teacher: ``plan_config``, the teacher directory's ``config.json``
    (checked against its weight files' headers first: :func:`~loopq.models.config_checks.check_against_header`), or
    :data:`PUBLISHED`; never its weights' values, never the hub."""
    if plan_config:
        return plan_config, read_json_object(Path(plan_config), PlanError, "pass the teacher's config.json")
    local = Path(teacher) / "config.json"
    if local.is_file():
        native = read_json_object(local, PlanError, "fix the teacher's config.json")
        cls = architecture_for(native, str(local))
        check_against_header(cls, cls.config_from_dict(native), Path(teacher))
        return str(local), native
    found = published_config(teacher)
    if found is None:
        raise PlanError(
            f"model.teacher {teacher}: no local config.json and no embedded shapes (known: {sorted(PUBLISHED)}); "
            "pass --plan_config <its config.json>"
        )
    return f"embedded {found[0]}", found[1]


# ---------------------------------------------------------------------------------------------------- counts
@dataclass(frozen=True)
class ModelCounts:
    """What the memory of a calibration depends on, counted on a meta-device teacher and student."""

    shape: LoopShape  # the looped groups (loopq.planning.guards)
    outside: LoopShape  # the quantized groups outside the loop (Parcae's prelude and coda), run once
    vocab: int
    frozen: int  # L: elements of the quantized groups' frozen weights and biases
    frozen_looped: int  # L_loop: of those, inside the loop
    frozen_promoted: int  # L_slt: of those, in the SLT-promoted groups
    promoted_groups: int
    largest_group: int  # elements of the largest group's frozen weights (one chain recomputed at a time)
    largest_input: int  # the widest group input (what the streamed clip initialisation scores at once)
    layers: int  # decoder layers in the loop (checkpoint_loops keeps each one's input)
    trainable: int  # Q: trainable quantization parameters (the SLT slots included: the layout is fixed)
    report: ParameterReport  # the paper's Table 5 (shared / loop-dependent)


def build_meta(native: dict[str, Any], quant: QuantConfig) -> tuple[LoopLM, LoopLM]:
    """The frozen teacher and its fake-quant student on the meta device, with ``quant.slt_budget`` looped groups
    promoted - the ones with the most promotion parameters, so that counts and memory are upper bounds."""
    cls = architecture_for(native, "config.json")
    with torch.device("meta"):
        teacher = cls(cls.config_from_dict(native))
        teacher.requires_grad_(False)
        student = prepare(teacher, quant)
        ranked = sorted(looped_quant_groups(student).values(), key=promotion_size, reverse=True)
        for group in ranked[: quant.slt_budget]:
            group.promote()
    return teacher, student


def promotion_size(group: QuantLinearGroup) -> int:
    """Parameters a group's SLT promotion puts to use (its per-loop slots)."""
    return sum(p.numel() for p in group.promotion_parameters())


def model_counts(native: dict[str, Any], quant: QuantConfig) -> ModelCounts:
    """:class:`ModelCounts` of a native ``config.json`` and a quantization config (meta device: no memory)."""
    teacher, student = build_meta(native, quant)
    groups = quant_groups(student)
    frozen = {name: sum(t.numel() for t in [*g.weights(), *g.biases()] if t is not None) for name, g in groups.items()}
    return ModelCounts(
        shape=loop_shape(teacher),
        outside=outside_shape(teacher),
        vocab=teacher.lm_head.weight.shape[0],
        frozen=sum(frozen.values()),
        frozen_looped=sum(frozen[n] for n, g in groups.items() if g.looped),
        frozen_promoted=sum(frozen[n] for n, g in groups.items() if g.promoted),
        promoted_groups=sum(g.promoted for g in groups.values()),
        largest_group=max(frozen.values(), default=0),
        largest_input=max((g.in_features for g in groups.values()), default=0),
        layers=len(teacher.loop_layers),
        trainable=sum(p.numel() for p in student.parameters() if p.requires_grad),
        report=parameter_report(student),
    )


def outside_shape(model: LoopLM) -> LoopShape:
    """A :class:`~loopq.planning.guards.LoopShape` of the quantizable groups and norms of the decoder layers outside
    the loop (Parcae's prelude and coda; nothing for Ouro and LoopFormer), each run once per forward."""
    looped = set(model.looped_group_names())
    groups = [g for n, g in model.linear_groups().items() if n not in looped and not is_fp_module(model, n)]
    layers = [m for n, m in model.decoder_layers().items() if not n.startswith(model.loop_layers_prefix + ".")]
    return LoopShape(
        hidden=model.state_dim,
        trained_loops=1,
        group_inputs=sum(g.in_features for g in groups),
        group_outputs=sum(lin.out_features for g in groups for lin in g.children()),
        norms=sum(isinstance(m, (RMSNorm, torch.nn.LayerNorm)) for layer in layers for m in layer.modules()),
        parameters=0,
    )


# ---------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class RunSettings:
    """The parts of a calibration's config that its memory depends on."""

    batch: int  # per process
    seq_len: int
    samples: int
    topk: int = 1000
    loops: int | None = None  # None: the teacher's trained count
    strategy: str = "single"  # single | ddp | zero2 | zero3
    processes: int = 1
    precision: str = "32-true"
    teacher_dtype: str = "fp32"  # bf16 | fp32
    checkpoint_loops: bool = False
    compiled: bool = False  # model.compile_quantizers
    on_cpu: bool = False  # host and device memory are one
    target_cache: bool = False
    init_clipping: bool = True  # model.init_clipping: LAS's data-driven clip initialisation runs in the setup
    objective: str = "trajectory"  # model.objective: the plan's terms are the trajectory objective's
    bucket: int | None = None  # DeepSpeed's gradient bucket (elements); None: sized to the parameters

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlanError(f"trainer.strategy: the plan knows {STRATEGIES}, not {self.strategy!r}")

    @property
    def deepspeed_fp16(self) -> bool:
        """DeepSpeed's own fp16 mode (``16-mixed``); ``bf16-mixed`` runs its fp32 engine under autocast."""
        return self.strategy.startswith("zero") and self.precision == "16-mixed"

    @property
    def autocast(self) -> bool:
        return self.precision.endswith("-mixed") and not self.deepspeed_fp16

    @property
    def cast_bytes(self) -> int | None:
        """Bytes of the dtype every parameter is cast to (``*-true`` precisions, DeepSpeed's fp16 mode), else None."""
        if self.precision.endswith("-true") and self.precision != "32-true":
            return 8 if self.precision.startswith("64") else 2
        return 2 if self.deepspeed_fp16 else None

    @property
    def param_bytes(self) -> int:
        """b_p: bytes of a trainable parameter as the strategy holds it (4 unless a cast applies)."""
        return self.cast_bytes or 4

    def numerics(self) -> tuple[str, bool]:
        """The key of :data:`WEIGHT_CHAIN_COPIES` and :data:`ACTIVATION_FRACTION` for the training step."""
        if self.autocast:
            return "autocast", self.compiled
        return ("bf16" if 2 in (self.teacher_bytes, self.param_bytes) else "fp32"), self.compiled

    @property
    def teacher_bytes(self) -> int:
        return TEACHER_DTYPES[self.teacher_dtype].itemsize


def normalise_precision(precision: Any) -> str:
    """Lightning's spelling of ``trainer.precision``: ``32`` -> ``32-true``, ``bf16`` -> ``bf16-mixed``, ..."""
    text = "32" if precision is None else str(precision)
    return {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(text, text)


def strategy_parts(strategy: Any) -> tuple[str, dict[str, Any]]:
    """(class_path or name, init_args) of a ``trainer.strategy``: a name, or a class_path/init_args mapping."""
    if isinstance(strategy, dict) or hasattr(strategy, "class_path"):
        get = strategy.get if isinstance(strategy, dict) else lambda k, d=None: getattr(strategy, k, d)
        args = get("init_args") or {}
        return str(get("class_path", "")), args if isinstance(args, dict) else vars(args)
    return str(strategy or "auto"), {}


def deepspeed_config(args: dict[str, Any]) -> dict[str, Any] | None:
    """The DeepSpeed config of strategy arguments: ``config`` (a dict or a JSON file), else the file
    ``PL_DEEPSPEED_CONFIG_PATH`` names (as Lightning reads it); None without one."""
    config = args.get("config") or os.environ.get("PL_DEEPSPEED_CONFIG_PATH")
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        config = read_json(Path(config), PlanError, "fix the DeepSpeed config")
    return config if isinstance(config, dict) else None


def strategy_of(strategy: Any, processes: int) -> str:
    """``trainer.strategy`` (a name, or a class_path/init_args mapping) as one of :data:`STRATEGIES`."""
    name, args = strategy_parts(strategy)
    name = name.lower()
    if "deepspeed" in name:
        mapping = isinstance(strategy, dict) or hasattr(strategy, "class_path")
        return f"zero{deepspeed_stage(args)}" if mapping else "zero3" if "stage_3" in name else "zero2"
    if "ddp" in name or "fsdp" in name:
        return "ddp"
    return "single" if processes == 1 else "ddp"


def deepspeed_stage(args: dict[str, Any]) -> int:
    """ZeRO stage of DeepSpeed strategy arguments: the config's ``zero_optimization.stage``, else ``stage`` (2)."""
    config = deepspeed_config(args)
    if config is not None:
        return int((config.get("zero_optimization") or {}).get("stage", 2))
    return int(args.get("stage") or 2)


# ---------------------------------------------------------------------------------------------------- formulas
def frozen_bytes(
    params: int, frozen: int, teacher_bytes: int, cast_bytes: int | None, strategy: str, processes: int
) -> int:
    """The frozen teacher, shared with the student: P b_t. A cast to b_c (``cast_bytes``) gives parameters new
    storage; the student's frozen weights are buffers, which DeepSpeed neither casts nor partitions (they keep the
    loaded storage) and Lightning's ``*-true`` precisions cast separately: P b_c + L b_t (DeepSpeed) or L b_c
    (Lightning) when b_t != b_c. ZeRO-3: P b / N + L b_t."""
    if strategy == "zero3":
        return math.ceil(params * (cast_bytes or teacher_bytes) / processes) + frozen * teacher_bytes
    if cast_bytes is None or cast_bytes == teacher_bytes:
        return params * teacher_bytes
    return params * cast_bytes + frozen * (teacher_bytes if strategy == "zero2" else cast_bytes)


def optimizer_bytes(trainable: int, strategy: str, processes: int, param_bytes: int) -> int:
    """Parameters, gradients and AdamW states of Q trainable parameters: 16 Q (+ 4 Q DDP buckets) without ZeRO;
    ZeRO-2 b_p Q + (b_p + 8 + master) Q / N, ZeRO-3 (2 b_p + 8 + master) Q / N, master = 4 (the fp32 partition
    DeepSpeed updates)."""
    if strategy in ("single", "ddp"):
        per = 4 * param_bytes + (param_bytes if strategy == "ddp" else 0)
        return trainable * per
    master = 4  # DeepSpeed clones an fp32 partition to update whatever the parameters' dtype
    sharded = param_bytes + 2 * 4 + master
    if strategy == "zero3":
        return math.ceil(trainable * (param_bytes + sharded) / processes)
    return trainable * param_bytes + math.ceil(trainable * sharded / processes)


#: DeepSpeed's own ``reduce_bucket_size`` default (elements), what a DeepSpeed config without the key gets
DEEPSPEED_CONFIG_BUCKET = 500_000_000


def bucket_bytes(trainable: int, strategy: str, param_bytes: int, bucket: int | None = None) -> int:
    """DeepSpeed's contiguous gradient buckets: ZeRO-2 two (double-buffered with ``overlap_comm``) while a backward
    runs, ZeRO-3 one for the run, each ``bucket`` elements of b_p (None: :func:`sized_bucket`, what
    ``LoopQDeepSpeedStrategy`` gives by default); none without DeepSpeed (DDP's buckets are in
    :func:`optimizer_bytes`)."""
    copies = {"zero2": 2, "zero3": 1}.get(strategy, 0)
    return copies * (sized_bucket(trainable) if bucket is None else bucket) * param_bytes


def bucket_of(strategy: Any) -> int | None:
    """The gradient bucket (elements) a ``trainer.strategy`` runs with, None where ``LoopQDeepSpeedStrategy`` sizes
    it to the parameters: a ``reduce_bucket_size`` it is given, a DeepSpeed config's (DeepSpeed's default 5e8 when
    the config lacks it; a config also comes from ``PL_DEEPSPEED_CONFIG_PATH``), else Lightning's 2e8 for
    Lightning's own DeepSpeed strategies (``deepspeed_stage_2``, its class)."""
    name, args = strategy_parts(strategy)
    if "deepspeed" not in name.lower():
        return None
    if args.get("reduce_bucket_size") is not None:
        return int(args["reduce_bucket_size"])
    config = deepspeed_config(args)
    if config is not None:
        return int((config.get("zero_optimization") or {}).get("reduce_bucket_size", DEEPSPEED_CONFIG_BUCKET))
    return None if name.startswith("loopq.") else DEEPSPEED_BUCKET


def matmul_bytes(numerics: tuple[str, bool]) -> int:
    """b_m: bytes of an element as the quantized matmuls read it (bf16 under autocast, else the fp32 chain output)."""
    return 2 if numerics[0] == "autocast" else 4


def weight_cache_bytes(counts: ModelCounts, loops: int, settings: RunSettings) -> int:
    """The no-grad quantized weights one forward keeps: (L + (T - 1) L_slt) b_m, nothing under ZeRO-3 (per call)."""
    if settings.strategy == "zero3":
        return 0
    return (counts.frozen + (loops - 1) * counts.frozen_promoted) * matmul_bytes(settings.numerics())


def use_bytes(largest_group: int, numerics: tuple[str, bool]) -> int:
    """One use's backward: the largest group's chain rebuilt with its graph, the weight, its cast and gradient, and
    the chain's working gradients, ``largest_group`` x (4 c_w + 12 + 2 b_m) (module docstring)."""
    return math.ceil(largest_group * (4 * WEIGHT_CHAIN_COPIES[numerics] + 12 + 2 * matmul_bytes(numerics)))


def activation_parts(counts: ModelCounts, loops: int, settings: RunSettings) -> tuple[int, int]:
    """(kept for the whole pass, recomputed one loop at a time) activation bytes, x :data:`ACTIVATION_FRACTION`.

    Without ``checkpoint_loops``: every loop's saved tensors, B S D T 4 factor
    (:func:`loopq.planning.guards.activation_bytes` with :func:`~loopq.planning.guards.activation_factor`), and nothing
    recomputed; with it (one checkpoint per (loop, layer) call): every layer's and loop's input, B S D T (n + 1) 4,
    kept and one layer's saved tensors, B S D 4 factor / n, while that layer is recomputed. The groups outside the
    loop (Parcae's prelude and coda) are kept once either way."""
    b, s, d = settings.batch, settings.seq_len, counts.shape.hidden
    factor = activation_factor(counts.shape)
    outside = 0
    if counts.outside.group_inputs:
        outside = activation_bytes(b, s, counts.outside.hidden, 1, 4, activation_factor(counts.outside))
    if settings.checkpoint_loops:
        n = max(counts.layers, 1)
        kept = activation_bytes(b, s, d, loops * (n + 1), 4, 1.0)
        recompute = activation_bytes(b, s, d, 1, 4, factor / n)
    else:
        kept, recompute = activation_bytes(b, s, d, loops, 4, factor), 0
    fraction = ACTIVATION_FRACTION[settings.numerics()]
    return math.ceil((kept + outside) * fraction), math.ceil(recompute * fraction)


def logit_bytes(batch: int, seq_len: int, vocab: int, hidden: int, loops: int) -> int:
    """The loss's tensors as the backward pass starts: B S (5 V + T D) 4 - the fp32 logits and their log-softmax kept
    for backward, the gradients of the log-softmax, of the logits and of the top-k gather (each B S V fp32), the
    trajectory differences (B S D per loop)."""
    return batch * seq_len * (5 * vocab + loops * hidden) * 4


def batch_target_bytes(batch: int, seq_len: int, topk: int, vocab: int, hidden: int, loops: int) -> int:
    """One batch's teacher targets on the device (``TeacherTargets.batch``): fp32 top-k values, int64 ids, fp32 loop
    states: B S (12 k + 4 T D)."""
    return batch * seq_len * (12 * min(topk, vocab) + 4 * loops * hidden)


def clip_init_bytes(tokens: int, largest_input: int, largest_group: int, vocab: int) -> int:
    """LAS's streamed clip initialisation (module docstring): max(min(tokens, 4096) 4 max_g in_g 3, 12 x the largest
    group's weight) + the forward's fp32 logits, ``tokens`` x V x 4."""
    return max(min(tokens, CLIP_INIT_TOKENS) * largest_input * 4 * 3, 12 * largest_group) + tokens * vocab * 4


def target_pass_bytes(seq_len: int, vocab: int, hidden: int, loops: int, teacher_bytes: int) -> int:
    """The teacher-target pass on the device (module docstring): ``TARGET_BATCH`` samples' logits in b_t, their
    fp32 copy (none for an fp32 teacher) and the loop states with their stacked and fp16 copies."""
    logit_bytes = teacher_bytes + (4 if teacher_bytes < 4 else 0)
    return TARGET_BATCH * seq_len * (vocab * logit_bytes + loops * hidden * (2 * teacher_bytes + 2))


def target_bytes(samples: int, seq_len: int, topk: int, vocab: int, hidden: int, loops: int) -> int:
    """The teacher targets (``loopq.calib.targets``): fp16 top-k values, int16 ids (int32 above 32767 tokens), fp16
    loop states (:func:`loopq.planning.guards.trajectory_bytes`): M S k (2 + b_id) + M T S D 2."""
    k = min(topk, vocab)
    id_bytes = 2 if vocab <= torch.iinfo(torch.int16).max else 4
    return samples * seq_len * k * (2 + id_bytes) + trajectory_bytes(samples, seq_len, hidden, loops)


def teacher_load_bytes(params: int, teacher_bytes: int) -> int:
    """Host memory while the teacher loads: the weights as read (assumed in b_t) and the model they are copied into,
    built on the meta device in b_t (``LoopLM.from_native``): 2 P b_t (measured 5.84 GiB with the ~0.5 GiB runtime
    for Ouro-1.4B in bf16, 5.34 GiB predicted: ``bench/real_shapes.py``)."""
    return 2 * params * teacher_bytes


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Pass:
    """What one training step's forward + backward adds to the resident memory.

    With ``checkpoint_loops`` a layer is recomputed only after the loss's backward is done, so the loss's tensors and
    a recomputed layer (with the backward of one use inside it) are not alive together: the pass needs
    ``max(recompute + use, logits)``, not their sum."""

    weights: int  # the quantized weights the forward keeps (no graph)
    kept: int  # activations kept for the whole pass
    recompute: int  # one layer's saved tensors while it is recomputed (checkpoint_loops), else 0
    use: int  # one use's backward: its weight chain rebuilt and its weight gradient, freed at once
    logits: int  # the loss's tensors as the backward pass starts
    targets: int  # the batch's teacher targets on the device

    @property
    def total(self) -> int:
        return self.weights + self.kept + max(self.recompute + self.use, self.logits) + self.targets


@dataclass(frozen=True)
class MemoryPlan:
    """Every term of a calibration's memory per process (bytes), its phases and its peak."""

    counts: ModelCounts
    settings: RunSettings
    loops: int
    frozen: int  # the frozen teacher (shared with the student), as the strategy holds it
    loaded: int  # the frozen teacher as loaded, before a DeepSpeed engine casts or partitions it (setup)
    quant_params: int  # the fp32 quantization parameters alone (setup: no gradients or optimizer states yet)
    quant_state: int  # quantization parameters, gradients and AdamW states
    buckets: int  # DeepSpeed's gradient buckets
    step: Pass
    clip_init: int
    target_pass: int  # the teacher's forward computing the targets (setup; 0 for the layer-wise objective)
    targets: int  # in host memory (and the cache file's size)
    teacher_load: int  # host, transient

    @property
    def resident(self) -> int:
        """What stays during training: frozen teacher, quantization state, and on a CPU run the targets too."""
        return self.frozen + self.quant_state + self.buckets + (self.targets if self.settings.on_cpu else 0)

    @property
    def target_phase(self) -> int:
        """Beyond the loaded teacher while the targets are computed (``on_fit_start``, after the strategy's setup):
        the quantization state (ZeRO-3 also its bucket), the teacher-target pass and, on a CPU run, the targets'
        host tensors, allocated for all samples before the pass ends."""
        s = self.settings
        zero3_bucket = self.buckets if s.strategy == "zero3" else 0
        host = self.targets if s.on_cpu and self.target_pass else 0
        return self.quant_state + zero3_bucket + self.target_pass + host

    @property
    def phases(self) -> dict[str, int]:
        """Peak of each phase: setup (teacher as loaded, then LAS's streamed clip initialisation with the fp32
        quantization parameters, or :attr:`target_phase`, whichever is larger) and the training step (SLT's scores
        come from its backward)."""
        return {
            "setup": self.loaded + max(self.quant_params + self.clip_init, self.target_phase),
            "training step": self.resident + self.step.total,
        }

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase]


def training_pass(counts: ModelCounts, loops: int, settings: RunSettings) -> Pass:
    """The :class:`Pass` of a training step."""
    s, d = settings, counts.shape.hidden
    kept, recompute = activation_parts(counts, loops, s)
    return Pass(
        weights=weight_cache_bytes(counts, loops, s),
        kept=kept,
        recompute=recompute,
        use=use_bytes(counts.largest_group, s.numerics()),
        logits=logit_bytes(s.batch, s.seq_len, counts.vocab, d, loops),
        targets=batch_target_bytes(s.batch, s.seq_len, s.topk, counts.vocab, d, loops),
    )


def plan_memory(counts: ModelCounts, settings: RunSettings) -> MemoryPlan:
    """The :class:`MemoryPlan` of a calibration (module docstring for every formula)."""
    loops = settings.loops or counts.shape.trained_loops
    s, n = settings, settings.processes
    params = counts.shape.parameters
    return MemoryPlan(
        counts=counts,
        settings=settings,
        loops=loops,
        frozen=frozen_bytes(params, counts.frozen, s.teacher_bytes, s.cast_bytes, s.strategy, n),
        loaded=params * s.teacher_bytes,
        quant_params=counts.trainable * 4,
        quant_state=optimizer_bytes(counts.trainable, s.strategy, n, s.param_bytes),
        buckets=bucket_bytes(counts.trainable, s.strategy, s.param_bytes, s.bucket),
        step=training_pass(counts, loops, s),
        clip_init=(
            clip_init_bytes(s.batch * n * s.seq_len, counts.largest_input, counts.largest_group, counts.vocab)
            if s.init_clipping
            else 0
        ),
        target_pass=(
            target_pass_bytes(s.seq_len, counts.vocab, counts.shape.hidden, loops, s.teacher_bytes)
            if s.objective == "trajectory"
            else 0
        ),
        targets=target_bytes(s.samples, s.seq_len, s.topk, counts.vocab, counts.shape.hidden, loops),
        teacher_load=teacher_load_bytes(params, s.teacher_bytes),
    )


def plan_shape(
    hidden: int,
    layers: int,
    loops: int,
    mlp: int,
    heads: int,
    vocab: int,
    batch: int,
    seq_len: int,
    strategy: str = "single",
    checkpoint_loops: bool = False,
    compiled: bool = False,
    precision: str = "32-true",
    teacher_dtype: str = "auto",
    samples: int = 1024,
    processes: int = 1,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    tied: bool = False,
    quant: QuantConfig | None = None,
    on_cpu: bool = True,
) -> MemoryPlan:
    """The plan of an Ouro-shaped teacher given by its dimensions (what a rehearsal at a real shape checks its
    measured memory against); ``teacher_dtype`` auto follows ``precision`` as ``loopq.fit`` does."""
    native = ouro_config(hidden, layers, loops, mlp, heads, vocab, kv_heads, head_dim, tied)
    precision = normalise_precision(precision)
    settings = RunSettings(
        batch=batch,
        seq_len=seq_len,
        samples=samples,
        strategy=strategy,
        processes=processes,
        precision=precision,
        teacher_dtype=resolve_teacher_dtype(teacher_dtype, precision),
        checkpoint_loops=checkpoint_loops,
        compiled=compiled,
        on_cpu=on_cpu,
    )
    return plan_memory(model_counts(native, quant or QuantConfig()), settings)


# ---------------------------------------------------------------------------------------------------- loopq.fit
def settings_from_config(config: Any) -> RunSettings:
    """:class:`RunSettings` of a parsed ``loopq.fit`` config (a jsonargparse namespace)."""
    trainer, model, data = config.trainer, config.model, config.data
    processes = device_count(trainer.devices) * int(trainer.num_nodes or 1)
    precision = normalise_precision(trainer.precision)
    quant = model.quant
    return RunSettings(
        batch=data.batch_size,
        seq_len=data.seq_len,
        samples=data.num_samples,
        topk=model.topk,
        loops=getattr(quant, "num_loops", None) if quant is not None else None,
        strategy=strategy_of(trainer.strategy, processes),
        bucket=bucket_of(trainer.strategy),
        processes=processes,
        precision=precision,
        teacher_dtype=resolve_teacher_dtype(model.teacher_dtype, precision),
        checkpoint_loops=bool(model.checkpoint_loops),
        compiled=bool(model.compile_quantizers),
        on_cpu=runs_on_cpu(trainer.accelerator),
        target_cache=bool(model.target_cache_dir),
        init_clipping=bool(getattr(model, "init_clipping", True)),
        objective=str(getattr(model, "objective", "trajectory")),
    )


def runs_on_cpu(accelerator: Any) -> bool:
    """Whether Lightning will run on the CPU: ``cpu``, or ``auto`` (the default) on a machine without CUDA (it was
    planned as a GPU run there, without the targets that a CPU run holds)."""
    name = str(accelerator or "auto")
    return name == "cpu" or (name == "auto" and not torch.cuda.is_available())


def device_count(devices: Any) -> int:
    """``trainer.devices`` as a count: an int, its string, or a list of indices; ``auto`` / -1 count as 1."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices)
    return int(text) if text.isdigit() and int(text) > 0 else 1


def quant_of(config: Any) -> QuantConfig:
    """The :class:`QuantConfig` of a parsed config's ``model.quant`` (defaults when absent)."""
    quant = config.model.quant
    return QuantConfig(**(vars(quant) if quant is not None else {}))


def plan_from_config(config: Any, plan_config: str | None = None) -> tuple[str, MemoryPlan]:
    """(where the shapes came from, the plan) of a parsed ``loopq.fit`` config, without loading the teacher."""
    source, native = teacher_config(str(config.model.teacher), plan_config)
    return source, plan_memory(model_counts(native, quant_of(config)), settings_from_config(config))


# ---------------------------------------------------------------------------------------------------- printing
def millions(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 10_000 else f"{n:,}"


def size(n: int) -> str:
    """Bytes as GiB (or MiB below one GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def format_plan(plan: MemoryPlan, title: str, source: str) -> str:
    """The plan as a table a user reads before starting (``--print_plan``)."""
    s, c, step = plan.settings, plan.counts, plan.step
    where = "CPU memory (host and device are one)" if s.on_cpu else "per GPU"
    head = f"  {where:<58}{'training step':>16}"
    lines = [
        f"LoopQ memory plan: {title}   (shapes: {source}; nothing loaded)",
        f"  teacher: {c.shape.parameters / 1e6:.1f}M parameters, hidden {c.shape.hidden}, {plan.loops} loops "
        f"(trained {c.shape.trained_loops}), vocab {c.vocab}",
        f"  run: {s.strategy} x {s.processes}, {s.precision}, teacher {s.teacher_dtype}, checkpoint_loops "
        f"{on(s.checkpoint_loops)}, compile_quantizers "
        f"{on(s.compiled)}, batch {s.batch} x {s.seq_len} per process",
        *(
            [
                f"  model.objective {s.objective}: planned as the trajectory objective (teacher targets, logits); the "
                "layer-wise objective runs the teacher live instead"
            ]
            if s.objective != "trajectory"
            else []
        ),
        head,
    ]
    rows = [
        (f"frozen teacher weights ({s.teacher_dtype}, shared with the student)", plan.frozen),
        (f"quantization params + grads + AdamW ({millions(c.trainable)})", plan.quant_state),
        *([(f"DeepSpeed gradient buckets ({bucket_label(s.bucket)})", plan.buckets)] if plan.buckets else []),
        ("fake-quant weights kept for the forward (no graph)", step.weights),
        (f"activations ({'layer inputs: ' if s.checkpoint_loops else ''}{plan.loops} loops)", step.kept),
    ]
    if s.checkpoint_loops:
        rows.append(("one layer recomputed (with the next row, if the larger)", step.recompute))
    rows += [
        ("one use's backward: weight chain + its gradient", step.use),
        ("logits and loss as the backward starts (if the largest)", step.logits),
        ("the batch's teacher targets", step.targets),
    ]
    if s.on_cpu:
        rows.append(("all teacher targets (in memory)", plan.targets))
    rows.append(("total", plan.phases["training step"]))
    lines += [f"    {name:<56}{size(value):>16}" for name, value in rows]
    lines += [
        f"  setup (teacher as loaded, streamed LAS clip initialisation or teacher targets): "
        f"{size(plan.phases['setup'])}",
        f"  PEAK {where}: {size(plan.peak)} ({plan.peak_phase})",
    ]
    if not s.on_cpu:
        lines.append(
            f"  host memory per process: teacher targets {size(plan.targets)}, teacher while "
            f"loading {size(plan.teacher_load)}"
        )
    kept = "" if s.target_cache else " (model.target_cache_dir unset: they stay in memory only)"
    r = c.report
    lines += [
        f"  teacher-target cache on disk: {size(plan.targets)}{kept}",
        f"  trainable quantization parameters: {millions(c.trainable)}; Table 5: shared {millions(r.shared)}, "
        f"loop-dependent {millions(r.loop_dependent)} ({100 * r.loop_dependent_ratio:.3f} %), with SLT's "
        f"{c.promoted_groups} largest groups promoted",
    ]
    return "\n".join(lines)


def bucket_label(bucket: int | None) -> str:
    return "sized to the parameters" if bucket is None else f"reduce_bucket_size {bucket:.2g}"


def on(flag: bool) -> str:
    return "on" if flag else "off"
