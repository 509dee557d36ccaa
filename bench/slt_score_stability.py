"""How stable is the sharing gap S_l (paper §4.2, Eq. 6) that SLT's first round selects on?

Runs ``python -m loopq.fit`` for one step (its step-0 SLT round scores every looped group) on the teacher as it is
and on copies whose floating-point weights are multiplied by ``1 + eps * N(0, 1)`` (``eps`` = 1e-7 by default, i.e.
about one fp32 ulp: the size of the difference another CPU's BLAS, another torch build or another thread count makes).
Same seed, same data, same config. Prints per run the selected group, its S_l, the median S_l, and against the
unperturbed run the Spearman rank correlation of all groups' S_l and the relative change of the selected group's S_l.

If a one-ulp change moves the selection, calibration runs are reproducible on one machine and environment (they are:
the same command twice gives the same bits) but not across machines; a result from another environment is another
sample of the seed distribution, not a mismatch.

    OMP_NUM_THREADS=1 python bench/slt_score_stability.py --teacher loopq/assets/small-ouro --perturbations 3
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopq.commands.examine import slt_history
from loopq.paths import REPO_ROOT


def perturbed_copy(teacher: Path, out: Path, eps: float, seed: int) -> Path:
    """``teacher`` copied to ``out`` with every floating weight scaled by ``1 + eps * N(0, 1)`` (in its own dtype)."""
    shutil.copytree(teacher, out)
    gen = torch.Generator().manual_seed(seed)
    for path in out.glob("*.safetensors"):
        weights = load_file(str(path))
        for name, w in weights.items():
            if w.is_floating_point():
                noise = torch.randn(w.shape, generator=gen, dtype=torch.float64)
                weights[name] = (w.double() * (1 + eps * noise)).to(w.dtype)
        save_file(weights, str(path), metadata={"format": "pt"})
    return out


def step0_scores(teacher: Path, run: Path, config: str, seed: int) -> dict[str, float]:
    """S_l of every looped group in the first SLT round of a one-step ``loopq.fit``."""
    cmd = [sys.executable, "-m", "loopq.fit", "--config", config, "--model.teacher", str(teacher)]
    cmd += ["--trainer.default_root_dir", str(run), "--trainer.max_steps", "1", "--trainer.enable_progress_bar"]
    cmd += ["false", "--seed_everything", str(seed), "--model.quant.seed", str(seed), "--data.seed", str(seed)]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, capture_output=True)
    return dict(slt_history(run)[0]["scores"])


def ranks(values: list[float]) -> torch.Tensor:
    order = torch.tensor(values).argsort()
    out = torch.empty(len(values))
    out[order] = torch.arange(len(values), dtype=torch.float32)
    return out


def spearman(a: dict[str, float], b: dict[str, float]) -> float:
    names = sorted(a)
    ra, rb = ranks([a[n] for n in names]), ranks([b[n] for n in names])
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, default=REPO_ROOT / "loopq/assets/small-ouro")
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--eps", type=float, default=1e-7)
    parser.add_argument("--perturbations", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the calibration seed (the same for every run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = step0_scores(args.teacher.resolve(), root / "run-base", args.config, args.seed)
        top = max(base, key=base.__getitem__)
        print(f"teacher {args.teacher}, calibration seed {args.seed}, {len(base)} looped groups, eps {args.eps:g}")
        print("| run | selected | S_l | median S_l | Spearman vs base | base's selection: S_l change |")
        print("|---|---|---:|---:|---:|---:|")
        runs = {"base": base}
        for k in range(args.perturbations):
            teacher = perturbed_copy(args.teacher, root / f"teacher-{k}", args.eps, seed=k)
            runs[f"eps, noise seed {k}"] = step0_scores(teacher, root / f"run-{k}", args.config, args.seed)
        for name, scores in runs.items():
            best = max(scores, key=scores.__getitem__)
            median = float(torch.tensor(list(scores.values())).median())
            rho = spearman(base, scores)
            change = scores[top] / base[top] - 1
            print(f"| {name} | {best} | {scores[best]:.0f} | {median:.0f} | {rho:.3f} | {change:+.1%} |")


if __name__ == "__main__":
    main()
