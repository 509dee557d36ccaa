"""Export a calibrated student to packed W4A4 / W4A8 and print its footprint (the *convert* step):

    python -m loopq.export --ckpt <student dir> --out <export dir>

The conversion and the directory format are :mod:`loopq.artifacts.quantized`; the footprint (the paper's Table 5 for
the loaded model: packed weights, fp16 scales, shared and loop-dependent quantization parameters and FP modules at
``--fp_dtype``, against the BF16 teacher) is :func:`loopq.quant.accounting.footprint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from loopq.artifacts import check_student_dir, export_student, load_quantized, load_student
from loopq.artifacts.layout import RUN_LOCK, STUDENT_META, json_object
from loopq.artifacts.quantized import check_export_dir
from loopq.artifacts.student import check_exportable, read_student_meta
from loopq.commands.cli import Command
from loopq.locks import DirectoryLock
from loopq.quant.accounting import footprint, format_footprint

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export(
    ckpt: Path,
    out: Path,
    fp_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16",
    teacher: Path | None = None,
) -> dict[str, float]:
    """Export the student ``ckpt`` to ``out`` and print its footprint (returned).

    Args:
        ckpt: student directory (loopq_quant.json + weights)
        out: export directory to write
        fp_dtype: dtype of the FP modules in the footprint
        teacher: teacher directory of a student whose recorded teacher path is gone (same content hash)
    """
    check_student_dir(ckpt)
    check_exportable(json_object(ckpt / STUDENT_META), ckpt)  # before a legacy one's warning is printed
    source = str(teacher) if teacher is not None else read_student_meta(ckpt).get("teacher")
    check_export_dir(out, source, reads=(ckpt,))
    with DirectoryLock(out, RUN_LOCK, "loopq.export", "--out"):  # one writer at a time
        student, meta = load_student(ckpt, teacher_dir=teacher)
        export_student(student, meta, out)
        report = footprint(load_quantized(out, dtype=DTYPES[fp_dtype]))
    print(f"exported {ckpt} -> {out}\n{format_footprint(report)}")
    return report


COMMAND = Command(export, "loopq.export", __doc__, renames={"--fp-dtype": "--fp_dtype"})

build_parser, main = COMMAND.parser, COMMAND.run
