"""The student's frozen weights stay the teacher's storage through every conversion of the calibration module
(``.to(device)`` by Lightning / DDP / DeepSpeed, a dtype cast). ``nn.Module._apply`` converts each module's tensors
separately, so the views ``prepare`` shares used to become copies: on the H100 the 8-layer Ouro-2.6B's setup held
2.64 GiB against the 1.6 GiB planned, its frozen weights twice. A dtype cast takes the same ``_apply`` path as a
device move, so the CPU checks it."""

from __future__ import annotations

import torch

from loopq.calib.module import LoopQCalibration
from loopq.paths import ASSETS
from loopq.quant import QuantConfig
from loopq.quant.modules import QuantLinearGroup
from loopq.quant.prepare import frozen_ties

CONFIG = QuantConfig(w_bits=4, a_bits=4, las=True, slt_budget=2, cta=True, cta_rank=8)


def storages(*modules: torch.nn.Module) -> dict[int, int]:
    """Bytes of each distinct storage the modules' parameters and buffers use, by address."""
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for m in modules
        for t in [*m.parameters(), *m.buffers()]
    }


def student_only(module: LoopQCalibration) -> int:
    """Bytes of the storages the student holds and the teacher does not."""
    teacher = storages(module.teacher)
    return sum(n for ptr, n in storages(module.student).items() if ptr not in teacher)


def frozen_weights(module: LoopQCalibration) -> dict[str, torch.Tensor]:
    groups = {n: m for n, m in module.student.named_modules() if isinstance(m, QuantLinearGroup)}
    return {f"{g}.{b}": t for g, m in groups.items() for b, t in m._buffers.items() if b.endswith("_weight")}


def test_a_conversion_keeps_the_frozen_weights_shared():
    module = LoopQCalibration(str(ASSETS / "tiny-ouro"), CONFIG)
    teacher = set(storages(module.teacher))
    weights = frozen_weights(module)
    assert weights and all(w.untyped_storage().data_ptr() in teacher for w in weights.values())
    ties, own = len(frozen_ties(module.teacher, module.student)), student_only(module)

    seen = []  # every floating tensor the conversion is applied to (the others pass unchanged), kept alive so that
    # no freed storage's address is reused by a later one
    floating = {
        p
        for m in [module.teacher]
        for p, t in ((t.untyped_storage().data_ptr(), t) for t in [*m.parameters(), *m.buffers()])
        if t.is_floating_point()
    }

    def to_float64(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        seen.append((t.detach(), t.untyped_storage().data_ptr()))  # a view keeps the storage (a parameter's .data
        # is replaced next, and a freed storage's address could be a later tensor's)
        return t.to(torch.float64)

    module._apply(to_float64)
    teacher_now = set(storages(module.teacher))
    weights = frozen_weights(module)
    assert all(w.dtype == torch.float64 and w.untyped_storage().data_ptr() in teacher_now for w in weights.values())
    assert len(frozen_ties(module.teacher, module.student)) == ties
    # the student's own tensors (quantization parameters, adapters) doubled at most; before the fix the frozen
    # weights joined them (here 0.27 MiB -> 3.55 MiB instead of 0.55)
    assert own < student_only(module) <= 2 * own
    # each of the teacher's tensors converted once: no transient second copy while the module moves
    originals = [ptr for _, ptr in seen if ptr in teacher]
    assert len(originals) == len(set(originals)) == len(floating)


def test_the_student_computes_on_the_converted_teacher_weights():
    """After a cast the student reads the cast teacher's storage: a write to the teacher's weights reaches its
    forward."""
    module = LoopQCalibration(str(ASSETS / "tiny-ouro"), CONFIG)
    ids = torch.randint(0, module.teacher.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    module.to(torch.float64)
    with torch.no_grad():
        out = module.student(ids).logits
        for group in module.teacher.linear_groups().values():
            for linear in group.children():
                linear.weight.mul_(2)  # the teacher's parameters, in place: the student reads the same storage
        assert not torch.equal(module.student(ids).logits, out)


def test_ddp_leaves_the_frozen_tensors_out(tmp_path):
    """DDP broadcasts every buffer from rank 0 before each forward and every tensor when it wraps: the frozen teacher
    and the student's views of it (the same files on every rank, never changed) are left out, nothing trainable is,
    and the small state that does change (mu, the SLT promotions and anchors) is still synchronised."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    module = LoopQCalibration(str(ASSETS / "tiny-ouro"), CONFIG)
    ignored = set(module._ddp_params_and_buffers_to_ignore)
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    teacher = {f"teacher.{n}" for n, _ in module.teacher.named_parameters()}
    weights = {f"student.{n}" for n, b in module.student.named_buffers() if n.endswith("_weight")}
    assert teacher <= ignored and weights <= ignored and weights
    assert not any(params[n].requires_grad for n in ignored if n in params)
    assert all(n in params or n in buffers for n in ignored)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(module, find_unused_parameters=True)
        synced = {id(b) for b in ddp.modules_buffers}
        assert not any(id(buffers[n]) in synced for n in weights)  # not broadcast before each forward
        assert id(module.mu) in synced and any(n.endswith("slt_promoted") for n in ddp.named_module_buffers)
    finally:
        dist.destroy_process_group()
