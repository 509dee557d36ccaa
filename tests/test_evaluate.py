"""``loopq.evaluate``'s model building: which ``--method`` labels build a training-free baseline from the teacher."""

import pytest
import torch

from loopq.commands.evaluate import build, static_config, static_method
from loopq.paths import ASSETS
from loopq.quant import quant_groups

TEACHER = str(ASSETS / "tiny-ouro")


@pytest.mark.parametrize(
    ("label", "method"),
    [
        ("Symmetric", "rtn"),
        ("RTN", "rtn"),
        ("RTN W4A4 g32", "rtn"),
        ("SmoothQuant", "smoothquant"),
        ("quarot", "quarot"),
        ("FP", None),
        ("teacher", None),
    ],
)
def test_method_labels(label, method):
    assert static_method(label) == method


def test_static_config_at_the_requested_bits():
    config = static_config("smoothquant", "w4a8")
    assert (config.method, config.w_bits, config.a_bits, config.group_size) == ("smoothquant", 4, 8, 32)
    with pytest.raises(ValueError, match="--bits 'w2a2'"):
        static_config("quarot", "w2a2")


def test_quarot_is_built_from_the_teacher_and_calibration_text():
    model, tok_dir, bits = build(TEACHER, None, None, "QuaRot", "w4a4", calib_samples=4, calib_seq_len=32)
    assert bits == "w4a4" and tok_dir.endswith("tiny-ouro")
    assert model.quant_config.method == "quarot" and not any(p.requires_grad for p in model.parameters())
    clips = [float(g.act_clip_ratio(0)) for g in quant_groups(model).values()]
    assert any(c < 0.999 for c in clips)  # searched on the calibration batch, not left at "no clipping"
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("label", ["SpinQuant", "FlatQuant", "LoopQ"])
def test_trained_methods_need_a_student(label):
    with pytest.raises(ValueError, match=f"--method {label} is calibrated by python -m loopq.fit"):
        build(TEACHER, None, None, label, "w4a4")
