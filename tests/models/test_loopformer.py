"""LoopFormer parity with the upstream implementation's recorded outputs (../shared/fixtures/loopformer-tiny)."""

import fnmatch
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from loopq.models import LinearGroup, LoopLMError, load_looplm
from loopq.models.loopformer import LoopFormerLM, step_schedule

ATOL = RTOL = 1e-4
GROUPS = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")


@pytest.fixture(scope="module")
def loopformer(fixtures):
    path = fixtures / "loopformer-tiny"
    return load_looplm(path), load_file(str(path / "reference.safetensors"))


@pytest.mark.parametrize("schedule", ["", "_nonuniform"])
def test_logits_and_trajectory_match_upstream(loopformer, schedule):
    model, ref = loopformer
    steps = ref["steps" + schedule]
    with torch.no_grad():
        out = model(ref["input_ids"], steps=steps.tolist(), return_trajectory=True)
    torch.testing.assert_close(out.logits, ref["logits" + schedule], atol=ATOL, rtol=RTOL)
    assert len(out.loop_states) == len(steps)
    for t, state in enumerate(out.loop_states):
        torch.testing.assert_close(state, ref["loop_states" + schedule][t], atol=ATOL, rtol=RTOL)


def test_num_loops_alone_runs_the_uniform_schedule(loopformer):
    model, ref = loopformer
    with torch.no_grad():
        by_count = model(ref["input_ids"], num_loops=4).logits
        by_tensor = model(ref["input_ids"], num_loops=4, steps=ref["steps"]).logits
    torch.testing.assert_close(by_count, ref["logits"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(by_tensor, by_count, atol=0, rtol=0)


def test_default_loop_count(loopformer):
    model, ref = loopformer
    assert model.default_num_loops == 8  # no loopq_default_loops in the published config
    with torch.no_grad():
        out = model(ref["input_ids"][:, :4], return_trajectory=True)
    assert len(out.loop_states) == 8


def test_steps_conflicting_with_num_loops_raises(loopformer):
    model, ref = loopformer
    with pytest.raises(LoopLMError, match="num_loops=4 conflicts with steps of length 3"):
        model(ref["input_ids"], num_loops=4, steps=[0.5, 0.25, 0.25])


@pytest.mark.parametrize("steps", [[], [0.5, 0.0], [0.5, -0.25], [math.nan], [True], torch.ones(2, 2)])
def test_invalid_steps_raise(steps):
    with pytest.raises(LoopLMError, match="steps"):
        step_schedule(steps, None)


def test_sequence_longer_than_block_size_raises(loopformer):
    model, _ = loopformer
    with pytest.raises(LoopLMError, match="block_size=64"):
        model(torch.zeros(1, 65, dtype=torch.long), num_loops=1)


def test_layer_states_end_in_loop_state(loopformer):
    model, ref = loopformer
    with torch.no_grad():
        out = model(ref["input_ids"], steps=[0.5, 0.25, 0.25], return_trajectory=True, return_layer_states=True)
    assert [len(x) for x in out.layer_states] == [2, 2, 2]
    for per_layer, state in zip(out.layer_states, out.loop_states, strict=True):
        torch.testing.assert_close(per_layer[-1], state, atol=0, rtol=0)  # loop state = raw residual, no norm_f
    torch.testing.assert_close(model.head(out.loop_states[-1], {}), out.logits, atol=0, rtol=0)


def test_groups_and_full_precision_modules(loopformer):
    model, _ = loopformer
    want = [f"transformer.h.blocks.{i}.{g}" for i in range(2) for g in GROUPS]
    assert sorted(model.linear_groups()) == sorted(want)
    assert sorted(model.looped_group_names()) == sorted(want)
    grouped = {f"{g}.{n}" for g, m in model.linear_groups().items() for n in m.names}
    for name, module in model.named_modules():
        fp = any(fnmatch.fnmatch(name, p) for p in model.fp_module_patterns)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            assert fp != (name in grouped), name  # every weight is either quantizable or full precision
        if isinstance(module, LinearGroup):
            assert not fp, name


def test_save_load_round_trip(loopformer, fixtures, tmp_path):
    model, ref = loopformer
    model.save_pretrained(tmp_path)
    fixture = fixtures / "loopformer-tiny"
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(load_file(str(fixture / "model.safetensors")))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved == {**json.loads((fixture / "config.json").read_text()), "loopq_default_loops": 8}
    again = load_looplm(tmp_path)
    assert again.lm_head.weight is again.transformer.wte.weight
    with torch.no_grad():
        a = model(ref["input_ids"], steps=[0.5, 0.25, 0.25]).logits
        b = again(ref["input_ids"], steps=[0.5, 0.25, 0.25]).logits
    assert torch.equal(a, b)


def test_untied_head_in_checkpoint_is_rejected(loopformer):
    model, _ = loopformer
    native = model.native_state_dict()
    native["gpt.lm_head.weight"] = native["gpt.transformer.wte.weight"] + 1
    with pytest.raises(LoopLMError, match="ties them"):
        LoopFormerLM(model.config).load_native_state_dict(native)


def test_bf16_forward_is_close_to_fp32(loopformer):
    model, ref = loopformer
    bf16 = LoopFormerLM(model.config)
    bf16.load_state_dict(model.state_dict())
    bf16.to(torch.bfloat16).eval()
    with torch.no_grad():
        logits = bf16(ref["input_ids"], steps=[0.25] * 4).logits
    assert logits.dtype == torch.bfloat16
    err = (logits.float() - ref["logits"]).abs()
    assert err.max() < 0.05 * ref["logits"].abs().max()
    assert err.mean() < 0.02 * ref["logits"].std()


def test_from_config_is_reproducible_and_tied():
    config = {"model_type": "loopformer", "block_size": 16, "vocab_size": 32, "n_layer": 2, "n_head": 2}
    config |= {"n_embd": 16, "intermediate_dim": 24, "loopq_default_loops": 3}
    a, b = LoopFormerLM.from_config(config, seed=0), LoopFormerLM.from_config(config, seed=0)
    assert a.lm_head.weight is a.transformer.wte.weight
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        out = a(ids, return_trajectory=True)
        assert torch.equal(out.logits, b(ids).logits)
    assert len(out.loop_states) == 3


@pytest.mark.parametrize(
    ("key", "value"), [("n_head", 3), ("n_layer", 0), ("bias", "no"), ("loopq_default_loops", 1.5)]
)
def test_bad_config_names_the_key(key, value):
    config = {"model_type": "loopformer", "n_embd": 64, "n_head": 4, key: value}
    with pytest.raises(LoopLMError, match=key):
        LoopFormerLM.config_from_dict(config)
