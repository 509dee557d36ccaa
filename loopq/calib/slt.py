"""The sharing gap S_l of every shared looped group (paper §4.2, Eq. 6) from the per-loop gradients of a backward pass.

For a shared group each loop t uses the same transform P = P1 (x) P2; its gradient is the sum over the loops of
what each use contributes, and the use of loop t contributes

    phi_{t,l} = dL/dDelta_t  at Delta_t = 0,   P_t = P + Delta_t,   P_t^{-1} = P^{-1} - P^{-1} Delta_t P^{-1},

i.e. ``G_P,t - P^{-T} G_{P^-1},t P^{-T}`` for each Kronecker factor, with G_P,t and G_{P^-1},t that use's gradients
w.r.t. the factor and its inverse (the activation and the weight side). :class:`loopq.quant.modules.LoopRecorder`
collects those two gradients per loop in the same backward pass as the training step (nothing weight-sized, no extra
pass, no perturbation of the forward); :func:`loop_gradients` turns them into phi ``[T, n1^2 + n2^2]`` and
:mod:`loopq.quant.sharing_gap` into S_l. The progressive reselection (:mod:`loopq.calib.reselection`) records during
training; :func:`sharing_gap_scores` runs the passes itself (``loopq.testbed`` scores a fresh student with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from loopq.quant import looped_quant_groups
from loopq.quant.modules import LoopRecorder, QuantLinearGroup
from loopq.quant.sharing_gap import SharingGapAccumulator


def scored_groups(student: torch.nn.Module) -> dict[str, QuantLinearGroup]:
    """The groups S_l is defined for: inside the loop, with a learnable transform, not promoted."""
    return {
        n: g
        for n, g in looped_quant_groups(student).items()
        if g.transform is not None and not g.promoted and any(p.requires_grad for p in g.transform.parameters())
    }


@contextmanager
def recording(groups: dict[str, QuantLinearGroup]) -> Iterator[dict[str, LoopRecorder]]:
    """Attach a :class:`LoopRecorder` to every group for the ``with`` block (removed afterwards)."""
    recorders = {n: LoopRecorder(g.slots) for n, g in groups.items()}
    try:
        for name, group in groups.items():
            group.recorder = recorders[name]
        yield recorders
    finally:
        for group in groups.values():
            group.recorder = None


def loop_gradients(recorder: LoopRecorder, inverses: tuple[Tensor, Tensor]) -> Tensor:
    """phi ``[T, n1^2 + n2^2]`` (module docstring) from one backward pass's recorded per-loop gradients; ``inverses``
    are the shared (P1^-1, P2^-1) the pass used."""
    rows = []
    for g_p1, g_p2, g_i1, g_i2 in recorder.grads:
        parts = []
        for g_p, g_inv, inv in ((g_p1, g_i1, inverses[0]), (g_p2, g_i2, inverses[1])):
            phi = torch.zeros_like(inv) if g_p is None else g_p.to(inv.dtype)
            if g_inv is not None:
                phi = phi - inv.transpose(0, 1) @ g_inv.to(inv.dtype) @ inv.transpose(0, 1)
            parts.append(phi.reshape(-1))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def shared_inverses(group: QuantLinearGroup) -> tuple[Tensor, Tensor]:
    """The shared transform's (P1^-1, P2^-1), detached (the same ops as the forward: the same values)."""
    with torch.no_grad():
        _, _, p1_inv, p2_inv = group.transform.matrices()  # type: ignore[union-attr]
    return p1_inv, p2_inv


def gap_scores(acc: dict[str, SharingGapAccumulator], eps_rel: float = 1e-3) -> dict[str, float]:
    """S_l of every accumulated group; the curvature floor scales with the group's mean Fisher (scale-free)."""
    return {n: a.score(eps=eps_rel * float(a.psi.mean()) / a.count + 1e-30) for n, a in acc.items() if a.count}


def reduce_phis(phis: dict[str, Tensor], reduce: Callable[[Tensor], Tensor] | None) -> dict[str, Tensor]:
    """Average every group's phi across processes in one flat collective (identity without ``reduce``)."""
    if reduce is None or not phis:
        return phis
    flat = reduce(torch.cat([p.reshape(-1) for p in phis.values()]))
    return dict(zip(phis, (c.view_as(p) for c, p in zip(flat.split([p.numel() for p in phis.values()]),
                                                          phis.values(), strict=True)), strict=True))  # fmt: skip


def sharing_gap_scores(
    module: Any,
    batches: Sequence[Sequence[Tensor]],
    eps_rel: float = 1e-3,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, float]:
    """S_l of every scored group (:func:`scored_groups`) from one forward/backward pass of ``module.compute_loss`` per
    batch (``torch.autograd.grad``: the parameters' ``.grad`` and the optimizer are untouched); ``reduce`` averages
    phi across processes."""
    groups = scored_groups(module.student)
    acc = {n: SharingGapAccumulator() for n in groups}
    params = [p for g in groups.values() for p in g.transform.parameters() if p.requires_grad]  # type: ignore[union-attr]
    device = getattr(module, "compute_device", None) or module.device
    for batch in batches if groups else []:
        batch = [t.to(device) for t in batch]
        inverses = {n: shared_inverses(g) for n, g in groups.items()}
        with recording(groups) as recorders, torch.enable_grad():
            loss = module.compute_loss(batch)["loss"]
            torch.autograd.grad(loss, params, allow_unused=True)
        phis = reduce_phis({n: loop_gradients(recorders[n], inverses[n]) for n in groups}, reduce)
        for name, phi in phis.items():
            acc[name].add(phi)
    return gap_scores(acc, eps_rel)
