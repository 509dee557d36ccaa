"""The committed embedded teachers meet their recorded numbers (issue: teacher + testbed)."""

import json

import pytest
import torch

from loopq.commands.testbed import QUICK_WINDOWS, SEQ_LEN
from loopq.data.tokenizer import load_tokenizer
from loopq.metrics.perplexity import perplexity, wikitext2_stream
from loopq.models import load_looplm
from loopq.paths import ASSETS
from loopq.quant import QuantConfig, prepare

PLAIN, STRESS = ASSETS / "tiny-ouro", ASSETS / "tiny-ouro-outliers"


# Fake-quant RTN perplexity is a step function of the activations: a one-ulp difference (another CPU's BLAS, another
# torch) flips some rounding decisions. Measured on the quick-check windows: the same RTN model in float64 instead of
# fp32 moves it by +0.18 % (small-ouro), +0.25 % (small-ouro-sensitive), -0.02 % (tiny-ouro-outliers); the recorded
# values differ from today's fp32 re-measurement by -0.13 %, +0.04 %, -0.04 %. 1 % is 3x the largest of these and
# still pins every headline (the smallest gap checked is small-ouro's 3.6 %). FP perplexity is smooth: 1e-4.
RTN_REL = 1e-2


def record(path):
    return json.loads((path / "testbed.json").read_text())


@pytest.fixture(scope="module")
def subset():
    stream = torch.tensor(wikitext2_stream(load_tokenizer(PLAIN)))
    return stream[: QUICK_WINDOWS * SEQ_LEN]


def test_teacher_is_small_native_ouro_with_tokenizer_and_record():
    model = load_looplm(PLAIN)
    assert model.arch == "ouro" and model.default_num_loops == 4
    assert sum(f.stat().st_size for f in PLAIN.iterdir()) < 10 * 2**20
    assert load_tokenizer(PLAIN).get_vocab_size() == model.config.vocab_size
    train = json.loads((PLAIN / "training_record.json").read_text())
    assert train["command"].startswith("python -m loopq.pretrain") and "seed" in train["model_hparams"]


def test_recorded_quality_bar():
    rec = record(PLAIN)
    fp = rec["fragility"]["FP"]["per_loop_ppl"]
    assert fp[-1] <= 0.5 * rec["unigram_ppl"], "a real LM: at most half the unigram perplexity"
    assert rec["last_over_first_loop_ppl"] == pytest.approx(fp[-1] / fp[0])
    assert fp[-1] <= 0.9 * fp[0], "the loops matter: last loop clearly better than loop 1"


def test_teacher_meets_its_recorded_perplexity(subset):
    model = load_looplm(PLAIN)
    got = perplexity(model, subset, SEQ_LEN, batch_size=8).ppl
    assert got == pytest.approx(record(PLAIN)["quick_check"]["fp_ppl"], rel=1e-4)


