"""The looped KV cache (loopq.models.kv_cache): cached decoding gives the tokens and logits of the full forward.

Independent expectation: the plain full forward of prompt + generated tokens (no cache, no mask), i.e. the
``generate(use_cache=False)`` re-run. Fake-quant and exported models run in float64: in fp32 a W4A4 activation code
can flip on a one-ulp difference between two forwards of different shapes (attention over a cache and causal
attention over the whole sequence round differently), which no cache can prevent. The exported model's kernels are
shape-invariant (a defined fp32 order, exact integer dots), so with float64 around them both forwards feed them the
same fp32 inputs; an fp32 exported model passed here but failed on CI's CPU.
"""

import pytest
import torch

from loopq.models import LoopLMError, load_looplm
from loopq.models.generation import generate
from loopq.models.kv_cache import LoopKVCache, SlotBuffer
from loopq.paths import REPO_ROOT
from loopq.quant import QuantConfig, prepare
from loopq.quant.packed import PackedLinearGroup
from tests.export.conftest import export_student

ARCHS = ["ouro-tiny", "loopformer-tiny", "parcae-tiny"]
NEW = 32


def prompt_ids(model, batch=2, length=12, seed=0):
    vocab = model.lm_head.weight.shape[0]
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def cached_logits(model, ids, prefill, **kwargs):
    """Logits of ``ids`` from a prefill of ``prefill`` tokens, then one cached forward per token."""
    cache = LoopKVCache.for_model(model, ids.shape[0])
    with torch.inference_mode():
        parts = [model(ids[:, :prefill], cache=cache, **kwargs).logits]
        parts += [model(ids[:, i : i + 1], cache=cache, **kwargs).logits for i in range(prefill, ids.shape[1])]
    return torch.cat(parts, dim=1)


def assert_cached_equals_rerun(model, ids, atol=1e-5, **kwargs):
    tokens = generate(model, ids, max_new_tokens=NEW, **kwargs)
    assert torch.equal(tokens, generate(model, ids, max_new_tokens=NEW, use_cache=False, **kwargs))
    full = torch.cat([ids, tokens], dim=1)
    with torch.inference_mode():
        want = model(full, **kwargs).logits
    torch.testing.assert_close(cached_logits(model, full, ids.shape[1], **kwargs), want, atol=atol, rtol=0)


@pytest.fixture(scope="module", params=ARCHS)
def teacher(request, fixtures):
    return load_looplm(fixtures / request.param).eval()


def test_cached_greedy_decoding_equals_the_rerun(teacher):
    assert_cached_equals_rerun(teacher, prompt_ids(teacher))


def test_left_padded_batch_equals_one_by_one(teacher):
    lengths = [12, 7, 1]
    ids = prompt_ids(teacher, batch=3)
    padded, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        padded[row, -n:], mask[row, -n:] = ids[row, :n], 1
    batched = generate(teacher, padded, attention_mask=mask, max_new_tokens=NEW)
    for row, n in enumerate(lengths):
        assert torch.equal(batched[row : row + 1], generate(teacher, ids[row : row + 1, :n], max_new_tokens=NEW))
    assert torch.equal(batched, generate(teacher, padded, attention_mask=mask, max_new_tokens=NEW, use_cache=False))


def test_cache_layout_is_one_entry_per_loop_and_layer(teacher):
    cache = LoopKVCache.for_model(teacher, 2)
    with torch.inference_mode():
        teacher(prompt_ids(teacher), num_loops=3, cache=cache)
    looped = {name for name in teacher.decoder_layers() if name.startswith(teacher.loop_layers_prefix + ".")}
    want = {(t, name) for t in range(3) for name in looped}
    want |= {(None, name) for name in set(teacher.decoder_layers()) - looped}  # Parcae's prelude and coda
    assert set(cache.keys) == want and cache.length == 12
    assert all(k.shape[0] == 2 and k.shape[2] == 12 for k in cache.keys.values())


def test_parcae_seeded_state_and_loopformer_schedule_decode_as_the_full_forward(fixtures):
    parcae = load_looplm(fixtures / "parcae-tiny").eval()
    assert_cached_equals_rerun(parcae, prompt_ids(parcae), seed=3, num_loops=2)
    loopformer = load_looplm(fixtures / "loopformer-tiny").eval()
    assert_cached_equals_rerun(loopformer, prompt_ids(loopformer), steps=[0.5, 0.25, 0.25])


def test_fake_quant_student_cached_equals_rerun():
    teacher = load_looplm(REPO_ROOT / "loopq/assets/tiny-ouro").eval()
    config = QuantConfig(w_bits=4, a_bits=4, group_size=32, transform_init="random", seed=0)
    student = prepare(teacher, config).eval().double()
    assert_cached_equals_rerun(student, prompt_ids(student, length=10))


def test_exported_student_cached_equals_rerun(fixtures, tmp_path):
    model = export_student(fixtures / "ouro-tiny", 4, tmp_path).eval().double()  # packed groups stay as exported
    assert all(g.weight_scale.dtype == torch.float16 for g in model.modules() if isinstance(g, PackedLinearGroup))
    assert_cached_equals_rerun(model, prompt_ids(model, length=10), atol=1e-10)  # measured: <= 4e-15


def test_a_cache_of_another_model_is_refused(fixtures):
    a, b = (load_looplm(fixtures / "ouro-tiny").eval() for _ in range(2))
    cache = LoopKVCache.for_model(a, 1)
    ids = prompt_ids(a, batch=1)
    with torch.inference_mode():
        a(ids, cache=cache)
        with pytest.raises(LoopLMError, match=r"^cache: .*another model"):
            b(ids[:, -1:], cache=cache)
        with pytest.raises(LoopLMError, match=r"^cache: built for a batch of 1"):
            a(prompt_ids(a, batch=2)[:, :1], cache=cache)


def test_positions_past_the_context_are_refused(fixtures):
    model = load_looplm(fixtures / "loopformer-tiny").eval()
    block = model.config.block_size
    cache = LoopKVCache.for_model(model, 1)
    with torch.inference_mode():
        model(torch.zeros(1, block, dtype=torch.long), cache=cache)
        with pytest.raises(LoopLMError, match="block_size"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_slot_buffer_appends_like_concatenation_and_grows_by_doubling():
    """Decoding appends one slot per step: the buffer holds exactly the concatenation, and its capacity doubles, so
    n appends reallocate O(log n) times instead of copying the whole entry at every step."""
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(2, 3, 5, 4, generator=gen)
    buffer, want, capacities = SlotBuffer(first), first, set()
    for _ in range(100):
        new = torch.randn(2, 3, 1, 4, generator=gen)
        buffer.append(new)
        want = torch.cat([want, new], dim=2)
        capacities.add(buffer.data.shape[2])
        assert torch.equal(buffer.view(), want)
    assert sorted(capacities) == [16, 32, 64, 128]
