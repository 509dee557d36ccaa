"""The runnable quantized group: packed int4 weights and the online activation side, on the LoopQ kernels.

Converting a fake-quant :class:`~loopq.quant.modules.QuantLinearGroup` (paper Eq. 3) splits each slot's

    y = Q_a(x P_t ; c_t) Q_w(W P_t^{-T} ; r_t)^T + b,      P_t = d_t^{-1} (P1 (x) P2)   (Eq. 2-3)

into an offline and an online half:

* offline, once (:func:`fold_weight`, :func:`pack_weight`): W'_t = (W * d_t) (P1^{-1} (x) P2^{-1})^T in float64 with
  the factors' closed-form inverses V diag(e^{-s}) U^T, rounded once to fp32 and quantized per output row with the
  clip r_t: int4 codes (exactly :func:`~loopq.qspec.quantize_codes` of that fp32 weight) packed two per
  byte, one fp16 scale per 32 inputs (:func:`loopq.kernels.quantize_weight`);
* online, every call: x * e^{-log d_t} (the kernel has no diagonal), then the fused kernel transform x (P1 (x) P2)
  with per-token group quantization at the loop's clip c_t, then the W4A4 or W4A8 GEMM of the whole group
  (concatenated outputs, split afterwards) + bias.

Every per-slot tensor has a leading slot axis of length 1 (shared by all loops) or T (loop-dependent: LAS clips, a
promoted group's transforms and weights); loop t reads entry ``min(t, len - 1)``, so loops beyond the calibrated
count reuse the last slot, as in the fake-quant group. Groups outside the loop receive ``t = None`` (slot 0).

Where the exported group and the fake-quant student differ (the exporter's tests measure each):

* the kernel transforms in a fixed fp32 summation order (``kron_apply_ordered``), the student with a BLAS matmul:
  the transformed activations differ in the last bits, so an activation code can move by 1 at an exact tie;
* weight scales are stored as fp16 (relative error <= 2^-11), the student keeps fp32 scales;
* the fold is float64, the student's effective weight fp32: a weight code can move by 1 at a near-tie;
* a bf16 student rounds x P to bf16 before quantizing; the kernel quantizes the fp32 transform.

The packed tensors keep their formats under ``model.to(dtype)`` (only device moves apply to them), so a loaded model
can be cast to BF16 as a whole: its FP modules follow, the packed groups do not.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from loopq.errors import LoopQError
from loopq.kernels import GROUP_SIZE, quantize_weight
from loopq.kernels.decode_plan import DecodePlan, plan_decode
from loopq.kernels.ops import check_prefill, quantized_linear
from loopq.kernels.packing import launch_device, tile_weight, tiled_shapes
from loopq.models.base import RMSNorm
from loopq.qspec import KERNEL_ACT_BITS, KERNEL_WEIGHT_BITS
from loopq.quant.modules import QuantLinearGroup
from loopq.quant.slots import loop_slot
from loopq.quant.transforms import KroneckerTransform, fold_weight, kron_factors


class ExportError(LoopQError):
    """A student, group or export directory the packed format cannot represent; the message names the culprit."""


@dataclass(frozen=True)
class PackedGroupSpec:
    """Layout of one packed group: enough to allocate its tensors before loading them (from JSON)."""

    names: tuple[str, ...]
    splits: tuple[int, ...]
    in_features: int
    a_bits: int
    looped: bool
    slots: int  # calibrated loop slots (1 outside the loop)
    weight_slots: int  # T for a promoted group, else 1
    transform_slots: int  # 0 without transforms
    act_slots: int  # T with LAS (or a promoted clip), else 1
    diag_scale: bool
    bias: bool

    @classmethod
    def of(cls, group: QuantLinearGroup) -> PackedGroupSpec:
        tr = group.transform
        return cls(
            names=tuple(group.names),
            splits=tuple(group.splits),
            in_features=group.in_features,
            a_bits=group.a_bits,
            looped=group.looped,
            slots=group.slots,
            weight_slots=group.slots if group.promoted else 1,
            transform_slots=(group.slots if group.promoted else 1) if tr is not None else 0,
            act_slots=group.act_clip_logits().numel(),
            diag_scale=tr is not None and tr.log_d is not None,
            bias=any(b is not None for b in group.biases()),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PackedGroupSpec:
        return cls(**{**data, "names": tuple(data["names"]), "splits": tuple(data["splits"])})


def check_kernel_support(w_bits: int, a_bits: int, group_size: int, key: str = "quant") -> None:
    """The kernels run int4 weights, 4/8-bit activations and groups of 32 inputs; say which ``key`` to change.

    Checked per group at export and, on the config alone, before a calibration whose student will be exported
    (``python -m loopq.run``), so an unexportable setting is refused in seconds, not after the calibration."""
    if w_bits != KERNEL_WEIGHT_BITS:
        raise ExportError(f"{key}.w_bits={w_bits}, but the kernels pack int4 weights; use w_bits=4")
    if a_bits not in KERNEL_ACT_BITS:
        raise ExportError(f"{key}.a_bits={a_bits}; the kernels run W4A4 or W4A8, use a_bits in {KERNEL_ACT_BITS}")
    if group_size != GROUP_SIZE:
        raise ExportError(f"{key}.group_size={group_size} is not supported by the kernels; use group_size={GROUP_SIZE}")


def check_exportable(group: QuantLinearGroup, name: str) -> None:
    """:func:`check_kernel_support` for one group, and its input dimension against the kernels' group."""
    check_kernel_support(group.w_bits, group.a_bits, group.group_size, key=f"{name}: quant")
    if group.in_features % GROUP_SIZE:
        raise ExportError(
            f"{name}: input dimension {group.in_features} is not a multiple of the kernels' group of {GROUP_SIZE}; "
            "keep this module full precision (fp_module_patterns)"
        )


