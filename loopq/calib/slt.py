"""Scoring the sharing gap S_l of every shared looped group (paper §4.2) on a calibration module.

:func:`sharing_gap_scores` attaches zero per-loop perturbations Delta_t to each still-shared group's transform
(:class:`LoopProbe`, set with :meth:`QuantLinearGroup.perturb`), takes gradients of the module's calibration loss
w.r.t. them (``torch.autograd.grad``: parameter gradients and the optimizer are untouched), optionally averages them
across processes, and returns S_l per group (:mod:`loopq.quant.sharing_gap`). ``chunk`` probes that many groups per
forward/backward pass (in model order): every probed group has T per-loop quantized weights and their gradients
alive in the pass, so a real-size model probes in chunks (``slt_probe_groups``) to fit a GPU, at the price of one
pass per chunk and batch; the scores do not depend on the chunking. A chunk that runs out of device memory is
halved and probed again (one process: :func:`sharing_gap_scores` returns the chunk size that fit, which the
reselection callback keeps for its later rounds); across processes an out-of-memory error is one line naming the
option, since ranks cannot agree on a retry in the middle of a collective. The SLT reselection schedule
(``callbacks/sharing_gap.py``) promotes the top-scored groups; ``loopq.testbed`` reports the scores of a fresh
student as a property of the teacher.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loopq.errors import LoopQError
from loopq.quant import looped_quant_groups
from loopq.quant.sharing_gap import SharingGapAccumulator

#: (P1, P2, P1^-1, P2^-1) of a transform
Matrices = tuple[Tensor, Tensor, Tensor, Tensor]
#: what a probe pass raises when the device is full (CUDA and other accelerators)
OUT_OF_MEMORY = (torch.OutOfMemoryError,)


class ProbeMemoryError(LoopQError):
    """The SLT probe does not fit even one group per pass, or ran out of memory across processes."""


@dataclass(frozen=True)
class ProbeResult:
    """S_l per probed group; ``fitted``: the groups per pass that fit after running out of memory (what the next
    round should start from), None when the requested chunk fit."""

    scores: dict[str, float]
    fitted: int | None = None


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
    return probe_scores(module, batches, eps_rel, reduce, chunk).scores


def probe_scores(
    module: Any,
    batches: Sequence[Sequence[Tensor]],
    eps_rel: float = 1e-3,
    reduce: Callable[[Tensor], Tensor] | None = None,
    chunk: int = 0,
) -> ProbeResult:
    """:func:`sharing_gap_scores` and the chunk size that fit: a chunk that runs out of memory is halved and probed
    again when ``reduce`` is None (one process); the scores do not depend on the chunking."""
    groups = {n: g for n, g in looped_quant_groups(module.student).items() if not g.promoted}
    names = list(groups)
    size = min(chunk, len(names)) if chunk > 0 else max(len(names), 1)
    acc: dict[str, SharingGapAccumulator] = {}
    start, fitted = 0, None
    while start < len(names):
        part = {n: groups[n] for n in names[start : start + size]}
        found = try_probe_chunk(module, part, batches, reduce)
        if found is None:
            size = fitted = smaller_chunk(size, reduce is not None)
            continue
        acc |= found
        start += len(part)
    psi_scale = {n: float(a.psi.mean()) / a.count for n, a in acc.items()}
    return ProbeResult({n: a.score(eps=eps_rel * psi_scale[n] + 1e-30) for n, a in acc.items()}, fitted)


def try_probe_chunk(
    module: Any,
    groups: dict[str, Any],
    batches: Sequence[Sequence[Tensor]],
    reduce: Callable[[Tensor], Tensor] | None,
) -> dict[str, SharingGapAccumulator] | None:
    """:func:`probe_chunk`, or None when it ran out of device memory (its tensors freed before returning)."""
    try:
        return probe_chunk(module, groups, batches, reduce)
    except OUT_OF_MEMORY:
        pass  # leave the except block first: its traceback holds the failed pass's tensors
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None


def smaller_chunk(size: int, distributed: bool) -> int:
    """The next chunk size after an out-of-memory pass of ``size`` groups (halved), or a one-line error."""
    if distributed:
        raise ProbeMemoryError(
            f"SLT probe ran out of device memory with {size} groups per pass across processes; set "
            f"model.slt_probe_groups (or SharingGapReselection.probe_groups) to {max(1, size // 2)} or less"
        )
    if size <= 1:
        raise ProbeMemoryError(
            "SLT probe ran out of device memory with one group per pass; lower data.batch_size or data.seq_len, "
            "or turn on model.checkpoint_loops / model.checkpoint_weights"
        )
    print(f"[loopq] SLT probe: out of device memory with {size} groups per pass; probing {size // 2} at a time")
    return size // 2


def probe_chunk(
    module: Any,
    groups: dict[str, Any],
    batches: Sequence[Sequence[Tensor]],
    reduce: Callable[[Tensor], Tensor] | None,
) -> dict[str, SharingGapAccumulator]:
    """Per-loop gradients phi of ``groups`` (probed together) accumulated over ``batches``."""
    probes = {n: LoopProbe.of(g) for n, g in groups.items() if g.perturbable}
    probed = {n: groups[n] for n in probes}
    acc = {n: SharingGapAccumulator() for n in probed}
    try:
        for name, probe in probes.items():
            groups[name].perturb(probe)
        for batch in batches if probed else []:
            batch = [t.to(getattr(module, "compute_device", module.device)) for t in batch]
            with torch.enable_grad():
                loss = module.compute_loss(batch)["loss"]
                deltas = [d for probe in probes.values() for d in probe.deltas]
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
        for name in probes:
            groups[name].perturb(None)
    return acc


@dataclass(frozen=True)
class LoopProbe:
    """Zero per-loop perturbations Delta_t ``[T, n, n]`` of a shared group's two Kronecker factors (§4.2): the group
    computes with P_t = P + Delta_t (:func:`probed_matrices`), so the gradients of the loss w.r.t. the deltas are
    the per-loop parts phi_{t,l} of the shared transform's gradient."""

    deltas: tuple[Tensor, Tensor]

    @classmethod
    def of(cls, group: Any) -> LoopProbe:
        """The zero probe of a perturbable group (one slot per loop, the factors' dtype and device)."""
        ref = group.transform.left.log_s
        n1, n2 = ref.numel(), group.transform.right.log_s.numel()
        return cls(
            (
                torch.zeros(group.slots, n1, n1, device=ref.device, dtype=ref.dtype, requires_grad=True),
                torch.zeros(group.slots, n2, n2, device=ref.device, dtype=ref.dtype, requires_grad=True),
            )
        )

    def matrices(
        self, slot: int, shared: tuple[Tensor, Tensor, Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return probed_matrices(shared, self.deltas[0][slot], self.deltas[1][slot])

    def gradients(self) -> Tensor | None:
        """phi ``[T, n1^2 + n2^2]`` accumulated in the deltas' ``.grad`` since the probe was made (or None)."""
        if self.deltas[0].grad is None:
            return None
        slots = self.deltas[0].shape[0]
        return torch.cat([d.grad.reshape(slots, -1) for d in self.deltas], dim=1).detach()


def probed_matrices(shared: Matrices, delta1: Tensor, delta2: Tensor) -> Matrices:
    """(P1 + Delta1, P2 + Delta2) and their inverses to first order, P^-1 - P^-1 Delta P^-1 (§4.2's probe).

    The probe is only ever evaluated at Delta = 0, where this is exact in value *and* gradient, and its forward is
    bit-identical to the unprobed one: a group's probe then leaves every other group's numerics untouched, so S_l
    does not depend on which groups are probed together (``slt_probe_groups``). A numerical inverse of P + Delta
    differs from the transform's own inverse by rounding, enough to flip 4-bit codes and move the scores."""
    p1, p2, p1_inv, p2_inv = shared
    return p1 + delta1, p2 + delta2, p1_inv - p1_inv @ delta1 @ p1_inv, p2_inv - p2_inv @ delta2 @ p2_inv


def per_loop_gradient(g1: Tensor | None, g2: Tensor | None, slots: int, device: torch.device | None = None) -> Tensor:
    """phi ``[T, J]``: the two Kronecker factors' per-loop perturbation gradients side by side."""
    parts = [g.reshape(slots, -1) for g in (g1, g2) if g is not None]
    return torch.cat(parts, dim=1).detach() if parts else torch.zeros(slots, 1, device=device)
