"""Single decoder layers of the LoopLM interface (``decoder_layers``, ``trace_layers``, ``run_layer``) and
``feeding_norm`` on all three architectures, checked against a full forward."""

import itertools

import pytest
import torch

from loopq.models import load_looplm

ARCHS = {"ouro": "ouro-tiny", "loopformer": "loopformer-tiny", "parcae": "parcae-tiny"}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request, fixtures):
    return load_looplm(fixtures / ARCHS[request.param])


def ids_for(model, seed=0):
    return torch.randint(0, model.lm_head.weight.shape[0], (2, 12), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_traced_loop_layers_are_the_layer_states_of_a_full_forward(model):
    ids = ids_for(model)
    loops = model.default_num_loops + 1  # any loop count, not only the trained one
    ref = model(ids, num_loops=loops, return_layer_states=True, return_trajectory=True)
    out, calls, _ = model.trace_layers(ids, num_loops=loops)
    assert torch.equal(out.logits, ref.logits)
    stack = set(model.decoder_layers()) & {f"{model.loop_layers_prefix}.{i}" for i in range(len(model.loop_layers))}
    looped = [c for c in calls if c.name in stack]
    assert len(looped) == loops * len(model.loop_layers)
    for i, call in enumerate(looped):
        t, layer = divmod(i, len(model.loop_layers))
        assert (call.t, call.name) == (t, f"{model.loop_layers_prefix}.{layer}")
        assert torch.equal(call.output, ref.layer_states[t][layer])


@torch.no_grad()
def test_layer_inputs_chain_through_the_recurrence(model):
    """Within a loop a layer reads the previous layer's output; loop t+1 starts from begin_loop(H_t)."""
    ids = ids_for(model, seed=1)
    out, calls, ctx = model.trace_layers(ids, return_trajectory=True)
    looped = [c for c in calls if c.t is not None]
    per_loop = len(model.loop_layers)
    for prev, call in itertools.pairwise(looped):
        if call.t == prev.t:
            assert torch.equal(call.inputs, prev.output)
        else:
            entering = model.begin_loop(out.loop_states[prev.t], call.t, ctx)
            assert torch.equal(call.inputs, entering)
    assert len(looped) == per_loop * model.default_num_loops


@torch.no_grad()
def test_run_layer_recomputes_every_call(model):
    ids = ids_for(model, seed=2)
    _, calls, ctx = model.trace_layers(ids)
    assert list(dict.fromkeys(c.name for c in calls)) == list(model.decoder_layers())  # each layer, in order
    for call in calls:
        assert torch.equal(model.run_layer(call.name, call.inputs, call.t, ctx), call.output)


def test_parcae_traces_prelude_and_coda_outside_the_loop(fixtures):
    model = load_looplm(fixtures / "parcae-tiny")
    with torch.no_grad():
        _, calls, _ = model.trace_layers(ids_for(model))
    outside = [c.name for c in calls if c.t is None]
    c = model.config
    assert len(outside) == c.n_layers_in_prelude + c.n_layers_in_coda
    assert outside[0].startswith("transformer.prelude.") and outside[-1].startswith("transformer.coda.")
    assert calls[0].name == "transformer.prelude.0" and calls[-1].name.startswith("transformer.coda.")


def test_feeding_norm_follows_norm_feeds(model):
    found = {name: model.feeding_norm(name) for name in model.linear_groups()}
    for name, norm in found.items():
        suffixes = [group for group in model.norm_feeds.values() if name.endswith("." + group)]
        assert (norm is not None) == bool(suffixes), name
        if norm is not None:
            layer = name[: -len(suffixes[0]) - 1]
            norm_name = next(n for n, g in model.norm_feeds.items() if g == suffixes[0])
            assert norm is model.get_submodule(f"{layer}.{norm_name}")
    assert any(found.values()) == bool(model.norm_feeds)
