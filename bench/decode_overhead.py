"""Python time of one quantized linear in eager decode, with the GPU kernels stubbed out (runs on a CPU).

    python bench/decode_overhead.py [--calls 2000] [--in-features 2048] [--out-features 6144]

A decode step issues one call per quantized linear group; in eager mode its cost on the host is the Python and
torch-dispatch work of :meth:`loopq.quant.packed.PackedLinearGroup.forward`: after the first (checked) call of a
shape, the plan of :mod:`loopq.kernels.decode_plan` (buffer stamp check, output allocation, two kernel launches).
This replaces every Triton kernel by a stub that returns at once and times the rest on CPU tensors: the host time
per linear that the GPU launches would overlap with. Prints microseconds per call (median of 5 runs) and how many
launches each call issued. Target (issue 43): <= 15 us per linear."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopq.kernels import decode_kernel, ops
from loopq.kernels import quantize_kernel as qk
from loopq.quant.packed import PackedGroupSpec, PackedLinearGroup
from loopq.quant.transforms import kron_factors


class _Stub:
    """``kernel[grid](...)`` that only counts."""

    launches = 0

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        _Stub.launches += 1


def stub_kernels() -> None:
    for module, name in ((qk, "_quantize_kernel"), (qk, "_quantize_dot_kernel"), (decode_kernel, "_decode_kernel")):
        setattr(module, name, _Stub())
    ops.triton_interpreted = lambda: True  # CPU tensors may take the "triton" backend: the kernels are stubs


def packed_group(k: int, n: int) -> PackedLinearGroup:
    """A W4A4 group with a transform, the diagonal, per-loop clips and a bias (every tensor of the hot path)."""
    spec = PackedGroupSpec(("proj",), (n,), k, 4, True, 4, 1, 1, 4, True, True)
    group = PackedLinearGroup(spec)
    n1, n2 = kron_factors(k)
    for t in group.buffers():
        t.zero_()
    group.left.copy_(torch.eye(n1))
    group.right.copy_(torch.eye(n2))
    group.backend = "triton"
    return group


def time_calls(group: PackedLinearGroup, x: torch.Tensor, calls: int) -> tuple[float, float]:
    """Median over 5 runs of the wall seconds and of the process CPU seconds per call (the CPU time excludes the
    time the process waits for a core on a shared machine)."""
    wall, cpu = [], []
    with torch.inference_mode():
        for _ in range(5):
            start, start_cpu = time.perf_counter(), time.process_time()
            for t in range(calls):
                group(x, t % 4)
            wall.append((time.perf_counter() - start) / calls)
            cpu.append((time.process_time() - start_cpu) / calls)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--out-features", type=int, default=6144)
    args = parser.parse_args(argv)
    stub_kernels()
    group = packed_group(args.in_features, args.out_features)
    x = torch.randn(1, 1, args.in_features).half()
    group(x, 0)  # warm-up
    _Stub.launches = 0
    wall, cpu = time_calls(group, x, args.calls)
    launches = _Stub.launches / (5 * args.calls)
    print(
        f"python per quantized linear (M=1, kernels stubbed): {wall * 1e6:.1f} us wall, {cpu * 1e6:.1f} us CPU, "
        f"{launches:g} launches/call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
