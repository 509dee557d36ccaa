"""``QuantConfig``: one small dataclass describing a LoopQ student or one of the paper's baselines.

``method`` names what the student is (paper §5, "Baselines"); every baseline is a *static* configuration of the same
framework - one shared quantizer per group for all loops, no LAS, SLT or CTA:

===============  ==============================================================================  ===========
method           group transform (x' = (x / d) (P1 (x) P2), W' = (W * d) (P1 (x) P2)^-T)         calibrated
===============  ==============================================================================  ===========
``rtn``          none ("Symmetric": plain round-to-nearest)                                       no
``smoothquant``  identity factors, d = SmoothQuant's migration scales from calibration data      no (data)
``quarot``       randomized Hadamard factors, d = gamma of the feeding RMSNorm                    no (data)
``spinquant``    Cayley-parameterised rotations started at QuaRot's, d = gamma; learned clips     logit KL
``flatquant``    learnable Kronecker factors + diagonal + clips (as LoopQ)                        layer-wise
``loopq``        learnable Kronecker factors + diagonal + clips, LAS, SLT, CTA                    Eq. 8
===============  ==============================================================================  ===========

:data:`METHODS` fixes the switches each baseline implies; a config that contradicts them is rejected naming the key
(build baselines with the constructors, e.g. :meth:`QuantConfig.quarot`). The transforms themselves are set up by
:mod:`loopq.quant.baselines`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

from loopq.errors import LoopQError
from loopq.qspec import SUPPORTED_BITS

TRANSFORM_INITS = ("identity", "rotation", "random")
DIAG_INITS = ("ones", "smooth")


@dataclass(frozen=True)
class Method:
    """What a quantization method fixes in the config, whether ``python -m loopq.fit`` calibrates it, and the
    name tables and result files call it (the paper's Table 1 labels)."""

    settings: Mapping[str, Any]
    trained: bool
    label: str = ""


_STATIC = {"las": False, "slt_budget": 0, "cta": False}  # one configuration shared by all loops
_NO_CLIP = {"learn_weight_clip": False, "learn_act_clip": False}
METHODS: dict[str, Method] = {
    "loopq": Method({}, trained=True, label="LoopQ"),
    "rtn": Method({"transforms": False, **_NO_CLIP, **_STATIC}, trained=False, label="Symmetric"),
    "smoothquant": Method(
        {"transforms": True, "diag_scale": True, **_NO_CLIP, **_STATIC}, trained=False, label="SmoothQuant"
    ),
    "quarot": Method({"transforms": True, "diag_scale": True, **_STATIC}, trained=False, label="QuaRot"),
    "spinquant": Method({"transforms": True, "diag_scale": True, **_STATIC}, trained=True, label="SpinQuant"),
    "flatquant": Method({"transforms": True, **_STATIC}, trained=True, label="FlatQuant"),
}
#: the label of the unquantized teacher in tables and result files
FP_LABEL = "FP"
#: bit-width pairs the exported kernels run and results are reported for, by label
BIT_LABELS = ("w4a4", "w4a8")


def method_of_label(label: str) -> str | None:
    """The ``quant.method`` a table label names (case-insensitive; ``RTN...`` labels are RTN), else None."""
    key = label.lower()
    if key.startswith("rtn"):
        return "rtn"
    return next((name for name, m in METHODS.items() if key in (name, m.label.lower())), None)


class Bits(NamedTuple):
    """A bit-width pair, the one value for it inside the package; ``w4a4``-style labels only at the boundary (command
    lines, file names, JSON): :meth:`parse` reads one, :attr:`label` writes one. 16 means unquantized (``w4a16``)."""

    w: int
    a: int

    @property
    def label(self) -> str:
        return f"w{self.w}a{self.a}"

    @classmethod
    def parse(cls, label: str, key: str = "bits") -> Bits:
        """The pair of a ``w<W>a<A>`` label with supported widths; a bad one is refused naming ``key``."""
        match = re.fullmatch(r"w(\d+)a(\d+)", label.strip().lower())
        if match is None:
            raise QuantConfigError(f"{key} {label!r}: write bit widths as w<W>a<A>, e.g. w4a4 or w4a8")
        bits = cls(int(match.group(1)), int(match.group(2)))
        for name, value in zip("wa", bits, strict=True):
            if value not in SUPPORTED_BITS:
                raise QuantConfigError(f"{key} {label!r}: {value}-bit {name} is not supported; use {SUPPORTED_BITS}")
        return bits


class QuantConfigError(LoopQError):
    """An invalid quantization setting; the message names the key."""


@dataclass
class QuantConfig:
    """What to quantize and which LoopQ components are on.

    Bit widths of 16 mean "not quantized". ``group_size = -1`` is per-channel (weights) / per-token
    (activations). ``num_loops`` is the calibrated loop count (default: the model's trained count).
    ``transform_init`` applies to the learnable transforms (``loopq``, ``flatquant``); ``smooth_alpha`` is
    SmoothQuant's migration strength. ``diag_init`` starts a learnable diagonal d at ones or, as FlatQuant does by
    default (its ``--diag_init sq_style --diag_alpha 0.3``), at SmoothQuant's scales with strength ``diag_alpha``
    from the teacher's activation maxima on the first calibration batch (all loops pooled: d is shared by them).
    """

    method: str = "loopq"
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
    smooth_alpha: float = 0.5
    diag_init: str = "smooth"
    diag_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantConfigError(f"quant.method={self.method!r} is not a method; use one of {sorted(METHODS)}")
        for key, want in METHODS[self.method].settings.items():
            if getattr(self, key) != want:
                raise QuantConfigError(
                    f"quant.{key}={getattr(self, key)!r} contradicts quant.method={self.method!r}; set quant.{key}: "
                    f"{want!r} (or build it with QuantConfig.{self.method}())"
                )
        for key in ("smooth_alpha", "diag_alpha"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise QuantConfigError(f"quant.{key}={getattr(self, key)} must be in [0, 1]")
        if self.diag_init not in DIAG_INITS:
            raise QuantConfigError(f"quant.diag_init={self.diag_init!r}: use one of {DIAG_INITS}")
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
    def of_method(
        cls, method: str, w_bits: int = 4, a_bits: int = 4, group_size: int = 32, **kwargs: Any
    ) -> QuantConfig:
        """The config of ``method`` (its fixed switches from :data:`METHODS`) at the given bit widths."""
        if method not in METHODS:
            raise QuantConfigError(f"quant.method={method!r} is not a method; use one of {sorted(METHODS)}")
        settings = {**METHODS[method].settings, **kwargs}
        return cls(method=method, w_bits=w_bits, a_bits=a_bits, group_size=group_size, **settings)

    @classmethod
    def rtn(cls, w_bits: int = 4, a_bits: int = 4, group_size: int = 32) -> QuantConfig:
        """Plain symmetric round-to-nearest (the paper's "Symmetric" baseline): every LoopQ component off."""
        return cls.of_method("rtn", w_bits, a_bits, group_size)

    @classmethod
    def smoothquant(cls, w_bits: int = 4, a_bits: int = 4, group_size: int = 32, alpha: float = 0.5) -> QuantConfig:
        """SmoothQuant (Xiao et al., 2023): per-channel migration scales, no clipping, nothing trained."""
        return cls.of_method("smoothquant", w_bits, a_bits, group_size, smooth_alpha=alpha)

    @classmethod
    def quarot(cls, w_bits: int = 4, a_bits: int = 4, group_size: int = 32) -> QuantConfig:
        """QuaRot-RTN (Ashkboos et al., 2024): randomized Hadamard rotations, MSE-searched clips, nothing trained."""
        return cls.of_method("quarot", w_bits, a_bits, group_size)

    @classmethod
    def spinquant(cls, w_bits: int = 4, a_bits: int = 4, group_size: int = 32) -> QuantConfig:
        """SpinQuant (Liu et al., 2025): learned rotations (Cayley) from QuaRot's start, learned clipping."""
        return cls.of_method("spinquant", w_bits, a_bits, group_size)

    @classmethod
    def flatquant(cls, w_bits: int = 4, a_bits: int = 4, group_size: int = 32) -> QuantConfig:
        """FlatQuant (Sun et al., 2025): learnable Kronecker transforms, diagonal and clipping, no loop awareness."""
        return cls.of_method("flatquant", w_bits, a_bits, group_size)

    @property
    def bits(self) -> Bits:
        """This config's bit widths."""
        return Bits(self.w_bits, self.a_bits)

    @property
    def label(self) -> str:
        """The method's table label (``LoopQ``, ``Symmetric``, ...)."""
        return METHODS[self.method].label

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise QuantConfigError(f"quant config: unknown keys {unknown}; valid keys are {sorted(known)}")
        return cls(**data)
