"""Checks that run in the first seconds of a command, before any work: never write over what a run reads, and never
start a loop count whose memory the machine does not have.

**Outputs.** A model directory is checked by :func:`loopq.artifacts.layout.check_output_dir` (the artifact layer
knows what each kind of model directory holds).
A run directory (``trainer.default_root_dir``, :func:`check_run_root`) holds logs and stage folders rather than a
model: it may contain the teacher (the working directory, Lightning's default, usually does) but may not be it,
be inside it, or be a model directory, and the folders a run writes (``checkpoints/``, ``student/``, ...) may not
hold the teacher. A result file (:func:`check_output_file`: ``evaluate --out``, ``examine --json``) may replace only an
earlier one of its command.

**Loop count** (:func:`check_loop_memory`). A student calibrated over T loops keeps every loop's activations for
the backward pass, and the teacher targets keep every loop's state of every calibration sample:

    activations  = batch x seq_len x hidden x T x dtype_bytes x factor          (:func:`activation_bytes`)
    trajectories = num_samples x seq_len x hidden x T x 2 (fp16)                (:func:`trajectory_bytes`)

``factor`` (:func:`activation_factor`) counts the hidden-sized tensors autograd keeps per token per loop, read off
the model's looped linear groups and norms. A loop count above twice the trained one gets a warning with the
estimate; an estimate above the available memory is refused unless ``LOOPQ_ALLOW_LOW_MEMORY=1``. Decoding
(:func:`check_decode_loops`) refuses more than :data:`MAX_DECODE_LOOP_FACTOR` x the trained loops, or a KV cache
beyond the free memory. The model these estimates read is built on the meta device only after its config passed
:mod:`loopq.models.config_checks` (types, layer count and shapes against the weight files' headers).

**Zero or negative work** (:func:`check_steps`, :func:`check_optimiser`, :func:`check_strategy`): trainer settings
under which no optimizer step runs, non-positive or non-finite learning rates, and unknown strategy names are refused
before the teacher loads; so is a tokenizer producing ids the model has no row for (:func:`check_tokenizer_vocab`).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loopq.artifacts.layout import check_output_dir, json_object, local_dirs, model_kind, relation
from loopq.data.calibration import calibration_stream, check_enough_tokens
from loopq.errors import GuardError, LoopLMError, UsageError, article
from loopq.files import in_the_way
from loopq.models.base import LoopLM, RMSNorm
from loopq.models.config_checks import check_against_header
from loopq.models.loading import architecture_for, read_config

#: what a run writes under ``trainer.default_root_dir`` (loopq.fit and loopq.run)
RUN_OUTPUTS = ("checkpoints", "student", "exported", "results", "report", "csv", "lightning_logs", "pipeline.json")
#: the folders among them
RUN_FOLDERS = tuple(name for name in RUN_OUTPUTS if name != "pipeline.json")
ALLOW_LOW_MEMORY = "LOOPQ_ALLOW_LOW_MEMORY"
#: tensors of a group's input size that its fake-quant chain keeps for backward: the input, the diagonal-scaled
#: and the two Kronecker-rotated copies, per-token absmax, scaled, rounded (STE), clamp mask, quantized input
SAVED_PER_GROUP_INPUT = 8
#: tensors of hidden size an RMSNorm keeps for backward (its input and the normalised input)
SAVED_PER_NORM = 2


# ---------------------------------------------------------------------------------------------------- outputs
def check_run_root(
    root: str | os.PathLike[str], teacher: str | os.PathLike[str] | None, key: str = "--trainer.default_root_dir"
) -> Path:
    """A run directory must not be the teacher, lie inside it or be a model directory, none of the folders a run
    writes there (:data:`RUN_OUTPUTS`) may hold the teacher, and none may be a file or a link to nothing; returns
    ``root``."""
    root = Path(root)
    problem = in_the_way(root)
    if problem is not None:
        raise GuardError(f"{key} {root}: {problem}")
    for read in local_dirs([teacher]):
        how = relation(root, read)
        if how in ("is", "is inside"):
            raise GuardError(f"{key} {root}: {how} the teacher directory {read}; pass another directory")
        for name in RUN_OUTPUTS:
            if relation(root / name, read) is not None:
                raise GuardError(
                    f"{key} {root}: the run writes {root / name}, which holds the teacher {read}; "
                    "pass another directory"
                )
    kind = model_kind(root)
    if kind is not None:
        raise GuardError(f"{key} {root}: is {article(kind)} directory; pass a separate run directory")
    for name in RUN_FOLDERS:  # a file there failed (FileExistsError) only when the run wrote it, after the work
        problem = in_the_way(root / name)
        if problem is not None:
            raise GuardError(f"{key} {root}: the run writes its {name}/ folder there, but {problem}")
    return root


def check_writable(path: str | os.PathLike[str], key: str, named: str | os.PathLike[str] | None = None) -> Path:
    """The directory ``path`` (or the nearest part of it that exists, where it would be created) accepts a new file:
    tried with a temporary file, so a read-only folder or filesystem is refused before any work, not after it.
    ``named``: what the message calls the output (a file in ``path``), default ``path``."""
    path = Path(path)
    named = path if named is None else named
    problem = in_the_way(path)
    if problem is not None:
        raise GuardError(f"{key} {named}: {problem}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise GuardError(
            f"{key} {named}: {existing} is not writable ({err.strerror or err}); pass a directory you can write to"
        ) from None
    return path


def is_result(path: Path) -> bool:
    """Whether ``path`` is a results JSON of ``loopq.evaluate`` (the only file an evaluation may replace)."""
    data = json_object(path)
    return "method" in data and "wikitext2_ppl" in data


def is_examined(path: Path) -> bool:
    """Whether ``path`` is the numbers JSON of ``loopq.examine --json`` (the only file a later one may replace)."""
    data = json_object(path)
    return "student" in data and "knock_outs" in data


def check_output_file(
    out: str | os.PathLike[str],
    reads: Iterable[str | os.PathLike[str] | None] = (),
    key: str = "--out",
    ours: Callable[[Path], bool] = is_result,
    what: str = "loopq.evaluate result",
) -> Path:
    """A result file may not be a directory, lie in or beside a model (any :func:`model_kind`, or a directory the
    command reads), or replace an existing file other than an earlier result (``ours``: the command's own kind of
    file, ``what`` it is called); returns ``out``."""
    out = Path(out)
    if out.is_dir():
        raise GuardError(f"{key} {out}: is a directory; pass a file path such as {out / 'result.json'}")
    for read in local_dirs(reads):
        if relation(out, read) is not None:
            raise GuardError(f"{key} {out}: lies inside {read}, which this command reads; pass another path")
    kind = model_kind(out.parent)
    if kind is not None:
        raise GuardError(f"{key} {out}: {out.parent} is {article(kind)} directory; write results elsewhere")
    if out.exists() and not ours(out):
        raise GuardError(f"{key} {out}: exists and is not {article(what)}; pass a new path")
    check_writable(out.parent, key, named=out)
    return out


# ---------------------------------------------------------------------------------------------------- loop count
@dataclass(frozen=True)
class LoopShape:
    """What the memory of one calibration loop depends on, read off the model (:func:`loop_shape`)."""

    hidden: int
    trained_loops: int
    group_inputs: int  # sum of in_features over the looped linear groups (all shared layers)
    group_outputs: int  # sum of out_features over the same groups
    norms: int  # RMSNorm / LayerNorm modules inside the shared layers
    parameters: int


def loop_shape(model: LoopLM) -> LoopShape:
    """The :class:`LoopShape` of a model (build it on the meta device: nothing is allocated)."""
    groups = model.linear_groups()
    looped = [groups[name] for name in model.looped_group_names()]
    linears = [lin for group in looped for lin in group.children()]
    return LoopShape(
        hidden=model.state_dim,
        trained_loops=model.default_num_loops,
        group_inputs=sum(group.in_features for group in looped),
        group_outputs=sum(lin.out_features for lin in linears),
        norms=sum(isinstance(m, (RMSNorm, nn.LayerNorm)) for m in model.loop_layers.modules()),
        parameters=sum(p.numel() for p in model.parameters()),
    )


def activation_factor(shape: LoopShape) -> float:
    """Hidden-sized tensors that autograd keeps per token per loop of the student's forward.

    Each looped group's fake-quant chain keeps :data:`SAVED_PER_GROUP_INPUT` copies of its input, its outputs are
    kept once by the ops that consume them (RoPE, attention, the MLP gate, the residual), and each RMSNorm keeps
    :data:`SAVED_PER_NORM`. The tiny Ouro teacher (2 layers, hidden 128, groups 3x128 + 384 in, 1280 out per layer,
    4 norms per layer) gives (8 x 768 + 1280 + 2 x 4 x 128) x 2 / 128 = 132; autograd's saved tensors measure 132.4
    (and the estimate is within 4 % for the Ouro, LoopFormer and Parcae test fixtures as well).
    """
    quantizers = SAVED_PER_GROUP_INPUT * shape.group_inputs + shape.group_outputs
    return (quantizers + SAVED_PER_NORM * shape.norms * shape.hidden) / shape.hidden


def activation_bytes(batch: int, seq_len: int, hidden: int, loops: int, dtype_bytes: int, factor: float) -> int:
    """Activation memory of one calibration step: batch x seq_len x hidden x loops x dtype_bytes x factor."""
    return math.ceil(batch * seq_len * hidden * loops * dtype_bytes * factor)


def trajectory_bytes(samples: int, seq_len: int, hidden: int, loops: int, dtype_bytes: int = 2) -> int:
    """The teacher targets' loop states (``TeacherTargets.states``, fp16), held in memory while they are built."""
    return samples * seq_len * hidden * loops * dtype_bytes


