"""The published Hugging Face layout of Ouro (sharded bf16 safetensors + index, auto_map, inv_freq buffers) read by
load_looplm, written by save_pretrained(max_shard_size), and refused with one line naming the file when damaged."""

import json
import random
import re
import shutil
from fnmatch import fnmatch

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopq.data.tokenizer import load_tokenizer
from loopq.models import LoopLMError, load_looplm
from loopq.models.loading import HUB_FILES, resolve_model_dir
from loopq.models.ouro import OuroLM, rope_inv_freq
from loopq.models.shards import INDEX_FILE, parse_size, plan_shards, shard_name

#: ByteDance/Ouro-1.4B's config.json: every field the published file has (transformers 4.x names)
OURO_14B = {
    "architectures": ["OuroForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModel": "modeling_ouro.OuroModel",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    },
    "bos_token_id": 0,
    "early_exit_threshold": 1.0,
    "eos_token_id": 0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "layer_types": ["full_attention"] * 24,
    "max_position_embeddings": 65536,
    "max_window_layers": 28,
    "model_type": "ouro",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "total_ut_steps": 4,
    "transformers_version": "4.55.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 49152,
}
#: the same fields at a width that runs in milliseconds (4 heads of 8, 2 layers, vocab 96)
TINY = OURO_14B | {
    "head_dim": 8,
    "hidden_size": 32,
    "intermediate_size": 48,
    "layer_types": ["full_attention"] * 2,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "vocab_size": 96,
}
IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))


def inv_freq_keys(layers):
    return ["model.rotary_emb.inv_freq", *(f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(layers))]


def bf16_ouro(config=TINY):
    return OuroLM.from_config(config, seed=0).to(torch.bfloat16).eval()


