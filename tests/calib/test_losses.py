"""Eq. 8 and the appendix mu_t, checked against hand computations."""

import math

import pytest
import torch

from loopq.calib.losses import adaptive_mu, loopq_loss, teacher_topk, topk_kl, trajectory_terms, transition_term


def test_topk_kl_full_vocab_equals_kl_divergence():
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 3, 5, generator=gen)
    values, indices = teacher_topk(t, k=1000)  # k capped at the vocabulary: full distribution
    want = torch.nn.functional.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none")
    torch.testing.assert_close(topk_kl(values, indices, s), want.sum(-1).mean())


def test_topk_kl_by_hand_and_zero_at_match():
    # teacher top-2 of [2, 0, -inf-ish]: p = softmax([2, 0]); student uniform over 3 tokens: q = 1/3
    t = torch.tensor([[[2.0, 0.0, -50.0]]])
    s = torch.zeros(1, 1, 3)
    values, indices = teacher_topk(t, k=2)
    p = torch.softmax(torch.tensor([2.0, 0.0]), -1)
    want = float((p * (p.log() - math.log(1 / 3))).sum())
    assert float(topk_kl(values, indices, s)) == pytest.approx(want, rel=1e-6)
    assert float(topk_kl(*teacher_topk(t, 3), t)) == pytest.approx(0.0, abs=1e-6)


def test_adaptive_mu_by_hand():
    # scalar "states": teacher H = [0, 2, 3], student = [1, 2, 3] (only loop 0 is off by 1)
    teacher = [torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.tensor([[3.0]])]
    student = [torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.tensor([[3.0]])]
    mu = adaptive_mu(teacher, student, eps=0.0)
    # t=0: ||H_T - H_0||^2 = 9, tail mismatch = 1 -> 9/10; t=1: 1/(1+0) = 1; t=T-1: 0/(0+0+eps) -> 0 with eps>0
    assert mu[0].item() == pytest.approx(0.9)
    assert mu[1].item() == pytest.approx(1.0)
    assert adaptive_mu(teacher, student, eps=1e-6)[2].item() == 0.0


def test_trajectory_and_transition_terms_by_hand():
    teacher = [torch.zeros(1, 2, 2), torch.ones(1, 2, 2)]
    student = [torch.full((1, 2, 2), 0.5), torch.full((1, 2, 2), 2.0)]
    mu = torch.tensor([0.25, 0.0])
    loopwise, to_final = trajectory_terms(student, teacher, mu)
    # loop 0: (1-.25)*0.25 ; loop 1: 1*1 -> 1.1875 ; to-final: .25 * (0.5-1)^2 = 0.0625
    assert float(loopwise) == pytest.approx(0.75 * 0.25 + 1.0)
    assert float(to_final) == pytest.approx(0.0625)
    adapted = [torch.full((1, 2, 2), 0.1)]  # A_0(H~_0) vs H_{1,0} = teacher loop_states[0] = 0
    assert float(transition_term(adapted, teacher)) == pytest.approx(0.01)


def test_total_is_kl_plus_lambda_times_state_terms():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 7, generator=gen)
    values, indices = teacher_topk(torch.randn(1, 4, 7, generator=gen), 5)
    teacher = [torch.randn(1, 4, 3, generator=gen) for _ in range(3)]
    student = [h + 0.1 for h in teacher]
    terms = loopq_loss(logits, student, student[:2], values, indices, teacher, torch.tensor([0.3, 0.2, 0.0]), lam=0.1)
    state = terms["loopwise"] + terms["to_final"] + terms["transition"]
    torch.testing.assert_close(terms["loss"], terms["kl"] + 0.1 * state)
    assert all(torch.isfinite(v) for v in terms.values())


def test_state_reduction_sum_is_the_squared_l2_norm_per_token():
    # two tokens of width 3: errors (1, 2, 2) and (0, 0, 3): squared norms 9 and 9
    student = [torch.tensor([[[1.0, 2.0, 2.0], [0.0, 0.0, 3.0]]])]
    teacher = [torch.zeros(1, 2, 3)]
    mu = torch.tensor([0.0])
    mean_l, _ = trajectory_terms(student, teacher, mu, "mean")
    sum_l, _ = trajectory_terms(student, teacher, mu, "sum")
    assert float(mean_l) == pytest.approx(18 / 6)  # per-element MSE (the project's default)
    assert float(sum_l) == pytest.approx(18 / 2)  # ||.||_2^2 per token, averaged over tokens (Eq. 8 as written)
    adapted = [torch.full((1, 2, 3), 0.5)]
    assert float(transition_term(adapted, teacher + teacher, "sum")) == pytest.approx(3 * 0.25)
    assert float(transition_term(adapted, teacher + teacher, "mean")) == pytest.approx(0.25)


def test_sum_reduction_at_lambda_equals_mean_at_lambda_times_width():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 4, 7, generator=gen)
    values, indices = teacher_topk(torch.randn(1, 4, 7, generator=gen), 5)
    teacher = [torch.randn(1, 4, 6, generator=gen) for _ in range(3)]
    student = [h + 0.1 * torch.randn(1, 4, 6, generator=gen) for h in teacher]
    mu = torch.tensor([0.3, 0.2, 0.0])
    summed = loopq_loss(logits, student, student[:2], values, indices, teacher, mu, lam=0.1, state_reduction="sum")
    meaned = loopq_loss(logits, student, student[:2], values, indices, teacher, mu, lam=0.6, state_reduction="mean")
    torch.testing.assert_close(summed["loss"], meaned["loss"])
    with pytest.raises(ValueError, match="state reduction"):
        loopq_loss(logits, student, None, values, indices, teacher, mu, state_reduction="max")
