"""Triton kernel #1: fused online Kronecker transform + per-token group quantization + int4 packing.

One program quantizes ``BLOCK_M`` tokens end to end, in registers except for the compaction of step 1:

1. transform (optional): ``XR = X R`` by loading columns of X from memory, then ``Z = L^T XR`` by pulling rows of
   XR out of registers with a masked sum (exact: one value plus zeros). Both follow the reference order of
   :mod:`loopq.kernels.reference` with separate fp32 multiplies and adds; the launch disables FMA contraction
   (``enable_fp_fusion=False``) so the GPU rounds like torch. ``n1``/``n2`` are padded to powers of two; when
   ``n2`` is not one (e.g. K = 5632 = 64 x 88) the padded rows are compacted back into K order through an fp32
   scratch row in global memory (store, CTA barrier, reload). ``tl.gather`` would avoid the round trip but
   lowers to ~130k warp shuffles per token at K = 5632.
2. per 32-element group: ``s = max(clip * absmax / q_max, 1e-8)`` with IEEE division (``div_rn``; plain ``/``
   is approximate on NVIDIA GPUs);
3. codes = round-half-to-even of ``clamp(x / s, q_min, q_max)``, written by hand without libdevice:
   ``(v + 1.5 * 2^23) - 1.5 * 2^23``. Every fp32 in [2^23, 2^24) is an integer, so the addition itself rounds
   ``v`` to the nearest integer with ties to even (1.5 * 2^23 is even), and the subtraction is exact; valid for
   |v| <= 2^22, guaranteed by clamping first (clamp and round commute for integer bounds). The textbook
   ``floor(v + 0.5)`` is wrong for v = 0.49999997, where ``v + 0.5`` already rounds up to 1.
4. int4: ``tl.split`` pairs (even k, odd k) into one byte (low, high nibble); int8: stored as is.

That exact path (``exact=True``) is the oracle-exact mode and the default in the CPU interpreter. ``exact=False``,
and since its dots compile without spills the default on CUDA (``exact=None``, :func:`uses_fast_path`; not yet timed
on a GPU), selects :func:`_quantize_dot_kernel`, one token per program, whose step 1 is fp32 ``tl.dot``
(``input_precision="ieee"``: FMA, no tf32) on chunks: ``XR_c = X[c, :] R`` for 32 rows of X at a time, accumulated
over 32-column chunks, then ``Z += L^T[:, c] XR_c``, output tiles zero-padded to powers of two >= 16 (e.g. 64 x 128
for K = 5632 = 64 x 88; compacted through the scratch row as above). The chunks bound what a dot holds in registers:
no spills at Ouro's widths on sm_80 and sm_90 (``tests/kernels/test_gpu_compile.py``), where the unchunked dots
spilled 50 KB per thread at K = 5632. A dot changes the summation order, so its contract is a bound, not
bit-exactness: transformed values within :func:`transform_error_bound` of the float64 transform, hence codes equal
to the reference's except where the pre-rounding value lies within that bound of a .5 tie or of the clamp, and
scales within the bound's image (``tests/kernels/test_quantize_kernel.py`` checks both against float64).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopq.kernels.packing import GROUP_SIZE, cdiv, next_pow2

ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23


@triton.jit
def _load_tokens(x_ptr, rows, row_mask, K: tl.constexpr, KP: tl.constexpr):
    cols = tl.arange(0, KP)
    mask = row_mask[:, None] & (cols < K)[None, :]
    return tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scaled(x, d_ptr, cols, col_mask, HAS_D: tl.constexpr):
    """``x * inv_d[cols]`` (the diagonal of the transform, one fp32 multiply as the reference does), or ``x``."""
    if HAS_D:
        x = x * tl.load(d_ptr + cols, mask=col_mask, other=0.0)
    return x


@triton.jit
def _transform_tokens(
    x_ptr,
    d_ptr,
    left_ptr,
    right_ptr,
    scratch_ptr,
    rows,
    row_mask,
    K: tl.constexpr,
    KP: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N1P: tl.constexpr,
    N2P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_D: tl.constexpr,
):
    a = tl.arange(0, N1P)
    b = tl.arange(0, N2P)
    x_rows = x_ptr + rows[:, None] * K + a[None, :] * N2  # &X[m, i, 0]
    x_mask = row_mask[:, None] & (a < N1)[None, :]
    xr = tl.zeros([BLOCK_M, N1P, N2P], dtype=tl.float32)
    for j in range(N2):
        x_col = tl.load(x_rows + j, mask=x_mask, other=0.0).to(tl.float32)  # X[m, :, j]
        x_col = _scaled(x_col, d_ptr, (a * N2 + j)[None, :], (a < N1)[None, :], HAS_D)
        r_row = tl.load(right_ptr + j * N2 + b, mask=b < N2, other=0.0)  # R[j, :]
        xr = xr + x_col[:, :, None] * r_row[None, None, :]
    z = tl.zeros([BLOCK_M, N1P, N2P], dtype=tl.float32)
    for i in range(N1):
        xr_i = tl.sum(tl.where((a == i)[None, :, None], xr, 0.0), axis=1)  # XR[m, i, :]
        l_row = tl.load(left_ptr + i * N1 + a, mask=a < N1, other=0.0)  # L[i, :]
        z = z + l_row[None, :, None] * xr_i[:, None, :]
    if N2P == N2:  # padding only after the last row: already in K order
        return tl.reshape(z, [BLOCK_M, KP])
    a3, b3 = a[None, :, None], b[None, None, :]
    z_mask = row_mask[:, None, None] & (a3 < N1) & (b3 < N2)
    tl.store(scratch_ptr + rows[:, None, None] * K + a3 * N2 + b3, z, mask=z_mask)
    tl.debug_barrier()  # the reload reads other threads' stores
    return _load_tokens(scratch_ptr, rows, row_mask, K, KP)


@triton.jit
def _quantize_kernel(
    x_ptr,
    d_ptr,
    left_ptr,
    right_ptr,
    scratch_ptr,
    codes_ptr,
    scales_ptr,
    M,
    clip,
    K: tl.constexpr,
    KP: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N1P: tl.constexpr,
    N2P: tl.constexpr,
    HAS_TRANSFORM: tl.constexpr,
    BITS: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_D: tl.constexpr = False,
    DECODE: tl.constexpr = False,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * K may exceed 2^31
    row_mask = rows < M
    if HAS_TRANSFORM:
        z = _transform_tokens(
            x_ptr, d_ptr, left_ptr, right_ptr, scratch_ptr, rows, row_mask, K, KP, N1, N2, N1P, N2P, BLOCK_M, HAS_D
        )
    else:
        cols = tl.arange(0, KP)[None, :]
        z = _scaled(_load_tokens(x_ptr, rows, row_mask, K, KP), d_ptr, cols, cols < K, HAS_D)

    _quantize_store(z, rows, row_mask, codes_ptr, scales_ptr, clip, K, KP, BITS, QMIN, QMAX, BLOCK_M, DECODE)


@triton.jit
def _quantize_store(
    z,
    rows,
    row_mask,
    codes_ptr,
    scales_ptr,
    clip,
    K: tl.constexpr,
    KP: tl.constexpr,
    BITS: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DECODE: tl.constexpr = False,
):
    """Steps 2-4 on transformed tokens ``z [BLOCK_M, KP]`` (K order, zero past K): scales, codes, packing.
    ``DECODE``: int8 codes in the decode GEMM's order (per group 16 even k, then 16 odd k), whatever ``BITS``."""
    groups = tl.reshape(z, [BLOCK_M, KP // 32, 32])
    absmax = tl.max(tl.abs(groups), axis=2)
    scale = tl.maximum(tl.math.div_rn(absmax * clip, QMAX), 1e-8)
    g = tl.arange(0, KP // 32)
    g_mask = row_mask[:, None] & (g < K // 32)[None, :]
    tl.store(scales_ptr + rows[:, None] * (K // 32) + g[None, :], scale, mask=g_mask)

    v = tl.math.div_rn(groups, scale[:, :, None])
    v = tl.minimum(tl.maximum(v, QMIN), QMAX)
    q = ((v + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int32)
    if DECODE:
        even, odd = tl.split(tl.reshape(q, [BLOCK_M, KP // 32, 16, 2]))
        p = tl.arange(0, 16)[None, None, :]
        base = codes_ptr + rows[:, None, None] * K + g[None, :, None] * 32 + p
        mask = g_mask[:, :, None] & (p < 16)
        tl.store(base, even.to(tl.int8), mask=mask)
        tl.store(base + 16, odd.to(tl.int8), mask=mask)
    elif BITS == 4:
        even, odd = tl.split(tl.reshape(q, [BLOCK_M, KP // 2, 2]))
        packed = ((even & 0xF) | ((odd & 0xF) << 4)).to(tl.uint8)
        c = tl.arange(0, KP // 2)
        c_mask = row_mask[:, None] & (c < K // 2)[None, :]
        tl.store(codes_ptr + rows[:, None] * (K // 2) + c[None, :], packed, mask=c_mask)
    else:
        c = tl.arange(0, KP)
        c_mask = row_mask[:, None] & (c < K)[None, :]
        tl.store(codes_ptr + rows[:, None] * K + c[None, :], tl.reshape(q, [BLOCK_M, KP]).to(tl.int8), mask=c_mask)


@triton.jit
def _transform_dot(
    x_ptr,
    d_ptr,
    left_ptr,
    right_ptr,
    scratch_ptr,
    row,
    K: tl.constexpr,
    KP: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N1P: tl.constexpr,
    N2P: tl.constexpr,
    CI: tl.constexpr,
    CJ: tl.constexpr,
    HAS_D: tl.constexpr,
):
    """``Z = L^T X R`` of one token as fp32 ``tl.dot`` on chunks (IEEE products and sums, no tf32), so that no dot
    operand is wider than ``CI`` / ``CJ`` along its reduction: for each block of ``CI`` rows of X,
    ``XR_c = X[c, :] R`` accumulated over ``CJ``-column chunks, then ``Z += L^T[:, c] XR_c``. Output tiles are
    padded to ``N1P x N2P`` (powers of two, at least 16 for the dot), reductions to multiples of the chunks; the
    padding adds exact zeros. Returns ``[1, KP]`` in K order, zero past K."""
    a = tl.arange(0, N1P)
    b = tl.arange(0, N2P)
    ci = tl.arange(0, CI)
    cj = tl.arange(0, CJ)
    x_tok = x_ptr + row * K
    z = tl.zeros([N1P, N2P], dtype=tl.float32)
    for i0 in range(0, N1, CI):
        i = i0 + ci
        xr = tl.zeros([CI, N2P], dtype=tl.float32)
        for j0 in range(0, N2, CJ):
            j = j0 + cj
            x_mask = (i < N1)[:, None] & (j < N2)[None, :]
            x = tl.load(x_tok + i[:, None] * N2 + j[None, :], mask=x_mask, other=0.0).to(tl.float32)
            x = _scaled(x, d_ptr, i[:, None] * N2 + j[None, :], x_mask, HAS_D)
            r = tl.load(right_ptr + j[:, None] * N2 + b[None, :], mask=(j < N2)[:, None] & (b < N2)[None, :], other=0.0)
            xr = tl.dot(x, r, xr, input_precision="ieee")  # [c, b] += sum_j X[c, j] R[j, b]
        left_t = tl.load(left_ptr + i[None, :] * N1 + a[:, None], mask=(a < N1)[:, None] & (i < N1)[None, :], other=0.0)
        z = tl.dot(left_t, xr, z, input_precision="ieee")  # [a, b] += sum_c L[c, a] XR[c, b]
    if N2P == N2:  # padding only after the last row: already in K order
        return tl.reshape(z, [1, KP])
    z_mask = (a < N1)[:, None] & (b < N2)[None, :]
    tl.store(scratch_ptr + row * K + a[:, None] * N2 + b[None, :], z, mask=z_mask)
    tl.debug_barrier()  # the reload reads other threads' stores
    return _load_tokens(scratch_ptr, row + tl.arange(0, 1), tl.full([1], True, tl.int1), K, KP)


@triton.jit
def _quantize_dot_kernel(
    x_ptr,
    d_ptr,
    left_ptr,
    right_ptr,
    scratch_ptr,
    codes_ptr,
    scales_ptr,
    M,
    clip,
    K: tl.constexpr,
    KP: tl.constexpr,
    N1: tl.constexpr,
    N2: tl.constexpr,
    N1P: tl.constexpr,
    N2P: tl.constexpr,
    CI: tl.constexpr,
    CJ: tl.constexpr,
    BITS: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    HAS_D: tl.constexpr = False,
    DECODE: tl.constexpr = False,
):
    """The fast path, one token per program: :func:`_transform_dot`, then the same quantization as
    :func:`_quantize_kernel`."""
    row = tl.program_id(0).to(tl.int64)  # M * K may exceed 2^31
    z = _transform_dot(x_ptr, d_ptr, left_ptr, right_ptr, scratch_ptr, row, K, KP, N1, N2, N1P, N2P, CI, CJ, HAS_D)
    rows = row + tl.arange(0, 1)
    _quantize_store(z, rows, rows < M, codes_ptr, scales_ptr, clip, K, KP, BITS, QMIN, QMAX, 1, DECODE)


def quantize_activation(
    x: Tensor,
    left: Tensor | None,
    right: Tensor | None,
    clip: float,
    bits: int,
    group_size: int,
    exact: bool | None = None,
    inv_d: Tensor | None = None,
    decode: bool = False,
) -> tuple[Tensor, Tensor]:
    """Launch the quantizer (arguments already validated by :mod:`loopq.kernels.ops`): one launch, which reads
    ``x`` in its own dtype and multiplies it by ``inv_d`` (fp32 ``[K]``, the transform's diagonal) on load.

    ``exact=True`` runs :func:`_quantize_kernel` (the reference's operation order, bit-exact), ``False`` the
    ``tl.dot`` transform of :func:`_quantize_dot_kernel` (within :func:`transform_error_bound`), ``None`` whichever
    :func:`uses_fast_path` picks: the fast path for compiled kernels on CUDA, the exact one in the CPU interpreter.
    Without a transform both are the same kernel. ``decode``: int8 codes ``[M, K]`` in the decode GEMM's order
    (:func:`loopq.kernels.packing.deinterleave_groups`) for either ``bits``, instead of the packed format."""
    if left is None or right is None or not uses_fast_path(exact, x.device):
        return _quantize_exact(x, left, right, clip, bits, inv_d, decode)
    return _quantize_fast(x, left, right, clip, bits, inv_d, decode)


def uses_fast_path(exact: bool | None, device: torch.device) -> bool:
    """Whether a transformed call takes the ``tl.dot`` path. ``exact=None`` does on CUDA with compiled kernels: its
    chunked dots compile without register spills at Ouro's widths (``tests/kernels/test_gpu_compile.py``); it has
    not been timed on a GPU yet. Under the interpreter (CPU CI) ``None`` stays exact, so the tests comparing the
    Triton backend with the torch reference bit for bit keep doing so."""
    if exact is not None:
        return not exact
    return device.type == "cuda" and isinstance(_quantize_dot_kernel, triton.runtime.JITFunction)


def _outputs(x: Tensor, bits: int, decode: bool = False) -> tuple[Tensor, Tensor]:
    m, k = x.shape
    packed = bits == 4 and not decode
    codes = torch.empty(m, k // 2 if packed else k, dtype=torch.uint8 if packed else torch.int8, device=x.device)
    return codes, torch.empty(m, k // GROUP_SIZE, dtype=torch.float32, device=x.device)


def fp32_value(clip: float) -> float:
    """The fp32 value of ``clip``, as a Python float (what the kernel's fp32 ``clip`` argument holds)."""
    return struct.unpack("f", struct.pack("f", clip))[0]


def dot_padding(n: int) -> int:
    """A Kronecker factor's size on the ``tl.dot`` path: the next power of two, at least 16 (the dot's minimum)."""
    return max(16, next_pow2(n))


class FastConfig(NamedTuple):
    """Compile-time shape of the fast path for one (n1, n2): padded tiles, reduction chunks, warps."""

    n1p: int
    n2p: int
    kp: int  # the quantized vector's padded length: n1p * n2p when it is already in K order, else next_pow2(K)
    ci: int  # rows of X (= reduction of the second dot) per chunk
    cj: int  # columns of X (= reduction of the first dot) per chunk
    num_warps: int


def fast_config(n1: int, n2: int) -> FastConfig:
    """One token per program, both reductions in chunks of 32 (16 for a factor padded to 16), 8 warps for a
    64 x 128 output tile (K = 5632; 32 fp32 accumulators per thread), 4 below. Ahead of time (``ptxas -v``,
    ``tests/kernels/gpu_compile.py``) this holds Ouro's widths without spills: 122 / 170 registers at K = 5632 and
    72 / 78 at K = 2048 on sm_90 / sm_80; the unchunked dots spilled 50 KB per thread at K = 5632."""
    n1p, n2p = dot_padding(n1), dot_padding(n2)
    kp = n1p * n2p if n2p == n2 else next_pow2(n1 * n2)
    return FastConfig(n1p, n2p, kp, min(32, n1p), min(32, n2p), 8 if n1p * n2p >= 8192 else 4)


class QuantizeLaunch(NamedTuple):
    """Everything of one quantizer launch but its tensors and clip: which kernel, the grid, the constexprs, and
    whether it needs the fp32 ``[M, K]`` scratch row of a transform whose ``n2`` is not a power of two. A function
    of the shapes only (:func:`quantize_launch`), so a caller that repeats a call can keep it."""

    fast: bool  # _quantize_dot_kernel, else _quantize_kernel
    grid: tuple[int]
    m: int
    needs_scratch: bool
    constexprs: dict[str, int | float | bool]  # with num_warps and enable_fp_fusion

    def run(
        self,
        x: Tensor,
        inv_d: Tensor | None,
        left: Tensor | None,
        right: Tensor | None,
        scratch: Tensor | None,
        codes: Tensor,
        scales: Tensor,
        clip32: float,
    ) -> None:
        """Launch on contiguous ``x`` (``M * K`` elements), fp32 contiguous factors (None without a transform),
        ``clip32`` already an fp32 value (:func:`fp32_value`); an absent tensor's pointer is ``x``'s (unread)."""
        kernel = _quantize_dot_kernel if self.fast else _quantize_kernel
        kernel[self.grid](
            x, x if inv_d is None else inv_d, x if left is None else left, x if right is None else right,
            x if scratch is None else scratch, codes, scales, self.m, clip32, **self.constexprs,
        )  # fmt: skip


def quantize_launch(
    m: int, k: int, factors: tuple[int, int] | None, bits: int, has_d: bool, decode: bool, fast: bool, cuda: bool
) -> QuantizeLaunch:
    """The launch of the exact kernel (``fast=False``, or no transform) or the ``tl.dot`` one for ``m >= 1`` tokens
    of ``k`` channels, Kronecker factor sizes ``factors`` (None: no transform)."""
    if fast and factors is not None:
        grid, num_warps, scratch, shape = _fast_shape(m, *factors)
    else:
        grid, num_warps, scratch, shape = _exact_shape(m, k, factors, cuda)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    constexprs = dict(K=k, BITS=bits, HAS_D=has_d, QMIN=float(qmin), QMAX=float(qmax), DECODE=decode, **shape)
    constexprs |= dict(num_warps=num_warps, enable_fp_fusion=False)  # the quantization steps round like the reference
    return QuantizeLaunch(fast and factors is not None, grid, m, scratch, constexprs)


def _exact_shape(m: int, k: int, factors: tuple[int, int] | None, cuda: bool) -> tuple[tuple[int], int, bool, dict]:
    """(grid, warps, scratch needed, constexprs) of :func:`_quantize_kernel`: ``BLOCK_M`` tokens per program, as
    many as :func:`_tile_budget` allows."""
    n1, n2 = factors or (1, 1)
    kp, n1p, n2p = next_pow2(k), next_pow2(n1), next_pow2(n2)
    tile = n1p * n2p if factors else kp
    block_m = max(1, min(next_pow2(m), _tile_budget(cuda) // tile))
    shape = dict(KP=kp, N1=n1, N2=n2, N1P=n1p, N2P=n2p, HAS_TRANSFORM=factors is not None, BLOCK_M=block_m)
    return (cdiv(m, block_m),), 8 if tile * block_m >= 4096 else 4, factors is not None and n2p != n2, shape


def _fast_shape(m: int, n1: int, n2: int) -> tuple[tuple[int], int, bool, dict]:
    """(grid, warps, scratch needed, constexprs) of :func:`_quantize_dot_kernel`: one token per program."""
    cfg = fast_config(n1, n2)
    shape = dict(KP=cfg.kp, N1=n1, N2=n2, N1P=cfg.n1p, N2P=cfg.n2p, CI=cfg.ci, CJ=cfg.cj)
    return (m,), cfg.num_warps, cfg.n2p != n2, shape


def _quantize_fast(
    x: Tensor, left: Tensor, right: Tensor, clip: float, bits: int, inv_d: Tensor | None = None, decode: bool = False
) -> tuple[Tensor, Tensor]:
    """Launch :func:`_quantize_dot_kernel` (the fast path)."""
    return _quantize(x, left, right, clip, bits, inv_d, decode, fast=True)


def transform_error_bound(x: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """Float64 ``[M, K]`` bound on ``|Z_fast - Z64|``, ``Z64 = L^T X R`` in float64 of the same fp32 inputs.

    Each dot sums products in fp32 in some order: ``|fl(X R) - X R| <= gamma_{n2} |X| |R|`` and, for
    ``Y = fl(X R)``, ``|fl(L^T Y) - L^T Y| <= gamma_{n1} |L|^T |Y|`` with ``|Y| <= (1 + gamma_{n2}) |X| |R|``
    (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5, with or without FMA); hence
    ``|Z_fast - Z64| <= (gamma_{n1} + gamma_{n2} + gamma_{n1} gamma_{n2}) |L|^T |X| |R|``, ``gamma_n =
    n u / (1 - n u)``, ``u = 2^-24``, n the padded sizes (padding adds exact zeros; the chunked sums of
    :func:`_transform_dot` are still one sum each of at most the padded number of products, in another order).
    Float64's own error on ``Z64`` (``gamma_{n1 + n2}`` with ``u = 2^-53``) is added so the bound also covers the
    oracle."""
    n1, n2 = left.shape[0], right.shape[0]

    def gamma(n: int, u: float = 2.0**-24) -> float:
        return n * u / (1 - n * u)

    g1, g2 = gamma(dot_padding(n1)), gamma(dot_padding(n2))
    rho = g1 + g2 + g1 * g2 + gamma(n1 + n2, 2.0**-53)
    xm = x.double().abs().reshape(-1, n1, n2)
    mag = left.double().abs().T @ xm @ right.double().abs()
    return rho * mag.reshape(x.shape)


def _quantize_exact(
    x: Tensor,
    left: Tensor | None,
    right: Tensor | None,
    clip: float,
    bits: int,
    inv_d: Tensor | None = None,
    decode: bool = False,
) -> tuple[Tensor, Tensor]:
    """Launch :func:`_quantize_kernel` (the exact path)."""
    return _quantize(x, left, right, clip, bits, inv_d, decode, fast=False)


def _quantize(
    x: Tensor,
    left: Tensor | None,
    right: Tensor | None,
    clip: float,
    bits: int,
    inv_d: Tensor | None,
    decode: bool,
    fast: bool,
) -> tuple[Tensor, Tensor]:
    codes, scales = _outputs(x, bits, decode)
    if x.shape[0] == 0:
        return codes, scales
    factors = (left.shape[0], right.shape[0]) if left is not None and right is not None else None
    launch = quantize_launch(*x.shape, factors, bits, inv_d is not None, decode, fast, x.is_cuda)
    x = x.contiguous()
    scratch = torch.empty(x.shape, dtype=torch.float32, device=x.device) if launch.needs_scratch else None
    left, right = (left.float().contiguous(), right.float().contiguous()) if factors else (None, None)
    launch.run(x, inv_d, left, right, scratch, codes, scales, fp32_value(clip))
    return codes, scales


def _tile_budget(cuda: bool) -> int:
    """fp32 elements per program: small on GPU (registers), larger in the CPU interpreter (numpy vectorisation)."""
    return 4096 if cuda else 8192