@torch.no_grad()
def pack_weight(group: QuantLinearGroup, slot: int) -> tuple[Tensor, Tensor]:
    """Slot ``slot``'s folded weight as int4 codes and fp16 scales in the kernel layout
    (:func:`loopq.kernels.packing.tile_weight` of :func:`loopq.kernels.quantize_weight`'s ``[N, K/2]``,
    ``[N, K/32]``)."""
    weight = fold_weight(torch.cat(group.weights()), group.transform_for(slot))
    clip = group.weight_clip_ratio(slot).reshape(-1)
    return tile_weight(*quantize_weight(weight, clip, bits=4, group_size=GROUP_SIZE))


@torch.no_grad()
def activation_side(transform: KroneckerTransform) -> tuple[Tensor, Tensor, Tensor | None]:
    """(P1, P2, e^{-log d}) in fp32, computed by the same ops as the student's forward (so the same bits)."""
    inv_d = None if transform.log_d is None else (-transform.log_d).exp()
    return transform.left.matrix(), transform.right.matrix(), inv_d


class BufferStamp(NamedTuple):
    """What a group's decode plans were built on: its buffer objects, their addresses and the version of
    ``act_clip``, the one buffer a plan copies (as a float; it holds views of the others, so in-place writes to
    them reach it). The plans are stale after a move or an assignment (other objects), a ``.data`` swap (another
    address) or a write to the clips, e.g. ``load_state_dict``. Not seen (as by ``host_clip``): an in-place write
    to the clips through ``.data`` or to inference tensors (neither bumps the version counter)."""

    buffers: tuple[Tensor | None, ...]
    live: tuple[Tensor, ...]
    addresses: tuple[int, ...]
    clip_version: int

    @classmethod
    def of(cls, buffers: dict[str, Tensor | None]) -> BufferStamp:
        objects = tuple(buffers.values())
        live = tuple(b for b in objects if b is not None)
        return cls(objects, live, tuple(b.data_ptr() for b in live), _version(buffers["act_clip"]))

    def holds(self, buffers: dict[str, Tensor | None]) -> bool:
        """Whether ``buffers`` are still the same objects at the same addresses and clip version (runs at every
        decode call: ~2 us)."""
        return (
            len(buffers) == len(self.buffers)
            and all(map(operator.is_, buffers.values(), self.buffers))
            and tuple([b.data_ptr() for b in self.live]) == self.addresses
            and _version(buffers["act_clip"]) == self.clip_version
        )


def _version(t: Tensor) -> int:
    """``t``'s version counter; inference tensors have none (0)."""
    return 0 if t.is_inference() else t._version


