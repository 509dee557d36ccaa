"""The baselines as configs of the framework: function preservation on all three architectures, SmoothQuant's scales,
QuaRot's fixed rotations and gamma fold, SpinQuant's Cayley factors, config errors, and the student round trip."""

import json

import pytest
import torch

from loopq.artifacts import load_student, write_student
from loopq.artifacts.layout import STUDENT_FORMAT as FORMAT
from loopq.models import load_looplm
from loopq.quant import QuantConfig, QuantConfigError, init_diagonal_from_data, prepare, quant_groups
from loopq.quant.baselines import input_absmax, smooth_scales, weight_absmax
from loopq.quant.config import METHODS
from loopq.quant.prepare import GROUP_SETUPS, prepare_static
from loopq.quant.transforms import CayleyFactor, FixedFactor, cayley

ARCHS = {"ouro": "ouro-tiny", "loopformer": "loopformer-tiny", "parcae": "parcae-tiny"}
STATIC = ("rtn", "smoothquant", "quarot")
BASELINES = ("rtn", "smoothquant", "quarot", "spinquant", "flatquant")


@pytest.fixture(scope="module", params=sorted(ARCHS))
def teacher(request, fixtures):
    return load_looplm(fixtures / ARCHS[request.param])


def ids_for(model, seed=0, length=16, batch=2):
    vocab = model.lm_head.weight.shape[0]
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(model, ids):
    with torch.no_grad():
        return model(ids, return_trajectory=True)


def build(teacher, method, w_bits=16, a_bits=16, ids=None):
    config = QuantConfig.of_method(method, w_bits, a_bits, group_size=32)
    if method in STATIC:
        return prepare_static(teacher, config, ids_for(teacher, seed=5) if ids is None else ids)
    return prepare(teacher, config)


def perturb_learnable(student, seed=0):
    """Move every learnable transform away from its start (SpinQuant's skew parameters, FlatQuant's factors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for group in quant_groups(student).values():
            if group.transform is None:
                continue
            for factor in (group.transform.left, group.transform.right):
                for p in factor.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.mark.parametrize("method", BASELINES)
def test_function_preserved_with_quantization_off(teacher, method):
    student = build(teacher, method)
    perturb_learnable(student)
    ids = ids_for(teacher)
    ref, out = run(teacher, ids), run(student, ids)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.loop_states, ref.loop_states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert student.transition is None  # no CTA in any baseline
    assert all(g.act_clip.numel() == 1 for g in quant_groups(student).values())  # no LAS


def test_every_method_has_a_group_setup():
    assert set(GROUP_SETUPS) == set(METHODS)


@pytest.mark.parametrize("method", STATIC)
def test_training_free_baselines_are_frozen_and_quantize(teacher, method):
    student = build(teacher, method, 4, 4)
    assert not [n for n, p in student.named_parameters() if p.requires_grad]
    ids = ids_for(teacher)
    out, ref = run(student, ids).logits, run(teacher, ids).logits
    assert torch.isfinite(out).all() and not torch.allclose(out, ref)


# ---------------------------------------------------------------------------------------------------- SmoothQuant
def test_smooth_scales_by_hand():
    act, weight = torch.tensor([4.0, 1.0, 9.0, 2.0]), torch.tensor([1.0, 4.0, 0.25, 0.0])
    # alpha = 0.5: sqrt(a) / sqrt(w); the zero weight column is floored at 1e-5
    want = torch.tensor([2.0, 0.5, 6.0, 2**0.5 / 1e-5**0.5])
    torch.testing.assert_close(smooth_scales(act, weight, 0.5), want)
    # alpha = 1: s = max|X| (all difficulty to the weights); alpha = 0: s = 1 / max|W|
    torch.testing.assert_close(smooth_scales(act, weight, 1.0), act)
    torch.testing.assert_close(smooth_scales(act[:3], weight[:3], 0.0), 1 / weight[:3])
    assert float(smooth_scales(torch.zeros(1), torch.ones(1), 0.5)) == pytest.approx(1e-5)  # dead channel: floor


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothing_balances_activation_and_weight_ranges(teacher, alpha):
    """After smoothing: max|X_j / s_j| = (a_j w_j)^(1 - alpha), max|W_j s_j| = (a_j w_j)^alpha (equal at 0.5)."""
    ids = ids_for(teacher, seed=5)
    config = QuantConfig.smoothquant(16, 16, alpha=alpha)
    student = prepare_static(teacher, config, ids)
    groups = quant_groups(student)
    act = input_absmax(teacher, ids, list(groups))
    for name, group in groups.items():
        d = group.transform.log_d.exp()
        a, w = act[name], weight_absmax(group)
        live = (a > 1e-3) & (w > 1e-3)
        x_range = (a / d)[live]
        w_range = torch.cat([wt.abs() * d for wt in group.weights()]).amax(dim=0)[live]
        product = (a * w)[live]
        torch.testing.assert_close(x_range, product.pow(1 - alpha), rtol=1e-4, atol=0)
        torch.testing.assert_close(w_range, product.pow(alpha), rtol=1e-4, atol=0)
        if alpha == 0.5:
            torch.testing.assert_close(x_range, w_range, rtol=1e-4, atol=0)
        assert isinstance(group.transform.left, FixedFactor)
        assert torch.equal(group.transform.left.matrix(), torch.eye(group.transform.left.r.shape[0]))


def test_activation_maxima_cover_every_loop(fixtures):
    """max|X_j| of a looped group is the maximum over its calls in all loops, not the last loop's."""
    teacher = load_looplm(fixtures / "ouro-tiny")
    ids = ids_for(teacher)
    name = "model.layers.0.self_attn.qkv_proj"
    per_call = []
    hook = teacher.get_submodule(name).register_forward_pre_hook(
        lambda m, args: per_call.append(args[0].abs().amax(dim=(0, 1)))
    )
    run(teacher, ids)
    hook.remove()
    assert len(per_call) == teacher.default_num_loops
    torch.testing.assert_close(input_absmax(teacher, ids, [name])[name], torch.stack(per_call).amax(dim=0))
    assert not torch.equal(per_call[-1], torch.stack(per_call).amax(dim=0))


