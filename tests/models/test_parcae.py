"""Parcae parity with the upstream implementation's recorded outputs (../shared/fixtures/parcae-tiny)."""

import json
from fnmatch import fnmatch

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from loopq.models import LoopLMError, load_looplm
from loopq.models.loading import read_config, read_weights
from loopq.models.parcae import ParcaeLM

ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def parcae(fixtures):
    path = fixtures / "parcae-tiny"
    return load_looplm(path), load_file(str(path / "reference.safetensors"))


def test_loads_as_parcae(parcae):
    model, _ = parcae
    assert isinstance(model, ParcaeLM)
    assert model.default_num_loops == 3


def test_logits_and_trajectory_match_upstream(parcae):
    model, ref = parcae
    with torch.no_grad():
        out = model(ref["input_ids"], num_loops=3, h0=ref["h0"], return_trajectory=True)
    torch.testing.assert_close(out.logits, ref["logits"], atol=ATOL, rtol=RTOL)
    assert len(out.loop_states) == 3
    for t, state in enumerate(out.loop_states):
        torch.testing.assert_close(state, ref["loop_states"][t], atol=ATOL, rtol=RTOL)


def test_head_of_last_loop_state_gives_the_logits(parcae):
    # README: lm_head(ln_f(coda(C(loop_states[-1])))) == logits, bit-exact upstream
    model, ref = parcae
    with torch.no_grad():
        _, ctx = model.embed(ref["input_ids"], 3, h0=ref["h0"])
        logits = model.head(ref["loop_states"][-1], ctx)
    torch.testing.assert_close(logits, ref["logits"], atol=ATOL, rtol=RTOL)


def test_layer_states_end_in_loop_state(parcae):
    model, ref = parcae
    with torch.no_grad():
        out = model(ref["input_ids"], h0=ref["h0"], return_trajectory=True, return_layer_states=True)
    assert [len(x) for x in out.layer_states] == [2, 2, 2]
    for per_layer, state in zip(out.layer_states, out.loop_states, strict=True):
        torch.testing.assert_close(per_layer[-1], state)


def test_injected_state_matters(parcae):
    model, ref = parcae
    with torch.no_grad():
        zero = model(ref["input_ids"], h0=torch.zeros_like(ref["h0"])).logits
    assert (zero - ref["logits"]).abs().max() > 0.1


def test_seeded_default_state_is_deterministic(parcae):
    model, ref = parcae
    ids = ref["input_ids"]
    state = torch.random.get_rng_state()
    with torch.no_grad():
        a = model(ids).logits
        b = model(ids, seed=0).logits
        c = model(ids, seed=1).logits
        d = model(ids, seed=1).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)  # default seed is 0
    torch.testing.assert_close(c, d, atol=0, rtol=0)
    assert not torch.allclose(a, c)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is never touched


def test_like_init_state_distribution(parcae):
    model, _ = parcae
    h = model.initial_state((4, 64, 64), seed=3)
    std = (2 / (5 * 64)) ** 0.5  # scaled-zero "embedding" std for n_embd = 64
    assert h.abs().max() <= 3 * std + 1e-6
    assert 0.7 * std < h.std() < 1.0 * std  # a [-3, 3] sigma truncated normal keeps ~98.7% of the std
    torch.testing.assert_close(h, model.initial_state((4, 64, 64), seed=3), atol=0, rtol=0)


def test_wrong_h0_shape_raises(parcae):
    model, ref = parcae
    with pytest.raises(LoopLMError, match="h0"):
        model(ref["input_ids"], h0=ref["h0"][:, :5])
    with pytest.raises(LoopLMError, match="h0"):
        model(ref["input_ids"], h0=ref["h0"][..., :32])


