"""``prepare(model, QuantConfig) -> student``: the fake-quant LoopQ student of a looped LM (torchao-style verb).

The student is a copy of the teacher in which every quantizable transform-weight group is swapped for a
:class:`QuantLinearGroup` and, with CTA on, the loop-boundary hook holds :class:`TransitionAdapters`. The
teacher's own parameters are frozen and *shared* (not copied) with the student by default: only quantization
parameters (transforms, clipping ratios, adapters) are trainable. The student keeps the teacher's forward
signature and outputs (logits, loop_states, ...).

``config.method`` picks how each group's transform starts (:data:`GROUP_SETUPS`: LoopQ's and FlatQuant's learnable
init, or a baseline's fixed factors from :mod:`loopq.quant.baselines`). The training-free baselines (RTN,
SmoothQuant, QuaRot) are finished by :func:`prepare_static`, which adds their data-dependent part and freezes them.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable

import torch
from torch import Tensor, nn

from loopq.models.base import LoopLM
from loopq.qspec import at_least_fp32
from loopq.quant import baselines
from loopq.quant.config import METHODS, QuantConfig, QuantConfigError
from loopq.quant.cta import TransitionAdapters
from loopq.quant.modules import GroupOptions, QuantLinearGroup, begin_forward
from loopq.quant.primitives import clip_errors, clip_grid, clip_logit, row_clip_errors

#: (group, weight of the RMSNorm feeding it or None, config, generator) -> sets up the group's transform in place
GroupSetup = Callable[[QuantLinearGroup, Tensor | None, QuantConfig, torch.Generator], None]


def is_fp_module(model: LoopLM, name: str) -> bool:
    """Whether ``name`` is declared full precision by the architecture (never quantized)."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in model.fp_module_patterns)


def check_group_sizes(model: LoopLM, config: QuantConfig) -> None:
    """Every quantized input dimension must split into whole groups."""
    if config.group_size == -1:
        return
    for name, group in model.linear_groups().items():
        if not is_fp_module(model, name) and group.in_features % config.group_size:
            raise QuantConfigError(
                f"quant.group_size={config.group_size} does not divide {name}'s input dimension "
                f"{group.in_features}; choose a divisor or -1 (per channel)"
            )


def prepare(
    model: LoopLM, config: QuantConfig, share_weights: bool = True, options: GroupOptions | None = None
) -> LoopLM:
    """Build the fake-quant student of ``model`` (the teacher is left untouched): every quantized group a
    :class:`QuantLinearGroup` computing as ``options`` say, CTA's adapters in the transition hook, and the
    quantization state :class:`~loopq.models.base.LoopLM` declares (``quant_config``, ``calibrated_loops``) filled."""
    check_group_sizes(model, config)
    num_loops = config.num_loops or model.default_num_loops
    memo = {id(p): p for p in model.parameters()} if share_weights else {}
    memo.update({id(b): b for b in model.buffers()} if share_weights else {})
    student = copy.deepcopy(model, memo)
    for p in student.parameters():
        p.requires_grad_(False)
    looped = set(student.looped_group_names())
    gen = torch.Generator().manual_seed(config.seed)
    for name, group in list(student.linear_groups().items()):
        if is_fp_module(student, name):
            continue
        qgroup = QuantLinearGroup(group, config, num_loops, looped=name in looped, options=options)
        norm = model.feeding_norm(name)
        GROUP_SETUPS[config.method](qgroup, None if norm is None else norm.weight, config, gen)
        qgroup.to(device=group_device(group))
        student.set_submodule(name, qgroup)
    if config.cta and num_loops >= 2:
        dim = student.state_dim
        student.transition = TransitionAdapters(dim, num_loops, config.cta_rank, seed=config.seed)
        student.transition.to(group_device(student))
    student.register_forward_pre_hook(begin_forward)  # per-forward transforms/weights, computed before the loop
    student.quant_config = config
    student.calibrated_loops = num_loops
    return student


def group_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def init_transform(group: QuantLinearGroup, how: str, gen: torch.Generator) -> None:
    """Identity, a random rotation (orthogonal factors, unit diagonal) or a random invertible transform."""
    tr = group.transform
    if tr is None or how == "identity":
        return
    with torch.no_grad():
        if how == "rotation":
            for factor in (tr.left, tr.right):
                factor.u.copy_(torch.randn(factor.u.shape, generator=gen, device=gen.device))
        else:
            tr.randomize_(gen)


