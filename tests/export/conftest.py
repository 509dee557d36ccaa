"""Calibrated-looking students of the three tiny fixtures, saved, exported by the CLI and loaded back.

Every student has random invertible transforms with a diagonal, random clipping ratios (activation clips per loop,
weight clips per row), CTA adapters away from the identity and one promoted group whose per-loop transforms differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

from loopq.artifacts import load_quantized, load_student, student_meta, write_student
from loopq.commands.export import main
from loopq.models import LoopLM, load_looplm
from loopq.quant import QuantConfig, looped_quant_groups, prepare, quant_groups
from loopq.quant.modules import QuantLinearGroup

ARCHS = {"ouro": "ouro-tiny", "loopformer": "loopformer-tiny", "parcae": "parcae-tiny"}
CASES = [(arch, bits) for arch in sorted(ARCHS) for bits in (4, 8)]


@dataclass
class Exported:
    arch: str
    a_bits: int
    teacher_dir: Path
    student_dir: Path
    out: Path
    student: LoopLM
    meta: dict
    model: LoopLM

    def ids(self, seed: int = 0, length: int = 16) -> Tensor:
        vocab = self.model.lm_head.weight.shape[0]
        return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def make_student(teacher: LoopLM, a_bits: int, seed: int = 0) -> tuple[LoopLM, str]:
    """A W4A{a_bits} student with non-trivial quantization parameters; returns it and its promoted group."""
    config = QuantConfig(w_bits=4, a_bits=a_bits, group_size=32, transform_init="random", cta=True, seed=seed)
    student = prepare(teacher, config)
    gen = torch.Generator().manual_seed(seed + 1)
    promoted = list(looped_quant_groups(student))[1]
    group = quant_groups(student)[promoted]
    group.promote()
    with torch.no_grad():
        for tr in group.loop_transforms:
            tr.randomize_(gen)
        for g in quant_groups(student).values():
            for p in (g.act_clip, g.weight_clip, g.loop_weight_clip):
                if p is not None:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.7 + 2.0)  # ratios ~0.65-0.99
        cta = student.transition
        for p, scale in ((cta.a, 0.1), (cta.b, 0.05), (cta.eta, 0.5)):
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return student, promoted


def export_student(teacher_dir: Path, a_bits: int, root: Path) -> LoopLM:
    """:func:`make_student` of ``teacher_dir`` written to ``root/student``, exported by the CLI to ``root/export`` and
    loaded back (the packed model)."""
    student, promoted = make_student(load_looplm(teacher_dir), a_bits)
    meta = student_meta(student, teacher_dir, root / "student", [promoted], [1.0] * student.calibrated_loops, None)
    write_student(student, meta, root / "student")
    main(["--ckpt", str(root / "student"), "--out", str(root / "export")])
    return load_quantized(root / "export")


@pytest.fixture(scope="session")
def export_dirs(tmp_path_factory) -> Callable[[str, int, Path], Path]:
    """``(arch, a_bits, teacher_dir) -> root`` holding ``student/`` and ``export/`` of :func:`export_student`, built
    once per process on first use and shared by every module (the directories are only read); the models are loaded
    fresh by each module's :func:`exported`, so no module sees another's in-memory changes."""
    built: dict[tuple[str, int], Path] = {}

    def get(arch: str, a_bits: int, teacher_dir: Path) -> Path:
        if (arch, a_bits) not in built:
            root = tmp_path_factory.mktemp(f"{arch}-w4a{a_bits}")
            export_student(teacher_dir, a_bits, root)
            built[arch, a_bits] = root
        return built[arch, a_bits]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-w4a{b}" for a, b in CASES])
def exported(request, fixtures, export_dirs) -> Exported:
    arch, a_bits = request.param
    teacher_dir = fixtures / ARCHS[arch]
    root = export_dirs(arch, a_bits, teacher_dir)
    model = load_quantized(root / "export")
    student, meta = load_student(root / "student")
    return Exported(arch, a_bits, teacher_dir, root / "student", root / "export", student, meta, model)


def use_kernel_numerics(student: LoopLM) -> list:
    """Switch every fake-quant group to the kernels' numerics (``QuantLinearGroup.kernel_numerics``); the returned
    handles' ``remove()`` switches them back."""
    groups = list(quant_groups(student).values())
    for g in groups:
        g.kernel_numerics = True
    return [_Restore(g) for g in groups]


class _Restore:
    def __init__(self, group: QuantLinearGroup) -> None:
        self.group = group

    def remove(self) -> None:
        self.group.kernel_numerics = False
