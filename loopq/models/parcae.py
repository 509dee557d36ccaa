"""Parcae (Sandy Research, ``sandyresearch/parcae``): a prelude / recurrent core / coda transformer whose loop is a
stable *diagonal* linear state-space update with the prelude output injected every iteration.

Forward (upstream ``Parcae.forward`` with ``iterate_forward`` / ``core_block_forward``), inference mode::

    x   = wte(ids) * embed_scale
    e   = ln_prelude(prelude(x))                      # prelude blocks, not looped; ln_prelude iff prelude_norm
    h_0 = initial state                               # like-init: truncated normal draw, see below
    for r in 1..R:   u   = h_{r-1} * decay + dt * (e @ B^T)             # transformer.adapter (DiagonalInjection)
                     h_r = core_block[L-1](... core_block[0](u))        # the shared stack
    logits = lm_head(ln_f(coda(C(h_R)))).float() * logit_scale          # then optional tanh softcap

with ``dt = softplus(dt_bias)``, ``decay = exp(-dt * exp(A_log))`` (elementwise over the recurrent width, so the
update is contractive for any parameters). The loop state handed between loops is ``h_r``, the output of the last
core block, before the next injection and before ``transformer.C``.

One block (upstream ``TransformerPreNormBlock``)::

    h = h + c_proj(attn(norm_1(h)))       h = h + proj(act(fc(norm_2(h))))       act = ReLU2: 0.5 * relu(x)^2

Attention, in upstream order: q, k, v = c_q/c_k/c_v(x); value-embedding mixing on v (below); optional clip_qkv
clamp and qk_bias; RoPE on *interleaved* pairs (x[2i], x[2i+1]) rotated by the angle pos / base^(2i/dh), computed
in fp32 from the ``freqs_cis`` table [1, block_size, 1, dh/2, (cos, sin)]; then qk_norm = parameter-free RMS norm
over the head dim (``F.rms_norm`` with eps=None, i.e. the dtype's machine epsilon); causal SDPA with scale
1/sqrt(dh) and grouped K/V heads.

Value embeddings (nanochat-style): ``value_embeds[str(i)]`` exists for the *effective* block indices i (prelude j
-> j, core j -> P+j, coda j -> P+L+j, with E = P+L+C blocks) with i % 2 == (E-1) % 2; ``attn.ve_gate`` (32 -> kv
heads, no bias) exists for blocks whose *layer id* (prelude j, core P+j, coda P+L*mean_recurrence+j) has the parity
of n_layer-1, where n_layer = n_layers_in_recurrent_block * mean_backprop_depth. Only where both exist::

    v = v + 2 * sigmoid(ve_gate(x[..., :32]))[..., None] * value_embeds[i](ids).view(B, S, kv_heads, dh)

Core blocks use their own widths (recurrent_embedding_dimension, recurrent_intermediation_embedding_dimension,
recurrent_num_attention_heads for both query and K/V heads); ``B`` maps n_embd -> recurrent width and ``C`` maps it
back.

Initial state. Upstream draws it from the *global* RNG on every call (``initialize_state``); for ``like-init``::

    h_0 ~ TruncatedNormal(0, std^2) on [-3 std, 3 std],  std = init table "embedding" std (sqrt(2/(5 n_embd)) for
    the published scaled-zero init), times embed_scale

Here the same distribution is drawn from a private ``torch.Generator`` seeded with ``seed`` (default 0), in fp32 on
the CPU and then cast, so a forward is deterministic and never touches the global RNG; an explicit ``h0`` replaces
the draw entirely. Upstream also samples the loop count (Poisson) unless given; here it is always explicit
(default ``mean_recurrence``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopq.models.base import LinearGroup, LoopLM, LoopLMError, RMSNorm, attention, same_values
from loopq.models.kv_cache import DecodeStep

#: upstream ``CausalSelfAttention.ve_gate_channels``: the gate reads the first 32 channels of the block input
VE_GATE_CHANNELS = 32
STATE_INITS = ("like-init", "normal", "embed", "zero", "unit")
NONLINS: dict[str, Callable[[Tensor], Tensor]] = {
    "ReLU2": lambda x: F.relu(x).pow(2).mul(0.5),
    "GELU": F.gelu,
    "ReLU": F.relu,
    "SiLU": F.silu,
}
#: init_strategy -> dim -> (std of the "embedding" init, embed_scale, logit_scale), from upstream's factor table
_INIT_SCALES: dict[str, Callable[[int], tuple[float, float, float]]] = {
    **dict.fromkeys(
        ("scaled", "scaled-zero", "scaled-geiping", "scaled-stuck", "small"),
        lambda d: (math.sqrt(2 / (5 * d)), 1.0, 1.0),
    ),
    "takase": lambda d: (math.sqrt(2 / (5 * d)), math.sqrt(d), 1.0),
    "takase-scaled": lambda d: (math.sqrt(2 / (5 * d)), math.sqrt(d), math.sqrt(2 / 5) / math.sqrt(d)),
    "mitchell": lambda d: (1 / math.sqrt(d), 1.0, 1.0),
    "normal": lambda d: (1 / math.sqrt(d), 1.0, 1.0),
    **dict.fromkeys(("llama", "llama-by-dim", "scaled-large-embed", "illiterate"), lambda d: (1.0, 1.0, 1.0)),
    "llama-by-dim-ls": lambda d: (1.0, 1.0, 1 / math.sqrt(d)),
    "scaled-and-logit-scale": lambda d: (1.0, 1.0, 1 / math.sqrt(d)),
    **dict.fromkeys(("megatron", "bert"), lambda d: (0.02, 1.0, 1.0)),
}


def _default_rope_settings() -> dict[str, Any]:
    return {"use_rope": True, "rope_condense_ratio": 1, "rope_base": 50000}


@dataclass
class ParcaeConfig:
    """The ``ParcaeConfig`` fields that define the computation, with upstream's defaults; others kept verbatim."""

    name: str = ""
    block_size: int = 4096
    n_embd: int = 4096
    intermediate_size: int | None = None
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    vocab_size: int = 50254
    padding_multiple: int = 512
    padded_vocab_size: int | None = None
    rope_settings: dict[str, Any] = field(default_factory=_default_rope_settings)
    use_abacus: bool = False
    randomize_positions_from: int | None = None
    block_class_name: str = "TransformerPreNormBlock"
    norm_class_name: str = "LayerNorm"
    attn_impl: str = "flash"
    norm_eps: float = 1e-5
    mlp_class_name: str = "BaseMLP"
    nonlin_name: str = "GELU"
    bias: bool = False
    qk_bias: bool = False
    init_strategy: str = "scaled"
    mup_model_scaling_factor: int = 1
    use_fused_head: str = "pytorch"
    clip_qkv: float | None = None
    qk_norm: bool = False
    logit_softcap: float | None = None
    injection_type: str = "diagonal"
    n_layers_in_recurrent_block: int = 4
    n_layers_in_prelude: int = 1
    n_layers_in_coda: int = 1
    state_init: str = "like-init"
    recurrent_embedding_dimension: int = 1024
    recurrent_intermediation_embedding_dimension: int = 3520
    recurrent_num_attention_heads: int | None = None
    prelude_norm: bool = False
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    tie_embeddings: bool = False
    model_class_name: str = "Parcae"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rope_settings = {**_default_rope_settings(), **(self.rope_settings or {})}
        choices: list[tuple[str, Any, tuple[Any, ...]]] = [
            ("model_class_name", self.model_class_name, ("Parcae",)),
            ("block_class_name", self.block_class_name, ("TransformerPreNormBlock",)),
            ("norm_class_name", self.norm_class_name, ("RMSNorm",)),
            ("mlp_class_name", self.mlp_class_name, ("BaseMLP", "GatedMLP")),
            ("nonlin_name", self.nonlin_name, tuple(NONLINS)),
            ("injection_type", self.injection_type, ("diagonal",)),
            ("attn_impl", self.attn_impl, ("flash", "sdpa")),
            ("use_fused_head", self.use_fused_head, ("pytorch", "cce")),
            ("state_init", self.state_init, STATE_INITS),
            ("init_strategy", self.init_strategy, tuple(_INIT_SCALES)),
            ("mup_model_scaling_factor", self.mup_model_scaling_factor, (1,)),
            ("use_abacus", self.use_abacus, (False,)),
            ("causal", self.extra.get("causal", True), (True,)),
        ]
        for key, value, allowed in choices:
            if value not in allowed:
                raise LoopLMError(
                    f"config.json: {key}={value!r} is not supported by loopq's Parcae; use one of {allowed}"
                )
        if "gemma" in self.name.lower():
            raise LoopLMError(
                f"config.json: name={self.name!r} selects upstream's unit-offset (Gemma) RMSNorm; unsupported"
            )
        positive = ("n_embd", "num_attention_heads", "recurrent_embedding_dimension", "block_size", "mean_recurrence")
        for key in positive:
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise LoopLMError(f"config.json: {key} must be a positive integer, got {getattr(self, key)!r}")
        if self.n_embd % self.num_attention_heads or self.num_attention_heads % self.kv_heads:
            raise LoopLMError(
                "config.json: n_embd must be divisible by num_attention_heads, and num_attention_heads by "
                "num_key_value_heads"
            )
        if self.recurrent_embedding_dimension % self.recurrent_heads:
            raise LoopLMError(
                "config.json: recurrent_embedding_dimension must be divisible by recurrent_num_attention_heads "
                "(or num_attention_heads when that is null)"
            )
        if self.rope_settings["use_rope"] and self.recurrent_head_dim != self.head_dim:
            raise LoopLMError(
                "config.json: the core blocks' head dim (recurrent_embedding_dimension / recurrent_num_attention_heads"
                f" = {self.recurrent_head_dim}) must equal the RoPE head dim n_embd / num_attention_heads = "
                f"{self.head_dim}; upstream shares one freqs_cis table"
            )

    # ----------------------------------------------------------------- derived sizes (upstream __post_init__)
    @property
    def vocab(self) -> int:
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        return -(-self.vocab_size // self.padding_multiple) * self.padding_multiple

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.num_attention_heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or 4 * self.n_embd

    @property
    def recurrent_heads(self) -> int:
        return self.recurrent_num_attention_heads or self.num_attention_heads

    @property
    def recurrent_head_dim(self) -> int:
        return self.recurrent_embedding_dimension // self.recurrent_heads

    @property
    def n_layer(self) -> int:
        """Upstream's derived ``n_layer`` (decides which blocks own a ``ve_gate``)."""
        return self.n_layers_in_recurrent_block * self.mean_backprop_depth

    @property
    def rope_length(self) -> int:
        return self.randomize_positions_from or self.block_size

    @property
    def scales(self) -> tuple[float, float, float]:
        """(like-init std, embed_scale, logit_scale) of ``init_strategy``."""
        return _INIT_SCALES[self.init_strategy](self.n_embd)


def has_value_embedding(index: int, count: int) -> bool:
    """Upstream ``has_ve``: alternate blocks, always including the last one."""
    return index % 2 == (count - 1) % 2


@dataclass(frozen=True)
class BlockSpec:
    """Widths of one block (prelude/coda use the model widths, core blocks the recurrent ones)."""

    dim: int
    heads: int
    kv_heads: int
    mlp_width: int
    ve_gate: bool
    ve_key: str | None  # value embedding mixed into this block's values (needs a gate too)


def rope_table(head_dim: int, length: int, base: float, condense_ratio: float) -> Tensor:
    """Upstream ``precompute_freqs_cis``: fp32 ``[1, length, 1, head_dim/2, 2]`` of (cos, sin) per interleaved pair."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    positions = torch.arange(length, dtype=torch.float32, device="cpu") / condense_ratio
    angles = torch.outer(positions, inv_freq)
    return torch.stack([angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]], dim=4)


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate interleaved pairs of ``x`` ``[B, S, H, dh]`` by ``table`` ``[1, S, 1, dh/2, 2]``, in fp32."""
    pairs = x.unflatten(-1, (-1, 2)).float()
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = table[..., 0], table[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(3).to(x.dtype)


class ParcaeAttention(nn.Module):
    def __init__(self, c: ParcaeConfig, s: BlockSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dh = s.heads, s.kv_heads, s.dim // s.heads
        self.qk_norm, self.clip_qkv, self.use_rope = c.qk_norm, c.clip_qkv, c.rope_settings["use_rope"]
        self.qkv = LinearGroup(
            c_q=nn.Linear(s.dim, self.heads * self.dh, bias=c.bias),
            c_k=nn.Linear(s.dim, self.kv_heads * self.dh, bias=c.bias),
            c_v=nn.Linear(s.dim, self.kv_heads * self.dh, bias=c.bias),
        )
        self.out = LinearGroup(c_proj=nn.Linear(s.dim, s.dim, bias=c.bias))
        if c.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.heads, self.dh))
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, self.kv_heads, bias=False) if s.ve_gate else None

    def forward(self, x: Tensor, t: int | None, ctx: dict[str, Any], ve: Tensor | None) -> Tensor:
        rope = ctx["rope"]
        b, s, _ = x.shape
        q, k, v = self.qkv(x, t)
        q = q.view(b, s, self.heads, self.dh)
        k = k.view(b, s, self.kv_heads, self.dh)
        v = v.view(b, s, self.kv_heads, self.dh)
        if ve is not None and self.ve_gate is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate.unsqueeze(-1) * ve.view(b, s, self.kv_heads, self.dh)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(min=-self.clip_qkv, max=self.clip_qkv) for z in (q, k, v))
        if hasattr(self, "qk_bias"):
            q_bias, k_bias = self.qk_bias.split(1, dim=0)
            q, k = (q + q_bias).to(q.dtype), (k + k_bias).to(q.dtype)
        if self.use_rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.qk_norm:
            q, k = F.rms_norm(q, (self.dh,)), F.rms_norm(k, (self.dh,))
        y = attention(self, t, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx)
        return self.out(y.transpose(1, 2).reshape(b, s, -1), t)[0]


