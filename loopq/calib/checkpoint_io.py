"""Crash-safe checkpoint files: write to a temporary file in the same folder, fsync, then atomically rename.

A process killed while saving leaves the previous checkpoint intact (the rename is the commit point). Loading
uses ``torch.load(weights_only=True)``: LoopQ checkpoints hold only tensors and plain Python values, so nothing
is ever unpickled.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        target = Path(path)
        if not target.is_file():
            raise FileNotFoundError(f"checkpoint {target} does not exist; pass --ckpt_path last or a .ckpt file")
        try:
            return torch.load(target, map_location=map_location or "cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"{target}: not a loadable LoopQ checkpoint (weights-only load failed: {err})") from err
