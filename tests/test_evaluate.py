"""``loopq.evaluate``'s model building: which ``--method`` labels build a training-free baseline from the teacher."""

import pytest
import torch

from loopq.commands.evaluate import FP, ModelMethod, build, parse_model_method, static_config, static_method
from loopq.paths import ASSETS, data_dir
from loopq.quant import quant_groups
from loopq.quant.config import Bits

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
    config = static_config("smoothquant", Bits(4, 8))
    assert (config.method, config.w_bits, config.a_bits, config.group_size) == ("smoothquant", 4, 8, 32)


def test_method_and_bits_are_parsed_once_at_the_boundary():
    """A baseline label at valid bits parses to its method and bits; FP ignores --bits; a bad --bits is refused
    only for a baseline (it means nothing to FP)."""
    assert parse_model_method("SmoothQuant", "W4A8") == ModelMethod("smoothquant", Bits(4, 8))
    assert parse_model_method("fp", "nonsense") == FP
    with pytest.raises(ValueError, match="--bits 'w2a2'"):
        parse_model_method("quarot", "w2a2")
    with pytest.raises(ValueError, match="is not a method for --model"):
        parse_model_method("QuaRott", "w4a4")


def test_quarot_is_built_from_the_teacher_and_calibration_text():
    quarot = ModelMethod("quarot", Bits(4, 4))
    model, tok_dir, bits = build(TEACHER, None, None, quarot, calib_samples=4, calib_seq_len=32)
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
        parse_model_method(label, "w4a4")


def test_lambada_perplexity_is_the_running_text_of_the_test_passages_under_the_same_windows(tmp_path):
    """``--lambada_ppl``: the perplexity of the first N 64-token windows of the LAMBADA test passages joined by blank
    lines, computed here from the jsonl and the teacher's logits directly (a second corpus beside WikiText-2)."""
    import json
    import math

    import torch.nn.functional as F
    from tokenizers import Tokenizer

    from loopq.commands.evaluate import evaluate
    from loopq.models import load_looplm

    result = evaluate(
        model=TEACHER, tasks=[], ppl_seq_len=64, ppl_windows=3, lambada_ppl=True, out=str(tmp_path / "r.json")
    )
    lines = (data_dir() / "lambada" / "lambada_test.jsonl").read_text().splitlines()
    text = "\n\n".join(json.loads(line)["text"] for line in lines if line.strip())
    ids = Tokenizer.from_file(str(ASSETS / "tiny-ouro" / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    windows = torch.tensor(ids[: 3 * 64]).view(3, 64)
    with torch.no_grad():
        logits = load_looplm(TEACHER)(windows).logits
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), windows[:, 1:].flatten())
    assert result["lambada_windows"] == 3
    assert result["lambada_ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert json.loads((tmp_path / "r.json").read_text())["lambada_ppl"] == result["lambada_ppl"]
    assert result["lambada_ppl"] != pytest.approx(result["wikitext2_ppl"], rel=1e-3)  # another text