# ---------------------------------------------------------------------------------------------------- QuaRot
def test_quarot_rotates_with_hadamards_and_folds_the_feeding_norm(teacher):
    student = build(teacher, "quarot", 4, 4)
    folded = 0
    for name, group in quant_groups(student).items():
        tr = group.transform
        for factor in (tr.left, tr.right):
            r = factor.matrix()
            assert isinstance(factor, FixedFactor)
            torch.testing.assert_close(r @ r.T, torch.eye(r.shape[0]), atol=1e-5, rtol=0)
        norm = teacher.feeding_norm(name)
        want = torch.zeros(group.in_features) if norm is None else norm.weight.detach().log()
        torch.testing.assert_close(tr.log_d, want)
        folded += norm is not None
    assert folded == 0 if teacher.arch == "loopformer" else folded > 0  # LoopFormer's norms have no weight


def test_quarot_activation_is_the_rotated_normalised_input(fixtures):
    """For a norm-fed group, (x / gamma) (P1 (x) P2) with x = gamma * rms(h): the rotation of the normalised h."""
    teacher = load_looplm(fixtures / "ouro-tiny")
    group = quant_groups(build(teacher, "quarot", 4, 4))["model.layers.0.self_attn.qkv_proj"]
    norm = teacher.get_submodule("model.layers.0.input_layernorm")
    h = torch.randn(3, group.in_features, generator=torch.Generator().manual_seed(0))
    tr = group.transform
    got = tr.activation(norm(h), *tr.matrices()[:2])
    normalised = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    want = normalised @ torch.kron(tr.left.matrix(), tr.right.matrix())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_quarot_is_deterministic_in_the_seed(fixtures):
    teacher = load_looplm(fixtures / "ouro-tiny")
    ids = ids_for(teacher)
    a, b = build(teacher, "quarot", 4, 4, ids), build(teacher, "quarot", 4, 4, ids)
    assert torch.equal(run(a, ids).logits, run(b, ids).logits)
    other = prepare_static(teacher, QuantConfig.of_method("quarot", 4, 4, seed=1), ids)
    assert not torch.equal(run(other, ids).logits, run(a, ids).logits)


