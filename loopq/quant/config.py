"""``QuantConfig``: one small dataclass describing a LoopQ student (and, with switches off, its baselines)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from loopq.quant.primitives import SUPPORTED_BITS

TRANSFORM_INITS = ("identity", "rotation", "random")


class QuantConfigError(ValueError):
    """An invalid quantization setting; the message names the key."""


@dataclass
class QuantConfig:
    """What to quantize and which LoopQ components are on.

    Bit widths of 16 mean "not quantized". ``group_size = -1`` is per-channel (weights) / per-token
    (activations). ``num_loops`` is the calibrated loop count (default: the model's trained count).
    """

    w_bits: int = 4
    a_bits: int = 4
    group_size: int = 32
    transforms: bool = True  # FlatQuant-style Kronecker transforms
    diag_scale: bool = True  # learnable per-channel diagonal inside the transform
    transform_init: str = "rotation"
    learn_weight_clip: bool = True
    learn_act_clip: bool = True
    las: bool = True  # loop-aware activation scaling (§4.1)
    slt_budget: int = 4  # selective loop-dependent transforms (§4.2): groups promoted during calibration
    cta: bool = True  # cross-loop transition adapters (§4.3)
    cta_rank: int = 8
    num_loops: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("w_bits", "a_bits"):
            if getattr(self, key) not in SUPPORTED_BITS:
                raise QuantConfigError(
                    f"quant.{key}={getattr(self, key)} is not supported; use one of {SUPPORTED_BITS}"
                )
        if self.group_size != -1 and self.group_size < 1:
            raise QuantConfigError(f"quant.group_size={self.group_size}: use a positive size or -1 (per channel)")
        if self.transform_init not in TRANSFORM_INITS:
            raise QuantConfigError(f"quant.transform_init={self.transform_init!r}: use one of {TRANSFORM_INITS}")
        if self.slt_budget < 0 or self.cta_rank < 1:
            raise QuantConfigError("quant.slt_budget must be >= 0 and quant.cta_rank >= 1")
        if self.num_loops is not None and self.num_loops < 1:
            raise QuantConfigError(f"quant.num_loops={self.num_loops} must be >= 1")

    @classmethod
    def rtn(cls, w_bits: int = 4, a_bits: int = 4, group_size: int = 32) -> QuantConfig:
        """Plain symmetric round-to-nearest (the paper's "Symmetric" baseline): every LoopQ component off."""
        return cls(
            w_bits=w_bits,
            a_bits=a_bits,
            group_size=group_size,
            transforms=False,
            learn_weight_clip=False,
            learn_act_clip=False,
            las=False,
            slt_budget=0,
            cta=False,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise QuantConfigError(f"quant config: unknown keys {unknown}; valid keys are {sorted(known)}")
        return cls(**data)
