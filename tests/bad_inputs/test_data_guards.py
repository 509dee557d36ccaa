"""Data guards by content, not name (issue 14, item 5): compressed sources are read decompressed, binary ones
refused, links resolved, benchmark evaluation text recognised by its fingerprints wherever it sits, ``hf:``
evaluation splits refused before any download.

Every refusal is one line naming the file (or the ``data.sources`` entry) and leaves every file byte-identical.
"""

import bz2
import gzip
import hashlib
import io
import lzma
import pickle
import re
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from loopq.commands.pretrain import PretrainDataModule
from loopq.data.calibration import CalibrationDataModule
from loopq.data.text import DEFAULT_TRAINING_SOURCES, DataError, read_training_text, resolve_sources

SMOL = "tokenizers/smollm2"
PROSE = "calibration/tinyshakespeare_input.txt"


def snapshot(*roots: Path) -> dict[str, str]:
    files = [p for root in roots for p in sorted(root.rglob("*")) if p.is_file()]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def refused(files: list[Path], pattern: str, roots: tuple[Path, ...]) -> str:
    """``read_training_text`` refuses ``files`` with one line matching ``pattern``; nothing on disk changes."""
    before = snapshot(*roots)
    with pytest.raises(DataError, match=pattern) as err:
        read_training_text(files)
    assert "\n" not in str(err.value)
    assert snapshot(*roots) == before
    return str(err.value)


def module(data, sources, **kw):
    args = {"tokenizer": str(data / SMOL), "num_samples": 8, "seq_len": 64, "holdout_samples": 0}
    return CalibrationDataModule(sources=[str(s) for s in sources], **{**args, **kw})


@pytest.fixture(scope="module")
def prose(data) -> bytes:
    """200 KB of genuine calibration prose (the head of tiny-shakespeare)."""
    return (data / PROSE).read_bytes()[:200_000]


# ------------------------------------------------------------------------------------------------ accepted input
@pytest.mark.parametrize(("compress", "suffix"), [(gzip.compress, "gz"), (bz2.compress, "bz2"), (lzma.compress, "xz")])
def test_compressed_calibration_file_is_read_as_the_plain_one(data, prose, tmp_path, compress, suffix):
    plain, packed = tmp_path / "prose.txt", tmp_path / f"prose.txt.{suffix}"
    plain.write_bytes(prose)
    packed.write_bytes(compress(prose))
    assert read_training_text([packed]) == read_training_text([plain]) == [prose.decode()]
    a, b = module(data, [plain]), module(data, [packed])
    a.setup(), b.setup()
    assert a.samples.equal(b.samples)


def test_compression_is_recognised_by_magic_bytes_not_the_suffix(prose, tmp_path):
    disguised = tmp_path / "notes.txt"  # gzip content under a text name
    disguised.write_bytes(gzip.compress(prose))
    mislabelled = tmp_path / "plain.gz"  # plain text under a gzip name
    mislabelled.write_bytes(prose)
    records = tmp_path / "docs.jsonl.gz"  # the suffix under the compression one says how to parse
    records.write_bytes(gzip.compress(b'{"text": "first document"}\n{"text": "second document"}\n'))
    assert read_training_text([disguised]) == read_training_text([mislabelled]) == [prose.decode()]
    assert read_training_text([records]) == ["first document", "second document"]


def test_genuine_training_sources_pass_the_guards_quickly(data):
    files = resolve_sources(list(DEFAULT_TRAINING_SOURCES), data)
    start = time.perf_counter()
    docs = read_training_text(files)
    took = time.perf_counter() - start
    assert len(docs) == len(files) and sum(map(len, docs)) > 5_000_000
    assert took < 10, f"reading and guarding {len(files)} files (~6 MB) took {took:.1f} s; measured ~0.6 s"


def test_a_stray_invalid_byte_is_tolerated(prose, tmp_path):
    path = tmp_path / "prose.txt"
    path.write_bytes(prose[:1000] + b"caf\xe9" + prose[1000:])  # one Latin-1 byte in 200 KB
    (doc,) = read_training_text([path])
    assert doc.count("\ufffd") == 1 and doc.endswith(prose[-100:].decode())


