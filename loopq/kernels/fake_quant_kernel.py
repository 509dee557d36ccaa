"""Triton kernels #5: the calibration's fake quantization (paper Eq. 4 with its STE) in one launch forward and one
backward, on a GPU.

Why. The third GPU run found a calibration step host-bound: 20,591 kernel launches for one 4-layer student step,
992 ms of CPU against 201 ms of GPU time. :func:`loopq.quant.primitives.fake_quant` is eleven torch kernels
forward (``abs``, ``amax``, ``* clip``, ``/ q_max``, ``clamp_min``, ``/ s``, ``round``, ``clamp``, ``* s``, and
the clip's ``sigmoid`` and reshape outside it) and about thirty backward (each op's derivative, the clamp's and the
``amax``'s masks, the sums over broadcast dimensions); every linear input of every loop takes one, and every weight
use one more in the per-use backward's recomputation. Counted on the CPU (``python bench/step_launches.py``), a
one-layer student step launches 3,237 kernels, 2,049 with these kernels (37 % fewer): one launch each way per
fake quantization, plus the clip's gradient, a sum over its groups.

What. Groups of 32 consecutive values (the paper's granularity; other group sizes keep the torch ops), fp32, the
clipping ratio a tensor of one value (an activation quantizer's, per loop with LAS) or one per row (a weight's,
``[rows, 1, 1]``). Forward, per group, torch's operations in torch's order with IEEE divisions: ``absmax`` (NaN
propagating, as ``amax``), ``s = max((absmax * clip) / q_max, floor)``, ``y = s * clamp(round(x / s), q_min,
q_max)`` with round-half-to-even: **bit for bit** the torch ops' output. Backward, the derivative autograd derives
from those ops, step by step in the same elementwise operations: through the rounding as identity (STE) where
``round(x / s)`` lies inside ``[q_min, q_max]`` (``(g s) / s``), to ``s`` from the product (``g * c``) and from the
division (``-(g s)((x / s) / s)`` inside), through ``clamp_min`` where the unclamped scale is at least the floor,
``/ q_max``, to ``clip`` (``* absmax``) and to ``absmax`` (``* clip``), which ``amax`` splits evenly among a group's
equal maxima and ``abs`` signs. Only the two sums over a group's 32 values (and the clip's sum over its groups) run
in another order than torch's: the gradients of values that are not a group's maximum are the torch ops' bit for
bit, the others and the clip's within those sums' fp32 rounding (``tests/kernels/test_fake_quant_kernel.py``).

Where. :func:`loopq.quant.primitives.fake_quant` calls :func:`fake_quant` where :func:`applies`: a tensor on one of
:data:`DEVICES` (CUDA; the tests add the CPU under Triton's interpreter), not inside ``torch.compile`` (a config's
``compile_quantizers`` keeps Inductor's fusion of the same ops). On the CPU nothing changes, so the CPU results of
docs/results.md stand as measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from loopq.kernels.packing import GROUP_SIZE, launch_device
from loopq.kernels.quantize_kernel import ROUND_MAGIC, _absmax
from loopq.qspec import qrange, scale_floor

#: devices whose tensors take the kernels (the tests add ``"cpu"`` with ``TRITON_INTERPRET=1``)
DEVICES = {"cuda"}
#: groups per program: 32 x 32 values, 4 warps
BLOCK = 32
NUM_WARPS = 4


@triton.jit
def _round_even(v, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """``clamp(round(v), q_min, q_max)`` with ties to even, as torch's ``round`` then ``clamp`` (NaN stays NaN; the
    sign of a zero kept, as ``round(-0.3) = -0.0``): clamped first (valid for integer bounds), then rounded by
    adding and subtracting 1.5 * 2^23."""
    c = tl.minimum(tl.maximum(v, QMIN, propagate_nan=tl.PropagateNan.ALL), QMAX, propagate_nan=tl.PropagateNan.ALL)
    c = (c + ROUND_MAGIC) - ROUND_MAGIC
    return tl.where(c == 0.0, v * 0.0, c)


@triton.jit
def _group_math(x, clip, QMAX: tl.constexpr, FLOOR: tl.constexpr):
    """``(absmax, clip * absmax, unclamped scale, scale)`` of groups ``x [BLOCK, 32]`` with ``clip [BLOCK]``."""
    absmax = _absmax(x)
    scaled = absmax * clip
    pre = tl.math.div_rn(scaled, QMAX)
    return absmax, scaled, pre, tl.maximum(pre, FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _load_groups(x_ptr, clip_ptr, n_groups, groups_per_clip, BLOCK: tl.constexpr):
    """Program ``program_id``'s ``BLOCK`` groups: ``(group ids, in range, offsets [BLOCK, 32], x, clip [BLOCK])``."""
    g = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = g < n_groups
    offs = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0)
    return g, ok, offs, x, tl.load(clip_ptr + g // groups_per_clip, mask=ok, other=1.0)


@triton.jit
def _forward_kernel(
    x_ptr,
    clip_ptr,
    y_ptr,
    n_groups,
    groups_per_clip,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    _, ok, offs, x, clip = _load_groups(x_ptr, clip_ptr, n_groups, groups_per_clip, BLOCK)
    _, _, _, s = _group_math(x, clip, QMAX, FLOOR)
    c = _round_even(tl.math.div_rn(x, s[:, None]), QMIN, QMAX)
    tl.store(y_ptr + offs, s[:, None] * c, mask=ok[:, None])


@triton.jit
def _backward_kernel(
    x_ptr,
    clip_ptr,
    gy_ptr,
    gx_ptr,
    gclip_ptr,
    n_groups,
    groups_per_clip,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``gx`` (per value) and ``gclip`` (per group: this group's share of the clip's gradient), recomputing the
    forward from ``x`` (module docstring)."""
    g, ok, offs, x, clip = _load_groups(x_ptr, clip_ptr, n_groups, groups_per_clip, BLOCK)
    gy = tl.load(gy_ptr + offs, mask=ok[:, None], other=0.0)
    absmax, _, pre, s = _group_math(x, clip, QMAX, FLOOR)
    v = tl.math.div_rn(x, s[:, None])
    # clamp's mask is on round(v); clamping to one past the bounds first keeps the rounding trick in range and
    # leaves the test unchanged (v beyond a bound + 1 rounds beyond the bound either way)
    r = _round_even(v, QMIN - 1.0, QMAX + 1.0)
    inside = (r >= QMIN) & (r <= QMAX)
    c = tl.minimum(tl.maximum(r, QMIN, propagate_nan=tl.PropagateNan.ALL), QMAX, propagate_nan=tl.PropagateNan.ALL)
    grad_r = tl.where(inside, gy * s[:, None], 0.0)  # d/dc of s * c, then clamp's mask (round: identity)
    gx = tl.math.div_rn(grad_r, s[:, None])  # d/dx of x / s
    # d/ds: of s * c (the product's other factor), and of x / s (-grad (x / s) / s): two sums over the group
    gs = tl.sum(gy * c, 1) + tl.sum(-grad_r * tl.math.div_rn(v, s[:, None]), 1)
    g_scaled = tl.math.div_rn(tl.where(pre >= FLOOR, gs, 0.0), QMAX)  # clamp_min, then / q_max
    tl.store(gclip_ptr + g, g_scaled * absmax, mask=ok)
    is_max = tl.abs(x) == absmax[:, None]
    count = tl.sum(is_max.to(tl.float32), 1)
    # amax: (grad / count) * mask, as torch (a NaN or inf reaching absmax spreads to the group's every value)
    g_abs = tl.math.div_rn(g_scaled * clip, count)[:, None] * is_max.to(tl.float32)
    sign = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
    tl.store(gx_ptr + offs, gx + g_abs * sign, mask=ok[:, None])


def applies(x: Tensor, bits: int, group_size: int, clip: Tensor | float) -> bool:
    """Whether ``fake_quant(x, bits, group_size, clip)`` runs here: ``x`` fp32 and contiguous on one of
    :data:`DEVICES` with whole 32-groups along its last dimension (``group_size`` 32), at most 8 bits, ``clip`` an
    fp32 tensor on its device of one value or one per row (``[rows, 1, 1]`` for a 2-D ``x [rows, K]``), not inside
    ``torch.compile``."""
    if x.device.type not in DEVICES or x.dtype != torch.float32 or not x.is_contiguous() or x.numel() == 0:
        return False
    if group_size != GROUP_SIZE or x.dim() == 0 or x.shape[-1] % GROUP_SIZE or not 2 <= bits <= 8:
        return False
    if not isinstance(clip, Tensor) or clip.dtype != torch.float32 or clip.device != x.device:
        return False
    if clip.numel() != 1 and (x.dim() != 2 or tuple(clip.shape) != (x.shape[0], 1, 1)):
        return False  # the per-row form: a weight [rows, K]; torch refuses other ranks with it
    return not torch.compiler.is_compiling()


def _launch_args(x: Tensor, clip: Tensor, bits: int) -> tuple[int, int, dict]:
    qmin, qmax = qrange(bits)
    n_groups = x.numel() // GROUP_SIZE
    consts = dict(QMIN=float(qmin), QMAX=float(qmax), FLOOR=scale_floor(torch.float32), BLOCK=BLOCK)
    return n_groups, n_groups // clip.numel(), consts


def forward(x: Tensor, clip: Tensor, bits: int) -> Tensor:
    """``fake_quant(x, bits, 32, clip)``'s value in one launch (:func:`applies` holds)."""
    y = torch.empty_like(x)
    n_groups, per_clip, consts = _launch_args(x, clip, bits)
    with launch_device(x):
        _forward_kernel[(triton.cdiv(n_groups, BLOCK),)](
            x, clip.contiguous(), y, n_groups, per_clip, **consts, num_warps=NUM_WARPS, enable_fp_fusion=False
        )
    return y


def backward(x: Tensor, clip: Tensor, grad_y: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """``(grad_x, grad_clip)`` of :func:`forward` for ``grad_y``: one launch, then the clip's sum over its groups."""
    gx = torch.empty_like(x)
    n_groups, per_clip, consts = _launch_args(x, clip, bits)
    part = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    with launch_device(x):
        _backward_kernel[(triton.cdiv(n_groups, BLOCK),)](
            x, clip.contiguous(), grad_y.contiguous(), gx, part, n_groups, per_clip, **consts,
            num_warps=NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return gx, part.view(clip.numel(), per_clip).sum(1).view(clip.shape)


class _FakeQuant(torch.autograd.Function):
    """:func:`forward` with :func:`backward` as its derivative; saves only ``x`` and ``clip`` (the backward
    recomputes the rest)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, clip: Tensor, bits: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, clip)
        ctx.bits = bits
        return forward(x, clip, bits)

    @staticmethod
    @once_differentiable  # a second derivative is an error, not a silent zero
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_y: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, clip = ctx.saved_tensors
        gx, gclip = backward(x, clip, grad_y, ctx.bits)
        return (gx if ctx.needs_input_grad[0] else None), (gclip if ctx.needs_input_grad[1] else None), None


def fake_quant(x: Tensor, clip: Tensor, bits: int) -> Tensor:
    """``loopq.quant.primitives.fake_quant(x, bits, 32, clip)`` (where :func:`applies`): one launch forward, and,
    where a gradient is recorded, one backward plus the clip's sum."""
    if torch.is_grad_enabled() and (x.requires_grad or clip.requires_grad):
        return _FakeQuant.apply(x, clip, bits)
    return forward(x, clip, bits)