# ---------------------------------------------------------------------------------------------------- SpinQuant
def test_cayley_factor_is_orthogonal_starts_at_its_base_and_learns():
    gen = torch.Generator().manual_seed(0)
    base = torch.linalg.qr(torch.randn(12, 12, generator=gen))[0]
    factor = CayleyFactor(base)
    r, r_inv = factor.matrix_and_inverse()
    assert torch.equal(r, base @ torch.eye(12)) and torch.equal(r_inv, r.T)
    with torch.no_grad():
        factor.skew.copy_(torch.randn(12, 12, generator=gen))
    r, r_inv = factor.matrix_and_inverse()
    torch.testing.assert_close(r @ r.T, torch.eye(12), atol=1e-5, rtol=0)
    torch.testing.assert_close(r @ r_inv, torch.eye(12), atol=1e-5, rtol=0)
    assert not torch.allclose(r, base, atol=1e-2)
    x = torch.randn(4, 12, generator=gen)
    (x @ factor.matrix()).pow(3).sum().backward()
    assert factor.skew.grad is not None and factor.skew.grad.abs().sum() > 0
    assert not any(b.requires_grad for b in factor.buffers())


def test_cayley_transform_by_hand():
    """A = [[0, -a], [a, 0]]: Cayley(A) is the rotation by theta with tan(theta / 2) = a."""
    a = 0.5
    got = cayley(torch.tensor([[0.0, -a], [a, 0.0]], dtype=torch.float64))
    theta = 2 * torch.atan(torch.tensor(a, dtype=torch.float64))
    want = torch.stack([torch.stack([theta.cos(), -theta.sin()]), torch.stack([theta.sin(), theta.cos()])])
    torch.testing.assert_close(got, want)


def test_spinquant_starts_at_quarot_and_learns_only_rotations_and_clips(fixtures):
    teacher = load_looplm(fixtures / "ouro-tiny")
    ids = ids_for(teacher)
    spin = prepare(teacher, QuantConfig.spinquant(4, 4))
    quarot = prepare(teacher, QuantConfig.quarot(4, 4))  # the same seed: the same Hadamards and signs
    for name, group in quant_groups(spin).items():
        other = quant_groups(quarot)[name].transform
        assert torch.equal(group.transform.left.matrix(), other.left.matrix())
        assert torch.equal(group.transform.log_d, other.log_d)
    trainable = [n for n, p in spin.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("skew", "clip")) for n in trainable)
    loss = run(spin, ids).logits.sum()  # the forward graph reaches every trainable parameter
    assert torch.isfinite(loss)
    with torch.enable_grad():
        spin(ids).logits.pow(2).mean().backward()
    assert all(p.grad is not None for p in spin.parameters() if p.requires_grad)


def test_spinquant_student_round_trip(fixtures, tmp_path):
    """The frozen Hadamard bases are rebuilt from the seed when a saved student is loaded."""
    teacher_dir = fixtures / "parcae-tiny"
    teacher = load_looplm(teacher_dir)
    student = prepare(teacher, QuantConfig.spinquant(4, 8))
    perturb_learnable(student, seed=2)
    meta = {"format": FORMAT, "teacher": str(teacher_dir), "arch": teacher.arch, "promoted": []}
    meta |= {"quant": student.quant_config.to_dict(), "calibrated_loops": student.calibrated_loops, "mu": []}
    write_student(student, meta, tmp_path)
    loaded, _ = load_student(tmp_path)
    ids = ids_for(teacher)
    assert torch.equal(run(loaded, ids).logits, run(student.eval(), ids).logits)


# ---------------------------------------------------------------------------------------------------- config
def test_unknown_method_is_a_one_line_error_naming_the_key():
    for make in (lambda: QuantConfig(method="gptq"), lambda: QuantConfig.from_dict({"method": "gptq"})):
        with pytest.raises(QuantConfigError, match=r"^quant.method='gptq' is not a method; use one of") as err:
            make()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("method", "key", "value"),
    [("quarot", "las", True), ("spinquant", "cta", True), ("flatquant", "slt_budget", 2), ("rtn", "transforms", True)],
)
def test_a_setting_that_contradicts_the_method_is_named(method, key, value):
    with pytest.raises(QuantConfigError, match=rf"quant.{key}={value!r} contradicts quant.method='{method}'"):
        QuantConfig.from_dict({**QuantConfig.of_method(method).to_dict(), key: value})