class PackedLinearGroup(nn.Module):
    """Integer replacement of a :class:`QuantLinearGroup` (same call: ``group(x, t) -> tuple of outputs``).

    ``backend`` is passed to the kernels (``None``: Triton on CUDA, the torch reference on CPU), ``prefill`` too
    (the GEMM of calls of more than 16 tokens: ``None`` is :func:`loopq.kernels.ops.prefill_scheme`'s choice,
    ``"int8"`` / ``"values"`` force one; :func:`set_prefill` sets it for a whole model).
    """

    def __init__(self, spec: PackedGroupSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.backend: str | None = None
        self.prefill: str | None = None
        self._decode_plans: dict[tuple, tuple[BufferStamp, DecodePlan]] = {}
        self._n, self._splits = sum(spec.splits), list(spec.splits)
        k, n, sw, st = spec.in_features, sum(spec.splits), spec.weight_slots, spec.transform_slots
        n1, n2 = kron_factors(k)
        empty = partial(torch.empty, device=device, dtype=torch.float32)
        code_shape, scale_shape = tiled_shapes(n, k)  # the kernel layout (export format v3)
        self.register_buffer("weight", empty(sw, *code_shape, dtype=torch.uint8))
        self.register_buffer("weight_scale", empty(sw, *scale_shape, dtype=torch.float16))
        self.register_buffer("act_clip", empty(spec.act_slots))
        self.register_buffer("left", empty(st, n1, n1) if st else None)
        self.register_buffer("right", empty(st, n2, n2) if st else None)
        self.register_buffer("inv_d", empty(st, k) if st and spec.diag_scale else None)
        self.register_buffer("bias", empty(n) if spec.bias else None)

    @classmethod
    @torch.no_grad()
    def from_quant_group(cls, group: QuantLinearGroup, name: str = "group") -> PackedLinearGroup:
        """Fold, quantize and pack every slot of a calibrated fake-quant group (the *convert* step)."""
        check_exportable(group, name)
        spec = PackedGroupSpec.of(group)
        packed = cls(spec, device="meta")
        codes, scales = zip(*(pack_weight(group, s) for s in range(spec.weight_slots)), strict=True)
        packed.weight, packed.weight_scale = torch.stack(codes), torch.stack(scales)
        packed.act_clip = torch.stack([group.act_clip_ratio(s) for s in range(spec.act_slots)]).float()
        if spec.transform_slots:
            sides = [activation_side(group.transform_for(s)) for s in range(spec.transform_slots)]
            left, right, inv_d = zip(*sides, strict=True)
            packed.left, packed.right = torch.stack(left), torch.stack(right)
            packed.inv_d = torch.stack(inv_d) if spec.diag_scale else None
        packed.bias = concat_bias(group)
        return packed

    def slot(self, t: int | None) -> int:
        """Loop index -> parameter slot; loops beyond the calibrated count reuse the last slot."""
        return loop_slot(t if self.spec.looped else None, self.spec.slots)

    def forward(self, x: Tensor, t: int | None = None) -> tuple[Tensor, ...]:
        """Quantizer (cast and 1/d folded in) + GEMM (bias, output dtype): two launches on CUDA at decode. A call of
        1..16 tokens repeats the plan (:mod:`loopq.kernels.decode_plan`) that the first checked call of its
        (loop, shape, dtype, device, backend) built, while its :class:`BufferStamp` holds."""
        with launch_device(x):  # the kernels launch on the current CUDA device: make it x's
            return self._forward(x, t)

    def _forward(self, x: Tensor, t: int | None) -> tuple[Tensor, ...]:
        norm = self.folded_norm
        # the folded norm's weight is not one of this group's buffers: its identity, address and dtype are in the key
        weight = None if norm is None else (id(norm.weight), norm.weight.data_ptr(), norm.weight.dtype)
        key = (t, x.shape, x.dtype, x.device, self.backend, weight)
        entry = self._decode_plans.get(key)
        if entry is not None:
            if entry[0].holds(self._buffers):
                return self._split(entry[1](x))
            self._decode_plans = {}  # the buffers changed: every plan is stale
        args = self._linear_args(x.reshape(-1, self.spec.in_features), self.slot(t))
        y = quantized_linear(*args)
        plan = plan_decode(*args, out_shape=(*x.shape[:-1], self._n))
        if plan is not None and (t is None or type(t) is int):  # a tensor index would hash by identity: no plan
            self._decode_plans[key] = (BufferStamp.of(self._buffers), plan)
        return self._split(y.reshape(*x.shape[:-1], self._n))

    def _linear_args(self, x: Tensor, slot: int) -> tuple:
        """:func:`quantized_linear`'s arguments for ``x [M, K]`` in loop slot ``slot``."""
        spec = self.spec
        ws = loop_slot(slot, spec.weight_slots)
        ts = loop_slot(slot, spec.transform_slots) if spec.transform_slots else 0
        left, right, inv_d = (None if b is None else b[ts] for b in (self.left, self.right, self.inv_d))
        clip = self.host_clip(slot)
        norm = self.folded_norm
        return (x, self.weight[ws], self.weight_scale[ws], self._n, left, right, inv_d, clip, spec.a_bits, self.bias,
                x.dtype, self.backend, None if norm is None else norm.weight,
                None if norm is None else norm.eps, self.prefill)  # fmt: skip

    @property
    def folded_norm(self) -> FoldedNorm | None:
        """The RMSNorm feeding this group, folded into its quantizer (:func:`fold_feeding_norms`), or None."""
        return self.__dict__.get("_folded_norm")

    def _split(self, y: Tensor) -> tuple[Tensor, ...]:
        """The group's outputs ``[..., N]`` -> one per linear."""
        return (y,) if len(self._splits) == 1 else y.split_with_sizes(self._splits, dim=-1)

    def host_clip(self, slot: int) -> float:
        """``act_clip`` of ``slot`` as a float, read once per buffer version: a ``float()`` per call would sync the
        device at every linear of a decode step and cannot run inside a CUDA graph capture."""
        clips = self.act_clip
        key = (clips.data_ptr(), _version(clips))
        if getattr(self, "_host_clips", (None,))[0] != key:
            self._host_clips = (key, clips.tolist())
        values = self._host_clips[1]
        return values[loop_slot(slot, len(values))]

    def __getstate__(self) -> dict[str, Any]:
        """Pickles and deep copies leave the decode plans (views, shared scratch) behind; the copy builds its own."""
        return {**self.__dict__, "_decode_plans": {}}

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> PackedLinearGroup:
        """Follow device moves but never dtype casts: ``model.to(torch.bfloat16)`` / ``.half()`` would round the
        fp16 scales and the fp32 transforms and clips, which the kernels read as they were exported."""
        self._decode_plans = {}
        self.__dict__.pop("_host_clips", None)  # keyed by address: a moved clip may reuse the old one's
        for name, t in self._buffers.items():
            if t is not None:
                self._buffers[name] = t.to(fn(torch.empty(0, dtype=t.dtype, device=t.device)).device)
        return self

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"in={s.in_features}, out={list(s.splits)}, W4A{s.a_bits}, slots(weight={s.weight_slots}, "
            f"transform={s.transform_slots}, act_clip={s.act_slots})"
        )


