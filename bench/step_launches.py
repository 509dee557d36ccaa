"""Kernel launches of one fake-quant calibration step against the FP model's (the GPU check's ``profile`` stage).

The third GPU run profiled one W4A4 student forward+backward at Ouro-1.4B's width (4 layers x 4 loops, batch 4 x 256,
bf16 autocast) at 5.43x the FP step with 20,591 kernel launches, 992 ms of CPU against 201 ms of CUDA time: the
step is bound by the host issuing small kernels, so the number of launches is a first-order proxy for its time.
Counted here on the CPU as a GPU would launch them (``bench/decode_launches.py``'s dispatch counter: views,
allocations and casts to a tensor's own dtype launch nothing), for the same step as the ``profile`` stage
(``loopq.commands.gpu_check.checks``: the same student config, forward under bf16 autocast, next-token
cross-entropy, backward) on a random-weight Ouro-1.4B-width model; the count does not depend on the batch or the
sequence length, so they are small here.

    python bench/step_launches.py --layers 1

Prints launches per step of the FP model and of the student, their ratio, the student's per looped layer
application (layers x 4 loops), and the operators the student launches most; then the student as a GPU runs it,
its fake quantizations as ``loopq.kernels.fake_quant_kernel``'s one launch forward and one backward (the Triton
kernels replaced by stubs that record their launches, as ``bench/decode_launches.py`` does: a count; the values
are uninitialised memory).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_launches import TorchKernels  # the same dispatch counter as the decode-step count

from loopq.commands.gpu_check.checks import STUDENT, train_step
from loopq.kernels import fake_quant_kernel
from loopq.models.ouro import OuroConfig, OuroLM
from loopq.quant import prepare

LOOPS = 4


def step_ops(model: torch.nn.Module, ids: torch.Tensor) -> list[str]:
    """The operators of one forward (bf16 autocast) + cross-entropy + backward, after one warm-up step."""
    step = train_step(model, ids, [], device_type="cpu")
    step()
    with TorchKernels() as counter:
        step()
    return counter.ops


@contextmanager
def fused_fake_quant(launches: list[str]) -> Iterator[None]:
    """The fake quantizations on the fused kernels' path, each Triton launch recorded in ``launches`` instead of run."""

    class Stub:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *args, **kwargs: launches.append(self.name)

    saved = fake_quant_kernel._forward_kernel, fake_quant_kernel._backward_kernel, fake_quant_kernel.DEVICES
    try:
        fake_quant_kernel._forward_kernel, fake_quant_kernel._backward_kernel = Stub("forward"), Stub("backward")
        fake_quant_kernel.DEVICES = {"cpu", "cuda"}
        yield
    finally:
        fake_quant_kernel._forward_kernel, fake_quant_kernel._backward_kernel, fake_quant_kernel.DEVICES = saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1, help="Ouro layers (the count grows linearly with them)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sample (the count does not depend on it)")
    parser.add_argument("--top", type=int, default=12, help="operators listed")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    teacher = OuroLM.from_config(OuroConfig(num_hidden_layers=args.layers), seed=0)  # Ouro-1.4B's other fields
    ids = torch.randint(0, teacher.config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0))
    student = prepare(teacher, STUDENT)
    fp = step_ops(teacher.requires_grad_(True), ids)
    quant = step_ops(student, ids)
    applications = args.layers * LOOPS
    print(f"Ouro-1.4B width, {args.layers} layers x {LOOPS} loops, one forward + backward under bf16 autocast")
    print(f"FP model      {len(fp):6d} launches")
    print(f"W4A4 student  {len(quant):6d} launches ({len(quant) / len(fp):.2f}x the FP step; "
          f"{(len(quant) - len(fp)) / applications:.0f} more per layer application)")  # fmt: skip
    print("student's most launched operators:")
    for name, n in Counter(quant).most_common(args.top):
        print(f"  {n:6d}  {name}")
    triton: list[str] = []
    with fused_fake_quant(triton):
        torch_ops = step_ops(student, ids)
    total = len(torch_ops) + len(triton) // 2  # step_ops runs the step twice: its warm-up and the counted one
    print(f"W4A4 student, fake quantization fused (as on a GPU): {total:6d} launches ({total / len(fp):.2f}x the FP "
          f"step; {len(torch_ops)} torch + {len(triton) // 2} Triton)")  # fmt: skip


if __name__ == "__main__":
    main()