class ParcaeMLP(nn.Module):
    def __init__(self, c: ParcaeConfig, s: BlockSpec) -> None:
        super().__init__()
        self.gated = c.mlp_class_name == "GatedMLP"
        self.act = NONLINS[c.nonlin_name]
        self.up = LinearGroup(fc=nn.Linear(s.dim, s.mlp_width * (2 if self.gated else 1), bias=c.bias))
        self.down = LinearGroup(proj=nn.Linear(s.mlp_width, s.dim, bias=c.bias))

    def forward(self, x: Tensor, t: int | None) -> Tensor:
        h = self.up(x, t)[0]
        if self.gated:
            gate, lin = h.chunk(2, dim=-1)
            h = self.act(gate) * lin
        else:
            h = self.act(h)
        return self.down(h, t)[0]


class ParcaeBlock(nn.Module):
    """Upstream ``TransformerPreNormBlock``; ``forward(h, t, ctx)`` with ``t=None`` outside the loop."""

    def __init__(self, c: ParcaeConfig, s: BlockSpec) -> None:
        super().__init__()
        self.ve_key = s.ve_key
        self.norm_1 = RMSNorm(s.dim, c.norm_eps)
        self.attn = ParcaeAttention(c, s)
        self.norm_2 = RMSNorm(s.dim, c.norm_eps)
        self.mlp = ParcaeMLP(c, s)

    def forward(self, h: Tensor, t: int | None, ctx: dict[str, Any]) -> Tensor:
        ve = ctx["value_embeds"][self.ve_key] if self.ve_key is not None else None
        h = h + self.attn(self.norm_1(h), t, ctx, ve)
        return h + self.mlp(self.norm_2(h), t)


