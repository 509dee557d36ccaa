"""Parameter accounting of a LoopQ student, the columns of the paper's Table 5 (App. C).

* **shared**: learned quantization parameters used by every loop - transforms and weight clips of unpromoted
  groups, activation clips without LAS, CTA's shared directions U and V;
* **loop-dependent**: LAS activation clips c_{t,l}, promoted groups' per-loop transforms and weight clips,
  CTA's a_t, b_t, eta_t;
* **weight scales**: the per-group weight scales the quantized student stores (one per ``group_size`` weights and
  slot: a promoted group has one set per loop). Not learned, so not in ``shared``; but the paper's "Shared"
  column counts them: for Ouro-1.4B its 40.65M is 38,535,168 group-32 weight scales + 1,598,784 transform
  parameters (P1, P2, d) + 516,096 weight-clip rows = 40,650,048 (:attr:`ParameterReport.table5_shared`, which
  leaves CTA's U, V out as the paper's count does; ``tests/quant/test_student.py`` rebuilds it on the meta device).
  The paper's "Loop-Dep" column (649.5K at SLT budget 4) is not reproduced by any counting we found.

Ratios are relative to the total = the model's own parameters + all learned quantization parameters in use. The
shared parameters of a promoted group are no longer used and are not counted.

:func:`parameter_report` counts a fake-quant student's parameters; :func:`footprint` is the same table in bytes for
a packed (exported) model - one Table-3 implementation for both forms.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import chain

import torch
from torch import Tensor, nn

from loopq.models.base import LoopLM
from loopq.quant.cta import TransitionAdapters
from loopq.quant.modules import QuantLinearGroup
from loopq.quant.packed import PackedLinearGroup


@dataclass
class ParameterReport:
    total: int
    model: int
    shared: int
    loop_dependent: int
    weight_scales: int = 0  # per-group weight scales of every slot (stored, not learned)
    cta_shared: int = 0  # CTA's U and V (part of ``shared``)

    @property
    def table5_shared(self) -> int:
        """The paper's Table 5 "Shared" count: learned shared parameters without CTA's U, V, plus the weight scales
        of the unpromoted groups (see the module docstring)."""
        return self.shared - self.cta_shared + self.weight_scales

    @property
    def shared_ratio(self) -> float:
        return self.shared / self.total

    @property
    def loop_dependent_ratio(self) -> float:
        return self.loop_dependent / self.total

    def as_dict(self) -> dict[str, float]:
        ratios = {"shared_ratio": self.shared_ratio, "loop_dependent_ratio": self.loop_dependent_ratio}
        return {**asdict(self), **ratios, "table5_shared": self.table5_shared}


def _numel(p: torch.Tensor) -> int:
    """Element count; DeepSpeed ZeRO-3 leaves an empty placeholder and records the full count in ``ds_numel``."""
    return getattr(p, "ds_numel", p.numel())


def _count(params: list[nn.Parameter]) -> int:
    return sum(_numel(p) for p in params if p.requires_grad)


def group_split(group: QuantLinearGroup) -> tuple[int, int]:
    """(shared, loop-dependent) parameter counts of one fake-quant group."""
    shared = loop = 0
    if group.promoted:
        loop += _count(group.promotion_parameters())
        if _numel(group.act_clip) > 1:  # LAS: the per-loop clips were loop-dependent already
            loop += _count([group.act_clip])
        return shared, loop
    if group.transform is not None:
        shared += _count(list(group.transform.parameters()))
    shared += _count([group.weight_clip])
    if _numel(group.act_clip) > 1:
        loop += _count([group.act_clip])
    else:
        shared += _count([group.act_clip])
    return shared, loop


def weight_scale_count(group: QuantLinearGroup) -> int:
    """The per-group weight scales ``group`` stores: ``N K / group_size`` per weight (``N`` per channel with
    ``group_size = -1``, none for unquantized 16-bit weights), times the slots of a promoted group."""
    if group.w_bits >= 16:
        return 0
    per_slot = sum(
        _numel(w) // w.shape[-1] if group.group_size == -1 else _numel(w) // group.group_size for w in group.weights()
    )
    return per_slot * (group.slots if group.promoted else 1)


def parameter_report(student: nn.Module) -> ParameterReport:
    """Counts of model, shared-quantization and loop-dependent parameters of ``student``, and its weight scales."""
    shared = loop = scales = cta_shared = 0
    quant_ids: set[int] = set()
    for module in student.modules():
        if isinstance(module, QuantLinearGroup):
            s, lp = group_split(module)
            shared, loop = shared + s, loop + lp
            scales += weight_scale_count(module)
            quant_ids.update(id(p) for p in module.parameters())
        elif isinstance(module, TransitionAdapters):
            cta_shared += _count(module.shared_parameters())
            loop += _count(module.loop_dependent_parameters())
            quant_ids.update(id(p) for p in module.parameters())
    shared += cta_shared
    model = sum(_numel(p) for p in student.parameters() if id(p) not in quant_ids)
    model += sum(b.numel() for m in student.modules() if isinstance(m, QuantLinearGroup) for b in m.weights())
    return ParameterReport(model + shared + loop, model, shared, loop, scales, cta_shared)


def packed_groups(model: nn.Module) -> Iterator[tuple[str, PackedLinearGroup]]:
    """The packed (exported) linear groups of a model, by module name."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, PackedLinearGroup))