def available_memory() -> int | None:
    """Bytes the machine can still give (``MemAvailable``); None where it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass(frozen=True)
class LoopPlan:
    """A calibration's loop count and the memory it needs (:func:`loop_plan`)."""

    loops: int
    trained_loops: int
    activations: int
    trajectories: int
    weights: int

    @property
    def total(self) -> int:
        return self.activations + self.trajectories + self.weights

    def describe(self) -> str:
        return (
            f"about {gib(self.total)} (activations {gib(self.activations)}, teacher trajectories "
            f"{gib(self.trajectories)}, weights {gib(self.weights)})"
        )


def loop_plan(
    shape: LoopShape,
    loops: int | None,
    batch: int,
    seq_len: int,
    samples: int,
    dtype_bytes: int = 4,
    checkpoint_loops: bool = False,
) -> LoopPlan:
    """The memory a calibration of ``loops`` loops (None: the trained count) needs. With ``checkpoint_loops`` only
    one loop's activations are alive at a time (each loop keeps just its input state)."""
    loops = loops or shape.trained_loops
    factor = activation_factor(shape)
    if checkpoint_loops:
        acts = activation_bytes(batch, seq_len, shape.hidden, 1, dtype_bytes, factor)
        acts += activation_bytes(batch, seq_len, shape.hidden, loops, dtype_bytes, 1.0)
    else:
        acts = activation_bytes(batch, seq_len, shape.hidden, loops, dtype_bytes, factor)
    weights = 2 * shape.parameters * 4  # the fp32 teacher, and the student's fake-quantized copies
    return LoopPlan(loops, shape.trained_loops, acts, trajectory_bytes(samples, seq_len, shape.hidden, loops), weights)


