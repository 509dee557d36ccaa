"""Train the embedded default teacher: a tiny Ouro-architecture looped LM on real English text.

    python -m loopq.pretrain --config configs/pretrain/tiny-ouro.yaml

Data: the calibration prose, LAMBADA development text and WikiText-2 *valid* (never a test split), tokenized
by a byte-level BPE trained on the same text. With ``data.bos: true`` every training window starts with the
BOS token (``<|endoftext|>``, id 0, as in Ouro's tokenizer) followed by ``seq_len`` tokens of the stream.

Objective (Ouro-style, every loop's exit is trained):

    L = sum_t w_t CE(lm_head(H_t), y)  +  gate_weight * sum_{t<T-1} BCE(sigmoid(g_t), stop_t)

with w_t proportional to ``loop_weights`` (rising with t, so the model learns to *use* its loops) and the exit
gate taught to stop at loop t when loop t+1 no longer lowers the token's loss by ``gate_margin`` nats
(targets from detached losses: the gate never shapes the LM). At the end the model is written in Ouro's native
format (config.json + model.safetensors) with ``tokenizer.json`` to ``out_dir``.

Resumable: with checkpointing on (``trainer.callbacks`` with a ``ModelCheckpoint(save_last=true)``, as in
``configs/pretrain/small-ouro.yaml``), ``python -m loopq.pretrain --config ... --ckpt_path last`` continues from the
newest checkpoint (model, optimizer, LR schedule, step; the data order goes on in its epoch after the batches the
checkpointed steps consumed, so a resumed run trains on the batches an uninterrupted one would). With
``trainer.accumulate_grad_batches > 1`` a stop (a signal, ``trainer.max_time``, a callback) that comes inside an
accumulation window waits for the window's optimizer step, so every checkpoint lies on a step boundary.
Without a ``ModelCheckpoint`` (``enable_checkpointing: false``, as in ``configs/pretrain/tiny-ouro.yaml``),
``--ckpt_path last`` resumes from the ``<default_root_dir>/checkpoints/last.ckpt`` that a stop on SIGTERM / Ctrl-C or
on ``trainer.max_time`` saved; with nothing saved it fails with one line instead of training from step 0.
A resume keeps the checkpoint's settings: another model shape, objective, optimiser, text, tokenizer or window
layout (``model.*`` / ``data.*`` but ``model.out_dir``, ``model.save_dtype``, ``data.root``), or another
``trainer.accumulate_grad_batches``, ``limit_train_batches`` or process count, is refused with one line naming the
differing keys (:func:`check_resume_settings`); the run length (``max_steps``, ``max_time``), logging and callbacks
may change.
The record written next to the model names the command, seed, steps, ``max_steps``, why the run stopped
(``stop_reason``) and the wall time summed over all resumed segments.

A run that ends before ``trainer.max_steps`` without a stop signal (``trainer.max_time`` ran out, ``max_epochs``, a
callback) is incomplete, and says so: it saves ``last.ckpt`` (resume with ``--ckpt_path last`` and a larger
``trainer.max_time``), writes the partly trained model only into an ``out_dir`` that holds no model yet (its record's
``stop_reason`` says why it stopped), never replaces a teacher already there, and exits with status 2 and one line.
A non-finite loss stops a run with one line and nothing exported; so does a run that took no step.

``out_dir`` is checked before training starts: it may be new, or hold a teacher this command trained before (its
``training_record.json`` names ``loopq.pretrain``; a ``loopq.stress`` output is not this command's): the README
rebuilds the embedded teachers in ``loopq/assets`` in place on purpose (students calibrated on the old weights are
then stale and must be recalibrated). Any other model there (a downloaded or stress teacher, a student, an export) is
refused unless ``--overwrite true``; the data root is refused even then.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import math
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import yaml
from jsonargparse import capture_parser
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from loopq.artifacts.layout import MODEL_KINDS, RUN_LOCK, TRAINING_RECORD, check_output_dir, model_kind
from loopq.calib.checkpoint_io import check_ckpt_path, load_weights_only, newest_intact
from loopq.calib.stop_on_signal import checkpoint_dir, exit_status, save_last
from loopq.calib.stop_on_signal import install as install_stop_on_signal
from loopq.commands.cli import SharedParsing, lightning_cli
from loopq.data.stream import contiguous_windows, token_stream
from loopq.data.text import (
    DEFAULT_TRAINING_SOURCES,
    check_sources_listed,
    read_source,
    read_training_text,
    resolve_sources,
)
from loopq.data.tokenizer import eos_id, load_tokenizer, train_bpe
from loopq.errors import LoopQError, UsageError
from loopq.files import atomic_write
from loopq.locks import DirectoryLock
from loopq.models.config_checks import check_config_types
from loopq.models.ouro import OuroConfig, OuroLM
from loopq.paths import data_dir
from loopq.planning.guards import NumberRule, check_numbers
from loopq.provenance import describe, differing_keys, flatten


class PretrainDataModule(L.LightningDataModule):
    """Trains the tokenizer on the training text, then serves shuffled contiguous windows of it."""

    def __init__(
        self,
        sources: list[str] | None = None,
        root: str | None = None,
        vocab_size: int = 2048,
        seq_len: int = 256,
        batch_size: int = 16,
        val_windows: int = 64,
        seed: int = 0,
        bos: bool = False,
        tokenizer: str | None = None,
    ) -> None:
        """Where the training text comes from and how it is cut into windows.

        Args:
            sources: training text files, globs relative to root (default: the calibration prose, LAMBADA development
                text and WikiText-2 valid; an empty list is refused)
            root: the folder sources are relative to (default: LOOPQ_DATA or the shared data folder)
            vocab_size: vocabulary of the BPE trained on the text
            seq_len: tokens per training window (after BOS with bos)
            batch_size: windows per step
            val_windows: windows held out for validation
            seed: seed of the window order
            bos: start every window with the BOS token
            tokenizer: a model directory or tokenizer.json to use instead of training a BPE (a fine-tune keeps its
                teacher's token ids)
        """
        super().__init__()
        if val_windows < 0:
            raise UsageError(f"data.val_windows={val_windows}: must be >= 0 (windows held out for validation)")
        for key, value in (("seq_len", seq_len), ("batch_size", batch_size), ("vocab_size", vocab_size)):
            if value < 1:
                raise UsageError(f"data.{key}={value}: must be >= 1")
        check_sources_listed(sources, DEFAULT_TRAINING_SOURCES)
        self.save_hyperparameters()
        self.tokenizer: Any = None
        self.train: Tensor | None = None
        self.val: Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        hp = self.hparams
        sources = DEFAULT_TRAINING_SOURCES if hp.sources is None else hp.sources
        files = resolve_sources(list(sources), Path(hp.root) if hp.root else data_dir())
        docs = read_training_text(files)  # the guards, over the sources as listed (a repeated one weights its text)
        self.tokenizer = load_tokenizer(hp.tokenizer) if hp.tokenizer else train_bpe(docs, hp.vocab_size)
        check_vocab_fits(self.tokenizer.get_vocab_size(), hp.vocab_size, hp.tokenizer)
        files = [path.resolve() for path in files]  # a file listed twice, however spelled, is one text
        streams = {path: token_stream(read_source(path)[1], self.tokenizer) for path in dict.fromkeys(files)}
        bos = eos_id(self.tokenizer) if hp.bos else None
        self.val, self.train = split_windows(streams, files, hp.seq_len, bos, hp.val_windows, hp.seed)

    def train_dataloader(self) -> DataLoader:
        trainer, batch = self.trainer, self.hparams.batch_size
        processes = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        sampler = EpochShuffle(len(self.train), self.hparams.seed, *processes)
        if trainer is not None:  # a resumed fit goes on after the windows its checkpointed steps consumed
            sampler.resume(*consumed_windows(trainer, epoch_batches(trainer, len(sampler), batch), batch))
        return DataLoader(TensorDataset(self.train), batch_size=batch, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.val), batch_size=self.hparams.batch_size)


def check_vocab_fits(tokens: int, vocab_size: int, tokenizer: str | None) -> None:
    """The model's embedding (``data.vocab_size``, linked to the model's) holds every token id the tokenizer makes:
    a byte-level BPE has at least 257 tokens whatever vocabulary it was asked for, and a given tokenizer has its own
    size; a smaller vocabulary failed mid-training with an index error."""
    if tokens > vocab_size:
        what = f"the tokenizer {tokenizer}" if tokenizer else "the BPE trained on the text (at least 257: bytes + BOS)"
        raise UsageError(f"data.vocab_size={vocab_size}: {what} has {tokens} tokens; set data.vocab_size >= {tokens}")


#: the training numbers of :class:`PretrainModule` (a negative gate weight trained the gate away from its targets, a
#: min_lr_ratio above 1 raised the learning rate past its peak, both silently)
TRAINING_RULES: tuple[NumberRule, ...] = (
    ("lr", "a finite number > 0 (configs/pretrain/tiny-ouro.yaml uses 0.003)", lambda v: v > 0),
    ("weight_decay", "a finite number >= 0", lambda v: v >= 0),
    ("min_lr_ratio", "a number from 0 to 1 (the final learning rate as a fraction of lr)", lambda v: 0 <= v <= 1),
    ("gate_weight", "a finite number >= 0 (the weight of the exit gate's loss)", lambda v: v >= 0),
    ("gate_margin", "a finite number >= 0 (nats)", lambda v: v >= 0),
    ("post_norm_init", "a finite number > 0", lambda v: v > 0),
)


def check_heads(num_attention_heads: int, num_key_value_heads: int) -> None:
    """Key/value heads that divide the query heads, named as the options (OuroConfig's own check says config.json
    and divided by zero for 0)."""
    if num_key_value_heads < 1 or num_attention_heads % num_key_value_heads:
        raise UsageError(
            f"model.num_key_value_heads={num_key_value_heads}: must be >= 1 and divide model.num_attention_heads="
            f"{num_attention_heads}"
        )


def check_model_shape(config: OuroConfig) -> None:
    """Sizes and counts at least 1 (:func:`~loopq.models.config_checks.check_config_types`, as the loader checks a
    config.json: a zero width trained and then wrote a teacher the loader refuses) and query heads dividing the
    width (a traceback mid-forward otherwise), before anything is built."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "extra"}
    check_config_types(OuroConfig, fields, source="model")
    if config.head_dim is None and config.hidden_size % config.num_attention_heads:
        raise UsageError(
            f"model.hidden_size={config.hidden_size} is not a multiple of model.num_attention_heads="
            f"{config.num_attention_heads}; choose heads that divide the width"
        )


