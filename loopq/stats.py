"""Statistics that decide whether a difference between two methods is real (seed repeats, log-gap recovery).

Every calibrated row of a comparison is run with several seeds (``python -m loopq.experiments ... --seeds 0 1 2``:
the seed draws the calibration windows, the random parts of the transforms and Lightning's global seed). The
tables report ``mean ± std`` (sample std, n - 1) and call two rows *separated* when their means differ by more than
``k`` (default 2) times the spread of a single run's difference, ``sqrt(s_a^2 + s_b^2)`` - conservative on
purpose: with 3 seeds the standard error of the mean would claim more than it can hold.

The log-gap recovery of a method, ``R = (ln RTN - ln M) / (ln RTN - ln FP)``, is the share of RTN's perplexity
gap (in log space) that it closes: 0 for RTN itself, 1 for full precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    mean: float
    std: float  # sample std (n - 1); 0 for a single value
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.2f}" if self.n == 1 else f"{self.mean:.2f} ± {self.std:.2f}"


def summarize(values: Sequence[float]) -> Summary:
    """Mean, sample std and count of ``values`` (at least one)."""
    if not values:
        raise ValueError("no values to summarize")
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return Summary(mean, std, n)


def log_gap_recovery(fp: float, rtn: float, method: float) -> float:
    """R = (ln rtn - ln method) / (ln rtn - ln fp); NaN when RTN has no gap to recover."""
    gap = math.log(rtn) - math.log(fp)
    return (math.log(rtn) - math.log(method)) / gap if gap > 0 else math.nan


def separated(a: Summary, b: Summary, k: float = 2.0) -> bool:
    """Do two rows differ by more than ``k`` times the spread of a single run's difference? A row measured once
    (std 0) against one measured once is never called separated: there is no spread to compare with."""
    spread = math.sqrt(a.std**2 + b.std**2)
    return spread > 0 and abs(a.mean - b.mean) > k * spread
