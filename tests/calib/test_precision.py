"""bf16 where it belongs (README, "Calibrating a real looped model" - Precision): a few ``bf16-mixed`` calibration
steps of the tiny teacher hold the teacher (and the student's frozen weights, which are the teacher's) in bf16, the
quantization parameters and their AdamW states in fp32, the cached targets in fp16, run the step under autocast, and
write a student that loads back - in one process and under DeepSpeed ZeRO-2 (configs/ouro2.6b.yaml's strategy)."""

import json
import math

import pytest
import torch

from loopq.artifacts import load_student
from loopq.calib.module import resolve_teacher_dtype
from loopq.errors import UsageError
from tests.helpers import FIT_CONFIGS, run_fit

DEEPSPEED = ("--config", "tests/configs/fit-deepspeed.yaml")


@pytest.mark.parametrize("strategy", ["single", "deepspeed"])
def test_bf16_mixed_calibration_keeps_each_part_in_its_dtype(tmp_path, strategy):
    record = tmp_path / "precision.json"
    recorder = json.dumps({"class_path": "tests.helpers.RecordPrecision", "init_args": {"path": str(record)}})
    configs = (*FIT_CONFIGS, *(DEEPSPEED if strategy == "deepspeed" else ()))
    run_fit(tmp_path, "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "3", "--trainer.callbacks+",
            recorder, configs=configs, env={"LOOPQ_DEEPSPEED_SHM": "0"})  # fmt: skip
    seen = json.loads(record.read_text())
    assert seen["teacher"] == seen["student_frozen"] == ["torch.bfloat16"] and seen["frozen_shared"]
    assert seen["quant_params"] == seen["optimizer_states"] == ["torch.float32"]
    assert set(seen["targets"].values()) <= {"torch.float16", "torch.bfloat16", "torch.int16", "torch.int32"}
    assert seen["targets"]["states"] in ("torch.float16", "torch.bfloat16")
    assert seen["logits"] == ["torch.bfloat16"]  # the training steps ran under autocast
    assert len(seen["losses"]) == 3 and all(math.isfinite(v) for v in seen["losses"])
    assert "teacher_dtype: bf16" in next(tmp_path.glob("lightning_logs/version_*/config.yaml")).read_text()
    student, _ = load_student(tmp_path / "student")
    assert {p.dtype for p in student.parameters() if p.requires_grad} == {torch.float32}
    assert torch.isfinite(student(torch.randint(0, 2048, (1, 16))).logits).all()


def test_teacher_dtype_auto_follows_the_precision_and_a_bad_value_names_the_key():
    assert [resolve_teacher_dtype("auto", p) for p in ("bf16-mixed", "bf16-true", "32", None, 32)] == [
        "bf16", "bf16", "fp32", "fp32", "fp32"]  # fmt: skip
    assert resolve_teacher_dtype("fp32", "bf16-mixed") == "fp32"
    with pytest.raises(UsageError, match=r"model\.teacher_dtype='fp16'"):
        resolve_teacher_dtype("fp16", "32")