def test_smooth_alpha_range_and_constructors():
    with pytest.raises(QuantConfigError, match=r"quant\.smooth_alpha=1\.5"):
        QuantConfig.smoothquant(alpha=1.5)
    assert QuantConfig.rtn().method == "rtn" and not QuantConfig.rtn().transforms
    for method in BASELINES:
        config = getattr(QuantConfig, method)(4, 8)
        assert (config.method, config.a_bits, config.las, config.slt_budget, config.cta) == (method, 8, False, 0, False)
        assert QuantConfig.from_dict(config.to_dict()) == config
    assert QuantConfig.from_dict({"w_bits": 4}).method == "loopq"  # student JSONs written before `method` existed


def test_prepare_static_rejects_trained_methods(fixtures):
    teacher = load_looplm(fixtures / "ouro-tiny")
    with pytest.raises(QuantConfigError, match=r"quant.method='spinquant' is calibrated by training"):
        prepare_static(teacher, QuantConfig.spinquant(), ids_for(teacher))


# ------------------------------------------------------------------------------- FlatQuant's diagonal start
@pytest.mark.parametrize("method", ["loopq", "flatquant"])
def test_smooth_diagonal_start_preserves_function_and_follows_smoothquant(teacher, method):
    """``quant.diag_init: smooth`` (FlatQuant's sq_style): d_j = a_j^alpha / w_j^(1 - alpha) from the teacher's
    maxima over all loops, a_j floored at a tenth of the group's median; with quantization off the student still
    equals the teacher, also on inputs other than the calibration batch (Parcae's ReLU^2 MLP has channels silent
    on it: unfloored, d = 1e-5 there breaks this by 0.2 in the logits)."""
    ids = ids_for(teacher, seed=5)
    student = prepare(teacher, QuantConfig.of_method(method, 16, 16, diag_alpha=0.3))
    groups = quant_groups(student)
    assert set(init_diagonal_from_data(teacher, student, ids, 0.3)) == set(groups)
    act = input_absmax(teacher, ids, list(groups))
    for name, group in groups.items():
        a, w = act[name].clamp_min(0.1 * act[name].median()), weight_absmax(group)
        torch.testing.assert_close(group.transform.log_d.exp(), (a**0.3 / w**0.7).clamp_min(1e-5), rtol=1e-5, atol=0)
    ref, out = run(teacher, ids_for(teacher)), run(student, ids_for(teacher))
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_smooth_diagonal_start_leaves_frozen_diagonals(fixtures):
    """SpinQuant's diagonal is QuaRot's frozen gamma fold: the data-dependent start must not touch it."""
    teacher = load_looplm(fixtures / "ouro-tiny")
    student = prepare(teacher, QuantConfig.spinquant())
    before = {n: g.transform.log_d.clone() for n, g in quant_groups(student).items()}
    assert init_diagonal_from_data(teacher, student, ids_for(teacher), 0.3) == []
    assert all(torch.equal(g.transform.log_d, before[n]) for n, g in quant_groups(student).items())


def test_smooth_diagonal_divides_the_stress_teachers_outlier_channels():
    """On the stress teacher (four residual channels x32) the start divides exactly those channels most: they are
    the largest d of the groups fed by a norm."""
    from loopq.paths import REPO_ROOT

    stress = REPO_ROOT / "loopq/assets/tiny-ouro-outliers"
    teacher = load_looplm(stress)
    channels = sorted(json.loads((stress / "testbed.json").read_text())["outliers"]["channels"])
    student = prepare(teacher, QuantConfig())
    ids = ids_for(teacher, length=64, batch=4)
    init_diagonal_from_data(teacher, student, ids, 0.3)
    fed_by_norm = [n for n in quant_groups(student) if teacher.feeding_norm(n) is not None]
    assert fed_by_norm
    for name in fed_by_norm:
        d = quant_groups(student)[name].transform.log_d.exp()
        assert sorted(d.topk(len(channels)).indices.tolist()) == channels, name


def test_diag_init_is_validated_by_key():
    with pytest.raises(QuantConfigError, match=r"quant\.diag_init='sq_style': use one of \('ones', 'smooth'\)"):
        QuantConfig(diag_init="sq_style")
    with pytest.raises(QuantConfigError, match=r"quant\.diag_alpha=-0\.1 must be in \[0, 1\]"):
        QuantConfig(diag_alpha=-0.1)