def split_windows(
    streams: dict[Path, Tensor], files: Sequence[Path], seq_len: int, bos: int | None, val_windows: int, seed: int
) -> tuple[Tensor, Tensor]:
    """(validation, training) windows of the token ``streams`` of the distinct source files.

    Validation: the first ``val_windows`` of the shuffled contiguous windows of the distinct sources, cut before any
    source is repeated. Training: the shuffled contiguous windows of the sources as listed (a source listed twice
    weights its text, as the configs weight WikiText-2 valid), less every window that holds a token of validation
    text; a repeated source's copy used to put the text of validation windows into training. Without repeats this is
    the one shuffle split at ``val_windows``, as before. With ``bos`` each window is [BOS] + seq_len stream tokens (the
    model always sees BOS at position 0: attention sink), else seq_len + 1 stream tokens."""
    span = seq_len if bos is not None else seq_len + 1
    distinct, listed = torch.cat(list(streams.values())), torch.cat([streams[path] for path in files])
    val_cut, train_cut = contiguous_windows(distinct, span), contiguous_windows(listed, span)
    if not 0 <= val_windows < len(val_cut):
        raise UsageError(
            f"data.val_windows={val_windows}: must be >= 0 and below the {len(val_cut)} windows of "
            f"{seq_len} tokens the sources make; lower it or add text"
        )
    val_order = shuffled_order(len(val_cut), seed)[:val_windows]
    held = torch.zeros(distinct.numel(), dtype=torch.bool)
    held[contiguous_windows(torch.arange(distinct.numel()), span)[val_order].flatten()] = True
    order = shuffled_order(len(train_cut), seed)
    train_order = order[~held[contiguous_windows(text_positions(streams, files), span)[order]].any(1)]
    if len(train_order) == 0:
        raise UsageError(f"data.val_windows={val_windows}: holds out every training window; lower it or add text")
    return with_bos(val_cut[val_order], bos), with_bos(train_cut[train_order], bos)


