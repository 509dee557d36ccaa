"""load_looplm / save_pretrained: native formats, strict keys, bad input, tokenizers."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopq.data.tokenizer import TokenizerError, load_tokenizer
from loopq.models import LoopLMError, architectures, load_looplm

ARCHS = {"ouro": "ouro-tiny", "loopformer": "loopformer-tiny", "parcae": "parcae-tiny"}


@pytest.fixture
def copy_of(fixtures, tmp_path):
    def make(name):
        dst = tmp_path / name
        shutil.copytree(fixtures / name, dst)
        return dst

    return make


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_loads_each_architecture_in_eval_fp32(fixtures, arch):
    model = load_looplm(fixtures / ARCHS[arch])
    assert model.arch == arch and not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_save_pretrained_round_trip(fixtures, tmp_path, arch):
    model = load_looplm(fixtures / ARCHS[arch])
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "out")
    again = load_looplm(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == model.config_to_dict()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_runs_and_tracks_fp32(fixtures, arch):
    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(1))
    fp32 = load_looplm(fixtures / ARCHS[arch])
    bf16 = load_looplm(fixtures / ARCHS[arch], dtype=torch.bfloat16)
    with torch.no_grad():
        a, b = fp32(ids).logits, bf16(ids).logits.float()
    assert torch.isfinite(b).all()
    assert (a - b).abs().mean() < 0.05 * a.std()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_num_loops_must_be_a_positive_int(fixtures, bad):
    model = load_looplm(fixtures / "ouro-tiny")
    with pytest.raises(LoopLMError, match="num_loops"):
        model(torch.zeros(1, 4, dtype=torch.long), num_loops=bad)


def test_unknown_architecture_is_named(copy_of):
    path = copy_of("ouro-tiny")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoopLMError, match=r"unknown architecture.*'llama'.*supported"):
        load_looplm(path)


def read_copy(path):
    """Tensors in memory (not memory-mapped), so the file can be overwritten."""
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def test_missing_and_unexpected_keys_are_listed(copy_of):
    path = copy_of("ouro-tiny")
    state = read_copy(path / "model.safetensors")
    state["model.extra.weight"] = state.pop("model.norm.weight")
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(LoopLMError, match=r"missing: \['model.norm.weight'\].*unexpected: \['model.extra.weight'\]"):
        load_looplm(path)


def test_shape_mismatch_names_the_tensor(copy_of):
    path = copy_of("ouro-tiny")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoopLMError, match=r"mlp.*shape"):
        load_looplm(path)


def test_pickle_in_place_of_safetensors_is_refused(copy_of):
    path = copy_of("ouro-tiny")
    torch.save(read_copy(path / "model.safetensors"), path / "model.safetensors")
    with pytest.raises(LoopLMError, match=r"model\.safetensors: a torch zip/pickle checkpoint, not safetensors"):
        load_looplm(path)


def test_torch_bin_is_read_weights_only(copy_of, tmp_path):
    path = copy_of("parcae-tiny")
    state = read_copy(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    assert load_looplm(path).arch == "parcae"

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, path / "pytorch_model.bin")
    with pytest.raises(LoopLMError, match="refusing to unpickle"):
        load_looplm(path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(LoopLMError, match="not a directory"):
        load_looplm(tmp_path / "nope")
    with pytest.raises(LoopLMError, match=r"no config.json"):
        load_looplm(tmp_path)


def test_every_architecture_is_registered():
    assert sorted(architectures()) == ["loopformer", "ouro", "parcae"]


def test_tokenizers_load_from_shared_files(data):
    smol = load_tokenizer(data / "tokenizers" / "smollm2")
    assert smol.get_vocab_size() == 49152 and smol.token_to_id("<|endoftext|>") == 0
    gpt2 = load_tokenizer(data / "tokenizers" / "gpt2")
    ids = gpt2.encode("Hello world").ids
    assert ids == [15496, 995]  # GPT-2's published ids for "Hello" and " world"
    assert gpt2.decode(ids) == "Hello world"


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(TokenizerError, match=r"no tokenizer.json"):
        load_tokenizer(tmp_path)
