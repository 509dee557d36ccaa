"""Export a calibrated student to packed W4A4 / W4A8 and print its footprint (the *convert* step):

    python -m loopq.export --ckpt <student dir> --out <export dir>

The conversion and the directory format are :mod:`loopq.artifacts.quantized`; the footprint (the paper's Table 3 for
the loaded model: packed weights, fp16 scales, shared and loop-dependent quantization parameters and FP modules at
``--fp-dtype``, against the BF16 teacher) is :func:`loopq.quant.accounting.footprint`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loopq.artifacts import check_student_dir, export_student, load_quantized, load_student
from loopq.artifacts.layout import RUN_LOCK, STUDENT_META, json_object
from loopq.artifacts.quantized import check_export_dir
from loopq.artifacts.student import check_exportable, read_student_meta
from loopq.errors import OneLineParser, run_cli
from loopq.locks import DirectoryLock
from loopq.quant.accounting import footprint, format_footprint

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = OneLineParser(prog="python -m loopq.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", type=Path, required=True, help=f"student directory ({STUDENT_META} + weights)")
    parser.add_argument("--out", type=Path, required=True, help="export directory to write")
    parser.add_argument(
        "--fp-dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the FP modules in the footprint"
    )
    args = parser.parse_args(argv)
    check_student_dir(args.ckpt)
    check_exportable(json_object(args.ckpt / STUDENT_META), args.ckpt)  # before a legacy one's warning is printed
    teacher = read_student_meta(args.ckpt).get("teacher")
    check_export_dir(args.out, teacher, reads=(args.ckpt,))
    with DirectoryLock(args.out, RUN_LOCK, "loopq.export", "--out"):  # one writer at a time
        student, meta = load_student(args.ckpt)
        export_student(student, meta, args.out)
        report = footprint(load_quantized(args.out, dtype=DTYPES[args.fp_dtype]))
    print(f"exported {args.ckpt} -> {args.out}\n{format_footprint(report)}")
    return report


if __name__ == "__main__":
    run_cli(main)
