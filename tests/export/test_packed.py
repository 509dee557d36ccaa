"""PackedLinearGroup against the fake-quant group: integer codes, teacher-forced outputs, backends, bad shapes.

Tolerances (teacher-forced: both groups see the student's own recorded inputs):

* weight codes: *equal* to ``quantize_codes`` of the student's effective weight folded in float64 (here with an
  independent Kronecker inverse); against the student's fp32 effective weight at most a 1e-4 fraction may move by
  1 (near-ties of the fp32 fold; measured over the six fixture students: 0 or 1 code per model, <= 5e-6);
* activation codes: at most a 1e-3 fraction may move by 1 - the kernel's transform sums in a fixed order, the
  student's ``kron_apply`` in BLAS order, so an exact tie can round the other way (measured: 0-2 codes in 2e5-5e5
  per forward, all W4A8);
* outputs (where no activation code moved): |out - ref| <= 2^-11 sum_k |xq_k wq_k| elementwise - the fp16 rounding
  of the weight scales (relative error <= 2^-11 each) is the only difference left (relative L2 measured 2e-4 to
  4e-3: the bound is on the sum of magnitudes, not on the possibly cancelling sum).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from loopq.artifacts import load_quantized
from loopq.kernels import decode_kernel, gemm_kernel, quantize_activation, triton_interpreted, unpack_int4
from loopq.kernels.packing import interleave_groups, untile_weight
from loopq.kernels.reference import gemm_fp64
from loopq.models import load_looplm
from loopq.models.base import LinearGroup, rms_norm
from loopq.qspec import quantize_codes
from loopq.quant import QuantConfig, quant_groups
from loopq.quant.modules import QuantLinearGroup
from loopq.quant.packed import ExportError, FoldedNorm, PackedLinearGroup, concat_bias, fold_weight, norm_unfolded
from loopq.quant.primitives import fake_quant
from loopq.quant.transforms import KroneckerTransform


def kronecker_fold(group: QuantLinearGroup, slot: int) -> torch.Tensor:
    """W' = (W * d) P^{-T} with P = kron(P1, P2) materialised and inverted numerically, in float64."""
    tr = copy.deepcopy(group.transform_for(slot)).double()
    with torch.no_grad():
        p = torch.kron(tr.left.matrix(), tr.right.matrix())
        w = torch.cat(group.weights()).double() * tr.log_d.exp()
        return (w @ torch.linalg.inv(p).T).float()


def record_inputs(student) -> tuple[dict[str, list], list]:
    """Hooks recording every group call ``(x, t)`` of the next student forwards, by group name (remove after)."""
    calls: dict[str, list] = {name: [] for name in quant_groups(student)}
    hooks = [
        g.register_forward_pre_hook(
            lambda m, args, n=name: calls[n].append((args[0], args[1] if len(args) > 1 else None))
        )
        for name, g in quant_groups(student).items()
    ]
    return calls, hooks


def test_weight_codes_are_the_students_codes(exported):
    moved = total = 0
    for name, group in quant_groups(exported.student).items():
        packed = exported.model.get_submodule(name)
        for slot in range(packed.spec.weight_slots):
            clip = group.weight_clip_ratio(slot)
            codes, scales = quantize_codes(kronecker_fold(group, slot), 4, 32, clip)
            n, k = codes.shape
            w_packed, w_scales = untile_weight(packed.weight[slot], packed.weight_scale[slot], n, k)
            assert torch.equal(unpack_int4(w_packed), codes), (name, slot)
            assert torch.equal(w_scales, scales.half()), (name, slot)
            with torch.no_grad():
                fp32_codes, _ = quantize_codes(group.effective_weight_fp(slot), 4, 32, clip)
            diff = (fp32_codes.int() - codes.int()).abs()
            assert int(diff.max()) <= 1
            moved, total = moved + int((diff > 0).sum()), total + diff.numel()
    assert moved <= 1e-4 * total


def test_activation_side_is_the_students(exported):
    for name, group in quant_groups(exported.student).items():
        packed = exported.model.get_submodule(name)
        for slot in range(packed.spec.transform_slots):
            tr = group.transform_for(slot)
            p1, p2, _, _ = tr.matrices()
            assert torch.equal(packed.left[slot], p1) and torch.equal(packed.right[slot], p2)
            assert torch.equal(packed.inv_d[slot], (-tr.log_d).exp())
        clips = [group.act_clip_ratio(s) for s in range(packed.spec.act_slots)]
        assert torch.equal(packed.act_clip, torch.stack(clips))


