"""The calibration ``LightningModule``: frozen FP teacher, fake-quant LoopQ student, trajectory-aware loss.

``training_step`` is thin: look up the teacher's cached targets for the batch's sample indices, run the student
over the true recurrence (its own quantized states feed the next loop), and evaluate the pure loss of
:mod:`loopq.calib.losses`.

The method's schedules have one home, the callbacks' arguments: :meth:`configure_callbacks` makes sure the
adaptive mu_t update (:class:`loopq.calib.mu.AdaptiveMu`) runs unless ``adaptive_mu`` is off, and the progressive
sharing-gap reselection (:class:`loopq.calib.reselection.SharingGapReselection`) whenever ``quant.slt_budget > 0``
- each with its own default schedule when the config's ``trainer.callbacks`` does not list it, so a YAML without a
``callbacks:`` block still runs the whole method; a listed one (its ``init_args``) is used as it is. Switching a
component off is a config switch recorded with the student: ``quant.slt_budget: 0``,
``quant.las: false``, ``quant.cta: false``, ``model.adaptive_mu: false``. Optional callbacks (per-loop
diagnostics, progress lines, :mod:`loopq.calib.diagnostics`, :mod:`loopq.calib.line_progress`) stay in the trainer's
list.

``objective`` selects the loss: ``trajectory`` (LoopQ's Eq. 8 over the true recurrence; with ``lam: 0`` the plain
logit KL that SpinQuant trains on) or ``layerwise`` (FlatQuant's recipe: every decoder layer's quantized output
against the FP output given the FP input, a shared layer once per loop; see :func:`~loopq.calib.losses.layerwise_loss`).
The training-free baselines (``quant.method`` rtn, smoothquant, quarot) are rejected here: build them with
:func:`loopq.quant.prepare.prepare_static`.

Optimisation follows FlatQuant / paper Table 6: AdamW, transforms and adapters at ``lr``, clipping ratios at
``clip_lr_mult * lr``, cosine schedule, gradient clipping 1.0 (set on the Trainer).

Speed and memory switches: ``checkpoint_loops`` checkpoints every (loop, layer) call: only each layer's input is
kept and the backward recomputes one layer at a time (memory nearly flat in the loop count and the depth);
``compile_quantizers`` runs the per-call transform + fake-quant chains as ``torch.compile``-d functions
(:mod:`loopq.quant.fused`: ~4x faster chains, ~20-45 s of compilation per shape, so for real calibrations). The
weight side needs no switch: every quantized use sends its weight gradient through its chain at once and keeps
nothing weight-sized for backward (the per-use backward, :mod:`loopq.quant.modules`).

Precision policy (``teacher_dtype``, README "Calibrating a real looped model"): the frozen teacher is held in
``teacher_dtype`` - ``bf16``, ``fp32``, or ``auto`` = bf16 when ``trainer.precision`` is a bf16 one (``loopq.fit``
resolves it from the trainer; a module built directly treats ``auto`` as fp32). ``prepare`` *shares* the teacher's
tensors with the student (its frozen weights are the teacher's storage, not a copy), so the teacher's dtype is the
frozen weights' dtype and a bf16 teacher halves what both take. The quantization parameters (transforms, clips,
adapters) are created in fp32 whatever the teacher's dtype, and so are AdamW's states (Lightning's ``bf16-mixed`` is
autocast: it casts no parameter). The training step runs under autocast: the quantizer chains take fp32 copies of
their inputs and weights (:func:`loopq.qspec.at_least_fp32`) and run their transforms with autocast off, in fp32
as the export does (:mod:`loopq.quant.transforms`, "Autocast"); the quantized matmuls run in bf16 and the loss is
computed in fp32. The teacher targets are stored in fp16 (:mod:`loopq.calib.targets`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from loopq.artifacts.student import fixed_layout_only, stored_tensors, student_meta, write_student
from loopq.calib.checkpoint_io import load_weights_only
from loopq.calib.deepspeed import gathered, is_zero3
from loopq.calib.losses import STATE_REDUCTIONS, layerwise_loss, loopq_loss
from loopq.calib.targets import TeacherTargets, load_or_compute
from loopq.calib.validation import VAL_SETS, ValidationMetrics, measure
from loopq.data.text import DataError
from loopq.errors import UsageError
from loopq.models import LoopLM, load_looplm
from loopq.models.loading import resolve_model_dir
from loopq.provenance import record, teacher_fingerprint
from loopq.quant import (
    GroupOptions,
    QuantConfig,
    init_clipping_from_data,
    init_diagonal_from_data,
    prepare,
    quant_groups,
    quant_parameters,
)
from loopq.quant.accounting import parameter_report
from loopq.quant.config import METHODS, QuantConfigError
from loopq.quant.prepare import apply_tied, frozen_names

OBJECTIVES = ("trajectory", "layerwise")
#: ``model.teacher_dtype`` -> the dtype of the frozen teacher (and of the student's frozen weights, which it shares)
TEACHER_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Trajectory:
    """Loop states ``[B, S, D]`` per loop of one batch: the FP teacher's and the student's."""

    teacher_states: list[Tensor]
    student_states: list[Tensor]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; calibration stops and the last good checkpoint is kept."""


