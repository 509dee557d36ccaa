"""A prepared decode call: the host side of :func:`loopq.kernels.ops.quantized_linear`'s Triton path for 1..16
tokens, decided once per (weight slot, input shape, dtype, device) instead of at every call.

A decode step calls each quantized linear with the same shapes at every token, and the work of a checked call (shape
and device checks, the transform factors' fp32 copies, the clip's fp32 value, the backend, both kernels' grids and
constexprs) gives the same answer every time: ~125 us of Python per linear with the kernels stubbed
(``bench/decode_overhead.py``), against a few microseconds of launch. :func:`plan_decode` computes it all after a
checked call; :meth:`DecodePlan.__call__` then writes the quantizer's codes and scales to the plan's scratch (one
per thread, allocated at its first call: the same call's GEMM consumes it, in stream order), allocates the output
(returned to the caller, so fresh at every call: a CUDA graph capture gets its own) and issues the same two
launches as the checked call: the quantizer (:class:`~loopq.kernels.quantize_kernel.QuantizeLaunch`) and the decode GEMM
(:func:`~loopq.kernels.decode_kernel.gemm_launch`, the launch :func:`~loopq.kernels.decode_kernel.gemm_tiled`
issues; ``tests/kernels/test_decode_plan.py`` checks that both paths launch the same kernels with the same
arguments and give the same bits).

A plan holds views of the tensors it was built from (weight slot, fp32 factors and diagonal, bias: an in-place write
to them reaches it; other dtypes get no plan) and the clip as a float, so its caller must rebuild it when the clip
or the tensors themselves change: :class:`~loopq.quant.packed.PackedLinearGroup` stamps its plans with its buffers'
identities and addresses and the clips' version counter, as ``host_clip`` does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from loopq.kernels import decode_kernel, ops, quantize_kernel
from loopq.kernels.packing import GROUP_SIZE


@dataclass(frozen=True, eq=False, slots=True)
class DecodePlan:
    """The two launches of one quantized linear for a fixed input shape (see the module docstring)."""

    quantize: quantize_kernel.QuantizeLaunch
    inv_d: Tensor | None
    left: Tensor | None  # fp32, contiguous; None without a transform
    right: Tensor | None
    clip: float  # fp32 value
    scratches: dict[int, Scratch]  # per thread, see __call__
    gemm: decode_kernel.GemmLaunch
    w_codes: Tensor  # the weight slot (as int32 words for the dp4a kernel)
    w_scales: Tensor
    bias: Tensor | None
    sizes: tuple[int, int, int]  # M, N, groups
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    norm_weight: Tensor | None = None  # the folded RMSNorm's weight (a view), or None
    norm_eps: float = 0.0  # its fp32 eps

    def __call__(self, x: Tensor) -> Tensor:
        """``y [*x.shape[:-1], N]`` for ``x`` of the planned shape, dtype and device (not checked here)."""
        x = x if x.is_contiguous() else x.contiguous()
        # the quantizer's outputs live in scratch the same call's GEMM consumes, in stream order; one per plan and
        # thread, so two groups of one shape, or two threads decoding with one model, never share it
        s = self.scratches.get(threading.get_ident())
        if s is None:
            m, n, groups = self.sizes
            fresh = scratch(m, groups * GROUP_SIZE, self.quantize.needs_scratch, x.device)
            if self.gemm.split > 1:
                fresh = fresh._replace(part=torch.empty(self.gemm.split, m, n, dtype=torch.float32, device=x.device))
            s = self.scratches.setdefault(threading.get_ident(), fresh)
        self.quantize.run(
            x, self.inv_d, self.left, self.right, s.transform, s.codes, s.scales, self.clip, self.norm_weight,
            self.norm_eps,
        )  # fmt: skip
        out = x.new_empty(self.out_shape, dtype=self.out_dtype)  # x is on the planned device
        g = self.gemm
        if s.part is None:
            part, counters = s.scales, self.w_codes  # stand-ins: an unsplit launch reads neither
        else:
            part, counters = s.part, decode_kernel.arrival_counters(x.device, g.blocks)
        try:
            g.kernel[g.grid](
                s.words if g.words else s.codes, s.scales, self.w_codes, self.w_scales,
                out if self.bias is None else self.bias, out, part, counters, *self.sizes, **g.constexprs,
            )  # fmt: skip
        except BaseException:  # as gemm_tiled: an interrupted interpreter launch leaves no counts behind
            if s.part is not None and not x.is_cuda:
                counters.zero_()
            raise
        return out


class Scratch(NamedTuple):
    """The quantizer's outputs, consumed by the GEMM of the same call: int8 codes ``[M, K]`` (and as int32 words),
    fp32 scales ``[M, K / 32]``, the transform's fp32 row buffer where it needs one, and a split GEMM's fp32
    partial outputs ``[split, M, N]`` (its arrival counters are :func:`~loopq.kernels.decode_kernel.arrival_counters`,
    shared per device and stream, fresh in a CUDA graph capture)."""

    codes: Tensor
    words: Tensor
    scales: Tensor
    transform: Tensor | None
    part: Tensor | None = None


def scratch(m: int, k: int, transform: bool, device: torch.device) -> Scratch:
    """A :class:`Scratch` for ``m`` tokens of ``k`` features on ``device``."""
    codes = torch.empty(m, k, dtype=torch.int8, device=device)
    scales = torch.empty(m, k // GROUP_SIZE, dtype=torch.float32, device=device)
    rows = torch.empty(m, k, dtype=torch.float32, device=device) if transform else None
    return Scratch(codes, codes.view(torch.int32), scales, rows)


def plan_decode(
    x: Tensor,
    w_codes: Tensor,
    w_scales: Tensor,
    n: int,
    left: Tensor | None,
    right: Tensor | None,
    inv_d: Tensor | None,
    clip: float,
    a_bits: int,
    bias: Tensor | None,
    out_dtype: torch.dtype | None,
    backend: str | None,
    norm_weight: Tensor | None = None,
    norm_eps: float | None = None,
    prefill: str | None = None,  # quantized_linear's choice for more tokens: no decode plan depends on it
    *,
    out_shape: tuple[int, ...],
) -> DecodePlan | None:
    """The plan of ``quantized_linear`` with these arguments (which that call has checked), for inputs of ``x``'s
    shape, dtype and device given as ``out_shape[:-1] + (K,)``; None where that call is not the Triton decode path
    (torch backend, no tokens or more than :data:`~loopq.kernels.decode_kernel.MAX_M`)."""
    m, k = x.shape
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not 0 < m <= decode_kernel.MAX_M or n == 0:
        return None
    if ops._resolve_backend(backend, x, "group_size", GROUP_SIZE, out_dtype) != "triton":
        return None
    left, right = ops._transform_factors(left, right, k, x.device)
    if not all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in (left, right, inv_d)):
        return None  # a plan holds views, never copies: in-place writes to its tensors reach it
    fast = left is not None and quantize_kernel.uses_fast_path(None, x.device)
    factors = None if left is None else (left.shape[0], right.shape[0])
    norm = quantize_kernel.norm_code(x.dtype, norm_weight)
    launch = quantize_kernel.quantize_launch(m, k, factors, a_bits, inv_d is not None, True, fast, x.is_cuda, norm)
    gemm = decode_kernel.gemm_launch(m, n, w_codes.shape[0], k // GROUP_SIZE, bias is not None, x.device)
    return DecodePlan(
        launch, inv_d, left, right, quantize_kernel.fp32_value(clip), {},
        gemm, w_codes.view(torch.int32) if gemm.words else w_codes, w_scales, bias, (m, n, k // GROUP_SIZE),
        out_shape, out_dtype, norm_weight, quantize_kernel.norm_eps(norm_eps),
    )  # fmt: skip