def learnable_init(
    group: QuantLinearGroup, norm_weight: Tensor | None, config: QuantConfig, gen: torch.Generator
) -> None:
    """LoopQ's and FlatQuant's learnable factors, started as ``config.transform_init`` says."""
    init_transform(group, config.transform_init, gen)


GROUP_SETUPS: dict[str, GroupSetup] = {
    "loopq": learnable_init,
    "flatquant": learnable_init,
    "rtn": learnable_init,  # no transform: nothing to do
    "smoothquant": baselines.smoothquant_group,
    "quarot": baselines.quarot_group,
    "spinquant": baselines.spinquant_group,
}


def _no_data(teacher: LoopLM, student: LoopLM, input_ids: Tensor, config: QuantConfig) -> None:
    """RTN: nothing depends on data."""


def _smooth(teacher: LoopLM, student: LoopLM, input_ids: Tensor, config: QuantConfig) -> None:
    baselines.smooth_(quant_groups(student), teacher, input_ids, config.smooth_alpha)


def _search_clips(teacher: LoopLM, student: LoopLM, input_ids: Tensor, config: QuantConfig) -> None:
    init_clipping_from_data(student, input_ids)


#: the data-dependent part of the training-free baselines: (teacher, student, calibration ids, config) -> None
STATIC_INITS: dict[str, Callable[[LoopLM, LoopLM, Tensor, QuantConfig], None]] = {
    "rtn": _no_data,
    "smoothquant": _smooth,
    "quarot": _search_clips,
}


#: where a tied tensor lives: (the student's module, its buffer's name, the teacher's module, its tensor's name)
Tie = tuple[nn.Module, str, nn.Module, str]


def frozen_ties(teacher: nn.Module, student: nn.Module) -> list[Tie]:
    """The student's buffers that are the teacher's tensors (:func:`prepare` shares them: its frozen weights and
    biases are ``detach()``-ed views of the teacher's parameters, the deep copy keeps its buffers), found by storage,
    offset, shape, stride and dtype."""

    def key(t: Tensor) -> tuple:
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype

    owners = {}
    for module in teacher.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and not t.is_meta and t.untyped_storage().nbytes() > 0:  # meta: no storage to share
                owners.setdefault(key(t), (module, name))
    ties = []
    for module in student.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta and b.untyped_storage().nbytes() > 0 and key(b) in owners:
                ties.append((module, name, *owners[key(b)]))
    return ties


def frozen_names(root: nn.Module, teacher: nn.Module, student: nn.Module) -> list[str]:
    """Names, as ``root.named_parameters()`` / ``named_buffers()`` give them, of the frozen teacher's tensors and of
    the student's buffers that are views of them (:func:`frozen_ties`): what is the same on every process (read from
    the same files) and never changes during a calibration."""
    tied = {(id(module), name) for module, name, _, _ in frozen_ties(teacher, student)}
    owner = {id(m): prefix for prefix, m in root.named_modules()}
    teacher_prefix = owner[id(teacher)]
    names = [n for n, _ in root.named_parameters() if n.startswith(teacher_prefix + ".")]
    names += [n for n, _ in root.named_buffers() if n.startswith(teacher_prefix + ".")]
    for module in student.modules():
        names += [f"{owner[id(module)]}.{name}" for name in module._buffers if (id(module), name) in tied]
    return names


def apply_tied(teacher: nn.Module, student: nn.Module, apply: Callable[[], object]) -> None:
    """Run ``apply`` (an ``nn.Module._apply`` over both: ``.to(device)``, ``.cuda()``, ``.bfloat16()``, DeepSpeed's
    casts) with the student's frozen tensors converted once, as the teacher's. ``_apply`` converts every module's
    tensors separately, so the views :func:`prepare` shares became copies: the frozen weights held twice on a GPU
    (the first GPU run of the paper-shape check: its setup 2.64 GiB allocated against 1.6 GiB planned, the 8-layer
    teacher's 1.1 GiB more). The tied buffers are set aside (never converted, no transient copy) and, after it,
    point at what the teacher's tensors became."""
    ties = frozen_ties(teacher, student)
    for module, name, _, _ in ties:
        module._buffers[name] = None
    try:
        apply()
    finally:
        for module, name, owner, source in ties:
            module._buffers[name] = getattr(owner, source).detach()


