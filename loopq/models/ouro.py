"""Ouro (ByteDance Seed, "Scaling Latent Reasoning via Looped Language Models"): a Llama-style decoder with
*sandwich* RMSNorms, looped ``total_ut_steps`` times with a shared ``model.norm`` after every loop.

One decoder layer (upstream ``OuroDecoderLayer``)::

    h = h + norm_2(attn(norm_1(h)))          # input_layernorm, input_layernorm_2
    h = h + post_2(mlp(post_1(h)))            # post_attention_layernorm(_2)

After each loop the state is normalised, ``H_t = model.norm(h)``, and that normed state both feeds the next
loop and the readouts: ``lm_head(H_t)`` and the early-exit gate ``g_t = early_exit_gate(H_t)``.
Exit distribution (upstream ``OuroForCausalLM``): lambda_t = sigmoid(g_t), p_t = lambda_t prod_{j<t}(1-lambda_j)
for t < T, p_T = prod_{j<T}(1-lambda_j). Logits can be read out at the last loop (default), as the expected-exit
mixture sum_t p_t lm_head(H_t), or per token at the first loop whose cumulative exit probability reaches a
threshold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopq.kernels import rowwise_kernel
from loopq.models.base import LinearGroup, LoopLM, LoopLMError, LoopLMOutput, RMSNorm, add_norm, attention
from loopq.models.kv_cache import DecodeStep

EXIT_MODES = ("last", "expected", "threshold")


@dataclass
class OuroConfig:
    """The fields of the published ``OuroConfig`` that define the computation (others are kept verbatim)."""

    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    total_ut_steps: int = 4
    early_exit_threshold: float | None = 1.0
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise LoopLMError(f"config.json: hidden_act={self.hidden_act!r} is not supported (Ouro uses 'silu')")
        self._check_rope()
        if self.num_attention_heads % self.num_key_value_heads:
            raise LoopLMError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
        layer_types = self.extra.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types) or self.extra.get("use_sliding_window"):
            raise LoopLMError("config.json: sliding-window layers (layer_types / use_sliding_window) unsupported")

    def _check_rope(self) -> None:
        """Only the default RoPE (``rope_theta``) is implemented: any other variant is refused however config.json
        names it (``rope_scaling``, or transformers 5's ``rope_parameters``, kept in ``extra``)."""
        for key, entry in (("rope_scaling", self.rope_scaling), ("rope_parameters", self.extra.get("rope_parameters"))):
            if entry is not None and (not isinstance(entry, Mapping) or rope_type(entry) != "default"):
                raise LoopLMError(f"config.json: {key}={entry!r} is not supported: use the default RoPE (null)")
        theta = (self.extra.get("rope_parameters") or {}).get("rope_theta", self.rope_theta)
        if theta != self.rope_theta:
            raise LoopLMError(
                f"config.json: rope_parameters.rope_theta={theta!r} differs from rope_theta={self.rope_theta!r} "
                "(the default when absent); set rope_theta to the model's value"
            )

    @property
    def dh(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def rope_type(entry: Mapping[str, Any]) -> str:
    """The RoPE variant a ``rope_scaling`` / ``rope_parameters`` entry names: its ``rope_type``, else the legacy
    ``type`` (as ``transformers`` and upstream's ``OuroRotaryEmbedding`` read it), else ``default``."""
    return str(entry.get("rope_type", entry.get("type")) or "default")


class OuroAttention(nn.Module):
    def __init__(self, c: OuroConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.dh = c.num_attention_heads, c.num_key_value_heads, c.dh
        self.qkv_proj = LinearGroup(
            q_proj=nn.Linear(c.hidden_size, self.n_heads * self.dh, bias=False),
            k_proj=nn.Linear(c.hidden_size, self.n_kv * self.dh, bias=False),
            v_proj=nn.Linear(c.hidden_size, self.n_kv * self.dh, bias=False),
        )
        self.o_proj = LinearGroup(o_proj=nn.Linear(self.n_heads * self.dh, c.hidden_size, bias=False))

    def forward(self, x: Tensor, t: int | None, ctx: dict[str, Any]) -> Tensor:
        b, s, _ = x.shape
        cos, sin = ctx["cos"], ctx["sin"]
        q, k, v = self.qkv_proj(x, t)
        q = q.view(b, s, self.n_heads, self.dh).transpose(1, 2)
        k = k.view(b, s, self.n_kv, self.dh).transpose(1, 2)
        v = v.view(b, s, self.n_kv, self.dh).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attention(self, t, q, k, v, ctx).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(y, t)[0]


class OuroMLP(nn.Module):
    def __init__(self, c: OuroConfig) -> None:
        super().__init__()
        self.up_gate = LinearGroup(
            gate_proj=nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            up_proj=nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
        )
        self.down_proj = LinearGroup(down_proj=nn.Linear(c.intermediate_size, c.hidden_size, bias=False))

    def forward(self, x: Tensor, t: int | None) -> Tensor:
        gate, up = self.up_gate(x, t)
        return self.down_proj(F.silu(gate) * up, t)[0]


class OuroDecoderLayer(nn.Module):
    def __init__(self, c: OuroConfig) -> None:
        super().__init__()
        eps = c.rms_norm_eps
        self.self_attn = OuroAttention(c)
        self.mlp = OuroMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(c.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(c.hidden_size, eps)

    def forward(self, h: Tensor, t: int | None, ctx: dict[str, Any]) -> Tensor:
        a = self.self_attn(self.input_layernorm(h), t, ctx)
        h = add_norm(h, self.input_layernorm_2, a)
        m = self.mlp(self.post_attention_layernorm(h), t)
        return add_norm(h, self.post_attention_layernorm_2, m)


def rope_inv_freq(dh: int, theta: float, device: torch.device | None = None) -> Tensor:
    """fp32 ``[dh/2]`` inverse frequencies ``theta^(-2i/dh)`` of the default RoPE (``transformers``' ``inv_freq``)."""
    return 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.int64, device=device).float() / dh))


def rope_tables(dh: int, theta: float, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin ``[*positions.shape, dh]`` of the default (non-interleaved, rotate-half) RoPE, computed in fp32
    (``positions`` ``[S]`` for a full forward, ``[B, S]`` per row for a cached or padded one)."""
    inv_freq = rope_inv_freq(dh, theta, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on ``[B, H, S, dh]`` (on a GPU without autograd, one launch of the same arithmetic:
    :func:`loopq.kernels.rowwise_kernel.rope`)."""
    if rowwise_kernel.rope_applies(x, cos, sin):
        return rowwise_kernel.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Model(nn.Module):
    """Holds the ``model.*`` parameters so that native names come out unchanged."""

    def __init__(self, c: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.early_exit_gate = nn.Linear(c.hidden_size, 1)


class OuroLM(LoopLM):
    """Ouro looped LM with the upstream exit-gate readouts (``exit_mode`` = last | expected | threshold).

    Which one matches what the Hugging Face remote code (``OuroForCausalLM.forward``) returns:

    * ``model(ids, labels=...)``: ``.logits`` is the expected-exit mixture, ``exit_mode="expected"``, and ``.loss``
      is transformers' causal-LM loss of those logits (shifted cross-entropy, mean over labels != -100), so a
      perplexity computed from ``.loss`` compares with ``exit_mode="expected"``;
    * ``model(ids)`` with the published config (``early_exit_threshold`` 1.0, no ``early_exit_step``): the
      per-token threshold exit, ``exit_mode="threshold"``. The default ``"last"`` (what LoopQ's lm-eval model and
      perplexity use) gives the same logits only while no token's cumulative exit probability reaches the threshold
      before the last loop: bit-identical on the fp32 reference fixture, not guaranteed in general.

    Both are checked against upstream outputs in ``tests/models/test_ouro.py``; see ``docs/models.md``.
    """

    arch = "ouro"
    config_class = OuroConfig
    config_tags: ClassVar[dict[str, str]] = {"model_type": "ouro"}
    layer_count_fields = ("num_hidden_layers",)
    fp_module_patterns = ("model.embed_tokens", "lm_head", "model.early_exit_gate", "*norm*")
    norm_feeds: ClassVar[dict[str, str]] = {
        "input_layernorm": "self_attn.qkv_proj",
        "post_attention_layernorm": "mlp.up_gate",
    }
    exclusive_norm_feeds: ClassVar[dict[str, str]] = norm_feeds  # each norm's output is its group's input only

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config)
        self.model = _Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def default_num_loops(self) -> int:
        return self.config.total_ut_steps

    @property
    def state_dim(self) -> int:
        return self.config.hidden_size

    @property
    def loop_layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def embed(
        self,
        input_ids: Tensor,
        num_loops: int,
        exit_mode: str = "last",
        exit_threshold: float | None = None,
        step: DecodeStep | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        if exit_mode not in EXIT_MODES:
            raise LoopLMError(f"exit_mode must be one of {EXIT_MODES}, got {exit_mode!r}")
        seq = input_ids.shape[1] if step is None else step.position_bound() + 1
        if seq > self.config.max_position_embeddings:
            raise LoopLMError(
                f"input has {seq} tokens but config.json max_position_embeddings="
                f"{self.config.max_position_embeddings} (the positions RoPE was trained on); crop the input to "
                "max_position_embeddings tokens"
            )
        h = self.model.embed_tokens(input_ids)
        if step is None:
            positions = torch.arange(seq, device=input_ids.device)
            cos, sin = rope_tables(self.config.dh, self.config.rope_theta, positions, h.dtype)
        else:  # per row [B, S, dh] -> [B, 1, S, dh], broadcast over heads
            cos, sin = (
                x[:, None] for x in rope_tables(self.config.dh, self.config.rope_theta, step.positions, h.dtype)
            )
        threshold = self.config.early_exit_threshold if exit_threshold is None else exit_threshold
        return h, {"cos": cos, "sin": sin, "exit_mode": exit_mode, "exit_threshold": threshold, "step": step}

    def end_loop(self, h: Tensor, t: int, ctx: dict[str, Any]) -> Tensor:
        return self.model.norm(h)

    def head(self, h: Tensor, ctx: dict[str, Any]) -> Tensor:
        return self.lm_head(h)

    def exit_gate_logits(self, h: Tensor) -> Tensor:
        """The exit gate's logit ``[..., 1]`` of a loop state ``H_t`` (used by :mod:`loopq.models.early_exit`)."""
        return self.model.early_exit_gate(h)

    def finalize(self, out: LoopLMOutput, ctx: dict[str, Any]) -> LoopLMOutput:
        states: list[Tensor] = ctx["loop_states"]
        gates = [self.exit_gate_logits(h) for h in states]
        probs = exit_distribution(torch.cat(gates, dim=-1))
        out.extras.update(exit_gate_logits=gates, exit_probs=probs)
        if ctx["exit_mode"] == "expected":
            out.logits = sum(probs[..., i : i + 1] * self.lm_head(h) for i, h in enumerate(states))  # type: ignore[assignment]
        elif ctx["exit_mode"] == "threshold" and ctx["exit_threshold"] is not None:
            steps = threshold_exit_steps(probs, ctx["exit_threshold"])
            chosen = torch.stack(states, dim=2).gather(2, steps[..., None, None].expand(-1, -1, 1, states[0].shape[-1]))
            out.logits = self.lm_head(chosen.squeeze(2))
            out.extras["exit_steps"] = steps
        return out

    # ------------------------------------------------------------------ native format
    def export_native(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def import_native(self, native: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
        state = dict(native)
        if self.config.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def derived_buffers(self) -> dict[str, tuple[Tensor, str]]:
        """RoPE ``inv_freq`` under the names ``transformers`` has registered it (the model-wide rotary embedding and,
        in older versions, one per attention layer): harmless in a checkpoint when it is what ``rope_theta`` and the
        head dim imply, refused otherwise."""
        c = self.config
        value, implied_by = (
            rope_inv_freq(c.dh, c.rope_theta, torch.device("cpu")),
            f"rope_theta={c.rope_theta}, head_dim={c.dh}",
        )
        layers = [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(c.num_hidden_layers)]
        return {name: (value, implied_by) for name in ["model.rotary_emb.inv_freq", *layers]}

    def init_std(self, name: str) -> float:
        return self.config.initializer_range


def exit_distribution(gate_logits: Tensor) -> Tensor:
    """Ouro's exit pdf over loops from gate logits ``[..., T]``; the last loop takes the remaining mass."""
    lam = torch.sigmoid(gate_logits)
    survive = torch.cumprod(1.0 - lam, dim=-1)
    before = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
    pdf = lam * before
    return torch.cat([pdf[..., :-1], before[..., -1:]], dim=-1)


def threshold_exit_steps(probs: Tensor, threshold: float) -> Tensor:
    """Per token, the first loop whose cumulative exit probability reaches ``threshold`` (else the last)."""
    reached = torch.cumsum(probs, dim=-1) >= threshold
    steps = torch.argmax(reached.to(probs.dtype), dim=-1)
    return torch.where(reached.any(dim=-1), steps, torch.full_like(steps, probs.shape[-1] - 1))