def footprint(model: LoopLM) -> dict[str, float]:
    """The paper's Table 5 for a loaded quantized model: bytes by kind, parameter counts, ratios vs BF16.

    * ``packed_weights`` / ``weight_scales``: int4 codes and fp16 scales of every slot (a promoted group has T);
    * ``quant_shared`` / ``quant_loop_dependent``: activation-side tensors (P1, P2, 1/d, clips) with one slot or
      one per loop, and CTA's shared U, V / per-loop a, b, eta (``params_*`` count their elements);
    * ``fp_modules``: every other tensor as loaded (embeddings, norms, heads, biases, ...);
    * ``bf16_model``: the teacher in BF16; ``quantized_layers`` (all tensors of the packed groups) against
      ``quantized_layers_bf16`` (their teacher weights and biases in BF16);
    * ``slt_weight_copies``: the packed weights and scales of the T - 1 extra loop slots of SLT-promoted groups
      (paper App. C: selected groups use loop-dependent transforms *and* quantized weights), so that
      ``quantized_layers_shared`` = the quantized layers as stored once for all loops, and
      ``quantized_layers_shared_ratio`` its ratio to BF16; ``packed_shared_ratio``: int4 codes + fp16 scales alone
      (4.5 / 16 = 0.281 without biases). A promoted group costs T times its packed weights, and every group keeps
      its fp32 factors P1, P2 and 1/d (~(n1^2 + n2^2 + n) * 4 bytes per slot): both are visible on a 128-wide,
      2-layer model and negligible at 2048 wide and 24-48 layers.
    """
    groups = [g for _, g in packed_groups(model)]
    quant = _quant_tensors(model)
    packed = [t for g in groups for t in (g.weight, g.weight_scale)]
    special = {id(t) for t in chain(packed, (t for t, _ in quant))}
    fp = [t for t in _unique_tensors(model) if id(t) not in special]
    report: dict[str, float] = {
        "packed_weights": sum(_nbytes(g.weight) for g in groups),
        "weight_scales": sum(_nbytes(g.weight_scale) for g in groups),
        "quant_shared": sum(_nbytes(t) for t, loop in quant if not loop),
        "quant_loop_dependent": sum(_nbytes(t) for t, loop in quant if loop),
        "fp_modules": sum(_nbytes(t) for t in fp),
    }
    report["total"] = sum(report.values())
    layer_params = sum(g.spec.in_features * sum(g.spec.splits) for g in groups)
    layer_biases = sum(g.bias.numel() for g in groups if g.bias is not None)
    teacher_params = layer_params + sum(t.numel() for t in fp)
    report["bf16_model"] = 2 * teacher_params
    report["relative"] = report["total"] / report["bf16_model"] - 1
    report["quantized_layers"] = sum(_nbytes(t) for g in groups for t in g.buffers())
    report["quantized_layers_bf16"] = 2 * (layer_params + layer_biases)
    report["quantized_layers_ratio"] = report["quantized_layers"] / report["quantized_layers_bf16"]
    report["slt_weight_copies"] = sum(
        _nbytes(t) * (t.shape[0] - 1) // t.shape[0] for g in groups for t in (g.weight, g.weight_scale)
    )
    report["quantized_layers_shared"] = report["quantized_layers"] - report["slt_weight_copies"]
    report["quantized_layers_shared_ratio"] = report["quantized_layers_shared"] / report["quantized_layers_bf16"]
    shared_packed = report["packed_weights"] + report["weight_scales"] - report["slt_weight_copies"]
    report["packed_shared_ratio"] = shared_packed / report["quantized_layers_bf16"]
    shared = sum(t.numel() for t, loop in quant if not loop)
    loop_dependent = sum(t.numel() for t, loop in quant if loop)
    total_params = teacher_params + shared + loop_dependent
    report.update(params_total=total_params, params_shared=shared, params_loop_dependent=loop_dependent)
    report.update(shared_ratio=shared / total_params, loop_dependent_ratio=loop_dependent / total_params)
    return report