def prepare_static(model: LoopLM, config: QuantConfig, input_ids: Tensor) -> LoopLM:
    """A training-free baseline student (RTN, SmoothQuant, QuaRot), calibrated on ``input_ids`` and frozen.

    SmoothQuant reads the FP teacher's activation maxima; QuaRot searches its clipping ratios on the student's own
    rotated activations (weights per row, activations per group); RTN uses no data.
    """
    if config.method not in STATIC_INITS:
        trained = sorted(m for m, spec in METHODS.items() if spec.trained)
        raise QuantConfigError(
            f"quant.method={config.method!r} is calibrated by training (python -m loopq.fit); prepare_static builds "
            f"{sorted(STATIC_INITS)} (trained: {trained})"
        )
    student = prepare(model, config)
    STATIC_INITS[config.method](model, student, input_ids, config)
    return student.requires_grad_(False).eval()


def quant_groups(student: nn.Module) -> dict[str, QuantLinearGroup]:
    """Every fake-quant group of a student by module name."""
    return {name: m for name, m in student.named_modules() if isinstance(m, QuantLinearGroup)}


def looped_quant_groups(student: nn.Module) -> dict[str, QuantLinearGroup]:
    """The fake-quant groups inside the shared stack (the candidates of SLT), in model order."""
    return {name: g for name, g in quant_groups(student).items() if g.looped}


