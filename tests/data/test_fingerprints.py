"""Benchmark fingerprints: the stored hashes are what the documented script computes from the shared data, and the
matching unit survives the formats a copy may take."""

import json

import numpy as np

from loopq.commands import make_fingerprints
from loopq.data import fingerprints as fp


def test_stored_fingerprints_regenerate_from_the_shared_data(data, tmp_path):
    out = tmp_path / "fingerprints.json"
    assert make_fingerprints.main(["--data", str(data), "--out", str(out)]) == 0
    assert out.read_bytes() == fp.FINGERPRINTS.read_bytes()
    assert make_fingerprints.main(["--data", str(data), "--check"]) == 0


def test_stored_file_holds_hashes_and_file_digests_only():
    record = json.loads(fp.FINGERPRINTS.read_text())
    assert set(record) == {"about", "shingle_words", "rate", "benchmarks"}
    for entry in record["benchmarks"].values():
        assert set(entry) == {"files", "count", "fingerprints"}
        hashes = fp.decode_hashes(entry["fingerprints"])
        assert hashes.size == entry["count"] > 30
        assert np.all(np.diff(hashes.astype(np.float64)) >= 0) and np.all(hashes % np.uint64(fp.RATE) == 0)


def test_json_escapes_raw_and_decoded_text_give_the_same_words():
    decoded = "He said: \u201cdon\u2019t go\u201d.\n\nShe went."
    raw = json.dumps({"text": decoded})  # what a renamed .jsonl copy holds
    assert fp.normalised_words(raw) == ["text", *fp.normalised_words(decoded)]
    assert fp.normalised_words(decoded) == ["he", "said", "don", "t", "go", "she", "went"]


def test_sampling_is_content_defined_so_an_excerpt_samples_a_subset(data):
    text = (data / "wikitext2" / "wiki.valid.tokens").read_text()
    whole = fp.sampled_hashes(text)
    excerpt = fp.sampled_hashes("unrelated preamble words here. " + text[300_000:400_000])
    assert excerpt.size > 10 and np.isin(excerpt, whole).all()
    rate = whole.size / len(fp.normalised_words(text))
    assert 0.5 / fp.RATE < rate < 2 / fp.RATE  # about one shingle in RATE is sampled


def test_hits_need_min_hits_distinct_fingerprints(data):
    prints = {"bench": fp.sampled_hashes((data / "wikitext2" / "wiki.valid.tokens").read_text())}
    words = (data / "wikitext2" / "wiki.valid.tokens").read_text().split()
    one = next(
        " ".join(words[i : i + fp.SHINGLE_WORDS])
        for i in range(len(words))
        if fp.sampled_hashes(" ".join(words[i : i + fp.SHINGLE_WORDS])).size == 1
    )
    # one fingerprint, however often repeated, is not enough
    assert fp.benchmark_hits(" ".join([one] * 3), prints) == {}
    assert fp.benchmark_hits(" ".join(words[:20_000]), prints)["bench"] >= fp.MIN_HITS