# ------------------------------------------------------------------------------------------------ binary input
def zip_of(text: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("prose.txt", text)
    return out.getvalue()


def tar_gz_of(text: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        info = tarfile.TarInfo("prose.txt")
        info.size = len(text)
        archive.addfile(info, io.BytesIO(text))
    return out.getvalue()


def safetensors_of() -> bytes:
    from safetensors.numpy import save

    return save({"w": np.ones((4, 4), dtype=np.float32)})


BINARY = {
    "random": (lambda text: np.random.default_rng(0).bytes(4096), r"binary data"),
    "zip": (zip_of, r"a zip archive"),
    "tar.gz": (tar_gz_of, r"a tar archive"),
    "gzip twice": (lambda text: gzip.compress(gzip.compress(text)), r"gzip data compressed twice"),
    "truncated gzip": (lambda text: gzip.compress(text)[:5000], r"corrupt or truncated gzip"),
    "safetensors": (lambda text: safetensors_of(), r"a safetensors file"),
    "pickle": (lambda text: pickle.dumps([text.decode()], protocol=4), r"a Python pickle"),
    "utf-16": (lambda text: text.decode().encode("utf-16"), r"UTF-16 text; convert it to UTF-8"),
    "latin-1": (lambda text: text.decode().replace("e", "é").encode("latin-1"), r"not UTF-8 .*iconv"),
}


@pytest.mark.parametrize("kind", BINARY)
def test_binary_sources_are_refused_naming_the_file(prose, tmp_path, kind):
    make, what = BINARY[kind]
    path = tmp_path / "calibration.txt"
    path.write_bytes(make(prose))
    refused([path], rf"^{tmp_path}/calibration\.txt: {what}", (tmp_path,))


def test_binary_source_is_refused_by_the_calibration_module(data, tmp_path):
    path = tmp_path / "weights.txt"
    path.write_bytes(safetensors_of())
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=r"weights\.txt: a safetensors file, not text"):
        module(data, [path]).setup()
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------- evaluation splits
def test_a_symlink_to_wikitext2_test_is_refused_naming_link_and_target(data, tmp_path):
    link = tmp_path / "notes.txt"
    link.symlink_to(data / "wikitext2" / "wiki.test.raw")
    message = refused([link], r"evaluation split", (tmp_path, data / "wikitext2"))
    assert message.startswith(f"{link} (-> {data / 'wikitext2' / 'wiki.test.raw'})")


def test_a_relative_link_through_dotdot_is_resolved_before_the_guard(data, tmp_path, monkeypatch):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "shakespeare.txt").symlink_to(data / "lambada" / "lambada_test.jsonl")
    monkeypatch.chdir(tmp_path / "corpus")
    pattern = r"^\.\./corpus/shakespeare\.txt \(-> .*lambada_test\.jsonl\): is a benchmark evaluation split"
    refused([Path("../corpus/shakespeare.txt")], pattern, (tmp_path,))


@pytest.mark.parametrize(
    ("source", "copy", "benchmark"),
    [
        ("lambada/lambada_test.jsonl", "stories.jsonl", "LAMBADA test"),
        ("lambada/lambada_test.jsonl", "stories.txt", "LAMBADA test"),
        ("wikitext2/wiki.test.tokens", "articles.txt", "WikiText-2 test"),
        ("arc/ARC-Challenge-Test.jsonl", "science.txt", "ARC-Challenge test"),
        ("winogrande/dev.jsonl", "sentences.txt", "WinoGrande dev"),
        ("mmlu/test/anatomy_test.csv", "medicine.txt", "MMLU test"),
    ],
)
def test_a_renamed_copy_of_an_evaluation_file_is_refused(data, tmp_path, source, copy, benchmark):
    (tmp_path / copy).write_bytes((data / source).read_bytes())
    refused([tmp_path / copy], rf"^{tmp_path}/{copy}: contains {benchmark} text \(\d+ fingerprinted", (tmp_path,))


def test_a_decompressed_and_a_recompressed_copy_of_hellaswag_are_refused(data, tmp_path):
    text = bz2.decompress((data / "hellaswag" / "hellaswag_val_full.txt.bz2").read_bytes())
    (tmp_path / "activities.txt").write_bytes(text)
    (tmp_path / "activities.xz").write_bytes(lzma.compress(text[:400_000]))
    for name in ("activities.txt", "activities.xz"):
        refused([tmp_path / name], rf"^{tmp_path}/{name}: contains HellaSwag validation text", (tmp_path,))