def quant_state(student: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every quantization parameter and buffer of a student: the transforms' factors and
    diagonals, the clip logits, SLT's offsets and anchors, the CTA adapters - everything of a
    :class:`QuantLinearGroup` but its frozen ``*_weight``/``*_bias`` buffers, and every tensor of the adapters."""
    found = []
    for root in student.modules():
        if not isinstance(root, QuantLinearGroup | TransitionAdapters):
            continue
        frozen = {f"{n}_{kind}" for n in getattr(root, "names", []) for kind in ("weight", "bias")}
        for prefix, module in root.named_modules():
            if prefix and isinstance(module, QuantLinearGroup | TransitionAdapters):
                continue  # visited as its own root
            tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            found += [(module, n) for n, t in tensors if t is not None and not (module is root and n in frozen)]
    return found


def cast_student(
    model: nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> nn.Module:
    """``model.to(device, dtype)``, in place, keeping the quantization state (:func:`quant_state`) in fp32 when
    ``dtype`` is narrower than fp32: a bf16/fp16 evaluation then computes with the calibrated transforms and clips
    (their chains run in fp32, Eq. 2-3) rather than with their bf16 rounding. Only the frozen weights and the
    unquantized modules take ``dtype``. A teacher (no quantization state) is plainly cast."""
    narrow = dtype is not None and dtype.is_floating_point and torch.finfo(dtype).bits < 32
    kept = [(m, n, getattr(m, n)) for m, n in quant_state(model)] if narrow else []
    originals = [t.detach() for _, _, t in kept]  # the fp32 values, referenced across the cast
    model.to(device=device, dtype=dtype)
    with torch.no_grad():
        for (module, name, _), value in zip(kept, originals, strict=True):
            if not value.is_floating_point():
                continue
            current = getattr(module, name)
            fp32 = value.to(device=current.device, dtype=torch.promote_types(value.dtype, torch.float32))
            if isinstance(current, nn.Parameter):
                current.data = fp32
            else:
                setattr(module, name, fp32)
    for group in quant_groups(model).values():
        group._cache, group._cache_state = {}, None
    return model


def quant_parameters(student: nn.Module) -> list[nn.Parameter]:
    """All trainable quantization parameters (transforms, clips, adapters)."""
    return [p for p in student.parameters() if p.requires_grad]


DIAG_MEDIAN_FLOOR = 0.1


def init_diagonal_from_data(teacher: LoopLM, student: LoopLM, input_ids: Tensor, alpha: float) -> list[str]:
    """Start every *learnable* diagonal d at SmoothQuant's scales max|X_j|^alpha / max|W_j|^(1-alpha).

    FlatQuant's default initialisation of its per-channel scaling (``diag_init=sq_style``, alpha 0.3): the
    activation maxima are the FP ``teacher``'s on ``input_ids`` over all loops (d is one diagonal shared by every
    loop; the loop-dependent part is LAS's). Channels silent on the batch are floored at a tenth of their group's
    median maximum (:data:`DIAG_MEDIAN_FLOOR`) so unseen inputs on them are not blown up by the transform.
    Frozen diagonals (QuaRot/SpinQuant's gamma) are left alone. Returns the names of the groups it set.
    """
    groups = {
        name: g
        for name, g in quant_groups(student).items()
        if g.transform is not None and g.transform.log_d is not None and g.transform.log_d.requires_grad
    }
    if groups:
        baselines.smooth_(groups, teacher, input_ids, alpha, median_floor=DIAG_MEDIAN_FLOOR)
    return list(groups)


@torch.no_grad()
def init_clipping_from_data(student: LoopLM, input_ids: Tensor, max_tokens: int = 4096) -> dict[str, list[float]]:
    """Initialise every activation clip c_{t,l} from loop t's own activations, and weight clips per row.

    Runs the student once (transforms as initialised) and, at each group call, scores the loop slot's transformed
    input (``max_tokens`` of its tokens spread evenly over all of them: :func:`spread_rows`) against every ratio of
    the grid: the MSE-optimal clipping ratio per slot
    (LAS init: loop-dependent statistics give loop-dependent scales; without LAS the mean error over all slots).
    Streamed: a call's input is scored and dropped, and the groups compute their quantized weights per call, so the
    setup keeps neither the recorded inputs nor every group's quantized weight. Weight clips: per output row, the
    MSE-optimal ratio on the same grid. Returns the chosen activation ratios per group.
    """
    groups = quant_groups(student)
    errors: dict[str, dict[int, tuple[Tensor, int]]] = {name: {} for name in groups}
    handles = []
    for name, group in groups.items():
        group.cache_weights = False
        handles.append(group.register_forward_pre_hook(_scorer(name, group, errors, max_tokens)))
    try:
        student(input_ids)
    finally:
        for h in handles:
            h.remove()
        for group in groups.values():
            group.cache_weights = True
    chosen: dict[str, list[float]] = {}
    for name, group in groups.items():
        chosen[name] = _init_act_clip(group, errors[name])
        _init_weight_clip(group)
    return chosen


def _scorer(name: str, group: QuantLinearGroup, errors: dict[str, dict[int, tuple[Tensor, int]]], max_tokens: int):
    def hook(module: QuantLinearGroup, args: tuple) -> None:
        x, t = args[0], args[1] if len(args) > 1 else None
        slot = module.slot(t)
        tr = module.transform_for(slot)
        flat = x.reshape(-1, x.shape[-1])
        rows = spread_rows(flat.shape[0], max_tokens)
        if rows is not None:
            flat = flat.index_select(0, rows.to(flat.device))
        if tr is not None:
            p1, p2, _, _ = tr.matrices()
            # from fp32, as the training step (autocast or widened) and the export quantize it: a bf16 teacher's
            # input would otherwise come back rounded to bf16 (``transform_activation`` casts back to its dtype)
            flat = tr.activation(at_least_fp32(flat), p1, p2)
        if module.act_clip.requires_grad:
            errors[name][slot] = (clip_errors(flat.float(), module.a_bits, module.group_size), flat.numel())

    return hook


def spread_rows(n: int, max_rows: int) -> Tensor | None:
    """``max_rows`` row indices spread evenly over ``0..n-1`` (deterministic, first and last included), or None
    (every row) when ``n <= max_rows``: the clip search scores a bounded number of tokens from every calibration
    sample instead of the first samples only."""
    if n <= max_rows:
        return None
    return torch.linspace(0, n - 1, max_rows, dtype=torch.float64).round().long()


def _init_act_clip(group: QuantLinearGroup, per_slot: dict[int, tuple[Tensor, int]]) -> list[float]:
    if not group.act_clip.requires_grad or not per_slot:
        return []
    grid = clip_grid(per_slot[next(iter(per_slot))][0].device)
    ratios = []
    for i in range(group.act_clip.numel()):
        if group.act_clip.numel() > 1:
            err = (per_slot.get(i) or next(iter(per_slot.values())))[0]
        else:  # one clip for every loop: the mean error over all slots' elements
            total = sum(n for _, n in per_slot.values())
            err = sum(e.double() * n for e, n in per_slot.values()) / total
        ratios.append(float(grid[int(torch.argmin(err))]))
    group.act_clip.copy_(clip_logit(torch.tensor(ratios, device=group.act_clip.device)))
    return ratios


def _init_weight_clip(group: QuantLinearGroup, grid: Tensor | None = None) -> None:
    if not group.weight_clip.requires_grad:
        return
    weight = group.effective_weight_fp(0)
    grid = torch.linspace(0.55, 1.0, 10, device=weight.device) if grid is None else grid.to(weight.device)
    errors = row_clip_errors(weight, group.w_bits, group.group_size, grid)
    best = grid[errors.argmin(dim=0)]
    group.weight_clip.copy_(clip_logit(best).reshape(1, -1))
