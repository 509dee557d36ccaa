"""A scoreable tiny model: the random-weight ouro-tiny fixture (vocab 128) plus a 128-id BPE trained on a few KB of
tiny-shakespeare. (``loopq.data.tokenizer.train_bpe`` is byte-level and always has >= 257 ids, too many for this
vocab, so the tokenizer here uses printable ASCII as its alphabet; other characters map to ``<unk>``.)"""

import shutil
import string

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loopq.data.tokenizer import EOS_TOKEN
from loopq.models import load_looplm

ALPHABET = sorted(set(string.printable) - set("\t\r\x0b\x0c"))


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """Tiny matrices: one thread is fastest, and far faster than two when another process holds a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer(data) -> Tokenizer:
    text = (data / "calibration" / "tinyshakespeare_input.txt").read_text(encoding="utf-8")[:8000]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=128,
        special_tokens=[EOS_TOKEN, "<unk>"],
        initial_alphabet=ALPHABET,
        limit_alphabet=len(ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    assert tok.get_vocab_size() == 128
    return tok


@pytest.fixture(scope="session")
def ouro_dir(fixtures, tokenizer, tmp_path_factory):
    """A model directory as ``pretrained=`` expects it: config + weights + tokenizer.json."""
    path = tmp_path_factory.mktemp("models") / "ouro-tiny"
    shutil.copytree(fixtures / "ouro-tiny", path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def ouro(ouro_dir):
    return load_looplm(ouro_dir)
