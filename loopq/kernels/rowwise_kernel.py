"""Triton kernels #4: the models' row-wise operations in one launch each (RMSNorm, the CTA transition adapter,
Ouro's RoPE), on a GPU when no gradient is needed.

:func:`loopq.models.base.rms_norm` (the rule of all three upstream models: widen to fp32, ``x * rsqrt(mean(x^2) +
eps)``, round to the input's dtype, then multiply by the weight in torch's promoted dtype) is eight torch kernels
on a GPU: the widening cast, ``pow``, ``mean``, ``+ eps``, ``rsqrt``, ``*``, the narrowing cast and ``* weight``.
A static decode step at batch 1 is launch-bound (each launch costs about as much as the tiny kernel it runs,
docs/benchmarks.md), and these casts and elementwise ops were 44 % of the BF16 step's launches (140 of 318 at one
Ouro-2.6B layer x 4 loops, ``bench/decode_launches.py``). This kernel does the same arithmetic in one launch: one
program per row, the sum of squares with :func:`~loopq.kernels.quantize_kernel._rms_inverse` (the helper the
quantizer's folded norm uses; IEEE square root and divisions, as the CPU's ``mean`` and ``rsqrt``), then the
reference's roundings with :func:`~loopq.kernels.quantize_kernel._normed_by` (``NORM`` 1: the weight's product
rounded to the input's dtype; 2: kept in fp32, torch's promotion when the two dtypes differ) or, without a weight,
the normalised value rounded to the input's dtype.

Contract: bit-for-bit the arithmetic of ``rms_norm``'s torch ops on a CPU (IEEE division by K and ``1 / sqrt``)
except the order in which the K squares are summed (a tree, not torch's), so ``r = 1 / sqrt(mean + eps)`` may differ
in its last bits (relative gamma_K + 6u at most), and an output by that plus one unit of the input's dtype where
``x r`` lies next to a rounding boundary; where the sum of squares is exact in any order (integer-valued rows), the
outputs are identical (``tests/kernels/test_rowwise_kernel.py``). Torch's own CUDA ops round ``r`` otherwise in its
last bits (``mean`` multiplies by a rounded 1 / K, ``rsqrt`` is ``rsqrtf``, within 2 ulp): on a GPU a frozen teacher
(this kernel) and a training student (the torch ops) may differ there.

Used by ``rms_norm`` only where :func:`applies`: a CUDA tensor, no autograd through the call (decode, prefill,
evaluation, a frozen teacher's forward), not while ``torch.compile`` traces, at most :data:`MAX_K` features.
Calibration's student keeps the torch ops, whose backward autograd derives.

The cross-loop transition adapter (CTA, paper 4.3, :func:`loopq.quant.cta.transition_adapter`) is the same kind of
row-wise work, fifteen torch kernels at 16 bits (the widening cast, the weightless RMSNorm's five, ``a - 1``,
``* n``, ``+ h``, ``+ b``, ``n V``, ``* eta``, ``(.) U^T``, ``+``, the cast back) and one launch of
:func:`transition` here: per row, the sum of squares as above, then ``z = (n V) * eta`` over chunks of the row, then
``((h + (a - 1) n) + b) + z U^T`` in torch's order, written in the input's dtype. Its contract: the elementwise
operations are torch's, in fp32; the two products with ``V`` and ``U^T`` sum in another order (their fp32
rounding), so outputs agree with the torch ops to within those sums' rounding, and bit for bit where every product
and partial sum is exact (dyadic values, ``tests/kernels/test_rowwise_kernel.py``).

Ouro's rotate-half RoPE (:func:`loopq.models.ouro.apply_rope`: ``x * cos + cat(-x2, x1) * sin``, five kernels per
tensor: the negation, the concatenation, two products, the sum) is :func:`rope`, one launch per tensor with the
same roundings (each product and the sum rounded to ``x``'s dtype): the same bits. The three decide with
:func:`applies`, :func:`transition_applies` and :func:`rope_applies`; at one Ouro layer x 4 loops they take a
static decode step from 318 launches to 138 (BF16) and from 303 to 137 (W4A4), ``bench/decode_launches.py``
(Ouro's sandwich norms also take the residual add after them: :func:`rms_norm` with ``residual``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopq.kernels.packing import launch_device, next_pow2
from loopq.kernels.quantize_kernel import _normed_by, _rms_inverse, norm_code, norm_eps

#: the widest row one program holds in registers (Ouro, LoopFormer and Parcae: 512 to 2048)
MAX_K = 16384
#: the sum of squares runs over chunks of this many features (the folded norm's ``NORM_KC``)
CHUNK = 1024
#: dtypes of the input and the weight the kernel takes; others keep the torch ops
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the widest CTA rank the adapter's kernel holds in registers (the paper: 8)
MAX_RANK = 64
#: devices whose tensors take the kernel (``bench/decode_launches.py`` adds ``"cpu"`` to count its launches with the
#: Triton kernels stubbed)
DEVICES = {"cuda"}


@triton.jit
def _rms_norm_kernel(x_ptr, g_ptr, res_ptr, y_ptr, eps, K: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                     NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_RES: tl.constexpr,
                     NUM_CHUNKS: tl.constexpr):  # fmt: skip
    """Row ``program_id`` of ``y = rms_norm(x, g, eps)``, or with ``HAS_RES`` of ``y = res + rms_norm(x, g, eps)``
    (the norm rounded to ``y``'s dtype first, as torch's two ops; ``x``, ``res``, ``y`` rows of ``K``; ``g`` read only
    with ``HAS_W``)."""
    row = tl.program_id(0).to(tl.int64)
    x_blk = x_ptr + row * K
    r = _rms_inverse(x_blk, tl.full([1], 1, tl.int1), K, eps, 1, KC)  # [1]
    for c in tl.static_range(NUM_CHUNKS):
        cols = c * KP + tl.arange(0, KP)
        mask = cols < K
        x = tl.load(x_blk + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g = tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = _normed_by(x, r, x_ptr, g, NORM)
        else:
            y = x * r
        if HAS_RES:
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
            y = tl.load(res_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32) + y
        tl.store(y_ptr + row * K + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def applies(x: Tensor, weight: Tensor | None) -> bool:
    """Whether ``rms_norm(x, weight, eps)`` runs as :func:`rms_norm`: a tensor on one of :data:`DEVICES`, dtypes in
    :data:`DTYPES`, at most :data:`MAX_K` features, a weight of exactly those features with unit stride, no autograd
    graph to record, not inside ``torch.compile``."""
    if x.device.type not in DEVICES or x.dtype not in DTYPES or x.dim() == 0 or not 0 < x.shape[-1] <= MAX_K:
        return False
    if x.numel() == 0:
        return False
    if weight is not None and (weight.dtype not in DTYPES or weight.device != x.device or weight.dim() != 1):
        return False
    if weight is not None and (weight.shape[0] != x.shape[-1] or weight.stride(0) != 1):  # torch would broadcast
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False
    return not torch.compiler.is_compiling()


def norm_dtype(x: Tensor, weight: Tensor | None) -> torch.dtype:
    """The dtype of ``rms_norm(x, weight, eps)``: ``x``'s, promoted with the weight's."""
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)


def residual_applies(h: Tensor, x: Tensor, weight: Tensor | None) -> bool:
    """Whether ``h + rms_norm(x, weight, eps)`` runs as one :func:`rms_norm` with ``residual=h``: the norm as for
    :func:`applies`, ``h`` of ``x``'s shape and device, of the norm's dtype (no further promotion), recording no
    gradient."""
    if not applies(x, weight) or h.shape != x.shape or h.device != x.device or h.dtype != norm_dtype(x, weight):
        return False
    return not (torch.is_grad_enabled() and h.requires_grad)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float | None, residual: Tensor | None = None) -> Tensor:
    """:func:`loopq.models.base.rms_norm` in one launch (the module docstring's contract); ``weight`` ``[K]`` or
    None, ``eps`` None for fp32's machine epsilon; ``residual``: ``residual + rms_norm(...)`` instead, in the same
    launch (torch's two roundings; ``residual`` of ``x``'s shape and the norm's dtype)."""
    k = x.shape[-1]
    if weight is not None and weight.shape[0] != k:
        raise ValueError(f"rms_norm: weight of {weight.shape[0]} features for rows of {k}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != norm_dtype(x, weight)):
        raise ValueError(f"rms_norm: a residual {residual.dtype} {tuple(residual.shape)} for {tuple(x.shape)} rows")
    rows = x.reshape(-1, k)
    rows = rows if rows.is_contiguous() else rows.contiguous()
    res = None if residual is None else residual.reshape(-1, k)
    res = res if res is None or res.is_contiguous() else res.contiguous()
    y = torch.empty(rows.shape, dtype=norm_dtype(x, weight), device=x.device)
    if rows.shape[0]:
        kp = min(next_pow2(k), CHUNK * 4)
        with launch_device(x):
            _rms_norm_kernel[(rows.shape[0],)](
                rows, rows if weight is None else weight, rows if res is None else res, y, norm_eps(eps), K=k, KP=kp,
                KC=min(next_pow2(k), CHUNK), NORM=norm_code(x.dtype, weight), HAS_W=weight is not None,
                HAS_RES=res is not None, NUM_CHUNKS=triton.cdiv(k, kp), num_warps=4 if kp <= 2048 else 8,
                enable_fp_fusion=False,  # round every step as torch does
            )  # fmt: skip
    return y.reshape(x.shape)


@triton.jit
def _transition_kernel(h_ptr, a_ptr, b_ptr, eta_ptr, u_ptr, v_ptr, y_ptr, eps, D: tl.constexpr, R: tl.constexpr,
                       RP: tl.constexpr, DC: tl.constexpr, KC: tl.constexpr):  # fmt: skip
    """Row ``program_id`` of ``A(h) = h + (a - 1) n + b + ((n V) eta) U^T``, ``n = rms_norm(h)`` in fp32 (``a``,
    ``b`` ``[D]``, ``eta`` ``[R]``, ``U``, ``V`` ``[D, R]``, all fp32), over chunks of ``DC`` features."""
    row = tl.program_id(0).to(tl.int64)
    h_blk = h_ptr + row * D
    r = _rms_inverse(h_blk, tl.full([1], 1, tl.int1), D, eps, 1, KC)  # [1]
    j = tl.arange(0, RP)
    j_ok = j < R
    z = tl.zeros([RP], dtype=tl.float32)
    for c0 in range(0, D, DC):
        cols = c0 + tl.arange(0, DC)
        ok = cols < D
        n = tl.load(h_blk + cols, mask=ok, other=0.0).to(tl.float32) * r
        v = tl.load(v_ptr + cols[:, None] * R + j[None, :], mask=ok[:, None] & j_ok[None, :], other=0.0)
        z += tl.sum(n[:, None] * v, axis=0)
    z = z * tl.load(eta_ptr + j, mask=j_ok, other=0.0)
    for c0 in range(0, D, DC):
        cols = c0 + tl.arange(0, DC)
        ok = cols < D
        h = tl.load(h_blk + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + cols[:, None] * R + j[None, :], mask=ok[:, None] & j_ok[None, :], other=0.0)
        a = tl.load(a_ptr + cols, mask=ok, other=0.0)
        out = h + (a - 1.0) * (h * r)
        out = out + tl.load(b_ptr + cols, mask=ok, other=0.0)
        out = out + tl.sum(z[None, :] * u, axis=1)
        tl.store(y_ptr + row * D + cols, out.to(y_ptr.dtype.element_ty), mask=ok)


def transition_applies(h: Tensor, params: tuple[Tensor, ...]) -> bool:
    """Whether :class:`loopq.quant.cta.TransitionAdapters` runs as :func:`transition`: ``h`` as for :func:`applies`,
    its parameters fp32 on ``h``'s device, none of them recording a gradient, and no autocast (a validation step
    under ``bf16-mixed`` computes the adapter as its training steps do)."""
    if not applies(h, None) or any(p.dtype != torch.float32 or p.device != h.device for p in params):
        return False
    a, b, eta, u, v = params
    d, rank = u.shape if u.dim() == 2 else (0, 0)
    if h.shape[-1] != d or a.shape != (d,) or b.shape != (d,) or eta.shape != (rank,) or v.shape != (d, rank):
        return False  # torch raises or broadcasts; the kernel would read out of its rows
    if not 0 < rank <= MAX_RANK:
        return False
    if torch.is_autocast_enabled(h.device.type):  # autocast would run the torch ops' two products in 16 bits
        return False
    return not (torch.is_grad_enabled() and any(p.requires_grad for p in params))


def transition(h: Tensor, a: Tensor, b: Tensor, eta: Tensor, u: Tensor, v: Tensor, eps: float) -> Tensor:
    """:func:`loopq.quant.cta.transition_adapter` of fp32 parameters on ``h`` widened to fp32, written in ``h``'s
    dtype, in one launch (the module docstring's contract)."""
    d, rank = u.shape
    rows = h.reshape(-1, d)
    rows = rows if rows.is_contiguous() else rows.contiguous()
    y = torch.empty(rows.shape, dtype=h.dtype, device=h.device)
    if rows.shape[0]:
        with launch_device(h):
            _transition_kernel[(rows.shape[0],)](
                rows, a.contiguous(), b.contiguous(), eta.contiguous(), u.contiguous(), v.contiguous(), y,
                norm_eps(eps), D=d, R=rank, RP=next_pow2(rank), DC=min(next_pow2(d), 256), KC=min(next_pow2(d), CHUNK),
                enable_fp_fusion=False,  # torch's separate roundings of (a - 1) n and the additions
            )  # fmt: skip
    return y.reshape(h.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, S, sxb, sxh, sxs, scb, sch, scs,
                 HALF: tl.constexpr, HP: tl.constexpr):  # fmt: skip
    """Row ``(b, h, s)`` of the rotate-half RoPE ``x * cos + rotate_half(x) * sin``, every product and the sum
    rounded to ``x``'s dtype as torch's three ops round them (``y`` contiguous ``[B, H, S, 2 HALF]``)."""
    pid = tl.program_id(0).to(tl.int64)
    s = pid % S
    h = (pid // S) % H
    b = pid // S // H
    i = tl.arange(0, HP)
    ok = i < HALF
    x_row = x_ptr + b * sxb + h * sxh + s * sxs
    c_row = b * scb + h * sch + s * scs
    x1 = tl.load(x_row + i, mask=ok, other=0.0)
    x2 = tl.load(x_row + HALF + i, mask=ok, other=0.0)
    ty = x1.dtype
    lo = _rounded_sum(x1, tl.load(cos_ptr + c_row + i, mask=ok, other=0.0), -x2,
                      tl.load(sin_ptr + c_row + i, mask=ok, other=0.0), ty)  # fmt: skip
    hi = _rounded_sum(x2, tl.load(cos_ptr + c_row + HALF + i, mask=ok, other=0.0), x1,
                      tl.load(sin_ptr + c_row + HALF + i, mask=ok, other=0.0), ty)  # fmt: skip
    y_row = y_ptr + pid * 2 * HALF
    tl.store(y_row + i, lo, mask=ok)
    tl.store(y_row + HALF + i, hi, mask=ok)


@triton.jit
def _rounded_sum(x, c, r, s, ty: tl.constexpr):
    """``x * c + r * s`` with each product and the sum rounded to ``ty`` (computed in fp32, as torch does)."""
    a = (x.to(tl.float32) * c.to(tl.float32)).to(ty)
    b = (r.to(tl.float32) * s.to(tl.float32)).to(ty)
    return (a.to(tl.float32) + b.to(tl.float32)).to(ty)


def rope_applies(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether :func:`loopq.models.ouro.apply_rope` runs as :func:`rope`: ``x`` ``[B, H, S, dh]`` as for
    :func:`applies` with unit stride along ``dh``, ``cos`` and ``sin`` of its dtype and device, of one shape that
    broadcasts to ``x``'s without growing it, with unit stride along ``dh``."""
    if not applies(x, None) or x.dim() != 4 or x.stride(-1) != 1 or x.shape[-1] % 2:
        return False
    if any(t.dtype != x.dtype or t.device != x.device or t.dim() == 0 or t.stride(-1) != 1 for t in (cos, sin)):
        return False
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.dim() > 4 or cos.shape[-1] != x.shape[-1]:
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False
    try:
        return torch.broadcast_shapes(x.shape, cos.shape) == x.shape
    except RuntimeError:
        return False


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotate-half RoPE of :func:`loopq.models.ouro.apply_rope` in one launch: the same roundings, elementwise,
    so the same bits; the output contiguous."""
    bsz, heads, seq, dh = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        c = cos.expand(x.shape)  # broadcast dimensions get stride 0
        with launch_device(x):
            _rope_kernel[(bsz * heads * seq,)](
                x, cos, sin, y, heads, seq, *x.stride()[:3], *c.stride()[:3], HALF=dh // 2, HP=next_pow2(dh // 2),
                num_warps=1, enable_fp_fusion=False,
            )  # fmt: skip
    return y
