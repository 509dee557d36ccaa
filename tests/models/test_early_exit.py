"""Early exit while decoding (loopq.models.early_exit): real loop skipping against independent expectations.

Expectations: the plain cached decode (a gate that never fires changes nothing); the uncached threshold-mode forward
(upstream's ``exit_distribution`` + ``threshold_exit_steps``) for the first decoded token, whose cache holds no copied
slot yet; a 1-loop model (every token exiting at loop 0 reads loop-0 states, which no later loop influences); a
reference that runs every loop and reads out at the upstream threshold exit, then applies the copy rule; each row
of a batch decoded alone.
"""

import pytest
import torch

from loopq.commands.generate import main
from loopq.errors import LoopQError
from loopq.metrics.decoding import decode_perplexity
from loopq.models import LoopLMError, load_looplm
from loopq.models.early_exit import ExitStats, early_exit_forward, exit_cdf
from loopq.models.generation import generate
from loopq.models.kv_cache import LoopKVCache
from loopq.models.ouro import exit_distribution
from loopq.paths import REPO_ROOT
from loopq.quant import QuantConfig, prepare
from tests.test_generate import tree_hash

TEACHER = REPO_ROOT / "loopq/assets/tiny-ouro"
PROMPT_LEN, NEW = 8, 12


@pytest.fixture(scope="module")
def teacher():
    return load_looplm(TEACHER).eval()


def random_ids(model, batch=2, length=PROMPT_LEN + NEW, seed=0):
    vocab = model.lm_head.weight.shape[0]
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def exit_decode(model, ids, threshold, prefill=PROMPT_LEN, kv_bits=None):
    """Prefill ``prefill`` tokens (all loops), then early-exit decode the rest teacher-forced: logits, exits, cache."""
    cache = LoopKVCache.for_model(model, ids.shape[0], kv_bits=kv_bits)
    with torch.inference_mode():
        model(ids[:, :prefill], cache=cache)
        steps = [early_exit_forward(model, ids[:, i : i + 1], cache, threshold) for i in range(prefill, ids.shape[1])]
    return torch.cat([s[0] for s in steps], dim=1), torch.stack([s[1] for s in steps], dim=1), cache


def reference_decode(model, ids, threshold, prefill=PROMPT_LEN):
    """Every loop run for every token, logits and exits from the upstream threshold readout, then the copy rule
    written out by hand: a row's slot in loop t > its exit loop e takes its loop-e keys/values."""
    cache = LoopKVCache.for_model(model, ids.shape[0])
    logits, exits = [], []
    with torch.inference_mode():
        model(ids[:, :prefill], cache=cache)
        for i in range(prefill, ids.shape[1]):
            out = model(ids[:, i : i + 1], cache=cache, exit_mode="threshold", exit_threshold=threshold)
            logits.append(out.logits)
            exits.append(out.extras["exit_steps"][:, 0])
            for store in (cache.keys, cache.values):
                for t, name in list(store):
                    for row, e in enumerate(exits[-1].tolist()):
                        if t > e:
                            store[(t, name)][row, :, -1] = store[(e, name)][row, :, -1]
    return torch.cat(logits, dim=1), torch.stack(exits, dim=1), cache


def test_a_gate_that_never_fires_is_the_plain_cached_decode(teacher):
    ids = random_ids(teacher)
    logits, exits, _ = exit_decode(teacher, ids, threshold=1.0)
    assert bool((exits == teacher.default_num_loops - 1).all())
    cache = LoopKVCache.for_model(teacher, 2)
    with torch.inference_mode():
        teacher(ids[:, :PROMPT_LEN], cache=cache)
        plain = torch.cat([teacher(ids[:, i : i + 1], cache=cache).logits for i in range(PROMPT_LEN, ids.shape[1])], 1)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=0)
    prompt = ids[:, :PROMPT_LEN]
    assert torch.equal(
        generate(teacher, prompt, max_new_tokens=NEW, exit_threshold=1.0), generate(teacher, prompt, max_new_tokens=NEW)
    )


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7, 0.9])
def test_first_decoded_token_exits_where_the_uncached_threshold_forward_does(teacher, threshold):
    ids = random_ids(teacher, batch=4, seed=1)
    _, exits, _ = exit_decode(teacher, ids[:, : PROMPT_LEN + 1], threshold)
    with torch.inference_mode():
        full = teacher(ids[:, : PROMPT_LEN + 1], exit_mode="threshold", exit_threshold=threshold)
    assert torch.equal(exits[:, 0], full.extras["exit_steps"][:, PROMPT_LEN])