def set_prefill(model: nn.Module, prefill: str | None) -> int:
    """Every packed group of ``model`` runs calls of more than 16 tokens with the prefill GEMM ``prefill``
    (``"int8"``, ``"values"``, or None for :func:`loopq.kernels.ops.prefill_scheme`'s choice by dtype); returns the
    number of groups. A bad name fails here, not at the first prefill."""
    check_prefill(prefill)
    groups = [m for m in model.modules() if isinstance(m, PackedLinearGroup)]
    for group in groups:
        group.prefill = prefill
    return len(groups)


def concat_bias(group: QuantLinearGroup) -> Tensor | None:
    """The group's biases as one fp32 vector over the concatenated outputs (zeros for bias-free linears)."""
    biases = group.biases()
    if all(b is None for b in biases):
        return None
    device = group.weights()[0].device
    parts = [
        torch.zeros(n, device=device) if b is None else b.float() for b, n in zip(biases, group.splits, strict=True)
    ]
    return torch.cat(parts)


class FoldedNorm(nn.Module):
    """An RMSNorm whose output feeds one packed group only, folded into that group: it passes its input through,
    and the group normalises it inside its quantizer's launch (:func:`quantized_linear`'s ``norm_weight``). It keeps
    the norm's ``weight`` (same state-dict key) and ``eps``. Such a group takes the norm's *input*: to call it on
    the norm's output (as the fake-quant group is called), use :func:`norm_unfolded`."""

    def __init__(self, weight: nn.Parameter, eps: float | None) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x


@contextmanager
def norm_unfolded(group: PackedLinearGroup) -> Iterator[PackedLinearGroup]:
    """``group`` called on its norm's *output* while inside (the call contract of a group without a folded norm),
    e.g. to feed it the inputs recorded from the fake-quant student; its folded norm is back on exit."""
    norm = group.__dict__.pop("_folded_norm", None)
    try:
        yield group
    finally:
        if norm is not None:
            group.__dict__["_folded_norm"] = norm


def fold_feeding_norms(model: nn.Module) -> int:
    """Fold every RMSNorm of ``model.exclusive_norm_feeds`` (its output feeds one packed group and nothing else)
    into that group: a decode step's norm is then no launch of its own (about 8 operators at bf16: the casts,
    pow, mean, + eps, rsqrt, two multiplies) but a prologue of the group's quantizer. The torch backend computes
    the same :func:`~loopq.models.base.rms_norm` it replaced (bit for bit); the Triton one within the last bits of
    ``1 / rms`` (its sum runs in another order). Returns the number of norms folded."""
    feeds = getattr(model, "exclusive_norm_feeds", {})
    folded = 0
    for name, group in list(model.named_modules()):
        if not isinstance(group, PackedLinearGroup) or group.folded_norm is not None:
            continue
        for norm_name, group_suffix in feeds.items():
            if name == group_suffix or name.endswith("." + group_suffix):
                path = name[: len(name) - len(group_suffix)] + norm_name
                norm = model.get_submodule(path)
                if isinstance(norm, RMSNorm) and norm.weight is not None and model.feeds_only_its_group(path):
                    fold = FoldedNorm(norm.weight, norm.eps)
                    model.set_submodule(path, fold)
                    group.__dict__["_folded_norm"] = fold
                    folded += 1
    return folded
