"""Quantized KV cache (loopq.models.kv_quant): the rounding invariant, the bytes by hand, logits near the fp cache.

Expectations: |dequant(quant(x)) - x| <= s/2 per group (symmetric round-to-nearest, no value clipped at
clip ratio 1); the byte count T x L x 2 x S x B x (codes + scales) written out from the tiny teacher's shapes;
the unquantized cached decode, from which an 8-bit cache moved the logits by at most 0.042 over six random prompts
(bound 0.1).
"""

import pytest
import torch

from loopq.commands.generate import main
from loopq.errors import LoopQError
from loopq.models import LoopLMError, load_looplm
from loopq.models.early_exit import early_exit_forward
from loopq.models.generation import generate
from loopq.models.kv_cache import LoopKVCache
from loopq.models.kv_quant import QuantizedKV, dequantize_kv, quantize_kv
from loopq.paths import REPO_ROOT
from loopq.qspec import qrange
from tests.test_generate import tree_hash

TEACHER = REPO_ROOT / "loopq/assets/tiny-ouro"
PREFILL = 8


@pytest.fixture(scope="module")
def teacher():
    return load_looplm(TEACHER).eval()


def random_ids(batch=2, length=20, seed=0):
    return torch.randint(0, 2048, (batch, length), generator=torch.Generator().manual_seed(seed))


def cached_logits(model, ids, kv_bits):
    cache = LoopKVCache.for_model(model, ids.shape[0], kv_bits=kv_bits)
    with torch.inference_mode():
        out = [model(ids[:, :PREFILL], cache=cache).logits]
        out += [model(ids[:, i : i + 1], cache=cache).logits for i in range(PREFILL, ids.shape[1])]
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_dim", [32, 64, 48])
def test_round_trip_error_is_at_most_half_a_step_per_group(bits, head_dim):
    x = torch.randn(2, 3, 5, head_dim, generator=torch.Generator().manual_seed(bits + head_dim))
    x[0, 0, 0, 1] = 40.0  # an outlier widens its group's step only
    q = quantize_kv(x, bits)
    group = 32 if head_dim % 32 == 0 else head_dim
    assert q.scales.shape == (2, 3, 5, head_dim // group)
    assert q.codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert q.codes.shape[-1] == head_dim * bits // 8
    step = q.scales.repeat_interleave(group, dim=-1)
    error = (dequantize_kv(q) - x).abs()
    assert bool((error <= step / 2 * (1 + 1e-6)).all())
    assert torch.allclose(step[..., 0], x[..., :group].abs().amax(-1) / qrange(bits)[1])


def test_cache_bytes_are_codes_plus_scales_by_hand(teacher):
    ids = random_ids(batch=2, length=12)
    c = teacher.config
    entries = c.total_ut_steps * c.num_hidden_layers * 2 * ids.numel()  # (loop, layer, K|V) x batch x tokens
    d_kv = c.num_key_value_heads * c.dh  # 2 heads x 32
    groups = c.num_key_value_heads * c.dh // 32
    want = {None: entries * d_kv * 4, 8: entries * (d_kv + groups * 4), 4: entries * (d_kv // 2 + groups * 4)}
    for bits, nbytes in want.items():
        cache = LoopKVCache.for_model(teacher, 2, kv_bits=bits)
        with torch.inference_mode():
            teacher(ids[:, :7], cache=cache)
            teacher(ids[:, 7:], cache=cache)
        assert cache.num_bytes() == nbytes
    assert want[None] / want[8] == pytest.approx(256 / 72) and want[None] / want[4] == pytest.approx(256 / 40)


def test_8_bit_cache_logits_stay_near_the_fp_cache_and_4_bit_further(teacher):
    ids = random_ids(seed=7)
    fp, _ = cached_logits(teacher, ids, None)
    q8, cache = cached_logits(teacher, ids, 8)
    q4, _ = cached_logits(teacher, ids, 4)
    assert isinstance(next(iter(cache.keys.values())), QuantizedKV)
    assert torch.equal(q8[:, :PREFILL], fp[:, :PREFILL])  # the prefill attends to its own K/V unrounded
    err8, err4 = (q8 - fp).abs().max(), (q4 - fp).abs().max()
    assert 0 < err8 < 0.1 and err8 < err4 < 1.5
    assert torch.equal(cached_logits(teacher, ids, 16)[0], fp)  # 16 = unquantized


def test_early_exit_copies_the_exit_loop_codes(teacher):
    ids = random_ids(batch=2, length=PREFILL + 1, seed=8)
    cache = LoopKVCache.for_model(teacher, 2, kv_bits=4)
    with torch.inference_mode():
        teacher(ids[:, :PREFILL], cache=cache)
        _, exits, _ = early_exit_forward(teacher, ids[:, PREFILL:], cache, 0.5)
    assert bool((exits < teacher.default_num_loops - 1).all())
    for (t, name), entry in cache.keys.items():
        for row, e in enumerate(exits.tolist()):
            if t > e:
                src = cache.keys[(e, name)]
                assert torch.equal(entry.codes[row, :, -1], src.codes[row, :, -1])
                assert torch.equal(entry.scales[row, :, -1], src.scales[row, :, -1])


@pytest.mark.parametrize("bits", [3, 2, 0, 32, True])
def test_bad_kv_bits_are_one_line_naming_the_flag(teacher, bits):
    with pytest.raises(LoopLMError, match=r"^--kv_bits must be 16 \(no quantization\), 8 or 4, got"):
        generate(teacher, random_ids(length=4), max_new_tokens=2, kv_bits=bits)


def test_cli_kv_bits(capsys):
    texts = main(["--model", str(TEACHER), "--prompt", "The loop", "--max_new_tokens", "4", "--kv_bits", "8"])
    assert texts[0] and capsys.readouterr().out.startswith("The loop")
    before = tree_hash(TEACHER)
    for args, message in [
        (["--kv_bits", "3"], r"^--kv_bits must be 16 \(no quantization\), 8 or 4, got 3$"),
        (["--kv_bits", "4", "--no_cache"], r"need the KV cache; drop --no_cache"),
    ]:
        with pytest.raises(LoopQError, match=message) as err:
            main(["--model", str(TEACHER), "--prompt", "The loop", *args])
        assert "\n" not in str(err.value)
    assert tree_hash(TEACHER) == before