def shuffled_order(count: int, seed: int) -> Tensor:
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))


def text_positions(streams: dict[Path, Tensor], files: Sequence[Path]) -> Tensor:
    """For every token of the stream of ``files`` as listed, its position in the stream of the distinct files (each
    at its first listing): the tokens of a repeated source's copies get the positions of its first."""
    starts = torch.tensor([0] + [s.numel() for s in streams.values()]).cumsum(0).tolist()
    first = dict(zip(streams, starts, strict=False))
    return torch.cat([first[path] + torch.arange(streams[path].numel()) for path in files])


def with_bos(windows: Tensor, bos: int | None) -> Tensor:
    """``windows`` with a first column of ``bos`` (unchanged without)."""
    if bos is None:
        return windows
    return torch.cat([torch.full((len(windows), 1), bos, dtype=windows.dtype), windows], 1)


def step_generator(seed: int, index: int) -> torch.Generator:
    """The generator of one step (or epoch): the same draws for the same (seed, index), so a resumed run repeats
    them."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class EpochShuffle(DistributedSampler):
    """The training windows in a fresh order each epoch, drawn from (seed, epoch) alone: Lightning calls
    ``set_epoch`` before each epoch, so a run resumed in epoch k replays epoch k's order (a generator seeded once
    per run, as before, replayed epoch 0's). Each of ``num_replicas`` processes takes every ``num_replicas``-th window
    of the order (padded to a multiple of them, as ``DistributedSampler``; Lightning leaves a ``DistributedSampler``
    as it is). :meth:`resume` skips the windows this process consumed before a mid-epoch checkpoint, so a resumed run
    sees the batches an uninterrupted one would. The length stays the whole epoch's: Lightning counts the batches
    its restored progress says were fetched."""

    def __init__(self, size: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.size, self.resume_epoch, self.skip = size, 0, 0

    def resume(self, epoch: int, windows: int) -> None:
        """Start ``epoch`` after this process's first ``windows`` windows of it (other epochs are whole)."""
        self.resume_epoch, self.skip = epoch, windows

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=step_generator(self.seed, self.epoch)).tolist()
        order += order[: self.total_size - self.size]
        mine = order[self.rank : self.total_size : self.num_replicas]
        return iter(mine[self.skip :] if self.epoch == self.resume_epoch else mine)


