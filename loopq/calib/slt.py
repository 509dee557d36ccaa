"""Scoring the sharing gap S_l of every shared looped group (paper §4.2) on a calibration module.

:func:`sharing_gap_scores` attaches zero per-loop perturbations Delta_t to each still-shared group's transform
(:meth:`QuantLinearGroup.start_probe`), takes gradients of the module's calibration loss w.r.t. them
(``torch.autograd.grad``: parameter gradients and the optimizer are untouched), optionally averages them across
processes, and returns S_l per group (:mod:`loopq.quant.sharing_gap`). ``chunk`` probes that many groups per
forward/backward pass (in model order): every probed group has T per-loop quantized weights and their gradients
alive in the pass, so a real-size model probes in chunks (``slt_probe_groups``) to fit a GPU, at the price of one
pass per chunk and batch; the scores do not depend on the chunking. The SLT reselection schedule
(``callbacks/sharing_gap.py``) promotes the top-scored groups; ``loopq.testbed`` reports the scores of a fresh
student as a property of the teacher.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from loopq.quant import looped_quant_groups
from loopq.quant.sharing_gap import SharingGapAccumulator


def sharing_gap_scores(
    module: Any,
    batches: Sequence[Sequence[Tensor]],
    eps_rel: float = 1e-3,
    reduce: Callable[[Tensor], Tensor] | None = None,
    chunk: int = 0,
) -> dict[str, float]:
    """S_l of every shared looped group with a transform, from per-loop gradients of ``module.compute_loss``.

    ``eps_rel`` scales the curvature floor with each group's mean Fisher (scale-free scores); ``reduce`` averages a
    flat gradient vector across processes (one all-reduce per batch for every chunk); ``chunk`` > 0 probes that many
    groups per pass (0: all in one pass)."""
    groups = {n: g for n, g in looped_quant_groups(module.student).items() if not g.promoted}
    names = list(groups)
    size = chunk if chunk > 0 else max(len(names), 1)
    acc: dict[str, SharingGapAccumulator] = {}
    for start in range(0, len(names), size):
        acc |= probe_chunk(module, {n: groups[n] for n in names[start : start + size]}, batches, reduce)
    psi_scale = {n: float(a.psi.mean()) / a.count for n, a in acc.items()}
    return {n: a.score(eps=eps_rel * psi_scale[n] + 1e-30) for n, a in acc.items()}


def probe_chunk(
    module: Any,
    groups: dict[str, Any],
    batches: Sequence[Sequence[Tensor]],
    reduce: Callable[[Tensor], Tensor] | None,
) -> dict[str, SharingGapAccumulator]:
    """Per-loop gradients phi of ``groups`` (probed together) accumulated over ``batches``."""
    for g in groups.values():
        g.start_probe()
    probed = {n: g for n, g in groups.items() if g.probe is not None}
    acc = {n: SharingGapAccumulator() for n in probed}
    try:
        for batch in batches if probed else []:
            batch = [t.to(module.device) for t in batch]
            with torch.enable_grad():
                loss = module.compute_loss(batch)["loss"]
                deltas = [d for g in probed.values() for d in g.probe]
                grads = torch.autograd.grad(loss, deltas, allow_unused=True)
            phis = [
                per_loop_gradient(grads[2 * i], grads[2 * i + 1], g.slots, loss.device)
                for i, g in enumerate(probed.values())
            ]
            if reduce is not None and phis:
                flat = reduce(torch.cat([p.reshape(-1) for p in phis]))
                phis = [c.view_as(p) for c, p in zip(flat.split([p.numel() for p in phis]), phis, strict=True)]
            for name, phi in zip(probed, phis, strict=True):
                acc[name].add(phi)
    finally:
        for g in groups.values():
            g.stop_probe()
    return acc


def per_loop_gradient(g1: Tensor | None, g2: Tensor | None, slots: int, device: torch.device | None = None) -> Tensor:
    """phi ``[T, J]``: the two Kronecker factors' per-loop perturbation gradients side by side."""
    parts = [g.reshape(slots, -1) for g in (g1, g2) if g is not None]
    return torch.cat(parts, dim=1).detach() if parts else torch.zeros(slots, 1, device=device)
