"""The integer-quantization spec: signed symmetric codes on groups, the bottom of the quantization stack.

For a group g of ``group_size`` consecutive elements along the last dimension (``-1``: the whole row) with clipping
ratio c in (0, 1]:  s_g = c * max|x_g| / q_max,  code = clip(round(x / s_g), q_min, q_max),  q_max = 2^(b-1) - 1,
q_min = -2^(b-1); rounding is half-to-even. The fake-quant training path (:mod:`loopq.quant.primitives`) and the
packed kernels (:mod:`loopq.kernels`) both build on these functions, so their codes agree bit for bit; this module
imports nothing from ``loopq``.

**One arithmetic on every device.** Every division here is an IEEE (correctly rounded) fp32 division by a *tensor*:
PyTorch on CUDA evaluates ``tensor / python_number`` as ``tensor * (1 / number)``, which differs from the CPU's
division by one ulp in about half of all scales (and then flips codes), while ``tensor / tensor`` divides on both.
The Triton quantizer divides with ``tl.math.div_rn`` (plain ``/`` is approximate on NVIDIA GPUs). So the scale is
``(absmax * clip) / q_max`` with ``q_max`` as a 0-dim tensor (:func:`qmax_tensor`) and the code is
``round(x / s)``; ``tests/quant/test_arithmetic.py`` pins both against a float64 oracle and checks that no division
in these paths takes a Python number.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the bit widths a student may use: 4 and 8 are what the kernels run; 3 is fake-quant only (fragility sweeps); 16
#: means unquantized. The one home of bit widths: the kernels and the export read the two below.
SUPPORTED_BITS = (3, 4, 8, 16)
#: what the packed kernels run: int4 weights, int4 (W4A4) or int8 (W4A8) activations
KERNEL_WEIGHT_BITS = 4
KERNEL_ACT_BITS = (4, 8)
#: scales are floored at this value so all-zero groups quantize to 0 instead of NaN (in a dtype where it is not
#: representable, fp16, at that dtype's smallest normal number: :func:`scale_floor`)
SCALE_EPS = 1e-8


def at_least_fp32(x: Tensor) -> Tensor:
    """``x`` in float32, or in its own dtype if that is wider: half/bfloat16 inputs are transformed in fp32 (mixed
    precision), float64 runs stay float64 throughout (a cast to fp32 there puts ~1e-7 noise - e.g. from a
    different batch split across processes - onto 4-bit rounding boundaries)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def qrange(bits: int) -> tuple[int, int]:
    """(q_min, q_max) of signed symmetric ``bits``-bit integers."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def to_groups(x: Tensor, group_size: int) -> Tensor:
    """View ``[..., n]`` as ``[..., n // group_size, group_size]`` (``-1``: one group of n)."""
    n = x.shape[-1]
    g = n if group_size == -1 else group_size
    if n % g:
        raise ValueError(f"group_size={group_size} does not divide the dimension {n}")
    return x.reshape(*x.shape[:-1], n // g, g)


def qmax_tensor(bits: int, like: Tensor) -> Tensor:
    """q_max as a 0-dim tensor of ``like``'s dtype on its device: the divisor of every scale (module docstring)."""
    return torch.full((), qrange(bits)[1], dtype=like.dtype, device=like.device)


def scale_floor(dtype: torch.dtype) -> float:
    """The smallest scale of ``dtype``: :data:`SCALE_EPS`, or the dtype's smallest normal number where that is
    larger (fp16: 1e-8 rounds to 0 there, and an all-zero group would divide 0 by 0). fp32/bf16/fp64: SCALE_EPS."""
    return max(SCALE_EPS, torch.finfo(dtype).tiny)


def scales_from_absmax(absmax: Tensor, bits: int, clip: Tensor | float = 1.0) -> Tensor:
    """s = (clip * absmax) / q_max, floored at :func:`scale_floor`: one fp32 product, one IEEE division."""
    scaled = absmax * clip
    return torch.div(scaled, qmax_tensor(bits, scaled)).clamp_min(scale_floor(scaled.dtype))


def group_scales(groups: Tensor, bits: int, clip: Tensor | float = 1.0) -> Tensor:
    """Per-group scale s = clip * absmax / q_max, shape ``[..., G, 1]``; ``clip`` broadcasts over rows."""
    return scales_from_absmax(groups.abs().amax(dim=-1, keepdim=True), bits, clip)


def quantize_codes(x: Tensor, bits: int, group_size: int, clip: Tensor | float = 1.0) -> tuple[Tensor, Tensor]:
    """Integer codes (int8 storage) and per-group scales ``[..., G]`` - the form the kernels consume."""
    qmin, qmax = qrange(bits)
    groups = to_groups(x, group_size)
    scales = group_scales(groups, bits, clip)
    codes = torch.round(groups / scales).clamp(qmin, qmax).to(torch.int8)
    return codes.reshape(x.shape), scales.squeeze(-1)


def dequantize_codes(codes: Tensor, scales: Tensor, group_size: int) -> Tensor:
    """Inverse of :func:`quantize_codes` (up to rounding): codes * per-group scale."""
    groups = to_groups(codes.to(scales.dtype), group_size)
    return (groups * scales.unsqueeze(-1)).reshape(codes.shape)
