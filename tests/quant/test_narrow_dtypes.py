"""Students of every method evaluated in bf16/fp16 (a trained student through ``load_artifact(dtype=...)``, a
training-free one in memory through lm-eval's ``dtype``, both :func:`cast_student`): they run, keep their
quantization parameters in fp32, and stay close to the fp32 student."""

import copy

import pytest
import torch

from loopq.artifacts import load_artifact, student_meta, write_student
from loopq.models import load_looplm
from loopq.quant import QuantConfig, quant_groups
from loopq.quant.prepare import cast_student, prepare, prepare_static, quant_state

from .test_baselines import STATIC, ids_for, perturb_learnable

METHODS = ("rtn", "smoothquant", "quarot", "spinquant", "flatquant", "loopq")
ARCHS = {"ouro": "ouro-tiny", "parcae": "parcae-tiny"}  # Parcae's ReLU^2 gives all-zero groups (fp16's scale floor)


def student_of(fixtures, tmp_path, arch: str, method: str):
    """A W4A8 student of ``method`` with non-trivial transforms, fp32: a trained one written to ``tmp_path`` and
    loaded back, a training-free one as ``prepare_static`` builds it (they are never saved: evaluate builds them)."""
    teacher_dir = fixtures / ARCHS[arch]
    teacher = load_looplm(teacher_dir)
    config = QuantConfig.of_method(method, 4, 8, group_size=32)
    if method in STATIC:
        return prepare_static(teacher, config, ids_for(teacher, seed=5))
    student = prepare(teacher, config)
    perturb_learnable(student, seed=3)
    write_student(student, student_meta(student, teacher_dir, tmp_path, [], [], None), tmp_path)
    return load_artifact(tmp_path, kind="student").model


def narrow_student(student, tmp_path, method: str, dtype: torch.dtype):
    if method in STATIC:
        return cast_student(copy.deepcopy(student), dtype)
    return load_artifact(tmp_path, kind="student", dtype=dtype).model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("method", METHODS)
def test_a_student_loaded_in_bf16_or_fp16_runs_and_is_close_to_fp32(fixtures, tmp_path, arch, method):
    fp32 = student_of(fixtures, tmp_path, arch, method)
    ids = ids_for(fp32, length=32)
    reference = logits(fp32, ids)
    for dtype in (torch.bfloat16, torch.float16):
        narrow = narrow_student(fp32, tmp_path, method, dtype)
        state = quant_state(narrow)
        assert state and all(
            getattr(m, n).dtype == torch.float32 for m, n in state if getattr(m, n).is_floating_point()
        )
        for group in quant_groups(narrow).values():
            assert all(w.dtype == dtype for w in group.weights())  # the frozen weights do take the dtype
        assert narrow.lm_head.weight.dtype == dtype
        out = logits(narrow, ids)
        assert torch.isfinite(out).all(), (method, dtype)
        if dtype == torch.bfloat16:
            # bf16 frozen weights and activations flip some 4-bit codes: the mean logit moves by 0.046-0.098 of the
            # logits' std (measured over the 12 cases, the same at 1 and 2 threads); 0.2 gives 2x margin and is
            # still far below a lost transform or clip (an error of the order of the spread itself)
            err = (out - reference).abs().mean() / reference.std()
            assert err < 0.2, (method, err.item())


@pytest.mark.parametrize("method", ["smoothquant", "quarot", "flatquant"])
def test_a_student_cast_whole_to_bf16_runs(fixtures, tmp_path, method):
    """``student.to(bf16)`` (DeepSpeed's ``.bfloat16()``) casts the factors too: the chains widen them to fp32 and
    run; only the factors' bf16 rounding separates it from the fp32 student, which :func:`cast_student` avoids."""
    student = student_of(fixtures, tmp_path, "ouro", method)
    ids = ids_for(student, length=32)
    reference = logits(student, ids)
    kept = logits(narrow_student(student, tmp_path, method, torch.bfloat16), ids)
    out = logits(copy.deepcopy(student).to(torch.bfloat16), ids)
    assert torch.isfinite(out).all()
    assert (out - reference).abs().mean() / reference.std() < 0.5
    assert (kept - reference).abs().mean() <= (out - reference).abs().mean()
