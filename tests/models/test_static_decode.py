"""Fixed-shape decoding (loopq.models.static_decode) and single-query attention (loopq.models.base).

Independent expectations: the growing LoopKVCache (itself tested against the full forward in test_kv_cache.py) and
``scaled_dot_product_attention``. The static cache's decode step attends over its whole capacity with the unfilled
slots masked (zeros, probability 0), the growing cache over the filled slots only: the same terms summed over a
longer, zero-padded axis, so the two differ by the rounding of a different reduction order only. Measured on the three
fp32 fixtures: prefill logits bit-identical (same shapes), decoded logits within 1.9e-6 of the growing cache at
|logits| <= 6.5 (a few fp32 ulps); asserted within 1e-5, the tolerance the growing cache has against the full forward
(docs/generation.md). In float64 the same comparison must hold within 1e-12 (rounding differences scale with eps; a
wrong slot, mask or position changes logits by O(1) at any precision).

No GPU runs here: the CUDA-graph path is exercised with :class:`FakeGraph`, which replays the captured step with the
cache's host counts frozen at capture, as a replayed graph sees them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from loopq.models import LoopLMError, load_looplm
from loopq.models import static_decode as sd
from loopq.models.base import single_query_attention
from loopq.models.generation import generate
from loopq.models.kv_cache import LoopKVCache
from loopq.models.static_decode import HostState, StaticDecoder, StaticKVCache
from loopq.quant.packed import PackedLinearGroup
from tests.device_guard import ElsewhereFactories
from tests.export.conftest import export_student

ARCHS = ["ouro-tiny", "loopformer-tiny", "parcae-tiny"]
GRAPH_ARCHS = ["ouro-tiny", "loopformer-tiny"]  # Parcae is refused for graphs (host RoPE table / initial state)
PROMPT, NEW = 12, 16


def prompt_ids(model, batch=2, length=PROMPT, seed=0):
    vocab = model.lm_head.weight.shape[0]
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=ARCHS)
def teacher(request, fixtures):
    return load_looplm(fixtures / request.param).eval()


def growing_logits(model, ids, prefill, **kwargs):
    cache = LoopKVCache.for_model(model, ids.shape[0])
    with torch.inference_mode():
        parts = [model(ids[:, :prefill], cache=cache, **kwargs).logits]
        parts += [model(ids[:, i : i + 1], cache=cache, **kwargs).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(parts, dim=1)


def static_logits(model, ids, prefill, capture=None, graphs=False, **kwargs):
    decoder = StaticDecoder(model, ids.shape[0], ids.shape[1], graphs=graphs, capture=capture, **kwargs)
    with torch.inference_mode():
        parts = [decoder.prefill(ids[:, :prefill])]
        parts += [decoder.step(ids[:, i]).clone() for i in range(prefill, ids.shape[1])]
    return torch.cat(parts, dim=1), decoder


def decoded_sequence(model, batch=2, **kwargs):
    ids = prompt_ids(model, batch)
    return torch.cat([ids, generate(model, ids, max_new_tokens=NEW, **kwargs)], dim=1)


class FakeGraph:
    """A CUDA graph's semantics on CPU. Capture runs the step's Python once (as ``torch.cuda.graph`` does; the
    decoder then resets the cache). Each replay re-runs the step with the cache's host counts frozen at their capture
    values, as a replayed graph would see them: a step that read a host count would replay a stale one. Its output
    is one static buffer, overwritten per replay."""

    def __init__(self) -> None:
        self.captures = self.replays = 0

    def __call__(self, fn: Callable[[], Tensor], reset: Callable[[], None]) -> Callable[[], Tensor]:
        cache = fn.__self__.cache  # type: ignore[attr-defined]  # the step is StaticDecoder._forward
        frozen = HostState(cache.host.length, cache.host.next_position_bound)
        static = fn().clone()
        reset()
        self.captures += 1

        def replay() -> Tensor:
            live = cache.host
            cache.host = HostState(frozen.length, frozen.next_position_bound)
            try:
                static.copy_(fn())
            finally:
                cache.host = live
            self.replays += 1
            return static

        return replay


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor value on the host (``.item()``, ``int()``, ``bool()`` of a tensor): on CUDA each is a
    device sync, and inside a CUDA graph capture an error."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):  # item: inference mode
            self.count += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------ single-query attention
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_single_query_attention_equals_sdpa_with_repeated_heads(kv_heads):
    gen = torch.Generator().manual_seed(kv_heads)
    b, h, p, dh = 3, 4, 9, 16
    q = torch.randn(b, h, 1, dh, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, p, dh, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(b, 1, 1, p, generator=gen) < 0.6
    mask[..., -1] = True  # the new token always sees itself
    rep = h // kv_heads
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask
    )
    torch.testing.assert_close(single_query_attention(q, k, v, mask), want, atol=1e-13, rtol=0)
    masked_out = v.clone()
    masked_out[~mask[:, 0, 0, None, :, None].expand_as(v)] = 1e6  # masked keys' values must not matter
    torch.testing.assert_close(single_query_attention(q, k, masked_out, mask), want, atol=1e-13, rtol=0)


# ------------------------------------------------------------------------------------------ static cache
def test_static_cache_logits_equal_the_growing_cache(teacher):
    full = decoded_sequence(teacher)
    want = growing_logits(teacher, full, PROMPT)
    got, decoder = static_logits(teacher, full, PROMPT)
    assert torch.equal(got[:, :PROMPT], want[:, :PROMPT])  # the prefill has the growing cache's shapes
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # measured <= 1.9e-6
    assert decoder.cache.length == full.shape[1] and int(decoder.cache.slot) == full.shape[1]
    looped = {n for n in teacher.decoder_layers() if n.startswith(teacher.loop_layers_prefix + ".")}
    want_keys = {(t, n) for t in range(teacher.default_num_loops) for n in looped}
    want_keys |= {(None, n) for n in set(teacher.decoder_layers()) - looped}
    assert set(decoder.cache.key_buffers) == want_keys
    assert all(x.shape[0] == 2 and x.shape[2] == full.shape[1] for x in decoder.cache.key_buffers.values())


def test_static_cache_in_float64_differs_by_rounding_only(teacher):
    model = teacher.double()
    try:
        full = decoded_sequence(model)
        got, _ = static_logits(model, full, PROMPT)
        torch.testing.assert_close(got, growing_logits(model, full, PROMPT), atol=1e-12, rtol=0)
    finally:
        teacher.float()


def test_static_left_padded_batch_decodes_each_prompt_as_alone(teacher):
    lengths = [12, 7, 1]
    ids = prompt_ids(teacher, batch=3)
    padded, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        padded[row, -n:], mask[row, -n:] = ids[row, :n], 1
    batched = generate(teacher, padded, attention_mask=mask, max_new_tokens=NEW, static_cache=True)
    assert torch.equal(batched, generate(teacher, padded, attention_mask=mask, max_new_tokens=NEW))
    for row, n in enumerate(lengths):
        alone = generate(teacher, ids[row : row + 1, :n], max_new_tokens=NEW, static_cache=True)
        assert torch.equal(batched[row : row + 1], alone)


def test_loopformer_schedule_and_parcae_seed_reach_every_static_step(fixtures):
    for arch, kwargs in (("loopformer-tiny", {"steps": [0.5, 0.25, 0.25]}), ("parcae-tiny", {"seed": 3})):
        model = load_looplm(fixtures / arch).eval()
        full = decoded_sequence(model, **kwargs)
        got, _ = static_logits(model, full, PROMPT, **kwargs)
        torch.testing.assert_close(got, growing_logits(model, full, PROMPT, **kwargs), atol=1e-5, rtol=0)


def test_exported_w4a4_static_cache_equals_the_growing_cache(fixtures, tmp_path):
    model = export_student(fixtures / "ouro-tiny", 4, tmp_path).eval().double()  # float64 around the kernels
    full = decoded_sequence(model)
    got, _ = static_logits(model, full, PROMPT)
    torch.testing.assert_close(got, growing_logits(model, full, PROMPT), atol=1e-10, rtol=0)  # as test_kv_cache


@pytest.mark.parametrize("arch", GRAPH_ARCHS)
def test_a_static_decode_step_reads_nothing_back_to_the_host(fixtures, arch):
    model = load_looplm(fixtures / arch).eval()
    ids = prompt_ids(model)
    static = StaticDecoder(model, 2, PROMPT + 2)
    growing = LoopKVCache.for_model(model, 2)
    with torch.inference_mode():
        token = static.prefill(ids)[:, -1].argmax(-1)
        model(ids, cache=growing)
        with HostReads() as static_reads:
            static.step(token)
        with HostReads() as growing_reads:
            model(token[:, None], cache=growing)
    assert static_reads.count == 0
    assert growing_reads.count >= 1  # the detector sees the growing cache's position read


def test_exported_w4a4_decode_step_reads_nothing_back_to_the_host(fixtures, tmp_path):
    model = export_student(fixtures / "ouro-tiny", 4, tmp_path).eval()
    decoder = StaticDecoder(model, 2, PROMPT + 3)
    with torch.inference_mode():
        token = decoder.prefill(prompt_ids(model))[:, -1].argmax(-1)
        decoder.step(token)  # the first call may read constants once (kernel arguments)
        with HostReads() as reads:
            decoder.step(token)
    assert reads.count == 0


# ------------------------------------------------------------------------------------------ graph path
@pytest.mark.parametrize("arch", GRAPH_ARCHS)
def test_replayed_step_equals_the_eager_static_step(fixtures, arch):
    model = load_looplm(fixtures / arch).eval()
    full = decoded_sequence(model)
    eager, _ = static_logits(model, full, PROMPT)
    fake = FakeGraph()
    replayed, decoder = static_logits(model, full, PROMPT, capture=fake, graphs=True)
    assert decoder.graphed and fake.captures == 1 and fake.replays == NEW
    assert torch.equal(replayed, eager)  # same ops, same shapes, same CPU: bit-identical
    assert decoder.cache.length == full.shape[1] and int(decoder.cache.slot) == full.shape[1]


def test_generate_with_cuda_graphs(fixtures, monkeypatch):
    model = load_looplm(fixtures / "ouro-tiny").eval()
    ids = prompt_ids(model)
    want = generate(model, ids, max_new_tokens=NEW)
    assert torch.equal(generate(model, ids, max_new_tokens=NEW, cuda_graphs=True), want)  # CPU: eager static step
    fake = FakeGraph()
    monkeypatch.setattr(sd, "capture_for", lambda device: fake)
    assert torch.equal(generate(model, ids, max_new_tokens=NEW, cuda_graphs=True), want)
    assert fake.captures == 1 and fake.replays == NEW - 1  # the last new token is never fed back
    assert torch.equal(generate(model, ids, max_new_tokens=2, cuda_graphs=True), want[:, :2])  # capture needs no room


def test_cuda_graphs_fall_back_to_the_eager_step_on_cpu(fixtures):
    model = load_looplm(fixtures / "ouro-tiny").eval()
    assert sd.capture_for(torch.device("cpu")) is None
    assert not StaticDecoder(model, 1, 4, graphs=True).graphed
    assert sd.capture_for(torch.device("cuda")) is sd.cuda_graph_capture


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"static_cache": True, "exit_threshold": 0.5}, r"^--static_cache runs every loop .* drop --exit_threshold"),
        ({"cuda_graphs": True, "kv_bits": 8}, r"^--cuda_graphs stores the cache .* drop --kv_bits"),
        ({"static_cache": True, "use_cache": False}, r"^--static_cache is a KV cache; drop --no_cache"),
    ],
)
def test_unsupported_options_are_one_line_naming_the_flag(fixtures, options, message):
    model = load_looplm(fixtures / "ouro-tiny").eval()
    with pytest.raises(LoopLMError, match=message) as err:
        generate(model, prompt_ids(model), max_new_tokens=2, **options)
    assert "\n" not in str(err.value)


def test_parcae_graphs_are_refused_and_its_static_cache_is_not(fixtures):
    model = load_looplm(fixtures / "parcae-tiny").eval()
    with pytest.raises(LoopLMError, match=r"^--cuda_graphs: Parcae's forward builds .* without --cuda_graphs"):
        generate(model, prompt_ids(model), max_new_tokens=2, cuda_graphs=True)
    assert generate(model, prompt_ids(model), max_new_tokens=2, static_cache=True).shape == (2, 2)


def test_static_cache_misuse_is_one_line(fixtures):
    model = load_looplm(fixtures / "ouro-tiny").eval()
    ids = prompt_ids(model)
    with pytest.raises(LoopLMError, match=r"^static cache: capacity must be an integer >= 1"):
        StaticKVCache(model, 2, 0)
    decoder = StaticDecoder(model, 2, PROMPT + 1)
    with torch.inference_mode():
        with pytest.raises(LoopLMError, match=r"^static decoder: call prefill"):
            decoder.step(ids[:, 0])
        decoder.prefill(ids)
        with pytest.raises(LoopLMError, match=r"^static decoder: prefill runs once"):
            decoder.prefill(ids)
        decoder.step(ids[:, 0])
        with pytest.raises(LoopLMError, match=r"^static cache: 13 cached \+ 1 new tokens exceed its capacity of 13"):
            decoder.step(ids[:, 0])
        with pytest.raises(LoopLMError, match=r"^cache: .*another model"):
            load_looplm(fixtures / "ouro-tiny").eval()(ids[:, :1], cache=decoder.cache)
        two_loops = StaticDecoder(model, 2, PROMPT + 1, num_loops=2)
        two_loops.prefill(ids)
        with pytest.raises(LoopLMError, match=r"^static cache: entry \(2, .* first written by a decode step"):
            model(ids[:, :1], cache=two_loops.cache)  # 4 loops: loop 2's entries appear after the prefill


def test_static_cache_refuses_positions_past_the_context(fixtures):
    model = load_looplm(fixtures / "loopformer-tiny").eval()
    block = model.config.block_size
    decoder = StaticDecoder(model, 1, block + 1)
    with torch.inference_mode():
        decoder.prefill(torch.zeros(1, block, dtype=torch.long))
        with pytest.raises(LoopLMError, match=r"^static cache: position .* past the model's context"):
            decoder.step(torch.zeros(1, dtype=torch.long))


def test_packed_groups_read_their_clip_once_and_follow_a_write(fixtures, tmp_path):
    model = export_student(fixtures / "ouro-tiny", 4, tmp_path).eval()
    group = next(m for m in model.modules() if isinstance(m, PackedLinearGroup))
    slot = group.act_clip.shape[0] - 1
    assert group.host_clip(slot) == float(group.act_clip[slot])
    with torch.no_grad():
        group.act_clip.mul_(0.5)  # an in-place write (load_state_dict copies in place) must not leave a stale value
    assert group.host_clip(slot) == float(group.act_clip[slot])


def test_static_and_graph_paths_make_every_tensor_on_the_model_device(fixtures, monkeypatch):
    model = load_looplm(fixtures / "ouro-tiny").eval()
    ids = prompt_ids(model)
    want = generate(model, ids, max_new_tokens=4)
    monkeypatch.setattr(sd, "capture_for", lambda device: FakeGraph())
    with ElsewhereFactories() as mode:  # a factory call without device= lands on meta and fails on the CPU model
        static = generate(model, ids, max_new_tokens=4, static_cache=True)
        graphed = generate(model, ids, max_new_tokens=4, cuda_graphs=True)
    assert mode.redirected == [], mode.redirected
    assert torch.equal(static, want) and torch.equal(graphed, want)
