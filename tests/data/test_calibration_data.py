"""Calibration/pretraining data: determinism, no benchmark leakage, bad input."""

import json

import pytest
import torch

from loopq.data.calibration import CalibrationDataModule
from loopq.data.stream import check_vocab, random_windows, token_stream
from loopq.data.text import (
    DEFAULT_CALIBRATION_SOURCES,
    DEFAULT_TRAINING_SOURCES,
    DataError,
    is_eval_only,
    lambada_test,
    read_document,
    read_training_text,
    resolve_sources,
    wikitext2_test,
)

SMOL = "tokenizers/smollm2"


def module(data, **kw):
    args = {"tokenizer": str(data / SMOL), "num_samples": 16, "seq_len": 64, "batch_size": 4, "holdout_samples": 2}
    return CalibrationDataModule(**{**args, **kw})


@pytest.fixture(scope="module")
def calib(data):
    dm = module(data, seed=7)
    dm.setup()
    return dm


def batches(dm):
    return [b[1] for b in dm.train_dataloader()]


def test_samples_have_the_requested_shape_and_are_real_text(calib, data):
    assert calib.samples.shape == (16, 64) and calib.holdout.shape == (2, 64)
    from loopq.data.tokenizer import load_tokenizer

    text = load_tokenizer(data / SMOL).decode(calib.samples[0].tolist())
    assert sum(c.isalpha() for c in text) > 100


def test_same_seed_same_batches_other_seed_other_samples(calib, data):
    again = module(data, seed=7)
    again.setup()
    assert torch.equal(again.samples, calib.samples)
    assert all(torch.equal(a, b) for a, b in zip(batches(again), batches(calib), strict=True))
    other = module(data, seed=8)
    other.setup()
    assert not torch.equal(other.samples, calib.samples)


def test_default_sources_hold_no_evaluation_split(data):
    for sources in (DEFAULT_CALIBRATION_SOURCES, DEFAULT_TRAINING_SOURCES):
        files = resolve_sources(list(sources), data)
        assert files and not any(is_eval_only(f) for f in files)


@pytest.mark.parametrize(
    "source",
    [
        "wikitext2/wiki.test.raw",
        "wikitext2/wiki.test.tokens",
        "lambada/lambada_test.jsonl",
        "arc/ARC-Challenge-Test.jsonl",
    ],
)
def test_evaluation_splits_are_refused(data, source):
    with pytest.raises(DataError, match="evaluation split"):
        module(data, sources=[source]).setup()


def test_eval_readers_read_the_real_files(data):
    assert wikitext2_test(data).count("\n") == 4358
    passages = lambada_test(data)
    assert len(passages) == 5153 and all(p.strip() for p in passages[:10])


def test_missing_empty_and_short_sources(data, tmp_path):
    with pytest.raises(DataError, match=r"no file at .*nothing\.txt"):
        module(data, sources=[str(tmp_path / "nothing.txt")]).setup()
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(DataError, match=r"empty\.txt: empty"):
        module(data, sources=[str(tmp_path / "empty.txt")]).setup()
    (tmp_path / "short.txt").write_text("Only a few words here.")
    with pytest.raises(DataError, match=r"shorter than one sample of seq_len=64"):
        module(data, sources=[str(tmp_path / "short.txt")]).setup()


def test_vocab_mismatch_names_the_tokenizer_key(data):
    with pytest.raises(DataError, match=r"data.tokenizer: produces token id .* vocab_size is 128"):
        module(data, vocab_size=128).setup()
    check_vocab(torch.tensor([[0, 127]]), 128)