def check_loop_plan(
    plan: LoopPlan, host_free: int | None, device_free: int | None = None, key: str = "model.quant.num_loops"
) -> None:
    """Warn (stderr) when ``plan.loops`` is more than twice the trained count; refuse a plan that does not fit
    (``device_free``: the accelerator's free memory, which then holds activations and weights; the trajectories
    stay in host memory) unless ``LOOPQ_ALLOW_LOW_MEMORY=1``."""
    if plan.loops > 2 * plan.trained_loops:
        print(
            f"[loopq] warning: {key}={plan.loops} is {plan.loops / plan.trained_loops:.0f}x the teacher's trained "
            f"{plan.trained_loops} loops; the calibration needs {plan.describe()}",
            file=sys.stderr,
            flush=True,
        )
    if os.environ.get(ALLOW_LOW_MEMORY) == "1":
        return
    on_device = plan.activations + plan.weights
    if device_free is not None and on_device > device_free:
        short = f"{gib(on_device)} on the accelerator but only {gib(device_free)} is free there"
    elif host_free is not None and plan.total - (on_device if device_free is not None else 0) > host_free:
        short = f"{plan.describe()} but only {gib(host_free)} of memory is free"
    else:
        return
    raise GuardError(
        f"{key}={plan.loops}: the calibration needs {short}; lower {key} (trained: {plan.trained_loops}), "
        f"data.batch_size or data.seq_len, set model.checkpoint_loops true, or set {ALLOW_LOW_MEMORY}=1 to start anyway"
    )


