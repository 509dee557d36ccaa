"""``loopq.evaluate``'s model building: which ``--method`` labels build a training-free baseline from the teacher."""

import json
import re
from fractions import Fraction

import pytest
import torch

from loopq.artifacts import load_artifact
from loopq.commands.evaluate import (
    FP,
    ModelMethod,
    build,
    evaluate,
    parse_model_method,
    static_config,
    static_method,
)
from loopq.data.calibration import calibration_samples
from loopq.paths import ASSETS, data_dir
from loopq.quant import quant_groups
from loopq.quant.config import Bits
from loopq.quant.prepare import init_clipping_from_data, prepare, prepare_static, spread_rows

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


def test_the_clip_search_scores_tokens_spread_over_every_sample():
    """Rows ``round(linspace(0, n - 1, m))``: first and last included, every sample reached; all rows up to m."""
    assert spread_rows(10, 4).tolist() == [0, 3, 6, 9]
    assert spread_rows(7, 3).tolist() == [0, 3, 6]
    assert spread_rows(4096, 4096) is None and spread_rows(100, 4096) is None
    exact = [round(Fraction(i * 8191, 4095)) for i in range(4096)]  # the nearest row to i (n - 1) / (m - 1)
    assert spread_rows(8192, 4096).tolist() == exact and len(set(exact)) == 4096


def test_quarot_clip_search_reads_the_samples_beyond_its_token_budget():
    """Beyond ``max_tokens`` rows the search used to score the first rows only, so samples past them never changed a
    clip (``--calib_samples 256`` evaluated as 32). Two batches sharing their first sample, the rest prose or
    uniform noise, at a 64-token budget (half of the first sample): the clips now see the difference."""
    teacher = load_artifact(TEACHER, kind="teacher")
    ids = calibration_samples(teacher.meta["teacher"], 8, 128)
    noise = torch.randint(0, int(ids.max()) + 1, (7, 128), generator=torch.Generator().manual_seed(1))
    chosen = []
    for batch in (ids, torch.cat([ids[:1], noise])):
        student = prepare(teacher.model, static_config("quarot", Bits(4, 4)))
        chosen.append(init_clipping_from_data(student, batch, max_tokens=64))
    assert chosen[0] != chosen[1]


def test_calib_sources_choose_the_baselines_calibration_text_and_are_recorded(tmp_path):
    """``--calib_sources`` means a fit config's ``data.sources``: the baseline calibrates on windows of that text
    only (the windows calibration_samples draws from it) and the result JSON says which text, how many, how long."""
    source = ["calibration/tinyshakespeare_input.txt"]
    quarot = ModelMethod("quarot", Bits(4, 4))
    expected = calibration_samples(TEACHER, 4, 32, sources=source)
    assert not torch.equal(expected, calibration_samples(TEACHER, 4, 32))  # another text than the default's
    built, _, _ = build(TEACHER, None, None, quarot, calib_samples=4, calib_seq_len=32, calib_sources=source)
    by_hand = prepare_static(
        load_artifact(TEACHER, kind="teacher").model, static_config("quarot", Bits(4, 4)), expected
    )
    ids = expected[:1, :16]
    with torch.no_grad():
        assert torch.equal(built(ids).logits, by_hand(ids).logits)
    result = evaluate(model=TEACHER, method="QuaRot", tasks=[], ppl_windows=1, calib_samples=4, calib_seq_len=32,
                      calib_sources=source, out=str(tmp_path / "quarot.json"), device="cpu")  # fmt: skip
    assert result["calibration"] == {"samples": 4, "seq_len": 32, "sources": source}
    assert json.loads((tmp_path / "quarot.json").read_text())["calibration"]["sources"] == source


def test_an_empty_calib_sources_list_is_refused_instead_of_calibrating_on_the_default_text(tmp_path):
    """``--calib_sources '[]'`` calibrated the baseline on the default prose and recorded ``sources: []``."""
    from loopq.data.text import DataError

    with pytest.raises(DataError, match=re.escape("--calib_sources=[]: lists no text; list the files")):
        evaluate(model=TEACHER, method="QuaRot", tasks=[], ppl_windows=1, calib_samples=4, calib_seq_len=32,
                 calib_sources=[], out=str(tmp_path / "quarot.json"), device="cpu")  # fmt: skip
    assert not (tmp_path / "quarot.json").exists()
