"""A resumable, world-size-invariant sampler for calibration.

The global sample order is a deterministic stream: the concatenation of permutations of the N samples, one per
pass, seeded by ``seed + pass``. Optimizer step s consumes global positions [s*G, (s+1)*G) with G the *global*
batch; rank r of W takes the r-th local slice of it. Hence

* the same global batch gives the same batches whatever the number of processes (1 process x 8 = 2 x 4);
* resuming at step s only needs s: the stream restarts at position s*G (no iterator state to save).

``start_step`` may be a callable (the trainer's ``global_step``): Lightning ends an "epoch" when a resumed run's
shortened iterator runs out and iterates the same sampler again, which must then continue at the current step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler


def stream_indices(num_samples: int, seed: int, start: int, count: int) -> list[int]:
    """Positions [start, start + count) of the global stream of per-pass permutations."""
    out: list[int] = []
    pos = start
    while len(out) < count:
        epoch, offset = divmod(pos, num_samples)
        perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch), device="cpu").tolist()
        take = perm[offset : offset + count - len(out)]
        out.extend(take)
        pos += len(take)
    return out


class CalibrationSampler(Sampler[int]):
    """Yields this rank's indices for optimizer steps ``start_step .. total_steps-1``."""

    def __init__(
        self,
        num_samples: int,
        local_batch: int,
        total_steps: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start_step: int | Callable[[], int] = 0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.num_samples, self.local_batch, self.total_steps = num_samples, local_batch, total_steps
        self.seed, self.rank, self.world_size, self.start_step = seed, rank, world_size, start_step

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.world_size

    def _start(self) -> int:
        return self.start_step() if callable(self.start_step) else self.start_step

    def __len__(self) -> int:
        return max(0, self.total_steps - self._start()) * self.local_batch

    def __iter__(self) -> Iterator[int]:
        for step in range(self._start(), self.total_steps):
            batch = stream_indices(self.num_samples, self.seed, step * self.global_batch, self.global_batch)
            yield from batch[self.rank * self.local_batch : (self.rank + 1) * self.local_batch]
