"""CPU step time of the per-use weight backward against plain autograd on the same student, in one run (ratio).

    OMP_NUM_THREADS=1 python bench/per_use_step.py --teacher loopq/assets/tiny-ouro --batch 4 --seq 256 --steps 5

Forward + backward of a fresh W4A4 LoopQ student (slt_budget 2, one group promoted, LAS and CTA on), the two
backward modes interleaved step by step so that a shared CPU slows both alike; prints the median of each and the
ratio per-use / autograd.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loopq.models import load_looplm
from loopq.quant import QuantConfig, looped_quant_groups, prepare
from loopq.quant.modules import GroupOptions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--teacher", default="loopq/assets/tiny-ouro")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    teacher = load_looplm(args.teacher)
    ids = torch.randint(0, 100, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    students = {}
    for name, per_use in (("autograd", False), ("per-use", True)):
        s = prepare(teacher, QuantConfig(slt_budget=2), options=GroupOptions(per_use_backward=per_use)).train()
        next(iter(looped_quant_groups(s).values())).promote()
        students[name] = s
    times: dict[str, list[float]] = {n: [] for n in students}
    for step in range(args.steps + 1):
        for name, s in students.items():
            start = time.perf_counter()
            out = s(ids, return_trajectory=True)
            loss = out.logits.float().log_softmax(-1).mean() + sum(h.pow(2).mean() for h in out.loop_states)
            loss.backward()
            s.zero_grad(set_to_none=True)
            if step:  # the first step warms up
                times[name].append(time.perf_counter() - start)
    med = {n: statistics.median(t) for n, t in times.items()}
    for name, m in med.items():
        print(f"{name:9s} median step {m * 1000:8.1f} ms over {args.steps} steps")
    print(f"ratio per-use / autograd: {med['per-use'] / med['autograd']:.3f}")


if __name__ == "__main__":
    main()
