"""The fake-quant transform-weight group: the unit that LoopQ quantizes, scores and promotes.

For loop t, a group with input x and linears W_1..W_k computes (paper Eq. 3 with §4.1-4.2)

    y_i = Q_a(x P_t ; c_{t}) Q_w(W_i P_t^{-T} ; r_t)^T + b_i

* ``P_t`` is the group's Kronecker transform: shared across loops, or per loop once the group is *promoted*
  (SLT, §4.2);
* ``c_t`` is the activation clipping ratio: one per loop with LAS (§4.1), else one per group;
* ``r_t`` are per-output-row weight clipping ratios (shared, or per loop once promoted).

The frozen full-precision weights are referenced, never copied per loop: a promoted group holds per-loop
*transforms and clips* only, and its per-loop quantized weights exist only at export time.
Groups outside the loop (Parcae's prelude/coda) have a single slot and receive ``t = None``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from loopq.models.base import LinearGroup
from loopq.qspec import at_least_fp32, quantize_codes
from loopq.quant.config import QuantConfig
from loopq.quant.fused import quantizers
from loopq.quant.primitives import clip_logit, clip_ratio
from loopq.quant.slots import loop_slot
from loopq.quant.transforms import KroneckerTransform, fold_weight

FULL_CLIP = 1.0 - 1e-4  # the initial learnable clip ratio: no clipping


class SlotTensors(NamedTuple):
    """The input-independent tensors of one parameter slot, computed once per forward."""

    mats: tuple[Tensor, Tensor, Tensor, Tensor] | None  # P1, P2, P1^-1, P2^-1
    weight: Tensor  # transformed, fake-quantized [sum(out), in], fp32
    inv_d: Tensor | None  # e^{-log d}
    act_clip: Tensor  # c_t for every activation slot


@dataclass(frozen=True)
class GroupOptions:
    """How a group computes (not what it computes: the numbers are the same either way), fixed when it is built.

    ``compiled``: run the per-call quantizer chains as torch.compile-d functions (``model.compile_quantizers``);
    ``checkpoint_weights``: recompute the weight's transform + fake-quant chain in the backward pass
    (``model.checkpoint_weights``): autograd then keeps the fp32 quantized weight only, not the chain's ~8 fp32
    copies of it."""

    compiled: bool = False
    checkpoint_weights: bool = False


class TransformPerturbation(Protocol):
    """Per-loop matrices in place of a shared group's transform, set by an algorithm for a while
    (:meth:`QuantLinearGroup.perturb`); SLT's sharing-gap probe is one (:class:`loopq.calib.slt.LoopProbe`). While it
    is set every loop has its own slot, and nothing is cached across forwards."""

    def matrices(
        self, slot: int, shared: tuple[Tensor, Tensor, Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...


class QuantLinearGroup(nn.Module):
    """Fake-quant replacement of a :class:`LinearGroup` (same call: ``group(x, t) -> tuple of outputs``).

    It owns its buffers (the frozen weights), its quantization parameters and its forward. The method's decisions
    live in the calibration code: *which* groups are promoted and when (:mod:`loopq.calib.reselection`), the
    sharing-gap probe's perturbations and gradients (:mod:`loopq.calib.slt`); the group only offers
    :meth:`promote` (its parameter layout) and :meth:`perturb`."""

    def __init__(
        self, group: LinearGroup, config: QuantConfig, num_loops: int, looped: bool, options: GroupOptions | None = None
    ) -> None:
        super().__init__()
        self.names = group.names
        linears = list(group.children())
        self.in_features = linears[0].in_features
        self.splits = [lin.out_features for lin in linears]
        for name, lin in zip(self.names, linears, strict=True):
            self.register_buffer(f"{name}_weight", lin.weight.detach())
            self.register_buffer(f"{name}_bias", None if lin.bias is None else lin.bias.detach())
        self.w_bits, self.a_bits, self.group_size = config.w_bits, config.a_bits, config.group_size
        self.slots = num_loops if looped else 1
        self.looped = looped
        out = sum(self.splits)
        self.transform = KroneckerTransform(self.in_features, config.diag_scale) if config.transforms else None
        self.loop_transforms: nn.ModuleList | None = None
        act_slots = self.slots if config.las else 1
        self.act_clip = _clip_param((act_slots,), config.learn_act_clip and config.a_bits < 16)
        self.weight_clip = _clip_param((1, out), config.learn_weight_clip and config.w_bits < 16)
        self.loop_weight_clip: nn.Parameter | None = None
        self.act_clip_promoted = False
        self.options = options or GroupOptions()
        #: an algorithm's per-loop stand-in for the shared transform matrices (:meth:`perturb`), else None
        self.perturbation: TransformPerturbation | None = None
        #: evaluate exactly as the exported kernels compute (see :meth:`kernel_forward`); a mode, like ``training``
        self.kernel_numerics = False
        self._cache: dict[int, SlotTensors] = {}
        self._cache_state: tuple | None = None

    # ------------------------------------------------------------------ helpers
    def weights(self) -> list[Tensor]:
        return [getattr(self, f"{n}_weight") for n in self.names]

    def biases(self) -> list[Tensor | None]:
        return [getattr(self, f"{n}_bias") for n in self.names]

    @property
    def promoted(self) -> bool:
        return self.loop_transforms is not None or self.loop_weight_clip is not None

    def slot(self, t: int | None) -> int:
        """Loop index -> parameter slot; loops beyond the calibrated count reuse the last slot."""
        return loop_slot(t if self.looped else None, self.slots)

    def transform_for(self, slot: int) -> KroneckerTransform | None:
        return self.loop_transforms[slot] if self.loop_transforms is not None else self.transform

    def act_clip_ratio(self, slot: int) -> Tensor:
        """c_t of ``slot`` (one entry per loop with LAS, else one); the same op as the forward (bit-identical)."""
        return clip_ratio(self.act_clip)[loop_slot(slot, self.act_clip.numel())]

    def weight_clip_ratio(self, slot: int) -> Tensor:
        logits = self.loop_weight_clip[slot : slot + 1] if self.loop_weight_clip is not None else self.weight_clip
        return clip_ratio(logits).reshape(-1, 1, 1)

    def transform_matrices(self, tr: KroneckerTransform, slot: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(P1, P2, P1^-1, P2^-1) of ``slot``, perturbed while a :attr:`perturbation` is set."""
        return self._slot_tensors(slot).mats  # type: ignore[return-value]

    # ------------------------------------------------------------------ forward
    def effective_weight_fp(self, slot: int) -> Tensor:
        """The transformed (not yet quantized) concatenated weight ``[sum(out), in]`` in fp32 for ``slot``."""
        tr = self.transform_for(slot)
        weight = torch.cat([at_least_fp32(w) for w in self.weights()])
        if tr is not None:
            _, _, p1_inv, p2_inv = self.transform_matrices(tr, slot)
            weight = tr.weight(weight, p1_inv, p2_inv)
        return weight

    def effective_weight(self, slot: int) -> Tensor:
        """The transformed, fake-quantized, concatenated weight ``[sum(out), in]`` (fp32) for ``slot``."""
        return self._slot_tensors(slot).weight

    # ------------------------------------------------------------------ per-forward cache
    # The transform matrices and the fake-quantized weight depend on the parameters and the slot only, not on
    # the input: a shared group has the same ones in every loop. They are computed once per model forward
    # (``begin_forward``, a forward pre-hook that ``prepare`` installs, i.e. *before* the loop and outside the
    # per-loop checkpointed bodies, whose recomputation then reuses them) and, in eval mode without gradients,
    # once per parameter version. Anything that changes a parameter in place bumps its version and invalidates.
    def _param_slot(self, slot: int) -> int:
        """Slot of the transform/weight: all loops share slot 0 unless promoted or perturbed per loop."""
        return slot if self.promoted or self.perturbation is not None else 0

    def _state_key(self) -> tuple:
        probe = None if self.perturbation is None else id(self.perturbation)
        versions = tuple(p._version for p in self.parameters())
        return self.training, torch.is_grad_enabled(), probe, versions

    def _slot_tensors(self, slot: int) -> SlotTensors:
        """Everything of ``slot`` that does not depend on the input, from the cache when valid."""
        key = self._param_slot(slot)
        state = self._state_key()
        if self._cache_state != state:
            self._cache = {}
            self._cache_state = state if self._cacheable() else None  # only begin_forward opens a training scope
        if key in self._cache:
            return self._cache[key]
        value = self._compute_slot(key, None)
        if self._cache_state is not None:
            self._cache[key] = value
        return value

    def _compute_slot(self, slot: int, base: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] | None) -> SlotTensors:
        tr = self.transform_for(slot)
        mats = inv_d = None
        if tr is not None:
            inv_d = None if tr.log_d is None else (-tr.log_d).exp()
            shared = base[id(tr)] if base is not None and id(tr) in base else tr.matrices()
            mats = shared if self.perturbation is None else self.perturbation.matrices(slot, shared)
        inverses = () if mats is None else (mats[2], mats[3])
        if self.options.checkpoint_weights and torch.is_grad_enabled():
            weight = checkpoint(self._weight_chain, slot, *inverses, use_reentrant=False)
        else:
            weight = self._weight_chain(slot, *inverses)
        return SlotTensors(mats, weight, inv_d, clip_ratio(self.act_clip))

    def _weight_chain(self, slot: int, *inverses: Tensor) -> Tensor:
        """Q_w(W P^{-T}; r) of ``slot`` (Eq. 3's weight side) from the frozen weights and (P1^-1, P2^-1)."""
        weight = torch.cat([at_least_fp32(w) for w in self.weights()])
        if inverses:
            weight = self.transform_for(slot).weight(weight, *inverses)  # type: ignore[union-attr]
        return quantizers(self.options.compiled)[1](weight, self.w_bits, self.group_size, self.weight_clip_ratio(slot))

    def begin_forward(self) -> None:
        """Compute every distinct slot's transform matrices and quantized weight for the coming model forward."""
        self._cache, self._cache_state = {}, None
        if self.kernel_numerics or self._cacheable():
            return  # the eval cache fills lazily and survives forwards
        if any(hasattr(p, "ds_id") for p in self.parameters()):
            return  # DeepSpeed ZeRO-3 gathers a module's parameters only inside its own forward: compute per call
        base: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        if self.perturbation is not None and self.transform is not None:
            base[id(self.transform)] = self.transform.matrices()
        for key in sorted({self._param_slot(t) for t in range(self.slots)}):
            self._cache[key] = self._compute_slot(key, base)
        self._cache_state = self._state_key()

    def _cacheable(self) -> bool:
        return not self.training and not torch.is_grad_enabled() and self.perturbation is None

    def train(self, mode: bool = True) -> QuantLinearGroup:
        self._cache, self._cache_state = {}, None
        return super().train(mode)

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        self._cache, self._cache_state = {}, None
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[arg-type]

    def __getstate__(self) -> dict:
        """Copies (``copy.deepcopy``, pickling) never carry the cache: it may hold non-leaf autograd tensors."""
        state = self.__dict__.copy()
        state["_cache"], state["_cache_state"] = {}, None
        return state

    def quantized_input(self, x: Tensor, slot: int) -> Tensor:
        """x P_t quantized with the loop's activation clipping."""
        cached = self._slot_tensors(slot)
        p1, p2 = cached.mats[:2] if cached.mats is not None else (None, None)
        clip = cached.act_clip[loop_slot(slot, cached.act_clip.numel())]
        return quantizers(self.options.compiled)[0](x, p1, p2, cached.inv_d, clip, self.a_bits, self.group_size)

    def forward(self, x: Tensor, t: int | None = None) -> tuple[Tensor, ...]:
        slot = self.slot(t)
        if self.kernel_numerics:
            return self.kernel_forward(x, slot)
        y = F.linear(self.quantized_input(x, slot), self.effective_weight(slot).to(x.dtype), self._bias(x))
        return tuple(y.split(self.splits, dim=-1))

    def kernel_forward(self, x: Tensor, slot: int) -> tuple[Tensor, ...]:
        """The same quantized computation with the exported kernels' numerics (bit-exact with ``loopq.export``):
        transform in the kernels' summation order in fp32, weights folded in float64, fp16 weight scales,
        per-group integer GEMM. Slower and without gradients: for evaluating a calibrated student."""
        from loopq.kernels import reference

        tr = self.transform_for(slot)
        z = x.reshape(-1, self.in_features).float()
        if tr is not None:
            p1, p2, _, _ = tr.matrices()
            z = z * (-tr.log_d).exp() if tr.log_d is not None else z
            z = reference.kron_apply_ordered(z, p1, p2)
        a_codes, a_scales = quantize_codes(z, self.a_bits, self.group_size, self.act_clip_ratio(slot))
        weight = fold_weight(torch.cat(self.weights()), tr)
        w_codes, w_scales = quantize_codes(weight, self.w_bits, self.group_size, self.weight_clip_ratio(slot))
        y = reference.gemm(a_codes, a_scales, w_codes, w_scales.half(), torch.float32).to(x.dtype)
        bias = self._bias(x)
        y = y if bias is None else y + bias
        return tuple(y.reshape(*x.shape[:-1], -1).split(self.splits, dim=-1))

    def _bias(self, x: Tensor) -> Tensor | None:
        biases = self.biases()
        if all(b is None for b in biases):
            return None
        parts = [b if b is not None else x.new_zeros(n) for b, n in zip(biases, self.splits, strict=True)]
        return torch.cat(parts).to(x.dtype)

    # ------------------------------------------------------------------ SLT
    def promote(self) -> list[nn.Parameter]:
        """Make transform, weight clipping and activation clipping loop-dependent (SLT, §4.2).

        Per-loop copies start equal to the shared values, so the output is unchanged at the moment of
        promotion. The shared parameters stay registered (unused) so optimizer/checkpoint layouts stay stable.
        Returns the new parameters (to add to the optimizer).
        """
        if not self.looped:
            raise ValueError("only groups inside the loop can be promoted to loop-dependent")
        self._cache, self._cache_state = {}, None
        if self.promoted:
            return []
        new: list[nn.Parameter] = []
        if self.transform is not None:
            self.loop_transforms = nn.ModuleList(copy.deepcopy(self.transform) for _ in range(self.slots))
            new.extend(self.loop_transforms.parameters())
        if self.weight_clip.requires_grad:
            self.loop_weight_clip = nn.Parameter(self.weight_clip.detach().repeat(self.slots, 1))
            new.append(self.loop_weight_clip)
        if self.act_clip.numel() == 1 and self.act_clip.requires_grad:  # LAS off: promotion adds c_{t,l}
            self.act_clip = nn.Parameter(self.act_clip.detach().repeat(self.slots))
            self.act_clip_promoted = True
            new.append(self.act_clip)
        return new

    def promotion_parameters(self) -> list[nn.Parameter]:
        """The parameters :meth:`promote` created (empty before promotion)."""
        params = list(self.loop_transforms.parameters()) if self.loop_transforms is not None else []
        if self.loop_weight_clip is not None:
            params.append(self.loop_weight_clip)
        if self.act_clip_promoted:
            params.append(self.act_clip)
        return params

    # ------------------------------------------------------------------ perturbation
    @property
    def perturbable(self) -> bool:
        """A shared transform inside the loop: what a per-loop :meth:`perturb` applies to."""
        return self.transform is not None and self.looped and not self.promoted

    def perturb(self, perturbation: TransformPerturbation | None) -> None:
        """Set (or with None, remove) per-loop stand-ins for this group's shared transform matrices."""
        if perturbation is not None and not self.perturbable:
            raise ValueError("only a shared transform inside the loop can be perturbed per loop")
        self.perturbation = perturbation
        self._cache, self._cache_state = {}, None


def begin_forward(model: nn.Module, args: object) -> None:
    """Forward pre-hook of a student: every group computes its per-forward tensors before the loop starts."""
    for module in model.modules():
        if isinstance(module, QuantLinearGroup):
            module.begin_forward()


def _clip_param(shape: tuple[int, ...], learnable: bool) -> nn.Parameter:
    """Clipping logits; a non-learnable clip is a frozen ratio of exactly 1 (plain RTN)."""
    if learnable:
        return nn.Parameter(clip_logit(FULL_CLIP).expand(shape).clone())
    return nn.Parameter(torch.full(shape, float("inf")), requires_grad=False)
