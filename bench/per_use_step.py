"""CPU step time of the per-use weight backward against plain autograd on the same student, in one run (ratio).

    OMP_NUM_THREADS=1 python bench/per_use_step.py --teacher loopq/assets/tiny-ouro --batch 4 --seq 256 --steps 5
    OMP_NUM_THREADS=1 python bench/per_use_step.py --ouro_layers 2 --batch 1 --seq 256 --steps 2   # real shapes

``--ouro_layers N`` replaces the teacher by a random fp32 Ouro of the published Ouro-1.4B shape (hidden 2048, MLP
5632, vocab 49152, 4 loops; ``bench/real_shapes.py``) with N layers: the weight chains at their real size.

Forward + backward of a fresh W4A4 LoopQ student (slt_budget 2, one group promoted, LAS and CTA on), the two
backward modes interleaved step by step so that a shared CPU slows both alike; prints the median of each and the
ratio per-use / autograd.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.real_shapes import OURO_1P4B
from loopq.models import load_looplm
from loopq.models.ouro import OuroLM
from loopq.quant import QuantConfig, looped_quant_groups, prepare
from loopq.quant.modules import GroupOptions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--teacher", default="loopq/assets/tiny-ouro")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compiled", action="store_true", help="torch.compile-d quantizer chains (the paper configs)")
    parser.add_argument("--ouro_layers", type=int, default=None, help="random Ouro-1.4B-shaped teacher, N layers")
    args = parser.parse_args()
    if args.ouro_layers:
        teacher = OuroLM.from_config({**OURO_1P4B, "num_hidden_layers": args.ouro_layers}, seed=0).eval()
    else:
        teacher = load_looplm(args.teacher)
    ids = torch.randint(0, 100, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    students = {}
    for name, per_use in (("autograd", False), ("per-use", True)):
        s = prepare(
            teacher, QuantConfig(slt_budget=2), options=GroupOptions(per_use_backward=per_use, compiled=args.compiled)
        ).train()
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
