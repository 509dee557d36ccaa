"""Run a whole comparison on one teacher and hand the results to the report:

    python -m loopq.experiments table1 --model loopq/assets/tiny-ouro --out results/tiny-ouro --limit 200

``table1``: the paper's Table 1 rows - FP, then every method of :data:`TABLE1` (Symmetric, SmoothQuant, QuaRot,
SpinQuant, FlatQuant, LoopQ) at W4A4 and W4A8 - each evaluated by :func:`loopq.evaluate.evaluate` (WikiText-2 PTQ
perplexity per loop + the lm-eval tasks with ``limit`` examples per task). The training-free baselines are built
from the teacher inside the evaluation; the trained ones (SpinQuant, FlatQuant, LoopQ) are calibrated by
``python -m loopq.fit`` with their calibration config (LoopQ: ``config``, default ``configs/tiny.yaml``; the
baselines: ``configs/baselines/*-tiny.yaml``) in a subprocess each, under ``<out>/runs/``. A row whose result JSON
exists is neither recalibrated nor re-evaluated.
``ablations``: LoopQ W4A4 without LAS, without SLT, without CTA (paper Table 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jsonargparse import CLI

from loopq.evaluate import evaluate
from loopq.paths import REPO_ROOT

BITS = {"w4a4": 4, "w4a8": 8}


@dataclass(frozen=True)
class Row:
    """One quantized method of Table 1: its label (``method`` in the JSON), file stem, and how it is calibrated
    (``calibration``: the ``table1`` argument naming its ``loopq.fit`` config; None: training-free)."""

    label: str
    slug: str
    calibration: str | None = None


TABLE1 = (
    Row("Symmetric", "rtn"),
    Row("SmoothQuant", "smoothquant"),
    Row("QuaRot", "quarot"),
    Row("SpinQuant", "spinquant", calibration="spinquant_config"),
    Row("FlatQuant", "flatquant", calibration="flatquant_config"),
    Row("LoopQ", "loopq", calibration="config"),
)
ABLATIONS = {
    "LoopQ w/o LAS": ["--model.quant.las", "false"],
    "LoopQ w/o SLT": ["--model.quant.slt_budget", "0"],
    "LoopQ w/o CTA": ["--model.quant.cta", "false"],
}


def calibrate(model: str, run_dir: Path, config: str, a_bits: int, extra: list[str]) -> Path:
    """``python -m loopq.fit`` in a fresh process; returns the student directory."""
    cmd = [
        sys.executable,
        "-m",
        "loopq.fit",
        "--config",
        config,
        "--model.teacher",
        model,
        "--model.quant.a_bits",
        str(a_bits),
        "--trainer.default_root_dir",
        str(run_dir),
        "--trainer.enable_progress_bar",
        "false",
        *extra,
    ]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    return run_dir / "student"


def table1(
    model: str,
    out: str,
    config: str = "configs/tiny.yaml",
    limit: int | None = 200,
    tasks: list[str] | None = None,
    spinquant_config: str = "configs/baselines/spinquant-tiny.yaml",
    flatquant_config: str = "configs/baselines/flatquant-tiny.yaml",
) -> list[Path]:
    """FP and every :data:`TABLE1` method at W4A4 and W4A8 on ``model``; one result JSON each in ``out``."""
    root = Path(out)
    configs = {"config": config, "spinquant_config": spinquant_config, "flatquant_config": flatquant_config}
    written = [_eval(root / "fp.json", model=model, method="FP", limit=limit, tasks=tasks)]
    for bits, a_bits in BITS.items():
        for row in TABLE1:
            path = root / f"{row.slug}-{bits}.json"
            common = {"method": row.label, "bits": bits, "limit": limit, "tasks": tasks}
            if row.calibration is None:
                written.append(_eval(path, model=model, **common))
                continue
            run = root / "runs" / f"{row.slug}-{bits}"
            done = path.is_file()  # a finished row is not recalibrated on a re-run
            student = run / "student" if done else calibrate(model, run, configs[row.calibration], a_bits, [])
            written.append(_eval(path, student=str(student), **common))
    return written


def ablations(
    model: str, out: str, config: str = "configs/tiny.yaml", limit: int | None = 200, tasks: list[str] | None = None
) -> list[Path]:
    """LoopQ W4A4 with one component switched off at a time (paper Table 2)."""
    root = Path(out)
    written = []
    for name, switch in ABLATIONS.items():
        slug = name.lower().replace(" ", "-").replace("/", "")
        run = root / "runs" / slug
        student = run / "student" if (root / f"{slug}.json").is_file() else calibrate(model, run, config, 4, switch)
        written.append(
            _eval(root / f"{slug}.json", student=str(student), method=name, bits="w4a4", limit=limit, tasks=tasks)
        )
    return written


def _eval(path: Path, **kwargs: object) -> Path:
    if path.is_file():  # experiments resume: finished evaluations are kept
        return path
    evaluate(out=str(path), **kwargs)  # type: ignore[arg-type]
    print(f"[loopq] wrote {path}: {json.loads(path.read_text())['wikitext2_ppl']:.2f} WT2 ppl")
    return path


def main(argv: list[str] | None = None) -> None:
    CLI([table1, ablations], args=argv, as_positional=False)


if __name__ == "__main__":
    main()