def test_prose_concatenated_with_a_slice_of_wikitext2_test_is_refused(data, prose, tmp_path):
    lines = (data / "wikitext2" / "wiki.test.raw").read_bytes().splitlines(keepends=True)
    excerpt = b"".join(lines[2000:2300])  # 300 of its 4358 lines, ~10,000 words (the docstring's bound: 5,000)
    mixed = tmp_path / "mixed.txt"
    mixed.write_bytes(prose[:100_000] + excerpt + prose[100_000:])
    refused([mixed], rf"^{tmp_path}/mixed\.txt: contains WikiText-2 test text", (tmp_path,))
    alone = tmp_path / "alone.txt"
    alone.write_bytes(prose)  # the same prose without the excerpt passes
    assert read_training_text([alone]) == [prose.decode()]


def test_pretraining_refuses_a_renamed_copy_before_training_a_tokenizer(data, tmp_path):
    copy = tmp_path / "books.txt"
    copy.write_bytes((data / "wikitext2" / "wiki.test.raw").read_bytes())
    before = snapshot(tmp_path)
    dm = PretrainDataModule(sources=[str(copy)], root=str(data))
    with pytest.raises(DataError, match=rf"^{tmp_path}/books\.txt: contains WikiText-2 test text"):
        dm.setup()
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------------ hf: sources
@pytest.fixture
def no_download(monkeypatch):
    import datasets

    def fail(*args, **kwargs):
        raise AssertionError(f"datasets.load_dataset{args} called: the guard must refuse before any download")

    monkeypatch.setattr(datasets, "load_dataset", fail)


@pytest.mark.parametrize(
    ("spec", "split"),
    [
        ("hf:Salesforce/wikitext:test", "test"),
        ("hf:EleutherAI/lambada_openai:test:text", "test"),
        ("hf:Rowan/hellaswag", "validation"),  # the default split
        ("hf:allenai/winogrande:validation:sentence", "validation"),
        ("hf:cais/mmlu:auxiliary_train+test", "test"),
        ("hf:my-org/my-corpus:test[:10%]", "test"),
    ],
)
def test_hf_evaluation_splits_are_refused_before_any_download(data, tmp_path, no_download, spec, split):
    before = snapshot(tmp_path)
    pattern = rf"^data\.sources {re.escape(repr(spec))}: split '{split}' of .* never be used for calibration"
    with pytest.raises(DataError, match=pattern) as err:
        module(data, [spec])
    assert "\n" not in str(err.value) and snapshot(tmp_path) == before


def test_hf_training_splits_pass_and_their_text_is_fingerprinted(data, monkeypatch):
    import datasets

    leaked = [line for line in (data / "wikitext2" / "wiki.test.raw").read_text().splitlines() if line.strip()]
    fake = {
        "mit-han-lab/pile-val-backup": datasets.Dataset.from_dict({"text": leaked}),
        "wikitext": datasets.Dataset.from_dict({"text": (data / PROSE).read_text().split("\n\n")}),
    }
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: fake[name])
    with pytest.raises(DataError, match=r"^data\.sources 'hf:mit-han-lab/pile-val-backup:validation:text': contains "):
        module(data, ["hf:mit-han-lab/pile-val-backup:validation:text"]).setup()
    dm = module(data, ["hf:wikitext:train"])
    dm.setup()
    assert dm.samples.shape == (8, 64)


def test_a_split_cut_into_small_renamed_files_is_refused_as_a_whole(data, tmp_path):
    folder = tmp_path / "quizzes"
    folder.mkdir()
    for n, csv in enumerate(sorted((data / "mmlu" / "dev").glob("*.csv"))):
        (folder / f"quiz{n:02d}.txt").write_bytes(csv.read_bytes())
    alone = []  # the files that pass one by one: each holds fewer than MIN_HITS fingerprints
    for path in sorted(folder.glob("*.txt")):
        try:
            read_training_text([path])
            alone.append(path)
        except DataError:
            pass
    assert len(alone) > 40
    message = refused(alone, rf"^{folder}/quiz\d\d\.txt, .* and \d+ more: together contain MMLU dev text", (tmp_path,))
    assert "(->" not in message