def test_too_long_input_raises(parcae):
    model, _ = parcae
    with pytest.raises(LoopLMError, match="block_size"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_save_load_round_trip(parcae, fixtures, tmp_path):
    model, ref = parcae
    model.save_pretrained(tmp_path)
    with (
        safe_open(str(tmp_path / "model.safetensors"), "pt") as saved,
        safe_open(str(fixtures / "parcae-tiny" / "model.safetensors"), "pt") as published,
    ):
        assert set(saved.keys()) == set(published.keys())
        assert len(set(saved.keys())) == 63
        keys = published.keys()
        for key in keys:
            assert torch.equal(saved.get_tensor(key), published.get_tensor(key)), key
    assert json.loads((tmp_path / "config.json").read_text()) == read_config(fixtures / "parcae-tiny")
    again = load_looplm(tmp_path)
    with torch.no_grad():
        a = model(ref["input_ids"], h0=ref["h0"]).logits
        b = again(ref["input_ids"], h0=ref["h0"]).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_config_round_trip(fixtures):
    config = read_config(fixtures / "parcae-tiny")
    assert ParcaeLM.matches(config)
    model = ParcaeLM(ParcaeLM.config_from_dict(config))
    assert model.config_to_dict() == config


def test_import_rejects_bad_rope_table_and_untied_head(fixtures):
    path = fixtures / "parcae-tiny"
    model = ParcaeLM(ParcaeLM.config_from_dict(read_config(path)))
    weights = read_weights(path)
    with pytest.raises(LoopLMError, match="freqs_cis"):
        model.load_native_state_dict({**weights, "freqs_cis": weights["freqs_cis"] * 1.01})
    with pytest.raises(LoopLMError, match="freqs_cis"):
        model.load_native_state_dict({**weights, "freqs_cis": weights["freqs_cis"][:, :64]})
    with pytest.raises(LoopLMError, match=r"lm_head\.weight"):
        model.load_native_state_dict({**weights, "lm_head.weight": weights["lm_head.weight"] + 1})
    # a checkpoint with only one copy of the tied matrix (and no RoPE table) loads too
    del weights["lm_head.weight"], weights["freqs_cis"]
    model.load_native_state_dict(weights)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("injection_type", "linear"),
        ("block_class_name", "SandwichBlock"),
        ("nonlin_name", "Softplus"),
        ("norm_class_name", "LayerNorm"),
        ("use_fused_head", "full-triton"),
        ("mup_model_scaling_factor", 2),
        ("init_strategy", "deepnorm-straight"),
    ],
)
def test_unsupported_options_name_the_key(fixtures, key, value):
    config = {**read_config(fixtures / "parcae-tiny"), key: value}
    with pytest.raises(LoopLMError, match=key):
        ParcaeLM.config_from_dict(config)


def test_groups_and_full_precision_modules(parcae):
    model, _ = parcae
    groups = model.linear_groups()
    per_block = {"attn.qkv": ["c_q", "c_k", "c_v"], "attn.out": ["c_proj"], "mlp.up": ["fc"], "mlp.down": ["proj"]}
    for part, n in (("prelude", 2), ("core_block", 2), ("coda", 2)):
        for i in range(n):
            for suffix, names in per_block.items():
                assert groups[f"transformer.{part}.{i}.{suffix}"].names == names
    assert len(groups) == 6 * 4
    assert model.looped_group_names() == [n for n in groups if n.startswith("transformer.core_block.")]

    def is_fp(name):
        return any(fnmatch(name, p) for p in model.fp_module_patterns)

    for name in groups:
        assert not is_fp(name)
        for linear in groups[name].names:
            assert not is_fp(f"{name}.{linear}")
    for name in ("transformer.wte", "lm_head", "transformer.adapter", "transformer.C", "transformer.ln_f"):
        assert is_fp(name)
    for name in ("transformer.ln_prelude", "transformer.core_block.0.norm_1", "value_embeds.3"):
        assert is_fp(name)
    assert is_fp("transformer.coda.1.attn.ve_gate")