def test_exit_cdf_is_the_cumulative_exit_distribution_before_the_last_loop():
    gates = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    cdf = exit_distribution(gates).cumsum(dim=-1)
    for t in range(3):
        torch.testing.assert_close(exit_cdf(gates[:, : t + 1]), cdf[:, t], atol=0, rtol=0)


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.9])
def test_skipping_equals_running_every_loop_and_copying_by_hand(teacher, threshold):
    ids = random_ids(teacher, seed=2)
    logits, exits, cache = exit_decode(teacher, ids, threshold)
    want_logits, want_exits, want_cache = reference_decode(teacher, ids, threshold)
    assert torch.equal(exits, want_exits) and 0 < exits.float().mean() < teacher.default_num_loops - 1
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
    assert set(cache.keys) == set(want_cache.keys)
    for key in cache.keys:
        torch.testing.assert_close(cache.keys[key], want_cache.keys[key], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.values[key], want_cache.values[key], atol=1e-5, rtol=0)


def test_every_token_exiting_at_loop_0_is_the_one_loop_decode(teacher):
    prompt = random_ids(teacher, length=PROMPT_LEN, seed=3)
    stats = ExitStats()
    tokens = generate(teacher, prompt, max_new_tokens=NEW, exit_threshold=1e-6, exit_stats=stats)
    assert stats.mean_loops() == 1.0 and stats.loops_run == [1] * (NEW - 1)
    assert torch.equal(tokens, generate(teacher, prompt, max_new_tokens=NEW, num_loops=1))


def test_batched_rows_exit_as_each_row_alone(teacher):
    windows = random_ids(teacher, batch=3, length=16, seed=4)
    batched = decode_perplexity(teacher, windows, exit_threshold=0.7, batch_size=3)
    alone = decode_perplexity(teacher, windows, exit_threshold=0.7, batch_size=1)
    assert torch.equal(batched.exit_loops, alone.exit_loops) and batched.exit_loops.unique().numel() > 1
    assert batched.ppl == pytest.approx(alone.ppl, rel=1e-5)


def test_decode_perplexity_without_exit_is_the_full_forward_perplexity(teacher):
    windows = random_ids(teacher, batch=2, length=16, seed=5)
    with torch.inference_mode():
        logits = teacher(windows).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())
    assert decode_perplexity(teacher, windows).ppl == pytest.approx(float(nll.exp()), rel=1e-5)


def test_fake_quant_student_skips_as_the_reference():
    teacher = load_looplm(TEACHER).eval()
    config = QuantConfig(w_bits=4, a_bits=4, group_size=32, transform_init="random", cta=True, seed=0)
    student = prepare(teacher, config).eval().double()
    ids = random_ids(student, seed=6)
    logits, exits, _ = exit_decode(student, ids, 0.7)
    want_logits, want_exits, _ = reference_decode(student, ids, 0.7)
    assert torch.equal(exits, want_exits)
    torch.testing.assert_close(logits, want_logits, atol=1e-8, rtol=0)


def test_exported_student_never_firing_gate_is_the_plain_decode(fixtures, tmp_path):
    from tests.export.conftest import export_student

    model = export_student(fixtures / "ouro-tiny", 4, tmp_path).eval()
    prompt = random_ids(model, length=PROMPT_LEN, seed=7)
    plain = generate(model, prompt, max_new_tokens=NEW)
    assert torch.equal(generate(model, prompt, max_new_tokens=NEW, exit_threshold=1.0), plain)
    stats = ExitStats()
    generate(model, prompt, max_new_tokens=NEW, exit_threshold=0.5, exit_stats=stats)
    assert 1.0 <= stats.mean_loops() <= model.default_num_loops


@pytest.mark.parametrize("threshold", [0.0, -0.1, 1.5, float("nan")])
def test_thresholds_outside_0_1_are_one_line_naming_the_flag(teacher, threshold):
    with pytest.raises(LoopLMError, match=r"^--exit_threshold must be in \(0, 1\]"):
        generate(teacher, random_ids(teacher, length=4), max_new_tokens=2, exit_threshold=threshold)


def test_early_exit_needs_the_gate_and_the_cache(teacher, fixtures):
    loopformer = load_looplm(fixtures / "loopformer-tiny").eval()
    with pytest.raises(LoopLMError, match=r"^--exit_threshold: early exit needs an exit gate .*loopformer"):
        generate(loopformer, random_ids(loopformer, length=4), max_new_tokens=2, exit_threshold=0.5)
    with pytest.raises(LoopLMError, match=r"^--exit_threshold needs the KV cache"):
        generate(teacher, random_ids(teacher, length=4), max_new_tokens=2, exit_threshold=0.5, use_cache=False)


def test_cli_reports_the_average_loops_and_refuses_bad_flags(capsys):
    main(["--model", str(TEACHER), "--prompt", "The loop", "--max_new_tokens", "6", "--exit_threshold", "0.7"])
    assert "loops per decoded token on average (5 tokens)" in capsys.readouterr().err
    before = tree_hash(TEACHER)
    for args, message in [
        (["--exit_threshold", "0"], r"^--exit_threshold must be in"),
        (["--exit_threshold", "0.5", "--no_cache"], r"^--exit_threshold and --kv_bits need the KV cache"),
    ]:
        with pytest.raises(LoopQError, match=message) as err:
            main(["--model", str(TEACHER), "--prompt", "The loop", *args])
        assert "\n" not in str(err.value)
    assert tree_hash(TEACHER) == before
