"""The ``loopq`` lm-eval model against log-softmax sums computed by hand with the model itself."""

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from loopq.metrics.lm import LoopQLM
from loopq.models.base import LoopLMError
from loopq.paths import ASSETS
from tests.helpers import gpt2_tokenizer_copy

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n"
)


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def log_probs(model, ids, num_loops=None):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]), num_loops=num_loops).logits[0].double(), -1)


def by_hand(model, tokenizer, context, continuation, max_length, num_loops=None):
    """lm-eval's split (trailing context spaces join the continuation), left truncation, sum and greedy flag."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = tokenizer.encode(context).ids if context else [0]  # an empty context is the EOS token (id 0)
    cont = tokenizer.encode(context + continuation).ids[len(ctx) if context else 0 :]
    tokens = (ctx + cont)[-(max_length + 1) :]
    logp = log_probs(model, tokens[:-1], num_loops)
    total, greedy = 0.0, True
    for pos in range(len(tokens) - len(cont), len(tokens)):
        total += float(logp[pos - 1, tokens[pos]])
        greedy &= int(logp[pos - 1].argmax()) == tokens[pos]
    return total, greedy


@pytest.fixture(scope="module")
def lm(ouro_dir):
    return LoopQLM(pretrained=str(ouro_dir), max_length=32, batch_size=3)


def test_registered_and_built_from_arg_string(ouro_dir):
    assert get_model("loopq") is LoopQLM
    assert get_model("hf").__name__ == "HFLM"  # registering "loopq" must not hide lm-eval's own models
    lm = LoopQLM.create_from_arg_string(f"pretrained={ouro_dir},num_loops=2,max_length=48", {"batch_size": "4"})
    assert (lm.num_loops, lm.max_length, lm.batch_size) == (2, 48, 4)


def test_a_model_arg_wins_over_lm_evals_flag_for_it(ouro_dir):
    """``python -m loopq.eval`` always passes ``--device``; a ``device=`` in ``model_args`` too made lm-eval call the
    model with it twice (a TypeError traceback). The ``model_args`` value wins, as does ``batch_size`` there."""
    args = f"pretrained={ouro_dir},device=cpu,batch_size=2"
    lm = LoopQLM.create_from_arg_string(args, {"device": "meta", "batch_size": 4, "max_length": None})
    assert lm.batch_size == 2 and next(lm.model.parameters()).device.type == "cpu"


CASES = [
    ("First Citizen:\nBefore we proceed", " any further"),
    ("Speak, speak. ", "You are all resolved"),  # trailing space moves into the continuation
    (TEXT, " rather"),  # longer than max_length: the context is cut from the left
    ("", "First Citizen"),  # empty context: scored after the EOS token
]


def test_loglikelihood_equals_hand_computation(lm, ouro, tokenizer):
    results = lm.loglikelihood([request("loglikelihood", c, x) for c, x in CASES])
    for (context, continuation), (score, greedy) in zip(CASES, results, strict=True):
        want, want_greedy = by_hand(ouro, tokenizer, context, continuation, max_length=32)
        assert score == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy


def test_loglikelihood_with_fewer_loops(ouro_dir, ouro, tokenizer):
    lm = LoopQLM(pretrained=str(ouro_dir), num_loops=1, max_length=32)
    (score, _), *_ = lm.loglikelihood([request("loglikelihood", *CASES[0])])
    assert score == pytest.approx(by_hand(ouro, tokenizer, *CASES[0], max_length=32, num_loops=1)[0], abs=1e-4)
    assert score != pytest.approx(by_hand(ouro, tokenizer, *CASES[0], max_length=32)[0], abs=1e-4)


def test_greedy_flag_and_batch_invariance(lm, ouro):
    context = lm.tok_encode("First Citizen:\n")
    logp = log_probs(ouro, context)
    greedy = [int(logp[-1].argmax())]
    wrong = [(greedy[0] + 1) % 128]
    batched = lm.score_pairs([(context, greedy), (context, wrong), (context[:5], context[5:9])])
    single = LoopQLM.from_model(ouro, lm.tokenizer, batch_size=1).score_pairs([(context, greedy)])
    assert batched[0][1] and not batched[1][1]
    assert batched[0][0] == pytest.approx(float(logp[-1, greedy[0]]), abs=1e-5)
    assert batched[0][0] == pytest.approx(single[0][0], abs=1e-5)


def test_loglikelihood_rolling_equals_windowed_sum(lm, ouro, tokenizer):
    ids = tokenizer.encode(TEXT).ids
    n, L = len(ids), lm.max_length
    assert n > 2 * L
    full = [lm.eot_token_id, *ids]  # full[j + 1] == ids[j]
    total, start = 0.0, 0
    while start < n:
        end = min(start + L, n)
        first = max(0, end - L)  # the last window keeps a full L-token context
        logp = log_probs(ouro, full[first:end])
        total += sum(float(logp[j - first, ids[j]]) for j in range(start, end))
        start = end
    (score,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", TEXT)])
    assert score == pytest.approx(total, abs=1e-3)
    assert sum(len(cont) for _, cont in lm.rolling_windows(ids)) == n  # every token predicted once


def test_generate_until_is_greedy_and_stops(lm, ouro, tokenizer):
    context = "First Citizen:\nBefore we"
    tokens = tokenizer.encode(context).ids
    for _ in range(6):
        tokens.append(int(log_probs(ouro, tokens[-32:])[-1].argmax()))
    text = tokenizer.decode(tokens[len(tokenizer.encode(context).ids) :])
    (out,) = lm.generate_until([request("generate_until", context, {"until": [], "max_gen_toks": 6})])
    assert out == text
    stop = text[2:4]
    (cut,) = lm.generate_until([request("generate_until", context, {"until": [stop], "max_gen_toks": 6})])
    assert cut == text.split(stop, 1)[0]


def test_generate_until_has_room_when_the_context_fills_the_positions(ouro_dir, ouro, tokenizer):
    """With ``max_length`` = the model's positions (LoopFormer's and Parcae's 256), a context cut to ``max_length``
    tokens left no position to generate in and gave ''; now it keeps its last positions - max_gen_toks tokens, as
    lm-eval's HF model does (and no more than that when max_length exceeds the positions)."""
    positions = ouro.max_positions
    context = TEXT * 4
    assert len(tokenizer.encode(context).ids) > positions
    tokens = tokenizer.encode(context).ids[-(positions - 5) :]
    for _ in range(5):
        tokens.append(int(log_probs(ouro, tokens)[-1].argmax()))
    want = tokenizer.decode(tokens[positions - 5 :])
    for max_length in (positions, 2 * positions):
        lm = LoopQLM(pretrained=str(ouro_dir), max_length=max_length)
        (out,) = lm.generate_until([request("generate_until", context, {"until": [], "max_gen_toks": 5})])
        assert out == want and out != ""


