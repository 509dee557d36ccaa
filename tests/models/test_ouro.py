"""Ouro parity with the upstream implementation's recorded outputs (../shared/fixtures/ouro-tiny)."""

import pytest
import torch
from safetensors.torch import load_file

from loopq.models import LoopLMError, load_looplm
from loopq.models.loading import read_config
from loopq.models.ouro import OuroLM, exit_distribution, threshold_exit_steps

ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def ouro(fixtures):
    path = fixtures / "ouro-tiny"
    return load_looplm(path), load_file(str(path / "reference.safetensors"))


def test_logits_and_trajectory_match_upstream(ouro):
    model, ref = ouro
    with torch.no_grad():
        out = model(ref["input_ids"], return_trajectory=True)
    torch.testing.assert_close(out.logits, ref["logits"], atol=ATOL, rtol=RTOL)
    assert len(out.loop_states) == 3
    for t, state in enumerate(out.loop_states):
        torch.testing.assert_close(state, ref["loop_states"][t], atol=ATOL, rtol=RTOL)
    for t, gate in enumerate(out.extras["exit_gate_logits"]):
        torch.testing.assert_close(gate, ref["exit_gate_logits"][t], atol=ATOL, rtol=RTOL)


def test_exit_readouts_match_upstream(ouro):
    model, ref = ouro
    with torch.no_grad():
        expected = model(ref["input_ids"], exit_mode="expected").logits
        threshold = model(ref["input_ids"], exit_mode="threshold").logits
    torch.testing.assert_close(expected, ref["expected_exit_logits"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(threshold, ref["default_call_logits"], atol=ATOL, rtol=RTOL)


def test_exit_distribution_by_hand():
    # lambda = sigmoid(0) = 0.5 per loop -> p = [0.5, 0.25, 0.25] (last loop takes the remaining mass)
    probs = exit_distribution(torch.zeros(1, 3))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.25, 0.25]]))
    # cumulative [0.5, 0.75, 1.0]: threshold 0.7 exits at loop index 1, threshold 2.0 never -> last
    assert threshold_exit_steps(probs, 0.7).item() == 1
    assert threshold_exit_steps(probs, 2.0).item() == 2


def test_low_threshold_exits_early_and_changes_logits(ouro):
    model, ref = ouro
    with torch.no_grad():
        out = model(ref["input_ids"], exit_mode="threshold", exit_threshold=0.0, return_trajectory=True)
    assert (out.extras["exit_steps"] == 0).all()
    torch.testing.assert_close(out.logits, model.lm_head(out.loop_states[0]))


def test_loop_extrapolation_continues_the_recurrence(ouro):
    model, ref = ouro
    with torch.no_grad():
        three = model(ref["input_ids"], num_loops=3, return_trajectory=True)
        five = model(ref["input_ids"], num_loops=5, return_trajectory=True)
    assert len(five.loop_states) == 5
    for a, b in zip(three.loop_states, five.loop_states[:3], strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(five.logits, three.logits)


def test_layer_states_end_in_loop_state(ouro):
    model, ref = ouro
    with torch.no_grad():
        out = model(ref["input_ids"], return_trajectory=True, return_layer_states=True)
    assert [len(x) for x in out.layer_states] == [2, 2, 2]
    # Ouro's loop state is model.norm applied to the last layer's output
    torch.testing.assert_close(model.model.norm(out.layer_states[1][-1]), out.loop_states[1])


def test_hf_loss_with_labels_is_the_loss_of_the_expected_exit_logits(ouro):
    """Upstream ``model(ids, labels=ids)`` returns the expected-exit mixture as ``.logits`` (the fixture's
    ``expected_exit_logits``) and transformers' causal-LM loss of them as ``.loss``: the same loss function on
    ``exit_mode="expected"`` gives the same number, so perplexities compare (docs/models.md)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    model, ref = ouro
    ids = ref["input_ids"]
    with torch.no_grad():
        ours = model(ids, exit_mode="expected").logits
    hf_loss = ForCausalLMLoss(ref["expected_exit_logits"], ids, vocab_size=128)
    torch.testing.assert_close(ForCausalLMLoss(ours, ids, vocab_size=128), hf_loss, atol=1e-5, rtol=1e-5)
    shifted = torch.nn.functional.cross_entropy(ours[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(shifted, hf_loss, atol=1e-5, rtol=1e-5)


def test_last_loop_equals_the_hf_default_call_only_while_no_token_exits_early(ouro):
    """Without labels upstream exits per token at ``early_exit_threshold`` (1.0): ``exit_mode="threshold"``. The
    default ``"last"`` gives the same logits on the fixture, but not once a gate saturates and a token's cumulative
    exit probability reaches 1.0 before the last loop."""
    model, ref = ouro
    ids = ref["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref["default_call_logits"], atol=ATOL, rtol=RTOL)
        bias = model.model.early_exit_gate.bias
        kept = bias.clone()
        bias.add_(50.0)  # sigmoid(g) == 1.0 in fp32: every token exits at loop 1
        try:
            last, threshold = model(ids).logits, model(ids, exit_mode="threshold")
        finally:
            bias.copy_(kept)
    assert (threshold.extras["exit_steps"] == 0).all() and not torch.allclose(last, threshold.logits)


@pytest.mark.parametrize(
    "entry",
    [
        {"rope_scaling": {"type": "linear", "factor": 4.0}},  # the legacy spelling upstream still reads
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},  # transformers 5's spelling
        {"rope_parameters": {"type": "dynamic", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},  # a theta the loader would not use
    ],
)
def test_a_rope_other_than_the_default_is_refused_however_config_json_spells_it(fixtures, entry):
    """A scaled RoPE used to load as plain RoPE when spelled ``type`` or ``rope_parameters`` (review finding)."""
    config = {**read_config(fixtures / "ouro-tiny"), **entry}
    with pytest.raises(LoopLMError, match=next(iter(entry))) as refused:
        OuroLM.config_from_dict(config)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("config.json: ")


def test_the_default_rope_loads_however_config_json_spells_it(fixtures):
    native = read_config(fixtures / "ouro-tiny")
    for entry in (
        {"rope_scaling": {"type": "default"}},
        {"rope_scaling": {}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": native["rope_theta"]}},
    ):
        assert OuroLM.config_from_dict({**native, **entry}).rope_theta == native["rope_theta"]
