"""The one interface every looped language model implements.

A looped LM (paper §2, Eq. 1) embeds the input, optionally runs a non-looped *prelude*, then applies one
shared stack of L layers T times and reads out logits from the last loop state:

    H_{0,0} = Embed(X)
    for t in 0..T-1:   H_{t,0} = begin_loop(H_t)        # Parcae: state injection; identity elsewhere
                       H_{t,l} = f_l(H_{t,l-1}; t)      # the shared stack, loop index threaded down
                       H_{t+1} = end_loop(H_{t,L})      # Ouro: per-loop model.norm; identity elsewhere
                       H_{t+1} <- A_t(H_{t+1})          # transition hook (t < T-1): where CTA attaches
    Z = head(H_T)

Architecture files provide only their blocks, their config, the `begin_loop`/`end_loop`/`head` pieces and
their checkpoint key map. Everything that quantization needs is declared here as data:

* every quantizable projection lives in a :class:`LinearGroup` - a *transform-weight group* of paper
  Table 4 (linears that consume the same input activation and therefore share one transform);
* every group's forward receives the loop index ``t`` (``None`` for modules outside the loop);
* ``fp_module_patterns`` lists modules that must stay full precision.

Module names inside a model follow the native checkpoint names except that a group adds one path segment
(``self_attn.qkv_proj.q_proj``); :func:`internal_to_native_key` drops it again, generically.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from loopq.errors import LoopLMError
from loopq.files import atomic_write
from loopq.kernels import rowwise_kernel
from loopq.models.kv_cache import DecodeCache, DecodeStep, decode_step
from loopq.models.shards import write_weights

ConfigT = TypeVar("ConfigT")


@dataclass
class LayerCall:
    """One decoder-layer call of a forward: ``output = model.run_layer(name, inputs, t, ctx)`` (``t`` is None
    outside the loop). A shared layer is called once per loop, so it appears once per loop."""

    name: str
    t: int | None
    inputs: Tensor
    output: Tensor


@dataclass
class LoopLMOutput:
    """What a looped forward returns.

    ``loop_states[t]`` is the state handed from loop t to loop t+1 (before any transition adapter);
    ``transition_states[t] = A_t(loop_states[t])`` for t < T-1 when a transition hook is installed;
    ``layer_states[t][l]`` is H_{t,l}, the output of shared layer l in loop t (only when requested).
    """

    logits: Tensor
    loop_states: list[Tensor] | None = None
    transition_states: list[Tensor] | None = None
    layer_states: list[list[Tensor]] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class LinearGroup(nn.Module):
    """Linears that read the same activation: a transform-weight group (paper Table 4).

    In the full-precision model this is just the linears; ``loopq.quant.prepare`` swaps the whole group for a
    fake-quant group that transforms and quantizes the shared input once per call.
    """

    def __init__(self, **linears: nn.Linear) -> None:
        super().__init__()
        if not linears:
            raise ValueError("LinearGroup needs at least one linear")
        for name, linear in linears.items():
            self.add_module(name, linear)

    @property
    def names(self) -> list[str]:
        return list(self._modules)

    @property
    def in_features(self) -> int:
        return next(iter(self.children())).in_features  # type: ignore[return-value]

    def forward(self, x: Tensor, t: int | None = None) -> tuple[Tensor, ...]:
        """Apply every linear of the group to ``x``; ``t`` is the loop index (unused in full precision)."""
        return tuple(linear(x) for linear in self.children())


def internal_to_native_key(key: str, group_paths: Sequence[str]) -> str:
    """Drop the group segment from a parameter name: ``a.qkv_proj.q_proj.weight`` -> ``a.q_proj.weight``."""
    for path in group_paths:
        if key.startswith(path + "."):
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            rest = key[len(path) + 1 :]
            return f"{parent}.{rest}" if parent else rest
    return key


def rms_norm(x: Tensor, weight: Tensor | None, eps: float | None) -> Tensor:
    """RMSNorm computed in fp32 and cast back (the rule all three upstream models use). On a GPU without autograd
    through the call, one Triton launch of the same arithmetic (:mod:`loopq.kernels.rowwise_kernel`) instead of eight
    torch kernels."""
    if rowwise_kernel.applies(x, weight):
        return rowwise_kernel.rms_norm(x, weight, eps)
    return rms_norm_ops(x, weight, eps)


def rms_norm_ops(x: Tensor, weight: Tensor | None, eps: float | None) -> Tensor:
    """:func:`rms_norm` as torch ops on any device (autograd's path, and the references the kernels are tested
    against)."""
    dtype = x.dtype
    x32 = x.float()
    if eps is None:
        eps = torch.finfo(x32.dtype).eps
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(dtype)
    return y * weight if weight is not None else y


def add_norm(h: Tensor, norm: nn.Module, x: Tensor) -> Tensor:
    """``h + norm(x)``, a residual stream plus a normed branch (Ouro's sandwich norms): on a GPU without autograd, for
    an :class:`RMSNorm`, one launch with the same two roundings (:func:`loopq.kernels.rowwise_kernel.rms_norm`)."""
    hooked = norm._forward_hooks or norm._forward_pre_hooks  # a hook sees the module's own call
    if type(norm) is RMSNorm and not hooked and rowwise_kernel.residual_applies(h, x, norm.weight):
        return rowwise_kernel.rms_norm(x, norm.weight, norm.eps, residual=h)
    return h + norm(x)


class RMSNorm(nn.Module):
    """RMSNorm with a weight, as :func:`rms_norm`: Ouro and Parcae pass their config's eps; ``eps=None`` is
    ``torch.nn.RMSNorm``'s default (machine epsilon of the fp32 compute dtype), which LoopFormer uses."""

    def __init__(self, dim: int, eps: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Causal SDPA on ``[B, H, S, Dh]``; grouped-query K/V heads are repeated to match the query heads."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def attention(module: nn.Module, t: int | None, q: Tensor, k: Tensor, v: Tensor, ctx: dict[str, Any]) -> Tensor:
    """Causal attention of a decoder layer's ``module`` in loop ``t`` on ``[B, H, S, Dh]``: plain
    :func:`causal_attention` for a full forward; with a :class:`~loopq.models.kv_cache.DecodeStep` in ``ctx`` the new
    K/V first join the cache entry of (``t``, this layer), and the step's mask (causal, padding excluded) applies."""
    step: DecodeStep | None = ctx.get("step")
    if step is None:
        return causal_attention(q, k, v)
    if step.cache is not None:
        k, v = step.cache.extend(module, t, k, v)
    if q.shape[2] == 1:
        return single_query_attention(q, k, v, step.mask)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask)


def single_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention of one new token per row, ``q`` ``[B, H, 1, dh]``, over ``k``, ``v`` ``[B, H_kv, P, dh]`` where the
    bool ``mask`` ``[B, 1, 1, P]`` is True: a decode step's attention, as two matmuls and a softmax.

    Why not ``scaled_dot_product_attention``: for a single query on CUDA it dispatched to the cuDNN backend at ~2.6 ms
    of CPU per call (issue 28), more than the whole step's weight reads. The arithmetic is transformers' eager
    attention (scores in the input dtype, the softmax in at least fp32, probabilities cast back), with the scale
    applied to ``q`` (one row) instead of the scores. Grouped-query heads are not repeated: the query heads of one
    K/V head are rows of one matmul (query head i uses K/V head ``i // (H / H_kv)``, as ``repeat_interleave``)."""
    b, h, _, dh = q.shape
    kv_heads = k.shape[1]
    grouped = (q * dh**-0.5).reshape(b, kv_heads, h // kv_heads, dh)  # [B, H_kv, rep, dh]
    scores = torch.matmul(grouped, k.transpose(-1, -2))  # [B, H_kv, rep, P]
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)  # fp32 for bf16/fp16, float64 stays float64
    probs = torch.where(mask, scores, float("-inf")).softmax(dim=-1, dtype=softmax_dtype).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, h, 1, dh)


def config_from_native(config_class: type[ConfigT], native: Mapping[str, Any]) -> ConfigT:
    """The config dataclass from a native ``config.json`` dict: its fields by name; every other key is kept verbatim
    in the dataclass's ``extra`` field, so that :func:`config_to_native` writes it back."""
    from loopq.models.config_checks import check_config_types

    check_config_types(config_class, native)
    known = {f.name for f in fields(config_class)} - {"extra"}  # type: ignore[arg-type]
    kwargs = {k: v for k, v in native.items() if k in known}
    extra = {k: v for k, v in native.items() if k not in known}
    try:
        return config_class(**kwargs, extra=extra)
    except TypeError as err:
        arch = config_class.__name__.removesuffix("Config")
        raise LoopLMError(f"config.json: invalid {arch} config ({err})") from err


def config_to_native(config: Any, tags: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`config_from_native`: the kept keys, the fields, then the architecture's marker ``tags``."""
    data = asdict(config)
    extra = data.pop("extra")
    return {**extra, **data, **tags}


def dtype_problem(tensor: Tensor, want: Tensor) -> str | None:
    """Why a stored tensor cannot fill the model's ``want``: it must be floating point where ``want`` is (any float
    dtype: it is cast on load) and integer where ``want`` is; None when it can."""
    if tensor.is_floating_point() == want.is_floating_point():
        return None
    expected = "a floating-point dtype (float32, bfloat16 or float16)" if want.is_floating_point() else want.dtype
    return f"is stored as {tensor.dtype} but the model expects {expected}"


class LoopLM(nn.Module):
    """Base class of all looped LMs; see the module docstring for the recurrence."""

    arch: ClassVar[str] = ""
    #: set on a quantized copy by ``loopq.quant.prepare`` / ``loopq.export.load_quantized`` (a ``QuantConfig``;
    #: typed loosely because the models layer sits below the quantization layer) and its calibrated loop count
    quant_config: Any = None
    calibrated_loops: int | None = None
    #: glob patterns (fnmatch on module names) of modules that must never be quantized
    fp_module_patterns: ClassVar[tuple[str, ...]] = ()
    #: per layer: RMSNorm (with a weight) -> the group whose input it produces (outlier/smoothing folds)
    norm_feeds: ClassVar[dict[str, str]] = {}
    #: the part of ``norm_feeds`` whose norm output may feed nothing but its group: an exported model folds those
    #: norms into the group's quantizer launch where :meth:`feeds_only_its_group` holds
    #: (:func:`loopq.quant.packed.fold_feeding_norms`)
    exclusive_norm_feeds: ClassVar[dict[str, str]] = {}
    #: the config dataclass (native ``config.json`` keys as fields, all other keys kept in its ``extra`` field)
    config_class: ClassVar[type[Any]]
    #: keys that mark a native ``config.json`` as this architecture's; written on save, checked by :meth:`matches`
    config_tags: ClassVar[dict[str, str]] = {}
    #: config fields whose sum is the number of stored layers (bounded by the weight files before building:
    #: :func:`loopq.models.config_checks.check_layer_count`)
    layer_count_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.transition: nn.Module | None = None
        self.checkpoint_loops = False

    # ----------------------------------------------------------------- architecture hooks
    @property
    def default_num_loops(self) -> int:
        raise NotImplementedError

    @property
    def state_dim(self) -> int:
        """Width of the loop state handed between loops (where transition adapters act)."""
        raise NotImplementedError

    @property
    def loop_layers(self) -> nn.ModuleList:
        """The shared stack f_1..f_L that is applied once per loop."""
        raise NotImplementedError

    def embed(self, input_ids: Tensor, num_loops: int, **kwargs: Any) -> tuple[Tensor, dict[str, Any]]:
        """Return H_0 (the state entering loop 0) and a context dict shared by all loops."""
        raise NotImplementedError

    def begin_loop(self, h: Tensor, t: int, ctx: dict[str, Any]) -> Tensor:
        return h

    def end_loop(self, h: Tensor, t: int, ctx: dict[str, Any]) -> Tensor:
        return h

    def head(self, h: Tensor, ctx: dict[str, Any]) -> Tensor:
        raise NotImplementedError

    def finalize(self, out: LoopLMOutput, ctx: dict[str, Any]) -> LoopLMOutput:
        """Architecture-specific extra outputs (Ouro's exit gate); default: nothing."""
        return out

    @property
    def max_positions(self) -> int:
        """The longest sequence (prompt + generated tokens) the model has positions for."""
        raise NotImplementedError

    # ----------------------------------------------------------------- the recurrence
    def forward(
        self,
        input_ids: Tensor,
        num_loops: int | None = None,
        return_trajectory: bool = False,
        return_layer_states: bool = False,
        cache: DecodeCache | None = None,
        attention_mask: Tensor | None = None,
        **kwargs: Any,
    ) -> LoopLMOutput:
        """Run ``num_loops`` loops (default: the trained count) over ``input_ids`` ``[B, S]``.

        ``cache`` (:class:`~loopq.models.kv_cache.LoopKVCache`): ``input_ids`` are the tokens after the cached ones;
        their K/V are appended to it. ``attention_mask`` ``[B, S]`` (1 = token, 0 = left padding): positions count
        real tokens only. Without both, this is the plain full forward."""
        num_loops = self.resolve_num_loops(num_loops, **kwargs)
        if input_ids.dim() != 2:
            raise LoopLMError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        step = self.prepare_decode(input_ids, cache, attention_mask)
        h, ctx = self.embed(input_ids, num_loops, **kwargs, **({} if step is None else {"step": step}))
        ctx["num_loops"] = num_loops
        states: list[Tensor] = []
        transitions: list[Tensor] = []
        layer_states: list[list[Tensor]] | None = [] if return_layer_states else None
        for t in range(num_loops):
            h, per_layer = self._run_loop(h, t, ctx, return_layer_states)
            states.append(h)
            if layer_states is not None:
                layer_states.append(per_layer)
            if self.transition is not None and t < num_loops - 1:
                h = self.transition(h, t)
                transitions.append(h)
        ctx["loop_states"] = states
        out = LoopLMOutput(
            logits=self.head(states[-1], ctx),
            loop_states=states if return_trajectory else None,
            transition_states=transitions if (return_trajectory and self.transition is not None) else None,
            layer_states=layer_states,
        )
        if cache is not None and step is not None:
            cache.advance(step)  # after the head: Parcae's coda layers append to the cache there
        return self.finalize(out, ctx)

    def prepare_decode(
        self, input_ids: Tensor, cache: DecodeCache | None, attention_mask: Tensor | None
    ) -> DecodeStep | None:
        """The cached / padded forward's positions and mask, or None for the plain full forward."""
        if cache is not None:
            cache.check(self, input_ids)
            return cache.step(attention_mask, input_ids)
        if attention_mask is None:
            return None
        b = input_ids.shape[0]
        none_past = torch.zeros(b, 0, dtype=torch.bool, device=input_ids.device)
        return decode_step(input_ids, attention_mask, none_past, input_ids.new_zeros(b), None)

    def resolve_num_loops(self, num_loops: int | None, **kwargs: Any) -> int:
        """The loop count of a forward call: ``num_loops``, else the trained count. ``kwargs`` are the forward's
        architecture arguments, for architectures where they fix the count (LoopFormer's ``steps``)."""
        n = self.default_num_loops if num_loops is None else num_loops
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise LoopLMError(f"num_loops must be an integer >= 1, got {num_loops!r}")
        return n

    def _run_loop(self, h: Tensor, t: int, ctx: dict[str, Any], keep: bool) -> tuple[Tensor, list[Tensor]]:
        """One loop; with ``checkpoint_loops`` (training) every (loop, layer) call is checkpointed on its own: only
        each layer's input is kept, and the backward recomputes one layer at a time."""
        if self.checkpoint_loops and torch.is_grad_enabled() and not keep:
            h = self.begin_loop(h, t, ctx)
            for layer in self.loop_layers:
                h = checkpoint(layer, h, t, ctx, use_reentrant=False)
            return self.end_loop(h, t, ctx), []
        return self.loop_body(h, t, ctx, keep)

    def loop_body(self, h: Tensor, t: int, ctx: dict[str, Any], keep: bool) -> tuple[Tensor, list[Tensor]]:
        """Loop ``t`` on state ``h``: begin_loop, the shared stack, end_loop (no transition adapter); with ``keep``
        also every layer's output. Callers that drive the loops themselves (early exit) use it with the context of
        :meth:`embed` and :meth:`prepare_decode`."""
        per_layer: list[Tensor] = []
        h = self.begin_loop(h, t, ctx)
        for layer in self.loop_layers:
            h = layer(h, t, ctx)
            if keep:
                per_layer.append(h)
        return self.end_loop(h, t, ctx), per_layer

    # ----------------------------------------------------------------- single layers (layer-wise calibration)
    def decoder_layers(self) -> dict[str, nn.Module]:
        """Every decoder layer ``layer(h, t, ctx) -> h`` by module name, in call order: the shared stack, plus
        the layers outside the loop where an architecture has them (Parcae's prelude and coda)."""
        prefix = self.loop_layers_prefix
        return {f"{prefix}.{i}": layer for i, layer in enumerate(self.loop_layers)}

    def run_layer(self, name: str, h: Tensor, t: int | None, ctx: dict[str, Any]) -> Tensor:
        """Decoder layer ``name`` on a given input ``h`` in loop ``t`` with a forward's context ``ctx`` (RoPE
        tables, LoopFormer's loop conditioning, Parcae's value embeddings; see :meth:`trace_layers`)."""
        return self.get_submodule(name)(h, t, ctx)

    def trace_layers(
        self, input_ids: Tensor, num_loops: int | None = None, **kwargs: Any
    ) -> tuple[LoopLMOutput, list[LayerCall], dict[str, Any]]:
        """A forward that records every decoder-layer call (name, loop, input, output) in order, and its context.

        ``run_layer(c.name, c.inputs, c.t, ctx)`` recomputes ``c.output``: with a quantized copy of the model in
        place of ``self`` it is the teacher-forced layer of FlatQuant-style layer-wise calibration.
        """
        calls: list[LayerCall] = []
        context: dict[str, Any] = {}

        def recorder(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
                h, t, ctx = args
                calls.append(LayerCall(name, t, h, output))
                context["ctx"] = ctx

            return hook

        handles = [layer.register_forward_hook(recorder(name)) for name, layer in self.decoder_layers().items()]
        try:
            out = self(input_ids, num_loops, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return out, calls, context["ctx"]

    # ----------------------------------------------------------------- quantization metadata
    def feeds_only_its_group(self, norm_path: str) -> bool:
        """Whether the norm at ``norm_path`` (an ``exclusive_norm_feeds`` entry) feeds its group and nothing else in
        this instance (an architecture whose layers differ overrides it)."""
        return True

    def feeding_norm(self, group_name: str) -> nn.Module | None:
        """The RMSNorm whose output is group ``group_name``'s input (from ``norm_feeds``), or None."""
        for norm, group in self.norm_feeds.items():
            if group_name == group or group_name.endswith("." + group):
                return self.get_submodule(group_name[: len(group_name) - len(group)] + norm)
        return None

    def linear_groups(self) -> dict[str, LinearGroup]:
        """Every transform-weight group by module name (looped and non-looped)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, LinearGroup)}

    def looped_group_names(self) -> list[str]:
        """Names of the groups inside the shared stack (those that see a loop index)."""
        prefix = self.loop_layers_prefix + "."
        return [name for name in self.linear_groups() if name.startswith(prefix)]

    @property
    def loop_layers_prefix(self) -> str:
        for name, module in self.named_modules():
            if module is self.loop_layers:
                return name
        raise RuntimeError("loop_layers is not a submodule")

    # ----------------------------------------------------------------- native checkpoint format
    @classmethod
    def matches(cls, config: Mapping[str, Any]) -> bool:
        """Whether a native ``config.json`` belongs to this architecture (default: it carries ``config_tags``)."""
        return bool(cls.config_tags) and all(config.get(k) == v for k, v in cls.config_tags.items())

    @classmethod
    def config_from_dict(cls, config: Mapping[str, Any]) -> Any:
        return config_from_native(cls.config_class, config)

    def config_to_dict(self) -> dict[str, Any]:
        return config_to_native(self.config, self.config_tags)

    @classmethod
    def from_config(cls, config: Any | Mapping[str, Any], seed: int | None = None) -> LoopLM:
        """A randomly initialised model (``seed`` makes the init reproducible)."""
        if isinstance(config, Mapping):
            config = cls.config_from_dict(config)
        with torch.random.fork_rng(enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            model = cls(config)
            model.reset_parameters()
        return model

    def reset_parameters(self) -> None:
        """Default init: N(0, :meth:`init_std`) matrices and embeddings, unit norms, zero biases."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=self.init_std(name))
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def init_std(self, name: str) -> float:
        """Std of the normal init of the matrix or embedding parameter ``name`` (default 0.02)."""
        return 0.02

    def export_native(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Architecture-specific renames after group segments are dropped (e.g. a ``gpt.`` prefix)."""
        return state

    def import_native(self, native: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
        """Inverse of :meth:`export_native`; may validate redundant tensors (tied copies, RoPE tables)."""
        return dict(native)

    def native_state_dict(self) -> dict[str, Tensor]:
        """The state dict under the architecture's published key names."""
        groups = list(self.linear_groups())
        plain = {internal_to_native_key(k, groups): v for k, v in self.state_dict().items()}
        return self.export_native(plain)

    def derived_buffers(self) -> dict[str, tuple[Tensor, str]]:
        """Buffers a published checkpoint may carry although ``config.json`` determines them (RoPE inverse frequencies),
        by native key: the values the config implies and the config keys that imply them. Loading accepts exactly these
        keys, only with these values (to the checkpoint dtype's precision), and then drops them. Default: none."""
        return {}

    def load_native_state_dict(
        self, native: Mapping[str, Tensor], source: str = "<state dict>", origins: Mapping[str, Any] | None = None
    ) -> None:
        """Strictly load a native state dict (copying into this model's parameters); a missing, unexpected or
        misshapen tensor raises naming ``source`` (or the file ``origins`` gives for that key)."""
        self.load_state_dict(self.match_native(native, source, origins), strict=True)

    @classmethod
    def from_native(
        cls,
        config: Any,
        native: Mapping[str, Tensor],
        source: str = "<state dict>",
        dtype: torch.dtype = torch.float32,
        origins: Mapping[str, Any] | None = None,
    ) -> LoopLM:
        """A model whose parameters are the checkpoint's tensors in ``dtype`` (checked as by :meth:`match_native`).

        The model is built on the meta device and each tensor is cast (or copied) once into its parameter, so loading
        holds the checkpoint plus one model in ``dtype``: no random init, and a bf16 checkpoint loaded in bf16 never
        has an fp32 copy. Tied parameters are tied again after the assignment."""
        with torch.device("meta"):
            model = cls(config)
        tied = model.tied_parameter_names()
        state: dict[str, Tensor] = {}
        copies: dict[int, Tensor] = {}  # a tensor stored once for two tied names is copied once
        for key, value in model.match_native(native, source, origins).items():
            if id(value) not in copies:
                copies[id(value)] = value.to(dtype, copy=True) if value.is_floating_point() else value.clone()
            state[key] = copies[id(value)]
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_parameters(tied)
        return model

    def tied_parameter_names(self) -> list[list[str]]:
        """Names of each parameter registered under more than one name (tied weights), the first the owner."""
        names: dict[int, list[str]] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        return [group for group in names.values() if len(group) > 1]

    def tie_parameters(self, tied: list[list[str]]) -> None:
        """Make every name of each group (owner first, as :meth:`tied_parameter_names` gives) the owner's parameter;
        refuse a model left with a tensor on the meta device (one no checkpoint tensor was assigned to)."""
        for owner, *aliases in tied:
            for alias in aliases:
                module, _, name = alias.rpartition(".")
                setattr(self.get_submodule(module), name, self.get_parameter(owner))
        left = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"{type(self).__name__}: tensors not set by the checkpoint: {left[:4]}")

    def match_native(
        self, native: Mapping[str, Tensor], source: str = "<state dict>", origins: Mapping[str, Any] | None = None
    ) -> dict[str, Tensor]:
        """A native state dict under this model's own parameter names, after every check of a strict load: the
        architecture's :meth:`import_native`, the :meth:`derived_buffers` allow-list, then exactly the expected keys
        with the expected shapes. Errors are one line naming the file (``origins[key]``, else ``source``)."""
        native = self.import_native(native, source)
        native = self._drop_derived_buffers(native, source, origins or {})
        groups = list(self.linear_groups())
        own = self.state_dict()
        by_native = {internal_to_native_key(k, groups): k for k in own}
        missing = sorted(set(by_native) - set(native))
        unexpected = sorted(set(native) - set(by_native))
        if missing or unexpected:
            raise LoopLMError(
                f"{source}: checkpoint keys do not match the {self.arch} architecture "
                f"(missing: {missing[:8]}{'...' if len(missing) > 8 else ''}; "
                f"unexpected: {_located(unexpected[:8], source, origins)}{'...' if len(unexpected) > 8 else ''}); "
                "check that config.json describes these weights"
            )
        for nkey, tensor in native.items():
            want = own[by_native[nkey]]
            if tuple(tensor.shape) != tuple(want.shape):
                raise LoopLMError(
                    f"{(origins or {}).get(nkey, source)}: tensor {nkey!r} has shape {tuple(tensor.shape)} but "
                    f"config.json implies {tuple(want.shape)}; the config does not describe these weights"
                )
            problem = dtype_problem(tensor, want)
            if problem is not None:
                raise LoopLMError(
                    f"{(origins or {}).get(nkey, source)}: tensor {nkey!r} {problem}; this file was not written as the "
                    "model's weights: re-download or re-convert it"
                )
        return {by_native[k]: v for k, v in native.items()}

    def _drop_derived_buffers(
        self, native: Mapping[str, Tensor], source: str, origins: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        """``native`` without the :meth:`derived_buffers` it carries, each checked against the config's values."""
        allowed = self.derived_buffers()
        state = dict(native)
        for key in sorted(set(state) & set(allowed)):
            got = state.pop(key)
            want, implied_by = allowed[key]
            if not same_values(got, want):
                raise LoopLMError(
                    f"{origins.get(key, source)}: {key!r} (shape {tuple(got.shape)}) is not what config.json implies "
                    f"({implied_by}: shape {tuple(want.shape)}); these weights were trained with another config: "
                    "fix config.json"
                )
        return state

    def save_pretrained(self, directory: str | Path, max_shard_size: int | str | None = None) -> Path:
        """Write ``config.json`` + weights in the native format (readable by :func:`load_looplm`), each tensor in its
        own dtype. ``max_shard_size`` (bytes, or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` as ``transformers`` reads it)
        splits weights that exceed it into ``model-0000i-of-0000n.safetensors`` shards plus
        ``model.safetensors.index.json``; by default they go to one ``model.safetensors``."""
        directory = Path(directory)
        state: dict[str, Tensor] = {}
        seen: set[int] = set()
        for key, value in self.native_state_dict().items():
            value = value.detach().cpu().contiguous()
            if value.data_ptr() in seen:  # safetensors cannot alias: tied copies are stored twice
                value = value.clone()
            seen.add(value.data_ptr())
            state[key] = value
        write_weights(directory, state, max_shard_size)
        atomic_write(directory / "config.json", lambda p: p.write_text(self.config_json() + "\n"))
        return directory

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def config_json(self) -> str:
        return json.dumps(self.config_to_dict(), indent=2, sort_keys=True)


def _located(keys: Sequence[str], source: str, origins: Mapping[str, Any] | None) -> str:
    """``['a', 'b']``, each key followed by the file holding it when that is not ``source`` (a shard)."""
    where = origins or {}
    return (
        "["
        + ", ".join(f"{k!r}" + (f" in {where[k]}" if str(where.get(k, source)) != source else "") for k in keys)
        + "]"
    )


def same_values(got: Tensor, want: Tensor, atol: float = 0.0) -> bool:
    """Whether a stored buffer holds ``want`` up to the rounding of the dtype it was stored in (4 eps of it,
    relative; a bf16 buffer moves by ~2e-3), or within ``atol`` (a table computed with other float ops upstream)."""
    if tuple(got.shape) != tuple(want.shape) or not got.is_floating_point():
        return False
    tol = 4 * torch.finfo(got.dtype).eps
    return torch.allclose(got.float(), want.to(got.dtype).float(), rtol=tol, atol=atol)
