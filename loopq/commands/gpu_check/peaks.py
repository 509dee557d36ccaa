"""Dense tensor-core peaks of common GPUs, and what fraction of them a measured kernel reaches.

A GEMM of ``[M, K] x [K, N]`` does ``2 M N K`` operations (a multiply and an add per term). Divided by its time it
gives TFLOP/s (BF16) or TOPS (int8); divided by the device's *dense* peak, the fraction of the tensor cores the
kernel keeps busy. LoopQ's W4A4 GEMM unpacks int4 to int8 and runs int8 ``mma`` (Hopper and Ada have no int4
tensor cores; Ampere's int4 path is not used), so its ceiling is the **int8** peak: about twice the BF16 one on the
data-center GPUs below (four times on the RTX 4090, whose BF16 with fp32 accumulation runs at half rate), which is
why a compute-bound W4A4 GEMM can at best be ~2x a BF16 GEMM there. At M = 1 both are bound by reading the weights
instead: ``hbm_tb_s`` gives the bandwidth against which the weight bytes per call are compared.

Peaks are NVIDIA's datasheet numbers *without* structured sparsity (the datasheets print the sparse figure, twice
the dense one, first), at boost clock; a device whose name matches no row gets ``n/a``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePeaks:
    """Dense peaks of one GPU model: BF16 tensor TFLOP/s (fp32 accumulate), int8 tensor TOPS, HBM/GDDR TB/s."""

    model: str
    bf16_tflops: float
    int8_tops: float
    hbm_tb_s: float


#: (regex on ``torch.cuda.get_device_name()``, peaks); the first match wins, so specific rows come first.
#: Sources (dense = sparse / 2): NVIDIA H100 datasheet (SXM5 / PCIe / NVL), H200 datasheet (SXM / NVL),
#: A100 datasheet (40 GB / 80 GB, SXM4 / PCIe), L40S and L4 datasheets, A10 datasheet, and the Ada Lovelace
#: architecture whitepaper v1.1 for the RTX 4090 (BF16 with fp32 accumulate: 165.2 TFLOP/s, as torch.matmul runs it).
PEAKS: tuple[tuple[str, DevicePeaks], ...] = (
    (r"H100.*NVL", DevicePeaks("H100 NVL", 835.5, 1670.5, 3.9)),
    (r"H100.*PCIe", DevicePeaks("H100 PCIe", 756.5, 1513.0, 2.0)),
    (r"H100", DevicePeaks("H100 SXM5", 989.4, 1978.9, 3.35)),  # "NVIDIA H100 80GB HBM3"
    (r"H200.*NVL", DevicePeaks("H200 NVL", 835.5, 1670.5, 4.8)),
    (r"H200", DevicePeaks("H200 SXM", 989.4, 1978.9, 4.8)),
    (r"A100.*(80GB.*PCIe|PCIe.*80GB)", DevicePeaks("A100 80GB PCIe", 312.0, 624.0, 1.935)),
    (r"A100.*80GB", DevicePeaks("A100 80GB SXM4", 312.0, 624.0, 2.039)),
    (r"A100", DevicePeaks("A100 40GB", 312.0, 624.0, 1.555)),
    (r"L40S", DevicePeaks("L40S", 362.05, 733.0, 0.864)),
    (r"\bL4\b", DevicePeaks("L4", 121.0, 242.5, 0.3)),
    (r"\bA10\b", DevicePeaks("A10", 125.0, 250.0, 0.6)),
    (r"RTX 4090", DevicePeaks("RTX 4090", 165.2, 660.6, 1.008)),
)


def peaks_for(device_name: str) -> DevicePeaks | None:
    """The peaks of the first :data:`PEAKS` row whose pattern matches ``device_name`` (case-insensitive)."""
    return next((peaks for pattern, peaks in PEAKS if re.search(pattern, device_name, flags=re.IGNORECASE)), None)


def gemm_tera_ops(m: int, n: int, k: int, ms: float) -> float:
    """Throughput of an ``[M, K] x [K, N]`` GEMM that took ``ms`` milliseconds, in tera-operations per second."""
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def weight_tb_s(n: int, k: int, bytes_per_weight: float, ms: float) -> float:
    """Bandwidth of reading an ``[N, K]`` weight of ``bytes_per_weight`` bytes each once in ``ms``, in TB/s."""
    return n * k * bytes_per_weight / (ms * 1e-3) / 1e12


def fraction(achieved: float, peak: float | None) -> float | None:
    """``achieved / peak``, or None when the peak is unknown."""
    return None if peak is None else achieved / peak


def percent(value: float | None) -> str:
    """A fraction as a whole percentage, ``n/a`` when unknown."""
    return "n/a" if value is None else f"{100 * value:.0f}%"
