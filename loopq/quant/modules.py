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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopq.models.base import LinearGroup
from loopq.quant.config import QuantConfig
from loopq.quant.primitives import clip_logit, clip_ratio, fake_quant, quantize_codes
from loopq.quant.transforms import KroneckerTransform, fold_weight

FULL_CLIP = 1.0 - 1e-4  # the initial learnable clip ratio: no clipping


class QuantLinearGroup(nn.Module):
    """Fake-quant replacement of a :class:`LinearGroup` (same call: ``group(x, t) -> tuple of outputs``)."""

    def __init__(self, group: LinearGroup, config: QuantConfig, num_loops: int, looped: bool) -> None:
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
        self.probe: tuple[Tensor, Tensor] | None = None
        self.act_clip_promoted = False
        #: evaluate exactly as the exported kernels compute (see :meth:`kernel_forward`)
        self.kernel_numerics = False
        self._eval_cache: dict[int, tuple[Tensor, ...]] = {}

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
        return 0 if t is None or not self.looped else min(t, self.slots - 1)

    def transform_for(self, slot: int) -> KroneckerTransform | None:
        return self.loop_transforms[slot] if self.loop_transforms is not None else self.transform

    def act_clip_ratio(self, slot: int) -> Tensor:
        logits = self.act_clip
        return clip_ratio(logits[min(slot, logits.numel() - 1)])

    def weight_clip_ratio(self, slot: int) -> Tensor:
        logits = self.loop_weight_clip[slot : slot + 1] if self.loop_weight_clip is not None else self.weight_clip
        return clip_ratio(logits).reshape(-1, 1, 1)

    def transform_matrices(self, tr: KroneckerTransform, slot: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(P1, P2, P1^-1, P2^-1); in probe mode P_t = P + Delta_t with a zero Delta_t whose gradient is phi_t."""
        if self.probe is None:
            if self._cacheable():
                key = -1 - slot
                if key not in self._eval_cache:
                    self._eval_cache[key] = tr.matrices()
                return self._eval_cache[key]  # type: ignore[return-value]
            return tr.matrices()
        p1 = tr.left.matrix() + self.probe[0][slot]
        p2 = tr.right.matrix() + self.probe[1][slot]
        return p1, p2, torch.linalg.inv(p1), torch.linalg.inv(p2)

    # ------------------------------------------------------------------ forward
    def effective_weight_fp(self, slot: int) -> Tensor:
        """The transformed (not yet quantized) concatenated weight ``[sum(out), in]`` in fp32 for ``slot``."""
        tr = self.transform_for(slot)
        weight = torch.cat([w.float() for w in self.weights()])
        if tr is not None:
            _, _, p1_inv, p2_inv = self.transform_matrices(tr, slot)
            weight = tr.weight(weight, p1_inv, p2_inv)
        return weight

    def effective_weight(self, slot: int) -> Tensor:
        """The transformed, fake-quantized, concatenated weight ``[sum(out), in]`` (fp32) for ``slot``.

        In eval mode without gradients it is computed once per slot and cached (the parameters cannot change
        there); ``train()``, promotion and loading a state dict drop the cache."""
        if self._cacheable() and slot in self._eval_cache:
            return self._eval_cache[slot][0]
        weight = fake_quant(self.effective_weight_fp(slot), self.w_bits, self.group_size, self.weight_clip_ratio(slot))
        if self._cacheable():
            self._eval_cache[slot] = (weight,)
        return weight

    def _cacheable(self) -> bool:
        return not self.training and not torch.is_grad_enabled() and self.probe is None

    def train(self, mode: bool = True) -> QuantLinearGroup:
        self._eval_cache = {}
        return super().train(mode)

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        self._eval_cache = {}
        super()._load_from_state_dict(*args, **kwargs)  # type: ignore[arg-type]

    def quantized_input(self, x: Tensor, slot: int) -> Tensor:
        """x P_t quantized with the loop's activation clipping."""
        tr = self.transform_for(slot)
        if tr is not None:
            p1, p2, _, _ = self.transform_matrices(tr, slot)
            x = tr.activation(x, p1, p2)
        return fake_quant(x, self.a_bits, self.group_size, self.act_clip_ratio(slot))

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
        self._eval_cache = {}
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

    # ------------------------------------------------------------------ sharing-gap probe
    def start_probe(self) -> None:
        """Attach zero per-loop perturbations Delta_t of (P1, P2); their gradients are phi_{t,l} of §4.2."""
        if self.transform is None or self.promoted or not self.looped:
            self.probe = None
            return
        n1, n2 = self.transform.left.log_s.numel(), self.transform.right.log_s.numel()
        ref = self.transform.left.log_s
        self.probe = (
            torch.zeros(self.slots, n1, n1, device=ref.device, requires_grad=True),
            torch.zeros(self.slots, n2, n2, device=ref.device, requires_grad=True),
        )

    def probe_gradients(self) -> Tensor | None:
        """Per-loop gradients ``[T, n1^2 + n2^2]`` accumulated since :meth:`start_probe` (or None)."""
        if self.probe is None or self.probe[0].grad is None:
            return None
        g1, g2 = (d.grad.reshape(self.slots, -1) for d in self.probe)
        return torch.cat([g1, g2], dim=1).detach()

    def stop_probe(self) -> None:
        self.probe = None


def _clip_param(shape: tuple[int, ...], learnable: bool) -> nn.Parameter:
    """Clipping logits; a non-learnable clip is a frozen ratio of exactly 1 (plain RTN)."""
    if learnable:
        return nn.Parameter(clip_logit(FULL_CLIP).expand(shape).clone())
    return nn.Parameter(torch.full(shape, float("inf")), requires_grad=False)