def epoch_batches(trainer: L.Trainer, windows: int, batch_size: int) -> int:
    """Batches one process runs per epoch: its ``windows`` in batches of ``batch_size``, cut by
    ``trainer.limit_train_batches`` (a count, or a fraction of the batches) as Lightning cuts them."""
    batches, limit = math.ceil(windows / batch_size), trainer.limit_train_batches
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def consumed_windows(trainer: L.Trainer, batches: int, batch_size: int) -> tuple[int, int]:
    """(the epoch the trainer's ``global_step`` falls in, the windows of it one process has consumed): an epoch of
    ``batches`` batches is ceil(batches / accumulate_grad_batches) optimizer steps (its last step may accumulate
    fewer), and every step before the global one took ``accumulate_grad_batches`` batches. 0 windows at a fresh
    start and at an epoch's end."""
    accumulate = trainer.accumulate_grad_batches
    epoch, step = divmod(trainer.global_step, max(1, math.ceil(batches / accumulate)))
    return epoch, step * accumulate * batch_size


def per_loop_token_losses(model: OuroLM, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Token-level CE of every loop's exit ``[T, B, S]`` and the exit-gate logits per loop."""
    out = model(ids[:, :-1], return_trajectory=True)
    targets = ids[:, 1:]
    losses = [
        F.cross_entropy(model.lm_head(h).flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        for h in out.loop_states
    ]
    return torch.stack(losses), out.extras["exit_gate_logits"]


def gate_targets(token_losses: Tensor, margin: float) -> Tensor:
    """stop_t = 1 when loop t+1 lowers the token's loss by less than ``margin`` nats (t = 0..T-2)."""
    gain = token_losses[:-1] - token_losses[1:]
    return (gain < margin).to(token_losses.dtype)


#: the dtypes a trained model may be written in (``save_dtype``)
SAVE_DTYPES = ("float32", "bfloat16")


def loop_weight_tensor(loop_weights: Sequence[float] | None, count: int, shortest: int | None = None) -> Tensor:
    """``model.loop_weights`` (default (t+1)^2), checked: ``count`` non-negative entries whose first ``shortest``
    (the fewest loops a training step can run; default all) are not all 0 - a step of that depth normalises its
    exits' weights by their sum, and a zero sum is a NaN loss."""
    weights = torch.tensor(loop_weights or [float((t + 1) ** 2) for t in range(count)], dtype=torch.float32)
    if len(weights) != count or (weights < 0).any() or weights.sum() <= 0:
        raise UsageError(f"model.loop_weights needs {count} non-negative entries (one per loop), got {loop_weights}")
    shortest = count if shortest is None else shortest
    if weights[:shortest].sum() <= 0:
        raise UsageError(
            f"model.loop_weights={loop_weights}: all 0 over the first {shortest} loop(s), the fewest a training step "
            "can run (budgets / sampled depth): such a step has no loss; give one of them a positive weight"
        )
    return weights


def check_save_dtype(save_dtype: str) -> None:
    if save_dtype not in SAVE_DTYPES:
        raise UsageError(f"model.save_dtype={save_dtype!r}: use one of {SAVE_DTYPES}")


class LoopedPretrainer(L.LightningModule):
    """What every architecture's pretrainer shares: the optimiser and schedule, the wall time over resumed segments,
    the logged steps and the export on fit end (with the record of ``program`` and :meth:`record_extra`). A subclass
    builds ``self.model`` (a :class:`LoopLM`), calls :meth:`init_training` and implements ``_objective``."""

    program = "loopq.pretrain"

    def init_training(self, weights: Tensor) -> None:
        """Register the normalised per-loop loss weights and start the wall-time and rate clocks."""
        self.register_buffer("loop_weights", weights / weights.sum(), persistent=False)
        self._t0 = time.time()
        self._wall_before = 0.0  # seconds spent in earlier (resumed-from) segments
        self._first_step, self._rate_t0 = 0, time.time()
        self._stop_checkpoint: Path | None = None  # last.ckpt saved when the run stopped short (on_train_batch_end)
        self._batch_step = 0  # the optimizer step the training batch in flight started at
        self._stop_held = False  # a stop asked for inside an accumulation window, held until its step is taken

    def _objective(self, batch: list[Tensor], stage: str) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def on_train_start(self) -> None:
        self._rate_t0, self._first_step = time.time(), self.global_step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_step = self.global_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """A stop before ``trainer.max_steps`` (``max_time``, a callback) saves last.ckpt here, mid-epoch as a
        ``ModelCheckpoint`` would: one saved at fit end resumes in the next epoch, past batches never trained on.
        Inside an accumulation window (``accumulate_grad_batches > 1``) the stop waits for the window's optimizer
        step, as a stop on a signal does (:mod:`loopq.calib.stop_on_signal`): saved after a micro-batch, the
        checkpoint lost the window's gradients and its resumed run stepped one micro-batch early from then on."""
        trainer = self.trainer
        if trainer.accumulate_grad_batches > 1 and trainer.global_step == self._batch_step:  # no step taken yet
            self._stop_held = self._stop_held or trainer.should_stop
            trainer.should_stop = False
            return
        trainer.should_stop = trainer.should_stop or self._stop_held
        self._stop_held = False
        if trainer.should_stop and not trainer.received_sigterm and 0 < trainer.global_step < trainer.max_steps:
            self._stop_checkpoint = save_last(trainer)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["loopq_wall_seconds"] = self.wall_seconds()
        checkpoint[DATA_POSITION] = data_position(self.trainer)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._wall_before = float(checkpoint.get("loopq_wall_seconds", 0.0))

    def wall_seconds(self) -> float:
        """Training wall time summed over every segment of a resumed run."""
        return self._wall_before + time.time() - self._t0

    def _losses(self, batch: list[Tensor], stage: str) -> Tensor:
        return self._objective(batch, stage)[0]

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = self._losses(batch, "train")
        check_finite_loss(loss, self.global_step + 1)
        self.log("loss", loss, prog_bar=True, logger=False)  # what the plain-line progress prints
        steps = self.global_step + 1 - self._first_step  # this segment's steps: a resumed run's rate stays true
        self.log("train/tokens_per_s", batch[0].numel() * steps / (time.time() - self._rate_t0))
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self._losses(batch, "val")

    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        total = schedule_steps(self.trainer)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, self.hparams.warmup_steps, total, self.hparams.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def record_extra(self) -> dict[str, Any]:
        """Entries the training record adds (a fine-tune's auxiliary objective)."""
        return {}

    def on_fit_end(self) -> None:
        """Export the trained model (module doc): never one that took no step or is not finite; a run that ended
        before ``trainer.max_steps`` saves last.ckpt, is exported only into a folder that holds no model yet, and
        fails with one line (:class:`RunIncomplete`)."""
        trainer = self.trainer
        if trainer.global_step == 0:
            raise UsageError("no training step ran (trainer.max_steps, data): nothing was exported")
        check_finite_parameters(self)
        short = 0 < trainer.global_step < trainer.max_steps
        saved = (self._stop_checkpoint or save_last(trainer)) if short else None
        out = Path(self.hparams.out_dir)
        export = not short or model_kind(out) is None
        if export and trainer.is_global_zero:
            dtype = getattr(torch, self.hparams.get("save_dtype", "float32"))
            export_teacher(self, trainer.datamodule, self.program, self.record_extra(), dtype)
        if short:
            what = f"wrote the partly trained model to {out}" if export else f"left the model in {out} as it was"
            raise RunIncomplete(
                f"stopped by {stop_reason(trainer)} after step {trainer.global_step} of trainer.max_steps "
                f"{trainer.max_steps}: {what}; saved {saved}; resume with --ckpt_path last (and a larger "
                "trainer.max_time)"
            )


class RunIncomplete(LoopQError):
    """Training ended before ``trainer.max_steps`` without a stop signal (``trainer.max_time``, ``max_epochs``, a
    callback); the message says what was saved and how to resume."""


def stop_reason(trainer: L.Trainer) -> str:
    """Why the fit ended: ``trainer.max_steps`` when it reached them, else ``trainer.max_time`` /
    ``trainer.max_epochs`` / ``a callback (trainer.should_stop)``."""
    if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return "trainer.max_steps"
    timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    if any(t.time_remaining() is not None and t.time_remaining() <= 0 for t in timers):
        return "trainer.max_time"
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0 and trainer.current_epoch >= max_epochs:
        return "trainer.max_epochs"
    return "a callback (trainer.should_stop)"


def schedule_steps(trainer: L.Trainer) -> int:
    """The optimizer steps the LR schedule spans: ``trainer.max_steps``, or, when it is not set (-1), the steps
    ``max_epochs`` make (Lightning's estimate); the schedule used to fall to its floor right after warm-up then."""
    if trainer.max_steps > 0:
        return trainer.max_steps
    total = trainer.estimated_stepping_batches
    if not math.isfinite(total):
        raise UsageError("trainer.max_steps and trainer.max_epochs are both unset: set trainer.max_steps")
    return max(1, int(total))


def check_finite_loss(loss: Tensor, step: int) -> None:
    """Stop a diverged run: a non-finite training loss ends it with one line, before the weights it would corrupt
    are stepped (no export follows: Lightning skips ``on_fit_end`` after an exception)."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise UsageError(
            f"training diverged: the loss is {float(loss.detach())} at step {step}; nothing was exported. Lower "
            "model.lr (or the option that made the loss non-finite) and run again"
        )


def check_finite_parameters(module: L.LightningModule) -> None:
    """Refuse to export weights that are not all finite (a model that diverged after its last logged loss)."""
    bad = [name for name, p in module.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
    if bad:
        raise UsageError(
            f"training diverged: {len(bad)} parameter(s) are not finite (first: {bad[0]}); nothing was exported. "
            "Lower model.lr and run again"
        )


class TeacherPretrainer(LoopedPretrainer):
    """Ouro-style multi-exit pretraining of a tiny looped LM."""

    def __init__(
        self,
        vocab_size: int = 2048,
        hidden_size: int = 128,
        intermediate_size: int = 384,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        total_ut_steps: int = 4,
        max_position_embeddings: int = 2048,
        loop_weights: list[float] | None = None,
        gate_weight: float = 0.1,
        gate_margin: float = 0.02,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        seed: int = 0,
        out_dir: str = "loopq/assets/tiny-ouro",
        post_norm_init: float = 1.0,
    ) -> None:
        """The Ouro model to build and how it is trained.

        Args:
            vocab_size: vocabulary size (linked to data.vocab_size)
            hidden_size: width of the residual stream
            intermediate_size: width of the MLP
            num_hidden_layers: shared layers run in every loop
            num_attention_heads: query heads
            num_key_value_heads: key/value heads (grouped-query attention)
            total_ut_steps: loops (Ouro's universal-transformer steps)
            max_position_embeddings: positions the model is built for
            loop_weights: per-loop weights of the multi-exit loss (default: (t+1)^2, normalised)
            gate_weight: weight of the exit gate's BCE
            gate_margin: nats loop t+1 must gain over loop t for the gate's target to say continue
            lr: peak learning rate
            weight_decay: AdamW weight decay of the matrices
            warmup_steps: linear warm-up steps
            min_lr_ratio: the cosine schedule's final learning rate as a fraction of lr
            seed: seed of the initialisation
            out_dir: where the trained model, tokenizer and record are written
            post_norm_init: initial gain of the sandwich norms (below 1: each block starts near the identity)
        """
        super().__init__()
        self.save_hyperparameters()
        check_numbers(self.hparams, TRAINING_RULES)
        check_heads(num_attention_heads, num_key_value_heads)
        config = OuroConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            total_ut_steps=total_ut_steps,
            max_position_embeddings=max_position_embeddings,
            extra={"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "architectures": ["OuroForCausalLM"]},
        )
        check_model_shape(config)
        self.model = OuroLM.from_config(config, seed=seed)
        init_post_norms(self.model, post_norm_init)
        self.init_training(loop_weight_tensor(loop_weights, total_ut_steps))

    def _objective(self, batch: list[Tensor], stage: str) -> tuple[Tensor, Tensor]:
        """(the Ouro objective, the per-loop mean CEs [T] it was made of, with their graph)."""
        token_losses, gates = per_loop_token_losses(self.model, batch[0])
        per_loop = token_losses.mean(dim=(1, 2))
        lm = (self.loop_weights * per_loop).sum()
        gate_logits = torch.stack([g.squeeze(-1) for g in gates[:-1]])
        gate = F.binary_cross_entropy_with_logits(
            gate_logits, gate_targets(token_losses.detach(), self.hparams.gate_margin)
        )
        for t, value in enumerate(per_loop):
            self.log(f"{stage}/ce_loop{t + 1}", value, prog_bar=(stage == "val" or t == len(per_loop) - 1))
        self.log(f"{stage}/gate_bce", gate)
        return lm + self.hparams.gate_weight * gate, per_loop


#: Ouro's sandwich norms: each sub-layer's output is RMS-normalised by these before it joins the residual stream
POST_NORMS = ("input_layernorm_2.weight", "post_attention_layernorm_2.weight")


def init_post_norms(model: OuroLM, gain: float) -> None:
    """Start the sandwich-norm gains at ``gain`` instead of 1. At 1 every sub-layer adds a unit-RMS vector to a
    residual stream that starts at the embeddings' RMS (0.02): with 6 layers x 4 loops (48 additions) the token
    signal is drowned at initialisation and training sits on the unigram plateau for hundreds of steps; a small
    gain (SkipInit/ReZero-style) keeps each block close to the identity at the start. 1.0 leaves the model as built."""
    if gain == 1.0:
        return
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(POST_NORMS):
                p.fill_(gain)


def warmup_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``floor`` at ``total`` steps (an LR multiplier)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def export_teacher(
    module: TeacherPretrainer,
    data: PretrainDataModule,
    program: str = "loopq.pretrain",
    extra: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save model + tokenizer in Ouro's native layout and a training record (the ``python -m program`` command and
    ``extra`` entries, e.g. a fine-tune's auxiliary objective) next to them. ``dtype``: of the saved weights
    (bf16 halves a committed teacher; :func:`loopq.models.load_looplm` reads it back as fp32). Every file is written
    atomically and the record last: a run stopped while exporting leaves no half-written file."""
    out = Path(module.hparams.out_dir)
    model = module.model.eval()
    (model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)).save_pretrained(out)
    atomic_write(out / "tokenizer.json", lambda p: data.tokenizer.save(str(p)))
    text = json.dumps(training_record(module, data, program, dtype) | (extra or {}), indent=2, default=str) + "\n"
    atomic_write(out / TRAINING_RECORD, lambda p: p.write_text(text))
    return out


def training_record(module: TeacherPretrainer, data: PretrainDataModule, program: str, dtype: torch.dtype) -> dict:
    """What the record next to a trained teacher says: the command, hyper-parameters, steps, tokens and time."""
    trainer = module.trainer
    return {
        "command": f"python -m {program} " + shlex.join(sys.argv[1:]),
        "model_hparams": dict(module.hparams),
        "data_hparams": dict(data.hparams),
        "steps": trainer.global_step,
        # optimizer steps x windows per step (accumulated micro-batches, every process) x tokens per window
        "train_tokens": trainer.global_step
        * trainer.accumulate_grad_batches
        * trainer.world_size
        * data.hparams.batch_size
        * data.hparams.seq_len,
        "wall_seconds": round(module.wall_seconds(), 1),
        "seed": module.hparams.seed,
        "torch": torch.__version__,
        "final_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "saved_dtype": str(dtype).removeprefix("torch."),
        "max_steps": trainer.max_steps,
        "stop_reason": stop_reason(trainer),
    }


class PretrainCLI(SharedParsing, LightningCLI):
    """``loopq.pretrain``'s command line (``loopq.stress`` subclasses it)."""

    #: the first line of ``--help``
    description = "Train a looped teacher (Ouro, LoopFormer or Parcae) on real English text."

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="'last' or a checkpoint: resume")
        parser.add_argument("--overwrite", type=bool, default=False, help="let model.out_dir replace any model")
        self.add_own_arguments(parser)

    def add_own_arguments(self, parser: Any) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size")
        parser.add_argument("--architecture", type=str, default="ouro", help=f"one of {sorted(ARCHITECTURES)}")

    def before_instantiate_classes(self) -> None:
        """Before any training: ``model.out_dir`` may hold only a teacher this command trained (see module doc); never,
        not even with ``--overwrite true``, the data it reads."""
        root = self.config.data.root or data_dir()
        replaces = MODEL_KINDS if self.config.overwrite else ("pretrained teacher",)
        check_output_dir(self.config.model.out_dir, [root], "model.out_dir", replaces=replaces)


def fit_resumable(
    cli_class: type[LightningCLI],
    model_class: type[L.LightningModule],
    args: list[str] | None,
    command: str | None = None,
) -> None:
    """Parse ``args`` with ``cli_class`` (``model_class`` on the pretraining data;
    :func:`~loopq.commands.cli.lightning_cli`), fit from ``--ckpt_path`` when given, and stop cleanly on SIGTERM /
    SIGINT: the step in flight finishes, last.ckpt is saved, exit 143 / 130.
    ``command``: the name the run lock records (default: ``loopq.<model_class's module>``)."""
    command = command or f"loopq.{model_class.__module__.rpartition('.')[2]}"
    cli = lightning_cli(cli_class, model_class, PretrainDataModule, args, command)
    install_stop_on_signal(cli.trainer)
    root = cli.trainer.default_root_dir
    try:
        with DirectoryLock(root, RUN_LOCK, command, "--trainer.default_root_dir"):  # one writer at a time
            ckpt_path = resume_checkpoint(cli.config.get("ckpt_path"), cli.trainer)
            if ckpt_path is not None:
                check_resume_settings(ckpt_path, cli.model, cli.datamodule, cli.trainer)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:  # stopped on request, last.ckpt saved (loopq.calib.stop_on_signal)
        raise SystemExit(exit_status(cli.trainer)) from None


#: the checkpoint entry with :func:`data_position`'s trainer settings
DATA_POSITION = "loopq_data_position"

#: hyper-parameters a resume may change (besides the trainer's run length, logging and callbacks): where and in which
#: dtype the trained model is written, and where the data folder lies
RESUME_MAY_CHANGE = frozenset({"model.out_dir", "model.save_dtype", "data.root"})


def data_position(trainer: L.Trainer) -> dict[str, Any]:
    """The trainer settings that decide which windows the steps so far consumed (:func:`consumed_windows`,
    :func:`epoch_batches`, :class:`EpochShuffle`'s shards): a resume with others goes on at another place of the
    data."""
    return {
        "trainer.accumulate_grad_batches": trainer.accumulate_grad_batches,
        "trainer.limit_train_batches": trainer.limit_train_batches,
        "processes (trainer.devices x trainer.num_nodes)": trainer.world_size,
    }


def run_settings(model: dict[str, Any], data: dict[str, Any], position: dict[str, Any]) -> dict[str, Any]:
    """What a resume must share with its checkpoint, as flat dotted keys: the model's and the data's
    hyper-parameters and the ``position`` (:func:`data_position`), less :data:`RESUME_MAY_CHANGE` and Lightning's
    own entries (``_instantiator``)."""
    flat = flatten({"model": dict(model), "data": dict(data)}) | dict(position)
    return {k: v for k, v in flat.items() if k not in RESUME_MAY_CHANGE and not k.partition(".")[2].startswith("_")}


def check_resume_settings(
    ckpt_path: str, module: L.LightningModule, data: L.LightningDataModule, trainer: L.Trainer
) -> None:
    """Refuse, before any training, to resume a checkpoint trained with other settings: the model's shapes (width,
    depth, vocabulary, loops), objective and optimiser, the data's text, tokenizer and windows, and the trainer
    settings of the data position (:func:`data_position`; a checkpoint from before they were recorded is not
    compared on them). One line names the differing keys, the checkpoint's value first. Another width used to fail in
    Lightning's state-dict load with a page of shape mismatches; another loop count, text or window order trained on
    silently, and the record then claimed the new settings for every step. The checkpoint is read weights-only; a
    DeepSpeed checkpoint directory is left to DeepSpeed's loader."""
    if Path(ckpt_path).is_dir():
        return
    checkpoint = load_weights_only(ckpt_path, mmap=True, kind="pretraining", writer="loopq.pretrain (or loopq.stress)")
    position = checkpoint.get(DATA_POSITION)
    recorded = run_settings(
        checkpoint.get("hyper_parameters") or {}, checkpoint.get("datamodule_hyper_parameters") or {}, position or {}
    )
    current = run_settings(module.hparams, data.hparams, data_position(trainer) if position else {})
    keys = differing_keys(recorded, current)
    if keys:
        raise UsageError(
            f"--ckpt_path {ckpt_path}: trained with other settings ({describe(keys, recorded, current)}); resume "
            "with the checkpoint's settings, or start a new run (another trainer.default_root_dir and model.out_dir, "
            "without --ckpt_path)"
        )


def resume_checkpoint(ckpt_path: str | None, trainer: L.Trainer) -> str | None:
    """The local checkpoint ``--ckpt_path`` names, checked before training. ``last``: the newest whole ``last*.ckpt``
    in the folder a stop on a signal saves to (:func:`loopq.calib.stop_on_signal.checkpoint_dir`) or in a
    ``ModelCheckpoint``'s folder - Lightning's own ``last`` looks only in the latter and, finding nothing, trained
    from step 0 with a warning; here nothing found is an error. A URL is refused (Lightning's remote load
    unpickles), and so is a file that is not a whole torch checkpoint (:func:`check_ckpt_path`)."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        folders = sorted({checkpoint_dir(trainer)} | {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks
                                                      if isinstance(cb, ModelCheckpoint) and cb.dirpath})  # fmt: skip
        found = newest_intact(path for folder in folders for path in folder.glob("last*.ckpt") if path.is_file())
        if found is None:
            raise UsageError(
                f"--ckpt_path last: no last*.ckpt in {', '.join(map(str, folders))}; pass a checkpoint file, or "
                "leave --ckpt_path out to start from step 0"
            )
        return str(found)
    if "://" in ckpt_path:
        raise UsageError(f"--ckpt_path {ckpt_path}: only a local checkpoint file or 'last'; download it first")
    check_ckpt_path(ckpt_path)
    return ckpt_path


#: ``architecture`` (top-level config key or ``--architecture``) -> the pretrainer's class path
ARCHITECTURES = {
    "ouro": "loopq.commands.pretrain.TeacherPretrainer",
    "loopformer": "loopq.commands.pretrain_looped.LoopFormerPretrainer",
    "parcae": "loopq.commands.pretrain_looped.ParcaePretrainer",
}


def requested_architecture(args: Sequence[str]) -> str:
    """The ``architecture`` the command line asks for: the last ``--architecture`` value or top-level key of a
    ``--config`` file, in command-line order (as the parser applies them); ``ouro`` when none says."""
    chosen = "ouro"
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key not in ("--config", "--architecture"):
            continue
        value = value or (args[i + 1] if i + 1 < len(args) else "")
        if key == "--architecture":
            chosen = value
            continue
        try:
            loaded = yaml.safe_load(Path(value).read_text())
        except (OSError, yaml.YAMLError):
            continue  # the CLI parser reports an unreadable config with its own one-line error
        if isinstance(loaded, dict) and "architecture" in loaded:
            chosen = str(loaded["architecture"])
    if chosen not in ARCHITECTURES:
        raise UsageError(f"architecture={chosen!r}: use one of {sorted(ARCHITECTURES)}")
    return chosen


def pretrainer_class(args: Sequence[str]) -> type[LoopedPretrainer]:
    """The pretrainer of the architecture the command line asks for (:func:`requested_architecture`)."""
    module, _, name = ARCHITECTURES[requested_architecture(args)].rpartition(".")
    return getattr(importlib.import_module(module), name)


def build_parser() -> Any:
    """The parser of ``python -m loopq.pretrain`` (of the default architecture), nothing parsed."""
    return capture_parser(lambda: fit_resumable(PretrainCLI, TeacherPretrainer, [], command="loopq.pretrain"))


def main(args: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if args is None else args)
    fit_resumable(PretrainCLI, pretrainer_class(argv), args, command="loopq.pretrain")