def test_jsonl_source_and_bad_jsonl(data, tmp_path):
    good = tmp_path / "docs.jsonl"
    good.write_text('{"text": "' + "word " * 200 + '"}\n{"text": "more text"}\n')
    assert len(read_training_text([good])) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: expected a JSON object with a 'text' field"):
        read_training_text([bad])
    for value, kind in (("12345", "int"), ("null", "NoneType"), ('["a"]', "list")):  # a tokenizer traceback before
        bad.write_text('{"text": "fine"}\n{"text": ' + value + "}\n")
        with pytest.raises(DataError, match=rf"bad\.jsonl:2: the 'text' field is {kind}, not text; make it a string"):
            read_training_text([bad])


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    """JSON allows raw U+2028, U+2029 and U+0085 inside strings; str.splitlines() split there and refused the file
    as malformed. Lines end at \\n only (\\r\\n too); empty lines are still skipped."""
    path = tmp_path / "docs.jsonl"
    texts = ["one\u2028still one", "two\u2029and\u0085two", "three"]
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in texts]
    path.write_bytes(("\n".join(lines[:2]) + "\n\n\r\n" + lines[2] + "\r\n").encode("utf-8"))
    assert read_document(path) == texts


def test_random_windows_are_windows_of_the_stream():
    stream = torch.arange(1000)
    w = random_windows(stream, 5, 10, seed=0)
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(5, 9, dtype=torch.long))


def test_token_stream_separates_documents_with_eos(data):
    from loopq.data.tokenizer import load_tokenizer

    tok = load_tokenizer(data / SMOL)
    stream = token_stream(["a b", "c"], tok)
    assert (stream == 0).sum() == 2 and stream[-1] == 0


def test_sampler_is_world_size_invariant_and_resumable():
    from loopq.data.sampler import CalibrationSampler

    one = list(CalibrationSampler(10, local_batch=4, total_steps=6, seed=3))
    two = [list(CalibrationSampler(10, 2, 6, seed=3, rank=r, world_size=2)) for r in range(2)]
    steps_one = [one[i : i + 4] for i in range(0, len(one), 4)]
    steps_two = [two[0][i : i + 2] + two[1][i : i + 2] for i in range(0, len(two[0]), 2)]
    assert steps_one == steps_two  # same global batches, split across ranks
    assert sorted(one[:10]) == list(range(10)) and one[:10] != list(range(10))  # a permutation per pass
    current = {"step": 4}
    resumed = CalibrationSampler(10, 4, 6, seed=3, start_step=lambda: current["step"])
    assert list(resumed) == one[16:] and len(resumed) == 8
    current["step"] = 5  # a sampler iterated again continues at the trainer's current step
    assert list(resumed) == one[20:]


def test_the_loader_tells_lightning_it_is_resumable(data):
    """Lightning warned at every mid-epoch resume that the data loader was not resumable (it tests its stateful
    protocol); the loader's position is the trainer's step, so it is, with an empty state."""
    from lightning.fabric.utilities.types import _Stateful

    dm = CalibrationDataModule(str(data / SMOL), num_samples=8, seq_len=16, holdout_samples=0, seed=0)
    dm.setup()
    loader = dm.train_dataloader()
    assert isinstance(loader, _Stateful) and loader.state_dict() == {}
    first = [ids.tolist() for ids, _ in loader]
    loader.load_state_dict({})
    assert [ids.tolist() for ids, _ in loader] == first  # nothing restored, nothing moved


def test_diagnostic_holdout_windows_overlap_no_calibration_window(data):
    """The diagnostics' held-out windows are held out: none shares a token with a calibration window (a review found
    2 of 8 overlapping, by 37 and 230 of 256 tokens, at the paper's 1024 x 256 with seed 0), and the calibration
    windows are those of one random draw of num_samples + holdout_samples offsets, as before the fix."""
    from loopq.data.calibration import calibration_stream
    from loopq.data.stream import random_starts

    dm = CalibrationDataModule(str(data / SMOL), num_samples=1024, seq_len=256, holdout_samples=8, seed=0)
    dm.setup()
    calib, held = dm.starts["calibration"], dm.starts["holdout"]
    tokens = calibration_stream(str(data / SMOL), None, None).numel()
    assert torch.equal(calib, random_starts(tokens, 1024 + 8, 256, 0)[:1024])
    assert len(held) == 8 and dm.holdout.shape == (8, 256)
    gaps = (held[:, None] - calib[None, :]).abs()
    assert int(gaps.min()) >= 256  # windows [s, s + 256) that share no position
    held_gaps = (held[:, None] - held[None, :]).abs() + 256 * torch.eye(8, dtype=torch.long)
    assert int(held_gaps.min()) >= 256