def _quant_tensors(model: LoopLM) -> list[tuple[Tensor, bool]]:
    """Quantization parameters in use, each with whether it is loop-dependent (one entry per loop)."""
    found = [(t, t.shape[0] > 1) for _, g in packed_groups(model) for t in (g.left, g.right, g.inv_d, g.act_clip)]
    if isinstance(model.transition, TransitionAdapters):
        per_loop = {id(p) for p in model.transition.loop_dependent_parameters()}
        found += [(p, id(p) in per_loop) for p in model.transition.parameters()]
    return [(t, loop) for t, loop in found if t is not None]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _unique_tensors(model: nn.Module) -> list[Tensor]:
    return list({id(t): t for t in chain(model.parameters(), model.buffers())}.values())


def format_footprint(report: dict[str, float]) -> str:
    mb = 1 / 2**20
    rows = [
        ("packed int4 weights", report["packed_weights"]),
        ("fp16 weight scales", report["weight_scales"]),
        ("quant params, shared", report["quant_shared"]),
        ("quant params, loop-dependent", report["quant_loop_dependent"]),
        ("FP modules", report["fp_modules"]),
    ]
    lines = [f"{name:<30}{value * mb:>12.3f} MB" for name, value in rows]
    lines += [
        f"{'total':<30}{report['total'] * mb:>12.3f} MB   BF16 model {report['bf16_model'] * mb:.3f} MB "
        f"({100 * report['relative']:+.1f}%)",
        f"{'quantized layers':<30}{report['quantized_layers'] * mb:>12.3f} MB   BF16 "
        f"{report['quantized_layers_bf16'] * mb:.3f} MB ({report['quantized_layers_ratio']:.3f}x)",
        f"{'  of which SLT loop copies':<30}{report['slt_weight_copies'] * mb:>12.3f} MB   shared part "
        f"{report['quantized_layers_shared'] * mb:.3f} MB ({report['quantized_layers_shared_ratio']:.3f}x BF16)",
        f"params: total {report['params_total']:,}  shared {report['params_shared']:,} "
        f"({100 * report['shared_ratio']:.3f}%)  loop-dependent {report['params_loop_dependent']:,} "
        f"({100 * report['loop_dependent_ratio']:.4f}%)",
    ]
    return "\n".join(lines)
