"""Parameter accounting of a LoopQ student, as in the paper's Table 3.

* **shared**: quantization parameters used by every loop - transforms and weight clips of unpromoted
  groups, activation clips without LAS, CTA's shared directions U and V;
* **loop-dependent**: LAS activation clips c_{t,l}, promoted groups' per-loop transforms and weight clips,
  CTA's a_t, b_t, eta_t.

Ratios are relative to the total = the model's own parameters + all quantization parameters in use. The
shared parameters of a promoted group are no longer used and are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from loopq.quant.cta import TransitionAdapters
from loopq.quant.modules import QuantLinearGroup


@dataclass
class ParameterReport:
    total: int
    model: int
    shared: int
    loop_dependent: int

    @property
    def shared_ratio(self) -> float:
        return self.shared / self.total

    @property
    def loop_dependent_ratio(self) -> float:
        return self.loop_dependent / self.total

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "shared_ratio": self.shared_ratio, "loop_dependent_ratio": self.loop_dependent_ratio}


def _numel(p: torch.Tensor) -> int:
    """Element count; DeepSpeed ZeRO-3 leaves an empty placeholder and records the full count in ``ds_numel``."""
    return getattr(p, "ds_numel", p.numel())


def _count(params: list[nn.Parameter]) -> int:
    return sum(_numel(p) for p in params if p.requires_grad)


def group_split(group: QuantLinearGroup) -> tuple[int, int]:
    """(shared, loop-dependent) parameter counts of one fake-quant group."""
    shared = loop = 0
    if group.loop_transforms is not None:
        loop += _count(list(group.loop_transforms.parameters()))
    elif group.transform is not None:
        shared += _count(list(group.transform.parameters()))
    if group.loop_weight_clip is not None:
        loop += _count([group.loop_weight_clip])
    else:
        shared += _count([group.weight_clip])
    if _numel(group.act_clip) > 1:
        loop += _count([group.act_clip])
    else:
        shared += _count([group.act_clip])
    return shared, loop


def parameter_report(student: nn.Module) -> ParameterReport:
    """Counts of model, shared-quantization and loop-dependent parameters of ``student``."""
    shared = loop = 0
    quant_ids: set[int] = set()
    for module in student.modules():
        if isinstance(module, QuantLinearGroup):
            s, lp = group_split(module)
            shared, loop = shared + s, loop + lp
            quant_ids.update(id(p) for p in module.parameters())
        elif isinstance(module, TransitionAdapters):
            shared += _count(module.shared_parameters())
            loop += _count(module.loop_dependent_parameters())
            quant_ids.update(id(p) for p in module.parameters())
    model = sum(_numel(p) for p in student.parameters() if id(p) not in quant_ids)
    model += sum(b.numel() for m in student.modules() if isinstance(m, QuantLinearGroup) for b in m.weights())
    return ParameterReport(total=model + shared + loop, model=model, shared=shared, loop_dependent=loop)
