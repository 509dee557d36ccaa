"""Quantization math as small pure functions (paper Eq. 4).

Symmetric uniform round-to-nearest on groups of ``group_size`` consecutive elements along the last (input)
dimension; ``group_size = -1`` means one group over the whole row (per-channel weights / per-token activations).
For a group g with clipping ratio c in (0, 1]:

    s_g = c * max|x_g| / q_max,        Q(x) = s_g * clip(round(x / s_g), q_min, q_max)

with q_max = 2^(b-1) - 1 and q_min = -2^(b-1) (int4: -8..7, int8: -128..127).

**Rounding rule: round-half-to-even** (``torch.round``), which is also what the exported kernels implement
by hand (``loopq.kernels``), so fake-quant and packed integer codes are bit-identical.

Rounding uses a straight-through estimator: the forward value is rounded, the backward pass treats round as
identity. Gradients reach the clipping ratio through the scale s_g (LSQ/FlatQuant-style learnable clipping).
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopq.kernels import fake_quant_kernel
from loopq.qspec import (  # the integer spec the fake-quant path builds on
    group_scales,
    qrange,
    scales_from_absmax,
    to_groups,
)


class _RoundSTE(torch.autograd.Function):
    """round() forward, identity backward: one autograd node instead of ``x + (round(x) - x).detach()``'s four ops."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        return grad


def round_ste(x: Tensor) -> Tensor:
    """Round half to even in the forward pass, identity gradient in the backward pass."""
    return _RoundSTE.apply(x) if torch.is_grad_enabled() and x.requires_grad else torch.round(x)


def fake_quant_groups(groups: Tensor, scales: Tensor, bits: int) -> Tensor:
    """Eq. 4 on grouped values with an STE for rounding: s * clip(round(x / s), q_min, q_max)."""
    qmin, qmax = qrange(bits)
    return scales * round_ste(groups / scales).clamp(qmin, qmax)


def fake_quant(x: Tensor, bits: int, group_size: int, clip: Tensor | float = 1.0) -> Tensor:
    """Dynamic symmetric fake quantization of ``x`` along its last dimension (identity for 16 bits).

    ``clip`` is a ratio in (0, 1]; for weights pass a ``[rows, 1, 1]`` tensor (per output row), for activations
    a scalar tensor (per quantizer, per loop with LAS). On a GPU, fp32 groups of 32 run as one Triton launch each way
    (:mod:`loopq.kernels.fake_quant_kernel`: the same value bit for bit, the gradients up to their sums' order).
    """
    if bits >= 16:
        return x
    if fake_quant_kernel.applies(x, bits, group_size, clip):  # a GPU: one launch each way (same value)
        return fake_quant_kernel.fake_quant(x, clip, bits)  # type: ignore[arg-type]
    groups = to_groups(x, group_size)
    return fake_quant_groups(groups, group_scales(groups, bits, clip), bits).reshape(x.shape)


def clip_ratio(logit: Tensor) -> Tensor:
    """Learnable clipping ratio parameterised as sigmoid(logit): always inside (0, 1)."""
    return torch.sigmoid(logit)


def clip_logit(ratio: float | Tensor) -> Tensor:
    """Inverse of :func:`clip_ratio` (ratios are capped just below 1 so the logit stays finite)."""
    r = torch.as_tensor(ratio, dtype=torch.float32, device=ratio.device if isinstance(ratio, Tensor) else None)
    r = r.clamp(1e-4, 1 - 1e-4)
    return torch.log(r) - torch.log1p(-r)


def clip_grid(device: torch.device | None = None) -> Tensor:
    """The clipping ratios the MSE searches try: 0.55 to 1.0 in 10 steps."""
    return torch.linspace(0.55, 1.0, 10, device=device)


def clip_errors(x: Tensor, bits: int, group_size: int, grid: Tensor | None = None) -> Tensor:
    """The fake-quant MSE of the sample ``x`` at every clipping ratio of ``grid`` (:func:`clip_grid`)."""
    grid = clip_grid(x.device) if grid is None else grid
    return torch.stack([(fake_quant(x, bits, group_size, float(c)) - x).pow(2).mean() for c in grid])


def best_clip_ratio(x: Tensor, bits: int, group_size: int, grid: Tensor | None = None) -> float:
    """The clipping ratio on ``grid`` that minimises the fake-quant MSE of the sample ``x`` (init for LAS)."""
    if bits >= 16:
        return 1.0 - 1e-4
    grid = clip_grid(x.device) if grid is None else grid
    return float(grid[int(torch.argmin(clip_errors(x, bits, group_size, grid)))])


@torch.no_grad()
def row_clip_errors(weight: Tensor, bits: int, group_size: int, grid: Tensor) -> Tensor:
    """``[len(grid), rows]``: the fake-quant squared error of each row of ``weight`` at every clipping ratio of ``grid``
    (the per-row weight-clip search). The same values as ``(fake_quant(weight, bits, group_size, c) - weight)^2``
    summed per row, with the group maxima taken once and the error computed in place: on a real-size model this
    search is most of ``prepare``'s time."""
    qmin, qmax = qrange(bits)
    groups = to_groups(weight, group_size)
    absmax = groups.abs().amax(dim=-1, keepdim=True)
    errors = []
    for c in grid.tolist():
        scales = scales_from_absmax(absmax, bits, c)
        err = torch.div(groups, scales).round_().clamp_(qmin, qmax).mul_(scales).sub_(groups).pow_(2)
        errors.append(err.sum(dim=(-1, -2)))
    return torch.stack(errors)
