"""The calibration ``LightningDataModule``: text sources -> tokenized fixed-length samples.

Paper defaults (Table 6): 1024 samples x 256 tokens drawn from random windows of the corpus; deterministic
given ``seed``. Sources are local text/jsonl files (globs relative to the data root; default: the calibration
prose in ``<shared>/data/calibration``) or ``hf:<dataset>[:split[:column]]`` for a Hugging Face dataset such
as the paper's ``hf:mit-han-lab/pile-val-backup:validation:text`` (needs hub access; never used in tests).
Every source passes the guards of :mod:`loopq.data.text`: an ``hf:`` source is refused by dataset id and split
before anything is downloaded (already when the module is built), and by content after the download.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from loopq.data.fingerprints import sampled_hashes
from loopq.data.sampler import CalibrationSampler
from loopq.data.stream import (
    check_one_window,
    check_vocab,
    disjoint_starts,
    random_starts,
    spread_windows,
    token_stream,
    windows_at,
)
from loopq.data.text import (
    DEFAULT_CALIBRATION_SOURCES,
    DataError,
    check_eval_content,
    check_hf_split,
    check_sources_listed,
    read_training_text,
    resolve_sources,
)
from loopq.data.tokenizer import load_tokenizer
from loopq.paths import data_dir


@dataclass(frozen=True)
class HFSource:
    """``hf:name[:split[:column]]``; split defaults to ``validation``, column to ``text``."""

    name: str
    split: str = "validation"
    column: str = "text"

    @classmethod
    def parse(cls, spec: str) -> HFSource:
        """Parse and guard (no download): evaluation splits of benchmarks are refused here."""
        parts = [*spec[3:].split(":"), "", ""]
        source = cls(parts[0], parts[1] or cls.split, parts[2] or cls.column)
        if not source.name:
            raise DataError(f"data.sources {spec!r}: no dataset name; write hf:<dataset>[:split[:column]]")
        check_hf_split(source.name, source.split, f"data.sources {spec!r}")
        return source


def load_hf_text(spec: str, max_docs: int) -> list[str]:
    """``hf:name[:split[:column]]`` -> documents (a user with hub access; ``datasets`` does the download)."""
    source = HFSource.parse(spec)
    import datasets

    ds = datasets.load_dataset(source.name, split=source.split)
    if source.column not in ds.column_names:
        raise DataError(f"data.sources {spec!r}: no column {source.column!r} (has {ds.column_names})")
    docs = [row for row in ds[source.column][:max_docs] if row and row.strip()]
    check_eval_content({f"data.sources {spec!r}": sampled_hashes("\n".join(docs))})
    return docs


@functools.lru_cache(maxsize=4)
def _tokenized(tokenizer: str, sources: tuple[str, ...], root: Path | None) -> Tensor:
    """The token stream of the sources (cached per process: DDP ranks and repeated setups tokenize once)."""
    return token_stream(load_calibration_docs(list(sources), root), load_tokenizer(tokenizer))


def load_calibration_docs(sources: list[str], root: Path | None) -> list[str]:
    """Documents of the ``hf:`` sources then the local files; every name is checked and every local file read (and
    guarded) before anything is downloaded."""
    hub = [s for s in sources if s.startswith("hf:")]
    for spec in hub:
        HFSource.parse(spec)
    local = [s for s in sources if not s.startswith("hf:")]
    local_docs = read_training_text(resolve_sources(local, root)) if local else []
    docs = [doc for spec in hub for doc in load_hf_text(spec, max_docs=20000)] + local_docs
    if not docs:
        raise DataError("data.sources: no text found; list at least one non-empty file")
    return docs


def calibration_stream(tokenizer: str, sources: list[str] | None, root: str | None) -> Tensor:
    """The token stream of the calibration sources (None: :data:`DEFAULT_CALIBRATION_SOURCES` under the data root; an
    empty list is refused), tokenized once per process."""
    check_sources_listed(sources, DEFAULT_CALIBRATION_SOURCES)
    directory = Path(root).expanduser() if root else data_dir()
    listed = DEFAULT_CALIBRATION_SOURCES if sources is None else sources
    return _tokenized(str(tokenizer), tuple(listed), directory)


def check_enough_tokens(tokens: int, num_samples: int, holdout_samples: int, seq_len: int) -> None:
    """The calibration windows and the held-out ones must fit the text side by side: with fewer tokens they overlap,
    the same text is calibrated on several times and the held-out windows repeat training text."""
    check_one_window(tokens, seq_len, "data.sources")
    windows = num_samples + holdout_samples
    if tokens >= windows * seq_len:
        return
    fits = tokens // seq_len - holdout_samples  # samples of this length that fit beside the held-out ones
    lower = [f"data.num_samples to {fits}"] if fits >= 1 else []
    if tokens // windows >= 2:
        lower.append(f"data.seq_len to {tokens // windows}")
    fix = "add text to data.sources" + (f", or lower {' or '.join(lower)}" if lower else "")
    raise DataError(
        f"data.sources: {tokens} tokens, but data.num_samples={num_samples} + data.holdout_samples={holdout_samples} "
        f"windows of data.seq_len={seq_len} need {windows * seq_len} (fewer would overlap, and the held-out windows "
        f"would repeat training text); {fix}"
    )


class CalibrationDataModule(L.LightningDataModule):
    """Random fixed-length windows of the calibration corpus, a held-out batch for diagnostics (windows that overlap
    no calibration window) and, with
    ``val_samples > 0``, held-out validation sets (:mod:`loopq.calib.validation`): ``heldout``, windows of the same
    sources that overlap no calibration or diagnostic window (drawn after them, so the calibration windows do not
    depend on it), and with ``val_sources`` (e.g. ``[wikitext2/wiki.valid.tokens]``) ``extra``, up to
    ``val_samples`` windows spread over those sources. Validation is sharded across processes without padding
    duplicates (each rank's shard is padded to the same number of batches with masked rows)."""

    def __init__(
        self,
        tokenizer: str,
        sources: list[str] | None = None,
        root: str | None = None,
        num_samples: int = 1024,
        seq_len: int = 256,
        batch_size: int = 4,
        holdout_samples: int = 8,
        seed: int = 0,
        vocab_size: int | None = None,
        num_workers: int = 0,
        val_samples: int = 0,
        val_sources: list[str] | None = None,
    ) -> None:
        """Check the options; the text is read and tokenized in ``setup``.

        Args:
            tokenizer: model directory whose tokenizer.json encodes the text (set from model.teacher)
            sources: calibration text files, globs relative to root (default: calibration/*.txt; an empty list is
                refused), or hf: specs
            root: the folder sources are relative to (default: LOOPQ_DATA or the shared data folder)
            num_samples: calibration windows
            seq_len: tokens per window
            batch_size: windows per step and process
            holdout_samples: held-out windows for the per-loop diagnostics
            seed: seed of the window draw
            vocab_size: refuse token ids at or above this (the teacher's vocabulary)
            num_workers: DataLoader worker processes
            val_samples: windows per held-out validation set (0: no validation)
            val_sources: text of the extra validation set (e.g. [wikitext2/wiki.valid.tokens])
        """
        super().__init__()
        if num_samples < 1 or seq_len < 2 or batch_size < 1:
            raise DataError("data.num_samples, data.seq_len and data.batch_size must be positive (seq_len >= 2)")
        if holdout_samples < 0:
            raise DataError(f"data.holdout_samples={holdout_samples}: a count of held-out windows, 0 or more")
        if val_samples < 0 or (val_sources and val_samples == 0):
            raise DataError(f"data.val_samples={val_samples}: use a positive count of validation windows per set")
        check_sources_listed(sources, DEFAULT_CALIBRATION_SOURCES)
        for spec in sources or ():
            if spec.startswith("hf:"):
                HFSource.parse(spec)  # refuse an evaluation split before the teacher is even loaded
        self.save_hyperparameters()
        self.samples: Tensor | None = None
        self.holdout: Tensor | None = None
        #: window offsets in the token stream: "calibration" and "holdout" (:func:`window_starts`)
        self.starts: dict[str, Tensor] = {}
        #: validation set name (loopq.calib.validation.VAL_SETS) -> its windows
        self.val_sets: dict[str, Tensor] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.samples is not None:
            return
        hp = self.hparams
        stream = calibration_stream(hp.tokenizer, hp.sources, hp.root)
        check_enough_tokens(stream.numel(), hp.num_samples, hp.holdout_samples, hp.seq_len)
        self.starts = window_starts(stream.numel(), hp.num_samples, hp.holdout_samples, hp.seq_len, hp.seed)
        windows = windows_at(stream, torch.cat(list(self.starts.values())), hp.seq_len)
        if hp.vocab_size is not None:
            check_vocab(windows, hp.vocab_size, key="data.tokenizer")
        self.samples, self.holdout = windows[: hp.num_samples], windows[hp.num_samples :]
        if hp.val_samples:
            self.val_sets = self.validation_sets(stream, torch.cat(list(self.starts.values())))

    def validation_sets(self, stream: Tensor, taken: Tensor) -> dict[str, Tensor]:
        """``heldout`` (and ``extra`` with ``val_sources``): see the class docstring."""
        hp = self.hparams
        seed = hp.seed + VAL_SEED_OFFSET  # another draw than the calibration windows'
        val = disjoint_starts(stream.numel(), hp.val_samples, hp.seq_len, seed, taken, "data.val_samples")
        sets = {"heldout": windows_at(stream, val, hp.seq_len)}
        if hp.val_sources:
            extra = calibration_stream(hp.tokenizer, hp.val_sources, hp.root)
            check_one_window(extra.numel(), hp.seq_len, "data.val_sources")
            sets["extra"] = spread_windows(extra, hp.val_samples, hp.seq_len)
        for windows in sets.values():
            if hp.vocab_size is not None:
                check_vocab(windows, hp.vocab_size, key="data.tokenizer")
        return sets

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per validation set of (token ids, real-row mask): this rank's shard (rows ``rank::world``),
        padded with masked rows so every rank runs the same number of batches (collectives stay in step)."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return [
            DataLoader(TensorDataset(*rank_shard(windows, rank, world)), batch_size=self.hparams.batch_size)
            for windows in self.val_sets.values()
        ]

    def train_dataloader(self) -> DataLoader:
        """Batches of (sample index, token ids); the order is resumable and world-size invariant.

        ``batch_size`` is per process; under a Trainer the sampler covers steps ``global_step .. max_steps``
        (so a resumed run continues the exact sample order), standalone it covers one pass.
        """
        if self.samples is None:
            raise RuntimeError("CalibrationDataModule.setup() must run before train_dataloader()")
        bs = self.hparams.batch_size
        trainer = self.trainer
        if trainer is not None and trainer.max_steps > 0:
            total, rank, world = trainer.max_steps, trainer.global_rank, trainer.world_size

            def start() -> int:
                return trainer.global_step

        else:
            total, rank, world = -(-len(self.samples) // bs), 0, 1

            def start() -> int:
                return 0

        sampler = CalibrationSampler(len(self.samples), bs, total, self.hparams.seed, rank, world, start)
        return StepResumedLoader(
            TensorDataset(torch.arange(len(self.samples), device="cpu"), self.samples),
            batch_size=bs,
            sampler=sampler,
            num_workers=self.hparams.num_workers,
        )


class StepResumedLoader(DataLoader):
    """The calibration loader: its sampler starts at the trainer's ``global_step``, so a resumed fit continues the
    exact sample order with nothing to store. It says so to Lightning (its stateful-loader protocol, with an empty
    state), which otherwise warned at every mid-epoch resume that the data loader was not resumable."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the position is the trainer's step."""


#: the validation windows' seed is the data seed plus this (any fixed offset: another draw)
VAL_SEED_OFFSET = 7919
#: the diagnostics' held-out windows' seed is the data seed plus this
HOLDOUT_SEED_OFFSET = 104729


def window_starts(tokens: int, num_samples: int, holdout: int, seq_len: int, seed: int) -> dict[str, Tensor]:
    """Offsets of the calibration windows (uniformly random; the first ``num_samples`` of one draw of
    ``num_samples + holdout``, as before the held-out windows were made disjoint, so calibrations are unchanged) and
    of the diagnostics' held-out windows, which overlap no calibration window (each other neither)."""
    calibration = random_starts(tokens, num_samples + holdout, seq_len, seed)[:num_samples]
    held = torch.zeros(0, dtype=torch.long)
    if holdout:
        key = "data.holdout_samples"
        held = disjoint_starts(tokens, holdout, seq_len, seed + HOLDOUT_SEED_OFFSET, calibration, key)
    return {"calibration": calibration, "holdout": held}


def rank_shard(windows: Tensor, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """Rows ``rank::world`` of ``windows`` and a mask of real rows, padded (with row 0, masked) to ceil(N / world)."""
    rows = windows[rank::world]
    pad = -(-windows.shape[0] // world) - rows.shape[0]
    ids = torch.cat([rows, windows[:1].expand(pad, -1)])
    mask = torch.cat([torch.ones(rows.shape[0], dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])
    return ids, mask


def calibration_samples(
    tokenizer: str, num_samples: int, seq_len: int, seed: int = 0, sources: list[str] | None = None
) -> Tensor:
    """``[num_samples, seq_len]`` calibration windows drawn as :class:`CalibrationDataModule` draws them (for the
    training-free baselines, which need one calibration batch and no Trainer)."""
    dm = CalibrationDataModule(
        tokenizer, sources, num_samples=num_samples, seq_len=seq_len, holdout_samples=0, seed=seed
    )
    dm.setup()
    assert dm.samples is not None
    return dm.samples
