"""The fake-quant student on all three architectures: function preservation, LAS, SLT promotion, CTA, counts."""

import copy

import pytest
import torch
from safetensors.torch import save_file

from loopq.artifacts.student import quant_state
from loopq.calib.slt import loop_gradients, recording, shared_inverses
from loopq.models import load_looplm
from loopq.models.ouro import OuroConfig, OuroLM
from loopq.quant import (
    GroupOptions,
    QuantConfig,
    QuantConfigError,
    init_clipping_from_data,
    looped_quant_groups,
    prepare,
    quant_groups,
)
from loopq.quant.accounting import parameter_report
from loopq.quant.cta import TransitionAdapters, transition_adapter
from loopq.quant.sharing_gap import SharingGapAccumulator, sharing_gap

ARCHS = {"ouro": "ouro-tiny", "loopformer": "loopformer-tiny", "parcae": "parcae-tiny"}
FP = {"w_bits": 16, "a_bits": 16}


def ids_for(model, seed=0, length=16):
    vocab = model.native_state_dict()[next(k for k in model.native_state_dict() if "wte" in k or "embed" in k)]
    return torch.randint(0, vocab.shape[0], (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def teacher(request, fixtures):
    return load_looplm(fixtures / ARCHS[request.param])


def run(model, ids):
    with torch.no_grad():
        return model(ids, return_trajectory=True)


def test_function_preserved_with_random_transforms_and_cta(teacher):
    ids = ids_for(teacher)
    student = prepare(teacher, QuantConfig(**FP, transform_init="random", cta=True))
    ref, out = run(teacher, ids), run(student, ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.loop_states, ref.loop_states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert len(quant_groups(student)) == len(teacher.linear_groups())


def test_teacher_is_untouched_and_frozen(teacher):
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = prepare(teacher, QuantConfig())
    assert all(isinstance(m, torch.nn.Module) for m in teacher.linear_groups().values())
    assert not quant_groups(teacher)
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    trainable = [n for n, p in student.named_parameters() if p.requires_grad]
    assert trainable and all(("transform" in n or "clip" in n or n.startswith("transition")) for n in trainable)


def test_w4a4_is_finite_and_las_scales_differ_per_loop(teacher):
    ids = ids_for(teacher)
    student = prepare(teacher, QuantConfig(w_bits=4, a_bits=4, group_size=16, cta=False))
    out = run(student, ids)
    assert torch.isfinite(out.logits).all()
    err = (out.logits - run(teacher, ids).logits).abs().mean()
    assert err > 0
    chosen = init_clipping_from_data(student, ids)
    looped = set(looped_quant_groups(student))
    per_loop = [r for name, r in chosen.items() if name in looped]
    assert per_loop and all(len(r) == teacher.default_num_loops for r in per_loop)
    assert any(len(set(r)) > 1 for r in per_loop), "LAS init should give loop-dependent clipping somewhere"
    assert torch.isfinite(run(student, ids).logits).all()


def test_promotion_leaves_output_unchanged(teacher):
    ids = ids_for(teacher)
    student = prepare(teacher, QuantConfig(w_bits=4, a_bits=4, group_size=16, transform_init="random"))
    name = next(iter(looped_quant_groups(student)))
    group = quant_groups(student)[name]
    before = run(student, ids).logits
    params = [id(p) for p in student.parameters()]
    group.promote()
    assert group.promoted and [id(p) for p in student.parameters()] == params  # the layout is fixed
    assert all(p.requires_grad for p in group.promotion_parameters())
    torch.testing.assert_close(run(student, ids).logits, before, atol=0, rtol=0)
    with torch.no_grad():  # the per-loop copies are now independent
        group.loop_transforms[0].left.log_s.add_(0.1)
    assert not torch.equal(run(student, ids).logits, before)


def test_a_promoted_groups_unused_shared_parameters_are_stored_at_their_promotion_values(teacher, tmp_path):
    """The shared parameters of a promoted group drift under AdamW's zero-gradient momentum steps (differently per
    strategy and across a ZeRO-3 resume); a student stores the values the group was promoted with, and computes the
    same with them."""
    ids = ids_for(teacher)
    student = prepare(teacher, QuantConfig(w_bits=4, a_bits=4, group_size=16, transform_init="random"))
    name = next(iter(looped_quant_groups(student)))
    group = quant_groups(student)[name]
    promoted_with = {
        k: v.detach().clone() for k, v in group.named_parameters() if k.startswith(("transform.", "weight"))
    }
    group.promote()
    with torch.no_grad():  # the drift: every shared parameter moves, the output does not
        before = run(student, ids).logits
        for p in group.shared_parameters():
            p.add_(0.25)
        torch.testing.assert_close(run(student, ids).logits, before, atol=0, rtol=0)
    state = quant_state(student)
    save_file(state, str(tmp_path / "student.safetensors"))  # distinct storages (safetensors refuses shared ones)
    for key, value in promoted_with.items():
        assert torch.equal(state[f"{name}.{key}"], value), key
    other = list(looped_quant_groups(student))[1] + "."  # unpromoted: stored as trained
    assert all(torch.equal(state[k], p.detach()) for k, p in student.named_parameters() if k.startswith(other))
    fresh = prepare(teacher, QuantConfig(w_bits=4, a_bits=4, group_size=16, transform_init="random"))
    fresh.load_state_dict(state, strict=False)
    torch.testing.assert_close(run(fresh, ids).logits, before, atol=0, rtol=0)


def test_non_looped_groups_cannot_be_promoted(fixtures):
    student = prepare(load_looplm(fixtures / "parcae-tiny"), QuantConfig())
    outside = [n for n in quant_groups(student) if n not in set(looped_quant_groups(student))]
    assert outside, "Parcae has prelude/coda groups outside the loop"
    with pytest.raises(ValueError, match="only groups inside the loop"):
        quant_groups(student)[outside[0]].promote()


def test_parameter_counts_have_no_kronecker_or_per_loop_weight_copies(teacher):
    cfg = QuantConfig(w_bits=4, a_bits=4, group_size=16, cta=True, cta_rank=8)
    student = prepare(teacher, cfg)
    T = teacher.default_num_loops
    for name, group in quant_groups(student).items():
        n1 = group.transform.left.log_s.numel()
        n2 = group.transform.right.log_s.numel()
        n = group.in_features
        assert n1 * n2 == n
        expected = 2 * n1 * n1 + n1 + 2 * n2 * n2 + n2 + n  # two factors (U, V, s) + diagonal
        assert sum(p.numel() for p in group.transform.parameters()) == expected < n * n
        assert all(
            b.data_ptr() == w.data_ptr() for b, w in zip(group.weights(), _teacher_weights(teacher, name), strict=True)
        )
    report = parameter_report(student)
    las = T * len(looped_quant_groups(student))  # one c_{t,l} per loop; groups outside the loop are shared
    dim = teacher.state_dim
    assert report.loop_dependent == las + (T - 1) * (2 * dim + 8)
    assert report.model == sum(p.numel() for p in teacher.parameters())
    group = quant_groups(student)[next(iter(looped_quant_groups(student)))]
    shared_before = report.shared
    group.promote()
    after = parameter_report(student)
    moved = sum(p.numel() for p in group.transform.parameters()) + group.weight_clip.numel()
    assert after.shared == shared_before - moved
    assert after.loop_dependent == report.loop_dependent + T * moved


def test_weight_scales_are_counted_per_slot(teacher):
    """By hand: a W4 group of weights [N_i, K] stores N_i K / 32 group scales per slot; promoting it stores T sets."""
    student = prepare(teacher, QuantConfig(w_bits=4, a_bits=4, group_size=32, slt_budget=1))
    per_group = {n: sum(w.numel() // 32 for w in g.weights()) for n, g in quant_groups(student).items()}
    assert parameter_report(student).weight_scales == sum(per_group.values())
    name = next(iter(looped_quant_groups(student)))
    quant_groups(student)[name].promote()
    T = student.calibrated_loops
    assert parameter_report(student).weight_scales == sum(per_group.values()) + (T - 1) * per_group[name]


@pytest.mark.parametrize(("layers", "paper", "tolerance"), [(24, 40.65e6, 0.005e6), (48, 82.16e6, 0.011 * 82.16e6)])
def test_table5_shared_column_of_the_paper(layers, paper, tolerance):
    """The paper's Table 5 (App. C) "Shared" column: 40.65M for Ouro-1.4B (24 layers), 82.16M for Ouro-2.6B (48),
    rebuilt on the meta device from the published shape. Its count is transforms + weight clips + group-32 weight
    scales (without CTA's U, V): 40,650,048 rounds to the paper's four digits; 2.6B comes out at 81.30M, 1.0 % under
    the paper's number (which we cannot reconcile further; the bound is that measured gap, not a fit)."""
    with torch.device("meta"):
        model = OuroLM(OuroConfig(num_hidden_layers=layers))
    report = parameter_report(prepare(model, QuantConfig(slt_budget=4)))
    assert report.cta_shared == 2 * 2048 * 8  # U, V at rank 8
    assert abs(report.table5_shared - paper) <= tolerance, report.as_dict()
    if layers == 24:
        assert report.table5_shared == 38_535_168 + 1_598_784 + 516_096  # scales + P1, P2, d + weight-clip rows


def _teacher_weights(teacher, name):
    return [lin.weight for lin in teacher.get_submodule(name).children()]


def test_bad_config_names_the_key(fixtures):
    with pytest.raises(QuantConfigError, match=r"quant.w_bits=5"):
        QuantConfig(w_bits=5)
    with pytest.raises(QuantConfigError, match=r"quant.a_bits"):
        QuantConfig(a_bits=2)
    with pytest.raises(QuantConfigError, match=r"quant.group_size=24 does not divide .* 64"):
        prepare(load_looplm(fixtures / "ouro-tiny"), QuantConfig(group_size=24))
    with pytest.raises(QuantConfigError, match="unknown keys"):
        QuantConfig.from_dict({"w_bit": 4})


def test_cta_by_hand():
    h = torch.tensor([[3.0, 4.0]])  # rms = sqrt(12.5)
    n = h / 12.5**0.5
    a, b = torch.tensor([2.0, 0.5]), torch.tensor([0.1, -0.1])
    u, v, eta = torch.tensor([[1.0], [0.0]]), torch.tensor([[1.0], [1.0]]), torch.tensor([0.5])
    got = transition_adapter(h, a, b, eta, u, v, eps=0.0)
    low_rank = 0.5 * (n[0, 0] + n[0, 1])  # (n V) * eta, then U^T puts it on feature 0
    want = h + (a - 1) * n + b + torch.stack([low_rank, torch.tensor(0.0)])
    torch.testing.assert_close(got, want)


def test_cta_is_identity_at_init_and_reuses_last_adapter():
    cta = TransitionAdapters(dim=8, num_loops=4, rank=2)
    h = torch.randn(3, 8)
    torch.testing.assert_close(cta(h, 0), h)
    with torch.no_grad():
        cta.b[2].fill_(1.0)
    torch.testing.assert_close(cta(h, 5), cta(h, 2))


def test_sharing_gap_by_hand():
    phi = torch.tensor([[1.0, 2.0], [3.0, 2.0]])  # T = 2 loops, J = 2 coordinates
    psi = torch.tensor([1.0, 4.0])
    # Var_t: coord 0 -> mean 2, E[phi^2] = 5 -> var 1; coord 1 -> var 0. S = 1 / (1 + eps)
    assert float(sharing_gap(phi, psi, eps=0.0)) == pytest.approx(1.0)
    acc = SharingGapAccumulator()
    acc.add(phi)
    acc.add(phi)
    # psi from the data: (sum_t phi)^2 = [16, 16]; S = 1 / 16
    assert acc.score(eps=0.0) == pytest.approx(1 / 16)


def test_probe_gradients_are_per_loop_parts_of_the_shared_gradient(fixtures):
    """sum_t phi_t is the gradient of the loss w.r.t. the shared P1 (through P1 on the activation side and through
    P1^-1 on the weight side: g_P - P^-T g_{P^-1} P^-T), read from an unprobed W4A4 forward; float64 so the two agree
    to rounding."""
    teacher = load_looplm(fixtures / "ouro-tiny", dtype=torch.float64)
    student = prepare(teacher, QuantConfig(transform_init="random", cta=False, las=False)).double().train()
    ids = ids_for(teacher)
    target = ids.roll(-1, dims=1)
    group = next(iter(looped_quant_groups(student).values()))

    def loss():
        return torch.nn.functional.cross_entropy(student(ids).logits.flatten(0, 1), target.flatten())

    shared = loss()
    p1, _, p1_inv, _ = group._slot_tensors(0).mats
    p1.retain_grad()
    p1_inv.retain_grad()
    shared.backward()
    expected = p1.grad - p1_inv.T @ p1_inv.grad @ p1_inv.T
    student.zero_grad()

    inverses = shared_inverses(group)
    with recording({"g": group}) as recorders:
        loss().backward()
    phi = loop_gradients(recorders["g"], inverses)
    n1 = p1.shape[0]
    assert phi.shape[0] == teacher.default_num_loops
    assert not torch.allclose(phi[0], phi[1]), "loops pull the shared transform differently"
    total = phi[:, : n1 * n1].sum(0).reshape(n1, n1)
    assert float(expected.abs().max()) > 1e-6, "the shared gradient must not vanish for the check to mean anything"
    torch.testing.assert_close(total, expected, rtol=1e-9, atol=1e-12)


def test_eval_cache_is_exact_and_follows_parameter_changes(fixtures):
    teacher = load_looplm(fixtures / "ouro-tiny")
    student = prepare(teacher, QuantConfig(w_bits=4, a_bits=4, group_size=16, transform_init="random")).eval()
    ids = ids_for(teacher)
    first = run(student, ids).logits
    group = next(iter(looped_quant_groups(student).values()))
    assert group._cache  # filled by the no-grad eval forward
    torch.testing.assert_close(run(student, ids).logits, first, atol=0, rtol=0)
    with torch.no_grad():
        group.transform.left.log_s.add_(0.2)  # an in-place change bumps the version: the cache cannot hide it
    changed = run(student, ids).logits
    assert not torch.equal(changed, first)
    uncached = copy.deepcopy(student)  # copies never carry the cache
    assert not next(iter(looped_quant_groups(uncached).values()))._cache
    group.promote()
    assert not group._cache
    state = {k: v.clone() for k, v in student.state_dict().items()}
    run(student, ids)
    student.load_state_dict(state)
    assert not group._cache


def _grads(student, ids, checkpoint_loops=False, hook=True):
    """Gradients of a trajectory-style loss on every trainable parameter (one forward + backward)."""
    student.zero_grad(set_to_none=True)
    student.checkpoint_loops = checkpoint_loops
    handles = student._forward_pre_hooks
    saved = dict(handles)
    if not hook:
        handles.clear()  # no per-forward cache: every loop recomputes transforms and weights
    try:
        out = student(ids, return_trajectory=True)
        loss = out.logits.float().pow(2).mean() + sum(s.float().pow(2).mean() for s in out.loop_states)
        loss.backward()
    finally:
        handles.update(saved)
    return {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHS)
def test_per_forward_cache_gives_the_uncached_gradients(fixtures, arch):
    teacher = load_looplm(fixtures / ARCHS[arch]).double()  # float64: summation order is not in the way
    config = QuantConfig(w_bits=4, a_bits=4, group_size=16, transform_init="random", slt_budget=1)
    student = prepare(teacher, config).train().double()
    next(iter(looped_quant_groups(student).values())).promote()  # one per-loop group, the rest shared
    ids = ids_for(teacher)
    reference = _grads(student, ids, hook=False)
    assert len(reference) > 10
    for ckpt in (False, True):
        cached = _grads(student, ids, checkpoint_loops=ckpt)
        assert cached.keys() == reference.keys()
        for name, grad in reference.items():
            torch.testing.assert_close(cached[name], grad, rtol=1e-9, atol=1e-10, msg=name)


def test_transforms_are_built_once_per_forward_not_per_loop(fixtures, monkeypatch):
    import loopq.quant.transforms as transforms

    calls = []
    original = transforms.orthogonal
    monkeypatch.setattr(transforms, "orthogonal", lambda a: calls.append(1) or original(a))
    teacher = load_looplm(fixtures / "ouro-tiny")
    student = prepare(teacher, QuantConfig(w_bits=4, a_bits=4, group_size=16, transform_init="random")).train()
    ids = ids_for(teacher)
    counts = {}
    for loops in (2, 4):
        calls.clear()
        student(ids, num_loops=loops).logits.sum().backward()
        counts[loops] = len(calls)
    # one Kronecker transform per group, two factors each, two orthogonal matrices (U, V) per factor
    assert counts[2] == counts[4] == 4 * len(quant_groups(student))
    # a second forward + backward with unchanged parameters (gradient accumulation) builds a fresh graph
    student(ids).logits.sum().backward()


def test_compiled_quantizers_match_eager(fixtures):
    """``model.compile_quantizers``: the torch.compile-d chains give the eager outputs and gradients (a fused
    reduction may sum in another order: the gradients agree to fp32 rounding, not bit for bit)."""
    teacher = load_looplm(fixtures / "ouro-tiny")
    config = QuantConfig(w_bits=4, a_bits=4, group_size=16, transform_init="random", slt_budget=1)
    student = prepare(teacher, config).train()
    next(iter(looped_quant_groups(student).values())).promote()
    ids = ids_for(teacher)
    eager = _grads(student, ids)
    eager_logits = student(ids).logits.detach()
    student = prepare(teacher, config, options=GroupOptions(compiled=True)).train()
    next(iter(looped_quant_groups(student).values())).promote()
    assert all(g.options.compiled for g in quant_groups(student).values())
    compiled = _grads(student, ids, checkpoint_loops=True)  # also through the per-loop recomputation
    torch.testing.assert_close(student(ids).logits.detach(), eager_logits, rtol=0, atol=1e-5)
    assert compiled.keys() == eager.keys()
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_las_init_of_a_bf16_teacher_scores_the_fp32_transform(monkeypatch):
    """LAS's clip initialisation scores what the training step and the export quantize: the transform of the input
    computed in fp32 - for a bf16 teacher too, whose transformed inputs used to come back rounded to bf16 (then every
    scored value was bf16-representable, as a review of session 25 found)."""
    import importlib

    from loopq.paths import ASSETS

    prepare_module = importlib.import_module("loopq.quant.prepare")  # (the package's ``prepare`` is the function)
    teacher = load_looplm(ASSETS / "tiny-ouro", dtype=torch.bfloat16)
    student = prepare(teacher, QuantConfig(transform_init="random"))
    scored: list[torch.Tensor] = []
    real = prepare_module.clip_errors

    def spy(x: torch.Tensor, *args, **kwargs):
        scored.append(x.detach().clone())
        return real(x, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "clip_errors", spy)
    init_clipping_from_data(student, torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0)))
    assert scored and all(x.dtype == torch.float32 for x in scored)
    off_grid = [bool((x != x.bfloat16().float()).any()) for x in scored]
    assert all(off_grid), f"{off_grid.count(False)} of {len(scored)} scored inputs were bf16-rounded"
