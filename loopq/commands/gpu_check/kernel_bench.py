"""The kernel benchmark: fused activation quantizer + W4A4 / W4A8 GEMM against a BF16 ``torch.matmul``.

Shapes are Ouro-1.4B's linears as the exported model runs them (:data:`SHAPES`, ``(N, K)``: fused QKV, ``o_proj``, fused
gate+up, ``down_proj``) at M tokens per call (:data:`TOKENS`: decode, a small batch, a calibration-size and a
prefill-size call). Every row is first **checked** - the Triton quantizer must reproduce the torch reference's codes and
scales bit for bit, the Triton GEMM's fp32 output must lie within the fp32 rounding bound of the float64 value of the
same codes (:func:`gemm_fp64_chunked`, in bounded memory: neither the prefill tile kernel of M > 16, which sums several
groups per step with FMA, nor the decode kernel of M <= 16 follows the reference's order; see :mod:`loopq.kernels`) -
then **timed** with ``triton.testing.do_bench`` (median, L2 flushed before every call, so weights are read from memory
as in a real forward), each as the packed model runs it (:func:`timed_calls`: at M <= 16 the decode kernel on the weight
laid out once, as the export stores it). A quantized linear pays quantizer + GEMM per call (``x q+mm``); the goals
(:func:`goal_for`) are on the GEMM alone (``x mm``): at M = 1 it reads 0.5625 bytes per weight (int4 + an fp16 scale per
32) instead of BF16's 2, so up to ~3.6x from bandwidth; at M > 16 a bf16 input takes the 16-bit scheme (the quantizer
writes the quantized values, the GEMM runs bf16 MMAs on them and the dequantized weight: ``ops.prefill_scheme``), at
most ~1x BF16, checked within :func:`~loopq.kernels.gemm_kernel.values_bound`; the integer kernel (int8 ``mma``, at
most 2x BF16 in its MMAs, :mod:`loopq.commands.gpu_check.peaks`) is timed beside it in the JSON.

The check runs wherever the kernels run (CUDA, or Triton's interpreter on CPU at a tiny shape); the timing needs CUDA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from loopq.commands.gpu_check.peaks import DevicePeaks, fraction, gemm_tera_ops, percent, weight_tb_s
from loopq.commands.gpu_check.table import BELOW_GOAL, FAIL, OK, grid
from loopq.kernels import (
    GROUP_SIZE,
    decode_kernel,
    gemm_kernel,
    gemm_w4a4,
    gemm_w4a8,
    ops,
    quantize_activation,
    quantize_kernel,
    quantize_weight,
    unpack_int4,
)
from loopq.kernels.packing import TILE_ROWS, cdiv, tile_weight
from loopq.qspec import dequantize_codes
from loopq.quant.transforms import kron_factors

#: (N, K) of Ouro-1.4B's linears: fused q/k/v, o_proj, fused gate/up, down_proj
SHAPES: tuple[tuple[int, int], ...] = ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632))
TOKENS: tuple[int, ...] = (1, 16, 256, 4096)
CLIP = 0.9
INT4_WEIGHT_BYTES = 0.5 + 2 / 32  # a packed int4 code + its share of one fp16 scale per 32 weights
GEMMS = ((4, gemm_w4a4), (8, gemm_w4a8))
#: ``do_bench``'s warm-up and measured time per timed call (its defaults are 25 and 100 ms)
BENCH_WARMUP_MS, BENCH_REP_MS = 50, 250
#: ``do_bench_cudagraph``'s measured time for the warm quantizer (:func:`warm_table`; decode rows only)
WARM_REP_MS = 100
#: float64 working memory the GEMM reference may hold at once, whatever M and N (:func:`reference_rows`)
REFERENCE_BYTES = 2**30
#: [rows, N] float64 tensors alive at once in :func:`gemm_fp64_chunked`: value, magnitude, and per group the
#: scale product, the dot and their product
REFERENCE_TENSORS = 5


@dataclass
class KernelRow:
    """One (N, K, M): the correctness check, then (on CUDA) the times in milliseconds."""

    n: int
    k: int
    m: int
    problems: list[str] = field(default_factory=list)  # empty: bit-exact quantizers, GEMMs within the fp32 bound
    max_abs_err: float = 0.0  # largest |Triton - torch| of the fp32 GEMM outputs, W4A4 and W4A8
    bf16_ms: float | None = None
    w4a4_quant_ms: float | None = None
    w4a4_gemm_ms: float | None = None
    w4a8_quant_ms: float | None = None
    w4a8_gemm_ms: float | None = None
    #: the decode GEMM's K split (M <= 16): the one ``decode_kernel.k_split`` picks on this device, and the W4A4
    #: GEMM's time at each split it can take (keys "1", "2", "4", "8"), to tune ``PROGRAMS_PER_SM`` and
    #: ``MMA_PROGRAMS_PER_SM`` by
    split: int | None = None
    split_ms: dict[str, float] = field(default_factory=dict)
    #: the W4A4 quantizer replayed in a CUDA graph without flushing L2 (:func:`warm_table`)
    w4a4_quant_warm_ms: float | None = None
    #: the prefill scheme timed as ``w4a4_gemm_ms`` / ``w4a8_gemm_ms`` (M > 16: ``ops.prefill_scheme``), else None
    prefill: str | None = None
    #: prefill (M > 16): the integer scheme's GEMM (``prefill="int8"``) beside the 16-bit one ``w4a4_gemm_ms`` times
    w4a4_int8_gemm_ms: float | None = None


def goal_for(m: int) -> float | None:
    """The W4A4-GEMM speed-up over BF16 issue 28 asks for at M tokens: 2.5x at M <= 16 (weight bandwidth: up to 3.56x
    for int4 + fp16 scales per 32 against bf16), 1.0x at M >= 256 (compute-bound; g32 scales on both operands cost
    CUDA-core work, so ~1.0x without overlap), none in between."""
    if m <= 16:
        return 2.5
    return 1.0 if m >= 256 else None


def speedup(bf16_ms: float | None, ms: float | None) -> float | None:
    """How many times faster than BF16 (> 1: faster); None when either time is missing."""
    return None if bf16_ms is None or ms is None else bf16_ms / ms


def transform_factors(
    k: int, gen: torch.Generator, device: torch.device | str, transform: bool = True
) -> tuple[Tensor | None, Tensor | None]:
    """Dense, well-conditioned Kronecker factors of the size LoopQ uses for input dimension ``k`` (both None
    without ``transform``)."""
    if not transform:
        return None, None
    n1, n2 = kron_factors(k)
    return tuple((torch.eye(n) + 0.1 * torch.randn(n, n, generator=gen)).to(device) for n in (n1, n2))  # type: ignore[return-value]


def reference_rows(m: int, n: int, budget: int = REFERENCE_BYTES) -> int:
    """Rows of the M tokens per chunk of :func:`gemm_fp64_chunked` so that its ``[rows, N]`` float64 working tensors
    (:data:`REFERENCE_TENSORS` of them) fit in ``budget`` bytes (at least one row)."""
    return max(1, min(m, budget // (REFERENCE_TENSORS * 8 * n)))


def gemm_fp64_chunked(
    a_codes: Tensor, a_scales: Tensor, w_codes: Tensor, w_scales: Tensor, budget: int = REFERENCE_BYTES
) -> tuple[Tensor, Tensor]:
    """The float64 value of the GEMM of int8-stored codes and its fp32 rounding bound, ``[M, N]`` each, in bounded
    memory: the kernels' contract (``loopq.kernels``): ``ref64 = sum_g dot_g s_a s_w`` and ``bound = gamma_{G+1}
    sum_k |a_k w_k s_a s_w|``, ``gamma_n = n u / (1 - n u)``, ``u = 2^-24`` (G per-group terms each rounded twice,
    summed by at most G - 1 fp32 additions in any order). A kernel's fp32 ``out`` is correct when
    ``|out - ref64| <= bound``. Computed :func:`reference_rows` tokens at a time and one 32-group at a time, so no
    ``[G, M, N]`` tensor is built (at M = 4096, N = 11264 that is ~22 GiB in float64); besides the two outputs and
    the float64 weight codes it holds at most ``budget`` bytes."""
    m, groups = a_scales.shape
    n = w_codes.shape[0]
    w = w_codes.double().reshape(n, groups, -1)
    w_abs, sw = w.abs(), w_scales.double()
    ref = torch.empty(m, n, dtype=torch.float64, device=a_codes.device)
    bound = torch.empty_like(ref)
    nu = (groups + 1) * 2.0**-24
    rows = reference_rows(m, n, budget)
    for start in range(0, m, rows):
        a = a_codes[start : start + rows].double().reshape(-1, groups, w.shape[2])
        sa = a_scales[start : start + rows].double()
        value = torch.zeros(a.shape[0], n, dtype=torch.float64, device=a.device)
        magnitude = torch.zeros_like(value)
        for g in range(groups):
            s = sa[:, g, None] * sw[None, :, g]
            value += (a[:, g] @ w[:, g].T) * s
            magnitude += (a[:, g].abs() @ w_abs[:, g].T) * s.abs()
        ref[start : start + rows] = value
        bound[start : start + rows] = nu / (1 - nu) * magnitude
    return ref, bound


def check_row(
    n: int,
    k: int,
    m: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    transform: bool = True,
    seed: int = 0,
) -> KernelRow:
    """Triton against the torch backend on ``device`` for one shape (with the online transform unless told not):
    the exact quantizer (``exact=True``) bit-exact (the default fast path on CUDA, tf32x3 tensor cores split across
    ~16 programs per token at M <= 16 and 8 tokens per program above, has a bound, not bit-exactness: the
    ``kernel-tests`` stage checks it against its float64 oracle; :func:`time_row` times it), GEMMs (fed the
    reference's codes, so a quantizer error is not counted twice) within :func:`gemm_fp64_chunked`'s fp32 bound of
    the float64 GEMM; ``max_abs_err`` is the largest |Triton - torch|."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    left, right = transform_factors(k, gen, device, transform)
    w, sw = quantize_weight(torch.randn(n, k, generator=gen).to(device))
    row = KernelRow(n, k, m)
    for bits, gemm in GEMMS:
        ref = quantize_activation(x, left, right, CLIP, bits, backend="torch")
        tri = quantize_activation(x, left, right, CLIP, bits, backend="triton", exact=True)
        if not all(torch.equal(t, r) for t, r in zip(tri, ref, strict=True)):
            row.problems.append(f"W4A{bits} quantizer not bit-exact")
        got = gemm(*ref, w, sw, torch.float32, backend="triton")
        err = (got - gemm(*ref, w, sw, torch.float32, backend="torch")).abs()
        row.max_abs_err = max(row.max_abs_err, float(err.max()))
        ref64, bound = gemm_fp64_chunked(unpack_int4(ref[0]) if bits == 4 else ref[0], ref[1], unpack_int4(w), sw)
        if not bool(((got.double() - ref64).abs() <= bound).all()):
            row.problems.append(f"W4A{bits} GEMM off by up to {float(err.max()):.2e}")
        if dtype in (torch.float16, torch.bfloat16):
            row.problems += check_values(x, left, right, ref, w, sw, bits)
    return row


def check_values(
    x: Tensor, left: Tensor | None, right: Tensor | None, ref: tuple[Tensor, Tensor], w: Tensor, sw: Tensor, bits: int
) -> list[str]:
    """The 16-bit prefill scheme on ``x``'s dtype: the exact quantizer's values are the reference codes ``ref`` times
    their scales rounded once to it (bit for bit), and ``gemm_values`` on them is within
    :func:`~loopq.kernels.gemm_kernel.values_bound` (its fp32 sums' rounding alone)."""
    values, _ = quantize_kernel.quantize_activation(
        x, left, right, CLIP, bits, GROUP_SIZE, True, None, False, None, x.dtype
    )
    want = dequantize_codes(unpack_int4(ref[0]) if bits == 4 else ref[0], ref[1], GROUP_SIZE).to(x.dtype)
    problems = [] if torch.equal(values, want) else [f"W4A{bits} values quantizer not bit-exact"]
    got = gemm_kernel.gemm_values(values, w, sw.half(), torch.float32)
    ref64, bound = gemm_kernel.values_bound(values.cpu(), unpack_int4(w).cpu(), sw.half().cpu())
    if not bool(((got.cpu().double() - ref64).abs() <= bound).all()):
        problems.append(f"W4A{bits} values GEMM off by up to {float((got.cpu().double() - ref64).abs().max()):.2e}")
    return problems


def timed_calls(
    x: Tensor,
    left: Tensor | None,
    right: Tensor | None,
    w: Tensor,
    sw: Tensor,
    bits: int,
    out_dtype: torch.dtype = torch.bfloat16,
    prefill: str | None = None,
) -> tuple[Callable[[], object], Callable[[], object]]:
    """The quantizer and the GEMM of one W4A{bits} row, as the packed model runs them: 1..16 tokens take the decode
    quantizer (codes in the decode order) and the decode GEMM on the weight laid out once beforehand (the export
    stores that layout), more tokens the quantizer and the prefill kernel on the natural layout. So the timed GEMM
    is the kernel alone, never the compatibility path's per-call weight re-layout (``ops._triton_gemm``). Prefill
    takes the scheme ``quantized_linear`` takes for ``x``'s dtype (``ops.prefill_scheme``: bf16's 16-bit values
    scheme, the quantizer writing the values and ``gemm_kernel.gemm_values``), or ``prefill`` if given."""
    m, n = x.shape[0], w.shape[0]
    if m > decode_kernel.MAX_M and ops.prefill_scheme(x.dtype, prefill) == "values":
        quant = partial(
            quantize_kernel.quantize_activation,
            x,
            left,
            right,
            CLIP,
            bits,
            GROUP_SIZE,
            None,
            None,
            False,
            None,
            x.dtype,
        )
        a, _ = quant()
        return quant, partial(gemm_kernel.gemm_values, a, w, sw.half(), out_dtype)
    if m > decode_kernel.MAX_M:
        quant = partial(quantize_activation, x, left, right, CLIP, bits, backend="triton")
        a, sa = quant()
        return quant, partial(dict(GEMMS)[bits], a, sa, w, sw, out_dtype, backend="triton")
    quant = partial(quantize_kernel.quantize_activation, x, left, right, CLIP, bits, GROUP_SIZE, None, None, True)
    a, sa = quant()
    w_codes, w_scales = tile_weight(w, sw.half())
    return quant, partial(decode_kernel.gemm_tiled, a, sa, w_codes, w_scales, n, out_dtype)


def time_row(row: KernelRow, transform: bool = True, seed: int = 0) -> None:
    """Fill ``row``'s times (CUDA, compiled kernels): BF16 ``x @ W^T``, and per W4A4 / W4A8 the quantizer (with the
    transform) and the GEMM (BF16 output) of :func:`timed_calls`, each the median of ``do_bench`` with the L2 cache
    flushed per call."""
    from triton.testing import do_bench, do_bench_cudagraph

    def bench(fn: Callable[[], object]) -> float:
        # compiled (and any lazy setup done) before do_bench sizes its repetitions from the first calls; longer than
        # do_bench's 25 / 100 ms defaults: the first GPU run read the same decode GEMM 1.7x apart as W4A4 and W4A8
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, return_mode="median")

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(row.m, row.k, generator=gen).to("cuda", torch.bfloat16)
    weight = torch.randn(row.n, row.k, generator=gen).to("cuda", torch.bfloat16)
    w, sw = quantize_weight(weight)
    left, right = transform_factors(row.k, gen, "cuda", transform)
    row.bf16_ms = bench(lambda: torch.matmul(x, weight.T))
    row.prefill = ops.prefill_scheme(x.dtype) if row.m > decode_kernel.MAX_M else None
    for bits, _ in GEMMS:
        quant, gemm = timed_calls(x, left, right, w, sw, bits)
        setattr(row, f"w4a{bits}_quant_ms", bench(quant))
        setattr(row, f"w4a{bits}_gemm_ms", bench(gemm))
        if bits == 4 and row.m <= decode_kernel.MAX_M:  # decode-size calls, where launch and cold caches weigh
            row.w4a4_quant_warm_ms = do_bench_cudagraph(quant, rep=WARM_REP_MS, return_mode="median")
    if row.m > decode_kernel.MAX_M:  # the integer prefill scheme beside the 16-bit one bf16 takes (JSON only)
        row.w4a4_int8_gemm_ms = bench(timed_calls(x, left, right, w, sw, 4, prefill="int8")[1])
    if row.m <= decode_kernel.MAX_M:
        _, gemm = timed_calls(x, left, right, w, sw, 4)
        mma = decode_kernel.uses_mma(row.m)
        blocks = cdiv(row.n, decode_kernel.MMA_ROWS if mma else TILE_ROWS)
        row.split = decode_kernel.k_split(blocks, row.k // GROUP_SIZE, decode_kernel.device_sms(x.device), mma)
        row.split_ms = {str(s): bench(partial(gemm, split=s)) for s in SPLITS if not (mma and s > 4)}


#: the K splits the sweep times (``decode_kernel.gemm_tiled(split=)``; the tensor-core kernel of 9..16 tokens takes
#: up to 4)
SPLITS = (1, 2, 4, 8)


def split_table(rows: list[KernelRow]) -> tuple[tuple[str, ...], list[list[str]]]:
    """The K-split sweep of the timed decode rows (headers, cells): the W4A4 GEMM's microseconds at each split, the
    split ``k_split`` chose on the device (``auto``) and the fastest."""
    headers = ("N", "K", "M", *(f"split {s} us" for s in SPLITS), "auto", "fastest")
    cells = [
        [str(r.n), str(r.k), str(r.m), *(_us(r.split_ms.get(str(s))) for s in SPLITS), str(r.split),
         min(r.split_ms, key=r.split_ms.__getitem__)]
        for r in rows if r.split_ms
    ]  # fmt: skip
    return headers, cells


def format_splits(rows: list[KernelRow]) -> str:
    """:func:`split_table` as text (empty without a timed decode row)."""
    headers, cells = split_table(rows)
    return grid(headers, cells, right=range(len(headers))) if cells else ""


def warm_table(rows: list[KernelRow]) -> tuple[tuple[str, ...], list[list[str]]]:
    """The W4A4 quantizer of the decode rows (M <= 16) timed two ways (headers, cells): as in the main table, L2
    flushed before each call, and replayed in a CUDA graph with L2 warm, as in a decode step, where the previous
    kernel has just written ``x`` and the transform's factors are read at every layer. The second GPU run timed
    decode-size quantizers at 8-37 us with L2 flushed; their ratio says how much of that was cold caches (code
    included) and launch."""
    headers = ("N", "K", "M", "A4 q us, L2 flushed", "A4 q us, warm graph", "flushed / warm")
    cells = [
        [str(r.n), str(r.k), str(r.m), _us(r.w4a4_quant_ms), _us(r.w4a4_quant_warm_ms),
         _x(speedup(r.w4a4_quant_ms, r.w4a4_quant_warm_ms))]
        for r in rows if r.w4a4_quant_warm_ms is not None
    ]  # fmt: skip
    return headers, cells


def format_warm(rows: list[KernelRow]) -> str:
    """:func:`warm_table` as text (empty without a timed row)."""
    headers, cells = warm_table(rows)
    return grid(headers, cells, right=range(len(headers))) if cells else ""


def measure(
    shapes: Iterable[tuple[int, int]],
    tokens: Iterable[int],
    transform: bool = True,
    log: Callable[[str], None] = print,
    on_row: Callable[[list[KernelRow]], None] | None = None,
) -> list[KernelRow]:
    """Check and time every M x (N, K) on CUDA, smallest M first (the decode rows, then the larger and slower
    ones); a row that fails its check is not timed. ``on_row`` gets the rows so far after each one (the GPU check
    records them, so a stage cut short keeps what it measured)."""
    rows: list[KernelRow] = []
    shapes = list(shapes)
    for m in tokens:
        for n, k in shapes:
            row = check_row(n, k, m, "cuda", transform=transform)
            if not row.problems:
                time_row(row, transform)
            log(f"  N={n} K={k} M={m}: {'; '.join(row.problems) or 'exact'}")
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    return rows


HEADERS = (
    "N",
    "K",
    "M",
    "bf16 us",
    "TFLOP/s",
    "%bf16 pk",
    "A4 q us",
    "A4 mm us",
    "A4 TOPS",
    "%int8 pk",
    "%HBM",
    "x mm",
    "x q+mm",
    "goal",
    "A8 q us",
    "A8 mm us",
    "%int8 pk",
    "x mm",
    "x q+mm",
    "check",
)


def _us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _tera(row: KernelRow, ms: float | None) -> float | None:
    return None if ms is None else gemm_tera_ops(row.m, row.n, row.k, ms)


def _goal_cell(row: KernelRow) -> str:
    goal, got = goal_for(row.m), speedup(row.bf16_ms, row.w4a4_gemm_ms)
    if goal is None:
        return ""
    return f">={goal}x " + ("?" if got is None else "met" if got >= goal else "MISSED")


def row_cells(row: KernelRow, peaks: DevicePeaks | None) -> list[str]:
    """The printed cells of one row (see :data:`HEADERS`): times in microseconds, throughput, fractions of the
    device's dense peaks (``n/a`` for an unknown device), speed-ups over BF16, goal, check."""
    bf16_peak, int8_peak, hbm = (peaks.bf16_tflops, peaks.int8_tops, peaks.hbm_tb_s) if peaks else (None, None, None)
    if row.prefill == "values":  # the 16-bit scheme runs bf16 MMAs: its peak is bf16's
        int8_peak = bf16_peak
    bf16, a4, a8 = (_tera(row, ms) for ms in (row.bf16_ms, row.w4a4_gemm_ms, row.w4a8_gemm_ms))
    a4_tb_s = None if row.w4a4_gemm_ms is None else weight_tb_s(row.n, row.k, INT4_WEIGHT_BYTES, row.w4a4_gemm_ms)

    def frac(value: float | None, peak: float | None) -> str:
        return "-" if value is None else percent(fraction(value, peak))

    return [
        str(row.n),
        str(row.k),
        str(row.m),
        _us(row.bf16_ms),
        "-" if bf16 is None else f"{bf16:.1f}",
        frac(bf16, bf16_peak),
        _us(row.w4a4_quant_ms),
        _us(row.w4a4_gemm_ms),
        "-" if a4 is None else f"{a4:.1f}",
        frac(a4, int8_peak),
        frac(a4_tb_s, hbm),
        _x(speedup(row.bf16_ms, row.w4a4_gemm_ms)),
        _x(speedup(row.bf16_ms, _sum(row.w4a4_quant_ms, row.w4a4_gemm_ms))),
        _goal_cell(row),
        _us(row.w4a8_quant_ms),
        _us(row.w4a8_gemm_ms),
        frac(a8, int8_peak),
        _x(speedup(row.bf16_ms, row.w4a8_gemm_ms)),
        _x(speedup(row.bf16_ms, _sum(row.w4a8_quant_ms, row.w4a8_gemm_ms))),
        "; ".join(row.problems) or "exact",
    ]


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def format_rows(rows: list[KernelRow], peaks: DevicePeaks | None) -> str:
    """The benchmark table: A4 / A8 = W4A4 / W4A8; ``q`` the quantizer (with transform), ``mm`` the GEMM; ``%int8 pk``
    against the int8 tensor-core peak, or bf16's for rows that ran the 16-bit prefill scheme (``KernelRow.prefill``);
    ``%HBM`` the W4A4 GEMM's weight bytes per second against the memory bandwidth (what bounds M = 1)."""
    return grid(HEADERS, [row_cells(r, peaks) for r in rows], right=range(len(HEADERS) - 1))


def worst_speedup(rows: list[KernelRow], keep: Callable[[int], bool]) -> float | None:
    """The smallest W4A4-GEMM speed-up over BF16 among timed rows whose M passes ``keep``."""
    values = [s for r in rows if keep(r.m) and (s := speedup(r.bf16_ms, r.w4a4_gemm_ms)) is not None]
    return min(values, default=None)


def summarize(rows: list[KernelRow], peaks: DevicePeaks | None) -> tuple[str, str]:
    """(status, one line): FAIL on any mismatch, ``below goal`` when a timed row misses its goal, else ok."""
    bad = [r for r in rows if r.problems]
    at_1, at_256 = worst_speedup(rows, lambda m: m <= 16), worst_speedup(rows, lambda m: m >= 256)
    timed = [(t, r) for r in rows if (t := _tera(r, r.w4a4_gemm_ms)) is not None]
    best, best_row = max(timed, key=lambda pair: pair[0], default=(None, None))
    parts = [f"{len(rows) - len(bad)}/{len(rows)} shapes exact"]
    if bad:
        parts.append("MISMATCH at " + ", ".join(f"N={r.n} K={r.k} M={r.m}" for r in bad))
    parts.append(f"W4A4 GEMM vs bf16, worst shape: M<=16 {_x(at_1)} (goal 2.5x), M>=256 {_x(at_256)} (goal 1.0x)")
    if best is not None:
        kind = "bf16" if best_row.prefill == "values" else "int8"
        peak = (peaks.bf16_tflops if kind == "bf16" else peaks.int8_tops) if peaks else None
        parts.append(f"best W4A4 {best:.0f} TOPS = {percent(fraction(best, peak))} of {kind} peak")
    missed = any(
        (goal := goal_for(r.m)) is not None and (s := speedup(r.bf16_ms, r.w4a4_gemm_ms)) is not None and s < goal
        for r in rows
    )
    return (FAIL if bad else BELOW_GOAL if missed else OK), "; ".join(parts)


def as_dict(row: KernelRow) -> dict[str, object]:
    """A row for the results JSON, with its derived speed-ups."""
    return {
        **dataclasses.asdict(row),
        "w4a4_gemm_speedup": speedup(row.bf16_ms, row.w4a4_gemm_ms),
        "w4a8_gemm_speedup": speedup(row.bf16_ms, row.w4a8_gemm_ms),
        "goal": goal_for(row.m),
    }
