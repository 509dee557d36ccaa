"""The per-use weight backward and the recorded per-loop gradients against plain autograd, in float64.

* every quantization parameter's gradient (shared and promoted transforms, weight and activation clips with and
  without LAS, CTA's adapters) equals plain autograd's through one quantized weight per slot, to 1e-10 relative;
* phi_{t,l} from the recorded per-use gradients equals the gradient w.r.t. explicit zero per-loop perturbations
  Delta_t of the factors (P_t = P + Delta_t, P_t^-1 = P^-1 - P^-1 Delta_t P^-1: the old probe pass, rebuilt here as
  the oracle), and so do the S_l computed from them;
* promotion changes no output and creates no parameter.
"""

import types

import pytest
import torch

from loopq.calib.slt import gap_scores, loop_gradients, recording, scored_groups, shared_inverses
from loopq.models import load_looplm
from loopq.paths import ASSETS
from loopq.quant import QuantConfig, looped_quant_groups, prepare
from loopq.quant.modules import GroupOptions
from loopq.quant.sharing_gap import SharingGapAccumulator


def student(las: bool, per_use: bool, promote: bool) -> torch.nn.Module:
    teacher = load_looplm(ASSETS / "tiny-ouro").double()
    s = prepare(teacher, QuantConfig(las=las, slt_budget=2, cta=True), options=GroupOptions(per_use_backward=per_use))
    s.double()
    gen = torch.Generator().manual_seed(3)
    offsets = {id(p) for g in looped_quant_groups(s).values() for p in g.promotion_parameters()}
    with torch.no_grad():  # random shared values; the per-loop offsets stay zero until a promotion (no gradient)
        for p in s.parameters():
            if p.requires_grad and id(p) not in offsets:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    if promote:
        for group in list(looped_quant_groups(s).values())[:2]:
            group.promote()
            with torch.no_grad():  # per-loop values that differ from the shared ones and between loops
                for p in group.promotion_parameters():
                    p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    return s


def loss_of(s: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = s(ids, return_trajectory=True)
    return out.logits.log_softmax(-1).mean() + sum(h.pow(2).mean() for h in out.loop_states)


def gradients(s: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
    named = {n: p for n, p in s.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss_of(s, ids), list(named.values()), allow_unused=True)
    return dict(zip(named, grads, strict=True))


@pytest.mark.parametrize("las", [True, False])
def test_per_use_backward_equals_autograd_in_float64(las):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = gradients(student(las, per_use=False, promote=True), ids)
    per_use = gradients(student(las, per_use=True, promote=True), ids)
    assert plain.keys() == per_use.keys()
    kinds = set()
    for name, g in plain.items():
        h = per_use[name]
        assert (g is None) == (h is None), name
        if g is None:
            continue
        kinds.add(name.split(".")[-1] if "transition" in name else name.split(".")[-2] if "loop_transforms" in name
                  else name.rsplit(".", 1)[-1])  # fmt: skip
        scale = g.abs().max().clamp_min(1e-300)
        assert ((g - h).abs().max() / scale).item() < 1e-10, name
    # the comparison covered shared and promoted transforms, both clips, LAS or per-loop act clips, and CTA
    assert {"u", "log_d", "weight_clip", "loop_weight_clip", "act_clip", "a", "eta"} <= kinds
    assert any("loop_transforms" in n and g is not None for n, g in plain.items())
    assert las or any("loop_act_clip" in n and g is not None for n, g in plain.items())


def probe_phis(s: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The oracle: zero per-loop perturbations of each scored group's factors and plain autograd w.r.t. them."""
    groups = scored_groups(s)
    deltas = {}
    for name, g in groups.items():
        n1, n2 = g.transform.left.log_s.numel(), g.transform.right.log_s.numel()
        d = (torch.zeros(g.slots, n1, n1, dtype=torch.float64, requires_grad=True),
             torch.zeros(g.slots, n2, n2, dtype=torch.float64, requires_grad=True))  # fmt: skip
        deltas[name] = d
        shared = g._transform_tensors

        def perturbed(self, slot, d=d, shared=shared):
            (p1, p2, i1, i2), log_d = shared(0)
            a, b = d[0][slot], d[1][slot]
            return (p1 + a, p2 + b, i1 - i1 @ a @ i1, i2 - i2 @ b @ i2), log_d

        g._transform_tensors = types.MethodType(perturbed, g)
        g._param_slot = lambda slot: slot
    flat = [t for d in deltas.values() for t in d]
    grads = torch.autograd.grad(loss_of(s, ids), flat)
    it = iter(grads)
    return {n: torch.cat([next(it).reshape(g.slots, -1), next(it).reshape(g.slots, -1)], 1)
            for n, g in groups.items()}  # fmt: skip


def test_recorded_per_loop_gradients_equal_the_probe_in_float64():
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    s = student(las=True, per_use=True, promote=True)  # two groups promoted: the others are scored
    groups = scored_groups(s)
    assert 0 < len(groups) == len(looped_quant_groups(s)) - 2
    inverses = {n: shared_inverses(g) for n, g in groups.items()}
    with recording(groups) as recorders:
        torch.autograd.grad(loss_of(s, ids), [p for p in s.parameters() if p.requires_grad], allow_unused=True)
    recorded = {n: loop_gradients(recorders[n], inverses[n]) for n in groups}
    oracle = probe_phis(student(las=True, per_use=False, promote=True), ids)
    for name, phi in recorded.items():
        scale = oracle[name].abs().max()
        assert scale > 0 and ((phi - oracle[name]).abs().max() / scale).item() < 1e-10, name
    scores = {}
    for phis in (recorded, oracle):
        acc = {n: SharingGapAccumulator() for n in phis}
        for n, phi in phis.items():
            acc[n].add(phi)
        scores[id(phis)] = gap_scores(acc)
    a, b = scores.values()
    assert a.keys() == b.keys() and all(abs(a[n] - b[n]) <= 1e-9 * abs(b[n]) for n in a)


def test_promotion_keeps_the_output_and_the_parameter_set():
    s = student(las=False, per_use=True, promote=False)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    params = [id(p) for p in s.parameters()]
    with torch.no_grad():
        before = s(ids).logits
        for group in looped_quant_groups(s).values():
            group.promote()
        after = s(ids).logits
    assert [id(p) for p in s.parameters()] == params
    assert torch.equal(before, after)
    state = s.state_dict()
    assert all(bool(v) for k, v in state.items() if k.endswith("slt_promoted"))
    fresh = student(las=False, per_use=True, promote=False)
    fresh.load_state_dict(state)  # resume: a plain load, promotions included
    assert all(g.promoted for g in looped_quant_groups(fresh).values())
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, after)