class DiagonalInjection(nn.Module):
    """u = h * exp(-dt * exp(A_log)) + dt * (e @ B^T), dt = softplus(dt_bias); upstream ``transformer.adapter``."""

    def __init__(self, state_dim: int, input_dim: int) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(state_dim))
        self.dt_bias = nn.Parameter(torch.zeros(state_dim))
        self.B = nn.Parameter(torch.zeros(state_dim, input_dim))

    def forward(self, h: Tensor, e: Tensor) -> Tensor:
        dt = F.softplus(self.dt_bias)
        decay = torch.exp(-dt * torch.exp(self.A_log))
        return h * decay + dt * (e @ self.B.T)


def block_specs(c: ParcaeConfig) -> tuple[list[BlockSpec], list[BlockSpec], list[BlockSpec]]:
    """Prelude, core and coda block specs, with upstream's value-embedding / ve_gate placement."""
    n_pre, n_core, n_coda = c.n_layers_in_prelude, c.n_layers_in_recurrent_block, c.n_layers_in_coda
    n_eff = n_pre + n_core + n_coda
    outer = (c.n_embd, c.num_attention_heads, c.kv_heads, c.mlp_width)
    inner = (c.recurrent_embedding_dimension, c.recurrent_heads, c.recurrent_heads)
    inner = (*inner, c.recurrent_intermediation_embedding_dimension)

    def spec(widths: tuple[int, int, int, int], layer_id: int, ve_index: int) -> BlockSpec:
        gate = has_value_embedding(layer_id, c.n_layer)
        key = str(ve_index) if gate and has_value_embedding(ve_index, n_eff) else None
        if key is not None and widths[2] * (widths[0] // widths[1]) != c.kv_heads * c.head_dim:
            raise LoopLMError(
                f"config.json: block {ve_index} mixes a value embedding of width {c.kv_heads * c.head_dim} into "
                "values of a different width; recurrent_embedding_dimension/heads must match n_embd/heads"
            )
        return BlockSpec(*widths, ve_gate=gate, ve_key=key)

    coda_id = n_pre + n_core * c.mean_recurrence
    prelude = [spec(outer, i, i) for i in range(n_pre)]
    core = [spec(inner, n_pre + i, n_pre + i) for i in range(n_core)]
    coda = [spec(outer, coda_id + i, n_pre + n_core + i) for i in range(n_coda)]
    return prelude, core, coda


class _Transformer(nn.Module):
    """Holds the ``transformer.*`` parameters so that native names come out unchanged."""

    def __init__(self, c: ParcaeConfig) -> None:
        super().__init__()
        prelude, core, coda = block_specs(c)
        self.wte = nn.Embedding(c.vocab, c.n_embd)
        self.prelude = nn.ModuleList(ParcaeBlock(c, s) for s in prelude)
        self.adapter = DiagonalInjection(c.recurrent_embedding_dimension, c.n_embd)
        self.core_block = nn.ModuleList(ParcaeBlock(c, s) for s in core)
        self.C = nn.Linear(c.recurrent_embedding_dimension, c.n_embd, bias=c.bias)
        self.coda = nn.ModuleList(ParcaeBlock(c, s) for s in coda)
        self.ln_f = RMSNorm(c.n_embd, c.norm_eps)
        self.ln_prelude = RMSNorm(c.n_embd, c.norm_eps) if c.prelude_norm else None


class ParcaeLM(LoopLM):
    """Parcae looped LM: prelude -> R x (diagonal injection + shared core blocks) -> C -> coda -> head."""

    arch = "parcae"
    config_class = ParcaeConfig
    config_tags: ClassVar[dict[str, str]] = {"_class_name": "ParcaeConfig"}
    layer_count_fields = ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")
    fp_module_patterns = (
        "transformer.wte",
        "lm_head",
        "transformer.adapter",
        "transformer.C",
        "transformer.ln_f",
        "transformer.ln_prelude",
        "*.norm_1",
        "*.norm_2",
        "value_embeds",
        "value_embeds.*",
        "*.ve_gate",
    )
    norm_feeds: ClassVar[dict[str, str]] = {"norm_1": "attn.qkv", "norm_2": "mlp.up"}
    #: norm_1's output also feeds the value-embedding gate in the blocks that own one (:meth:`feeds_only_its_group`)
    exclusive_norm_feeds: ClassVar[dict[str, str]] = norm_feeds
    rope_key = "freqs_cis"

    def feeds_only_its_group(self, norm_path: str) -> bool:
        """``norm_2`` always; ``norm_1`` where its block's attention has no ``ve_gate`` (which reads its output)."""
        block, _, name = norm_path.rpartition(".")
        return name != "norm_1" or self.get_submodule(f"{block}.attn").ve_gate is None

    def __init__(self, config: ParcaeConfig) -> None:
        super().__init__(config)
        self.transformer = _Transformer(config)
        kv_dim = config.kv_heads * config.head_dim
        n_eff = config.n_layers_in_prelude + config.n_layers_in_recurrent_block + config.n_layers_in_coda
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(config.vocab, kv_dim) for i in range(n_eff) if has_value_embedding(i, n_eff)}
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @property
    def default_num_loops(self) -> int:
        return self.config.mean_recurrence

    @property
    def state_dim(self) -> int:
        return self.config.recurrent_embedding_dimension

    @property
    def loop_layers(self) -> nn.ModuleList:
        return self.transformer.core_block

    def decoder_layers(self) -> dict[str, nn.Module]:
        """Prelude, core (the shared stack) and coda blocks, in call order."""
        parts = {"prelude": self.transformer.prelude, "core_block": self.transformer.core_block}
        parts["coda"] = self.transformer.coda
        return {f"transformer.{part}.{i}": block for part, blocks in parts.items() for i, block in enumerate(blocks)}

    def rope_table(self) -> Tensor:
        """The full fp32 ``freqs_cis`` table upstream registers as a buffer (and publishes in checkpoints)."""
        c, rope = self.config, self.config.rope_settings
        return rope_table(c.head_dim, c.rope_length, rope["rope_base"], rope["rope_condense_ratio"])

    @property
    def max_positions(self) -> int:
        return self.config.rope_length

    def embed(
        self,
        input_ids: Tensor,
        num_loops: int,
        h0: Tensor | None = None,
        seed: int | None = None,
        step: DecodeStep | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        """Run wte + prelude (+ ln_prelude) to get ``e``; return the initial state ``h0`` or a seeded draw.

        The seeded draw is one vector per *position* (shared by the batch), so a cached or left-padded forward
        (``step``) takes each token's row at its own position: decoding is deterministic and equals the full forward
        of the unpadded sequence under the same seed."""
        c = self.config
        b, s = input_ids.shape
        if (s if step is None else step.position_bound() + 1) > c.rope_length:
            raise LoopLMError(
                f"input has {s} positions but the model's RoPE table has {c.rope_length} (config.json block_size); "
                "shorten the input"
            )
        x = self.transformer.wte(input_ids)
        _, embed_scale, _ = c.scales
        if embed_scale != 1:
            x = x * embed_scale
        table = self.rope_table()
        ctx: dict[str, Any] = {
            "rope": (table[:, :s] if step is None else table[0, step.positions.cpu()]).to(x.device),
            "value_embeds": {key: emb(input_ids) for key, emb in self.value_embeds.items()},
            "step": step,
        }
        for block in self.transformer.prelude:
            x = block(x, None, ctx)
        if self.transformer.ln_prelude is not None:
            x = self.transformer.ln_prelude(x)
        ctx["e"] = x
        want = (b, s, c.recurrent_embedding_dimension)
        if h0 is None:
            # one draw per position over the whole RoPE length, shared by the batch: every sequence's state depends
            # only on (seed, position), so results do not depend on batch composition or sequence length
            draw = self.initial_state((c.rope_length, c.recurrent_embedding_dimension), 0 if seed is None else seed)
            h = draw[:s].expand(want) if step is None else draw[step.positions.cpu()]
            return h.to(device=x.device, dtype=x.dtype), ctx
        if not isinstance(h0, Tensor) or tuple(h0.shape) != want:
            got = tuple(h0.shape) if isinstance(h0, Tensor) else type(h0).__name__
            raise LoopLMError(
                f"h0 must be a tensor of shape {want} [batch, seq, recurrent_embedding_dimension], got {got}"
            )
        return h0.to(device=x.device, dtype=x.dtype), ctx

    def initial_state(self, shape: tuple[int, ...], seed: int) -> Tensor:
        """Upstream ``initialize_state``'s distribution (``state_init``), drawn in fp32 from a ``seed``-ed generator."""
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise LoopLMError(f"seed must be an integer, got {seed!r}")
        c = self.config
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std, embed_scale, _ = c.scales
        if c.state_init == "zero":
            return torch.zeros(shape, device="cpu")  # drawn on the host, moved by the caller
        if c.state_init == "like-init":
            x = torch.empty(shape, device="cpu")
            nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
            return x * embed_scale if embed_scale != 1 else x
        x = torch.randn(shape, generator=gen, device="cpu")
        if c.state_init == "embed":
            return x.mul(1 / math.sqrt(c.n_embd))
        if c.state_init == "unit":
            sd, mean = torch.std_mean(x, dim=-1, keepdim=True)
            return (x - mean) / (sd + 1e-8)
        return x  # "normal"

    def begin_loop(self, h: Tensor, t: int, ctx: dict[str, Any]) -> Tensor:
        return self.transformer.adapter(h, ctx["e"])

    def head(self, h: Tensor, ctx: dict[str, Any]) -> Tensor:
        x = self.transformer.C(h)
        for block in self.transformer.coda:
            x = block(x, None, ctx)
        logits = self.lm_head(self.transformer.ln_f(x)).float()
        _, _, logit_scale = self.config.scales
        if logit_scale != 1:
            logits = logits * logit_scale
        cap = self.config.logit_softcap
        return cap * torch.tanh(logits / cap) if cap is not None else logits

    # ------------------------------------------------------------------ native format
    @classmethod
    def matches(cls, config: Mapping[str, Any]) -> bool:
        """A config with ``_class_name: ParcaeConfig`` (``config_tags``) or ``model_class_name: Parcae``."""
        return super().matches(config) or config.get("model_class_name") == "Parcae"

    def export_native(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        state[self.rope_key] = self.rope_table()
        return state

    def import_native(self, native: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
        state = {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in native.items()}
        table = state.pop(self.rope_key, None)
        if table is not None:
            want = self.rope_table()
            if not same_values(table, want, atol=1e-5):  # to the stored dtype's rounding: a bf16 table too
                raise LoopLMError(
                    f"{source}: {self.rope_key!r} (shape {tuple(table.shape)}) is not the RoPE table that config.json "
                    f"implies (shape {tuple(want.shape)}, rope_settings={self.config.rope_settings}, block_size="
                    f"{self.config.block_size}); fix rope_settings/block_size/randomize_positions_from in config.json"
                )
        if self.config.tie_embeddings:
            wte, head = "transformer.wte.weight", "lm_head.weight"
            if wte in state and head in state:
                if not torch.equal(state[wte], state[head]):
                    raise LoopLMError(
                        f"{source}: {head!r} differs from {wte!r} but config.json has tie_embeddings=true; "
                        "set tie_embeddings=false if the checkpoint really has an untied head"
                    )
            elif wte in state or head in state:
                state[wte] = state[head] = state.get(wte, state.get(head))  # type: ignore[assignment]
        return state

    def reset_parameters(self) -> None:
        """Upstream-style scaled init: truncated N(0, 2/(5 d)) matrices and embeddings, zero output projections under
        ``scaled-zero``, unit norms, A_log = 0, dt_bias giving decay sqrt(1/5), identity (or orthogonal) ``B``, zero
        ``ve_gate`` (gate = 1). Not bit-identical to upstream's initializer; meant for tests and from-scratch runs."""
        c = self.config
        depth = c.n_layers_in_prelude + c.n_layers_in_coda + c.n_layers_in_recurrent_block * c.mean_recurrence
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, nn.Embedding):
                    _trunc_normal(module.weight, math.sqrt(2 / (5 * c.n_embd)))
                elif isinstance(module, RMSNorm):
                    nn.init.ones_(module.weight)
                elif isinstance(module, nn.Linear) and module is not self.lm_head:
                    std = math.sqrt(2 / (5 * module.in_features))
                    if name.endswith(("c_proj", "mlp.down.proj")):
                        std = 0.0 if c.init_strategy == "scaled-zero" else std / math.sqrt(2 * depth)
                    if name.endswith("ve_gate"):
                        std = 0.0
                    _trunc_normal(module.weight, std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, ParcaeAttention) and hasattr(module, "qk_bias"):
                    nn.init.zeros_(module.qk_bias)
            if not c.tie_embeddings:
                _trunc_normal(self.lm_head.weight, math.sqrt(2 / (5 * c.n_embd)))
            adapter = self.transformer.adapter
            nn.init.zeros_(adapter.A_log)
            dt = -math.log(math.sqrt(1 / 5))
            adapter.dt_bias.fill_(dt + math.log(-math.expm1(-dt)))  # inverse softplus
            if adapter.B.shape[0] == adapter.B.shape[1]:
                adapter.B.copy_(torch.eye(adapter.B.shape[0]))
            else:
                nn.init.orthogonal_(adapter.B)


def _trunc_normal(weight: Tensor, std: float) -> None:
    if std == 0:
        nn.init.zeros_(weight)
    else:
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