def test_teacher_forced_codes_and_outputs(exported):
    calls, hooks = record_inputs(exported.student)
    with torch.no_grad():
        exported.student(exported.ids())
    for h in hooks:
        h.remove()
    moved = total = 0
    for name, group in quant_groups(exported.student).items():
        packed = exported.model.get_submodule(name)
        for x, t in calls[name]:  # the student's group inputs: the norm's output, where a norm is folded
            with torch.no_grad(), norm_unfolded(packed):
                diff = activation_code_moves(group, packed, x, t)
                assert int(diff.max()) <= 1, (name, t)
                moved, total = moved + int((diff > 0).sum()), total + diff.numel()
                if not diff.any():
                    assert_within_fp16_scale_error(group, packed, x, t)
    assert moved <= 1e-3 * total


def activation_code_moves(group: QuantLinearGroup, packed: PackedLinearGroup, x: torch.Tensor, t: int | None):
    """|kernel code - student code| of every activation element of one call."""
    slot = group.slot(t)
    tr = group.transform_for(slot)
    p1, p2, _, _ = tr.matrices()
    want, _ = quantize_codes(tr.activation(x, p1, p2), group.a_bits, 32, group.act_clip_ratio(slot))
    flat = x.reshape(-1, group.in_features)
    flat = flat if packed.inv_d is None else flat * _at(packed.inv_d, slot)
    left, right, clip = _at(packed.left, slot), _at(packed.right, slot), float(_at(packed.act_clip, slot))
    codes, _ = quantize_activation(flat, left, right, clip, group.a_bits)
    got = unpack_int4(codes) if group.a_bits == 4 else codes
    return (got.int() - want.reshape(got.shape).int()).abs()


def assert_within_fp16_scale_error(group, packed, x, t):
    """With the same codes on both sides (weights folded in float64, as exported), the only difference left is the
    fp16 rounding of the weight scales: |out - ref| <= 2^-11 sum_k |xq_k wq_k|."""
    slot = group.slot(t)
    xq = group.quantized_input(x, slot)
    weight = fold_weight(torch.cat(group.weights()), group.transform_for(slot))
    wq = fake_quant(weight, 4, 32, group.weight_clip_ratio(slot))
    bias = concat_bias(group)
    ref, out = xq @ wq.T + (0 if bias is None else bias), torch.cat(packed(x, t), -1)
    bound = 2**-11 * (xq.abs() @ wq.abs().T)
    assert ((out - ref).abs() <= bound * 1.01 + 1e-6).all()


def _at(per_slot: torch.Tensor, slot: int) -> torch.Tensor:
    return per_slot[min(slot, per_slot.shape[0] - 1)]


@pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
def test_triton_backend_matches_torch_backend(exported, monkeypatch):
    """A group call of 17 tokens runs the prefill tile kernel: the same activation codes and scales as the torch
    backend (the quantizer is bit-exact), and a GEMM within ``gemm_fp64``'s fp32 bound of those codes (the tile
    kernel sums several groups per step with FMA, so it is not bit-exact); the outputs then agree to a few ulps."""
    name = exported.meta["promoted"][0]
    packed = exported.model.get_submodule(name)
    x = torch.randn(17, packed.spec.in_features, generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(gemm_kernel, "gemm", _checked(gemm_kernel.gemm, calls))
    with torch.no_grad():
        want = packed(x, 1)
        packed.backend = "triton"
        try:
            got = packed(x, 1)
        finally:
            packed.backend = None
    assert [m for m, _ in calls] == [17] and all(ok for _, ok in calls)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _checked(gemm, calls: list):
    """The prefill ``gemm`` recording (M, whether its bias-free fp32 output is within ``gemm_fp64``'s bound of its
    codes) per call; it returns the kernel's own output with the bias and the output dtype."""

    def run(a, sa, w, sw, out_dtype, a_int4, bias=None):
        out = gemm(a, sa, w, sw, torch.float32, a_int4)
        ref, bound = gemm_fp64(unpack_int4(a) if a_int4 else a, sa, unpack_int4(w), sw)
        calls.append((a.shape[0], bool(((out.double() - ref).abs() <= bound).all())))
        return gemm(a, sa, w, sw, out_dtype, a_int4, bias=bias)

    return run


def _checked_decode(gemm_tiled, calls: list):
    """The decode GEMM recording (M, whether its bias-free output is within ``gemm_fp64``'s bound) per call."""

    def run(a, sa, w, sw, n, out_dtype, bias=None):
        out = gemm_tiled(a, sa, w, sw, n, torch.float32)
        w_packed, w_scales = untile_weight(w, sw, n, a.shape[1])
        ref, bound = gemm_fp64(interleave_groups(a), sa, unpack_int4(w_packed), w_scales)
        calls.append((a.shape[0], bool(((out.double() - ref).abs() <= bound).all())))
        return (out if bias is None else out + bias).to(out_dtype)

    return run


@pytest.mark.slow  # the interpreter runs the 48 decode GEMMs of two whole-model forwards: ~40 s on 2 shared cores
@pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
def test_decode_forward_within_the_bound(exported, monkeypatch):
    """Whole-model forwards of 4 tokens and of 1 token on the Triton backend's decode GEMM (the export
    layout, int8 codes in the decode order): every GEMM the exported model issues is within ``gemm_fp64``'s fp32
    bound of its codes (the kernels' contract; the logits are not compared, since a rounding difference may move a
    later activation code). Ouro only."""
    if exported.arch != "ouro":
        pytest.skip("one architecture suffices: the GEMM calls are the same kernels")
    calls = []
    monkeypatch.setattr(decode_kernel, "gemm_tiled", _checked_decode(decode_kernel.gemm_tiled, calls))
    ids = exported.ids(length=4)
    for tokens in (ids[:1], ids[:1, :1]):
        _set_backend(exported.model, "triton")
        try:
            with torch.no_grad():
                assert torch.isfinite(exported.model(tokens).logits).all()
        finally:
            _set_backend(exported.model, None)
    assert {m for m, _ in calls} == {4, 1} and all(ok for _, ok in calls)


def _set_backend(model: nn.Module, backend: str | None) -> None:
    for module in model.modules():
        if isinstance(module, PackedLinearGroup):
            module.backend = backend


def test_fold_preserves_the_function_without_quantization():
    gen = torch.Generator().manual_seed(0)
    tr = KroneckerTransform(96)
    tr.randomize_(gen)
    w, x = torch.randn(40, 96, generator=gen), torch.randn(5, 96, generator=gen)
    with torch.no_grad():
        p1, p2, _, _ = tr.matrices()
        y = tr.activation(x, p1, p2) @ fold_weight(w, tr).T
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_bits", [4, 8])
@pytest.mark.parametrize(
    "switches",
    [{}, {"diag_scale": False}, {"transforms": False}, {"las": False}],
    ids=["full", "no-d", "no-P", "no-las"],
)
def test_group_variants_with_bias(switches, a_bits):
    """Biases on some linears, no diagonal, no transform, one shared activation clip; inside and outside the loop."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        linears = LinearGroup(a=nn.Linear(64, 48), b=nn.Linear(64, 16, bias=False), c=nn.Linear(64, 8))
    config = QuantConfig(a_bits=a_bits, **switches)
    for looped in (True, False):
        group = QuantLinearGroup(linears, config, num_loops=3, looped=looped)
        if group.transform is not None:
            group.transform.randomize_(gen)
        with torch.no_grad():
            group.act_clip.copy_(torch.randn(group.act_clip.shape, generator=gen) + 2)
        packed = PackedLinearGroup.from_quant_group(group)
        assert packed.spec.act_slots == (3 if looped and config.las else 1)
        x = torch.randn(3, 5, 64, generator=gen)
        for t in (0, 2, 4) if looped else (None,):
            with torch.no_grad():
                outs = packed(x, t)
                assert [o.shape[-1] for o in outs] == [48, 16, 8]
                if group.transform is not None:
                    assert not activation_code_moves(group, packed, x, t).any()
                assert_within_fp16_scale_error(group, packed, x, t)


def test_input_dimension_not_a_multiple_of_32_is_rejected():
    group = QuantLinearGroup(LinearGroup(proj=nn.Linear(48, 16)), QuantConfig(group_size=32), 2, looped=True)
    with pytest.raises(ExportError, match="input dimension 48"):
        PackedLinearGroup.from_quant_group(group, "layers.0.proj")


def test_exclusive_feeding_norms_are_folded_into_their_groups(exported):
    """Ouro folds both norms of a layer (input -> QKV, post-attention -> gate/up), Parcae its ``norm_2`` and the
    ``norm_1`` of blocks without a value-embedding gate (which also reads it), LoopFormer none (weightless, modulated
    norms). The state dict
    keeps the norms' keys; a folded group normalises its input itself: called on the norm's input it gives what the
    unfolded group gives on the norm's output, bit for bit on the torch backend."""
    model = exported.model
    groups = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinearGroup)}
    suffixes = {"ouro": (".qkv_proj", ".up_gate"), "parcae": (".mlp.up",), "loopformer": ()}[exported.arch]
    expected = {n for n in groups if suffixes and n.endswith(suffixes)}
    if exported.arch == "parcae":  # blocks whose attention has no value-embedding gate fold norm_1 too
        gated = [n for n, m in model.named_modules() if n.endswith(".attn") and m.ve_gate is not None]
        assert 0 < len(gated) < len([n for n in groups if n.endswith(".attn.qkv")])  # the fixture has both kinds
        expected |= {n for n in groups if n.endswith(".attn.qkv") and n[: -len(".qkv")] not in gated}
    folded = {n: g.folded_norm for n, g in groups.items() if g.folded_norm is not None}
    assert set(folded) == expected and (expected or exported.arch == "loopformer")
    assert sorted(map(id, folded.values())) == sorted(id(m) for m in model.modules() if isinstance(m, FoldedNorm))
    teacher_keys = set(load_looplm(exported.teacher_dir).state_dict())
    assert {k for k in teacher_keys if "norm" in k} <= set(model.state_dict())
    for name, norm in folded.items():
        group = groups[name]
        h = 3 * torch.randn(3, group.spec.in_features, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got = group(h, 0)
            with norm_unfolded(group):
                want = group(rms_norm(h, norm.weight, norm.eps), 0)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), name
        assert group.folded_norm is norm  # back after the context