def device_memory(accelerator: str | None) -> int | None:
    """Free bytes of the CUDA device a run will use (None on CPU)."""
    if str(accelerator or "auto") not in ("auto", "gpu", "cuda") or not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])


def meta_teacher(teacher: str | os.PathLike[str]) -> LoopLM | None:
    """A local teacher directory's model built on the meta device (nothing allocated, no weight read), after its
    config.json values are type-checked and the config is checked against the weight files' headers - layer count
    first, so that a config claiming a million layers is refused before any is built
    (:mod:`loopq.models.config_checks`); None for a hub id or a path that is not a model: the loader reports those."""
    directory = Path(teacher)
    if not (directory / "config.json").is_file():
        return None
    config = read_config(directory)
    cls = architecture_for(config, str(directory / "config.json"))
    config_obj = cls.config_from_dict(config)
    check_against_header(cls, config_obj, directory)
    with torch.device("meta"):
        return cls(config_obj)


def teacher_shape(teacher: str | os.PathLike[str]) -> LoopShape | None:
    """:func:`loop_shape` of a local teacher directory (:func:`meta_teacher`), or None."""
    model = meta_teacher(teacher)
    return None if model is None else loop_shape(model)


#: a decode loop count beyond this multiple of the trained count is refused: each token runs every loop (time and KV
#: cache grow linearly) far past anything the model was trained or calibrated for
MAX_DECODE_LOOP_FACTOR = 16


def check_decode_loops(model: LoopLM, loops: int | None, tokens: int, key: str = "--num_loops") -> None:
    """Before decoding: a loop count more than :data:`MAX_DECODE_LOOP_FACTOR` x the trained one, or whose KV cache
    (loops x layers x tokens x 2 x hidden x 4 bytes, an upper bound) does not fit the free memory, is refused
    unless ``LOOPQ_ALLOW_LOW_MEMORY=1``."""
    if loops is None or os.environ.get(ALLOW_LOW_MEMORY) == "1":
        return
    trained = model.default_num_loops
    layers = len(model.loop_layers) if hasattr(model.loop_layers, "__len__") else 1
    cache = loops * layers * tokens * 2 * model.state_dim * 4
    free = available_memory()
    if loops > MAX_DECODE_LOOP_FACTOR * trained or (free is not None and cache > free):
        raise GuardError(
            f"{key} {loops}: {loops / trained:.0f}x the model's trained {trained} loops - every token would run "
            f"{loops} loops (a KV cache of up to {gib(cache)}, and {loops / trained:.0f}x the time); pass at most "
            f"{MAX_DECODE_LOOP_FACTOR * trained}, or set {ALLOW_LOW_MEMORY}=1 to run it anyway"
        )


def check_tokenizer_vocab(tokenizer: str | os.PathLike[str], model: LoopLM, key: str = "data.tokenizer") -> None:
    """A tokenizer may not produce ids the model has no embedding row for (an ``IndexError`` deep in calibration
    setup otherwise); a smaller tokenizer vocabulary (padded embedding tables) is fine."""
    from loopq.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    ids = tok.get_vocab_size(with_added_tokens=True)
    rows = int(model.lm_head.weight.shape[0])  # the logits' rows: every id the tokenizer produces needs one
    if ids > rows:
        where = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        raise GuardError(
            f"{where}: produces ids up to {ids - 1} but the model's vocabulary has {rows} rows ({key}); pass the "
            "tokenizer the model was trained with"
        )


def check_positions(model: LoopLM, length: int, key: str, what: str = "the model") -> None:
    """A sequence-length option may not exceed the positions ``model`` has (RoPE table / position embeddings)."""
    if length > model.max_positions:
        raise UsageError(
            f"{key} {length}: longer than the {model.max_positions} positions {what} has (its config.json); pass "
            f"{key} {model.max_positions} or less"
        )


