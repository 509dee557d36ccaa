"""PTQ-protocol perplexity against a hand computation, and per-loop readouts for all three architectures."""

import math

import pytest
import torch

from loopq.metrics.perplexity import (
    perplexity,
    readout,
    readout_context,
    token_windows,
    wikitext2_ptq_text,
)
from loopq.models import load_looplm
from loopq.models.base import LoopLMError

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 3


def test_perplexity_equals_hand_computation(ouro, tokenizer):
    ids = tokenizer.encode(TEXT).ids
    seq_len = 16
    nll, count = 0.0, 0
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        window = ids[start : start + seq_len]
        with torch.no_grad():
            logp = torch.log_softmax(ouro(torch.tensor([window])).logits[0].double(), -1)
        nll -= sum(float(logp[i, window[i + 1]]) for i in range(seq_len - 1))
        count += seq_len - 1
    result = perplexity(ouro, ids, seq_len=seq_len, batch_size=3)
    assert result.num_windows == len(ids) // seq_len
    assert result.num_tokens == count
    assert result.ppl == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert result.per_loop is None


@pytest.mark.parametrize("arch", ["ouro-tiny", "loopformer-tiny", "parcae-tiny"])
def test_per_loop_readout_ends_at_the_model_logits(fixtures, arch):
    model = load_looplm(fixtures / arch)
    vocab = model.config.vocab_size
    stream = torch.randint(0, vocab, (4 * 24,), generator=torch.Generator().manual_seed(0))
    result = perplexity(model, stream, seq_len=24, batch_size=2, num_loops=3, per_loop=True)
    assert len(result.per_loop) == 3
    assert result.per_loop[-1] == pytest.approx(result.ppl, rel=1e-5)
    assert len(set(result.per_loop)) == 3  # each loop's state reads out differently
    ids = stream[:24].view(1, 24)
    with torch.no_grad():
        out = model(ids, num_loops=3, return_trajectory=True)
        last = readout(model, out.loop_states[-1], readout_context(model, ids, 3))
    torch.testing.assert_close(last, out.logits)


def test_windows_drop_the_tail_and_reject_short_streams():
    assert token_windows(list(range(10)), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(LoopLMError, match="shorter than one window"):
        token_windows([1, 2, 3], 4)


def test_wikitext2_ptq_text_is_gptq_join_of_dataset_rows(data):
    raw = (data / "wikitext2" / "wiki.test.raw").read_text(encoding="utf-8")
    text = wikitext2_ptq_text(raw)
    # HF wikitext-2-raw-v1 test rows: "", " = Robert Boulter = \n", "", " Robert Boulter is ...\n", ... (4358 rows)
    assert text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is an English film")
    assert len(raw.splitlines()) == 4358
    assert text.count("\n\n") >= 4357
