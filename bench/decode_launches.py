"""Kernel launches of one static-cache decode step: the W4A4 / W4A8 exports against their BF16 teacher (issue 43).

Issue 43 asks for "W4A4 decode step launches <= bf16's". A decode step at batch 1 is launch-bound on a GPU (the
second GPU run: 0.93 ms against 0.18 ms of weight reads at one layer, docs/benchmarks.md), so the count is a
first-order proxy for its time. Counted on the CPU, as a GPU would launch them: the Triton kernels are replaced by
stubs that record each launch (so the packed groups take their CUDA path, ``backend="triton"``: quantizer + GEMM,
and the models' RMSNorms, RoPE and CTA adapters theirs, ``loopq.kernels.rowwise_kernel``: one launch each),
and every torch operator that launches a kernel on a GPU is counted with a dispatch mode (allocations, views,
dtype no-ops and metadata are not). The model is the e2e benchmark's: a random-weight Ouro-2.6B layer shape, 4 loops,
``--layers`` layers, uncalibrated students (the launches do not depend on the calibration) with the paper's
components (LAS, CTA; SLT adds no launch: a promoted group picks other tensors for the same kernels).

    python bench/decode_launches.py --layers 1 [--json out.json]

Prints per model: torch kernels, Triton launches, total, and the total's difference from BF16 per looped layer
application (layers x loops); then the operators whose counts differ from BF16's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopq.artifacts import export_student, load_quantized, student_meta
from loopq.commands.gpu_check.flow import write_random_teacher
from loopq.kernels import decode_kernel, gemm_kernel, ops, rowwise_kernel
from loopq.kernels import quantize_kernel as qk
from loopq.models import LoopLM, load_looplm
from loopq.models.static_decode import StaticDecoder
from loopq.quant import QuantConfig, prepare
from loopq.quant.packed import PackedLinearGroup

#: operators that launch no GPU kernel: allocations, views, metadata, and the casts to a tensor's own dtype
FREE = (
    "empty",
    "new_empty",
    "view",
    "reshape",
    "as_strided",
    "_unsafe_view",
    "t.",
    "expand",
    "select",
    "slice",
    "split",
    "permute",
    "unsqueeze",
    "squeeze",
    "transpose",
    "lift_fresh",
    "promote_types",
    "detach",
    "alias",
)
TRITON = (
    (qk, "_quantize_kernel"),
    (qk, "_quantize_dot_kernel"),
    (decode_kernel, "_decode_kernel"),
    (decode_kernel, "_decode_mma_kernel"),
    (gemm_kernel, "_gemm_kernel"),
    (rowwise_kernel, "_rms_norm_kernel"),
    (rowwise_kernel, "_transition_kernel"),
    (rowwise_kernel, "_rope_kernel"),
)
LOOPS = 4


class TorchKernels(TorchDispatchMode):
    """Records the torch operators that launch a GPU kernel (a cast is one only when the dtype changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        out = func(*args, **kwargs)
        same = name.startswith(("to.", "_to_copy")) and out is args[0]
        if not name.startswith(FREE) and not same:
            self.ops.append(name)
        return out


@contextmanager
def stubbed_triton(launches: list[str]) -> Iterator[None]:
    """Every Triton kernel of the packed path replaced by a stub recording ``name`` per launch."""

    def stub(name: str) -> Any:
        class Stub:
            def __getitem__(self, grid: Any) -> Any:
                return lambda *args, **kwargs: launches.append(name)

        return Stub()

    saved = [(mod, name, getattr(mod, name)) for mod, name in TRITON]
    interpreted, devices = ops.triton_interpreted, rowwise_kernel.DEVICES
    try:
        for mod, name in TRITON:
            setattr(mod, name, stub(name))
        ops.triton_interpreted = lambda: True
        rowwise_kernel.DEVICES = {"cpu", *devices}  # the norms and the CTA take their CUDA path too
        yield
    finally:
        for mod, name, kernel in saved:
            setattr(mod, name, kernel)
        ops.triton_interpreted, rowwise_kernel.DEVICES = interpreted, devices


def step_launches(model: LoopLM, prompt: int = 8) -> tuple[list[str], list[str]]:
    """(torch kernels, Triton launches) of one static decode step at batch 1, after a prefill and a first step."""
    launches: list[str] = []
    packed = [m for m in model.modules() if isinstance(m, PackedLinearGroup)]
    for m in packed:
        m.backend = "triton"
    ids = torch.zeros(1, prompt, dtype=torch.long)
    with stubbed_triton(launches), torch.inference_mode():
        decoder = StaticDecoder(model, 1, prompt + 2)
        token = decoder.prefill(ids)[:, -1].argmax(-1)
        decoder.step(token)
        launches.clear()
        with TorchKernels() as kernels:
            decoder.step(token)
    return kernels.ops, launches


def models(root: Path, layers: int) -> dict[str, LoopLM]:
    """The teacher and its exports in float16, which stands in for bfloat16: the same casts (the fp32 norms), and
    the Triton interpreter's argument checks refuse bfloat16 on a CPU."""
    teacher_dir = write_random_teacher(root / "teacher", layers)
    teacher = load_looplm(teacher_dir, dtype=torch.float32).eval()
    out: dict[str, LoopLM] = {"BF16": load_looplm(teacher_dir, dtype=torch.float16).eval()}
    for a_bits in (4, 8):
        student = prepare(teacher, QuantConfig(w_bits=4, a_bits=a_bits, group_size=32, seed=0))
        meta = student_meta(student, teacher_dir, root / f"student-a{a_bits}", [], [1.0] * LOOPS, None)
        path = export_student(student, meta, root / f"export-a{a_bits}")
        out[f"W4A{a_bits}"] = load_quantized(path, dtype=torch.float16).eval()
    return out


def count(layers: int) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        nets = models(Path(tmp), layers)
        rows = {}
        for name, net in nets.items():
            kernels, launches = step_launches(net)
            rows[name] = {"torch": len(kernels), "triton": len(launches), "total": len(kernels) + len(launches),
                          "ops": Counter(kernels) + Counter(launches)}  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="Ouro layers (1.4B: 24, 2.6B: 48)")
    parser.add_argument("--json", type=Path, default=None, help="also write the counts here")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers must be >= 1")
    rows = count(args.layers)
    applications = args.layers * LOOPS
    base = rows["BF16"]
    print(f"one static decode step at batch 1, Ouro-2.6B layer shape, {args.layers} layer(s) x {LOOPS} loops")
    print("| model | torch kernels | Triton launches | total | x BF16 | per layer application vs BF16 |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        extra = (r["total"] - base["total"]) / applications
        ratio = r["total"] / base["total"]
        print(f"| {name} | {r['torch']} | {r['triton']} | {r['total']} | {ratio:.3f} | {extra:+.2f} |")
    for name in ("W4A4", "W4A8"):
        diff = {op: rows[name]["ops"][op] - base["ops"][op] for op in rows[name]["ops"] | base["ops"]}
        print(f"{name} - BF16 by operator: " + ", ".join(f"{op} {d:+d}" for op, d in sorted(diff.items()) if d))
    if args.json:
        args.json.write_text(json.dumps({k: {**v, "ops": dict(v["ops"])} for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
