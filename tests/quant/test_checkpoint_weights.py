"""``checkpoint_weights``: the weight side of every group (transform + fake quantization) is recomputed in the
backward pass - bit-identical numbers, and autograd no longer keeps the chain's copies of every weight."""

from __future__ import annotations

import torch

from loopq.models import load_looplm
from loopq.paths import ASSETS
from loopq.quant import GroupOptions, QuantConfig, looped_quant_groups, prepare, quant_groups


def student(checkpoint_weights: bool):
    torch.manual_seed(0)
    config = QuantConfig(transform_init="random", cta=True, seed=0)
    model = prepare(
        load_looplm(ASSETS / "tiny-ouro"), config, options=GroupOptions(checkpoint_weights=checkpoint_weights)
    )
    quant_groups(model)[list(looped_quant_groups(model))[1]].promote()
    return model.train()


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (what a checkpoint keeps is invisible)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_gradients_are_bit_identical_with_and_without_recomputation():
    plain, recomputed = student(False), student(True)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    for model in (plain, recomputed):
        out = model(ids, return_trajectory=True)
        (out.logits.float().square().mean() + sum(s.square().mean() for s in out.loop_states)).backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    other = {n: p.grad for n, p in recomputed.named_parameters() if p.requires_grad}
    assert grads.keys() == other.keys() and any(g is not None for g in grads.values())
    for name, grad in grads.items():
        assert (grad is None and other[name] is None) or torch.equal(grad, other[name]), name


def test_the_weight_chain_keeps_nothing_for_backward_when_recomputed():
    plain, recomputed = student(False), student(True)
    group = quant_groups(plain)["model.layers.0.mlp.up_gate"]
    weight_bytes = 4 * sum(w.numel() for w in group.weights())  # the fp32 concatenated weight
    chain = saved_bytes(lambda: group._compute_slot(0, None))
    kept = saved_bytes(lambda: quant_groups(recomputed)["model.layers.0.mlp.up_gate"]._compute_slot(0, None))
    assert chain >= 5 * weight_bytes  # the plain chain: several fp32 copies of the weight (docs: ~8)
    assert kept <= 0.1 * weight_bytes  # recomputed: only the small inverse transforms


def test_the_calibration_module_switches_every_group():
    from loopq.calib.module import LoopQCalibration

    module = LoopQCalibration(str(ASSETS / "tiny-ouro"), QuantConfig(), checkpoint_weights=True)
    assert all(g.options.checkpoint_weights for g in quant_groups(module.student).values())
    assert not any(
        g.options.checkpoint_weights for g in quant_groups(LoopQCalibration(str(ASSETS / "tiny-ouro"))).values()
    )
