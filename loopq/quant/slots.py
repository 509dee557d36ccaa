"""The one loop-slot policy: which per-loop parameter loop ``t`` uses.

A loop-dependent parameter (LAS clip c_t, an SLT-promoted transform or weight, a CTA adapter, their packed export)
holds one entry per calibrated loop. Loop ``t`` (0-based) reads entry ``t``; loops beyond the calibrated count
(loop extrapolation, paper Fig. 5) reuse the last entry; a shared parameter (one entry) serves every loop, and so
does a call without a loop index (a non-looped prelude/coda group, ``t is None``). Every reader goes through
:func:`loop_slot`, so the rule is written once.
"""

from __future__ import annotations


def loop_slot(t: int | None, entries: int) -> int:
    """Index of the entry loop ``t`` reads among ``entries`` per-loop entries (see module docstring)."""
    if entries < 1:
        raise ValueError(f"a per-loop parameter needs at least one entry, got {entries}")
    if t is None:
        return 0
    if t < 0:
        raise ValueError(f"loop index must be >= 0, got {t}")
    return min(t, entries - 1)
