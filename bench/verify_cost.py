"""What verifying an artifact on load costs (issue #29): the sha256 of every file of an export against its load.

(a) the tiny export: a W4A4 student of the embedded tiny teacher (straight out of ``prepare``) exported, then
    ``load_quantized`` timed with the check (one sha256 pass over every file of the manifest) and the check alone;
(b) a real-shape weight file: ``--mib`` MiB of random fp16 tensors in one safetensors file (a 1.5B model's export is
    ~1 GiB), ``read_safetensors`` against ``sha256_file`` + ``read_safetensors`` (the file is in the page cache, as
    it is right after the check: the hash reads it first). ``read_safetensors`` memory-maps lazily, so the second number
    is the whole cost of the check.

    python bench/verify_cost.py [--mib 1024] [--repeats 3]

Medians of ``--repeats`` runs on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from loopq.artifacts import export_student, load_quantized, student_meta
from loopq.artifacts.quantized import read_export_meta, verify_export_files
from loopq.artifacts.seal import sha256_file
from loopq.files import read_safetensors
from loopq.models import load_looplm
from loopq.paths import ASSETS
from loopq.quant import QuantConfig, prepare


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tiny_export(root: Path) -> Path:
    teacher = ASSETS / "tiny-ouro"
    student = prepare(load_looplm(teacher), QuantConfig(w_bits=4, a_bits=4))
    meta = student_meta(student, teacher, root / "student", [], [1.0] * student.calibrated_loops, None)
    return export_student(student, meta, root / "export")


def random_weights(path: Path, mib: int) -> Path:
    tensors = {f"layer{i}.weight": torch.randn(4096, 4096, dtype=torch.float16) for i in range(max(1, mib // 32))}
    save_file(tensors, str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of the random weight file (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = tiny_export(Path(tmp))
        size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
        check = median_seconds(lambda: verify_export_files(out, read_export_meta(out)), args.repeats)
        load = median_seconds(lambda: load_quantized(out), args.repeats)
        print(f"tiny export ({size:.2f} MiB): load_quantized {load * 1e3:.1f} ms, the check {check * 1e3:.1f} ms of it")
        weights = random_weights(Path(tmp) / "model.safetensors", args.mib)
        size = weights.stat().st_size / 2**20
        read = median_seconds(lambda: read_safetensors(weights), args.repeats)
        both = median_seconds(lambda: (sha256_file(weights), read_safetensors(weights)), args.repeats)
        print(
            f"random weights ({size:.0f} MiB): read {read:.2f} s, sha256 + read {both:.2f} s "
            f"(+{both - read:.2f} s, {size / max(both - read, 1e-9):.0f} MiB/s of hashing)"
        )


if __name__ == "__main__":
    main()