class LoopQCalibration(L.LightningModule):
    """LoopQ calibration of a looped LM (see module docstring)."""

    def __init__(
        self,
        teacher: str,
        quant: QuantConfig | None = None,
        lam: float = 0.1,
        state_reduction: str = "mean",
        temperature: float = 1.0,
        topk: int = 1000,
        lr: float = 5e-3,
        clip_lr_mult: float = 10.0,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        init_clipping: bool = True,
        checkpoint_loops: bool = False,
        compile_quantizers: bool = False,
        teacher_dtype: str = "auto",
        target_cache_dir: str | None = None,
        output_dir: str | None = None,
        objective: str = "trajectory",
        adaptive_mu: bool = True,
        student_from: Literal["last", "best"] = "last",
    ) -> None:
        """Load the teacher and prepare its fake-quant student.

        Args:
            teacher: teacher model directory (config.json, weights, tokenizer) or hub id
            quant: the quantization config (bits, group size, LAS, SLT, CTA; loopq.quant.QuantConfig)
            lam: weight of the trajectory terms against the top-k logit KL (Eq. 8; 0: logit KL only)
            state_reduction: how d(a, b) reduces the hidden dimension: mean or sum
            temperature: temperature of the top-k logit KL
            topk: teacher logits kept per token for the KL (the cached targets)
            lr: learning rate of the transforms and adapters
            clip_lr_mult: the clipping ratios' learning rate as a multiple of lr
            weight_decay: AdamW weight decay
            warmup_steps: linear warm-up steps before the cosine schedule
            init_clipping: initialise the LAS clipping ratios from the first batch's activations
            checkpoint_loops: recompute every (loop, layer) call in the backward (less memory, more time)
            compile_quantizers: run the transform + fake-quant chains torch.compile-d (faster after compiling)
            teacher_dtype: dtype of the frozen teacher: bf16, fp32, or auto (bf16 under a bf16 trainer.precision)
            target_cache_dir: folder caching the teacher's targets on disk (default: computed in memory)
            output_dir: where the student is written (default: <trainer.default_root_dir>/student)
            objective: trajectory (LoopQ's Eq. 8) or layerwise (FlatQuant's layer-wise MSE)
            adaptive_mu: update the trajectory weights mu_t during calibration (loopq.calib.mu)
            student_from: the student is the last step's, or the checkpoint best on held-out validation
        """
        super().__init__()
        quant = quant or QuantConfig()
        if objective not in OBJECTIVES:
            raise UsageError(f"model.objective={objective!r}: use one of {OBJECTIVES}")
        if state_reduction not in STATE_REDUCTIONS:
            raise UsageError(f"model.state_reduction={state_reduction!r}: use one of {STATE_REDUCTIONS}")
        if not METHODS[quant.method].trained:
            raise QuantConfigError(
                f"quant.method={quant.method!r} is training-free: build it with loopq.quant.prepare.prepare_static "
                "(python -m loopq.evaluate --method ...), not python -m loopq.fit"
            )
        self.save_hyperparameters(ignore=["quant"])
        self.hparams["quant"] = quant.to_dict()  # plain types only: checkpoints load with weights_only=True
        self.quant_config = quant
        directory = resolve_model_dir(teacher)  # once: a hub id is looked up here only
        self.teacher = load_teacher(directory, TEACHER_DTYPES[resolve_teacher_dtype(teacher_dtype)])
        self.teacher_dir = str(directory)
        self.teacher_sha256 = teacher_fingerprint(self.teacher_dir)
        #: teacher fingerprint + resolved config (loopq.fit sets the config), stored in checkpoints and the student
        self.provenance: dict[str, Any] = record(self.teacher_sha256)
        options = GroupOptions(compiled=compile_quantizers)
        self.student = prepare(self.teacher, quant, options=options)
        self.student.checkpoint_loops = checkpoint_loops
        # DDP broadcasts every buffer from rank 0 before each forward (broadcast_buffers) and every tensor when it
        # wraps the module; the frozen teacher and the student's views of it are read from the same files on every
        # rank and never change, so it leaves them out (the whole model's weights per step otherwise)
        self._ddp_params_and_buffers_to_ignore = frozen_names(self, self.teacher, self.student)
        self.num_loops = self.student.calibrated_loops
        self.register_buffer("mu", torch.zeros(self.num_loops), persistent=False)
        self.targets: TeacherTargets | None = None
        #: the last training batch's teacher and (detached) student loop states; what the mu_t update reads
        self.last_trajectory: Trajectory | None = None
        self._data_initialised = False
        #: held-out validation metrics per set (loopq.calib.validation); their states are not checkpointed
        self.val_metrics = nn.ModuleDict({name: ValidationMetrics(self.num_loops) for name in VAL_SETS})

    # ------------------------------------------------------------------ teacher is frozen, never trained/saved twice
    def train(self, mode: bool = True) -> LoopQCalibration:
        super().train(mode)
        self.teacher.eval()
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> LoopQCalibration:
        """Every conversion (``.to(device)`` by Lightning, DDP or DeepSpeed, a dtype cast) keeps the student's frozen
        weights the teacher's storage (:func:`loopq.quant.prepare.apply_tied`), as the memory plan counts them."""
        convert = lambda: super(LoopQCalibration, self)._apply(fn, recurse)  # noqa: E731
        if "student" in self._modules and "teacher" in self._modules:
            apply_tied(self.teacher, self.student, convert)
        else:
            convert()
        return self

    # ------------------------------------------------------------------ setup
    def ensure_targets(self) -> TeacherTargets:
        """Teacher targets for every calibration sample, computed once (or read from the cache)."""
        if self.targets is None:
            samples: Tensor = self.trainer.datamodule.samples
            head = self.teacher.lm_head.weight
            vocab = getattr(head, "ds_shape", head.shape)[0]  # ZeRO-3 partitions it: ds_shape is the full shape
            if int(samples.max()) >= vocab:
                raise DataError(f"data.tokenizer produces id {int(samples.max())} >= the teacher's vocab {vocab}")
            self.targets = load_or_compute(
                self.teacher,
                self.teacher_sha256,
                samples,
                self.hparams.topk,
                self.num_loops,
                self.hparams.target_cache_dir,
                self.global_rank,
                self.trainer.strategy.barrier,
                collective=is_zero3(self.trainer.strategy),
            )
        return self.targets

    def setup(self, stage: str) -> None:
        """Fresh runs initialise the diagonals and LAS clipping from data (resumed runs load them instead; the SLT
        promotions are part of the loaded state, :mod:`loopq.quant.modules`)."""
        if stage != "fit":
            return
        self.initialise_from_data()

    # ------------------------------------------------------------------ placement: the one place that decides devices
    @property
    def compute_device(self) -> torch.device:
        """Where this run computes: the strategy's root device once a trainer is attached, else where the student's
        parameters are. Not ``self.device``: Lightning sets that to the accelerator *before* it moves the parameters
        (in ``setup`` the tensors are still on the CPU while ``self.device`` already says cuda)."""
        if self._trainer is not None:
            return self.trainer.strategy.root_device
        return next(self.student.parameters()).device

    def place(self) -> None:
        """Move the module to :attr:`compute_device` now. Lightning moves it only after ``setup``, but data-dependent
        initialisation runs in ``setup`` and needs the teacher where the data goes; moving it early is the move
        Lightning (and DeepSpeed) would make anyway, and a no-op when it is there already."""
        self.to(self.compute_device)

    def initialise_from_data(self) -> None:
        """Data-dependent start, once per fresh run, from the first global batch (a resumed run loads its state).

        First the learnable diagonals (``quant.diag_init: smooth``: SmoothQuant-style scales from the teacher's
        activations, FlatQuant's default), then LAS clipping on the activations those transforms produce. A second
        ``fit`` of the same module keeps what the first one calibrated.
        """
        if self._data_initialised or self.trainer.ckpt_path:
            return
        self.place()
        dm = self.trainer.datamodule
        global_batch = dm.hparams.batch_size * self.trainer.world_size  # data.batch_size is per process
        ids = dm.samples[:global_batch].to(self.compute_device)
        if self.quant_config.diag_init == "smooth":
            init_diagonal_from_data(self.teacher, self.student, ids, self.quant_config.diag_alpha)
        if self.hparams.init_clipping:
            init_clipping_from_data(self.student, ids)
        self._data_initialised = True

    def on_fit_start(self) -> None:
        if self.hparams.objective == "trajectory":  # the layer-wise objective runs the teacher live instead
            self.ensure_targets()
        report = parameter_report(self.student)
        for logger in self.loggers:
            logger.log_metrics({f"params/{k}": float(v) for k, v in report.as_dict().items()}, step=self.global_step)

    def configure_callbacks(self) -> list[L.Callback]:
        """The method's schedules this config implies (see module docstring); explicit ones in the trainer win."""
        return method_callbacks(self, self.trainer.callbacks if self._trainer is not None else [])

    # ------------------------------------------------------------------ the step
    def compute_loss(self, batch: list[Tensor]) -> dict[str, Tensor]:
        """The loss terms of ``objective`` for one batch (``loss`` is the one optimised)."""
        if self.hparams.objective == "layerwise":
            return self.layerwise_loss(batch)
        return self.trajectory_loss(batch)

    def layerwise_loss(self, batch: list[Tensor]) -> dict[str, Tensor]:
        """Teacher-forced decoder layers: the FP teacher's recorded layer calls, each re-run by the student."""
        _, ids = batch
        with torch.no_grad():
            _, calls, ctx = self.teacher.trace_layers(ids, num_loops=self.num_loops)
        outputs = [self.student.run_layer(c.name, c.inputs, c.t, ctx) for c in calls]
        self.last_trajectory = None
        return layerwise_loss(outputs, [c.output for c in calls], [c.t for c in calls])

    def trajectory_loss(self, batch: list[Tensor]) -> dict[str, Tensor]:
        """Student forward over the recurrence + Eq. 8 against the cached teacher targets."""
        idx, ids = batch
        values, indices, teacher_states = self.ensure_targets().batch(idx, ids.device)
        out = self.student(ids, num_loops=self.num_loops, return_trajectory=True)
        terms = loopq_loss(
            out.logits,
            out.loop_states,
            out.transition_states,
            values,
            indices,
            teacher_states,
            self.mu,
            self.hparams.lam,
            self.hparams.temperature,
            self.hparams.get("state_reduction", "mean"),
        )
        self.last_trajectory = Trajectory(teacher_states, [s.detach() for s in out.loop_states])
        return terms

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        terms = self.compute_loss(batch)
        # One all-reduce per step: the logged terms become means over the global batch (not rank 0's shard), and
        # a non-finite loss on any rank makes the mean non-finite, so every rank stops together.
        names = list(terms)
        values = torch.stack([terms[k].detach().float() for k in names])
        if self.trainer.world_size > 1:
            values = self.trainer.strategy.reduce(values, reduce_op="mean")
        logged = dict(zip(names, values.tolist(), strict=True))
        if not math.isfinite(logged["loss"]):
            raise NonFiniteLossError(
                f"loss is not finite at step {self.global_step} (terms: {logged}); the last good checkpoint is "
                "kept - lower model.lr or check the data, then resume with --ckpt_path last"
            )
        self.log_dict({f"train/{k}": v for k, v in logged.items()}, prog_bar=False)
        self.log("loss", logged["loss"], prog_bar=True, logger=False)
        return terms["loss"]

    # ------------------------------------------------------------------ held-out validation (loopq.calib.validation)
    def validation_step(self, batch: list[Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        ids, real = batch
        hp = {**self.hparams, "state_reduction": self.hparams.get("state_reduction", "mean")}
        if not real.any():
            # A batch of masked rows only keeps the ranks' batch counts equal; its forwards still run: under ZeRO-3
            # they gather the partitioned parameters collectively, and a rank that skipped them hung the others.
            measure(self.teacher, self.student, ids[:1], self.mu, hp, self.num_loops)
            return
        ids = ids[real]
        found = measure(self.teacher, self.student, ids, self.mu, hp, self.num_loops)
        self.val_metrics[VAL_SETS[dataloader_idx]].update(*found, ids)

    def on_validation_epoch_end(self) -> None:
        """Compute (torchmetrics reduces across processes), log ``val/<set>/<metric>``, reset."""
        names = VAL_SETS[: len(self.trainer.datamodule.val_sets)] if self._trainer is not None else ()
        for name in names:
            values = self.val_metrics[name].values()
            self.log_dict({f"val/{name}/{k}": v for k, v in values.items()}, sync_dist=False)
            self.val_metrics[name].reset()

    @property
    def promoted(self) -> list[str]:
        """The SLT-promoted groups (their flag is part of the student's state)."""
        return [name for name, g in quant_groups(self.student).items() if g.promoted]

    # ------------------------------------------------------------------ optimizer
    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: transforms+adapters @ lr, clips @ clip_lr_mult*lr, every SLT per-loop slot @ lr.

        Fixed for the whole run (:mod:`loopq.quant.modules`): the per-loop slots of a group take part from its
        promotion on (no gradient before, so AdamW leaves them and their state untouched until then)."""
        slt = [p for g in quant_groups(self.student).values() for p in g.promotion_parameters() if p.requires_grad]
        slot_ids = {id(p) for p in slt}
        main, clips = [], []
        for name, p in self.student.named_parameters():
            if p.requires_grad and id(p) not in slot_ids:
                (clips if "clip" in name else main).append(p)
        lr = self.hparams.lr
        groups = [
            {"params": main, "lr": lr, "name": "transforms"},
            {"params": clips, "lr": lr * self.hparams.clip_lr_mult, "name": "clips"},
            {"params": slt, "lr": lr, "name": "slt"},
        ]
        return [g for g in groups if g["params"]]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Every trainable quantization parameter steps with a gradient, zero where this step did not use it (the SLT
        offsets before their promotion, a promoted group's shared parameters after it): DeepSpeed's ZeRO optimizers
        step them so, over one flat partition, and AdamW here does the same, so every strategy computes the same
        run (an offset's AdamW state then counts its steps from the start of the run). DeepSpeed keeps its
        gradients in its own buffers and is left alone."""
        if isinstance(self.trainer.strategy, DeepSpeedStrategy):
            return
        for p in self.student.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.AdamW(self.param_groups(), weight_decay=self.hparams.weight_decay)
        total = max(1, self.trainer.max_steps)
        warm = self.hparams.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: cosine(s, warm, total)] * len(opt.param_groups))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Only what a student directory stores (quantization parameters, SLT state): the teacher is reloaded from its
        directory."""
        full = super().state_dict(*args, **kwargs)
        keep = stored_tensors(self.student)
        return {k: v for k, v in full.items() if k.removeprefix("student.") in keep}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        missing = [k for k in ("student." + k for k in stored_tensors(self.student)) if k not in state_dict]
        if strict and missing and all(fixed_layout_only(k) for k in missing):
            raise UsageError(
                f"checkpoint lacks the SLT slots {missing[:3]}: written before the fixed SLT layout; start the "
                "calibration again (without --ckpt_path)"
            )
        if strict and missing:
            raise KeyError(f"checkpoint lacks student parameters {missing[:5]}; is it a LoopQ calibration checkpoint?")
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["loopq"] = {
            "promoted": list(self.promoted),
            "teacher": self.teacher_dir,
            "mu": self.mu.tolist(),
            "provenance": self.provenance,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("loopq")
        if state is None:
            raise KeyError("checkpoint has no 'loopq' section: not written by loopq.fit")
        self.mu.copy_(torch.tensor(state["mu"], device=self.mu.device))

    def on_fit_end(self) -> None:
        out = self.hparams.output_dir or (Path(self.trainer.default_root_dir) / "student")
        self.provenance["selected"] = self.select_student()
        # under ZeRO-3 the student's parameters are partitioned: every rank takes part in gathering them
        with gathered(self.trainer.strategy, quant_parameters(self.student)):
            if self.trainer.is_global_zero:
                meta = student_meta(
                    self.student, self.teacher_dir, out, self.promoted, self.mu.tolist(), self.provenance
                )
                path = write_student(self.student, meta, out)
                print(f"[loopq] calibrated student written to {path}")
        self.trainer.strategy.barrier("loopq_student_written")

    def select_student(self) -> dict[str, Any]:
        """Which calibration state becomes the student (``student_from``): the last step's (the paper's), or the
        checkpoint the monitoring :class:`ModelCheckpoint` scored best on held-out validation, loaded into the
        student here (weights only). Returned for the provenance (recorded, not compared)."""
        last = {"checkpoint": "last", "step": self.global_step}
        if self.hparams.student_from != "best":
            return last
        monitored = [cb for cb in self.trainer.checkpoint_callbacks if getattr(cb, "monitor", None)]
        best = monitored[0].best_model_path if monitored else ""
        if not best:  # no validation ran (a run shorter than val_check_interval): nothing to choose from
            rank_zero_warn("model.student_from best: no checkpoint was scored on validation; the student is the last")
            return {**last, "why": "no scored checkpoint"}
        state = load_weights_only(best)
        self.load_state_dict(state["state_dict"])
        self.mu.copy_(torch.tensor(state["loopq"]["mu"], device=self.mu.device))
        score = monitored[0].best_model_score
        print(f"[loopq] student from the best checkpoint: step {state['global_step']}, {monitored[0].monitor} {score}")
        return {
            "checkpoint": "best",
            "step": int(state["global_step"]),
            "monitor": monitored[0].monitor,
            "score": None if score is None else float(score),
            "last_step": self.global_step,
        }


def method_callbacks(module: LoopQCalibration, configured: list[L.Callback]) -> list[L.Callback]:
    """AdaptiveMu (unless ``adaptive_mu`` is off) and SharingGapReselection (when ``quant.slt_budget > 0``), with
    their default schedules, each only when ``configured`` has none of its kind (a listed one is the schedule; adding
    ours would make Lightning replace it)."""
    from loopq.calib.mu import AdaptiveMu
    from loopq.calib.reselection import SharingGapReselection

    hp = module.hparams
    have = {type(c) for c in configured}
    wanted: list[L.Callback] = []
    if hp.objective == "trajectory" and hp.adaptive_mu and not any(issubclass(t, AdaptiveMu) for t in have):
        wanted.append(AdaptiveMu())
    if module.quant_config.slt_budget > 0 and not any(issubclass(t, SharingGapReselection) for t in have):
        wanted.append(SharingGapReselection())
    return wanted


def resolve_teacher_dtype(name: str, precision: str | int | None = None) -> str:
    """``model.teacher_dtype`` as ``bf16`` or ``fp32``: ``auto`` is bf16 under a bf16 ``trainer.precision``
    (``bf16-mixed``, ``bf16-true``, ``bf16``) and fp32 under any other (or unknown) precision."""
    if name == "auto":
        return "bf16" if str(precision).startswith("bf16") else "fp32"
    if name not in TEACHER_DTYPES:
        raise UsageError(f"model.teacher_dtype={name!r}: use one of {['auto', *TEACHER_DTYPES]}")
    return name


def load_teacher(path: str | Path, dtype: torch.dtype = torch.float32) -> LoopLM:
    """Load and freeze the FP teacher in ``dtype`` (:func:`load_looplm`: a clear error for a directory that is not
    a looped LM); ``path`` is a directory or a hub id, resolved once, ``config.json`` read once."""
    teacher = load_looplm(path, dtype=dtype)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


def cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warm-up then cosine decay to 0 at ``total``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress))