def test_from_model_wraps_an_in_memory_model(lm, ouro):
    wrapped = LoopQLM.from_model(ouro, lm.tokenizer, max_length=32)
    reqs = [request("loglikelihood", c, x) for c, x in CASES]
    got, want = wrapped.loglikelihood(reqs), lm.loglikelihood(reqs)
    assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-5)
    assert [g for _, g in got] == [g for _, g in want]
    with pytest.raises(LoopLMError, match="tokenizer"):
        LoopQLM.from_model(ouro, None)


def test_pretrained_directory_with_a_gpt2_tokenizer(tmp_path):
    """``pretrained=<dir>`` looked only for tokenizer.json; GPT-2's encoder.json + vocab.bpe (LoopFormer's format,
    which an export copies) is read as the tokenizer loader reads it."""
    teacher = ASSETS / "tiny-ouro"
    lm = LoopQLM(pretrained=str(gpt2_tokenizer_copy(teacher, tmp_path / "gpt2")))
    text = "The loop ran once more, and again."
    assert lm.tok_encode(text) == LoopQLM(pretrained=str(teacher)).tok_encode(text)


def test_bad_model_args_name_the_flag(ouro_dir, ouro, data):
    with pytest.raises(LoopLMError, match="batch_size"):
        LoopQLM(pretrained=str(ouro_dir), batch_size="auto")
    with pytest.raises(LoopLMError, match="dtype"):
        LoopQLM(pretrained=str(ouro_dir), dtype="int3")
    big = data / "tokenizers" / "smollm2" / "SmolLM2-135M-Instruct-Tokenizer.json"
    with pytest.raises(LoopLMError, match="vocab_size is 128"):
        LoopQLM.from_model(ouro, str(big))