# ---------------------------------------------------------------------------------------------------- loopq.fit
def check_schedule(max_steps: int | None, warmup_steps: int) -> None:
    """The calibration's cosine schedule runs over ``trainer.max_steps``: it must be a step count (-1, Lightning's
    "no limit", would train 1000 epochs with the learning rate at 0 after step 1; 0 trains nothing), and the warm-up
    must end before it."""
    if max_steps is None or max_steps < 1:
        raise UsageError(
            f"--trainer.max_steps {max_steps}: the calibration's learning-rate schedule runs over trainer.max_steps, "
            "so it must be 1 or more (configs/tiny.yaml uses 300)"
        )
    if not 0 <= warmup_steps < max_steps:
        raise UsageError(
            f"--model.warmup_steps {warmup_steps}: must be >= 0 and below --trainer.max_steps {max_steps}, or the "
            "schedule never leaves its warm-up"
        )


def check_optimiser(model: Any) -> None:
    """Learning rates must be finite and positive (a negative one calibrates by gradient ascent: the loss rises
    while the run reports success), weight decay and the loss weight ``lam`` finite and non-negative, the
    distillation temperature finite and positive, ``topk`` a count (0 switched the logit term off silently)."""
    rules = (
        ("lr", "a finite number > 0 (configs/tiny.yaml uses 0.005)", lambda v: v > 0),
        ("clip_lr_mult", "a finite number > 0 (the clipping ratios' lr is clip_lr_mult x lr)", lambda v: v > 0),
        ("weight_decay", "a finite number >= 0", lambda v: v >= 0),
        ("lam", "a finite number >= 0 (the weight of Eq. 8's state terms)", lambda v: v >= 0),
        ("temperature", "a finite number > 0", lambda v: v > 0),
        ("topk", "a whole number >= 1 (the teacher logits the KL keeps; the configs use 1000)",
         lambda v: v >= 1 and float(v).is_integer()),
    )  # fmt: skip
    check_numbers(model, rules)


#: (key, what it must be, the test of a finite value)
NumberRule = tuple[str, str, Callable[[float], bool]]


