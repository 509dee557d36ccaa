"""The paper's static baselines as set-ups of one fake-quant group's transform (see :mod:`loopq.quant.config`).

Every baseline keeps the group's :class:`~loopq.quant.transforms.KroneckerTransform`,

    x' = (x / d) (P1 (x) P2),      W' = (W * d) (P1 (x) P2)^{-T},

and only chooses its factors and diagonal, so the fake-quant forward, the float64 fold and the exporter (which runs
1/d and P1, P2 online) serve all of them unchanged. One configuration is shared by every loop.

* **SmoothQuant** (Xiao et al., 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
  Language Models", Eq. 4): identity factors and d = s, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), with max|X_j|
  over all loops and tokens of a calibration batch of the FP teacher and max|W_j| over all linears of the group
  (:func:`smooth_scales`). For a group fed by an RMSNorm (``norm_feeds``) the division by s folds into the norm's
  weight, and for an MLP's down projection into the up projection's rows; the export keeps 1/d online for every
  group instead (one multiply per channel, the same numbers). Every quantized group is smoothed, not only the
  norm-fed ones as upstream: here the online diagonal costs the same everywhere.
* **QuaRot** (Ashkboos et al., 2024): frozen randomized Hadamard factors (:mod:`loopq.quant.hadamard`) and, for a
  norm-fed group, d = gamma of the feeding RMSNorm, so the quantized activation is the rotated *normalised* input -
  QuaRot fuses gamma into the next weights before rotating. Upstream rotates the residual stream once (fused into
  the weights) and adds online Hadamards before the down projection and across heads; here every group's input is
  rotated online by its own transform, which gives the same quantized activations for the norm-fed groups and the
  online-Hadamard ones for ``o_proj``/``down_proj``. Weights: RTN (upstream's QuaRot-RTN, not GPTQ) with per-row
  clipping ratios from an MSE grid search; activations: one clipping ratio per group from the same search on
  calibration data (:func:`loopq.quant.prepare.init_clipping_from_data`). Nothing is trained.
* **SpinQuant** (Liu et al., 2025): QuaRot's set-up with each factor a :class:`~loopq.quant.transforms.CayleyFactor`
  started at the randomized Hadamard; rotations and clipping are learned on the logit KL alone (``lam: 0``).

FlatQuant and LoopQ use the learnable :class:`~loopq.quant.transforms.FactorMatrix` factors and need no set-up here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopq.models.base import LoopLM
from loopq.quant.config import QuantConfig
from loopq.quant.hadamard import randomized_hadamard
from loopq.quant.modules import QuantLinearGroup
from loopq.quant.transforms import CayleyFactor, FixedFactor, KroneckerTransform, kron_factors

SCALE_FLOOR = 1e-5  # upstream SmoothQuant clamps the weight maxima and the scales at 1e-5


def smooth_scales(act_absmax: Tensor, weight_absmax: Tensor, alpha: float = 0.5) -> Tensor:
    """SmoothQuant's migration scales s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (Xiao et al., 2023, Eq. 4).

    After smoothing, max|X_j / s_j| = (max|X_j| max|W_j|)^(1 - alpha) and max|W_j s_j| = (max|X_j| max|W_j|)^alpha:
    alpha = 0.5 gives both sides the same range. Weight maxima and scales are floored at 1e-5 as upstream.
    """
    weight_absmax = weight_absmax.float().clamp_min(SCALE_FLOOR)
    return (act_absmax.float().pow(alpha) / weight_absmax.pow(1 - alpha)).clamp_min(SCALE_FLOOR)


def weight_absmax(group: QuantLinearGroup) -> Tensor:
    """max |W_ij| over the output rows of every linear of the group, per input channel j."""
    return torch.cat([w.detach().float().abs() for w in group.weights()]).amax(dim=0)


@torch.no_grad()
def input_absmax(model: LoopLM, input_ids: Tensor, names: list[str]) -> dict[str, Tensor]:
    """Per input channel max |x| of the named groups' inputs over every call (all loops, all tokens)."""
    found: dict[str, Tensor] = {}

    def recorder(name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            current = args[0].detach().float().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
            found[name] = torch.maximum(found[name], current) if name in found else current

        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(recorder(name)) for name in names]
    try:
        model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return found


@torch.no_grad()
def smooth_(
    groups: dict[str, QuantLinearGroup], teacher: LoopLM, input_ids: Tensor, alpha: float, median_floor: float = 0.0
) -> None:
    """Set every group's diagonal to SmoothQuant's scales from the FP ``teacher``'s activations on ``input_ids``.

    ``median_floor`` > 0 raises each channel's activation maximum to at least that fraction of the group's median
    first (0: upstream SmoothQuant). A channel silent on the calibration batch otherwise gets d ~ 1e-5, and any
    later input on it is multiplied by ~1e5 - harmless for a diagonal alone, ruinous once a learned transform mixes
    that channel into the others.
    """
    act = input_absmax(teacher, input_ids, list(groups))
    for name, group in groups.items():
        a = act[name].to(group.transform.log_d.device)
        if median_floor > 0:
            a = a.clamp_min(median_floor * float(a.median()))
        group.transform.log_d.copy_(smooth_scales(a, weight_absmax(group), alpha).log())


def _freeze_diagonal(transform: KroneckerTransform, norm_weight: Tensor | None) -> None:
    """d = |gamma| of the feeding RMSNorm (1 when the group is not norm-fed), frozen.

    |gamma| rather than gamma because d > 0 by construction (d = exp(log_d)); a negative gamma entry then leaves a
    sign flip of that channel in the activation, i.e. the normalised input is rotated by diag(sign gamma) P, still
    an orthogonal matrix. Zero entries are floored at 1e-6 (a dead channel: any d gives the same product).
    """
    with torch.no_grad():
        if norm_weight is not None:
            transform.log_d.copy_(norm_weight.detach().float().abs().clamp_min(1e-6).log())
    transform.log_d.requires_grad_(False)


def smoothquant_group(
    group: QuantLinearGroup, norm_weight: Tensor | None, config: QuantConfig, gen: torch.Generator
) -> None:
    """Identity factors; the diagonal stays 1 until :func:`smooth_` sets it from data (frozen either way)."""
    tr = group.transform
    n1, n2 = kron_factors(tr.n)
    eye = {"dtype": tr.log_d.dtype, "device": tr.log_d.device}
    tr.left, tr.right = FixedFactor(torch.eye(n1, **eye)), FixedFactor(torch.eye(n2, **eye))
    tr.log_d.requires_grad_(False)


def quarot_group(
    group: QuantLinearGroup, norm_weight: Tensor | None, config: QuantConfig, gen: torch.Generator
) -> None:
    """Frozen randomized Hadamard factors and d = gamma of the feeding norm."""
    tr = group.transform
    n1, n2 = kron_factors(tr.n)
    tr.left, tr.right = FixedFactor(randomized_hadamard(n1, gen)), FixedFactor(randomized_hadamard(n2, gen))
    _freeze_diagonal(tr, norm_weight)


def spinquant_group(
    group: QuantLinearGroup, norm_weight: Tensor | None, config: QuantConfig, gen: torch.Generator
) -> None:
    """Learned Cayley rotations started at QuaRot's randomized Hadamard, d = gamma of the feeding norm (frozen)."""
    tr = group.transform
    n1, n2 = kron_factors(tr.n)
    tr.left, tr.right = CayleyFactor(randomized_hadamard(n1, gen)), CayleyFactor(randomized_hadamard(n2, gen))
    _freeze_diagonal(tr, norm_weight)
