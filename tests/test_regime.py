"""The activation-regime statistics (loopq.calib.regime) against hand computations and planted outliers."""

import pytest
import torch
from tokenizers import Tokenizer, models

from loopq.calib.regime import (
    activation_regime,
    channel_absmax,
    is_punctuation,
    kurtosis,
    max_median_ratio,
    spearman,
    top_channel_overlap,
    top_token_sites,
)
from loopq.models import load_looplm
from loopq.paths import ASSETS


def test_channel_profile_and_ratio_by_hand():
    x = torch.tensor([[[1.0, -2.0, 3.0]], [[-4.0, 0.5, 1.0]]])  # [B, S, K]
    assert channel_absmax(x).tolist() == [4.0, 2.0, 3.0]
    assert max_median_ratio(torch.tensor([4.0, 2.0, 3.0])) == pytest.approx(4 / 3)


def test_kurtosis_by_hand():
    assert kurtosis(torch.tensor([-1.0, 1.0])) == pytest.approx(1.0)  # two-point: the minimum
    # [0, 0, 0, 4]: mu 1, centred (-1, -1, -1, 3): m2 = 3, m4 = (1 + 1 + 1 + 81) / 4 = 21 -> 21 / 9
    assert kurtosis(torch.tensor([0.0, 0.0, 0.0, 4.0])) == pytest.approx(21 / 9)
    gauss = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    assert kurtosis(gauss) == pytest.approx(3.0, abs=0.05)


def test_spearman_is_rank_based():
    a = torch.tensor([1.0, 5.0, 2.0, 9.0])
    assert spearman(a, a.exp()) == pytest.approx(1.0)  # any increasing map: same ranks
    assert spearman(a, -a) == pytest.approx(-1.0)
    # ranks (0, 2, 1, 3) vs (0, 1, 2, 3): 1 - 6 * sum d^2 / (n (n^2 - 1)) = 1 - 6 * 2 / 60 = 0.8
    assert spearman(a, torch.tensor([1.0, 2.0, 3.0, 4.0])) == pytest.approx(0.8)


def test_top_channel_overlap_by_hand():
    a = torch.tensor([9.0, 1.0, 8.0, 1.0, 1.0, 7.0])
    b = torch.tensor([9.0, 8.0, 1.0, 1.0, 1.0, 7.0])
    assert top_channel_overlap(a, b, k=3) == pytest.approx(2 / 4)  # {0, 2, 5} vs {0, 1, 5}
    assert top_channel_overlap(a, a) == 1.0


def test_punctuation_tokens():
    assert is_punctuation(",") and is_punctuation("Ġ.") and is_punctuation("Ċ")
    assert not is_punctuation("Ġthe") and not is_punctuation("")


def test_top_sites_find_a_planted_sink():
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, ",": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    ids = torch.tensor([[0, 1, 3, 2] * 25] * 2)  # [2, 100]
    x = torch.randn(2, 100, 8, generator=torch.Generator().manual_seed(0)) * 0.1
    x[:, 0, 5] = 50.0  # the sink: position 0 (a BOS token)
    sites = top_token_sites(x, ids, tok, special={0})
    assert sites["tokens"] == 2  # 1 % of 200 tokens
    assert sites["at_position_0"] == 1.0 and sites["at_special"] == 1.0 and sites["at_punctuation"] == 0.0
    assert sites["most_frequent"] == [["<|endoftext|>", 2]]


def test_regime_of_the_stress_teacher_sees_its_static_outliers():
    """The stress variant multiplies 4 fixed channels by 32 in every norm-fed group: the ratio jumps, and the
    same channels dominate in every loop (the top channels of loop 1 and loop T are the planted ones)."""
    from loopq.data.tokenizer import load_tokenizer

    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    tok = load_tokenizer(ASSETS / "tiny-ouro")
    plain = activation_regime(load_looplm(ASSETS / "tiny-ouro"), ids, tok)["groups"]
    stress = activation_regime(load_looplm(ASSETS / "tiny-ouro-outliers"), ids, tok)["groups"]
    name = "model.layers.0.self_attn.qkv_proj"  # fed by input_layernorm
    assert min(stress[name]["max_median_ratio"]) > 8 * max(plain[name]["max_median_ratio"])
    assert stress[name]["top_channel_overlap_first_last"] == 1.0  # K/32 = 4 channels: exactly the planted four