def test_stress_variant_is_the_same_function():
    plain, stress = load_looplm(PLAIN), load_looplm(STRESS)
    ids = torch.randint(0, plain.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = plain(ids, return_trajectory=True), stress(ids, return_trajectory=True)
    assert torch.equal(a.logits, b.logits)  # power-of-two reparameterisation: bit-identical
    assert all(torch.equal(x, y) for x, y in zip(a.loop_states, b.loop_states, strict=True))
    assert not torch.equal(plain.model.layers[0].input_layernorm.weight, stress.model.layers[0].input_layernorm.weight)


def test_rtn_w4a4_breaks_the_stress_variant(subset):
    stress = load_looplm(STRESS)
    fp = perplexity(stress, subset, SEQ_LEN, batch_size=8).ppl
    rtn = perplexity(prepare(stress, QuantConfig.rtn(4, 4, 32)).eval(), subset, SEQ_LEN, batch_size=8).ppl
    assert rtn >= 2 * fp
    assert rtn == pytest.approx(record(STRESS)["quick_check"]["rtn_w4a4_g32_ppl"], rel=RTN_REL)


# ---------------------------------------------------------------------------------------------------- second teacher
SMALL = ASSETS / "small-ouro"


def test_second_teacher_is_a_native_ouro_of_the_issue_size_with_its_record():
    model = load_looplm(SMALL)
    c = model.config
    assert model.arch == "ouro" and model.default_num_loops == 4
    assert c.num_hidden_layers >= 6 and c.hidden_size >= 256  # >= 24 looped transform groups per kind
    assert sum(f.stat().st_size for f in SMALL.iterdir()) <= 40 * 2**20
    assert load_tokenizer(SMALL).get_vocab_size() == c.vocab_size
    train = json.loads((SMALL / "training_record.json").read_text())
    assert train["command"].startswith("python -m loopq.pretrain") and train["steps"] == 3000
    assert not any("test" in source for source in train["data_hparams"]["sources"]), "never a test split"
    rec = record(SMALL)
    assert rec["fragility"]["FP"]["ppl"] <= 120, "the issue's bar: WikiText-2 ppl <= 120"
    assert rec["fragility"]["FP"]["ppl"] <= 0.5 * record(PLAIN)["fragility"]["FP"]["ppl"], "clearly better than tiny"


def remeasured_fp_and_rtn(path):
    """FP and RTN W4A4 g32 perplexity of the teacher at ``path`` on the testbed's quick-check windows, each checked
    against its ``testbed.json``."""
    model = load_looplm(path)
    stream = torch.tensor(wikitext2_stream(load_tokenizer(path)))[: QUICK_WINDOWS * SEQ_LEN]
    quick = record(path)["quick_check"]
    fp = perplexity(model, stream, SEQ_LEN, batch_size=8).ppl
    rtn = perplexity(prepare(model, QuantConfig.rtn(4, 4, 32)).eval(), stream, SEQ_LEN, batch_size=8).ppl
    assert fp == pytest.approx(quick["fp_ppl"], rel=1e-4)
    assert rtn == pytest.approx(quick["rtn_w4a4_g32_ppl"], rel=RTN_REL)
    return fp, rtn


def test_second_teacher_meets_its_recorded_fp_and_rtn_w4a4_perplexity():
    """The headline numbers of small-ouro's TESTBED.md, re-measured on the testbed's quick-check windows."""
    fp, rtn = remeasured_fp_and_rtn(SMALL)
    assert 1.0 < rtn / fp < 1.10, "as recorded: plain RTN W4A4 g32 costs a few percent, short of the issue's 10 %"


# ------------------------------------------------------------------------------ second teacher, sensitive variant
SENSITIVE = ASSETS / "small-ouro-sensitive"


def test_sensitive_variant_is_a_bf16_fine_tune_of_the_second_teacher_within_the_size_budget():
    model, base = load_looplm(SENSITIVE), load_looplm(SMALL)
    assert model.config_to_dict() == base.config_to_dict()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # stored bf16, read as fp32
    two = [*SMALL.iterdir(), *SENSITIVE.iterdir()]
    assert sum(f.stat().st_size for f in two) <= 40 * 2**20, "the second teacher and its variant: 40 MB at most"
    assert (SENSITIVE / "tokenizer.json").read_text() == (SMALL / "tokenizer.json").read_text()
    train = json.loads((SENSITIVE / "training_record.json").read_text())
    assert train["command"].startswith("python -m loopq.stress --config configs/stress/small-ouro-sensitive.yaml")
    assert train["saved_dtype"] == "bfloat16" and train["steps"] == 200
    assert train["model_hparams"]["aux_weight"] == 0 and train["model_hparams"]["noise_weight"] > 0
    assert train["stress"]["teacher"] == "loopq/assets/small-ouro"


def test_sensitive_variant_meets_its_recorded_fp_and_rtn_w4a4_perplexity():
    """TESTBED.md's headline, re-measured: RTN W4A4 g32 costs well over the issue's 10 % on this variant."""
    fp, rtn = remeasured_fp_and_rtn(SENSITIVE)
    assert rtn / fp > 1.10, "as recorded: plain RTN W4A4 g32 costs more than the issue's 10 %"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"factor": 0.0}, "--factor 0.0: must be a positive power of two"),
        ({"factor": 3.0}, "--factor 3.0: must be a positive power of two"),
        ({"channels": 0}, "--channels 0: must be between 1 and"),
        ({"channels": 10**6}, "--channels 1000000: must be between 1 and the hidden size"),
    ],
)
def test_bad_stress_variant_options_are_refused_before_any_measurement(tmp_path, option, message):
    import re
    import shutil

    from loopq.commands.testbed import testbed
    from loopq.errors import UsageError

    model = tmp_path / "teacher"
    shutil.copytree(PLAIN, model)
    before = {f.name: f.read_bytes() for f in model.iterdir()}
    with pytest.raises(UsageError, match=re.escape(message)):
        testbed(model, outliers_out=tmp_path / "stress", **option)
    assert {f.name: f.read_bytes() for f in model.iterdir()} == before and not (tmp_path / "stress").exists()