def write_published(directory, model, config=TINY, order="reversed", shards=3, inv_freq=None):
    """An Ouro directory as the hub has it, written here by hand (not by save_pretrained): ``shards`` bf16 shards
    whose numbering does not follow the key order, the index, ``inv_freq`` buffers, tokenizer and generation files."""
    state = {k: v.contiguous() for k, v in model.native_state_dict().items()}
    freq = rope_inv_freq(config["head_dim"], config["rope_theta"]) if inv_freq is None else inv_freq
    state |= {key: freq.to(torch.bfloat16) for key in inv_freq_keys(config["num_hidden_layers"])}
    keys = sorted(state)
    if order == "shuffled":
        random.Random(0).shuffle(keys)
    else:
        keys.reverse()
    weight_map = {key: shard_name(1 + i * shards // len(keys), shards) for i, key in enumerate(keys)}
    directory.mkdir(parents=True, exist_ok=True)
    for shard in sorted(set(weight_map.values()), reverse=True):
        save_file({k: state[k] for k in keys if weight_map[k] == shard}, str(directory / shard), {"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return directory


@pytest.fixture
def published(tmp_path, data):
    model = bf16_ouro()
    directory = write_published(tmp_path / "Ouro-tiny", model)
    shutil.copy(data / "tokenizers" / "smollm2" / "SmolLM2-135M-Instruct-Tokenizer.json", directory / "tokenizer.json")
    return directory, model


def one_line_error(path, match):
    """Load ``path`` expecting a LoopLMError whose single line matches ``match``; return the message."""
    with pytest.raises(LoopLMError, match=match) as err:
        load_looplm(path)
    assert "\n" not in str(err.value)
    return str(err.value)


# ----------------------------------------------------------------------------------- the published layout loads
@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_published_ouro_layout_loads_exactly(tmp_path, order):
    model = bf16_ouro()
    directory = write_published(tmp_path / "m", model, order=order)
    loaded = load_looplm(directory)  # config says torch_dtype bfloat16: still fp32 unless dtype is passed
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    in_bf16 = load_looplm(directory, dtype=torch.bfloat16)
    for (name, p), q in zip(model.named_parameters(), in_bf16.parameters(), strict=True):
        assert q.dtype == torch.bfloat16 and torch.equal(p, q), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, model.float()(IDS).logits, atol=0, rtol=0)
        torch.testing.assert_close(in_bf16(IDS).logits, bf16_ouro()(IDS).logits, atol=0, rtol=0)


def test_published_directory_has_every_hub_file_and_its_tokenizer_loads(published):
    directory, _ = published
    names = sorted(p.name for p in directory.iterdir())
    assert [n for n in names if not any(fnmatch(n, pattern) for pattern in HUB_FILES)] == []
    assert load_tokenizer(directory).get_vocab_size() == 49152
    assert load_looplm(directory).config.extra["auto_map"] == OURO_14B["auto_map"]  # kept, never executed


def test_transformers_v5_dtype_key_is_accepted_and_ignored(tmp_path):
    config = {k: v for k, v in TINY.items() if k != "torch_dtype"} | {"dtype": "bfloat16"}
    directory = write_published(tmp_path / "m", bf16_ouro(config), config=config)
    assert next(load_looplm(directory).parameters()).dtype == torch.float32


def test_ouro_14b_width_matches_its_published_tensor_list():
    """The real Ouro-1.4B config on the meta device (no memory): every tensor a 1.4B index lists, with its shape,
    is accepted by the strict loader, inv_freq included; a missing or extra one is not."""
    with torch.device("meta"):
        model = OuroLM(OuroLM.config_from_dict(OURO_14B))
    h, ff, vocab = 2048, 5632, 49152
    expected = {"lm_head.weight": (vocab, h), "model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    expected |= {"model.early_exit_gate.weight": (1, h), "model.early_exit_gate.bias": (1,)}
    for i in range(24):
        layer = f"model.layers.{i}."
        expected |= {f"{layer}self_attn.{p}_proj.weight": (h, h) for p in "qkvo"}
        expected |= {f"{layer}mlp.{p}_proj.weight": (ff, h) for p in ("gate", "up")}
        expected |= {f"{layer}mlp.down_proj.weight": (h, ff)}
        expected |= {f"{layer}{n}.weight": (h,) for n in ("input_layernorm", "post_attention_layernorm")}
        expected |= {f"{layer}{n}_2.weight": (h,) for n in ("input_layernorm", "post_attention_layernorm")}
    native = model.native_state_dict()
    assert {k: tuple(v.shape) for k, v in native.items()} == expected
    assert sum(v.numel() for v in native.values()) == 1_434_652_673  # head + embeddings 201.3M, 24 layers of 51.4M
    index = {k: torch.empty(shape, dtype=torch.bfloat16, device="meta") for k, shape in expected.items()}
    index |= dict.fromkeys(inv_freq_keys(24), rope_inv_freq(128, 1e6).to(torch.bfloat16))
    assert len(model.match_native(index, "model.safetensors.index.json")) == len(expected)
    shards = plan_shards(index, parse_size("1GB"))  # bf16: 2.87 GB of tensors
    assert len(shards) == 3 and sorted(k for shard in shards for k in shard) == sorted(index)
    for bad, match in [({"model.norm.weight"}, r"missing: \['model.norm.weight'\]"), (set(), "unexpected")]:
        extra = {} if bad else {"model.layers.24.mlp.up_proj.weight": index["model.layers.0.mlp.up_proj.weight"]}
        broken = {k: v for k, v in index.items() if k not in bad} | extra
        with pytest.raises(LoopLMError, match=rf"^index.json: .*{match}"):
            model.match_native(broken, "index.json")


# ----------------------------------------------------------------------------------- save_pretrained(max_shard_size)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sharded_save_round_trips_bit_exactly(tmp_path, dtype):
    model = OuroLM.from_config(TINY, seed=0).to(dtype).eval()  # fp32: full-precision bits, not bf16 ones
    model.save_pretrained(tmp_path, max_shard_size="10KB")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == [shard_name(i + 1, len(shards)) for i in range(len(shards))]
    assert not (tmp_path / "model.safetensors").exists()
    native = model.native_state_dict()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in native.values())
    assert sorted(index["weight_map"]) == sorted(native)
    for shard in shards:
        tensors = read_shard(tmp_path / shard)
        assert {t.dtype for t in tensors.values()} == {dtype}
        assert all(index["weight_map"][k] == shard for k in tensors)
    again = load_looplm(tmp_path, dtype=dtype)
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert q.dtype == dtype and torch.equal(p, q), name


def test_saving_again_replaces_the_other_layout(tmp_path):
    model = bf16_ouro()
    model.save_pretrained(tmp_path, max_shard_size=8_000)
    many = {p.name for p in tmp_path.glob("model-*.safetensors")}
    model.save_pretrained(tmp_path, max_shard_size="1MB")  # fits in one file: no index, no shards
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    fewer = {p.name for p in tmp_path.glob("model-*.safetensors")}
    assert 1 < len(fewer) < len(many) and not (tmp_path / "model.safetensors").exists()
    assert torch.equal(load_looplm(tmp_path, dtype=torch.bfloat16).lm_head.weight, model.lm_head.weight)


def test_max_shard_size_is_read_as_transformers_reads_it():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500 mb") == 5 * 10**8
    assert parse_size(1234) == 1234 and parse_size("1.5KB") == 1500
    for bad in ["5 parsecs", "GB", 0, -3, True, 2.5]:
        with pytest.raises(LoopLMError, match=r"max_shard_size=.*'5GB'"):
            parse_size(bad)


def test_tied_weights_stay_tied_after_loading(fixtures):
    model = load_looplm(fixtures / "loopformer-tiny")
    assert model.tied_parameter_names() == [["transformer.wte.weight", "lm_head.weight"]]
    assert model.lm_head.weight is model.transformer.wte.weight


# ----------------------------------------------------------------------------------- damaged layouts: one line each
def read_shard(path):
    """A shard's tensors in memory (not memory-mapped), so that the file can be rewritten."""
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def edit_index(directory, edit):
    index = json.loads((directory / INDEX_FILE).read_text())
    edit(index["weight_map"])
    (directory / INDEX_FILE).write_text(json.dumps(index))


def test_missing_shard_names_the_index_and_the_shard(published):
    directory, _ = published
    (directory / shard_name(2, 3)).unlink()
    one_line_error(
        directory, rf"^{re.escape(str(directory / INDEX_FILE))}: names shard '{shard_name(2, 3)}', which is not in "
    )


def test_key_listed_but_in_no_shard(published):
    directory, _ = published
    edit_index(directory, lambda wm: wm.update({"model.norm.bias": shard_name(1, 3)}))
    one_line_error(
        directory, rf"^{re.escape(str(directory / INDEX_FILE))}: lists 'model.norm.bias' in '{shard_name(1, 3)}', which"
    )


def test_shard_key_missing_from_the_index(published):
    directory, _ = published
    edit_index(directory, lambda wm: wm.pop("model.norm.weight"))
    one_line_error(directory, r"model-0000\d-of-00003.safetensors: holds 'model.norm.weight', which model.safet")


def test_key_in_two_shards(published):
    directory, _ = published
    shard = directory / shard_name(1, 3)
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    elsewhere = next(k for k, s in weight_map.items() if s != shard.name)
    state = read_shard(shard) | {elsewhere: torch.ones(1)}
    save_file(state, str(shard), {"format": "pt"})
    one_line_error(directory, rf"^{re.escape(str(shard))}: holds '{elsewhere}', which .* places in .*exactly one shard")


def test_unexpected_key_names_its_shard(published):
    directory, _ = published
    shard = directory / shard_name(3, 3)
    state = read_shard(shard) | {"model.layers.2.mlp.up_proj.weight": torch.ones(48, 32)}
    save_file(state, str(shard), {"format": "pt"})
    edit_index(directory, lambda wm: wm.update({"model.layers.2.mlp.up_proj.weight": shard.name}))
    message = one_line_error(
        directory, rf"^{re.escape(str(directory / INDEX_FILE))}: checkpoint keys do not match the ouro"
    )
    assert f"unexpected: ['model.layers.2.mlp.up_proj.weight' in {shard}]" in message


@pytest.mark.parametrize(
    ("freq", "match"),
    [
        (rope_inv_freq(8, 10000.0), r"'model.*inv_freq' \(shape \(4,\)\) is not what config.json implies \(rope_theta"),
        (rope_inv_freq(16, 1e6), r"'model.*inv_freq' \(shape \(8,\)\) is not .*head_dim=8: shape \(4,\)"),
    ],
)
def test_inv_freq_must_be_what_the_config_implies(tmp_path, freq, match):
    directory = write_published(tmp_path / "m", bf16_ouro(), inv_freq=freq)
    one_line_error(directory, rf"^{re.escape(str(tmp_path))}/m/model-0000\d-of-00003.safetensors: {match}")


def test_inv_freq_of_a_layer_the_config_lacks_is_unexpected(published):
    directory, _ = published
    shard = directory / shard_name(1, 3)
    state = read_shard(shard)
    state["model.layers.5.self_attn.rotary_emb.inv_freq"] = rope_inv_freq(8, 1e6)
    save_file(state, str(shard), {"format": "pt"})
    edit_index(directory, lambda wm: wm.update({"model.layers.5.self_attn.rotary_emb.inv_freq": shard.name}))
    one_line_error(directory, r"unexpected: \['model.layers.5.self_attn.rotary_emb.inv_freq' in ")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"metadata": {}, "weight_map": {"lm_head.weight": "model-0', r"not valid JSON \(.* at line 1"),
        ('{"metadata": {}}', r"no 'weight_map' object"),
        (
            '{"weight_map": {"a": "model-00001-of-00003.safetensors", "a": "x.safetensors"}}',
            r"'weight_map' lists 'a' more than once",
        ),
        (
            '{"weight_map": {"lm_head.weight": "../model-00001-of-00003.safetensors"}}',
            r"'weight_map' sends 'lm_head.weight' to '../model-00001-of-00003.safetensors', not a .safet",
        ),
    ],
)
def test_damaged_index_is_named(published, text, match):
    directory, _ = published
    (directory / INDEX_FILE).write_text(text)
    one_line_error(directory, rf"^{re.escape(str(directory / INDEX_FILE))}: {match}")


# ----------------------------------------------------------------------------------- hub ids (never downloaded here)
def test_hub_id_fetches_config_weights_tokenizer_chat_template_and_generation_config(monkeypatch, tmp_path):
    import huggingface_hub

    asked = {}

    def fake_snapshot_download(repo_id, allow_patterns):
        asked.update(repo_id=repo_id, patterns=allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_dir("ByteDance/Ouro-1.4B-Thinking") == tmp_path
    published = ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"]
    published += ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"]
    remote_code = ["modeling_ouro.py", "configuration_ouro.py", "README.md"]
    assert all(any(fnmatch(name, p) for p in asked["patterns"]) for name in published)
    assert not any(fnmatch(name, p) for p in asked["patterns"] for name in remote_code)
