"""The LoopQ quantization core: pure quantizers, Kronecker transforms, the fake-quant group, LAS/SLT/CTA."""

from loopq.quant.config import QuantConfig, QuantConfigError
from loopq.quant.modules import GroupOptions, QuantLinearGroup
from loopq.quant.prepare import (
    init_clipping_from_data,
    init_diagonal_from_data,
    looped_quant_groups,
    prepare,
    quant_groups,
    quant_parameters,
)

__all__ = [
    "GroupOptions",
    "QuantConfig",
    "QuantConfigError",
    "QuantLinearGroup",
    "init_clipping_from_data",
    "init_diagonal_from_data",
    "looped_quant_groups",
    "prepare",
    "quant_groups",
    "quant_parameters",
]