def test_folded_model_equals_the_unfolded_one(exported):
    """The whole model: logits of the export loaded with its norms folded (the default) and with ``fold_norms=False``
    are bit for bit equal on the torch backend - each folded group normalises with its own norm's weight and eps
    (a fold that paired a group with another norm, or lost the eps, would differ)."""
    unfolded = load_quantized(exported.out, fold_norms=False)
    assert not any(isinstance(m, FoldedNorm) for m in unfolded.modules())
    assert any(isinstance(m, FoldedNorm) for m in exported.model.modules()) == (exported.arch != "loopformer")
    ids = exported.ids(seed=3)
    with torch.no_grad():
        assert torch.equal(exported.model(ids).logits, unfolded(ids).logits)


@pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
def test_a_decode_plan_follows_a_replaced_norm_weight(exported):
    """A folded norm's weight is not a buffer of its group, so a decode plan keys on its identity, address and
    dtype: assigning a new Parameter (e.g. ``load_state_dict(assign=True)``) must not leave a plan on the old one."""
    folded = [(n, m) for n, m in exported.model.named_modules() if getattr(m, "folded_norm", None)]
    if not folded:
        pytest.skip(f"{exported.arch} folds no norm")
    name, group = folded[0]
    norm = group.folded_norm
    x = torch.randn(1, group.spec.in_features, generator=torch.Generator().manual_seed(2))
    old = norm.weight
    group.backend = "triton"
    try:
        with torch.no_grad():
            group(x, 0)  # builds the plan
            norm.weight = nn.Parameter(old.detach() * 2, requires_grad=False)
            got = torch.cat(group(x, 0), -1)
            with norm_unfolded(group):
                want = torch.cat(group(rms_norm(x, norm.weight, norm.eps), 0), -1)
    finally:
        group.backend, norm.weight = None, old
    assert torch.equal(got, want), name
