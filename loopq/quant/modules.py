"""The fake-quant transform-weight group: the unit that LoopQ quantizes, scores and promotes.

For loop t, a group with input x and linears W_1..W_k computes (paper Eq. 3 with §4.1-4.2)

    y_i = Q_a(x P_t ; c_{t}) Q_w(W_i P_t^{-T} ; r_t)^T + b_i

* ``P_t`` is the group's Kronecker transform: shared across loops, or per loop once the group is *promoted*
  (SLT, §4.2);
* ``c_t`` is the activation clipping ratio: one per loop with LAS (§4.1), else one per group (per loop once
  promoted);
* ``r_t`` are per-output-row weight clipping ratios (shared, or per loop once promoted).

**Fixed parameter layout.** A looped group that SLT may promote (``quant.slt_budget > 0``) holds its per-loop slots
from construction on: ``loop_transforms[t]``, ``loop_weight_clip[t]`` and, without LAS, ``loop_act_clip[t]`` are
*offsets* (zero at the start) added to an anchor buffer ``slt_anchor`` that :meth:`QuantLinearGroup.promote`
fills with the shared values under ``no_grad`` (and flips the ``slt_promoted`` buffer). Loop t of a promoted group
then computes with ``anchor + offset_t`` - the same function of the offsets as an independent per-loop copy of the
shared parameters, with the same gradients (the optimizer steps the offsets at ``lr``, also the clip offsets:
``docs/design-notes.md``) - and the shared parameters stop being used. Nothing is ever added to or
removed from the parameter set: the optimizer, the LR schedule, DDP and DeepSpeed see one layout for the whole run,
and a resume is a plain ``load_state_dict`` (the anchors and flags are buffers in the state). Before promotion the
offsets receive a zero gradient (the calibration fills unused gradients with zeros, as DeepSpeed's ZeRO does), so with
no weight decay AdamW leaves them exactly at zero until the promotion.

**Per-use weight backward** (``GroupOptions.per_use_backward``, the default). Each use of a group (one per loop)
multiplies by the quantized weight inside :class:`_QuantizedUse`, which keeps nothing weight-sized for backward: its
backward recomputes the group's weight chain Q_w(W P^{-T}; r) (:func:`weight_chain`) from the frozen weights and the
small chain inputs (P1^-1, P2^-1, log d, clip logits), pushes this use's weight gradient through it at once and
returns the chain inputs' gradients (transform-sized). No weight-sized tensor is kept for autograd across layers or
loops, nor summed over loops; the no-grad quantized weight of each distinct slot is computed once per model forward
(:meth:`QuantLinearGroup.begin_forward`) and kept in the matmul's dtype. ``per_use_backward=False`` is plain autograd
through one quantized weight per slot (the reference the tests compare against).

**Per-loop gradients for SLT.** While :attr:`QuantLinearGroup.recorder` is set, every use routes the shared
transform's matrices through :class:`_LoopTap`, whose backward adds that loop's gradients w.r.t. (P1, P2, P1^-1,
P2^-1) to the recorder: the per-loop parts phi_{t,l} of §4.2 come out of the training step's own backward
(:mod:`loopq.calib.slt`).

The frozen full-precision weights are referenced, never copied per loop. Groups outside the loop (Parcae's
prelude/coda) have a single slot and receive ``t = None``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopq.models.base import LinearGroup
from loopq.qspec import at_least_fp32, quantize_codes
from loopq.quant.config import QuantConfig
from loopq.quant.fused import quantizers
from loopq.quant.primitives import clip_logit, clip_ratio
from loopq.quant.slots import loop_slot
from loopq.quant.transforms import KroneckerTransform, fold_weight, kron_apply

FULL_CLIP = 1.0 - 1e-4  # the initial learnable clipping ratio: no clipping
#: the chain inputs of one slot: P1^-1, P2^-1 (or None without transform), log d (or None), weight clip logits
ChainInputs = tuple[Tensor | None, Tensor | None, Tensor | None, Tensor]


class SlotTensors(NamedTuple):
    """The input-independent tensors of one parameter slot, computed once per forward."""

    mats: tuple[Tensor, Tensor, Tensor, Tensor] | None  # P1, P2, P1^-1, P2^-1
    chain: ChainInputs  # what the weight chain is computed from
    weight: Tensor  # transformed, fake-quantized [sum(out), in], fp32 (no graph with per-use backward)
    inv_d: Tensor | None  # e^{-log d}
    act_clip: Tensor  # c_t for every activation slot


@dataclass(frozen=True)
class GroupOptions:
    """How a group computes (not what it computes: the numbers are the same either way), fixed when it is built.

    ``compiled``: run the per-call quantizer chains as torch.compile-d functions (``model.compile_quantizers``);
    ``per_use_backward``: the per-use weight backward (module docstring); off, plain autograd keeps each slot's
    quantized weight with its chain's intermediates and the weight gradient summed over loops (the reference the
    tests compare the per-use backward against)."""

    compiled: bool = False
    per_use_backward: bool = True


def weight_chain(
    weights: list[Tensor],
    p1_inv: Tensor | None,
    p2_inv: Tensor | None,
    log_d: Tensor | None,
    clip_logits: Tensor,
    w_bits: int,
    group_size: int,
    compiled: bool = False,
) -> Tensor:
    """Q_w((W * d) (P1 (x) P2)^{-T}; r) for rows of the concatenated ``weights`` (Eq. 3's weight side), fp32."""
    weight = torch.cat([at_least_fp32(w) for w in weights])
    if p1_inv is not None and p2_inv is not None:
        if log_d is not None:
            weight = weight * log_d.exp()
        weight = kron_apply(weight, p1_inv.transpose(0, 1), p2_inv.transpose(0, 1))
    return quantizers(compiled)[1](weight, w_bits, group_size, clip_ratio(clip_logits).reshape(-1, 1, 1))


def widened(x: Tensor) -> Tensor:
    """The group's input in fp32 when a model cast to bf16/fp16 runs without autocast: its transform, activation
    quantization and matmul then run in fp32 as the calibration's did (x / d of SmoothQuant's small d leaves fp16's
    range otherwise), the output is cast back. ``x`` itself for fp32/fp64 inputs and under autocast."""
    if torch.is_autocast_enabled(x.device.type):
        return x
    return at_least_fp32(x)


class _QuantizedUse(torch.autograd.Function):
    """``F.linear(x, Q_w(...), bias)`` whose backward recomputes the weight chain and sends this use's weight
    gradient through it at once (module docstring). ``chain`` rebuilds the fp32 quantized weight from
    ``chain_inputs``; ``weight`` is the same value computed without a graph."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, chain: Callable[..., Tensor], *chain_inputs: Tensor
    ) -> Tensor:
        device = x.device.type
        ctx.autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.chain, ctx.device, ctx.x_dtype, ctx.x_shape = chain, device, x.dtype, x.shape
        ctx.present = [t is not None for t in chain_inputs]
        mm_x = x.to(ctx.autocast) if ctx.autocast is not None else x  # what the matmul reads (autocast's cast)
        # the weight in the matmul's dtype: under autocast the fp32 quantized input (``transform_activation``) would
        # otherwise widen the bf16 weight, which autocast then narrows again (two weight-sized casts, same values)
        y = F.linear(mm_x, weight.to(mm_x.dtype), bias)
        ctx.save_for_backward(mm_x, *[t for t in chain_inputs if t is not None])
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        mm_x, *saved = ctx.saved_tensors
        it = iter(saved)
        inputs = [next(it) if present else None for present in ctx.present]
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
        autocast = torch.autocast(ctx.device, ctx.autocast) if ctx.autocast is not None else contextlib.nullcontext()
        with torch.enable_grad(), autocast:
            weight = ctx.chain(*leaves).to(ctx.x_dtype)
            mm_weight = weight.to(mm_x.dtype)
        g = grad_y.reshape(-1, grad_y.shape[-1]).to(mm_x.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ mm_weight.detach()).reshape(ctx.x_shape).to(ctx.x_dtype)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads: dict[int, Tensor | None] = {}
        if wanted:
            grad_w = g.transpose(0, 1) @ mm_x.reshape(-1, mm_x.shape[-1])
            found = torch.autograd.grad(mm_weight, wanted, grad_w, allow_unused=True)
            grads = {id(t): d for t, d in zip(wanted, found, strict=True)}
        return grad_x, None, None, None, *[None if t is None else grads.get(id(t)) for t in leaves]


class _LoopTap(torch.autograd.Function):
    """Identity on (P1, P2, P1^-1, P2^-1) of one use; its backward adds the use's gradients to ``recorder``."""

    @staticmethod
    def forward(ctx: Any, recorder: LoopRecorder, slot: int, *mats: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.recorder, ctx.slot = recorder, slot
        return tuple(m.view_as(m) for m in mats)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        ctx.recorder.add(ctx.slot, grads)
        return None, None, *grads


class LoopRecorder:
    """Per-loop gradients of a shared transform's matrices (P1, P2, P1^-1, P2^-1), summed over a backward pass
    (set :attr:`QuantLinearGroup.recorder`; :mod:`loopq.calib.slt` turns them into phi_{t,l})."""

    def __init__(self, slots: int) -> None:
        self.grads: list[list[Tensor | None]] = [[None] * 4 for _ in range(slots)]

    def add(self, slot: int, grads: tuple[Tensor | None, ...]) -> None:
        row = self.grads[slot]
        for i, g in enumerate(grads):
            if g is not None:
                g = g.detach()
                row[i] = g.clone() if row[i] is None else row[i] + g


class QuantLinearGroup(nn.Module):
    """Fake-quant replacement of a :class:`LinearGroup` (same call: ``group(x, t) -> tuple of outputs``).

    It owns its buffers (the frozen weights), its quantization parameters (in the fixed layout of the module
    docstring) and its forward. The method's decisions live in the calibration code: *which* groups are promoted and
    when (:mod:`loopq.calib.reselection`), the per-loop gradients' scores (:mod:`loopq.calib.slt`); the group only
    offers :meth:`promote` and :attr:`recorder`."""

    def __init__(
        self,
        group: LinearGroup,
        config: QuantConfig,
        num_loops: int,
        looped: bool,
        options: GroupOptions | None = None,
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
        act_slots = self.slots if config.las else 1
        self.act_clip = _clip_param((act_slots,), config.learn_act_clip and config.a_bits < 16)
        self.weight_clip = _clip_param((1, out), config.learn_weight_clip and config.w_bits < 16)
        #: whether SLT may promote this group: its per-loop slots exist from the start (module docstring)
        self.promotable = looped and config.slt_budget > 0
        self.loop_transforms: nn.ModuleList | None = None
        self.loop_weight_clip: nn.Parameter | None = None
        self.loop_act_clip: nn.Parameter | None = None
        if self.promotable:
            self.slt_anchor = nn.Module()  # the shared values at promotion (buffers: no optimizer holds them)
            if self.transform is not None:
                self.loop_transforms = nn.ModuleList(_zero_offsets(self.transform) for _ in range(self.slots))
            self.loop_weight_clip = _offset_param((self.slots, out), self.weight_clip.requires_grad)
            if act_slots == 1:
                self.loop_act_clip = _offset_param((self.slots,), self.act_clip.requires_grad)
            for name, p in self.named_shared_parameters().items():
                self.slt_anchor.register_buffer(_anchor_name(name), torch.zeros(p.shape))
            self.register_buffer("slt_promoted", torch.zeros((), dtype=torch.bool))
        self._promoted = False  # mirrors the slt_promoted buffer (read every forward without a device sync)
        self.options = options or GroupOptions()
        #: set by SLT scoring: per-loop gradients of the shared transform's matrices are added to it
        self.recorder: LoopRecorder | None = None
        #: keep each slot's quantized weight for the forward (False: recompute it per call, e.g. while the setup's
        #: gradient-free forward streams through the groups; :func:`loopq.quant.prepare.init_clipping_from_data`)
        self.cache_weights = True
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
        return self._promoted

    def slot(self, t: int | None) -> int:
        """Loop index -> parameter slot; loops beyond the calibrated count reuse the last slot."""
        return loop_slot(t if self.looped else None, self.slots)

    def transform_values(self, slot: int) -> dict[str, Tensor] | None:
        """The transform's parameters in ``slot`` (anchor + offset_t once promoted), or None for the shared ones."""
        if not self._promoted or self.loop_transforms is None:
            return None
        offsets = dict(self.loop_transforms[slot].named_parameters())
        return {n: self._anchor(n) + offsets[n] for n, _ in self.transform.named_parameters()}

    def transform_for(self, slot: int) -> KroneckerTransform | None:
        """The transform ``slot`` computes with, as a module: the shared one, or a detached copy holding the
        promoted slot's values (for export and kernel numerics; the forward reads :meth:`transform_values`)."""
        values = self.transform_values(slot)
        if values is None:
            return self.transform
        tr = copy.deepcopy(self.transform)
        with torch.no_grad():
            for name, p in tr.named_parameters():
                p.copy_(values[name])
        return tr

    def act_clip_logits(self) -> Tensor:
        """Activation clipping logits, one per activation slot (per loop with LAS or once promoted)."""
        if self._promoted and self.loop_act_clip is not None:
            return self.slt_anchor.act_clip + self.loop_act_clip
        return self.act_clip

    def act_clip_ratio(self, slot: int) -> Tensor:
        """c_t of ``slot``; the same op as the forward (bit-identical)."""
        logits = self.act_clip_logits()
        return clip_ratio(logits)[loop_slot(slot, logits.numel())]

    def weight_clip_logits(self, slot: int) -> Tensor:
        if self._promoted and self.loop_weight_clip is not None:
            return self.slt_anchor.weight_clip + self.loop_weight_clip[slot : slot + 1]
        return self.weight_clip

    def weight_clip_ratio(self, slot: int) -> Tensor:
        return clip_ratio(self.weight_clip_logits(slot)).reshape(-1, 1, 1)

    # ------------------------------------------------------------------ forward
    def effective_weight_fp(self, slot: int) -> Tensor:
        """The transformed (not yet quantized) concatenated weight ``[sum(out), in]`` in fp32 for ``slot``."""
        tr = self.transform_for(slot)
        weight = torch.cat([at_least_fp32(w) for w in self.weights()])
        if tr is not None:
            _, _, p1_inv, p2_inv = tr.matrices()
            weight = tr.weight(weight, p1_inv, p2_inv)
        return weight

    # ------------------------------------------------------------------ per-forward cache
    # The transform matrices and the fake-quantized weight depend on the parameters and the slot only, not on
    # the input: a shared group has the same ones in every loop. They are computed once per model forward
    # (``begin_forward``, a forward pre-hook that ``prepare`` installs, i.e. *before* the loop and outside the
    # per-loop checkpointed bodies, whose recomputation then reuses them) and, in eval mode without gradients,
    # once per parameter version. Anything that changes a parameter in place bumps its version and invalidates.
    def _param_slot(self, slot: int) -> int:
        """Slot of the transform/weight: all loops share slot 0 unless promoted."""
        return slot if self._promoted else 0

    def _state_key(self) -> tuple:
        versions = tuple(p._version for p in self.parameters())
        return self.training, torch.is_grad_enabled(), self._promoted, versions

    def _slot_tensors(self, slot: int) -> SlotTensors:
        """Everything of ``slot`` that does not depend on the input, from the cache when valid."""
        key = self._param_slot(slot)
        state = self._state_key()
        if self._cache_state != state:
            self._cache = {}
            self._cache_state = state if self._cacheable() else None  # only begin_forward opens a training scope
        if key in self._cache:
            return self._cache[key]
        value = self._compute_slot(key)
        if self._cache_state is not None:
            self._cache[key] = value
        return value

    def _transform_tensors(self, slot: int) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor] | None, Tensor | None]:
        """((P1, P2, P1^-1, P2^-1), log d) of ``slot``: the shared transform's, or the promoted slot's values."""
        tr = self.transform
        if tr is None:
            return None, None
        values = self.transform_values(slot)
        if values is None:
            return tr.matrices(), tr.log_d
        mats, log_d = torch.func.functional_call(_Evaluate(tr), {f"tr.{k}": v for k, v in values.items()}, ())
        return mats, log_d

    def _compute_slot(self, slot: int) -> SlotTensors:
        mats, log_d = self._transform_tensors(slot)
        inv_d = None if log_d is None else (-log_d).exp()
        chain: ChainInputs = (
            None if mats is None else mats[2],
            None if mats is None else mats[3],
            log_d,
            self.weight_clip_logits(slot),
        )
        if self.options.per_use_backward and torch.is_grad_enabled():
            with torch.no_grad():
                weight = self._chain(*chain)
            device = weight.device.type
            if torch.is_autocast_enabled(device):  # the matmul reads it in this dtype: keep only that (same values)
                weight = weight.to(torch.get_autocast_dtype(device))
        else:
            weight = self._chain(*chain)
        return SlotTensors(mats, chain, weight, inv_d, clip_ratio(self.act_clip_logits()))

    def _chain(self, p1_inv: Tensor | None, p2_inv: Tensor | None, log_d: Tensor | None, clip: Tensor) -> Tensor:
        return weight_chain(self.weights(), p1_inv, p2_inv, log_d, clip, self.w_bits, self.group_size,
                            self.options.compiled)  # fmt: skip

    def begin_forward(self) -> None:
        """Compute every distinct slot's transform matrices and quantized weight for the coming model forward."""
        self._cache, self._cache_state = {}, None
        if self.kernel_numerics or self._cacheable() or not self.cache_weights:
            return  # the eval cache fills lazily and survives forwards
        if any(hasattr(p, "ds_id") for p in self.parameters()):
            return  # DeepSpeed ZeRO-3 gathers a module's parameters only inside its own forward: compute per call
        for key in sorted({self._param_slot(t) for t in range(self.slots)}):
            self._cache[key] = self._compute_slot(key)
        self._cache_state = self._state_key()

    def _cacheable(self) -> bool:
        return not self.training and not torch.is_grad_enabled() and self.cache_weights

    def train(self, mode: bool = True) -> QuantLinearGroup:
        self._cache, self._cache_state = {}, None
        return super().train(mode)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        self._cache, self._cache_state = {}, None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.promotable:
            self._promoted = bool(self.slt_promoted)

    def __getstate__(self) -> dict:
        """Copies (``copy.deepcopy``, pickling) never carry the cache: it may hold non-leaf autograd tensors."""
        state = self.__dict__.copy()
        state["_cache"], state["_cache_state"], state["recorder"] = {}, None, None
        return state

    def quantized_input(self, x: Tensor, slot: int, mats: tuple[Tensor, ...] | None = None) -> Tensor:
        """x P_t quantized with the loop's activation clipping (``mats``: the slot's matrices, e.g. tapped)."""
        cached = self._slot_tensors(slot)
        mats = cached.mats if mats is None else mats
        p1, p2 = mats[:2] if mats is not None else (None, None)
        clip = cached.act_clip[loop_slot(slot, cached.act_clip.numel())]
        return quantizers(self.options.compiled)[0](x, p1, p2, cached.inv_d, clip, self.a_bits, self.group_size)

    def forward(self, x: Tensor, t: int | None = None) -> tuple[Tensor, ...]:
        slot = self.slot(t)
        if self.kernel_numerics:
            return self.kernel_forward(x, slot)
        cached = self._slot_tensors(slot)
        mats, chain = cached.mats, cached.chain
        if mats is not None and self.recorder is not None and not self._promoted and torch.is_grad_enabled():
            mats = _LoopTap.apply(self.recorder, slot, *mats)
            chain = (mats[2], mats[3], *chain[2:])
        x_in = widened(x)
        xq = self.quantized_input(x_in, slot, mats)
        if self.options.per_use_backward and torch.is_grad_enabled():
            y = _QuantizedUse.apply(xq, cached.weight, self._bias(x_in), self._chain, *chain)
        else:
            y = F.linear(xq, cached.weight.to(x_in.dtype), self._bias(x_in))
        if x_in is not x:
            y = y.to(x.dtype)
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
    @torch.no_grad()
    def promote(self) -> None:
        """Make transform, weight clipping and activation clipping loop-dependent (SLT, §4.2): the anchors take the
        shared values and every loop computes with anchor + its offset (zero until then), so the output is unchanged
        at the moment of promotion. No parameter is created or removed (module docstring)."""
        if not self.promotable:
            raise ValueError("only groups inside the loop of a student with quant.slt_budget > 0 can be promoted")
        if self._promoted:
            return
        self._cache, self._cache_state = {}, None
        for name, p in self.named_shared_parameters().items():
            self._anchor(name).copy_(p)
        self.slt_promoted.fill_(True)
        self._promoted = True

    def promotion_parameters(self) -> list[nn.Parameter]:
        """The per-loop offsets that a promotion puts to use (they exist from the start)."""
        params = list(self.loop_transforms.parameters()) if self.loop_transforms is not None else []
        params += [p for p in (self.loop_weight_clip, self.loop_act_clip) if p is not None]
        return params

    def stored_shared(self) -> dict[str, Tensor]:
        """A promoted group's shared parameters as a student stores them (names relative to the group): the values
        it was promoted with, its anchors. Unused after the promotion, they still take AdamW's zero-gradient momentum
        steps, whose last digits differ between strategies and across a ZeRO-3 resume; stored so, the student does
        not depend on them. Empty for an unpromoted group."""
        return {name: self._anchor(name) for name in self.named_shared_parameters()} if self._promoted else {}

    def named_shared_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters every loop uses while the group is shared (unused once it is promoted), by name relative to
        the group; each has an anchor in a promotable group."""
        named = dict(self.transform.named_parameters(prefix="transform")) if self.transform is not None else {}
        named["weight_clip"] = self.weight_clip
        if self.loop_act_clip is not None:
            named["act_clip"] = self.act_clip
        return named

    def shared_parameters(self) -> list[nn.Parameter]:
        return list(self.named_shared_parameters().values())

    def _anchor(self, name: str) -> Tensor:
        return getattr(self.slt_anchor, _anchor_name(name))


class _Evaluate(nn.Module):
    """``torch.func.functional_call`` target: a transform's matrices and log d with substituted parameters."""

    def __init__(self, tr: KroneckerTransform) -> None:
        super().__init__()
        self.tr = tr

    def forward(self) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Tensor | None]:
        return self.tr.matrices(), self.tr.log_d


def begin_forward(model: nn.Module, args: object) -> None:
    """Forward pre-hook of a student: every group computes its per-forward tensors before the loop starts."""
    for module in model.modules():
        if isinstance(module, QuantLinearGroup):
            module.begin_forward()


def _anchor_name(name: str) -> str:
    """The anchor buffer's name of shared parameter ``name`` (relative to the group or to its transform)."""
    return name.removeprefix("transform.").replace(".", "_")


def _zero_offsets(transform: KroneckerTransform) -> KroneckerTransform:
    """A copy of ``transform`` whose parameters are zero offsets (same shapes and trainability)."""
    offsets = copy.deepcopy(transform)
    with torch.no_grad():
        for p in offsets.parameters():
            p.zero_()
    return offsets


def _offset_param(shape: tuple[int, ...], learnable: bool) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape), requires_grad=learnable)


def _clip_param(shape: tuple[int, ...], learnable: bool) -> nn.Parameter:
    """Clipping logits; a non-learnable clip is a frozen ratio of exactly 1 (plain RTN)."""
    if learnable:
        return nn.Parameter(clip_logit(FULL_CLIP).expand(shape).clone())
    return nn.Parameter(torch.full(shape, float("inf")), requires_grad=False)