def test_loop_extrapolation_continues_the_recurrence(parcae):
    model, ref = parcae
    with torch.no_grad():
        three = model(ref["input_ids"], num_loops=3, h0=ref["h0"], return_trajectory=True)
        five = model(ref["input_ids"], num_loops=5, h0=ref["h0"], return_trajectory=True)
    for a, b in zip(three.loop_states, five.loop_states[:3], strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(five.logits, three.logits)


def test_bf16_forward_runs(fixtures, parcae):
    model = load_looplm(fixtures / "parcae-tiny", dtype=torch.bfloat16)
    ref = parcae[1]
    with torch.no_grad():
        out = model(ref["input_ids"], h0=ref["h0"], return_trajectory=True)
    assert out.loop_states[-1].dtype == torch.bfloat16
    assert torch.isfinite(out.logits).all()
    assert (out.logits - ref["logits"]).abs().max() < 0.5


def test_from_config_is_seeded_and_runs(fixtures):
    config = read_config(fixtures / "parcae-tiny")
    a = ParcaeLM.from_config(config, seed=1)
    b = ParcaeLM.from_config(ParcaeLM.config_from_dict(config), seed=1)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = a(ids, return_trajectory=True)
    assert out.logits.shape == (1, 8, 256) and torch.isfinite(out.logits).all()
    assert torch.isfinite(out.loop_states[-1]).all()


def test_recurrent_width_differs_from_n_embd(fixtures):
    # core blocks of width 96 (6 heads of 16): B maps e into the recurrent width, C maps back out
    config = {**read_config(fixtures / "parcae-tiny"), "recurrent_embedding_dimension": 96}
    config.update(recurrent_num_attention_heads=6, recurrent_intermediation_embedding_dimension=192)
    # with 2 core blocks, core block 1 mixes a 64-wide value embedding into 96-wide values: upstream cannot run it
    with pytest.raises(LoopLMError, match="recurrent_embedding_dimension"):
        ParcaeLM(ParcaeLM.config_from_dict(config))
    config.update(n_layers_in_recurrent_block=1, tie_embeddings=False)  # the single core block has no ve_gate
    model = ParcaeLM.from_config(config, seed=0)
    assert model.transformer.adapter.B.shape == (96, 64) and model.transformer.C.weight.shape == (64, 96)
    assert not model.transformer.core_block[0].attn.ve_gate and model.transformer.core_block[0].ve_key is None
    assert model.lm_head.weight is not model.transformer.wte.weight
    with torch.no_grad():
        out = model(torch.zeros(1, 4, dtype=torch.long), return_trajectory=True)
    assert out.loop_states[0].shape == (1, 4, 96) and out.logits.shape == (1, 4, 256)


def test_seeded_state_does_not_depend_on_batch_composition(fixtures):
    model = load_looplm(fixtures / "parcae-tiny")
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        batched = model(ids, seed=3).logits
        alone = model(ids[1:2], seed=3).logits
        prefix = model(ids[1:2, :12], seed=3).logits
    torch.testing.assert_close(batched[1:2], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone[:, :12], prefix, atol=1e-5, rtol=1e-5)  # causal: a prefix scores the same


def test_a_checkpoint_stored_all_in_bf16_loads_its_rope_table(fixtures, tmp_path):
    """Upstream's ``model.to(torch.bfloat16)`` stores ``freqs_cis`` in bf16 too (~2e-3 off the fp32 table): it is
    checked to bf16's rounding, not refused with a message that blames a correct config.json (review finding); a
    wrong table in bf16 is still refused."""
    from safetensors.torch import save_file

    path = fixtures / "parcae-tiny"
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    weights = {k: v.to(torch.bfloat16) for k, v in read_weights(path).items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    model = load_looplm(tmp_path, dtype=torch.bfloat16)
    assert model.arch == "parcae"
    with pytest.raises(LoopLMError, match="freqs_cis"):
        model.load_native_state_dict({**weights, "freqs_cis": weights["freqs_cis"] * 1.1})