def check_numbers(model: Any, rules: Iterable[NumberRule]) -> None:
    """Each ``--model.<key>`` of ``rules`` that ``model`` sets is a finite number passing its test; the first that is
    not is refused naming the option, its value and what it must be."""
    for key, must, ok in rules:
        value = getattr(model, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            reason = "not finite" if isinstance(value, float) and not math.isfinite(value) else "out of range"
            raise UsageError(f"--model.{key} {value}: {reason}; it must be {must}")


def check_choices(config: Any) -> None:
    """Options the calibration module and data module would refuse only once the teacher is loaded: refused first,
    in the same words (``model.objective``, ``model.state_reduction``, ``data.holdout_samples``)."""
    from loopq.calib.losses import STATE_REDUCTIONS
    from loopq.calib.module import OBJECTIVES

    model, data = config.model, config.data
    for key, allowed in (("objective", OBJECTIVES), ("state_reduction", STATE_REDUCTIONS)):
        value = getattr(model, key, None)
        if value is not None and value not in allowed:
            raise UsageError(f"model.{key}={value!r}: use one of {allowed}")
    holdout = getattr(data, "holdout_samples", 0)
    if isinstance(holdout, int) and holdout < 0:
        raise UsageError(f"data.holdout_samples={holdout}: a count of held-out windows, 0 or more")


def zero_duration(value: Any) -> bool:
    """Whether a ``trainer.max_time`` (``"DD:HH:MM:SS"``, a dict of timedelta fields, a timedelta) is no time."""
    if isinstance(value, str):
        try:
            return all(float(part) == 0 for part in value.split(":"))
        except ValueError:
            return False
    if isinstance(value, dict):
        return all(not v for v in value.values())
    return hasattr(value, "total_seconds") and value.total_seconds() <= 0


def check_steps(trainer: Any) -> None:
    """Refuse, before any work, every trainer setting under which not one optimizer step would run (the run would
    otherwise report a calibrated student that is the untrained initialisation): ``max_epochs 0``,
    ``limit_train_batches`` 0 (or a fraction of the ``max_steps`` batches that rounds to none), ``max_time`` 0; and
    gradient accumulation, which would feed the step-counted sample order twice (a review saw samples used 2-4x)."""
    epochs = getattr(trainer, "max_epochs", None)
    if epochs == 0:
        raise UsageError(
            "--trainer.max_epochs 0: no optimizer step would run; leave it unset (the calibration runs "
            "for --trainer.max_steps) or pass 1 or more"
        )
    limit = getattr(trainer, "limit_train_batches", None)
    steps = getattr(trainer, "max_steps", None) or 0
    if limit is not None and not isinstance(limit, bool) and isinstance(limit, (int, float)):
        batches = int(limit * steps) if isinstance(limit, float) and limit <= 1 else int(limit)
        if batches < 1:
            raise UsageError(
                f"--trainer.limit_train_batches {limit}: no training batch would run (of "
                f"--trainer.max_steps {steps}); leave it unset or pass 1.0"
            )
    if getattr(trainer, "max_time", None) is not None and zero_duration(trainer.max_time):
        raise UsageError(f"--trainer.max_time {trainer.max_time}: no time to train; leave it unset or give a duration")
    devices = getattr(trainer, "devices", None)
    if devices in (0, "0") or devices == []:
        raise UsageError(f"--trainer.devices {devices}: no device to run on; pass 1 or more (or auto)")
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        raise UsageError(
            f"--trainer.accumulate_grad_batches {accumulate}: calibration takes one batch per optimizer step (its "
            "sampler, SLT's gradient recording and the mu_t schedule count optimizer steps); leave it at 1 and raise "
            "--data.batch_size or the number of processes for a larger batch"
        )


def check_strategy(trainer: Any) -> None:
    """A ``trainer.strategy`` given by name must be one Lightning knows (a misspelt one, ``dpp``, ended in
    Lightning's traceback after the teacher loaded); the closest names are suggested."""
    import difflib

    from lightning.pytorch.strategies import StrategyRegistry

    strategy = getattr(trainer, "strategy", None)
    if not isinstance(strategy, str):
        return
    known = ["auto", *StrategyRegistry.available_strategies()]
    if strategy not in known:
        close = difflib.get_close_matches(strategy, known, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise UsageError(
            f"--trainer.strategy {strategy}: not a strategy Lightning knows; {hint}(names: auto, ddp, ddp_spawn, "
            "deepspeed_stage_2, ... or a class_path such as loopq.calib.deepspeed.LoopQDeepSpeedStrategy)"
        )


def check_student_choice(config: Any) -> None:
    """``model.student_from: best`` needs held-out validation, a ``ModelCheckpoint`` that monitors it, and a
    checkpoint that is one file (not DeepSpeed's directory)."""
    if getattr(config.model, "student_from", "last") != "best":
        return
    key = "--model.student_from best"
    if not (config.data.val_samples or config.data.val_sources):
        raise UsageError(f"{key}: nothing is validated; set --data.val_samples N (docs/usage.md, held-out validation)")
    callbacks = config.trainer.callbacks or []
    monitored = [
        cb for cb in callbacks
        if str(getattr(cb, "class_path", "")).endswith("ModelCheckpoint")
        and (getattr(cb, "init_args", None) or {}).get("monitor")
    ]  # fmt: skip
    if not monitored:
        raise UsageError(
            f"{key}: no ModelCheckpoint in trainer.callbacks monitors a validation metric; add one with "
            "monitor: val/heldout/kl_full (docs/usage.md)"
        )
    monitors = [str(cb.init_args["monitor"]) for cb in monitored]
    if len(monitors) > 1:
        raise UsageError(
            f"{key}: several ModelCheckpoints monitor a metric ({', '.join(monitors)}); keep the one to choose by"
        )
    if not monitors[0].startswith("val/"):
        raise UsageError(f"{key}: the ModelCheckpoint monitors {monitors[0]}, not a validation metric (val/...)")
    strategy = config.trainer.strategy
    name = str(getattr(strategy, "class_path", strategy)).lower()
    if "deepspeed" in name:
        raise UsageError(f"{key}: not under DeepSpeed (its checkpoints are directories); use --model.student_from last")


def check_calibration_text(data: Any) -> None:
    """The calibration text holds enough tokens for the requested windows (:func:`~loopq.data.calibration.
    check_enough_tokens`), checked before the teacher loads when every source is a local file (an ``hf:`` source
    is downloaded, and checked, when the data module is set up); the stream stays cached for that setup."""
    if any(str(spec).startswith("hf:") for spec in data.sources or ()):
        return
    stream = calibration_stream(data.tokenizer, data.sources, data.root)
    check_enough_tokens(stream.numel(), data.num_samples, data.holdout_samples, data.seq_len)


def is_hub_id(teacher: str) -> bool:
    """``org/name`` that is not a local path: the loader fetches it from the hub
    (:func:`loopq.models.loading.resolve_model_dir`'s rule)."""
    return not Path(teacher).exists() and teacher.count("/") == 1 and not teacher.startswith((".", "/"))


def check_local_teacher(teacher: str) -> None:
    """A local ``model.teacher`` is a model directory (a folder with ``config.json``), checked before anything reads
    the run directory: a student left there by an earlier run would otherwise be compared against the missing
    teacher and the message would name the run directory, not the teacher. A hub id is left to the loader."""
    if is_hub_id(teacher):
        return
    directory = Path(teacher)
    if not directory.is_dir():
        raise LoopLMError(f"{directory}: not a directory; pass the folder holding config.json and the weights")
    read_config(directory)  # no (or unreadable) config.json: one line naming it


def check_calibration(config: Any) -> None:
    """Everything :mod:`loopq.fit` (and :mod:`loopq.run`) checks on its parsed config before building anything:
    the schedule, the step count, the optimiser settings and the strategy name, the run, student and target-cache
    directories against the teacher, then :func:`check_against_teacher`."""
    check_schedule(config.trainer.max_steps, config.model.warmup_steps)
    check_steps(config.trainer)
    check_optimiser(config.model)
    check_choices(config)
    check_strategy(config.trainer)
    check_student_choice(config)
    teacher = str(config.model.teacher)
    root = Path(config.trainer.default_root_dir or os.getcwd())
    check_run_root(root, teacher)
    check_writable(root, "--trainer.default_root_dir")
    if config.model.output_dir:
        check_output_dir(config.model.output_dir, [teacher], "--model.output_dir", replaces=("student",))
        check_writable(config.model.output_dir, "--model.output_dir")
    else:  # the run's own student folder: replaced only when a sealed student (or its write journal) is there
        check_output_dir(root / "student", [teacher], "--trainer.default_root_dir", replaces=("student",))
    cache = config.model.target_cache_dir
    for read in local_dirs([teacher] if cache else []):  # a cache file there would change the teacher's fingerprint
        how = relation(Path(cache), read)
        if how in ("is", "is inside"):
            raise GuardError(f"--model.target_cache_dir {cache}: {how} the teacher {read}; pass another directory")
    model = meta_teacher(teacher)
    if model is not None:
        check_against_teacher(config, model)


def activation_dtype_bytes(precision: str) -> int:
    """Bytes per element of what a ``trainer.precision`` keeps for backward: 2 under ``bf16-true`` / ``16-true``, 8
    under ``64`` / ``64-true``, else 4 (``32``, ``32-true``, and mixed precision, which keeps the quantizer chains in
    fp32). Reading any ``*-true`` as 2 bytes halved fp32's estimate and quartered float64's."""
    if precision in ("bf16-true", "16-true"):
        return 2
    return 8 if precision in ("64", "64-true") else 4


def check_against_teacher(config: Any, model: LoopLM) -> None:
    """For a local teacher (``model``: built on the meta device): ``data.seq_len`` against its positions, the loop
    count against the memory, and the calibration text against the windows asked for."""
    check_positions(model, config.data.seq_len, "--data.seq_len", f"the teacher {config.model.teacher}")
    check_tokenizer_vocab(config.data.tokenizer or config.model.teacher, model)
    quant = config.model.quant
    precision = str(getattr(config.trainer, "precision", None) or "32")
    plan = loop_plan(
        loop_shape(model),
        getattr(quant, "num_loops", None) if quant is not None else None,
        batch=config.data.batch_size,
        seq_len=config.data.seq_len,
        samples=config.data.num_samples,
        dtype_bytes=activation_dtype_bytes(precision),
        checkpoint_loops=bool(config.model.checkpoint_loops),
    )
    check_loop_plan(plan, available_memory(), device_memory(getattr(config.trainer, "accelerator", None)))
    check_calibration_text(config.data)
